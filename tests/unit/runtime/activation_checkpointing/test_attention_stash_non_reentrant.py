# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash under transformers' default, non-reentrant checkpointing: selective checkpointing of the attention call.

The same install serves both modes; here every comparison is against plain non-reentrant checkpointing, bitwise on
CPU, counting that the stashed layers' recomputes run no attention forward kernel and that each was served. CI runs
them on both checkpoint layouts of transformers.
"""

import gc

import pytest
import torch

from deepspeed.runtime.activation_checkpointing import attention_stash

from attention_stash_helpers import (CPU_BACKWARD, CPU_FORWARD, MODELS, NUM_LAYERS, CountOps, assert_same_grads,
                                     batch_ids, checkpointed, counted_step, live_checkpoint_calls, llama_model,
                                     mixtral_model, param_grads, qwen3_moe_model)


def _non_reentrant(model):
    return checkpointed(model, use_reentrant=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_layers", [1, NUM_LAYERS])
@pytest.mark.parametrize("model_name", ["mixtral", "qwen3_moe", "llama"])
def test_matches_plain_non_reentrant_checkpointing(install, model_name, num_layers, dtype):
    make_model = {**MODELS, "llama": llama_model}[model_name]
    model = _non_reentrant(make_model(dtype))
    ids = batch_ids()
    expected_loss, expected, calls = counted_step(model, input_ids=ids, labels=ids)
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
    expected_loss, expected, _ = counted_step(model, **inputs)
    handle = install(model, NUM_LAYERS)
    loss, grads, calls = counted_step(model, **inputs)
    assert calls[CPU_FORWARD] == 0 and handle.recomputes_served == NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


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
    expected_loss, expected, _ = counted_step(_non_reentrant(qwen3_moe_model()), input_ids=ids, labels=ids)
    model = qwen3_moe_model().train()
    handle = install(model, NUM_LAYERS)
    _non_reentrant(model)
    loss, grads, calls = counted_step(model, input_ids=ids, labels=ids)
    assert calls[CPU_FORWARD] == 0 and handle.recomputes_served == NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_second_backward_through_a_retained_graph_names_it(install):
    model = _non_reentrant(mixtral_model())
    install(model, NUM_LAYERS)
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="got a second backward through a retained graph"):
        loss.backward()


@pytest.mark.parametrize("given", ["context_fn", "debug"])
def test_rejects_a_checkpoint_with_its_own_context_fn_or_debug(install, given):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    extra = {
        "context_fn": lambda: create_selective_checkpoint_contexts([])
    } if given == "context_fn" else {
        "debug": True
    }
    model = checkpointed(mixtral_model(), use_reentrant=False, **extra)
    install(model, 1)
    expected = "context_fn" if given == "context_fn" else "debug=True"
    with pytest.raises(RuntimeError,
                       match=f"needs the checkpoint of model.layers.2 to run without a context_fn or debug of its "
                       f"own, got {expected}"):
        model(input_ids=batch_ids(), labels=batch_ids())


def test_checks_a_checkpoint_function_set_after_a_served_step(install):
    """The stash checks a layer's checkpoint settings once per checkpoint function: one set after a served step, with
    debug=True (PyTorch takes it only without reentrant checkpointing), is checked again."""
    model = _non_reentrant(mixtral_model())
    handle = install(model, 1)
    model(input_ids=batch_ids(), labels=batch_ids()).loss.backward()
    assert handle.recomputes_served == 1
    checkpointed(model, use_reentrant=False, debug=True)
    with pytest.raises(RuntimeError,
                       match="needs the checkpoint of model.layers.2 to run without a context_fn or "
                       "debug of its own, got debug=True"):
        model(input_ids=batch_ids(), labels=batch_ids())


def test_dropout_and_math_still_raise(install):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _non_reentrant(mixtral_model(attention_dropout=0.1))
    install(model, 1)
    with pytest.raises(RuntimeError, match="needs attention dropout 0 in model.layers.2, got 0.1"):
        model(input_ids=batch_ids(), labels=batch_ids())
    model = _non_reentrant(mixtral_model())
    install(model, 1)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError,
                                                     match="a fused SDPA backend it can replay: .*got MATH on cpu"):
        model(input_ids=batch_ids(), labels=batch_ids())
