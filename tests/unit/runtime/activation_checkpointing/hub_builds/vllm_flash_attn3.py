# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A mirror of the Hub build kernels-community/vllm-flash-attn3's Python layer, for the attention stash tests: its
``torch-ext/vllm_flash_attn3/flash_attn_interface.py``, written for these tests, the parts Hugging Face and the stash
reach. transformers 5.24 and 5.25 load this build for attn_implementation="flash_attention_3" where flash-attn 3 is
not installed and the kernels package is.

Read at version 1, the version transformers 5.22 to 5.25 ask for (huggingface/kernels-community df070bae, the file's
last change; unchanged through the build's version 1 since cb661dfd).

As in the real file:

* ``_flash_attn_forward`` and ``_flash_attn_backward`` are plain functions (no custom ops), with the real file's
  parameter names, order and defaults: one ``window_size`` pair, no ``attention_chunk``, attention sinks ``s_aux``
  last in the forward; they call the build's compiled ``fwd`` (which takes ``s_aux``) and ``bwd`` (which returns
  dq, dk, dv first) through ``_ops.ops``;
* FlashAttnFunc and FlashAttnVarlenFunc return the output and its log-sum-exp, save (q, k, v, out, log-sum-exp,
  [cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k]) and give ``s_aux`` no gradient;
* flash_attn_func and flash_attn_varlen_func take the real file's parameters, ``s_aux`` last.

The compiled ops are attention_stash_flash3's stand-ins, defined in this build's namespace; ``fwd`` computes the
sinks as the build's kernel does (flash-attn/softmax.h, finalize_aux): each head's sink logit, unscaled, in every
row's normaliser and so in the log-sum-exp, which ``bwd`` takes, giving dq, dk and dv and no gradient for the sinks.
"""

import torch

from ._ops import ops


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _flash_attn_forward(q,
                        k,
                        v,
                        k_new,
                        v_new,
                        qv,
                        out,
                        cu_seqlens_q,
                        cu_seqlens_k,
                        cu_seqlens_k_new,
                        seqused_q,
                        seqused_k,
                        max_seqlen_q,
                        max_seqlen_k,
                        page_table,
                        kv_batch_idx,
                        leftpad_k,
                        rotary_cos,
                        rotary_sin,
                        seqlens_rotary,
                        q_descale,
                        k_descale,
                        v_descale,
                        softmax_scale,
                        causal,
                        window_size=(-1, -1),
                        softcap=0.0,
                        rotary_interleaved=True,
                        scheduler_metadata=None,
                        num_splits=1,
                        pack_gqa=None,
                        sm_margin=0,
                        s_aux=None):
    q, k, k_new, v_new = [maybe_contiguous(x) for x in (q, k, k_new, v_new)]
    v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
    out, softmax_lse, *rest = ops.fwd(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                                      seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx,
                                      leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale,
                                      v_descale, softmax_scale, causal, window_size[0], window_size[1], softcap,
                                      rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin, s_aux)
    return out, softmax_lse, *rest


def _flash_attn_backward(dout,
                         q,
                         k,
                         v,
                         out,
                         softmax_lse,
                         cu_seqlens_q,
                         cu_seqlens_k,
                         sequed_q,
                         sequed_k,
                         max_seqlen_q,
                         max_seqlen_k,
                         dq,
                         dk,
                         dv,
                         softmax_scale,
                         causal,
                         window_size=(-1, -1),
                         softcap=0.0,
                         deterministic=False,
                         sm_margin=0):
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    dq, dk, dv, softmax_d, *rest = ops.bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                           sequed_q, sequed_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                           window_size[0], window_size[1], softcap, deterministic, sm_margin)
    return dq, dk, dv, softmax_d


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
                softcap=0.0,
                num_splits=1,
                pack_gqa=None,
                deterministic=False,
                sm_margin=0,
                s_aux=None):
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
                                                      window_size=window_size,
                                                      softcap=softcap,
                                                      num_splits=num_splits,
                                                      pack_gqa=pack_gqa,
                                                      sm_margin=sm_margin,
                                                      s_aux=s_aux)
        ctx.save_for_backward(q, k, v, out, softmax_lse)
        ctx.softmax_scale, ctx.causal, ctx.window_size = softmax_scale, causal, window_size
        ctx.softcap, ctx.deterministic, ctx.sm_margin = softcap, deterministic, sm_margin
        return out, softmax_lse

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, softmax_lse, None, None, None, None, None, None, dq, dk, dv,
                             ctx.softmax_scale, ctx.causal, ctx.window_size, ctx.softcap, ctx.deterministic,
                             ctx.sm_margin)
        return dq[..., :dout.shape[-1]], dk[..., :dout.shape[-1]], dv[..., :dout.shape[-1]], *(None, ) * 14


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
                softcap=0.0,
                num_splits=1,
                pack_gqa=None,
                deterministic=False,
                sm_margin=0,
                s_aux=None):
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
                                                      window_size=window_size,
                                                      softcap=softcap,
                                                      num_splits=num_splits,
                                                      pack_gqa=pack_gqa,
                                                      sm_margin=sm_margin,
                                                      s_aux=s_aux)
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.softmax_scale, ctx.causal, ctx.window_size = softmax_scale, causal, window_size
        ctx.softcap, ctx.deterministic, ctx.sm_margin = softcap, deterministic, sm_margin
        return out, softmax_lse

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                             ctx.max_seqlen_q, ctx.max_seqlen_k, dq, dk, dv, ctx.softmax_scale, ctx.causal,
                             ctx.window_size, ctx.softcap, ctx.deterministic, ctx.sm_margin)
        return dq[..., :dout.shape[-1]], dk[..., :dout.shape[-1]], dv[..., :dout.shape[-1]], *(None, ) * 20


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
                    softcap=0.0,
                    num_splits=1,
                    pack_gqa=None,
                    deterministic=False,
                    sm_margin=0,
                    s_aux=None):
    return FlashAttnFunc.apply(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
                               softcap, num_splits, pack_gqa, deterministic, sm_margin, s_aux)


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
                           softcap=0.0,
                           num_splits=1,
                           pack_gqa=None,
                           deterministic=False,
                           sm_margin=0,
                           s_aux=None):
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                     max_seqlen_k, softmax_scale, causal, qv, q_descale, k_descale, v_descale,
                                     window_size, softcap, num_splits, pack_gqa, deterministic, sm_margin, s_aux)
