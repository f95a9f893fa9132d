# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash's flash-attn 2 kernel calls, bound against flash-attn's own autograd functions, on CPU: flash-attn's
package's and a Hub build's (test_attention_stash_flash_kernels.py binds flash-attn 3's).

The stash calls flash-attn's forward kernel op as FlashAttnFunc (FlashAttnVarlenFunc) calls it, and its recompute node
saves what that function saves and calls flash-attn's backward op as that function's backward does. Here recorders
stand in for flash-attn's kernel functions (``flash_attn_interface._wrapped_flash_attn_*`` in the package, the same
without "_wrapped" in a Hub build, custom ops there, through which flash-attn's functions call its ops), returning
sentinels of distinct values; flash-attn's function and the stash run on the same inputs, and every argument of every
kernel call (by parameter name, defaults filled in), and every saved tensor, is compared. The
arguments that share a type get distinct values (cu_seqlens_q and cu_seqlens_k, the max lengths, the two window
sizes), so that a swap of two of them fails here, as the planted swap below shows.
"""

import dataclasses
import sys

import pytest
import torch

from deepspeed.runtime.activation_checkpointing import attention_stash

from attention_stash_flash import flash_attn_or_skip, use_flash_attention_2
from attention_stash_flash3 import flash_kernels_or_skip, use_hub_kernel
from attention_stash_helpers import assert_same_calls, bare_call, bound_arguments, same_value

FLASH_ATTN = flash_attn_or_skip()
FAMILY = attention_stash._FLASH_FAMILIES[0]
FLASH_ATTN_VERSION = __import__("flash_attn").__version__
# The kernel functions flash-attn 2.8's autograd functions call, which the stash's install finds (checked below); a Hub
# build's call the same functions without the prefix "_wrapped".
NAMES = [f"_wrapped_flash_attn_{function}" for function in FAMILY.functions]
HEADS, KEY_HEADS = 4, 2
CU_SEQLENS_Q = (0, 3, 8)
CU_SEQLENS_K = (0, 4, 8)


@pytest.fixture(params=["flash_attn", "hub_kernel"])
def interface(request, monkeypatch, tmp_path_factory):
    """flash-attn 2's interface module as the install finds it: flash-attn's package's, or a Hub build's."""
    if request.param == "flash_attn":
        use_flash_attention_2(monkeypatch)
        implementation = "flash_attention_2"
    else:
        flash_kernels_or_skip()
        use_hub_kernel(monkeypatch, tmp_path_factory, "kernels-community/flash-attn2")
        implementation = "kernels-community/flash-attn2"
    return attention_stash._load_flash(attention_stash._implementation(implementation))


class Recorder:
    """Stands in for flash-attn's kernel functions in ``interface``'s module: records each call's arguments; a forward
    returns sentinels of distinct values (padded output, log-sum-exp, an empty S_dmask, rng_state), a backward fills
    dq, dk and dv."""

    def __init__(self, monkeypatch, interface):
        self.calls = []
        self.module = sys.modules[interface.function.__module__]
        for ops in (interface.ops, interface.varlen_ops):
            for name in (ops.op, ops.op.replace("forward", "backward")):
                monkeypatch.setattr(self.module, name, self._kernel(name, getattr(self.module, name)))

    def _kernel(self, name, original):

        def kernel(*args, **kwargs):
            # Each call by parameter name, as the kernel function it stands in for binds it.
            bound = bound_arguments(original, args, kwargs)
            self.calls.append((name, bound))
            query = bound["q"]
            if "forward" in name:
                varlen = "varlen" in name
                lse_shape = (HEADS, query.shape[0]) if varlen else (query.shape[0], HEADS, query.shape[1])
                return (torch.full_like(query, 7.0), torch.full(lse_shape,
                                                                11.0), query.new_empty(0), torch.tensor([13, 17]))
            for buffer, value in zip(("dq", "dk", "dv"), (19.0, 23.0, 29.0)):
                bound[buffer].fill_(value)
            return torch.empty(0)

        return kernel


def _inputs(varlen, head_dim):
    generator = torch.Generator().manual_seed(0)
    shape = (8, ) if varlen else (2, 4)

    def tensor(heads, seed):
        return torch.randn(*shape, heads, head_dim, generator=generator.manual_seed(seed), requires_grad=True)

    return tensor(HEADS, 1), tensor(KEY_HEADS, 2), tensor(KEY_HEADS, 3)


def _arguments(varlen, head_dim, deterministic=False):
    """One flash call's arguments, each of a distinct value where two share a type."""
    cu_seqlens = (torch.tensor(CU_SEQLENS_Q, dtype=torch.int32),
                  torch.tensor(CU_SEQLENS_K, dtype=torch.int32)) if varlen else (None, None)
    max_seqlens = (5, 4) if varlen else (None, None)
    return attention_stash._FlashArguments(0.0, head_dim**-0.5, True, (3, 5), 2.5, None, deterministic, *cu_seqlens,
                                           *max_seqlens)


def _theirs(recorder, varlen, query, key, value, arguments, grad):
    """flash-attn's own function, forward and backward: its kernel calls and its saved tensors."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor,
                                                  lambda tensor: tensor):
        if varlen:
            out = recorder.module.FlashAttnVarlenFunc.apply(
                query, key, value, arguments.cu_seqlens_q, arguments.cu_seqlens_k, arguments.max_seqlen_q,
                arguments.max_seqlen_k, arguments.dropout_p, arguments.softmax_scale, arguments.causal,
                arguments.window_size, arguments.softcap, arguments.alibi_slopes, arguments.deterministic, False, None,
                True)
        else:
            out = recorder.module.FlashAttnFunc.apply(query, key, value, arguments.dropout_p, arguments.softmax_scale,
                                                      arguments.causal, arguments.window_size, arguments.softcap,
                                                      arguments.alibi_slopes, arguments.deterministic, False, True)
    grads = torch.autograd.grad(out, (query, key, value), grad)
    return out, saved, grads, recorder.calls[:]


def _ours(recorder, ops, query, key, value, arguments, grad):
    """The stash's attention call in a bare checkpoint call: its first pass without grad (reentrant checkpointing's,
    which runs the kernel alone), then its recompute, whose node returns what that kept, forward and backward."""
    start = len(recorder.calls)
    call, counters = bare_call(lambda *inputs: attention_stash._state.call.attend(ops, *inputs, None, arguments),
                               "flash_attention_2")
    with torch.no_grad():
        call(query.detach(), key.detach(), value.detach())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor,
                                                  lambda tensor: tensor):
        out = call(query, key, value)
    assert counters.recomputes_served == 1
    grads = torch.autograd.grad(out, (query, key, value), grad)
    return out, saved, grads, recorder.calls[start:]


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondeterministic", "deterministic"])
@pytest.mark.parametrize("head_dim", [16, 36], ids=["head_dim_16", "head_dim_36_padded"])
@pytest.mark.parametrize("varlen", [False, True], ids=["flash_attn_func", "flash_attn_varlen_func"])
def test_kernel_calls_and_saves_follow_flash_attns_functions(monkeypatch, interface, varlen, head_dim, deterministic):
    """The stash's forward and backward kernel calls are flash-attn's, argument for argument; its node saves what
    flash-attn's function saves, in its order (under non-reentrant checkpointing they fill that function's node);
    and its output and gradients are flash-attn's. For flash-attn's package and a Hub build of it alike, with
    deterministic backwards (FLASH_ATTENTION_DETERMINISTIC=1) or not: the setting reaches the backward kernel."""
    ops = interface.varlen_ops if varlen else interface.ops
    recorder = Recorder(monkeypatch, interface)
    arguments = _arguments(varlen, head_dim, deterministic)
    query, key, value = _inputs(varlen, head_dim)
    grad = torch.randn(query.shape, generator=torch.Generator().manual_seed(4))
    their_out, their_saved, their_grads, their_calls = _theirs(recorder, varlen, query, key, value, arguments, grad)
    out, saved, grads, calls = _ours(recorder, ops, query, key, value, arguments, grad)

    assert_same_calls(calls, their_calls)
    # (query, key, value, padded output, log-sum-exp, [cu_seqlens_q, cu_seqlens_k,] rng_state)
    assert len(saved) == len(their_saved) == (8 if varlen else 6)
    assert all(same_value(mine, their) for mine, their in zip(saved, their_saved))
    assert same_value(out, their_out)
    assert all(same_value(mine, their) for mine, their in zip(grads, their_grads))
    # The padded head dimension reached the kernels, and the gradients were sliced back.
    assert their_calls[0][1]["q"].shape[-1] == head_dim + -head_dim % 8 and grads[0].shape == query.shape
    assert calls[-1][1]["deterministic"] is deterministic


def test_a_planted_swap_is_caught(monkeypatch):
    """A backward that passes the two window sizes swapped (both ints, the same for a symmetric window) fails the
    comparison, as would any two arguments of a type swapped."""
    use_flash_attention_2(monkeypatch)
    interface = attention_stash._load_flash(attention_stash._implementation("flash_attention_2"))
    recorder = Recorder(monkeypatch, interface)
    ops = interface.varlen_ops
    arguments = _arguments(True, 16)
    query, key, value = _inputs(True, 16)
    grad = torch.randn(query.shape)
    *_, their_calls = _theirs(recorder, True, query, key, value, arguments, grad)

    def swapped_backward(grad, q, k, v, mask, out, tensors, scalars, a, needs_grad):
        swapped = dataclasses.replace(a, window_size=a.window_size[::-1])
        return ops.backward(grad, q, k, v, mask, out, tensors, scalars, swapped, needs_grad)

    *_, calls = _ours(recorder, dataclasses.replace(ops, backward=swapped_backward), query, key, value, arguments,
                      grad)
    with pytest.raises(AssertionError, match="_wrapped_flash_attn_varlen_backward', 'window_size_left'"):
        assert_same_calls(calls, their_calls)


def test_the_install_finds_flash_attns_interface(monkeypatch):
    """What a flash_attention_2 install finds through Hugging Face's lazy import: flash-attn 2's functions, and the
    kernel functions their autograd functions call, which the tests above bind."""
    use_flash_attention_2(monkeypatch)
    interface = attention_stash._load_flash(attention_stash._implementation("flash_attention_2"))
    assert interface.family is FAMILY
    assert (interface.function, interface.varlen_function) == (FLASH_ATTN.flash_attn_func,
                                                               FLASH_ATTN.flash_attn_varlen_func)
    assert [interface.ops.op, interface.varlen_ops.op] == NAMES[:2]
    assert interface.description == f"flash-attn 2's interface from flash_attn {FLASH_ATTN_VERSION}"
