# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash on Hugging Face's attn_implementation="flash_attention_2" (flash-attn 2.8), on CPU and on meta.

flash-attn's Python layer runs here without its CUDA kernels. On CPU, attention_stash_flash.py stands in for its four
kernel ops with deterministic ones, so that Hugging Face's whole flash_attention_2 path runs with values: plain batches
(flash_attn_func), padded ones (unpadded to flash_attn_varlen_func) and packed ones (varlen, with the cu_seqlens a
padding-free collator passes or from position_ids). A stock step and a stashed one are compared bitwise, and the
kernel calls are counted: the stashed recompute runs no attention forward. On the meta device flash-attn's own fake
kernels run, through the decoder layers called directly, as in test_attention_stash_meta.py.
"""

import inspect
import sys
from collections import Counter

import pytest
import torch
import transformers

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError

from attention_stash_flash import (DOCUMENTS, PADDING, flash_attn_or_skip, make_batch, meta_of_a_batch, meta_step,
                                   real_2d, use_flash_attention_2)
from attention_stash_helpers import (QWEN3_NEXT_HYBRID, CountOps, assert_same_grads, assert_stock_process,
                                     checkpointed, counted_step, kept_outputs, live_checkpoint_calls, live_tensors,
                                     llama_model, logged_messages, mistral_model, param_grads, qwen3_moe_model,
                                     tensors)

FLASH_ATTN = flash_attn_or_skip()
# What the install line says the flash_attention_2 installs serve.
SOURCE = f"flash-attn 2's interface from flash_attn {sys.modules['flash_attn'].__version__}"

MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
DTYPE = torch.bfloat16


def _qwen3_next_model(dtype):
    """A hybrid: a gated-delta-net (linear attention) layer before each full-attention layer."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(vocab_size=128,
                                          hidden_size=64,
                                          intermediate_size=64,
                                          num_hidden_layers=4,
                                          num_attention_heads=4,
                                          num_key_value_heads=2,
                                          head_dim=16,
                                          max_position_embeddings=64,
                                          layer_types=["linear_attention", "full_attention"] * 2,
                                          attn_implementation="sdpa",
                                          **QWEN3_NEXT_HYBRID)
    return transformers.Qwen3NextForCausalLM(config).to(dtype)


def _two_calls(model):
    """Each attention module's forward runs twice per layer forward: two flash calls, kept and replayed in order."""
    for layer in model.model.layers:
        forward = layer.self_attn.forward

        def repeated(*args, forward=forward, **kwargs):
            outputs = [forward(*args, **kwargs) for _ in range(2)]
            return outputs[0][0] + outputs[1][0], outputs[0][1]

        layer.self_attn.forward = repeated
    return model


# name: (model, attention layers, attention calls per attention layer)
MODELS = {
    "llama": (lambda: llama_model(DTYPE), 3, 1),
    # 36 is not a multiple of 8: flash-attn pads it to 40, and the stash keeps the output so.
    "llama_head_dim_36": (lambda: llama_model(DTYPE, head_dim=36), 3, 1),
    "mistral_sliding_window": (lambda: mistral_model(DTYPE, sliding_window=8), 3, 1),
    "qwen3_moe": (lambda: qwen3_moe_model(DTYPE), 3, 1),
    "qwen3_next": (lambda: _qwen3_next_model(DTYPE), 2, 1),
    "llama_two_calls": (lambda: _two_calls(llama_model(DTYPE)), 3, 2),
}
BATCHES = ("plain", "padded", "packed_position_ids", "packed_cu_seq_lens")
# Llama on every batch kind (each reaches flash-attn another way: flash_attn_func, or flash_attn_varlen_func with
# cu_seqlens unpadded from the mask, derived from position_ids, or passed as the same tensors to both passes); each
# other model on a plain and a packed batch: what a model changes for the stash (the head dimension's padding, the
# window, layers without softmax attention, two calls per layer) reaches both functions alike (merged in issue 58).
STEP_CASES = [(name, kind) for name in MODELS
              for kind in (BATCHES if name == "llama" else ("plain", "packed_position_ids"))]


@pytest.fixture
def flash(monkeypatch):
    use_flash_attention_2(monkeypatch)


def flash_model(name, use_reentrant=True):
    make, _, _ = MODELS[name]
    if name == "qwen3_next" and not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3NextForCausalLM")
    model = make()
    # Hugging Face checks for flash-attn's CUDA build when loading with flash_attention_2; set on the built model.
    model.config._attn_implementation = "flash_attention_2"
    return checkpointed(model, use_reentrant=use_reentrant)


def flash_op(func):
    """flash-attn's kernel ops (flash_attn::*), by name, for CountOps; None for any other op."""
    namespace, _, name = func._schema.name.partition("::")
    return name if namespace == "flash_attn" else None


@MODES
@pytest.mark.parametrize("name, kind", STEP_CASES)
def test_a_flash_attention_2_step_is_stock(install, flash, name, kind, use_reentrant):
    """A stock step, then a stashed one on every attention layer: the same loss and gradients bitwise, the
    recompute's attention forwards skipped, every call served, the kept bytes the planner's, nothing left after."""
    model = flash_model(name, use_reentrant)
    _, layers, calls_per_layer = MODELS[name]
    calls = layers * calls_per_layer
    inputs, (batch, sequence) = make_batch(kind)
    before = tensors()
    varlen = "" if kind == "plain" else "varlen_"
    forward, backward = f"_flash_attn_{varlen}forward", f"_flash_attn_{varlen}backward"

    expected_loss, expected, stock_calls = counted_step(model, inputs, flash_op, whole_step=True)
    assert stock_calls == {forward: 2 * calls, backward: calls}
    handle = install(model, layers)
    loss, grads, stashed_calls = counted_step(model, inputs, flash_op, whole_step=True)
    assert stashed_calls == {forward: calls, backward: calls}
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (calls, 0, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)

    config = model.config
    # The planner counts one call per attention layer: the test's second call is its own.
    planned = attention_stash.attention_stash_layer_bytes(model, batch, sequence)
    padded_head_dim = config.head_dim + -config.head_dim % 8
    assert planned == batch * sequence * config.num_attention_heads * (padded_head_dim * 2 + 4)
    if kind == "padded":
        # The padding is unpadded away: the varlen kernel keeps the real tokens only.
        tokens = batch * sequence - PADDING
        assert handle.peak_kept_bytes == calls * config.num_attention_heads * tokens * (padded_head_dim * 2 + 4)
    else:
        assert handle.peak_kept_bytes == calls * planned
    del inputs, loss, expected_loss
    assert kept_outputs() == [] and live_checkpoint_calls() == []
    assert live_tensors(before, model, expected, grads, counted=real_2d) == []


@MODES
@pytest.mark.parametrize("kind", ["plain", "padded"])
def test_a_flash_step_under_autocast_is_stock(install, flash, kind, use_reentrant):
    """A float32 model under CPU autocast to bfloat16, around forward and backward: Hugging Face casts the queries,
    keys and values for flash-attn, and the stashed step is the stock one, bitwise."""
    model = checkpointed(llama_model(torch.float32), use_reentrant)
    model.config._attn_implementation = "flash_attention_2"
    inputs, _ = make_batch(kind)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected, _ = counted_step(model, inputs, flash_op, whole_step=True)
        handle = install(model, 3)
        loss, grads, calls = counted_step(model, inputs, flash_op, whole_step=True)
    assert calls[f"_flash_attn_{'' if kind == 'plain' else 'varlen_'}forward"] == 3
    assert (handle.recomputes_served, handle.num_kept) == (3, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


@MODES
def test_a_flash_model_installs_with_its_cost(install, flash, use_reentrant):
    """The install line counts flash-attn's layout, the head dimension padded to a multiple of 8; the planner too."""
    model = flash_model("llama_head_dim_36", use_reentrant)
    with logged_messages() as messages:
        install(model, 2, micro_batch_size=2, sequence_length=32)
    per_layer = 2 * 32 * 4 * (40 * 2 + 4)
    assert any(f"keeping the attention output of 2 of 3 attention layers (model.layers.1 to model.layers.2) for "
               f"their recompute: {2 * per_layer:,} bytes per micro-batch in flight" in message
               and message.endswith(f'; attn_implementation "flash_attention_2" ({SOURCE}).')
               for message in messages), messages
    assert attention_stash.attention_stash_layers_for_budget(model, 2 * per_layer, 2, 32) == 2


@MODES
def test_a_recompute_with_other_cu_seqlens_is_refused(install, flash, use_reentrant):
    """cu_seqlens a collator passes, changed in place between the forward and the backward: the recompute's flash
    call gets other document boundaries than the kept output's, and the stash names them."""
    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch("packed_cu_seq_lens")
    handle = install(model, 3)
    loss = model(**inputs).loss
    inputs["cu_seq_lens_q"][1] += 8
    with pytest.raises(
            AttentionStashError,
            match=r"needs the recompute of model\.layers\.2 to call flash-attn 2 \(flash_attn_varlen_func\) "
            r"with its forward's arguments, got another cu_seqlens_q \(changed in place\) \(attention call 1\): "
            r"the kept output is the forward's. Keep the batch's packing, padding, position_ids and cu_seq_lens"):
        loss.backward()
    del loss
    assert handle.num_kept == 0 and kept_outputs() == []


@MODES
def test_a_recompute_with_other_document_lengths_is_refused(install, flash, use_reentrant):
    """position_ids changed in place between the forward and the backward, so that Hugging Face would derive other
    document lengths in the recompute: the stash names the position_ids, which it compares before the flash-attn call
    (by identity and version, as the checkpoint holds them), and releases what the refused layer kept at once."""
    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch("packed_position_ids")
    handle = install(model, 3)
    loss = model(**inputs).loss
    inputs["position_ids"].copy_(torch.cat([torch.arange(32), torch.arange(32)]).unsqueeze(0))
    with pytest.raises(AttentionStashError,
                       match=r"needs the recompute of model\.layers\.2 to get its forward's position_ids, got another "
                       r"one \(another tensor, shape or version\): the kept output is the forward's\. Do not change a "
                       r"mask or position_ids in place"):
        loss.backward()
    assert (handle.num_kept, handle.released_without_backward) == (2, 1)


@MODES
def test_a_recompute_that_packs_a_batch_its_forward_did_not_is_refused(install, flash, monkeypatch, use_reentrant):
    """A forward that ran flash_attn_func and a recompute that runs flash_attn_varlen_func on the same inputs (Hugging
    Face's packing test answering otherwise in the recompute, which the stash's copy of its function follows): the
    kept output is the plain one, and the stash names both."""
    import transformers.modeling_flash_attention_utils as flash_utils

    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch("packed_position_ids")
    handle = install(model, 3)
    loss = model(**{**inputs, "position_ids": torch.arange(64).unsqueeze(0)}).loss
    monkeypatch.setattr(flash_utils, "_is_packed_sequence", lambda position_ids, batch_size: True)
    with pytest.raises(AttentionStashError,
                       match=r"needs one attention kernel for both passes of model\.layers\.2, got flash-attn 2 "
                       r"\(flash_attn_func\) in the forward and flash-attn 2 \(flash_attn_varlen_func\) in the "
                       r"recompute"):
        loss.backward()
    assert (handle.num_kept, handle.released_without_backward) == (2, 1)


@MODES
def test_a_recompute_with_other_flash_settings_is_refused(install, flash, monkeypatch, use_reentrant):
    """FLASH_ATTENTION_DETERMINISTIC switched between the forward and the backward: the recompute's call differs from
    the forward's in a setting, and the stash names it and the settings to keep."""
    model = flash_model("llama", use_reentrant)
    install(model, 3)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "0")
    loss = model(**make_batch("plain")[0]).loss
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    with pytest.raises(AttentionStashError,
                       match=r"call flash-attn 2 \(flash_attn_func\) with its forward's arguments, got another "
                       r"deterministic \(attention call 1\): the kept output is the forward's\. Keep flash-attn's "
                       r"settings \(FLASH_ATTENTION_DETERMINISTIC"):
        loss.backward()


def test_attention_dropout_is_refused(install, flash):
    model = flash_model("llama")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    install(model, 3)
    with pytest.raises(AttentionStashError, match=r"needs attention dropout 0 in model\.layers\.0, got 0\.1"):
        model(**make_batch("plain")[0])


@pytest.mark.parametrize("requires_grad", [True, False], ids=["learned", "constant"])
def test_a_softcap_tensor_is_refused(install, flash, requires_grad):
    """A softcap passed as a tensor (through the model's keyword arguments, which reach flash_attention_forward),
    learned or not: flash-attn's kernels take a number."""
    model = flash_model("llama")
    install(model, 1)
    softcap = torch.tensor(20.0, requires_grad=requires_grad)
    learned = " that requires grad \\(a learned softcap\\)" if requires_grad else ""
    with pytest.raises(AttentionStashError,
                       match=f"needs a softcap that is a number in model\\.layers\\.2, got a tensor{learned}"):
        model(**make_batch("plain")[0], softcap=softcap)


def _interface():
    """The flash interface the latest flash_attention_2 install found."""
    return attention_stash._FLASH_INTERFACES["flash_attention_2"]


def _call_of_a_stashed_layer(install):
    """A checkpoint call of a stashed flash layer, in its first pass, for the guards Hugging Face's path never
    reaches."""
    model = flash_model("llama")
    handle = install(model, 1)
    call = attention_stash._CheckpointCall(handle._stashes[0], None)
    call.passes, call.kept = 1, []
    return call


@pytest.mark.parametrize("argument,message", [
    (lambda: dict(alibi_slopes=torch.ones(4, requires_grad=True)), r"needs ALiBi slopes that do not require grad"),
    (lambda: dict(return_attn_probs=True), r"got return_attn_probs=True"),
    (lambda: dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), r"got block_table=tensor"),
    (lambda: dict(dropout_p=0.5), r"needs attention dropout 0"),
],
                         ids=["learned_alibi", "return_attn_probs", "block_table", "dropout"])
def test_flash_arguments_the_replay_cannot_reproduce_are_refused(install, flash, argument, message):
    call = _call_of_a_stashed_layer(install)
    query = torch.randn(1, 8, 4, 16, dtype=DTYPE)
    arguments = dict(dropout_p=0.0,
                     softmax_scale=None,
                     causal=True,
                     window_size=(-1, -1),
                     softcap=0.0,
                     alibi_slopes=None,
                     deterministic=False,
                     return_attn_probs=False,
                     block_table=None)
    with pytest.raises(AttentionStashError, match=message):
        call.flash(_interface(), query, query, query, attention_stash._FlashArguments(**{**arguments, **argument()}))
    assert call.kept == []


def test_alibi_slopes_that_need_no_grad_are_served(install, flash):
    """ALiBi slopes as a constant: kept with the call's arguments, and passed to the backward as flash-attn does."""
    call = _call_of_a_stashed_layer(install)
    query = torch.randn(1, 8, 4, 16, dtype=DTYPE)
    slopes = torch.ones(4)
    with pytest.raises(NotImplementedError, match="has no ALiBi slopes"):
        # The CPU stand-in kernels have no ALiBi: the stash got as far as the kernel call.
        call.flash(_interface(), query, query, query, attention_stash._FlashArguments(causal=True,
                                                                                      alibi_slopes=slopes))


def test_other_flash_functions_are_refused(install, flash, monkeypatch):
    """Where Hugging Face's lazy import hands out other flash functions than flash-attn 2's (a hub kernel, an NPU
    build, flash-attn 3), the stash names them."""
    import transformers.modeling_flash_attention_utils as flash_utils

    def other_flash_attn_func(*args, **kwargs):
        return FLASH_ATTN.flash_attn_func(*args, **kwargs)

    lazy_imports = flash_utils._lazy_imports

    def other_lazy_imports(*args, **kwargs):
        return (other_flash_attn_func, *lazy_imports(*args, **kwargs)[1:])

    model = flash_model("llama")
    install(model, 1)
    # After the install, which found flash-attn 2's: Hugging Face's next lazy import hands out the other one.
    monkeypatch.setattr(flash_utils, "_lazy_imports", other_lazy_imports)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    with pytest.raises(AttentionStashError,
                       match=r"needs Hugging Face's flash_attention_2 to call flash-attn 2's flash_attn_func and "
                       r"flash_attn_varlen_func, whose kernels it replays, as the install found them \(flash-attn 2's "
                       r"interface from flash_attn 2\.8\.3\), got <function .*other_flash_attn_func"):
        model(**make_batch("plain")[0])


def test_an_install_without_flash_attn_is_refused(flash, monkeypatch):
    model = flash_model("llama")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(AttentionStashError,
                       match=r'needs flash-attn 2 \(the flash_attn package\) for attn_implementation='
                       r'"flash_attention_2", got an import error: .*Install flash-attn 2, or load the model with '
                       r'attn_implementation="sdpa"'):
        attention_stash.install_attention_stash(model, 1)
    assert attention_stash._held is None


@pytest.mark.parametrize("change", ["missing", "reordered"])
def test_a_flash_attn_without_flash_attn_2_8s_kernel_functions_is_refused(flash, monkeypatch, change):
    """A flash-attn build without a kernel function the stash calls, or whose kernel function has flash-attn 2.8's
    parameter names in another order (another build, whose autograd functions the stash has not been checked against,
    though it passes every argument by name): refused at the install, naming what differs."""
    model = flash_model("llama")
    if change == "missing":
        monkeypatch.delattr(FLASH_ATTN, "_wrapped_flash_attn_varlen_backward")
        found = "without _wrapped_flash_attn_varlen_backward"
    else:
        names = attention_stash._FLASH_FAMILIES[0].signatures[0].split()
        reordered = [names[1], names[0], *names[2:]]

        def reordered_forward(*args, **kwargs):
            raise AssertionError("not called")

        reordered_forward.__signature__ = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in reordered])
        monkeypatch.setattr(FLASH_ATTN, "_wrapped_flash_attn_forward", reordered_forward)
        found = rf"_wrapped_flash_attn_forward\({', '.join(reordered)}\)"
    with pytest.raises(AttentionStashError,
                       match=r"needs flash-attn 2's interface as flash-attn 2\.8 has it for attn_implementation="
                       r"\"flash_attention_2\", got flash_attn 2\.8\.3 \(flash_attn\.flash_attn_interface\) " + found +
                       r"\. Install flash-attn 2\.8"):
        attention_stash.install_attention_stash(model, 1)
    assert attention_stash._held is None


def test_a_flash_entry_the_stash_cannot_serve_leaves_nothing_installed(flash, monkeypatch):
    """A "flash_attention_2" entry that is not Hugging Face's function, in a model whose vision layers run sdpa and
    whose text layers flash-attn: the install takes its hold on the sdpa entry first, and gives it back when the flash
    one is refused."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def other_flash_attention(module, query, key, value, attention_mask, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "flash_attention_2", other_flash_attention)
    model = _llava_model(use_reentrant=True)
    layers = len(attention_stash._model_plans(model, *attention_stash._entry_points())[0])
    with pytest.raises(AttentionStashError,
                       match=r"needs Hugging Face's flash_attention_2 attention function, which calls flash-attn "
                       r"through transformers\.modeling_flash_attention_utils\._flash_attention_forward, as "
                       r"ALL_ATTENTION_FUNCTIONS\[\"flash_attention_2\"\], got <function .*other_flash_attention"):
        attention_stash.install_attention_stash(model, layers)
    assert attention_stash._held is None and not attention_stash._STASHES
    monkeypatch.undo()
    assert_stock_process()


def test_a_stashed_layer_reaching_another_implementation_s_entry_is_refused(install, flash):
    """An sdpa model switched to flash_attention_2 after its install while a flash model's stash holds that entry:
    its stashed layer reaches the flash entry, which names the implementation the layer was installed with."""
    sdpa_model = checkpointed(llama_model(DTYPE))
    install(sdpa_model, 1)
    install(flash_model("llama"), 1)
    sdpa_model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(AttentionStashError,
                       match=r'needs model\.layers\.2 to call attention with attn_implementation="sdpa", as at the '
                       r'install, in each forward, got a forward with "flash_attention_2"'):
        sdpa_model(**make_batch("plain")[0])


def test_switching_a_flash_model_to_sdpa_after_the_install_is_refused(install, flash):
    model = flash_model("llama")
    install(model, 1)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(AttentionStashError,
                       match=r'needs model\.layers\.2 to call attention with attn_implementation="flash_attention_2", '
                       r'as at the install, in each forward, got a forward with "sdpa"'):
        model(**make_batch("plain")[0])


def test_an_sdpa_and_a_flash_model_are_served_side_by_side(install, flash):
    """One process, two models, two implementations: each model's stash serves its own entry, and both entries go
    back to transformers' own when both stashes are removed (the install fixture checks)."""
    sdpa_model = checkpointed(llama_model(DTYPE))
    model = flash_model("llama")
    inputs, _ = make_batch("plain")
    for one in (sdpa_model, model):
        one.zero_grad(set_to_none=True)
    expected = [one(**inputs).loss for one in (sdpa_model, model)]
    for loss in expected:
        loss.backward()
    expected_grads = [param_grads(one) for one in (sdpa_model, model)]
    handles = [install(one, 3) for one in (sdpa_model, model)]
    for one, handle, loss, grads in zip((sdpa_model, model), handles, expected, expected_grads):
        one.zero_grad(set_to_none=True)
        stashed = one(**inputs).loss
        stashed.backward()
        assert torch.equal(stashed, loss) and handle.recomputes_served == 3
        assert_same_grads(param_grads(one), grads)
    assert set(attention_stash._held.entries) == {"sdpa", "flash_attention_2"}


# ---------------------------------------------------------------------------------------------------------------------
# On the meta device, through flash-attn's own fake kernels.
# ---------------------------------------------------------------------------------------------------------------------


def _meta_model(name, use_reentrant):
    with torch.device("meta"):
        model = flash_model(name, use_reentrant)
    return model


@MODES
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
# Qwen3-MoE's attention is Llama's for the stash (merged in issue 58).
@pytest.mark.parametrize("name", [name for name in MODELS if name != "qwen3_moe"])
def test_a_flash_step_on_meta(install, flash, name, packed, use_reentrant):
    """The decoder layers on meta tensors in bfloat16, called as the model calls them (Hugging Face's mask and
    packing code reads values, which meta tensors do not have: a packed batch passes its cu_seqlens, as a
    padding-free collator does). flash-attn's fake kernels run forward and backward; every call is served, the kept
    bytes are the planner's, every parameter gets a gradient of its shape and dtype, and nothing is left after."""
    if name == "qwen3_next" and packed:
        pytest.skip("Qwen3-Next's linear attention needs flash-linear-attention for cu_seqlens")
    model = _meta_model(name, use_reentrant)
    _, layers, calls_per_layer = MODELS[name]
    calls = layers * calls_per_layer
    handle = install(model, layers)
    counter = meta_step(model, handle, packed, CountOps(flash_op), calls)
    infix = "varlen_" if packed else ""
    assert counter.calls == {f"_flash_attn_{infix}forward": calls, f"_flash_attn_{infix}backward": calls}
    assert live_tensors(model=model, counted=meta_of_a_batch) == [] and live_checkpoint_calls() == []


def test_the_meta_layout_is_flash_attns(flash):
    """What the stash's node keeps of a flash-attn call (the padded output, the log-sum-exp, rng_state) is what
    flash-attn 2.8's fake kernels return, in layout and dtype, and what the planner counts."""
    query = torch.empty(2, 72, 4, 40, device="meta", dtype=DTYPE)
    key = torch.empty(2, 72, 2, 40, device="meta", dtype=DTYPE)
    ops = attention_stash._load_flash(attention_stash._implementation("flash_attention_2")).ops
    output, (lse, rng_state), scalars = ops.kernel(query, key, key, None,
                                                   attention_stash._FlashArguments(0.0, 36**-0.5))
    assert output.shape == (2, 72, 4, 40) and scalars == ()
    assert (lse.shape, lse.dtype, rng_state.shape, rng_state.dtype) == ((2, 4, 72), torch.float32, (2, ), torch.int64)
    assert output.nbytes + lse.nbytes == ops.kept_bytes(2, 4, 72, 36, DTYPE)


def _llava_model(use_reentrant):
    """A tiny Llava whose text config says "flash_attention_2" and whose top and vision configs say "sdpa", as
    from_pretrained(attn_implementation={"text_config": "flash_attention_2", "vision_config": "sdpa"}) leaves them
    but for the top one."""
    torch.manual_seed(0)
    text = transformers.LlamaConfig(vocab_size=160,
                                    hidden_size=64,
                                    intermediate_size=64,
                                    num_hidden_layers=3,
                                    num_attention_heads=4,
                                    num_key_value_heads=2,
                                    max_position_embeddings=128)
    vision = transformers.CLIPVisionConfig(hidden_size=32,
                                           intermediate_size=32,
                                           num_hidden_layers=2,
                                           num_attention_heads=2,
                                           image_size=16,
                                           patch_size=8,
                                           projection_dim=32)
    config = transformers.LlavaConfig(text_config=text,
                                      vision_config=vision,
                                      image_token_id=150,
                                      vision_feature_layer=-1,
                                      attn_implementation="sdpa")
    model = transformers.LlavaForConditionalGeneration(config).to(DTYPE)
    model.config.text_config._attn_implementation = "flash_attention_2"
    return checkpointed(model, use_reentrant)


@MODES
def test_each_layer_is_served_with_its_own_config_s_implementation(install, flash, use_reentrant):
    """A multimodal model whose text layers run flash-attn and whose vision layers run sdpa: each stashed layer is
    served through the implementation its attention modules' config names, both at once, bitwise."""
    model = _llava_model(use_reentrant)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    ids[:, 1:5] = 150
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2)).to(DTYPE)
    inputs = dict(input_ids=ids, pixel_values=pixels, labels=ids.masked_fill(ids == 150, -100))
    expected_loss, expected, stock_calls = counted_step(model, inputs, flash_op, whole_step=True)
    layers = len(attention_stash._model_plans(model, *attention_stash._entry_points())[0])
    with logged_messages() as messages:
        handle = install(model, layers)
    implementations = Counter((stash.name.split(".")[1], stash.implementation) for stash in handle._stashes)
    assert implementations == {("vision_tower", "sdpa"): 2, ("language_model", "flash_attention_2"): 3}
    assert messages[-1].endswith(f'; attn_implementation "sdpa" and "flash_attention_2" ({SOURCE}).'), messages
    loss, grads, calls = counted_step(model, inputs, flash_op, whole_step=True)
    assert stock_calls["_flash_attn_forward"] == 6 and calls["_flash_attn_forward"] == 3
    assert (handle.recomputes_served, handle.num_kept) == (layers, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


# ---------------------------------------------------------------------------------------------------------------------
# A recompute whose flash-attn call would differ from its forward's: each difference refused, what was kept released
# at once (while the caller still holds the loss, and with it the graph).
# ---------------------------------------------------------------------------------------------------------------------


def _assert_released_at_once(handle, layers=1):
    assert (handle.num_kept, handle.kept_bytes, handle.recomputes_served,
            handle.released_without_backward) == (0, 0, 0, layers)


@MODES
@pytest.mark.parametrize("change", ["moved", "lengths"])
def test_a_padding_mask_changed_in_place_is_refused(install, flash, change, use_reentrant):
    """A right-padded batch, unpadded to flash_attn_varlen_func, whose mask is changed in place between the forward
    and the backward. "moved": each row keeps its number of tokens, at other positions (the padding moved to the
    row's start): the recompute's cu_seqlens equal the forward's, but Hugging Face would pad the kept output back at
    the new positions. "lengths": a row loses tokens. Both are refused, naming the padding mask."""
    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch("plain")
    # A boolean mask reaches the layers as it is (Hugging Face converts an integer one to a new boolean tensor).
    mask = torch.ones_like(inputs["input_ids"], dtype=torch.bool)
    mask[1, -PADDING:] = False
    handle = install(model, 1)
    before = tensors()
    loss = model(**inputs, attention_mask=mask).loss
    if change == "moved":
        mask[1].copy_(mask[1].roll(PADDING))
    else:
        mask[0, -PADDING:] = False
    with pytest.raises(AttentionStashError,
                       match=r"needs the recompute of model\.layers\.2 to get its forward's padding mask, got another "
                       r"one \(another tensor, shape or version\): the kept output is the forward's\. Do not change a "
                       r"mask or position_ids in place between a forward and its backward"):
        loss.backward()
    _assert_released_at_once(handle)
    del loss
    assert kept_outputs() == [] and live_checkpoint_calls() == []
    # Nothing of the refused step is left alive: no kept output, no activation, no gradient.
    assert live_tensors(before, model, counted=real_2d) == []


@MODES
def test_an_unchanged_right_padded_batch_is_served(install, flash, use_reentrant):
    """The same right-padded batch, unchanged: served bitwise, the mask compared without a value read."""
    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch("plain")
    mask = torch.ones_like(inputs["input_ids"])
    mask[1, -PADDING:] = 0
    inputs.update(attention_mask=mask, labels=inputs["labels"].masked_fill(mask == 0, -100))
    expected_loss, expected, _ = counted_step(model, inputs, flash_op, whole_step=True)
    handle = install(model, 3)
    loss, grads, calls = counted_step(model, inputs, flash_op, whole_step=True)
    assert calls == {"_flash_attn_varlen_forward": 3, "_flash_attn_varlen_backward": 3}
    assert (handle.recomputes_served, handle.num_kept, handle.released_without_backward) == (3, 0, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def _position_ids_within_a_document(inputs, monkeypatch):
    # Hugging Face derives the same cu_seqlens and maximum lengths: the flash-attn call's arguments agree, but the
    # recompute would rotate its queries and keys by other positions than the kept output's.
    inputs["position_ids"][0, DOCUMENTS[0] + 3] += 1


def _repacked_documents(inputs, monkeypatch):
    # cu_seqlens of the forward's shape and maximum, other boundaries (documents 24+40 packed as 40+24), derived anew
    # in the recompute and so compared by value. The stash's copy of Hugging Face's function follows the patch.
    import transformers.modeling_flash_attention_utils as flash_utils

    prepare = flash_utils._prepare_from_posids

    def repacked(*args, **kwargs):
        query, key, value, (cu_seqlens, _), max_lengths = prepare(*args, **kwargs)
        cu_seqlens = torch.tensor([0, DOCUMENTS[1], sum(DOCUMENTS)], dtype=cu_seqlens.dtype)
        return query, key, value, (cu_seqlens, cu_seqlens), max_lengths

    monkeypatch.setattr(flash_utils, "_prepare_from_posids", repacked)


def _collator_s_cu_seqlens_k(inputs, monkeypatch):
    inputs["cu_seq_lens_k"][1] += 8


@MODES
@pytest.mark.parametrize("kind,change,message", [
    ("packed_position_ids", _position_ids_within_a_document,
     r"needs the recompute of model\.layers\.2 to get its forward's position_ids, got another one \(another tensor, "
     r"shape or version\)"),
    ("packed_position_ids", _repacked_documents,
     r"call flash-attn 2 \(flash_attn_varlen_func\) with its forward's arguments, got another cu_seqlens_q "
     r"\(attention call 1\)"),
    ("packed_cu_seq_lens", _collator_s_cu_seqlens_k, r"got another cu_seqlens_k \(changed in place\) \(attention "
     r"call 1\)"),
],
                         ids=["position_ids_within_a_document", "repacked_documents", "cu_seqlens_k_in_place"])
def test_a_packed_batch_changed_between_the_passes_is_refused(install, flash, monkeypatch, kind, change, message,
                                                              use_reentrant):
    """A packed batch changed between the forward and the backward where the compared arguments could agree: each
    refused by name, what was kept released at once."""
    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch(kind)
    handle = install(model, 1)
    loss = model(**inputs).loss
    change(inputs, monkeypatch)
    with pytest.raises(AttentionStashError, match=message):
        loss.backward()
    _assert_released_at_once(handle)


@MODES
def test_max_lengths_as_tensors_are_compared_by_value(install, flash, monkeypatch, use_reentrant):
    """Hugging Face's packing from position_ids passes the maximum lengths as 0-dimensional tensors, new in each pass:
    equal ones are served, bitwise; another one is refused, naming it."""
    import transformers.modeling_flash_attention_utils as flash_utils

    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch("packed_position_ids")
    seen = []
    prepare = flash_utils._prepare_from_posids

    def recording(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        seen.append(prepared[-1])
        return prepared

    monkeypatch.setattr(flash_utils, "_prepare_from_posids", recording)
    expected_loss, expected, _ = counted_step(model, inputs, flash_op, whole_step=True)
    assert all(isinstance(length, torch.Tensor) and length.dim() == 0 for lengths in seen for length in lengths)
    handle = install(model, 3)
    loss, grads, _ = counted_step(model, inputs, flash_op, whole_step=True)
    assert handle.recomputes_served == 3 and torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)

    loss = model(**inputs).loss

    def longer(*args, **kwargs):
        query, key, value, cu_seqlens, (max_length, _) = prepare(*args, **kwargs)
        return query, key, value, cu_seqlens, (max_length + 1, max_length + 1)

    monkeypatch.setattr(flash_utils, "_prepare_from_posids", longer)
    with pytest.raises(AttentionStashError, match=r"got another max_seqlen_q \(attention call 1\)"):
        loss.backward()
    # The last layer's recompute was refused and released its output; the others' go with the graph.
    assert (handle.num_kept, handle.released_without_backward) == (2, 1)


def _gemma2_model(use_reentrant):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=128,
                                       hidden_size=64,
                                       intermediate_size=64,
                                       num_hidden_layers=2,
                                       num_attention_heads=4,
                                       num_key_value_heads=2,
                                       head_dim=16,
                                       max_position_embeddings=64,
                                       sliding_window=8,
                                       attn_logit_softcapping=30.0,
                                       attn_implementation="eager")
    model = transformers.Gemma2ForCausalLM(config).to(DTYPE)
    model.config._attn_implementation = "flash_attention_2"
    return checkpointed(model, use_reentrant)


def _other_window(model):
    # Gemma2's sliding layers (the even ones) read their window at construction.
    model.model.layers[0].self_attn.sliding_window = 4


def _other_softcap(model):
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 20.0


def _other_scale(model):
    for layer in model.model.layers:
        layer.self_attn.scaling *= 2


@MODES
@pytest.mark.parametrize("change,setting", [(_other_window, "window_size"), (_other_softcap, "softcap"),
                                            (_other_scale, "softmax_scale")],
                         ids=["window", "softcap", "scale"])
def test_a_recompute_with_another_flash_setting_is_refused(install, flash, change, setting, use_reentrant):
    """A Gemma2 (a sliding layer, then a global one, both softcapped) whose window, softcap or scale changes between
    the forward and the backward: each is refused by name, the refused call's kept output goes at once, the other
    layer's with the graph. The unchanged step is served bitwise."""
    model = _gemma2_model(use_reentrant)
    inputs, _ = make_batch("plain")
    expected_loss, expected, _ = counted_step(model, inputs, flash_op, whole_step=True)
    handle = install(model, 2)
    loss, grads, calls = counted_step(model, inputs, flash_op, whole_step=True)
    assert calls["_flash_attn_forward"] == 2 and handle.recomputes_served == 2
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    loss = model(**inputs).loss
    change(model)
    with pytest.raises(AttentionStashError,
                       match=f"with its forward's arguments, got another {setting} \\(attention call 1\\): the kept "
                       f"output is the forward's\\. Keep flash-attn's settings"):
        loss.backward()
    # The window is the first layer's, whose recompute comes last: the second layer's was served before.
    window = change is _other_window
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (1 - window, 2 + window, 1)
    del loss
    assert (handle.num_kept, handle.kept_bytes, handle.released_without_backward) == (0, 0, 2 - window)


def test_trained_keys_and_values_beside_a_frozen_query_projection(install, flash):
    """Only the key and value projections train (LoRA on k/v alone), on input embeddings that need no grad (a frozen
    encoder's, which Hugging Face's hook for input grads does not reach): under non-reentrant checkpointing, whose
    first pass runs with grad, the first layer's queries need no grad while its keys and values do. Served bitwise,
    the first layer's keys and values trained through the stash's node, the recompute's attention forwards skipped."""
    model = flash_model("llama", use_reentrant=False)
    for name, param in model.named_parameters():
        param.requires_grad_(".k_proj." in name or ".v_proj." in name)
    inputs, _ = make_batch("plain")
    inputs["inputs_embeds"] = model.model.embed_tokens(inputs.pop("input_ids")).detach()
    queries = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *args: queries.append(args[-1].requires_grad))
    expected_loss, expected, _ = counted_step(model, inputs, flash_op, whole_step=True)
    assert set(queries) == {False} and "model.layers.0.self_attn.k_proj.weight" in expected
    handle = install(model, 3)
    loss, grads, calls = counted_step(model, inputs, flash_op, whole_step=True)
    assert calls["_flash_attn_forward"] == 3
    assert (handle.recomputes_served, handle.num_kept) == (3, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


@MODES
@pytest.mark.parametrize("change", ["dropped", "added"])
def test_a_padding_mask_dropped_or_added_in_the_recompute_is_refused(install, flash, change, use_reentrant):
    """A padded batch whose layer gets no position_ids (a model that passes none to its attention): the forward's
    padding mask dropped in the recompute, or a mask the forward did not get added there, is refused by name, before
    the recompute calls flash-attn."""
    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch("padded")
    # Popped from the end: the forward's first. Each keeps or drops the layer's padding mask.
    masks = []

    def hook(module, args, kwargs):
        mask = kwargs["attention_mask"] if masks.pop() else None
        return args, {**kwargs, "attention_mask": mask, "position_ids": None}

    model.model.layers[2].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    handle = install(model, 1)
    masks.extend([True, True])
    model(**inputs).loss.backward()
    assert (handle.recomputes_served, handle.num_kept) == (1, 0)
    masks.extend([False, True] if change == "dropped" else [True, False])
    loss = model(**inputs).loss
    with pytest.raises(AttentionStashError,
                       match=r"needs the recompute of model\.layers\.2 to get its forward's padding mask, got a "
                       r"change from or to none: the kept output is the forward's"):
        loss.backward()
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 1, 1)


@MODES
def test_cu_seqlens_of_other_versions_are_each_compared_with_their_own(install, flash, use_reentrant):
    """A collator's cu_seq_lens_q and cu_seq_lens_k, two tensors whose version counters differ at the forward (one was
    written in place before it): unchanged, the step is served; either one changed in place alone after the forward is
    named."""
    model = flash_model("llama", use_reentrant)
    inputs, _ = make_batch("packed_cu_seq_lens")
    inputs["cu_seq_lens_q"].add_(0)
    assert (inputs["cu_seq_lens_q"]._version, inputs["cu_seq_lens_k"]._version) == (1, 0)
    expected_loss, expected, _ = counted_step(model, inputs, flash_op, whole_step=True)
    handle = install(model, 3)
    loss, grads, _ = counted_step(model, inputs, flash_op, whole_step=True)
    assert (handle.recomputes_served, handle.num_kept) == (3, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    for name in ("cu_seqlens_k", "cu_seqlens_q"):
        loss = model(**inputs).loss
        inputs[name.replace("seqlens", "seq_lens")].add_(0)
        with pytest.raises(AttentionStashError,
                           match=f"got another {name} \\(changed in place\\) \\(attention call 1\\)"):
            loss.backward()
        del loss
    assert (handle.num_kept, handle.recomputes_served) == (0, 3)


def test_a_flash_call_under_a_torch_func_transform_is_refused(install, flash):
    call = _call_of_a_stashed_layer(install)
    query = torch.randn(1, 8, 4, 16, dtype=DTYPE)
    with pytest.raises(AttentionStashError,
                       match=r"needs the training forwards of model\.layers\.2 to run under autograd "
                       r"alone, got a torch\.func transform"):
        torch.func.grad(lambda query: call.flash(_interface(), query, query, query,
                                                 attention_stash._FlashArguments(causal=True)).float().sum())(query)
    assert call.kept == []


def test_other_alibi_slopes_in_the_recompute_are_named():
    """ALiBi slopes are compared by identity: the ones the forward passed, or the recompute differs by them."""
    slopes = torch.ones(4)

    def arguments(alibi_slopes):
        return attention_stash._FlashArguments(0.0, 0.25, True, (-1, -1), 0.0, alibi_slopes, False, None, None, None,
                                               None)

    assert arguments(slopes).differing(arguments(slopes)) is None
    assert arguments(slopes).differing(arguments(slopes.clone())) == "alibi_slopes"
