# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A mirror of the Hub build kernels-community/flash-attn3's Python layer, for the attention stash tests: its
``torch-ext/flash_attn3/flash_attn_interface.py``, written for these tests, the parts Hugging Face and the stash reach.

Read at version 1 (huggingface/kernels-community 8e6f8376, the file's last change). transformers 5.25 asks for version
2 (kernels-community PR #1132, "Expose ops ... Bump version since we are exposing something new"): its package
``__init__`` also exports ``ops`` and ``add_op_namespace_prefix`` from ``_ops``, which the tests' local build follows
(attention_stash_flash3.build_hub_kernel); its flash_attn_interface.py was not reachable here, and that change names
nothing else.

As in the real file:

* ``_flash_attn_forward`` and ``_flash_attn_backward`` are custom ops (``torch.library.custom_op``) named in the
  build's namespace, each with a fake kernel beside it, with the real file's parameter names, order and defaults
  (``out_``; ``window_size_left`` and ``window_size_right``; the backward's ``is_causal``); the forward has an autograd
  formula (``register_autograd``); they call the build's compiled ``fwd`` and ``bwd`` (whose ``bwd`` returns softmax_d
  first) through ``_ops.ops``;
* FlashAttnFunc and FlashAttnVarlenFunc call ``_flash_attn_forward`` for both, save (q, k, v, out, log-sum-exp,
  [cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k]) and pad no head dimension;
* flash_attn_func and flash_attn_varlen_func take the real file's parameters, ``return_attn_probs`` among them.

Where it differs, because these tests run the CUDA build's role on CPU: the custom ops are registered for the CPU (the
real ones for "cuda"), and the backward's fake kernel rounds softmax_d's rows to 128 without asking the CUDA device for
its block size. The compiled ops are attention_stash_flash3's stand-ins, defined in this build's namespace.
"""

from typing import Optional, Tuple

import torch

from ._ops import ops as flash_attn_3_cuda
from ._ops import add_op_namespace_prefix


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


@torch.library.custom_op(add_op_namespace_prefix("_flash_attn_forward"), mutates_args=(), device_types="cpu")
def _flash_attn_forward(q: torch.Tensor,
                        k: torch.Tensor,
                        v: torch.Tensor,
                        k_new: Optional[torch.Tensor] = None,
                        v_new: Optional[torch.Tensor] = None,
                        qv: Optional[torch.Tensor] = None,
                        out_: Optional[torch.Tensor] = None,
                        cu_seqlens_q: Optional[torch.Tensor] = None,
                        cu_seqlens_k: Optional[torch.Tensor] = None,
                        cu_seqlens_k_new: Optional[torch.Tensor] = None,
                        seqused_q: Optional[torch.Tensor] = None,
                        seqused_k: Optional[torch.Tensor] = None,
                        max_seqlen_q: Optional[int] = None,
                        max_seqlen_k: Optional[int] = None,
                        page_table: Optional[torch.Tensor] = None,
                        kv_batch_idx: Optional[torch.Tensor] = None,
                        leftpad_k: Optional[torch.Tensor] = None,
                        rotary_cos: Optional[torch.Tensor] = None,
                        rotary_sin: Optional[torch.Tensor] = None,
                        seqlens_rotary: Optional[torch.Tensor] = None,
                        q_descale: Optional[torch.Tensor] = None,
                        k_descale: Optional[torch.Tensor] = None,
                        v_descale: Optional[torch.Tensor] = None,
                        softmax_scale: Optional[float] = None,
                        causal: bool = False,
                        window_size_left: int = -1,
                        window_size_right: int = -1,
                        attention_chunk: int = 0,
                        softcap: float = 0.0,
                        rotary_interleaved: bool = True,
                        scheduler_metadata: Optional[torch.Tensor] = None,
                        num_splits: int = 1,
                        pack_gqa: Optional[bool] = None,
                        sm_margin: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, k_new, v_new = [maybe_contiguous(x) for x in (q, k, k_new, v_new)]
    v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
    out, softmax_lse, out_accum, softmax_lse_accum = flash_attn_3_cuda.fwd(
        q, k, v, k_new, v_new, qv, out_, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
        max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
        q_descale, k_descale, v_descale, softmax_scale, causal, window_size_left, window_size_right, attention_chunk,
        softcap, rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin)
    if out_accum is None:
        out_accum = torch.tensor([], device=out.device)
    if softmax_lse_accum is None:
        softmax_lse_accum = torch.tensor([], device=out.device)
    return out, softmax_lse, out_accum, softmax_lse_accum


@torch.library.register_fake(add_op_namespace_prefix("_flash_attn_forward"))
def _flash_attn_forward_fake(q,
                             k,
                             v,
                             k_new=None,
                             v_new=None,
                             qv=None,
                             out_=None,
                             cu_seqlens_q=None,
                             cu_seqlens_k=None,
                             cu_seqlens_k_new=None,
                             seqused_q=None,
                             seqused_k=None,
                             max_seqlen_q=None,
                             max_seqlen_k=None,
                             page_table=None,
                             kv_batch_idx=None,
                             leftpad_k=None,
                             rotary_cos=None,
                             rotary_sin=None,
                             seqlens_rotary=None,
                             q_descale=None,
                             k_descale=None,
                             v_descale=None,
                             softmax_scale=None,
                             causal=False,
                             window_size_left=-1,
                             window_size_right=-1,
                             attention_chunk=0,
                             softcap=0.0,
                             rotary_interleaved=True,
                             scheduler_metadata=None,
                             num_splits=1,
                             pack_gqa=None,
                             sm_margin=0):
    if cu_seqlens_q is not None:
        total_q, num_heads, _ = q.shape
        out = torch.empty((total_q, num_heads, v.shape[-1]), dtype=q.dtype, device=q.device)
        softmax_lse = torch.empty((num_heads, total_q), dtype=torch.float32, device=q.device)
    else:
        batch_size, seqlen_q, num_heads, _ = q.shape
        out = torch.empty((batch_size, seqlen_q, num_heads, v.shape[-1]), dtype=q.dtype, device=q.device)
        softmax_lse = torch.empty((batch_size, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, softmax_lse, torch.tensor([], device=q.device), torch.tensor([], device=q.device)


@torch.library.custom_op(add_op_namespace_prefix("_flash_attn_backward"),
                         mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_backward(dout: torch.Tensor,
                         q: torch.Tensor,
                         k: torch.Tensor,
                         v: torch.Tensor,
                         out: torch.Tensor,
                         softmax_lse: torch.Tensor,
                         cu_seqlens_q: Optional[torch.Tensor] = None,
                         cu_seqlens_k: Optional[torch.Tensor] = None,
                         sequed_q: Optional[torch.Tensor] = None,
                         sequed_k: Optional[torch.Tensor] = None,
                         max_seqlen_q: Optional[int] = None,
                         max_seqlen_k: Optional[int] = None,
                         dq: Optional[torch.Tensor] = None,
                         dk: Optional[torch.Tensor] = None,
                         dv: Optional[torch.Tensor] = None,
                         softmax_scale: Optional[float] = None,
                         is_causal: bool = False,
                         window_size_left: int = -1,
                         window_size_right: int = -1,
                         softcap: float = 0.0,
                         deterministic: bool = False,
                         sm_margin: int = 0) -> torch.Tensor:
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    softmax_d, *rest = flash_attn_3_cuda.bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                             sequed_q, sequed_k, max_seqlen_q, max_seqlen_k, softmax_scale, is_causal,
                                             window_size_left, window_size_right, softcap, deterministic, sm_margin)
    return softmax_d


@torch.library.register_fake(add_op_namespace_prefix("_flash_attn_backward"))
def _flash_attn_backward_fake(dout,
                              q,
                              k,
                              v,
                              out,
                              softmax_lse,
                              cu_seqlens_q=None,
                              cu_seqlens_k=None,
                              sequed_q=None,
                              sequed_k=None,
                              max_seqlen_q=None,
                              max_seqlen_k=None,
                              dq=None,
                              dk=None,
                              dv=None,
                              softmax_scale=None,
                              is_causal=False,
                              window_size_left=-1,
                              window_size_right=-1,
                              softcap=0.0,
                              deterministic=False,
                              sm_margin=0):
    num_heads = q.shape[-2]
    if cu_seqlens_q is None:
        return torch.empty((q.shape[0], num_heads, round_multiple(q.shape[1], 128)),
                           dtype=torch.float32,
                           device=q.device)
    batch_size = cu_seqlens_q.shape[0] - 1
    return torch.empty((num_heads, round_multiple(q.shape[0] + batch_size * 128, 128)),
                       dtype=torch.float32,
                       device=q.device)


def setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, softmax_lse, _, _ = output
    ctx.save_for_backward(q, k, v, out, softmax_lse)
    ctx.softmax_scale, ctx.causal, ctx.window_size = inputs[-11], inputs[-10], [inputs[-9], inputs[-8]]
    ctx.attention_chunk, ctx.softcap, ctx.sm_margin = inputs[-7], inputs[-6], inputs[-1]


def _backward(ctx, dout, *grads):
    q, k, v, out, softmax_lse = ctx.saved_tensors
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, None, None, None, None, None, None, dq, dk, dv,
                         ctx.softmax_scale, ctx.causal, ctx.window_size[0], ctx.window_size[1], ctx.softcap, False,
                         ctx.sm_margin)
    return dq, dk, dv, *((None, ) * 21)


_flash_attn_forward.register_autograd(_backward, setup_context=setup_context)


class FlashAttnFunc(torch.autograd.Function):

    @staticmethod
    def forward(ctx,
                q,
                k,
                v,
                softmax_scale,
                causal,
                qv=None,
                q_descale=None,
                k_descale=None,
                v_descale=None,
                window_size=(-1, -1),
                attention_chunk=0,
                softcap=0.0,
                num_splits=1,
                pack_gqa=None,
                deterministic=False,
                sm_margin=0,
                return_softmax=False):
        if softmax_scale is None:
            softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0))**(-0.5)
        out, softmax_lse, *rest = _flash_attn_forward(q,
                                                      k,
                                                      v,
                                                      None,
                                                      None,
                                                      qv,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      q_descale,
                                                      k_descale,
                                                      v_descale,
                                                      softmax_scale,
                                                      causal=causal,
                                                      window_size_left=window_size[0],
                                                      window_size_right=window_size[1],
                                                      attention_chunk=attention_chunk,
                                                      softcap=softcap,
                                                      num_splits=num_splits,
                                                      pack_gqa=pack_gqa,
                                                      sm_margin=sm_margin)
        ctx.save_for_backward(q, k, v, out, softmax_lse)
        ctx.softmax_scale, ctx.causal, ctx.window_size = softmax_scale, causal, window_size
        ctx.attention_chunk, ctx.softcap, ctx.deterministic, ctx.sm_margin = (attention_chunk, softcap, deterministic,
                                                                              sm_margin)
        return (out, softmax_lse) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse = ctx.saved_tensors
        assert ctx.attention_chunk == 0, "FA3 backward does not support attention_chunk"
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, softmax_lse, None, None, None, None, None, None, dq, dk, dv,
                             ctx.softmax_scale, ctx.causal, ctx.window_size[0], ctx.window_size[1], ctx.softcap,
                             ctx.deterministic, ctx.sm_margin)
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]], *(None, ) * 14


class FlashAttnVarlenFunc(torch.autograd.Function):

    @staticmethod
    def forward(ctx,
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                seqused_q,
                seqused_k,
                max_seqlen_q,
                max_seqlen_k,
                softmax_scale,
                causal,
                qv=None,
                q_descale=None,
                k_descale=None,
                v_descale=None,
                window_size=(-1, -1),
                attention_chunk=0,
                softcap=0.0,
                num_splits=1,
                pack_gqa=None,
                deterministic=False,
                sm_margin=0,
                return_softmax=False):
        if softmax_scale is None:
            softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0))**(-0.5)
        out, softmax_lse, *rest = _flash_attn_forward(q,
                                                      k,
                                                      v,
                                                      None,
                                                      None,
                                                      qv,
                                                      None,
                                                      cu_seqlens_q,
                                                      cu_seqlens_k,
                                                      None,
                                                      seqused_q,
                                                      seqused_k,
                                                      max_seqlen_q,
                                                      max_seqlen_k,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      None,
                                                      q_descale,
                                                      k_descale,
                                                      v_descale,
                                                      softmax_scale,
                                                      causal=causal,
                                                      window_size_left=window_size[0],
                                                      window_size_right=window_size[1],
                                                      attention_chunk=attention_chunk,
                                                      softcap=softcap,
                                                      num_splits=num_splits,
                                                      pack_gqa=pack_gqa,
                                                      sm_margin=sm_margin)
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.softmax_scale, ctx.causal, ctx.window_size = softmax_scale, causal, window_size
        ctx.attention_chunk, ctx.softcap, ctx.deterministic, ctx.sm_margin = (attention_chunk, softcap, deterministic,
                                                                              sm_margin)
        return (out, softmax_lse) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
        assert ctx.attention_chunk == 0, "FA3 backward does not support attention_chunk"
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                             ctx.max_seqlen_q, ctx.max_seqlen_k, dq, dk, dv, ctx.softmax_scale, ctx.causal,
                             ctx.window_size[0], ctx.window_size[1], ctx.softcap, ctx.deterministic, ctx.sm_margin)
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]], *(None, ) * 20


def flash_attn_func(q,
                    k,
                    v,
                    softmax_scale=None,
                    causal=False,
                    qv=None,
                    q_descale=None,
                    k_descale=None,
                    v_descale=None,
                    window_size=(-1, -1),
                    attention_chunk=0,
                    softcap=0.0,
                    num_splits=1,
                    pack_gqa=None,
                    deterministic=False,
                    sm_margin=0,
                    return_attn_probs=False):
    return FlashAttnFunc.apply(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
                               attention_chunk, softcap, num_splits, pack_gqa, deterministic, sm_margin,
                               return_attn_probs)


def flash_attn_varlen_func(q,
                           k,
                           v,
                           cu_seqlens_q,
                           cu_seqlens_k,
                           max_seqlen_q,
                           max_seqlen_k,
                           seqused_q=None,
                           seqused_k=None,
                           softmax_scale=None,
                           causal=False,
                           qv=None,
                           q_descale=None,
                           k_descale=None,
                           v_descale=None,
                           window_size=(-1, -1),
                           attention_chunk=0,
                           softcap=0.0,
                           num_splits=1,
                           pack_gqa=None,
                           deterministic=False,
                           sm_margin=0,
                           return_attn_probs=False):
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                     max_seqlen_k, softmax_scale, causal, qv, q_descale, k_descale, v_descale,
                                     window_size, attention_chunk, softcap, num_splits, pack_gqa, deterministic,
                                     sm_margin, return_attn_probs)
