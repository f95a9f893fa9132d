# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash's CUDA paths, run end to end on the meta device, on any machine.

PyTorch registers meta kernels for its CUDA attention ops (cuDNN, flash and memory-efficient attention) and their
backwards, in CPU builds too, and autograd runs them on meta tensors: shapes, dtypes, strides and the graph, without
values. Here tiny models are built on the meta device in bfloat16 and their decoder layers are called directly, with
position embeddings (Hugging Face's mask creation reads tensor values, which meta tensors do not have), in both
checkpoint modes, with the stash on every attention layer. The module's code runs unchanged; two substitutions live
in this test only: ``torch._fused_sdp_choice`` answers the backend under test, as PyTorch would for those inputs
(flash takes no mask; memory-efficient attention takes no unexpanded grouped heads; cuDNN takes both), and ("meta",
that backend) maps to the backend table's CUDA entry.

Each case checks that every recompute was served, that the bytes kept are the planner's for that backend's layout,
that nothing is kept or alive after the step, that every parameter got a gradient of its shape and dtype, and, under
non-reentrant checkpointing, that the first pass's graph holds the stash's node for each call (the checkpoint's own
check compares the metadata of each of its saves with the recompute node's).

What the meta device cannot check: values (the forward's output, the gradients, bitwise or close), and the
comparison of the stash's mask preparation with F.sdpa's own, which runs F.sdpa's C++ dispatch (marked done here).
tests/benchmarks/gpu_check.sh runs both on a GPU.
"""

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError

from attention_stash_helpers import (QWEN3_NEXT_HYBRID, CountOps, checkpointed, graph_nodes, live_checkpoint_calls,
                                     live_tensors)

BATCH = 2
# No dimension of the models' parameters has this size; not a multiple of 32, so that the memory-efficient kernel
# pads its log-sum-exp.
SEQUENCE = 72
DTYPE = torch.bfloat16
MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])

BACKENDS = {
    "cudnn": (SDPBackend.CUDNN_ATTENTION, attention_stash._CUDNN),
    "flash": (SDPBackend.FLASH_ATTENTION, attention_stash._FLASH),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, attention_stash._EFFICIENT),
}

_SMALL = dict(vocab_size=128,
              hidden_size=64,
              intermediate_size=64,
              num_attention_heads=4,
              num_key_value_heads=2,
              head_dim=16,
              attn_implementation="sdpa")
# name: (model class, config class, config beyond _SMALL, attention layers, attention calls per attention layer)
MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2), 2, 1),
    "llama_full_heads": ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2, num_key_value_heads=4), 2, 1),
    # 36 is not a multiple of 8: flash attention pads it to 40, and keeps its output so.
    "llama_head_dim_36": ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2, head_dim=36), 2, 1),
    # Each attention module's forward runs twice per layer forward: two attention calls, kept and replayed in order.
    "llama_two_calls": ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2), 2, 2),
    # The seed's family: query and key norms before RoPE, a mixture of experts after attention.
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(num_hidden_layers=2, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2), 2, 1),
    # A hybrid: three gated-delta-net (linear attention) layers per full-attention layer.
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   dict(num_hidden_layers=4,
                        **QWEN3_NEXT_HYBRID,
                        layer_types=["linear_attention", "linear_attention", "full_attention",
                                     "linear_attention"]), 1, 1),
}
# (backend, model, masked): what PyTorch would pick each backend for. Memory-efficient attention gets models with as
# many key/value heads as query heads; flash attention gets no mask. The seed's family runs on cuDNN, the backend
# PyTorch picks for it on Hopper; on the others its attention is Llama's for the stash (merged in issue 58).
CASES = [
    ("cudnn", "llama", False),
    ("cudnn", "llama", True),
    ("cudnn", "llama_full_heads", True),
    ("cudnn", "llama_two_calls", False),
    ("cudnn", "qwen3_moe", False),
    ("cudnn", "qwen3_next", False),
    ("flash", "llama", False),
    ("flash", "llama_full_heads", False),
    ("flash", "llama_head_dim_36", False),
    ("flash", "llama_two_calls", False),
    ("flash", "qwen3_next", False),
    ("efficient", "llama_full_heads", False),
    ("efficient", "llama_full_heads", True),
]


def _pytorch_choice(backend):
    """torch._fused_sdp_choice for a machine where ``backend`` is PyTorch's first choice: the math backend where that
    backend does not take the inputs, as PyTorch's constraints have it."""

    def choose(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if backend is SDPBackend.FLASH_ATTENTION and attn_mask is not None:
            return SDPBackend.MATH.value
        if backend is SDPBackend.EFFICIENT_ATTENTION and key.shape[-3] != query.shape[-3]:
            return SDPBackend.MATH.value
        return backend.value

    return choose


def use_backend_on_meta(monkeypatch, name):
    """Serve the backend ``name`` on the meta device from a fresh process's state; returns the table's ops for it."""
    backend, ops = BACKENDS[name]
    monkeypatch.setattr(torch, "_fused_sdp_choice", _pytorch_choice(backend))
    monkeypatch.setitem(attention_stash._BACKENDS, ("meta", backend.value), ops)
    # F.sdpa's own mask preparation does not run on meta: the GPU check compares it.
    monkeypatch.setattr(attention_stash, "_MASKS_CHECKED", {(ops, torch.bool, DTYPE)})
    return ops


@pytest.fixture
def cuda_backend_on_meta(monkeypatch):
    return lambda name: use_backend_on_meta(monkeypatch, name)


def _meta_model(name):
    model_class, config_class, extra, _, calls = MODELS[name]
    if not hasattr(transformers, model_class):
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    config = getattr(transformers, config_class)(**{**_SMALL, **extra})
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config).to(DTYPE)
    if calls > 1:
        for layer in model.model.layers:
            forward = layer.self_attn.forward

            def repeated(*args, forward=forward, **kwargs):
                outputs = [forward(*args, **kwargs) for _ in range(calls)]
                return sum(output[0] for output in outputs), outputs[0][1]

            layer.self_attn.forward = repeated
    return model


def _layers_forward(model, mask):
    """The decoder layers' forward on a meta batch, as the model's forward would call them: the last hidden states
    and the first layer's input."""
    inputs = torch.empty(BATCH, SEQUENCE, model.config.hidden_size, device="meta", dtype=DTYPE, requires_grad=True)
    positions = torch.arange(SEQUENCE, device="meta").unsqueeze(0)
    embeddings = model.model.rotary_emb(inputs, positions)
    hidden = inputs
    for layer in model.model.layers:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=embeddings, position_ids=positions)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return hidden, inputs


def of_the_batch(tensor):
    """What the live-tensor checks count: a tensor of three or more dimensions with one of SEQUENCE."""
    return tensor.dim() >= 3 and SEQUENCE in tensor.shape


@MODES
@pytest.mark.parametrize("backend,model_name,masked",
                         CASES,
                         ids=[f"{b}-{m}-{'masked' if k else 'unmasked'}" for b, m, k in CASES])
def test_cuda_backend_training_step_on_meta(install, cuda_backend_on_meta, backend, model_name, masked, use_reentrant):
    ops = cuda_backend_on_meta(backend)
    model = checkpointed(_meta_model(model_name), use_reentrant=use_reentrant)
    _, _, _, attention_layers, calls = MODELS[model_name]
    handle = install(model, attention_layers)
    mask = torch.empty(BATCH, 1, SEQUENCE, SEQUENCE, device="meta", dtype=torch.bool) if masked else None

    hidden, inputs = _layers_forward(model, mask)
    config = model.config
    # The planner's layout for this backend is what the stash keeps.
    per_call = ops.kept_bytes(BATCH, config.num_attention_heads, SEQUENCE, config.head_dim, DTYPE)
    layer_bytes = attention_stash.attention_stash_layer_bytes(model, BATCH, SEQUENCE, device="meta")
    assert layer_bytes == per_call
    assert (handle.num_kept, handle.kept_bytes) == (attention_layers * calls, attention_layers * calls * per_call)

    # Reentrant checkpointing records no graph in the first pass; non-reentrant records the stash's node of each call.
    assert graph_nodes(hidden.grad_fn).count("_AttentionNodeBackward") == (0 if use_reentrant else attention_layers *
                                                                           calls)
    with CountOps() as backward:
        hidden.sum().backward()
    kernel_calls = (backward.calls[f"{ops.op}.default"], backward.calls[f"{ops.op}_backward.default"])
    assert kernel_calls == (0, attention_layers * calls)
    del hidden, mask
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (attention_layers * calls, 0, 0)
    assert handle.peak_kept_bytes == attention_layers * calls * per_call
    assert inputs.grad is not None and inputs.grad.shape == inputs.shape
    for name, param in model.named_parameters():
        if name.startswith("model.layers."):
            assert param.grad is not None, name
            assert (param.grad.shape, param.grad.dtype) == (param.shape, param.dtype), name
    del inputs
    assert live_tensors(counted=of_the_batch) == [] and live_checkpoint_calls() == []
    handle.remove()
    del model
    assert live_tensors(counted=of_the_batch) == []


def test_the_choice_follows_pytorchs_constraints():
    """The test's backend answer gives the math backend, which the stash refuses, where PyTorch would not pick the
    backend under test: flash attention for a masked call, memory-efficient attention for unexpanded grouped heads."""
    query = torch.empty(1, 4, 8, 16, device="meta")
    grouped = torch.empty(1, 2, 8, 16, device="meta")
    mask = torch.empty(1, 1, 8, 8, device="meta", dtype=torch.bool)
    flash = _pytorch_choice(SDPBackend.FLASH_ATTENTION)
    efficient = _pytorch_choice(SDPBackend.EFFICIENT_ATTENTION)
    assert flash(query, grouped, grouped, None) == SDPBackend.FLASH_ATTENTION.value
    assert flash(query, query, query, mask) == SDPBackend.MATH.value
    assert efficient(query, query, query, mask) == SDPBackend.EFFICIENT_ATTENTION.value
    assert efficient(query, grouped, grouped, None, enable_gqa=True) == SDPBackend.MATH.value
    with pytest.raises(AttentionStashError, match="a fused SDPA backend it can replay: .*got MATH on meta"):
        attention_stash._ops_for("meta", SDPBackend.MATH.value)


def test_a_mask_preparation_without_the_kernel_call_is_refused():
    """Where F.sdpa makes no call of the backend's kernel for the arguments (on the meta device it runs none of the
    CUDA kernels), the comparison of the masks has nothing to compare with, and refuses, naming the backend."""
    query = torch.empty(1, 4, 8, 16, device="meta", dtype=DTYPE)
    mask = torch.empty(1, 1, 8, 8, device="meta", dtype=torch.bool)
    ops = attention_stash._CUDNN
    bias = ops.prepare_mask(mask, query, query, query)
    with pytest.raises(AttentionStashError,
                       match=r"needs its mask for cuDNN attention to be the one F.scaled_dot_product_attention passes "
                       r"the kernel in torch .*, got another \(torch.bfloat16 \(1, 1, 8, 8\) against None \(\)\)"):
        attention_stash._check_mask_preparation(ops, SDPBackend.CUDNN_ATTENTION.value, bias, query, query, query, mask,
                                                False, None, False)


@MODES
@pytest.mark.parametrize("backend", [None, *BACKENDS], ids=["pytorchs_choice", *BACKENDS])
def test_an_sdpa_call_on_a_device_neither_cpu_nor_cuda_is_refused(install, monkeypatch, backend, use_reentrant):
    """The meta device without the CUDA table's entries: a device that is neither CPU nor CUDA, whose backend the
    table has no entry for. Its first stashed attention call is refused, naming the backend PyTorch chose and the
    device; no fused kernel runs, CUDA's entry for that backend neither, and nothing is kept. Once with PyTorch's own
    answer on meta (the math backend), and once for each fused backend of the table's CUDA entries, answered as a
    device whose PyTorch picks it would (XPU, say): the choice alone must not pick CUDA's kernel."""
    if backend is not None:
        monkeypatch.setattr(torch, "_fused_sdp_choice", _pytorch_choice(BACKENDS[backend][0]))
    # Four key/value heads: each fused backend takes the unmasked call.
    model = checkpointed(_meta_model("llama_full_heads"), use_reentrant=use_reentrant)
    handle = install(model, MODELS["llama_full_heads"][3])
    query = torch.empty(BATCH, 4, SEQUENCE, 16, device="meta", dtype=DTYPE, requires_grad=True)
    chosen = SDPBackend(torch._fused_sdp_choice(query, query, query)).name
    assert chosen == ("MATH" if backend is None else BACKENDS[backend][0].name)
    fused = {f"{ops.op}.default" for ops in attention_stash._BACKENDS.values()}
    with CountOps(lambda func: func.__name__ if func.__name__ in fused else None) as kernels, pytest.raises(
            AttentionStashError,
            match=r"^attention stash needs PyTorch to choose a fused SDPA backend it can replay: .*; got "
            rf"{chosen} on meta\. The math backend and any other have no exact replay\."):
        _layers_forward(model, None)
    assert kernels.calls == {}
    assert (handle.num_kept, handle.kept_bytes, handle.recomputes_served) == (0, 0, 0)
    assert live_checkpoint_calls() == []
