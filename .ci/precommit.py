#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""DeepSpeed's pre-commit checks on this repository, without pre-commit: the hooks of deepspeedai/DeepSpeed's
.pre-commit-config.yaml, with its file patterns and exclusions, over the files git knows here (tracked, and untracked
ones it does not ignore), so that the files pass upstream as they are.

    python .ci/precommit.py

Run by CI's first leg. yapf, flake8 and codespell must be the releases requirements/requirements-dev.txt pins (the
ones DeepSpeed's checks run); the script says so where they are not, and leaves that tool's check failed. DeepSpeed's
own scripts (check-torchcuda, check-torchdist, check-license, check-extraindexurl) and the pre-commit-hooks fixers it
runs are checked here in Python, reporting what each would fix instead of fixing it. Prints one line per check, PASS
or FAIL, and under a failure every file and line at fault; exits 1 where any check fails.

What the rules look for is spelled here in two pieces, so that this file passes them (DeepSpeed excludes its check
scripts instead).
"""

import argparse
import concurrent.futures
import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINS = "requirements/requirements-dev.txt"
TOOLS = ("yapf", "flake8", "codespell")

# codespell's arguments in DeepSpeed's config, with this repository's words added: dout (flash-attn's name for the
# output gradient) and OVERRIDEABLE (PyTorch's SDPBackend member). codespell 2.1.0 drops the listed words from its
# dictionary, whose entries are lower case, so they are listed in lower case: they then match in any case.
CODESPELL_SKIP = "docs/Gemfile.lock,tests/unit/gpt2-merges.txt,tests/unit/gpt2-vocab.json"
CODESPELL_IGNORE_WORDS = "youn,unsupport,noe,cann,dout,overrideable"
CODESPELL_ARGS = (f"--skip={CODESPELL_SKIP}", r"--ignore-regex=\\n", f"--ignore-words-list={CODESPELL_IGNORE_WORDS}",
                  "--check-filenames", "--check-hidden")

# Each hook's files and exclude patterns, as DeepSpeed's config names them (searched in the path, as pre-commit does).
LICENSE_FILES = r"\.(py|c|cpp|cu|cc|h|hpp|cuh|hip|tr)$"
LICENSE_EXCLUDE = (r"^(deepspeed/inference/v2/kernels/ragged_ops/blocked_flash"
                   r"|deepspeed/inference/v2/kernels/cutlass_ops/grouped_gemm)")
TORCHDIST_EXCLUDE = (r"^(deepspeed/comm/|docs/|benchmarks/|scripts/check-torchdist.py|deepspeed/moe/sharded_moe.py"
                     r"|deepspeed/runtime/comm/coalesced_collectives.py|deepspeed/elasticity/elastic_agent.py"
                     r"|deepspeed/launcher/launch.py|tests/unit/comm/test_dist.py)")
TORCHCUDA_EXCLUDE = (r"^(.github/workflows/|scripts/check-torchcuda.py"
                     r"|docs/_tutorials/accelerator-abstraction-interface.md|docs/_tutorials/deepnvme.md"
                     r"|accelerator/cuda_accelerator.py|deepspeed/inference/engine.py"
                     r"|deepspeed/model_implementations/transformers/clip_encoder.py"
                     r"|deepspeed/model_implementations/diffusers/vae.py"
                     r"|deepspeed/model_implementations/diffusers/unet.py|op_builder/spatial_inference.py"
                     r"|op_builder/transformer_inference.py|op_builder/builder.py|setup.py"
                     r"|tests/unit/ops/sparse_attention/test_sparse_attention.py)")
EXTRAINDEXURL_FILES = r"\.(yml|yaml|sh|py)$"
EXTRAINDEXURL_EXCLUDE = r"^(scripts/check-extraindexurl.py)"
# The one workflow check-extraindexurl's script itself leaves out.
EXTRAINDEXURL_ALLOWED = ".github/workflows/xpu-max1100.yml"
END_OF_FILE_EXCLUDE = r"docs/CNAME"
REQUIREMENTS_FILES = r"requirements.*\.txt$"
C_FILES = r"\.(c|cc|cpp|cxx|h|hh|hpp|hxx|cu|cuh)$"

# The rules of DeepSpeed's scripts. check-torchcuda: a line naming torch's CUDA module fails unless it carries the
# marker; a call of the tensor method that moves to CUDA fails on any line; in Python files, so does the tensor
# attribute asking whether it is on CUDA. check-torchdist: torch's distributed package, its nn wrappers aside.
# check-extraindexurl: pip's option for an extra index.
TORCH_CUDA_TEXT, CUDA_CALL_TEXT, IS_CUDA_TEXT = "torch" + ".cuda", ".cuda" + "()", ".is" + "_cuda"
TORCH_DIST_TEXT, EXTRA_INDEX_URL_TEXT = "torch" + ".distributed", "--extra-index" + "-url"
TORCH_CUDA = re.compile(re.escape(TORCH_CUDA_TEXT))
IGNORE_CUDA = "#ignore-cuda"
CUDA_CALL = re.compile(re.escape(CUDA_CALL_TEXT))
IS_CUDA = re.compile(re.escape(IS_CUDA_TEXT))
TORCH_DIST = re.compile(re.escape(TORCH_DIST_TEXT) + r"(?: |(?!\.nn))")
EXTRA_INDEX_URL = re.compile(re.escape(EXTRA_INDEX_URL_TEXT))
LICENSE_LINES = (
    ("# SPDX-License-Identifier: Apache-2.0", "// SPDX-License-Identifier: Apache-2.0",
     "# SPDX-License-Identifier: Apache-2.0 AND BSD-3-Clause",
     "// SPDX-License-Identifier: Apache-2.0 AND BSD-3-Clause"),
    ("# DeepSpeed Team", "// DeepSpeed Team"),
)

# identify's test for text: no byte outside these in the first 1 KiB.
_TEXT_BYTES = bytes(sorted({7, 8, 9, 10, 11, 12, 13, 27} | set(range(0x20, 0x100)) - {0x7f}))
_BOM = b"\xef\xbb\xbf"


# --- the files -------------------------------------------------------------------------------------------------------
def repository_files(root):
    """The files git knows in ``root``: tracked, and untracked ones it does not ignore; those present, sorted."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root,
                            capture_output=True,
                            check=True).stdout.decode().split("\0")
    return sorted({path for path in listed if path and os.path.lexists(os.path.join(root, path))})


def read(root, path):
    """The file's bytes, read once per version of it (its modification time and size)."""
    full = os.path.join(root, path)
    state = os.stat(full)
    return _read(full, state.st_mtime_ns, state.st_size)


@functools.lru_cache(maxsize=None)
def _read(full, modified, size):
    with open(full, "rb") as file:
        return file.read()


def is_text(root, path):
    full = os.path.join(root, path)
    if os.path.islink(full) or not os.path.isfile(full):
        return False
    return not read(root, path)[:1024].translate(None, _TEXT_BYTES)


def is_python(root, path):
    """Python as identify tags it: by extension, or an extension-less executable with a python shebang."""
    if path.endswith((".py", ".pyw")):
        return True
    full = os.path.join(root, path)
    if "." in os.path.basename(path) or not os.access(full, os.X_OK) or not is_text(root, path):
        return False
    first = read(root, path).split(b"\n", 1)[0]
    return first.startswith(b"#!") and b"python" in first


def lines(root, path):
    """The file's lines as git grep numbers them, decoded (undecodable bytes replaced)."""
    return read(root, path).decode("utf-8", errors="replace").split("\n")


def selected(files, pattern=None, exclude=None):
    return [
        path for path in files
        if (pattern is None or re.search(pattern, path)) and (exclude is None or not re.search(exclude, path))
    ]


# --- DeepSpeed's scripts ---------------------------------------------------------------------------------------------
def torchcuda_findings(root, files):
    found = []
    for path in selected(files, exclude=TORCHCUDA_EXCLUDE):
        if not is_text(root, path):
            continue
        for number, line in enumerate(lines(root, path), 1):
            if TORCH_CUDA.search(line) and IGNORE_CUDA not in line:
                found.append(f"{path}:{number}: {TORCH_CUDA_TEXT} without {IGNORE_CUDA}: use "
                             f"deepspeed.accelerator's get_accelerator(), or mark a CUDA-only line {IGNORE_CUDA}")
            if CUDA_CALL.search(line):
                found.append(f"{path}:{number}: {CUDA_CALL_TEXT}: use .to(get_accelerator().device_name())")
            if path.endswith(".py") and IS_CUDA.search(line):
                found.append(f"{path}:{number}: {IS_CUDA_TEXT}: use get_accelerator().on_accelerator(tensor)")
    return found


def matching_lines(root, paths, pattern):
    """(path, line number) of each line of the text files ``paths`` that ``pattern`` matches."""
    return [(path, number) for path in paths if is_text(root, path)
            for number, line in enumerate(lines(root, path), 1) if pattern.search(line)]


def torchdist_findings(root, files):
    return [
        f"{path}:{number}: {TORCH_DIST_TEXT}: use deepspeed.comm"
        for path, number in matching_lines(root, selected(files, exclude=TORCHDIST_EXCLUDE), TORCH_DIST)
    ]


def license_findings(root, files):
    found = []
    for path in selected(files, LICENSE_FILES, LICENSE_EXCLUDE):
        present = set(lines(root, path))
        for alternatives in LICENSE_LINES:
            if present.isdisjoint(alternatives):
                found.append(f"{path}: no line '{alternatives[0]}'")
    return found


def extraindexurl_findings(root, files):
    paths = [
        path for path in selected(files, EXTRAINDEXURL_FILES, EXTRAINDEXURL_EXCLUDE) if path != EXTRAINDEXURL_ALLOWED
    ]
    return [
        f"{path}:{number}: {EXTRA_INDEX_URL_TEXT}: use --index-url"
        for path, number in matching_lines(root, paths, EXTRA_INDEX_URL)
    ]


# --- pre-commit-hooks ------------------------------------------------------------------------------------------------
def case_conflict_findings(root, files):
    names = set(files)
    for path in files:
        parts = path.split("/")
        names.update("/".join(parts[:end]) for end in range(1, len(parts)))
    by_case = {}
    for name in names:
        by_case.setdefault(name.lower(), []).append(name)
    return [
        f"{', '.join(sorted(group))}: names that differ only in case" for group in by_case.values() if len(group) > 1
    ]


def json_findings(root, files):

    def refuse_duplicates(pairs):
        keys = [key for key, _ in pairs]
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        if duplicates:
            raise ValueError(f"duplicate keys {duplicates}")
        return dict(pairs)

    found = []
    for path in files:
        if path.endswith(".json") and is_text(root, path):
            try:
                json.loads(read(root, path), object_pairs_hook=refuse_duplicates)
            except ValueError as error:
                found.append(f"{path}: not valid JSON: {error}")
    return found


def yaml_findings(root, files):
    paths = [path for path in files if path.endswith((".yaml", ".yml")) and is_text(root, path)]
    if not paths:
        return []
    try:
        import yaml
    except ImportError:
        return [f"{path}: not checked: PyYAML is not installed" for path in paths]
    found = []
    for path in paths:
        try:
            list(yaml.safe_load_all(read(root, path)))
        except yaml.YAMLError as error:
            found.append(f"{path}: not valid YAML: {' '.join(str(error).split())}")
    return found


def symlink_findings(root, files):
    return [
        f"{path}: a symlink to {os.readlink(os.path.join(root, path))}, which does not exist" for path in files
        if os.path.islink(os.path.join(root, path)) and not os.path.exists(os.path.join(root, path))
    ]


def destroyed_symlink_findings(root, files):
    staged = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=root, capture_output=True)
    if staged.returncode:  # no git index here, so no symlink in it
        return []
    links = {entry.split("\t", 1)[1] for entry in staged.stdout.decode().split("\0") if entry.startswith("120000 ")}
    return [
        f"{path}: a symlink in git, a plain file here" for path in files
        if path in links and not os.path.islink(os.path.join(root, path))
    ]


def end_of_file_findings(root, files):
    found = []
    for path in selected(files, exclude=END_OF_FILE_EXCLUDE):
        data = read(root, path) if is_text(root, path) else b""
        if not data:
            continue
        body = data.rstrip(b"\r\n")
        ending, last = data[len(body):], body.count(b"\n") + 1
        if not body:
            found.append(f"{path}:1: only line endings: end-of-file-fixer empties it")
        elif not ending:
            found.append(f"{path}:{last}: no line ending at the end of the file")
        elif ending not in (b"\n", b"\r\n", b"\r"):
            found.append(f"{path}:{last + 1}: blank lines at the end of the file")
    return found


def byte_order_marker_findings(root, files):
    return [
        f"{path}:1: a UTF-8 byte order marker" for path in files
        if is_text(root, path) and read(root, path)[:3] == _BOM
    ]


def _has_coding(line):
    return line.strip() != b"" and line.lstrip()[:1] == b"#" and any(
        word in line for word in (b"unicode", b"encoding", b"coding:", b"coding="))


def encoding_pragma_findings(root, files):
    """fix-encoding-pragma --remove: no coding comment on the first line (the second after a shebang), and no file
    that is only a shebang or such a comment."""
    found = []
    for path in files:
        if not is_python(root, path):
            continue
        head = read(root, path).splitlines(keepends=True)
        shebang = head[:1] if head and head[0].startswith(b"#!") else []
        candidate = head[len(shebang):len(shebang) + 1]
        pragma = bool(candidate) and _has_coding(candidate[0])
        rest = b"".join(head[len(shebang) + pragma:])
        if pragma:
            found.append(f"{path}:{len(shebang) + 1}: an encoding pragma")
        elif shebang and not rest.strip():
            found.append(f"{path}:1: only a shebang")
    return found


def line_ending_findings(root, files):
    """mixed-line-ending --fix=lf: every line ends in LF alone."""
    found = []
    for path in files:
        if not is_text(root, path):
            continue
        for number, line in enumerate(read(root, path).split(b"\n"), 1):
            if b"\r" in line:
                found.append(f"{path}:{number}: a CR line ending (--fix=lf)")
                break
    return found


def trailing_whitespace_findings(root, files):
    found = []
    for path in files:
        if not is_text(root, path):
            continue
        for number, line in enumerate(read(root, path).split(b"\n"), 1):
            content = line[:-1] if line.endswith(b"\r") else line
            if content != content.rstrip():
                found.append(f"{path}:{number}: trailing whitespace")
    return found


class _Requirement:
    """One entry as requirements-txt-fixer sorts them: a requirement's lines and the comment lines above it."""

    def __init__(self):
        self.comments, self.value = [], None

    def complete(self):
        return self.value is not None and not self.value.rstrip(b"\r\n").endswith(b"\\")

    def key(self):
        """Its place: a file's header first, then by name, an entry with comments before one without."""
        if self.value == b"\n":
            return (0, b"", 0)
        lowered = self.value.lower()
        for egg in (b"#egg=", b"&egg="):
            if egg in self.value:
                return (1, lowered.partition(egg)[2], not self.comments)
        token = re.match(rb"[^;\s]*", lowered).group()
        operator = re.search(rb"={2,3}|!=|~=|>=?|<=?", token)
        return (1, token[:operator.start()] if operator else token, not self.comments)


def requirements_fixed(data):
    """What requirements-txt-fixer writes for ``data``: the requirements sorted by name, each with the comments above
    it, a header comment (the file's first comment lines, closed by a blank line) first and the comment lines after the
    last requirement last, exact duplicates and pkg-resources==0.0.0 dropped, and a line ending at the end."""
    if not data.strip():
        return data
    given = data.splitlines(keepends=True)
    if not given[-1].endswith(b"\n"):
        given[-1] += b"\n"
    entries = []
    for line in given:
        if not entries or entries[-1].complete():
            entries.append(_Requirement())
        entry = entries[-1]
        if len(entries) == 1 and not line.strip():
            if entry.comments and entry.comments[0].startswith(b"#"):
                entry.value = b"\n"
            else:
                entry.comments.append(line)
        elif not line.strip() or line.lstrip().startswith(b"#"):
            entry.comments.append(line)
        else:
            entry.value = (entry.value or b"") + line
    tail = entries.pop().comments if entries[-1].value is None else []
    entries = [entry for entry in entries if entry.value != b"pkg-resources==0.0.0\n"]
    fixed, previous = [], None
    for entry in sorted(entries, key=_Requirement.key):
        fixed.extend(entry.comments)
        if entry.value != previous:
            fixed.append(entry.value)
            previous = entry.value
    return b"".join(fixed + tail)


def requirements_findings(root, files):
    found = []
    for path in selected(files, REQUIREMENTS_FILES):
        data = read(root, path)
        fixed = requirements_fixed(data)
        if fixed != data:
            given, wanted = data.splitlines(), fixed.splitlines()
            number = next((index for index, pair in enumerate(zip(given, wanted)) if pair[0] != pair[1]),
                          min(len(given), len(wanted))) + 1
            order = [line.decode() for line in wanted if line.strip() and not line.lstrip().startswith(b"#")]
            found.append(f"{path}:{number}: not in requirements-txt-fixer's order, which is {', '.join(order)}")
    return found


def clang_format_findings(root, files):
    return [f"{path}: C/C++ source, which clang-format checks: run pre-commit" for path in selected(files, C_FILES)]


# --- the tools -------------------------------------------------------------------------------------------------------
def pinned_versions(root):
    """The versions requirements-dev.txt pins for the tools, by name (a tool it does not pin is missing)."""
    with open(os.path.join(root, PINS), encoding="utf-8") as file:
        pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", file.read(), flags=re.M))
    return {tool: pins[tool] for tool in TOOLS if tool in pins}


def version_problems(root):
    """What keeps each tool from being checked: not pinned, not installed, or not the pinned release."""
    pins, problems = pinned_versions(root), {}
    for tool in TOOLS:
        try:
            installed = importlib.metadata.version(tool)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if tool not in pins:
            problems[tool] = f"{PINS} pins no {tool}"
        elif installed != pins[tool]:
            problems[tool] = (f"{tool} {installed or 'is not installed'}{' is installed' if installed else ''}, "
                              f"{PINS} pins {pins[tool]}: pip install {tool}=={pins[tool]}")
    return pins, problems


def _yapf_diff(path):
    from yapf.yapflib import file_resources, yapf_api

    style = file_resources.GetDefaultStyleForDir(os.path.dirname(os.path.abspath(path)))
    diff, _, changed = yapf_api.FormatFile(path, style_config=style, print_diff=True)
    return diff if changed else ""


def yapf_findings(root, paths, pool):
    """yapf --diff on each file, in ``pool``'s processes, largest first: each file yapf would change, at each hunk."""
    futures = {
        path: pool.submit(_yapf_diff, os.path.join(root, path))
        for path in sorted(paths, key=lambda path: -len(read(root, path)))
    }
    found = []
    for path in sorted(futures):
        try:
            diff = futures[path].result()
        except Exception as error:  # yapf cannot parse it, say
            found.append(f"{path}: yapf failed: {type(error).__name__}: {error}")
            continue
        hunks = re.findall(r"^@@ -(\d+)(?:,(\d+))? ", diff, flags=re.M)
        for first, count in hunks:
            first, last = int(first), int(first) + max(int(count or 1), 1) - 1
            found.append(f"{path}:{first}: yapf reformats lines {first}-{last}")
        if diff and not hunks:
            found.append(f"{path}: yapf reformats it")
    return found


def flake8_command(paths):
    return [sys.executable, "-m", "flake8", "--config=.flake8", *paths]


def codespell_command(paths):
    # codespell's main() returns its exit status; 2.1.0's python -m codespell_lib drops it.
    main = "import sys; from codespell_lib import main; sys.exit(main(*sys.argv[1:]))"
    return [sys.executable, "-c", main, *CODESPELL_ARGS, *paths]


def start_tool(root, command):
    """``command`` (in this Python) run in ``root``, its output collected."""
    return subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def tool_findings(process):
    """What a tool started by start_tool printed, where it exited with a failure; nothing where it passed."""
    output, _ = process.communicate()
    if process.returncode == 0:
        return []
    return [line for line in output.splitlines() if line.strip()] or [f"exit status {process.returncode}"]


# --- the run ---------------------------------------------------------------------------------------------------------
RULE_CHECKS = (
    ("check-case-conflict", case_conflict_findings),
    ("check-json", json_findings),
    ("check-symlinks", symlink_findings),
    ("check-yaml", yaml_findings),
    ("destroyed-symlinks", destroyed_symlink_findings),
    ("end-of-file-fixer", end_of_file_findings),
    ("fix-byte-order-marker", byte_order_marker_findings),
    ("fix-encoding-pragma --remove", encoding_pragma_findings),
    ("mixed-line-ending --fix=lf", line_ending_findings),
    ("requirements-txt-fixer", requirements_findings),
    ("trailing-whitespace", trailing_whitespace_findings),
    ("clang-format", clang_format_findings),
    ("check-torchdist", torchdist_findings),
    ("check-license", license_findings),
    ("check-torchcuda", torchcuda_findings),
    ("check-extraindexurl", extraindexurl_findings),
)


def report(name, found, detail=""):
    print(f"{'FAIL' if found else 'PASS'}  {name}{f' ({detail})' if detail else ''}")
    for line in found:
        print(f"      {line}")
    return not found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=REPO, help="the repository to check (default: this one)")
    args = parser.parse_args(argv)
    root, started = os.path.abspath(args.root), time.perf_counter()
    files = repository_files(root)
    python = [path for path in files if is_python(root, path)]
    text = [path for path in files if is_text(root, path)]
    pins, problems = version_problems(root)

    # The tools run beside the checks done here: flake8 and codespell as processes, yapf in a pool of processes.
    flake8 = codespell = pool = None
    if python and "flake8" not in problems:
        flake8 = start_tool(root, flake8_command(python))
    if text and "codespell" not in problems:
        codespell = start_tool(root, codespell_command(text))
    if python and "yapf" not in problems:
        import yapf.yapflib.yapf_api  # noqa: F401 (once, before the pool's processes fork)

        pool = concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1)
    try:
        versions = ", ".join(f"{tool} {pins[tool]}" for tool in TOOLS if tool not in problems)
        passed = [report("tool versions", list(problems.values()), f"{versions} as {PINS} pins" if versions else "")]
        for name, check in RULE_CHECKS:
            passed.append(report(name, check(root, files)))
        tools = (
            ("yapf", python, lambda: yapf_findings(root, python, pool)),
            ("flake8", python, lambda: tool_findings(flake8)),
            ("codespell", text, lambda: tool_findings(codespell)),
        )
        for tool, paths, findings in tools:
            if tool in problems:
                passed.append(report(tool, [f"not run: {problems[tool]}"]))
            else:
                passed.append(report(tool, findings() if paths else [], f"{len(paths)} files"))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    failed = passed.count(False)
    print(f"precommit: {len(passed) - failed} of {len(passed)} checks passed over {len(files)} files in "
          f"{time.perf_counter() - started:.1f} s" + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
