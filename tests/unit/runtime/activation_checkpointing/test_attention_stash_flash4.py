# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash on attn_implementation="flash_attention_4" (flash-attn 4, ``flash_attn.cute`` from the flash-attn-4
pre-releases), on CPU through attention_stash_flash4's test double of its interface, and on CUDA where the real one
imports.

flash-attn 4's autograd functions call two Python functions, ``_flash_attn_fwd`` and ``_flash_attn_bwd``, whose
parameters change from one beta to the next: the stash has a record per set of betas with the same ones (4.0.0b19 to
b40, the newest), and the double builds each record's representative release. A stock step and a stashed one are
compared bitwise, and the double's kernel runs counted (its ``calls``).
"""

import contextlib
import functools
import re
from collections import Counter

import pytest
import torch

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError

from attention_stash_flash4 import FLASH4_RELEASES, RECORD_OF, use_flash_attn_4
from attention_stash_helpers import (assert_same_grads, assert_stock_process, bound_arguments, checkpointed,
                                     gemma2_model, gpt_oss_model, kept_outputs, live_checkpoint_calls, live_tensors,
                                     llama_model, logged_messages, mistral_model, param_grads, qwen3_moe_model,
                                     same_value, tensors)
from attention_stash_flash import PADDING, make_batch, meta_of_a_batch, meta_step, real_2d

DTYPE = torch.bfloat16
IMPLEMENTATION = "flash_attention_4"
NEWEST = FLASH4_RELEASES[-1]
MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
# Gemma 2's attention logit cap, small enough that the tiny model's scores bend under it.
SOFTCAP = 1.0
# name: (model, attention layers). gpt-oss: a sliding-window layer and a full one, with learnable sinks that train or
# are frozen (as LoRA leaves them); the integration casts them to the query's dtype.
MODELS = {
    "llama":
    lambda use_reentrant: checkpointed(llama_model(DTYPE), use_reentrant),
    "qwen3_moe":
    lambda use_reentrant: checkpointed(qwen3_moe_model(DTYPE), use_reentrant),
    "mistral_sliding_window":
    lambda use_reentrant: checkpointed(mistral_model(DTYPE, sliding_window=8), use_reentrant),
    "gemma2_softcap":
    lambda use_reentrant: checkpointed(gemma2_model(DTYPE, attn_logit_softcapping=SOFTCAP), use_reentrant),
    "gpt_oss_trained_sinks":
    lambda use_reentrant: checkpointed(gpt_oss_model(DTYPE), use_reentrant),
    "gpt_oss_frozen_sinks":
    lambda use_reentrant: checkpointed(gpt_oss_model(DTYPE, frozen_sinks=True), use_reentrant),
}
LAYERS = {"gpt_oss_trained_sinks": 2, "gpt_oss_frozen_sinks": 2}
BATCHES = ("plain", "padded", "packed_position_ids", "packed_cu_seq_lens")
# The newest release: Llama on every batch kind, the other families on a plain and a packed batch; each record's
# representative: Llama on a plain and a packed batch, and gpt-oss's sinks, which train from 4.0.0b26.
STEP_CASES = ([(NEWEST, "llama", kind) for kind in BATCHES] + [(NEWEST, name, kind) for name in list(MODELS)[1:]
                                                               for kind in ("plain", "packed_position_ids")] +
              [(release, name, kind) for release in FLASH4_RELEASES[:-1] for name in ("llama", "gpt_oss_frozen_sinks")
               for kind in ("plain", "packed_position_ids")] + [(release, "gpt_oss_trained_sinks", "plain")
                                                                for release in FLASH4_RELEASES[2:-1]])


def flash4_model(name, use_reentrant=True):
    model = MODELS[name](use_reentrant)
    # Hugging Face checks for CUDA when loading with flash_attention_4; set on the built model.
    model.config._attn_implementation = IMPLEMENTATION
    return model


def step(model, inputs, interface):
    """A training step: its loss, the parameters' gradients, and the double's kernel runs in it."""
    model.zero_grad(set_to_none=True)
    interface.calls.clear()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), param_grads(model), dict(interface.calls)


def kernel_names(kind):
    varlen = "" if kind == "plain" else "varlen_"
    return f"{varlen}fwd", f"{varlen}bwd"


def source(release):
    """The install line's words for the double at ``release``: the flash-attn-4 distribution first, then any other
    whose files hold flash_attn/cute/interface.py too (flash-attn 2.8.3's wheel ships that file)."""
    return f'attn_implementation "{IMPLEMENTATION}" (flash-attn 4\'s interface from flash_attn flash-attn-4 {release}'


@MODES
@pytest.mark.parametrize("release, name, kind", STEP_CASES)
def test_a_step_is_stock(install, monkeypatch, release, name, kind, use_reentrant):
    """A stock step, then a stashed one on every attention layer: the same loss and gradients bitwise (the sinks'
    included, where they train), the recompute's attention forwards skipped, every call served, the kept bytes the
    planner's, nothing left after."""
    interface = use_flash_attn_4(monkeypatch, release)
    model = flash4_model(name, use_reentrant)
    layers = LAYERS.get(name, 3)
    inputs, (batch, sequence) = make_batch(kind)
    forward, backward = kernel_names(kind)
    before = tensors()

    expected_loss, expected, stock_calls = step(model, inputs, interface)
    assert stock_calls == {forward: 2 * layers, backward: layers}
    with logged_messages() as messages:
        handle = install(model, layers)
    assert source(release) in messages[-1], messages
    loss, grads, calls = step(model, inputs, interface)
    assert calls == {forward: layers, backward: layers}
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (layers, 0, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    sinks = [name for name in grads if name.endswith("sinks")]
    assert len(sinks) == (layers if name == "gpt_oss_trained_sinks" else 0)
    assert all(grads[name].abs().sum() > 0 for name in sinks)

    config = model.config
    planned = attention_stash.attention_stash_layer_bytes(model, batch, sequence)
    assert planned == batch * sequence * config.num_attention_heads * (config.head_dim * 2 + 4)
    # A padded batch is unpadded: the varlen kernel keeps its real tokens only.
    tokens = batch * sequence - (PADDING if kind == "padded" else 0)
    assert handle.peak_kept_bytes == layers * config.num_attention_heads * tokens * (config.head_dim * 2 + 4)
    del inputs, loss, expected_loss
    assert kept_outputs() == [] and live_checkpoint_calls() == []
    assert live_tensors(before, model, expected, grads, counted=real_2d) == []


@pytest.mark.parametrize("release", sorted(RECORD_OF, key=lambda release: int(release.rpartition("b")[2])))
def test_each_release_read_is_served_by_its_record(install, monkeypatch, release):
    """Every beta read, b19 to b36, b39 and b40 (b37 and b38 are not on the package index), installs with the record
    whose kernel functions' parameters are its own, named on the install line, and serves a step."""
    interface = use_flash_attn_4(monkeypatch, release)
    model = flash4_model("llama")
    handle = install(model, 3)
    family = attention_stash._FLASH_INTERFACES[IMPLEMENTATION].family
    beta = int(release.rpartition("b")[2])
    first, _, last = family.release.removeprefix("flash-attn-4 ").partition(" to ")
    assert int(first.rpartition("b")[2]) <= beta <= int((last or first).rpartition("b")[2])
    for function in ("_flash_attn_fwd", "_flash_attn_bwd"):
        assert attention_stash._parameters(getattr(
            interface, function)) == family.signatures[0 if function.endswith("fwd") else 2].split()
    step(model, make_batch("plain")[0], interface)
    assert handle.recomputes_served == 3


@MODES
@pytest.mark.parametrize("release", [FLASH4_RELEASES[0], FLASH4_RELEASES[1]])
def test_sinks_that_train_before_their_gradient_are_refused_at_the_first_forward(install, monkeypatch, release,
                                                                                 use_reentrant):
    """Up to 4.0.0b25 flash-attn 4's backward gives the sinks no gradient: sinks that train are refused at the
    stashed layer's first forward, naming the release and the one that trains them, and nothing is kept."""
    use_flash_attn_4(monkeypatch, release)
    model = flash4_model("gpt_oss_trained_sinks", use_reentrant)
    handle = install(model, 2)
    before = tensors()
    record = attention_stash._FLASH_INTERFACES[IMPLEMENTATION].family.release
    with pytest.raises(AttentionStashError,
                       match=rf"got learnable_sink \(the layer's sinks, as gpt-oss passes them\) that requires grad "
                       rf"for flash-attn 4 as {record} has it, whose backward gives the sinks no gradient\. .*"
                       rf"\(flash-attn 4 from 4\.0\.0b26\)\."):
        model(**make_batch("plain")[0])
    assert handle.num_kept == 0 and kept_outputs() == [] and live_checkpoint_calls() == []
    assert live_tensors(before, model, counted=real_2d) == []


def _float32_sinks(model):
    """gpt-oss's sinks kept in float32 in a bfloat16 model: the integration casts them to the query's dtype, a new
    tensor of the same values in each pass."""
    for layer in model.model.layers:
        layer.self_attn.sinks.data = layer.self_attn.sinks.data.float()
    return model


@MODES
@pytest.mark.parametrize("name", ["gpt_oss_trained_sinks", "gpt_oss_frozen_sinks"])
def test_sinks_cast_to_the_querys_dtype_in_each_pass_are_served(install, monkeypatch, name, use_reentrant):
    """float32 sinks reach flash-attn 4 as a new bfloat16 tensor in each pass, with equal values: compared by value,
    served bitwise, their gradient (in float32, through the cast) the stock one."""
    interface = use_flash_attn_4(monkeypatch)
    model = _float32_sinks(flash4_model(name, use_reentrant))
    inputs = make_batch("plain")[0]
    seen = []
    function = interface._flash_attn_fwd

    @functools.wraps(function)
    def recording(*args, **kwargs):
        seen.append(kwargs["learnable_sink"])
        return function(*args, **kwargs)

    monkeypatch.setattr(interface, "_flash_attn_fwd", recording)
    expected_loss, expected, _ = step(model, inputs, interface)
    handle = install(model, 2)
    seen.clear()
    loss, grads, calls = step(model, inputs, interface)
    assert calls == {"fwd": 2, "bwd": 2} and handle.recomputes_served == 2
    # The stashed step's forward kernels: its first pass's, one per layer, of bfloat16 sinks made from float32 ones.
    assert [sink.dtype for sink in seen] == [DTYPE] * 2
    assert all(sink is not layer.self_attn.sinks for sink, layer in zip(seen, model.model.layers))
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    sinks = [grads.get(f"model.layers.{index}.self_attn.sinks") for index in range(2)]
    if name == "gpt_oss_trained_sinks":
        assert all(grad.dtype == torch.float32 and grad.abs().sum() > 0 for grad in sinks)
    else:
        assert sinks == [None, None]


@pytest.mark.parametrize("kind", ["plain", "packed_position_ids"])
@pytest.mark.parametrize("present", ["forward", "recompute"])
def test_sinks_in_one_pass_alone_are_refused_by_name(install, monkeypatch, kind, present):
    """A layer whose sinks reach flash-attn 4 in one pass and not in the other (a plain call or a varlen one): the
    recompute raises, naming learnable_sink, and nothing is kept."""
    use_flash_attn_4(monkeypatch)
    model = flash4_model("gpt_oss_frozen_sinks")
    handle = install(model, 2)
    passes = []
    for layer in model.model.layers:
        attention, sinks = layer.self_attn, layer.self_attn.sinks

        def forward(*args, attention=attention, sinks=sinks, forward=type(layer.self_attn).forward, **kwargs):
            # The first pass runs without grad (reentrant), the recompute with it.
            with_sinks = torch.is_grad_enabled() == (present == "recompute")
            attention.sinks = sinks if with_sinks else None
            try:
                return forward(attention, *args, **kwargs)
            finally:
                attention.sinks = sinks

        monkeypatch.setattr(attention, "forward", forward)
    inputs = make_batch(kind)[0]
    loss = model(**inputs).loss
    with pytest.raises(AttentionStashError,
                       match=r"needs the recompute of model\.layers\.1 to call flash-attn 4 \(flash_attn_"
                       rf"{'' if kind == 'plain' else 'varlen_'}func\) with its forward's arguments, got another "
                       r"learnable_sink \(attention call 1\)"):
        loss.backward()
    del loss
    assert handle.num_kept == 0 and kept_outputs() == [] and live_checkpoint_calls() == []


class Recorder:
    """Records each call of the double's kernel functions by parameter name, defaults filled in (they run as called)."""

    def __init__(self, monkeypatch, interface):
        self.calls = []
        for name in ("_flash_attn_fwd", "_flash_attn_bwd"):
            function = getattr(interface, name)

            @functools.wraps(function)
            def recording(*args, function=function, name=name, **kwargs):
                self.calls.append((name, bound_arguments(function, args, kwargs)))
                return function(*args, **kwargs)

            monkeypatch.setattr(interface, name, recording)

    def take(self, name):
        return [arguments for called, arguments in self.calls if called == name]


@MODES
@pytest.mark.parametrize("kind", ["plain", "packed_position_ids"])
@pytest.mark.parametrize("release", [FLASH4_RELEASES[0], NEWEST])
def test_kernel_calls_follow_flash_attn_4s_autograd_functions(install, monkeypatch, release, kind, use_reentrant):
    """The stash calls _flash_attn_fwd as FlashAttnFunc (FlashAttnVarlenFunc) calls it in the stock first pass, every
    parameter the same value but return_lse, which it sets (the forward computes no log-sum-exp without grad else),
    and _flash_attn_bwd as their backward does, every parameter the same (dq, dk and dv left to the kernel, no
    pack_gqa, the sinks where the release's backward takes them): gpt-oss's sinks, frozen in 4.0.0b19, trained in
    b40."""
    interface = use_flash_attn_4(monkeypatch, release)
    model = flash4_model("gpt_oss_trained_sinks" if release == NEWEST else "gpt_oss_frozen_sinks", use_reentrant)
    inputs = make_batch(kind)[0]
    recorder = Recorder(monkeypatch, interface)
    step(model, inputs, interface)
    stock_forwards, stock_backwards = recorder.take("_flash_attn_fwd")[:2], recorder.take("_flash_attn_bwd")
    install(model, 2)
    recorder.calls = []
    step(model, inputs, interface)
    forwards, backwards = recorder.take("_flash_attn_fwd"), recorder.take("_flash_attn_bwd")
    assert len(forwards) == len(backwards) == len(stock_backwards) == 2
    for ours, theirs in (*zip(forwards, stock_forwards), *zip(backwards, stock_backwards)):
        assert list(ours) == list(theirs)
        for parameter, value in theirs.items():
            if parameter == "return_lse":
                assert (ours[parameter], value) == (True, False)
            else:
                assert same_value(ours[parameter], value), parameter
    assert all(arguments["learnable_sink"] is not None for arguments in forwards)
    assert [arguments.get("learnable_sink") is not None for arguments in backwards] == [release == NEWEST] * 2


@MODES
def test_gemma_2s_softcap_reaches_both_kernels_as_in_the_stock_step(install, monkeypatch, use_reentrant):
    """Gemma 2's logit cap: the stashed step passes it to the forward and to the backward, as the stock step does (its
    step in test_a_step_is_stock is bitwise stock; flash-attn 4's backward reads any softcap but 0.0 as a cap)."""
    interface = use_flash_attn_4(monkeypatch)
    model = flash4_model("gemma2_softcap", use_reentrant)
    inputs = make_batch("plain")[0]
    recorder = Recorder(monkeypatch, interface)
    step(model, inputs, interface)
    stock = Counter((name, arguments["softcap"]) for name, arguments in recorder.calls)
    handle = install(model, 3)
    recorder.calls = []
    step(model, inputs, interface)
    stashed = Counter((name, arguments["softcap"]) for name, arguments in recorder.calls)
    assert stock == {("_flash_attn_fwd", SOFTCAP): 6, ("_flash_attn_bwd", SOFTCAP): 3}
    assert stashed == {("_flash_attn_fwd", SOFTCAP): 3, ("_flash_attn_bwd", SOFTCAP): 3}
    assert handle.recomputes_served == 3


def _call_of_a_stashed_layer(install, monkeypatch):
    """A checkpoint call of a stashed flash-attn 4 layer, in its first pass, as the current call, for the guards
    Hugging Face's path never reaches; and flash_attn_func and flash_attn_varlen_func as the stash hands them out."""
    use_flash_attn_4(monkeypatch)
    handle = install(flash4_model("llama"), 1)
    call = attention_stash._CheckpointCall(handle._stashes[0], None)
    call.passes, call.kept = 1, []
    monkeypatch.setattr(attention_stash._state, "call", call)
    return call, attention_stash._FLASH_INTERFACES[IMPLEMENTATION].calls


@pytest.mark.parametrize("argument, given", [
    ("score_mod", lambda: lambda score, *indices: score),
    ("mask_mod", lambda: lambda *indices: True),
    ("block_sparse_tensors", lambda: (torch.zeros(1, dtype=torch.int32), )),
    ("aux_tensors", lambda: [torch.zeros(1)]),
    ("qv", lambda: torch.zeros(1, 8, 4, 16, dtype=DTYPE)),
    ("gather_kv_indices", lambda: torch.zeros(1, 8, 2, dtype=torch.int32)),
    ("page_table", lambda: torch.zeros(2, 1, dtype=torch.int32)),
    ("return_lse", lambda: True),
    ("scales", lambda: (torch.ones(1), ) * 3),
])
@pytest.mark.parametrize("varlen", [False, True], ids=["flash_attn_func", "flash_attn_varlen_func"])
def test_arguments_the_replay_cannot_reproduce_are_refused_by_name(install, monkeypatch, argument, given, varlen):
    """flash-attn 4's score and mask modifications, block sparsity, MLA, the gather and paged paths, an extra output,
    FP8 scales: refused at the call, naming the argument and its value, before anything runs or is kept; the same
    arguments at their defaults are served."""
    call, (function, varlen_function) = _call_of_a_stashed_layer(install, monkeypatch)
    query = torch.randn(8, 4, 16, dtype=DTYPE) if varlen else torch.randn(1, 8, 4, 16, dtype=DTYPE)
    cu_seqlens = torch.tensor([0, 8], dtype=torch.int32)
    run = (partial_call(varlen_function, query, cu_seqlens) if varlen else partial_call(function, query))
    value = given()
    with pytest.raises(AttentionStashError,
                       match=rf"needs flash-attn calls that return the attention output of "
                       rf"plain softmax attention alone in model\.layers\.2, got {argument}="):
        run(**{argument: value})
    assert call.kept == [] and call.calls == 0
    default = False if argument == "return_lse" else None
    assert run(**{argument: default}).shape == query.shape
    assert len(call.kept) == 1


def partial_call(function, query, cu_seqlens=None):
    """The stash's flash_attn_func (or flash_attn_varlen_func) on ``query`` as query, key and value, causal."""
    varlen = () if cu_seqlens is None else (cu_seqlens, cu_seqlens)

    def run(**options):
        if cu_seqlens is not None:
            options.update(max_seqlen_q=8, max_seqlen_k=8)
        return function(query, query, query, *varlen, causal=True, **options)

    return run


# The Hub build kernels-community/flash-attn4 (4.0.0.beta8, before b19) as its kernel functions read in
# flash-attn4/torch-ext/flash_attn4/interface.py (huggingface/kernels-community 02177390): no qv, min_seqlen_k,
# aux_scalars, descales or gather_kv_indices.
HUB_BETA8_FORWARD = ("q k v cu_seqlens_q cu_seqlens_k seqused_q seqused_k max_seqlen_q max_seqlen_k page_table "
                     "softmax_scale causal softcap window_size_left window_size_right learnable_sink tile_mn "
                     "mma_pv_is_rs intra_wg_overlap num_threads num_splits pack_gqa _arch score_mod mask_mod "
                     "block_sparse_tensors return_lse out lse aux_tensors")


def test_a_release_of_other_kernel_functions_is_refused_at_install_naming_the_records(install, monkeypatch):
    """A flash-attn 4 whose _flash_attn_fwd takes other parameters than every record's (here the Hub build's beta 8,
    a pre-b19 interface): refused at install, naming the release installed, what differs, and every record known."""
    interface = use_flash_attn_4(monkeypatch)
    namespace = {}
    exec(f"def _flash_attn_fwd({', '.join(HUB_BETA8_FORWARD.split())}): pass", namespace)
    monkeypatch.setattr(interface, "_flash_attn_fwd", namespace["_flash_attn_fwd"])
    records = " or ".join(f"flash-attn-4 {record}" for record in attention_stash._FLASH4_RECORDS)
    assert records.count("flash-attn-4") == 5
    message = (rf"needs flash-attn 4's interface as flash-attn-4 .* has it for attn_implementation="
               rf'"flash_attention_4", got flash_attn flash-attn-4 4\.0\.0b40.* \(flash_attn\.cute\.interface\) '
               rf"_flash_attn_fwd\(q, k, v, cu_seqlens_q, .*, aux_tensors\)\. Install {re.escape(records)}, or load "
               rf'the model with attn_implementation="sdpa"\.')
    with pytest.raises(AttentionStashError, match=message):
        install(flash4_model("llama"), 1)
    assert_stock_process()


def test_flash_attention_4_not_importable_is_refused_at_install(install):
    """Without flash-attn 4 (this machine's flash_attn.cute is flash-attn 2.8.3's, which needs CUDA's Python
    packages), the install names the import error and what to load instead; the planner too; nothing is held."""
    model = flash4_model("llama")
    message = (r'needs flash-attn 4 \(its flash_attn\.cute package, from the flash-attn-4 pre-release\) for '
               r'attn_implementation="flash_attention_4", got an import error: .*\. Install flash-attn 4, or load the '
               r'model with attn_implementation="sdpa"\.')
    with pytest.raises(AttentionStashError, match=message):
        install(model, 1)
    with pytest.raises(AttentionStashError, match=message):
        attention_stash.attention_stash_layer_bytes(model, 2, 32)
    assert_stock_process()


def test_under_torch_compile_flash_attn_4_is_refused_by_name(install, monkeypatch):
    """flash-attn 4's kernel functions are Python functions over CuTe DSL kernels, not torch ops dynamo traces: the
    install line says so, and the compiled checkpoint's contexts refuse them by name, as flash-attn 3's."""
    use_flash_attn_4(monkeypatch)
    model = checkpointed(llama_model(DTYPE), use_reentrant=False)
    model.config._attn_implementation = IMPLEMENTATION
    with logged_messages() as messages:
        handle = install(model, 3)
    assert "; under torch.compile, refused: dynamo cannot trace these kernels; " in messages[-1]
    stash = attention_stash._LAYER_STASHES[id(model.model.layers[0])]
    with pytest.raises(AttentionStashError,
                       match=r"needs kernel functions that dynamo traces \(torch ops with fake kernels\) for the "
                       r"compiled checkpoint of model\.layers\.0, got flash-attn 4's interface from flash_attn "
                       r"flash-attn-4 4\.0\.0b40.*, whose kernel functions are Python functions calling compiled "
                       r"kernels\."):
        attention_stash._compiled_contexts(stash.key, None)
    assert handle.compiled_layers == ()


@MODES
@pytest.mark.parametrize("kind", ["plain", "packed_position_ids"])
def test_a_recompute_with_another_deterministic_setting_is_refused(install, monkeypatch, kind, use_reentrant):
    """FLASH_ATTENTION_DETERMINISTIC changed between a forward and its backward: Hugging Face passes flash-attn 4 the
    other value in the recompute, which the stash names; nothing is kept after."""
    use_flash_attn_4(monkeypatch)
    model = flash4_model("llama", use_reentrant)
    handle = install(model, 3)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "0")
    loss = model(**make_batch(kind)[0]).loss
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    function = "flash_attn_func" if kind == "plain" else "flash_attn_varlen_func"
    with pytest.raises(AttentionStashError,
                       match=rf"call flash-attn 4 \({function}\) with its forward's arguments, got another "
                       r"deterministic \(attention call 1\): the kept output is the forward's\."):
        loss.backward()
    del loss
    assert handle.num_kept == 0 and kept_outputs() == [] and live_checkpoint_calls() == []


@MODES
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_a_step_on_meta(install, monkeypatch, packed, use_reentrant):
    """The decoder layers on meta tensors in bfloat16, called as the model calls them (a packed batch passes its
    cu_seqlens, as a padding-free collator does), through the double, whose kernels are plain torch ops: every call
    served, the kept bytes the planner's, every parameter a gradient of its shape and dtype, nothing left after."""
    interface = use_flash_attn_4(monkeypatch)
    with torch.device("meta"):
        model = flash4_model("llama", use_reentrant)
    handle = install(model, 3)
    meta_step(model, handle, packed, contextlib.nullcontext(), 3)
    varlen = "varlen_" if packed else ""
    assert dict(interface.calls) == {f"{varlen}fwd": 3, f"{varlen}bwd": 3}
    assert live_tensors(model=model, counted=meta_of_a_batch) == [] and live_checkpoint_calls() == []
