# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash on attn_implementation="flash_attention_4" with the real flash-attn 4 (``flash_attn.cute`` from a
flash-attn-4 pre-release) on a GPU it runs on: Hopper or datacenter Blackwell. Skipped, with the reason, elsewhere;
test_attention_stash_flash4.py runs the same steps on CPU through the test double. tests/benchmarks/gpu_check.sh
reports it skipped on a lent device (flash-attn 4's GPU stack, a 92 MB CUTLASS DSL wheel, cannot travel there): run
it where flash-attn 4 is installed.

A stock step and a stashed one, with FLASH_ATTENTION_DETERMINISTIC=1 (Hugging Face passes flash-attn 4 deterministic
from it: its backward is deterministic only then), have the same loss and gradients bitwise; the calls of flash-attn
4's kernel functions, ``_flash_attn_fwd`` and ``_flash_attn_bwd`` (its autograd functions look them up in the module
at each call), are counted: the stash skips the recompute's forward. Nothing here imports flash-attn 2, which would
shadow flash-attn 4's ``flash_attn`` package.
"""

import functools
import importlib.metadata
import os
import types
from collections import Counter

import pytest
import torch
from packaging.version import Version

from attention_stash_helpers import assert_same_grads, checkpointed, gpt_oss_model, llama_model, param_grads

DEVICE = "cuda"
DTYPE = torch.bfloat16
IMPLEMENTATION = "flash_attention_4"
# flash-attn 4's kernels: Hopper (9.x) and datacenter Blackwell (10.x, 11.x); 12.x has no deterministic backward,
# and no backward for the sinks.
ARCHES = (9, 10, 11)
# A head dimension flash-attn 4 takes on each of them (interface.py, _validate_head_dims).
HEAD_DIM = 64
# The first release whose backward gives gpt-oss's sinks their gradient.
SINKS_TRAIN = Version("4.0.0b26")
# Documents of a packed batch: one row of 64 tokens, as test_attention_stash_flash.py packs them.
DOCUMENTS = (24, 40)
MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
# Set to "required" where flash-attn 4 is meant to run (a GPU with it installed), a test that cannot run here fails,
# with the reason, instead of skipping.
REQUIRED = "ATTENTION_STASH_FLASH_ATTN_4"


@functools.cache
def unavailable():
    """Why the real flash-attn 4 cannot run here, or None where it can."""
    if not torch.cuda.is_available():  #ignore-cuda
        return "the real flash-attn 4 needs CUDA"
    major, minor = torch.cuda.get_device_capability()  #ignore-cuda
    if major not in ARCHES:
        return f"flash-attn 4 runs on compute capability 9.x, 10.x or 11.x, got {major}.{minor}"
    try:
        release = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return "no flash-attn-4 distribution is installed (pip install --pre flash-attn-4)"
    try:
        import flash_attn.cute.interface as interface
    except Exception as error:
        return f"flash_attn.cute does not import (flash-attn-4 {release}): {type(error).__name__}: {error}"
    expected = importlib.metadata.distribution("flash-attn-4").locate_file("flash_attn/cute/interface.py")
    if os.path.realpath(interface.__file__) != os.path.realpath(expected):
        return f"flash_attn.cute.interface is {interface.__file__}, not flash-attn-4 {release}'s {expected}"
    return None


@pytest.fixture
def flash4(monkeypatch):
    """flash-attn 4's kernel functions, counted (``calls``), and its release (``release``), deterministic."""
    reason = unavailable()
    if reason and os.environ.get(REQUIRED) == "required":
        pytest.fail(f"{REQUIRED}=required, and {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)
    import flash_attn.cute.interface as interface

    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    calls = Counter()
    for name in ("_flash_attn_fwd", "_flash_attn_bwd"):
        function = getattr(interface, name)

        # functools.wraps: the stash's install reads the parameters through __wrapped__ (inspect.signature follows
        # it), and each kernel function reads its compiled kernels from its compile_cache attribute through the
        # module's name, which the wrapper's __dict__ shares.
        @functools.wraps(function)
        def counted(*args, _function=function, _name=name, **kwargs):
            calls[_name] += 1
            return _function(*args, **kwargs)

        monkeypatch.setattr(interface, name, counted)
    return types.SimpleNamespace(calls=calls, release=Version(importlib.metadata.version("flash-attn-4")))


# name: (model, attention layers), built on CPU.
MODELS = {
    "llama": (lambda use_reentrant: checkpointed(llama_model(DTYPE, head_dim=HEAD_DIM), use_reentrant), 3),
    "gpt_oss_trained_sinks":
    (lambda use_reentrant: checkpointed(gpt_oss_model(DTYPE, head_dim=HEAD_DIM), use_reentrant), 2),
}


def make_batch(kind):
    """A plain batch of two rows, or one row of documents packed as DataCollatorWithFlattening packs them."""
    generator = torch.Generator().manual_seed(1)
    if kind == "plain":
        ids = torch.randint(0, 128, (2, 32), generator=generator)
        inputs = dict(input_ids=ids, labels=ids)
    else:
        ids = torch.randint(0, 128, (1, sum(DOCUMENTS)), generator=generator)
        labels = ids.clone()
        labels[0, DOCUMENTS[0]] = -100
        position_ids = torch.cat([torch.arange(length) for length in DOCUMENTS]).unsqueeze(0)
        inputs = dict(input_ids=ids, position_ids=position_ids, labels=labels)
    return {key: value.to(DEVICE) for key, value in inputs.items()}


def step(model, inputs, calls):
    """A training step: its loss, the parameters' gradients, and the kernel functions' calls in it."""
    model.zero_grad(set_to_none=True)
    calls.clear()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), param_grads(model), dict(calls)


@MODES
@pytest.mark.parametrize("name, kind", [("llama", "plain"), ("llama", "packed"), ("gpt_oss_trained_sinks", "plain")])
def test_a_cuda_step_on_flash_attn_4_is_stock(install, flash4, name, kind, use_reentrant):
    """A stock step, then a stashed one on every attention layer: the same loss and gradients bitwise (the sinks'
    included), one forward kernel per layer where the stock step runs two, every recompute served."""
    if name == "gpt_oss_trained_sinks" and flash4.release < SINKS_TRAIN:
        pytest.skip(f"flash-attn-4 {flash4.release}'s backward gives the sinks no gradient (from {SINKS_TRAIN})")
    build, layers = MODELS[name]
    model = build(use_reentrant).to(DEVICE)
    # Hugging Face checks for CUDA when loading with flash_attention_4; set on the built model.
    model.config._attn_implementation = IMPLEMENTATION
    inputs = make_batch(kind)

    expected_loss, expected, stock_calls = step(model, inputs, flash4.calls)
    assert stock_calls == {"_flash_attn_fwd": 2 * layers, "_flash_attn_bwd": layers}
    handle = install(model, layers)
    loss, grads, calls = step(model, inputs, flash4.calls)
    assert calls == {"_flash_attn_fwd": layers, "_flash_attn_bwd": layers}
    assert (handle.recomputes_served, handle.num_kept) == (layers, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    sinks = [grad for parameter, grad in grads.items() if parameter.endswith("sinks")]
    assert len(sinks) == (layers if name == "gpt_oss_trained_sinks" else 0)
    assert all(grad.abs().sum() > 0 for grad in sinks)
