# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Tests of the attention stash.

The CPU tests train tiny Hugging Face MoE models built from configs, where PyTorch's SDPA runs the fused CPU
flash-attention kernel, an entry of the stash's own backend table, so they run the production code path. Every CPU
comparison is bitwise: the stash replays the same deterministic kernels on the same inputs as the normal recompute.
"""

import dataclasses
import gc
import os
import weakref
import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.modeling_layers import GradientCheckpointingLayer

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError, install_attention_stash

from attention_stash_helpers import (bare_call, CPU_BACKWARD, CPU_FORWARD, DEFAULT_THREADS, MODELS, NUM_LAYERS,
                                     CountOps, assert_served_as_plain, assert_same_grads, assert_stock_process,
                                     batch_ids, checkpointed, counted_step, free_port, kept_outputs, llama_model,
                                     mixtral_model, param_grads, qwen3_moe_model, stashed_train_step, train_step,
                                     STOCK_SDPA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_layers", [1, NUM_LAYERS])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_matches_normal_recompute(install, model_name, num_layers, dtype):
    model = checkpointed(MODELS[model_name](dtype))
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)

    handle = install(model, num_layers)
    assert handle.layers == tuple(f"model.layers.{i}" for i in range(NUM_LAYERS - num_layers, NUM_LAYERS))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    assert handle.num_kept == num_layers
    with CountOps() as counted:
        loss.backward()
    # The recompute runs the attention forward kernel only in the layers without a stash.
    assert counted.calls[CPU_FORWARD] == NUM_LAYERS - num_layers
    assert counted.calls[CPU_BACKWARD] == NUM_LAYERS
    assert handle.num_kept == 0 and handle.recomputes_served == num_layers
    assert torch.equal(loss.detach(), expected_loss)
    assert_same_grads(param_grads(model), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kept_bytes_are_one_output_and_its_lse_per_layer(install, dtype):
    model = checkpointed(qwen3_moe_model(dtype))
    handle = install(model, 2)
    batch, sequence, heads, head_dim = 3, 40, 4, 16
    loss = model(input_ids=batch_ids(batch=batch, sequence=sequence), labels=batch_ids(batch=batch,
                                                                                       sequence=sequence)).loss
    # The output in the model's dtype, the log-sum-exp in FP32; grouped key/value heads do not count.
    per_layer = batch * heads * sequence * (head_dim * dtype.itemsize + 4)
    assert handle.kept_bytes == 2 * per_layer
    loss.backward()
    assert handle.kept_bytes == 0


def test_checkpointing_enabled_after_install(install):
    """The Hugging Face Trainer enables checkpointing itself, after the user's install."""
    model = checkpointed(qwen3_moe_model())
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    model = qwen3_moe_model().train()
    handle = install(model, NUM_LAYERS)
    checkpointed(model)
    loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


class _Identity(torch.autograd.Function):

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_other_pre_hooks_replacing_the_layer_input(install):
    """ZeRO-3 passes each module's inputs through an autograd function in a forward pre-hook; a stash installed after
    deepspeed.initialize must still key by the layer's own input."""
    model = checkpointed(mixtral_model())
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: (_Identity.apply(args[0]), *args[1:]))
    loss, grads = stashed_train_step(model, install(model, NUM_LAYERS), ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_grouped_heads_either_way(install, monkeypatch):
    """Hugging Face passes GQA to sdpa as enable_gqa=True or as repeat_kv'd key/value; both replay exactly."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    for key_heads, use_gqa in ((2, True), (4, False)):
        monkeypatch.setattr(hf_sdpa, "use_gqa_in_sdpa", lambda *args, **kwargs: use_gqa)
        model = checkpointed(qwen3_moe_model())
        ids = batch_ids()
        expected_loss, expected = train_step(model, ids)
        handle = install(model, NUM_LAYERS)
        model.zero_grad(set_to_none=True)
        with CountOps() as forward:
            loss = model(input_ids=ids, labels=ids).loss
        with CountOps() as backward:
            loss.backward()
        # 4 query heads reach the kernel with 2 key/value heads, or with 4 repeated ones.
        assert forward.key_heads == {key_heads} and backward.calls[CPU_FORWARD] == 0
        assert handle.recomputes_served == NUM_LAYERS
        assert torch.equal(loss.detach(), expected_loss)
        assert_same_grads(param_grads(model), expected)
        handle.remove()


def test_each_recompute_takes_its_own_output(install):
    """Two forwards, then their backwards in reverse order, against the same schedule without the stash."""

    def schedule(model):
        model.zero_grad(set_to_none=True)
        first = model(input_ids=batch_ids(seed=1), labels=batch_ids(seed=1)).loss
        second = model(input_ids=batch_ids(seed=2), labels=batch_ids(seed=2)).loss
        second.backward()
        after_second = param_grads(model)
        first.backward()
        return first.detach(), second.detach(), after_second, param_grads(model)

    model = checkpointed(mixtral_model())
    expected = schedule(model)
    handle = install(model, NUM_LAYERS)
    got = schedule(model)
    assert handle.num_kept == 0 and handle.recomputes_served == 2 * NUM_LAYERS
    assert not torch.equal(expected[0], expected[1])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert_same_grads(got[2], expected[2])
    assert_same_grads(got[3], expected[3])


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_backwards_in_an_order_neither_forward_nor_reverse(install, use_reentrant):
    """Three forwards, then their backwards in the order 1, 0, 2: a store that served first-in-first-out or
    last-in-first-out would hand the first backward another forward's outputs."""

    def schedule(model):
        model.zero_grad(set_to_none=True)
        losses = [model(input_ids=batch_ids(seed=seed), labels=batch_ids(seed=seed)).loss for seed in range(3)]
        grads = []
        for index in (1, 0, 2):
            losses[index].backward()
            grads.append(param_grads(model))
        return [loss.detach() for loss in losses], grads

    model = checkpointed(qwen3_moe_model(), use_reentrant=use_reentrant)
    expected_losses, expected_grads = schedule(model)
    handle = install(model, NUM_LAYERS)
    losses, grads = schedule(model)
    assert handle.recomputes_served == 3 * NUM_LAYERS and handle.num_kept == 0
    assert all(torch.equal(loss, expected) for loss, expected in zip(losses, expected_losses))
    for got, expected in zip(grads, expected_grads):
        assert_same_grads(got, expected)


def test_forwards_without_backward_keep_nothing(install):
    model = checkpointed(mixtral_model())
    ids = batch_ids()
    with torch.no_grad():
        expected_logits = model(input_ids=ids).logits
    expected_tokens = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
    handle = install(model, NUM_LAYERS)

    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected_logits)
    assert handle.num_kept == 0

    # Generation in train mode runs without grad, with the KV cache.
    assert torch.equal(model.generate(ids[:, :8], max_new_tokens=4, do_sample=False), expected_tokens)
    assert handle.num_kept == 0

    model.eval()
    loss = model(input_ids=ids, labels=ids).loss
    assert handle.num_kept == 0
    loss.backward()
    model.train()

    # A dropped forward: its loss is deleted without a backward.
    loss = model(input_ids=ids, labels=ids).loss
    assert handle.num_kept == NUM_LAYERS
    del loss
    gc.collect()
    assert handle.num_kept == 0


def test_autocast_matches_normal_recompute(install):
    model = checkpointed(qwen3_moe_model())
    ids = batch_ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected = train_step(model, ids)
        handle = install(model, NUM_LAYERS)
        loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_remove_restores_stock_behaviour(install):
    stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
    first, second = checkpointed(mixtral_model()), checkpointed(qwen3_moe_model())
    ids = batch_ids()
    expected_loss, expected = train_step(first, ids)

    handle = install(first, 2)
    other = install(second, 1)
    entry = ALL_ATTENTION_FUNCTIONS["sdpa"]
    held = attention_stash._held.entries["sdpa"]
    assert entry is held.entry and held.original is stock
    # In the library-wide mapping, where AttentionInterface.register writes: a later registration replaces it.
    assert AttentionInterface._global_mapping["sdpa"] is entry
    handle.remove()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is entry  # the other model still has a stash
    other.remove()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is stock
    assert all(not layer._forward_pre_hooks for layer in first.model.layers)

    # Stock behaviour: training without a checkpoint is allowed again.
    getattr(first, "activation_checkpointing_disable", first.gradient_checkpointing_disable)()
    first(input_ids=ids, labels=ids).loss.backward()

    # Install, remove, install again.
    checkpointed(first)
    again = install(first, NUM_LAYERS)
    loss, grads = stashed_train_step(first, again, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    again.remove()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is stock


def test_recompute_releases_each_output_during_the_backward(install):
    model = checkpointed(mixtral_model())
    handle = install(model, NUM_LAYERS)
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    outputs = [weakref.ref(out) for out in kept_outputs()]
    assert len(outputs) == NUM_LAYERS
    seen = []

    def first_layer_recompute(module, args):
        if torch.is_grad_enabled():
            seen.append((handle.num_kept, [output() is None for output in outputs]))

    model.model.layers[0].self_attn.register_forward_pre_hook(first_layer_recompute)
    loss.backward()
    # Backward recomputes the last layer first: by layer 0's recompute the outputs of layers 1 and 2 are freed.
    assert seen == [(1, [False, True, True])]
    del loss
    gc.collect()
    assert all(output() is None for output in outputs)


def test_backend_choice_is_the_training_forwards_in_both_passes(install, monkeypatch):
    """PyTorch's choice depends on whether the inputs require grad with grad enabled (cuDNN's head-dim limits for the
    backward on Hopper, flash's on sm86/89). A stubbed choice that picks the fused kernel only for training inputs:
    the first pass, which runs without grad, must still ask for that choice."""
    choose = torch._fused_sdp_choice
    asked = []

    def training_only(query, *args, **kwargs):
        trained = query.requires_grad and torch.is_grad_enabled()
        asked.append(trained)
        return choose(query, *args, **kwargs) if trained else SDPBackend.MATH.value

    model = checkpointed(qwen3_moe_model())
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    handle = install(model, NUM_LAYERS)
    monkeypatch.setattr(torch, "_fused_sdp_choice", training_only)
    loss, grads = stashed_train_step(model, handle, ids)
    assert asked == [True] * (2 * NUM_LAYERS)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_backend_table_selects_by_device_and_choice():
    cases = {
        ("cpu", SDPBackend.FLASH_ATTENTION): attention_stash._CPU_FLASH,
        ("cuda", SDPBackend.CUDNN_ATTENTION): attention_stash._CUDNN,
        ("cuda", SDPBackend.FLASH_ATTENTION): attention_stash._FLASH,
        ("cuda", SDPBackend.EFFICIENT_ATTENTION): attention_stash._EFFICIENT,
    }
    for (device, backend), ops in cases.items():
        assert attention_stash._ops_for(device, backend.value) is ops
    for device, backend in (("cuda", SDPBackend.MATH), ("cpu", SDPBackend.MATH), ("cpu", SDPBackend.CUDNN_ATTENTION),
                            ("cuda", SDPBackend.OVERRIDEABLE), ("cuda", SDPBackend.ERROR)):
        with pytest.raises(AttentionStashError,
                           match=f"a fused SDPA backend it can replay: .*; got {backend.name} on {device}"):
            attention_stash._ops_for(device, backend.value)


def test_head_dim_padding_for_kernels_that_need_it(install, monkeypatch):
    """F.sdpa pads the head dimension to a multiple of 8 for CUDA flash attention; the stash pads, differentiably, and
    slices the output back. Here on the CPU kernel, which F.sdpa does not pad, so the stash's padded kernel runs other
    summation blocks than the normal recompute: equal to 1e-5 relative, not bitwise."""
    monkeypatch.setitem(attention_stash._BACKENDS, ("cpu", SDPBackend.FLASH_ATTENTION.value),
                        dataclasses.replace(attention_stash._CPU_FLASH, head_dim_multiple=8))
    model = checkpointed(qwen3_moe_model(head_dim=12))
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    handle = install(model, NUM_LAYERS)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    assert {out.shape[-1] for out in kept_outputs()} == {16}
    loss.backward()
    assert handle.recomputes_served == NUM_LAYERS
    assert torch.allclose(loss.detach(), expected_loss, rtol=1e-5, atol=0)
    grads = param_grads(model)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert (grad - expected[name]).norm() <= 1e-5 * expected[name].norm(), name


# ---------------------------------------------------------------------------------------------------------------------
# Fail-fast paths, each with its message.
# ---------------------------------------------------------------------------------------------------------------------


def test_rejects_other_attention_implementations():
    with pytest.raises(
            AttentionStashError,
            match='needs a Hugging Face model with attn_implementation "sdpa", "flash_attention_2", '
            '"flash_attention_3", "flash_attention_4" or a Hub kernel with flash-attn\'s interface \\("kernels-community/flash-attn2"'
            '\\), got \'eager\' on MixtralForCausalLM'):
        install_attention_stash(mixtral_model(attn_implementation="eager"), 1)


def test_rejects_attention_implementation_switched_after_install(install):
    model = checkpointed(mixtral_model())
    install(model, 1)
    model.config._attn_implementation = "eager"
    with pytest.raises(AttentionStashError,
                       match='needs model.layers.2 to call attention with attn_implementation="sdpa", as at the '
                       'install, in each forward, got a forward with "eager"'):
        model(input_ids=batch_ids(), labels=batch_ids())


def test_rejects_training_outside_a_checkpoint(install):
    model = mixtral_model().train()
    install(model, 1)
    with pytest.raises(AttentionStashError,
                       match="needs Hugging Face activation checkpointing for a training forward of model.layers.2, "
                       r"got no activation checkpointing on it .*activation_checkpointing_enable\(\)"):
        model(input_ids=batch_ids(), labels=batch_ids())


def test_serves_activation_offload(install):
    """Saved-tensor hooks around the checkpoint, as transformers' activation_checkpointing_enable(offload=True) sets
    with pinned memory (which needs an accelerator), here with save_on_cpu's unpinned copies: the recompute runs on
    the unpacked copy of the layer input, and its checkpoint call still finds what its first pass kept."""
    model = checkpointed(mixtral_model())
    ids = batch_ids()
    with torch.autograd.graph.save_on_cpu():
        expected_loss, expected = train_step(model, ids)
        handle = install(model, NUM_LAYERS)
        loss, grads = stashed_train_step(model, handle, ids)
    assert handle.recomputes_served == NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_rejects_attention_dropout(install):
    model = checkpointed(mixtral_model(attention_dropout=0.1))
    install(model, 1)
    with pytest.raises(AttentionStashError, match="needs attention dropout 0 in model.layers.2, got 0.1"):
        model(input_ids=batch_ids(), labels=batch_ids())


def test_rejects_other_sdpa_backend_choice(install):
    model = checkpointed(mixtral_model())
    install(model, 1)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(AttentionStashError,
                                                     match="a fused SDPA backend it can replay: .*got MATH on cpu"):
        model(input_ids=batch_ids(), labels=batch_ids())


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_rejects_backend_change_between_passes(install, monkeypatch, use_reentrant):
    other_cpu_ops = dataclasses.replace(attention_stash._CPU_FLASH, name="another CPU kernel")
    model = checkpointed(mixtral_model(), use_reentrant=use_reentrant)
    install(model, 1)
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    monkeypatch.setitem(attention_stash._BACKENDS, ("cpu", SDPBackend.FLASH_ATTENTION.value), other_cpu_ops)
    with pytest.raises(AttentionStashError,
                       match="got CPU flash attention in the forward and another CPU kernel in the"):
        loss.backward()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_rejects_an_in_place_change_of_the_attention_output(install, use_reentrant):
    """The kept output is the forward's own tensor: a change in place of it, or of a view of it, after the attention
    call in the forward alone would make the replayed gradients silently wrong (autograd sees no saved tensor change
    in the recompute). The recompute raises instead, and releases what it kept."""
    model = checkpointed(llama_model(), use_reentrant=use_reentrant)
    handle = install(model, NUM_LAYERS)
    changes = []

    def change_once(module, args):
        # o_proj's input is a view of the attention output; only the forward changes it.
        if not changes:
            args[0].mul_(2.0)
            changes.append(module)

    model.model.layers[-1].self_attn.o_proj.register_forward_pre_hook(change_once)
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    with pytest.raises(AttentionStashError,
                       match="needs the attention output of model.layers.2 unchanged from its forward to its "
                       "recompute, got an in-place change of it"):
        loss.backward()
    del loss
    gc.collect()
    assert (handle.num_kept, handle.kept_bytes, handle.released_without_backward) == (0, 0, NUM_LAYERS)


def test_rejects_recompute_without_kept_output(install):
    model = checkpointed(mixtral_model())
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    install(model, 1)
    with pytest.raises(AttentionStashError,
                       match="needs a kept attention output for the recompute of model.layers.2, got a recompute "
                       "outside the stash's checkpoint call: of a forward that ran before the install"):
        loss.backward()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_a_forward_before_a_reinstall_is_recomputed_in_its_own_call(install, use_reentrant):
    """The forward ran under a stash removed before its backward, with another installed on the layer meanwhile: its
    recompute runs in the removed stash's checkpoint call, and the new stash's counts stay at zero. Under reentrant
    checkpointing that recompute is stock, as the removal promises; under non-reentrant checkpointing the forward's
    graph holds the removed stash's node, whose saves only its own recompute gives, and it serves that recompute."""
    model = checkpointed(mixtral_model(), use_reentrant)
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    first = install(model, NUM_LAYERS)
    loss = model(input_ids=ids, labels=ids).loss
    first.remove()
    second = install(model, NUM_LAYERS)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert torch.equal(loss.detach(), expected_loss)
    assert_same_grads(param_grads(model), expected)
    assert (first.num_kept, second.num_kept, second.recomputes_served) == (0, 0, 0)
    assert first.recomputes_served == (0 if use_reentrant else NUM_LAYERS)
    assert not kept_outputs()


def test_same_input_tensor_in_two_forwards_before_their_backwards(install):
    """A caller's leaf (a soft prompt, inputs_embeds) passed to two forwards: each backward takes its own output."""

    def schedule(model, embeds):
        model.zero_grad(set_to_none=True)
        first = model(inputs_embeds=embeds, labels=batch_ids(seed=1)).loss
        second = model(inputs_embeds=embeds, labels=batch_ids(seed=2)).loss
        second.backward()
        first.backward()
        return first.detach(), second.detach(), param_grads(model), embeds.grad.clone()

    model = checkpointed(mixtral_model())
    embeds = model.model.embed_tokens(batch_ids()).detach().requires_grad_()
    expected = schedule(model, embeds)
    embeds.grad = None
    handle = install(model, NUM_LAYERS)
    got = schedule(model, embeds)
    assert handle.recomputes_served == 2 * NUM_LAYERS and handle.num_kept == 0
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert_same_grads(got[2], expected[2])
    assert torch.equal(got[3], expected[3])


def _attention_called(attention, times):
    """Makes ``attention`` call its forward ``times()`` times per call, returning the sum of the outputs."""
    forward = attention.forward

    def repeated(*args, **kwargs):
        outputs = [forward(*args, **kwargs) for _ in range(times())]
        return sum(output[0] for output in outputs), outputs[0][1]

    attention.forward = repeated


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_serves_several_attention_calls_in_one_forward(install, use_reentrant):
    """A layer that calls attention more than once per forward (DiffLlama, LongCat-Flash): each call's output is kept
    and replayed in call order, and each is counted."""
    model = checkpointed(mixtral_model(), use_reentrant=use_reentrant)
    _attention_called(model.model.layers[2].self_attn, lambda: 3)
    ids = batch_ids()
    expected_loss, expected, _ = counted_step(model, dict(input_ids=ids, labels=ids))
    handle = install(model, 1)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    assert handle.num_kept == 3
    assert handle.kept_bytes == 3 * attention_stash.attention_stash_layer_bytes(model, 2, 32, device="cpu")
    with CountOps() as counted:
        loss.backward()
    assert counted.calls[CPU_FORWARD] == NUM_LAYERS - 1
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 3, 0)
    assert torch.equal(loss.detach(), expected_loss)
    assert_same_grads(param_grads(model), expected)


def test_rejects_a_recompute_with_fewer_attention_calls(install):
    model = checkpointed(mixtral_model())
    calls = iter([2, 1])
    _attention_called(model.model.layers[2].self_attn, lambda: next(calls))
    handle = install(model, 1)
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of model.layers.2 to make its forward's 2 attention calls, got 1"):
        loss.backward()
    # Released at once, while the caller still holds the loss and with it the graph.
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 1, 1)
    del loss
    gc.collect()
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 1, 1)


def test_rejects_second_install(install):
    model = checkpointed(mixtral_model())
    install(model, 1)
    with pytest.raises(AttentionStashError,
                       match="needs one install per decoder layer, got a second one on model.layers.2"):
        install_attention_stash(model, 2)
    assert len(attention_stash._STASHES) > 0 and model.model.layers[1] not in attention_stash._STASHES


def _refuse_other_implementation(model, monkeypatch):
    model.config._attn_implementation = "eager"
    return install_attention_stash(model, 1)


def _refuse_a_class_attribute(model, monkeypatch):
    monkeypatch.setattr(type(model.model.layers[2]), "_gradient_checkpointing_func", None, raising=False)
    return install_attention_stash(model, 1)


def _refuse_an_unservable_sdpa_entry(model, monkeypatch):
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", lambda *args, **kwargs: None)
    return install_attention_stash(model, 1)


def _refuse_a_plan_without_geometry(model, monkeypatch):
    for layer in model.model.layers:
        monkeypatch.delattr(layer.self_attn, "head_dim")
        monkeypatch.setattr(layer.self_attn, "config", None)
    return install_attention_stash(model, 1, micro_batch_size=2, sequence_length=32)


@pytest.mark.parametrize("refuse, message", [
    (lambda model, _: install_attention_stash(model, NUM_LAYERS + 1), "needs num_layers from 1 to the model's"),
    (lambda model, _: install_attention_stash(model, memory_budget=1, micro_batch_size=2, sequence_length=32),
     "needs a memory_budget of at least one layer's"),
    (_refuse_other_implementation, 'needs a Hugging Face model with attn_implementation "sdpa", "flash_attention_2"'),
    (_refuse_a_class_attribute, "needs model.layers.2 to keep its checkpoint function per instance"),
    (_refuse_an_unservable_sdpa_entry, "needs Hugging Face's sdpa attention function"),
    (_refuse_a_plan_without_geometry, "needs the head count and head dimension of MixtralAttention"),
],
                         ids=["range", "budget", "implementation", "class_attribute", "sdpa_entry", "geometry"])
def test_a_refused_install_leaves_nothing_installed(monkeypatch, refuse, message):
    """Every check runs before anything is installed: a refused install leaves no layer registered, no slot on the
    layer class and no wrapper in the sdpa entry, and a later install goes through."""
    model = checkpointed(mixtral_model())
    with pytest.raises((AttentionStashError, ValueError), match=message):
        refuse(model, monkeypatch)
    # The refused sdpa entry is the test's own, in the interface's local mapping: the library-wide one is as it was.
    assert AttentionInterface._global_mapping["sdpa"] is STOCK_SDPA
    assert "_gradient_checkpointing_func" not in GradientCheckpointingLayer.__dict__
    assert not attention_stash._STASHES and attention_stash._held is None
    monkeypatch.undo()
    assert_stock_process()
    handle = install_attention_stash(checkpointed(mixtral_model()), 1)
    handle.remove()
    assert_stock_process()


def test_a_refused_second_install_leaves_the_first_as_it_was(install):
    model = checkpointed(mixtral_model())
    first = install(model, 1)
    with pytest.raises(AttentionStashError,
                       match="needs one install per decoder layer, got a second one on model.layers.2"):
        install_attention_stash(model, 2)
    assert set(attention_stash._STASHES.values()) == set(first._stashes)
    first.remove()
    assert_stock_process()


@pytest.mark.parametrize("num_layers", [True, 1.0, "2"])
def test_rejects_non_integer_num_layers(num_layers):
    with pytest.raises(TypeError, match=f"needs an integer num_layers, got {type(num_layers).__name__}"):
        install_attention_stash(mixtral_model(), num_layers)


@pytest.mark.parametrize("num_layers", [0, -1, NUM_LAYERS + 1])
def test_rejects_out_of_range_num_layers(num_layers):
    with pytest.raises(ValueError,
                       match=f"needs num_layers from 1 to the model's {NUM_LAYERS} attention layers \\(of "
                       f"{NUM_LAYERS} decoder layers\\), got {num_layers}"):
        install_attention_stash(mixtral_model(), num_layers)


@pytest.mark.parametrize("missing", [
    "_fused_sdp_choice", "_C._current_graph_task_id", "_C._dynamo.eval_frame.get_eval_frame_callback", "aten_op",
    "checkpointing_layer", "attention_functions"
])
def test_rejects_missing_entry_points(monkeypatch, missing):
    model = mixtral_model()
    if missing.startswith("_"):
        owner, _, attribute = f"torch.{missing}".rpartition(".")
        monkeypatch.delattr(f"{owner}.{attribute}")
        name = f"torch.{missing}"
    elif missing == "aten_op":
        monkeypatch.setitem(attention_stash._BACKENDS, ("cuda", SDPBackend.CUDNN_ATTENTION.value),
                            dataclasses.replace(attention_stash._CUDNN, op="_scaled_dot_product_cudnn_attention_v9"))
        # The forward's entry point and its backward's, both missing.
        name = ("torch._scaled_dot_product_cudnn_attention_v9, "
                "torch.ops.aten._scaled_dot_product_cudnn_attention_v9_backward")
    elif missing == "checkpointing_layer":
        monkeypatch.delattr(transformers.modeling_layers, "GradientCheckpointingLayer")
        name = "transformers.modeling_layers.GradientCheckpointingLayer"
    else:
        monkeypatch.setattr(transformers.modeling_utils, "ALL_ATTENTION_FUNCTIONS", {})
        name = r'transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS\["sdpa"\]'
    with pytest.raises(AttentionStashError,
                       match=f"needs PyTorch 2.11 or newer and transformers 5.x, got an installation "
                       f"without {name}\\. It is tested on PyTorch 2.13 to 2.15: install one of those, and report a "
                       f"newer release that moved these\\.$"):
        install_attention_stash(model, 1)


# ---------------------------------------------------------------------------------------------------------------------
# GPU (cuDNN, flash and memory-efficient attention), skipped without CUDA.
# ---------------------------------------------------------------------------------------------------------------------

CUDA_AVAILABLE = torch.cuda.is_available()  #ignore-cuda
requires_cuda = pytest.mark.skipif(not CUDA_AVAILABLE, reason="the CUDA SDPA backends need CUDA")

CUDA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _relative_error(grad, reference):
    return ((grad.float() - reference).norm() / reference.norm()).item()


def _left_padding_mask(batch, sequence, device):
    """Causal, with the first rows of the first sequence padded: those rows attend to nothing at all."""
    mask = torch.ones(sequence, sequence, dtype=torch.bool, device=device).tril().expand(batch, 1, sequence, sequence)
    mask = mask.clone()
    mask[0, :, :, :sequence // 8] = False
    return mask


def _bare_call():
    """A checkpoint call object whose layer function is one attention call: each call of it is a pass."""
    return bare_call(attention_stash._sdpa_of_current_call)


def _replay(query, key, value, mask, gqa, leaves):
    """One attention call through a checkpoint call object, as a stashed layer makes it: the first pass without grad
    keeps the kernel's outputs, the recompute on fresh leaves returns them from the stash's autograd node."""
    call, counters = _bare_call()
    arguments = dict(attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    with torch.no_grad():
        first = call(query, key, value, **arguments)
    inputs = leaves()
    replayed = call(*inputs, **arguments)
    assert (counters.recomputes_served, counters.kept) == (1, 0)
    assert torch.equal(first, replayed)
    return inputs, replayed


def test_rejects_a_recompute_under_a_torch_func_transform():
    """The recompute's node is applied without autograd.Function.apply's functorch handling: under a torch.func
    transform the stash raises, serves nothing, and releases its kept output at once, while the call still lives."""
    query, key, value = (torch.randn(1, 4, 8, 8) for _ in range(3))
    call, counters = _bare_call()
    with torch.no_grad():
        call(query, key, value, is_causal=True)
    with pytest.raises(AttentionStashError,
                       match="needs the training forwards of attention to run under autograd alone, got a "
                       "torch.func transform"):
        torch.func.grad(lambda query: call(query, key, value, is_causal=True).sum())(query.clone())
    assert (counters.kept, counters.kept_bytes, counters.recomputes_served,
            counters.released_without_backward) == (0, 0, 0, 1)
    call = None
    assert (counters.kept, counters.kept_bytes, counters.released_without_backward) == (0, 0, 1)


def test_rejects_a_first_pass_with_grad_under_a_torch_func_transform():
    """A non-reentrant checkpoint's first pass applies the node too: under a torch.func transform it raises before
    keeping anything."""
    query, key, value = (torch.randn(1, 4, 8, 8) for _ in range(3))
    call, counters = _bare_call()
    with pytest.raises(AttentionStashError,
                       match="needs the training forwards of attention to run under autograd alone, got a "
                       "torch.func transform"):
        torch.func.grad(lambda query: call(query, key, value, is_causal=True).sum())(query.clone())
    assert (counters.kept, counters.kept_bytes, counters.released_without_backward, list(call.kept)) == (0, 0, 0, [])


REPLAY_CASES = [("cpu", SDPBackend.FLASH_ATTENTION)] + [("cuda", backend) for backend in CUDA_BACKENDS]


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("key_heads", [32, 4], ids=["mha", "gqa"])
@pytest.mark.parametrize("device, backend", REPLAY_CASES, ids=lambda case: getattr(case, "name", case).lower())
def test_replay_matches_autograd(device, backend, key_heads, masked):
    """The stash's replay against autograd's F.sdpa, each backend forced: causal, or a left-padded causal mask with
    fully masked rows. On CPU every gradient is bitwise. On CUDA (Qwen3-30B-A3B's shapes: 32 query heads, head dim
    128, bfloat16) the output is bitwise; dK and dV bitwise where two autograd runs agree bitwise, and dQ (and any
    gradient that varies between autograd runs) no further from an FP32 reference than autograd's own."""
    if device == "cuda" and not CUDA_AVAILABLE:
        pytest.skip("the CUDA SDPA backends need CUDA")
    torch.manual_seed(0)
    shapes = {"cuda": (2, 32, 2048, 128, torch.bfloat16), "cpu": (2, 32, 64, 16, torch.float32)}
    batch, heads, sequence, head_dim, dtype = shapes[device]
    query = torch.randn(batch, heads, sequence, head_dim, device=device, dtype=dtype)
    key, value = (torch.randn(batch, key_heads, sequence, head_dim, device=device, dtype=dtype) for _ in range(2))
    grad_out = torch.randn_like(query)
    gqa = key_heads != heads
    mask = _left_padding_mask(batch, sequence, device) if masked else None

    def leaves(dtype=dtype):
        return [t.detach().to(dtype).requires_grad_() for t in (query, key, value)]

    def sdpa(inputs):
        return torch.nn.functional.scaled_dot_product_attention(*inputs,
                                                                attn_mask=mask,
                                                                is_causal=mask is None,
                                                                enable_gqa=gqa)

    with sdpa_kernel(backend):
        choice = torch._fused_sdp_choice(*leaves(), mask, 0.0, mask is None, enable_gqa=gqa)
        if choice != backend.value:
            pytest.skip(f"{backend.name} does not run these inputs here")
        autograd_runs = []
        for _ in range(2):
            inputs = leaves()
            sdpa(inputs).backward(grad_out)
            autograd_runs.append(inputs)
        expected = sdpa(leaves())
        inputs, replayed = _replay(query, key, value, mask, gqa, leaves)
        replayed.backward(grad_out)

    assert torch.equal(replayed, expected)
    if device == "cpu":
        for index in range(3):
            assert torch.equal(inputs[index].grad, autograd_runs[0][index].grad), index
        return
    reference = leaves(torch.float32)
    with sdpa_kernel(SDPBackend.MATH):
        sdpa(reference).backward(grad_out.float())
    for index in range(3):
        first, second = (run[index].grad for run in autograd_runs)
        if index > 0 and torch.equal(first, second):
            assert torch.equal(inputs[index].grad, first), index
        else:
            # A nondeterministic accumulation order moves the last bits between runs; 1% of the error covers that
            # order, not a worse gradient. Fully masked rows have no reference (NaN in FP32 math): left out.
            rows = torch.isfinite(reference[index].grad)
            worst = max(_relative_error(grad[rows], reference[index].grad[rows]) for grad in (first, second))
            assert _relative_error(inputs[index].grad[rows], reference[index].grad[rows]) <= 1.01 * worst, index


@requires_cuda
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("backend", CUDA_BACKENDS, ids=lambda backend: backend.name.lower())
def test_cuda_two_layer_training_step(install, backend, masked, use_reentrant):
    """A two-layer model's training step with and without the stash, each backend forced, on equal-length or
    left-padded sequences (flash attention takes no mask: PyTorch does not pick it for the padded batch), under both
    checkpoint modes."""
    model = checkpointed(qwen3_moe_model(torch.bfloat16,
                                         num_hidden_layers=2,
                                         hidden_size=512,
                                         num_attention_heads=8,
                                         num_key_value_heads=8,
                                         head_dim=64).to("cuda"),
                         use_reentrant=use_reentrant)
    ids = batch_ids(sequence=256).to("cuda")
    inputs = dict(input_ids=ids, labels=ids)
    if masked:
        if backend == SDPBackend.FLASH_ATTENTION:
            pytest.skip("flash attention takes no mask")
        mask = torch.ones_like(ids)
        mask[0, :40] = 0
        inputs.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    with sdpa_kernel(backend):
        model.zero_grad(set_to_none=True)
        expected_loss = model(**inputs).loss
        expected_loss.backward()
        expected = param_grads(model)
        handle = install(model, 2)
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        assert handle.num_kept == 2
        loss.backward()
    assert handle.num_kept == 0 and handle.recomputes_served == 2
    assert torch.equal(loss.detach(), expected_loss.detach())
    for name, grad in param_grads(model).items():
        # Only dQ may differ, by a nondeterministic accumulation order; 1e-2 relative L2 bounds that spread.
        assert (grad.float() - expected[name].float()).norm() <= 1e-2 * expected[name].float().norm(), name


def test_autoep_engine_step_with_and_without_the_stash(install):
    """One training step of a DeepSpeed AutoEP engine on a two-layer Mixtral, on CUDA (cuDNN) where it is available."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 23):
        pytest.skip("DeepSpeed 0.19.8's AutoEP fails in deepspeed.initialize with transformers >= 5.23; CI runs this "
                    "test under transformers 5.22.2")
    for variable, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                              ("MASTER_PORT", free_port())):
        os.environ.setdefault(variable, default)
    # The engine's device: DeepSpeed's accelerator, CUDA where it is available.
    device = get_accelerator().device_name()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-4,
                "torch_adam": True
            }
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 1,
            "preset_model": "mixtral"
        },
    }
    ids = batch_ids(sequence=128).to(device)

    def step(num_layers):
        # Head dimension 128 in bfloat16, which PyTorch runs on cuDNN on Hopper.
        model = mixtral_model(torch.bfloat16,
                              hidden_size=1024,
                              intermediate_size=256,
                              num_hidden_layers=2,
                              num_attention_heads=8,
                              num_key_value_heads=8,
                              max_position_embeddings=128)
        checkpointed(model)
        handle = install(model, num_layers) if num_layers else None
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert any(type(module).__name__ == "AutoEPMoELayer" for module in engine.module.modules())
        loss = engine(input_ids=ids, labels=ids).loss
        assert handle is None or handle.num_kept == num_layers
        engine.backward(loss)
        assert handle is None or handle.recomputes_served == num_layers
        grads = {
            name: param.grad.float().clone()
            for name, param in engine.module.named_parameters() if "self_attn" in name
        }
        engine.step()
        if handle is not None:
            assert handle.num_kept == 0
            handle.remove()
        return loss.detach(), grads

    expected_loss, expected = step(0)
    loss, grads = step(2)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected.keys() and len(grads) == 8
    for name, grad in grads.items():
        if device == "cpu":
            assert torch.equal(grad, expected[name]), name
        else:
            # cuDNN accumulates dQ in a nondeterministic order, which reaches the query projection's gradient, and
            # through dQ the others upstream of it; 1e-2 relative L2 bounds that run-to-run spread.
            assert (grad - expected[name]).norm() <= 1e-2 * expected[name].norm(), name


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padded"])
def test_the_stash_node_differentiates_as_autograd_in_both_passes(masked):
    """Under non-reentrant checkpointing the first pass runs with grad and applies the stash's node, which runs the
    kernel; the recompute applies the same node, which returns the kept output. Each node's backward, the first
    pass's with its own saves (a checkpoint fills them with the recompute's) and the recompute's, gives autograd's
    gradients for F.sdpa, bitwise on CPU."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = _left_padding_mask(2, 16, "cpu") if masked else None
    arguments = dict(attn_mask=mask, is_causal=mask is None)
    grad_out = torch.randn_like(query)

    def leaves():
        return [t.clone().requires_grad_() for t in (query, key, value)]

    expected_inputs = leaves()
    torch.nn.functional.scaled_dot_product_attention(*expected_inputs, **arguments).backward(grad_out)
    call, counters = _bare_call()
    first_inputs = leaves()
    with CountOps() as first_pass:
        first = call(*first_inputs, **arguments)
    assert type(first.grad_fn).__name__ == "_AttentionNodeBackward" and first_pass.calls[CPU_FORWARD] == 1
    inputs = leaves()
    with CountOps() as recompute:
        replayed = call(*inputs, **arguments)
    assert type(replayed.grad_fn) is type(first.grad_fn) and recompute.calls[CPU_FORWARD] == 0
    assert torch.equal(first.detach(), replayed) and counters.recomputes_served == 1
    replayed.backward(grad_out)
    first.backward(grad_out)
    for got, got_first, expected in zip(inputs, first_inputs, expected_inputs):
        assert torch.equal(got.grad, expected.grad) and torch.equal(got_first.grad, expected.grad)


# ---------------------------------------------------------------------------------------------------------------------
# Paths no other test reached: each guard fires, each fallback does what it says.
# ---------------------------------------------------------------------------------------------------------------------


def test_a_recompute_node_that_raises_counts_its_entry_released_once(monkeypatch):
    """The recompute's node raising (here a stand-in for any error inside it): its entry is counted released once,
    not served, and nothing stays kept."""
    query, key, value = (torch.randn(1, 4, 8, 8) for _ in range(3))
    call, counters = _bare_call()
    with torch.no_grad():
        call(query, key, value, is_causal=True)

    def failing(*args):
        raise RuntimeError("the node failed")

    monkeypatch.setattr(attention_stash, "_apply_node", failing)
    with pytest.raises(RuntimeError, match="^the node failed$"):
        call(*(tensor.clone().requires_grad_() for tensor in (query, key, value)), is_causal=True)
    assert (counters.kept, counters.kept_bytes, counters.recomputes_served,
            counters.released_without_backward) == (0, 0, 0, 1)


def test_a_recompute_without_its_forward_s_mask_is_refused():
    """A first pass with a mask, a recompute without one: refused naming the change, and released at once."""
    query, key, value = (torch.randn(2, 4, 16, 8) for _ in range(3))
    call, counters = _bare_call()
    with torch.no_grad():
        call(query, key, value, attn_mask=_left_padding_mask(2, 16, "cpu"))
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of attention to get its forward's attention mask, got a change from "
                       "or to none: the kept output is the forward's"):
        call(*(tensor.clone().requires_grad_() for tensor in (query, key, value)), is_causal=True)
    assert (counters.kept, counters.released_without_backward) == (0, 1)


def test_a_recompute_on_a_backend_without_a_replay_is_refused(install):
    """The forward on PyTorch's fused CPU kernel, the backward (and so the reentrant recompute) under
    sdpa_kernel(MATH): the stash names the backend it cannot replay, and releases the layer's output at once."""
    model = checkpointed(llama_model())
    handle = install(model, 1)
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids).loss
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(AttentionStashError,
                                                     match="a fused SDPA backend it can replay: .*got MATH on cpu"):
        loss.backward()
    assert (handle.num_kept, handle.released_without_backward) == (0, 1)


def test_the_checkpoint_function_slot_reads_and_deletes_as_an_attribute(install):
    """The stash's slot for the layers' checkpoint function behaves as the plain attribute it stands for: absent, it
    raises AttributeError on a read and on a delete."""
    model = checkpointed(llama_model())
    install(model, 1)
    layer = model.model.layers[0]
    del layer._gradient_checkpointing_func
    assert not hasattr(layer, "_gradient_checkpointing_func")
    with pytest.raises(AttributeError, match="_gradient_checkpointing_func"):
        del layer._gradient_checkpointing_func


def test_a_global_deleted_after_the_install_fails_as_in_the_original(install, monkeypatch):
    """A name that Hugging Face's sdpa function reads from its module, deleted after the install: the stash's copy
    fails as the original does, with the original's NameError."""
    import transformers.integrations.sdpa_attention as sdpa_module

    model = checkpointed(llama_model())
    install(model, NUM_LAYERS)
    ids = batch_ids()
    model(input_ids=ids, labels=ids).loss.backward()
    monkeypatch.delattr(sdpa_module, "use_gqa_in_sdpa")
    with pytest.raises(NameError, match="use_gqa_in_sdpa"):
        model(input_ids=ids, labels=ids)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_a_step_at_pytorchs_default_thread_count_is_stock(install, use_reentrant):
    """conftest.py gives each pytest-xdist worker its share of the cores for PyTorch's threads (1 on 2 cores); at
    PyTorch's own default, as a user's process runs, a stashed step is stock bitwise too, every recompute served
    without its attention forward."""
    threads = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        assert torch.get_num_threads() == DEFAULT_THREADS
        ids = batch_ids()
        assert_served_as_plain(checkpointed(qwen3_moe_model(), use_reentrant),
                               NUM_LAYERS,
                               install,
                               input_ids=ids,
                               labels=ids)
    finally:
        torch.set_num_threads(threads)
