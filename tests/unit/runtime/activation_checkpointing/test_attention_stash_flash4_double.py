# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The CPU test double of flash-attn 4's Python interface (attention_stash_flash4), checked on its own.

Its hand-written backward against autograd (gradcheck in float64); its values against a plain float64 softmax attention
written here; the facts of the real interface a caller depends on, release by release (the log-sum-exp only where
needed, softcap=None failing in the backward, the sinks' gradient from 4.0.0b26, how many values _flash_attn_fwd
returns, what it refuses); its parameters pinned to lists read from the real interface.py of each record (and, where the
wheels' files are on this machine, to those files themselves); use_flash_attn_4's install and undo; and a tiny Hugging
Face model training through it on plain, padded and packed batches, as with sdpa.
"""

import ast
import importlib.metadata
import inspect
import math
import os
import pathlib
import sys
import types

import pytest
import torch

from attention_stash_flash4 import FLASH4_RELEASES, RECORD_OF, interface_module, use_flash_attn_4
from attention_stash_helpers import NUM_LAYERS, checkpointed, llama_model

import attention_stash_flash4

B40 = "4.0.0b40"
# The unpacked wheels' flash_attn/cute/interface.py, at <folder>/b<beta>/flash_attn/cute/interface.py: on the machine
# this double was written on, not in CI, where the test reading them skips.
# A folder of flash-attn-4's unpacked wheels, <beta>/flash_attn/cute/interface.py (pip download flash-attn-4==4.0.0bN).
WHEELS = os.environ.get("ATTENTION_STASH_FLASH4_WHEELS")

# ---------------------------------------------------------------------------------------------------------------------
# The real parameters (name=default, "*" before keyword-only ones) of each record's four functions, read from each
# release's flash_attn/cute/interface.py.
# ---------------------------------------------------------------------------------------------------------------------

FWD_B19 = ("q k v qv=None cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None max_seqlen_q=None "
           "max_seqlen_k=None min_seqlen_k=None page_table=None softmax_scale=None causal=False softcap=None "
           "window_size_left=None window_size_right=None learnable_sink=None tile_mn=None mma_pv_is_rs=None "
           "intra_wg_overlap=None num_threads=384 num_splits=1 pack_gqa=None _arch=None score_mod=None mask_mod=None "
           "block_sparse_tensors=None return_lse=False out=None lse=None aux_tensors=None aux_scalars=None "
           "q_descale=None k_descale=None v_descale=None gather_kv_indices=None")
FWD_B25 = ("q k v qv=None cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None max_seqlen_q=None "
           "max_seqlen_k=None min_seqlen_k=None page_table=None softmax_scale=None causal=False softcap=None "
           "window_size_left=None window_size_right=None learnable_sink=None tile_mn=None mma_pv_is_rs=None "
           "intra_wg_overlap=None num_threads=384 num_splits=1 pack_gqa=None _arch=None score_mod=None mask_mod=None "
           "block_sparse_tensors=None return_lse=False out=None lse=None aux_tensors=None aux_scalars=None "
           "q_descale=None k_descale=None v_descale=None gather_kv_indices=None scheduler_metadata=None "
           "seqlen_k_per_split=None disable_scheduler_metadata=False")
FWD_B32 = ("q k v qv=None cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None max_seqlen_q=None "
           "max_seqlen_k=None min_seqlen_k=None page_table=None softmax_scale=None causal=False softcap=None "
           "window_size_left=None window_size_right=None learnable_sink=None tile_mn=None mma_pv_is_rs=None "
           "intra_wg_overlap=None num_threads=384 num_splits=1 pack_gqa=None _arch=None score_mod=None mask_mod=None "
           "block_sparse_tensors=None return_lse=False out=None lse=None aux_tensors=None aux_scalars=None "
           "q_descale=None k_descale=None v_descale=None gather_kv_indices=None scheduler_metadata=None "
           "seqlen_k_per_split=None disable_scheduler_metadata=False gather_bwd_recompute_p=False")
FWD_B39 = (
    "q k v qv=None cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None max_seqlen_q=None "
    "max_seqlen_k=None min_seqlen_k=None page_table=None softmax_scale=None causal=False softcap=None "
    "window_size_left=None window_size_right=None learnable_sink=None tile_mn=None mma_pv_is_rs=None "
    "intra_wg_overlap=None num_splits=1 pack_gqa=None _arch=None score_mod=None mask_mod=None "
    "block_sparse_tensors=None return_lse=False out=None lse=None aux_tensors=None aux_scalars=None scales=None "
    "gather_kv_indices=None scheduler_metadata=None seqlen_k_per_split=None disable_scheduler_metadata=False "
    "gather_bwd_recompute_p=False * config=None")
BWD_B19 = (
    "q k v out dout lse softmax_scale=None causal=False softcap=0.0 window_size_left=None window_size_right=None "
    "m_block_size=64 n_block_size=128 num_threads=256 pack_gqa=False num_stages_Q=2 num_stages_dO=2 "
    "SdP_swapAB=False dKV_swapAB=False dQ_swapAB=False AtomLayoutMSdP=2 AtomLayoutNdKV=2 AtomLayoutMdQ=2 "
    "V_in_regs=False cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None max_seqlen_q=None "
    "max_seqlen_k=None deterministic=False dq=None dk=None dv=None score_mod=None score_mod_bwd=None "
    "mask_mod=None aux_tensors=None aux_scalars=None block_sparse_tensors=None dlse=None")
BWD_B26 = BWD_B19 + " learnable_sink=None"
BWD_B39 = BWD_B19 + " learnable_sink=None * config=None"
FUNC_B19 = ("q k v qv=None gather_kv_indices=None softmax_scale=None causal=False window_size=(None,None) "
            "learnable_sink=None softcap=0.0 num_splits=1 pack_gqa=None deterministic=False score_mod=None "
            "score_mod_bwd=None mask_mod=None aux_tensors=None aux_scalars=None block_sparse_tensors=None "
            "block_sparse_tensors_bwd=None return_lse=False")
FUNC_B32 = FUNC_B19 + " gather_bwd_recompute_p=False gather_bwd_token_chunk=None"
FUNC_B39 = FUNC_B32 + " config=None scales=None"
VARLEN_B19 = ("q k v qv=None cu_seqlens_q=None cu_seqlens_k=None max_seqlen_q=None max_seqlen_k=None "
              "min_seqlen_k=None seqused_q=None seqused_k=None gather_kv_indices=None page_table=None "
              "softmax_scale=None causal=False window_size=(None,None) learnable_sink=None softcap=0.0 num_splits=1 "
              "pack_gqa=None deterministic=False score_mod=None score_mod_bwd=None mask_mod=None "
              "block_sparse_tensors=None aux_tensors=None aux_scalars=None return_lse=False")
VARLEN_B25 = VARLEN_B19 + " scheduler_metadata=None seqlen_k_per_split=None disable_scheduler_metadata=False"
VARLEN_B32 = VARLEN_B25 + " gather_bwd_recompute_p=False gather_bwd_token_chunk=None"
VARLEN_B39 = VARLEN_B32 + " config=None scales=None"
# FlashAttnVarlenFunc.forward's parameters after ctx, at 4.0.0b40: seqused_q and seqused_k after the cumulative lengths.
VARLEN_FUNCTION_B40 = (
    "q k v qv cu_seqlens_q cu_seqlens_k seqused_q seqused_k max_seqlen_q max_seqlen_k min_seqlen_k "
    "gather_kv_indices page_table softmax_scale causal window_size learnable_sink softcap num_splits "
    "pack_gqa deterministic score_mod score_mod_bwd mask_mod block_sparse_tensors aux_tensors "
    "aux_scalars return_lse scheduler_metadata seqlen_k_per_split disable_scheduler_metadata "
    "gather_bwd_recompute_p gather_bwd_token_chunk config scales")
# Per representative release: (_flash_attn_fwd, _flash_attn_bwd, flash_attn_func, flash_attn_varlen_func).
REAL_PARAMETERS = {
    "4.0.0b19": (FWD_B19, BWD_B19, FUNC_B19, VARLEN_B19),
    "4.0.0b25": (FWD_B25, BWD_B19, FUNC_B19, VARLEN_B25),
    "4.0.0b26": (FWD_B25, BWD_B26, FUNC_B19, VARLEN_B25),
    "4.0.0b32": (FWD_B32, BWD_B26, FUNC_B32, VARLEN_B32),
    "4.0.0b33": (FWD_B32, BWD_B26, FUNC_B32, VARLEN_B32),
    "4.0.0b40": (FWD_B39, BWD_B39, FUNC_B39, VARLEN_B39),
}
KERNEL_FUNCTIONS = ("_flash_attn_fwd", "_flash_attn_bwd", "flash_attn_func", "flash_attn_varlen_func")
# Per representative release: how many values _flash_attn_fwd returns, whether the backward takes the sinks.
FORWARD_ARITY = {"4.0.0b19": 4, "4.0.0b25": 4, "4.0.0b26": 4, "4.0.0b32": 4, "4.0.0b33": 5, "4.0.0b40": 5}
SINK_GRADIENT = {"4.0.0b19": False, "4.0.0b25": False, "4.0.0b26": True, "4.0.0b32": True, "4.0.0b33": True, B40: True}
# The docstring's line ranges of 4.0.0b40's interface.py.
MIRRORED_LINES = ("FlashAttnFunc (lines 3445-3585)", "FlashAttnVarlenFunc (lines 3588-3780)",
                  "flash_attn_func (lines 3820-3902)", "flash_attn_varlen_func (lines 3905-4067)",
                  "``_flash_attn_fwd`` (from line 594)", "``_flash_attn_bwd`` (from line 2069)",
                  "``_resolve_causal_local_window`` (lines 279-300)")


def listed(parameters):
    """(name, kind, default) of each entry of a name=default list."""
    entries, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for entry in parameters.split():
        if entry == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        name, _, default = entry.partition("=")
        entries.append((name, kind, ast.literal_eval(default) if default else inspect.Parameter.empty))
    return entries


def signature_of(function):
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


# ---------------------------------------------------------------------------------------------------------------------
# A plain softmax attention in float64, for the values and gradients.
# ---------------------------------------------------------------------------------------------------------------------


def reference(q, k, v, causal=False, left=None, right=None, softcap=0.0, sink=None, cu_q=None, cu_k=None):
    """out and lse of softmax attention, one query row at a time: row i of a sequence of n_q queries over n_k keys
    sees key j where j <= i + n_k - n_q (causal), and j within [diagonal - left, diagonal + right] of that diagonal
    (None: unbounded); its logits are q_i.k_j / sqrt(dim), softcapped, and its head's sink, which has no value. A row
    that sees nothing gets output 0 and a log-sum-exp of -inf, or of its sink."""
    if cu_q is None:
        sequences = [(q[b], k[b], v[b]) for b in range(q.shape[0])]
    else:
        sequences = [(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]])
                     for i in range(len(cu_q) - 1)]
    heads, groups = q.shape[-2], q.shape[-2] // k.shape[-2]
    outs, lses = [], []
    for sq, sk, sv in sequences:
        n_q, n_k = sq.shape[0], sk.shape[0]
        rows_out, rows_lse = [], []
        for i in range(n_q):
            diagonal = i + n_k - n_q
            first = 0 if left is None else diagonal - left
            last = diagonal if causal else n_k - 1 if right is None else diagonal + right
            keys = [j for j in range(n_k) if first <= j <= last]
            head_out, head_lse = [], []
            for h in range(heads):
                logits = [(sq[i, h] * sk[j, h // groups]).sum() / math.sqrt(q.shape[-1]) for j in keys]
                if softcap:
                    logits = [softcap * torch.tanh(logit / softcap) for logit in logits]
                if sink is not None:
                    logits.append(sink[h])
                if not logits:
                    head_out.append(torch.zeros_like(sv[0, 0]))
                    head_lse.append(torch.tensor(-math.inf, dtype=q.dtype))
                    continue
                weights = torch.softmax(torch.stack(logits), dim=0)
                head_out.append(
                    sum((weights[n] * sv[j, h // groups] for n, j in enumerate(keys)), torch.zeros_like(sv[0, 0])))
                head_lse.append(torch.logsumexp(torch.stack(logits), dim=0))
            rows_out.append(torch.stack(head_out))
            rows_lse.append(torch.stack(head_lse))
        outs.append(torch.stack(rows_out))
        lses.append(torch.stack(rows_lse).T)
    if cu_q is None:
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses, dim=1)


def inputs(batch=2, seqlen_q=4, seqlen_k=4, heads=4, kv_heads=2, dim=8, sink=False, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, heads, dim), (batch, seqlen_k, kv_heads, dim), (batch, seqlen_k, kv_heads, dim)]
    if batch is None:
        shapes = [shape[1:] for shape in shapes]
    tensors = [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]
    if sink:
        tensors.append(torch.randn(heads, generator=generator, dtype=dtype))
    return [tensor.requires_grad_() for tensor in tensors]


def cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# Each case: the shapes (inputs()), flash_attn_func's or flash_attn_varlen_func's arguments, and the same attention
# for reference(). Varlen: two sequences of 3 and 5 queries over 5 and 6 keys (cu_q/cu_k).
CASES = {
    "causal": (dict(seqlen_q=4, seqlen_k=6), dict(causal=True), dict(causal=True)),
    "more_queries": (dict(seqlen_q=6, seqlen_k=4), dict(causal=True), dict(causal=True)),
    "more_queries_sinks": (dict(seqlen_q=6, seqlen_k=4, sink=True), dict(causal=True), dict(causal=True)),
    "window": (dict(seqlen_q=6, seqlen_k=6), dict(window_size=(2, 1)), dict(left=2, right=1)),
    "causal_window": (dict(seqlen_q=6, seqlen_k=6), dict(causal=True, window_size=(2, 2)), dict(left=2, right=0)),
    "softcap": (dict(), dict(causal=True, softcap=1.5), dict(causal=True, softcap=1.5)),
    "mha": (dict(kv_heads=4), dict(), dict()),
    "sinks": (dict(sink=True), dict(causal=True), dict(causal=True)),
    "varlen": (dict(batch=None, seqlen_q=8, seqlen_k=11, sink=True), dict(causal=True), dict(causal=True)),
}
CU_Q, CU_K = cu(3, 5), cu(5, 6)


def run(module, case, tensors, **extra):
    """The double's (out, lse) with return_lse for a case of CASES."""
    _, arguments, _ = CASES[case]
    q, k, v, *sink = tensors
    arguments = dict(arguments, learnable_sink=sink[0] if sink else None, return_lse=True, **extra)
    if case == "varlen":
        return module.flash_attn_varlen_func(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, **arguments)
    return module.flash_attn_func(q, k, v, **arguments)


def loss_of(out, lse):
    """A loss of both outputs, weighted so that every element counts differently; rows with no key left out of lse."""
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    lse_weights = torch.linspace(0.5, -0.5, lse.numel(), dtype=lse.dtype).reshape(lse.shape)
    return (out * weights).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * lse_weights).sum()


# ---------------------------------------------------------------------------------------------------------------------
# The backward against autograd, the values against the reference.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["causal", "window", "softcap", "gqa", "sinks", "varlen"])
def test_the_backward_is_the_forwards_gradient(case):
    """gradcheck in float64: the hand-written backward (dq, dk, dv, dsink, through both out and lse, and with either
    missing) is the gradient of the forward, as finite differences of it give, for causal attention, a sliding window
    (non-causal, (1, 1)), a softcap, grouped key/value heads, sinks, and two sequences of different lengths."""
    module = interface_module(B40)
    shapes = dict(batch=1, seqlen_q=3, seqlen_k=4, heads=2, kv_heads=2, dim=4)
    arguments = dict(causal=True)
    if case == "window":
        arguments = dict(window_size=(1, 1))
    elif case == "softcap":
        arguments = dict(causal=True, softcap=1.5)
    elif case == "gqa":
        shapes.update(heads=4)
    elif case in ("sinks", "varlen"):
        shapes.update(sink=True)
    if case == "varlen":
        shapes.update(batch=None, seqlen_q=5, seqlen_k=7)
    tensors = inputs(**shapes)

    def attention(q, k, v, *sink):
        options = dict(arguments, learnable_sink=sink[0] if sink else None, return_lse=True)
        if case == "varlen":
            return module.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu(2, 3), cu_seqlens_k=cu(3, 4), **options)
        return module.flash_attn_func(q, k, v, **options)

    assert torch.autograd.gradcheck(attention, tensors)
    assert module.calls["varlen_bwd" if case == "varlen" else "bwd"] > 0


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_are_softmax_attentions(case):
    """In float32, the double's out and lse and the gradients of q, k, v and the sinks are those of reference() in
    float64, within 1e-5 (absolute and relative): float32 rounds each product, sum, exp and log at about 6e-8 of its
    value, and these values add at most a dozen terms of order 1, so their error stays near 1e-6; a wrong mask, scale,
    softcap, alignment or sink moves them by 1e-2 and more. Rows that see no key: output 0, lse -inf (or the sink)."""
    shapes, _, options = CASES[case]
    module = interface_module(B40)
    expected_inputs = inputs(**shapes)
    actual_inputs = [tensor.detach().float().requires_grad_() for tensor in expected_inputs]
    cu_seqlens = dict(cu_q=CU_Q.tolist(), cu_k=CU_K.tolist()) if case == "varlen" else {}
    sink = expected_inputs[3] if shapes.get("sink") else None
    expected = reference(*expected_inputs[:3], sink=sink, **options, **cu_seqlens)
    loss_of(*expected).backward()
    actual = run(module, case, actual_inputs)
    loss_of(*actual).backward()
    for ours, theirs in zip(actual, expected):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(actual_inputs, expected_inputs):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-5, atol=1e-5)
    if case.startswith("more_queries"):
        out, lse = actual
        assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
        empty = lse[:, :, :2]
        expected_lse = torch.full_like(empty, -math.inf) if sink is None else sink.detach().float()[None, :, None]
        assert torch.equal(empty, expected_lse.expand_as(empty))


def test_runs_are_bitwise_equal_and_splits_change_nothing():
    """Two runs on the same inputs give the same outputs and gradients bitwise, whatever num_splits, pack_gqa and
    deterministic say; a softmax_scale of 1/sqrt(dim) is the default; windows of (-1, -1) and (None, None) are none."""
    module = interface_module(B40)

    def step(**extra):
        tensors = inputs(sink=True, dtype=torch.float32)
        outputs = run(module, "sinks", tensors, **extra)
        loss_of(*outputs).backward()
        return [*(output.detach() for output in outputs), *(tensor.grad for tensor in tensors)]

    first = step()
    for extra in ({}, dict(num_splits=3, pack_gqa=True, deterministic=True), dict(softmax_scale=1.0 / math.sqrt(8)),
                  dict(window_size=(-1, -1)), dict(window_size=(None, None))):
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(step(**extra), first)), extra


def test_the_log_sum_exp_is_only_where_needed():
    """_flash_attn_fwd allocates the log-sum-exp where an input requires grad or return_lse is set, else gives None:
    flash_attn_func under no_grad returns (out, None), with return_lse (out, lse), as with grad."""
    module = interface_module(B40)
    q, k, v = (tensor.detach() for tensor in inputs(dtype=torch.float32))
    with torch.no_grad():
        out, lse = module.flash_attn_func(q, k, v, causal=True)
        assert out.shape == q.shape and lse is None
        _, lse = module.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert lse.shape == (2, 4, 4) and lse.dtype == torch.float32
        assert module._flash_attn_fwd(q, k, v, causal=True)[1] is None
    assert module.flash_attn_func(q, k, v.requires_grad_(), causal=True)[1].shape == (2, 4, 4)


@pytest.mark.parametrize("release", FLASH4_RELEASES)
def test_only_sinks_requiring_grad_ask_for_the_log_sum_exp_from_b26(release):
    """Up to 4.0.0b25 the forward's log-sum-exp follows q, k, v and qv alone; from 4.0.0b26 the sinks too."""
    module = interface_module(release)
    q, k, v, sink = (tensor.detach() for tensor in inputs(sink=True, dtype=torch.float32))
    lse = module._flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink.requires_grad_())[1]
    assert (lse is not None) == SINK_GRADIENT[release]


@pytest.mark.parametrize("release", FLASH4_RELEASES)
def test_each_release_returns_as_the_real_one(release):
    """_flash_attn_fwd returns 4 values up to 4.0.0b32, 5 from b33 (b19: 2 for empty inputs, which its FlashAttnFunc
    cannot unpack); _flash_attn_bwd returns dsink after dq, dk and dv from b26, where it takes the sinks, and
    FlashAttnFunc gives the sinks a gradient from then on (none before); each returns one gradient per input from b26
    (b19 and b25: 30 Nones after dq, dk and dv, 31 for varlen)."""
    module = interface_module(release)
    q, k, v, sink = inputs(sink=True, dtype=torch.float32)
    results = module._flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink)
    assert len(results) == FORWARD_ARITY[release] and results[2:] == (None, ) * (len(results) - 2)
    out, lse = results[:2]
    backward = dict(learnable_sink=sink) if SINK_GRADIENT[release] else {}
    grads = module._flash_attn_bwd(q, k, v, out, torch.ones_like(out), lse, causal=True, **backward)
    assert len(grads) == (4 if SINK_GRADIENT[release] else 3)
    assert [grad.shape for grad in grads[:3]] == [q.shape, k.shape, v.shape]
    assert ("learnable_sink" in inspect.signature(module._flash_attn_bwd).parameters) == SINK_GRADIENT[release]
    out, _ = module.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    out.sum().backward()
    assert (sink.grad is not None) == SINK_GRADIENT[release] and q.grad is not None
    empty = module._flash_attn_fwd(q[:, :0].detach(), k.detach(), v.detach(), return_lse=True)
    assert len(empty) == (2 if release == "4.0.0b19" else FORWARD_ARITY[release])
    if release == "4.0.0b19":
        with pytest.raises(ValueError, match="not enough values to unpack"):
            module.flash_attn_func(q[:, :0].detach(), k.detach(), v.detach())
    functions = dict(zip((module.FlashAttnFunc, module.FlashAttnVarlenFunc), REAL_PARAMETERS[release][2:]))
    for function, parameters in functions.items():
        assert len(inspect.signature(function.forward).parameters) == len(parameters.split()) + 1
    # FlashAttnFunc.backward as autograd calls it, on what its forward saved.
    saved = [q, k, v, None, out.detach(), lse.detach(), None, None, *(None, ) * (FORWARD_ARITY[release] - 4), None]
    unset = ("softmax_scale", "score_mod", "score_mod_bwd", "mask_mod", "aux_scalars", "block_sparse_tensors_bwd")
    ctx = types.SimpleNamespace(**dict.fromkeys(unset), causal=True, window_size=(None, None), softcap=0.0)
    ctx.return_lse, ctx.deterministic = False, False
    ctx.saved_tensors = (*saved, *((sink, ) if SINK_GRADIENT[release] else ()))
    returned = module.FlashAttnFunc.backward(ctx, torch.ones_like(out), None)
    assert len(returned) == (len(REAL_PARAMETERS[release][2].split()) if SINK_GRADIENT[release] else 33)
    given = [index for index, grad in enumerate(returned) if grad is not None]
    assert given == ([0, 1, 2, 8] if SINK_GRADIENT[release] else [0, 1, 2])


@pytest.mark.parametrize("release", FLASH4_RELEASES)
def test_a_softcap_of_none_fails_in_the_backward(release):
    """The forward takes softcap=None as none (as 0.0); the backward takes any softcap but 0.0 as one, and fails on
    None, loudly: through flash_attn_func, whose backward passes the forward's softcap on, and called directly."""
    module = interface_module(release)
    q, k, v = inputs(dtype=torch.float32)
    out, lse = module.flash_attn_func(q, k, v, causal=True, softcap=None)
    assert torch.equal(out, module.flash_attn_func(q, k, v, causal=True, softcap=0.0)[0])
    with pytest.raises(TypeError, match="softcap=None"):
        out.sum().backward()
    with pytest.raises(TypeError, match="softcap=None"):
        module._flash_attn_bwd(q, k, v, out, torch.ones_like(out), lse, causal=True, softcap=None)


@pytest.mark.parametrize("release", FLASH4_RELEASES)
def test_what_the_double_does_not_compute_is_refused(release):
    """Arguments the double does not compute raise NotImplementedError where given, in each release that has them."""
    module = interface_module(release)
    q, k, v = (tensor.detach() for tensor in inputs(dtype=torch.float32))
    one = torch.ones(1)
    refused = dict(qv=q,
                   score_mod=abs,
                   mask_mod=abs,
                   aux_tensors=[one],
                   aux_scalars=(1, ),
                   block_sparse_tensors=one,
                   gather_kv_indices=one,
                   config=object(),
                   scales=attention_stash_flash4.TensorwiseScales())
    parameters = inspect.signature(module.flash_attn_func).parameters
    for name, value in refused.items():
        if name in parameters:
            with pytest.raises(NotImplementedError, match=name):
                module.flash_attn_func(q, k, v, **{name: value})
    fwd = inspect.signature(module._flash_attn_fwd).parameters
    for name in ("page_table", "q_descale", "seqused_k", "scales", "config"):
        if name in fwd:
            with pytest.raises(NotImplementedError, match=name):
                module._flash_attn_fwd(q, k, v, **{name: one})
    with pytest.raises(NotImplementedError, match="score_mod_bwd"):
        module._flash_attn_bwd(q, k, v, q, q, torch.zeros(2, 4, 4), score_mod_bwd=abs)
    with pytest.raises(NotImplementedError, match="together"):
        module.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu(4))
    if release >= "4.0.0b32":
        with pytest.raises(ValueError, match="gather_kv_indices"):
            module.flash_attn_func(q, k, v, gather_bwd_recompute_p=True)


def test_sinks_are_checked_as_the_real_interface_checks_them():
    """learnable_sink: one per query head, float16, bfloat16 or float32 (float64 with float64 inputs, in the double)."""
    module = interface_module(B40)
    q, k, v = (tensor.detach() for tensor in inputs(dtype=torch.float32))
    for sink in (torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.float64), torch.zeros(2)):
        with pytest.raises(AssertionError):
            module.flash_attn_func(q, k, v, learnable_sink=sink)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        module.flash_attn_func(q, k, v, learnable_sink=torch.zeros(4, dtype=dtype))
    module.flash_attn_func(*(tensor.double() for tensor in (q, k, v)), learnable_sink=torch.zeros(4).double())


@pytest.mark.parametrize("release", ["4.0.0b26", B40])
def test_rows_that_see_no_key_give_their_sink_all_the_mass(release):
    """Without keys, the output is 0 and the log-sum-exp -inf, or the sink from 4.0.0b31; either way the backward
    counts each such row's sink with probability 1 (flash_bwd_postprocess.py dsink_row_term takes an lse of -inf so):
    dsink is the sum of dlse over those rows, as the real backward's empty-input path returns it."""
    module = interface_module(release)
    q, k, v, sink = (tensor.detach() for tensor in inputs(sink=True, dtype=torch.float32))
    out, lse = module._flash_attn_fwd(q, k[:, :0], v[:, :0], learnable_sink=sink, return_lse=True)[:2]
    empty_lse = sink[None, :, None] if release >= "4.0.0b31" else torch.tensor(-math.inf)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, empty_lse.expand_as(lse))
    dlse = torch.linspace(-1.0, 2.0, lse.numel()).reshape(lse.shape)
    for keys, values, stats in ((k[:, :0], v[:, :0], lse), (k, v, torch.full_like(lse, -math.inf))):
        grads = module._flash_attn_bwd(q,
                                       keys,
                                       values,
                                       out,
                                       torch.ones_like(out),
                                       stats,
                                       dlse=dlse,
                                       learnable_sink=sink)
        torch.testing.assert_close(grads[3], dlse.sum((0, 2)))


def test_the_gradient_of_lse_counts_only_with_return_lse():
    """FlashAttnFunc drops the log-sum-exp's gradient unless return_lse is set, and takes a missing output gradient
    as zeros (its grads are not materialized): a loss of lse alone reaches the inputs only with return_lse."""
    module = interface_module(B40)
    for return_lse in (False, True):
        q, k, v = inputs(dtype=torch.float32)
        out, lse = module.flash_attn_func(q, k, v, causal=True, return_lse=return_lse)
        (out.sum() + lse.sum()).backward()
        grads = [tensor.grad for tensor in (q, k, v)]
        q, k, v = inputs(dtype=torch.float32)
        out, _ = module.flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(grads, (q.grad, k.grad, v.grad))) != return_lse
    expected = inputs()
    q, k, v = (tensor.detach().float().requires_grad_() for tensor in expected)
    module.flash_attn_func(q, k, v, causal=True, return_lse=True)[1].sum().backward()
    reference(*expected, causal=True)[1].sum().backward()
    torch.testing.assert_close(q.grad.double(), expected[0].grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(v.grad, torch.zeros_like(v))


def test_meta_tensors_run_through():
    """On the meta device (no CUDA check, plain torch ops): the outputs' and gradients' shapes and dtypes."""
    module = interface_module(B40)
    q = torch.empty(2, 8, 4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 8, 2, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    sink = torch.empty(4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out, lse = module.flash_attn_func(q, k, k, causal=True, learnable_sink=sink)
    assert (out.device.type, out.shape, out.dtype, lse.shape, lse.dtype) == ("meta", q.shape, q.dtype, (2, 4, 8),
                                                                             torch.float32)
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, sink.grad.shape) == (q.shape, k.shape, sink.shape)
    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32, device="meta")
    out, lse = module.flash_attn_varlen_func(q[0], k[0], k[0], cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)
    assert (out.shape, lse.shape) == ((8, 4, 16), (4, 8))


WINDOWS = [(False, None, None), (True, None, None), (False, -1, -1), (True, -1, -1), (False, -1, 0), (False, 3, -5),
           (True, 4, 4), (False, 2, 1), (False, None, 0)]
# _resolve_causal_local_window's results for WINDOWS: up to 4.0.0b29 (causal set first, then windows whose sides sum
# below zero dropped), and from b30 (windows with both sides negative dropped first).
RESOLVED = {
    "4.0.0b29": [(False, False, None, None), (True, False, None, None), (False, False, None, None),
                 (True, False, None, None), (False, False, None, None), (False, False, None, None),
                 (False, True, 4, 0), (False, True, 2, 1), (True, False, None, None)],
    "4.0.0b30": [(False, False, None, None), (True, False, None, None), (False, False, None, None),
                 (True, False, None, None), (False, True, -1, 0), (False, True, 3, -5), (False, True, 4, 0),
                 (False, True, 2, 1), (True, False, None, None)],
}


@pytest.mark.parametrize("release", ["4.0.0b19", "4.0.0b29", "4.0.0b30", B40])
def test_windows_resolve_as_the_release_resolves_them(release):
    """_resolve_causal_local_window as the release has it; a mask_mod turns causal and local off."""
    module = interface_module(release)
    expected = RESOLVED["4.0.0b29" if release < "4.0.0b30" else "4.0.0b30"]
    assert [module._resolve_causal_local_window(*window) for window in WINDOWS] == expected
    assert module._resolve_causal_local_window(True, 3, 0, mask_mod=abs) == (False, False, 3, 0)


# ---------------------------------------------------------------------------------------------------------------------
# The mirror's shape.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("release", FLASH4_RELEASES)
def test_the_parameters_are_the_real_ones(release):
    """The four functions' parameters (names, kinds, defaults) are each record's in the real interface.py, pinned
    here; the autograd functions' forwards take flash_attn_func's and (seqused moved after the cumulative lengths)
    flash_attn_varlen_func's after ctx; each function is the module's own, which a caller can find it by."""
    module = interface_module(release)
    for name, parameters in zip(KERNEL_FUNCTIONS, REAL_PARAMETERS[release]):
        function = getattr(module, name)
        assert signature_of(function) == listed(parameters), name
        assert function.__module__ == module.__name__ == "flash_attn.cute.interface"
        assert function.__globals__ is vars(module) and getattr(module, function.__name__) is function
    dense, varlen = (list(inspect.signature(function.forward).parameters)[1:]
                     for function in (module.FlashAttnFunc, module.FlashAttnVarlenFunc))
    assert dense == [name for name, _, _ in listed(REAL_PARAMETERS[release][2])]
    names = [name for name, _, _ in listed(REAL_PARAMETERS[release][3])]
    moved = [name for name in names if name not in ("seqused_q", "seqused_k")]
    assert varlen == moved[:6] + ["seqused_q", "seqused_k"] + moved[6:]
    if release == B40:
        assert varlen == VARLEN_FUNCTION_B40.split()


def test_the_releases_and_records():
    """The representative releases, in order, and the record of every release read (b37 and b38 are not published)."""
    assert FLASH4_RELEASES == ("4.0.0b19", "4.0.0b25", "4.0.0b26", "4.0.0b32", "4.0.0b33", "4.0.0b40")
    betas = {int(release.rpartition("b")[2]): RECORD_OF[release] for release in RECORD_OF}
    assert sorted(betas) == [*range(19, 37), 39, 40]
    assert [betas[beta] for beta in (19, 24, 25, 26, 31, 32, 33, 36, 39, 40)] == [
        "4.0.0b19", "4.0.0b19", "4.0.0b25", "4.0.0b26", "4.0.0b26", "4.0.0b32", "4.0.0b33", "4.0.0b33", B40, B40
    ]
    for release, record in RECORD_OF.items():
        assert [signature_of(getattr(interface_module(release), name)) for name in KERNEL_FUNCTIONS
                ] == [listed(parameters) for parameters in REAL_PARAMETERS[record]], release
    with pytest.raises(ValueError, match="4.0.0b37 was not read"):
        interface_module("4.0.0b37")


def test_the_docstring_names_what_it_mirrors():
    """attention_stash_flash4's docstring names the version mirrored and the line ranges of its interface.py."""
    text = " ".join(attention_stash_flash4.__doc__.split())
    assert "flash_attn/cute/interface.py`` of flash-attn-4 4.0.0b40" in text
    for lines in MIRRORED_LINES:
        assert lines in text, lines


REAL_FILES = sorted(pathlib.Path(WHEELS).glob("b*/flash_attn/cute/interface.py") if WHEELS else (),
                    key=lambda path: int(path.parts[-4][1:]))


@pytest.mark.skipif(not REAL_FILES,
                    reason=f"no flash-attn-4 unpacked wheels in ATTENTION_STASH_FLASH4_WHEELS={WHEELS}")
def test_the_double_is_each_real_file():
    """Where the real interface.py of each release read is here: the four functions' and the autograd forwards'
    parameters are the double's of that release; _flash_attn_fwd returns as many values, lists the same inputs whose
    requires_grad asks for the log-sum-exp, and _resolve_causal_local_window (run from the real file's text) resolves
    every window as the double's; 4.0.0b40's line ranges are the docstring's."""
    assert [path.parts[-4] for path in REAL_FILES] == [f"b{beta}" for beta in (*range(19, 37), 39, 40)]
    for path in REAL_FILES:
        release = f"4.0.0{path.parts[-4]}"
        module = interface_module(release)
        source = path.read_text()
        tree = ast.parse(source)
        nodes = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        for name in KERNEL_FUNCTIONS:
            arguments = nodes[name].args
            defaults = [None] * (len(arguments.args) - len(arguments.defaults)) + arguments.defaults
            real = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, d) for a, d in zip(arguments.args, defaults)]
            real += [(a.arg, inspect.Parameter.KEYWORD_ONLY, d)
                     for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults)]
            real = [(n, kind, inspect.Parameter.empty if d is None else ast.literal_eval(d)) for n, kind, d in real]
            assert signature_of(getattr(module, name)) == real, (release, name)
        for name in ("FlashAttnFunc", "FlashAttnVarlenFunc"):
            forward = next(node for node in nodes[name].body if getattr(node, "name", None) == "forward")
            assert list(inspect.signature(getattr(module,
                                                  name).forward).parameters) == [a.arg for a in forward.args.args
                                                                                 ], (release, name)
        forward = nodes["_flash_attn_fwd"]
        returns = [len(node.value.elts) for node in ast.walk(forward) if isinstance(node, ast.Return)]
        arity = 5 if release >= "4.0.0b33" else 4
        assert sorted(returns) == sorted([arity, 2 if release == "4.0.0b19" else arity]), release
        wanted = next(node for node in ast.walk(forward)
                      if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "requires_grad")
        watched = {
            ast.unparse(element)
            for element in next(
                node for node in ast.walk(wanted.value) if isinstance(node, (ast.List, ast.Tuple))).elts
        }
        assert watched == ({"q", "k", "v", "qv", "learnable_sink"} if release >= "4.0.0b26" else {"q", "k", "v", "qv"})
        namespace = {}
        exec(ast.get_source_segment(source, nodes["_resolve_causal_local_window"]), namespace)
        for window in WINDOWS + [(True, 0, 0), (False, 0, -1), (True, -3, 2), (False, -2, 1)]:
            assert module._resolve_causal_local_window(*window) == namespace["_resolve_causal_local_window"](
                *window), (release, window)
        if release == B40:
            for text in MIRRORED_LINES:
                name = text.split()[0].strip("`")
                first, _, last = text.rpartition(" ")[2].rstrip(")").partition("-")
                assert nodes[name].lineno == int(first) and (not last or nodes[name].end_lineno == int(last)), text


# ---------------------------------------------------------------------------------------------------------------------
# use_flash_attn_4, and a model training through it.
# ---------------------------------------------------------------------------------------------------------------------


def test_use_flash_attn_4_installs_the_double_and_undoes_it():
    """Imports of flash_attn.cute give the double, importlib.metadata the flash-attn-4 distribution at the release
    (packages_distributions mapping flash_attn to it, its RECORD the package's files), and transformers' lazy import
    of flash_attention_4 its functions; monkeypatch's undo takes all of it back."""
    import transformers.modeling_flash_attention_utils as flash_utils

    before = {name: getattr(flash_utils, name, None) for name in ("_flash_fn", "_loaded_implementation")}
    cute_before = sys.modules.get("flash_attn.cute")
    with pytest.MonkeyPatch.context() as monkeypatch:
        module = use_flash_attn_4(monkeypatch, "4.0.0b33")
        import flash_attn.cute
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        assert flash_attn.cute.interface is module and sys.modules["flash_attn.cute.interface"] is module
        assert (flash_attn_func, flash_attn_varlen_func) == (module.flash_attn_func, module.flash_attn_varlen_func)
        assert flash_attn.cute.__version__ == "0.0.0"  # its __init__ asks for a distribution named "fa4"
        assert importlib.metadata.version("flash-attn-4") == "4.0.0b33"
        assert "flash-attn-4" in importlib.metadata.packages_distributions()["flash_attn"]
        assert "flash_attn/cute/interface.py" in map(str, importlib.metadata.files("flash-attn-4"))
        (function, varlen_function, *_), _ = flash_utils.lazy_import_flash_attention("flash_attention_4")
        assert (function, varlen_function) == (module.flash_attn_func, module.flash_attn_varlen_func)
    assert sys.modules.get("flash_attn.cute") is cute_before
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("flash-attn-4")
    assert {name: getattr(flash_utils, name, None) for name in before} == before


DOCUMENTS, PADDING = (12, 20), 5


def batch(kind):
    """A plain batch, a padded one (the second row's first tokens masked out) or a packed one (one row of documents,
    positions restarting per document, no mask), as a model's inputs with labels."""
    generator = torch.Generator().manual_seed(1)
    if kind == "packed":
        ids = torch.randint(0, 128, (1, sum(DOCUMENTS)), generator=generator)
        labels = ids.clone()
        labels[0, DOCUMENTS[0]] = -100
        position_ids = torch.cat([torch.arange(length) for length in DOCUMENTS]).unsqueeze(0)
        return dict(input_ids=ids, position_ids=position_ids, labels=labels)
    ids = torch.randint(0, 128, (2, 16), generator=generator)
    if kind == "plain":
        return dict(input_ids=ids, labels=ids)
    mask = torch.ones_like(ids)
    mask[1, :PADDING] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
@pytest.mark.parametrize("release", FLASH4_RELEASES)
def test_a_model_trains_through_the_double(monkeypatch, release, kind):
    """A tiny checkpointed Llama with attn_implementation="flash_attention_4" takes a step on each kind of batch: each
    layer's attention runs the double's kernels (flash_attn_func on a plain batch, flash_attn_varlen_func on a padded
    or packed one), twice forward (checkpointing's recompute) and once backward, and the loss and gradients are
    finite and those of sdpa (float32 both, within 1e-5)."""
    module = use_flash_attn_4(monkeypatch, release)
    results = {}
    for implementation in ("sdpa", "flash_attention_4"):
        model = checkpointed(llama_model())
        model.config._attn_implementation = implementation
        loss = model(**batch(kind)).loss
        loss.backward()
        results[implementation] = loss.detach(), {name: p.grad for name, p in model.named_parameters()}
    varlen = "varlen_" if kind != "plain" else ""
    assert dict(module.calls) == {f"{varlen}fwd": 2 * NUM_LAYERS, f"{varlen}bwd": NUM_LAYERS}
    (loss, grads), (expected_loss, expected) = results["flash_attention_4"], results["sdpa"]
    assert torch.isfinite(loss) and all(torch.isfinite(grad).all() for grad in grads.values())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-5, msg=name)
