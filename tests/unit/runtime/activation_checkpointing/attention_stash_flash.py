# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""flash-attn 2 on a machine without CUDA, for the attention stash tests.

flash-attn's Python layer calls its kernels through four custom ops (``flash_attn::_flash_attn_forward``,
``_flash_attn_varlen_forward`` and their backwards). The CPU stand-ins registered here let Hugging Face's whole
flash_attention_2 path (unpadding a padded batch, packing from position_ids, Ulysses) run with values on CPU, so a
stock run and a stashed run can be compared bitwise: both call the same deterministic stand-in. The stand-ins follow
flash-attn's semantics (layouts, bottom-right causal alignment, sliding windows, softcap, grouped heads, the
log-sum-exp and softmax_d layouts) but not its numerics: they compute in float32 with plain matrix products. The
meta-device tests do not use them: there flash-attn's own fake kernels run.
"""

import importlib
import importlib.util
import math
import os
import sys
import types

import torch

from deepspeed.runtime.activation_checkpointing import attention_stash

# Into the repository's .test-packages folder, which tests/conftest.py puts on the test session's path.
INSTALL_HINT = ("FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip install "
                "--no-build-isolation --no-deps --target .test-packages flash-attn==2.8.3 (in the repository's root)")

# The names in transformers.modeling_flash_attention_utils that cache the lazily imported flash functions.
_LAZY_FLASH_NAMES = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                     "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")

# flash-attn rounds the rows of softmax_d up to blocks of 128 (see mha_bwd and mha_varlen_bwd).
_ROW_BLOCK = 128

_registered = False


def import_flash_attn():
    """flash_attn.flash_attn_interface; without flash-attn's compiled kernels, over an empty stand-in for them."""
    if importlib.util.find_spec("flash_attn") is None:
        raise ImportError(f"flash-attn is not installed; install its Python layer with: {INSTALL_HINT}")
    try:
        import flash_attn_2_cuda  # noqa: F401
    except ImportError:
        # A CPU machine: flash_attn_interface imports the compiled module at import time, and calls it only
        # from the CUDA kernels of its custom ops.
        sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    try:
        return importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as error:
        raise ImportError(f"flash_attn.flash_attn_interface does not import ({error!r}); "
                          f"reinstall flash-attn with: {INSTALL_HINT}") from error


# Set to "required" (CI does), a machine without flash-attn fails the flash_attention_2 tests instead of skipping them.
REQUIRED = "ATTENTION_STASH_FLASH_ATTN"


def flash_attn_or_skip():
    """import_flash_attn() for a test module: skips the module, with the reason, where flash-attn cannot be imported,
    unless the environment requires it (REQUIRED set to "required"), where the reason fails the run."""
    import pytest

    try:
        return import_flash_attn()
    except ImportError as error:
        if os.environ.get(REQUIRED) == "required":
            raise ImportError(f"{REQUIRED}=required, and flash-attn does not import: {error}") from error
        pytest.skip(str(error), allow_module_level=True)


def use_flash_attention_2(monkeypatch):
    """Make transformers' flash_attention_2 path run on this machine for the rest of the test.

    Imports flash-attn (see import_flash_attn), registers the CPU stand-in kernels, tells
    transformers.modeling_flash_attention_utils that flash-attn 2 is available (it asks before each lazy import of
    the flash functions), and clears its cached flash functions so the next call imports flash-attn's. monkeypatch
    restores both when the test ends. A model runs the path once its config says so:
    ``model.config._attn_implementation = "flash_attention_2"``.
    """
    import transformers.modeling_flash_attention_utils as flash_utils

    import_flash_attn()
    register_cpu_kernels()
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda *args, **kwargs: True)
    for name in _LAZY_FLASH_NAMES:
        if hasattr(flash_utils, name):
            monkeypatch.setattr(flash_utils, name, None)


def register_cpu_kernels():
    """Register the CPU stand-ins for flash-attn's four custom ops, once per process."""
    global _registered
    if _registered:
        return
    import_flash_attn()
    kernels = {
        "flash_attn::_flash_attn_forward": flash_forward_cpu,
        "flash_attn::_flash_attn_varlen_forward": flash_varlen_forward_cpu,
        "flash_attn::_flash_attn_backward": flash_backward_cpu,
        "flash_attn::_flash_attn_varlen_backward": flash_varlen_backward_cpu,
    }
    for op_name, kernel in kernels.items():
        torch.library.register_kernel(op_name, "cpu", _outside_autocast(kernel))
    _registered = True


def _outside_autocast(kernel):
    """The kernel with CPU autocast off inside it, as flash-attn's CUDA kernels compute in their inputs' dtype
    whatever autocast says: the stand-ins' float32 products would otherwise run in autocast's dtype."""

    def run(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return kernel(*args, **kwargs)

    return run


def _check_supported(dropout_p, alibi_slopes, return_softmax=False, **unsupported):
    if dropout_p != 0.0:
        raise NotImplementedError(f"the CPU flash-attn stand-in has no dropout; got dropout_p={dropout_p}")
    if alibi_slopes is not None:
        raise NotImplementedError("the CPU flash-attn stand-in has no ALiBi slopes")
    if return_softmax:
        raise NotImplementedError("the CPU flash-attn stand-in does not return the softmax (flash-attn returns it "
                                  "only with dropout)")
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"the CPU flash-attn stand-in does not take {name}")


def _allowed_keys(seqlen_q, seqlen_k, causal, window_size_left, window_size_right):
    """[seqlen_q, seqlen_k] bool: which keys each query sees, aligned bottom-right as flash-attn does."""
    if causal:
        window_size_right = 0
    query = torch.arange(seqlen_q).unsqueeze(1)
    key = torch.arange(seqlen_k).unsqueeze(0)
    diagonal = query + seqlen_k - seqlen_q
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if window_size_left >= 0:
        allowed &= key >= diagonal - window_size_left
    if window_size_right >= 0:
        allowed &= key <= diagonal + window_size_right
    return allowed


def _expand_heads(tensor, num_heads):
    """[seqlen, kv_heads, d] -> float32 [heads, seqlen, d]: each key/value head serves consecutive query heads."""
    groups = num_heads // tensor.shape[1]
    return tensor.float().repeat_interleave(groups, dim=1).transpose(0, 1)


def _scores(q, k, softmax_scale, softcap, allowed):
    """float32 [heads, seqlen_q, seqlen_k] scores (masked to -inf) and the uncapped ones, for the softcap gradient."""
    raw = torch.matmul(q, k.transpose(1, 2)) * softmax_scale
    scores = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    return scores.masked_fill(~allowed, -math.inf), raw


def _sequence_forward(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap, sinks=None):
    """One sequence: q [seqlen_q, heads, d], k/v [seqlen_k, kv_heads, d] -> float32 out [seqlen_q, heads, d] and
    float32 lse [heads, seqlen_q] (+inf where a query sees no key, its output 0, as flash-attn does).

    ``sinks`` [heads], vLLM's flash-attn 3's s_aux: each head's sink logit, unscaled, joins every row's normaliser and
    so its log-sum-exp, as its kernel's softmax finalize_aux does (flash-attn/softmax.h); a row that sees no key gets
    output 0 and the sink as its log-sum-exp."""
    num_heads = q.shape[1]
    allowed = _allowed_keys(q.shape[0], k.shape[0], causal, window_size_left, window_size_right)
    scores, _ = _scores(q.float().transpose(0, 1), _expand_heads(k, num_heads), softmax_scale, softcap, allowed)
    normalised = scores if sinks is None else torch.cat(
        (scores, sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)), dim=-1)
    lse = torch.logsumexp(normalised, dim=-1)
    no_key = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(no_key, 0.0).unsqueeze(-1))
    out = torch.matmul(probs, _expand_heads(v, num_heads))
    return out.transpose(0, 1), lse.masked_fill(no_key, math.inf)


def _sequence_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size_left, window_size_right, softcap):
    """One sequence's float32 dq, dk, dv and softmax_d [heads, seqlen_q] = rowsum(dout * out), from the saved out
    and lse as flash-attn's backward computes them."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    allowed = _allowed_keys(q.shape[0], k.shape[0], causal, window_size_left, window_size_right)
    q_heads, k_heads, v_heads = (q.float().transpose(0, 1), _expand_heads(k, num_heads), _expand_heads(v, num_heads))
    scores, raw = _scores(q_heads, k_heads, softmax_scale, softcap, allowed)
    # lse is +inf for a query that sees no key: its probabilities are exp(-inf) = 0.
    probs = torch.exp(scores - lse.float().unsqueeze(-1))
    dout_heads, out_heads = dout.float().transpose(0, 1), out.float().transpose(0, 1)
    softmax_d = (dout_heads * out_heads).sum(dim=-1)
    dv_heads = torch.matmul(probs.transpose(1, 2), dout_heads)
    dprobs = torch.matmul(dout_heads, v_heads.transpose(1, 2))
    dscores = probs * (dprobs - softmax_d.unsqueeze(-1))
    if softcap > 0:
        dscores = dscores * (1.0 - torch.tanh(raw / softcap)**2)
    dq = torch.matmul(dscores, k_heads).transpose(0, 1) * softmax_scale
    dk_heads = torch.matmul(dscores.transpose(1, 2), q_heads) * softmax_scale

    def per_kv_head(grad):
        # [heads, seqlen_k, d] -> [seqlen_k, kv_heads, d], summing each group of query heads in a fixed order.
        grouped = grad.reshape(num_kv_heads, num_heads // num_kv_heads, *grad.shape[1:]).sum(dim=1)
        return grouped.transpose(0, 1)

    return dq, per_kv_head(dk_heads), per_kv_head(dv_heads), softmax_d


def _check_heads(q, k):
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"flash-attn needs the query heads ({q.shape[-2]}) to be a multiple of the key/value heads "
                         f"({k.shape[-2]})")


def _forward_results(q, out, softmax_lse):
    """The forward op's four results: out and lse, an empty S_dmask and a zero rng_state."""
    return out.to(q.dtype), softmax_lse, q.new_empty((0, )), torch.zeros(2, dtype=torch.int64, device=q.device)


def _copy_gradients(grads, dq, dk, dv):
    for buffer, grad in zip((dq, dk, dv), grads):
        if buffer is not None:
            buffer.copy_(grad)


def flash_forward_cpu(q,
                      k,
                      v,
                      dropout_p,
                      softmax_scale,
                      causal,
                      window_size_left,
                      window_size_right,
                      softcap,
                      alibi_slopes,
                      return_softmax,
                      sinks=None):
    """flash_attn::_flash_attn_forward on CPU: q [batch, seqlen_q, heads, d], k/v [batch, seqlen_k, kv_heads, d]
    -> out (q's shape and dtype), lse float32 [batch, heads, seqlen_q], S_dmask (0,), rng_state int64 (2,)."""
    _check_supported(dropout_p, alibi_slopes, return_softmax)
    _check_heads(q, k)
    outputs, lses = [], []
    for index in range(q.shape[0]):
        out, lse = _sequence_forward(q[index], k[index], v[index], softmax_scale, causal, window_size_left,
                                     window_size_right, softcap, sinks)
        outputs.append(out)
        lses.append(lse)
    return _forward_results(q, torch.stack(outputs), torch.stack(lses))


def flash_varlen_forward_cpu(q,
                             k,
                             v,
                             cu_seqlens_q,
                             cu_seqlens_k,
                             max_seqlen_q,
                             max_seqlen_k,
                             dropout_p,
                             softmax_scale,
                             causal,
                             window_size_left=-1,
                             window_size_right=-1,
                             softcap=0.0,
                             alibi_slopes=None,
                             return_softmax=False,
                             block_table=None,
                             leftpad_k=None,
                             seqused_k=None,
                             zero_tensors=False,
                             sinks=None):
    """flash_attn::_flash_attn_varlen_forward on CPU: q [total_q, heads, d], k/v [total_k, kv_heads, d], sequence i
    in rows cu_seqlens[i]:cu_seqlens[i + 1] -> out (q's shape and dtype), lse float32 [heads, total_q], S_dmask (0,),
    rng_state int64 (2,). Rows past the last sequence get output 0 and lse +inf."""
    _check_supported(dropout_p,
                     alibi_slopes,
                     return_softmax,
                     block_table=block_table,
                     leftpad_k=leftpad_k,
                     seqused_k=seqused_k)
    _check_heads(q, k)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    softmax_lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float32, device=q.device)
    for start_q, end_q, start_k, end_k in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        if end_q == start_q:
            continue
        out[start_q:end_q], softmax_lse[:, start_q:end_q] = _sequence_forward(q[start_q:end_q], k[start_k:end_k],
                                                                              v[start_k:end_k], softmax_scale, causal,
                                                                              window_size_left, window_size_right,
                                                                              softcap, sinks)
    return _forward_results(q, out, softmax_lse)


def flash_backward_cpu(dout,
                       q,
                       k,
                       v,
                       out,
                       softmax_lse,
                       dq,
                       dk,
                       dv,
                       dropout_p,
                       softmax_scale,
                       causal,
                       window_size_left,
                       window_size_right,
                       softcap,
                       alibi_slopes,
                       deterministic,
                       rng_state=None):
    """flash_attn::_flash_attn_backward on CPU: writes dq, dk, dv in place and returns softmax_d, float32
    [batch, heads, seqlen_q rounded up to 128] as flash-attn lays it out (rows past seqlen_q are 0)."""
    _check_supported(dropout_p, alibi_slopes)
    batch, seqlen_q, num_heads, _ = q.shape
    dq_parts, dk_parts, dv_parts = [], [], []
    softmax_d = torch.zeros(batch, num_heads, _round_up(seqlen_q), dtype=torch.float32, device=q.device)
    for index in range(batch):
        dq_part, dk_part, dv_part, d_part = _sequence_backward(dout[index], q[index], k[index], v[index], out[index],
                                                               softmax_lse[index], softmax_scale, causal,
                                                               window_size_left, window_size_right, softcap)
        dq_parts.append(dq_part)
        dk_parts.append(dk_part)
        dv_parts.append(dv_part)
        softmax_d[index, :, :seqlen_q] = d_part
    _copy_gradients((torch.stack(dq_parts), torch.stack(dk_parts), torch.stack(dv_parts)), dq, dk, dv)
    return softmax_d


def flash_varlen_backward_cpu(dout,
                              q,
                              k,
                              v,
                              out,
                              softmax_lse,
                              dq,
                              dk,
                              dv,
                              cu_seqlens_q,
                              cu_seqlens_k,
                              max_seqlen_q,
                              max_seqlen_k,
                              dropout_p,
                              softmax_scale,
                              causal,
                              window_size_left,
                              window_size_right,
                              softcap,
                              alibi_slopes,
                              deterministic,
                              rng_state=None,
                              zero_tensors=False):
    """flash_attn::_flash_attn_varlen_backward on CPU: writes dq, dk, dv in place (0 in rows outside every sequence)
    and returns softmax_d, float32 [heads, total_q + 128 * batch] as flash-attn lays it out: sequence i's rows start
    at column cu_seqlens_q[i] + 128 * i, the other columns are 0."""
    _check_supported(dropout_p, alibi_slopes)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch = len(bounds_q) - 1
    grads = [torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device) for tensor in (q, k, v)]
    softmax_d = torch.zeros(q.shape[1], q.shape[0] + _ROW_BLOCK * batch, dtype=torch.float32, device=q.device)
    for index in range(batch):
        start_q, end_q, start_k, end_k = bounds_q[index], bounds_q[index + 1], bounds_k[index], bounds_k[index + 1]
        if end_q == start_q:
            continue
        dq_part, dk_part, dv_part, d_part = _sequence_backward(dout[start_q:end_q], q[start_q:end_q], k[start_k:end_k],
                                                               v[start_k:end_k], out[start_q:end_q],
                                                               softmax_lse[:, start_q:end_q], softmax_scale, causal,
                                                               window_size_left, window_size_right, softcap)
        grads[0][start_q:end_q] = dq_part
        grads[1][start_k:end_k] += dk_part
        grads[2][start_k:end_k] += dv_part
        column = start_q + _ROW_BLOCK * index
        softmax_d[:, column:column + end_q - start_q] = d_part
    _copy_gradients(grads, dq, dk, dv)
    return softmax_d


def _round_up(length):
    return (length + _ROW_BLOCK - 1) // _ROW_BLOCK * _ROW_BLOCK


# Batches and meta steps of the flash tests (flash-attn 2 and 3, the Hub builds, flash-attn 4), here so that each test file
# skips for its own implementation's reason alone.
# Documents of a packed batch: one row of 64 tokens.
DOCUMENTS = (24, 40)
# Left padding of the second row of a padded batch.
PADDING = 5
META_BATCH, META_SEQUENCE = 2, 72


def make_batch(kind):
    """The batch's model inputs, and the (micro-batch, sequence) the planner counts for it."""
    generator = torch.Generator().manual_seed(1)
    if kind in ("plain", "padded"):
        ids = torch.randint(0, 128, (2, 32), generator=generator)
        if kind == "plain":
            return dict(input_ids=ids, labels=ids), (2, 32)
        mask = torch.ones_like(ids)
        mask[1, :PADDING] = 0
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)), (2, 32)
    # One row of documents, as transformers' DataCollatorWithFlattening makes it: positions restart per document,
    # and no label crosses a boundary.
    ids = torch.randint(0, 128, (1, sum(DOCUMENTS)), generator=generator)
    position_ids = torch.cat([torch.arange(length) for length in DOCUMENTS]).unsqueeze(0)
    labels = ids.clone()
    labels[0, DOCUMENTS[0]] = -100
    inputs = dict(input_ids=ids, position_ids=position_ids, labels=labels)
    if kind == "packed_cu_seq_lens":
        cu_seq_lens = torch.tensor([0, DOCUMENTS[0], sum(DOCUMENTS)], dtype=torch.int32)
        inputs.update(cu_seq_lens_q=cu_seq_lens,
                      cu_seq_lens_k=cu_seq_lens.clone(),
                      max_length_q=max(DOCUMENTS),
                      max_length_k=max(DOCUMENTS))
    return inputs, (1, sum(DOCUMENTS))


def real_2d(tensor):
    """What a step's live-tensor check counts: a tensor of two or more dimensions, not on meta."""
    return tensor.dim() >= 2 and not tensor.is_meta


def meta_of_a_batch(tensor):
    """What a meta step's live-tensor check counts: a meta tensor of two or more dimensions with one of a batch's
    sequence (plain or packed)."""
    return tensor.dim() >= 2 and tensor.is_meta and (META_SEQUENCE in tensor.shape
                                                     or META_BATCH * META_SEQUENCE in tensor.shape)


def meta_step(model, handle, packed, counter, calls):
    """One step of the decoder layers on meta tensors in bfloat16, called as the model calls them, counted by
    ``counter`` (returned): ``calls`` attention calls kept, as the planner counts their bytes, then served; every
    layer parameter gets a gradient of its shape and dtype."""
    batch, sequence = (1, META_BATCH * META_SEQUENCE) if packed else (META_BATCH, META_SEQUENCE)
    inputs = torch.empty(batch,
                         sequence,
                         model.config.hidden_size,
                         device="meta",
                         dtype=torch.bfloat16,
                         requires_grad=True)
    embeddings = model.model.rotary_emb(inputs, torch.arange(sequence, device="meta").unsqueeze(0))
    varlen = {}
    if packed:
        cu_seq_lens = torch.empty(META_BATCH + 1, device="meta", dtype=torch.int32)
        varlen = dict(cu_seq_lens_q=cu_seq_lens,
                      cu_seq_lens_k=cu_seq_lens,
                      max_length_q=META_SEQUENCE,
                      max_length_k=META_SEQUENCE)
    hidden = inputs
    with counter:
        for layer in model.model.layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=embeddings, position_ids=None, **varlen)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        planned = attention_stash.attention_stash_layer_bytes(model, batch, sequence)
        assert (handle.num_kept, handle.kept_bytes) == (calls, calls * planned)
        hidden.sum().backward()
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (calls, 0, 0)
    assert inputs.grad is not None and inputs.grad.shape == inputs.shape
    for param_name, param in model.named_parameters():
        if param_name.startswith("model.layers."):
            assert param.grad is not None, param_name
            assert (param.grad.shape, param.grad.dtype) == (param.shape, param.dtype), param_name
    return counter
