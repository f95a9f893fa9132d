# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A mirror of the Hub build kernels-community/flash-attn2's Python layer, for the attention stash tests: its
``torch-ext/flash_attn2/flash_attn_interface.py``, written for these tests, the parts Hugging Face and the stash reach.

Read at version 3 (huggingface/kernels-community 2d6ecf3c, the newest source this project could read; the file last
changed at cf18692e). transformers 5.22 to 5.25 ask for version 4, whose source was not reachable here: the mirror
follows version 3, and transformers 5.24 and 5.25 call the build's functions alike (flash_attn_varlen_func and
flash_attn_func, the same keywords).

As in the real file:

* ``_flash_attn_forward``, ``_flash_attn_varlen_forward``, ``_flash_attn_backward`` and ``_flash_attn_varlen_backward``
  are custom ops (``torch.library.custom_op``) named in the build's namespace (``add_op_namespace_prefix``), each with
  a fake kernel beside it, with the real file's parameter names, order and defaults; they call the build's compiled
  ops ``fwd``, ``varlen_fwd``, ``bwd`` and ``varlen_bwd`` through ``_ops.ops``;
* FlashAttnFunc and FlashAttnVarlenFunc pad the head dimension to a multiple of 8, call those custom ops directly
  (there is no ``_wrapped_`` name), save (q, k, v, padded output, log-sum-exp, [cu_seqlens_q, cu_seqlens_k,] rng_state)
  and slice the output and gradients back;
* flash_attn_func and flash_attn_varlen_func take the real file's parameters.

Where it differs, because these tests run the CUDA build's role on CPU: the custom ops are registered for the CPU
(the real file registers them for ``_get_device()``, which answers "cuda" on a CUDA machine and "cpu" here),
flash_attn_varlen_func saves for the backward wherever grad is enabled (the real one passes ``is_grad_enabled=False``
on CPU, where the build has a varlen forward only), and the forwards' fake kernels return an empty softmax where the
real ones size it for ``return_softmax``, which neither Hugging Face nor the stash asks for. The compiled ops are
attention_stash_flash3's stand-ins, defined in this build's namespace before the module loads.
"""

from typing import Optional, Tuple

import torch

from ._ops import ops as flash_attn
from ._ops import add_op_namespace_prefix


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


def _lse(q, varlen):
    shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty(shape, dtype=torch.float32, device=q.device)


@torch.library.custom_op(add_op_namespace_prefix("_flash_attn_forward"), mutates_args=(), device_types="cpu")
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor],
                        return_softmax: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    out, softmax_lse, S_dmask, rng_state = flash_attn.fwd(q, k, v, None, alibi_slopes, dropout_p, softmax_scale,
                                                          causal, window_size_left, window_size_right, softcap,
                                                          return_softmax, None)
    return out, softmax_lse, S_dmask, rng_state


@torch.library.register_fake(add_op_namespace_prefix("_flash_attn_forward"))
def _flash_attn_forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                             alibi_slopes, return_softmax):
    return (torch.empty_like(q), _lse(q, False), q.new_empty(
        (0, )), torch.empty((2, ), dtype=torch.int64, device=q.device))


@torch.library.custom_op(add_op_namespace_prefix("_flash_attn_varlen_forward"), mutates_args=(), device_types="cpu")
def _flash_attn_varlen_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int = -1,
        window_size_right: int = -1,
        softcap: float = 0.0,
        alibi_slopes: Optional[torch.Tensor] = None,
        return_softmax: bool = False,
        block_table: Optional[torch.Tensor] = None,
        leftpad_k: Optional[torch.Tensor] = None,
        seqused_k: Optional[torch.Tensor] = None,
        zero_tensors: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    out, softmax_lse, S_dmask, rng_state = flash_attn.varlen_fwd(q, k, v, None, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                                                 leftpad_k, block_table, alibi_slopes, max_seqlen_q,
                                                                 max_seqlen_k, dropout_p, softmax_scale, zero_tensors,
                                                                 causal, window_size_left, window_size_right, softcap,
                                                                 return_softmax, None)
    return out, softmax_lse, S_dmask, rng_state


@torch.library.register_fake(add_op_namespace_prefix("_flash_attn_varlen_forward"))
def _flash_attn_varlen_forward_fake(q,
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
                                    zero_tensors=False):
    return (torch.empty_like(q), _lse(q, True), q.new_empty(
        (0, )), torch.empty((2, ), dtype=torch.int64, device=q.device))


@torch.library.custom_op(add_op_namespace_prefix("_flash_attn_backward"),
                         mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_backward(dout: torch.Tensor,
                         q: torch.Tensor,
                         k: torch.Tensor,
                         v: torch.Tensor,
                         out: torch.Tensor,
                         softmax_lse: torch.Tensor,
                         dq: Optional[torch.Tensor],
                         dk: Optional[torch.Tensor],
                         dv: Optional[torch.Tensor],
                         dropout_p: float,
                         softmax_scale: float,
                         causal: bool,
                         window_size_left: int,
                         window_size_right: int,
                         softcap: float,
                         alibi_slopes: Optional[torch.Tensor],
                         deterministic: bool,
                         rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    dq, dk, dv, softmax_d = flash_attn.bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, dropout_p,
                                           softmax_scale, causal, window_size_left, window_size_right, softcap,
                                           deterministic, None, rng_state)
    return softmax_d


@torch.library.register_fake(add_op_namespace_prefix("_flash_attn_backward"))
def _flash_attn_backward_fake(dout,
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
    batch_size, seqlen_q, num_heads, _ = q.shape
    return torch.empty((batch_size, num_heads, round_multiple(seqlen_q, 128)), device=q.device, dtype=torch.float32)


@torch.library.custom_op(add_op_namespace_prefix("_flash_attn_varlen_backward"),
                         mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_varlen_backward(dout: torch.Tensor,
                                q: torch.Tensor,
                                k: torch.Tensor,
                                v: torch.Tensor,
                                out: torch.Tensor,
                                softmax_lse: torch.Tensor,
                                dq: Optional[torch.Tensor],
                                dk: Optional[torch.Tensor],
                                dv: Optional[torch.Tensor],
                                cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor,
                                max_seqlen_q: int,
                                max_seqlen_k: int,
                                dropout_p: float,
                                softmax_scale: float,
                                causal: bool,
                                window_size_left: int,
                                window_size_right: int,
                                softcap: float,
                                alibi_slopes: Optional[torch.Tensor],
                                deterministic: bool,
                                rng_state: Optional[torch.Tensor] = None,
                                zero_tensors: bool = False) -> torch.Tensor:
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    dq, dk, dv, softmax_d = flash_attn.varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                                  cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p,
                                                  softmax_scale, zero_tensors, causal, window_size_left,
                                                  window_size_right, softcap, deterministic, None, rng_state)
    return softmax_d


@torch.library.register_fake(add_op_namespace_prefix("_flash_attn_varlen_backward"))
def _flash_attn_varlen_backward_fake(dout,
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
    batch_size = cu_seqlens_q.numel() - 1
    total_q, num_heads, _ = q.shape
    return torch.empty((num_heads, total_q + 128 * batch_size), device=q.device, dtype=torch.float32)


def _pad(tensors, head_size_og):
    if head_size_og % 8 == 0:
        return tensors
    return [torch.nn.functional.pad(x, [0, 8 - head_size_og % 8]) for x in tensors]


class FlashAttnFunc(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        is_grad = is_grad_enabled and any(x.requires_grad for x in [q, k, v])
        if softmax_scale is None:
            softmax_scale = q.shape[-1]**(-0.5)
        head_size_og = q.size(3)
        q, k, v = _pad((q, k, v), head_size_og)
        out_padded, softmax_lse, S_dmask, rng_state = _flash_attn_forward(q,
                                                                          k,
                                                                          v,
                                                                          dropout_p,
                                                                          softmax_scale,
                                                                          causal=causal,
                                                                          window_size_left=window_size[0],
                                                                          window_size_right=window_size[1],
                                                                          softcap=softcap,
                                                                          alibi_slopes=alibi_slopes,
                                                                          return_softmax=return_softmax
                                                                          and dropout_p > 0)
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
            ctx.dropout_p, ctx.softmax_scale, ctx.causal = dropout_p, softmax_scale, causal
            ctx.window_size, ctx.softcap, ctx.alibi_slopes, ctx.deterministic = (window_size, softcap, alibi_slopes,
                                                                                 deterministic)
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (dout_padded, ) = _pad((dout, ), dout.size(3))
        _flash_attn_backward(dout_padded,
                             q,
                             k,
                             v,
                             out,
                             softmax_lse,
                             dq,
                             dk,
                             dv,
                             ctx.dropout_p,
                             ctx.softmax_scale,
                             ctx.causal,
                             ctx.window_size[0],
                             ctx.window_size[1],
                             ctx.softcap,
                             ctx.alibi_slopes,
                             ctx.deterministic,
                             rng_state=rng_state)
        return dq[..., :dout.shape[-1]], dk[..., :dout.shape[-1]], dv[..., :dout.shape[-1]], *(None, ) * 9


class FlashAttnVarlenFunc(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table, is_grad_enabled):
        is_grad = is_grad_enabled and any(x.requires_grad for x in [q, k, v])
        if softmax_scale is None:
            softmax_scale = q.shape[-1]**(-0.5)
        head_size_og = q.size(2)
        q, k, v = _pad((q, k, v), head_size_og)
        out_padded, softmax_lse, S_dmask, rng_state = _flash_attn_varlen_forward(q,
                                                                                 k,
                                                                                 v,
                                                                                 cu_seqlens_q,
                                                                                 cu_seqlens_k,
                                                                                 max_seqlen_q,
                                                                                 max_seqlen_k,
                                                                                 dropout_p,
                                                                                 softmax_scale,
                                                                                 causal=causal,
                                                                                 window_size_left=window_size[0],
                                                                                 window_size_right=window_size[1],
                                                                                 softcap=softcap,
                                                                                 alibi_slopes=alibi_slopes,
                                                                                 return_softmax=return_softmax
                                                                                 and dropout_p > 0,
                                                                                 block_table=block_table)
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state)
            ctx.dropout_p, ctx.max_seqlen_q, ctx.max_seqlen_k = dropout_p, max_seqlen_q, max_seqlen_k
            ctx.softmax_scale, ctx.causal, ctx.window_size = softmax_scale, causal, window_size
            ctx.softcap, ctx.alibi_slopes, ctx.deterministic = softcap, alibi_slopes, deterministic
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (dout_padded, ) = _pad((dout, ), dout.size(2))
        _flash_attn_varlen_backward(dout_padded,
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
                                    ctx.max_seqlen_q,
                                    ctx.max_seqlen_k,
                                    ctx.dropout_p,
                                    ctx.softmax_scale,
                                    ctx.causal,
                                    ctx.window_size[0],
                                    ctx.window_size[1],
                                    ctx.softcap,
                                    ctx.alibi_slopes,
                                    ctx.deterministic,
                                    rng_state=rng_state)
        return dq[..., :dout.shape[-1]], dk[..., :dout.shape[-1]], dv[..., :dout.shape[-1]], *(None, ) * 14


def flash_attn_func(q,
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
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs, torch.is_grad_enabled())


def flash_attn_varlen_func(q,
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
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                     return_attn_probs, block_table, torch.is_grad_enabled())
