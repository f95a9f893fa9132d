# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Behaviours of the sdpa path that each rest on one comparison or one branch of the stash, pinned one by one: the
recompute runs no attention forward in either checkpoint mode; layers whose queries need no grad beside keys and values
that do; the bytes kept are the planner's on every backend; a mask is compared by its view as well as its storage,
and a mask built in the layer by its shape as well as its digest; the scale and is_causal are compared between the
passes; the checkpoint function set after the install is the one that runs. The flash path's are in
test_attention_stash_flash.py, test_attention_stash_flash_bindings.py and test_attention_stash_flash_kernels.py.
"""

import pytest
import torch

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError

from attention_stash_helpers import (CPU_BACKWARD, CPU_FORWARD, NUM_LAYERS, CountOps, assert_same_grads, batch_ids,
                                     checkpointed, graph_nodes, live_checkpoint_calls, llama_model, logged_messages,
                                     param_grads)
from test_attention_stash_masks import SEQUENCE, _padding_mask
from test_attention_stash_meta import BACKENDS, BATCH, DTYPE, _layers_forward, _meta_model, use_backend_on_meta
from test_attention_stash_meta import SEQUENCE as META_SEQUENCE

MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])


def _counts(handle):
    return handle.num_kept, handle.recomputes_served, handle.released_without_backward


@MODES
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_the_recompute_runs_no_attention_forward(install, use_reentrant, masked):
    """The forward runs each stashed layer's attention kernel once; the recompute runs none, only the backward
    kernels, whichever the checkpoint mode (reentrant: the first pass runs the kernel alone; non-reentrant: in the
    stash's node, which the recompute runs again without it)."""
    model = checkpointed(llama_model(), use_reentrant)
    ids = batch_ids(sequence=SEQUENCE)
    inputs = dict(input_ids=ids, labels=ids, attention_mask=_padding_mask("right") if masked else None)
    handle = install(model, NUM_LAYERS)
    with CountOps() as forward:
        loss = model(**inputs).loss
    with CountOps() as backward:
        loss.backward()
    assert (forward.calls[CPU_FORWARD], backward.calls[CPU_FORWARD], backward.calls[CPU_BACKWARD]) == (NUM_LAYERS, 0,
                                                                                                       NUM_LAYERS)
    assert _counts(handle) == (0, NUM_LAYERS, 0)


def _train_only(model, trained):
    for name, param in model.named_parameters():
        param.requires_grad_(trained(name))


@pytest.mark.parametrize("trained", ["keys_and_values", "after_the_first_layer"])
def test_layers_whose_queries_need_no_grad(install, trained):
    """Non-reentrant checkpointing, whose first pass runs with grad, on input embeddings that need no grad (a frozen
    encoder's, which Hugging Face's hook for input grads does not reach). Only the key and value projections train
    (LoRA on k/v alone): the first layer's queries need no grad, its keys and values do, and get their gradients
    through the stash's node, which the first pass applies whatever needs grad. Or nothing before the second layer
    trains: nothing in the first layer needs grad, no backward reaches its recompute, and what it kept goes with the
    graph. Served as the stock step, bitwise. (Under reentrant checkpointing such a first layer passes no gradient on,
    and its recompute's queries need grad wherever the layer gets one.)"""
    model = checkpointed(llama_model(), use_reentrant=False)
    if trained == "keys_and_values":
        _train_only(model, lambda name: ".k_proj." in name or ".v_proj." in name)
    else:
        _train_only(model, lambda name: not name.startswith(("model.embed_tokens.", "model.layers.0.")))
    ids = batch_ids()
    embeddings = model.model.embed_tokens(ids).detach()
    queries = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *args: queries.append(args[-1].requires_grad))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(inputs_embeds=embeddings, labels=ids).loss
        loss.backward()
        return loss.detach(), param_grads(model)

    expected_loss, expected = step()
    assert queries == [False, False] or queries == [False]
    first_layer_trains = trained == "keys_and_values"
    assert ("model.layers.0.self_attn.k_proj.weight" in expected) == first_layer_trains
    handle = install(model, NUM_LAYERS)
    loss, grads = step()
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    served = NUM_LAYERS - 1 + first_layer_trains
    assert _counts(handle) == (0, served, NUM_LAYERS - served)


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_the_bytes_kept_on_cpu_are_the_planners(install, use_reentrant, dtype):
    """After the forward, each stashed layer holds the planner's bytes: its output and log-sum-exp (float64 for a
    float64 model on CPU), nothing else the kernel saved."""
    model = checkpointed(llama_model(dtype), use_reentrant)
    ids = batch_ids(sequence=SEQUENCE)
    handle = install(model, NUM_LAYERS)
    loss = model(input_ids=ids, labels=ids).loss
    per_layer = attention_stash.attention_stash_layer_bytes(model, 2, SEQUENCE, device="cpu")
    lse_bytes = dtype.itemsize
    assert per_layer == 2 * 4 * SEQUENCE * (16 * dtype.itemsize + lse_bytes)
    assert (handle.num_kept, handle.kept_bytes) == (NUM_LAYERS, NUM_LAYERS * per_layer)
    loss.backward()
    assert (handle.kept_bytes, handle.peak_kept_bytes) == (0, NUM_LAYERS * per_layer)


@MODES
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_bytes_kept_on_each_cuda_backend_are_the_planners(install, monkeypatch, backend, use_reentrant):
    """On the meta device, each CUDA backend's kernel saves more than its output and log-sum-exp (cuDNN its seed,
    offset and cumulative lengths; flash attention its rng state; memory-efficient attention its seed and offset):
    the stash counts the output and log-sum-exp alone, in the backend's layout, as the planner does."""
    ops = use_backend_on_meta(monkeypatch, backend)
    model = checkpointed(_meta_model("llama_full_heads"), use_reentrant=use_reentrant)
    handle = install(model, 2)
    hidden, _ = _layers_forward(model, None)
    calls = [call for call in live_checkpoint_calls() if call.stash.counters is handle._counters]
    assert all(len(entry.tensors) > 1 for call in calls for entry in call.kept)
    per_layer = attention_stash.attention_stash_layer_bytes(model, BATCH, META_SEQUENCE, device="meta")
    output_and_lse = (BATCH * 4 * META_SEQUENCE * 16 * DTYPE.itemsize + BATCH * 4 *
                      (META_SEQUENCE + -META_SEQUENCE % ops.lse_rows_multiple) * 4)
    assert per_layer == output_and_lse
    assert handle.kept_bytes == 2 * per_layer
    hidden.sum().backward()
    assert (handle.kept_bytes, handle.recomputes_served) == (0, 2)


def _as_given(mask):
    return mask


def _mask_hook(model):
    """A pre-hook on the last layer's attention that hands it, as its mask, what the function popped from the end of
    the returned list makes of the mask it gets: the forward's last, then the recompute's."""
    masks = []

    def hook(module, args, kwargs):
        return args, {**kwargs, "attention_mask": masks.pop()(kwargs["attention_mask"])}

    model.model.layers[2].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return masks


@MODES
def test_a_mask_viewed_with_other_strides_in_the_recompute_is_refused(install, use_reentrant):
    """The checkpoint holds the layer's mask; the recompute gets a view of the same storage, of the same shape, dtype
    and version, with other strides (its transpose): another mask, refused, and what was kept goes at once."""
    model = checkpointed(llama_model(), use_reentrant)
    handle = install(model, 1)
    masks = _mask_hook(model)
    ids = batch_ids(sequence=SEQUENCE)
    inputs = dict(input_ids=ids, attention_mask=_padding_mask("right"), labels=ids)
    masks.extend([_as_given, _as_given])
    model(**inputs).loss.backward()
    assert _counts(handle) == (0, 1, 0)
    masks.extend([lambda mask: mask.transpose(-1, -2), _as_given])
    loss = model(**inputs).loss
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of model.layers.2 to get its forward's attention mask, got another "
                       "one"):
        loss.backward()
    assert _counts(handle) == (0, 1, 1)


def _every_key(mask=None):
    return torch.ones(2, 1, SEQUENCE, 1, dtype=torch.bool)


def _first_key_only(mask=None):
    mask = torch.zeros(2, 1, SEQUENCE, SEQUENCE, dtype=torch.bool)
    mask[..., 0] = True
    return mask


@MODES
def test_a_mask_built_in_the_layer_with_another_shape_is_refused(install, use_reentrant):
    """A mask the layer builds (digested by value): the forward's attends to every key of each row through one
    broadcast column, the recompute's to the first key alone: equal digests (the weights of the keys attended), other
    shapes, so another mask, refused."""
    model = checkpointed(llama_model(), use_reentrant)
    handle = install(model, 1)
    digests = attention_stash._mask_digest(_every_key()), attention_stash._mask_digest(_first_key_only())
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(*digests))
    masks = _mask_hook(model)
    ids = batch_ids(sequence=SEQUENCE)
    masks.extend([_every_key, _every_key])
    model(input_ids=ids, labels=ids).loss.backward()
    assert _counts(handle) == (0, 1, 0)
    masks.extend([_first_key_only, _every_key])
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of model.layers.2 to build the attention mask its forward built "
                       "inside the layer, got one with other values"):
        loss.backward()
    assert _counts(handle) == (0, 1, 1)


def _set_attribute(name, value):

    def change(module):
        setattr(module, name, value)

    return change


@MODES
@pytest.mark.parametrize("name, value", [("scaling", 0.5), ("is_causal", False)])
def test_a_recompute_with_another_sdpa_argument_is_refused(install, use_reentrant, name, value):
    """The layer's attention scale (or causality) changed between the forward and its backward: the recompute calls
    F.sdpa with another scale (is_causal) than the kept output's, refused by name."""
    model = checkpointed(llama_model(), use_reentrant)
    handle = install(model, 1)
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids).loss
    attention = model.model.layers[2].self_attn
    assert getattr(attention, name) != value
    setattr(attention, name, value)
    argument = "scale" if name == "scaling" else name
    with pytest.raises(AttentionStashError,
                       match=f"needs the recompute of model.layers.2 to call CPU flash attention with its forward's "
                       f"arguments, got another {argument} \\(attention call 1\\)"):
        loss.backward()
    assert _counts(handle) == (0, 0, 1)


def test_the_checkpoint_function_set_after_the_install_is_the_one_that_runs(install):
    """Checkpointing enabled again after the install, in the other mode, then with a function of the caller's: each
    step runs the layers' checkpoint function as set last, wrapped by the stash, and is served."""
    model = checkpointed(llama_model(), use_reentrant=True)
    ids = batch_ids()
    handle = install(model, NUM_LAYERS)
    for use_reentrant in (True, False):
        checkpointed(model, use_reentrant)
        loss = model(input_ids=ids, labels=ids).loss
        nodes = graph_nodes(loss.grad_fn)
        assert nodes.count("CheckpointFunctionBackward") == (NUM_LAYERS if use_reentrant else 0)
        loss.backward()
    calls = []

    def counted_checkpoint(function, *args, **kwargs):
        calls.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    for layer in model.model.layers:
        layer._gradient_checkpointing_func = counted_checkpoint
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == NUM_LAYERS and all(type(call) is attention_stash._CheckpointCall for call in calls)
    assert _counts(handle) == (0, 3 * NUM_LAYERS, 0)


def test_second_order_gradients_are_refused_by_name(install):
    """Under non-reentrant checkpointing a backward that records a graph (create_graph=True, for a gradient penalty)
    reaches the stash's node, whose kernel backward is not differentiable: the stash's own error names it. (Reentrant
    checkpointing's backward records none, stock or stashed: its gradients come without a graph either way.)"""
    model = checkpointed(llama_model(), use_reentrant=False)
    install(model, NUM_LAYERS)
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(AttentionStashError,
                       match=r"needs first-order gradients, got a backward that records a graph \(create_graph=True"):
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], create_graph=True)


def test_the_handle_names_what_it_stashed(install):
    """handle.summary is the install's log line, which DeepSpeed's log_dist logs on rank 0 alone (every rank's handle
    has it); repr(handle) adds the counts. A copy's handle stashes nothing, and says so. The module exports its public
    names alone."""
    import copy

    from deepspeed.utils.logging import get_dist_msg

    model = checkpointed(llama_model())
    with logged_messages() as messages:
        handle = install(model, 2)
    assert handle.summary.startswith("attention stash: keeping the attention output of 2 of 3 attention layers "
                                     "(model.layers.1 to model.layers.2) for their recompute")
    # "[Rank -1] " without a process group, "[Rank 0] " in one (an earlier test in this process may have made one).
    assert messages == [get_dist_msg(handle.summary, ranks=[0])] and messages[0].endswith(handle.summary)
    ids = batch_ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert repr(handle) == f"AttentionStashHandle(2 layers, 0 kept, 2 served: {handle.summary})"
    assert repr(copy.deepcopy(handle)) == "AttentionStashHandle(0 layers, 0 kept, 0 served: nothing stashed)"
    assert sorted(attention_stash.__all__) == [
        "AttentionStashError", "AttentionStashHandle", "attention_stash_layer_bytes",
        "attention_stash_layers_for_budget", "install_attention_stash"
    ]
