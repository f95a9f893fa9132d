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
        "plain recompute", "stash 1 layers", "stash 2 layers", "non-reentrant recompute", "stash 2, non-reentrant",
        "selective AC (SDPA)"
    ]
    # Each arm ran twice from the same weights on the same batches: the CPU losses are bitwise equal.
    assert result["loss_cross_arm"] == 0 and result["loss_repeat_noise"] == 0
    assert result["sdpa_backend"] == "FLASH_ATTENTION"  # the CPU kernel the stash replays
    for arm in arms.values():
        assert len(arm["run_medians_ms"]) == 2 and len(arm["losses"]) == 2
    formula = 1 * 8 * 64 * (64 * 4 + 4)  # micro-batch x heads x sequence x (head dim x fp32 bytes + FP32 LSE)
    assert result["kept_bytes_predicted"] == formula
    assert arms["stash 1 layers"]["kept_bytes"] == formula and arms["stash 2 layers"]["kept_bytes"] == 2 * formula
    # Every step of both runs of each stashed arm was served: (1 warm-up + 1 timed) steps x 2 runs x layers.
    assert arms["stash 1 layers"]["recomputes_served"] == 4 and arms["stash 2 layers"]["recomputes_served"] == 8
    assert arms["stash 2, non-reentrant"]["recomputes_served"] == 8
    assert arms["stash 2, non-reentrant"]["kept_bytes"] == 2 * formula
    assert arms["stash 2, non-reentrant"]["baseline"] == "non-reentrant recompute"
    table = capsys.readouterr().out.rsplit("\n\n", 2)
    assert "arms agree" in table[-1] and "selective AC (SDPA)" in table[-2]


def test_bench_padded_batches(bench, tmp_path):
    path = tmp_path / "bench.json"
    bench.main([
        "--layers", "2", "--sequence", "64", "--steps", "1", "--experts", "2", "--no-sac", "--pad-fraction", "0.5",
        "--json",
        str(path)
    ])
    result = json.loads(path.read_text())
    assert result["settings"]["pad_fraction"] == 0.5 and result["loss_cross_arm"] == 0
    assert [arm["recomputes_served"] for arm in result["arms"]] == [0, 4, 8]


def test_bench_fails_a_stash_that_does_not_serve(bench, monkeypatch):
    """A stash that fell back to the normal recompute would time plain recompute under its name: the run stops."""
    from deepspeed.runtime.activation_checkpointing import attention_stash

    def plain_attention(call, *args, **kwargs):
        # Counted as a call of each pass, keeping nothing: the stash's own call-count check passes.
        call.calls += 1
        if call.passes == 1:
            call.kept.append(None)
        return attention_stash._SDPA(*args, **kwargs)

    monkeypatch.setattr(attention_stash._CheckpointCall, "sdpa", plain_attention)
    with pytest.raises(RuntimeError,
                       match=r"needs the stash to serve every recompute of stash \d layers, got 0 of \d layers"):
        bench.main(["--layers", "2", "--sequence", "64", "--steps", "1", "--experts", "2", "--no-sac"])


def _fake_runs(bench, device, saved_ms):
    """Results shaped as a run on ``device`` reports them: CUDA has peak allocated, no RSS and no live-tensor bytes."""
    settings = {**bench.PRESETS["qwen3-30b-a3b" if device == "cuda" else "cpu"], "pad_fraction": 0.0}
    arms = [
        dict(label="plain recompute", kind="plain", stashed=0),
        dict(label="stash 4 layers", kind="stash", stashed=4),
        dict(label="stash 8 layers", kind="stash", stashed=8),
        dict(label="non-reentrant recompute", kind="non_reentrant", stashed=0),
        dict(label="selective AC (SDPA)", kind="selective", stashed=0),
    ]
    base = {"plain": 1000.0, "non_reentrant": 1010.0, "selective": 995.0}
    runs = []
    for arm in arms + arms[::-1]:
        median = base.get(arm["kind"], 1000.0 - saved_ms * arm["stashed"])
        runs.append((arm["label"], {
            "recomputes_served": arm["stashed"] * 8,
            "times_ms": [median - 1.0, median, median + 1.0],
            "median_ms": median,
            "losses": [2.5] * 8,
            "kept_bytes": arm["stashed"] * 136_314_880,
            "peak_allocated_bytes": 60 * 2**30 + arm["stashed"] * 136_314_880 if device == "cuda" else None,
            "peak_rss_bytes": None if device == "cuda" else 2**30,
            "peak_live_bytes": None if device == "cuda" else 2**29 + arm["stashed"] * 136_314_880,
        }))
    return settings, arms, runs


def test_report_of_a_gpu_run(bench, tmp_path):
    """The GPU preset's results (peak allocated, no RSS) make a table, JSON-able rows and a plot, without a GPU."""
    settings, arms, runs = _fake_runs(bench, "cuda", saved_ms=0.9)
    by_arm, repeat_noise, cross_arm = bench.summarize(settings, arms, runs, attention_ms=0.93)
    table = bench.format_table(settings, by_arm, 0.93, "CUDNN_ATTENTION", 136_314_880, repeat_noise, cross_arm)
    json.dumps(by_arm)
    assert "peak alloc" in table and "peak RSS" not in table and "NOISY" not in table
    assert "= 97% of the attention forward" in table
    stashed = next(row for row in by_arm if row["label"] == "stash 8 layers")
    assert stashed["peak_rss_bytes"] is None and stashed["peak_allocated_bytes"] == 60 * 2**30 + 8 * 136_314_880
    bench.plot(str(tmp_path / "bench.png"), settings, by_arm)
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_report_calls_a_saving_beyond_the_attention_forward_noisy(bench):
    """A saving of more than the attention forward plus the noise: the machine moved the timings, not the stash."""
    settings, arms, runs = _fake_runs(bench, "cpu", saved_ms=2.0)
    by_arm, repeat_noise, cross_arm = bench.summarize(settings, arms, runs, attention_ms=0.93)
    table = bench.format_table(settings, by_arm, 0.93, "FLASH_ATTENTION", 136_314_880, repeat_noise, cross_arm)
    assert table.count("NOISY: more than the attention forward (0.93 ms) plus the noise allows") == 2


def test_host_benchmark_runs_and_counts_what_it_served(capsys):
    """Bookkeeping only: the host benchmark's few pairs run in both modes, every recompute is served, the tables and
    the modes' comparison come out."""
    sys.path.insert(0, BENCHMARKS)
    try:
        import attention_stash_host
        attention_stash_host.main(["--pairs", "4", "--warmup", "1", "--profile", "2"])
    finally:
        sys.path.remove(BENCHMARKS)
    out = capsys.readouterr().out
    for mode in ("reentrant", "non-reentrant"):
        section = out.partition(f"\n{mode} checkpointing: plain step")[2]
        for part in ("all 8 stashed: step", "first pass", "recompute", "backward other", "4 unstashed layers pay"):
            assert part in section
        assert f"host cost of the stash, {mode}:" in section
    assert "non-reentrant against reentrant: " in out and "times target" in out
    # The profiles: plain runs F.sdpa's kernel in both passes; the stash runs it once and replays it in its node, which
    # a non-reentrant checkpoint's first pass applies too. Each row: a part, then per model "<calls> x, <us>" or "-".
    profiles = out.split("\nattention's own work per layer and step")[1:]
    assert len(profiles) == 2
    for profile, node_calls in zip(profiles, ("1", "2")):
        rows = {line[:34].strip(): line[34:].split() for line in profile.splitlines()[3:8]}
        assert rows["fused forward kernel"][0:4:3] == ["2", "1"]
        assert rows["stash's node"][:2] == ["-", node_calls]
        assert rows["attention node in the backward"][0:4:3] == ["1", "1"]
