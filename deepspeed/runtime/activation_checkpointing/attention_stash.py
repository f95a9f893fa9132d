# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
Keep the attention output of Hugging Face decoder layers for their checkpoint recompute.

With per-layer activation checkpointing, the backward pass runs every decoder layer forward again. For the layers it
is installed on, the attention stash keeps the first forward's attention output and log-sum-exp and hands them to the
attention backward, so the recompute skips the attention forward kernel: one autograd node replays them, under
reentrant and non-reentrant checkpointing alike. The memory cost is one attention output plus its log-sum-exp per
stashed layer, from the layer's forward to its recompute. Hugging Face's "sdpa" (PyTorch's fused SDPA kernels) and
"flash_attention_2" (flash-attn 2's) attention implementations are served.

transformers and flash-attn are imported lazily, by ``install_attention_stash``.
"""

import inspect
import math
import operator
import sys
import threading
import types
import weakref
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from deepspeed.utils import logger

aten = torch.ops.aten

_FEATURE = "attention stash"
# PyTorch's builtin that Hugging Face's sdpa function calls as torch.nn.functional's, where nothing replaced it there.
_SDPA = torch._C._nn.scaled_dot_product_attention
# PyTorch entry points beyond the public API; the installer checks them, with the kernels of the backend table.
_TORCH_ENTRY_POINTS = ("_fused_sdp_choice", "_C._current_graph_task_id", "_C._set_grad_enabled",
                       "_C._is_any_autocast_enabled", "_C._are_functorch_transforms_active",
                       "_C._autograd._top_saved_tensors_default_hooks",
                       "_C._dynamo.eval_frame.get_eval_frame_callback", "utils.checkpoint._StopRecomputationError")
# What a non-reentrant checkpoint raises from its recompute's last save, to stop the recompute there.
_StopRecomputationError = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
# The attribute in which Hugging Face keeps a decoder layer's checkpoint function, read at every checkpointed call.
_CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"
# The name under which Hugging Face's modeling code reaches its attention interface.
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
_CHECKPOINTING_HINT = ("model.activation_checkpointing_enable() (gradient_checkpointing_enable() up to transformers "
                       "5.22), reentrant or not")

# ---------------------------------------------------------------------------------------------------------------------
# Per-backend op table. Each entry prepares a mask as F.scaled_dot_product_attention does for the backend, and runs the
# aten forward that F.sdpa dispatches to, with the log-sum-exp: its ``kernel`` returns (output, saved tensors,
# scalars). Each entry is also the recompute's autograd node: its forward returns the kept output, and its backward
# calls the kernel's backward with exactly the arguments of the forward's entry in PyTorch's derivatives.yaml.
# ---------------------------------------------------------------------------------------------------------------------


def _float_mask(mask, dtype):
    """A boolean mask as the additive mask F.sdpa makes of it (0 where attended, -inf elsewhere, in the query's
    dtype); any other mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                       torch.full((), -math.inf, dtype=dtype, device=mask.device))


def _saved_tensors(ctx):
    """The saved tensors of a stash node that saved them in a kernel node's order (a non-reentrant recompute's, whose
    backward does not run unless its graph is differentiated itself), as (query, key, value, mask, output, the
    kernel's other saved tensors)."""
    ordered = [None] * ctx.size
    for index, tensor in zip(ctx.order, ctx.saved_tensors):
        ordered[index] = tensor
    return ordered


class _StashedAttention(torch.autograd.Function):
    """The recompute's attention node, one subclass per backend: returns the output the first pass kept, and its
    backward is the backend kernel's backward. Like autograd's own node for these kernels, that backward is not
    differentiable again."""

    @staticmethod
    def forward(ctx, query, key, value, mask, kept, is_causal, scale):
        # ``kept`` is the first pass's _Kept of the call. Under reentrant checkpointing this node runs the backward,
        # and ``kept.order`` is None. Under non-reentrant checkpointing the first pass's own kernel node runs it: this
        # node saves the tensors that node saved, in its order (see _kernel_with_grad), for the checkpoint to fill
        # that node's saved tensors with them.
        order = kept.order
        if order is None:
            ctx.save_for_backward(query, key, value, mask, kept.output, *kept.tensors)
        else:
            saved = (query, key, value, mask, kept.output, *kept.tensors)
            ctx.save_for_backward(*[saved[index] for index in order])
            ctx.size = len(saved)
        ctx.order, ctx.scalars, ctx.is_causal, ctx.scale = order, kept.scalars, is_causal, scale
        return kept.output

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # The node's apply without autograd.Function.apply's functorch handling, which costs a stashed recompute about
        # as much as the node itself; the stash refuses functorch transforms instead.
        cls.replay = super(torch.autograd.Function, cls).apply


class _CpuFlashOps(_StashedAttention):
    """``F.scaled_dot_product_attention``'s fused CPU kernel; it takes grouped key/value heads as they are."""

    name = "CPU flash attention"
    head_dim_multiple = 1
    ops = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The log-sum-exp is [batch, sequence, heads] in the kernel's accumulation dtype: FP32, FP64 for FP64.
        lse_bytes = 8 if dtype == torch.float64 else 4
        return batch * heads * sequence * (head_dim * dtype.itemsize + lse_bytes)

    @staticmethod
    def prepare_mask(mask, query, key, value):
        return _float_mask(mask, query.dtype)

    @staticmethod
    def kernel(query, key, value, mask, is_causal, scale):
        out, lse = torch._scaled_dot_product_flash_attention_for_cpu(query,
                                                                     key,
                                                                     value,
                                                                     0.0,
                                                                     is_causal,
                                                                     attn_mask=mask,
                                                                     scale=scale)
        return out, (lse, ), ()

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask, out, lse = ctx.saved_tensors if ctx.order is None else _saved_tensors(ctx)
        grad_query, grad_key, grad_value = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad_out, query, key, value, out, lse, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale)
        return grad_query, grad_key, grad_value, None, None, None, None


class _CudnnOps(_StashedAttention):
    """cuDNN attention, PyTorch's first SDPA choice on Hopper and Blackwell GPUs."""

    name = "cuDNN attention"
    head_dim_multiple = 1
    ops = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The output, and an FP32 log-sum-exp of [batch, heads, sequence, 1]; the philox scalars are not counted.
        return batch * heads * sequence * (head_dim * dtype.itemsize + 4)

    @staticmethod
    def prepare_mask(mask, query, key, value):
        # The kernel expands the bias itself.
        return _float_mask(mask, query.dtype)

    @staticmethod
    def kernel(query, key, value, mask, is_causal, scale):
        # compute_log_sumexp=True: under the checkpoint's no_grad first forward F.sdpa would skip the log-sum-exp.
        out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, _ = (
            torch._scaled_dot_product_cudnn_attention(query,
                                                      key,
                                                      value,
                                                      mask,
                                                      True,
                                                      0.0,
                                                      is_causal,
                                                      False,
                                                      scale=scale))
        return out, (lse, philox_seed, philox_offset, cum_seq_q, cum_seq_k), (max_q, max_k)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors if ctx.order is None else _saved_tensors(ctx)
        query, key, value, mask, out, lse, philox_seed, philox_offset, cum_seq_q, cum_seq_k = saved
        max_q, max_k = ctx.scalars
        grad_query, grad_key, grad_value = aten._scaled_dot_product_cudnn_attention_backward.default(grad_out,
                                                                                                     query,
                                                                                                     key,
                                                                                                     value,
                                                                                                     out,
                                                                                                     lse,
                                                                                                     philox_seed,
                                                                                                     philox_offset,
                                                                                                     mask,
                                                                                                     cum_seq_q,
                                                                                                     cum_seq_k,
                                                                                                     max_q,
                                                                                                     max_k,
                                                                                                     0.0,
                                                                                                     ctx.is_causal,
                                                                                                     scale=ctx.scale)
        return grad_query, grad_key, grad_value, None, None, None, None


class _FlashOps(_StashedAttention):
    """FlashAttention-2 on CUDA, PyTorch's first SDPA choice on Ampere and Ada GPUs."""

    name = "flash attention"
    ops = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
    # F.sdpa pads the head dimension to a multiple of 8 for this kernel and slices its output back; so does the stash.
    head_dim_multiple = 8

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The output at the padded head dimension, and an FP32 log-sum-exp of [batch, heads, sequence].
        return batch * heads * sequence * ((head_dim + -head_dim % 8) * dtype.itemsize + 4)

    @staticmethod
    def prepare_mask(mask, query, key, value):
        # PyTorch never picks this kernel for a masked call: it has no mask argument.
        assert mask is None
        return None

    @staticmethod
    def kernel(query, key, value, mask, is_causal, scale):
        out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, _ = (
            torch._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, False, scale=scale))
        return out, (lse, cum_seq_q, cum_seq_k, rng_state, unused), (max_q, max_k)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors if ctx.order is None else _saved_tensors(ctx)
        query, key, value, mask, out, lse, cum_seq_q, cum_seq_k, rng_state, unused = saved
        max_q, max_k = ctx.scalars
        # The derivative passes rng_state and unused as the philox seed and offset.
        grad_query, grad_key, grad_value = aten._scaled_dot_product_flash_attention_backward.default(grad_out,
                                                                                                     query,
                                                                                                     key,
                                                                                                     value,
                                                                                                     out,
                                                                                                     lse,
                                                                                                     cum_seq_q,
                                                                                                     cum_seq_k,
                                                                                                     max_q,
                                                                                                     max_k,
                                                                                                     0.0,
                                                                                                     ctx.is_causal,
                                                                                                     rng_state,
                                                                                                     unused,
                                                                                                     scale=ctx.scale)
        return grad_query, grad_key, grad_value, None, None, None, None


class _EfficientOps(_StashedAttention):
    """Memory-efficient attention on CUDA, PyTorch's choice where flash and cuDNN do not apply."""

    name = "memory-efficient attention"
    head_dim_multiple = 1
    ops = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The output, and an FP32 log-sum-exp whose sequence dimension the kernel pads to a multiple of 32.
        return batch * heads * (sequence * head_dim * dtype.itemsize + (sequence + -sequence % 32) * 4)

    @staticmethod
    def prepare_mask(mask, query, key, value):
        # As F.sdpa's preprocess_mask: a bias whose strides the kernel cannot load is padded in its last dimension and
        # sliced back (the same values, aligned rows), then expanded to [batch, query heads, queries, keys]. PyTorch
        # 2.13 aligns to 8 and older releases to 16; 16 satisfies both.
        bias = _float_mask(mask, query.dtype)
        if bias is None:
            return None
        if bias.stride(-1) != 1 or any(stride % 16 for stride in bias.stride()[:-1]):
            size = bias.shape[-1]
            bias = F.pad(bias, (0, 16 - size % 16))[..., :size]
        return bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])

    @staticmethod
    def kernel(query, key, value, mask, is_causal, scale):
        # compute_log_sumexp=True, as in F.sdpa when grads are required; the log-sum-exp is padded to 32 rows.
        out, lse, philox_seed, philox_offset = torch._scaled_dot_product_efficient_attention(query,
                                                                                             key,
                                                                                             value,
                                                                                             mask,
                                                                                             True,
                                                                                             0.0,
                                                                                             is_causal,
                                                                                             scale=scale)
        return out, (lse, philox_seed, philox_offset), ()

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors if ctx.order is None else _saved_tensors(ctx)
        query, key, value, mask, out, lse, philox_seed, philox_offset = saved
        # grad_input_mask: which of query, key, value and the bias need a gradient; a mask never does here.
        grad_query, grad_key, grad_value, _ = aten._scaled_dot_product_efficient_attention_backward.default(
            grad_out,
            query,
            key,
            value,
            mask,
            out,
            lse,
            philox_seed,
            philox_offset,
            0.0, [*ctx.needs_input_grad[:3], False],
            ctx.is_causal,
            scale=ctx.scale)
        return grad_query, grad_key, grad_value, None, None, None, None


# (device type, the backend torch._fused_sdp_choice reports) -> ops that replay it exactly.
_BACKENDS = {
    ("cpu", SDPBackend.FLASH_ATTENTION.value): _CpuFlashOps,
    ("cuda", SDPBackend.CUDNN_ATTENTION.value): _CudnnOps,
    ("cuda", SDPBackend.FLASH_ATTENTION.value): _FlashOps,
    ("cuda", SDPBackend.EFFICIENT_ATTENTION.value): _EfficientOps,
}
_BACKEND_NAMES = {backend.value: name for name, backend in SDPBackend.__members__.items()}


def _training_choice(query, key, value, mask, is_causal, scale, enable_gqa):
    """The backend F.sdpa picks for these arguments in a training forward, where the query requires grad with grad
    enabled. The first pass runs without grad, where PyTorch may pick another (cuDNN's and flash's limits differ for
    the backward), so it asks with a query that requires grad."""
    grad_enabled = torch.is_grad_enabled()
    if grad_enabled and query.requires_grad:
        return torch._fused_sdp_choice(query, key, value, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    # The grad mode set directly rather than by torch.enable_grad(): this runs in every stashed first pass.
    torch._C._set_grad_enabled(True)
    try:
        return torch._fused_sdp_choice(query.detach().requires_grad_(),
                                       key,
                                       value,
                                       mask,
                                       0.0,
                                       is_causal,
                                       scale=scale,
                                       enable_gqa=enable_gqa)
    finally:
        torch._C._set_grad_enabled(grad_enabled)


def _autocast_inputs(query, key, value, mask):
    """Query, key, value and a float mask in autocast's lower precision where autocast is on for their device, as
    F.sdpa runs them (autocast casts every floating-point argument but float64); the aten ops the stash calls are not
    autocast-aware."""
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
        raise RuntimeError(
            f"{_FEATURE} needs PyTorch to choose a fused SDPA backend it can replay: {served}; got "
            f"{_BACKEND_NAMES.get(choice, choice)} on {device_type}. The math backend and any other have "
            f"no exact replay. An sdpa_kernel context, torch.use_deterministic_algorithms(True), or a "
            f"dtype or head dimension no fused kernel takes changes the choice.")
    return ops


# What the table's mask preparation is checked against: the mask F.sdpa itself passes to the kernel, once per backend,
# mask dtype and query dtype in a process, since that preparation has changed between PyTorch releases.
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
    kernel = _KernelArguments(getattr(aten, ops.ops[0]).default)
    with torch.no_grad(), sdpa_kernel([getattr(SDPBackend, _BACKEND_NAMES[choice])]), kernel:
        _SDPA(query, key, value, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    # No arguments where F.sdpa ran no such kernel call: then no mask of theirs matches.
    arguments = kernel.arguments or {}
    theirs = next((arguments[name] for name in ("attn_mask", "attn_bias") if name in arguments), None)
    if not (isinstance(theirs, torch.Tensor) and theirs.dtype == bias.dtype and theirs.shape == bias.shape
            and torch.equal(theirs, bias)):
        raise RuntimeError(f"{_FEATURE} needs its mask for {ops.name} to be the one F.scaled_dot_product_attention "
                           f"passes the kernel in torch {torch.__version__}, got another ({bias.dtype} "
                           f"{tuple(bias.shape)} against {getattr(theirs, 'dtype', None)} "
                           f"{tuple(getattr(theirs, 'shape', ()))}). Train masked batches without the stash on this "
                           f"PyTorch.")
    _MASKS_CHECKED.add((ops, mask.dtype, query.dtype))


# (ops, whether a mask is given) -> the positions in (query, key, value, mask, output, *the kernel's saved tensors) of
# the tensors that the kernel's own autograd node saves, in the order it saves them: PyTorch's generated code sets that
# order per kernel, whatever the shapes, device or dtype. Learned from the first such call in a process.
_NATIVE_SAVES = {}


def _recording_hooks(hooks):
    """Saved-tensor hooks that note each save, in order, and hand it on to ``hooks`` (the (pack, unpack) in force, a
    non-reentrant checkpoint's; None for none, where saves stay as they are): (the list of saves, pack, unpack)."""
    pack, unpack = hooks if hooks is not None else (_identity, _identity)
    saved = []

    def recording_pack(tensor):
        saved.append(tensor)
        return pack(tensor)

    return saved, recording_pack, unpack


def _identity(tensor):
    return tensor


def _kernel_with_grad(ops, query, key, value, bias, is_causal, scale):
    """Run the kernel with grad, as a non-reentrant checkpoint's first pass does, leaving its own autograd node in the
    graph: (output, saved tensors, scalars, the node's save order as _NATIVE_SAVES holds it).

    The first call of a backend and mask presence in a process learns the order from this very call: the saved-tensor
    hooks in force (the checkpoint's) still pack every save, and a recording pack hook in front of them notes which
    tensor each save is. Nothing else runs, and nothing is held after the call. Where no order is known yet and no
    saved-tensor hooks are in force, nothing will fill the node's saves: the order stays None, and the recompute's node
    runs the backward itself. Raises for a saved tensor the stash does not have."""
    kind = (ops, bias is None)
    order = _NATIVE_SAVES.get(kind)
    hooks = None if order is not None else torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return (*ops.kernel(query, key, value, bias, is_causal, scale), order)
    packed, recording_pack, unpack = _recording_hooks(hooks)
    with torch.autograd.graph.saved_tensors_hooks(recording_pack, unpack):
        out, tensors, scalars = ops.kernel(query, key, value, bias, is_causal, scale)
    if out.grad_fn is None:
        # No input requires grad: the kernel has no node, and neither will the recompute's.
        return out, tensors, scalars, None
    candidates = (query, key, value, bias, out, *tensors)
    roles = [[index for index, candidate in enumerate(candidates) if candidate is tensor] for tensor in packed]
    # Each save takes the first of its roles not taken yet: a tensor in two roles (a key that is the value) is saved
    # twice, and either role gives the recompute's node the same tensor.
    order = []
    for matches in roles:
        order.append(next((index for index in matches if index not in order), None))
    if None in order:
        raise RuntimeError(
            f"{_FEATURE} needs to know each tensor that the {ops.name} kernel's autograd node saves, to "
            f"serve non-reentrant checkpointing, got {len(packed)} saved tensors of which it knows "
            f"{len(packed) - order.count(None)} in torch {torch.__version__}. Use reentrant checkpointing "
            f"(use_reentrant=True) with the stash on this PyTorch.")
    order = tuple(order)
    # Where a tensor had two roles, which save was which is not known: the order serves this call only.
    if all(len(matches) == 1 for matches in roles):
        _NATIVE_SAVES[kind] = order
    return out, tensors, scalars, order


def _mask_identity(mask):
    return mask.data_ptr(), mask.shape, mask.stride(), mask.dtype, mask._version


# Rows of a mask digested at once, so that a digest never holds more than this slice of the mask in float64.
_DIGEST_ROWS = 256
# Random weights over the keys of a mask, per device: one vector, extended when a mask with more keys comes and never
# changed in its prefix, so that two digests of one shape use the same weights; as long as the most keys digested.
_DIGEST_WEIGHTS = {}


def _mask_digest(mask):
    """A fingerprint of a mask's values, for a mask the checkpoint does not hold: for each query row, the sum of its
    finite values and the sum of its -inf positions, each against fixed random weights over the keys, in float64.
    Equal masks give equal digests bit for bit (the same kernels on the same shapes); a mask with other values gives
    another, but for a coincidence of the weights."""
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


# ---------------------------------------------------------------------------------------------------------------------
# flash-attn 2, behind Hugging Face's "flash_attention_2": flash_attn_func for plain batches, flash_attn_varlen_func
# for padded batches (unpadded first) and packed ones. flash-attn's own autograd functions (FlashAttnFunc and
# FlashAttnVarlenFunc) pad the head dimension to a multiple of 8 inside their forward, save (query, key, value, padded
# output, log-sum-exp, [cu_seqlens_q, cu_seqlens_k,] rng_state) and call flash-attn's backward op. The stash's nodes
# below do the same, but for the forward kernel: the recompute's node returns the kept output.
# ---------------------------------------------------------------------------------------------------------------------


def _flash_attn_interface():
    """flash-attn's interface module, which the stash calls as flash-attn's autograd functions do; imported by the
    install of a model with attn_implementation="flash_attention_2"."""
    global _flash_attn
    if _flash_attn is not None:
        return _flash_attn
    try:
        from flash_attn import flash_attn_interface
    except ImportError as error:
        raise RuntimeError(f'{_FEATURE} needs flash-attn 2 (the flash_attn package) for attn_implementation='
                           f'"flash_attention_2", got an import error: {error}. Install flash-attn 2, or load the '
                           f'model with attn_implementation="sdpa".') from error
    missing = [name for name in _FLASH_ATTN_ENTRY_POINTS if not hasattr(flash_attn_interface, name)]
    if missing:
        raise RuntimeError(f"{_FEATURE} needs flash-attn 2's interface as flash-attn 2.8 has it, got "
                           f"flash_attn {getattr(sys.modules.get('flash_attn'), '__version__', '?')} without "
                           f"{', '.join(missing)}. Install flash-attn 2.8, or load the model with "
                           f"attn_implementation=\"sdpa\".")
    _flash_attn = flash_attn_interface
    return flash_attn_interface


# flash_attn.flash_attn_interface, once the install of a flash_attention_2 model imported and checked it.
_flash_attn = None

# What the stash uses of flash_attn.flash_attn_interface.
_FLASH_ATTN_ENTRY_POINTS = ("flash_attn_func", "flash_attn_varlen_func", "_wrapped_flash_attn_forward",
                            "_wrapped_flash_attn_varlen_forward", "_wrapped_flash_attn_backward",
                            "_wrapped_flash_attn_varlen_backward")


class _FlashArguments:
    """The arguments of one flash-attn call that its backward takes; the varlen ones are None for a plain batch."""

    __slots__ = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                 "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "versions")

    def __init__(self, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        self.dropout_p = dropout_p
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.window_size = window_size
        self.softcap = softcap
        self.alibi_slopes = alibi_slopes
        self.deterministic = deterministic
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_k = cu_seqlens_k
        self.max_seqlen_q = max_seqlen_q
        self.max_seqlen_k = max_seqlen_k
        # The cu_seqlens' version counters now: a padding-free collator's reach both passes as the same tensors.
        self.versions = None if cu_seqlens_q is None else (cu_seqlens_q._version, cu_seqlens_k._version)

    def differing(self, other):
        """The name of the first argument in which ``other`` differs from these; None for none. The cu_seqlens are
        compared by value, or, where both passes got the same tensor, by its version counter: unchanged, it holds the
        same values, without reading them from the device."""
        for name in ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_size", "softcap",
                     "deterministic", "dropout_p"):
            if getattr(self, name) != getattr(other, name):
                return name
        if self.alibi_slopes is not other.alibi_slopes:
            return "alibi_slopes"
        if self.versions is not None:
            for name, version in zip(("cu_seqlens_q", "cu_seqlens_k"), self.versions):
                ours, theirs = getattr(self, name), getattr(other, name)
                if ours is theirs:
                    if theirs._version != version:
                        return f"{name} (changed in place)"
                elif ours.shape != theirs.shape or not torch.equal(ours, theirs):
                    return name
        return None


def _pad_head_dim(tensors):
    """The tensors zero-padded to a head dimension that is a multiple of 8, as flash-attn's autograd functions pad
    them (not differentiably: their backward slices the gradients)."""
    head_dim = tensors[0].shape[-1]
    if head_dim % 8 == 0:
        return tensors
    return [F.pad(tensor, [0, 8 - head_dim % 8]) for tensor in tensors]


class _StashedFlashAttention(torch.autograd.Function):
    """The recompute's node for one flash-attn call, one subclass per flash-attn function: as flash-attn's autograd
    function, its forward pads the head dimension and saves what that function saves, in its order, and its backward
    is that function's, call for call; but its forward returns the kept output. Under non-reentrant checkpointing the
    first pass's flash-attn node runs the backward, its saves filled by this node's. The varlen function differs from
    the plain one by its cu_seqlens (saved) and maximum lengths (passed), which a plain call's arguments lack."""

    @staticmethod
    def forward(ctx, query, key, value, kept, arguments):
        head_dim = query.shape[-1]
        if query.requires_grad or key.requires_grad or value.requires_grad:
            query, key, value = _pad_head_dim((query, key, value))
            lse, rng_state = kept.tensors
            ctx.save_for_backward(query, key, value, kept.output, lse, *_cu_seqlens(arguments), rng_state)
            ctx.arguments = arguments
        return kept.output[..., :head_dim]

    @staticmethod
    def kernel(query, key, value, arguments):
        """The forward kernel call of flash-attn's function, on its padded query, key and value: (padded output,
        log-sum-exp, rng_state)."""
        if arguments.cu_seqlens_q is None:
            forward, varlen, extra = _flash_attn._wrapped_flash_attn_forward, (), {}
        else:
            forward, extra = _flash_attn._wrapped_flash_attn_varlen_forward, {"block_table": None}
            varlen = (*_cu_seqlens(arguments), arguments.max_seqlen_q, arguments.max_seqlen_k)
        out, lse, _, rng_state = forward(query,
                                         key,
                                         value,
                                         *varlen,
                                         arguments.dropout_p,
                                         arguments.softmax_scale,
                                         causal=arguments.causal,
                                         window_size_left=arguments.window_size[0],
                                         window_size_right=arguments.window_size[1],
                                         softcap=arguments.softcap,
                                         alibi_slopes=arguments.alibi_slopes,
                                         return_softmax=False,
                                         **extra)
        return out, lse, rng_state

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, *cu_seqlens, rng_state = ctx.saved_tensors
        arguments = ctx.arguments
        if cu_seqlens:
            backward, varlen = _flash_attn._wrapped_flash_attn_varlen_backward, (*cu_seqlens, arguments.max_seqlen_q,
                                                                                 arguments.max_seqlen_k)
        else:
            backward, varlen = _flash_attn._wrapped_flash_attn_backward, ()
        grad_query, grad_key, grad_value = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        head_dim = grad_out.shape[-1]
        (grad_out_padded, ) = _pad_head_dim((grad_out, ))
        backward(grad_out_padded,
                 query,
                 key,
                 value,
                 out,
                 lse,
                 grad_query,
                 grad_key,
                 grad_value,
                 *varlen,
                 arguments.dropout_p,
                 arguments.softmax_scale,
                 arguments.causal,
                 arguments.window_size[0],
                 arguments.window_size[1],
                 arguments.softcap,
                 arguments.alibi_slopes,
                 arguments.deterministic,
                 rng_state=rng_state)
        return grad_query[..., :head_dim], grad_key[..., :head_dim], grad_value[..., :head_dim], None, None

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The output at the head dimension padded to a multiple of 8, and an FP32 log-sum-exp of [batch, heads,
        # sequence]; varlen's of [heads, total tokens] is as large for batch x sequence tokens.
        return batch * heads * sequence * ((head_dim + -head_dim % 8) * dtype.itemsize + 4)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # As for _StashedAttention: apply without functorch's handling, which the stash refuses.
        cls.replay = super(torch.autograd.Function, cls).apply


def _cu_seqlens(arguments):
    """A varlen call's (cu_seqlens_q, cu_seqlens_k); () for a plain call."""
    return () if arguments.cu_seqlens_q is None else (arguments.cu_seqlens_q, arguments.cu_seqlens_k)


class _FlashAttnOps(_StashedFlashAttention):
    """flash-attn 2's flash_attn_func (FlashAttnFunc), for plain batches."""

    name = "flash-attn 2 (flash_attn_func)"
    function = "flash_attn_func"
    # How many tensors flash-attn's function saves.
    saves = 6


class _FlashAttnVarlenOps(_StashedFlashAttention):
    """flash-attn 2's flash_attn_varlen_func (FlashAttnVarlenFunc), for padded batches, unpadded, and packed ones."""

    name = "flash-attn 2 (flash_attn_varlen_func)"
    function = "flash_attn_varlen_func"
    saves = 8


def _flash_with_grad(ops, query, key, value, arguments):
    """Call flash-attn's function itself with grad, as a non-reentrant checkpoint's first pass does, leaving its
    autograd node in the graph: (its output, and the padded output, log-sum-exp and rng_state that node saves).

    A recording pack hook in front of the saved-tensor hooks in force (the checkpoint's) notes the node's saves;
    they are flash-attn's, in its order, and the padded output is the one whose slice the function returned."""
    saved, recording_pack, unpack = _recording_hooks(torch._C._autograd._top_saved_tensors_default_hooks(False))
    function = getattr(_flash_attn, ops.function)
    varlen = ()
    if arguments.cu_seqlens_q is not None:
        varlen = (*_cu_seqlens(arguments), arguments.max_seqlen_q, arguments.max_seqlen_k)
    with torch.autograd.graph.saved_tensors_hooks(recording_pack, unpack):
        out = function(query,
                       key,
                       value,
                       *varlen,
                       dropout_p=arguments.dropout_p,
                       softmax_scale=arguments.softmax_scale,
                       causal=arguments.causal,
                       window_size=arguments.window_size,
                       softcap=arguments.softcap,
                       alibi_slopes=arguments.alibi_slopes,
                       deterministic=arguments.deterministic)
    if len(saved) != ops.saves or out._base is not saved[3]:
        got = (f"{len(saved)} saved tensors"
               if len(saved) != ops.saves else "an output that is not a slice of the fourth saved tensor")
        raise RuntimeError(f"{_FEATURE} needs the autograd node of {ops.name} to save {ops.saves} tensors and "
                           f"return a slice of the fourth, the padded output, as flash-attn 2.8 does, got {got} in "
                           f"flash_attn {getattr(sys.modules.get('flash_attn'), '__version__', '?')}. Use reentrant "
                           f"checkpointing (use_reentrant=True) with the stash on this flash-attn.")
    return out, saved[3], saved[4], saved[-1]


# ---------------------------------------------------------------------------------------------------------------------
# One checkpoint call of a stashed layer.
# ---------------------------------------------------------------------------------------------------------------------


def _raise_replaced_sdpa():
    raise RuntimeError(f"{_FEATURE} needs torch.nn.functional.scaled_dot_product_attention to be PyTorch's own, "
                       f"whose kernels it replays, got {F.scaled_dot_product_attention!r} put in its place. Remove "
                       f"that replacement, or train without the stash.")


class _ThreadState(threading.local):
    # The checkpoint call whose layer function runs on this thread now, if any: the one its attention call serves.
    call = None


_state = _ThreadState()


class _Kept:
    """What the first pass keeps of one attention call, until the recompute's call of the same index takes it."""

    __slots__ = ("ops", "output", "tensors", "scalars", "nbytes", "version", "order")

    def __init__(self, ops, output, tensors, scalars, nbytes, version, order):
        # The backend's ops; the attention output; the kernel's other saved tensors, its log-sum-exp first; its
        # scalars; the bytes counted (output and log-sum-exp); the output's version counter when kept; the positions
        # of the kernel node's saves (see _kernel_with_grad), None where the recompute's node runs the backward.
        self.ops = ops
        self.output = output
        self.tensors = tensors
        self.scalars = scalars
        self.nbytes = nbytes
        self.version = version
        self.order = order


class _CheckpointCall:
    """One checkpointed call of a stashed decoder layer.

    The stash hands it to the layer's checkpoint function in place of the layer's function, so the checkpoint runs
    it in both of its passes, the first forward and the recompute in the backward, and holds it exactly as long as its
    graph. What its first pass keeps of each attention call lives in it, in call order: released when the recompute's
    call of the same index takes it, or with the graph.
    """

    # Class defaults, so that the one object made per checkpointed call sets only its first two attributes.
    passes = 0
    # Attention calls made so far in the current pass: the index of the next one.
    calls = 0
    # Whether an attention module of the layer reached the stash's sdpa entry in the current pass.
    reached = False
    # A _Kept for each attention call of the first pass, None once the recompute took it.
    kept = ()
    # What identifies the masks (and flash-attn's position_ids) of the first pass's calls, for the recompute to compare,
    # by (call index, role); None without any: (True, identity) for a tensor the checkpoint holds, (False, (shape,
    # dtype), digest) for one built in the layer.
    masks = None

    def __init__(self, stash, function):
        self.stash = stash
        self.function = function

    def __call__(self, *args, **kwargs):
        passes = self.passes = self.passes + 1
        if passes == 1:
            self.kept = []
        elif passes > 2:
            raise RuntimeError(f"{_FEATURE} needs one backward per forward of {self.stash.name}, got a second "
                               f"backward through a retained graph (backward(retain_graph=True)): the first backward "
                               f"took the kept attention output. Sum the losses into one backward, or remove the "
                               f"stash for such steps.")
        elif not self.stash.active:
            # Removed between the forward and this recompute, which runs stock attention: what was kept goes now.
            self._release()
        self.calls = 0
        self.reached = False
        previous = _state.call
        _state.call = self
        try:
            outputs = self.function(*args, **kwargs)
        except _StopRecomputationError:
            # A non-reentrant recompute stopped at its last save: each of its attention calls has reached the stash by
            # then, or the tensors it saved are not the forward's.
            if passes == 2 and self.stash.active and self.calls < len(self.kept):
                self._check_recompute_calls()
            raise
        except BaseException:
            # A refusal, or any error, in either pass: no recompute will take what is kept, so it goes now, not with
            # the graph (which the caller's loss and the exception's frames may hold a while).
            self._release()
            raise
        finally:
            _state.call = previous
        if passes == 1 and not self.calls and self.stash.active:
            self.stash.raise_without_attention_call(self.reached)
        if passes == 2:
            if self.calls != len(self.kept) and self.stash.active:
                self._check_recompute_calls()
            # Each entry was taken: nothing is left for the release.
            self.kept = ()
        return outputs

    def _check_recompute_calls(self):
        """Raise for a recompute that made other attention calls than its forward, releasing what is kept."""
        expected = len(self.kept)
        self._release()
        if not self.calls:
            self.stash.raise_without_attention_call(self.reached)
        raise RuntimeError(f"{_FEATURE} needs the recompute of {self.stash.name} to make its forward's "
                           f"{expected} attention calls, got {self.calls}. Keep a layer's attention calls the "
                           f"same from a forward to its backward, or remove the stash from this layer.")

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        """F.scaled_dot_product_attention for one attention call of the layer, with the arguments it got: the first
        pass runs the kernel F.sdpa would run and keeps its outputs, the recompute's call of the same index returns
        them from an autograd node whose backward is that kernel's backward. Under non-reentrant checkpointing, whose
        first pass records a graph, the first pass runs the kernel with grad, so that PyTorch's own node for it is in
        the graph and runs the backward; the recompute's node saves what that node saved, for the checkpoint to fill
        its saved tensors."""
        if F.scaled_dot_product_attention is not _SDPA:
            _raise_replaced_sdpa()
        index = self.calls
        self.calls = index + 1
        # This runs in both passes of every stashed layer: what an unmasked call without dropout needs comes first.
        if dropout_p != 0.0 or attn_mask is not None or self.masks is not None:
            self._check_arguments(attn_mask, dropout_p, index)
        if torch._C._is_any_autocast_enabled():
            query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
        choice = _training_choice(query, key, value, attn_mask, is_causal, scale, enable_gqa)
        # The device's type without making a torch.device, for the devices the table serves.
        device_type = "cuda" if query.is_cuda else "cpu" if query.is_cpu else query.device.type
        ops = _BACKENDS.get((device_type, choice))
        kept = self.kept
        if self.passes > 1:
            entry = kept[index] if index < len(kept) else None
            if entry is None or entry.ops is not ops or entry.output.dtype != query.dtype:
                self._raise_unlike_forward(entry, ops, query, index, device_type, choice)
        elif ops is None:
            _ops_for(device_type, choice)
        bias = None
        if attn_mask is not None:
            bias = ops.prepare_mask(attn_mask, query, key, value)
            if (ops, attn_mask.dtype, query.dtype) not in _MASKS_CHECKED:
                _check_mask_preparation(ops, choice, bias, query, key, value, attn_mask, is_causal, scale, enable_gqa)
        head_dim = 0
        if ops.head_dim_multiple != 1 and query.shape[-1] % ops.head_dim_multiple:
            # As F.sdpa does: the scale from the unpadded head dimension, then zero padding, differentiably.
            head_dim = query.shape[-1]
            scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
            query, key, value = (F.pad(t, (0, -t.shape[-1] % ops.head_dim_multiple)) for t in (query, key, value))
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and torch._C._are_functorch_transforms_active():
            self._raise_functorch()
        if self.passes == 1:
            if grad_enabled:
                # A non-reentrant checkpoint: the kernel's own autograd node records this pass's graph and runs the
                # backward, and the recompute's node saves what that node saves, in its order.
                out, tensors, scalars, order = _kernel_with_grad(ops, query, key, value, bias, is_causal, scale)
                # An alias for the call: the output itself would tie the call to the graph.
                output = out.detach()
            else:
                out, tensors, scalars = ops.kernel(query, key, value, bias, is_causal, scale)
                output, order = out, None
            # The output and its log-sum-exp; the other saved tensors are scalars of a few bytes.
            nbytes = out.nbytes + tensors[0].nbytes
            kept.append(_Kept(ops, output, tensors, scalars, nbytes, out._version, order))
            self.stash.counters.add(nbytes)
        else:
            out = self._replay(entry, index, ops.replay, query, key, value, bias, entry, is_causal, scale)
        return out[..., :head_dim] if head_dim else out

    def _replay(self, entry, index, replay, *args):
        """The recompute of attention call ``index``: takes its kept ``entry`` and returns ``replay(*args)``, the
        recompute's node applied, counting the entry served, or released where the node raises. Raises for an output
        changed since the forward."""
        if entry.output._version != entry.version:
            raise RuntimeError(f"{_FEATURE} needs the attention output of {self.stash.name} unchanged from its "
                               f"forward to its recompute, got an in-place change of it (or of a view of it) in "
                               f"the forward. Change a copy of the attention output, or remove the stash from "
                               f"this layer.")
        self.kept[index] = None
        try:
            out = replay(*args)
        except _StopRecomputationError:
            # A non-reentrant checkpoint stops its recompute at its last save, which may be the node's.
            self.stash.counters.served(entry.nbytes)
            raise
        except BaseException:
            self.stash.counters.released(entry.nbytes)
            raise
        self.stash.counters.served(entry.nbytes)
        return out

    def _raise_unlike_forward(self, entry, ops, query, index, device_type=None, choice=None):
        """Raise for a recompute's attention call that differs from its forward's in dtype or backend."""
        if entry is not None and entry.output.dtype != query.dtype:
            raise RuntimeError(f"{_FEATURE} needs the recompute of {self.stash.name} to run attention in its "
                               f"forward's dtype, got {entry.output.dtype} in the forward and {query.dtype} in the "
                               f"recompute (attention call {index + 1}): autocast differs between the passes, as "
                               f"under a checkpoint function that does not restore it in its recompute "
                               f"(deepspeed.checkpointing.checkpoint does not). Use torch.utils.checkpoint, as "
                               f"Hugging Face does by default, or train without autocast.")
        if ops is None:
            _ops_for(device_type, choice)
        raise RuntimeError(f"{_FEATURE} needs one attention kernel for both passes of {self.stash.name}, got "
                           f"{entry.ops.name if entry else 'none'} in the forward and {ops.name} in the recompute "
                           f"(attention call {index + 1}). Keep sdpa_kernel contexts, deterministic-algorithm "
                           f"settings, a batch's packing and a layer's attention calls the same for a forward and "
                           f"its backward.")

    def flash(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
              softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
              block_table):
        """flash-attn 2's flash_attn_func (``cu_seqlens_q`` None) or flash_attn_varlen_func for one attention call of
        the layer, with the arguments Hugging Face gave it: the first pass runs the forward kernel flash-attn's
        autograd function would run and keeps its padded output, log-sum-exp and rng_state, the recompute's call of
        the same index returns the output from a node whose backward is that function's. Under non-reentrant
        checkpointing the first pass calls flash-attn's function itself, whose node records the graph and runs the
        backward, and keeps what that node saves; the recompute's node saves the same, for the checkpoint to fill its
        saved tensors."""
        index = self.calls
        self.calls = index + 1
        ops = _FlashAttnOps if cu_seqlens_q is None else _FlashAttnVarlenOps
        if (dropout_p != 0.0 or return_attn_probs or block_table is not None or alibi_slopes is not None
                or isinstance(softcap, torch.Tensor)):
            self._check_flash_arguments(dropout_p, return_attn_probs, block_table, alibi_slopes, softcap)
        if softmax_scale is None:
            # As flash-attn's autograd functions: from the head dimension before padding.
            softmax_scale = query.shape[-1]**(-0.5)
        arguments = _FlashArguments(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and torch._C._are_functorch_transforms_active():
            self._raise_functorch()
        kept = self.kept
        if self.passes == 1:
            if grad_enabled and (query.requires_grad or key.requires_grad or value.requires_grad):
                out, output, lse, rng_state = _flash_with_grad(ops, query, key, value, arguments)
            else:
                output, lse, rng_state = ops.kernel(*_pad_head_dim((query, key, value)), arguments)
                out = output[..., :query.shape[-1]]
            nbytes = output.nbytes + lse.nbytes
            kept.append(_Kept(ops, output, (lse, rng_state), arguments, nbytes, output._version, None))
            self.stash.counters.add(nbytes)
            return out
        entry = kept[index] if index < len(kept) else None
        if entry is None or entry.ops is not ops or entry.output.dtype != query.dtype:
            self._raise_unlike_forward(entry, ops, query, index)
        differing = entry.scalars.differing(arguments)
        if differing is not None:
            self._release()
            if differing.startswith(("cu_seqlens", "max_seqlen")):
                fix = ("Keep the batch's packing, padding, position_ids and cu_seq_lens the same from a forward to "
                       "its backward")
            else:
                fix = ("Keep flash-attn's settings (FLASH_ATTENTION_DETERMINISTIC, a layer's softcap, window and "
                       "scale) the same from a forward to its backward")
            raise RuntimeError(f"{_FEATURE} needs the recompute of {self.stash.name} to call {ops.name} with its "
                               f"forward's arguments, got another {differing} (attention call {index + 1}): the "
                               f"kept output is the forward's. {fix}.")
        return self._replay(entry, index, ops.replay, query, key, value, entry, arguments)

    def _check_flash_arguments(self, dropout_p, return_attn_probs, block_table, alibi_slopes, softcap):
        """The guards of a flash-attn call with an argument other than Hugging Face's training defaults."""
        if dropout_p != 0.0:
            raise RuntimeError(f"{_FEATURE} needs attention dropout 0 in {self.stash.name}, got {dropout_p}. Set the "
                               f"model config's attention_dropout to 0.0, or remove the stash.")
        if return_attn_probs or block_table is not None:
            raise RuntimeError(f"{_FEATURE} needs flash-attn calls that return the attention output alone, without a "
                               f"block table, in {self.stash.name}, got "
                               f"{'return_attn_probs=True' if return_attn_probs else 'a block_table'}. Remove the "
                               f"stash from this layer.")
        if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.requires_grad:
            raise RuntimeError(f"{_FEATURE} needs ALiBi slopes that do not require grad in {self.stash.name}, got "
                               f"learned ones, whose gradient flash-attn does not compute. Remove the stash from "
                               f"layers with learned ALiBi slopes.")
        if isinstance(softcap, torch.Tensor):
            raise RuntimeError(f"{_FEATURE} needs a softcap that is a number in {self.stash.name}, got a tensor"
                               f"{' that requires grad (a learned softcap)' if softcap.requires_grad else ''}, which "
                               f"flash-attn's kernels take as a constant. Remove the stash from this layer.")

    def _raise_functorch(self):
        raise RuntimeError(f"{_FEATURE} needs the training forwards of {self.stash.name} to run under autograd "
                           f"alone, got a torch.func transform (grad, vjp, vmap, jacrev). Remove the stash, or "
                           f"take gradients with backward() rather than torch.func.")

    def _check_arguments(self, attn_mask, dropout_p, index):
        """The guards of an attention call that has dropout or a mask (or whose layer had a mask in the first pass)."""
        if dropout_p != 0.0:
            raise RuntimeError(f"{_FEATURE} needs attention dropout 0 in {self.stash.name}, got {dropout_p}. Set the "
                               f"model config's attention_dropout to 0.0, or remove the stash.")
        if attn_mask is not None and attn_mask.requires_grad:
            raise RuntimeError(f"{_FEATURE} needs an attention mask that does not require grad in {self.stash.name}, "
                               f"got a learned one. Remove the stash from layers with learned attention biases.")
        self.compare_input(index, "attention mask", attn_mask)

    def compare_input(self, index, role, tensor):
        """Remember, in the first pass, the tensor that plays ``role`` in attention call ``index`` (an sdpa mask, or
        the padding mask and position_ids that decide where Hugging Face's flash path unpads, packs and pads back a
        batch), and compare the recompute's call of the same index with it. A tensor the checkpoint holds is compared
        by identity and version counter, one built inside the layer by a digest of its values."""
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
            raise RuntimeError(f"{_FEATURE} needs the recompute of {self.stash.name} to get its forward's {role}, "
                               f"got a change from or to none: the kept output is the forward's. Keep a batch's "
                               f"masks and position_ids the same from a forward to its backward.")
        if tensor is None:
            return
        if expected[0]:
            if _mask_identity(tensor) != expected[1]:
                raise RuntimeError(f"{_FEATURE} needs the recompute of {self.stash.name} to get its forward's {role}, "
                                   f"got another one (another tensor, shape or version): the kept output is the "
                                   f"forward's. Do not change a mask or position_ids in place between a forward and "
                                   f"its backward.")
        elif (tensor.shape, tensor.dtype) != expected[1] or not all(
                torch.equal(ours, theirs) for ours, theirs in zip(_mask_digest(tensor), expected[2])):
            raise RuntimeError(f"{_FEATURE} needs the recompute of {self.stash.name} to build the {role} its "
                               f"forward built inside the layer, got one with other values (a nondeterministic "
                               f"choice, such as a top-k over tied scores, can differ between the passes): the kept "
                               f"output is the forward's. Make the mask's computation deterministic, or remove the "
                               f"stash from this layer.")

    def _holds(self, tensor):
        """Whether the checkpoint holds ``tensor``'s storage: whether it is (a view of) a tensor bound in the layer's
        checkpointed function, as Hugging Face binds a layer's keyword arguments, its attention mask among them. A mask
        passed otherwise is compared by value, as one built in the layer is."""
        pointer = tensor.untyped_storage().data_ptr()
        bound = (*getattr(self.function, "args", ()), *(getattr(self.function, "keywords", None) or {}).values())
        return any(
            isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == pointer for value in bound)

    def _release(self):
        for entry in self.kept:
            if entry is not None:
                self.stash.counters.released(entry.nbytes)
        self.kept = ()

    # The checkpoint's graph was freed without the recompute taking these: their forward had no backward.
    __del__ = _release


class _Counters:
    """What the stashes of one install keep and serve, for its handle: attention outputs, one per attention call."""

    def __init__(self):
        self.kept = self.kept_bytes = self.peak_kept_bytes = 0
        self.recomputes_served = self.released_without_backward = 0

    def add(self, nbytes):
        self.kept += 1
        self.kept_bytes += nbytes
        if self.kept_bytes > self.peak_kept_bytes:
            self.peak_kept_bytes = self.kept_bytes

    def served(self, nbytes):
        self.kept -= 1
        self.kept_bytes -= nbytes
        self.recomputes_served += 1

    def released(self, nbytes):
        self.kept -= 1
        self.kept_bytes -= nbytes
        self.released_without_backward += 1


class _LayerStash:
    """The stash of one decoder layer: wraps each of its checkpointed calls in a ``_CheckpointCall``."""

    def __init__(self, name, layer, model, config, counters):
        self.name = name
        # The attention implementation served, Hugging Face's name for it.
        self.implementation = config._attn_implementation
        self.layer = weakref.ref(layer)
        # The layer's modules at the install: only their attention calls are the layer's, not those of a model that
        # a hook inside the layer runs.
        self.modules = weakref.WeakSet(layer.modules())
        # The model it was installed on, for the error messages.
        self.model = weakref.ref(model)
        self.config = config
        self.counters = counters
        self.active = True
        # The stored checkpoint function wrapped for the last read, while it is the one stored.
        self.wrapped = None

    def checkpoint(self, checkpoint_function, function, *args, **kwargs):
        """The layer's checkpoint function, as the stash hands it to Hugging Face's checkpointed call."""
        if not torch.is_grad_enabled():
            # No graph, so no backward to serve: transformers <= 5.22 checkpoints no_grad forwards too.
            return checkpoint_function(function, *args, **kwargs)
        # Dynamo's frame callback is set inside a torch.compile region, also where a graph break runs code eagerly.
        if torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False):
            raise RuntimeError(f"{_FEATURE} needs eager execution for a training forward of {self.name}, got "
                               f"torch.compile, whose graphs would break around the stash's state in every stashed "
                               f"layer and whose gradients the stash cannot promise. Train the compiled model "
                               f"without the stash (handle.remove()), or the stashed model without torch.compile.")
        return checkpoint_function(_CheckpointCall(self, function), *args, **kwargs)

    def raise_outside_checkpoint(self):
        """Raise for a training call of the layer's attention that the stash's checkpoint call does not run."""
        layer = self.layer()
        owner = None if layer is None or _held is None else _class_defining(type(layer), _CHECKPOINT_FUNCTION)
        if owner is not None and owner is not _held.layer_class:
            raise RuntimeError(f"{_FEATURE} needs {self.name} to read its checkpoint function through "
                               f"GradientCheckpointingLayer, which the stash holds, got a class attribute "
                               f"{_CHECKPOINT_FUNCTION} on {owner.__name__}, set after the install, that hides it. "
                               f"Delete that class attribute: activation_checkpointing_enable() sets the function on "
                               f"each layer.")
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(f"{_FEATURE} needs a kept attention output for the recompute of {self.name}, got a "
                               f"recompute outside the stash's checkpoint call: of a forward that ran before the "
                               f"install, by a checkpoint that does not read the layer's {_CHECKPOINT_FUNCTION}, or "
                               f"of a layer that shares the attention module without a stash. "
                               f"Install the stash before the forward, and checkpoint the layer through Hugging "
                               f"Face's activation checkpointing.")
        model = self.model()
        checkpointed = [] if model is None else [
            name for name, layer, _ in _model_attention_layers(model)[0] if layer.gradient_checkpointing
        ]
        stashable = (f" The attention layers checkpointed now are {', '.join(checkpointed)}: remove() the stash and "
                     f"install it again, and num_layers counts those." if checkpointed else "")
        raise RuntimeError(f"{_FEATURE} needs Hugging Face activation checkpointing for a training forward of "
                           f"{self.name}, got no activation checkpointing on it (none enabled, every_n_layers leaves "
                           f"it out, or a layer without a stash shares its attention module). Call "
                           f"{_CHECKPOINTING_HINT}, or put the model in eval mode or "
                           f"torch.no_grad() for forwards without a backward.{stashable}")

    def raise_other_implementation(self, implementation):
        """Raise for an attention call of the layer through another implementation than the install's."""
        raise RuntimeError(f'{_FEATURE} needs {self.name} to call attention with attn_implementation='
                           f'"{self.implementation}", as at the install, in each forward, got a forward with '
                           f'"{implementation}". Remove the stash before switching the attention implementation, '
                           f'and stash only layers with softmax attention.')

    def raise_without_attention_call(self, reached):
        """Raise for a checkpointed forward of the layer that made no attention call the stash ran; ``reached``:
        whether the layer's attention reached the stash's sdpa entry."""
        implementation = self.implementation
        if self.config._attn_implementation != implementation:
            self.raise_other_implementation(self.config._attn_implementation)
        # An active stash's install holds the entry.
        hold = _held.entries[implementation]
        if reached:
            kernel = _KERNEL_CALLED[implementation]
            raise RuntimeError(f"{_FEATURE} needs the {implementation} attention function to call {kernel} in each "
                               f"forward of {self.name}, got a forward in which {hold.original!r}, the function the "
                               f"stash serves, did not. Remove the stash from this layer.")
        entry = _held.attention_functions.get(implementation)
        if entry is not hold.front:
            raise RuntimeError(f'{_FEATURE} needs the attention of {self.name} to reach the {implementation} entry '
                               f'it installed in {_INTERFACE}, got {entry!r} in {_INTERFACE}["{implementation}"], put '
                               f'there after the install in place of {hold.front!r} without calling the entry it '
                               f'replaced (a registration, or undoing one, such as DeepSpeed Ulysses sequence '
                               f'parallelism\'s). Register attention functions before installing the stash, or remove '
                               f'the stash before changing that entry.')
        if hold.place.function() is not hold.entry:
            raise RuntimeError(f'{_FEATURE} needs the attention of {self.name} to reach the {implementation} entry '
                               f'it installed as {hold.place.description}, got {hold.place.function()!r} there, put '
                               f'there after the install without calling the entry it replaced. Set that function '
                               f'before installing the stash, or remove the stash before changing it.')
        raise RuntimeError(f"{_FEATURE} needs the attention modules of {self.name} to call Hugging Face's attention "
                           f"interface with themselves as its module, got a forward without such a call (an attention "
                           f"module replaced after the install, or one that calls attention another way). Install "
                           f"the stash after changing the layer's modules.")


# ---------------------------------------------------------------------------------------------------------------------
# The hold on each decoder layer's checkpoint function, and the wrapper of Hugging Face's "sdpa" attention function.
# ---------------------------------------------------------------------------------------------------------------------

# Every submodule of a stashed decoder layer, attention modules among them, maps to that layer's stash.
_STASHES = weakref.WeakKeyDictionary()
# Install and remove change process-wide entries; one at a time.
_LOCK = threading.Lock()
# The hold on Hugging Face's sdpa entry and its layer class, while any stash is installed: a _Hold.
_held = None
# What GradientCheckpointingLayer's class dictionary held under _CHECKPOINT_FUNCTION before the slot went in.
_MISSING = object()
# Each sdpa entry the stash made, to the function it stands in front of: a library that wrapped one may write it back.
_ENTRIES = weakref.WeakKeyDictionary()


class _Hold:
    """What the stash changed in Hugging Face's objects, to undo: the layer class that has the checkpoint-function
    slot, and for each attention implementation served, its _Entry."""

    def __init__(self, layer_class, attention_functions):
        self.layer_class = layer_class
        self.attention_functions = attention_functions
        self.class_attribute = layer_class.__dict__.get(_CHECKPOINT_FUNCTION, _MISSING)
        self.entries = {}


class _Entry:
    """The stash's entry for one attention implementation: the place whose function it replaced (see _entry_place),
    that function, and the entry."""

    def __init__(self, place, original, entry):
        self.place = place
        self.original = original
        self.entry = entry
        # What the interface's lookup of the implementation returns with the entry in place: the entry, or a wrapper
        # in front of it.
        self.front = None


class _CheckpointFunctionSlot:
    """``GradientCheckpointingLayer._gradient_checkpointing_func`` while a stash is installed.

    Hugging Face stores each layer's checkpoint function on the layer and reads it at every checkpointed call. Stores
    still land in the layer's ``__dict__``; reads on a stashed layer return the stored function wrapped by the stash,
    whenever checkpointing was enabled, and reads on any other layer return it as stored.
    """

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        try:
            function = layer.__dict__[_CHECKPOINT_FUNCTION]
        except KeyError:
            raise AttributeError(_CHECKPOINT_FUNCTION) from None
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


def _module_view(module, **entries):
    """A module object with ``entries`` in front of ``module``'s attributes."""
    view = types.ModuleType(module.__name__)
    view.__dict__.update(entries, __getattr__=partial(getattr, module))
    return view


def _attention_of_current_call(query,
                               key,
                               value,
                               attn_mask=None,
                               dropout_p=0.0,
                               is_causal=False,
                               *,
                               scale=None,
                               enable_gqa=False):
    # F.sdpa's signature spelled out: binding named arguments costs less than passing *args and **kwargs on.
    return _state.call.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _flash_of_current_call(q,
                           k,
                           v,
                           dropout_p=0.0,
                           softmax_scale=None,
                           causal=False,
                           window_size=(-1, -1),
                           softcap=0.0,
                           alibi_slopes=None,
                           deterministic=False,
                           return_attn_probs=False):
    # flash_attn_func's signature.
    return _state.call.flash(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, None)


def _flash_varlen_of_current_call(q,
                                  k,
                                  v,
                                  cu_seqlens_q,
                                  cu_seqlens_k,
                                  max_seqlen_q,
                                  max_seqlen_k,
                                  dropout_p=0.0,
                                  softmax_scale=None,
                                  causal=False,
                                  window_size=(-1, -1),
                                  softcap=0.0,
                                  alibi_slopes=None,
                                  deterministic=False,
                                  return_attn_probs=False,
                                  block_table=None):
    # flash_attn_varlen_func's signature.
    return _state.call.flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                             causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)


def _names_read(function):
    """The names a function's code and the functions defined in it read, attributes and globals alike: those defined
    in it run with its globals too."""
    code = getattr(function, "__code__", None)
    codes, names = [code] if isinstance(code, types.CodeType) else [], set()
    while codes:
        names.update(codes[-1].co_names)
        codes += [const for const in codes.pop().co_consts if isinstance(const, types.CodeType)]
    return names


def _copy_with(function, entries):
    """A copy of ``function`` whose module globals are a snapshot of its module's, with ``entries`` in front: every
    other name resolves at dictionary speed, as in the original."""
    copy = types.FunctionType(function.__code__, {
        **function.__globals__,
        **entries
    }, function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def _sdpa_copy(function, where):
    """A copy of Hugging Face's sdpa function that runs its code unchanged, but for one name: where its code reaches
    F.scaled_dot_product_attention through a module global (``torch``, ``torch.nn``, ``F`` or the function itself),
    the copy reaches the current checkpoint call's ``sdpa``. Grouped heads, causality, masks, cropping and output
    post-processing stay Hugging Face's, for any transformers version, at the cost of one Python call. Returns the
    copy and the functions whose module globals it snapshots."""
    functional = _module_view(F, scaled_dot_product_attention=_attention_of_current_call)
    nn = _module_view(torch.nn, functional=functional)
    views = {
        id(torch): _module_view(torch, nn=nn),
        id(torch.nn): nn,
        id(F): functional,
        id(_SDPA): _attention_of_current_call
    }
    module_globals = getattr(function, "__globals__", None)
    names = _names_read(function)
    entries = {name: views[id(module_globals[name])] for name in names if id(module_globals.get(name)) in views}
    if not entries or _SDPA.__name__ not in names:
        raise RuntimeError(f"{_FEATURE} needs Hugging Face's sdpa attention function, which calls "
                           f"torch.nn.functional.scaled_dot_product_attention in its own code, as {where}, got "
                           f"{function!r}, which does not (a wrapper around another attention function, or another "
                           f"kernel). Install the stash before wrapping or replacing that entry.")
    return _copy_with(function, entries), (function, )


def _flash_copy(function, where):
    """A copy of Hugging Face's flash_attention_2 function (flash_attention_forward) that runs its code unchanged,
    but where it calls _flash_attention_forward, the copy calls a copy of that whose lazy_import_flash_attention
    hands out the current checkpoint call's ``flash`` in place of flash-attn's flash_attn_func and
    flash_attn_varlen_func. Unpadding, packing (cu_seqlens from a padding-free collator or from position_ids), sliding
    windows and softcapping stay Hugging Face's. Returns the copy and the functions whose module globals it
    snapshots."""
    inner = getattr(function, "__globals__", {}).get("_flash_attention_forward")
    if ("_flash_attention_forward" not in _names_read(function)
            or "lazy_import_flash_attention" not in _names_read(inner)
            or not callable(inner.__globals__.get("lazy_import_flash_attention"))):
        raise RuntimeError(f"{_FEATURE} needs Hugging Face's flash_attention_2 attention function, which calls "
                           f"flash-attn through transformers.modeling_flash_attention_utils._flash_attention_forward, "
                           f"as {where}, got {function!r}, which does not (a wrapper around another attention "
                           f"function, or another kernel). Install the stash before wrapping or replacing that entry.")
    lazy_import = partial(_stashing_flash_import, inner.__globals__["lazy_import_flash_attention"])
    inner_copy = _copy_with(inner, {"lazy_import_flash_attention": lazy_import})
    checked = partial(_flash_inputs_checked, inner_copy)
    return _copy_with(function, {"_flash_attention_forward": checked}), (function, inner)


def _flash_inputs_checked(flash_attention_forward,
                          query,
                          key,
                          value,
                          attention_mask,
                          *args,
                          position_ids=None,
                          **kwargs):
    """Hugging Face's _flash_attention_forward for a stashed call, once the current checkpoint call has compared
    what decides where the kept output goes, but never reaches flash-attn: the padding mask, from which Hugging Face
    unpads the batch and pads the output back (a mask whose rows keep their number of tokens at other positions gives
    the same cu_seqlens), and the position_ids it packs a batch from (and rotates the queries and keys with)."""
    call = _state.call
    if attention_mask is not None or position_ids is not None or call.masks is not None:
        call.compare_input(call.calls, "padding mask", attention_mask)
        call.compare_input(call.calls, "position_ids", position_ids)
    return flash_attention_forward(query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)


def _stashing_flash_import(lazy_import, implementation, *args, **kwargs):
    """Hugging Face's lazy_import_flash_attention for a stashed call: what it returns, with flash-attn's
    flash_attn_func and flash_attn_varlen_func replaced by the current checkpoint call's."""
    (function, varlen_function, *others), processors = lazy_import(implementation, *args, **kwargs)
    if function is not _flash_attn.flash_attn_func or varlen_function is not _flash_attn.flash_attn_varlen_func:
        raise RuntimeError(f"{_FEATURE} needs Hugging Face's flash_attention_2 to call flash-attn 2's "
                           f"flash_attn_func and flash_attn_varlen_func, whose kernels it replays, got "
                           f"{function!r} and {varlen_function!r} (another flash attention package, a hub kernel, or "
                           f"an NPU build). Train without the stash, or load the model with "
                           f"attn_implementation=\"sdpa\".")
    return (_flash_of_current_call, _flash_varlen_of_current_call, *others), processors


# Each served attention implementation, to how the stash copies Hugging Face's function for it, and to the kernel
# function that copy calls.
_COPIES = {"sdpa": _sdpa_copy, "flash_attention_2": _flash_copy}
_KERNEL_CALLED = {
    "sdpa": "torch.nn.functional.scaled_dot_product_attention",
    "flash_attention_2": "flash-attn's flash_attn_func or flash_attn_varlen_func"
}


def _stashing_entry(original, where, implementation):
    """The function the stash puts in Hugging Face's interface as its entry for ``implementation``, in front of
    ``original``.

    An attention module of a stashed layer, called inside the layer's checkpoint call, runs the stash's copy of
    ``original`` (see _COPIES); every other call runs ``original`` itself. It keeps doing so after the stash lets go
    of the entry, for a library that wrapped it meanwhile: after the removal, that wrapper calls what it would have
    called without the stash. Raises, before anything is changed, where ``original`` cannot be served.

    The copy's globals are a snapshot of its module's: where a name it reads there changes later (a library's patch
    of ``repeat_kv``, ``mock.patch``), the next call makes a new copy, so that it runs what the original would."""
    make_copy = _COPIES[implementation]
    copy, sources = make_copy(original, where)
    # The module globals each copied function reads, and their values when the copy was made.
    watched = []
    for source in sources:
        names = [name for name in _names_read(source) if name in source.__globals__]
        if names:
            watched.append((source.__globals__, operator.itemgetter(*names)))
    values = [read(module_globals) for module_globals, read in watched]

    def stashing_entry(module, *args, **kwargs):
        nonlocal copy, values
        call = _state.call
        if call is not None and module in call.stash.modules:
            if call.stash.active:
                if call.stash.implementation != implementation:
                    call.stash.raise_other_implementation(implementation)
                call.reached = True
                try:
                    now = [read(module_globals) for module_globals, read in watched]
                except KeyError:
                    # A global deleted since: the copy's code then fails as the original's would.
                    now = None
                if now != values:
                    copy, values = make_copy(original, where)[0], now
                return copy(module, *args, **kwargs)
            # The recompute of a forward that ran before its stash's removal: stock, as the removal promises.
            return original(module, *args, **kwargs)
        if torch.is_grad_enabled() and module.training:
            stash = _STASHES.get(module)
            # A stash whose layer was collected leaves its modules to whatever runs them now.
            if stash is not None and stash.layer() is not None:
                stash.raise_outside_checkpoint()
        return original(module, *args, **kwargs)

    _ENTRIES[stashing_entry] = original
    return stashing_entry


class _Place:
    """Where the sdpa function that Hugging Face's lookups reach is held: a key of a dictionary, whose function the
    stash's entry replaces and the removal writes back."""

    def __init__(self, dictionary, key, description):
        self.dictionary = dictionary
        self.key = key
        self.description = description

    def function(self):
        return self.dictionary.get(self.key)

    def put(self, function):
        self.dictionary[self.key] = function


def _ulysses_attention(function):
    """The UlyssesSPAttentionHF whose wrapper ``function`` is: DeepSpeed's Ulysses sequence parallelism (ALST) puts a
    closure around it in the interface's entry of its core implementation (register_with_transformers). None for any
    other function."""
    ulysses_sp = sys.modules.get("deepspeed.runtime.sequence_parallel.ulysses_sp")
    if ulysses_sp is None:
        return None
    for cell in getattr(function, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:
            continue
        if isinstance(content, ulysses_sp.UlyssesSPAttentionHF) and "attn" in vars(content):
            return content
    return None


def _entry_place(attention_functions, implementation):
    """Where the stash's entry goes: the implementation's entry of the mapping that Hugging Face's lookups read (the
    interface's local mapping where it has one there, else its library-wide one, which AttentionInterface.register
    writes), so that a later registration replaces it as it would replace the original. Where DeepSpeed's Ulysses
    sequence parallelism has put its wrapper there, the wrapper stays in front, and the stash's entry goes behind it,
    in place of the core attention function the wrapper calls on the gathered sequence."""
    local = getattr(attention_functions, "_local_mapping", None)
    shared = getattr(type(attention_functions), "_global_mapping", None)
    if isinstance(local, dict) and isinstance(shared, dict) and implementation not in local:
        mapping = shared
    else:
        mapping = local if isinstance(local, dict) else attention_functions
    ulysses = _ulysses_attention(mapping[implementation])
    if ulysses is not None:
        return _Place(
            vars(ulysses), "attn", f"the core attention function of DeepSpeed's Ulysses sequence parallelism "
            f"(UlyssesSPAttentionHF.attn, behind {_INTERFACE}[\"{implementation}\"])")
    return _Place(mapping, implementation, f"{_INTERFACE}[\"{implementation}\"]")


# ---------------------------------------------------------------------------------------------------------------------
# The planner and the installer.
# ---------------------------------------------------------------------------------------------------------------------


def _resolves(root, dotted_name):
    for name in dotted_name.split("."):
        root = getattr(root, name, None)
        if root is None:
            return False
    return True


def _entry_points():
    """The transformers objects the stash hooks into; raises if any entry point it uses is missing."""
    missing = [f"torch.{name}" for name in _TORCH_ENTRY_POINTS if not _resolves(torch, name)]
    # Each forward kernel through its torch binding, each backward through torch.ops.aten.
    missing += [f"torch.{ops.ops[0]}" for ops in _BACKENDS.values() if not hasattr(torch, ops.ops[0])]
    missing += [f"torch.ops.aten.{ops.ops[1]}" for ops in _BACKENDS.values() if not hasattr(aten, ops.ops[1])]
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        GradientCheckpointingLayer = None
        missing.append("transformers.modeling_layers.GradientCheckpointingLayer")
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        ALL_ATTENTION_FUNCTIONS = None
    if ALL_ATTENTION_FUNCTIONS is None or "sdpa" not in ALL_ATTENTION_FUNCTIONS:
        missing.append('transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]')
    if missing:
        raise RuntimeError(f"{_FEATURE} needs PyTorch 2.11 or newer and transformers 5.x, got an installation without "
                           f"{', '.join(missing)}.")
    return GradientCheckpointingLayer, ALL_ATTENTION_FUNCTIONS


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
    """How a module's own forward calls attention: "interface" through Hugging Face's attention interface (the sdpa
    entry the stash serves), "own interface" through an attention interface of its module's own, "direct" by calling
    F.scaled_dot_product_attention itself; None for a module that calls none of them."""
    forward = _forward_of(module)
    if forward is None:
        return None
    names = forward.__code__.co_names
    if _INTERFACE in names:
        return "interface" if forward.__globals__.get(_INTERFACE) is interface else "own interface"
    return "direct" if "scaled_dot_product_attention" in names else None


def _is_cross_attention(name, module):
    """Whether an attention module of a decoder layer attends to an encoder's states, as transformers names them."""
    return (getattr(module, "is_cross_attention", False) is True or "Cross" in type(module).__name__
            or any(part in name for part in ("encoder_attn", "crossattention", "cross_attn")))


def _attention_layers(model, layer_class, interface):
    """The decoder layers with softmax attention through the attention interface, as (name, layer, attention
    modules), and the others as (name, why they are left out), in model order; found from the modules' code, without
    running the model."""
    attention_layers, others = [], []
    for name, layer in _decoder_layers(model, layer_class):
        kinds = {}
        for module_name, module in layer.named_modules():
            kind = _attention_kind(module, interface)
            if kind == "interface" and _is_cross_attention(module_name, module):
                kind = "cross"
            kinds.setdefault(kind, []).append(module)
        if "interface" in kinds or "cross" in kinds:
            # The planner counts self-attention calls: a causal LM runs its cross-attention only given encoder states.
            attention_layers.append((name, layer, kinds.get("interface") or kinds["cross"]))
        elif "direct" in kinds:
            others.append((name, f"{type(kinds['direct'][0]).__name__} calls F.scaled_dot_product_attention itself, "
                           f"not through Hugging Face's attention interface"))
        elif "own interface" in kinds:
            module = kinds["own interface"][0]
            others.append((name, f"{type(module).__name__} calls attention through an attention interface of its own "
                           f"({type(module).__module__}.{_INTERFACE}), not Hugging Face's"))
        else:
            others.append((name, "no softmax attention (linear attention, a state-space or convolution mixer)"))
    return attention_layers, others


def _calls_per_forward(module):
    """How many attention calls a module's forward makes, counted in its source: the calls of the function it takes
    from the attention interface; 1 where the source is not available."""
    try:
        source = inspect.getsource(_forward_of(module))
    except (OSError, TypeError):
        return 1
    return max(1, source.count("attention_interface("))


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


def _attention_geometry(module, implementation="sdpa"):
    """(query heads, key/value heads, head dimension of the attention output) of an attention module, from its own
    attributes first and its config's next, under the names transformers' families give them; None where they do
    not tell."""
    config = getattr(module, "config", None)
    heads = (_positive_int(module, "num_heads", "num_attention_heads", "n_heads")
             or _positive_int(config, "num_attention_heads"))
    if heads is None:
        return None
    # Multi-head latent attention (DeepSeek) has a value head dimension of its own, the output's under sdpa; for
    # flash-attn, Hugging Face pads the value to the query's head dimension, the output's there.
    first = "qk_head_dim" if implementation == "flash_attention_2" else "v_head_dim"
    head_dim = (_positive_int(module, first, "head_dim", "head_size", "attention_head_size")
                or _positive_int(config, first, "head_dim"))
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


def _attention_calls(name, modules, implementation="sdpa"):
    """(query heads, key/value heads, head dimension) of each attention call a layer's forward makes, from its
    attention modules; raises where the planner cannot tell."""
    calls = []
    for module in modules:
        geometry = _attention_geometry(module, implementation)
        if geometry is None:
            raise RuntimeError(f"{_FEATURE} needs the head count and head dimension of {type(module).__name__} in "
                               f"{name} to plan its memory, got neither from its attributes (num_heads, "
                               f"num_attention_heads, head_dim, head_size, attention_head_size, v_head_dim) nor from "
                               f"its config. Install with num_layers and no batch shape, which needs no plan.")
        calls += [geometry] * _calls_per_forward(module)
    return calls


def _model_dtype(model):
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_FEATURE} needs an integer {name}, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{_FEATURE} needs a positive {name}, got {value}.")


# Why an attention layer is left out where activation checkpointing is on for other decoder layers only.
_NOT_CHECKPOINTED = "no activation checkpointing (every_n_layers leaves it out), so no recompute to serve"


def _model_attention_layers(model):
    """The model's attention layers, as _attention_layers finds them, and the decoder layers left out; raises for a
    model without any attention layer, naming why. Where activation checkpointing is on for some decoder layers only
    (every_n_layers), the attention layers are the checkpointed ones: the others have no recompute."""
    layer_class, interface = _entry_points()
    attention_layers, others = _attention_layers(model, layer_class, interface)
    if not attention_layers:
        if not others:
            raise RuntimeError(f"{_FEATURE} needs a model with Hugging Face decoder layers "
                               f"(GradientCheckpointingLayer), got {type(model).__name__} without any.")
        raise RuntimeError(f"{_FEATURE} needs decoder layers with softmax attention through Hugging Face's attention "
                           f"interface ({_INTERFACE}), whose sdpa entry it serves, got none in "
                           f"{type(model).__name__}: in {others[-1][0]}, {others[-1][1]}. Train this model without "
                           f"the stash.")
    enabled = [name for name, layer in _decoder_layers(model, layer_class) if layer.gradient_checkpointing]
    checkpointed = [layer for layer in attention_layers if layer[1].gradient_checkpointing]
    if enabled and len(checkpointed) < len(attention_layers):
        if not checkpointed:
            raise RuntimeError(f"{_FEATURE} needs activation checkpointing on attention layers, whose recompute it "
                               f"serves, got it on {', '.join(enabled)} only, none of which has softmax attention "
                               f"(every_n_layers leaves the {len(attention_layers)} attention layers out). Choose "
                               f"every_n_layers so that it checkpoints attention layers, or train without the stash.")
        others = others + [(name, _NOT_CHECKPOINTED)
                           for name, layer, _ in attention_layers if not layer.gradient_checkpointing]
        attention_layers = checkpointed
    return attention_layers, others


def _sequence_parallel_ranks(sequence_parallel_size, model, attention_layers):
    """The ranks over which Ulysses sequence parallelism splits each attention call's heads, and how that is known:
    (the size given, "given"), else (the size of the DeepSpeed ALST registration that Hugging Face's lookup of the
    last attention layer's implementation reaches, "found registered"), else (1, None)."""
    _, attention_functions = _entry_points()
    name, _, modules = attention_layers[-1]
    ulysses = _ulysses_attention(attention_functions.get(_layer_implementation(name, modules, model)))
    if sequence_parallel_size is not None:
        _check_positive_int("sequence_parallel_size", sequence_parallel_size)
        if ulysses is not None and ulysses.world_size != sequence_parallel_size:
            raise ValueError(f"{_FEATURE} needs sequence_parallel_size to be that of the Ulysses sequence "
                             f"parallelism registered, {ulysses.world_size}, got {sequence_parallel_size}. Leave it "
                             f"out to plan with the registration's.")
        return sequence_parallel_size, "given"
    return (ulysses.world_size, "found registered") if ulysses is not None else (1, None)


def _rank_heads(heads, key_heads, ranks):
    """The query and key/value heads one rank's attention call gets under Ulysses sequence parallelism over ``ranks``:
    its share of the query heads; of the key/value heads, its share, or one where there are fewer than ranks (ALST
    replicates them). Raises for head counts it cannot split, as ALST does."""
    if heads % ranks:
        raise ValueError(f"{_FEATURE} needs query heads divisible by the sequence-parallel size to plan them, got "
                         f"{heads} heads and {ranks} ranks.")
    return heads // ranks, max(1, key_heads // ranks)


def _layer_bytes(model, attention_layers, micro_batch_size, sequence_length, dtype, device, ranks=1):
    """Bytes each attention layer would keep per micro-batch in flight, with the layer's name, last layer first and
    as far as the caller reads (a layer the stash would not serve raises only once reached); under Ulysses sequence
    parallelism over ``ranks``, one rank's: its share of the heads over the whole sequence. For flash-attn, the layout
    of its kernels; for sdpa, that of the backend PyTorch picks on ``device``."""
    _check_positive_int("micro_batch_size", micro_batch_size)
    _check_positive_int("sequence_length", sequence_length)
    if device is None:
        from deepspeed.accelerator import get_accelerator
        device = get_accelerator().device_name()
    device = torch.device(device)
    backends = {}
    for name, _, modules in reversed(attention_layers):
        nbytes = 0
        implementation = _layer_implementation(name, modules, model)
        for heads, key_heads, head_dim in _attention_calls(name, modules, implementation):
            heads, key_heads = _rank_heads(heads, key_heads, ranks)
            geometry = (heads, key_heads, head_dim)
            if implementation == "flash_attention_2":
                # Packed and padded batches run flash_attn_varlen_func, whose layout keeps as many bytes per token.
                ops = _FlashAttnOps
            elif geometry not in backends:
                # The backend PyTorch picks for these shapes in training decides the layout of what is kept.
                query = torch.empty(1,
                                    heads,
                                    sequence_length,
                                    head_dim,
                                    device=device,
                                    dtype=dtype,
                                    requires_grad=True)
                key = torch.empty(1, key_heads, sequence_length, head_dim, device=device, dtype=dtype)
                with torch.enable_grad():
                    choice = torch._fused_sdp_choice(query, key, key, None, 0.0, True, enable_gqa=key_heads != heads)
                ops = backends[geometry] = _ops_for(device.type, choice)
            else:
                ops = backends[geometry]
            nbytes += ops.kept_bytes(micro_batch_size, heads, sequence_length, head_dim, dtype)
        yield name, nbytes


def attention_stash_layer_bytes(model: torch.nn.Module,
                                micro_batch_size: int,
                                sequence_length: int,
                                dtype: torch.dtype = None,
                                device=None,
                                sequence_parallel_size: int = None) -> int:
    """Bytes one stashed attention layer keeps per micro-batch in flight: one attention output plus its log-sum-exp
    per attention call, for the model's last attention layer.

    Follows the real layout of the SDPA backend PyTorch picks for the model's attention shapes on ``device``
    (DeepSpeed's accelerator by default) in ``dtype`` (the model's by default): the output in ``dtype``, the
    log-sum-exp in FP32, padded where the kernel pads it. Per-kernel scalars of a few bytes are not counted. Raises,
    like the stash itself, when PyTorch would pick a backend the stash cannot replay. For Qwen3-30B-A3B (32 query
    heads, head dimension 128) at micro-batch 4 and sequence 4096 in bfloat16 this is 136 MB.

    Under DeepSpeed's Ulysses sequence parallelism (ALST) each rank's attention runs its share of the heads over the
    whole sequence, so the figure is one rank's, with ``sequence_length`` the whole sequence (the shards' lengths
    summed). The number of ranks is ``sequence_parallel_size`` where given, else that of the ALST registration
    Hugging Face's "sdpa" entry reaches now (``UlyssesSPAttentionHF.register_with_transformers``), else 1.
    """
    attention_layers, _ = _model_attention_layers(model)
    ranks, _ = _sequence_parallel_ranks(sequence_parallel_size, model, attention_layers)
    return next(
        _layer_bytes(model, attention_layers, micro_batch_size, sequence_length, dtype or _model_dtype(model), device,
                     ranks))[1]


def attention_stash_layers_for_budget(model: torch.nn.Module,
                                      memory_budget: int,
                                      micro_batch_size: int,
                                      sequence_length: int,
                                      micro_batches_in_flight: int = 1,
                                      dtype: torch.dtype = None,
                                      device=None,
                                      sequence_parallel_size: int = None) -> int:
    """The largest ``num_layers`` whose stash fits ``memory_budget`` bytes; 0 when not even one layer fits.

    Each stashed layer keeps ``attention_stash_layer_bytes`` per micro-batch in flight: one, unless a schedule runs
    several forwards before their backwards (pipeline schedules, or accumulation that does). Under Ulysses sequence
    parallelism the budget and the bytes are one rank's, as ``attention_stash_layer_bytes`` says.
    """
    attention_layers, _ = _model_attention_layers(model)
    ranks, _ = _sequence_parallel_ranks(sequence_parallel_size, model, attention_layers)
    sizes = _layer_bytes(model, attention_layers, micro_batch_size, sequence_length, dtype or _model_dtype(model),
                         device, ranks)
    return len(_fitting_layers(sizes, memory_budget, micro_batches_in_flight))


def _fitting_layers(sizes, memory_budget, micro_batches_in_flight):
    """The (name, bytes) of the layers ``sizes`` yields, last first, as long as they fit ``memory_budget``."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget >= 0:
        raise ValueError(f"{_FEATURE} needs a memory_budget in bytes of 0 or more, got {memory_budget!r}.")
    _check_positive_int("micro_batches_in_flight", micro_batches_in_flight)
    total, fitting = 0, []
    while True:
        try:
            size = next(sizes)
        except StopIteration:
            return fitting
        except RuntimeError:
            # A layer the stash would not serve (another attention implementation): the layers taken end before it.
            if fitting:
                return fitting
            raise
        total += size[1] * micro_batches_in_flight
        if total > memory_budget:
            return fitting
        fitting.append(size)


# The attention implementations the stash serves, as Hugging Face names them.
_IMPLEMENTATIONS = ("sdpa", "flash_attention_2")


def _attention_config(modules, model):
    """The config from which an attention layer's modules read their attention implementation: their own (a
    multimodal model's text config, which may name another implementation than the model's), else the model's."""
    for module in modules:
        config = getattr(module, "config", None)
        if isinstance(getattr(config, "_attn_implementation", None), str):
            return config
    return getattr(model, "config", None)


def _layer_implementation(name, modules, model):
    """The attention implementation an attention layer runs; raises for one the stash does not serve."""
    implementation = getattr(_attention_config(modules, model), "_attn_implementation", None)
    if implementation not in _IMPLEMENTATIONS:
        served = " or ".join(f'"{name}"' for name in _IMPLEMENTATIONS)
        raise RuntimeError(f'{_FEATURE} needs a Hugging Face model with attn_implementation {served}, got '
                           f'{implementation!r} on {type(model).__name__} ({name}). Load it with '
                           f'from_pretrained(..., attn_implementation="sdpa") or "flash_attention_2" (flash-attn 2), '
                           f'and pass the model itself (engine.module of a DeepSpeed engine).')
    return implementation


def _class_defining(cls, name):
    """The first class in ``cls``'s method resolution order whose dictionary has ``name``, or None."""
    return next((klass for klass in cls.__mro__ if name in klass.__dict__), None)


def _earlier_entry(function):
    """The sdpa entry of an earlier install that ``function`` is, or wraps: through ``__wrapped__`` (functools.wraps)
    or a variable of its closure, a few wrappers deep; None for none."""

    def is_entry(candidate):
        try:
            return candidate in _ENTRIES
        except TypeError:
            # Unhashable: no function.
            return False

    for _ in range(8):
        if is_entry(function):
            return function
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            contents = []
            for cell in getattr(function, "__closure__", None) or ():
                try:
                    contents.append(cell.cell_contents)
                except ValueError:
                    pass
            inner = next((content for content in contents if is_entry(content)), None)
        if inner is None:
            return None
        function = inner
    return None


def _check_unshared(model, layer_class, chosen):
    """Raise where an attention module of a layer to stash is also a module of a decoder layer left unstashed: its
    calls there would run outside a stashed checkpoint."""
    attention = {id(module): (name, module) for name, _, modules in chosen for module in modules}
    stashed = {id(layer) for _, layer, _ in chosen}
    for other_name, other in _decoder_layers(model, layer_class):
        if id(other) in stashed:
            continue
        for module in other.modules():
            if id(module) in attention:
                name, module = attention[id(module)]
                raise RuntimeError(f"{_FEATURE} needs the attention modules of the layers it stashes to be theirs "
                                   f"alone, got the {type(module).__name__} of {name} shared with {other_name}, "
                                   f"which is not stashed. Choose num_layers so that both layers are stashed, or "
                                   f"neither.")


def _take_hold(layer_class, attention_functions, implementation):
    """Put the checkpoint-function slot in place, once for all stashes, and the stash's entry for ``implementation``,
    once for all stashes of that implementation. Under ``_LOCK``."""
    global _held
    if _held is not None and implementation in _held.entries:
        return
    place = _entry_place(attention_functions, implementation)
    current = place.function()
    # The entry of an earlier install that a library wrapped (and may have written back, unwrapping) serves again: it
    # is what the lookups reach.
    earlier = _earlier_entry(current)
    if earlier is not None:
        entry = _Entry(place, _ENTRIES[earlier], earlier)
    else:
        # The entry first: it raises for an original it cannot serve, before anything is changed.
        entry = _Entry(place, current, _stashing_entry(current, place.description, implementation))
    if _held is None:
        _held = _Hold(layer_class, attention_functions)
        setattr(layer_class, _CHECKPOINT_FUNCTION, _SLOT)
    if current is entry.original:
        place.put(entry.entry)
    entry.front = attention_functions.get(implementation)
    _held.entries[implementation] = entry


def _let_go():
    """Undo ``_take_hold`` once no stash is left. Under ``_LOCK``. An entry or slot that something else replaced
    meanwhile stays as that left it; a wrapper around the stash's entry keeps calling it, and it the original."""
    global _held
    hold = _held
    if hold is None or any(stash.active and stash.layer() is not None for stash in list(_STASHES.values())):
        return
    _held = None
    for entry in hold.entries.values():
        if entry.place.function() is entry.entry:
            entry.place.put(entry.original)
    if hold.layer_class.__dict__.get(_CHECKPOINT_FUNCTION) is _SLOT:
        if hold.class_attribute is _MISSING:
            delattr(hold.layer_class, _CHECKPOINT_FUNCTION)
        else:
            setattr(hold.layer_class, _CHECKPOINT_FUNCTION, hold.class_attribute)


def _let_go_after_collection():
    """Called when a stashed layer is collected: where no stashed layer is left alive, the hold goes, as if removed.
    A collection can run inside an install or removal on this thread, which then holds the lock: the next one lets
    go."""
    if _LOCK.acquire(blocking=False):
        try:
            _let_go()
        finally:
            _LOCK.release()


def _install_message(model, chosen, implementations, attention_layers, others, sizes, micro_batch_size,
                     sequence_length, ranks):
    """The install's log line: what is stashed, at what cost, what is left out and why, in which checkpoint mode,
    with which attention implementation (``implementations``: the chosen layers'). It never raises: where the planner
    cannot tell the cost, it says so. ``ranks``: _sequence_parallel_ranks'."""
    dtype = _model_dtype(model)
    served = " and ".join(f'"{implementation}"' for implementation in dict.fromkeys(implementations))
    count, how = ranks
    per_rank = (f" on each rank of Ulysses sequence parallelism over {count} ranks ({how}): its share of the heads "
                f"over the whole sequence" if count > 1 else "")
    if sizes is not None:
        total = sum(nbytes for _, nbytes in sizes)
        cost = (f"{total:,} bytes per micro-batch in flight{per_rank} (micro-batch {micro_batch_size}, sequence "
                f"{sequence_length})")
    else:
        try:
            per_token = 0
            for (name, _, modules), implementation in zip(chosen, implementations):
                for heads, key_heads, head_dim in _attention_calls(name, modules, implementation):
                    heads = _rank_heads(heads, key_heads, count)[0]
                    if implementation == "flash_attention_2":
                        per_token += _FlashAttnOps.kept_bytes(1, heads, 1, head_dim, dtype)
                    else:
                        # Without a batch shape the SDPA backend, and any padding of its, is not known.
                        per_token += heads * (head_dim * dtype.itemsize + 4)
            cost = (f"{per_token:,} bytes per token of each micro-batch in flight in {dtype}{per_rank} (give "
                    f"micro_batch_size and sequence_length for the exact figure)")
        except (RuntimeError, ValueError):
            cost = "a cost the planner cannot tell for these attention modules"
    message = (f"{_FEATURE}: keeping the attention output of {len(chosen)} of {len(attention_layers)} attention "
               f"layers ({chosen[0][0]} to {chosen[-1][0]}) for their recompute: {cost}; "
               f"{_checkpointing_mode(chosen[-1][1])}; attn_implementation {served}.")
    if others:
        reasons = {}
        for _, why in others:
            reasons[why] = reasons.get(why, 0) + 1
        message += " Left out: " + "; ".join(
            f"{count} decoder layer{'s' * (count > 1)} {'with' if why.startswith('no ') else 'where'} {why}"
            for why, count in reasons.items())
        message += "."
    return message


def _checkpointing_mode(layer):
    """The layer's checkpointing, as far as its checkpoint function tells now, and how the stash serves it."""
    function = layer.__dict__.get(_CHECKPOINT_FUNCTION)
    reentrant = getattr(function, "keywords", {}).get("use_reentrant")
    if not layer.gradient_checkpointing or reentrant is None:
        mode = "checkpointing not enabled yet"
    else:
        mode = "reentrant checkpointing" if reentrant else "non-reentrant checkpointing"
    return f"{mode}: the recompute replays the kept output through the kernel's backward, in either mode"


class AttentionStashHandle:
    """Returned by ``install_attention_stash``: names the stashed layers, counts what they keep, uninstalls them."""

    def __init__(self, stashes, counters):
        self._stashes = stashes
        self._counters = counters

    @property
    def layers(self):
        """Module names of the stashed decoder layers, in model order."""
        return tuple(stash.name for stash in self._stashes)

    @property
    def num_kept(self):
        """Attention outputs kept now, waiting for their recompute."""
        return self._counters.kept

    @property
    def kept_bytes(self):
        """Bytes the kept attention outputs and their log-sum-exps hold now, laid out as
        ``attention_stash_layer_bytes`` counts them; the kernels' few bytes of scalars are not counted."""
        return self._counters.kept_bytes

    @property
    def peak_kept_bytes(self):
        """The most bytes kept at once since the install."""
        return self._counters.peak_kept_bytes

    @property
    def recomputes_served(self):
        """Recomputes that took a kept output instead of running the attention forward."""
        return self._counters.recomputes_served

    @property
    def released_without_backward(self):
        """Kept outputs released because their forward's graph was freed without a backward."""
        return self._counters.released_without_backward

    def __reduce__(self):
        # A copy or a pickle of the handle, as of a model that holds it, stashes nothing: the stash belongs to the
        # original's layers, and the copied model is stock. One mechanism for copy.copy, copy.deepcopy, pickle and
        # torch.save.
        return AttentionStashHandle, ([], _Counters())

    def remove(self):
        """Uninstall. A backward of a forward that ran before the removal recomputes its attention as stock code does,
        in either checkpoint mode, and releases what the forward kept. Hugging Face's sdpa entry and the layer class's
        attribute return when no stash is left."""
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
                            sequence_parallel_size: int = None) -> AttentionStashHandle:
    """Keep the attention output of the last ``num_layers`` decoder layers for their checkpoint recompute.

    ``model`` is a Hugging Face model loaded with ``attn_implementation="sdpa"`` or ``"flash_attention_2"`` (flash-attn
    2; each layer as its attention modules' config says) and trained with per-layer activation checkpointing, with or
    without AutoEP. The stash takes hold of each stashed layer's checkpoint function, so it runs inside each
    checkpointed call of the layer. Its first pass calls the kernel that ``F.scaled_dot_product_attention`` (or
    flash-attn's autograd function) would run and keeps its outputs (one attention output plus its log-sum-exp); the
    recompute returns them from an autograd node whose backward is that kernel's backward, so it skips the attention
    forward. Plain, padded and packed batches are served, flash-attn's variable-length calls too. Reentrant and
    non-reentrant checkpointing (transformers' default) are served alike; under non-reentrant checkpointing the first
    pass leaves PyTorch's (or flash-attn's) own attention node in the graph, which the recompute's node fills, and a
    checkpoint's own ``context_fn`` (a selective-checkpointing policy) or ``debug=True`` composes with the stash. What
    a call keeps lives with its checkpoint's graph: it is released when the recompute takes it, or when the graph is
    freed without a backward.

    ``num_layers`` counts attention layers from the end. Where activation checkpointing is on for some decoder layers
    only (``every_n_layers``) when the stash is installed, it counts the checkpointed ones: the others have no
    recompute to serve.

    Instead of ``num_layers``, pass ``memory_budget`` in bytes with ``micro_batch_size`` and ``sequence_length`` (and
    ``micro_batches_in_flight`` where a schedule keeps several): the stash then takes the most layers whose kept
    outputs fit, as ``attention_stash_layers_for_budget`` counts them. Given the batch shape with ``num_layers`` too,
    the install log line states the exact cost.

    Under DeepSpeed's Ulysses sequence parallelism (ALST, ``UlyssesSPAttentionHF.register_with_transformers``),
    registered before or after the install, the stash serves the core attention each rank runs on the whole
    sequence and its share of the heads. Costs are then one rank's, with ``sequence_length`` the whole sequence: the
    number of ranks is ``sequence_parallel_size`` where given, else that of the registration found at the install;
    give it where ALST is registered after the install.

    Forwards without a backward (``torch.no_grad()``, eval mode, generation) run stock sdpa and keep nothing. What the
    stash cannot serve raises instead of falling back: attention dropout, a training forward outside a checkpoint or
    under ``torch.compile`` or a ``torch.func`` transform, an SDPA backend without an exact replay, an attention output
    changed in place in the forward, a recompute whose attention runs in another dtype than its forward's (autocast
    not restored by the checkpoint), a second install on a layer, a second backward through a retained graph.

    The stash's sdpa entry goes where Hugging Face's lookups find it; a function registered as "sdpa" after the install
    replaces it, as it would replace the original, and runs everywhere but in stashed layers, which raise naming it. A
    wrapper that a library puts around the stash's entry keeps working after ``remove()``, as without the stash.

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
    if memory_budget is not None and (micro_batch_size is None or sequence_length is None):
        raise TypeError(f"{_FEATURE} needs micro_batch_size and sequence_length with memory_budget, to size what each "
                        f"layer keeps.")
    attention_layers, others = _model_attention_layers(model)
    ranks = _sequence_parallel_ranks(sequence_parallel_size, model, attention_layers)
    if ranks[0] > 1:
        # Heads that the ranks cannot split are refused as ALST refuses them, with a batch shape or without.
        for name, _, modules in attention_layers:
            try:
                calls = _attention_calls(name, modules, _layer_implementation(name, modules, model))
            except RuntimeError:
                calls = []
            for heads, key_heads, _ in calls:
                _rank_heads(heads, key_heads, ranks[0])
    if (micro_batch_size is None) != (sequence_length is None):
        raise TypeError(f"{_FEATURE} needs both micro_batch_size and sequence_length, or neither, got one.")
    # The planner sizes the layers the stash takes, from the last one: an earlier layer it would not serve (another
    # attention implementation) is never sized.
    planned = partial(_layer_bytes,
                      model,
                      micro_batch_size=micro_batch_size,
                      sequence_length=sequence_length,
                      dtype=_model_dtype(model),
                      device=None,
                      ranks=ranks[0])
    sizes = None
    if memory_budget is not None:
        sizes = _fitting_layers(planned(attention_layers), memory_budget, micro_batches_in_flight)
        num_layers = len(sizes)
        if num_layers == 0:
            raise ValueError(f"{_FEATURE} needs a memory_budget of at least one layer's "
                             f"{next(planned(attention_layers))[1]:,} bytes per micro-batch in flight x "
                             f"{micro_batches_in_flight}, got {memory_budget:,}.")
    if not 1 <= num_layers <= len(attention_layers):
        checkpointed = "checkpointed " if any(why == _NOT_CHECKPOINTED for _, why in others) else ""
        raise ValueError(f"{_FEATURE} needs num_layers from 1 to the model's {len(attention_layers)} {checkpointed}"
                         f"attention layers (of {len(attention_layers) + len(others)} decoder layers), got "
                         f"{num_layers}.")
    chosen = attention_layers[-num_layers:]
    if sizes is None and micro_batch_size is not None:
        sizes = list(planned(chosen))
    # Each stashed layer's attention implementation, as its attention modules' config says.
    configs = [_attention_config(modules, model) for _, _, modules in chosen]
    implementations = [_layer_implementation(name, modules, model) for name, _, modules in chosen]
    if "flash_attention_2" in implementations:
        _flash_attn_interface()
    for name, layer, _ in chosen:
        if _class_defining(type(layer), _CHECKPOINT_FUNCTION) not in (None, layer_class):
            raise RuntimeError(f"{_FEATURE} needs {name} to keep its checkpoint function per instance, as "
                               f"GradientCheckpointingLayer does, got a class attribute {_CHECKPOINT_FUNCTION} on "
                               f"{type(layer).__name__}. Remove that attribute from the class.")
    _check_unshared(model, layer_class, chosen)
    message = _install_message(model, chosen, implementations, attention_layers, others, sizes, micro_batch_size,
                               sequence_length, ranks)

    counters = _Counters()
    with _LOCK:
        for name, layer, _ in chosen:
            if layer in _STASHES:
                raise RuntimeError(f"{_FEATURE} needs one install per decoder layer, got a second one on {name}. Call "
                                   f"remove() on the first handle before installing again.")
        # Raises where Hugging Face's entry of an implementation cannot be served, before any stash goes in; what an
        # earlier implementation's hold put in place goes again with it. Nothing raises after it.
        try:
            for implementation in dict.fromkeys(implementations):
                _take_hold(layer_class, attention_functions, implementation)
        except BaseException:
            _let_go()
            raise
        stashes = []
        for (name, layer, _), config in zip(chosen, configs):
            stash = _LayerStash(name, layer, model, config, counters)
            for module in layer.modules():
                _STASHES[module] = stash
            stashes.append(stash)
            # A model dropped without remove() leaves nothing installed either.
            stash.finalizer = weakref.finalize(layer, _let_go_after_collection)
            stash.finalizer.atexit = False
    logger.info(message)
    return AttentionStashHandle(stashes, counters)
