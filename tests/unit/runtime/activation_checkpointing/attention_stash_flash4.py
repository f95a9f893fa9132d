# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""flash-attn 4 (``flash_attn.cute``, the flash-attn-4 pre-release) on a machine without CUDA, for the attention stash
tests: a test double of its Python interface whose kernels compute on CPU.

A mirror of ``flash_attn/cute/interface.py`` of flash-attn-4 4.0.0b40, written for these tests, the parts Hugging Face
and the stash reach: FlashAttnFunc (lines 3445-3585), FlashAttnVarlenFunc (lines 3588-3780), flash_attn_func (lines
3820-3902), flash_attn_varlen_func (lines 3905-4067), ``_flash_attn_fwd`` (from line 594), ``_flash_attn_bwd`` (from
line 2069) and ``_resolve_causal_local_window`` (lines 279-300). As in the real file:

* the four functions have its parameter names, order, kinds and defaults (``config`` keyword-only in the kernel
  functions alone); FlashAttnVarlenFunc.forward takes seqused_q and seqused_k right after the cumulative lengths, where
  flash_attn_varlen_func takes them after min_seqlen_k;
* the autograd functions pass ``_flash_attn_fwd`` and ``_flash_attn_bwd`` what the real ones pass, by name, look them
  up in the module when they run, save the same tensors in the same order, return (out, lse), do not materialize
  missing gradients (a missing dout becomes zeros, dlse counts only with return_lse), and return the sinks' gradient
  where the release's backward gives it;
* ``_flash_attn_fwd`` allocates the log-sum-exp only where q, k, v, qv or the sinks require grad, or return_lse is set
  (lse is None otherwise), treats a softcap of 0.0 or None as none, and returns (out, lse, p, row_max, o_lo), p, row_max
  and o_lo None; ``_flash_attn_bwd`` treats every softcap but 0.0 as one, so None fails (a TypeError here, where the
  real one fails building its softcap score_mod from None), and returns (dq, dk, dv), and dsink after them with sinks.

interface_module(release) builds the module of any release read, 4.0.0b19 to 4.0.0b36, 4.0.0b39 and 4.0.0b40 (b37 and
b38 are not on the package index), with the signatures of its record (RECORD_OF; FLASH4_RELEASES are the records'
representatives) and what its autograd functions do differently: up to b25 the backward takes no sinks and the sinks
get no gradient; up to b25 the forward's log-sum-exp follows q, k, v and qv only; up to b32 ``_flash_attn_fwd`` returns
four values (b19's returns two for empty inputs, which its FlashAttnFunc fails to unpack). Where a release's kernel
function differs from b40's in a value, the double follows it: up to b29 ``_resolve_causal_local_window`` applies
causal before it drops windows whose sides sum below zero (b30 on drops those with both sides negative first); up to
b30 an empty input's log-sum-exp is -inf with sinks too (b31 on: the sink).

The kernels are an independent computation in plain torch ops (so meta tensors run through them too): float32 (float64
for float64 inputs, whose log-sum-exp is then float64 too), deterministic, over layouts as flash-attn 4's: q
[batch, seqlen, heads, dim] or, for varlen, [total, heads, dim]; lse [batch, heads, seqlen] or [heads, total]; keys
aligned bottom-right for causal and local masks; key/value heads serving consecutive query heads; a row that sees no
key gets output 0 and a log-sum-exp of -inf, or of its sink. Learnable sinks are flash-attn 4's (flash_attn/cute/
softmax.py apply_learnable_sink, lines 47-77, and Softmax.finalize; flash_bwd_postprocess.py dsink_row_term, lines
48-58): one logit per query head, in natural-log units and not multiplied by softmax_scale, joins every row's
normaliser and so its log-sum-exp, contributing nothing to the output; dsink[h] = -sum over rows of
exp(sink[h] - lse) * (rowsum(dout * out) - dlse), a row whose lse is -inf counting with probability 1. softmax_scale,
deterministic, num_splits, pack_gqa, the tile and scheduler settings change no value. The double accepts float32 and
float64 inputs beside float16 and bfloat16 (the real ones assert half precision; the tests' models run in float32),
and float64 sinks with float64 inputs. It refuses with NotImplementedError what it does not compute: qv (MLA),
score_mod, score_mod_bwd, mask_mod, block sparsity, aux tensors and scalars, paged KV (page_table), gather_kv_indices,
FP8 scales (q/k/v_descale, scales), an explicit config, seqused_q and seqused_k, and cu_seqlens_q without
cu_seqlens_k or the other way round.

use_flash_attn_4(monkeypatch, release) makes ``import flash_attn.cute`` give the double, importlib.metadata see the
flash-attn-4 distribution at that release, and transformers' flash_attention_4 path load it.
"""

import atexit
import collections
import importlib.machinery
import importlib.metadata
import linecache
import math
import operator
import pathlib
import shutil
import sys
import tempfile
import types
import warnings
from functools import cache
from typing import NamedTuple

import torch

from attention_stash_flash import _LAZY_FLASH_NAMES, import_flash_attn

# Every release read, by beta number, and the representative of each record: the releases whose four functions have
# the same parameters and whose _flash_attn_fwd returns as many values.
_BETAS = (*range(19, 37), 39, 40)
_REPRESENTATIVES = (19, 25, 26, 32, 33, 40)
FLASH4_RELEASES = tuple(f"4.0.0b{beta}" for beta in _REPRESENTATIVES)
RECORD_OF = {
    f"4.0.0b{beta}": f"4.0.0b{max(first for first in _REPRESENTATIVES if first <= beta) if beta < 39 else 40}"
    for beta in _BETAS
}

# The four functions' parameters at 4.0.0b19 (name=default; "*" starts the keyword-only ones), and what later records
# add or change (see _parameters).
_FORWARD = ("q k v qv=None cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None max_seqlen_q=None "
            "max_seqlen_k=None min_seqlen_k=None page_table=None softmax_scale=None causal=False softcap=None "
            "window_size_left=None window_size_right=None learnable_sink=None tile_mn=None mma_pv_is_rs=None "
            "intra_wg_overlap=None num_threads=384 num_splits=1 pack_gqa=None _arch=None score_mod=None mask_mod=None "
            "block_sparse_tensors=None return_lse=False out=None lse=None aux_tensors=None aux_scalars=None "
            "q_descale=None k_descale=None v_descale=None gather_kv_indices=None")
_BACKWARD = ("q k v out dout lse softmax_scale=None causal=False softcap=0.0 window_size_left=None "
             "window_size_right=None m_block_size=64 n_block_size=128 num_threads=256 pack_gqa=False num_stages_Q=2 "
             "num_stages_dO=2 SdP_swapAB=False dKV_swapAB=False dQ_swapAB=False AtomLayoutMSdP=2 AtomLayoutNdKV=2 "
             "AtomLayoutMdQ=2 V_in_regs=False cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None "
             "max_seqlen_q=None max_seqlen_k=None deterministic=False dq=None dk=None dv=None score_mod=None "
             "score_mod_bwd=None mask_mod=None aux_tensors=None aux_scalars=None block_sparse_tensors=None dlse=None")
_FUNC = ("q k v qv=None gather_kv_indices=None softmax_scale=None causal=False window_size=(None,None) "
         "learnable_sink=None softcap=0.0 num_splits=1 pack_gqa=None deterministic=False score_mod=None "
         "score_mod_bwd=None mask_mod=None aux_tensors=None aux_scalars=None block_sparse_tensors=None "
         "block_sparse_tensors_bwd=None return_lse=False")
_VARLEN_FUNC = ("q k v qv=None cu_seqlens_q=None cu_seqlens_k=None max_seqlen_q=None max_seqlen_k=None "
                "min_seqlen_k=None seqused_q=None seqused_k=None gather_kv_indices=None page_table=None "
                "softmax_scale=None causal=False window_size=(None,None) learnable_sink=None softcap=0.0 num_splits=1 "
                "pack_gqa=None deterministic=False score_mod=None score_mod_bwd=None mask_mod=None "
                "block_sparse_tensors=None aux_tensors=None aux_scalars=None return_lse=False")
_SCHEDULER = " scheduler_metadata=None seqlen_k_per_split=None disable_scheduler_metadata=False"
_GATHER_BWD = " gather_bwd_recompute_p=False gather_bwd_token_chunk=None"
_CONFIG_SCALES = " config=None scales=None"

# What _flash_attn_fwd and _flash_attn_bwd refuse where given (not None), beyond each release's scales or descales and
# config.
_FORWARD_REFUSED = ("qv", "seqused_q", "seqused_k", "page_table", "score_mod", "mask_mod", "block_sparse_tensors",
                    "aux_tensors", "aux_scalars", "gather_kv_indices")
_BACKWARD_REFUSED = ("seqused_q", "seqused_k", "score_mod", "score_mod_bwd", "mask_mod", "aux_tensors", "aux_scalars",
                     "block_sparse_tensors")
_HALF = (torch.float16, torch.bfloat16)
# The real forward takes fp8 too (forward only), which the double does not compute; it adds float32 and float64.
_INPUT_DTYPES = (*_HALF, torch.float32, torch.float64)
_LEARNABLE_SINK_DTYPES = (*_HALF, torch.float32)

_distribution_roots = {}  # release -> a folder holding flash-attn-4's dist-info at that release, one per process


class _Release:
    """A release of flash-attn-4 the double builds: its version, beta number, and the calls its kernels ran (by
    "fwd", "varlen_fwd", "bwd", "varlen_bwd")."""

    def __init__(self, version):
        if version not in RECORD_OF:
            raise ValueError(f"flash-attn-4 {version} was not read; the double builds {', '.join(RECORD_OF)}")
        self.version, self.beta = version, int(version.rpartition("b")[2])
        self.calls = collections.Counter()

    @property
    def forward_arity(self):
        return 5 if self.beta >= 33 else 4

    @property
    def sinks_have_gradient(self):
        return self.beta >= 26


def _parameters(beta):
    """(_flash_attn_fwd, _flash_attn_bwd, flash_attn_func, flash_attn_varlen_func, FlashAttnVarlenFunc.forward after
    ctx) parameters of beta ``beta``, each a string of name=default entries."""
    forward, backward, func, varlen = _FORWARD, _BACKWARD, _FUNC, _VARLEN_FUNC
    if beta >= 25:
        forward, varlen = forward + _SCHEDULER, varlen + _SCHEDULER
    if beta >= 26:
        backward += " learnable_sink=None"
    if beta >= 32:
        forward += " gather_bwd_recompute_p=False"
        func, varlen = func + _GATHER_BWD, varlen + _GATHER_BWD
    if beta >= 39:
        forward = forward.replace(" num_threads=384", "").replace("q_descale=None k_descale=None v_descale=None",
                                                                  "scales=None") + " * config=None"
        backward += " * config=None"
        func, varlen = func + _CONFIG_SCALES, varlen + _CONFIG_SCALES
    seqused = " seqused_q=None seqused_k=None"
    varlen_function = varlen.replace(seqused, "").replace("cu_seqlens_k=None", "cu_seqlens_k=None" + seqused)
    return forward, backward, func, varlen, varlen_function


def _names(parameters):
    return [entry.partition("=")[0] for entry in parameters.split() if entry != "*"]


# The module's code, one thin function per entry point with the release's parameters; the bodies are below.
_SOURCE = '''
def _resolve_causal_local_window(causal, window_size_left, window_size_right, mask_mod=None):
    return _resolve_window(_RELEASE, causal, window_size_left, window_size_right, mask_mod)


def _flash_attn_fwd({0}):
    return _forward_kernel(_RELEASE, locals())


def _flash_attn_bwd({1}):
    return _backward_kernel(_RELEASE, locals())


class FlashAttnFunc(torch.autograd.Function):

    @staticmethod
    def forward(ctx, {2}):
        return _function_forward(globals(), ctx, False, locals())

    @staticmethod
    def backward(ctx, dout, dlse):
        return _function_backward(globals(), ctx, False, dout, dlse)


class FlashAttnVarlenFunc(torch.autograd.Function):

    @staticmethod
    def forward(ctx, {4}):
        return _function_forward(globals(), ctx, True, locals())

    @staticmethod
    def backward(ctx, dout, dlse):
        return _function_backward(globals(), ctx, True, dout, dlse)


def flash_attn_func({2}):
    return _apply(globals(), False, locals())


def flash_attn_varlen_func({3}):
    return _apply(globals(), True, locals())
'''


def interface_module(release="4.0.0b40"):
    """A new module ``flash_attn.cute.interface`` of flash-attn-4 ``release`` (a key of RECORD_OF), not registered in
    sys.modules: its flash_attn_func, flash_attn_varlen_func, FlashAttnFunc, FlashAttnVarlenFunc, _flash_attn_fwd,
    _flash_attn_bwd and _resolve_causal_local_window are its own (defined in it, its globals theirs), with the
    release's parameters; BlockScales and TensorwiseScales from 4.0.0b39, _validate_gather_bwd_kwargs from 4.0.0b32.
    ``calls`` counts its kernels' runs by "fwd", "varlen_fwd", "bwd" and "varlen_bwd"."""
    release = _Release(release)
    doc = f"flash-attn-4 {release.version}'s flash_attn.cute.interface as attention_stash_flash4's CPU test double."
    module = types.ModuleType("flash_attn.cute.interface", doc)
    module.__package__ = "flash_attn.cute"
    module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    source = _SOURCE.format(*(", ".join(parameters.split()) for parameters in _parameters(release.beta)))
    filename = f"<flash_attn.cute.interface {release.version}, attention_stash_flash4>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
    namespace = vars(module)
    namespace.update(torch=torch,
                     calls=release.calls,
                     _RELEASE=release,
                     _resolve_window=_resolve_window,
                     _forward_kernel=_forward_kernel,
                     _backward_kernel=_backward_kernel,
                     _function_forward=_function_forward,
                     _function_backward=_function_backward,
                     _apply=_apply)
    if release.beta >= 32:
        namespace["_validate_gather_bwd_kwargs"] = _validate_gather_bwd_kwargs
    if release.beta >= 39:
        namespace.update(BlockScales=BlockScales, TensorwiseScales=TensorwiseScales)
    exec(compile(source, filename, "exec"), namespace)
    return module


def package_module(interface):
    """The package ``flash_attn.cute`` over ``interface`` (an interface_module), as its __init__.py makes it: its
    __version__ that of a distribution named "fa4" ("0.0.0" where none is installed, as with flash-attn-4's wheel),
    and flash_attn_func and flash_attn_varlen_func (and BlockScales and TensorwiseScales from 4.0.0b39) exported."""
    package = types.ModuleType("flash_attn.cute", "Flash Attention CUTE (CUDA Template Engine) implementation.")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec(package.__name__, None, is_package=True)
    package.__spec__.submodule_search_locations = []
    try:
        package.__version__ = importlib.metadata.version("fa4")
    except importlib.metadata.PackageNotFoundError:
        package.__version__ = "0.0.0"
    exports = ["flash_attn_func", "flash_attn_varlen_func"]
    if interface._RELEASE.beta >= 39:
        exports = ["BlockScales", "TensorwiseScales", *exports]
    package.__all__ = exports
    package.interface = interface
    for name in exports:
        setattr(package, name, getattr(interface, name))
    return package


def use_flash_attn_4(monkeypatch, release="4.0.0b40"):
    """Make flash-attn-4 ``release`` (a key of RECORD_OF) the double for the rest of the test; return its interface
    module (interface_module), whose ``calls`` counts its kernels' runs. monkeypatch undoes all of it:

    * sys.modules holds the double as ``flash_attn.cute`` and ``flash_attn.cute.interface`` (ahead of flash-attn 2's
      own flash_attn/cute folder), and the ``flash_attn`` package has it as its ``cute``: flash-attn 2's package where
      it imports (attention_stash_flash.import_flash_attn: it stays imported), else a bare namespace package, as a
      flash-attn-4 install alone leaves it;
    * a folder with the flash-attn-4 distribution's dist-info at ``release`` (METADATA, top_level.txt, a RECORD of the
      package's two files) goes first on sys.path, so importlib.metadata finds the distribution and
      packages_distributions() maps flash_attn to it; transformers' cached copy of that mapping is a fresh one;
    * transformers' cached flash functions are cleared, so ``lazy_import_flash_attention("flash_attention_4")`` imports
      the double's. A model runs it once ``model.config._attn_implementation = "flash_attention_4"``.
    """
    import transformers.modeling_flash_attention_utils as flash_utils
    import transformers.utils.import_utils as import_utils

    interface = interface_module(release)
    package = package_module(interface)
    monkeypatch.syspath_prepend(str(_distribution_root(release)))
    parent = sys.modules.get("flash_attn")
    if parent is None:
        try:
            import_flash_attn()
            parent = sys.modules["flash_attn"]
        except ImportError:
            parent = types.ModuleType("flash_attn")
            parent.__path__ = []
            parent.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
            parent.__spec__.submodule_search_locations = []
            monkeypatch.setitem(sys.modules, "flash_attn", parent)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setattr(parent, "cute", package, raising=False)
    mapping = cache(importlib.metadata.packages_distributions)
    for module in (import_utils, flash_utils):
        # From transformers 5.23; 5.22 maps the distributions once at import, into a dict no flash path here reads.
        if hasattr(module, "_package_distribution_mapping"):
            monkeypatch.setattr(module, "_package_distribution_mapping", mapping)
    for name in _LAZY_FLASH_NAMES:
        if hasattr(flash_utils, name):
            monkeypatch.setattr(flash_utils, name, None)
    return interface


def _distribution_root(release):
    root = _distribution_roots.get(release)
    if root is not None and root.is_dir():
        return root
    root = _distribution_roots[release] = pathlib.Path(tempfile.mkdtemp(prefix="flash_attn_4_double_"))
    atexit.register(shutil.rmtree, root, True)
    dist_info = f"flash_attn_4-{release}.dist-info"
    files = {
        "METADATA": f"Metadata-Version: 2.4\nName: flash-attn-4\nVersion: {release}\n",
        "WHEEL": "Wheel-Version: 1.0\nGenerator: attention_stash_flash4\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "INSTALLER": "pip\n",
        "top_level.txt": "flash_attn\n",
    }
    record = [
        "flash_attn/cute/__init__.py", "flash_attn/cute/interface.py", *(f"{dist_info}/{name}" for name in files)
    ]
    files["RECORD"] = "".join(f"{path},,\n" for path in [*record, f"{dist_info}/RECORD"])
    (root / dist_info).mkdir()
    for name, text in files.items():
        (root / dist_info / name).write_text(text)
    return root


class TensorwiseScales(NamedTuple):
    """FP8 dequantization scales for q, k and v (4.0.0b39 on); the double refuses them."""

    q: torch.Tensor = None
    k: torch.Tensor = None
    v: torch.Tensor = None


class BlockScales(NamedTuple):
    """MXFP8 block scales for q and k, and optionally v (4.0.0b39 on); the double refuses them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor = None


def _validate_gather_bwd_kwargs(gather_kv_indices, gather_bwd_recompute_p, gather_bwd_token_chunk):
    """flash_attn_func's and flash_attn_varlen_func's check of the sparse-MLA backward settings (4.0.0b32 on): they
    need gather_kv_indices, and a chunk must be a positive integer; returns the chunk as an int, or None."""
    if gather_kv_indices is None:
        if gather_bwd_recompute_p or gather_bwd_token_chunk is not None:
            raise ValueError("gather_bwd_recompute_p and gather_bwd_token_chunk apply only to sparse top-k MLA "
                             "attention, and gather_kv_indices is not given")
        return None
    if gather_bwd_token_chunk is None:
        return None
    try:
        chunk = 0 if isinstance(gather_bwd_token_chunk, bool) else operator.index(gather_bwd_token_chunk)
    except TypeError:
        chunk = 0
    if chunk <= 0:
        raise ValueError(f"gather_bwd_token_chunk must be a positive int or None, got {gather_bwd_token_chunk!r}")
    return chunk


def _resolve_window(release, causal, window_size_left, window_size_right, mask_mod=None):
    """_resolve_causal_local_window: (causal, local, window_size_left, window_size_right), canonical. Windows with both
    sides negative (4.0.0b30 on; before, whose sides sum below zero once causal set the right side to 0) are none; a
    window of (None, 0) is causal."""
    left, right = window_size_left, window_size_right
    if mask_mod is not None:
        return False, False, left, right
    if release.beta < 30 and causal:
        right = 0
    if left is not None and right is not None and (left + right < 0 if release.beta < 30 else left < 0 and right < 0):
        left = right = None
    if release.beta >= 30 and causal:
        right = 0
    local = False
    if left is not None or right is not None:
        if left is None and right == 0:
            causal, right = True, None
        else:
            causal, local = False, True
    return causal, local, left, right


def _refuse(what, arguments, names):
    for name in names:
        if arguments.get(name) is not None:
            raise NotImplementedError(f"the CPU flash-attn 4 double does not take {name} ({what})")


def _apply(namespace, varlen, arguments):
    """flash_attn_func's and flash_attn_varlen_func's body: the release's checks, then its autograd function's apply
    with every argument, in the order of that function's forward."""
    release, arguments = namespace["_RELEASE"], dict(arguments)
    if release.beta >= 39 and varlen and isinstance(arguments["scales"], namespace["BlockScales"]):
        raise NotImplementedError("flash-attn 4 takes MXFP8 BlockScales in dense attention only: use flash_attn_func")
    if release.beta >= 32:
        chunk = arguments["gather_bwd_token_chunk"] = namespace["_validate_gather_bwd_kwargs"](
            arguments["gather_kv_indices"], arguments["gather_bwd_recompute_p"], arguments["gather_bwd_token_chunk"])
        q = arguments["q"]
        if (not varlen and chunk is not None and q.dim() == 4 and q.shape[0] > 1 and q.shape[1] > chunk
                and torch.is_grad_enabled() and any(arguments[name] is not None and arguments[name].requires_grad
                                                    for name in ("q", "k", "v", "qv"))):
            warnings.warn("gather_bwd_token_chunk needs varlen inputs or a batch of one; the backward runs unchunked",
                          stacklevel=3)
    function = namespace["FlashAttnVarlenFunc" if varlen else "FlashAttnFunc"]
    return function.apply(*(arguments[name] for name in _names(_parameters(release.beta)[4 if varlen else 2])))


def _function_forward(namespace, ctx, varlen, arguments):
    """FlashAttnFunc.forward's and FlashAttnVarlenFunc.forward's body, as the release has it."""
    release, a = namespace["_RELEASE"], arguments
    aux_scalars = tuple(a["aux_scalars"]) if a["aux_scalars"] else None
    q, k, v, qv = a["q"], a["k"], a["v"], a["qv"]
    shared_kv = k is v
    if shared_kv and v.shape[-1] == 512:
        # The MLA formula with q and k as None; _flash_attn_fwd refuses qv.
        qv = q if qv is None else qv
        q = k = None
    options = dict(qv=qv)
    if varlen:
        options.update((name, a[name]) for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
                                                    "max_seqlen_q", "max_seqlen_k", "min_seqlen_k", "page_table"))
    options.update(softmax_scale=a["softmax_scale"],
                   causal=a["causal"],
                   window_size_left=a["window_size"][0],
                   window_size_right=a["window_size"][1],
                   learnable_sink=a["learnable_sink"],
                   softcap=a["softcap"],
                   num_splits=a["num_splits"],
                   pack_gqa=a["pack_gqa"],
                   score_mod=a["score_mod"],
                   mask_mod=a["mask_mod"])
    if varlen:
        options.update(block_sparse_tensors=a["block_sparse_tensors"], aux_tensors=a["aux_tensors"])
        options.update(aux_scalars=aux_scalars)
    else:
        options.update(aux_tensors=a["aux_tensors"], aux_scalars=aux_scalars)
        options.update(block_sparse_tensors=a["block_sparse_tensors"])
    options.update(return_lse=a["return_lse"], gather_kv_indices=a["gather_kv_indices"])
    if varlen and release.beta >= 25:
        options.update(
            (name, a[name]) for name in ("scheduler_metadata", "seqlen_k_per_split", "disable_scheduler_metadata"))
    if release.beta >= 32:
        options.update(gather_bwd_recompute_p=a["gather_bwd_recompute_p"])
    if release.beta >= 39:
        options.update(config=a["config"], scales=a["scales"])
    results = namespace["_flash_attn_fwd"](q, k, v, **options)
    if release.forward_arity == 5:
        out, lse, p, row_max, o_lo = results
        saved = [q, k, v, qv, out, lse, p, row_max, o_lo]
    else:
        out, lse, p, row_max = results
        saved = [q, k, v, qv, out, lse, p, row_max]
    saved.append(a["gather_kv_indices"])
    if release.sinks_have_gradient:
        saved.append(a["learnable_sink"])
    if varlen:
        saved += [a["cu_seqlens_q"], a["cu_seqlens_k"], a["seqused_q"], a["seqused_k"]]
    ctx.save_for_backward(*saved, *(a["aux_tensors"] or ()))
    if release.beta >= 32:
        ctx.gather_bwd_recompute_p = a["gather_bwd_recompute_p"]
    ctx.shared_kv = shared_kv
    for name in ("softmax_scale", "causal", "window_size", "softcap", "deterministic"):
        setattr(ctx, name, a[name])
    if varlen:
        ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.min_seqlen_k = a["max_seqlen_q"], a["max_seqlen_k"], a["min_seqlen_k"]
    ctx.return_lse, ctx.score_mod, ctx.score_mod_bwd, ctx.mask_mod = (a["return_lse"], a["score_mod"],
                                                                      a["score_mod_bwd"], a["mask_mod"])
    ctx.aux_scalars = aux_scalars
    if not varlen:
        ctx.block_sparse_tensors_bwd = a["block_sparse_tensors_bwd"]
    if release.beta >= 32:
        ctx.gather_bwd_token_chunk = a["gather_bwd_token_chunk"]
    ctx.set_materialize_grads(False)
    return out, lse


def _function_backward(namespace, ctx, varlen, dout, dlse):
    """FlashAttnFunc.backward's and FlashAttnVarlenFunc.backward's body, as the release has it: one gradient for each
    forward input (up to 4.0.0b25: dq, dk, dv and 30 Nones, 31 for varlen, with no gradient for the sinks)."""
    release = namespace["_RELEASE"]
    saved = list(ctx.saved_tensors)
    q, k, v, qv, out, lse, p, row_max = saved[:8]
    rest = saved[8 + (release.forward_arity == 5):]
    gather_kv_indices, rest = rest[0], rest[1:]
    learnable_sink = rest.pop(0) if release.sinks_have_gradient else None
    if varlen:
        (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), rest = rest[:4], rest[4:]
    aux_tensors = rest if rest else None
    if not ctx.return_lse:
        dlse = None
    if dout is None:
        dout = torch.zeros_like(out)
    if qv is not None:
        raise NotImplementedError("the CPU flash-attn 4 double has no MLA backward (_flash_attn_bwd_sparse_mla)")
    options = dict(window_size_left=ctx.window_size[0], window_size_right=ctx.window_size[1])
    if varlen:
        options.update(cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k,
                       seqused_q=seqused_q,
                       seqused_k=seqused_k,
                       max_seqlen_q=ctx.max_seqlen_q,
                       max_seqlen_k=ctx.max_seqlen_k)
    options.update(deterministic=ctx.deterministic, score_mod=ctx.score_mod, score_mod_bwd=ctx.score_mod_bwd)
    if varlen:
        options.update(aux_tensors=aux_tensors, aux_scalars=ctx.aux_scalars, mask_mod=ctx.mask_mod)
    else:
        options.update(mask_mod=ctx.mask_mod, aux_tensors=aux_tensors, aux_scalars=ctx.aux_scalars)
        options.update(block_sparse_tensors=ctx.block_sparse_tensors_bwd)
    options.update(dlse=dlse)
    if release.sinks_have_gradient:
        options.update(learnable_sink=learnable_sink)
    result = namespace["_flash_attn_bwd"](q, k, v, out, dout, lse, ctx.softmax_scale, ctx.causal, ctx.softcap,
                                          **options)
    if not release.sinks_have_gradient:
        dq, dk, dv = result
        return dq, dk, dv, *((None, ) * (31 if varlen else 30))
    if learnable_sink is None:
        (dq, dk, dv), dsink = result, None
    else:
        dq, dk, dv, dsink = result
    names = _names(_parameters(release.beta)[4 if varlen else 2])
    grads = [None] * len(names)
    grads[:3], grads[names.index("learnable_sink")] = (dq, dk, dv), dsink
    return tuple(grads)


def _check_tensor(tensor, name, shape, dtype, device):
    assert tensor.shape == shape, f"{name} shape {tuple(tensor.shape)} != expected {tuple(shape)}"
    assert tensor.dtype == dtype, f"{name} dtype {tensor.dtype} != expected {dtype}"
    assert tensor.device == device, f"{name} device {tensor.device} != expected {device}"


def _check_sink(sink, num_head, dtype):
    assert sink.shape == (num_head, )
    allowed = _LEARNABLE_SINK_DTYPES + ((torch.float64, ) if dtype == torch.float64 else ())
    assert sink.dtype in allowed, "learnable_sink must be float16, bfloat16, or float32"


def _stats_dtype(dtype):
    """The dtype the kernels compute, and store the log-sum-exp, in: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward_kernel(release, a):
    """_flash_attn_fwd's body: the real one's checks and allocation, then the CPU kernel."""
    q, k, v, sink, cu_seqlens_q, cu_seqlens_k = (a["q"], a["k"], a["v"], a["learnable_sink"], a["cu_seqlens_q"],
                                                 a["cu_seqlens_k"])
    release.calls["varlen_fwd" if cu_seqlens_q is not None else "fwd"] += 1
    watched = (q, k, v, a["qv"], sink) if release.beta >= 26 else (q, k, v, a["qv"])
    requires_grad = any(t is not None and t.requires_grad for t in watched)
    scales = ("scales", "config") if release.beta >= 39 else ("q_descale", "k_descale", "v_descale")
    _refuse("_flash_attn_fwd", {**a, "aux_scalars": a["aux_scalars"] or None}, _FORWARD_REFUSED + scales)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise NotImplementedError("the CPU flash-attn 4 double takes cu_seqlens_q and cu_seqlens_k together")
    assert v is not None and q is not None
    num_head, head_dim = q.shape[-2:]
    if cu_seqlens_q is None:
        batch_size, seqlen_q = q.shape[:2]
        total_q = batch_size * seqlen_q
    else:
        batch_size, seqlen_q, total_q = cu_seqlens_q.shape[0] - 1, None, q.shape[0]
    seqlen_k, num_head_kv, head_dim_v = v.shape[-3:]
    if cu_seqlens_k is None:
        assert k.shape == (batch_size, seqlen_k, num_head_kv, head_dim)
        assert v.shape == (batch_size, seqlen_k, num_head_kv, head_dim_v)
    else:
        assert k.shape == (seqlen_k, num_head_kv, head_dim) and v.shape == (seqlen_k, num_head_kv, head_dim_v)
        assert cu_seqlens_k.shape == (batch_size + 1, ), "cu_seqlens_k must have shape (batch_size + 1,)"
        assert cu_seqlens_q.shape == (batch_size + 1, ), "cu_seqlens_q must have shape (batch_size + 1,)"
        for t in (cu_seqlens_q, cu_seqlens_k):
            assert t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
            assert t.stride(0) == 1, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be contiguous"
    assert v.dtype in _INPUT_DTYPES, "inputs must be float16, bfloat16 (or, in the double, float32, float64)"
    assert q.dtype == k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
    if sink is not None:
        _check_sink(sink, num_head, v.dtype)
    assert num_head % num_head_kv == 0, "num_head must be divisible by num_head_kv"
    softmax_scale = 1.0 / math.sqrt(head_dim) if a["softmax_scale"] is None else a["softmax_scale"]
    softcap = None if a["softcap"] == 0.0 else a["softcap"]
    rows = (batch_size, seqlen_q) if cu_seqlens_q is None else (total_q, )
    lse_shape = (batch_size, num_head, seqlen_q) if cu_seqlens_q is None else (num_head, total_q)
    out, lse, stats = a["out"], a["lse"], _stats_dtype(v.dtype)
    if out is None:
        out = torch.empty(*rows, num_head, head_dim_v, dtype=q.dtype, device=v.device)
    else:
        _check_tensor(out, "out", (*rows, num_head, head_dim_v), q.dtype, v.device)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=stats, device=v.device) if requires_grad or a["return_lse"] else None
    else:
        _check_tensor(lse, "lse", lse_shape, stats, v.device)
    if seqlen_k == 0 or total_q == 0:
        out.zero_()
        if lse is not None:
            if sink is None or release.beta < 31:
                lse.fill_(-math.inf)
            else:
                lse.copy_(sink[:, None])
        if release.beta == 19:
            return out, lse
        return (out, lse, None, None, None)[:release.forward_arity]
    causal, local, left, right = _resolve_window(release, a["causal"], a["window_size_left"], a["window_size_right"])
    with torch.autocast("cpu", enabled=False):  # the kernels compute as their inputs say, whatever autocast says
        allowed, _ = _allowed_keys(q, k, cu_seqlens_q, cu_seqlens_k, causal, local, left, right)
        result, stats_values = _attend(_batched(q, cu_seqlens_q), _batched(k, cu_seqlens_k), _batched(v, cu_seqlens_k),
                                       sink, allowed, softmax_scale, softcap, stats)
    out.copy_(result.reshape(out.shape))
    if lse is not None:
        lse.copy_(stats_values.reshape(lse_shape))
    return (out, lse, None, None, None)[:release.forward_arity]


def _backward_kernel(release, a):
    """_flash_attn_bwd's body: the real one's checks, then the CPU kernel; (dq, dk, dv), and dsink with sinks."""
    q, k, v, out, dout, lse = (a[name] for name in ("q", "k", "v", "out", "dout", "lse"))
    cu_seqlens_q, cu_seqlens_k, dlse, sink = a["cu_seqlens_q"], a["cu_seqlens_k"], a["dlse"], a.get("learnable_sink")
    release.calls["varlen_bwd" if cu_seqlens_q is not None else "bwd"] += 1
    _refuse("_flash_attn_bwd", a, _BACKWARD_REFUSED + (("config", ) if release.beta >= 39 else ()))
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise NotImplementedError("the CPU flash-attn 4 double takes cu_seqlens_q and cu_seqlens_k together")
    if sink is not None:
        assert lse is not None, "learnable_sink backward requires LSE"
    softcap = a["softcap"]
    if softcap != 0.0 and not isinstance(softcap, (int, float)):
        # Any softcap but 0.0 is one to the real backward, which builds its softcap score_mod from it: from None, a
        # function that divides the scores by None when it compiles.
        raise TypeError(f"flash-attn 4's backward takes softcap={softcap!r} as a softcap (any value but 0.0 is one) "
                        f"and fails building its score_mod from it; pass 0.0 for none")
    causal, local, left, right = _resolve_window(release, a["causal"], a["window_size_left"], a["window_size_right"])
    num_head, head_dim = q.shape[-2:]
    num_head_kv, head_dim_v = k.shape[-2], v.shape[-1]
    if cu_seqlens_q is None:
        batch_size, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        assert k.shape == (batch_size, seqlen_k, num_head_kv, head_dim)
        assert v.shape == (batch_size, seqlen_k, num_head_kv, head_dim_v)
        assert out.shape == dout.shape == (batch_size, seqlen_q, num_head, head_dim_v)
        assert lse.shape == (batch_size, num_head, seqlen_q), "lse must have shape (batch_size, num_head, seqlen_q)"
    else:
        batch_size, total_q, total_k = cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0]
        assert k.shape == (total_k, num_head_kv, head_dim) and v.shape == (total_k, num_head_kv, head_dim_v)
        assert cu_seqlens_k.shape == cu_seqlens_q.shape == (batch_size + 1, )
        assert out.shape == dout.shape == (total_q, num_head, head_dim_v)
        assert lse.shape == (num_head, total_q), "lse must have shape (num_head, total_q)"
        for t in (cu_seqlens_q, cu_seqlens_k):
            assert t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k must be int32"
    assert q.dtype in _INPUT_DTYPES, "inputs must be float16 or bfloat16 (or, in the double, float32, float64)"
    assert q.dtype == k.dtype == v.dtype == out.dtype == dout.dtype, "inputs must have the same dtype"
    stats = _stats_dtype(q.dtype)
    assert lse.dtype == stats, f"lse must be {stats}"
    if sink is not None:
        _check_sink(sink, num_head, q.dtype)
    assert num_head % num_head_kv == 0, "num_head must be divisible by num_head_kv"
    softmax_scale = 1.0 / math.sqrt(head_dim) if a["softmax_scale"] is None else a["softmax_scale"]
    with torch.autocast("cpu", enabled=False):
        allowed, in_sequence = _allowed_keys(q, k, cu_seqlens_q, cu_seqlens_k, causal, local, left, right)
        rows = [_batched(t, cu_seqlens_q) for t in (dout, q, out)]
        keys = [_batched(t, cu_seqlens_k) for t in (k, v)]
        stats_values = [None if t is None else _heads_first(t, cu_seqlens_q) for t in (lse, dlse)]
        grads = _attend_backward(*rows[:2], *keys, rows[2], *stats_values, sink, allowed, in_sequence, softmax_scale,
                                 None if softcap == 0.0 else softcap, stats)
    results = []
    for grad, given, tensor, name in zip(grads, (a["dq"], a["dk"], a["dv"]), (q, k, v), ("dq", "dk", "dv")):
        if given is None:
            given = torch.empty_like(tensor)
        else:
            _check_tensor(given, name, tensor.shape, tensor.dtype, tensor.device)
        results.append(given.copy_(grad.reshape(tensor.shape)))
    if sink is None:
        return tuple(results)
    return (*results, grads[3].to(sink.dtype))


def _batched(tensor, cu_seqlens):
    """[batch, seqlen, heads, dim] as it is; varlen [total, heads, dim] as one batch of all its rows."""
    return tensor if cu_seqlens is None else tensor.unsqueeze(0)


def _heads_first(stats, cu_seqlens):
    """A log-sum-exp (or its gradient) as [batch, heads, seqlen]: varlen [heads, total] as one batch."""
    return stats if cu_seqlens is None else stats.unsqueeze(0)


def _token_table(cu_seqlens, total, device):
    """Per row of a layout: its sequence (one-hot over the sequences, none for rows past the last), its position in
    the sequence and the sequence's length. Without cu_seqlens, the ``total`` rows of one batch entry."""
    index = torch.arange(total, device=device)
    if cu_seqlens is None:
        member = torch.ones(total, 1, dtype=torch.bool, device=device)
        return member, index, torch.full((total, ), total, dtype=torch.long, device=device)
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    member = (index[:, None] >= starts) & (index[:, None] < ends)
    return member, index - (member * starts).sum(-1), (member * (ends - starts)).sum(-1)


def _allowed_keys(q, k, cu_seqlens_q, cu_seqlens_k, causal, local, left, right):
    """[rows, keys] bool: the keys each query row sees (for varlen, within its own sequence), aligned bottom-right as
    flash-attn 4's masks do (mask.py): key j is diagonal to row i where j = i + seqlen_k - seqlen_q; causal keeps
    keys up to the diagonal, local those from ``left`` before it to ``right`` after it (None: no bound). And [rows]
    bool: the rows inside a sequence."""
    rows, keys = (q.shape[1], k.shape[1]) if cu_seqlens_q is None else (q.shape[0], k.shape[0])
    member_q, position_q, length_q = _token_table(cu_seqlens_q, rows, q.device)
    member_k, position_k, length_k = _token_table(cu_seqlens_k, keys, q.device)
    allowed = (member_q[:, None, :] & member_k[None, :, :]).any(-1)
    diagonal = position_q[:, None] + length_k[None, :] - length_q[:, None]
    if causal:
        allowed &= position_k[None, :] <= diagonal
    if local and right is not None:
        allowed &= position_k[None, :] <= diagonal + right
    if local and left is not None:
        allowed &= position_k[None, :] >= diagonal - left
    return allowed, member_q.any(-1)


def _heads(tensor, num_head, dtype):
    """[batch, seqlen, heads or key/value heads, dim] -> dtype [batch, heads, seqlen, dim], each key/value head serving
    consecutive query heads."""
    return tensor.to(dtype).repeat_interleave(num_head // tensor.shape[2], dim=2).transpose(1, 2)


def _scores(q, k, allowed, softmax_scale, softcap, dtype):
    """The scaled scores q k^T [batch, heads, rows, keys], and the softcapped ones masked to -inf."""
    raw = torch.matmul(_heads(q, q.shape[2], dtype), _heads(k, q.shape[2], dtype).transpose(-1, -2)) * softmax_scale
    capped = raw if softcap is None else softcap * torch.tanh(raw / softcap)
    return raw, capped.masked_fill(~allowed, -math.inf)


def _finite(lse):
    """A log-sum-exp with -inf (a row that saw nothing) as 0, as flash-attn 4's backward preprocess takes it."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _attend(q, k, v, sink, allowed, softmax_scale, softcap, dtype):
    """Batched softmax attention: out [batch, rows, heads, dim_v] and lse [batch, heads, rows] in ``dtype``. Each
    head's sink is one more column of its rows' normaliser, unscaled, with no value."""
    _, scores = _scores(q, k, allowed, softmax_scale, softcap, dtype)
    columns = scores
    if sink is not None:
        columns = torch.cat((scores, sink.to(dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)), dim=-1)
    lse = torch.logsumexp(columns, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probs, _heads(v, q.shape[2], dtype)).transpose(1, 2), lse


def _attend_backward(dout, q, k, v, out, lse, dlse, sink, allowed, in_sequence, softmax_scale, softcap, dtype):
    """dq, dk, dv (in the batched layouts of q, k, v) and dsink [heads] (None without sinks) from the saved out and
    lse, as flash-attn 4's backward computes them: dscores = P * (dP - D'), D' = rowsum(dout * out) - dlse."""
    num_head = q.shape[2]
    raw, scores = _scores(q, k, allowed, softmax_scale, softcap, dtype)
    lse = lse.to(dtype)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    dout_heads, out_heads = dout.to(dtype).transpose(1, 2), out.to(dtype).transpose(1, 2)
    delta = (dout_heads * out_heads).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(dtype)
    q_heads, k_heads, v_heads = (_heads(t, num_head, dtype) for t in (q, k, v))
    dv_heads = torch.matmul(probs.transpose(-1, -2), dout_heads)
    dscores = probs * (torch.matmul(dout_heads, v_heads.transpose(-1, -2)) - delta.unsqueeze(-1))
    if softcap is not None:
        dscores = dscores * (1.0 - torch.tanh(raw / softcap)**2)
    dq = torch.matmul(dscores, k_heads).transpose(1, 2) * softmax_scale
    dk_heads = torch.matmul(dscores.transpose(-1, -2), q_heads) * softmax_scale

    def per_key_head(grad):
        # [batch, heads, keys, dim] -> [batch, keys, key/value heads, dim], summing each group of query heads.
        batch, _, keys, dim = grad.shape
        return grad.reshape(batch, k.shape[2], num_head // k.shape[2], keys, dim).sum(2).transpose(1, 2)

    dsink = None
    if sink is not None:
        sink_probs = torch.exp(sink.to(dtype).view(1, -1, 1) - lse).masked_fill(torch.isneginf(lse), 1.0)
        dsink = -(sink_probs * delta).masked_fill(~in_sequence, 0.0).sum((0, 2))
    return dq, per_key_head(dk_heads), per_key_head(dv_heads), dsink
