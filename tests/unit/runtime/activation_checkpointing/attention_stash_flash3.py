# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""flash-attn 3 and Hub kernels on a machine without CUDA, for the attention stash tests.

More ways into Hugging Face's flash attention path, beside attention_stash_flash's flash_attention_2:

* "flash_attention_3": transformers imports ``flash_attn_interface``, flash-attn 3's Python layer (flash-attn 2.8.3's
  wheel ships it as ``hopper/flash_attn_interface.py``), which calls the ops ``flash_attn_3::fwd`` and ``bwd`` that
  flash-attn 3's compiled ``flash_attn_3._C`` registers. import_flash_attn_3 defines those ops here.
* Hub kernels, which transformers loads through the ``kernels`` package: "kernels-community/flash-attn2" (also
  transformers' fallback for "flash_attention_2"), "kernels-community/flash-attn3" and
  "kernels-community/vllm-flash-attn3" (transformers' fallback for "flash_attention_3"). build_hub_kernel writes a
  local kernel repository whose Python layer is the build's mirror in hub_builds/ (each names the real file it mirrors:
  custom ops where the real build has them, plain functions where it has those), and defines the build's compiled ops
  in its namespace here with the real builds' schemas; use_hub_kernel points ``kernels`` at it with LOCAL_KERNELS.

The ops' CPU kernels delegate to attention_stash_flash's stand-ins, so all paths compute the same values; their fake
kernels give the shapes only, for the meta device. Inputs the stand-ins do not implement raise NotImplementedError.
"""

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import sys
import types
from functools import reduce

import torch

from attention_stash_flash import (_LAZY_FLASH_NAMES, _ROW_BLOCK, INSTALL_HINT, REQUIRED, _outside_autocast, _round_up,
                                   flash_backward_cpu, flash_forward_cpu, flash_varlen_backward_cpu,
                                   flash_varlen_forward_cpu)

# flash-attn 3's schemas, as hopper/flash_api.cpp registers them (TORCH_LIBRARY(flash_attn_3, m)).
_FA3_FWD = ("fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, Tensor(v_new!)? v_new=None, "
            "Tensor? q_v=None, Tensor(out!)? out=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
            "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
            "int? max_seqlen_k=None, Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, "
            "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, "
            "Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, bool is_causal=False, "
            "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, float softcap=0.0, "
            "bool is_rotary_interleaved=False, Tensor? scheduler_metadata=None, int num_splits=0, "
            "bool? pack_gqa=None, int sm_margin=0) -> (Tensor(out!), Tensor, Tensor, Tensor)")
_FA3_BWD = ("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(dq!)? dq=None, "
            "Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
            "Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
            "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
            "float softcap=0.0, bool deterministic=False, int sm_margin=0) "
            "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)")
# kernels-community/flash-attn3's (flash-attn/flash_api_stable.cpp): flash-attn 3's, its bwd returning softmax_d and
# four workspaces, dq, dk and dv written in place.
_HUB_FA3_BWD = _FA3_BWD.replace("-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)",
                                "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
# kernels-community/vllm-flash-attn3's (flash-attn/flash_api_stable.cpp): no attention_chunk, a softmax_scale of 0.0 by
# default, k_new and v_new not written, and attention sinks (s_aux) last.
_VLLM_FA3_FWD = reduce(lambda schema, change: schema.replace(*change),
                       (("Tensor(k_new!)? k_new", "Tensor? k_new"), ("Tensor(v_new!)? v_new", "Tensor? v_new"),
                        ("float? softmax_scale=None", "float softmax_scale=0.0"), ("int attention_chunk=0, ", ""),
                        ("int sm_margin=0)", "int sm_margin=0, Tensor? s_aux=None)")), _FA3_FWD)
_VLLM_FA3_BWD = _FA3_BWD.replace("float? softmax_scale=None", "float softmax_scale=0.0")
# flash-attn 2's mha_fwd, mha_varlen_fwd, mha_bwd and mha_varlen_bwd (csrc/flash_attn/flash_api.cpp) in the argument
# order of flash-attn 2.8.3's calls and a Hub build's torch_binding.cpp, which returns Tensor[] as here; here only the
# buffers the kernels write (out, dq, dk, dv) are marked mutable.
_FA2_OPS = (
    "fwd(Tensor q, Tensor k, Tensor v, Tensor(a!)? out, Tensor? alibi_slopes, float p_dropout, float softmax_scale, "
    "bool is_causal, int window_size_left, int window_size_right, float softcap, bool return_softmax, "
    "Generator? gen) -> Tensor[]",
    "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor(a!)? out, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "Tensor? seqused_k, Tensor? leftpad_k, Tensor? block_table, Tensor? alibi_slopes, int max_seqlen_q, "
    "int max_seqlen_k, float p_dropout, float softmax_scale, bool zero_tensors, bool is_causal, "
    "int window_size_left, int window_size_right, float softcap, bool return_softmax, Generator? gen) -> Tensor[]",
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a!)? dq, Tensor(b!)? dk, "
    "Tensor(c!)? dv, Tensor? alibi_slopes, float p_dropout, float softmax_scale, bool is_causal, "
    "int window_size_left, int window_size_right, float softcap, bool deterministic, Generator? gen, "
    "Tensor? rng_state) -> Tensor[]",
    "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a!)? dq, "
    "Tensor(b!)? dk, Tensor(c!)? dv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? alibi_slopes, "
    "int max_seqlen_q, int max_seqlen_k, float p_dropout, float softmax_scale, bool zero_tensors, bool is_causal, "
    "int window_size_left, int window_size_right, float softcap, bool deterministic, Generator? gen, "
    "Tensor? rng_state) -> Tensor[]",
)
# flash-attn 3's arguments the stand-in does not implement (num_splits, pack_gqa, sm_margin and deterministic change
# no value it computes); vLLM's attention sinks (s_aux) it computes.
_FA3_UNSUPPORTED = ("k_new", "v_new", "q_v", "cu_seqlens_k_new", "seqused_q", "seqused_k", "page_table",
                    "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale",
                    "k_descale", "v_descale", "scheduler_metadata")
_KERNEL_EXPORTS = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                   "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                   "flash_attn_with_kvcache")

_libraries = {}  # namespace -> torch.library.Library: ops stay registered while their Library lives
_defined = set()  # (namespace, op name)
_hub_kernel_paths = {}  # repository -> its variant folder, built once per process


def import_flash_attn_3():
    """flash-attn 3's Python layer as the top-level module ``flash_attn_interface``, as transformers imports it.

    Where ``flash_attn_3._C`` (flash-attn 3's compiled ops) does not import, puts empty stand-ins for ``flash_attn_3``
    and ``flash_attn_3._C`` in sys.modules. Defines ``flash_attn_3::fwd`` and ``bwd`` with CPU and fake kernels (once
    per process; where flash-attn 3's own ops exist, adds only the CPU kernels). Where no real ``flash_attn_interface``
    is installed, loads flash-attn 2.8.3's ``hopper/flash_attn_interface.py`` as ``flash_attn_interface``, or raises
    ImportError with the install hint where that file is missing.
    """
    if "flash_attn_3._C" not in sys.modules:
        try:
            importlib.import_module("flash_attn_3._C")
        except ImportError:
            package, compiled = types.ModuleType("flash_attn_3"), types.ModuleType("flash_attn_3._C")
            package.__path__, package._C = [], compiled
            sys.modules.update({"flash_attn_3": package, "flash_attn_3._C": compiled})
    _define("flash_attn_3", _FA3_FWD, _fa3_forward_cpu, _fa3_forward_fake)
    _define("flash_attn_3", _FA3_BWD, _fa3_backward_cpu, _fa3_backward_fake)
    if "flash_attn_interface" not in sys.modules:
        if importlib.util.find_spec("flash_attn_interface") is not None:
            return importlib.import_module("flash_attn_interface")
        path = _distribution_file("hopper/flash_attn_interface.py")
        spec = importlib.util.spec_from_file_location("flash_attn_interface", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["flash_attn_interface"] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            del sys.modules["flash_attn_interface"]
            raise
    return sys.modules["flash_attn_interface"]


def flash_kernels_or_skip():
    """For a test module of flash-attn 3 and the Hub kernel: flash-attn 3's interface (import_flash_attn_3) and the
    kernels package. Skips the module, with the reason, where either cannot be imported, unless the environment
    requires flash-attn (attention_stash_flash.REQUIRED set to "required", as CI does), where it fails the run."""
    import pytest

    try:
        import kernels  # noqa: F401
        return import_flash_attn_3()
    except ImportError as error:
        if os.environ.get(REQUIRED) == "required":
            raise ImportError(f"{REQUIRED}=required, and flash-attn 3's interface or kernels does not import: "
                              f"{error}. Install them with: pip install kernels; {INSTALL_HINT}") from error
        pytest.skip(str(error), allow_module_level=True)


def use_flash_attention_3(monkeypatch):
    """Make transformers' flash_attention_3 path run on this machine for the rest of the test.

    Imports flash-attn 3 (see import_flash_attn_3), tells transformers.modeling_flash_attention_utils that flash-attn
    3 is available, and clears its cached flash functions so the next call imports flash_attn_interface's; monkeypatch
    restores both. A model runs the path once ``model.config._attn_implementation = "flash_attention_3"``.
    """
    import transformers.modeling_flash_attention_utils as flash_utils

    import_flash_attn_3()
    monkeypatch.setattr(flash_utils, "is_flash_attn_3_available", lambda *args, **kwargs: True)
    _clear_lazy_flash(monkeypatch, flash_utils)


def build_hub_kernel(root, repo_id):
    """Write a local Hub kernel repository for ``repo_id`` (a key of HUB_BUILDS) under ``root`` and return its build
    variant's folder (``root/<name>/build/torch-cpu``), the path to give LOCAL_KERNELS.

    The variant holds the build's mirror from hub_builds/ as flash_attn_interface.py, an _ops.py as the build's
    (``ops = torch.ops.<namespace>`` and ``add_op_namespace_prefix``), an __init__.py exporting the mirror's
    flash_attn_func and flash_attn_varlen_func (the real one exports more, flash_attn_with_kvcache among them, which
    Hugging Face's training path does not call: without it transformers warns that block tables are not supported),
    and those two names of _ops.py where the real one exports them at the version transformers asks for, and
    metadata.json, whose id (the module's name in sys.modules and its ops' namespace) is ``_<package>_`` and a hash of
    the mirror's text. Defines the namespace's compiled ops (once per process) before the kernels package imports the
    mirror, whose custom ops register in that namespace.
    """
    build = HUB_BUILDS[repo_id]
    source = _mirror(build)
    namespace = hub_kernel_name(repo_id)
    # The fields kernels 0.17.2 requires; the version transformers asks for (FLASH_ATTN_KERNEL_VERSIONS).
    metadata = dict(id=namespace,
                    name=repo_id.partition("/")[2],
                    version=build.version,
                    license="BSD-3-Clause",
                    backend={"type": "cpu"})
    metadata["python-depends"] = []
    ops = (f"import torch\n\nops = torch.ops.{namespace}\n\n\ndef add_op_namespace_prefix(op_name: str):\n"
           f'    """Prefix op by namespace."""\n    return f"{namespace}::{{op_name}}"\n')
    exports = ("flash_attn_func", "flash_attn_varlen_func")
    init = f"from .flash_attn_interface import {', '.join(exports)}\n"
    if build.ops_exported_from is not None and build.version >= build.ops_exported_from:
        init = "from ._ops import add_op_namespace_prefix, ops\n" + init
        exports += ("add_op_namespace_prefix", "ops")
    init += f"\n__all__ = {list(exports)!r}\n"
    files = {"flash_attn_interface.py": source, "_ops.py": ops, "__init__.py": init}
    files["metadata.json"] = json.dumps(metadata, indent=2) + "\n"
    variant = pathlib.Path(root) / metadata["name"] / "build" / "torch-cpu"
    variant.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (variant / name).write_text(text)
    for schema, kernel, fake in build.ops:
        _define(namespace, schema, kernel, fake)
    return variant


def _mirror(build):
    return (pathlib.Path(__file__).parent / "hub_builds" / f"{build.package}.py").read_text()


def hub_kernel_name(repo_id):
    """The name of ``repo_id``'s local build (a key of HUB_BUILDS): its module's in sys.modules, its ops' namespace."""
    build = HUB_BUILDS[repo_id]
    return f"_{build.package}_" + hashlib.sha256(_mirror(build).encode()).hexdigest()[:7]


def use_hub_kernel(monkeypatch, tmp_path_factory_or_root, repo_id="kernels-community/flash-attn2"):
    """Make transformers load ``repo_id`` (a key of HUB_BUILDS) from its local kernel repository (build_hub_kernel,
    built once per process under a pytest tmp_path_factory's new folder or the given root) for the rest of the test;
    return the kernel module.

    Sets LOCAL_KERNELS and HF_HUB_OFFLINE, lets transformers use the installed ``kernels``, clears transformers'
    cached flash functions and ``repo_id``'s attention registrations (monkeypatch restores all of it), and loads the
    kernel with ``lazy_import_flash_attention(repo_id)``, which registers ``repo_id`` in ALL_ATTENTION_FUNCTIONS. A
    model runs the kernel once ``model.config._attn_implementation = repo_id``.
    """
    import huggingface_hub.constants
    import kernels
    import transformers.integrations.hub_kernels as hub_kernels
    import transformers.modeling_flash_attention_utils as flash_utils
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    path = _hub_kernel_paths.get(repo_id)
    if path is None or not path.exists():
        root = tmp_path_factory_or_root
        root = root.mktemp("hub_kernel") if hasattr(root, "mktemp") else pathlib.Path(root)
        path = _hub_kernel_paths[repo_id] = build_hub_kernel(root, repo_id)
    monkeypatch.setenv("LOCAL_KERNELS", f"{repo_id}={path}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import; kernels reads this
    # transformers binds get_kernel_hub only where the kernels release it asks for is installed when it imports (5.22.2:
    # >= 0.17.2, < 0.18; 5.24: 0.18; 5.25: 0.19). Each release's get_kernel(repo_id, *, revision, version, user_agent,
    # trust_remote_code, ...) takes what transformers passes and loads LOCAL_KERNELS repositories alike, so the check
    # is relaxed here and get_kernel_hub bound to the installed one.
    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(hub_kernels, "get_kernel_hub", kernels.get_kernel, raising=False)
    _clear_lazy_flash(monkeypatch, flash_utils)
    for interface in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):  # registrations go to a copy
        mapping = {key: value for key, value in type(interface)._global_mapping.items() if key != repo_id}
        monkeypatch.setattr(type(interface), "_global_mapping", mapping)
    flash_utils.lazy_import_flash_attention(repo_id)
    return kernels.get_kernel(repo_id, version=HUB_BUILDS[repo_id].version)


def _clear_lazy_flash(monkeypatch, flash_utils):
    for name in _LAZY_FLASH_NAMES:
        if hasattr(flash_utils, name):
            monkeypatch.setattr(flash_utils, name, None)


def _distribution_file(name):
    """The installed path of one of flash-attn's files, or ImportError with the install hint."""
    try:
        files = importlib.metadata.distribution("flash-attn").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    path = next((file.locate() for file in files if file.as_posix() == name), None)
    if path is None or not pathlib.Path(path).is_file():
        raise ImportError(f"flash-attn 2.8.3's {name} is not installed; install its Python layer with: {INSTALL_HINT}")
    return path


def _define(namespace, schema, cpu_kernel, fake_kernel):
    """Define the op ``schema`` in ``namespace`` with a CPU and a fake kernel, once per process; where the op exists
    already (flash-attn 3's own), add the CPU kernel only. The kernels get every argument by its schema name."""
    name = schema.split("(", 1)[0]
    if (namespace, name) in _defined:
        return
    if namespace not in _libraries:
        _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    library = _libraries[namespace]
    defined_here = not hasattr(getattr(torch.ops, namespace), name)
    if defined_here:
        library.define(schema)
    arguments = getattr(getattr(torch.ops, namespace), name).default._schema.arguments

    def by_name(kernel):

        def run(*args, **kwargs):
            # The dispatcher leaves out trailing arguments that equal their defaults.
            values = {argument.name: argument.default_value for argument in arguments}
            values.update(zip((argument.name for argument in arguments), args), **kwargs)
            return kernel(**values)

        return run

    library.impl(name, _outside_autocast(by_name(cpu_kernel)), "CPU")
    if defined_here:
        torch.library.register_fake(f"{namespace}::{name}", by_name(fake_kernel), lib=library)
    _defined.add((namespace, name))


def _check_fa3(cu_seqlens_q, cu_seqlens_k, others):
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise NotImplementedError("the CPU flash-attn 3 stand-in takes cu_seqlens_q and cu_seqlens_k together")
    if others.get("attention_chunk", 0) != 0:
        raise NotImplementedError(
            f"the CPU flash-attn 3 stand-in has no attention_chunk; got {others['attention_chunk']}")
    for name in _FA3_UNSUPPORTED:
        if others.get(name) is not None:
            raise NotImplementedError(f"the CPU flash-attn 3 stand-in does not take {name}")


def _fa3_scale(q, softmax_scale):
    return q.shape[-1]**-0.5 if softmax_scale is None else softmax_scale


def _into(buffer, result):
    """result, written into buffer where the caller passed one (flash-attn's out, dq, dk, dv)."""
    return result if buffer is None else buffer.copy_(result)


def _gradient_buffers(q, k, v, dq, dk, dv):
    return [torch.empty_like(tensor) if grad is None else grad for grad, tensor in ((dq, q), (dk, k), (dv, v))]


def _workspaces(q, count):
    """flash-attn 3's split and accumulation results (out_accum, softmax_lse_log2, dq_accum, ...): empty here."""
    return [q.new_empty((0, ), dtype=torch.float32) for _ in range(count)]


def _lse_shape(q, cu_seqlens_q):
    """softmax_lse: [batch, heads, seqlen_q], or [heads, total_q] for varlen."""
    return (q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens_q is None else (q.shape[1], q.shape[0])


def _softmax_d(q, cu_seqlens_q):
    """An empty softmax_d as attention_stash_flash's backwards lay it out."""
    if cu_seqlens_q is None:
        shape = (q.shape[0], q.shape[2], _round_up(q.shape[1]))
    else:
        shape = (q.shape[1], q.shape[0] + _ROW_BLOCK * (cu_seqlens_q.shape[0] - 1))
    return q.new_empty(shape, dtype=torch.float32)


def _fa3_forward_cpu(q,
                     k,
                     v,
                     out,
                     cu_seqlens_q,
                     cu_seqlens_k,
                     max_seqlen_q,
                     max_seqlen_k,
                     softmax_scale,
                     is_causal,
                     window_size_left,
                     window_size_right,
                     softcap,
                     s_aux=None,
                     **others):
    """flash_attn_3::fwd: out (q's shape and dtype), softmax_lse float32 (see _lse_shape), empty out_accum and
    softmax_lse_accum. vLLM's fwd takes attention sinks (s_aux, one per head) into each row's normaliser and
    log-sum-exp, as its kernel does; its bwd is flash-attn 3's, from that log-sum-exp."""
    _check_fa3(cu_seqlens_q, cu_seqlens_k, others)
    options = (0.0, _fa3_scale(q, softmax_scale), is_causal, window_size_left, window_size_right, softcap)
    if cu_seqlens_q is None:
        result, softmax_lse, _, _ = flash_forward_cpu(q, k, v, *options, None, False, s_aux)
    else:
        result, softmax_lse, _, _ = flash_varlen_forward_cpu(q,
                                                             k,
                                                             v,
                                                             cu_seqlens_q,
                                                             cu_seqlens_k,
                                                             max_seqlen_q,
                                                             max_seqlen_k,
                                                             *options,
                                                             sinks=s_aux)
    return _into(out, result), softmax_lse, *_workspaces(q, 2)


def _fa3_forward_fake(q, out, cu_seqlens_q, cu_seqlens_k, s_aux=None, **others):
    _check_fa3(cu_seqlens_q, cu_seqlens_k, others)
    out = torch.empty_like(q) if out is None else out
    return out, q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32), *_workspaces(q, 2)


def _fa3_backward_cpu(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                      deterministic, **others):
    """flash_attn_3::bwd: writes dq, dk, dv in place and returns them, softmax_d float32 (as the flash-attn 2
    stand-ins lay it out) and four empty workspaces (softmax_lse_log2, dq_accum, dk_accum, dv_accum)."""
    _check_fa3(cu_seqlens_q, cu_seqlens_k, others)
    dq, dk, dv = _gradient_buffers(q, k, v, dq, dk, dv)
    options = (0.0, _fa3_scale(q, softmax_scale), is_causal, window_size_left, window_size_right, softcap, None,
               deterministic)
    if cu_seqlens_q is None:
        softmax_d = flash_backward_cpu(dout, q, k, v, out, softmax_lse, dq, dk, dv, *options)
    else:
        softmax_d = flash_varlen_backward_cpu(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, *options)
    return dq, dk, dv, softmax_d, *_workspaces(q, 4)


def _fa3_backward_fake(q, k, v, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, **others):
    _check_fa3(cu_seqlens_q, cu_seqlens_k, others)
    return *_gradient_buffers(q, k, v, dq, dk, dv), _softmax_d(q, cu_seqlens_q), *_workspaces(q, 4)


def _hub_forward_cpu(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left,
                     window_size_right, softcap, return_softmax, gen):
    result, *rest = flash_forward_cpu(q, k, v, p_dropout, softmax_scale, is_causal, window_size_left,
                                      window_size_right, softcap, alibi_slopes, return_softmax)
    return [_into(out, result), *rest]


def _hub_varlen_forward_cpu(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
                            max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
                            window_size_left, window_size_right, softcap, return_softmax, gen):
    result, *rest = flash_varlen_forward_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
                                             softcap, alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k,
                                             zero_tensors)
    return [_into(out, result), *rest]


def _hub_backward_cpu(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale, is_causal,
                      window_size_left, window_size_right, softcap, deterministic, gen, rng_state):
    dq, dk, dv = _gradient_buffers(q, k, v, dq, dk, dv)
    softmax_d = flash_backward_cpu(dout, q, k, v, out, softmax_lse, dq, dk, dv, p_dropout, softmax_scale, is_causal,
                                   window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                   rng_state)
    return [dq, dk, dv, softmax_d]


def _hub_varlen_backward_cpu(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                             max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
                             window_size_left, window_size_right, softcap, deterministic, gen, rng_state):
    dq, dk, dv = _gradient_buffers(q, k, v, dq, dk, dv)
    softmax_d = flash_varlen_backward_cpu(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
                                          window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                          rng_state, zero_tensors)
    return [dq, dk, dv, softmax_d]


def _hub_forward_fake(q, out, cu_seqlens_q=None, **others):
    """fwd and varlen_fwd on the meta device."""
    out = torch.empty_like(q) if out is None else out
    softmax_lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return [out, softmax_lse, q.new_empty((0, )), q.new_empty((2, ), dtype=torch.int64)]


def _hub_backward_fake(q, k, v, dq, dk, dv, cu_seqlens_q=None, **others):
    """bwd and varlen_bwd on the meta device."""
    return [*_gradient_buffers(q, k, v, dq, dk, dv), _softmax_d(q, cu_seqlens_q)]


def _hub_fa3_backward_cpu(**arguments):
    """kernels-community/flash-attn3's bwd: flash_attn_3::bwd's stand-in, returning softmax_d and the workspaces."""
    _, _, _, softmax_d, *workspaces = _fa3_backward_cpu(**arguments)
    return softmax_d, *workspaces


def _hub_fa3_backward_fake(**arguments):
    _, _, _, softmax_d, *workspaces = _fa3_backward_fake(**arguments)
    return softmax_d, *workspaces


@dataclasses.dataclass(frozen=True)
class HubBuild:
    """A Hub build the tests mirror: its package (its mirror is hub_builds/<package>.py), its compiled ops as (schema,
    CPU kernel, fake kernel), and the version from which the real package's __init__ also exports its _ops module's
    ``ops`` and ``add_op_namespace_prefix`` (None: none does)."""

    package: str
    ops: tuple
    ops_exported_from: int = None

    @property
    def version(self):
        """The version transformers asks for (5.25: flash-attn2 4, flash-attn3 2, vllm-flash-attn3 1), which the local
        build carries; its mirror's docstring says which version's files it was read at."""
        from transformers.integrations.hub_kernels import get_attn_kernel_version

        return get_attn_kernel_version("kernels-community/" + self.package.replace("_", "-"))


_FA2_CPU_KERNELS = (_hub_forward_cpu, _hub_varlen_forward_cpu, _hub_backward_cpu, _hub_varlen_backward_cpu)
HUB_BUILDS = {
    "kernels-community/flash-attn2":
    HubBuild(
        "flash_attn2",
        tuple(
            zip(_FA2_OPS, _FA2_CPU_KERNELS,
                (_hub_forward_fake, _hub_forward_fake, _hub_backward_fake, _hub_backward_fake)))),
    "kernels-community/flash-attn3":
    HubBuild("flash_attn3", ((_FA3_FWD, _fa3_forward_cpu, _fa3_forward_fake),
                             (_HUB_FA3_BWD, _hub_fa3_backward_cpu, _hub_fa3_backward_fake)),
             ops_exported_from=2),
    "kernels-community/vllm-flash-attn3":
    HubBuild("vllm_flash_attn3", ((_VLLM_FA3_FWD, _fa3_forward_cpu, _fa3_forward_fake),
                                  (_VLLM_FA3_BWD, _fa3_backward_cpu, _fa3_backward_fake))),
}
