# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmark's bookkeeping on a tiny model: every arm trains the same, and the stash keeps what the formula says.

Nothing here is timed; speed and memory are the benchmark's to measure.
"""

import json
import os
import re
import sys
import time

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from attention_stash_helpers import FORWARD_LAYOUT, run_on_two_ranks

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks")

# The real runs here use the CPU preset, which needs DeepSpeed's accelerator to be the CPU; on a GPU machine
# tests/benchmarks/gpu_check.sh runs the GPU preset instead.
on_cpu_accelerator = pytest.mark.skipif(get_accelerator().device_name() != "cpu",
                                        reason="the benchmark's CPU preset needs DeepSpeed's CPU accelerator")
# The compiled runs' model. transformers 5.22's Qwen3-MoE experts (torch.ops.transformers.grouped_mm_fallback, whose
# backward reads a tensor's value) break dynamo's graph inside the checkpointed layer, where the stash refuses
# (test_attention_stash_compile.py pins that refusal); its Llama compiles whole, as both models do from 5.23.
COMPILED_MODEL = [] if FORWARD_LAYOUT else ["--preset", "llama-long-cpu"]


@pytest.fixture
def bench():
    sys.path.insert(0, BENCHMARKS)
    try:
        import attention_stash_bench
        yield attention_stash_bench
    finally:
        sys.path.remove(BENCHMARKS)


@on_cpu_accelerator
def test_bench_arms_agree_and_keep_the_formula(bench, tmp_path, capsys):
    path = tmp_path / "bench.json"
    started = time.perf_counter()
    bench.main([
        "--layers", "2", "--sequence", "64", "--steps", "1", "--experts", "2", "--json",
        str(path), "--plot",
        str(tmp_path / "bench.png")
    ])
    elapsed = time.perf_counter() - started
    result = json.loads(path.read_text())
    arms = {arm["label"]: arm for arm in result["arms"]}
    assert list(arms) == [
        "plain recompute", "stash 1 layers", "stash 2 layers", "non-reentrant recompute", "stash 2, non-reentrant",
        "selective AC (TRL)"
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
    out = capsys.readouterr().out
    table = out.rsplit("\n\n", 3)
    assert "arms agree" in table[-1] and "selective AC (TRL)" in table[-3]
    # TRL's own selective checkpointing (requirements-dev.txt installs TRL), named above the table and in the JSON.
    import trl

    source = f"TRL {trl.__version__}'s enable_selective_activation_checkpointing"
    assert f"\nselective AC (TRL): {source}, non-reentrant (its one mode)\n" in out
    assert arms["selective AC (TRL)"]["selective_source"] == source
    # Every recompute ran the attention forwards of its unstashed layers only, selective's none.
    forwards = {label: arm["attention_forwards_in_backward"] for label, arm in arms.items()}
    assert forwards == {
        "plain recompute": 2,
        "stash 1 layers": 1,
        "stash 2 layers": 0,
        "non-reentrant recompute": 2,
        "stash 2, non-reentrant": 0,
        "selective AC (TRL)": 0
    }
    assert ("attention forwards in each backward (counted in each run's first step, untimed): plain recompute 2, "
            "stash 1 layers 1, stash 2 layers 0, non-reentrant recompute 2, stash 2, non-reentrant 0, selective AC "
            "(TRL) 0\n") in out
    # The two values of each arm's first numbers column are named, and every comparison against plain carries its
    # noise (the plain row itself has none).
    title, header, _, *rows = table[-3].splitlines()
    assert title.startswith("attention stash benchmark: Qwen3-MoE 2 layers, 2 experts (top 2), sequence 64")
    assert "fwd / rev sweep (ms)" in header and "vs plain (± noise)" in header
    assert "fwd / rev sweep: the arm's median step time in the forward sweep" in table[-2]
    assert len(rows) == 6 and all(re.search(r" [+-]\d+\.\d% ± \d+\.\d%", row) for row in rows[1:])
    for comparison in result["comparisons"]:
        assert all(" ± " in part for part in comparison["parts"].values()), comparison
    # The run's wall time, printed last: the README's estimate is checked against it.
    wall = re.search(r"^wall time: (\d+) min (\d\d) s \((\d+\.\d) s\), from the start to the table",
                     out.splitlines()[-1])
    assert wall is not None, out.splitlines()[-1]
    assert 0 < result["wall_s"] <= elapsed and float(wall[3]) == round(result["wall_s"], 1)
    assert int(wall[1]) * 60 + int(wall[2]) == int(result["wall_s"])
    assert (tmp_path / "bench.png").stat().st_size > 0


@on_cpu_accelerator
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


@on_cpu_accelerator
def test_bench_hybrid_preset(bench, tmp_path, capsys):
    """The Qwen3-Next-shaped preset: three linear-attention layers per full-attention layer, so 8 layers give 2 to
    stash; every stashed attention layer's recompute is served and keeps the planner's bytes."""
    path = tmp_path / "bench.json"
    bench.main([
        "--preset", "qwen3-next-cpu", "--layers", "8", "--sequence", "64", "--steps", "1", "--experts", "2",
        "--no-sac", "--json",
        str(path)
    ])
    result = json.loads(path.read_text())
    assert result["loss_cross_arm"] == 0
    # 1 and 2 of the 2 attention layers, over a warm-up step and a timed one, in each of the two sweeps.
    assert [arm["recomputes_served"] for arm in result["arms"]] == [0, 4, 8]
    assert all(arm["kept_per_layer_bytes"] == result["kept_bytes_predicted"] for arm in result["arms"]
               if arm["stashed"])
    assert "Qwen3-Next-shaped hybrid, 8 layers (2 with softmax attention)" in capsys.readouterr().out


@on_cpu_accelerator
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
                       match=r"attention_stash_bench needs the stash to serve every recompute of stash \d layers, "
                       r"got 0 of \d layers"):
        bench.main(["--layers", "2", "--sequence", "64", "--steps", "1", "--experts", "2", "--no-sac"])


@on_cpu_accelerator
def test_bench_compiled_arms_serve_and_agree(bench, tmp_path, capsys, monkeypatch):
    """--compile: compiled non-reentrant recompute against the stash on both layers (aot_eager on CPU). Each run
    compiles in its first step, untimed like the second, which measures memory; every stashed layer's compiled graph
    saves its attention outputs, and the two arms' losses are bitwise equal: the same aten ops run, the stash's graph
    saves the attention kernel's outputs where the other recomputes them."""
    path, runs, graphs_at_step = tmp_path / "bench.json", [], []

    def recorded_run(*args, **kwargs):
        runs.append(run_arm(*args, **kwargs))
        return runs[-1]

    def counted_loss(*args, **kwargs):
        graphs_at_step.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return forward_loss(*args, **kwargs)

    run_arm, forward_loss = bench.run_arm, bench.forward_loss
    monkeypatch.setattr(bench, "run_arm", recorded_run)
    monkeypatch.setattr(bench, "forward_loss", counted_loss)
    bench.main([
        "--compile", *COMPILED_MODEL, "--layers", "2", "--sequence", "64", "--steps", "1", "--experts", "2", "--json",
        str(path), "--plot",
        str(tmp_path / "bench.png")
    ])
    graphs_at_step.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    result = json.loads(path.read_text())
    assert result["settings"]["compile"] == "aot_eager" and result["settings"]["warmup"] == 2
    arms = {arm["label"]: arm for arm in result["arms"]}
    assert list(arms) == ["compiled recompute", "compiled stash 2 layers"]
    stash = arms["compiled stash 2 layers"]
    # Both runs' graphs saved both layers' attention; the stash itself kept and served nothing.
    assert stash["compiled_layers"] == [["model.layers.0", "model.layers.1"]] * 2
    assert stash["recomputes_served"] == 0 and stash["kept_bytes"] == 0
    assert arms["compiled recompute"]["compiled_layers"] == [[], []]
    assert result["loss_cross_arm"] == 0 and result["loss_repeat_noise"] == 0
    # No global warm-up: four runs of 2 untimed steps and 1 timed one, dynamo compiling in each run's first step alone
    # (the graphs it compiled so far, before each step and after the last).
    assert [(len(run["losses"]), len(run["times_ms"])) for run in runs] == [(3, 1)] * 4
    for run in range(4):
        before, *after = graphs_at_step[3 * run:3 * run + 4]
        assert before < after[0] == after[1] == after[2], graphs_at_step
    assert (tmp_path / "bench.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "Left out: the reentrant arms" in out and "selective AC (TRL)," in out
    title, header, _, *rows = out.rsplit("\n\n", 3)[-3].splitlines()
    model = "Qwen3-MoE 2 layers, 2 experts (top 2)" if FORWARD_LAYOUT else "Llama 2 dense layers"
    assert title.startswith(f"attention stash benchmark: {model}, sequence 64, micro-batch ")
    assert (", float32 on cpu, compiled (torch.compile, backend aot_eager, dynamic=False, non-reentrant checkpointing"
            in title)
    assert "peak RSS" in header and "peak live" not in header and len(rows) == 2
    assert "compiled layers served 2 / 2 of 2" in out and "arms agree" in out


@on_cpu_accelerator
def test_bench_fails_a_compiled_stash_that_does_not_serve(bench, monkeypatch):
    """A compiled stash whose policy recomputes the attention kernel would time compiled recompute under its name: the
    run stops."""
    from torch.utils.checkpoint import CheckpointPolicy

    from deepspeed.runtime.activation_checkpointing import attention_stash

    def recompute_everything(stash, ops, user_policy, ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    monkeypatch.setattr(attention_stash, "_compiled_policy", recompute_everything)
    with pytest.raises(RuntimeError,
                       match=r"attention_stash_bench needs the compiled graph to save the attention of every stashed "
                       r"layer of compiled stash 2 layers, got 0 of 2\."):
        bench.main(
            ["--compile", *COMPILED_MODEL, "--layers", "2", "--sequence", "64", "--steps", "1", "--experts", "2"])


@on_cpu_accelerator
def test_bench_fails_a_selective_arm_that_recomputes_attention(bench, monkeypatch):
    """A selective arm whose policy did not take (plain non-reentrant checkpointing under its name, as where a wrapper
    of TRL's is bypassed) would time plain recompute as selective checkpointing: the run stops at its first step."""

    def plain_instead(model, kwargs):
        bench._checkpointing(model, kwargs)
        return "plain non-reentrant checkpointing"

    monkeypatch.setattr(bench, "selective_checkpointing", plain_instead)
    with pytest.raises(RuntimeError,
                       match=r"attention_stash_bench needs selective AC \(TRL\) to run 0 attention forwards in each "
                       r"backward, got 2: its recompute ran attention it should have saved\."):
        bench.main(["--layers", "2", "--sequence", "64", "--steps", "1", "--experts", "2"])


def test_trls_policy_written_out_saves_what_trls_own_saves(bench, monkeypatch):
    """Without TRL the benchmarks write its policy out: on a tiny Llama, TRL's own selective checkpointing and the
    written-out one train bitwise alike, and neither recompute runs an attention forward."""
    from attention_stash_helpers import CPU_FORWARD, batch_ids, counted_step, llama_model

    import trl

    steps = []
    for installed in (True, False):
        if not installed:
            monkeypatch.setitem(sys.modules, "trl", None)  # import trl raises ImportError, as where it is missing
        model = llama_model()
        source = bench.selective_checkpointing(model, {"use_reentrant": False})
        assert source == (f"TRL {trl.__version__}'s enable_selective_activation_checkpointing"
                          if installed else "TRL's policy written out (TRL is not installed)")
        # TRL's wrapper is gone again: a later enable is plain.
        assert "gradient_checkpointing_enable" not in vars(model)
        ids = batch_ids()
        steps.append(counted_step(model.train(), dict(input_ids=ids, labels=ids)))
    (loss, grads, calls), (written_loss, written_grads, written_calls) = steps
    assert calls[CPU_FORWARD] == written_calls[CPU_FORWARD] == 0
    assert torch.equal(loss, written_loss) and grads.keys() == written_grads.keys()
    assert all(torch.equal(grads[name], written_grads[name]) for name in grads)


@pytest.mark.parametrize("options, message", [
    (["--warmup", "1"], "--compile needs at least 2 warm-up steps: the first compiles, the second measures memory"),
    (["--autoep"], "--compile takes no --sequence-parallel and no --autoep"),
])
def test_bench_refuses_what_it_cannot_run_compiled(bench, capsys, options, message):
    with pytest.raises(SystemExit):
        bench.parse_args(["--compile", *options])
    assert message in capsys.readouterr().err


def _fake_runs(bench, device, saved_ms, spread_ms=1.0):
    """Results shaped as a run on ``device`` reports them: CUDA has peak allocated, no RSS and no live-tensor bytes.

    Each run's steps are its median and the median -/+ ``spread_ms``: an interquartile range of 1.5 x ``spread_ms``
    over an arm's two runs. A stash arm is ``saved_ms`` per stashed layer faster than its recompute.
    """
    settings = {**bench.PRESETS["qwen3-30b-a3b" if device == "cuda" else "cpu"], "pad_fraction": 0.0}
    arms = [
        dict(label="plain recompute", kind="plain", stashed=0),
        dict(label="stash 4 layers", kind="stash", stashed=4),
        dict(label="stash 8 layers", kind="stash", stashed=8),
        dict(label="non-reentrant recompute", kind="non_reentrant", stashed=0),
        dict(label="stash 8, non-reentrant", kind="stash_nr", stashed=8),
        dict(label="selective AC (TRL)", kind="selective", stashed=0),
    ]
    base = {"plain": 1000.0, "non_reentrant": 1010.0, "selective": 995.0}
    runs = []
    for arm in arms + arms[::-1]:
        if arm["kind"] in bench.STASH_KINDS:
            median = base[bench.STASH_KINDS[arm["kind"]]] - saved_ms * arm["stashed"]
        else:
            median = base[arm["kind"]]
        runs.append((arm["label"], {
            "recomputes_served":
            arm["stashed"] * 8,
            "offloaded_bytes":
            0,
            "restored_bytes":
            0,
            "times_ms": [median - spread_ms, median, median + spread_ms],
            "median_ms":
            median,
            "losses": [2.5] * 8,
            "kept_bytes":
            arm["stashed"] * 136_314_880,
            "peak_allocated_bytes":
            60 * 2**30 + arm["stashed"] * 136_314_880 if device == "cuda" else None,
            "peak_rss_bytes":
            None if device == "cuda" else 2**30,
            "peak_live_bytes":
            None if device == "cuda" else 2**29 + arm["stashed"] * 136_314_880,
            "selective_source":
            "TRL 1.16.0's enable_selective_activation_checkpointing" if arm["kind"] == "selective" else None,
        }))
    return settings, arms, runs


def _plotted(figure):
    """Per axis: the error-bar series by label, as (x, median, lower bar, upper bar), the hollow (unresolved) points
    and the annotations."""
    from matplotlib.container import ErrorbarContainer

    axes = []
    for axis in figure.axes:
        series = {}
        for container in axis.containers:
            if isinstance(container, ErrorbarContainer):
                line, _, (bars, ) = container.lines
                spans = [segment[:, 1] for segment in bars.get_segments()]
                series[container.get_label()] = [
                    (x, y, y - low, high - y) for x, y, (low, high) in zip(line.get_xdata(), line.get_ydata(), spans)
                ]
        hollow = [(x, y) for line in axis.lines if line.get_markerfacecolor() == "white"
                  for x, y in zip(line.get_xdata(), line.get_ydata())]
        axes.append((series, hollow, [text.get_text() for text in axis.texts]))
    return axes


def test_report_of_a_gpu_run(bench, tmp_path):
    """The GPU preset's results (peak allocated, no RSS) make a table, JSON-able rows and a plot, without a GPU."""
    settings, arms, runs = _fake_runs(bench, "cuda", saved_ms=0.9)
    by_arm, repeat_noise, cross_arm = bench.summarize(settings, arms, runs, attention_ms=0.93)
    table = bench.format_table(settings, by_arm, 0.93, "CUDNN_ATTENTION", 136_314_880, repeat_noise, cross_arm)
    json.dumps(by_arm)
    assert "peak alloc" in table and "peak RSS" not in table and "NOISY" not in table
    assert table.count("= 97% of the attention forward") == 3
    # Differences of 2.2 ms and more against an interquartile range of 1.5 ms: every comparison is a result.
    assert table.count("UNRESOLVED") == 1  # the legend's
    assert "stash 8, non-reentrant against stash 8 layers (reentrant): step time +1.0% ± 0.2%\n" in table
    assert "stash 8 layers against selective AC (TRL): step time -0.2% ± 0.2%, peak alloc +1,040.0 ± 0.0 MiB" in table
    assert ("stash 8, non-reentrant against selective AC (TRL): step time +0.8% ± 0.2%, peak alloc +1,040.0 ± 0.0 MiB"
            in table)
    stashed = next(row for row in by_arm if row["label"] == "stash 8 layers")
    assert stashed["peak_rss_bytes"] is None and stashed["peak_allocated_bytes"] == 60 * 2**30 + 8 * 136_314_880
    assert (stashed["vs_plain"], stashed["vs_plain_verdict"]) == (pytest.approx(-0.0072), None)
    figure = bench.plot(str(tmp_path / "bench.png"), settings, by_arm)
    assert (tmp_path / "bench.png").stat().st_size > 0
    (times, hollow, texts), (memory, _, _) = _plotted(figure)
    # Both checkpointing modes, each from its recompute to its stash arms, with each arm's interquartile range.
    reentrant, non_reentrant = times["reentrant: plain recompute, stash"], times["non-reentrant: recompute, stash"]
    assert [(x, y) for x, y, *_ in reentrant] == [(0, 1000.0), (4, pytest.approx(996.4)), (8, pytest.approx(992.8))]
    assert [y for _, y, *_ in non_reentrant] == [1010.0, pytest.approx(1002.8)]
    assert non_reentrant[-1][0] > 8  # beside the reentrant arm, not on it
    for _, _, low, high in reentrant + non_reentrant:
        assert (low, high) == (pytest.approx(0.75), pytest.approx(0.75))
    assert hollow == [] and texts == []
    # Memory from zero.
    assert figure.axes[1].get_ylim()[0] == 0 and len(memory) == 2


def test_report_calls_comparisons_within_the_noise_unresolved(bench, tmp_path):
    """Arms 10 ms apart or less, with an interquartile range of 150 ms: no comparison is a result, in the table, the
    per-layer savings or the plot."""
    settings, arms, runs = _fake_runs(bench, "cpu", saved_ms=0.9, spread_ms=100.0)
    by_arm, repeat_noise, cross_arm = bench.summarize(settings, arms, runs, attention_ms=0.93)
    table = bench.format_table(settings, by_arm, 0.93, "FLASH_ATTENTION", 136_314_880, repeat_noise, cross_arm)
    header, _, *rows = table.split("\n\n")[0].splitlines()
    assert len(rows) == 6 and "±" not in rows[0]  # plain against itself: no comparison
    for row in rows[1:]:
        assert re.search(r" [+-]\d+\.\d% ± \d+\.\d% UNRESOLVED ", row), row
    assert table.count("= UNRESOLVED: within the noise") == 3
    assert "stash 8, non-reentrant against stash 8 layers (reentrant): step time +1.0% ± 15.1% UNRESOLVED\n" in table
    assert "stash 8 layers against selective AC (TRL): step time -0.2% ± 15.1% UNRESOLVED, peak live" in table
    assert "stash 8, non-reentrant against selective AC (TRL): step time +0.8% ± 15.1% UNRESOLVED, peak live" in table
    assert all(row["vs_plain_verdict"] == "UNRESOLVED" for row in by_arm if row["kind"] != "plain")
    figure = bench.plot(str(tmp_path / "bench.png"), settings, by_arm)
    (times, hollow, texts), (_, memory_hollow, _) = _plotted(figure)
    # Every stash arm is drawn hollow and labelled, the recomputes (0 stashed layers) are not.
    assert sorted(x for x, _ in hollow) == [4, 8, pytest.approx(8.24)] and len(memory_hollow) == 3
    assert texts == ["UNRESOLVED"] * 3
    assert figure.axes[1].get_ylim()[0] == 0


@pytest.mark.parametrize(
    "difference, noise, bound, expected",
    [
        (2.0, 1.0, None, None),  # beyond its noise: a result
        (-2.0, 1.0, None, None),
        (0.5, 1.0, None, "UNRESOLVED"),  # within it
        (-1.0, 1.0, None, "UNRESOLVED"),
        (0.0, 0.0, None, None),  # exact figures (memory) need no noise
        (0.9, 0.5, 1.0, None),
        (0.4, 0.5, 1.0, "UNRESOLVED"),
        (0.9, 1.2, 1.0, "UNRESOLVED"),  # the noise covers all the bound allows
        (1.6, 0.5, 1.0, "NOISY"),  # more than the bound plus the noise
    ])
def test_one_verdict_rule(bench, difference, noise, bound, expected):
    assert bench.verdict(difference, noise, bound) == expected


def test_report_calls_a_saving_beyond_the_attention_forward_noisy(bench):
    """A saving of more than the attention forward plus the noise: the machine moved the timings, not the stash."""
    settings, arms, runs = _fake_runs(bench, "cpu", saved_ms=2.0)
    by_arm, repeat_noise, cross_arm = bench.summarize(settings, arms, runs, attention_ms=0.93)
    table = bench.format_table(settings, by_arm, 0.93, "FLASH_ATTENTION", 136_314_880, repeat_noise, cross_arm)
    assert table.count("NOISY: more than the attention forward (0.93 ms) plus the noise allows") == 3


def _offload_arms(bench, stash_ms=1000.0, step=0.01, spread_ms=1.0, extra_layers=0.5, offloaded=1):
    """--offload's four arms on a GPU, summarized: the stash with offload ``step`` (a fraction) slower than the stash
    alone, and ``extra_layers`` of one layer's kept bytes above the offload alone at its peak."""
    settings = {**bench.PRESETS["llama-8b-long"], "layers": 4, "pad_fraction": 0.0, "offload": "transformers"}
    layer = 272_629_760
    arms = [
        dict(label="plain recompute", kind="plain", stashed=0),
        dict(label="offload", kind="offload", stashed=0),
        dict(label="stash 4 layers", kind="stash", stashed=4),
        dict(label="stash 4 + offload", kind="stash_offload", stashed=4),
    ]
    medians = {
        "plain": stash_ms + 40.0,
        "offload": stash_ms + 50.0,
        "stash": stash_ms,
        "stash_offload": stash_ms * (1 + step)
    }
    peaks = {"plain": 20 * 2**30, "offload": 19 * 2**30, "stash": 20 * 2**30 + 3 * layer}
    peaks["stash_offload"] = peaks["offload"] + int(extra_layers * layer)
    runs = []
    for arm in arms + arms[::-1]:
        median, stashed = medians[arm["kind"]], arm["stashed"]
        moved = offloaded * stashed * 3 * layer if arm["kind"] == "stash_offload" else 0
        runs.append((arm["label"], {
            "recomputes_served": stashed * 3,
            "offloaded_bytes": moved,
            "restored_bytes": moved,
            "times_ms": [median - spread_ms, median, median + spread_ms],
            "median_ms": median,
            "losses": [2.5] * 3,
            "kept_bytes": stashed * layer,
            "peak_allocated_bytes": peaks[arm["kind"]],
            "peak_rss_bytes": None,
            "peak_live_bytes": None,
        }))
    by_arm, _, _ = bench.summarize(settings, arms, runs, attention_ms=20.0)
    return settings, by_arm, layer


@pytest.mark.parametrize(
    "options, verdicts",
    [
        ({}, ["holds", "holds"]),  # half a layer above the offload, 1.0% ± 0.15% slower than the stash
        (dict(extra_layers=3, step=0.05), ["DOES NOT HOLD", "DOES NOT HOLD"]),  # kept on the device; 5% slower
        (dict(extra_layers=1, step=0.019, spread_ms=10.0), ["holds", "UNRESOLVED"]),  # 2% within 1.9% ± 1.5%
        (dict(offloaded=0), ["NOT JUDGED: nothing was offloaded", "holds"]),  # a synchronized accelerator
    ])
def test_offload_expectations_judged_by_the_noise_rule(bench, options, verdicts):
    settings, by_arm, layer = _offload_arms(bench, **options)
    memory, step = bench.offload_expectations(settings, by_arm, layer)
    assert memory["expected"] == ("stash 4 + offload peaks within one layer's kept bytes (272,629,760 B, 260.0 MiB) "
                                  "of offload alone")
    assert step["expected"] == "stash 4 + offload steps within 2% of stash 4 layers"
    assert memory["verdict"].startswith(verdicts[0]) and step["verdict"] == verdicts[1]
    if not options:
        assert memory["measured"] == "peak alloc +130.0 ± 0.0 MiB" and step["measured"] == "step time +1.0% ± 0.1%"
    # The stash with offload against the offload alone, as each stash arm against its own recompute.
    both = by_arm[-1]
    assert both["baseline"] == "offload" and both["kept_per_layer_bytes"] == layer
    # Each of its 2 runs moved 4 layers x 3 steps of kept bytes each way.
    moved = f"{24 * layer * options.get('offloaded', 1):,} B"
    assert bench.offload_moved(by_arm) == (f"stash 4 + offload: offloaded {moved} and restored {moved} of kept "
                                           f"outputs and log-sum-exps in 6 steps; recomputes served 24 = 4 layers x 6 "
                                           f"steps")


def test_offload_route_follows_what_transformers_offers(bench, monkeypatch):
    """auto: transformers' own offload where activation_checkpointing_enable takes offload and the run has an
    accelerator, else DeepSpeed's CheckpointHiddenStatesOffload, saying why; transformers asked for where it cannot
    be is refused."""
    import transformers

    def enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        pass

    monkeypatch.setattr(transformers.PreTrainedModel, "activation_checkpointing_enable", enable, raising=False)
    assert bench.offload_route("auto", "cuda") == ("transformers", "transformers offers it here")
    assert bench.offload_route("transformers", "cuda") == ("transformers", "asked for")
    assert bench.offload_route("auto",
                               "cpu") == ("deepspeed",
                                          "transformers' offload=True pins host memory, which a CPU run cannot")
    assert bench.offload_route("deepspeed", "cuda") == ("deepspeed", "asked for")
    monkeypatch.delattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    route, why = bench.offload_route("auto", "cuda")
    assert route == "deepspeed" and why == (f"transformers' offload=True is not in transformers "
                                            f"{transformers.__version__} (5.23 added it)")
    assert bench.offload_route("transformers", "cuda") == (None, why)


@pytest.mark.parametrize("options, message", [
    (["--offload", "transformers"], "--offload transformers: transformers' offload=True "),
    (["--offload", "--sequence", "32,64"], "--offload takes no --compile, --sequence-parallel or --autoep, and one"),
    (["--offload", "--compile"], "--offload takes no --compile"),
])
def test_bench_refuses_what_it_cannot_offload(bench, capsys, options, message):
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "llama-long-cpu", *options])
    assert message in capsys.readouterr().err


def test_offload_arms_checkpointing(bench):
    """Every offload arm checkpoints reentrant; on the transformers route its checkpoints offload their inputs
    (activation_checkpointing_enable(offload=True)), on the deepspeed route run_arm's context does instead."""

    class Model:

        def __init__(self):
            self.calls = []

        def activation_checkpointing_disable(self):
            pass

        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, offload=False):
            self.calls.append((activation_checkpointing_kwargs, offload))

        def train(self):
            pass

    model = Model()
    for kind, route in (("offload", "transformers"), ("stash_offload", "transformers"), ("stash", "transformers"),
                        ("stash_offload", "deepspeed"), ("plain", None)):
        bench.set_checkpointing(model, kind, offload=route)
    reentrant = {"use_reentrant": True}
    assert model.calls == [(reentrant, True), (reentrant, True), (reentrant, False), (reentrant, False),
                           (reentrant, False)]


@on_cpu_accelerator
def test_bench_fails_a_stash_with_offload_that_moves_nothing(bench, monkeypatch):
    """On an accelerator that copies, a stash with offload that offloaded nothing would time the stash alone under
    the offload's name: the run stops. Here the CPU passes for one (DeepSpeed's engine never copies on it)."""
    monkeypatch.setattr(bench, "_synchronized_accelerator", lambda: False)
    # One thread, as the GPU check's dry run runs this leg: on cores that other processes keep busy, OpenMP's waits
    # make the tiny steps far slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.raises(RuntimeError,
                       match=r"attention_stash_bench needs stash 2 \+ offload to offload its kept outputs and take "
                       r"all of them back, got 0 B offloaded and 0 B restored"):
        try:
            bench.main(["--preset", "llama-long-cpu", "--offload", "--sequence", "32"])
        finally:
            torch.set_num_threads(threads)


def test_host_benchmark_runs_and_counts_what_it_served(capsys):
    """Bookkeeping only: the host benchmark's few pairs run on both models in both modes beside TRL's selective
    checkpointing (TRL's own: requirements-dev.txt installs it), every recompute is served, the tables, the modes'
    comparison, the stash against selective and the summary come out."""
    import trl

    sys.path.insert(0, BENCHMARKS)
    try:
        import attention_stash_host
        attention_stash_host.main(["--pairs", "4", "--warmup", "1", "--profile", "2"])
    finally:
        sys.path.remove(BENCHMARKS)
    out = capsys.readouterr().out
    assert out.startswith("attention stash host cost: Llama and Qwen3-MoE, 8 layers")
    for model in ("Llama", "Qwen3-MoE"):
        for mode in ("reentrant", "non-reentrant"):
            section = out.partition(f"\n{model}, {mode} checkpointing: plain step")[2]
            for part in ("all 8 stashed: step", "first pass", "recompute", "backward other", "4 unstashed layers pay"):
                assert part in section
            assert f"host cost of the stash, {mode}:" in section
        selective = out.partition(f"\n{model}, TRL's selective checkpointing (TRL {trl.__version__}'s "
                                  f"enable_selective_activation_checkpointing; non-reentrant only: TRL has no "
                                  f"reentrant mode): ")[2]
        assert re.match(r"[\d,]+\.\d us per layer and step over plain non-reentrant", selective)
        for mode in ("reentrant", "non-reentrant"):
            assert re.search(
                # Four pairs on a loaded machine can leave a median cost below zero: a sign is allowed.
                rf"\nthe stash \({mode}\) against selective: -?[\d,.]+ against [\d,.]+ us per layer and step, "
                r"-?\d\.\d{3} times \(.* from the medians' 95% intervals\): (within|over|UNRESOLVED by the noise "
                r"against) the 0\.1 times target",
                selective)
    assert out.count("non-reentrant against reentrant: ") == 2 and "times target" in out
    summary = out.partition("\nhost cost per layer and step (us;")[2].splitlines()
    assert summary[1].split() == [
        "model", "plain", "(reentrant)", "plain", "(non-reentrant)", "selective", "(TRL)", "stash", "(reentrant)",
        "stash", "(non-reentrant)"
    ]
    for line, model in zip(summary[3:5], ("Llama", "Qwen3-MoE")):
        cells = line.split()
        assert cells[0] == model and len(cells) == 6 and all(re.match(r"-?[\d,]+\.\d$", c) for c in cells[1:])
    # The profiles, per model reentrant then non-reentrant: plain runs F.sdpa's kernel in both passes; the stash runs
    # it once and applies its node in the recompute (reentrant), or in both passes (non-reentrant, whose first pass
    # records its graph). Each row: a part, then per model "<calls> x, <us>" or "-".
    profiles = out.split("\nattention's own work per layer and step")[1:]
    assert len(profiles) == 4
    for profile, nodes in zip(profiles, ("1", "2") * 2):
        rows = {line[:34].strip(): line[34:].split() for line in profile.splitlines()[3:8]}
        assert rows["fused forward kernel"][0:4:3] == ["2", "1"]
        assert rows["stash's node"][:2] == ["-", nodes]
        assert rows["attention node in the backward"][0:4:3] == ["1", "1"]


def test_host_benchmark_leaves_selective_out_of_reentrant_runs(capsys):
    """--mode reentrant: TRL's selective checkpointing has no reentrant mode, and the benchmark says so."""
    sys.path.insert(0, BENCHMARKS)
    try:
        import attention_stash_host
        attention_stash_host.main(["--pairs", "4", "--warmup", "1", "--mode", "reentrant", "--model", "llama"])
    finally:
        sys.path.remove(BENCHMARKS)
    out = capsys.readouterr().out
    assert "\nTRL's selective checkpointing is left out: it has no reentrant mode.\n" in out
    assert "against selective" not in out and "\nLlama, reentrant checkpointing: plain step" in out


@on_cpu_accelerator
def test_sweep_of_sequence_lengths_runs_every_length(bench, tmp_path, capsys):
    """--sequence with several lengths: plain recompute and the stash at each, every recompute served, the losses of
    both arms equal, a row and a plotted point per length."""
    path = tmp_path / "sweep.json"
    bench.main([
        "--layers", "2", "--sequence", "32,48", "--steps", "1", "--experts", "2", "--json",
        str(path), "--plot",
        str(tmp_path / "sweep.png")
    ])
    result = json.loads(path.read_text())
    assert [row["sequence"] for row in result["rows"]] == [32, 48] and result["target"] == 0.9
    for row in result["rows"]:
        # (1 warm-up + 1 timed step) x 2 runs x 2 layers.
        assert row["recomputes_served"] == 8 and row["steps_run"] == 4 and row["losses_agree"]
        assert row["backend"] == "FLASH_ATTENTION" and 0 < row["share"]
    assert (tmp_path / "sweep.png").stat().st_size > 0
    table = capsys.readouterr().out.split("attention stash sweep: ")[1]
    assert table.splitlines()[0].startswith("2 layers (2 with softmax attention), micro-batch 1, float32 on cpu")
    assert [line.split()[0] for line in table.splitlines()[3:5]] == ["32", "48"]


def _sweep_runs(plain_ms, stash_ms, spread_ms, stashed=4):
    arms = [
        dict(label="plain recompute", kind="plain", stashed=0),
        dict(label="stash 4 layers", kind="stash", stashed=stashed)
    ]
    runs = []
    for arm in arms + arms[::-1]:
        median = stash_ms if arm["stashed"] else plain_ms
        runs.append((arm["label"], {
            "recomputes_served": arm["stashed"] * 3,
            "offloaded_bytes": 0,
            "restored_bytes": 0,
            "times_ms": [median - spread_ms, median, median + spread_ms],
            "median_ms": median,
            "losses": [2.5] * 3,
            "kept_bytes": arm["stashed"] * 1000,
            "peak_allocated_bytes": None,
            "peak_rss_bytes": 2**30,
            "peak_live_bytes": 2**29,
        }))
    return arms, runs


def test_sweep_rows_judge_share_saving_and_their_ratio(bench):
    """A length whose saving resolves: the share of 4 attention forwards of 25 ms in a 1000 ms step is 10%, a saving
    of 95 ms is 9.5%, 95% of the share; the target is met. A length within its noise is UNRESOLVED and does not
    count; a saving under 90% of the share misses the target."""
    settings = {**bench.PRESETS["cpu"], "pad_fraction": 0.0}
    resolved = bench.sweep_row({
        **settings, "sequence": 4096
    }, *reversed(_sweep_runs(1000.0, 905.0, 2.0)), (25.0, "FLASH_ATTENTION", [24.5, 25.5]))
    assert resolved["share"] == pytest.approx(0.1) and resolved["share_noise"] == pytest.approx(0.004)
    assert resolved["saving"] == pytest.approx(0.095) and resolved["saving_verdict"] is None
    assert resolved["saving_over_share"] == pytest.approx(0.95) and resolved["saving_over_share_verdict"] is None
    unresolved = bench.sweep_row({
        **settings, "sequence": 512
    }, *reversed(_sweep_runs(100.0, 99.0, 20.0)), (0.5, "FLASH_ATTENTION", [0.4, 0.6]))
    assert unresolved["saving_verdict"] == "UNRESOLVED" and unresolved["saving_over_share_verdict"] == "UNRESOLVED"
    table = bench.format_sweep(settings, [unresolved, resolved], 0.9)
    assert "UNRESOLVED" in table.splitlines()[2] and "UNRESOLVED" not in table.splitlines()[3]
    assert table.splitlines()[-1] == ("target (saving at least 90% of the share), at the 1 lengths that resolved: "
                                      "met at every one (4096)")
    # 70% of the share, with a noise of 3%: a miss. 85%, with a noise of 30%: below the target within the noise.
    gate = (25.0, "FLASH_ATTENTION", [24.5, 25.5])
    short = bench.sweep_row({**settings, "sequence": 8192}, *reversed(_sweep_runs(1000.0, 930.0, 2.0)), gate)
    near = bench.sweep_row({**settings, "sequence": 2048}, *reversed(_sweep_runs(1000.0, 915.0, 20.0)), gate)
    assert near["saving_verdict"] is None and near["saving_over_share"] == pytest.approx(0.85)
    assert bench.format_sweep(settings, [resolved, short, near], 0.9).splitlines()[-1] == (
        "target (saving at least 90% of the share), at the 3 lengths that resolved: MISSED at [8192]")
    assert bench.format_sweep(settings, [resolved, near], 0.9).splitlines()[-1] == (
        "target (saving at least 90% of the share), at the 2 lengths that resolved: met at [4096]; below it within "
        "the noise at 2048 (85.0% ± 30.0%): UNRESOLVED there")


@on_cpu_accelerator
def test_sweep_under_sequence_parallelism_on_two_ranks(tmp_path):
    """--sequence-parallel under torchrun: ALST over 2 ranks, each training half of each sequence; every recompute
    served, and each rank keeping its half of the heads over the whole sequence, as the planner counts it."""
    path = tmp_path / "sweep.json"
    result = run_on_two_ranks(os.path.join(BENCHMARKS,
                                           "attention_stash_bench.py"), "--sequence-parallel", "--sequence", "32",
                              "--layers", "2", "--steps", "1", "--experts", "2", "--json", str(path))
    assert "Ulysses sequence parallelism over 2 ranks (figures of rank 0: 4 of 8 query heads" in result.stdout
    (row, ) = json.loads(path.read_text())["rows"]
    assert row["recomputes_served"] == 8 and row["losses_agree"]
    # Micro-batch 1 x 4 of the 8 query heads x the whole sequence x (head dim 64 x fp32 bytes + FP32 LSE).
    assert row["kept_per_layer_bytes"] == row["planner_bytes"] == 1 * 4 * 32 * (64 * 4 + 4)
