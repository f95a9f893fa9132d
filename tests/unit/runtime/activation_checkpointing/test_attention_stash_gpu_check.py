# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The GPU check's dry run: tests/benchmarks/gpu_check.sh --dry-run on CPU at tiny shapes, so that the one command a
lent H200 gets is known to work before a device is spent on it. Every step must pass, the offline install must land in
a fresh venv, and RESULTS.md must carry each section with figures in it. About 45 seconds on 2 idle cores.
"""

import glob
import os
import re
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
SCRIPT = os.path.join(REPO, "tests", "benchmarks", "gpu_check.sh")
STEPS = ("build-wheels", "venv", "install-venv", "probe-image", "probe-wheel", "suite-image", "bench", "op-figures",
         "long-sequence", "offload-32", "suite-wheel")
SECTIONS = ("## Versions", "## Offline install", "## Steps", "## GPU tests", "### Leg 1: transformers",
            "### Leg 2: transformers", "## Rest of the suite", "## Benchmark", "## Op-level figures",
            "## Bytes kept per layer against the planner", "## Peak memory per arm", "## Long sequences", "## Offload")


def _section(report, title):
    start = report.index(title)
    end = report.find("\n#", start + len(title))
    return report[start:] if end < 0 else report[start:end]


def _row(section, first_cell):
    """The cells of the table row of ``section`` that starts with ``first_cell``."""
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{section}")


def test_gpu_check_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "PYTHON": sys.executable}
    env.pop("GPU_CHECK_BUDGET", None)
    run = subprocess.run(["bash", SCRIPT, "--dry-run"], env=env, capture_output=True, text=True, timeout=900)
    report = (out / "RESULTS.md").read_text()
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{report}"
    for title in SECTIONS:
        assert title in report, title
    assert "- Mode: DRY RUN on CPU" in report
    assert re.search(r"^- Date: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", report, re.M)

    # Every step ran and passed, each with its command; leg 2's target install where a transformers wheel was at hand.
    transformers_wheels = glob.glob(str(work / "wheels" / "transformers-*.whl"))
    expected = STEPS[:4] + ("install-target", ) + STEPS[4:] if transformers_wheels else STEPS
    steps = _section(report, "## Steps")
    names = [line.split(" | ")[0].lstrip("| ") for line in steps.splitlines()[4:] if line.startswith("|")]
    assert names == list(expected)
    for name in expected:
        assert _row(steps, name)[1] == "passed", name
    assert f"- Steps: {len(expected)} of {len(expected)} passed" in report

    # The offline install happened, into a venv made for this run, from the wheel folder the dry run built.
    venv = work / "venv"
    assert (venv / "pyvenv.cfg").is_file()
    installed = glob.glob(str(venv / "lib" / "python*" / "site-packages" /
                              "deepspeed_attention_stash-0.1.0.dist-info"))
    assert len(installed) == 1
    install = _section(report, "## Offline install")
    assert f"- Fresh venv: `{venv}`" in install
    wheel = _row(install, "deepspeed_attention_stash-0.1.0-py3-none-any.whl")
    assert wheel[1:3] == ["0.1.0", "venv"] and wheel[3].startswith(str(venv))
    command = _row(steps, "install-venv")[-1]
    assert f"{venv}/bin/python -m pip install --no-index --no-deps" in command and str(work / "wheels") in command
    if transformers_wheels:
        transformers_wheel = _row(install, os.path.basename(transformers_wheels[0]))
        assert transformers_wheel[2] == "target" and transformers_wheel[3] == str(work / "site-transformers")
    else:
        assert "leg 2 REUSES the installed transformers" in install

    versions = _section(report, "## Versions")
    assert _row(versions, "torch")[1:] == [torch.__version__] * 2
    assert all(re.match(r"\d+\.\d+", cell) for cell in _row(versions, "transformers")[1:])
    assert _row(versions, "interpreter")[1] == f"{venv}/bin/python"

    # Each transformers leg recorded the GPU tests: the CPU replay case passed, every CUDA case has an outcome.
    for leg in ("### Leg 1: transformers", "### Leg 2: transformers"):
        section = _section(report, leg)
        replay = _row(section, "test_attention_stash.py::test_replay_matches_autograd[cpu-flash_attention-gqa-padded]")
        assert replay[1] == "passed"
        cuda = [line for line in section.splitlines() if "[cuda-" in line or "test_cuda_two_layer" in line]
        assert len(cuda) == 24 and all(re.search(r"\| (passed|skipped|failed|error) \|", line) for line in cuda)
        # The from_pretrained step, at its defaults, in both checkpoint modes (skipped without CUDA).
        for mode in ("reentrant", "non_reentrant"):
            case = ("test_attention_stash_from_pretrained.py::"
                    f"test_a_model_from_pretrained_at_the_defaults_is_served_on_cuda[{mode}]")
            assert _row(section, case)[1] == ("passed" if torch.cuda.is_available() else "skipped")  #ignore-cuda

    benchmark = _section(report, "## Benchmark")
    for arm in ("plain recompute", "stash 1 layers", "stash 2 layers", "non-reentrant recompute",
                "stash 2, non-reentrant", "selective AC (TRL)"):
        assert re.match(r"[\d,]+\.\d$", _row(benchmark, arm)[2]), arm
    assert re.search(r"Attention forward \(the benchmark's op-level gate.*\): \d+\.\d+ ms per layer", benchmark)
    assert "arms agree" in benchmark

    figures = _section(report, "## Op-level figures")
    assert re.match(r"\d+\.\d+ ms$", _row(figures, "default (FLASH_ATTENTION)")[2])
    assert re.match(r"-?\d+\.\d+ ms$", _row(figures, "stash 2 layers")[2])

    # Micro-batch 1, 8 query heads, sequence 64, head dim 64 in FP32: the output and its FP32 log-sum-exp.
    formula = 1 * 8 * 64 * (64 * 4 + 4)
    kept = _section(report, "## Bytes kept per layer against the planner")
    assert f"{formula:,} B" in kept
    assert _row(kept, "attention_stash_layer_bytes, default")[1:3] == [f"{formula:,}", "+0"]
    assert _row(kept, "kept by stash 2 layers (peak kept / stashed layers)")[1:3] == [f"{formula:,}", "+0"]

    memory = _section(report, "## Peak memory per arm")
    assert re.match(r"[\d,.]+ MiB$", _row(memory, "stash 2 layers")[2])

    # The long-sequence leg at tiny shapes: both lengths, every recompute served, the planner's bytes kept (4 query
    # heads of dimension 16 in FP32, and the FP32 log-sum-exp).
    long = _section(report, "## Long sequences")
    assert "Lengths finished: 2 of 2." in long
    for sequence in (32, 64):
        row = _row(long, str(sequence))
        assert row[1] == "FLASH_ATTENTION" and row[-1] == "8"
        assert row[-3] == row[-2] == f"{4 * sequence * (16 * 4 + 4):,}"

    # The offload leg at tiny shapes, in 4 layers: its four arms, the stash's recomputes served (4 layers x 4 steps
    # in the two runs of each arm), the route (DeepSpeed's on CPU, where transformers' pins memory it cannot) and the
    # two expectations: on CPU DeepSpeed's engine moves no byte, so the memory one is not judged, the step one is.
    offload = _section(report, "## Offload")
    rows = [[cell.strip() for cell in line.strip("| ").split(" | ")] for line in offload.splitlines()
            if line.startswith("| 32 ")]
    assert [row[1] for row in rows] == ["plain recompute", "offload", "stash 4 layers", "stash 4 + offload"]
    assert [row[-3:] for row in rows] == [["0", "0", "0"], ["0", "0", "0"], ["0", "0", "16"], ["0", "0", "16"]]
    assert all(re.match(r"[\d,]+\.\d$", row[2]) and re.match(r"[\d,.]+ MiB$", row[4]) for row in rows)
    assert "the inputs offloaded by DeepSpeed's CheckpointHiddenStatesOffload around each step" in offload
    assert "stash 4 + offload: offloaded 0 B and restored 0 B" in offload
    assert re.search(
        r"^- 32: stash 4 \+ offload peaks within one layer's kept bytes .*: \*\*NOT JUDGED: nothing was "
        r"offloaded", offload, re.M)
    assert re.search(
        r"^- 32: stash 4 \+ offload steps within 2% of stash 4 layers: step time .*: "
        r"\*\*(holds|DOES NOT HOLD|UNRESOLVED)\*\*$", offload, re.M)

    # What the device tool brings back: at most 8 files, no folders.
    files = sorted(path.name for path in out.iterdir())
    assert files == [
        "RESULTS.md", "bench.json", "bench.png", "gpu_check.log", "junit-image.xml", "junit-wheel.xml", "long.json",
        "op_figures.json"
    ]


def test_gpu_check_names_what_its_python_lacks(tmp_path):
    """Run with a Python that lacks the packages (a machine's own python3, say), the check stops before any step with
    one message naming what is missing and how to get it, and a report that says no step ran."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    out = tmp_path / "out"
    env = {
        **os.environ, "OUT": str(out),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "PYTHON": str(tmp_path / "bare" / "bin" / "python")
    }
    run = subprocess.run(["bash", SCRIPT, "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "[gpu_check]" not in run.stdout
    message = run.stderr.strip()
    assert message.startswith("gpu_check.sh (dry-run) needs a Python with torch, transformers, deepspeed, pytest, "
                              "setuptools as PYTHON, got ")
    assert "without: torch, transformers, deepspeed, pytest" in message
    assert "run the README's test command in it" in message and "PYTHON=/path/to/venv/bin/python" in message
    assert (out / "RESULTS.md").read_text() == f"# Attention stash: GPU check (dry-run): NO STEP RAN\n\n{message}\n"
