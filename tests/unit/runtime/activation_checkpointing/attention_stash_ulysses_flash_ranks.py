# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run by test_attention_stash_ulysses_flash.py under torchrun with two ranks over gloo: the stash under DeepSpeed's
Ulysses sequence parallelism (ALST, UlyssesSPAttentionHF.register_with_transformers) with each flash implementation
given after the first argument as its core, one after the other: "flash_attention_2" (flash-attn 2's Python layer),
"flash_attention_3" (flash-attn 3's), a Hub kernel of attention_stash_flash3.HUB_BUILDS (a local repository) or
"flash_attention_4" (flash-attn 4's interface at its newest release read, 4.0.0b40), over the CPU stand-ins of
attention_stash_flash.py and attention_stash_flash3.py and the test double of attention_stash_flash4.py; each
implementation's setup is undone before the next one's.

For each implementation, each checkpoint mode and each batch kind, a tiny Llama (float32; bfloat16 on flash-attn 4,
which takes half precision alone) trains one step on each rank's shard with ALST alone, which is the reference; then
with the stash on all its layers, installed before ALST registers and with ALST registered first. The plain batch (two
samples, position_ids counting from 0) runs flash_attn_func; the packed one (one sample of two documents, position_ids
restarting at the boundary, which ALST gathers whole) runs flash_attn_varlen_func. The forward kernels are counted as
the ops they are, and flash-attn 4's as the runs of its kernel function ``_flash_attn_fwd``, a Python function. Each
rank writes its report, by implementation, as JSON to ``rank<N>.json`` in the folder given as the first argument.
"""

import functools
import gc
import json
import os
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))  # tests/: conftest imports this tree's module

import conftest  # noqa: E402,F401
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from attention_stash_flash import use_flash_attention_2  # noqa: E402
from attention_stash_flash3 import use_flash_attention_3, use_hub_kernel  # noqa: E402
from attention_stash_flash4 import use_flash_attn_4  # noqa: E402
from attention_stash_helpers import NUM_LAYERS, assert_stock_process, batch_ids, bound_arguments  # noqa: E402
from attention_stash_helpers import checkpointed  # noqa: E402
from attention_stash_helpers import live_tensors, llama_model, param_grads, tensors  # noqa: E402
from deepspeed.runtime.activation_checkpointing import attention_stash  # noqa: E402
from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu  # noqa: E402
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: E402

RANKS = 2
# The whole sequence; each rank trains its half.
SEQUENCE = 32
# The packed batch's documents, of 10 and 22 tokens: rank 0's shard holds the boundary.
DOCUMENTS = (10, 22)
# The forward ops seen by name: the kernel functions that are custom ops, and compiled forward ops called directly.
FORWARD_OPS = ("_flash_attn_forward", "_flash_attn_varlen_forward", "fwd", "varlen_fwd")

# The namespaces of those ops: flash-attn 2's and 3's, and each Hub build's, which ends with a hash of the build.
NAMESPACES = ("flash_attn", "flash_attn_3", "_flash_attn2_", "_flash_attn3_", "_vllm_flash_attn3_")

# The model's dtype by implementation, float32 for the others (their stand-ins take it): flash-attn 4 asserts half
# precision (its double does not), as the single-process tests of test_attention_stash_flash4.py run it.
DTYPES = {"flash_attention_4": torch.bfloat16}
# The FlashForwardCalls counting now, innermost last: flash-attn 4's forward kernel notes its runs in the last one.
_COUNTING = []


def forward_op(func, args, kwargs):
    """(batch kind, the query's cu_seqlens, the namespace without a build's hash) of a forward op of flash-attn 2,
    flash-attn 3 or a Hub kernel (its kernel function where that is a custom op, else the compiled op it calls); None
    for any other op."""
    namespace, _, name = func.overloadpacket._qualified_op_name.partition("::")
    family = namespace if namespace in NAMESPACES[:2] else next(
        (prefix for prefix in NAMESPACES[2:] if namespace.startswith(prefix)), None)
    if family is None or name not in FORWARD_OPS:
        return None
    # By name: the dispatcher leaves out trailing arguments that equal their defaults.
    names = (argument.name for argument in func._schema.arguments)
    cu_seqlens = {**dict(zip(names, args)), **kwargs}.get("cu_seqlens_q")
    return ("dense", None, family) if cu_seqlens is None else ("varlen", cu_seqlens, family)


def batches():
    """Each batch kind: (micro-batch size, input_ids and position_ids of the whole sequence)."""
    plain = (2, batch_ids(seed=3, batch=2, sequence=SEQUENCE), torch.arange(SEQUENCE).unsqueeze(0).expand(2, -1))
    packed_positions = torch.cat([torch.arange(length) for length in DOCUMENTS]).unsqueeze(0)
    packed = (1, batch_ids(seed=4, batch=1, sequence=SEQUENCE), packed_positions)
    return {"plain": plain, "packed": packed}


class FlashForwardCalls(TorchDispatchMode):
    """Counts the calls of flash-attn's two forward ops, by batch kind ("dense", "varlen"), and notes the query's
    cu_seqlens of each varlen call and the namespaces of the ops: one process runs several implementations, each of
    which must run its own kernels. flash-attn 4's forward kernel, not an op, notes its runs itself
    (count_flash_attn_4_forwards) in the one counting last."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()
        self.cu_seqlens = []
        self.namespaces = set()

    def __enter__(self):
        _COUNTING.append(self)
        return super().__enter__()

    def __exit__(self, *exception):
        _COUNTING.remove(self)
        return super().__exit__(*exception)

    def note(self, kind, cu_seqlens, namespace):
        """One forward kernel run: its batch kind, the query's cu_seqlens (None for a dense call), its namespace."""
        self.calls[kind] += 1
        self.namespaces.add(namespace)
        if cu_seqlens is not None:
            self.cu_seqlens.append(cu_seqlens.tolist())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        found = forward_op(func, args, kwargs or {})
        if found is not None:
            self.note(*found)
        return func(*args, **(kwargs or {}))


def count_flash_attn_4_forwards(interface, monkeypatch):
    """flash-attn 4's forward kernel function, ``_flash_attn_fwd`` of the double's ``interface`` module, a Python
    function that no dispatch mode sees as an op, replaced until ``monkeypatch`` is undone by one that notes each run
    in the FlashForwardCalls counting as forward_op describes an op's, its namespace the interface's package
    ("flash_attn.cute"). Its autograd functions and the stash look the function up in the module when they run."""
    function = interface._flash_attn_fwd

    @functools.wraps(function)
    def counted(*args, **kwargs):
        cu_seqlens = bound_arguments(function, args, kwargs)["cu_seqlens_q"]
        for counting in _COUNTING[-1:]:
            counting.note("dense" if cu_seqlens is None else "varlen", cu_seqlens, interface.__package__)
        return function(*args, **kwargs)

    monkeypatch.setattr(interface, "_flash_attn_fwd", counted)


def use_flash(flash, folder, rank, monkeypatch):
    """What the tests' fixtures do for ``flash`` under pytest, until ``monkeypatch`` is undone (each rank builds its
    own copy of the Hub kernel), and flash-attn 4's forward kernel counted."""
    if flash == "flash_attention_2":
        use_flash_attention_2(monkeypatch)
    elif flash == "flash_attention_3":
        use_flash_attention_3(monkeypatch)
    elif flash == "flash_attention_4":
        count_flash_attn_4_forwards(use_flash_attn_4(monkeypatch, "4.0.0b40"), monkeypatch)
    else:
        use_hub_kernel(monkeypatch, os.path.join(folder, f"kernel{rank}"), flash)


def flash_llama(flash, use_reentrant):
    model = checkpointed(llama_model(DTYPES.get(flash, torch.float32)), use_reentrant=use_reentrant)
    model.config._attn_implementation = flash
    return model


def register_alst(flash, model, micro_batch):
    return UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model,
                                                           core_attn_implementation=flash,
                                                           sequence_parallel_size=RANKS,
                                                           micro_batch_size=micro_batch,
                                                           seq_length_is_variable=True)


def unregister_alst(flash):
    """Back to transformers' own entry (ALST's registration writes the interface's local mapping) and no
    sequence-parallel groups, for the next registration."""
    ALL_ATTENTION_FUNCTIONS._local_mapping.pop(flash, None)
    mpu._release_sequence_parallel_groups()
    assert_stock_process()


def shard(tensor, rank):
    length = tensor.shape[1] // RANKS
    return tensor[:, rank * length:(rank + 1) * length]


def step(model, batch, rank):
    """One training step on this rank's shard: the loss, the gradients, flash-attn's forward kernels called in the
    forward and in the backward (the recomputes), and the cu_seqlens of the forward's varlen calls."""
    _, ids, positions = batch
    model.zero_grad(set_to_none=True)
    with FlashForwardCalls() as forward:
        logits = model(input_ids=shard(ids, rank), position_ids=shard(positions, rank)).logits
    loss = logits.float().pow(2).mean()
    with FlashForwardCalls() as backward:
        loss.backward()
    calls = {
        "forward": dict(forward.calls),
        "backward": dict(backward.calls),
        "cu_seqlens": forward.cu_seqlens,
        "namespaces": sorted(forward.namespaces | backward.namespaces)
    }
    return loss.detach(), param_grads(model), calls


def same(first, second):
    """Whether two steps' losses and gradients are bitwise equal."""
    return torch.equal(first[0], second[0]) and first[1].keys() == second[1].keys() and all(
        torch.equal(grad, second[1][name]) for name, grad in first[1].items())


def live_once_gloo_lets_go(before):
    """live_tensors(before), once gloo has let go of the step's collectives: a gloo worker thread completes a
    collective's work, which returns the caller's wait(), and only then drops its own reference to the work, which
    holds the collective's tensors (ProcessGroupGloo::runLoop resets workInProgress_ after execute). On a loaded
    machine that can come after the count, which then sees the buffer of ALST's last all-to-all (seen under the
    shuffled suite on two workers: [2, 16, 1, 32] for a packed batch, ws x local sequence x batch x a rank's
    embedding). So the count repeats for up to 5 s until nothing is left; a tensor anything else holds stays
    reported."""
    deadline = time.monotonic() + 5
    live = live_tensors(before)
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = live_tensors(before)
    return live


def cases(flash, rank, use_reentrant, kind, batch, report):
    """ALST alone, then the stash on every layer installed before and after ALST's registration."""
    micro_batch = batch[0]
    mode = "reentrant" if use_reentrant else "non_reentrant"
    model = flash_llama(flash, use_reentrant)
    register_alst(flash, model, micro_batch)
    reference = step(model, batch, rank)
    del model
    unregister_alst(flash)
    before = tensors()
    for order in ("stash_first", "alst_first"):
        model = flash_llama(flash, use_reentrant)
        if order == "stash_first":
            handle = attention_stash.install_attention_stash(model, NUM_LAYERS, sequence_parallel_size=RANKS)
            register_alst(flash, model, micro_batch)
        else:
            register_alst(flash, model, micro_batch)
            handle = attention_stash.install_attention_stash(model, NUM_LAYERS)
        result = step(model, batch, rank)
        report[f"{order}_{mode}_{kind}"] = {
            "bitwise": same(result, reference),
            "served": handle.recomputes_served,
            "num_kept": handle.num_kept,
            "kept_bytes": handle.kept_bytes,
            "peak_kept_bytes": handle.peak_kept_bytes,
            # One rank's bytes per layer, from the ALST registration found: its share of the heads over the whole
            # sequence.
            "planned": attention_stash.attention_stash_layer_bytes(model, micro_batch, SEQUENCE, device="cpu"),
            "reference_ops": reference[2],
            "ops": result[2],
        }
        handle.remove()
        unregister_alst(flash)
        del handle, model, result
        # What the step left alive once the stash is removed and the model dropped: nothing.
        report[f"{order}_{mode}_{kind}"]["live"] = live_once_gloo_lets_go(before)


def main():
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    report = {"rank": rank}
    for flash in sys.argv[2:]:
        monkeypatch = pytest.MonkeyPatch()
        use_flash(flash, sys.argv[1], rank, monkeypatch)
        report[flash] = {}
        for use_reentrant in (True, False):
            for kind, batch in batches().items():
                # As conftest.py's fixture before each test: each case's collections see only what was made since.
                gc.collect()
                gc.freeze()
                cases(flash, rank, use_reentrant, kind, batch, report[flash])
        monkeypatch.undo()
        assert_stock_process()
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as file:
        json.dump(report, file)
    dist.barrier()


if __name__ == "__main__":
    main()
