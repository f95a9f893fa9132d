# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The GPU check's two commands, each a device call of its own (protocol: the seed's protocol; suite: the suite's
CUDA tests, the peer comparison and the offload leg), and the long-sequence sweep's call. Their budgets must fit a
call each and the two calls 12 minutes together (tests/benchmarks/gpu_check.sh --budgets, no Python). Their dry run
(--dry-run: every command on CPU at tiny shapes, the setup shared) must pass every step, install offline into a fresh
venv, and write each command's RESULTS-<command>.md with each section and figures in it, so that the calls a lent GPU
gets are known to work before a device is spent on them. About 50 seconds on 2 idle cores.
"""

import glob
import os
import re
import subprocess
import sys
import zipfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
SCRIPT = os.path.join(REPO, "tests", "benchmarks", "gpu_check.sh")
SETUP = ("build-wheels", "venv", "install-venv", "probe-image")
# Each command's steps in the dry run, after the shared setup's (leg 2's target install, where a transformers wheel
# is at hand, before probe-wheel) and the budget check.
STEPS = {
    "protocol": ("budget", "seed-tests", "sweep", "op-figures"),
    "suite": ("probe-wheel", "budget", "suite-image", "peer", "offload-32", "flash4", "suite-wheel"),
    "long": ("probe-wheel", "budget", "long-sequence"),
}
SECTIONS = {
    "protocol":
    ("## Skipped here, and why", "## Versions", "## Offline install", "## Steps", "## The seed's GPU tests",
     "## Benchmark", "## Op-level figures", "## Bytes kept per layer against the planner", "## Peak memory per arm"),
    "suite": ("## Skipped here, and why", "## Versions", "## Offline install", "## Steps", "## GPU tests",
              "### Leg 1: transformers", "### Leg 2: transformers", "## Rest of the suite", "## flash-attn 4",
              "## Benchmark", "## Peak memory per arm", "## Offload"),
    "long": ("## Skipped here, and why", "## Versions", "## Offline install", "## Steps", "## Long sequences"),
}
# What each call brings back from $OUT: the device tool brings 8 files back at most.
FILES = {
    "protocol":
    ["RESULTS-protocol.md", "gpu_check-protocol.log", "junit-seed.xml", "op_figures.json", "sweep.json", "sweep.png"],
    "suite":
    ["RESULTS-suite.md", "gpu_check-suite.log", "junit-image.xml", "junit-wheel.xml", "peer.json", "peer.png"],
    "long": ["RESULTS-long.md", "gpu_check-long.log", "long.json"],
}
FLASH4_GPU_SKIP = ("flash-attn 4's GPU stack cannot travel to the device machine: its nvidia-cutlass-dsl-libs-cu13 "
                   "wheel is 92 MB, over the device tool's 64 MiB limit on what travels, and the device image has no "
                   "CUTLASS DSL; nothing was installed and no device time spent")
# The device tool: at most 10 minutes a call; the check's own limits: 9 minutes a command, 12 for the two calls.
CALL_SECONDS, COMMAND_SECONDS, TWO_CALLS_SECONDS = 600, 540, 720


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


def _step_names(report):
    steps = _section(report, "## Steps")
    return [line.split(" | ")[0].lstrip("| ") for line in steps.splitlines()[4:] if line.startswith("|")]


def _budgets(script=SCRIPT):
    """gpu_check.sh --budgets: its return code, its table by command, each command's caps, and its other lines."""
    run = subprocess.run(["bash", script, "--budgets"], capture_output=True, text=True, timeout=60)
    lines = run.stdout.splitlines()
    header = lines[0].split()
    assert header == ["command", "setup", "steps", "report", "margin", "need", "budget", "limit"], run.stdout
    table, caps = {}, {}
    for line in lines[1:]:
        words = line.split()
        if len(words) == len(header) and all(word.isdigit() for word in words[1:]):
            table[words[0]] = dict(zip(header[1:], map(int, words[1:])))
        elif line.startswith("caps "):
            command, _, listed = line[len("caps "):].partition(":")
            caps[command] = {name: int(cap) for name, cap in (word.split("=") for word in listed.split())}
    return run, table, caps, lines


def test_each_command_fits_a_call_and_the_two_calls_fit_twelve_minutes():
    """protocol and suite, the two calls: each one's caps (setup and its own steps) with the report's reserve and a
    margin fit its default budget, which is at most 9 minutes, a minute under a call's 10; their defaults together
    are at most 12 minutes. The steps are the protocol's and the suite's, flash-attn 4's costs nothing on the GPU, and
    the script's header and usage give the table's numbers."""
    run, table, caps, lines = _budgets()
    assert run.returncode == 0 and run.stderr == "", run.stdout + run.stderr
    assert list(table) == ["protocol", "suite", "long"] and lines[-1] == "every budget holds"
    setup = ["venv", "install-venv", "probe-image"]
    assert list(caps["protocol"]) == setup + ["seed-tests", "sweep", "op-figures"]
    assert list(caps["suite"]) == setup + [
        "install-target", "probe-wheel", "suite-image", "peer", "offload-16384", "offload-32768", "flash4",
        "suite-wheel"
    ]
    assert list(caps["long"]) == setup + ["install-target", "probe-wheel", "long-sequence"]
    assert caps["suite"]["flash4"] == 0
    for command, row in table.items():
        names = list(caps[command])
        split = names.index("probe-wheel" if "probe-wheel" in names else "probe-image") + 1
        assert row["setup"] == sum(caps[command][name] for name in names[:split]), command
        assert row["steps"] == sum(caps[command][name] for name in names[split:]), command
        assert all(cap > 0 for name, cap in caps[command].items() if name != "flash4"), command
        assert row["report"] >= 10 and row["margin"] >= 10, command
        assert row["need"] == row["setup"] + row["steps"] + row["report"] + row["margin"], command
        # The caps and the reserves within the budget with the margin to spare, the budget within 9 minutes.
        assert row["setup"] + row["steps"] + row["report"] + row["margin"] <= row["budget"], command
        assert row["budget"] <= row["limit"] == COMMAND_SECONDS, command
    assert table["protocol"]["budget"] + table["suite"]["budget"] <= TWO_CALLS_SECONDS
    total = table["protocol"]["budget"] + table["suite"]["budget"]
    assert f"protocol + suite: {total} s of {TWO_CALLS_SECONDS} s" in lines

    # The header says the same, and its usage gives each call a timeout_s of its budget and 30 s, within a call's 10
    # minutes: the two calls' timeouts and a machine's start inside a task's 15.
    with open(SCRIPT) as file:
        header = file.read().split("\nset -uo pipefail", 1)[0]
    for command, row in table.items():
        assert re.search(
            rf"^#   {command}: +setup {row['setup']} s \+ steps {row['steps']} s \+ report {row['report']} s \+ "
            rf"margin {row['margin']} s = {row['budget']} s, its default budget$", header, re.M), command
        timeouts = re.findall(rf'"bash tests/benchmarks/gpu_check.sh {command}", carry \[".whl"\], timeout_s (\d+)',
                              header)
        assert timeouts and all(int(value) == row["budget"] + 30 <= CALL_SECONDS for value in timeouts), command
    assert "timeout_s 600" not in header and 'carry [".whl"]' in header
    # BENCHMARKS.md names each command with its budget.
    with open(os.path.join(REPO, "BENCHMARKS.md")) as file:
        benchmarks = file.read()
    for command, row in table.items():
        assert f"`gpu_check.sh {command}` ({row['budget']} s)" in benchmarks, command


def test_a_budget_that_does_not_hold_fails_the_check(tmp_path):
    """A cap raised over its command's budget, a budget over a call's 9 minutes, and the two calls over 12 minutes:
    --budgets names each and fails (the dry run's budget step with it)."""
    with open(SCRIPT) as file:
        text = file.read()
    folder = tmp_path / "tests" / "benchmarks"
    folder.mkdir(parents=True)
    script = folder / "gpu_check.sh"
    assert len(re.findall(r"\[peer\]=\d+", text)) == 1
    script.write_text(re.sub(r"\[peer\]=\d+", "[peer]=300", text))
    run, table, _, lines = _budgets(str(script))
    assert run.returncode == 1, run.stdout
    need = table["suite"]["need"]
    assert need > table["suite"]["budget"]
    assert f"NOT HELD: suite: its caps and reserves need {need} s, over its budget of {table['suite']['budget']} s" in \
        lines
    assert [line for line in lines if line.startswith("NOT HELD")] == [lines[-1]]
    budgets = re.search(r"^declare -A DEFAULT_BUDGET=\(\[protocol\]=(\d+) \[suite\]=\d+ \[long\]=\d+\)$", text, re.M)
    script.write_text(
        text.replace(budgets.group(0), f"declare -A DEFAULT_BUDGET=([protocol]={budgets.group(1)} "
                     "[suite]=600 [long]=600)"))
    run, table, _, lines = _budgets(str(script))
    assert run.returncode == 1, run.stdout
    two = table["protocol"]["budget"] + 600
    assert [line for line in lines if line.startswith("NOT HELD")] == [
        "NOT HELD: suite: its budget of 600 s is over a call's 540 s",
        "NOT HELD: long: its budget of 600 s is over a call's 540 s",
        f"NOT HELD: protocol + suite: {two} s, over the two calls' 720 s",
    ]


def test_the_gpu_check_runs_a_command_a_call():
    """On the GPU a run names its command: without one (both would outrun a call) or with an unknown word, it stops
    before anything runs."""
    for args, message in (([], "gpu_check.sh: name the command: protocol or suite (a device call each), or long"),
                          (["protocol", "both"], "gpu_check.sh: unknown argument both")):
        run = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stdout == "" and run.stderr.startswith(message), run.stderr


def _dry_run_checks(out, work, command, budgets):
    """What every command's report of the dry run holds: its sections, mode, date, steps (each passed, under three
    times its GPU cap, or the dry run's own), budget and the setup it shared."""
    report = (out / f"RESULTS-{command}.md").read_text()
    for title in SECTIONS[command]:
        assert title in report, (command, title)
    assert report.startswith(f"# Attention stash: GPU check, {command}\n")
    assert "- Mode: DRY RUN on CPU" in report
    assert re.search(r"^- Date: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", report, re.M)

    # Every step ran and passed, each with its command; leg 2's target install where a transformers wheel was at hand.
    transformers_wheels = glob.glob(str(work / "wheels" / "transformers-*.whl"))
    expected = SETUP + (("install-target", ) if transformers_wheels and command != "protocol" else ()) + STEPS[command]
    steps = _section(report, "## Steps")
    assert _step_names(report) == list(expected), command
    for name in expected:
        assert _row(steps, name)[1] == "passed", (command, name)
    assert f"- Steps: {len(expected)} of {len(expected)} passed\n" in report

    # The budget: checked, and each step's limit its GPU cap times the dry run's factor, or the dry run's own cap.
    _, table, caps, lines = budgets
    factor, own = re.match(r"dry run: each cap times (\d+); its own caps: (.*)$", lines[-2]).groups()
    own = dict((name, int(cap)) for name, cap in (word.split("=") for word in own.split()))
    assert _row(steps, "budget")[1:] == ["passed", "0", "0.0", "0", "`bash tests/benchmarks/gpu_check.sh --budgets`"]
    for name in expected:
        if name == "budget":
            continue
        cap = own[name] if name in own else int(factor) * caps[command][name]
        assert _row(steps, name)[4] == str(cap), (command, name)
    row = table[command]
    assert (
        f"- Time budget: {row['budget'] * int(factor)} s (the dry run's: {factor} x the default {row['budget']} "
        f"s); on the GPU the caps need setup {row['setup']} s + steps {row['steps']} s + report {row['report']} s "
        f"+ margin {row['margin']} s = {row['need']} s of the default {row['budget']} s, at most 540 s a call; "
        f"protocol and suite together {table['protocol']['budget'] + table['suite']['budget']} s of 720 s\n") in report

    # The offline install happened, into a venv made for this run, from the wheel folder the dry run built.
    venv = work / "venv"
    install = _section(report, "## Offline install")
    assert f"- Fresh venv: `{venv}`" in install
    wheel = _row(install, "deepspeed_attention_stash-0.1.0-py3-none-any.whl")
    assert wheel[1:3] == ["0.1.0", "venv"] and wheel[3].startswith(str(venv))
    install_command = _row(steps, "install-venv")[-1]
    assert f"{venv}/bin/python -m pip install --no-index --no-deps" in install_command
    assert str(work / "wheels") in install_command
    versions = _section(report, "## Versions")
    legs = 1 if command == "protocol" else 2
    assert _row(versions, "torch")[1:] == [torch.__version__] * legs
    assert len(_row(versions, "transformers")[1:]) == legs
    assert all(re.match(r"\d+\.\d+", cell) for cell in _row(versions, "transformers")[1:])
    assert _row(versions, "interpreter")[1:] == [f"{venv}/bin/python"] * legs
    return report, transformers_wheels


def test_gpu_check_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "PYTHON": sys.executable}
    env.pop("GPU_CHECK_BUDGET", None)
    run = subprocess.run(["bash", SCRIPT, "--dry-run"], env=env, capture_output=True, text=True, timeout=900)
    reports = "\n".join(path.read_text() for path in sorted(out.glob("RESULTS-*.md")))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{reports}"
    # The setup ran once, for all three commands.
    assert [line.split(":")[0] for line in run.stdout.splitlines() if line.startswith("[gpu_check] venv:")] == \
        ["[gpu_check] venv"]
    budgets = _budgets()
    protocol, _ = _dry_run_checks(out, work, "protocol", budgets)
    suite, transformers_wheels = _dry_run_checks(out, work, "suite", budgets)
    long_report, _ = _dry_run_checks(out, work, "long", budgets)

    venv = work / "venv"
    assert (venv / "pyvenv.cfg").is_file()
    installed = glob.glob(str(venv / "lib" / "python*" / "site-packages" /
                              "deepspeed_attention_stash-0.1.0.dist-info"))
    assert len(installed) == 1
    install = _section(suite, "## Offline install")
    if transformers_wheels:
        transformers_wheel = _row(install, os.path.basename(transformers_wheels[0]))
        assert transformers_wheel[2] == "target" and transformers_wheel[3] == str(work / "site-transformers")
    else:
        assert "leg 2 REUSES the installed transformers" in install
    install = _section(protocol, "## Offline install")
    assert "- Leg 2:" not in install and "this command runs under leg 1's transformers alone" in install

    # What each command leaves to another, and why; the dry run's AutoEP deselection.
    assert _section(protocol, "## Skipped here, and why").splitlines()[2:5] == [
        "- the AutoEP engine step: deselected in the dry run (about 40 s of CPU under transformers 5.22 and older, "
        "skipped on newer); on the GPU it runs",
        "- the suite's CUDA tests, the peer comparison (TRL's selective), the offload leg and flash-attn 4: another "
        "call's: gpu_check.sh suite",
        "- the long-sequence sweep: a call of its own (gpu_check.sh long), outside the two calls' 12 minutes",
    ]
    assert _section(suite, "## Skipped here, and why").splitlines()[2:4] == [
        "- the seed's GPU tests (the replay, the AutoEP engine step), the stashed-layer sweep and the op-level "
        "figures: another call's: gpu_check.sh protocol",
        "- the long-sequence sweep: a call of its own (gpu_check.sh long), outside the two calls' 12 minutes",
    ]
    assert "- everything else: the two calls' commands: gpu_check.sh protocol and gpu_check.sh suite" in long_report

    # The protocol's seed tests under leg 1: the CPU replay cases passed, every CUDA replay case has an outcome, the
    # AutoEP step deselected here (the GPU run has it).
    seed = _section(protocol, "## The seed's GPU tests")
    assert "-k 'replay_matches_autograd or autoep_engine_step' --deselect " \
           "tests/unit/runtime/activation_checkpointing/test_attention_stash.py::" \
           "test_autoep_engine_step_with_and_without_the_stash" in seed
    assert "- Not run here: the AutoEP engine step" in seed
    for case in ("mha-causal", "mha-padded", "gqa-causal", "gqa-padded"):
        assert _row(seed, f"test_attention_stash.py::test_replay_matches_autograd[cpu-flash_attention-{case}]")[1] \
            == "passed"
    cuda = [line for line in seed.splitlines() if "[cuda-" in line]
    assert len(cuda) == 12 and all(re.search(r"\| (passed|skipped|failed|error) \|", line) for line in cuda)
    assert "autoep" not in seed.split("Tests: ", 2)[-1]

    # Each transformers leg of the suite recorded the GPU tests: the CPU replay case passed, every CUDA case has an
    # outcome.
    for leg in ("### Leg 1: transformers", "### Leg 2: transformers"):
        section = _section(suite, leg)
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
    # batch in both checkpoint modes, each passed, from the junit XML that stays in the work folder; and the one line
    # that the GPU run gives instead.
    flash4 = _section(suite, "## flash-attn 4")
    assert "- Wheels: dry run: the CPU double's flash-attn 4 tests, no flash-attn 4 installed" in flash4
    assert f"- On the GPU (`gpu_check.sh suite`): not run, not a failure: {FLASH4_GPU_SKIP}" in flash4
    assert "Tests: 4 passed (from the junit XML in the work folder)." in flash4
    for kind in ("plain", "packed_position_ids"):
        for mode in ("reentrant", "non_reentrant"):
            case = f"test_attention_stash_flash4.py::test_a_step_is_stock[4.0.0b40-llama-{kind}-{mode}]"
            assert _row(flash4, case)[1] == "passed", case
    assert (work / "suite" / "junit-flash4.xml").is_file()

    # The stashed-layer sweep (protocol): the stash on no, half and all layers, no selective arms; the peer comparison
    # (suite): every arm, TRL's selective and its non-reentrant control among them.
    for report, title, arms, left_out in (
        (protocol, "## Benchmark: the stashed-layer sweep", ("plain recompute", "stash 1 layers", "stash 2 layers"),
         ("non-reentrant recompute", "stash 2, non-reentrant", "selective AC (TRL)")),
        (suite, "## Benchmark: the peer comparison (TRL's selective)",
         ("plain recompute", "stash 1 layers", "stash 2 layers", "non-reentrant recompute", "stash 2, non-reentrant",
          "selective AC (TRL)"), ()),
    ):
        benchmark = _section(report, title)
        for arm in arms:
            assert re.match(r"[\d,]+\.\d$", _row(benchmark, arm)[2]), arm
        for arm in left_out:
            assert f"| {arm} |" not in benchmark, arm
        assert re.search(r"Attention forward \(the benchmark's op-level gate.*\): \d+\.\d+ ms per layer", benchmark)
        assert "arms agree" in benchmark
    assert "--no-sac --json " in _row(_section(protocol, "## Steps"), "sweep")[-1]
    assert "--no-sac" not in _row(_section(suite, "## Steps"), "peer")[-1]

    figures = _section(protocol, "## Op-level figures")
    assert re.match(r"\d+\.\d+ ms$", _row(figures, "default (FLASH_ATTENTION)")[2])
    assert re.match(r"-?\d+\.\d+ ms$", _row(figures, "stash 2 layers")[2])

    # Micro-batch 1, 8 query heads, sequence 64, head dim 64 in FP32: the output and its FP32 log-sum-exp.
    formula = 1 * 8 * 64 * (64 * 4 + 4)
    kept = _section(protocol, "## Bytes kept per layer against the planner")
    assert f"{formula:,} B" in kept
    assert _row(kept, "attention_stash_layer_bytes, default")[1:3] == [f"{formula:,}", "+0"]
    assert _row(kept, "kept by stash 2 layers (peak kept / stashed layers)")[1:3] == [f"{formula:,}", "+0"]

    for report in (protocol, suite):
        memory = _section(report, "## Peak memory per arm")
        assert re.match(r"[\d,.]+ MiB$", _row(memory, "stash 2 layers")[2])

    # The long-sequence leg at tiny shapes: both lengths, every recompute served, the planner's bytes kept (4 query
    # heads of dimension 16 in FP32, and the FP32 log-sum-exp).
    long = _section(long_report, "## Long sequences")
    assert "Lengths finished: 2 of 2." in long
    for sequence in (32, 64):
        row = _row(long, str(sequence))
        assert row[1] == "FLASH_ATTENTION" and row[-1] == "8"
        assert row[-3] == row[-2] == f"{4 * sequence * (16 * 4 + 4):,}"

    # The offload leg at tiny shapes, in 4 layers: its four arms, the stash's recomputes served (4 layers x 4 steps
    # in the two runs of each arm), the route (DeepSpeed's on CPU, where transformers' pins memory it cannot) and the
    # two expectations: on CPU DeepSpeed's engine moves no byte, so the memory one is not judged, the step one is.
    offload = _section(suite, "## Offload")
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

    # What the device tool brings back from each call: at most 8 files, no folders; each report names its own.
    files = sorted(path.name for path in out.iterdir())
    assert files == sorted(name for names in FILES.values() for name in names)
    for command, names in FILES.items():
        assert len(names) <= 8
        report = (out / f"RESULTS-{command}.md").read_text()
        assert report.rstrip().endswith(".") and all(name in report.rsplit("\nFiles: ", 1)[1] for name in names)


def test_gpu_check_on_the_gpu_runs_each_commands_steps_and_skips_flash_attn_4_in_a_line(tmp_path):
    """The GPU run's steps, in order, with their commands: the protocol's seed tests with the AutoEP step, its sweep
    without the selective arms and the op-level figures from it; the suite's CUDA tests in both legs, the peer
    comparison with every arm, the offload leg at 16k and 32k tokens, and flash-attn 4 skipped in one line with its
    reason, nothing installed, even with a flash-attn-4 wheel in the wheel folder. Run here with a budget of a second:
    every other step is skipped for the time, in no time, and the reports say so."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "flash_attn_4-4.0.0b40-py3-none-any.whl", "w") as archive:
        archive.writestr("flash_attn_4-4.0.0b40.dist-info/METADATA",
                         "Metadata-Version: 2.1\nName: flash_attn_4\nVersion: 4.0.0b40\n")
    env = {
        **os.environ, "OUT": str(out),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "GPU_CHECK_WHEELS": str(wheels),
        "GPU_CHECK_BUDGET": "1",
        "PYTHON": sys.executable
    }
    run = subprocess.run(["bash", SCRIPT, "protocol", "suite"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    out_of_time = "skipped (out of time)"
    setup = ["venv", "install-base", "probe-image"]
    protocol = (out / "RESULTS-protocol.md").read_text()
    assert "- Mode: GPU (`gpu_check.sh`)" in protocol
    assert "- Time budget: 1 s (GPU_CHECK_BUDGET; the default is 255 s)" in protocol
    assert _step_names(protocol) == setup + ["budget", "seed-tests", "sweep", "op-figures"]
    steps = _section(protocol, "## Steps")
    seed = _row(steps, "seed-tests")
    assert seed[1] == out_of_time and "test_attention_stash.py -k 'replay_matches_autograd or autoep_engine_step' " \
        in seed[-1] and "--deselect" not in seed[-1] and "junit-seed.xml" in seed[-1]
    sweep = _row(steps, "sweep")[-1]
    assert "--preset qwen3-30b-a3b --device cuda --dtype bfloat16 --sequence 4096 --micro-batch 4 --no-sac " \
        f"--json {out}/sweep.json" in sweep
    assert f"--bench-json {out}/sweep.json" in _row(steps, "op-figures")[-1]

    suite = (out / "RESULTS-suite.md").read_text()
    assert _step_names(suite) == setup + [
        "install-target", "probe-wheel", "budget", "suite-image", "peer", "offload-16384", "offload-32768", "flash4",
        "suite-wheel"
    ]
    steps = _section(suite, "## Steps")
    for name in ("suite-image", "suite-wheel"):
        assert "-k 'replay_matches_autograd or cuda or kept_bytes_are_one_output or from_pretrained'" in \
            _row(steps, name)[-1]
    peer = _row(steps, "peer")[-1]
    assert "--preset qwen3-30b-a3b" in peer and "--no-sac" not in peer and f"--json {out}/peer.json" in peer
    for n in (16384, 32768):
        assert f"--layers 4 --offload --warmup 1 --steps 2 --sequence {n} " in _row(steps, f"offload-{n}")[-1]
    assert _row(steps, "flash4") == [
        "flash4", f"skipped: {FLASH4_GPU_SKIP} (test_attention_stash_flash4_cuda.py "
        "runs the real one where it is installed)", "-", "0", "0", "`-`"
    ]
    assert "flash_attn_4-" not in " ".join(_row(steps, name)[-1] for name in _step_names(suite))
    assert not (tmp_path / "work" / "site-flash4").exists()
    skipped = _section(suite, "## Skipped here, and why")
    assert f"- `flash4`: {FLASH4_GPU_SKIP}" in skipped
    assert f"- Not run, not a failure: {FLASH4_GPU_SKIP}" in _section(suite, "## flash-attn 4")
    assert "; skipped, not failed: flash4; not passed: " in suite
    assert all(
        row.split(" | ")[1] in (out_of_time, "passed") or row.startswith("| flash4 |")
        for row in steps.splitlines()[4:] if row.startswith("|"))


def test_gpu_check_names_what_its_python_lacks(tmp_path):
    """Run with a Python that lacks the packages (a machine's own python3, say), the check stops before any step with
    one message naming what is missing and how to get it, and a report for each command that says no step ran."""
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
    assert sorted(path.name
                  for path in out.iterdir()) == ["RESULTS-long.md", "RESULTS-protocol.md", "RESULTS-suite.md"]
    for command in ("protocol", "suite", "long"):
        assert (out / f"RESULTS-{command}.md").read_text() == \
            f"# Attention stash: GPU check, {command} (dry-run): NO STEP RAN\n\n{message}\n"


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
    """A GPU run of the suite, whose flash-attn 4 step is skipped for its reason (its stack cannot travel): the step
    is reported with the reason, in the steps and in what the command skipped, and not counted as a failure; one
    skipped for the time is."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (work / "meta.tsv").write_text("mode\tgpu\ncommand\tsuite\nflash4_note\tnot installed: its GPU stack cannot "
                                   "travel\n")
    (work / "steps.tsv").write_text("venv\tpassed\t0\t0.1\t60\tpython venv\n"
                                    f"flash4\tskipped: {FLASH4_GPU_SKIP}\t-\t0\t0\t-\n")
    run = _report_helper("report", "--work", str(work), "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(path.name for path in out.iterdir()) == ["RESULTS-suite.md"]
    report = (out / "RESULTS-suite.md").read_text()
    assert "- Steps: 1 of 2 passed; skipped, not failed: flash4\n" in report
    assert "## Logs of the steps that did not pass" not in report
    flash4 = _section(report, "## flash-attn 4")
    assert "- Wheels: not installed: its GPU stack cannot travel" in flash4
    assert f"- Not run, not a failure: {FLASH4_GPU_SKIP}" in flash4
    assert _section(report, "## Skipped here, and why").splitlines()[2:] == [f"- `flash4`: {FLASH4_GPU_SKIP}"]
    with open(work / "steps.tsv", "a") as steps:
        steps.write("suite-wheel\tskipped (out of time)\t-\t0\t0\tpytest\n")
    assert _report_helper("report", "--work", str(work), "--out", str(out)).returncode == 0
    report = (out / "RESULTS-suite.md").read_text()
    assert "- Steps: 1 of 3 passed; skipped, not failed: flash4; not passed: suite-wheel\n" in report
    assert "### suite-wheel: skipped (out of time)" in report
    assert "suite-wheel" not in _section(report, "## Skipped here, and why")
