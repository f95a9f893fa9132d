# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The GPU check's Python side (gpu_check.sh): the fresh venv, what an environment holds, and each command's report.

    python gpu_check_report.py venv DIR                   # a fresh venv that sees this interpreter's packages
    python gpu_check_report.py probe --out P.json [--venv DIR] [--target DIR] [--device cuda] [WHEEL ...]
    python gpu_check_report.py flash4-wheels DIR          # DIR's newest flash-attn-4 wheel and its dependencies' there
                                                          # (gpu_check.sh keeps them out of its venv)
    python gpu_check_report.py report --work DIR --out DIR

``report`` reads what one command's steps left in its work folder (meta.tsv, which names the command, steps.tsv,
skipped.tsv, the probes, the logs) and in the output folder (the junit XML of its pytest steps, the benchmark's and
the op-level figures' JSON) and writes RESULTS-<command>.md there. A step that failed or timed out is reported as
such, with the end of its log, and every section that lacks its input says which step it waited for; one skipped for
a reason (its status "skipped: REASON") is not a failure. Each report says what its command skipped and why.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
import xml.etree.ElementTree as ElementTree
import zipfile

# The GPU tests: every CUDA case, the replay against autograd on each backend (its CPU case too) and the AutoEP step,
# which runs on CUDA where there is one (the protocol's). Matched against the test's name with its parameters.
GPU_TESTS = re.compile(r"cuda|replay_matches_autograd|autoep_engine_step")
# The seed's figures on an H100 at the Qwen3-30B-A3B preset, and the planner's bytes per layer there.
H100_SAVED_MS = 0.93
H100_FA3_FORWARD_MS = 0.95
PRESET_PLANNER_BYTES = 136_314_880
LEGS = (("image", "the image's transformers"), ("wheel", "transformers from the wheel folder"))
# gpu_check.sh's commands, each a device call of its own with its own report, RESULTS-<command>.md.
COMMANDS = {
    "protocol": "the seed's protocol: its GPU tests (the replay against autograd, the AutoEP engine step), the "
    "stashed-layer sweep and the op-level figures, under the image's transformers",
    "suite": "the suite's CUDA tests under both transformers, the peer comparison (TRL's selective), the offload leg "
    "and flash-attn 4",
    "long": "the long-sequence sweep",
}
# The benchmark's run in each command, its step and its files under the output folder (STEP.json, STEP.png).
BENCH_STEPS = {"protocol": "sweep", "suite": "peer"}
BENCH_TITLES = {
    "sweep": "the stashed-layer sweep",
    "peer": "the peer comparison (TRL's selective)",
}
# What each command leaves in the output folder: the device tool brings 8 files back at most.
FILES = {
    "protocol": "RESULTS-protocol.md, gpu_check-protocol.log (every step's log), junit-seed.xml, sweep.json, "
    "sweep.png, op_figures.json",
    "suite": "RESULTS-suite.md, gpu_check-suite.log (every step's log), junit-image.xml, junit-wheel.xml, "
    "peer.json, peer.png (the offload leg's figures and flash-attn 4's outcomes are above)",
    "long": "RESULTS-long.md, gpu_check-long.log (every step's log), long.json",
}
LOG_TAIL_LINES = 40
# A step's status when it was skipped for a reason, which is not a failure ("skipped (out of time)" is one).
SKIPPED = "skipped: "


def make_venv(directory):
    """A fresh venv with the system site-packages and, after its own, this interpreter's.

    ``--system-site-packages`` gives a venv the base interpreter's packages: when this interpreter is itself a venv's
    (the H200's python3 is /opt/torch/.venv's, which holds torch), that is not where its packages are, so a .pth file
    adds them, behind the new venv's own site-packages.
    """
    venv.create(directory, system_site_packages=True, with_pip=False, symlinks=os.name != "nt")
    site = sysconfig.get_path("purelib", vars={"base": directory, "platbase": directory})
    parents = [path for path in sys.path if os.path.basename(path) in ("site-packages", "dist-packages")]
    with open(os.path.join(site, "_gpu_check_parent_site.pth"), "w") as file:
        # addsitedir, not a plain path: the .pth files of those folders (editable installs, say) count too.
        file.write("".join(f"import site; site.addsitedir({path!r})\n" for path in parents))
    print(f"venv {directory}: site-packages {site}, then {', '.join(parents) or 'nothing else'}")
    return 0


def _cudnn(version):
    if not version:
        return None
    # cuDNN 9 numbers its versions major * 10000 + minor * 100 + patch, cuDNN 8 major * 1000 + minor * 100 + patch.
    if version >= 90000:
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"


def _wheel_name(path):
    name, version = os.path.basename(path).split("-")[:2]
    return name, version


def probe(args):
    """The versions one environment holds, and where each wheel it was given landed; 1 when one is not there."""
    import importlib.metadata as metadata

    import torch

    cuda_available = torch.cuda.is_available()  #ignore-cuda
    info = dict(python=sys.version.split()[0],
                executable=sys.executable,
                prefix=sys.prefix,
                pythonpath=os.environ.get("PYTHONPATH", ""),
                torch=torch.__version__,
                cuda=torch.version.cuda,
                cudnn=_cudnn(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
                cuda_available=cuda_available,
                gpu=None,
                driver=None,
                modules={},
                wheels=[])
    if info["cuda_available"]:
        info["gpu"] = torch.cuda.get_device_name(0)  #ignore-cuda
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))  #ignore-cuda
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True,
                             text=True,
                             timeout=10)
        if smi.returncode == 0 and smi.stdout.strip():
            info["smi_gpu"], info["driver"] = [part.strip() for part in smi.stdout.splitlines()[0].split(",")][:2]
    except (OSError, subprocess.SubprocessError):
        pass
    for name in ("transformers", "deepspeed", "pydantic", "pytest", "matplotlib"):
        try:
            module = __import__(name)
            info["modules"][name] = dict(version=getattr(module, "__version__", None), file=module.__file__)
        except Exception as error:  # recorded: a module that does not import is what the check is for
            info["modules"][name] = dict(error=f"{type(error).__name__}: {error}".splitlines()[0][:200])
    places = [(kind, os.path.realpath(path)) for kind, path in (("venv", args.venv), ("target", args.target)) if path]
    missing = []
    for path in args.wheels:
        name, version = _wheel_name(path)
        row = dict(wheel=os.path.basename(path), name=name, version=version, found=None, location=None, where=None)
        try:
            distribution = metadata.distribution(name)
            row["found"] = distribution.version
            row["location"] = os.path.realpath(str(distribution.locate_file("")))
            inside = [kind for kind, place in places if os.path.commonpath([row["location"], place]) == place]
            row["where"] = inside[0] if inside else "elsewhere"
        except metadata.PackageNotFoundError:
            pass
        if row["found"] != version or (places and row["where"] == "elsewhere"):
            missing.append(row["wheel"])
        info["wheels"].append(row)
    with open(args.out, "w") as file:
        json.dump(info, file, indent=2)
    print(json.dumps(info, indent=2))
    if missing:
        print(f"not installed where expected: {', '.join(missing)}", file=sys.stderr)
    if args.device == "cuda" and not info["cuda_available"]:
        print("torch sees no CUDA device", file=sys.stderr)
        return 1
    broken = [name for name in ("transformers", "deepspeed", "pytest") if "error" in info["modules"][name]]
    if broken:
        print(f"does not import: {', '.join(broken)}", file=sys.stderr)
    return 1 if missing or broken else 0


def flash4_wheels(folder):
    """The newest flash-attn-4 wheel in ``folder`` and, after it, the wheels there of its dependencies, as pip would
    pick them from the folder alone: each Requires-Dist that holds here (extras only where asked), transitively. A
    dependency the folder lacks (torch, say) is left to the environment. Without such a wheel: 1, nothing printed."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    wheels = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".whl"):
            project, version = parse_wheel_filename(name)[:2]
            if project not in wheels or wheels[project][0] < version:
                wheels[project] = (version, os.path.join(folder, name))
    pending, seen = [(canonicalize_name("flash-attn-4"), frozenset())], {}
    while pending:
        project, extras = pending.pop(0)
        if project not in wheels or (project in seen and extras <= seen[project]):
            continue
        seen[project] = seen.get(project, frozenset()) | extras
        with zipfile.ZipFile(wheels[project][1]) as wheel:
            metadata = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
            lines = wheel.read(metadata).decode().splitlines()
        for line in lines:
            if line.startswith("Requires-Dist:"):
                requirement = Requirement(line.partition(":")[2].strip())
                if requirement.marker is None or any(
                        requirement.marker.evaluate({"extra": extra}) for extra in extras | {""}):
                    pending.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    if not seen:
        print(f"no flash_attn_4-*.whl in {folder}", file=sys.stderr)
        return 1
    print("\n".join(wheels[project][1] for project in seen))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# RESULTS-<command>.md
# ---------------------------------------------------------------------------------------------------------------------


def _load_json(path):
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def _read_tsv(path, columns):
    rows = []
    if os.path.isfile(path):
        with open(path) as file:
            for line in file:
                parts = line.rstrip("\n").split("\t")
                rows.append(dict(zip(columns, parts + [""] * (len(columns) - len(parts)))))
    return rows


def _cell(value):
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return lines


def _mib(value):
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def _ms(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f} ms"


def _log_tail(path, lines=LOG_TAIL_LINES):
    try:
        with open(path, errors="replace") as file:
            text = file.read().splitlines()
    except OSError:
        return ["(no log)"]
    return text if lines is None else text[-lines:]


def junit_cases(path):
    """Each test case of a junit XML file: id, outcome, seconds, the first line of its message."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # the test a KeyboardInterrupt stopped: pytest writes it without a name
        module = case.get("classname", "").rsplit(".", 1)[-1]
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                if child.tag == "skipped" and child.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                message = (child.get("message") or child.text or "").strip().splitlines()
                message = message[0][:160] if message else ""
                break
        name = f"{module}.py::{case.get('name')}"
        cases.append(dict(id=name, outcome=outcome, seconds=float(case.get("time", 0)), message=message))
    return cases


_VERBOSE = re.compile(r"^(?:\S+/)?(\S+\.py::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?: \((.*)\))?")


def log_cases(path):
    """Fallback when a run left no junit XML: the outcomes pytest -v printed as each test finished."""
    cases = []
    for line in _log_tail(path, lines=None):
        match = _VERBOSE.match(line)
        if match:
            outcome = {"XFAIL": "xfailed", "XPASS": "xpassed"}.get(match.group(2), match.group(2).lower())
            cases.append(dict(id=match.group(1), outcome=outcome, seconds=None, message=match.group(3) or ""))
    return cases


def _counts(cases):
    counts = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return ", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items())) or "no test"


class Report:

    def __init__(self, work, out):
        self.work, self.out = work, out
        self.meta = {row["key"]: row["value"] for row in _read_tsv(os.path.join(work, "meta.tsv"), ["key", "value"])}
        self.command = self.meta.get("command", "suite")
        self.legs = [leg for leg in self.meta.get("legs", "image wheel").split() if leg in dict(LEGS)]
        self.steps = _read_tsv(os.path.join(work, "steps.tsv"),
                               ["name", "status", "rc", "seconds", "limit", "command"])
        self.step = {row["name"]: row for row in self.steps}
        self.probes = {leg: _load_json(os.path.join(work, f"probe-{leg}.json")) for leg, _ in LEGS}
        # The benchmark's run of this command: the stashed-layer sweep (protocol) or the peer comparison (suite).
        self.bench_step = BENCH_STEPS.get(self.command)
        self.bench = _load_json(os.path.join(out, f"{self.bench_step}.json")) if self.bench_step else None
        self.op = _load_json(os.path.join(out, "op_figures.json")) if self.command == "protocol" else None
        self.long = _load_json(os.path.join(out, "long.json")) if self.command == "long" else None
        # The offload leg's JSON by step name (offload-LENGTH), in the work folder.
        self.offload = {
            name[:-len(".json")]: _load_json(os.path.join(work, name))
            for name in os.listdir(work) if name.startswith("offload-") and name.endswith(".json")
        }
        self.lines = []

    def passed(self, row):
        """Whether a step counts as passed: it passed, or it was skipped for a reason (not for the time)."""
        return row["status"] == "passed" or row["status"].startswith(SKIPPED)

    def add(self, *lines):
        self.lines.extend(lines)

    def waited(self, step, what):
        row = self.step.get(step)
        status = f"{row['status']} (rc {row['rc']}, {row['seconds']} s)" if row else "did not run"
        self.add(f"Not available ({what}): the step `{step}` {status}; the end of its log is below.", "")

    def _leg_title(self, leg):
        probe = self.probes[leg] or {}
        version = probe.get("modules", {}).get("transformers", {}).get("version", "?")
        if leg == "wheel" and "REUSES" in self.meta.get("leg2_note", ""):
            return f"transformers {version} (REUSED: no transformers wheel at hand)"
        return f"transformers {version} ({dict(LEGS)[leg]})"

    def _cases(self, step, junit):
        """A pytest step's test cases, from its junit XML or, where it left none, from its log; and which it was."""
        try:
            return junit_cases(junit), "junit XML"
        except (OSError, ElementTree.ParseError):
            return log_cases(os.path.join(self.work, "logs", f"{step}.log")), "pytest -v log (no junit)"

    def _unfinished(self, step):
        row = self.step.get(step)
        if row and row["status"] != "passed":
            self.add(
                f"The run {row['status']} (rc {row['rc']}, {row['seconds']} s of {row['limit']}): the "
                f"tables hold the tests that finished.", "")

    def _cases_table(self, cases):
        self.add(*_table(["test", "outcome", "seconds", "message"], [[
            case["id"], case["outcome"], "-" if case["seconds"] is None else f"{case['seconds']:.2f}", case["message"]
        ] for case in cases]))
        self.add("")

    def header(self):
        mode = self.meta.get("mode", "?")
        self.add(f"# Attention stash: GPU check, {self.command}", "")
        self.add(f"- Date: {self.meta.get('date', '?')} (report written "
                 f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC)")
        self.add(f"- Command: `gpu_check.sh {self.command}`: {COMMANDS.get(self.command, '?')}")
        if mode == "dry-run":
            self.add("- Mode: DRY RUN on CPU at tiny shapes (`gpu_check.sh --dry-run`): every step's command, the "
                     "offline install into a fresh venv and this report, not a GPU result")
        else:
            self.add("- Mode: GPU (`gpu_check.sh`)")
        for key, label in (("commit", "Commit"), ("host", "Host")):
            self.add(f"- {label}: {self.meta.get(key, '?')}")
        self.add(self._budget_line())
        failed = [row["name"] for row in self.steps if not self.passed(row)]
        skipped = [row["name"] for row in self.steps if row["status"].startswith(SKIPPED)]
        passed = f"- Steps: {len(self.steps) - len(failed) - len(skipped)} of {len(self.steps)} passed"
        passed += f"; skipped, not failed: {', '.join(skipped)}" if skipped else ""
        self.add(passed + (f"; not passed: {', '.join(failed)}" if failed else ""), "")

    def _budget_line(self):
        budget, default = self.meta.get("budget", "?"), self.meta.get("budget_default", "?")
        try:
            setup, steps, report, margin = (int(part) for part in self.meta["budget_parts"].split())
            limit, two_limit, two = (int(part) for part in self.meta["budget_limits"].split())
        except (KeyError, ValueError):
            return f"- Time budget (s): {budget}"
        if self.meta.get("mode") == "dry-run" and budget == str(int(default) * int(self.meta.get("dry_factor", 1))):
            which = f"the dry run's: {self.meta['dry_factor']} x the default {default} s"
        elif budget == default:
            which = "the default"
        else:
            which = f"GPU_CHECK_BUDGET; the default is {default} s"
        return (f"- Time budget: {budget} s ({which}); on the GPU the caps need setup {setup} s + steps {steps} s + "
                f"report {report} s + margin {margin} s = {setup + steps + report + margin} s of the default "
                f"{default} s, at most {limit} s a call; protocol and suite together {two} s of {two_limit} s")

    def skipped(self):
        self.add("## Skipped here, and why", "")
        lines = [
            f"- `{row['name']}`: {row['status'][len(SKIPPED):]}" for row in self.steps
            if row["status"].startswith(SKIPPED)
        ]
        lines += [
            f"- {row['what']}: {row['why']}"
            for row in _read_tsv(os.path.join(self.work, "skipped.tsv"), ["what", "why"])
        ]
        self.add(*(lines or ["Nothing."]), "")

    def versions(self):
        self.add("## Versions", "")
        if not any(self.probes[leg] for leg in self.legs):
            self.waited("probe-image", "the versions")
            return
        rows = []
        fields = (("GPU", lambda p: p.get("gpu") or p.get("smi_gpu") or "none (CPU)"),
                  ("compute capability", lambda p: p.get("capability", "-")),
                  ("driver", lambda p: p.get("driver") or "-"), ("Python", lambda p: p["python"]),
                  ("interpreter", lambda p: p["executable"]), ("torch", lambda p: p["torch"]),
                  ("CUDA (torch)", lambda p: p.get("cuda") or "-"), ("cuDNN", lambda p: p.get("cudnn") or "-"))
        for label, field in fields:
            rows.append([label] + [field(self.probes[leg]) if self.probes[leg] else "-" for leg in self.legs])
        for name in ("transformers", "deepspeed", "pydantic", "pytest", "matplotlib"):
            cells = []
            for leg in self.legs:
                module = (self.probes[leg] or {}).get("modules", {}).get(name)
                if not module:
                    cells.append("-")
                elif "error" in module:
                    cells.append(f"does not import: {module['error']}")
                else:
                    cells.append(f"{module['version']} ({module['file']})")
            rows.append([name] + cells)
        titles = {"image": "leg 1: " + self._leg_title("image"), "wheel": "leg 2: " + self._leg_title("wheel")}
        self.add(*_table([""] + [titles[leg] for leg in self.legs], rows))
        self.add("")

    def install(self):
        self.add("## Offline install", "")
        self.add(f"- Wheel folder: `{self.meta.get('wheels', '?')}` ({self.meta.get('wheels_note', '')})")
        self.add(f"- Fresh venv: `{self.meta.get('venv', '?')}` ({self.meta.get('venv_note', '')})")
        if "wheel" in self.legs:
            self.add(f"- pip: `--no-index --no-deps --find-links` the wheel folder; leg 2's transformers into the "
                     f"target folder `{self.meta.get('target', '?')}`, first on PYTHONPATH for that leg")
            self.add(f"- Leg 2: {self.meta.get('leg2_note', '?')}", "")
        else:
            self.add(
                "- pip: `--no-index --no-deps --find-links` the wheel folder; this command runs under leg 1's "
                "transformers alone", "")
        rows = []
        for leg in self.legs:
            for wheel in (self.probes[leg] or {}).get("wheels", []):
                rows.append(
                    [wheel["wheel"], wheel["found"] or "NOT FOUND", wheel["where"] or "-", wheel["location"] or "-"])
        if rows:
            self.add(*_table(["installed wheel", "version that imports", "in", "location"], rows))
        else:
            self.add("No wheel was installed.")
        self.add("")

    def steps_table(self):
        self.add("## Steps", "")
        rows = [[row["name"], row["status"], row["rc"], row["seconds"], row["limit"], f"`{row['command']}`"]
                for row in self.steps]
        self.add(*_table(["step", "status", "rc", "seconds", "timeout (s)", "command"], rows))
        self.add("")

    def seed_tests(self):
        self.add("## The seed's GPU tests", "")
        self.add(
            f"Tests: `{self.meta.get('seed_tests', '?')}` under {self._leg_title('image')}: the replayed node "
            f"against autograd's on each CUDA backend (output, dK and dV bitwise; dQ as accurate as autograd's "
            f"against FP32) and its CPU case, and a training step of an AutoEP engine on a two-layer Mixtral with and "
            f"without the stash (equal loss, attention gradients within 1e-2 relative L2).", "")
        if self.meta.get("seed_note"):
            self.add(f"- Not run here: {self.meta['seed_note']}", "")
        cases, source = self._cases("seed-tests", os.path.join(self.out, "junit-seed.xml"))
        self._unfinished("seed-tests")
        if not cases:
            self.waited("seed-tests", "the test outcomes")
            return
        self.add(f"Tests: {_counts(cases)} (from the {source}).", "")
        self._cases_table(cases)

    def suites(self):
        self.add("## GPU tests", "")
        self.add(
            f"Suite: `{self.meta.get('suite', '?')}`. GPU tests are those whose name matches "
            f"`{GPU_TESTS.pattern}`: cuDNN, flash and memory-efficient attention forced in turn, MHA and GQA, "
            f"causal and padded, the replay against autograd (and its CPU case), the CUDA two-layer step and "
            f"a model loaded by from_pretrained at its defaults and trained on CUDA (the AutoEP engine step is the "
            f"protocol's). Non-reentrant checkpointing on CUDA runs in the peer comparison's non-reentrant arms.", "")
        rest = []
        for leg, _ in LEGS:
            step = f"suite-{leg}"
            self.add(f"### Leg {1 if leg == 'image' else 2}: {self._leg_title(leg)}", "")
            cases, source = self._cases(step, os.path.join(self.out, f"junit-{leg}.xml"))
            self._unfinished(step)
            gpu = [case for case in cases if GPU_TESTS.search(case["id"].split("::")[-1])]
            if not cases:
                self.waited(step, "the test outcomes")
            else:
                self.add(f"GPU tests: {_counts(gpu)} (from the {source}).", "")
                self._cases_table(gpu)
            rest.append((leg, [case for case in cases if case not in gpu]))
        self.add("## Rest of the suite", "")
        for leg, cases in rest:
            bad = [case for case in cases if case["outcome"] in ("failed", "error")]
            row = self.step.get(f"suite-{leg}")
            unfinished = ""
            if row and row["status"] != "passed":
                unfinished = f" (the run {row['status']}: what had not run by then is not counted)"
            self.add(f"- Leg {1 if leg == 'image' else 2}, {self._leg_title(leg)}: {_counts(cases)}{unfinished}")
            for case in bad:
                self.add(f"  - {case['outcome'].upper()} `{case['id']}`: {case['message']}")
        self.add("")

    def flash4_tests(self):
        self.add("## flash-attn 4", "")
        self.add(f"- Wheels: {self.meta.get('flash4_note', '?')}")
        if self.meta.get("flash4_gpu"):
            self.add(f"- On the GPU (`gpu_check.sh suite`): not run, not a failure: {self.meta['flash4_gpu']}")
        row = self.step.get("flash4")
        if row is None:
            self.add("")
            self.waited("flash4", "the flash-attn 4 tests")
            return
        if row["status"].startswith(SKIPPED):
            self.add(f"- Not run, not a failure: {row['status'][len(SKIPPED):]}", "")
            return
        self.add(f"- Command: `{row['command']}`", "")
        cases, source = self._cases("flash4", os.path.join(self.work, "junit-flash4.xml"))
        source = source.replace("junit XML", "junit XML in the work folder")
        if not cases:
            self.waited("flash4", "the flash-attn 4 test outcomes")
            return
        if row["status"] != "passed":
            self.add(
                f"The run {row['status']} (rc {row['rc']}, {row['seconds']} s of {row['limit']}): the table "
                f"holds the tests that finished.", "")
        self.add(f"Tests: {_counts(cases)} (from the {source}).", "")
        self._cases_table(cases)

    def benchmark(self):
        step = self.bench_step
        self.add(f"## Benchmark: {BENCH_TITLES[step]}", "")
        self.add(f"Command: `{self.step.get(step, {}).get('command', '?')}`; {self.meta.get('bench_note', '')}", "")
        if not self.bench:
            self.waited(step, "the benchmark's figures")
            return
        settings, versions = self.bench["settings"], self.bench["versions"]
        self.add(
            f"Qwen3-MoE, {settings['layers']} layers, {settings['experts']} experts (top {settings['top_k']}), "
            f"hidden {settings['hidden']}, {settings['heads']} query and {settings['kv_heads']} key/value heads "
            f"of dimension {settings['head_dim']}, sequence {settings['sequence']}, micro-batch "
            f"{settings['micro_batch']}, {settings['dtype']} on {settings['device']}; {settings['steps']} timed "
            f"steps after {settings['warmup']} per run; torch {versions['torch']}, transformers "
            f"{versions['transformers']}, deepspeed {versions['deepspeed']}.", "")
        memory = "peak_allocated_bytes" if settings["device"] == "cuda" else "peak_live_bytes"
        rows = []
        for arm in self.bench["arms"]:
            stash = "saved_per_layer_ms" in arm
            verdict = "-"
            if stash:
                verdict = "NOISY" if arm["noisy"] else (
                    "unresolved" if arm["noise_per_layer_ms"] >= self.bench["attention_forward_ms"] else
                    f"{arm['saved_fraction_of_attention']:.0%} of the attention forward")
            rows.append([
                arm["label"], arm["stashed"] or "-", f"{arm['median_ms']:,.1f}", f"{arm['vs_plain']:+.2%}",
                _mib(arm[memory]), f"{arm['kept_per_layer_bytes']:,.0f}" if stash else "-",
                _ms(arm.get("saved_per_layer_ms"), 2),
                _ms(arm.get("noise_per_layer_ms"), 2), verdict
            ])
        label = "peak allocated" if memory == "peak_allocated_bytes" else "peak live"
        self.add(*_table([
            "arm", "stashed", "median step (ms)", "vs plain", label, "kept B per layer",
            "saved per layer and micro-batch", "noise per layer", "verdict"
        ], rows))
        self.add(
            "", f"Attention forward (the benchmark's op-level gate, perf_counter around F.sdpa): "
            f"{self.bench['attention_forward_ms']:.3f} ms per layer and micro-batch, SDPA backend "
            f"{self.bench['sdpa_backend']}. Losses: largest difference across arms "
            f"{self.bench['loss_cross_arm']:.3g}, same-arm repeat noise {self.bench['loss_repeat_noise']:.3g}.")
        plot = f"{step}.png"
        self.add(
            f"Plot: {f'`{plot}`' if os.path.isfile(os.path.join(self.out, plot)) else 'none'} "
            f"({self.meta.get('plot_note', '')}).", "")
        table = _log_tail(os.path.join(self.work, "logs", f"{step}.log"), lines=None)
        start = next((index for index, line in enumerate(table) if line.startswith("attention stash benchmark:")),
                     None)
        if start is not None:
            self.add("The benchmark's own table:", "", "```", *table[start:], "```", "")

    def op_figures(self):
        self.add("## Op-level figures", "")
        if not self.op:
            self.waited("op-figures", "the op-level figures")
        else:
            settings = self.op["settings"]
            self.add(
                f"Attention forward at query ({settings['micro_batch']}, {settings['heads']}, "
                f"{settings['sequence']}, {settings['head_dim']}), {settings['kv_heads']} key/value heads, "
                f"{settings['dtype']}, causal, inputs that require grad; {self.op['timer']}, median of "
                f"{self.op['repeats']} after {self.op['warmup']} warm-up calls, each backend forced. For "
                f"reference, on an H100 at the preset: the seed's saving {H100_SAVED_MS} ms per stashed layer "
                f"and micro-batch; a FlashAttention-3-class kernel needs about {H100_FA3_FORWARD_MS} ms for this "
                f"forward.", "")
            rows = [[
                row["backend"], row["layout"] or "-",
                _ms(row["median_ms"]), "-" if row["min_ms"] is None else f"{row['min_ms']:.3f} - {row['max_ms']:.3f}",
                "-" if row["median_ms"] is None else f"{row['median_ms'] / H100_FA3_FORWARD_MS:.2f}x",
                row.get("note") or ""
            ] for row in self.op["attention"]]
            self.add(
                *_table(["backend", "key/value heads", "median", "min - max (ms)", "of H100 FA3-class", "note"], rows))
            self.add("")
        bench = self.bench
        if bench:
            forward = bench["attention_forward_ms"]
            self.add("Saving per stashed layer and micro-batch (from the stashed-layer sweep's JSON):", "")
            rows = [[
                arm["label"], arm["baseline"],
                _ms(arm["saved_per_layer_ms"]),
                _ms(arm["noise_per_layer_ms"]), f"{arm['saved_per_layer_ms'] / forward:.0%}",
                f"{arm['saved_per_layer_ms'] / H100_SAVED_MS:.2f}x"
            ] for arm in bench["arms"] if "saved_per_layer_ms" in arm]
            self.add(*_table([
                "stash arm", "against", "saved", "noise", f"of the attention forward ({forward:.3f} ms)",
                f"of the seed's H100 {H100_SAVED_MS} ms"
            ], rows))
            self.add("")

    def kept_bytes(self):
        self.add("## Bytes kept per layer against the planner", "")
        settings = (self.bench or self.op or {}).get("settings")
        if not settings:
            self.waited(self.bench_step, "the bytes kept")
            return
        element = 2 if settings["dtype"] in ("bfloat16", "float16") else 4
        formula = settings["micro_batch"] * settings["heads"] * settings["sequence"] * (
            settings["head_dim"] * element + 4)
        self.add(
            f"Formula, output plus FP32 log-sum-exp (micro-batch x query heads x sequence x (head dim x "
            f"{element} + 4)): {formula:,} B; the issue's planner figure at the Qwen3-30B-A3B preset: "
            f"{PRESET_PLANNER_BYTES:,} B" +
            (" (these shapes are not the preset's)." if formula != PRESET_PLANNER_BYTES else " (these shapes)."), "")
        rows = []
        if self.op:
            for row in self.op["planner"]:
                rows.append([
                    f"attention_stash_layer_bytes, {row['backend']}",
                    "-" if row["bytes"] is None else f"{row['bytes']:,}",
                    "-" if row["bytes"] is None else f"{row['bytes'] - formula:+,}", row["note"] or ""
                ])
        if self.bench:
            rows.append([
                "the benchmark's planner figure", f"{self.bench['kept_bytes_predicted']:,}",
                f"{self.bench['kept_bytes_predicted'] - formula:+,}", ""
            ])
            for arm in self.bench["arms"]:
                if "kept_per_layer_bytes" in arm:
                    kept = arm["kept_per_layer_bytes"]
                    rows.append([
                        f"kept by {arm['label']} (peak kept / stashed layers)", f"{kept:,.0f}",
                        f"{kept - formula:+,.0f}",
                        f"{kept / self.bench['kept_bytes_predicted'] - 1:+.2%} against the benchmark's planner; "
                        f"{arm['recomputes_served']} recomputes served"
                    ])
        self.add(*_table(["what", "bytes per layer", "against the formula", "note"], rows))
        self.add("")
        if not self.bench:
            self.waited(self.bench_step, "the bytes the benchmark kept")

    def long_sequences(self):
        self.add("## Long sequences", "")
        self.add(f"Command: `{self.step.get('long-sequence', {}).get('command', '?')}`", "")
        if not self.long or not self.long.get("rows"):
            self.waited("long-sequence", "the long-sequence figures")
            return
        settings = self.long["settings"]
        self.add(
            f"Llama-shaped, {settings['layers']} layers, hidden {settings['hidden']}, {settings['heads']} query and "
            f"{settings['kv_heads']} key/value heads of dimension {settings['head_dim']}, micro-batch "
            f"{settings['micro_batch']}, {settings['dtype']} on {settings['device']}; plain reentrant recompute "
            f"against the stash on every layer, {settings['steps']} timed steps after {settings['warmup']} per run, "
            f"two runs per arm. Lengths finished: {len(self.long['rows'])} of {len(settings['sequences'])}.", "")
        rows = []
        for row in self.long["rows"]:
            judged = {
                key:
                f"{row[key]:.1%} ± {row[f'{key}_noise']:.1%}" +
                (f" {row[f'{key}_verdict']}" if row[f"{key}_verdict"] else "")
                for key in ("share", "saving", "saving_over_share")
            }
            rows.append([
                f"{row['sequence']:,}", row["backend"],
                _ms(row["attention_forward_ms"],
                    2), f"{row['plain_ms']:,.1f}", f"{row['stash_ms']:,.1f}", judged["share"], judged["saving"],
                f"{row['saved_per_layer_ms']:.2f} ± {row['noise_per_layer_ms']:.2f}", judged["saving_over_share"],
                f"{row['kept_per_layer_bytes']:,.0f}", f"{row['planner_bytes']:,}", f"{row['recomputes_served']:,}"
            ])
        self.add(*_table([
            "sequence", "backend", "attention forward (ms)", "plain step (ms)", "stash step (ms)", "attention share",
            "step saving", "saved per layer (ms)", "saving / share", "kept B per layer", "planner B per layer",
            "recomputes served"
        ], rows))
        self.add("")

    def offload_leg(self):
        self.add("## Offload", "")
        steps = [row for row in self.steps if row["name"].startswith("offload-")]
        if not steps:
            self.add("Not available (the offload figures): no offload step ran.", "")
            return
        self.add(*(f"Command: `{row['command']}`" for row in steps), "")
        rows, notes = [], []
        for step in steps:
            run = self.offload.get(step["name"])
            if not run or not run.get("arms"):
                self.waited(step["name"], f"the offload figures at {step['name'][len('offload-'):]} tokens")
                continue
            settings = run["settings"]
            sequence = f"{settings['sequence']:,}"
            notes += [
                f"{sequence} tokens, {settings['layers']} layers, {settings['dtype']} on {settings['device']}: the "
                f"inputs offloaded by {run.get('offload_route', '?')}; {run.get('offload_moved', '?')}.", ""
            ]
            notes += [
                f"- {sequence}: {item['expected']}: {item['measured']}: **{item['verdict']}**"
                for item in run.get("offload_expectations", [])
            ] + [""]
            for arm in run["arms"]:
                memory = arm["peak_allocated_bytes"]
                rows.append([
                    sequence, arm["label"], f"{arm['median_ms']:,.1f}",
                    " - ".join(f"{q:,.1f}" for q in arm["quartiles_ms"]),
                    _mib(arm["peak_live_bytes"] if memory is None else memory), f"{arm['offloaded_bytes']:,}",
                    f"{arm['restored_bytes']:,}", f"{arm['recomputes_served']:,}"
                ])
        if not rows:
            return
        self.add(*_table([
            "sequence", "arm", "median step (ms)", "IQR (ms)", "peak (CUDA allocated; CPU live)", "offloaded B",
            "restored B", "recomputes served"
        ], rows))
        self.add("", *notes)

    def peak_memory(self):
        self.add("## Peak memory per arm", "")
        if not self.bench:
            self.waited(self.bench_step, "the peak memory")
            return
        rows = [[
            arm["label"],
            _mib(arm["peak_allocated_bytes"]),
            _mib(arm["peak_live_bytes"]),
            _mib(arm["peak_rss_bytes"])
        ] for arm in self.bench["arms"]]
        self.add(*_table(["arm", "peak allocated (CUDA)", "peak live tensors (CPU)", "peak RSS (CPU)"], rows))
        self.add("")

    def failed_logs(self):
        failed = [row for row in self.steps if not self.passed(row)]
        if not failed:
            return
        self.add("## Logs of the steps that did not pass", "")
        for row in failed:
            self.add(f"### {row['name']}: {row['status']} (rc {row['rc']})", "", "```",
                     *_log_tail(os.path.join(self.work, "logs", f"{row['name']}.log")), "```", "")

    def write(self):
        sections = {
            "protocol": (self.seed_tests, self.benchmark, self.op_figures, self.kept_bytes, self.peak_memory),
            "suite": (self.suites, self.flash4_tests, self.benchmark, self.peak_memory, self.offload_leg),
            "long": (self.long_sequences, ),
        }[self.command]
        for section in (self.header, self.skipped, self.versions, self.install, self.steps_table, *sections,
                        self.failed_logs):
            section()
        self.add(f"Files: {FILES[self.command]}.")
        path = os.path.join(self.out, f"RESULTS-{self.command}.md")
        with open(path, "w") as file:
            file.write("\n".join(self.lines) + "\n")
        print(f"wrote {path}")
        return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("venv", help="make a fresh venv that sees this interpreter's packages")
    make.add_argument("directory")
    check = commands.add_parser("probe", help="record the versions this environment holds")
    check.add_argument("--out", required=True)
    check.add_argument("--venv", help="the wheels are expected in this venv ...")
    check.add_argument("--target", help="... or in this target folder")
    check.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    check.add_argument("wheels", nargs="*")
    flash4 = commands.add_parser("flash4-wheels", help="list a folder's flash-attn-4 wheel and its dependencies'")
    flash4.add_argument("folder")
    report = commands.add_parser("report", help="write RESULTS-<command>.md for the command the work folder ran")
    report.add_argument("--work", required=True)
    report.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "venv":
        return make_venv(args.directory)
    if args.command == "probe":
        return probe(args)
    if args.command == "flash4-wheels":
        return flash4_wheels(args.folder)
    return Report(args.work, args.out).write()


if __name__ == "__main__":
    sys.exit(main())
