# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmark's bookkeeping on a tiny model: every arm trains the same, and the stash keeps what the formula says.

Nothing here is timed; speed and memory are the benchmark's to measure.
"""

import json
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks")


@pytest.fixture
def bench():
    sys.path.insert(0, BENCHMARKS)
    try:
        import attention_stash_bench
        yield attention_stash_bench
    finally:
        sys.path.remove(BENCHMARKS)


def test_bench_arms_agree_and_keep_the_formula(bench, tmp_path, capsys):
    path = tmp_path / "bench.json"
    bench.main(["--layers", "2", "--sequence", "64", "--steps", "1", "--experts", "2", "--json", str(path)])
    result = json.loads(path.read_text())
    arms = {arm["label"]: arm for arm in result["arms"]}
    assert list(arms) == [
        "plain recompute", "stash 1 layers", "stash 2 layers", "non-reentrant recompute", "selective AC (SDPA)"
    ]
    # Each arm ran twice from the same weights on the same batches: the CPU losses are bitwise equal.
    assert result["loss_cross_arm"] == 0 and result["loss_repeat_noise"] == 0
    assert result["sdpa_backend"] == "FLASH_ATTENTION"  # the CPU kernel the stash replays
    for arm in arms.values():
        assert len(arm["run_medians_ms"]) == 2 and len(arm["losses"]) == 2
    formula = 1 * 8 * 64 * (64 * 4 + 4)  # micro-batch x heads x sequence x (head dim x fp32 bytes + FP32 LSE)
    assert result["kept_bytes_predicted"] == formula
    assert arms["stash 1 layers"]["kept_bytes"] == formula and arms["stash 2 layers"]["kept_bytes"] == 2 * formula
    table = capsys.readouterr().out.rsplit("\n\n", 2)
    assert "arms agree" in table[-1] and "selective AC (SDPA)" in table[-2]
