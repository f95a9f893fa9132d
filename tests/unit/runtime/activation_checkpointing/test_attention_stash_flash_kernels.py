# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash on attn_implementation="flash_attention_3" and on a Hub kernel ("kernels-community/flash-attn2"), on CPU
and on meta.

Each is one record of the stash's implementations table, served through the same flash path as flash_attention_2:
the install finds the functions Hugging Face's lazy import hands out, and the flash-attn interface they belong to
(flash-attn 3's, or flash-attn 2's as a Hub build has it). attention_stash_flash3.py supplies flash-attn 3's two ops
and the Hub kernel's four, with CPU kernels that compute what attention_stash_flash.py's stand-ins compute and fake
kernels for meta; the Hub kernel is a local repository that the kernels package loads through LOCAL_KERNELS, nothing
is fetched. A stock step and a stashed one are compared bitwise, and the kernel ops are counted.
"""

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import re
import sys
import types

import pytest
import torch
import transformers
from packaging.version import Version

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError

from attention_stash_flash import flash_attn_or_skip
from attention_stash_flash3 import (HUB_BUILDS, flash_kernels_or_skip, hub_kernel_name, use_flash_attention_3,
                                    use_hub_kernel)
from attention_stash_helpers import (CountOps, assert_same_calls, assert_same_grads, assert_stock_process,
                                     bound_arguments, checkpointed, counted_step, kept_outputs, live_checkpoint_calls,
                                     gpt_oss_model, live_tensors, llama_model, logged_messages, mistral_model,
                                     param_grads, same_value, tensors)
from attention_stash_flash import PADDING, make_batch, meta_of_a_batch, meta_step, real_2d
from test_attention_stash_flash import _qwen3_next_model

flash_attn_or_skip()
FLASH_ATTN_3 = flash_kernels_or_skip()

DTYPE = torch.bfloat16
MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
# The Hub builds mirrored in hub_builds/: flash-attn 2's (custom ops), flash-attn 3's (custom ops) and vLLM's
# flash-attn 3 (plain functions); transformers' fallbacks for flash_attention_2 and flash_attention_3.
HUBS = ("kernels-community/flash-attn2", "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3")
HUB = HUBS[0]
IMPLEMENTATIONS = ("flash_attention_3", *HUBS)
# Each implementation: its family's name, and the multiple its output's head dimension is padded to.
FAMILY = {
    "flash_attention_3": ("flash-attn 3", 1),
    HUBS[0]: ("flash-attn 2", 8),
    HUBS[1]: ("flash-attn 3", 1),
    HUBS[2]: ("vLLM's flash-attn 3", 1)
}
# A Hub build's kernel functions that are custom ops, by the compiled op each calls (the name counted).
HUB_NAMESPACES = ("_flash_attn2_", "_flash_attn3_", "_vllm_flash_attn3_")
KERNEL_FUNCTION_OPS = {
    "_flash_attn_forward": "fwd",
    "_flash_attn_varlen_forward": "varlen_fwd",
    "_flash_attn_backward": "bwd",
    "_flash_attn_varlen_backward": "varlen_bwd"
}
# name: (model, attention layers)
MODELS = {
    "llama": (lambda: llama_model(DTYPE), 3),
    # 36 is not a multiple of 8: flash-attn 2 pads it to 40, flash-attn 3 keeps it.
    "llama_head_dim_36": (lambda: llama_model(DTYPE, head_dim=36), 3),
    "mistral_sliding_window": (lambda: mistral_model(DTYPE, sliding_window=8), 3),
    # A hybrid: linear attention before each of its two softmax attention layers.
    "qwen3_next": (lambda: _qwen3_next_model(DTYPE), 2),
}
BATCHES = ("plain", "padded", "packed_position_ids", "packed_cu_seq_lens")
# The models each implementation's steps run, the first on every batch kind (each reaches the flash functions another
# way: flash_attn_func, or flash_attn_varlen_func with cu_seqlens unpadded from the mask, derived from position_ids, or
# passed as the same tensors to both passes), the others on a plain and a packed batch: what a model changes for the
# stash (its head dimension's padding, its window, layers without softmax attention) reaches both functions alike.
# The Hub builds of flash-attn 3 share flash-attn 3's family code: they run on the unpadded head dimension and a
# window, which each build names its own way.
STEP_MODELS = dict.fromkeys(IMPLEMENTATIONS[:2],
                            ("llama", "llama_head_dim_36", "mistral_sliding_window", "qwen3_next"))
STEP_MODELS.update(dict.fromkeys(HUBS[1:], ("llama_head_dim_36", "mistral_sliding_window")))
STEP_CASES = [(implementation, name, kind) for implementation in IMPLEMENTATIONS
              for index, name in enumerate(STEP_MODELS[implementation])
              for kind in (BATCHES if index == 0 else ("plain", "packed_position_ids"))]


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, monkeypatch, tmp_path_factory):
    """Each implementation's path made to run on this machine for the test; its name."""
    if request.param == "flash_attention_3":
        use_flash_attention_3(monkeypatch)
    else:
        use_hub_kernel(monkeypatch, tmp_path_factory, request.param)
    return request.param


def kernel_model(name, implementation, use_reentrant=True):
    if name == "qwen3_next" and not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3NextForCausalLM")
    model = MODELS[name][0]()
    # Hugging Face checks for CUDA builds when loading with these; set on the built model.
    model.config._attn_implementation = implementation
    return checkpointed(model, use_reentrant=use_reentrant)


def kernel_op(func):
    """flash-attn 3's ops and a Hub kernel's (fwd, varlen_fwd, bwd, varlen_bwd), by name, for CountOps: a Hub build's
    custom op (a kernel function) as the compiled op it calls, which runs inside it unseen; None for any other op."""
    namespace, _, name = func._schema.name.partition("::")
    if namespace == "flash_attn_3" or namespace.startswith(HUB_NAMESPACES):
        return KERNEL_FUNCTION_OPS.get(name, name)
    return None


def kernel_ops(implementation, kind):
    """The names of the forward and backward ops a batch kind runs."""
    varlen = "varlen_" if implementation == HUB and kind != "plain" else ""
    return f"{varlen}fwd", f"{varlen}bwd"


def source(implementation):
    """What the install line says the implementation's kernels are: flash-attn 3's module, or a Hub kernel's local
    build, by its repository (the name of its build, whatever implementation Hugging Face loaded it for)."""
    repo_id = implementation.partition("@")[0]
    if repo_id == "flash_attention_3":
        return "flash-attn 3's interface from flash_attn_interface"
    return (f"{FAMILY[repo_id][0]}'s interface from the Hub kernel {repo_id.partition('/')[2]} version "
            f"{HUB_BUILDS[repo_id].version}, a local build ({hub_kernel_name(repo_id)})")


@MODES
@pytest.mark.parametrize("implementation, name, kind", STEP_CASES, indirect=["implementation"])
def test_a_step_is_stock(install, implementation, name, kind, use_reentrant):
    """A stock step, then a stashed one on every attention layer: the same loss and gradients bitwise, the recompute's
    attention forwards skipped, every call served, the kept bytes the planner's, nothing left after."""
    model = kernel_model(name, implementation, use_reentrant)
    layers = MODELS[name][1]
    inputs, (batch, sequence) = make_batch(kind)
    before = tensors()
    forward, backward = kernel_ops(implementation, kind)

    expected_loss, expected, stock_calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert stock_calls == {forward: 2 * layers, backward: layers}
    handle = install(model, layers)
    loss, grads, stashed_calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert stashed_calls == {forward: layers, backward: layers}
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (layers, 0, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)

    config = model.config
    head_dim = config.head_dim + -config.head_dim % FAMILY[implementation][1]
    planned = attention_stash.attention_stash_layer_bytes(model, batch, sequence)
    assert planned == batch * sequence * config.num_attention_heads * (head_dim * 2 + 4)
    # A padded batch is unpadded: the varlen kernel keeps its real tokens only.
    tokens = batch * sequence - (PADDING if kind == "padded" else 0)
    assert handle.peak_kept_bytes == layers * config.num_attention_heads * tokens * (head_dim * 2 + 4)
    del inputs, loss, expected_loss
    assert kept_outputs() == [] and live_checkpoint_calls() == []
    assert live_tensors(before, model, expected, grads, counted=real_2d) == []


@MODES
def test_the_install_line_names_the_kernels_and_their_cost(install, implementation, use_reentrant):
    """The install line names the implementation and where its kernels come from (the Hub kernel's repository and
    version), and counts its family's layout: flash-attn 3 does not pad the head dimension, flash-attn 2 pads it to a
    multiple of 8. The planner agrees."""
    model = kernel_model("llama_head_dim_36", implementation, use_reentrant)
    with logged_messages() as messages:
        install(model, 2, micro_batch_size=2, sequence_length=32)
    per_layer = 2 * 32 * 4 * ((36 + -36 % FAMILY[implementation][1]) * 2 + 4)
    assert any(f"keeping the attention output of 2 of 3 attention layers (model.layers.1 to model.layers.2) for "
               f"their recompute: {2 * per_layer:,} bytes per micro-batch in flight" in message
               and message.endswith(f'; attn_implementation "{implementation}" ({source(implementation)}).')
               for message in messages), messages
    assert attention_stash.attention_stash_layers_for_budget(model, 2 * per_layer, 2, 32) == 2


def test_a_kernel_from_the_hub_is_named_with_its_repository_and_revision(monkeypatch, tmp_path_factory):
    """A kernel the kernels package fetched from the Hub (here, the local one as the package reports a fetched one):
    its repository and revision."""
    import kernels

    module = use_hub_kernel(monkeypatch, tmp_path_factory, HUB)
    fetched = types.SimpleNamespace(module=module,
                                    metadata=None,
                                    repo_info=types.SimpleNamespace(repo_id=HUB, revision="v4"))
    monkeypatch.setattr(kernels, "get_loaded_kernels", lambda: [fetched])
    # No interface found before: the same functions would keep its words.
    monkeypatch.setattr(attention_stash, "_FLASH_INTERFACES", {})
    interface = attention_stash._load_flash(attention_stash._implementation(HUB))
    assert interface.description == (f"flash-attn 2's interface from the Hub kernel {HUB} at revision v4 "
                                     f"({module.__name__})")


def test_flash_attention_2_served_through_hugging_faces_hub_kernel_fallback(install, monkeypatch, tmp_path_factory):
    """Where flash-attn 2 is not available and the kernels package is, Hugging Face's lazy import for
    "flash_attention_2" loads the Hub kernel kernels-community/flash-attn2: the install finds it, names it, and the
    stash serves it bitwise."""
    import transformers.modeling_flash_attention_utils as flash_utils

    use_hub_kernel(monkeypatch, tmp_path_factory, HUB)
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda *args, **kwargs: False)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    model = kernel_model("llama", "flash_attention_2")
    inputs, _ = make_batch("plain")
    expected_loss, expected, stock_calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert stock_calls == {"fwd": 6, "bwd": 3}
    with logged_messages() as messages:
        handle = install(model, 3)
    line = f'; attn_implementation "flash_attention_2" ({source(HUB)}).'
    assert messages[-1].endswith(line), messages
    loss, grads, calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert calls == {"fwd": 3, "bwd": 3} and handle.recomputes_served == 3
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_an_implementation_whose_functions_change_is_served_with_the_new_ones(install, monkeypatch, tmp_path_factory):
    """flash_attention_2 installed over flash-attn's package, then, once Hugging Face hands out other functions for
    it (the package gone, its lazy import falls back to the Hub kernel kernels-community/flash-attn2), installed on
    another model: that install finds the new functions, names them, and serves them bitwise."""
    import transformers.modeling_flash_attention_utils as flash_utils
    from attention_stash_flash import use_flash_attention_2

    inputs, _ = make_batch("plain")
    with monkeypatch.context() as patch:
        use_flash_attention_2(patch)
        model = kernel_model("llama", "flash_attention_2")
        handle = install(model, 3)
        model(**inputs).loss.backward()
        assert handle.recomputes_served == 3
        handle.remove()
    use_hub_kernel(monkeypatch, tmp_path_factory, HUB)
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda *args, **kwargs: False)
    model = kernel_model("llama", "flash_attention_2")
    expected_loss, expected, _ = counted_step(model, inputs, kernel_op, whole_step=True)
    with logged_messages() as messages:
        handle = install(model, 3)
    assert messages[-1].endswith(f'; attn_implementation "flash_attention_2" ({source(HUB)}).')
    loss, grads, calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert calls == {"fwd": 3, "bwd": 3} and handle.recomputes_served == 3
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_an_implementation_handed_other_functions_of_the_same_names_is_served_with_them(
        install, monkeypatch, tmp_path_factory):
    """flash_attention_3 installed over flash-attn 3's interface, then handed functions of the same names that are
    other objects: the interface module loaded again from its file (a reload). The next install finds the new
    functions and serves them bitwise, not the first interface's (whose functions Hugging Face no longer hands out,
    which the first forward would refuse)."""
    inputs, _ = make_batch("plain")
    use_flash_attention_3(monkeypatch)
    model = kernel_model("llama", "flash_attention_3")
    handle = install(model, 3)
    model(**inputs).loss.backward()
    assert handle.recomputes_served == 3
    handle.remove()
    first = sys.modules["flash_attn_interface"]
    spec = importlib.util.spec_from_file_location("flash_attn_interface", first.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = ("flash_attn_func", "flash_attn_varlen_func", "_flash_attn_forward", "_flash_attn_backward")
    assert all(getattr(module, name) is not getattr(first, name) for name in names)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    use_flash_attention_3(monkeypatch)
    model = kernel_model("llama", "flash_attention_3")
    expected_loss, expected, _ = counted_step(model, inputs, kernel_op, whole_step=True)
    with logged_messages() as messages:
        handle = install(model, 3)
    assert messages[-1].endswith(f'; attn_implementation "flash_attention_3" ({source("flash_attention_3")}).')
    loss, grads, calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert calls == {"fwd": 3, "bwd": 3} and handle.recomputes_served == 3
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_two_revisions_of_a_hub_kernel_are_served_side_by_side(install, monkeypatch, tmp_path_factory):
    """Two models of one process on two revisions of one Hub kernel ("kernels-community/flash-attn2@v1" and "@v2",
    each its own attention implementation in Hugging Face's interface): each install names its revision, and both
    stashes serve their model's steps, each through its own implementation's entry."""
    import transformers.modeling_flash_attention_utils as flash_utils

    use_hub_kernel(monkeypatch, tmp_path_factory, HUB)
    inputs, _ = make_batch("plain")
    models, handles, expected = [], [], []
    for revision in ("v1", "v2"):
        name = f"{HUB}@{revision}"
        flash_utils.lazy_import_flash_attention(name)
        model = kernel_model("llama", name)
        expected.append(counted_step(model, inputs, kernel_op, whole_step=True)[:2])
        with logged_messages() as messages:
            handles.append(install(model, 3))
        assert messages[-1].endswith(f'; attn_implementation "{name}" ({source(name)}).'), messages
        models.append(model)
    for model, handle, (expected_loss, expected_grads) in zip(models, handles, expected):
        loss, grads, calls = counted_step(model, inputs, kernel_op, whole_step=True)
        assert calls == {"fwd": 3, "bwd": 3} and handle.recomputes_served == 3
        assert torch.equal(loss, expected_loss)
        assert_same_grads(grads, expected_grads)


@MODES
def test_flash_attention_3_served_through_hugging_faces_hub_kernel_fallback(install, monkeypatch, tmp_path_factory,
                                                                            use_reentrant):
    """Where flash-attn 3 is not installed and the kernels package is, transformers 5.24 turns
    attn_implementation="flash_attention_3" into its Hub fallback, kernels-community/vllm-flash-attn3 (the
    flash_attention_3 most Hopper users get): the install names vLLM's flash-attn 3; the stash serves it bitwise."""
    import transformers.modeling_utils as modeling_utils

    repo_id = HUBS[2]
    use_hub_kernel(monkeypatch, tmp_path_factory, repo_id)
    # Hugging Face's own check of the kernels package's version, relaxed for 0.17 as in use_hub_kernel.
    monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda *args, **kwargs: True)
    model = llama_model(DTYPE)
    model.set_attn_implementation("flash_attention_3")
    assert model.config._attn_implementation == repo_id
    model = checkpointed(model, use_reentrant)
    inputs, _ = make_batch("padded")
    expected_loss, expected, stock_calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert stock_calls == {"fwd": 6, "bwd": 3}
    with logged_messages() as messages:
        handle = install(model, 3)
    assert messages[-1].endswith(f'; attn_implementation "{repo_id}" ({source(repo_id)}).'), messages
    loss, grads, calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert calls == {"fwd": 3, "bwd": 3} and handle.recomputes_served == 3
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def _gpt_oss_model(repo_id, frozen_sinks, use_reentrant=True, dtype=DTYPE):
    """helpers' tiny gpt-oss on ``repo_id``, checkpointed."""
    model = gpt_oss_model(dtype, frozen_sinks=frozen_sinks)
    model.config._attn_implementation = repo_id
    return checkpointed(model, use_reentrant)


def test_attention_sinks_that_require_grad_are_refused_at_the_first_forward(install, monkeypatch, tmp_path_factory):
    """gpt-oss passes its attention sinks as s_aux, which vLLM's flash-attn 3 takes and whose backward gives them no
    gradient: where the sinks train, the stashed layer's first forward is refused, naming the sinks and the fix, and
    nothing is kept."""
    repo_id = HUBS[2]
    use_hub_kernel(monkeypatch, tmp_path_factory, repo_id)
    model = _gpt_oss_model(repo_id, frozen_sinks=False)
    handle = install(model, 2)
    before = tensors()
    with pytest.raises(
            AttentionStashError,
            match=r"needs attention sinks that do not require grad in model\.layers\.0, got s_aux \(the "
            r"layer's sinks, as gpt-oss passes them\) that requires grad for vLLM's flash-attn 3 as the Hub "
            r"build kernels-community/vllm-flash-attn3 has it, whose backward gives the sinks no gradient\. "
            r"Freeze the sinks \(as LoRA does\), or remove the stash from layers with sinks and train them "
            r"with an implementation whose backward computes their gradient \(flash-attn 4 from "
            r"4\.0\.0b26\)\."):
        model(**make_batch("plain")[0])
    assert handle.num_kept == 0 and kept_outputs() == [] and live_checkpoint_calls() == []
    assert live_tensors(before, model, counted=real_2d) == []


@MODES
@pytest.mark.parametrize("cast", [False, True], ids=["bfloat16_sinks", "float32_sinks_cast_each_pass"])
@pytest.mark.parametrize("kind", ["plain", "packed_position_ids"])
def test_frozen_attention_sinks_are_served(install, monkeypatch, tmp_path_factory, kind, cast, use_reentrant):
    """gpt-oss with frozen sinks on vLLM's flash-attn 3 (LoRA on Hopper): its backward, from the log-sum-exp the sinks
    are in, is complete for q, k and v, so the stash serves the kept output and log-sum-exp: bitwise as the plain
    recompute, in both modes, on a plain and a packed batch, each recompute served, nothing alive after the step. Sinks
    kept in float32 in the bfloat16 model reach the kernel as s_aux, a new bfloat16 tensor in each pass (the integration
    casts them to the query's dtype) with equal values: compared by value, as flash-attn 4's learnable_sink is."""
    repo_id = HUBS[2]
    use_hub_kernel(monkeypatch, tmp_path_factory, repo_id)
    model = _gpt_oss_model(repo_id, frozen_sinks=True, use_reentrant=use_reentrant)
    for layer in model.model.layers if cast else ():
        layer.self_attn.sinks.data = layer.self_attn.sinks.data.float()
    inputs, _ = make_batch(kind)
    expected_loss, expected, stock_calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert stock_calls == {"fwd": 4, "bwd": 2}
    handle = install(model, 2)
    before = tensors()
    loss, grads, calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert calls == {"fwd": 2, "bwd": 2} and handle.recomputes_served == 2
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    assert not any(name.endswith("sinks") for name in grads)
    del loss, grads
    assert handle.num_kept == 0 and kept_outputs() == [] and live_checkpoint_calls() == []
    assert live_tensors(before, model, counted=real_2d) == []


@pytest.mark.parametrize("cast", [False, True], ids=["same_tensor", "cast_each_pass"])
def test_frozen_sinks_changed_between_the_passes_are_refused(install, monkeypatch, tmp_path_factory, cast):
    """Frozen sinks changed in place between the forward and the backward: the kept output is of the old ones, so the
    recompute is refused, naming s_aux; so where Hugging Face hands each pass a new tensor (float32 sinks cast to the
    bfloat16 query), compared by value."""
    repo_id = HUBS[2]
    use_hub_kernel(monkeypatch, tmp_path_factory, repo_id)
    model = _gpt_oss_model(repo_id, frozen_sinks=True)
    if cast:
        for layer in model.model.layers:
            layer.self_attn.sinks.data = layer.self_attn.sinks.data.float()
    handle = install(model, 2)
    loss = model(**make_batch("plain")[0]).loss
    with torch.no_grad():
        model.model.layers[1].self_attn.sinks.add_(1.0)
    changed = "s_aux" if cast else r"s_aux \(changed in place\)"
    with pytest.raises(AttentionStashError,
                       match=rf"needs the recompute of model\.layers\.1 to call vLLM's flash-attn 3 "
                       rf"\(flash_attn_func\) with its forward's arguments, got another {changed} \(attention call "
                       rf"1\): the kept output is the forward's\. Keep flash-attn's settings \(.*sinks\) the same"):
        loss.backward()
    del loss
    handle.remove()
    assert kept_outputs() == [] and live_checkpoint_calls() == []


@pytest.mark.parametrize("varlen", [False, True], ids=["plain", "varlen"])
def test_the_vllm_stand_in_computes_sinks_as_the_build_does(monkeypatch, tmp_path_factory, varlen):
    """vLLM's flash-attn 3's _flash_attn_forward and _flash_attn_backward, as the mirror calls the stand-in ops, with
    sinks, against a float64 reference that puts each head's sink logit in the softmax as gpt-oss's eager attention
    does: the output; the log-sum-exp, with the sinks in its normaliser; dq, dk and dv from that log-sum-exp, as
    autograd's with the sinks frozen. A causal sliding window over 6 queries and 4 keys, aligned bottom-right, leaves
    the first two queries no key: output 0, log-sum-exp their head's sink, as the kernel's finalize_aux gives. The
    stand-in computes in float32, the reference in float64, from the same float32 inputs: equal within 2e-6."""
    module = importlib.import_module(
        use_hub_kernel(monkeypatch, tmp_path_factory, HUBS[2]).__name__ + ".flash_attn_interface")
    generator = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 6, 4, 8, generator=generator) for _ in range(2))
    k, v = (torch.randn(1, 4, 2, 8, generator=generator) for _ in range(2))
    sinks, scale, window = torch.randn(4, generator=generator) * 2, 0.3, (2, 0)

    def reference(q, k, v):
        """[1, 6, 4, 8] output and [1, 4, 6] log-sum-exp, in float64."""
        q, k, v = (t[0].transpose(0, 1).repeat_interleave(4 // t.shape[2], 0) for t in (q, k, v))
        key, query = torch.arange(4), torch.arange(6).unsqueeze(1) - 2
        allowed = (key <= query) & (key >= query - window[0])
        scores = ((q @ k.transpose(1, 2)) * scale).masked_fill(~allowed, -math.inf)
        logits = torch.cat((scores, sinks.double().view(-1, 1, 1).expand(-1, 6, 1)), dim=-1)
        out = torch.softmax(logits, dim=-1)[..., :-1] @ v
        return out.transpose(0, 1).unsqueeze(0), torch.logsumexp(logits, dim=-1).unsqueeze(0)

    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    expected_out, expected_lse = reference(*inputs)
    expected_grads = torch.autograd.grad(expected_out, inputs, dout.double())
    assert torch.equal(expected_lse[0, :, :2], sinks.double().view(-1, 1).expand(-1, 2))
    varlen_arguments = {}
    if varlen:
        q, k, v, dout = (t[0] for t in (q, k, v, dout))
        cu_seqlens_q, cu_seqlens_k = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
        varlen_arguments = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=6, max_seqlen_k=4)
    nones = dict.fromkeys(
        ("k_new", "v_new", "qv", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q", "seqused_k",
         "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin",
         "seqlens_rotary", "q_descale", "k_descale", "v_descale"))
    options = dict(softmax_scale=scale, causal=True, window_size=window)
    out, lse, *_ = module._flash_attn_forward(q, k, v, **{**nones, **varlen_arguments}, **options, s_aux=sinks)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    backward_varlen = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
    backward_varlen.update(varlen_arguments)
    module._flash_attn_backward(dout,
                                q,
                                k,
                                v,
                                out,
                                lse,
                                **backward_varlen,
                                sequed_q=None,
                                sequed_k=None,
                                dq=grads[0],
                                dk=grads[1],
                                dv=grads[2],
                                **options)
    if varlen:
        out, lse, grads = out.unsqueeze(0), lse.unsqueeze(0), [grad.unsqueeze(0) for grad in grads]
    torch.testing.assert_close(out.double(), expected_out.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.double(), expected_lse.detach(), rtol=0, atol=2e-6)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected, rtol=0, atol=2e-6)


@MODES
def test_flash_attention_3_without_dropout_is_served_where_the_model_asks_for_it(install, monkeypatch, use_reentrant):
    """flash-attn 3 has no dropout, and Hugging Face passes none to it: a model configured with attention dropout
    trains as without the stash, bitwise, rather than being refused for what the kernel never runs."""
    use_flash_attention_3(monkeypatch)
    model = kernel_model("llama", "flash_attention_3", use_reentrant)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    inputs, _ = make_batch("padded")
    expected_loss, expected, _ = counted_step(model, inputs, kernel_op, whole_step=True)
    handle = install(model, 3)
    loss, grads, calls = counted_step(model, inputs, kernel_op, whole_step=True)
    assert calls == {"fwd": 3, "bwd": 3} and handle.recomputes_served == 3
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


@MODES
def test_a_recompute_with_another_deterministic_setting_is_refused(install, implementation, monkeypatch,
                                                                   use_reentrant):
    """FLASH_ATTENTION_DETERMINISTIC switched between the forward and the backward: the backward would run another
    algorithm than the forward asked for, and the stash names the setting."""
    model = kernel_model("llama", implementation, use_reentrant)
    handle = install(model, 3)
    before = tensors()
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "0")
    loss = model(**make_batch("plain")[0]).loss
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    family = FAMILY[implementation][0]
    with pytest.raises(AttentionStashError,
                       match=f"call {family} \\(flash_attn_func\\) with its forward's arguments, got another "
                       r"deterministic \(attention call 1\): the kept output is the forward's\. Keep flash-attn's "
                       r"settings \(FLASH_ATTENTION_DETERMINISTIC"):
        loss.backward()
    del loss
    assert handle.num_kept == 0 and kept_outputs() == [] and live_checkpoint_calls() == []
    assert live_tensors(before, model, counted=real_2d) == []


def test_flash_attn_3s_backward_settings_are_compared_between_the_passes():
    """sm_margin reaches flash-attn 3's backward, as deterministic does: a recompute with another is named."""
    arguments = attention_stash._FlashArguments(softmax_scale=0.25, causal=True, sm_margin=0)
    assert arguments.differing(dataclasses.replace(arguments)) is None
    assert arguments.differing(dataclasses.replace(arguments, sm_margin=8)) == "sm_margin"
    assert arguments.differing(dataclasses.replace(arguments, deterministic=True)) == "deterministic"


@pytest.mark.parametrize("argument", [
    dict(qv=torch.ones(1)),
    dict(q_descale=torch.ones(1)),
    dict(attention_chunk=64),
    dict(seqused_q=torch.ones(1, dtype=torch.int32)),
],
                         ids=["qv", "q_descale", "attention_chunk", "seqused_q"])
def test_flash_attention_3_arguments_the_replay_does_not_serve_are_refused(install, monkeypatch, argument):
    """flash-attn 3's arguments beyond plain softmax attention (another input, FP8 scales, chunked attention, used
    lengths), which Hugging Face does not pass in training: named, and nothing kept."""
    use_flash_attention_3(monkeypatch)
    model = kernel_model("llama", "flash_attention_3")
    handle = install(model, 1)
    call = attention_stash._CheckpointCall(handle._stashes[0], None)
    call.passes, call.kept = 1, []
    query = torch.randn(1, 8, 4, 16, dtype=DTYPE)
    (name, value), = argument.items()
    interface = attention_stash._FLASH_INTERFACES["flash_attention_3"]
    with pytest.raises(AttentionStashError,
                       match=f"needs flash-attn calls that return the attention output of plain softmax attention "
                       f"alone in model\\.layers\\.2, got {name}="):
        call.flash(interface, query, query, query, attention_stash._FlashArguments(causal=True, **argument))
    assert call.kept == [] and handle.num_kept == 0


def _interface_module(implementation):
    return sys.modules[attention_stash._load_flash(
        attention_stash._implementation(implementation)).function.__module__]


def test_an_interface_with_parameters_the_stash_does_not_know_is_refused_at_install(implementation, monkeypatch):
    """A flash_attn_varlen_func that takes a parameter the stash does not know (a newer release, another kernel such
    as flash-attn 4 with its learnable sinks): refused at the install, naming the parameter and the kernel."""
    import transformers.modeling_flash_attention_utils as flash_utils

    module = _interface_module(implementation)

    def newer_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, learnable_sink=None):
        raise AssertionError("not called")

    # The module's own function, as a release of it would define it.
    flash_attn_varlen_func = types.FunctionType(newer_varlen_func.__code__, vars(module), "flash_attn_varlen_func",
                                                newer_varlen_func.__defaults__)
    monkeypatch.setattr(module, "flash_attn_varlen_func", flash_attn_varlen_func)
    if implementation in HUBS:
        monkeypatch.setattr(sys.modules[module.__name__.partition(".")[0]], "flash_attn_varlen_func",
                            flash_attn_varlen_func)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    model = kernel_model("llama", implementation)
    family = FAMILY[implementation][0]
    with pytest.raises(AttentionStashError,
                       match=f"needs {family}'s interface as .* has it for attn_implementation=\"{implementation}\", "
                       f"got .*\\({module.__name__}\\) learnable_sink in its functions' parameters\\. Install "):
        attention_stash.install_attention_stash(model, 1)
    assert attention_stash._held is None and not attention_stash._STASHES


def test_a_hub_kernel_without_the_kernel_functions_is_refused_at_install(monkeypatch, tmp_path_factory):
    """A Hub build of flash-attn 2 without one of the kernel functions its autograd functions call: named."""
    use_hub_kernel(monkeypatch, tmp_path_factory, HUB)
    module = _interface_module(HUB)
    monkeypatch.delattr(module, "_flash_attn_varlen_backward")
    with pytest.raises(AttentionStashError,
                       match=f"needs flash-attn 2's interface as flash-attn 2\\.8 has it for attn_implementation="
                       f"\"{HUB}\", got the Hub kernel flash-attn2 version 4, a local build .* without "
                       f"_flash_attn_varlen_backward\\. Install flash-attn 2\\.8"):
        attention_stash.install_attention_stash(kernel_model("llama", HUB), 1)
    assert attention_stash._held is None


def test_an_implementation_that_does_not_load_is_refused_at_install(implementation, monkeypatch, tmp_path):
    """flash-attn 3's interface not importable, a Hub kernel the kernels package cannot find: named, with the error."""
    import transformers.modeling_flash_attention_utils as flash_utils

    model = kernel_model("llama", implementation)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    if implementation == "flash_attention_3":
        monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
        message = (r'needs flash-attn 3 \(its flash_attn_interface module, from flash-attn\'s hopper/ build\) for '
                   r'attn_implementation="flash_attention_3", got an import error: .*Install flash-attn 3, or load')
    else:
        monkeypatch.setenv("LOCAL_KERNELS", f"{implementation}={tmp_path}")
        message = (f'needs the Hub kernel {implementation} \\(loaded by the kernels package\\) for '
                   f'attn_implementation="{implementation}", got an error \\(ValueError\\): .*Install the Hub kernel '
                   f'{implementation}, or load')
    # (?s): the kernels package's error spans lines.
    with pytest.raises(AttentionStashError, match="(?s)" + message):
        attention_stash.install_attention_stash(model, 1)
    assert attention_stash._held is None


def test_other_functions_after_the_install_are_refused(install, implementation, monkeypatch):
    """Hugging Face's lazy import handing out other functions than the install found (another implementation loaded
    since under the same name): refused at the first stashed call, naming the install's."""
    import transformers.modeling_flash_attention_utils as flash_utils

    model = kernel_model("llama", implementation)
    install(model, 3)
    lazy_imports = flash_utils._lazy_imports

    def other_flash_attn_func(*args, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(flash_utils, "_lazy_imports", lambda *args, **kwargs:
                        (other_flash_attn_func, *lazy_imports(*args, **kwargs)[1:]))
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    family = FAMILY[implementation][0]
    with pytest.raises(AttentionStashError,
                       match=f"needs Hugging Face's {implementation} to call {family}'s flash_attn_func and "
                       f"flash_attn_varlen_func, whose kernels it replays, as the install found them "
                       f"\\({re.escape(source(implementation))}\\), got <function .*other_flash_attn_func"):
        model(**make_batch("plain")[0])


@MODES
def test_a_hub_kernel_registered_again_by_hugging_face_stays_served(install, monkeypatch, tmp_path_factory,
                                                                    use_reentrant):
    """transformers keeps one flash implementation loaded per process; loading the Hub kernel again after another
    (here: transformers told that none is loaded) registers its entry again, library-wide, in the first flash call of
    the next forward, which an unstashed layer makes. The stash's entry stands in front of that registration: the
    stashed layers are served, bitwise; after the removal the registration is what lookups reach."""
    import transformers.modeling_flash_attention_utils as flash_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    use_hub_kernel(monkeypatch, tmp_path_factory, HUB)
    model = kernel_model("llama", HUB, use_reentrant)
    inputs, _ = make_batch("packed_position_ids")
    expected_loss, expected, _ = counted_step(model, inputs, kernel_op, whole_step=True)
    handle = install(model, 2)
    stock = AttentionInterface._global_mapping[HUB]
    for step in range(2):
        monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
        loss, grads, calls = counted_step(model, inputs, kernel_op, whole_step=True)
        assert AttentionInterface._global_mapping[HUB] is stock
        assert calls == {"varlen_fwd": 4, "varlen_bwd": 3} and handle.recomputes_served == 2 * (step + 1)
        assert torch.equal(loss, expected_loss)
        assert_same_grads(grads, expected)
    handle.remove()
    assert HUB not in ALL_ATTENTION_FUNCTIONS._local_mapping and ALL_ATTENTION_FUNCTIONS[HUB] is stock


def _exported(implementation):
    """The module Hugging Face's lazy import reads flash_attn_func from: flash-attn 3's interface, the kernel's
    package."""
    module = _interface_module(implementation)
    return module if implementation == "flash_attention_3" else sys.modules[module.__name__.partition(".")[0]]


@pytest.mark.parametrize("replacement", ["wrapper", "none"])
def test_functions_that_are_not_the_interfaces_own_are_refused_at_install(implementation, monkeypatch, replacement):
    """A wrapper around flash_attn_func (functools.wraps copies its name and module), whose effect the stash's replay
    would skip, or a kernel without flash_attn_func (a varlen-only one): refused at install, naming them."""
    import transformers.modeling_flash_attention_utils as flash_utils

    exported = _exported(implementation)
    function = exported.flash_attn_func

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **{**kwargs, "softcap": 5.0})

    monkeypatch.setattr(exported, "flash_attn_func", wrapper if replacement == "wrapper" else None)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    got = r"<function flash_attn_func at .*>" if replacement == "wrapper" else "None"
    with pytest.raises(AttentionStashError,
                       match=f"needs the flash_attn_func and flash_attn_varlen_func of a flash-attn interface module "
                       f"for attn_implementation=\"{implementation}\", got {got} and <function flash_attn_varlen_func "
                       rf"at .*>, which are not \(a wrapper around them, or a kernel without them\)"):
        attention_stash.install_attention_stash(kernel_model("llama", implementation), 1)
    assert attention_stash._held is None


def test_kernel_functions_of_another_signature_are_refused_at_install(implementation, monkeypatch):
    """Kernel functions that take other arguments than the family's (flash-attn 2.6's took the window as a tuple):
    refused at install, naming the function and its parameters."""
    module = _interface_module(implementation)

    def older_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
        raise AssertionError("not called")

    monkeypatch.setattr(module, "_flash_attn_forward", older_forward)
    with pytest.raises(AttentionStashError,
                       match=r"got .* _flash_attn_forward\(q, k, v, dropout_p, softmax_scale, causal, window_size, "
                       r"softcap, alibi_slopes, return_softmax\)\. Install "):
        attention_stash.install_attention_stash(kernel_model("llama", implementation), 1)
    assert attention_stash._held is None


@MODES
def test_an_install_between_a_forward_and_its_backward_leaves_it_served(install, implementation, use_reentrant):
    """Another model's install (and a refused one) between a stashed forward and its backward: the install finds the
    same functions, and the pending recompute is served with the ops its forward kept."""
    model = kernel_model("llama", implementation, use_reentrant)
    inputs, _ = make_batch("plain")
    expected_loss, expected, _ = counted_step(model, inputs, kernel_op, whole_step=True)
    handle = install(model, 3)
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    install(kernel_model("llama", implementation, use_reentrant), 3)
    with pytest.raises(AttentionStashError, match="needs one install per decoder layer"):
        attention_stash.install_attention_stash(model, 3)
    loss.backward()
    assert handle.recomputes_served == 3
    assert torch.equal(loss.detach(), expected_loss)
    assert_same_grads(param_grads(model), expected)


def test_a_registration_after_a_hub_kernels_install_is_not_shadowed(install, monkeypatch, tmp_path_factory):
    """The stash's entry for a Hub kernel stands in front of the library-wide registration: a function registered
    there after the install is what an unstashed layer calls, and a stashed layer's call refuses it, naming both."""
    from transformers.modeling_utils import AttentionInterface

    use_hub_kernel(monkeypatch, tmp_path_factory, HUB)
    model = kernel_model("llama", HUB)
    handle = install(model, 2)
    stock, calls = AttentionInterface._global_mapping[HUB], []

    def registered(module, *args, **kwargs):
        calls.append(module)
        return stock(module, *args, **kwargs)

    AttentionInterface.register(HUB, registered)
    before = tensors()
    with pytest.raises(AttentionStashError,
                       match=rf"needs the attention of model\.layers\.1 to run the {HUB} function it served at the "
                       f"install, <function flash_attention_forward at .*>, got <function .*registered at .*> "
                       rf"registered for it since\. Register attention functions before installing the stash"):
        model(**make_batch("plain")[0])
    assert calls == [model.model.layers[0].self_attn] and handle.num_kept == 0
    assert live_checkpoint_calls() == [] and live_tensors(before, model, counted=real_2d) == []


# ---------------------------------------------------------------------------------------------------------------------
# The mirrors of the Hub builds (hub_builds/), pinned to the real builds' files.
# ---------------------------------------------------------------------------------------------------------------------

# The kernel functions of each real build's torch-ext/<package>/flash_attn_interface.py, in
# huggingface/kernels-community: whether they are custom ops in the build's namespace (torch.library.custom_op with
# add_op_namespace_prefix), and each one's parameters in order, as the real file defines them, read at the version
# and commit READ_AT names (the newest source this project could read: transformers 5.25 asks for flash-attn2 4 and
# flash-attn3 2, whose interface files were not reachable; flash-attn3 2 also exports its _ops module's names).
READ_AT = {
    "kernels-community/flash-attn2":
    "Read at version 3 (huggingface/kernels-community 2d6ecf3c",
    "kernels-community/flash-attn3":
    "Read at version 1 (huggingface/kernels-community 8e6f8376",
    "kernels-community/vllm-flash-attn3":
    "Read at version 1, the version transformers 5.22 to 5.25 ask for "
    "(huggingface/kernels-community df070bae",
}
# The versions transformers asks for (get_attn_kernel_version): flash-attn3's is 1 up to 5.24, 2 from 5.25.
ASKED = {HUBS[0]: 4, HUBS[1]: 2 if Version(transformers.__version__) >= Version("5.25") else 1, HUBS[2]: 1}
_FA2_KERNEL = "dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes"
_FA3_FORWARD = ("q k v k_new v_new qv {out} cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k "
                "max_seqlen_q max_seqlen_k page_table kv_batch_idx leftpad_k rotary_cos rotary_sin seqlens_rotary "
                "q_descale k_descale v_descale softmax_scale causal {window} softcap rotary_interleaved "
                "scheduler_metadata num_splits pack_gqa sm_margin{sinks}")
_FA3_BACKWARD = ("dout q k v out softmax_lse cu_seqlens_q cu_seqlens_k sequed_q sequed_k max_seqlen_q max_seqlen_k dq "
                 "dk dv softmax_scale {causal} softcap deterministic sm_margin")
REAL_KERNEL_FUNCTIONS = {
    HUBS[0]: (True, {
        "_flash_attn_forward":
        f"q k v {_FA2_KERNEL} return_softmax",
        "_flash_attn_varlen_forward": (f"q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k {_FA2_KERNEL} "
                                       f"return_softmax block_table leftpad_k seqused_k zero_tensors"),
        "_flash_attn_backward":
        f"dout q k v out softmax_lse dq dk dv {_FA2_KERNEL} deterministic rng_state",
        "_flash_attn_varlen_backward": (f"dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q "
                                        f"max_seqlen_k {_FA2_KERNEL} deterministic rng_state zero_tensors"),
    }),
    HUBS[1]: (True, {
        "_flash_attn_forward":
        _FA3_FORWARD.format(out="out_", window="window_size_left window_size_right attention_chunk", sinks=""),
        "_flash_attn_backward":
        _FA3_BACKWARD.format(causal="is_causal window_size_left window_size_right"),
    }),
    HUBS[2]: (False, {
        "_flash_attn_forward": _FA3_FORWARD.format(out="out", window="window_size", sinks=" s_aux"),
        "_flash_attn_backward": _FA3_BACKWARD.format(causal="causal window_size"),
    }),
}


@pytest.mark.parametrize("repo_id", HUBS)
def test_the_mirrors_kernel_functions_are_the_real_builds(monkeypatch, tmp_path_factory, repo_id):
    """Each mirror's kernel functions are what the real build's are: custom ops in the build's namespace, with a fake
    kernel that runs them on meta, where the real ones are (flash-attn2's, flash-attn3's), plain functions where they
    are (vllm-flash-attn3's); with the real file's parameters, in order. A mirror cannot drift to fit the stash. Each
    mirror names the version and commit it was read at; the local build carries the version transformers asks for and
    exports what the real package exports there of the stash's concern (flash-attn3's _ops names from version 2)."""
    from torch._library.custom_ops import CustomOpDef
    from transformers.integrations.hub_kernels import get_attn_kernel_version

    kernel = use_hub_kernel(monkeypatch, tmp_path_factory, repo_id)
    module = sys.modules[f"{kernel.__name__}.flash_attn_interface"]
    assert READ_AT[repo_id] in " ".join(module.__doc__.split())
    version = get_attn_kernel_version(repo_id)
    assert HUB_BUILDS[repo_id].version == version == ASKED[repo_id]
    exported = {"ops", "add_op_namespace_prefix"} <= set(kernel.__all__)
    assert exported == (repo_id == HUBS[1] and version >= 2)
    custom_ops, functions = REAL_KERNEL_FUNCTIONS[repo_id]
    for name, parameters in functions.items():
        function = getattr(module, name)
        assert isinstance(function, CustomOpDef) == custom_ops, name
        if custom_ops:
            assert function._qualname == f"{kernel.__name__}::{name}"
            assert [argument.name for argument in function._opoverload._schema.arguments] == parameters.split(), name
        else:
            assert list(inspect.signature(function).parameters) == parameters.split(), name
    # A forward on meta: through the fake kernel of the custom op, or the compiled op's.
    query = torch.empty(2, 8, 4, 16, device="meta", dtype=DTYPE)
    key = torch.empty(2, 8, 2, 16, device="meta", dtype=DTYPE)
    out = kernel.flash_attn_func(query, key, key, causal=True)
    out = out[0] if isinstance(out, tuple) else out
    assert (out.device.type, out.shape, out.dtype) == ("meta", query.shape, DTYPE)


# ---------------------------------------------------------------------------------------------------------------------
# On the meta device, through the stand-ins' fake kernels.
# ---------------------------------------------------------------------------------------------------------------------


@MODES
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_a_step_on_meta(install, implementation, packed, use_reentrant):
    """The decoder layers on meta tensors in bfloat16, called as the model calls them (a packed batch passes its
    cu_seqlens, as a padding-free collator does): every call served, the kept bytes the planner's, every parameter a
    gradient of its shape and dtype, nothing left after."""
    with torch.device("meta"):
        model = kernel_model("llama_head_dim_36", implementation, use_reentrant)
    handle = install(model, 3)
    counter = meta_step(model, handle, packed, CountOps(kernel_op), 3)
    assert counter.calls == dict(zip(kernel_ops(implementation, "packed" if packed else "plain"), (3, 3)))
    assert live_tensors(model=model, counted=meta_of_a_batch) == [] and live_checkpoint_calls() == []


def test_the_meta_layout_is_flash_attn_3s(monkeypatch):
    """What the stash keeps of a flash-attn 3 call (the unpadded output, the log-sum-exp) is what flash-attn 3's op
    returns, in layout and dtype, and what the planner counts."""
    use_flash_attention_3(monkeypatch)
    ops = attention_stash._load_flash(attention_stash._implementation("flash_attention_3")).ops
    query = torch.empty(2, 72, 4, 36, device="meta", dtype=DTYPE)
    key = torch.empty(2, 72, 2, 36, device="meta", dtype=DTYPE)
    output, (lse, *cu_seqlens), scalars = ops.kernel(query, key, key, None,
                                                     attention_stash._FlashArguments(softmax_scale=36**-0.5))
    assert output.shape == (2, 72, 4, 36) and cu_seqlens == [] and scalars == ()
    assert (lse.shape, lse.dtype) == ((2, 4, 72), torch.float32)
    assert output.nbytes + lse.nbytes == ops.kept_bytes(2, 4, 72, 36, DTYPE)


# ---------------------------------------------------------------------------------------------------------------------
# Bound against the own autograd functions of flash-attn 3 and of its Hub builds.
# ---------------------------------------------------------------------------------------------------------------------

FLASH_3_BUILDS = pytest.mark.parametrize("implementation", ["flash_attention_3", *HUBS[1:]])


class Recorder:
    """Stands in for the two kernel functions of a flash-attn 3 interface ``module``: records each call's arguments;
    the forward returns sentinels of distinct values (output, log-sum-exp, and the two accumulators), the backward
    fills dq, dk, dv."""

    def __init__(self, monkeypatch, module):
        self.calls = []
        for name in ("_flash_attn_forward", "_flash_attn_backward"):
            monkeypatch.setattr(module, name, self._kernel(name, getattr(module, name)))

    def _kernel(self, name, original):

        def kernel(*args, **kwargs):
            # Each call by parameter name, as the kernel function it stands in for binds it.
            bound = bound_arguments(original, args, kwargs)
            self.calls.append((name, bound))
            if name == "_flash_attn_forward":
                query, cu_seqlens = bound["q"], bound["cu_seqlens_q"]
                lse_shape = (4, query.shape[0]) if cu_seqlens is not None else (query.shape[0], 4, query.shape[1])
                return torch.full_like(query, 7.0), torch.full(lse_shape, 11.0), torch.empty(0), torch.empty(0)
            for buffer, value in zip(("dq", "dk", "dv"), (19.0, 23.0, 29.0)):
                bound[buffer].fill_(value)
            return (bound["dq"], bound["dk"], bound["dv"], torch.empty(0))

        return kernel


def _flash3_case(varlen, deterministic=False):
    """Query, key, value and the arguments of one call, each of a distinct value where two share a type."""
    generator = torch.Generator().manual_seed(0)
    shape = (8, ) if varlen else (2, 4)
    query, key, value = (torch.randn(*shape, heads, 16, generator=generator, requires_grad=True)
                         for heads in (4, 2, 2))
    cu_seqlens = dict(cu_seqlens_q=torch.tensor([0, 3, 8], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32),
                      max_seqlen_q=5,
                      max_seqlen_k=4) if varlen else {}
    arguments = attention_stash._FlashArguments(softmax_scale=0.25,
                                                causal=True,
                                                window_size=(3, 5),
                                                softcap=2.5,
                                                deterministic=deterministic,
                                                num_splits=3,
                                                pack_gqa=False,
                                                sm_margin=7,
                                                **cu_seqlens)
    return query, key, value, arguments


def _theirs_3(module, varlen, query, key, value, a, grad):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda t: t):
        options = dict(softmax_scale=a.softmax_scale,
                       causal=a.causal,
                       window_size=a.window_size,
                       softcap=a.softcap,
                       num_splits=a.num_splits,
                       pack_gqa=a.pack_gqa,
                       deterministic=a.deterministic,
                       sm_margin=a.sm_margin)
        if varlen:
            out = module.flash_attn_varlen_func(query, key, value, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q,
                                                a.max_seqlen_k, **options)
        else:
            out = module.flash_attn_func(query, key, value, **options)
    # vLLM's functions return the log-sum-exp too, which Hugging Face drops.
    out = out[0] if isinstance(out, tuple) else out
    return out, saved, torch.autograd.grad(out, (query, key, value), grad)


def _ours_3(implementation, ops, query, key, value, a, grad):
    """The stash's call in a bare checkpoint call: its first pass without grad, then its recompute."""
    from attention_stash_helpers import bare_call

    call, counters = bare_call(lambda *inputs: attention_stash._state.call.attend(ops, *inputs, None, a),
                               implementation)
    with torch.no_grad():
        call(query.detach(), key.detach(), value.detach())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda t: t):
        out = call(query, key, value)
    assert counters.recomputes_served == 1
    return out, saved, torch.autograd.grad(out, (query, key, value), grad)


def _flash_3_interface(monkeypatch, tmp_path_factory, implementation):
    """flash-attn 3's interface, or a Hub build's, loaded as the install loads it; its module."""
    if implementation == "flash_attention_3":
        use_flash_attention_3(monkeypatch)
    else:
        use_hub_kernel(monkeypatch, tmp_path_factory, implementation)
    interface = attention_stash._load_flash(attention_stash._implementation(implementation))
    return interface, sys.modules[interface.function.__module__]


def _bound_case(monkeypatch, tmp_path_factory, implementation, varlen, ops=None, deterministic=False):
    interface, module = _flash_3_interface(monkeypatch, tmp_path_factory, implementation)
    recorder = Recorder(monkeypatch, module)
    query, key, value, arguments = _flash3_case(varlen, deterministic)
    grad = torch.randn(query.shape, generator=torch.Generator().manual_seed(4))
    theirs = _theirs_3(module, varlen, query, key, value, arguments, grad)
    their_calls = recorder.calls[:]
    ops = ops or (interface.varlen_ops if varlen else interface.ops)
    ours = _ours_3(implementation, ops, query, key, value, arguments, grad)
    return ours, theirs, recorder.calls[len(their_calls):], their_calls


@FLASH_3_BUILDS
@pytest.mark.parametrize("deterministic", [False, True], ids=["nondeterministic", "deterministic"])
@pytest.mark.parametrize("varlen", [False, True], ids=["flash_attn_func", "flash_attn_varlen_func"])
def test_kernel_calls_and_saves_follow_flash_attn_3s_functions(monkeypatch, tmp_path_factory, implementation, varlen,
                                                               deterministic):
    """The stash calls the forward and backward kernel functions of flash-attn 3 (of its Hub build, of vLLM's) as its
    FlashAttnFunc (FlashAttnVarlenFunc) calls them, argument for argument, deterministic backwards among them, and its
    node saves what that function saves, in its order: (query, key, value, output, log-sum-exp, [cu_seqlens_q,
    cu_seqlens_k]); its output and gradients are that function's."""
    ours, theirs, calls, their_calls = _bound_case(monkeypatch,
                                                   tmp_path_factory,
                                                   implementation,
                                                   varlen,
                                                   deterministic=deterministic)
    (out, saved, grads), (their_out, their_saved, their_grads) = ours, theirs
    assert_same_calls(calls, their_calls)
    assert calls[-1][1]["deterministic"] is deterministic
    assert len(saved) == len(their_saved) == (7 if varlen else 5)
    assert all(same_value(mine, their) for mine, their in zip(saved, their_saved))
    assert same_value(out, their_out)
    assert all(same_value(mine, their) for mine, their in zip(grads, their_grads))


@FLASH_3_BUILDS
def test_a_planted_swap_in_flash_attn_3s_backward_is_caught(monkeypatch, tmp_path_factory, implementation):
    """A backward that passes the two window sizes swapped fails the comparison, as would any two arguments of a
    type swapped: the window by its pair, or by its left size where the kernel function takes the two apart."""
    ops = _flash_3_interface(monkeypatch, tmp_path_factory, implementation)[0].varlen_ops

    def swapped_backward(grad, q, k, v, mask, out, tensors, scalars, a, needs_grad):
        swapped = dataclasses.replace(a, window_size=a.window_size[::-1])
        return ops.backward(grad, q, k, v, mask, out, tensors, scalars, swapped, needs_grad)

    _, _, calls, their_calls = _bound_case(monkeypatch, tmp_path_factory, implementation, True,
                                           dataclasses.replace(ops, backward=swapped_backward))
    with pytest.raises(AssertionError, match="_flash_attn_backward', 'window_size(_left)?'"):
        assert_same_calls(calls, their_calls)


def test_nothing_is_left_installed(monkeypatch, tmp_path_factory):
    """After an install and removal on each implementation, Hugging Face's objects are their own again."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for implementation in IMPLEMENTATIONS:
        with monkeypatch.context() as patch:
            if implementation in HUBS:
                use_hub_kernel(patch, tmp_path_factory, implementation)
            else:
                use_flash_attention_3(patch)
            handle = attention_stash.install_attention_stash(kernel_model("llama", implementation), 3)
            handle.remove()
            assert attention_stash._held is None and implementation not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert_stock_process()
