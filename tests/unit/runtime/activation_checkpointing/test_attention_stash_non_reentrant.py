# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash under transformers' default, non-reentrant checkpointing.

The same install serves both modes: a non-reentrant checkpoint's first pass runs the kernel with grad, leaving
PyTorch's own attention node in the graph, and its recompute applies the stash's node to the kept outputs, which saves
what that node saved, in its order, so the checkpoint fills the first pass's saved tensors with the kept ones. Here
every comparison is against plain non-reentrant checkpointing with the same settings, bitwise on CPU, counting that the
stashed layers' recomputes run no attention forward kernel and that each was served: a user's own
selective-checkpointing policy (context_fn), debug=True, and a checkpoint that stops its recompute at the node's saves.
CI runs them on both checkpoint layouts of transformers.
"""

import gc

import pytest
import torch

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError

from attention_stash_helpers import (CPU_BACKWARD, CPU_FORWARD, MODELS, NUM_LAYERS, CountOps, assert_same_grads,
                                     assert_served_as_plain, batch_ids, checkpointed, counted_step,
                                     live_checkpoint_calls, llama_model, mixtral_model, param_grads, qwen3_moe_model)


def _non_reentrant(model):
    return checkpointed(model, use_reentrant=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_layers", [1, NUM_LAYERS])
@pytest.mark.parametrize("model_name", ["mixtral", "qwen3_moe", "llama"])
def test_matches_plain_non_reentrant_checkpointing(install, model_name, num_layers, dtype):
    make_model = {**MODELS, "llama": llama_model}[model_name]
    model = _non_reentrant(make_model(dtype))
    ids = batch_ids()
    expected_loss, expected, calls = counted_step(model, dict(input_ids=ids, labels=ids))
    assert calls[CPU_FORWARD] == NUM_LAYERS
    handle = install(model, num_layers)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    assert handle.num_kept == num_layers
    # The output and its log-sum-exp per stashed layer, as the planner counts them.
    assert handle.kept_bytes == num_layers * attention_stash.attention_stash_layer_bytes(model, 2, 32, device="cpu")
    with CountOps() as counted:
        loss.backward()
    # The recompute runs the attention forward kernel only in the layers without a stash.
    assert counted.calls[CPU_FORWARD] == NUM_LAYERS - num_layers and counted.calls[CPU_BACKWARD] == NUM_LAYERS
    assert (handle.num_kept, handle.kept_bytes, handle.recomputes_served) == (0, 0, num_layers)
    assert torch.equal(loss.detach(), expected_loss)
    assert_same_grads(param_grads(model), expected)


def test_padded_batch(install):
    model = _non_reentrant(llama_model())
    ids = batch_ids()
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert_served_as_plain(model, NUM_LAYERS, install, **inputs)


def test_dropped_no_grad_and_eval_forwards(install):
    model = _non_reentrant(mixtral_model())
    handle = install(model, NUM_LAYERS)
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids).loss
    assert handle.num_kept == NUM_LAYERS
    del loss
    assert (handle.num_kept, handle.kept_bytes, handle.released_without_backward) == (0, 0, NUM_LAYERS)
    with torch.no_grad():
        model(input_ids=ids)
    model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)
    model.eval()
    model(input_ids=ids, labels=ids).loss.backward()
    model.train()
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 0, NUM_LAYERS)
    gc.collect()
    assert not live_checkpoint_calls()


def test_checkpointing_enabled_after_install(install):
    ids = batch_ids()
    expected_loss, expected, _ = counted_step(_non_reentrant(qwen3_moe_model()), dict(input_ids=ids, labels=ids))
    model = qwen3_moe_model().train()
    handle = install(model, NUM_LAYERS)
    _non_reentrant(model)
    loss, grads, calls = counted_step(model, dict(input_ids=ids, labels=ids))
    assert calls[CPU_FORWARD] == 0 and handle.recomputes_served == NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_second_backward_through_a_retained_graph_names_it(install):
    model = _non_reentrant(mixtral_model())
    install(model, NUM_LAYERS)
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(AttentionStashError, match="got a second backward through a retained graph"):
        loss.backward()


def _matmuls_saved():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # A policy as axolotl and torchtitan build them: keep the matmuls' outputs, recompute the rest.
    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default, torch.ops.aten.addmm.default])


def test_composes_with_a_selective_checkpointing_policy(install):
    """A checkpoint's own context_fn runs around the stash: its policy keeps the matmuls, the stash the attention."""
    ids = batch_ids()
    without_policy = counted_step(_non_reentrant(llama_model()), dict(input_ids=ids, labels=ids))[2]
    model = checkpointed(llama_model(), use_reentrant=False, context_fn=_matmuls_saved)
    _, plain_calls, calls = assert_served_as_plain(model, NUM_LAYERS, install, input_ids=ids, labels=ids)
    # The policy is in force in the stashed model: its recomputes run no matmul forward it kept.
    assert calls["mm.default"] == plain_calls["mm.default"] < without_policy["mm.default"]


def test_a_policy_that_keeps_the_attention_kernel_too(install):
    """A policy that also keeps the attention kernel's outputs holds the very tensors the stash keeps; the stash's
    node serves the recompute, and the bytes it counts are the output and log-sum-exp once."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kernel = getattr(torch.ops.aten, CPU_FORWARD.partition(".")[0]).default
    model = checkpointed(llama_model(),
                         use_reentrant=False,
                         context_fn=lambda: create_selective_checkpoint_contexts([kernel]))
    ids = batch_ids()
    handle, plain_calls, _ = assert_served_as_plain(model, NUM_LAYERS, install, input_ids=ids, labels=ids)
    # The policy is in force: without the stash, no recompute runs the kernel.
    assert plain_calls[CPU_FORWARD] == 0
    assert handle.peak_kept_bytes == NUM_LAYERS * attention_stash.attention_stash_layer_bytes(
        model, 2, 32, device="cpu")


def test_debug_checkpoint_is_served(install):
    """debug=True (PyTorch takes it only without reentrant checkpointing) records every op of both passes for its
    error messages; the stash serves it, also when it is enabled after a served step."""
    model = _non_reentrant(mixtral_model())
    ids = batch_ids()
    handle, _, _ = assert_served_as_plain(model, 1, install, input_ids=ids, labels=ids)
    checkpointed(model, use_reentrant=False, debug=True)
    handle.remove()
    assert_served_as_plain(model, 1, install, input_ids=ids, labels=ids)


def test_recompute_that_stops_at_the_nodes_saves(install):
    """A non-reentrant checkpoint stops its recompute at its last saved tensor. In a layer whose attention node saves
    last (no projection, norm or MLP after it), that stop is raised from the node's saves: the recompute was served,
    and the counters balance."""
    model = _non_reentrant(llama_model())
    layer = model.model.layers[-1]
    layer.self_attn.o_proj = layer.post_attention_layernorm = layer.mlp = torch.nn.Identity()
    ids = batch_ids()
    handle, _, _ = assert_served_as_plain(model, NUM_LAYERS, install, input_ids=ids, labels=ids)
    assert handle.kept_bytes == 0
    gc.collect()
    assert not live_checkpoint_calls()


def test_dropout_and_math_still_raise(install):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _non_reentrant(mixtral_model(attention_dropout=0.1))
    install(model, 1)
    with pytest.raises(AttentionStashError, match="needs attention dropout 0 in model.layers.2, got 0.1"):
        model(input_ids=batch_ids(), labels=batch_ids())
    model = _non_reentrant(mixtral_model())
    install(model, 1)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(AttentionStashError,
                                                     match="a fused SDPA backend it can replay: .*got MATH on cpu"):
        model(input_ids=batch_ids(), labels=batch_ids())
