# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash under torch.compile (issue 46), on CPU with AOTAutograd's eager backend and the min-cut partitioner.

Dynamo traces Hugging Face's checkpoint as its checkpoint operator; the stash gives a stashed layer's checkpoint a
selective-checkpointing policy that saves the attention kernel's outputs, so the compiled backward graph has no
attention forward for a stashed layer and one for each other layer. On CPU, torch 2.13 and 2.14 wrap the
checkpointed regions' fused CPU attention op in rng-state operators (``run_and_save_rng_state`` in the forward graph,
``run_with_rng_state`` in the backward one), so the attention forwards of a graph are counted through those as well as
directly: a search for the op alone finds none even in a compiled plain step's backward graph there.
"""

import importlib
import re
from importlib.metadata import version

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from deepspeed.runtime.activation_checkpointing.attention_stash import (AttentionStashError,
                                                                        attention_stash_layer_bytes)

from attention_stash_helpers import (CPU_FLASH, FORWARD_LAYOUT, NUM_LAYERS, Graphs, assert_same_grads,
                                     attention_forwards, batch_ids, checkpointed, live_checkpoint_calls, live_tensors,
                                     llama_model, param_grads, qwen3_moe_model, tensors)

FAMILIES = {"llama": llama_model, "qwen3_moe": qwen3_moe_model}
BATCH, SEQUENCE = 2, 32


def matmuls(graphs):
    return sum(1 for graph in graphs for node in graph.graph.nodes if node.target is torch.ops.aten.mm.default)


def output_bytes(graphs):
    """The bytes of the forward graphs' outputs: what they return, and what they save for their backward graphs, but
    the rng states saved for a recomputed attention forward (their size is symbolic in the graph)."""
    outputs = [node for graph in graphs for node in next(n for n in graph.graph.nodes if n.op == "output").args[0]]
    values = [node.meta.get("val") for node in outputs if isinstance(node, torch.fx.Node)]
    return sum(value.numel() * value.element_size() for value in values
               if isinstance(value, torch.Tensor) and all(isinstance(size, int) for size in value.shape))


def inputs(padded):
    ids = batch_ids(batch=BATCH, sequence=SEQUENCE)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, SEQUENCE // 2:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def compiled_steps(model, batch, steps=2):
    """``steps`` compiled training steps on one batch: each one's loss, and the last one's gradients."""
    graphs = Graphs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=graphs, dynamic=False)
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = compiled(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    torch._dynamo.reset()
    return losses, param_grads(model), graphs


@pytest.fixture
def traceable_kernels():
    """kernels >= 0.18 wraps Hugging Face's attention modules' forward in one that sets a context variable of its own,
    a mutation dynamo refuses inside a checkpoint unless told not to replay it in the recompute: compiled plain runs
    every checkpoint eagerly then. Both arms of a test that takes this fixture trace their checkpoints; the tests at
    dynamo's defaults (test_at_dynamos_defaults_*) show what a user meets without it."""
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield


@pytest.fixture
def family(request):
    return FAMILIES[request.param]


# A padded batch reaches the attention with a mask whatever the family: Qwen3-MoE, whose attention is Llama's for the
# stash and whose experts are what it adds to the graph, runs the plain batch alone (issue 58).
@pytest.mark.parametrize("family, padded", [("llama", False), ("llama", True), ("qwen3_moe", False)],
                         ids=["llama-plain", "llama-padded", "qwen3_moe-plain"],
                         indirect=["family"])
@pytest.mark.usefixtures("traceable_kernels")
def test_a_compiled_step_saves_the_stashed_layers_attention(install, family, padded):
    """Compiled plain against compiled stashed, two stashed layers of three: losses and gradients bitwise, each step
    as the first; the backward graph runs the attention forward of the unstashed layer alone and every matmul the
    plain one recomputes; the forward graph saves at most two layers' outputs and log-sum-exps more."""
    batch, stashed = inputs(padded), NUM_LAYERS - 1
    plain_losses, plain_grads, plain = compiled_steps(checkpointed(family(), use_reentrant=False), batch)
    model = checkpointed(family(), use_reentrant=False)
    handle = install(model, stashed)
    if family is qwen3_moe_model and not FORWARD_LAYOUT:
        # transformers 5.22's Qwen3-MoE block breaks dynamo's graph inside the checkpointed layer: refused by name.
        with pytest.raises((AttentionStashError, torch._dynamo.exc.BackendCompilerFailed)) as raised:
            compiled_steps(model, batch)
        error = getattr(raised.value, "inner_exception", raised.value)
        assert isinstance(error, AttentionStashError) and "eagerly after a graph break" in str(error)
        return
    losses, grads, graphs = compiled_steps(model, batch)

    assert losses[0] == plain_losses[0] and losses[1] == losses[0] and plain_losses[1] == plain_losses[0]
    assert_same_grads(grads, plain_grads)
    assert attention_forwards(plain.backward) == NUM_LAYERS
    assert attention_forwards(graphs.backward) == NUM_LAYERS - stashed
    assert matmuls(graphs.backward) == matmuls(plain.backward) > 0
    # One forward and one backward graph: no recompile for the second step, nor for the stash.
    assert (len(graphs.forward), len(graphs.backward)) == (len(plain.forward), len(plain.backward))
    extra = output_bytes(graphs.forward) - output_bytes(plain.forward)
    assert 0 < extra <= stashed * attention_stash_layer_bytes(model, BATCH, SEQUENCE)
    assert handle.compiled_layers == handle.layers and handle.recomputes_served == 0 and handle.num_kept == 0


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.usefixtures("traceable_kernels")
def test_nothing_outlives_a_compiled_step(install, padded):
    """After each compiled step, its graphs alive, no tensor of the batch's shape is left that was not alive before
    it (other tests' graphs may hold some): the saved attention outputs die with the backward graph's inputs, and the
    stash keeps nothing of its own; nor after remove()."""

    def of_the_batch(tensor):  # real tensors of three or more dimensions with one of SEQUENCE (not dynamo's fakes)
        return tensor.dim() >= 3 and SEQUENCE in tensor.shape and not isinstance(tensor, FakeTensor)

    model = checkpointed(llama_model(), use_reentrant=False)
    handle = install(model, NUM_LAYERS)
    batch = inputs(padded)
    torch._dynamo.reset()
    before = tensors()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    for _ in range(2):
        loss = compiled(**batch).loss
        loss.backward()
        del loss
        assert live_tensors(before, counted=of_the_batch) == [] and live_checkpoint_calls() == []
    assert handle.compiled_layers == handle.layers and handle.num_kept == 0 and handle.kept_bytes == 0
    handle.remove()
    del compiled, model
    torch._dynamo.reset()
    assert live_tensors(before, counted=of_the_batch) == [] and live_checkpoint_calls() == []


@pytest.mark.usefixtures("traceable_kernels")
def test_a_compiled_model_has_no_graph_break_of_the_stashs(install):
    """fullgraph=True: dynamo traces the stash's checkpoint call and entry into one graph with the decoder loop."""
    model = checkpointed(llama_model(use_cache=False), use_reentrant=False)
    handle = install(model, NUM_LAYERS)
    ids = batch_ids(batch=BATCH, sequence=SEQUENCE)
    torch._dynamo.reset()
    loss = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids).loss
    loss.backward()
    torch._dynamo.reset()
    assert handle.compiled_layers == handle.layers


@pytest.mark.usefixtures("traceable_kernels")
def test_installing_after_a_warm_compile_recompiles_once_and_removing_restores_stock(install):
    """A model compiled and trained before the install: the install recompiles it once (dynamo guards on the layers'
    checkpoint function), after which its backward graph saves the stashed attention; remove() and a fresh compile
    give the stock graphs again."""
    model = checkpointed(llama_model(), use_reentrant=False)
    batch, graphs = inputs(False), Graphs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=graphs, dynamic=False)

    def step():
        model.zero_grad(set_to_none=True)
        loss = compiled(**batch).loss
        loss.backward()
        return loss.detach()

    stock = step()
    before = len(graphs.backward)
    handle = install(model, NUM_LAYERS)
    assert step() == stock
    recompiled = len(graphs.backward)
    assert step() == stock and len(graphs.backward) == recompiled > before
    assert attention_forwards(graphs.backward[:before]) == NUM_LAYERS
    assert attention_forwards(graphs.backward[before:]) == 0
    assert handle.compiled_layers == handle.layers
    handle.remove()
    losses, _, fresh = compiled_steps(model, batch, steps=1)
    assert losses == [stock] and attention_forwards(fresh.backward) == NUM_LAYERS


def mm_policy(ctx, op, *args, **kwargs):
    """A user's policy that saves the matmuls."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_attention_policy(ctx, op, *args, **kwargs):
    """A user's policy that recomputes the attention kernel."""
    return CheckpointPolicy.MUST_RECOMPUTE if op is CPU_FLASH.default else CheckpointPolicy.PREFER_RECOMPUTE


def contexts(policy):
    return create_selective_checkpoint_contexts(policy)


@pytest.mark.parametrize("policy", [mm_policy, recompute_attention_policy])
@pytest.mark.usefixtures("traceable_kernels")
def test_a_checkpoints_own_policy_composes_and_wins_where_it_names_an_op(install, policy):
    """The checkpoint's own context_fn: where it saves the matmuls, the backward graph recomputes none of them and no
    attention forward; where it recomputes the attention kernel, that policy wins, and the handle does not report
    the layers."""
    from functools import partial

    batch = inputs(False)
    plain_losses, plain_grads, plain = compiled_steps(checkpointed(llama_model(),
                                                                   use_reentrant=False,
                                                                   context_fn=partial(contexts, policy)),
                                                      batch,
                                                      steps=1)
    model = checkpointed(llama_model(), use_reentrant=False, context_fn=partial(contexts, policy))
    handle = install(model, NUM_LAYERS)
    losses, grads, graphs = compiled_steps(model, batch, steps=1)
    assert losses == plain_losses
    assert_same_grads(grads, plain_grads)
    if policy is mm_policy:
        # Their policy saves the matmuls, ours the attention: neither is recomputed.
        assert matmuls(graphs.backward) == matmuls(plain.backward)
        assert attention_forwards(plain.backward) == NUM_LAYERS
        assert attention_forwards(graphs.backward) == 0
        assert handle.compiled_layers == handle.layers
    else:
        assert attention_forwards(graphs.backward) == NUM_LAYERS
        assert handle.compiled_layers == ()


@pytest.mark.parametrize("budget", [0.5, 0.0])
@pytest.mark.usefixtures("traceable_kernels")
def test_under_an_activation_memory_budget_the_attention_stays_saved(install, budget):
    """Under a partitioner's memory budget below 1 (torch._functorch.config.activation_memory_budget), which may
    recompute what a policy only prefers to save, the stashed layers' attention outputs are saved as a must: bitwise
    as compiled plain under the same budget, no attention forward in the backward graphs. At 0, where the partitioner
    recomputes every op whatever the policy, the first compiled step is refused, naming the budget."""
    batch = inputs(False)
    with torch._functorch.config.patch(activation_memory_budget=budget):
        model = checkpointed(llama_model(), use_reentrant=False)
        handle = install(model, NUM_LAYERS)
        if budget == 0:
            with pytest.raises((AttentionStashError, torch._dynamo.exc.BackendCompilerFailed)) as raised:
                compiled_steps(model, batch, steps=1)
            error = getattr(raised.value, "inner_exception", raised.value)
            assert isinstance(error, AttentionStashError) and (
                "needs a partitioner that saves what its policy must save for the compiled checkpoint of "
                "model.layers.0, got torch._functorch.config.activation_memory_budget = 0, under which AOTAutograd's "
                "partitioner recomputes every op, the attention kernel too. Set a budget above 0, or remove the "
                "stash (handle.remove()).") in str(error)
            assert live_checkpoint_calls() == []
            return
        plain_losses, plain_grads, plain = compiled_steps(checkpointed(llama_model(), use_reentrant=False),
                                                          batch,
                                                          steps=1)
        losses, grads, graphs = compiled_steps(model, batch, steps=1)
    assert losses == plain_losses
    assert_same_grads(grads, plain_grads)
    assert attention_forwards(plain.backward) == NUM_LAYERS
    assert attention_forwards(graphs.backward) == 0
    assert handle.compiled_layers == handle.layers


@pytest.mark.parametrize("dynamo", ["defaults", "traced"])
@pytest.mark.parametrize("setup, message", [
    ("reentrant", "needs non-reentrant checkpointing for the compiled checkpoint of model.layers.0, got "
     "use_reentrant=True, which torch.compile never runs: dynamo traces every checkpoint as non-reentrant. Enable "
     "checkpointing with use_reentrant=False, or remove the stash (handle.remove())."),
    ("other_context_fn", "needs a context_fn made by create_selective_checkpoint_contexts, the one kind dynamo takes "
     "for the compiled checkpoint of model.layers.0, got functools.partial(<class 'tuple'>"),
])
def test_what_the_compiled_path_cannot_serve_is_refused_at_the_first_compiled_step(install, setup, message, dynamo):
    """Refused by name at the first compiled step, before any step runs; torch.compile's error carries it. Both at
    dynamo's defaults, where kernels >= 0.18 makes dynamo run each checkpoint eagerly (torch's own checkpoint would
    refuse the stash's context_fn for a reentrant one, naming neither), and with the checkpoints traced."""
    import contextlib
    from functools import partial

    if setup == "reentrant":
        model = checkpointed(llama_model(), use_reentrant=True)
    else:
        model = checkpointed(llama_model(),
                             use_reentrant=False,
                             context_fn=partial(tuple, (contextlib.nullcontext(), contextlib.nullcontext())))
    install(model, NUM_LAYERS)
    torch._dynamo.reset()
    traced = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=dynamo == "traced")
    with traced, pytest.raises((AttentionStashError, torch._dynamo.exc.BackendCompilerFailed)) as raised:
        torch.compile(model, backend=Graphs())(**inputs(False)).loss.backward()
    torch._dynamo.reset()
    # Raised as the graph is traced (the context_fn's contexts), or as it is compiled, which wraps it.
    error = getattr(raised.value, "inner_exception", raised.value)
    assert isinstance(error, AttentionStashError) and message in str(error)


@pytest.mark.parametrize("order", ["install_then_compile", "compile_then_install"])
@pytest.mark.usefixtures("traceable_kernels")
def test_offload_true_is_refused_at_the_first_compiled_step(install, order):
    """An install with offload=True, whose kept outputs a compiled graph cannot hand to an offload engine (it saves
    them itself): the first compiled step with aot_eager raises, naming it, whether the install came before
    torch.compile or after a compiled model's warm step (which it recompiles); nothing is kept."""
    model = checkpointed(llama_model(), use_reentrant=False)
    torch._dynamo.reset()
    handle = install(model, NUM_LAYERS, offload=True) if order == "install_then_compile" else None
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    if handle is None:
        compiled(**inputs(False)).loss.backward()
        handle = install(model, NUM_LAYERS, offload=True)
    with pytest.raises((AttentionStashError, torch._dynamo.exc.BackendCompilerFailed)) as raised:
        compiled(**inputs(False)).loss.backward()
    torch._dynamo.reset()
    error = getattr(raised.value, "inner_exception", raised.value)
    assert isinstance(error, AttentionStashError) and (
        "attention stash needs its kept outputs on the device for the compiled checkpoint of model.layers.0, got "
        "offload=True: the compiled graph saves them itself. Install with offload=None, or remove the stash "
        "(handle.remove()).") in str(error)
    assert (handle.num_kept, handle.compiled_layers) == (0, ()) and live_checkpoint_calls() == []


def use_flash(monkeypatch, tmp_path_factory, implementation):
    """Hugging Face's path for a flash ``implementation`` made to run on this machine (see attention_stash_flash and
    attention_stash_flash3), its kernels imported, as the install would: Hugging Face imports them at its first call,
    which breaks dynamo's graph inside the layer. The op of its forward kernel function, None for a Python function."""
    from attention_stash_flash import flash_attn_or_skip, use_flash_attention_2
    from attention_stash_flash3 import flash_kernels_or_skip, hub_kernel_name, use_flash_attention_3, use_hub_kernel
    from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

    if implementation == "flash_attention_2":
        flash_attn_or_skip()
        use_flash_attention_2(monkeypatch)
        lazy_import_flash_attention(implementation)
        return torch.ops.flash_attn._flash_attn_forward.default
    flash_kernels_or_skip()
    if implementation == "flash_attention_3":
        use_flash_attention_3(monkeypatch)
        lazy_import_flash_attention(implementation)
        return None
    # A custom op's, named in the build's namespace.
    module = importlib.import_module(
        use_hub_kernel(monkeypatch, tmp_path_factory, implementation).__name__ + ".flash_attn_interface")
    op = getattr(module._flash_attn_forward, "_opoverload", None)
    assert op is None or op.namespace == hub_kernel_name(implementation)
    return op


def flash_model(implementation):
    # bfloat16, as flash-attn takes it: Hugging Face casts float32 inputs with a warning, which breaks the graph.
    model = checkpointed(llama_model(dtype=torch.bfloat16), use_reentrant=False)
    model.config._attn_implementation = implementation
    return model


# Each build's kernel functions are their own ops, compiled on a plain batch. A padded batch breaks dynamo's graph in
# Hugging Face's unpadding, before any build's function is called: flash_attention_2 alone runs it (issue 58).
@pytest.mark.parametrize("implementation, padded", [("flash_attention_2", False), ("flash_attention_2", True),
                                                    ("kernels-community/flash-attn2", False),
                                                    ("kernels-community/flash-attn3", False)],
                         ids=[
                             "flash_attention_2-plain", "flash_attention_2-padded",
                             "kernels-community/flash-attn2-plain", "kernels-community/flash-attn3-plain"
                         ])
@pytest.mark.usefixtures("traceable_kernels")
def test_a_compiled_flash_step_saves_the_stashed_layers_attention(install, monkeypatch, tmp_path_factory,
                                                                  implementation, padded):
    """flash-attn 2's kernel functions, and the Hub builds', are custom ops with fake kernels (flash-attn's own and the
    builds'; the CPU kernels are the tests' stand-ins): compiled plain against compiled stashed, as for sdpa, the
    stashed layers' forward op saved. A padded batch breaks dynamo's graph inside the layer, and is refused."""
    from attention_stash_helpers import logged_messages

    op = use_flash(monkeypatch, tmp_path_factory, implementation)
    batch, stashed = inputs(padded), NUM_LAYERS - 1
    plain_losses, plain_grads, plain = compiled_steps(flash_model(implementation), batch)
    model = flash_model(implementation)
    with logged_messages() as messages:
        handle = install(model, stashed)
    assert "; under torch.compile, the compiled checkpoint saves the kernel's outputs instead" in messages[-1]
    if padded:
        # Hugging Face unpads with nonzero(), whose shape dynamo does not trace by default, and calls the varlen
        # function with one tensor as both cu_seqlens, which it does not trace at all: compiled plain runs these
        # checkpoints eagerly, and the stash refuses them by name.
        with pytest.raises((AttentionStashError, torch._dynamo.exc.BackendCompilerFailed)) as raised:
            compiled_steps(model, batch)
        error = getattr(raised.value, "inner_exception", raised.value)
        assert isinstance(error, AttentionStashError) and "eagerly after a graph break" in str(error)
        assert attention_forwards(plain.backward, op) == 0 and handle.compiled_layers == ()
        return
    losses, grads, graphs = compiled_steps(model, batch)
    assert losses[0] == plain_losses[0] and losses[1] == losses[0]
    assert_same_grads(grads, plain_grads)
    assert attention_forwards(plain.backward, op) == NUM_LAYERS
    assert attention_forwards(graphs.backward, op) == NUM_LAYERS - stashed
    assert matmuls(graphs.backward) == matmuls(plain.backward) > 0
    assert handle.compiled_layers == handle.layers and handle.recomputes_served == 0


# A packed batch's documents: one row of BATCH x SEQUENCE tokens.
DOCUMENTS = (24, 40)


def packed_inputs(cu_seq_lens):
    """One row of documents, as transformers' DataCollatorWithFlattening makes it: positions restart per document and
    no label crosses a boundary; with ``cu_seq_lens``, also the flash kwargs its return_flash_attn_kwargs=True adds
    (cu_seq_lens_q and cu_seq_lens_k, max_length_q and max_length_k)."""
    ids = batch_ids(batch=1, sequence=sum(DOCUMENTS))
    labels = ids.clone()
    labels[0, DOCUMENTS[0]] = -100
    batch = dict(input_ids=ids,
                 position_ids=torch.cat([torch.arange(length) for length in DOCUMENTS]).unsqueeze(0),
                 labels=labels)
    if cu_seq_lens:
        bounds = torch.tensor([0, DOCUMENTS[0], sum(DOCUMENTS)], dtype=torch.int32)
        batch.update(cu_seq_lens_q=bounds,
                     cu_seq_lens_k=bounds.clone(),
                     max_length_q=max(DOCUMENTS),
                     max_length_k=max(DOCUMENTS))
    return batch


# (implementation, its varlen forward kernel function's op name in the forward op's namespace): flash-attn 3's
# autograd functions call one forward op for both functions.
PACKED_CASES = [("flash_attention_2", "_flash_attn_varlen_forward"),
                ("kernels-community/flash-attn2", "_flash_attn_varlen_forward"),
                ("kernels-community/flash-attn3", "_flash_attn_forward")]


@pytest.mark.parametrize("implementation, varlen_name",
                         PACKED_CASES,
                         ids=[implementation for implementation, _ in PACKED_CASES])
@pytest.mark.usefixtures("traceable_kernels")
def test_a_compiled_flash_step_saves_a_packed_batchs_varlen_attention(install, monkeypatch, tmp_path_factory,
                                                                      implementation, varlen_name):
    """A packed batch with the collator's cu_seq_lens and max lengths (DataCollatorWithFlattening with
    return_flash_attn_kwargs=True), which Hugging Face passes to flash_attn_varlen_func as they are: dynamo traces it
    into the layers' graphs, the varlen forward op with them. Compiled plain against compiled stashed, as for a plain
    batch: the stashed layers' varlen forward op saved, not run in the backward graph; losses and gradients bitwise."""
    op = use_flash(monkeypatch, tmp_path_factory, implementation)
    varlen = getattr(getattr(torch.ops, op.namespace), varlen_name).default
    batch, stashed = packed_inputs(cu_seq_lens=True), NUM_LAYERS - 1
    plain_losses, plain_grads, plain = compiled_steps(flash_model(implementation), batch)
    model = flash_model(implementation)
    handle = install(model, stashed)
    losses, grads, graphs = compiled_steps(model, batch)
    assert losses[0] == plain_losses[0] and losses[1] == losses[0] and plain_losses[1] == plain_losses[0]
    assert_same_grads(grads, plain_grads)
    # The batch reached flash_attn_varlen_func in every layer, traced: its op in the forward graphs, flash-attn 2's
    # plain forward op nowhere.
    assert attention_forwards(plain.forward, varlen) == attention_forwards(graphs.forward, varlen) == NUM_LAYERS
    assert op is varlen or attention_forwards(plain.forward + graphs.forward + graphs.backward, op) == 0
    assert attention_forwards(plain.backward, varlen) == NUM_LAYERS
    assert attention_forwards(graphs.backward, varlen) == NUM_LAYERS - stashed
    assert matmuls(graphs.backward) == matmuls(plain.backward) > 0
    assert (len(graphs.forward), len(graphs.backward)) == (len(plain.forward), len(plain.backward))
    assert handle.compiled_layers == handle.layers and handle.recomputes_served == 0 and handle.num_kept == 0


@pytest.mark.parametrize("captured", [False, True], ids=["defaults", "capture_scalar_outputs"])
@pytest.mark.usefixtures("traceable_kernels")
def test_a_batch_packed_by_position_ids_alone_breaks_the_graph_and_is_refused(install, monkeypatch, tmp_path_factory,
                                                                              captured):
    """A packed batch with position_ids alone (no attention mask, no cu_seq_lens): Hugging Face's
    _flash_attention_forward tests for packing with ``if _is_packed_sequence(position_ids, batch_size):``
    (transformers/modeling_flash_attention_utils.py), a branch on a tensor's value, where dynamo breaks the graph
    ("Data-dependent branching": attempted to jump with TensorVariable()) before any kernel function is called, and
    runs the layer's checkpoint eagerly: compiled plain runs no attention in its graphs, and the stash refuses the
    eager checkpoint by name. Not traceable with capture_scalar_outputs and capture_dynamic_output_shape_ops either
    (what .item() of the max length and nonzero() further on would need): the branch comes first, and breaks alike.
    The reason is read from dynamo's graph-break counters."""
    from torch._dynamo.utils import counters

    from attention_stash_helpers import live_checkpoint_calls

    # torch._dynamo.config.patch rather than monkeypatch, whose undo deletes a config module's setting.
    scalars = torch._dynamo.config.patch(capture_scalar_outputs=captured, capture_dynamic_output_shape_ops=captured)
    # The varlen op exists once flash-attn imports: after use_flash, which skips with its reason where it does not.
    use_flash(monkeypatch, tmp_path_factory, "flash_attention_2")
    varlen = torch.ops.flash_attn._flash_attn_varlen_forward.default
    batch = packed_inputs(cu_seq_lens=False)
    counters.clear()
    with scalars:
        _, _, plain = compiled_steps(flash_model("flash_attention_2"), batch, steps=1)
    assert any(reason.startswith("Data-dependent branching") for reason in counters["graph_break"])
    assert attention_forwards(plain.forward + plain.backward, varlen) == 0
    model = flash_model("flash_attention_2")
    handle = install(model, NUM_LAYERS)
    with scalars, pytest.raises((AttentionStashError, torch._dynamo.exc.BackendCompilerFailed)) as raised:
        compiled_steps(model, batch, steps=1)
    error = getattr(raised.value, "inner_exception", raised.value)
    assert isinstance(error, AttentionStashError) and "eagerly after a graph break" in str(error)
    assert handle.compiled_layers == () and handle.num_kept == 0 and live_checkpoint_calls() == []


@pytest.mark.parametrize("implementation, source", [
    ("flash_attention_3", "flash-attn 3's interface from flash_attn_interface"),
    ("kernels-community/vllm-flash-attn3", "vLLM's flash-attn 3's interface from the Hub kernel "),
])
def test_flash_kernels_dynamo_cannot_trace_are_refused_at_the_first_compiled_step(install, monkeypatch,
                                                                                  tmp_path_factory, implementation,
                                                                                  source):
    """flash-attn 3's interface (flash-attn 2.8.3's hopper/) and vLLM's Hub build call their compiled kernels from
    Python functions, without fake kernels: the install line says they are refused compiled, and the compiled
    checkpoint's contexts (made as the first compiled step's graph is compiled) refuse them by name."""
    from attention_stash_helpers import logged_messages
    from deepspeed.runtime.activation_checkpointing import attention_stash

    assert use_flash(monkeypatch, tmp_path_factory, implementation) is None
    model = flash_model(implementation)
    with logged_messages() as messages:
        handle = install(model, NUM_LAYERS)
    assert "; under torch.compile, refused: dynamo cannot trace these kernels; " in messages[-1]
    stash = attention_stash._LAYER_STASHES[id(model.model.layers[0])]
    with pytest.raises(AttentionStashError) as raised:
        attention_stash._compiled_contexts(stash.key, None)
    assert str(raised.value).startswith(
        f"attention stash needs kernel functions that dynamo traces (torch ops with fake kernels) for the compiled "
        f"checkpoint of model.layers.0, got {source}")
    assert str(raised.value).endswith(
        ", whose kernel functions are Python functions calling compiled kernels. Train the compiled model with sdpa, "
        "flash-attn 2 or a Hub build whose kernel functions are such ops, or remove the stash (handle.remove()).")
    assert handle.compiled_layers == ()


@pytest.mark.usefixtures("traceable_kernels")
def test_a_graph_break_inside_a_stashed_layer_is_refused(install):
    """A pre-hook on layer 1's attention that breaks dynamo's graph: dynamo runs that layer's checkpoint eagerly, which
    the stash refuses by name (its compiled frames are the layers' own: none reuses another layer's stash)."""
    model = checkpointed(llama_model(use_cache=False), use_reentrant=False)
    install(model, NUM_LAYERS)
    model.model.layers[1].self_attn.register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    torch._dynamo.reset()
    with pytest.raises((AttentionStashError, torch._dynamo.exc.BackendCompilerFailed)) as raised:
        torch.compile(model, backend=Graphs())(**inputs(False)).loss.backward()
    torch._dynamo.reset()
    error = getattr(raised.value, "inner_exception", raised.value)
    # The layer dynamo gives up on first: the one with the graph break, or one before it where an earlier compile in
    # the process left the layers' shared frame to run eagerly.
    assert isinstance(error, AttentionStashError) and re.search(
        r"needs dynamo's tracing for the compiled checkpoint of model\.layers\.[01], got a checkpoint run eagerly "
        r"after a graph break in the layer's forward\. Remove the graph break, or remove the stash", str(error))


@pytest.mark.usefixtures("traceable_kernels")
def test_a_stashed_checkpoint_run_eagerly_inside_a_compiled_region_is_refused(install, monkeypatch):
    """Where dynamo runs a frame eagerly and calls a stashed layer's checkpoint from it, its frame callback is still
    set: the eager path refuses, naming the graph break. The callback is what the guard reads, so the test sets it."""
    model = checkpointed(llama_model(), use_reentrant=False)
    install(model, NUM_LAYERS)
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: object())
    with pytest.raises(
            AttentionStashError,
            match=r"^attention stash needs dynamo's tracing for the compiled checkpoint of model\.layers\.0, "
            r"got a checkpoint run eagerly after a graph break in the layer's forward\. Remove the graph "
            r"break, or remove the stash \(handle\.remove\(\)\)\.$"):
        model(**inputs(False))


def test_at_dynamos_defaults_kernels_wrapper_is_named_and_its_setting_serves(install):
    """Dynamo at its defaults, non-reentrant checkpointing, as a user meets it. Where kernels wraps Hugging Face's
    attention forward in one that sets a context variable (kernels >= 0.18 with the transformers release that asks for
    it: the README's install), dynamo runs every checkpoint eagerly, plain ones too: the stash refuses by name, naming
    the kernels release and the dynamo setting that removes the cause, and with that setting the same model's compiled
    steps serve, bitwise like compiled plain. Without the wrapper (transformers 5.22 with kernels 0.17) the defaults
    serve."""
    from packaging.version import Version
    from transformers.utils.import_utils import is_kernels_available

    batch = inputs(False)
    model = checkpointed(llama_model(), use_reentrant=False)
    # transformers takes the kernels release it asks for (5.22: 0.17, whose wrapper sets no variable; 5.24: 0.18; 5.25:
    # 0.19), and wraps the attention forward with it.
    wrapped = is_kernels_available() and Version(version("kernels")) >= Version("0.18")
    assert ("_kernel_funcs" in vars(model.model.layers[0].self_attn)) is is_kernels_available()
    handle = install(model, NUM_LAYERS)
    serving = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=wrapped)
    if wrapped:
        torch._dynamo.reset()
        with pytest.raises((AttentionStashError, torch._dynamo.exc.BackendCompilerFailed)) as raised:
            torch.compile(model, backend=Graphs())(**batch).loss.backward()
        torch._dynamo.reset()
        error = getattr(raised.value, "inner_exception", raised.value)
        assert isinstance(error, AttentionStashError) and re.search(
            r"needs dynamo's tracing for the compiled checkpoint of model\.layers\.[0-9], got a checkpoint run "
            r"eagerly after a graph break in the layer's forward: kernels " + re.escape(version("kernels")) +
            r" sets a context variable there, a mutation dynamo does not trace inside a checkpoint, so plain "
            r"checkpoints run eagerly too\. Set torch\._dynamo\.config\.skip_fwd_side_effects_in_bwd_under_checkpoint "
            r"= True \(the recompute then skips setting that variable and resetting it, which leave nothing behind\), "
            r"or remove the stash \(handle\.remove\(\)\)\.", str(error))
        # Refused mid-step: nothing kept.
        assert handle.compiled_layers == () and handle.num_kept == 0 and live_checkpoint_calls() == []
    with serving:
        plain_losses, plain_grads, plain = compiled_steps(checkpointed(llama_model(), use_reentrant=False), batch, 1)
        losses, grads, graphs = compiled_steps(model, batch, 1)
    assert losses == plain_losses
    assert_same_grads(grads, plain_grads)
    assert attention_forwards(plain.backward) == NUM_LAYERS and attention_forwards(graphs.backward) == 0
    assert handle.compiled_layers == handle.layers and handle.recomputes_served == 0


@pytest.mark.usefixtures("traceable_kernels")
def test_the_trainer_with_torch_compile_saves_the_stashed_layers_attention(install, tmp_path, monkeypatch):
    """The Hugging Face Trainer with ``torch_compile=True`` and its "aot_eager" backend, the stash installed before
    ``train()``: two steps leave the parameters bitwise those of the same run without the stash, and the backward
    graphs run no attention forward of a stashed layer. The backend's name is given this file's (AOTAutograd with the
    min-cut partitioner running the graphs eagerly, as aot_eager, keeping them): the Trainer takes only known names."""
    from torch._dynamo.backends import registry
    from transformers import Trainer, TrainingArguments

    class Batches(torch.utils.data.Dataset):

        def __len__(self):
            return 8

        def __getitem__(self, index):
            ids = batch_ids(seed=index, batch=1, sequence=SEQUENCE)[0]
            return {"input_ids": ids, "labels": ids}

    def train(stashed):
        model, graphs = llama_model(), Graphs()
        handle = install(model, stashed) if stashed else None
        registry.lookup_backend("aot_eager")  # registered at its first lookup
        monkeypatch.setitem(registry._COMPILER_FNS, "aot_eager", graphs)
        # transformers 5.23 renamed the Trainer's gradient_checkpointing arguments, keeping deprecated aliases.
        prefix = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"
        arguments = TrainingArguments(output_dir=str(tmp_path / str(stashed)),
                                      per_device_train_batch_size=BATCH,
                                      max_steps=2,
                                      **{f"{prefix}_checkpointing": True},
                                      torch_compile=True,
                                      torch_compile_backend="aot_eager",
                                      use_cpu=True,
                                      report_to=[],
                                      save_strategy="no",
                                      disable_tqdm=True)
        torch._dynamo.reset()
        Trainer(model=model, args=arguments, train_dataset=Batches()).train()
        torch._dynamo.reset()
        # The Trainer's non-reentrant default.
        assert model.model.layers[0].__dict__["_gradient_checkpointing_func"].keywords["use_reentrant"] is False
        return {name: param.detach().clone() for name, param in model.named_parameters()}, graphs, handle

    plain_params, plain, _ = train(0)
    params, graphs, handle = train(NUM_LAYERS)
    assert_same_grads(params, plain_params)
    assert attention_forwards(plain.backward) == NUM_LAYERS
    assert attention_forwards(graphs.backward) == 0 and len(graphs.backward) == len(plain.backward)
    assert handle.compiled_layers == handle.layers and handle.recomputes_served == 0


@pytest.mark.usefixtures("traceable_kernels")
def test_an_inductor_step_saves_the_stashed_layers_attention(install):
    """Inductor (its C++ kernels on CPU), two stashed layers of three, against the same step run eagerly: the backward
    graph Inductor compiles runs the attention forward of the unstashed layer alone, and loss and gradients agree with
    eager within float32 rounding, as Inductor fuses and orders the surrounding arithmetic its own way. One compile:
    the unstashed layer's recomputed forward is the count's control (issue 58)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    graphs = Graphs()

    def inner(graph, inputs, **kwargs):
        (graphs.backward if kwargs.get("is_backward") else graphs.forward).append(graph)
        return compile_fx_inner(graph, inputs, **kwargs)

    # Inductor's caches would hand back graphs compiled by an earlier run, without calling the inner compile. Set with
    # the configs' own patch: monkeypatch's undo deletes a torch config setting, which breaks later compiles.
    uncached = (torch._inductor.config.patch(fx_graph_cache=False),
                torch._functorch.config.patch(enable_autograd_cache=False))
    batch, stashed = inputs(False), NUM_LAYERS - 1

    eager = checkpointed(llama_model(), use_reentrant=False)
    eager_loss = eager(**batch).loss
    eager_loss.backward()
    model = checkpointed(llama_model(), use_reentrant=False)
    handle = install(model, stashed)
    torch._dynamo.reset()
    try:
        with uncached[0], uncached[1]:
            compiled = torch.compile(model,
                                     backend=lambda graph, inputs: compile_fx(graph, inputs, inner_compile=inner),
                                     dynamic=False)
            loss = compiled(**batch).loss
            loss.backward()
    finally:
        torch._dynamo.reset()
    # Measured: the losses equal, the gradients apart by 3e-8 at most (float32's epsilon is 1.2e-7).
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    plain_grads, grads = param_grads(eager), param_grads(model)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6)
    assert attention_forwards(graphs.backward) == NUM_LAYERS - stashed
    assert handle.compiled_layers == handle.layers and len(handle.layers) == stashed
