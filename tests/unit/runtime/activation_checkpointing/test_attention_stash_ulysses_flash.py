# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash under DeepSpeed's Ulysses sequence parallelism (ALST) with core "flash_attention_2", a Hub kernel
(kernels-community/vllm-flash-attn3, mirrored) or "flash_attention_4", on two ranks over gloo, on CPU over the
stand-in kernels of attention_stash_flash.py and attention_stash_flash3.py and attention_stash_flash4.py's double of
flash-attn 4's interface (at 4.0.0b40, the newest release read).

ALST's wrapper in Hugging Face's entry of the core implementation all-to-alls query, key and value to the whole
sequence and a rank's share of the heads, gathers position_ids, and calls the core flash function it captured; the
stash's entry is that core function, installed before ALST registers or behind its wrapper after. The script
attention_stash_ulysses_flash_ranks.py trains one step per case on both ranks: bitwise against ALST alone, every
recompute served without a flash forward, and one rank's bytes kept as the planner counts them; a plain batch runs
flash_attn_func, a packed one flash_attn_varlen_func over the documents of the whole sequence. flash-attn 4's model is
in bfloat16 (its kernels take half precision alone), the others' in float32; its forward kernel, a Python function
rather than an op, is counted by its runs.
"""

import os

import pytest

from attention_stash_flash import flash_attn_or_skip
from attention_stash_flash3 import flash_kernels_or_skip
from attention_stash_helpers import NUM_LAYERS, reports_of_two_ranks

MODES = ("reentrant", "non_reentrant")
ORDERS = ("stash_first", "alst_first")
KINDS = ("plain", "packed")
# Each batch kind: its micro-batch size, and the flash-attn forward op it runs.
MICRO_BATCH = {"plain": 2, "packed": 1}
OP = {"plain": "dense", "packed": "varlen"}
# Each implementation's forward kernels: flash-attn 2's ops, vLLM's build's (its namespace ends with the build's hash),
# and flash-attn 4's kernel function, of its interface's package.
NAMESPACE = {
    "flash_attention_2": "flash_attn",
    "kernels-community/vllm-flash-attn3": "_vllm_flash_attn3_",
    "flash_attention_4": "flash_attn.cute"
}
# The bytes of an element of each implementation's model (and attention output): float32 but for flash-attn 4's
# bfloat16; the log-sum-exp is float32 in all.
ELEMENT_BYTES = {"flash_attention_4": 2}
SEQUENCE = 32

# Hugging Face's own flash entry (flash_attention_2, over flash-attn 2's family), a Hub kernel's entry, registered
# by the lazy import (vLLM's flash-attn 3, the flash_attention_3 most Hopper users get, over flash-attn 3's family),
# and flash_attention_4 (the same entry as flash_attention_2's, over flash-attn 4's interface, the double at its newest
# release). ALST wraps the core's entry whatever build it calls: flash_attention_3's entry is flash_attention_2's, the
# other builds' records run their steps in test_attention_stash_flash_kernels.py (merged in issue 58), and flash-attn
# 4's other records theirs in test_attention_stash_flash4.py.
IMPLEMENTATIONS = ("flash_attention_2", "kernels-community/vllm-flash-attn3", "flash_attention_4")


def _available():
    """The implementations this environment can run: flash-attn 4's double everywhere; flash-attn 2's where flash-attn
    imports (skipped, or failed where CI requires it), the Hub kernel's where the kernels package and flash-attn 3's
    interface import as well."""
    available = []
    try:
        flash_attn_or_skip()
        available.append("flash_attention_2")
        flash_kernels_or_skip()
        available.append("kernels-community/vllm-flash-attn3")
    except pytest.skip.Exception:
        pass
    return (*available, "flash_attention_4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every available implementation's cases, one after the other in one process pair (issue 58: a pair's start, its
    imports and gloo's rendezvous, cost as much as an implementation's cases), once per run: each rank's report."""
    available = _available()
    return reports_of_two_ranks(
        tmp_path_factory, "ulysses_flash_" + "_".join(name.replace("/", "_") for name in available),
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_stash_ulysses_flash_ranks.py"), *available)


@pytest.fixture(params=IMPLEMENTATIONS)
def reports(request, runs):
    """Each rank's report of one implementation (flash-attn 2's and the Hub kernel's skip, saying why, where they
    cannot run)."""
    if request.param not in runs[0]:
        flash_attn_or_skip()
        flash_kernels_or_skip()
    return [{"rank": report["rank"], "implementation": request.param, **report[request.param]} for report in runs]


def cases(reports, order, mode, kind):
    return [(report["rank"], report[f"{order}_{mode}_{kind}"]) for report in reports]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_both_install_orders_are_served_bitwise(reports, order, mode, kind):
    """One step on each rank's shard: loss and gradients bitwise equal to ALST without the stash, every layer's
    recompute served, nothing kept after the step, and no tensor alive after remove() and the model's drop (the
    digest of ALST's gathered position_ids included)."""
    for rank, case in cases(reports, order, mode, kind):
        assert case["bitwise"], rank
        assert case["served"] == NUM_LAYERS, rank
        assert case["num_kept"] == 0 and case["kept_bytes"] == 0, rank
        assert case["live"] == [], rank


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_the_planner_counts_one_ranks_bytes(reports, order, mode, kind):
    """Each rank keeps its share of the heads (2 of 4) over the whole sequence, as the planner counts it with ALST's
    registration found: the micro-batch of the step (1 for the packed batch) and the whole sequence."""
    # Micro-batch x 2 heads x 32 tokens x (16 x 4 bytes of output, 16 x 2 in bfloat16, + 4 of log-sum-exp).
    element = ELEMENT_BYTES.get(reports[0]["implementation"], 4)
    expected = MICRO_BATCH[kind] * 2 * SEQUENCE * (16 * element + 4)
    for rank, case in cases(reports, order, mode, kind):
        assert case["planned"] == expected, rank
        assert case["peak_kept_bytes"] == NUM_LAYERS * case["planned"], rank


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_the_batch_kind_picks_the_flash_op(reports, order, mode, kind):
    """The plain batch runs flash_attn_func and the packed one flash_attn_varlen_func, over the documents of the whole
    sequence that ALST's gathered position_ids mark (10 and 22 tokens), one call per layer, of the implementation's own
    kernels (flash-attn 4's kernel function _flash_attn_fwd, dense or varlen, for flash-attn 4's two functions); ALST
    alone runs it again in each recompute, the stash in none."""
    op = OP[kind]
    cu_seqlens = [[0, 10, SEQUENCE]] * NUM_LAYERS if kind == "packed" else []
    namespaces = [NAMESPACE[reports[0]["implementation"]]]
    for rank, case in cases(reports, order, mode, kind):
        stock = {
            "forward": {
                op: NUM_LAYERS
            },
            "backward": {
                op: NUM_LAYERS
            },
            "cu_seqlens": cu_seqlens,
            "namespaces": namespaces
        }
        assert case["reference_ops"] == stock, rank
        assert case["ops"] == {**stock, "backward": {}}, rank
