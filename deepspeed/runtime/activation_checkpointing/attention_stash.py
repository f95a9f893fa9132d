# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
Keep the attention output of Hugging Face decoder layers for their checkpoint recompute.

With per-layer activation checkpointing, the backward pass runs every decoder layer forward again. For the layers it
is installed on, the attention stash keeps the first forward's attention output and log-sum-exp, from the layer's
forward to its recompute, and hands them to the attention backward: the recompute skips the attention forward.

Contents, in reading order:

- Records and errors: ``AttentionStashError``, what one attention call keeps, the arguments compared between passes.
- Kernels: the table of PyTorch's fused SDPA backends, the flash-attn interfaces the stash knows (flash-attn 2's, 3's
  and 4's, from a package or a Hub kernel), and ``_AttentionNode``, the one autograd node that runs or replays a kernel
  in both passes of both checkpoint modes.
- One checkpoint call: ``_CheckpointCall``, run by a stashed layer's checkpoint in place of the layer's function, with
  the one skeleton of an attention call, and what it keeps offloaded where the checkpoint offloads its inputs
  (DeepSpeed's offload engine); under torch.compile, the checkpoint's selective-checkpointing policy instead.
- The implementations table: a record per attention implementation served ("sdpa", "flash_attention_2" to "_4", a Hub
  kernel's): how the stash's copy of Hugging Face's function reaches the checkpoint call, how its kernels are loaded
  and checked, its planner geometry.
- The hold on Hugging Face's objects: the layer class's checkpoint-function slot and the interface's entries.
- Discovery and the planner: a plan per attention layer, made once per install, and a rank's bytes (ALST, AutoTP).
- The installer and the handle: ``install_attention_stash``, ``AttentionStashHandle``, and the planner's functions.
"""

import dataclasses
import importlib.metadata
import inspect
import itertools
import math
import operator
import re
import sys
import threading
import types
import weakref
from collections import Counter
from dataclasses import dataclass
from functools import cached_property, partial, reduce

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.utils.checkpoint
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import CheckpointPolicy as _Policy
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from deepspeed.accelerator import get_accelerator
from deepspeed.module_inject.layers import LinearAllreduce
from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size
from deepspeed.runtime.activation_checkpointing import checkpointing as _ds_checkpointing
from deepspeed.runtime.activation_checkpointing import offload_activations as _ds_offload
from deepspeed.utils import log_dist, logger

__all__ = [
    "AttentionStashError", "AttentionStashHandle", "install_attention_stash", "attention_stash_layer_bytes",
    "attention_stash_layers_for_budget"
]

aten = torch.ops.aten

_FEATURE = "attention stash"
# PyTorch's builtin that Hugging Face's sdpa function calls as torch.nn.functional's, where nothing replaced it there.
_SDPA = torch._C._nn.scaled_dot_product_attention
# PyTorch entry points beyond the public API; the installer checks them, with the kernels of the backend table.
_TORCH_ENTRY_POINTS = ("_fused_sdp_choice", "_C._current_graph_task_id", "_C._set_grad_enabled",
                       "_C._is_any_autocast_enabled", "_C._are_functorch_transforms_active",
                       "_C._dynamo.eval_frame.get_eval_frame_callback", "utils.checkpoint._StopRecomputationError",
                       "utils.checkpoint._checkpoint_hook", "_C._autograd._top_saved_tensors_default_hooks")
# What a non-reentrant checkpoint raises from its recompute's last save, to stop the recompute there.
_StopRecomputationError = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
# The attribute in which Hugging Face keeps a decoder layer's checkpoint function, read at every checkpointed call.
_CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"
# The name under which Hugging Face's modeling code reaches its attention interface.
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"

# ---------------------------------------------------------------------------------------------------------------------
# Records and errors.
# ---------------------------------------------------------------------------------------------------------------------


class AttentionStashError(RuntimeError):
    """Raised where the stash cannot serve a setup, instead of falling back: its message names the cause and fix."""


@dataclass(slots=True, eq=False)
class _Kept:
    """One attention call of a first pass, until the recompute's call of the same index: the kernel's ops and
    arguments, what the kernel returned (output; other saved tensors, log-sum-exp first; scalars), the bytes counted,
    the output's version and, offloaded, the (log-sum-exp, output) tokens of the offload engine (``_fetch``)."""

    ops: object
    arguments: object
    output: torch.Tensor = None
    tensors: tuple = ()
    scalars: tuple = ()
    nbytes: int = 0
    version: int = 0
    host: tuple = None


@dataclass(slots=True, eq=False)
class _SdpaArguments:
    """The arguments of one F.scaled_dot_product_attention call that its kernel's backward takes (its mask is saved
    as a tensor)."""

    is_causal: bool
    scale: float

    def differing(self, other):
        """The name of the first argument in which ``other`` differs from these; None for none."""
        return "is_causal" if self.is_causal != other.is_causal else "scale" if self.scale != other.scale else None

    def fix(self, name):
        return "Keep a layer's attention arguments the same from a forward to its backward"


@dataclass(slots=True, eq=False)
class _FlashArguments:
    """The arguments of one flash-attn call, flash-attn's defaults by default: the varlen ones are None for a plain
    batch's flash_attn_func."""

    dropout_p: float = 0.0
    softmax_scale: float = None
    causal: bool = False
    window_size: tuple = None  # none given: its family's default, no window
    softcap: float = 0.0
    alibi_slopes: torch.Tensor = None
    deterministic: bool = False
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_k: int = None
    return_attn_probs: bool = False
    block_table: torch.Tensor = None
    # flash-attn 3's: its varlen function's and the arguments it adds (its defaults); it has no dropout_p.
    seqused_q: torch.Tensor = None
    seqused_k: torch.Tensor = None
    qv: torch.Tensor = None
    q_descale: torch.Tensor = None
    k_descale: torch.Tensor = None
    v_descale: torch.Tensor = None
    attention_chunk: int = 0
    num_splits: int = 1
    pack_gqa: bool = None
    sm_margin: int = 0
    # Attention sinks (gpt-oss's), in each row's normaliser and so in the log-sum-exp: vLLM's flash-attn 3's, to which
    # its backward gives no gradient, and flash-attn 4's, which the stash's node takes as an input for their gradient.
    s_aux: torch.Tensor = None
    learnable_sink: torch.Tensor = None
    # The cu_seqlens' and sinks' version counters at the call: a padding-free collator's reach both passes as the same
    # tensors. Then flash-attn 4's arguments the stash does not model, by name (_flash_arguments).
    versions: tuple = None
    others: dict = None

    def __post_init__(self):
        if self.cu_seqlens_q is not None or self.s_aux is not None or self.learnable_sink is not None:
            self.versions = tuple(getattr(getattr(self, name), "_version", None) for name in _FLASH_TENSORS)

    def differing(self, other):
        """As _SdpaArguments.differing; cu_seqlens and sinks by value, or by version where both passes got the same
        tensor (frozen sinks cast to the query's dtype are a new tensor in each pass)."""
        for name in ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_size", "softcap",
                     "deterministic", "dropout_p", "sm_margin"):
            if getattr(self, name) != getattr(other, name):
                return name
        if self.alibi_slopes is not other.alibi_slopes:
            return "alibi_slopes"
        for name, version in zip(_FLASH_TENSORS, self.versions or (None, ) * 4):
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours is theirs:
                if theirs is not None and theirs._version != version:
                    return f"{name} (changed in place)"
            elif theirs is None or ours is None or ours.shape != theirs.shape or not torch.equal(ours, theirs):
                return name
        return None

    def fix(self, name):
        if name.startswith(("cu_seqlens", "max_seqlen")):
            return ("Keep the batch's packing, padding, position_ids and cu_seq_lens the same from a forward to its "
                    "backward")
        return ("Keep flash-attn's settings (FLASH_ATTENTION_DETERMINISTIC, a layer's softcap, window, scale and "
                "sinks) the same from a forward to its backward")

    def varlen(self):
        """The varlen function's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); () for a plain call."""
        return () if self.cu_seqlens_q is None else (self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q,
                                                     self.max_seqlen_k)

    def unserved(self):
        """The first argument given that asks for more than the attention output of plain softmax attention (an
        extra output, a paged cache, FP8 scales, another input, chunked attention, a score or mask modification,
        block sparsity, a gather), as name=value; None for none."""
        for name in ("return_attn_probs", "block_table", "seqused_q", "seqused_k", "qv", "q_descale", "k_descale",
                     "v_descale", "attention_chunk"):
            value = getattr(self, name)
            if value is not None and value is not False and not (type(value) is int and value == 0):
                return f"{name}={value!r}"
        given = ((name, value) for name, value in (self.others or {}).items()
                 if value is not None and value is not False)
        return next((f"{name}={value!r}" for name, value in given), None)


# The tensors compared between the passes by value, or by version where both passes got the same one.
_FLASH_TENSORS = ("cu_seqlens_q", "cu_seqlens_k", "s_aux", "learnable_sink")

# ---------------------------------------------------------------------------------------------------------------------
# Kernels. Each ``kernel`` runs a forward op, returning (output, the other tensors its backward takes, log-sum-exp
# first, scalars); each ``backward`` calls the backward op with exactly the arguments of the forward's derivative in
# PyTorch's derivatives.yaml (flash-attn's: of its autograd function's backward). _AttentionNode runs both.
# ---------------------------------------------------------------------------------------------------------------------


def _float_mask(mask, query, key=None, value=None):
    """A boolean mask as the additive mask F.sdpa makes of it (0 where attended, -inf elsewhere, in the query's
    dtype); any other mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=query.dtype, device=mask.device)
    return torch.where(mask, zero, torch.full((), -math.inf, dtype=query.dtype, device=mask.device))


def _efficient_mask(mask, query, key, value):
    """As F.sdpa's preprocess_mask: a bias whose strides the kernel cannot load is padded and sliced back (aligned
    rows; PyTorch 2.13 aligns to 8, older releases to 16), then expanded to [batch, query heads, queries, keys]."""
    bias = _float_mask(mask, query)
    if bias is None:
        return None
    if bias.stride(-1) != 1 or any(stride % 16 for stride in bias.stride()[:-1]):
        size = bias.shape[-1]
        bias = F.pad(bias, (0, 16 - size % 16))[..., :size]
    return bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _cpu_flash_kernel(q, k, v, mask, a):
    kernel = torch._scaled_dot_product_flash_attention_for_cpu
    out, lse = kernel(q, k, v, 0.0, a.is_causal, attn_mask=mask, scale=a.scale)
    return out, (lse, ), ()


def _cpu_flash_backward(grad, q, k, v, mask, out, tensors, scalars, a, needs_grad):
    op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    return op(grad, q, k, v, out, *tensors, 0.0, a.is_causal, attn_mask=mask, scale=a.scale)


def _cudnn_kernel(q, k, v, mask, a):
    # compute_log_sumexp=True: under the checkpoint's no_grad first forward F.sdpa would skip the log-sum-exp.
    outputs = torch._scaled_dot_product_cudnn_attention(q, k, v, mask, True, 0.0, a.is_causal, False, scale=a.scale)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = outputs
    return out, (lse, seed, offset, cum_q, cum_k), (max_q, max_k)


def _cudnn_backward(grad, q, k, v, mask, out, tensors, scalars, a, needs_grad):
    lse, seed, offset, cum_q, cum_k = tensors
    op = aten._scaled_dot_product_cudnn_attention_backward.default
    return op(grad, q, k, v, out, lse, seed, offset, mask, cum_q, cum_k, *scalars, 0.0, a.is_causal, scale=a.scale)


def _flash_kernel(q, k, v, mask, a):
    outputs = torch._scaled_dot_product_flash_attention(q, k, v, 0.0, a.is_causal, False, scale=a.scale)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = outputs
    return out, (lse, cum_q, cum_k, rng_state, unused), (max_q, max_k)


def _flash_backward(grad, q, k, v, mask, out, tensors, scalars, a, needs_grad):
    # The derivative passes rng_state and unused as the philox seed and offset.
    lse, cum_q, cum_k, rng_state, unused = tensors
    op = aten._scaled_dot_product_flash_attention_backward.default
    return op(grad, q, k, v, out, lse, cum_q, cum_k, *scalars, 0.0, a.is_causal, rng_state, unused, scale=a.scale)


def _efficient_kernel(q, k, v, mask, a):
    # compute_log_sumexp=True, as in F.sdpa when grads are required; the log-sum-exp is padded to 32 rows.
    kernel = torch._scaled_dot_product_efficient_attention
    out, lse, seed, offset = kernel(q, k, v, mask, True, 0.0, a.is_causal, scale=a.scale)
    return out, (lse, seed, offset), ()


def _efficient_backward(grad, q, k, v, mask, out, tensors, scalars, a, needs_grad):
    # grad_input_mask: which of query, key, value and the bias need a gradient; a mask never does here.
    op = aten._scaled_dot_product_efficient_attention_backward.default
    grads = op(grad, q, k, v, mask, out, *tensors, 0.0, [*needs_grad[:3], False], a.is_causal, scale=a.scale)
    return grads[:3]


@dataclass(frozen=True, eq=False)
class _Ops:
    """One kernel the stash runs and replays: its name, its forward op's (the backward op's adds "_backward"),
    ``kernel``, ``backward`` and ``prepare_mask``, and its layout: the output's head dimension padded to
    ``head_dim_multiple``, an FP32 log-sum-exp (FP64 for FP64 where ``lse_follows_fp64``) in rows padded to
    ``lse_rows_multiple``."""

    name: str
    op: str
    kernel: object
    backward: object
    prepare_mask: object = _float_mask
    head_dim_multiple: int = 1
    lse_rows_multiple: int = 1
    lse_follows_fp64: bool = False

    def kept_bytes(self, batch, heads, sequence, head_dim, dtype):
        """Bytes one call keeps, its output and log-sum-exp (flash-attn's varlen one of [heads, total tokens] is as
        large as its plain one for batch x sequence tokens); the kernels' scalars are not counted."""
        head_dim += -head_dim % self.head_dim_multiple
        lse_bytes = 8 if self.lse_follows_fp64 and dtype == torch.float64 else 4
        rows = sequence + -sequence % self.lse_rows_multiple
        return batch * heads * (sequence * head_dim * dtype.itemsize + rows * lse_bytes)


# The fused CPU kernel; it takes grouped key/value heads as they are, and keeps an FP64 log-sum-exp for FP64 inputs.
_CPU_FLASH = _Ops("CPU flash attention", "_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_kernel,
                  _cpu_flash_backward, _float_mask, 1, 1, True)
# cuDNN attention, PyTorch's first SDPA choice on Hopper and Blackwell GPUs; it expands the bias itself.
_CUDNN = _Ops("cuDNN attention", "_scaled_dot_product_cudnn_attention", _cudnn_kernel, _cudnn_backward)
# FlashAttention-2 on CUDA, Ampere's and Ada's first choice (never masked): the head dimension padded to 8, as F.sdpa.
_FLASH = _Ops("flash attention", "_scaled_dot_product_flash_attention", _flash_kernel, _flash_backward, _float_mask, 8)
# Memory-efficient attention on CUDA, PyTorch's choice where flash and cuDNN do not apply.
_EFFICIENT = _Ops("memory-efficient attention", "_scaled_dot_product_efficient_attention", _efficient_kernel,
                  _efficient_backward, _efficient_mask, 1, 32)
# A call with an empty dimension (a rank that AutoTP gives no heads), which no fused kernel takes (PyTorch's CPU flash
# kernel dies of SIGFPE): F.sdpa's result, with no kernel in either pass (a query's sum over no keys is zero).
_EMPTY = _Ops("no kernel (an empty call)", "", lambda q, k, v, mask, a: (q.new_zeros(*q.shape[:-1], v.shape[-1]),
                                                                         (q.new_empty(0), ), ()),
              lambda grad, q, k, v, *rest: (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))

# (device type, the backend torch._fused_sdp_choice reports) -> ops that replay it exactly.
_BACKENDS = {
    ("cpu", SDPBackend.FLASH_ATTENTION.value): _CPU_FLASH,
    ("cuda", SDPBackend.CUDNN_ATTENTION.value): _CUDNN,
    ("cuda", SDPBackend.FLASH_ATTENTION.value): _FLASH,
    ("cuda", SDPBackend.EFFICIENT_ATTENTION.value): _EFFICIENT,
}
_BACKEND_NAMES = {backend.value: name for name, backend in SDPBackend.__members__.items()}


def _training_choice(query, key, value, mask, is_causal, scale, enable_gqa):
    """The backend F.sdpa picks in a training forward. The first pass runs without grad, where PyTorch may pick another
    (cuDNN's and flash's limits differ for the backward): so it asks with a query that requires grad."""
    grad_enabled = torch.is_grad_enabled()
    if grad_enabled and query.requires_grad:
        return torch._fused_sdp_choice(query, key, value, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    # The grad mode set directly rather than by torch.enable_grad(): this runs in every stashed first pass.
    torch._C._set_grad_enabled(True)
    try:
        query = query.detach().requires_grad_()
        return torch._fused_sdp_choice(query, key, value, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    finally:
        torch._C._set_grad_enabled(grad_enabled)


def _autocast_inputs(query, key, value, mask):
    """Query, key, value and a float mask as F.sdpa runs them under autocast (every floating-point argument but float64
    cast), since the aten ops the stash calls are not autocast-aware."""
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value, mask
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in (query, key, value, mask))


def _ops_for(device_type, choice):
    """The table's ops for the backend ``torch._fused_sdp_choice`` reported; raises for one without an exact replay."""
    ops = _BACKENDS.get((device_type, choice))
    if ops is None:
        served = ", ".join(f"{ops.name} ({_BACKEND_NAMES[backend]}) on {device}"
                           for (device, backend), ops in _BACKENDS.items())
        raise AttentionStashError(
            f"{_FEATURE} needs PyTorch to choose a fused SDPA backend it can replay: {served}; got "
            f"{_BACKEND_NAMES.get(choice, choice)} on {device_type}. The math backend and any other have "
            f"no exact replay. An sdpa_kernel context, torch.use_deterministic_algorithms(True), or a "
            f"dtype or head dimension no fused kernel takes changes the choice.")
    return ops


# (ops, mask dtype, query dtype) whose mask preparation was checked against F.sdpa's own in this process.
_MASKS_CHECKED = set()


class _KernelArguments(TorchDispatchMode):
    """Records the arguments of one call of ``op`` and returns empty outputs in place of running it."""

    def __init__(self, op):
        super().__init__()
        self.op, self.arguments = op, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not self.op:
            return func(*args, **(kwargs or {}))
        names = [argument.name for argument in func._schema.arguments]
        self.arguments = {**dict(zip(names, args)), **(kwargs or {})}
        return tuple(0 if isinstance(output.type, torch.IntType) else args[0].new_empty(0)
                     for output in func._schema.returns)


def _check_mask_preparation(ops, choice, bias, query, key, value, mask, is_causal, scale, enable_gqa):
    """Raise unless ``bias`` is the mask that F.sdpa gives the backend's kernel for these arguments."""
    kernel = _KernelArguments(getattr(aten, ops.op).default)
    with torch.no_grad(), sdpa_kernel([getattr(SDPBackend, _BACKEND_NAMES[choice])]), kernel:
        _SDPA(query, key, value, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    # No arguments where F.sdpa ran no such kernel call: then no mask of theirs matches.
    arguments = kernel.arguments or {}
    theirs = next((arguments[name] for name in ("attn_mask", "attn_bias") if name in arguments), None)
    if not (isinstance(theirs, torch.Tensor) and theirs.dtype == bias.dtype and theirs.shape == bias.shape
            and torch.equal(theirs, bias)):
        raise AttentionStashError(f"{_FEATURE} needs its mask for {ops.name} to be the one "
                                  f"F.scaled_dot_product_attention passes the kernel in torch {torch.__version__}, "
                                  f"got another ({bias.dtype} {tuple(bias.shape)} against "
                                  f"{getattr(theirs, 'dtype', None)} {tuple(getattr(theirs, 'shape', ()))}). Train "
                                  f"masked batches without the stash on this PyTorch.")
    _MASKS_CHECKED.add((ops, mask.dtype, query.dtype))


def _mask_identity(mask):
    return mask.data_ptr(), mask.shape, mask.stride(), mask.dtype, mask._version


# Rows of a mask digested at once, so that a digest never holds more than this slice of the mask in float64.
_DIGEST_ROWS = 256
# Random weights over a mask's keys, per device: one vector, extended for more keys with its prefix kept. A digest is
# compared only while its stash holds Hugging Face's objects: the last removal releases them (_let_go).
_DIGEST_WEIGHTS = {}


def _mask_digest(mask):
    """A fingerprint of a mask the checkpoint does not hold: per query row, the sums of its finite values and of its
    -inf positions against fixed random weights over the keys, in float64. Equal masks give equal digests bit for bit;
    other masks, others but for a coincidence."""
    keys = mask.shape[-1]
    weights = _DIGEST_WEIGHTS.get(mask.device)
    have = 0 if weights is None else weights.numel()
    if have < keys:
        more = torch.rand(keys - have, dtype=torch.float64, generator=torch.Generator().manual_seed(have)) + 1.0
        more = more.to(mask.device)
        weights = _DIGEST_WEIGHTS[mask.device] = more if weights is None else torch.cat([weights, more])
    weights = weights[:keys]
    digest = []
    for rows in mask.split(_DIGEST_ROWS, dim=-2):
        if rows.dtype == torch.bool:
            digest.append(torch.where(rows, weights, 0.0).sum(-1))
        else:
            rows = rows.double()
            blocked = torch.isneginf(rows)
            digest += [torch.where(blocked, weights, 0.0).sum(-1), (rows.masked_fill(blocked, 0.0) * weights).sum(-1)]
    return digest


# flash-attn 2, 3 and 4, from their pip packages or a Hub kernel: flash_attn_func for plain batches,
# flash_attn_varlen_func for padded (unpadded first) and packed ones. Their autograd functions call their interface
# module's kernel functions (plain functions, or custom ops as a Hub build's are), which the stash calls by name in
# that module, each argument by its parameter's name, with the values those functions pass: flash-attn 2's pad the head
# dimension to a multiple of 8 and save (query, key, value, padded output, log-sum-exp, [cu_seqlens_q, cu_seqlens_k,]
# rng_state); flash-attn 3's save (query, key, value, output, log-sum-exp, [cu_seqlens_q, cu_seqlens_k, seqused_q,
# seqused_k]); flash-attn 4's, the sinks too, and its backward returns the gradients (the sinks' from 4.0.0b26). So
# does the stash's node, its padding differentiable. A kernel function's parameters not named here (flash-attn 3's
# rotary_interleaved, scheduler_metadata) keep their defaults, as the autograd functions leave them; but flash-attn 4's
# forward computes the log-sum-exp where an input requires grad, or for return_lse=True, as the stash asks.


def _flash_values(a, family):
    """The arguments of a flash call as ``family``'s kernel functions name them, each build's names included; the
    tensors of the call are added by the caller."""
    values = {name: getattr(a, name) for name in _FLASH_FIELDS}
    values["window_size"] = left, right = a.window_size or family.window
    values.update(is_causal=a.causal,
                  window_size_left=left,
                  window_size_right=right,
                  sequed_q=a.seqused_q,
                  sequed_k=a.seqused_k)
    # What the autograd functions pass as none or false: no extra output, cache, rotary embedding or buffer.
    values.update(_FLASH_NONE, return_softmax=False, zero_tensors=False, return_lse=True)
    return values


_FLASH_FIELDS = tuple(field.name for field in dataclasses.fields(_FlashArguments))
_FLASH_NONE = dict.fromkeys(("leftpad_k", "k_new", "v_new", "out", "out_", "cu_seqlens_k_new", "page_table",
                             "kv_batch_idx", "rotary_cos", "rotary_sin", "seqlens_rotary"))


def _flash_kernel(module, function, parameters, family, q, k, v, mask, a):
    values = _flash_values(a, family)
    values.update(q=q, k=k, v=v)
    out, lse, *rest = getattr(module, function)(**{name: values[name] for name in parameters if name in values})
    # flash-attn 2's forward returns its backward's rng_state last.
    return out, (lse, *a.varlen()[:2], *(rest[-1:] if family.rng_state else ())), ()


def _flash_backward(module, function, parameters, family, grad, q, k, v, mask, out, tensors, scalars, a, needs_grad):
    values = _flash_values(a, family)
    grads = (None, ) * 3 if family.returns_grads else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    values.update(dout=grad,
                  q=q,
                  k=k,
                  v=v,
                  out=out,
                  softmax_lse=tensors[0],
                  lse=tensors[0],
                  dq=grads[0],
                  dk=grads[1],
                  dv=grads[2],
                  learnable_sink=mask)
    if family.rng_state:
        values["rng_state"] = tensors[-1]
    del values["pack_gqa"]  # a forward's argument: flash-attn 4's backward takes its own default
    result = getattr(module, function)(**{name: values[name] for name in parameters if name in values})
    return result if family.returns_grads else grads


@dataclass(frozen=True, eq=False)
class _FlashFamily:
    """A flash-attn interface the stash knows, as one build has it (a pip package, a Hub kernel): its name and
    release, the parameters of its flash_attn_func and flash_attn_varlen_func beyond q, k and v, the prefixes of the
    kernel functions its autograd functions call (the first a module has), their names after the prefix (forward,
    varlen forward, backward, varlen backward) and parameters, whether its forward returns an rng_state for its
    backward, the head-dimension multiple of its output, whether its backward returns the gradients, and the window
    its flash functions take by default (none)."""

    name: str
    release: str
    parameters: frozenset
    prefixes: tuple
    functions: tuple
    signatures: tuple
    rng_state: bool
    head_dim_multiple: int
    returns_grads: bool = False
    window: tuple = (-1, -1)

    @cached_property
    def sinks_train(self):
        """Whether its backward takes the sinks, and so returns their gradient (flash-attn 4 from 4.0.0b26)."""
        return "learnable_sink" in self.signatures[2].split()

    def ops(self, module, names, varlen):
        """Ops for flash_attn_func (or flash_attn_varlen_func) of ``module``, whose kernel functions are ``names``."""
        (forward, backward), signatures = (names[varlen], names[2 + varlen]), self.signatures[varlen::2]
        forward_parameters, backward_parameters = (tuple(signature.split()) for signature in signatures)
        return _Ops(f"{self.name} ({'flash_attn_varlen_func' if varlen else 'flash_attn_func'})", forward,
                    partial(_flash_kernel, module, forward, forward_parameters, self),
                    partial(_flash_backward, module, backward, backward_parameters, self), _float_mask,
                    self.head_dim_multiple)


_FLASH_VARLEN_PARAMETERS = "cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k "
# flash-attn 2.8's kernel functions' parameters, after (dout,) q, k, v (, out, softmax_lse, dq, dk, dv).
_FLASH2_KERNEL = ("{} dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes {}")
_FLASH2_FORWARD, _FLASH2_BACKWARD = "q k v", "dout q k v out softmax_lse dq dk dv"
# flash-attn 3's flash_attn_func and flash_attn_varlen_func parameters, and its kernel functions' (flash-attn 2.8.3's
# hopper/flash_attn_interface.py); the Hub builds rename or add some.
_FLASH3_PARAMETERS = (_FLASH_VARLEN_PARAMETERS + "seqused_q seqused_k softmax_scale causal qv q_descale k_descale "
                      "v_descale window_size attention_chunk softcap num_splits pack_gqa deterministic sm_margin")
_FLASH3_FORWARD = ("q k v k_new v_new qv out cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k "
                   "max_seqlen_q max_seqlen_k page_table kv_batch_idx leftpad_k rotary_cos rotary_sin seqlens_rotary "
                   "q_descale k_descale v_descale softmax_scale causal window_size attention_chunk softcap "
                   "rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin")
_FLASH3_BACKWARD = ("dout q k v out softmax_lse cu_seqlens_q cu_seqlens_k sequed_q sequed_k max_seqlen_q max_seqlen_k "
                    "dq dk dv softmax_scale causal window_size softcap deterministic sm_margin")
# flash-attn 3's autograd functions call one forward and one backward for both functions.
_FLASH3_FUNCTIONS = ("forward", "forward", "backward", "backward")
# kernels-community/flash-attn3: out_ for out, and both window sizes by name (is_causal in its backward).
_HUB_FLASH3_WINDOW = ("causal window_size ", "causal window_size_left window_size_right ")
# kernels-community/vllm-flash-attn3: no attention_chunk, and attention sinks (s_aux).
_VLLM_FLASH3_FORWARD = _FLASH3_FORWARD.replace(" attention_chunk", "") + " s_aux"
# flash-attn 4 (flash_attn.cute.interface): flash_attn_func's and flash_attn_varlen_func's parameters in any release
# read, its kernel functions' in 4.0.0b19, and the betas whose kernel functions' are the same, read from b19 to b40.
_FLASH4_PARAMETERS = (_FLASH_VARLEN_PARAMETERS + "min_seqlen_k seqused_q seqused_k page_table qv gather_kv_indices "
                      "softmax_scale causal window_size learnable_sink softcap num_splits pack_gqa deterministic "
                      "score_mod score_mod_bwd mask_mod aux_tensors aux_scalars block_sparse_tensors "
                      "block_sparse_tensors_bwd return_lse scheduler_metadata seqlen_k_per_split "
                      "disable_scheduler_metadata gather_bwd_recompute_p gather_bwd_token_chunk config scales")
_FLASH4_FORWARD = ("q k v qv cu_seqlens_q cu_seqlens_k seqused_q seqused_k max_seqlen_q max_seqlen_k min_seqlen_k "
                   "page_table softmax_scale causal softcap window_size_left window_size_right learnable_sink tile_mn "
                   "mma_pv_is_rs intra_wg_overlap num_threads num_splits pack_gqa _arch score_mod mask_mod "
                   "block_sparse_tensors return_lse out lse aux_tensors aux_scalars q_descale k_descale v_descale "
                   "gather_kv_indices")
_FLASH4_BACKWARD = ("q k v out dout lse softmax_scale causal softcap window_size_left window_size_right m_block_size "
                    "n_block_size num_threads pack_gqa num_stages_Q num_stages_dO SdP_swapAB dKV_swapAB dQ_swapAB "
                    "AtomLayoutMSdP AtomLayoutNdKV AtomLayoutMdQ V_in_regs cu_seqlens_q cu_seqlens_k seqused_q "
                    "seqused_k max_seqlen_q max_seqlen_k deterministic dq dk dv score_mod score_mod_bwd mask_mod "
                    "aux_tensors aux_scalars block_sparse_tensors dlse")
_FLASH4_B25 = _FLASH4_FORWARD + " scheduler_metadata seqlen_k_per_split disable_scheduler_metadata"
_FLASH4_RECORDS = {
    "4.0.0b19 to 4.0.0b24": (_FLASH4_FORWARD, _FLASH4_BACKWARD),
    "4.0.0b25": (_FLASH4_B25, _FLASH4_BACKWARD),
    # The sinks' gradient: the backward takes them, and returns it last.
    "4.0.0b26 to 4.0.0b31": (_FLASH4_B25, _FLASH4_BACKWARD + " learnable_sink"),
    "4.0.0b32 to 4.0.0b36": (_FLASH4_B25 + " gather_bwd_recompute_p", _FLASH4_BACKWARD + " learnable_sink"),
    "4.0.0b39 to 4.0.0b40":
    (_FLASH4_B25.replace(" num_threads", "").replace("q_descale k_descale v_descale", "scales") +
     " gather_bwd_recompute_p config", _FLASH4_BACKWARD + " learnable_sink config"),
}
_FLASH_FAMILIES = (
    _FlashFamily(
        "flash-attn 2", "flash-attn 2.8",
        frozenset((_FLASH_VARLEN_PARAMETERS + "dropout_p softmax_scale causal window_size softcap alibi_slopes "
                   "deterministic return_attn_probs block_table").split()), ("_wrapped_flash_attn_", "_flash_attn_"),
        ("forward", "varlen_forward", "backward", "varlen_backward"),
        (_FLASH2_KERNEL.format(_FLASH2_FORWARD, "return_softmax"),
         _FLASH2_KERNEL.format(f"{_FLASH2_FORWARD} {_FLASH_VARLEN_PARAMETERS}",
                               "return_softmax block_table leftpad_k seqused_k zero_tensors"),
         _FLASH2_KERNEL.format(_FLASH2_BACKWARD, "deterministic rng_state"),
         _FLASH2_KERNEL.format(f"{_FLASH2_BACKWARD} {_FLASH_VARLEN_PARAMETERS}",
                               "deterministic rng_state zero_tensors")), True, 8),
    _FlashFamily("flash-attn 3", "flash-attn 3 as flash-attn 2.8.3's hopper interface",
                 frozenset(_FLASH3_PARAMETERS.split()), ("_flash_attn_", ), _FLASH3_FUNCTIONS,
                 (_FLASH3_FORWARD, ) * 2 + (_FLASH3_BACKWARD, ) * 2, False, 1),
    _FlashFamily(
        "flash-attn 3", "the Hub build kernels-community/flash-attn3",
        frozenset(f"{_FLASH3_PARAMETERS} return_attn_probs".split()), ("_flash_attn_", ), _FLASH3_FUNCTIONS,
        (_FLASH3_FORWARD.replace(" out ", " out_ ").replace(*_HUB_FLASH3_WINDOW), ) * 2 +
        (_FLASH3_BACKWARD.replace(" causal window_size", " is_causal window_size_left window_size_right"), ) * 2,
        False, 1),
    _FlashFamily("vLLM's flash-attn 3", "the Hub build kernels-community/vllm-flash-attn3",
                 frozenset(_FLASH3_PARAMETERS.replace(" attention_chunk", " s_aux").split()), ("_flash_attn_", ),
                 _FLASH3_FUNCTIONS, (_VLLM_FLASH3_FORWARD, ) * 2 + (_FLASH3_BACKWARD, ) * 2, False, 1),
    *(_FlashFamily("flash-attn 4", f"flash-attn-4 {release}", frozenset(_FLASH4_PARAMETERS.split()),
                   ("_flash_attn_", ), ("fwd", "fwd", "bwd", "bwd"),
                   (forward, ) * 2 + (backward, ) * 2, False, 1, True, (None, None))
      for release, (forward, backward) in _FLASH4_RECORDS.items()),
)


class _AttentionNode(torch.autograd.Function):
    """The autograd node of one attention call, the same in both passes of both checkpoint modes: its forward runs the
    kernel where ``entry`` has no output yet (a first pass with grad, non-reentrant checkpointing's) and returns the
    output, the first pass's in a recompute; it saves the same tensors in the same order in both, so that a
    non-reentrant checkpoint fills the first pass's node with the recompute's saves; its backward is the kernel's."""

    @staticmethod
    def forward(ctx, query, key, value, mask, entry):
        if entry.output is None:
            entry.output, entry.tensors, entry.scalars = entry.ops.kernel(query, key, value, mask, entry.arguments)
        ctx.save_for_backward(query, key, value, mask, entry.output, *entry.tensors)
        ctx.ops, ctx.arguments, ctx.scalars = entry.ops, entry.arguments, entry.scalars
        return entry.output

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise AttentionStashError(f"{_FEATURE} needs first-order gradients, got a backward that records a graph "
                                      f"(create_graph=True, for a second-order gradient), which the attention "
                                      f"kernels' backward does not differentiate. Remove the stash (handle.remove()) "
                                      f"for steps that take second-order gradients.")
        query, key, value, mask, out, *tensors = ctx.saved_tensors
        grads = ctx.ops.backward(grad, query, key, value, mask, out, tensors, ctx.scalars, ctx.arguments,
                                 ctx.needs_input_grad)
        # (dq, dk, dv), and flash-attn 4's sinks' gradient where it computes one.
        return (*grads, None, None)[:5]


# The node's apply without autograd.Function.apply's functorch handling (as costly as the node): the stash refuses it.
_apply_node = super(torch.autograd.Function, _AttentionNode).apply

# ---------------------------------------------------------------------------------------------------------------------
# One checkpoint call of a stashed layer.
# ---------------------------------------------------------------------------------------------------------------------


def _raise_replaced_sdpa():
    raise AttentionStashError(f"{_FEATURE} needs torch.nn.functional.scaled_dot_product_attention to be PyTorch's "
                              f"own, whose kernels it replays, got {F.scaled_dot_product_attention!r} put in its "
                              f"place. Remove that replacement, or train without the stash.")


class _ThreadState(threading.local):
    # The checkpoint call whose layer function runs on this thread now, if any: the one its attention call serves.
    call = None


_state = _ThreadState()
# The checkpoint calls whose first pass put the stash's node in its graph, until their recompute: a removed stash's
# hold stays meanwhile, since only the stash's recompute gives that node's saves.
_RECORDED = weakref.WeakSet()


def _fetch(engine, token):
    """(tensor, event) of id ``token`` of DeepSpeed's _ActivationOffloadEngine, its copy back started: run on its side
    stream, restore_input waits there, and the compute stream at the tensor's use (_arrived), not before."""
    with get_accelerator().stream(engine.s1):  # None (no streams): the current one
        tensor = engine.restore_input(token)
    return tensor, None if engine.s1 is None else engine.s1.record_event()


def _arrived(engine, token):
    """The tensor of a token: an engine's id, what _fetch returned for one, or the tensor that the engine left alone."""
    tensor, event = _fetch(engine, token) if type(token) is int else token if type(token) is tuple else (token, None)
    if event is not None:
        engine.compute_stream.wait_event(event)
        tensor.record_stream(engine.compute_stream)
    return tensor


def _saves_on_cpu():
    """Whether torch's save_on_cpu (transformers' offload=True) is the saved-tensors hook around the running checkpoint
    (on top, or under a non-reentrant checkpoint's own), each known by the closure its constructor makes."""
    made = [hooks.__init__.__code__.co_consts for hooks in (torch.utils.checkpoint._checkpoint_hook, save_on_cpu)]
    hooks = top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is not None and getattr(top[0], "__code__", None) in made[0]:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        torch._C._autograd._push_saved_tensors_default_hooks(*top)
    return hooks is not None and getattr(hooks[0], "__code__", None) in made[1]


class _CheckpointCall:
    """One checkpointed call of a stashed decoder layer, run by the layer's checkpoint in place of the layer's function
    in both passes, and held as long as its graph: what its first pass keeps of each attention call lives here until
    the recompute's call of the same index takes it, or the graph goes."""

    # Class defaults: passes run; attention calls made in this one; whether the layer's attention reached the stash's
    # entry in it; a _Kept per attention call of the first pass, None once taken; the first pass's masks (and
    # position_ids) by (call index, role): (True, identity) held by the checkpoint, (False, (shape, dtype), digest)
    # built in the layer; whether the first pass applied the stash's node (then the recompute is the stash's, also
    # after a removal); whether this pass runs the stash's attention; the offload engine of what it keeps (or None),
    # its stats then (a reset replaces them), and the call offloaded before (weakly), whose recompute comes next.
    passes, calls, reached, kept, masks, recorded, serving = 0, 0, False, (), None, False, True
    engine = stats = previous = None

    def __init__(self, stash, function, checkpoint_function=None):
        self.stash, self.function, self.checkpoint_function = stash, function, checkpoint_function

    def __call__(self, *args, **kwargs):
        passes = self.passes = self.passes + 1
        if passes == 1:
            self.kept, self.engine = [], self.stash.offload_engine(self.checkpoint_function)
        elif passes > 2:
            raise AttentionStashError(f"{_FEATURE} needs one backward per forward of {self.stash.name}, got a "
                                      f"second backward through a retained graph (backward(retain_graph=True)): the "
                                      f"first backward took the kept attention output. Sum the losses into one "
                                      f"backward, or remove the stash for such steps.")
        elif not self.stash.active and not self.recorded:
            # Removed between the forward and this recompute, which runs stock attention: what was kept goes now.
            self._release()
        serving = self.serving = self.stash.active or self.recorded
        self.calls, self.reached = 0, False
        previous = _state.call
        _state.call = self
        try:
            if passes == 2 and self.engine is not None:
                with _disable_current_modes():
                    self._restore()
            outputs = self.function(*args, **kwargs)
        except _StopRecomputationError:
            # A non-reentrant recompute stopped at its last save: each of its attention calls has run by then.
            if passes == 2 and serving and self.calls < len(self.kept):
                self._check_recompute_calls()
            self._settle()
            raise
        except BaseException:
            # A refusal, or any error: no recompute will take what is kept, so it goes now, not with the graph.
            self._release()
            raise
        finally:
            _state.call = previous
        if passes == 1 and not self.calls and serving:
            self.stash.raise_without_attention_call(self.reached)
        if passes == 1 and self.engine is not None:
            with _disable_current_modes():
                self._offload()
        if passes == 2:
            if self.calls != len(self.kept) and serving:
                self._check_recompute_calls()
            self.kept = ()
            self._settle()
        return outputs

    def _check_recompute_calls(self):
        """Raise for a recompute that made other attention calls than its forward, releasing what is kept."""
        try:
            if not self.calls:
                self.stash.raise_without_attention_call(self.reached)
            raise AttentionStashError(f"{_FEATURE} needs the recompute of {self.stash.name} to make its forward's "
                                      f"{len(self.kept)} attention calls, got {self.calls}. Keep a layer's attention "
                                      f"calls the same from a forward to its backward, or remove the stash from it.")
        finally:
            # After the message, which reads the hold that the release may let go of.
            self._release()

    def attend(self, ops, query, key, value, mask, arguments):
        """One attention call of the layer, every implementation's: the first pass runs ``ops``' kernel (in the stash's
        node where it records a graph) and keeps its results; the recompute's call of the same index, given the same
        kernel and arguments, returns the kept output from the stash's node."""
        index, self.calls = self.calls, self.calls + 1
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and torch._C._are_functorch_transforms_active():
            raise AttentionStashError(f"{_FEATURE} needs the training forwards of {self.stash.name} to run under "
                                      f"autograd alone, got a torch.func transform (grad, vjp, vmap, jacrev). Remove "
                                      f"the stash, or take gradients with backward() rather than torch.func.")
        head_dim = query.shape[-1]
        padded = head_dim % ops.head_dim_multiple
        if padded:
            # As F.sdpa and flash-attn do for kernels that need it: zero padding, differentiably here, sliced back.
            query, key, value = (F.pad(t, (0, ops.head_dim_multiple - padded)) for t in (query, key, value))
        if self.passes == 1:
            entry = _Kept(ops, arguments)
            if grad_enabled:
                out = _apply_node(query, key, value, mask, entry)
                # An alias for the call: the output itself would tie the call to the graph.
                entry.output = out.detach()
                if not self.recorded:
                    self.recorded = True
                    _RECORDED.add(self)
            else:
                entry.output, entry.tensors, entry.scalars = ops.kernel(query, key, value, mask, arguments)
                out = entry.output
            entry.nbytes, entry.version = out.nbytes + entry.tensors[0].nbytes, out._version
            self.kept.append(entry)
            self.stash.counters.add(entry.nbytes)
        else:
            kept = self.kept
            entry = kept[index] if index < len(kept) else None
            if entry is None or entry.ops is not ops or entry.output.dtype != query.dtype:
                self._raise_unlike_forward(index, ops, query)
            differing = entry.arguments.differing(arguments)
            if differing is not None:
                raise AttentionStashError(f"{_FEATURE} needs the recompute of {self.stash.name} to call {ops.name} "
                                          f"with its forward's arguments, got another {differing} (attention call "
                                          f"{index + 1}): the kept output is the forward's. "
                                          f"{arguments.fix(differing)}.")
            if entry.output._version != entry.version:
                raise AttentionStashError(f"{_FEATURE} needs the attention output of {self.stash.name} unchanged from "
                                          f"its forward to its recompute, got an in-place change of it (or of a view "
                                          f"of it) in the forward. Change a copy of the attention output, or remove "
                                          f"the stash from this layer.")
            kept[index] = None
            try:
                out = _apply_node(query, key, value, mask, entry)
            except _StopRecomputationError:
                # A non-reentrant checkpoint stops its recompute at its last save, which may be the node's.
                self.stash.counters.take(entry.nbytes, served=True)
                raise
            except BaseException:
                self.stash.counters.take(entry.nbytes, served=False)
                raise
            self.stash.counters.take(entry.nbytes, served=True)
        return out[..., :head_dim] if padded else out

    def _offload(self):
        """Hand each kept log-sum-exp, then output, to the offload engine, which copies them to host memory once newer
        ones pass its keep-last window (the last output stays); as _restore, outside the checkpoint's dispatch modes."""
        counters, self.stats, engine = self.stash.counters, self.engine.stats, self.engine
        for entry in self.kept:
            tensors = lse, out = entry.tensors[0], entry.output
            # Engine ids, or tensors it leaves (small, on a host device); version: changes since the kernel, kept for later.
            entry.host = tuple(engine.offload_input(tensor) or tensor for tensor in tensors)
            counters.offloaded_bytes += sum(t.nbytes for t, token in zip(tensors, entry.host) if token is not t)
            entry.tensors, entry.output, entry.version = (None, *entry.tensors[1:]), None, entry.version - out._version
        self.previous, counters.offloaded = counters.offloaded, weakref.ref(self)

    def _restore(self):
        """Bring this recompute's kept outputs back (prefetched by the one before), and start bringing back those of
        the first pass before this one, whose recompute comes next."""
        engine, counters = self.engine, self.stash.counters
        if engine.stats is not self.stats:
            raise AttentionStashError(f"{_FEATURE} needs the offload engine of {self.stash.name} to hold its kept "
                                      f"output until the recompute, got it reset since (deepspeed.checkpointing.reset"
                                      f"(), an offload context entered again). Run the backward first.")
        for entry in self.kept:
            tensors = lse, out = tuple(_arrived(engine, token) for token in entry.host)
            counters.restored_bytes += sum(t.nbytes for t, token in zip(tensors, entry.host) if token is not t)
            entry.tensors, entry.output, entry.host = (lse, *entry.tensors[1:]), out, None
            entry.version += out._version
        following = self.previous and self.previous()
        for entry in following.kept if following is not None and following.engine is engine else ():
            entry.host = tuple(_fetch(engine, token) if type(token) is int else token for token in entry.host or ())

    def _raise_unlike_forward(self, index, ops, query, device_type=None, choice=None):
        """Raise for an attention call without a kernel the stash replays, or a recompute's call that differs from its
        forward's in dtype or kernel."""
        entry = self.kept[index] if self.passes > 1 and index < len(self.kept) else None
        if entry is not None and entry.output.dtype != query.dtype:
            raise AttentionStashError(f"{_FEATURE} needs the recompute of {self.stash.name} to run attention in its "
                                      f"forward's dtype, got {entry.output.dtype} in the forward and {query.dtype} in "
                                      f"the recompute (attention call {index + 1}): autocast differs between the "
                                      f"passes, as under a checkpoint function that does not restore it "
                                      f"(deepspeed.checkpointing.checkpoint). Use torch.utils.checkpoint, Hugging "
                                      f"Face's default, or train without autocast.")
        if ops is None:
            _ops_for(device_type, choice)
        raise AttentionStashError(f"{_FEATURE} needs one attention kernel for both passes of {self.stash.name}, got "
                                  f"{entry.ops.name if entry else 'none'} in the forward and {ops.name} in the "
                                  f"recompute (attention call {index + 1}). Keep sdpa_kernel contexts, "
                                  f"deterministic-algorithm settings, a batch's packing and a layer's attention calls "
                                  f"the same for a forward and its backward.")

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        """F.scaled_dot_product_attention for one attention call of the layer: the kernel and mask F.sdpa would use."""
        if F.scaled_dot_product_attention is not _SDPA:
            _raise_replaced_sdpa()
        # This runs in both passes of every stashed layer: what an unmasked call without dropout needs comes first.
        if dropout_p != 0.0 or attn_mask is not None or self.masks is not None:
            self._check_dropout(dropout_p)
            if attn_mask is not None and attn_mask.requires_grad:
                raise AttentionStashError(f"{_FEATURE} needs an attention mask that does not require grad in "
                                          f"{self.stash.name}, got a learned one. Remove the stash from layers with "
                                          f"learned attention biases.")
            self.compare_input(self.calls, "attention mask", attn_mask)
        if torch._C._is_any_autocast_enabled():
            query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
        if not (query.numel() and key.numel()):
            return self.attend(_EMPTY, query, key, value, None, _SdpaArguments(is_causal, scale))
        choice = _training_choice(query, key, value, attn_mask, is_causal, scale, enable_gqa)
        # CPU's type without making a torch.device; any other device's type from its torch.device.
        device_type = "cpu" if query.is_cpu else query.device.type
        ops = _BACKENDS.get((device_type, choice))
        if ops is None:
            self._raise_unlike_forward(self.calls, None, query, device_type, choice)
        bias = attn_mask if attn_mask is None else ops.prepare_mask(attn_mask, query, key, value)
        if attn_mask is not None and (ops, attn_mask.dtype, query.dtype) not in _MASKS_CHECKED:
            _check_mask_preparation(ops, choice, bias, query, key, value, attn_mask, is_causal, scale, enable_gqa)
        if scale is None and query.shape[-1] % ops.head_dim_multiple:
            # As F.sdpa does for a kernel that pads the head dimension: the scale from the unpadded one.
            scale = 1.0 / math.sqrt(query.shape[-1])
        return self.attend(ops, query, key, value, bias, _SdpaArguments(is_causal, scale))

    def flash(self, interface, query, key, value, arguments):
        """``interface``'s flash_attn_func (``cu_seqlens_q`` None) or flash_attn_varlen_func for one attention call
        of the layer: the forward kernel function that its autograd function would call."""
        a = arguments
        # The guards of a call with an argument other than Hugging Face's training defaults.
        if a.dropout_p != 0.0:
            self._check_dropout(a.dropout_p)
        unserved = a.unserved()
        if unserved is not None:
            raise AttentionStashError(f"{_FEATURE} needs flash-attn calls that return the attention output of plain "
                                      f"softmax attention alone in {self.stash.name}, got {unserved}. Remove the "
                                      f"stash from this layer.")
        sinks = a.s_aux if a.learnable_sink is None else a.learnable_sink
        family = interface.family
        if sinks is not None and sinks.requires_grad and not family.sinks_train:
            raise AttentionStashError(f"{_FEATURE} needs attention sinks that do not require grad in "
                                      f"{self.stash.name}, got {'s_aux' if sinks is a.s_aux else 'learnable_sink'} "
                                      f"(the layer's sinks, as gpt-oss passes them) that requires grad for "
                                      f"{family.name} as {family.release} has it, whose backward gives the sinks no "
                                      f"gradient. Freeze the sinks (as LoRA does), or remove the stash from layers "
                                      f"with sinks and train them with an implementation whose backward computes "
                                      f"their gradient (flash-attn 4 from 4.0.0b26).")
        if isinstance(a.alibi_slopes, torch.Tensor) and a.alibi_slopes.requires_grad:
            raise AttentionStashError(f"{_FEATURE} needs ALiBi slopes that do not require grad in {self.stash.name}, "
                                      f"got learned ones, whose gradient flash-attn does not compute. Remove the "
                                      f"stash from layers with learned ALiBi slopes.")
        if isinstance(a.softcap, torch.Tensor):
            raise AttentionStashError(f"{_FEATURE} needs a softcap that is a number in {self.stash.name}, got a tensor"
                                      f"{' that requires grad (a learned softcap)' if a.softcap.requires_grad else ''}"
                                      f", which flash-attn's kernels take as a constant. Remove the stash from this "
                                      f"layer.")
        if a.softmax_scale is None:
            # As flash-attn's autograd functions: from the head dimension before padding.
            a.softmax_scale = query.shape[-1]**(-0.5)
        # flash-attn 4's sinks are the node's fourth input, in the place of sdpa's mask, for their gradient.
        return self.attend(interface.ops if a.cu_seqlens_q is None else interface.varlen_ops, query, key, value,
                           a.learnable_sink, a)

    def _check_dropout(self, dropout_p):
        if dropout_p != 0.0:
            raise AttentionStashError(f"{_FEATURE} needs attention dropout 0 in {self.stash.name}, got {dropout_p}. "
                                      f"Set the model config's attention_dropout to 0.0, or remove the stash.")

    def compare_input(self, index, role, tensor):
        """Remember, in the first pass, the tensor that plays ``role`` in attention call ``index`` (an sdpa mask, or
        the padding mask and position_ids from which Hugging Face's flash path unpads and packs a batch), and compare
        the recompute's with it: by identity and version for a tensor the checkpoint holds, else by a digest."""
        masks = self.masks
        if self.passes == 1:
            if tensor is not None:
                if masks is None:
                    masks = self.masks = {}
                masks[index, role] = ((True, _mask_identity(tensor)) if self._holds(tensor) else
                                      (False, (tensor.shape, tensor.dtype), _mask_digest(tensor)))
            return
        expected = None if masks is None else masks.get((index, role))
        if (tensor is None) != (expected is None):
            raise AttentionStashError(f"{_FEATURE} needs the recompute of {self.stash.name} to get its forward's "
                                      f"{role}, got a change from or to none: the kept output is the forward's. Keep "
                                      f"a batch's masks and position_ids the same from a forward to its backward.")
        if tensor is None:
            return
        if expected[0]:
            if _mask_identity(tensor) != expected[1]:
                raise AttentionStashError(f"{_FEATURE} needs the recompute of {self.stash.name} to get its forward's "
                                          f"{role}, got another one (another tensor, shape or version): the kept "
                                          f"output is the forward's. Do not change a mask or position_ids in place "
                                          f"between a forward and its backward.")
        elif (tensor.shape, tensor.dtype) != expected[1] or not all(
                torch.equal(ours, theirs) for ours, theirs in zip(_mask_digest(tensor), expected[2])):
            raise AttentionStashError(f"{_FEATURE} needs the recompute of {self.stash.name} to build the {role} its "
                                      f"forward built inside the layer, got one with other values (a "
                                      f"nondeterministic choice, such as a top-k over tied scores, can differ between "
                                      f"the passes): the kept output is the forward's. Make the mask's computation "
                                      f"deterministic, or remove the stash from this layer.")

    def _holds(self, tensor):
        """Whether ``tensor`` is (a view of) a tensor bound in the layer's checkpointed function, as Hugging Face binds
        a layer's keyword arguments, its attention mask among them: then the checkpoint holds its storage."""
        pointer = tensor.untyped_storage().data_ptr()
        bound = (*getattr(self.function, "args", ()), *(getattr(self.function, "keywords", None) or {}).values())
        return any(
            isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == pointer for value in bound)

    def _release(self, blocking=True):
        """Count every entry not taken released, and let go of them (offloaded, taken back: the engine's only way)."""
        for entry in self.kept:
            if entry is not None:
                self.stash.counters.take(entry.nbytes, served=False)
                for token in entry.host if entry.host and self.engine.stats is self.stats else ():
                    _arrived(self.engine, token)
        self.kept = ()
        self._settle(blocking)

    def _settle(self, blocking=True):
        """The end of a recorded first pass's wait for its recompute: a removed stash's hold may go now."""
        if self.recorded:
            self.recorded = False
            _RECORDED.discard(self)
            if not self.stash.active:
                _let_go_quietly(blocking)

    def __del__(self):
        # The graph went without a recompute (no backward); a collection may run where this thread holds the lock.
        self._release(blocking=False)


@dataclass(slots=True)
class _Counters:
    """What the stashes of one install keep and serve, for its handle: attention outputs, one per attention call."""

    kept: int = 0
    kept_bytes: int = 0
    peak_kept_bytes: int = 0
    recomputes_served: int = 0
    released_without_backward: int = 0
    # Layers whose compiled graph saves the attention kernel's outputs, as the checkpoint's policy was asked to.
    compiled: set = dataclasses.field(default_factory=set)
    # Offload: bytes handed to an engine and taken back; the last call offloaded (weakly); the install's engine.
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    offloaded: object = None
    engine: object = None
    tensor_parallel: int = None  # the install's tensor_parallel_size, until the first training forward checks it

    def add(self, nbytes):
        self.kept += 1
        self.kept_bytes += nbytes
        self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)

    def take(self, nbytes, served):
        self.kept -= 1
        self.kept_bytes -= nbytes
        if served:
            self.recomputes_served += 1
        else:
            self.released_without_backward += 1


# ---------------------------------------------------------------------------------------------------------------------
# The implementations table. In a stashed layer's checkpoint call, the stash's entry in Hugging Face's interface runs
# a copy of Hugging Face's function whose call of the kernel function reaches the current checkpoint call instead;
# grouped heads, masks, unpadding, packing and output post-processing stay Hugging Face's.
# ---------------------------------------------------------------------------------------------------------------------


def _sdpa_of_current_call(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    # F.sdpa's signature spelled out: binding named arguments costs less than passing *args and **kwargs on.
    return _state.call.sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _flash_of_current_call(interface, q, k, v, **options):
    # flash_attn_func, as Hugging Face calls it: query, key and value, then each option by name.
    return _state.call.flash(interface, q, k, v, _flash_arguments(options))


def _flash_varlen_of_current_call(interface, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    # flash_attn_varlen_func, as Hugging Face calls it.
    return _state.call.flash(interface, q, k, v, _flash_arguments(options, cu_seqlens_q, cu_seqlens_k))


def _flash_arguments(options, cu_seqlens_q=None, cu_seqlens_k=None):
    """A flash call's _FlashArguments; arguments without a field kept apart, for unserved() to name where given."""
    try:
        return _FlashArguments(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **options)
    except TypeError:
        others = {name: options.pop(name) for name in set(options).difference(_FLASH_FIELDS)}
        return _FlashArguments(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **options, others=others)


def _module_view(module, **entries):
    """A module object with ``entries`` in front of ``module``'s attributes."""
    view = types.ModuleType(module.__name__)
    view.__dict__.update(entries, __getattr__=partial(getattr, module))
    return view


def _names_read(function):
    """The names that a function's code and the functions defined in it (which run with its globals) read."""
    code = getattr(function, "__code__", None)
    codes, names = [code] if isinstance(code, types.CodeType) else [], set()
    while codes:
        names.update(codes[-1].co_names)
        codes += [const for const in codes.pop().co_consts if isinstance(const, types.CodeType)]
    return names


def _copy_with(function, entries):
    """A copy of ``function`` whose module globals are a snapshot of its module's, with ``entries`` in front."""
    module_globals = {**function.__globals__, **entries}
    copy = types.FunctionType(function.__code__, module_globals, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def _raise_other_function(implementation, where, function, calls):
    raise AttentionStashError(f"{_FEATURE} needs Hugging Face's {implementation} attention function, which calls "
                              f"{calls}, as {where}, got {function!r}, which does not (a wrapper "
                              f"around another attention function, or another kernel). Install the stash before "
                              f"wrapping or replacing that entry.")


def _sdpa_copy(record, function, where):
    """Hugging Face's sdpa function, copied so that where its code reaches F.scaled_dot_product_attention through a
    module global, it reaches the current checkpoint call's ``sdpa``: (copy, the functions whose globals it
    snapshots)."""
    functional = _module_view(F, scaled_dot_product_attention=_sdpa_of_current_call)
    nn = _module_view(torch.nn, functional=functional)
    # What each module global that reaches F.sdpa (torch, torch.nn, F, the function itself) becomes in the copy.
    views = dict(
        zip(map(id, (torch, torch.nn, F, _SDPA)), (_module_view(torch, nn=nn), nn, functional, _sdpa_of_current_call)))
    module_globals = getattr(function, "__globals__", None)
    names = _names_read(function)
    entries = {name: views[id(module_globals[name])] for name in names if id(module_globals.get(name)) in views}
    if not entries or _SDPA.__name__ not in names:
        _raise_other_function(record.name, where, function, f"{record.calls} in its own code")
    return _copy_with(function, entries), (function, )


def _flash_copy(record, function, where):
    """Hugging Face's flash attention function, copied so that it calls a copy of _flash_attention_forward whose
    lazy_import_flash_attention hands out the current checkpoint call's ``flash``: (copy, the functions whose globals
    it snapshots)."""
    inner = getattr(function, "__globals__", {}).get("_flash_attention_forward")
    if ("_flash_attention_forward" not in _names_read(function)
            or "lazy_import_flash_attention" not in _names_read(inner)
            or not callable(inner.__globals__.get("lazy_import_flash_attention"))):
        _raise_other_function(
            record.name, where, function,
            "flash-attn through transformers.modeling_flash_attention_utils._flash_attention_forward")
    lazy_import = partial(_stashing_flash_import, inner.__globals__["lazy_import_flash_attention"])
    inner_copy = _copy_with(inner, {"lazy_import_flash_attention": lazy_import})
    checked = partial(_flash_inputs_checked, inner_copy)
    return _copy_with(function, {"_flash_attention_forward": checked}), (function, inner)


def _flash_inputs_checked(inner, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
    """Hugging Face's _flash_attention_forward (``inner``, its copy), once the current checkpoint call has compared
    what places the kept output: the padding mask it unpads by (rows that keep their token counts give the same
    cu_seqlens), and the position_ids it packs by."""
    call = _state.call
    if attention_mask is not None or position_ids is not None or call.masks is not None:
        call.compare_input(call.calls, "padding mask", attention_mask)
        call.compare_input(call.calls, "position_ids", position_ids)
    return inner(query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)


def _stashing_flash_import(lazy_import, implementation, *args, **kwargs):
    """Hugging Face's lazy_import_flash_attention for a stashed call: what it returns, with the flash_attn_func and
    flash_attn_varlen_func that the install found for ``implementation`` replaced by the current checkpoint call's."""
    (function, varlen_function, *others), processors = lazy_import(implementation, *args, **kwargs)
    interface = _FLASH_INTERFACES.get(implementation)
    if interface is None or function is not interface.function or varlen_function is not interface.varlen_function:
        found = f"{interface.family.name}'s" if interface else "the"
        raise AttentionStashError(f"{_FEATURE} needs Hugging Face's {implementation} to call {found} flash_attn_func "
                                  f"and flash_attn_varlen_func, whose kernels it replays, as the install found them "
                                  f"({interface.description if interface else 'none'}), got {function!r} and "
                                  f"{varlen_function!r} (another flash attention package or Hub kernel, or an NPU "
                                  f"build). Install the stash after choosing the attention implementation, or load "
                                  f"the model with attn_implementation=\"sdpa\".")
    return (*interface.calls, *others), processors


@dataclass(slots=True, eq=False)
class _FlashInterface:
    """The flash functions Hugging Face's lazy import hands out for an implementation: their family, where they come
    from (the install line's words), flash_attn_func and flash_attn_varlen_func, the ops of each, and the current
    checkpoint call's stand-ins for them."""

    family: _FlashFamily
    description: str
    function: object
    varlen_function: object
    ops: _Ops
    varlen_ops: _Ops
    compiled_ops: frozenset
    calls: tuple = ()


# The flash interface of each implementation, as its latest install (or plan) found it.
_FLASH_INTERFACES = {}


def _source(module):
    """Where a flash interface module comes from, in words: a Hub kernel's repository and revision as the kernels
    package loaded it (its name and version for a local build), or a package's name and version."""
    top = module.__name__.partition(".")[0]
    for loaded in getattr(sys.modules.get("kernels"), "get_loaded_kernels", list)():
        if getattr(loaded.module, "__name__", None) == top:
            info, metadata = loaded.repo_info, loaded.metadata
            return (f"the Hub kernel {info.repo_id} at revision {info.revision} ({top})"
                    if info else f"the Hub kernel {metadata.name} version {metadata.version}, a local build ({top})")
    version = getattr(sys.modules.get(top), "__version__", None)
    distributions = importlib.metadata.packages_distributions().get(top, ())
    if version is None or len(distributions) > 1:
        # A module without a version of its own (flash-attn 3's flash_attn_interface), or one of a package that several
        # distributions install (flash_attn: flash-attn 2's and 4's): the distribution whose files hold it.
        file = f"{module.__name__.replace('.', '/')}.py"
        owners = [name for name in distributions if file in map(str, importlib.metadata.files(name) or ())]
        version = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in owners or distributions)
    return f"{top} {version}".rstrip()


def _parameters(function):
    """The parameter names of a function, or of a torch op as its schema names them: an op overload, an op packet's
    default overload, a custom op's (torch.library.custom_op, whose own signature is (*args, **kwargs))."""
    op = getattr(function, "_opoverload", None) or getattr(function, "default", function)
    schema = getattr(op, "_schema", None)
    return [argument.name for argument in schema.arguments] if schema else list(inspect.signature(function).parameters)


def _load_flash(record):
    """The flash interface Hugging Face's lazy import hands out for ``record``'s implementation, checked against the
    families the stash knows: its functions the interface module's own, their parameters and its kernel functions'
    the family's. Raises for one it cannot serve, naming what differs. The same functions give the same interface."""
    from transformers import modeling_flash_attention_utils as flash_utils

    name = record.name
    what, where = (text.format(name=name) for text in record.requires)
    try:
        (function, varlen_function, *_), _ = flash_utils.lazy_import_flash_attention(name)
        if function is varlen_function is None:  # transformers 5.22 keeps a failed import as loaded, without them
            raise ImportError("transformers' import of its flash functions failed before, and it hands out none")
    except Exception as error:
        kind = "an import error" if isinstance(error, ImportError) else f"an error ({type(error).__name__})"
        raise AttentionStashError(
            f'{_FEATURE} needs {what} ({where}) for attn_implementation="{name}", got {kind}: '
            f'{error}. Install {what}, or load the model with attn_implementation="sdpa".') from error
    module = sys.modules.get(getattr(function, "__module__", None))
    if module is None or not all(
            getattr(module, getattr(f, "__name__", ""), None) is f and getattr(f, "__globals__", None) is vars(module)
            for f in (function, varlen_function)):
        raise AttentionStashError(f'{_FEATURE} needs the flash_attn_func and flash_attn_varlen_func of a flash-attn '
                                  f'interface module for attn_implementation="{name}", got {function!r} and '
                                  f'{varlen_function!r}, which are not (a wrapper around them, or a kernel without '
                                  f'them). Remove the wrapper, or load the model with attn_implementation="sdpa".')
    parameters = set(_parameters(function) + _parameters(varlen_function)) - {"q", "k", "v"}

    def differences(family):
        """Where the module differs from the family's build: (kernel function names, what differs)."""
        prefix = next((prefix for prefix in family.prefixes if hasattr(module, prefix + family.functions[0])),
                      family.prefixes[0])
        names = [prefix + function for function in family.functions]
        unknown = sorted(parameters - family.parameters)
        found = [f"{', '.join(unknown)} in its functions' parameters"] if unknown else []
        for kernel, signature in dict(zip(names, family.signatures)).items():
            if not callable(getattr(module, kernel, None)):
                found.append(f"without {kernel}")
            elif _parameters(getattr(module, kernel)) != signature.split():
                found.append(f"{kernel}({', '.join(_parameters(getattr(module, kernel)))})")
        return names, found

    # The first family whose build the module is, else the one it differs from least, for the error.
    family, (names, differing) = min(((family, differences(family)) for family in _FLASH_FAMILIES),
                                     key=lambda found: len(found[1][1]))
    if differing:
        known = " or ".join(other.release for other in _FLASH_FAMILIES if other.name == family.name)
        raise AttentionStashError(f"{_FEATURE} needs {family.name}'s interface as {family.release} has it for "
                                  f"attn_implementation=\"{name}\", got {_source(module)} ({module.__name__}) "
                                  f"{'; '.join(differing)}. Install {known}, or load the model with "
                                  f"attn_implementation=\"sdpa\".")
    interface = _FLASH_INTERFACES.get(name)
    if interface is None or (interface.function, interface.varlen_function,
                             interface.ops.op) != (function, varlen_function, names[0]):
        # A pending recompute compares its ops with its forward's: the same functions keep the same ops.
        interface = _FlashInterface(family, f"{family.name}'s interface from {_source(module)}", function,
                                    varlen_function, family.ops(module, names, False), family.ops(module, names, True),
                                    _traced_ops(getattr(module, name) for name in names[:2]))
        interface.calls = (partial(_flash_of_current_call, interface), partial(_flash_varlen_of_current_call,
                                                                               interface))
        _FLASH_INTERFACES[name] = interface
    return interface


def _traced_ops(functions):
    """The names of the ops that are the given kernel functions, for a compiled checkpoint's policy; empty where one is
    not a torch op with a fake kernel (a Python function over compiled kernels), which dynamo would not trace."""
    ops = [getattr(function, "_opoverload", None) or getattr(function, "default", None) for function in functions]
    if not all(op is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta") for op in ops):
        return frozenset()
    return frozenset(op._schema.name for op in ops)


def _flash_layout(record, *shapes):
    """The ops whose layout a flash call keeps: its family's (head-dimension padding, log-sum-exp), as the functions
    Hugging Face hands out now have it (not an earlier install's, whose functions may be gone)."""
    return _load_flash(record).ops


def _sdpa_layout(record, device, dtype, sequence_length, heads, key_heads, head_dim):
    """The ops whose layout the stash keeps for an sdpa call of these shapes on ``device``: the backend PyTorch picks
    for them in training. Without a batch shape the backend is not known: cuDNN's layout, unpadded, stands for it."""
    if device is None:
        return _CUDNN
    query = torch.empty(1, heads, sequence_length, head_dim, device=device, dtype=dtype, requires_grad=True)
    key = torch.empty(1, key_heads, sequence_length, head_dim, device=device, dtype=dtype)
    with torch.enable_grad():
        choice = torch._fused_sdp_choice(query, key, key, None, 0.0, True, enable_gqa=key_heads != heads)
    return _ops_for(device.type, choice)


@dataclass(frozen=True, eq=False)
class _Implementation:
    """An attention implementation the stash serves, under Hugging Face's ``name``: the kernel function its Hugging
    Face function ``calls``, in words; the attention modules' ``head_dim_name`` for the output's head dimension where
    not ``head_dim``; ``copy``, ``load`` (imports and checks its kernels, once per install) and ``layout`` (the ops
    whose layout a call keeps), each given the record; what it ``requires``, and from where, for the load's error."""

    name: str
    calls: str
    head_dim_name: str
    copy: object
    load: object
    layout: object
    requires: tuple = ()
    # Whether Hugging Face registers the implementation's entry again, library-wide, at each load of its kernels (a Hub
    # kernel's, when another flash implementation was loaded since): the stash's entry then goes in front of it.
    registered_at_load: bool = False
    # Under torch.compile: the names of the kernels' ops that the checkpoint's policy saves (none: refused there).
    compiled_ops: object = lambda record: (_FLASH_INTERFACES.get(record.name) or _load_flash(record)).compiled_ops


_FLASH_CALLS = "flash-attn's flash_attn_func or flash_attn_varlen_func"
# The fused SDPA kernels of the backend table, which a compiled stashed layer's checkpoint saves.
_SDPA_OPS = frozenset(f"aten::{ops.op}" for ops in _BACKENDS.values())
# Multi-head latent attention (DeepSeek) has a value head dimension of its own, the output's under sdpa; for
# flash-attn, Hugging Face pads the value to the query's head dimension. flash_attn_varlen_func's layout keeps as many
# bytes per token as flash_attn_func's.
_IMPLEMENTATIONS = {
    record.name: record
    for record in [
        _Implementation("sdpa",
                        "torch.nn.functional.scaled_dot_product_attention",
                        "v_head_dim",
                        _sdpa_copy,
                        lambda record: None,
                        _sdpa_layout,
                        compiled_ops=lambda record: _SDPA_OPS),
        _Implementation("flash_attention_2", _FLASH_CALLS, "qk_head_dim", _flash_copy, _load_flash, _flash_layout, (
            "flash-attn 2", "the flash_attn package")),
        _Implementation("flash_attention_3", _FLASH_CALLS, "qk_head_dim", _flash_copy, _load_flash, _flash_layout, (
            "flash-attn 3", "its flash_attn_interface module, from flash-attn's hopper/ build")),
        _Implementation("flash_attention_4", _FLASH_CALLS, "qk_head_dim", _flash_copy, _load_flash, _flash_layout, (
            "flash-attn 4", "its flash_attn.cute package, from the flash-attn-4 pre-release")),
    ]
}
# A Hub kernel that Hugging Face loads through the kernels package, under its repository's name (and @revision):
# served where it has flash-attn 2's or 3's interface, with the same ops as their pip packages.
_HUB_KERNEL = _Implementation(None, _FLASH_CALLS, "qk_head_dim", _flash_copy, _load_flash, _flash_layout,
                              ("the Hub kernel {name}", "loaded by the kernels package"), True)
_HUB_KERNEL_NAME = re.compile(r"[^/:@|\s]+/[^/:@|\s]+(@[^/:@|\s]+)?")


def _implementation(name):
    """The table's record of an implementation, a Hub kernel's made at its first sight; None for one not served."""
    record = _IMPLEMENTATIONS.get(name)
    if record is None and isinstance(name, str) and _HUB_KERNEL_NAME.fullmatch(name):
        record = _IMPLEMENTATIONS.setdefault(name, dataclasses.replace(_HUB_KERNEL, name=name))
    return record


# ---------------------------------------------------------------------------------------------------------------------
# The hold on Hugging Face's objects: each stashed layer's checkpoint function, and each served implementation's entry.
# ---------------------------------------------------------------------------------------------------------------------

# Every submodule of a stashed decoder layer, attention modules among them, maps to that layer's stash.
_STASHES = weakref.WeakKeyDictionary()
# Install and remove change process-wide entries; one at a time.
_LOCK = threading.Lock()
# The hold on Hugging Face's entries and its layer class, while any stash is installed: a _Hold.
_held = None
# What GradientCheckpointingLayer's class dictionary held under _CHECKPOINT_FUNCTION before the slot went in.
_MISSING = object()
# Each entry the stash made, to the function it stands in front of: a library that wrapped one may write it back.
_ENTRIES = weakref.WeakKeyDictionary()


@dataclass(slots=True, eq=False)
class _Entry:
    """The stash's entry for one implementation: where the function that Hugging Face's lookups reach is held (a key of
    a dictionary, described; where the entry shadows the key of a mapping ``behind`` it, that mapping), the function
    it replaced there, the entry, and what the lookup returns with it in place."""

    dictionary: dict
    key: str
    description: str
    behind: dict = None
    original: object = None
    entry: object = None
    front: object = None

    def function(self):
        function = self.dictionary.get(self.key)
        return function if function is not None or self.behind is None else self.behind.get(self.key)

    def put(self, function):
        self.dictionary[self.key] = function

    def restore(self):
        """Undo the entry where it is still in place: the function it replaced back, or the shadowing key gone."""
        if self.dictionary.get(self.key) is self.entry:
            if self.behind is None:
                self.put(self.original)
            else:
                del self.dictionary[self.key]


@dataclass(slots=True, eq=False)
class _Hold:
    """What the stash changed in Hugging Face's objects, to undo: the slot's class and what it held, each _Entry."""

    layer_class: type
    attention_functions: object
    class_attribute: object
    entries: dict


class _LayerStash:
    """The stash of one decoder layer, which wraps each checkpointed call in a ``_CheckpointCall``: its name,
    implementation, config, layer and modules (only their attention calls are the layer's), model, counters, whether it
    is active, the stored checkpoint function wrapped for the last read, whether the layer was checkpointed at the
    install or since (a training forward without checkpointing then stands aside), whether it stands aside, warned
    of, since its last checkpointed call, and the install's ``offload``."""

    def __init__(self, plan, model, counters, offload=None):
        self.key = next(_KEYS)
        _BY_KEY[self.key] = self
        self.name, self.implementation, self.config = plan.name, plan.implementation, plan.config
        self.layer, self.modules = weakref.ref(plan.layer), weakref.WeakSet(plan.layer.modules())
        self.model, self.counters, self.active, self.wrapped = weakref.ref(model), counters, True, None
        self.checkpointed, self.aside, self.offload = plan.layer.gradient_checkpointing is True, False, offload
        self.offloads = (None, False, False)

    def checkpoint(self, checkpoint_function, function, *args, **kwargs):
        """The layer's checkpoint function, as the stash hands it to Hugging Face's checkpointed call."""
        self.checkpointed, self.aside = True, False
        if not torch.is_grad_enabled():
            # No graph, so no backward to serve: transformers <= 5.22 checkpoints no_grad forwards too.
            return checkpoint_function(function, *args, **kwargs)
        compiling, keywords = torch.compiler.is_compiling(), getattr(checkpoint_function, "keywords", {})
        if self.counters.tensor_parallel is not None and not compiling:
            given, self.counters.tensor_parallel = self.counters.tensor_parallel, None
            if (_autotp_share(self.layer()) or (1, 1, 1))[2] != given:
                raise AttentionStashError(_TP_MISMATCH.format((_autotp_share(self.layer()) or (1, 1, 1))[2], given))
        # Dynamo's frame callback is set where a graph break runs code of a torch.compile region eagerly.
        if compiling or torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False):
            if keywords.get("use_reentrant"):
                # Traced, dynamo runs it as non-reentrant; run eagerly (a graph break), torch refuses a context_fn.
                _refuse_compiled(
                    self, "non-reentrant checkpointing", "use_reentrant=True, which torch.compile never runs: dynamo "
                    "traces every checkpoint as non-reentrant", "Enable checkpointing with use_reentrant=False")
            if self.offload:
                _refuse_compiled(self, "its kept outputs on the device", "offload=True: the compiled graph saves them "
                                 "itself", "Install with offload=None")
            if not compiling:
                _refuse_compiled(self, "dynamo's tracing", *_graph_break(self))
            # Traced by dynamo, as its checkpoint operator: the checkpoint's policy saves the kernel's outputs.
            contexts = partial(_compiled_contexts, self.key, keywords.get("context_fn"))
            return checkpoint_function(function, *args, **kwargs, context_fn=contexts)
        if keywords.get("context_fn") is not None:
            kwargs["context_fn"] = partial(_compiled_contexts, self.key, keywords["context_fn"], False)
        return checkpoint_function(_CheckpointCall(self, function, checkpoint_function), *args, **kwargs)

    def offload_engine(self, checkpoint_function):
        """The offload engine of a first pass (None keeps on the device): the checkpoint's (a CheckpointHiddenStatesOffload
        entered, cpu_checkpointing's), else the install's where it offloads (asked once per function) or offload=True."""
        if self.offload is False:
            return None
        if self.offloads[0] is not checkpoint_function:
            function = getattr(checkpoint_function, "func", checkpoint_function)
            self.offloads = (checkpoint_function, function
                             in (_ds_checkpointing.checkpoint, _ds_checkpointing.non_reentrant_checkpoint),
                             _saves_on_cpu())
        cpu_checkpointing = self.offloads[1] and _ds_checkpointing.CPU_CHECKPOINT
        return (_ds_offload._PATCH_USERS and _ds_offload._current_manager()
                or cpu_checkpointing and _ds_checkpointing._get_cpu_offload_engine()
                or (self.offload or cpu_checkpointing or self.offloads[2]) and self.counters.engine or None)

    def outside_checkpoint(self):
        """For a training call of the layer's attention that the stash's checkpoint call does not run: stand aside
        (stock attention, nothing kept) where the layer's checkpointing was turned off since it was on, warning once
        until a checkpointed call; else raise."""
        if any((getattr(getattr(mode, "policy_fn", None), "args", None) or (None, ))[0] is self
               for mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack()):
            # The eager forward of its compiled checkpoint (_compiled_contexts): dynamo gave up tracing the layer.
            _refuse_compiled(self, "dynamo's tracing", *_graph_break(self))
        layer = self.layer()
        owner = None if layer is None or _held is None else _class_defining(type(layer), _CHECKPOINT_FUNCTION)
        if owner is not None and owner is not _held.layer_class:
            raise AttentionStashError(f"{_FEATURE} needs {self.name} to read its checkpoint function through "
                                      f"GradientCheckpointingLayer, which the stash holds, got a class attribute "
                                      f"{_CHECKPOINT_FUNCTION} on {owner.__name__}, set after the install, that hides "
                                      f"it. Delete that class attribute: activation_checkpointing_enable() sets the "
                                      f"function on each layer.")
        if torch._C._current_graph_task_id() != -1:
            raise AttentionStashError(f"{_FEATURE} needs a kept attention output for the recompute of {self.name}, "
                                      f"got a recompute outside the stash's checkpoint call: of a forward that ran "
                                      f"before the install, by a checkpoint that does not read the layer's "
                                      f"{_CHECKPOINT_FUNCTION}, or of a layer that shares the attention module "
                                      f"without a stash. Install the stash before the forward, and checkpoint the "
                                      f"layer through Hugging Face's activation checkpointing.")
        stand_aside = self.checkpointed and not layer.gradient_checkpointing
        if stand_aside and self.aside:
            return
        model = self.model()
        checkpointed = [] if model is None else [
            plan.name for plan in _model_plans(model, *_entry_points())[0] if plan.layer.gradient_checkpointing
        ]
        stashable = (f" The attention layers checkpointed now are {', '.join(checkpointed)}: remove() the stash and "
                     f"install it again, and num_layers counts those." if checkpointed else "")
        if stand_aside:
            unserved = [
                stash for stash in dict.fromkeys(_STASHES.values()) if stash.counters is self.counters
                and stash.checkpointed and not getattr(stash.layer(), "gradient_checkpointing", True)
            ]
            for stash in unserved:
                stash.aside = True
            logger.warning(f"{_FEATURE}: {', '.join(stash.name for stash in unserved)} run stock attention and keep "
                           f"nothing in training forwards without activation checkpointing, turned off on them since "
                           f"it was on: no recompute to serve. Enable it again to serve them.{stashable}")
            return
        raise AttentionStashError(f"{_FEATURE} needs Hugging Face activation checkpointing for a training forward of "
                                  f"{self.name}, got no activation checkpointing on it (none enabled, every_n_layers "
                                  f"leaves it out, or a layer without a stash shares its attention module). Call "
                                  f"model.activation_checkpointing_enable() (gradient_checkpointing_enable() up to "
                                  f"transformers 5.22), reentrant or not, or put the model in eval mode or "
                                  f"torch.no_grad() for forwards without a backward.{stashable}")

    def raise_other_implementation(self, implementation):
        """Raise for an attention call of the layer through another implementation than the install's."""
        self.raise_if_removed()
        raise AttentionStashError(f'{_FEATURE} needs {self.name} to call attention with attn_implementation='
                                  f'"{self.implementation}", as at the install, in each forward, got a forward with '
                                  f'"{implementation}". Remove the stash before switching the attention '
                                  f'implementation, and stash only layers with softmax attention.')

    def raise_if_removed(self):
        """Raise for a recompute after the removal (the graph holds the stash's node) that does not reach the stash."""
        if not self.active:
            raise AttentionStashError(f"{_FEATURE} needs the recompute of {self.name}, whose forward ran under "
                                      f"non-reentrant checkpointing before handle.remove(), to call attention as that "
                                      f"forward did, got another implementation or entry: that forward's graph holds "
                                      f"the stash's node, whose saves only the stash gives. Change the attention "
                                      f"implementation or its entry after that forward's backward.")

    def raise_without_attention_call(self, reached):
        """Raise for a checkpointed forward of the layer that made no attention call the stash ran; ``reached``:
        whether the layer's attention reached the stash's entry."""
        self.raise_if_removed()
        implementation = self.implementation
        if self.config._attn_implementation != implementation:
            self.raise_other_implementation(self.config._attn_implementation)
        # An active stash's install holds the entry.
        hold = _held.entries[implementation]
        if reached:
            raise AttentionStashError(f"{_FEATURE} needs the {implementation} attention function to call "
                                      f"{_implementation(implementation).calls} in each forward of {self.name}, got "
                                      f"a forward in which {hold.original!r}, the function the stash serves, did not. "
                                      f"Remove the stash from this layer.")
        entry = _held.attention_functions.get(implementation)
        if entry is not hold.front:
            raise AttentionStashError(f'{_FEATURE} needs the attention of {self.name} to reach the {implementation} '
                                      f'entry it installed in {_INTERFACE}, got {entry!r} in {_INTERFACE}'
                                      f'["{implementation}"], put there after the install in place of '
                                      f'{hold.front!r} without calling the entry it replaced (a registration, or '
                                      f'undoing one, such as DeepSpeed Ulysses sequence parallelism\'s). Register '
                                      f'attention functions before installing the stash, or remove the stash before '
                                      f'changing that entry.')
        if hold.function() is not hold.entry:
            raise AttentionStashError(f'{_FEATURE} needs the attention of {self.name} to reach the {implementation} '
                                      f'entry it installed as {hold.description}, got {hold.function()!r} '
                                      f'there, put there after the install without calling the entry it replaced. '
                                      f'Set that function before installing the stash, or remove the stash before '
                                      f'changing it.')
        raise AttentionStashError(f"{_FEATURE} needs the attention modules of {self.name} to call Hugging Face's "
                                  f"attention interface with themselves as its module, got a forward without such a "
                                  f"call (an attention module replaced after the install, or one that calls attention "
                                  f"another way). Install the stash after changing the layer's modules.")


class _CheckpointFunctionSlot:
    """``GradientCheckpointingLayer._gradient_checkpointing_func`` while a stash is installed: stores land in the
    layer's ``__dict__``, as without it; reads on a stashed layer return the stored function wrapped by the stash."""

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        try:
            function = layer.__dict__[_CHECKPOINT_FUNCTION]
        except KeyError:
            raise AttributeError(_CHECKPOINT_FUNCTION) from None
        if torch.compiler.is_compiling():
            # Dynamo resolves a WeakKeyDictionary lookup as the first key's, also for another layer's compiled frame;
            # and it would guard on a cached partial, and recompile.
            stash = _LAYER_STASHES.get(id(layer))
            return function if stash is None or stash.layer() is not layer else partial(stash.checkpoint, function)
        stash = _STASHES.get(layer)
        if stash is None or stash.layer() is not layer:
            return function
        if stash.wrapped is None or stash.wrapped.args[0] is not function:
            stash.wrapped = partial(stash.checkpoint, function)
        return stash.wrapped

    def __set__(self, layer, function):
        layer.__dict__[_CHECKPOINT_FUNCTION] = function

    def __delete__(self, layer):
        try:
            del layer.__dict__[_CHECKPOINT_FUNCTION]
        except KeyError:
            raise AttributeError(_CHECKPOINT_FUNCTION) from None


_SLOT = _CheckpointFunctionSlot()
# Each _LayerStash under a key of its own, which a compiled checkpoint's policy names (dynamo guards on it); and under
# its layer's id, for the slot's compiled reads (entries go in _let_go once inactive or their layer is gone).
_KEYS = itertools.count()
_BY_KEY = weakref.WeakValueDictionary()
_LAYER_STASHES = {}


def _compiled_contexts(key, context_fn, compiled=True):
    """The selective-checkpointing contexts of a stashed layer's checkpoint under torch.compile, made as the compiled
    graph is partitioned: its policy saves the outputs of the kernels the stash serves (MUST_SAVE), composed with the
    checkpoint's own ``context_fn``, whose policy wins where it names an op (MUST_SAVE or MUST_RECOMPUTE). Eager, it
    recomputes them: its cache of what the stash keeps would be a second reference, which no offload moves."""
    stash, user_policy = _BY_KEY.get(key), None
    if context_fn is not None:
        user_policy = getattr(context_fn()[0], "policy_fn", None)
    if stash is None or not (compiled or user_policy):
        # Removed since dynamo traced the call, or eager contexts without a policy: stock.
        return (context_fn or torch.utils.checkpoint.noop_context_fn)()
    record = _implementation(stash.implementation)
    ops, interface = record.compiled_ops(record), _FLASH_INTERFACES.get(stash.implementation)
    refusals = ((not ops, "kernel functions that dynamo traces (torch ops with fake kernels)",
                 f"{interface.description if interface else stash.implementation}, whose kernel functions are Python "
                 f"functions calling compiled kernels", "Train the compiled model with sdpa, flash-attn 2 or a Hub "
                 "build whose kernel functions are such ops"),
                (context_fn and not user_policy, "a context_fn made by create_selective_checkpoint_contexts, the one "
                 "kind dynamo takes", repr(context_fn), "Give the checkpoint such a policy"),
                (torch._functorch.config.activation_memory_budget == 0, "a partitioner that saves what its policy "
                 "must save", "torch._functorch.config.activation_memory_budget = 0, under which AOTAutograd's "
                 "partitioner recomputes every op, the attention kernel too", "Set a budget above 0"))
    for refused, needs, got, fix in refusals if compiled else ():
        if refused:
            _refuse_compiled(stash, needs, got, fix)
    # Outside AOTAutograd's tracing the policy saves the kernel eagerly: dynamo's checkpoint operator under a backend
    # without AOTAutograd (dynamo's "eager") runs the traced layer, whose attention never reaches the stash's entry; a
    # checkpoint run eagerly after a graph break reaches it, which refuses (_LayerStash.outside_checkpoint).
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(
        partial(_compiled_policy, stash if compiled else None, ops, user_policy))


def _refuse_compiled(stash, needs, got, fix):
    raise AttentionStashError(f"{_FEATURE} needs {needs} for the compiled checkpoint of {stash.name}, got {got}. "
                              f"{fix}, or remove the stash (handle.remove()).")


def _graph_break(stash):
    """What runs a stashed layer's checkpoint eagerly under torch.compile, and its fix: a graph break inside the layer,
    named where the stash knows it. kernels >= 0.18 wraps Hugging Face's attention forward (``use_kernelized_func``)
    in one that sets a context variable of its own, which dynamo does not trace inside a checkpoint: the wrapper is
    found by that variable in its globals, wherever the kernels release keeps its module; ZeRO-3 gathers each
    submodule's parameters in hooks dynamo does not trace (torch.compiler.disable)."""
    got = "a checkpoint run eagerly after a graph break in the layer's forward"
    if any(hasattr(param, "ds_id") for module in stash.modules for param in module.parameters(recurse=False)):
        return (f"{got}: DeepSpeed ZeRO stage 3 gathers each submodule's parameters in forward hooks that dynamo does "
                f"not trace, so plain checkpoints run eagerly too", "Compile with ZeRO stage 0, 1 or 2")
    wrapped = [type(module).forward for module in stash.modules if "_kernel_funcs" in vars(module)]
    if (torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
            or not any("_ACTIVE_KERNEL_FUNCS" in getattr(forward, "__globals__", ()) for forward in wrapped)):
        return got, "Remove the graph break"
    return (f"{got}: kernels {importlib.metadata.version('kernels')} sets a context variable there, a mutation dynamo "
            f"does not trace inside a checkpoint, so plain checkpoints run eagerly too", "Set torch._dynamo.config."
            "skip_fwd_side_effects_in_bwd_under_checkpoint = True (the recompute then skips setting that variable and "
            "resetting it, which leave nothing behind)")


def _compiled_policy(stash, ops, user_policy, ctx, op, *args, **kwargs):
    """The compiled checkpoint's policy: MUST_SAVE for a served kernel's op, unless the checkpoint's own policy
    recomputes it; else that policy's answer, or PREFER_RECOMPUTE. Eager (``stash`` None), where the stash keeps the
    served kernel's outputs, PREFER_RECOMPUTE for it."""
    policy = user_policy(ctx, op, *args, **kwargs) if user_policy else _Policy.PREFER_RECOMPUTE
    if getattr(getattr(op, "_schema", None), "name", None) not in ops or policy == _Policy.MUST_RECOMPUTE:
        return policy
    if stash is None:
        return _Policy.PREFER_RECOMPUTE
    stash.counters.compiled.add(stash.name)
    return _Policy.MUST_SAVE


def _stashing_entry(original, place, implementation):
    """The stash's entry for ``implementation`` in front of ``original``, for ``place`` (an _Entry): an attention
    module of a stashed layer, inside its checkpoint call, runs the stash's copy of ``original``, any other call
    ``original``, also after the removal. Raises, before anything changes, for an ``original`` it cannot serve. Where a
    global the copy reads changes (a library's patch, ``mock.patch``), the next call copies again; where the entry
    shadows a key of a mapping behind it, a registration there since the install is called, or refused for a stashed
    layer."""
    served, where, behind, key = implementation.name, place.description, place.behind, place.key
    copy, sources = implementation.copy(implementation, original, where)
    watched = []
    for source in sources:
        names = [name for name in _names_read(source) if name in source.__globals__]
        if names:
            watched.append((source.__globals__, operator.itemgetter(*names)))
    values = [read(module_globals) for module_globals, read in watched]

    def stashing_entry(module, *args, **kwargs):
        nonlocal copy, values
        if torch.compiler.is_compiling():
            return (original if behind is None else behind.get(key, original))(module, *args, **kwargs)
        call = _state.call
        if behind is not None and behind.get(key) is not original:
            if call is not None and module in call.stash.modules and call.serving:
                raise AttentionStashError(f"{_FEATURE} needs the attention of {call.stash.name} to run the {served} "
                                          f"function it served at the install, {original!r}, got {behind.get(key)!r} "
                                          f"registered for it since. Register attention functions before installing "
                                          f"the stash, or remove the stash before registering another.")
            return behind[key](module, *args, **kwargs)
        if call is not None and module in call.stash.modules:
            if call.serving:
                if call.stash.implementation != served:
                    call.stash.raise_other_implementation(served)
                call.reached = True
                try:
                    now = [read(module_globals) for module_globals, read in watched]
                except KeyError:
                    # A global deleted since: the copy's code then fails as the original's would.
                    now = None
                if now != values:
                    copy, values = implementation.copy(implementation, original, where)[0], now
                return copy(module, *args, **kwargs)
            # The recompute of a forward that ran before its stash's removal: stock, as the removal promises.
            return original(module, *args, **kwargs)
        if torch.is_grad_enabled() and module.training:
            stash = _STASHES.get(module)
            if stash is not None and stash.layer() is not None:
                stash.outside_checkpoint()
        return original(module, *args, **kwargs)

    _ENTRIES[stashing_entry] = original
    return stashing_entry


def _wrapped_within(function, match):
    """The first of ``function`` and what it wraps (the ``__wrapped__`` that functools.wraps sets, and the variables
    of its closure), breadth first and a few wrappers deep, for which ``match`` holds; None for none."""
    candidates = [function]
    for _ in range(8):
        inner = []
        for candidate in candidates:
            try:
                if match(candidate):
                    return candidate
            except TypeError:
                # Unhashable, or no weak reference to it: no function.
                pass
            inner.append(getattr(candidate, "__wrapped__", None))
            for cell in getattr(candidate, "__closure__", None) or ():
                try:
                    inner.append(cell.cell_contents)
                except ValueError:
                    # An empty cell: a variable not bound yet.
                    pass
        candidates = [candidate for candidate in inner if candidate is not None]
    return None


def _ulysses_attention(function):
    """The UlyssesSPAttentionHF that DeepSpeed's ALST wraps in ``function`` (register_with_transformers puts that
    closure in its core implementation's entry); None for any other function."""
    ulysses_sp = sys.modules.get("deepspeed.runtime.sequence_parallel.ulysses_sp")
    if ulysses_sp is None:
        return None
    ulysses = ulysses_sp.UlyssesSPAttentionHF
    return _wrapped_within(function, lambda candidate: isinstance(candidate, ulysses) and "attn" in vars(candidate))


def _entry_place(attention_functions, record):
    """An _Entry for where the stash's entry goes: the implementation's key in the mapping Hugging Face's lookups read
    (the interface's local one where it has the key, else the library-wide one), as a later registration would replace
    it; in front of the library-wide one, in the local one, for an implementation that Hugging Face registers again at
    each load of its kernel there; behind the wrapper of DeepSpeed's Ulysses sequence parallelism there, the core
    function it calls."""
    implementation = record.name
    local = getattr(attention_functions, "_local_mapping", None)
    shared = getattr(type(attention_functions), "_global_mapping", None)
    if isinstance(local, dict) and isinstance(shared, dict) and implementation not in local:
        mapping, behind = (local, shared) if record.registered_at_load else (shared, None)
    else:
        mapping, behind = (local if isinstance(local, dict) else attention_functions), None
    ulysses = _ulysses_attention(attention_functions.get(implementation))
    if ulysses is not None:
        return _Entry(
            vars(ulysses), "attn", f"the core attention function of DeepSpeed's Ulysses sequence parallelism "
            f"(UlyssesSPAttentionHF.attn, behind {_INTERFACE}[\"{implementation}\"])")
    return _Entry(mapping, implementation, f"{_INTERFACE}[\"{implementation}\"]", behind)


def _class_defining(cls, name):
    """The first class in ``cls``'s method resolution order whose dictionary has ``name``, or None."""
    return next((klass for klass in cls.__mro__ if name in klass.__dict__), None)


def _take_hold(layer_class, attention_functions, implementation):
    """Put the checkpoint-function slot in place, once for all stashes, and the stash's entry for ``implementation``
    (a record of the table), once for all stashes of that implementation. Under ``_LOCK``."""
    global _held
    if _held is not None and implementation.name in _held.entries:
        return
    entry = _entry_place(attention_functions, implementation)
    current = entry.function()
    # The entry of an earlier install that a library wrapped (or wrote back) serves again: the lookups reach it.
    earlier = _wrapped_within(current, _ENTRIES.__contains__)
    if earlier is not None:
        entry.original, entry.entry = _ENTRIES[earlier], earlier
    else:
        # The entry first: it raises for an original it cannot serve, before anything is changed.
        entry.original, entry.entry = current, _stashing_entry(current, entry, implementation)
    if _held is None:
        _held = _Hold(layer_class, attention_functions, layer_class.__dict__.get(_CHECKPOINT_FUNCTION, _MISSING), {})
        setattr(layer_class, _CHECKPOINT_FUNCTION, _SLOT)
    if current is entry.original:
        entry.put(entry.entry)
    entry.front = attention_functions.get(implementation.name)
    _held.entries[implementation.name] = entry


def _let_go():
    """Undo ``_take_hold`` once no stash is active and no recorded first pass waits for its recompute. Under ``_LOCK``.
    What something else replaced meanwhile stays as that left it."""
    global _held
    for layer_id, stash in list(_LAYER_STASHES.items()):
        if not stash.active or stash.layer() is None:
            del _LAYER_STASHES[layer_id]
    hold = _held
    if hold is None or _RECORDED or any(stash.active and stash.layer() is not None
                                        for stash in list(_STASHES.values())):
        return
    _held = None
    # No forward's digest waits for its recompute now: the weights go with the hold, and the next install starts anew.
    _DIGEST_WEIGHTS.clear()
    for entry in hold.entries.values():
        entry.restore()
    if hold.layer_class.__dict__.get(_CHECKPOINT_FUNCTION) is _SLOT:
        if hold.class_attribute is _MISSING:
            delattr(hold.layer_class, _CHECKPOINT_FUNCTION)
        else:
            setattr(hold.layer_class, _CHECKPOINT_FUNCTION, hold.class_attribute)


def _let_go_quietly(blocking=False):
    """``_let_go`` under the lock; not blocking on it from a collection, which can run inside an install or removal on
    this thread: the next one lets go then. A recompute, which never runs under the lock, blocks."""
    if _LOCK.acquire(blocking=blocking):
        try:
            _let_go()
        finally:
            _LOCK.release()


# ---------------------------------------------------------------------------------------------------------------------
# Discovery and the planner.
# ---------------------------------------------------------------------------------------------------------------------


def _entry_points():
    """The transformers objects the stash hooks into (the decoder-layer class, the attention interface); raises if any
    entry point it uses is missing."""
    missing = [
        f"torch.{name}" for name in _TORCH_ENTRY_POINTS
        if reduce(lambda owner, part: getattr(owner, part, None), name.split("."), torch) is None
    ]
    # Each forward kernel through its torch binding, each backward through torch.ops.aten.
    missing += [f"torch.{ops.op}" for ops in _BACKENDS.values() if not hasattr(torch, ops.op)]
    missing += [
        f"torch.ops.aten.{op}" for op in (f"{ops.op}_backward" for ops in _BACKENDS.values()) if not hasattr(aten, op)
    ]
    try:
        from transformers import modeling_layers, modeling_utils
    except ImportError:
        modeling_layers = modeling_utils = None
    layer_class = getattr(modeling_layers, "GradientCheckpointingLayer", None)
    interface = getattr(modeling_utils, _INTERFACE, None)
    if layer_class is None:
        missing.append("transformers.modeling_layers.GradientCheckpointingLayer")
    if interface is None or "sdpa" not in interface:
        missing.append(f'transformers.modeling_utils.{_INTERFACE}["sdpa"]')
    if missing:
        raise AttentionStashError(f"{_FEATURE} needs PyTorch 2.11 or newer and transformers 5.x, got an installation "
                                  f"without {', '.join(missing)}. It is tested on PyTorch 2.13 to 2.15: install one "
                                  f"of those, and report a newer release that moved these.")
    return layer_class, interface


def _decoder_layers(model, layer_class):
    """The model's per-layer checkpoint units in model order, leaving out any nested inside another."""
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, layer_class) and not any(name.startswith(f"{outer}.") for outer, _ in layers):
            layers.append((name, module))
    return layers


def _forward_of(module):
    forward = inspect.unwrap(type(module).forward)
    return forward if isinstance(getattr(forward, "__code__", None), types.CodeType) else None


def _attention_kind(module, interface):
    """How a module's forward calls attention: "interface" through Hugging Face's attention interface, "own interface"
    through its module's own, "direct" by calling F.scaled_dot_product_attention; None for neither."""
    forward = _forward_of(module)
    if forward is None:
        return None
    names = forward.__code__.co_names
    if _INTERFACE in names:
        return "interface" if forward.__globals__.get(_INTERFACE) is interface else "own interface"
    return "direct" if "scaled_dot_product_attention" in names else None


def _positive_int(source, *names):
    for name in names:
        try:
            value = getattr(source, name, None)
        except Exception:
            # transformers' per-layer configs refuse a global read of an attribute that differs between layers.
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _attention_geometry(module, head_dim_names):
    """(query heads, key/value heads, output head dimension) of an attention module, from its attributes, else its
    config's, under the names transformers' families give them; None where they do not tell."""
    config = getattr(module, "config", None)
    heads = (_positive_int(module, "num_heads", "num_attention_heads", "n_heads")
             or _positive_int(config, "num_attention_heads"))
    if heads is None:
        return None
    head_dim = (_positive_int(module, *head_dim_names, "head_size", "attention_head_size")
                or _positive_int(config, *head_dim_names))
    if head_dim is None:
        hidden = _positive_int(config, "hidden_size")
        head_dim = hidden // heads if hidden and hidden % heads == 0 else None
    if head_dim is None:
        return None
    groups = _positive_int(module, "num_key_value_groups")
    key_heads = (_positive_int(module, "num_key_value_heads", "num_kv_heads")
                 or (heads // groups if groups and heads % groups == 0 else None)
                 or _positive_int(config, "num_key_value_heads") or heads)
    return heads, key_heads, head_dim


@dataclass(slots=True, eq=False)
class _LayerPlan:
    """An attention layer, as the install finds it once: name, layer, attention modules, the config naming their
    implementation, that implementation, and each attention call's (query heads, key/value heads, head dimension), None
    where the modules do not tell."""

    name: str
    layer: torch.nn.Module
    modules: list
    config: object
    implementation: str
    calls: list
    # The attention module whose geometry is not known, by class name, where calls is None.
    unknown: str = None

    def served(self, model):
        """The implementation's record; raises for one the stash does not serve."""
        record = _implementation(self.implementation)
        if record is None:
            raise AttentionStashError(
                f'{_FEATURE} needs a Hugging Face model with attn_implementation "sdpa", '
                f'"flash_attention_2", "flash_attention_3", "flash_attention_4" or a Hub kernel with flash-attn\'s '
                f'interface ("kernels-community/flash-attn2"), got {self.implementation!r} on '
                f'{type(model).__name__} ({self.name}). Load it with from_pretrained(..., '
                f'attn_implementation="sdpa") or one of the others, and pass the model itself '
                f'(engine.module of a DeepSpeed engine).')
        return record

    def geometry(self):
        """The calls' geometry; raises where the planner cannot tell it."""
        if self.calls is None:
            raise AttentionStashError(f"{_FEATURE} needs the head count and head dimension of {self.unknown} in "
                                      f"{self.name} to plan its memory, got neither from its attributes (num_heads, "
                                      f"num_attention_heads, head_dim, head_size, attention_head_size, v_head_dim) "
                                      f"nor from its config. Install with num_layers and no batch shape, which needs "
                                      f"no plan.")
        return self.calls


def _plan(name, layer, modules, model):
    """The plan of an attention layer. Its modules read their implementation from their own config (a multimodal
    model's text config may name another), else the model's; a module makes as many attention calls as its source calls
    the interface's function (1 without a source)."""
    configs = [getattr(module, "config", None) for module in modules] + [getattr(model, "config", None)]
    config = next(config for config in configs
                  if isinstance(getattr(config, "_attn_implementation", None), str) or config is configs[-1])
    implementation = getattr(config, "_attn_implementation", None)
    head_dim_names = ((_implementation(implementation) or _IMPLEMENTATIONS["sdpa"]).head_dim_name, "head_dim")
    calls = []
    for module in modules:
        geometry = _attention_geometry(module, head_dim_names)
        if geometry is None:
            return _LayerPlan(name, layer, modules, config, implementation, None, type(module).__name__)
        try:
            calls += [geometry] * max(1, inspect.getsource(_forward_of(module)).count("attention_interface("))
        except (OSError, TypeError):
            calls.append(geometry)
    return _LayerPlan(name, layer, modules, config, implementation, calls)


def _autotp_share(module):
    """(this rank's part, the whole, the tensor-parallel size) of the width of what ``module``'s row-parallel output
    projection takes, the attention output, where DeepSpeed's AutoTP sharded it; None elsewhere."""
    layer = next((layer for layer in module.modules() if isinstance(layer, LinearAllreduce)), None)
    sizes = getattr(layer, "_partition_sizes", None)
    return None if sizes is None else (sizes[layer.tp_index], sum(sizes), layer.tp_world_size)


# Why an attention layer is left out where activation checkpointing is on for other decoder layers only.
_NOT_CHECKPOINTED = "no activation checkpointing (every_n_layers leaves it out), so no recompute to serve"


def _model_plans(model, layer_class, interface):
    """A plan for each decoder layer with softmax attention through the interface, found from the modules' code, in
    model order (the checkpointed ones, where every_n_layers leaves some out); and the other layers as (name, why left
    out). Raises for a model without any."""
    plans, others, enabled = [], [], []
    for name, layer in _decoder_layers(model, layer_class):
        if layer.gradient_checkpointing:
            enabled.append(name)
        kinds = {}
        for module_name, module in layer.named_modules():
            kind = _attention_kind(module, interface)
            # An attention module that attends to an encoder's states, as transformers names them.
            names = (type(module).__name__.replace("Cross", "cross_attn"), module_name)
            if kind == "interface" and (getattr(module, "is_cross_attention", False) is True
                                        or any(part in name for name in names
                                               for part in ("encoder_attn", "crossattention", "cross_attn"))):
                kind = "cross"
            kinds.setdefault(kind, []).append(module)
        if "interface" in kinds or "cross" in kinds:
            # The planner counts self-attention calls: a causal LM runs its cross-attention only given encoder states.
            plans.append(_plan(name, layer, kinds.get("interface") or kinds["cross"], model))
        elif "direct" in kinds:
            others.append((name, f"{type(kinds['direct'][0]).__name__} calls F.scaled_dot_product_attention itself, "
                           f"not through Hugging Face's attention interface"))
        elif "own interface" in kinds:
            module = kinds["own interface"][0]
            others.append((name, f"{type(module).__name__} calls attention through an attention interface of its own "
                           f"({type(module).__module__}.{_INTERFACE}), not Hugging Face's"))
        else:
            others.append((name, "no softmax attention (linear attention, a state-space or convolution mixer)"))
    if not plans:
        if not others:
            raise AttentionStashError(f"{_FEATURE} needs a model with Hugging Face decoder layers "
                                      f"(GradientCheckpointingLayer), got {type(model).__name__} without any.")
        raise AttentionStashError(f"{_FEATURE} needs decoder layers with softmax attention through Hugging Face's "
                                  f"attention interface ({_INTERFACE}), whose sdpa entry it serves, got none in "
                                  f"{type(model).__name__}: in {others[-1][0]}, {others[-1][1]}. Train this model "
                                  f"without the stash.")
    checkpointed = [plan for plan in plans if plan.layer.gradient_checkpointing]
    if enabled and len(checkpointed) < len(plans):
        if not checkpointed:
            raise AttentionStashError(f"{_FEATURE} needs activation checkpointing on attention layers, whose "
                                      f"recompute it serves, got it on {', '.join(enabled)} only, none of which has "
                                      f"softmax attention (every_n_layers leaves the {len(plans)} attention layers "
                                      f"out). Choose every_n_layers so that it checkpoints attention layers, or train "
                                      f"without the stash.")
        others += [(plan.name, _NOT_CHECKPOINTED) for plan in plans if not plan.layer.gradient_checkpointing]
        plans = checkpointed
    return plans, others


def _sequence_parallel_ranks(sequence_parallel_size, plans, attention_functions):
    """The ranks over which Ulysses sequence parallelism splits each call's heads, and how that is known: (the size
    given, "given"), else (the size of the ALST registration the last layer's lookup reaches, "found registered"), else
    (1, None)."""
    ulysses = _ulysses_attention(attention_functions.get(plans[-1].implementation))
    if sequence_parallel_size is not None:
        _check_positive_int("sequence_parallel_size", sequence_parallel_size)
        if ulysses is not None and ulysses.world_size != sequence_parallel_size:
            raise ValueError(f"{_FEATURE} needs sequence_parallel_size to be that of the Ulysses sequence "
                             f"parallelism registered, {ulysses.world_size}, got {sequence_parallel_size}. Leave it "
                             f"out to plan with the registration's.")
        return sequence_parallel_size, "given"
    return (ulysses.world_size, "found registered") if ulysses is not None else (1, None)


def _tensor_parallel_ranks(tensor_parallel_size, plans):
    """(the tensor-parallel size, how known), the plans' calls made this rank's share of the heads: AutoTP's, else rank
    0's (the largest) over the size given, by DeepSpeed's split (key/value heads, the remainder to the first ranks)."""
    shares = [_autotp_share(plan.modules[0]) for plan in plans]
    found = shares[-1][2] if shares[-1] else 1
    if tensor_parallel_size is not None:
        _check_positive_int("tensor_parallel_size", tensor_parallel_size)
        if found > 1 and found != tensor_parallel_size:
            raise ValueError(_TP_MISMATCH.format(found, tensor_parallel_size))
    given = tensor_parallel_size if found == 1 and tensor_parallel_size != 1 else None
    for plan, share in zip(plans, shares):
        if plan.calls and (share or given):
            split = (lambda count, kv: -(-count * share[0] // share[1])) if share else (
                lambda count, kv: get_shard_size(count, given, AutoTPMeta(kv), rank=0))
            plan.calls = [(split(heads, kv), split(kv, kv), head_dim) for heads, kv, head_dim in plan.calls]
    return max(found, given or 1), "found sharded by AutoTP" if found > 1 else "given: rank 0's share, the largest"


_TP_MISMATCH = (f"{_FEATURE} needs tensor_parallel_size to be the size AutoTP sharded the model with, {{}}, got {{}}. "
                f"Leave it out, or give the config's tensor_parallel.autotp_size.")


def _rank_heads(heads, key_heads, ranks):
    """One rank's query and key/value heads under Ulysses sequence parallelism over ``ranks``: its share of each, or
    one key/value head where there are fewer than ranks (ALST replicates them). Raises, as ALST does, for heads it
    cannot split."""
    if heads % ranks:
        raise ValueError(f"{_FEATURE} needs query heads divisible by the sequence-parallel size to plan them, got "
                         f"{heads} heads and {ranks} ranks.")
    return heads // ranks, max(1, key_heads // ranks)


def _model_dtype(model):
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_FEATURE} needs an integer {name}, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{_FEATURE} needs a positive {name}, got {value}.")


def _layer_bytes(model, micro_batch_size, sequence_length, dtype, device, ranks, plans):
    """(plan, bytes it would keep per micro-batch in flight) of each attention layer, last first and as far as the
    caller reads (a layer the stash would not serve raises once reached); over Ulysses ``ranks``, one rank's."""
    _check_positive_int("micro_batch_size", micro_batch_size)
    _check_positive_int("sequence_length", sequence_length)
    if device is None:
        device = get_accelerator().device_name()
    device = torch.device(device)
    layouts = {}
    for plan in reversed(plans):
        record, nbytes = plan.served(model), 0
        for heads, key_heads, head_dim in plan.geometry():
            heads, key_heads = _rank_heads(heads, key_heads, ranks)
            key = (record, heads, key_heads, head_dim)
            # No heads on this rank (AutoTP): no kernel, nothing kept.
            if heads and key not in layouts:
                layouts[key] = record.layout(record, device, dtype, sequence_length, heads, key_heads, head_dim)
            nbytes += heads and layouts[key].kept_bytes(micro_batch_size, heads, sequence_length, head_dim, dtype)
        yield plan, nbytes


def _fitting_layers(sizes, memory_budget, micro_batches_in_flight, offload=False):
    """The (plan, bytes) of the layers ``sizes`` yields, last first, as long as they fit ``memory_budget`` on the
    device: offloaded, as long as any two consecutive ones fit (the one recomputed and the next one, prefetched)."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget >= 0:
        raise ValueError(f"{_FEATURE} needs a memory_budget in bytes of 0 or more, got {memory_budget!r}.")
    _check_positive_int("micro_batches_in_flight", micro_batches_in_flight)
    fitting = []
    while True:
        try:
            size = next(sizes)
        except StopIteration:
            return fitting
        except AttentionStashError:
            # A layer the stash would not serve (another attention implementation): the layers taken end before it.
            if fitting:
                return fitting
            raise
        window = fitting[-1:] if offload else fitting
        if (sum(nbytes for _, nbytes in window) + size[1]) * micro_batches_in_flight > memory_budget:
            return fitting
        fitting.append(size)


def _check_unshared(model, layer_class, chosen):
    """Raise where an attention module of a layer to stash is also a module of a decoder layer left unstashed: its
    calls there would run outside a stashed checkpoint."""
    attention = {id(module): (plan.name, module) for plan in chosen for module in plan.modules}
    stashed = {id(plan.layer) for plan in chosen}
    for other_name, other in _decoder_layers(model, layer_class):
        if id(other) in stashed:
            continue
        for module in other.modules():
            if id(module) in attention:
                name, module = attention[id(module)]
                raise AttentionStashError(f"{_FEATURE} needs the attention modules of the layers it stashes to be "
                                          f"theirs alone, got the {type(module).__name__} of {name} shared with "
                                          f"{other_name}, which is not stashed. Choose num_layers so that both layers "
                                          f"are stashed, or neither.")


def _install_message(model, chosen, records, plans, others, sizes, micro_batch_size, sequence_length, ranks,
                     tensor_parallel, offload):
    """The install's log line: what is stashed, at what cost (the planner's words where it cannot tell) and where, what
    is left out and why, the checkpoint mode and the implementations (``records``). It never raises."""
    dtype = _model_dtype(model)
    served = " and ".join(f'"{name}"' +
                          (f" ({_FLASH_INTERFACES[name].description})" if name in _FLASH_INTERFACES else "")
                          for name in dict.fromkeys(record.name for record in records))
    count, how = ranks
    per_rank = (f" on each rank of Ulysses sequence parallelism over {count} ranks ({how}): its share of the heads "
                f"over the whole sequence" if count > 1 else "")
    if tensor_parallel[0] > 1:
        none = not any(heads for plan in chosen for heads, *_ in plan.calls or [(1, )])
        per_rank += (f" on this rank of AutoTP over {tensor_parallel[0]} ranks ({tensor_parallel[1]}): its share of "
                     f"the heads{' (none: its calls are served without a kernel)' * none}")
    if sizes is not None:
        cost = (f"{sum(nbytes for _, nbytes in sizes):,} bytes per micro-batch in flight{per_rank} (micro-batch "
                f"{micro_batch_size}, sequence {sequence_length})")
    else:
        try:
            per_token = 0
            for plan, record in zip(chosen, records):
                for heads, key_heads, head_dim in plan.geometry():
                    heads = _rank_heads(heads, key_heads, count)[0]
                    ops = heads and record.layout(record, None, dtype, None, heads, key_heads, head_dim)
                    per_token += heads and ops.kept_bytes(1, heads, 1, head_dim, dtype)
            cost = (f"{per_token:,} bytes per token of each micro-batch in flight in {dtype}{per_rank} (give "
                    f"micro_batch_size and sequence_length for the exact figure)")
        except (AttentionStashError, ValueError):
            cost = "a cost the planner cannot tell for these attention modules"
    # The checkpointing, as far as the last layer's checkpoint function tells now.
    layer = chosen[-1].layer
    reentrant = getattr(layer.__dict__.get(_CHECKPOINT_FUNCTION), "keywords", {}).get("use_reentrant")
    mode = ("checkpointing not enabled yet" if not layer.gradient_checkpointing or reentrant is None else
            "reentrant checkpointing" if reentrant else "non-reentrant checkpointing")
    compiled = ("under torch.compile, the compiled checkpoint saves the kernel's outputs instead (a model compiled "
                "before this install recompiles once)" if all(
                    record.compiled_ops(record)
                    for record in records) else "under torch.compile, refused: dynamo cannot trace these kernels")
    where = ("on the device" if offload is False else "in host memory, two layers' on the device at most"
             if offload else "in host memory where a layer's checkpoint offloads its inputs, else on the device")
    message = (f"{_FEATURE}: keeping the attention output of {len(chosen)} of {len(plans)} attention layers "
               f"({chosen[0].name} to {chosen[-1].name}) for their recompute: {cost}, {where}; {mode}: the "
               f"recompute replays the kept output through the kernel's backward, in either mode; {compiled}; "
               f"attn_implementation {served}.")
    if others:
        reasons = Counter(why for _, why in others)
        message += " Left out: " + "; ".join(
            f"{count} decoder layer{'s' * (count > 1)} {'with' if why.startswith('no ') else 'where'} {why}"
            for why, count in reasons.items()) + "."
    return message


# ---------------------------------------------------------------------------------------------------------------------
# The installer, the handle and the planner's functions.
# ---------------------------------------------------------------------------------------------------------------------


def _planned(model, sequence_parallel_size, tensor_parallel_size, transformers_objects=None):
    """The model's plans and left-out layers, with (Ulysses ranks, how known) and (AutoTP ranks, how known)."""
    _, attention_functions = transformers_objects = transformers_objects or _entry_points()
    plans, others = _model_plans(model, *transformers_objects)
    tensor_parallel = _tensor_parallel_ranks(tensor_parallel_size, plans)
    return plans, others, _sequence_parallel_ranks(sequence_parallel_size, plans, attention_functions), tensor_parallel


def attention_stash_layer_bytes(model: torch.nn.Module,
                                micro_batch_size: int,
                                sequence_length: int,
                                dtype: torch.dtype = None,
                                device=None,
                                sequence_parallel_size: int = None,
                                tensor_parallel_size: int = None) -> int:
    """Bytes the model's last attention layer keeps per micro-batch in flight, stashed: an output plus its log-sum-exp
    per attention call, in the layout of the kernel that runs it (for sdpa, of the backend PyTorch picks on ``device``,
    DeepSpeed's accelerator by default) in ``dtype`` (the model's by default). For Qwen3-30B-A3B (32 query heads, head
    dimension 128) at micro-batch 4 and sequence 4096 in bfloat16: 136 MB. Raises, as the stash does, for a backend it
    cannot replay. Under DeepSpeed's Ulysses sequence parallelism (ALST), one rank's: its share of the heads over the
    whole ``sequence_length``, over ``sequence_parallel_size`` ranks, else the registration's found, else 1. Under
    AutoTP, this rank's share of the heads, as sharded, else rank 0's over ``tensor_parallel_size`` ranks."""
    plans, _, (ranks, _), _ = _planned(model, sequence_parallel_size, tensor_parallel_size)
    sizes = _layer_bytes(model, micro_batch_size, sequence_length, dtype or _model_dtype(model), device, ranks, plans)
    return next(sizes)[1]


def attention_stash_layers_for_budget(model: torch.nn.Module,
                                      memory_budget: int,
                                      micro_batch_size: int,
                                      sequence_length: int,
                                      micro_batches_in_flight: int = 1,
                                      dtype: torch.dtype = None,
                                      device=None,
                                      sequence_parallel_size: int = None,
                                      offload: bool = False,
                                      tensor_parallel_size: int = None) -> int:
    """The largest ``num_layers`` whose stash fits ``memory_budget`` bytes (a rank's under ALST, AutoTP); 0 for none.
    Each stashed layer keeps ``attention_stash_layer_bytes`` per micro-batch in flight: one, unless a schedule runs
    several forwards before their backwards (pipeline schedules). Offloaded, the device holds two layers' at most."""
    plans, _, (ranks, _), _ = _planned(model, sequence_parallel_size, tensor_parallel_size)
    sizes = _layer_bytes(model, micro_batch_size, sequence_length, dtype or _model_dtype(model), device, ranks, plans)
    return len(_fitting_layers(sizes, memory_budget, micro_batches_in_flight, offload))


class AttentionStashHandle:
    """Returned by ``install_attention_stash``: names the stashed layers, counts what they keep, uninstalls them."""

    def __init__(self, stashes, counters, summary="nothing stashed"):
        self._stashes, self._counters = stashes, counters
        # The install's log line: what is stashed, at what cost, and what is left out and why.
        self.summary = summary

    def __repr__(self):
        return (f"AttentionStashHandle({len(self._stashes)} layers, {self.num_kept} kept, {self.recomputes_served} "
                f"served: {self.summary})")

    @property
    def layers(self):
        """Module names of the stashed decoder layers, in model order."""
        return tuple(stash.name for stash in self._stashes)

    @property
    def compiled_layers(self):
        """The stashed layers whose torch.compile graph saves the attention kernel's outputs, as the compiled
        checkpoint's policy was asked for them; the eager counters do not count compiled steps."""
        return tuple(stash.name for stash in self._stashes if stash.name in self._counters.compiled)

    # Attention outputs kept now; the bytes they and their log-sum-exps hold, as attention_stash_layer_bytes counts;
    # the most at once; recomputes served a kept output; kept outputs released without one (no backward, a refusal).
    num_kept = property(lambda self: self._counters.kept)
    kept_bytes = property(lambda self: self._counters.kept_bytes)
    peak_kept_bytes = property(lambda self: self._counters.peak_kept_bytes)
    recomputes_served = property(lambda self: self._counters.recomputes_served)
    released_without_backward = property(lambda self: self._counters.released_without_backward)
    # Bytes of kept outputs and log-sum-exps handed to an offload engine (for host memory), and taken back.
    offloaded_bytes = property(lambda self: self._counters.offloaded_bytes)
    restored_bytes = property(lambda self: self._counters.restored_bytes)

    def __reduce__(self):
        # A copy or pickle of the handle (or of a model that holds it) stashes nothing: the stash is the original's.
        return AttentionStashHandle, ([], _Counters())

    def remove(self):
        """Uninstall: forwards from now on run stock attention. The recompute of a forward that ran before is stock
        under reentrant checkpointing; under non-reentrant checkpointing, whose graph holds the stash's node, the
        stash serves it, and Hugging Face's objects return once no stash is left and no such recompute waits."""
        with _LOCK:
            removed = set(self._stashes)
            for stash in self._stashes:
                stash.active = False
                stash.finalizer.detach()
            for module in [module for module, stash in _STASHES.items() if stash in removed]:
                del _STASHES[module]
            self._stashes = []
            _let_go()


def install_attention_stash(model: torch.nn.Module,
                            num_layers: int = None,
                            *,
                            memory_budget: int = None,
                            micro_batch_size: int = None,
                            sequence_length: int = None,
                            micro_batches_in_flight: int = 1,
                            sequence_parallel_size: int = None,
                            offload: bool = None,
                            tensor_parallel_size: int = None) -> AttentionStashHandle:
    """Keep the attention output of the last ``num_layers`` decoder layers for their checkpoint recompute.

    ``model`` is a Hugging Face model loaded with ``attn_implementation="sdpa"``, ``"flash_attention_2"``,
    ``"flash_attention_3"`` or a Hub kernel with flash-attn's interface (``"kernels-community/flash-attn2"``), each
    layer as its attention modules' config says, and trained with per-layer activation checkpointing, reentrant or not.
    In each checkpointed call of a stashed layer, the first pass runs the kernel F.scaled_dot_product_attention (or
    flash-attn's autograd function) would run and keeps its output and log-sum-exp; the recompute returns them from the
    stash's autograd node, whose backward is the kernel's, and skips the attention forward. What a call keeps is
    released when its recompute takes it, or with its checkpoint's graph.

    ``num_layers`` counts attention layers from the end (the checkpointed ones, where ``every_n_layers`` leaves some
    out). Instead, ``memory_budget`` in bytes with ``micro_batch_size`` and ``sequence_length`` (and
    ``micro_batches_in_flight``) takes the most layers that fit, as ``attention_stash_layers_for_budget`` counts them;
    the batch shape with ``num_layers`` makes the install's log line state the exact cost. Under DeepSpeed's Ulysses
    sequence parallelism (ALST), registered before or after the install, each rank keeps its share of the heads over
    the whole sequence: costs are one rank's, over ``sequence_parallel_size`` ranks where given, else the
    registration's found at the install. Under AutoTP, this rank's share of the heads, as sharded (after
    ``deepspeed.initialize``), else rank 0's over ``tensor_parallel_size`` ranks, checked at the first forward.

    Under ``torch.compile`` (non-reentrant checkpointing; sdpa, flash-attn 2, or a Hub build whose kernels are custom
    ops) a stashed layer's checkpoint gets a selective-checkpointing policy that saves the kernel's outputs instead;
    ``handle.compiled_layers`` names them.

    ``offload=None`` offloads what a layer keeps where its checkpoint offloads its inputs (DeepSpeed's
    ``CheckpointHiddenStatesOffload`` or ``cpu_checkpointing``, transformers' ``offload=True``), through its engine
    where it has one; ``True`` everywhere, ``False`` nowhere. Offloaded, ``memory_budget`` counts two layers.
    Forwards without a backward run stock attention and keep nothing. What the stash cannot serve raises an
    ``AttentionStashError`` naming the cause and the fix, never falling back: attention dropout, a ``torch.func``
    transform, an SDPA backend without an exact replay, a recompute unlike its forward, among others.
    Returns an ``AttentionStashHandle``; its ``remove()`` uninstalls the stash.
    """
    layer_class, attention_functions = _entry_points()
    if F.scaled_dot_product_attention is not _SDPA:
        _raise_replaced_sdpa()
    if (num_layers is None) == (memory_budget is None):
        raise TypeError(f"{_FEATURE} needs exactly one of num_layers and memory_budget, got "
                        f"{'both' if num_layers is not None else 'neither'}.")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)):
        raise TypeError(f"{_FEATURE} needs an integer num_layers, got {type(num_layers).__name__}.")
    if offload not in (None, True, False):
        raise TypeError(f"{_FEATURE} needs offload None (follow the checkpoint), True or False, got {offload!r}.")
    if memory_budget is not None and (micro_batch_size is None or sequence_length is None):
        raise TypeError(f"{_FEATURE} needs micro_batch_size and sequence_length with memory_budget, to size what each "
                        f"layer keeps.")
    plans, others, ranks, tensor_parallel = _planned(model, sequence_parallel_size, tensor_parallel_size,
                                                     (layer_class, attention_functions))
    if ranks[0] > 1:
        # Heads that the ranks cannot split are refused as ALST refuses them, with a batch shape or without.
        for plan in plans:
            for heads, key_heads, _ in plan.calls or ():
                _rank_heads(heads, key_heads, ranks[0])
    if (micro_batch_size is None) != (sequence_length is None):
        raise TypeError(f"{_FEATURE} needs both micro_batch_size and sequence_length, or neither, got one.")
    # The planner sizes the layers the stash takes, from the last one: an earlier layer it would not serve is not.
    planned = partial(_layer_bytes, model, micro_batch_size, sequence_length, _model_dtype(model), None, ranks[0])
    sizes = None
    if memory_budget is not None:
        sizes = _fitting_layers(planned(plans), memory_budget, micro_batches_in_flight, offload is True)
        num_layers = len(sizes)
        if num_layers == 0:
            raise ValueError(f"{_FEATURE} needs a memory_budget of at least one layer's {next(planned(plans))[1]:,} "
                             f"bytes per micro-batch in flight x {micro_batches_in_flight}, got {memory_budget:,}.")
    if not 1 <= num_layers <= len(plans):
        left_out = any(why == _NOT_CHECKPOINTED for _, why in others)
        fix = (f" every_n_layers leaves the others without a recompute to serve: num_layers={len(plans)} stashes all "
               f"it checkpoints." if left_out else "")
        raise ValueError(f"{_FEATURE} needs num_layers from 1 to the model's {len(plans)} {'checkpointed ' * left_out}"
                         f"attention layers (of {len(plans) + len(others)} decoder layers), got {num_layers}.{fix}")
    chosen = plans[-num_layers:]
    if sizes is None and micro_batch_size is not None:
        sizes = list(planned(chosen))
    records = [plan.served(model) for plan in chosen]
    for record in dict.fromkeys(records):
        record.load(record)
    for plan in chosen:
        if _class_defining(type(plan.layer), _CHECKPOINT_FUNCTION) not in (None, layer_class):
            raise AttentionStashError(f"{_FEATURE} needs {plan.name} to keep its checkpoint function per instance, "
                                      f"as GradientCheckpointingLayer does, got a class attribute "
                                      f"{_CHECKPOINT_FUNCTION} on {type(plan.layer).__name__}. Remove that attribute "
                                      f"from the class.")
    _check_unshared(model, layer_class, chosen)
    message = _install_message(model, chosen, records, plans, others, sizes, micro_batch_size, sequence_length, ranks,
                               tensor_parallel, offload)

    counters = _Counters(
        engine=None if offload is False else _ds_offload._ActivationOffloadEngine(min_offload_bytes=0),
        tensor_parallel=tensor_parallel_size)
    with _LOCK:
        for plan in chosen:
            if plan.layer in _STASHES:
                raise AttentionStashError(f"{_FEATURE} needs one install per decoder layer, got a second one on "
                                          f"{plan.name}. Call remove() on the first handle before installing again.")
        # Raises where Hugging Face's entry of an implementation cannot be served, before any stash goes in; what an
        # earlier implementation's hold put in place goes again with it. Nothing raises after it.
        try:
            for record in dict.fromkeys(records):
                _take_hold(layer_class, attention_functions, record)
        except BaseException:
            _let_go()
            raise
        stashes = []
        for plan in chosen:
            stash = _LayerStash(plan, model, counters, offload)
            for module in plan.layer.modules():
                _STASHES[module] = stash
            _LAYER_STASHES[id(plan.layer)] = stash
            stashes.append(stash)
            # A model dropped without remove() leaves nothing installed either.
            stash.finalizer = weakref.finalize(plan.layer, _let_go_quietly)
            stash.finalizer.atexit = False
    log_dist(message, ranks=[0])
    return AttentionStashHandle(stashes, counters, message)
