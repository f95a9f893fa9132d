# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
Keep the attention output of Hugging Face decoder layers for their reentrant checkpoint recompute.

With per-layer reentrant activation checkpointing, the backward pass runs every decoder layer forward again. For the
layers it is installed on, the attention stash keeps the first forward's attention output and log-sum-exp and hands
them to the attention backward kernel, so the recompute skips the attention forward kernel. The memory cost is one
attention output plus its log-sum-exp per stashed layer, from the layer's forward to its recompute.

transformers is imported lazily, by ``install_attention_stash``.
"""

import math
import weakref

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from deepspeed.utils import logger

aten = torch.ops.aten

_FEATURE = "attention stash"
# The keyword argument through which a stashed layer's forward pre-hook hands the layer's input to its attention call.
# Transformers' decoder layers pass their keyword arguments on to the attention function, and both checkpoint layouts
# bind them to the checkpointed function, so the recompute receives them too.
_LAYER_INPUT_KWARG = "attention_stash_layer_input"
_MISSING = object()
# PyTorch entry points beyond the public API; the installer checks them, with the aten ops of the backend table.
_TORCH_ENTRY_POINTS = ("_fused_sdp_choice", "_C._current_graph_task_id",
                       "_C._autograd._top_saved_tensors_default_hooks")
_REENTRANT_HINT = ('model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True}) '
                   '(activation_checkpointing_enable(activation_checkpointing_kwargs=...) from transformers 5.23)')
# The builtin Hugging Face's sdpa function reaches, even through wrappers of F.scaled_dot_product_attention.
_SDPA = F.scaled_dot_product_attention

# ---------------------------------------------------------------------------------------------------------------------
# Per-backend op table. Each entry runs the aten forward that F.scaled_dot_product_attention dispatches to for the
# backend, with the log-sum-exp, and calls the matching backward with exactly the arguments of the forward's entry in
# PyTorch's derivatives.yaml. The forward returns (output, saved tensors, saved scalars).
# ---------------------------------------------------------------------------------------------------------------------


class _CpuFlashOps:
    """``F.scaled_dot_product_attention``'s fused CPU kernel; it takes grouped key/value heads as they are."""

    name = "CPU flash attention"
    ops = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The log-sum-exp is [batch, sequence, heads] in the kernel's accumulation dtype: FP32, FP64 for FP64.
        lse_bytes = 8 if dtype == torch.float64 else 4
        return batch * heads * sequence * (head_dim * dtype.itemsize + lse_bytes)

    @staticmethod
    def forward(query, key, value, is_causal, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)
        return out, (lse, ), ()

    @staticmethod
    def backward(grad_out, query, key, value, out, tensors, scalars, is_causal, scale, needs_grad):
        lse, = tensors
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out,
                                                                         query,
                                                                         key,
                                                                         value,
                                                                         out,
                                                                         lse,
                                                                         0.0,
                                                                         is_causal,
                                                                         scale=scale)


class _CudnnOps:
    """cuDNN attention, PyTorch's first SDPA choice on Hopper and Blackwell GPUs."""

    name = "cuDNN attention"
    ops = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The output, and an FP32 log-sum-exp of [batch, heads, sequence, 1]; the philox scalars are not counted.
        return batch * heads * sequence * (head_dim * dtype.itemsize + 4)

    @staticmethod
    def forward(query, key, value, is_causal, scale):
        # compute_log_sumexp=True: under the checkpoint's no_grad first forward F.sdpa would skip the log-sum-exp.
        out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, _ = (
            aten._scaled_dot_product_cudnn_attention(query, key, value, None, True, 0.0, is_causal, False,
                                                     scale=scale))
        return out, (lse, philox_seed, philox_offset, cum_seq_q, cum_seq_k), (max_q, max_k)

    @staticmethod
    def backward(grad_out, query, key, value, out, tensors, scalars, is_causal, scale, needs_grad):
        lse, philox_seed, philox_offset, cum_seq_q, cum_seq_k = tensors
        max_q, max_k = scalars
        # attn_bias None: the forward had no mask.
        return aten._scaled_dot_product_cudnn_attention_backward(grad_out,
                                                                 query,
                                                                 key,
                                                                 value,
                                                                 out,
                                                                 lse,
                                                                 philox_seed,
                                                                 philox_offset,
                                                                 None,
                                                                 cum_seq_q,
                                                                 cum_seq_k,
                                                                 max_q,
                                                                 max_k,
                                                                 0.0,
                                                                 is_causal,
                                                                 scale=scale)


class _FlashOps:
    """FlashAttention-2 on CUDA, PyTorch's first SDPA choice on Ampere and Ada GPUs."""

    name = "flash attention"
    ops = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
    # F.sdpa pads the head dimension to a multiple of 8 for this kernel and slices its output back; the caller does too.
    head_dim_multiple = 8

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The output at the padded head dimension, and an FP32 log-sum-exp of [batch, heads, sequence].
        return batch * heads * sequence * ((head_dim + -head_dim % 8) * dtype.itemsize + 4)

    @staticmethod
    def forward(query, key, value, is_causal, scale):
        out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, _ = (aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, is_causal, False, scale=scale))
        return out, (lse, cum_seq_q, cum_seq_k, rng_state, unused), (max_q, max_k)

    @staticmethod
    def backward(grad_out, query, key, value, out, tensors, scalars, is_causal, scale, needs_grad):
        lse, cum_seq_q, cum_seq_k, rng_state, unused = tensors
        max_q, max_k = scalars
        # The derivative passes rng_state and unused as the philox seed and offset.
        return aten._scaled_dot_product_flash_attention_backward(grad_out,
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
                                                                 is_causal,
                                                                 rng_state,
                                                                 unused,
                                                                 scale=scale)


class _EfficientOps:
    """Memory-efficient attention on CUDA, PyTorch's choice where flash and cuDNN do not apply."""

    name = "memory-efficient attention"
    ops = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")

    @staticmethod
    def kept_bytes(batch, heads, sequence, head_dim, dtype):
        # The output, and an FP32 log-sum-exp whose sequence dimension the kernel pads to a multiple of 32.
        return batch * heads * (sequence * head_dim * dtype.itemsize + (sequence + -sequence % 32) * 4)

    @staticmethod
    def forward(query, key, value, is_causal, scale):
        # compute_log_sumexp=True, as in F.sdpa when grads are required; the log-sum-exp is padded to 32 rows.
        out, lse, philox_seed, philox_offset = aten._scaled_dot_product_efficient_attention(query,
                                                                                            key,
                                                                                            value,
                                                                                            None,
                                                                                            True,
                                                                                            0.0,
                                                                                            is_causal,
                                                                                            scale=scale)
        return out, (lse, philox_seed, philox_offset), ()

    @staticmethod
    def backward(grad_out, query, key, value, out, tensors, scalars, is_causal, scale, needs_grad):
        lse, philox_seed, philox_offset = tensors
        # grad_input_mask: which of query, key, value and the (absent) bias need a gradient.
        grad_query, grad_key, grad_value, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out,
            query,
            key,
            value,
            None,
            out,
            lse,
            philox_seed,
            philox_offset,
            0.0, [*needs_grad, False],
            is_causal,
            scale=scale)
        return grad_query, grad_key, grad_value


# (device type, the backend torch._fused_sdp_choice reports) -> ops that replay it exactly.
_BACKENDS = {
    ("cpu", SDPBackend.FLASH_ATTENTION.value): _CpuFlashOps,
    ("cuda", SDPBackend.CUDNN_ATTENTION.value): _CudnnOps,
    ("cuda", SDPBackend.FLASH_ATTENTION.value): _FlashOps,
    ("cuda", SDPBackend.EFFICIENT_ATTENTION.value): _EfficientOps,
}
_BACKEND_NAMES = {backend.value: name for name, backend in SDPBackend.__members__.items()}


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


# ---------------------------------------------------------------------------------------------------------------------
# Keyed store: one per stashed decoder layer.
# ---------------------------------------------------------------------------------------------------------------------


class _Kept:
    """What one first forward keeps for its recompute."""

    __slots__ = ("ops", "out", "tensors", "scalars", "nbytes", "finalizer")

    def __init__(self, ops, out, tensors, scalars):
        self.ops, self.out, self.tensors, self.scalars = ops, out, tensors, scalars
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (out, *tensors) if t is not None
        }
        self.nbytes = sum(storages.values())
        self.finalizer = None


class _Counters:
    """What the stashes of one install keep and serve, for its handle."""

    def __init__(self):
        self.kept = self.kept_bytes = self.peak_kept_bytes = 0
        self.recomputes_served = self.released_without_backward = 0

    def add(self, kept):
        self.kept += 1
        self.kept_bytes += kept.nbytes
        self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)

    def drop(self, kept):
        self.kept -= 1
        self.kept_bytes -= kept.nbytes


def _input_key(layer_input):
    # The reentrant recompute runs on a detached alias of the layer's input: another Python object with the same
    # storage and version counter. While the checkpoint holds that input no other live tensor has its data pointer,
    # so a recompute finds only its own forward's output.
    return layer_input.data_ptr(), layer_input._version, tuple(layer_input.shape)


class _LayerStash:
    """The kept attention outputs of one decoder layer, keyed by the layer's input."""

    def __init__(self, name, layer, config, counters):
        self.name = name
        self._layer = weakref.ref(layer)
        self._config = config
        self._counters = counters
        self.kept = {}
        # First among the layer's pre-hooks, so it sees the layer's own input: others may replace it, as ZeRO-3's does
        # with an autograd function, whose output inside the checkpoint's no-grad forward does not require grad.
        self._hook = layer.register_forward_pre_hook(self._pass_layer_input, prepend=True, with_kwargs=True)

    def _pass_layer_input(self, layer, args, kwargs):
        # Transformers <= 5.22 checkpoints the layer's __call__, so this hook runs in the first forward and in the
        # recompute, on the input each of them gets. From 5.23 it checkpoints forward and the hook runs once, before
        # the checkpoint, which binds these keyword arguments for the recompute as well.
        if layer.training and self._config._attn_implementation != "sdpa":
            raise RuntimeError(f'{_FEATURE} needs attn_implementation="sdpa" for {self.name}, got '
                               f'"{self._config._attn_implementation}". Remove the stash before switching the '
                               f"attention implementation.")
        layer_input = args[0] if args and isinstance(args[0], torch.Tensor) else None
        return args, {**kwargs, _LAYER_INPUT_KWARG: layer_input}

    def keep(self, layer_input, kept):
        key = _input_key(layer_input)
        if key in self.kept:
            raise RuntimeError(
                f"{_FEATURE} needs a distinct input for each forward of {self.name} before its "
                f"backward and one attention call per forward, got a second output for one input: the "
                f"same tensor passed to two forwards (pass a new tensor to each), or a layer that calls "
                f"attention twice (remove the stash from it).")
        # A forward whose graph is freed without a backward frees its input with it; its output goes too.
        kept.finalizer = weakref.finalize(layer_input, self._release, key)
        self.kept[key] = kept
        self._counters.add(kept)

    def _release(self, key):
        kept = self.kept.pop(key, None)
        if kept is not None:
            self._counters.drop(kept)
            self._counters.released_without_backward += 1

    def take(self, layer_input):
        kept = None if layer_input is None else self.kept.pop(_input_key(layer_input), None)
        if kept is None:
            raise RuntimeError(f"{_FEATURE} needs a kept attention output for the recompute of {self.name}, got none "
                               f"for its input. Install the stash before the forward, not between a forward and its "
                               f"backward, and do not remove it in between.")
        kept.finalizer.detach()
        self._counters.drop(kept)
        self._counters.recomputes_served += 1
        return kept

    def clear(self):
        for kept in self.kept.values():
            kept.finalizer.detach()
            self._counters.drop(kept)
        self.kept.clear()

    def remove(self):
        self._hook.remove()
        self.clear()

    def check_training_pass(self, layer_input):
        """Return whether this training call is the recompute (True) or the first forward (False); None: neither."""
        if layer_input is _MISSING:
            raise RuntimeError(f"{_FEATURE} needs {self.name} to pass its keyword arguments on to the attention "
                               f"function, got an sdpa call without them. The layer's forward must forward **kwargs "
                               f"to its attention module, and the stash must be installed before the forward.")
        if torch.is_grad_enabled():
            if torch._C._current_graph_task_id() == -1:
                layer = self._layer()
                if layer is not None and layer.gradient_checkpointing:
                    cause = "non-reentrant checkpointing, transformers' default"
                else:
                    cause = "no activation checkpointing"
                raise RuntimeError(f"{_FEATURE} needs Hugging Face reentrant activation checkpointing for a training "
                                   f"forward of {self.name}, got {cause}. Call {_REENTRANT_HINT}, or put the model in "
                                   f"eval mode or torch.no_grad() for forwards without a backward.")
            return True
        # Inside the reentrant checkpoint the first forward runs without grad on an input that requires it; any other
        # forward without grad has no backward to serve.
        if layer_input is None or not layer_input.requires_grad:
            return None
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            # Such hooks pack the checkpoint's saved input, so the recompute would run on another tensor.
            raise RuntimeError(f"{_FEATURE} needs the reentrant checkpoint of {self.name} to save its input as it is, "
                               f"got saved-tensor hooks around it (activation offload: activation_checkpointing_enable"
                               f"(offload=True) or torch.autograd.graph.save_on_cpu). Turn the offload off or remove "
                               f"the stash.")
        return False


# ---------------------------------------------------------------------------------------------------------------------
# Autograd node of the recompute: returns the kept output, and its backward is the backend's attention backward.
# ---------------------------------------------------------------------------------------------------------------------


class _StashedAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value, kept, is_causal, scale):
        ctx.save_for_backward(query, key, value, kept.out, *kept.tensors)
        ctx.ops, ctx.scalars, ctx.is_causal, ctx.scale = kept.ops, kept.scalars, is_causal, scale
        return kept.out

    # Like autograd's own node for these ops, the backward kernels are not differentiable again.
    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, *tensors = ctx.saved_tensors
        grad_query, grad_key, grad_value = ctx.ops.backward(grad_out, query, key, value, out, tensors, ctx.scalars,
                                                            ctx.is_causal, ctx.scale, ctx.needs_input_grad[:3])
        return grad_query, grad_key, grad_value, None, None, None


# ---------------------------------------------------------------------------------------------------------------------
# The wrapper of Hugging Face's "sdpa" attention function.
# ---------------------------------------------------------------------------------------------------------------------


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _StashedSdpaCall(TorchFunctionMode):
    """Runs one Hugging Face sdpa call with its F.scaled_dot_product_attention served by the stash.

    Hugging Face prepares the call (grouped heads, causality, scale) and post-processes its output as it always does;
    only the attention kernel is swapped, with the arguments F.sdpa itself received.
    """

    def __init__(self, stash, layer_input, recompute):
        super().__init__()
        self.stash, self.layer_input, self.recompute = stash, layer_input, recompute

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(*args, **kwargs)
        if attn_mask is not None:
            raise RuntimeError(
                f"{_FEATURE} needs attention without a mask in {self.stash.name}, got an attention "
                f"mask, as padding (or packing with per-document masks) makes. Train on equal-length or "
                f"concatenated sequences with attention_mask=None, or remove the stash.")
        if dropout_p != 0.0:
            raise RuntimeError(f"{_FEATURE} needs attention dropout 0 in {self.stash.name}, got {dropout_p}. Set the "
                               f"model config's attention_dropout to 0.0, or remove the stash.")
        if torch.is_autocast_enabled(query.device.type):
            # F.sdpa runs in autocast's lower precision; the aten ops below are not autocast-aware.
            dtype = torch.get_autocast_dtype(query.device.type)
            query, key, value = (t.to(dtype) if t.dtype != torch.float64 else t for t in (query, key, value))
        # The recompute checks the choice too: it is the backend the normal recompute would differentiate.
        choice = torch._fused_sdp_choice(query, key, value, None, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        ops = _ops_for(query.device.type, choice)
        head_dim = query.shape[-1]
        multiple = getattr(ops, "head_dim_multiple", 1)
        padded = head_dim % multiple != 0
        if padded:
            # As F.sdpa does: the scale from the unpadded head dimension, then zero padding, differentiably.
            scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
            query, key, value = (F.pad(t, (0, -t.shape[-1] % multiple)) for t in (query, key, value))
        if self.recompute:
            kept = self.stash.take(self.layer_input)
            if kept.ops is not ops:
                raise RuntimeError(f"{_FEATURE} needs one SDPA backend for both passes of {self.stash.name}, got "
                                   f"{kept.ops.name} in the forward and {ops.name} in the recompute.")
            out = _StashedAttention.apply(query, key, value, kept, is_causal, scale)
        else:
            out, tensors, scalars = ops.forward(query, key, value, is_causal, scale)
            self.stash.keep(self.layer_input, _Kept(ops, out, tensors, scalars))
        return out[..., :head_dim] if padded else out


# Every submodule of a stashed decoder layer, attention modules among them, maps to that layer's stash.
_STASHES = weakref.WeakKeyDictionary()
# Hugging Face's "sdpa" entry that _stashing_sdpa replaced and calls, while it is installed.
_original_sdpa = None


def _stashing_sdpa(module, *args, **kwargs):
    layer_input = kwargs.pop(_LAYER_INPUT_KWARG, _MISSING)
    stash = _STASHES.get(module)
    if stash is None or not module.training:
        return _original_sdpa(module, *args, **kwargs)
    recompute = stash.check_training_pass(layer_input)
    if recompute is None:
        return _original_sdpa(module, *args, **kwargs)
    with _StashedSdpaCall(stash, layer_input, recompute):
        return _original_sdpa(module, *args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# The installer.
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
    missing += [f"torch.ops.aten.{op}" for ops in _BACKENDS.values() for op in ops.ops if not hasattr(aten, op)]
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


def _attention_geometry(name, layer):
    """(query heads, head dimension of the attention output) of a decoder layer's attention module."""
    for module in layer.modules():
        heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
        # Multi-head latent attention (DeepSeek) has a value head dimension of its own, the output's.
        head_dim = getattr(module, "v_head_dim", None) or getattr(module, "head_dim", None)
        if isinstance(heads, int) and isinstance(head_dim, int):
            return heads, head_dim
    raise RuntimeError(f"{_FEATURE} needs an attention module with config.num_attention_heads and a head_dim in "
                       f"{name} to plan its memory, got none.")


def _model_dtype(model):
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_FEATURE} needs an integer {name}, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{_FEATURE} needs a positive {name}, got {value}.")


def _layer_bytes(model, micro_batch_size, sequence_length, dtype, device):
    """Bytes each decoder layer would keep per micro-batch in flight, last layer first, with the layer names."""
    layer_class, _ = _entry_points()
    _check_positive_int("micro_batch_size", micro_batch_size)
    _check_positive_int("sequence_length", sequence_length)
    layers = _decoder_layers(model, layer_class)
    if not layers:
        raise RuntimeError(f"{_FEATURE} needs a model with Hugging Face decoder layers (GradientCheckpointingLayer), "
                           f"got {type(model).__name__} without any.")
    if dtype is None:
        dtype = _model_dtype(model)
    if device is None:
        from deepspeed.accelerator import get_accelerator
        device = get_accelerator().device_name()
    device = torch.device(device)
    config = model.config
    key_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    sizes, choices = [], {}
    for name, layer in reversed(layers):
        heads, head_dim = _attention_geometry(name, layer)
        if (heads, head_dim) not in choices:
            # The backend PyTorch picks for these shapes on that device decides the layout of what is kept.
            query = torch.empty(1, heads, sequence_length, head_dim, device=device, dtype=dtype, requires_grad=True)
            key = torch.empty(1, key_heads, sequence_length, head_dim, device=device, dtype=dtype)
            choice = torch._fused_sdp_choice(query, key, key, None, 0.0, True, enable_gqa=key_heads != heads)
            choices[heads, head_dim] = _ops_for(device.type, choice)
        ops = choices[heads, head_dim]
        sizes.append((name, ops.kept_bytes(micro_batch_size, heads, sequence_length, head_dim, dtype)))
    return sizes


def attention_stash_layer_bytes(model: torch.nn.Module,
                                micro_batch_size: int,
                                sequence_length: int,
                                dtype: torch.dtype = None,
                                device=None) -> int:
    """Bytes one stashed decoder layer keeps per micro-batch in flight: one attention output plus its log-sum-exp.

    Follows the real layout of the SDPA backend PyTorch picks for the model's attention shapes on ``device``
    (DeepSpeed's accelerator by default) in ``dtype`` (the model's by default): the output in ``dtype``, the
    log-sum-exp in FP32, padded where the kernel pads it. Per-kernel scalars of a few bytes are not counted. Raises,
    like the stash itself, when PyTorch would pick a backend the stash cannot replay. For Qwen3-30B-A3B (32 query
    heads, head dimension 128) at micro-batch 4 and sequence 4096 in bfloat16 this is 136 MB.
    """
    return _layer_bytes(model, micro_batch_size, sequence_length, dtype, device)[0][1]


def attention_stash_layers_for_budget(model: torch.nn.Module,
                                      memory_budget: int,
                                      micro_batch_size: int,
                                      sequence_length: int,
                                      micro_batches_in_flight: int = 1,
                                      dtype: torch.dtype = None,
                                      device=None) -> int:
    """The largest ``num_layers`` whose stash fits ``memory_budget`` bytes; 0 when not even one layer fits.

    Each stashed layer keeps ``attention_stash_layer_bytes`` per micro-batch in flight: one, unless a schedule runs
    several forwards before their backwards (pipeline schedules, or accumulation that does).
    """
    return _fitting_layers(_layer_bytes(model, micro_batch_size, sequence_length, dtype, device), memory_budget,
                           micro_batches_in_flight)


def _fitting_layers(sizes, memory_budget, micro_batches_in_flight):
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget >= 0:
        raise ValueError(f"{_FEATURE} needs a memory_budget in bytes of 0 or more, got {memory_budget!r}.")
    _check_positive_int("micro_batches_in_flight", micro_batches_in_flight)
    total, fitting = 0, 0
    for _, nbytes in sizes:
        total += nbytes * micro_batches_in_flight
        if total > memory_budget:
            break
        fitting += 1
    return fitting


class AttentionStashHandle:
    """Returned by ``install_attention_stash``: names the stashed layers, counts what they keep, uninstalls them."""

    def __init__(self, stashes, counters, attention_functions):
        self._stashes = stashes
        self._counters = counters
        self._attention_functions = attention_functions

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
        """Bytes of memory the kept outputs and their saved tensors hold now."""
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

    def remove(self):
        """Uninstall: drop kept outputs and hooks; Hugging Face's sdpa entry returns when no stash is left."""
        global _original_sdpa
        removed = set(self._stashes)
        for stash in self._stashes:
            stash.remove()
        for module in [module for module, stash in _STASHES.items() if stash in removed]:
            del _STASHES[module]
        self._stashes = []
        if not _STASHES and _original_sdpa is not None:
            functions = self._attention_functions
            if functions["sdpa"] is _stashing_sdpa:
                # The wrapper is a local entry of the shared interface; dropping it uncovers the library-wide one.
                del functions["sdpa"]
                if functions.get("sdpa") is not _original_sdpa:
                    functions["sdpa"] = _original_sdpa
            _original_sdpa = None


def install_attention_stash(model: torch.nn.Module,
                            num_layers: int = None,
                            *,
                            memory_budget: int = None,
                            micro_batch_size: int = None,
                            sequence_length: int = None,
                            micro_batches_in_flight: int = 1) -> AttentionStashHandle:
    """Keep the attention output of the last ``num_layers`` decoder layers for their reentrant checkpoint recompute.

    ``model`` is a Hugging Face model loaded with ``attn_implementation="sdpa"`` and trained with per-layer reentrant
    checkpointing (``gradient_checkpointing_kwargs={"use_reentrant": True}``), with or without AutoEP. In the first
    forward of each stashed layer, the attention kernel that ``F.scaled_dot_product_attention`` would run is called
    directly, with the log-sum-exp, and its output is kept; the recompute returns the kept output from an autograd node
    whose backward is the kernel's backward, so it skips the attention forward. Each kept output is one attention
    output plus its log-sum-exp, held from the layer's forward to its recompute, and keyed by the layer's input so a
    backward only uses its own forward's output.

    Instead of ``num_layers``, pass ``memory_budget`` in bytes with ``micro_batch_size`` and ``sequence_length`` (and
    ``micro_batches_in_flight`` where a schedule keeps several): the stash then takes the most layers whose kept
    outputs fit, as ``attention_stash_layers_for_budget`` counts them. Given the batch shape with ``num_layers`` too,
    the install log line states the exact cost.

    Forwards without a backward (``torch.no_grad()``, eval mode, generation) run stock sdpa and keep nothing. What the
    stash cannot serve raises instead of falling back: an attention mask or dropout, a training forward outside a
    reentrant checkpoint, an SDPA backend without an exact replay, a second install on a layer.

    Returns an ``AttentionStashHandle``; its ``remove()`` uninstalls the stash.
    """
    global _original_sdpa
    layer_class, attention_functions = _entry_points()
    if (num_layers is None) == (memory_budget is None):
        raise TypeError(f"{_FEATURE} needs exactly one of num_layers and memory_budget, got "
                        f"{'both' if num_layers is not None else 'neither'}.")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)):
        raise TypeError(f"{_FEATURE} needs an integer num_layers, got {type(num_layers).__name__}.")
    if memory_budget is not None and (micro_batch_size is None or sequence_length is None):
        raise TypeError(f"{_FEATURE} needs micro_batch_size and sequence_length with memory_budget, to size what each "
                        f"layer keeps.")
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        raise RuntimeError(f'{_FEATURE} needs a Hugging Face model with attn_implementation="sdpa", got '
                           f'{implementation!r} on {type(model).__name__}. Load it with from_pretrained(..., '
                           f'attn_implementation="sdpa"), and pass the model itself (engine.module of a DeepSpeed '
                           f'engine).')
    layers = _decoder_layers(model, layer_class)
    layer_bytes = None
    if micro_batch_size is not None or sequence_length is not None:
        if micro_batch_size is None or sequence_length is None:
            raise TypeError(f"{_FEATURE} needs both micro_batch_size and sequence_length, or neither, got one.")
        sizes = _layer_bytes(model, micro_batch_size, sequence_length, None, None)
        layer_bytes = sizes[0][1]
    if memory_budget is not None:
        num_layers = _fitting_layers(sizes, memory_budget, micro_batches_in_flight)
        if num_layers == 0:
            raise ValueError(f"{_FEATURE} needs a memory_budget of at least one layer's {layer_bytes:,} bytes per "
                             f"micro-batch in flight x {micro_batches_in_flight}, got {memory_budget:,}.")
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"{_FEATURE} needs num_layers from 1 to the model's {len(layers)} decoder layers, got "
                         f"{num_layers}.")
    chosen = layers[-num_layers:]
    for name, layer in chosen:
        if layer in _STASHES:
            raise RuntimeError(f"{_FEATURE} needs one install per decoder layer, got a second one on {name}. Call "
                               f"remove() on the first handle before installing again.")

    counters = _Counters()
    stashes = []
    for name, layer in chosen:
        stash = _LayerStash(name, layer, config, counters)
        for module in layer.modules():
            _STASHES[module] = stash
        stashes.append(stash)
    if _original_sdpa is None:
        _original_sdpa = attention_functions["sdpa"]
        attention_functions["sdpa"] = _stashing_sdpa
    if layer_bytes is None:
        heads, head_dim = _attention_geometry(*chosen[-1])
        dtype = _model_dtype(model)
        cost = (f"{heads * (head_dim * dtype.itemsize + 4):,} bytes per token and layer of each micro-batch in flight "
                f"in {dtype} (give micro_batch_size and sequence_length for the exact figure)")
    else:
        cost = (f"{layer_bytes * num_layers:,} bytes per micro-batch in flight ({layer_bytes:,} per layer at "
                f"micro-batch {micro_batch_size}, sequence {sequence_length})")
    logger.info(f"{_FEATURE}: keeping the attention output of {num_layers} of {len(layers)} decoder layers "
                f"({chosen[0][0]} to {chosen[-1][0]}) for their recompute: {cost}.")
    return AttentionStashHandle(stashes, counters, attention_functions)
