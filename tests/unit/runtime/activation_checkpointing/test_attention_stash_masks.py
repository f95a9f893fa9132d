# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Attention masks: padded, packed and sliding-window batches, and additive float masks.

Each case trains a model with and without the stash and compares bitwise: the replay runs the same CPU kernel on the
same mask F.sdpa would give it. Each counts that the recompute runs no attention forward kernel and that every stashed
layer's recompute was served. CI runs them on both checkpoint layouts of transformers.
"""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError

from attention_stash_helpers import (CPU_BACKWARD, CPU_FORWARD, NUM_LAYERS, assert_same_grads, batch_ids, checkpointed,
                                     counted_step, llama_model, mistral_model, qwen3_moe_model)

SEQUENCE = 32


def _assert_served_exactly(make_model, num_layers=NUM_LAYERS, install=None, **inputs):
    """The stashed step equals the plain one bitwise; the recompute ran the attention forward only in the layers
    without a stash, and every stashed layer's recompute was served."""
    model = checkpointed(make_model())
    expected_loss, expected, plain_calls = counted_step(model, inputs)
    assert plain_calls[CPU_FORWARD] == NUM_LAYERS  # the masked calls run the fused CPU kernel, here as in F.sdpa
    handle = install(model, num_layers)
    loss, grads, calls = counted_step(model, inputs)
    assert handle.recomputes_served == num_layers and handle.num_kept == 0
    assert calls[CPU_FORWARD] == NUM_LAYERS - num_layers and calls[CPU_BACKWARD] == NUM_LAYERS
    assert not torch.isnan(loss)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    return handle


def _padding_mask(side):
    mask = torch.ones(2, SEQUENCE, dtype=torch.long)
    if side == "right":
        mask[0, -9:] = 0
        mask[1, -3:] = 0
    else:
        # Left padding: the padded rows of the prefix attend to nothing at all (fully masked).
        mask[0, :9] = 0
        mask[1, :3] = 0
    return mask


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("make_model", [llama_model, qwen3_moe_model], ids=["llama", "qwen3_moe"])
def test_padded_batches(install, make_model, side):
    ids = batch_ids(sequence=SEQUENCE)
    mask = _padding_mask(side)
    labels = ids.masked_fill(mask == 0, -100)
    _assert_served_exactly(make_model, install=install, input_ids=ids, attention_mask=mask, labels=labels)


def test_padded_batch_with_some_layers_stashed(install):
    ids = batch_ids(sequence=SEQUENCE)
    _assert_served_exactly(llama_model,
                           1,
                           install=install,
                           input_ids=ids,
                           attention_mask=_padding_mask("left"),
                           labels=ids)


def test_packed_documents_from_position_ids(install):
    """Documents packed into rows, told apart by position ids that restart: Hugging Face builds per-document causal
    masks from them (no attention_mask given)."""
    ids = batch_ids(sequence=SEQUENCE)
    position_ids = torch.cat([torch.arange(12), torch.arange(7), torch.arange(13)]).repeat(2, 1)
    position_ids[1] = torch.cat([torch.arange(20), torch.arange(12)])
    seen = []

    def model_masks(module, args, kwargs):
        seen.append(kwargs.get("attention_mask"))

    def make_model():
        model = qwen3_moe_model()
        model.model.layers[0].self_attn.register_forward_pre_hook(model_masks, with_kwargs=True)
        return model

    handle = _assert_served_exactly(make_model, install=install, input_ids=ids, position_ids=position_ids, labels=ids)
    # Block-diagonal: the first row's second document does not see its first.
    assert seen[0] is not None and not seen[0][0, 0, 12, 11] and seen[0][0, 0, 12, 12]
    assert handle.recomputes_served == NUM_LAYERS


def test_sliding_window_shorter_than_the_sequence(install):
    ids = batch_ids(sequence=SEQUENCE)
    _assert_served_exactly(lambda: mistral_model(sliding_window=8), install=install, input_ids=ids, labels=ids)


def test_additive_float_mask(install):
    """A 4D float mask, which Hugging Face passes to the attention as it is: an additive bias, with -inf and finite
    values, broadcast over the heads."""
    ids = batch_ids(sequence=SEQUENCE)
    bias = torch.randn(2, 1, SEQUENCE, SEQUENCE, generator=torch.Generator().manual_seed(3))
    bias = bias.masked_fill(~torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool).tril(), float("-inf"))
    _assert_served_exactly(llama_model, install=install, input_ids=ids, attention_mask=bias, labels=ids)


@pytest.mark.parametrize("order", ["autocast_first", "fp32_first"])
def test_additive_float_mask_under_autocast(install, monkeypatch, order):
    """Autocast casts a float mask to its dtype along with the query, key and value, as F.sdpa runs it; a bias whose
    rounding matters shows whether the stash does the same, with the mask check made under autocast or, in fp32,
    before it."""
    monkeypatch.setattr(attention_stash, "_MASKS_CHECKED", set())
    ids = batch_ids(sequence=SEQUENCE)
    bias = torch.zeros(2, 1, SEQUENCE, SEQUENCE)
    bias[0, :, :, :3] = -0.3
    bias[1, :, :, 5:9] = 0.123456789
    bias = bias.masked_fill(~torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool).tril(), float("-inf"))
    model = checkpointed(llama_model())
    inputs = dict(input_ids=ids, attention_mask=bias, labels=ids)

    def step(autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return counted_step(model, inputs)[:2]

    expected = {autocast: step(autocast) for autocast in (False, True)}
    handle = install(model, NUM_LAYERS)
    for autocast in ((True, False) if order == "autocast_first" else (False, True)):
        loss, grads = step(autocast)
        assert torch.equal(loss, expected[autocast][0])
        assert_same_grads(grads, expected[autocast][1])
    assert handle.recomputes_served == 2 * NUM_LAYERS


def test_bf16_padded_batch(install):
    ids = batch_ids(sequence=SEQUENCE)
    _assert_served_exactly(lambda: qwen3_moe_model(torch.bfloat16),
                           install=install,
                           input_ids=ids,
                           attention_mask=_padding_mask("left"),
                           labels=ids)


def test_rejects_a_mask_changed_between_forward_and_backward(install):
    model = checkpointed(llama_model())
    handle = install(model, 1)
    masks = []
    model.model.layers[2].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True)
    ids = batch_ids(sequence=SEQUENCE)
    loss = model(input_ids=ids, attention_mask=_padding_mask("right"), labels=ids).loss
    masks[0].logical_not_().logical_not_()  # the same values, written in place
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of model.layers.2 to get its forward's attention mask, got another "
                       "one"):
        loss.backward()
    # What was kept goes at once, while the caller still holds the loss and with it the graph.
    assert (handle.num_kept, handle.kept_bytes, handle.released_without_backward) == (0, 0, 1)


def test_rejects_a_masked_call_that_pytorch_runs_on_math(install):
    model = checkpointed(llama_model())
    install(model, 1)
    ids = batch_ids(sequence=SEQUENCE)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(AttentionStashError,
                                                     match="a fused SDPA backend it can replay: .*got MATH on cpu"):
        model(input_ids=ids, attention_mask=_padding_mask("left"), labels=ids)


def test_rejects_a_learned_mask(install):
    model = checkpointed(llama_model())
    install(model, 1)
    ids = batch_ids(sequence=SEQUENCE)
    bias = torch.zeros(2, 1, SEQUENCE, SEQUENCE, requires_grad=True)
    with pytest.raises(AttentionStashError,
                       match="needs an attention mask that does not require grad in model.layers.2"):
        model(input_ids=ids, attention_mask=bias, labels=ids)


def test_mask_preparation_is_checked_against_pytorch_once(install, monkeypatch):
    """The first masked call of a backend in a process compares the stash's prepared mask with the one F.sdpa gives
    the kernel; a preparation that PyTorch does not make (here: finfo.min where F.sdpa writes -inf) raises."""
    monkeypatch.setattr(attention_stash, "_MASKS_CHECKED", set())
    model = checkpointed(llama_model())
    install(model, 1)
    ids = batch_ids(sequence=SEQUENCE)
    model(input_ids=ids, attention_mask=_padding_mask("left"), labels=ids).loss.backward()
    assert attention_stash._MASKS_CHECKED == {(attention_stash._CPU_FLASH, torch.bool, torch.float32)}

    def finfo_min_mask(mask, query, key, value):
        return mask if mask is None else torch.zeros(mask.shape, dtype=query.dtype).masked_fill(
            ~mask,
            torch.finfo(query.dtype).min)

    backend = ("cpu", SDPBackend.FLASH_ATTENTION.value)
    monkeypatch.setitem(attention_stash._BACKENDS, backend,
                        dataclasses.replace(attention_stash._CPU_FLASH, prepare_mask=finfo_min_mask))
    monkeypatch.setattr(attention_stash, "_MASKS_CHECKED", set())
    with pytest.raises(AttentionStashError,
                       match="needs its mask for CPU flash attention to be the one F.scaled_dot_product_attention "
                       "passes the kernel in torch"):
        model(input_ids=ids, attention_mask=_padding_mask("left"), labels=ids)


@pytest.mark.parametrize("keys", [32, 30, 17])
def test_memory_efficient_bias_is_aligned_with_the_same_values(keys):
    """F.sdpa's preprocessing for memory-efficient attention, run on CPU tensors: a boolean mask becomes an additive
    one, rows whose strides the kernel cannot load are padded and sliced back, and the bias is expanded over heads."""
    query, key = torch.randn(2, 4, 8, 16), torch.randn(2, 4, keys, 16)
    mask = torch.rand(2, 1, 8, keys, generator=torch.Generator().manual_seed(0)) > 0.3
    bias = attention_stash._EFFICIENT.prepare_mask(mask, query, key, key)
    assert bias.shape == (2, 4, 8, keys) and bias.dtype == torch.float32 and bias.stride(-1) == 1
    assert all(stride % 16 == 0 for stride in bias.stride()[:-1] if stride)
    expected = torch.zeros(2, 1, 8, keys).masked_fill(~mask, float("-inf")).expand(2, 4, 8, keys)
    assert torch.equal(bias, expected)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_built_in_the_layer_is_compared_in_every_row(install, kind):
    """A mask the layer builds in each pass (not held by the checkpoint, so digested by value), longer than one
    digest slice of 256 rows: a recompute whose mask differs only in a row of the first slice, where one blocked key
    moves to another column, is refused; a boolean mask and a float one (its -inf entries) alike. The same mask in
    both passes is served."""
    sequence = 300
    model = checkpointed(llama_model(max_position_embeddings=512))
    handle = install(model, 1)
    drift = []

    def build(module, args, kwargs):
        allowed = torch.ones(sequence, sequence, dtype=torch.bool).tril()
        if drift and drift.pop():
            # The recompute's row 10 blocks key 0 and attends to key 11 instead: as many keys, other columns.
            allowed[10, 0], allowed[10, 11] = False, True
        mask = allowed if kind == "bool" else torch.zeros(sequence, sequence).masked_fill(~allowed, float("-inf"))
        return args, {**kwargs, "attention_mask": mask.expand(2, 1, sequence, sequence)}

    model.model.layers[2].self_attn.register_forward_pre_hook(build, with_kwargs=True)
    ids = batch_ids(sequence=sequence)
    model(input_ids=ids, labels=ids).loss.backward()
    assert (handle.recomputes_served, handle.num_kept) == (1, 0)
    drift.extend([True, False])  # popped from the end: the forward's mask unchanged, the recompute's drifted
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of model.layers.2 to build the attention mask its forward built "
                       "inside the layer, got one with other values"):
        loss.backward()
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 1, 1)


def test_the_digest_weights_are_one_vector_per_device(monkeypatch):
    """Masks of many lengths (ALST's variable sequence length gathers position_ids of each batch's length) digest
    against one weight vector per device, as long as the most keys digested; extending it for a longer mask keeps its
    prefix, so a forward's digest still equals its recompute's when a longer mask was digested in between."""
    monkeypatch.setattr(attention_stash, "_DIGEST_WEIGHTS", {})
    masks = [torch.rand(2, 1, keys, keys, generator=torch.Generator().manual_seed(keys)) > 0.5 for keys in (17, 300)]
    before = attention_stash._mask_digest(masks[0])
    attention_stash._mask_digest(masks[1])
    after = attention_stash._mask_digest(masks[0])
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(before, after))
    for keys in range(1, 64):
        attention_stash._mask_digest(torch.ones(1, keys, dtype=torch.long))
    weights = attention_stash._DIGEST_WEIGHTS
    assert list(weights) == [torch.device("cpu")] and weights[torch.device("cpu")].shape == (300, )
