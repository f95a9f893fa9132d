# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The GPU check's dry run: tests/benchmarks/gpu_check.sh --dry-run on CPU at tiny shapes, so that the one command a
lent H200 gets is known to work before a device is spent on it. Every step must pass, the offline install must land in
a fresh venv, and RESULTS.md must carry each section with figures in it. About 50 seconds on 2 idle cores.
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
         "long-sequence", "offload-32", "flash4", "suite-wheel")
SECTIONS = ("## Versions", "## Offline install", "## Steps", "## GPU tests", "### Leg 1: transformers",
            "### Leg 2: transformers", "## Rest of the suite", "## flash-attn 4", "## Benchmark",
            "## Op-level figures", "## Bytes kept per layer against the planner", "## Peak memory per arm",
            "## Long sequences", "## Offload")


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

    # The flash-attn 4 step on CPU: the double's stock and stashed steps at 4.0.0b40, Llama on a plain and a packed
    # batch in both checkpoint modes, each passed, from the junit XML that stays in the work folder.
    flash4 = _section(report, "## flash-attn 4")
    assert "- Wheels: dry run: the CPU double's flash-attn 4 tests, no flash-attn 4 installed" in flash4
    assert "Tests: 4 passed (from the junit XML in the work folder)." in flash4
    for kind in ("plain", "packed_position_ids"):
        for mode in ("reentrant", "non_reentrant"):
            case = f"test_attention_stash_flash4.py::test_a_step_is_stock[4.0.0b40-llama-{kind}-{mode}]"
            assert _row(flash4, case)[1] == "passed", case
    assert (work / "junit-flash4.xml").is_file()

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


def _report_helper(*args):
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "benchmarks", "gpu_check_report.py"), *args],
        capture_output=True,
        text=True,
        timeout=120)


def test_flash4_wheels_are_the_newest_flash_attn_4_and_its_dependencies_in_the_folder(tmp_path):
    """The flash-attn 4 step's wheels: the newest flash-attn-4 wheel, then those of the folder it requires, through
    their own requirements and the extras asked for, and no other (not an extra's that nothing asks for, not
    DeepSpeed's); 1, and nothing listed, where the folder holds no flash-attn-4 wheel."""
    import zipfile

    def wheel(name, version, *requires):
        with zipfile.ZipFile(tmp_path / f"{name}-{version}-py3-none-any.whl", "w") as archive:
            lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {line}" for line in requires)]
            archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(["Metadata-Version: 2.1", *lines]))

    wheel("deepspeed", "0.19.8", "hjson")
    wheel("hjson", "3.1.0")
    wheel("einops", "0.8.1")
    wheel("flash_attn_4", "4.0.0b39", "einops")
    wheel("flash_attn_4", "4.0.0b40", "nvidia-cutlass-dsl>=4.6.2", "torch", "quack-kernels>=0.5.3",
          'nvidia-cutlass-dsl[cu13]>=4.6.2; extra == "cu13"', 'pytest; extra == "dev"')
    wheel("quack_kernels", "0.5.3", "nvidia-cutlass-dsl[extra]", "torch")
    wheel("nvidia_cutlass_dsl", "4.6.2", "nvidia-cutlass-dsl-libs-base==4.6.2",
          'nvidia-cutlass-dsl-libs-cu13==4.6.2; extra == "cu13"', 'cuda-python; extra == "extra"')
    for name in ("nvidia_cutlass_dsl_libs_base", "nvidia_cutlass_dsl_libs_cu13", "cuda_python", "pytest"):
        wheel(name, "4.6.2")
    run = _report_helper("flash4-wheels", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert [os.path.basename(path) for path in run.stdout.split()] == [
        "flash_attn_4-4.0.0b40-py3-none-any.whl", "nvidia_cutlass_dsl-4.6.2-py3-none-any.whl",
        "quack_kernels-0.5.3-py3-none-any.whl", "nvidia_cutlass_dsl_libs_base-4.6.2-py3-none-any.whl",
        "cuda_python-4.6.2-py3-none-any.whl"
    ]
    for path in tmp_path.glob("flash_attn_4-*"):
        path.unlink()
    run = _report_helper("flash4-wheels", str(tmp_path))
    assert (run.returncode, run.stdout) == (1, "") and f"no flash_attn_4-*.whl in {tmp_path}" in run.stderr


def test_a_step_skipped_for_a_reason_is_reported_and_not_failed(tmp_path):
    """A GPU run without a flash-attn-4 wheel: its flash-attn 4 step, skipped for that reason, is reported with the
    reason and not counted as a failure; one skipped for the time is."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (work / "meta.tsv").write_text("mode\tgpu\nflash4_note\tno flash_attn_4-*.whl in the wheel folder\n")
    (work / "steps.tsv").write_text("venv\tpassed\t0\t0.1\t60\tpython venv\n"
                                    "flash4\tskipped: no flash_attn_4-*.whl in the wheel folder /w\t-\t0\t0\t-\n")
    run = _report_helper("report", "--work", str(work), "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    report = (out / "RESULTS.md").read_text()
    assert "- Steps: 1 of 2 passed; skipped, not failed: flash4\n" in report
    assert "## Logs of the steps that did not pass" not in report
    flash4 = _section(report, "## flash-attn 4")
    assert "- Not run, not a failure: no flash_attn_4-*.whl in the wheel folder /w" in flash4
    with open(work / "steps.tsv", "a") as steps:
        steps.write("suite-wheel\tskipped (out of time)\t-\t0\t0\tpytest\n")
    assert _report_helper("report", "--work", str(work), "--out", str(out)).returncode == 0
    report = (out / "RESULTS.md").read_text()
    assert "- Steps: 1 of 3 passed; skipped, not failed: flash4; not passed: suite-wheel\n" in report
    assert "### suite-wheel: skipped (out of time)" in report
