# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""DeepSpeed's pre-commit rules as .ci/precommit.py checks them, on small files planted in a temporary folder: each rule
fails its offending line, naming file and line, and passes clean text. The tools themselves (yapf, flake8, codespell)
run over the repository in CI's first leg (.ci/run), not here.
"""

import importlib.util
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
SCRIPT = os.path.join(REPO, ".ci", "precommit.py")
# What the rules look for, put together here so that this file passes them.
TORCH_CUDA = "torch" + ".cuda"
CUDA_CALL = ".cuda" + "()"
IS_CUDA = ".is" + "_cuda"
TORCH_DIST = "torch" + ".distributed"
MISSPELLED = "t" + "eh"  # codespell's "the"
LICENSE = "# SPDX-License-Identifier: Apache-2.0\n\n# DeepSpeed Team\n"


@pytest.fixture(scope="module")
def precommit():
    spec = importlib.util.spec_from_file_location("precommit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plant(root, files):
    """Writes ``files`` (path: text) under ``root``; returns their paths, sorted, as the checks take them."""
    for path, text in files.items():
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(root, path), "w", newline="") as file:
            file.write(text)
    return sorted(files)


def places(findings):
    """Each finding's file and line ("path:line"), in order."""
    return [":".join(finding.split(":")[:2]) for finding in findings]


def test_torch_cuda_fails_without_the_marker(precommit, tmp_path):
    files = plant(
        tmp_path,
        {
            "a.py":
            f"import torch\nok = {TORCH_CUDA}.is_available()\nmarked = {TORCH_CUDA}.is_available()  #ignore-cuda\n",
            "notes.md": f"Call {TORCH_CUDA}.synchronize() here.\n",
            "setup.py": f"print({TORCH_CUDA}.is_available())\n",  # excluded in DeepSpeed's config
        })
    findings = precommit.torchcuda_findings(str(tmp_path), files)
    assert places(findings) == ["a.py:2", "notes.md:1"]
    assert "#ignore-cuda" in findings[0] and "get_accelerator()" in findings[0]


def test_a_cuda_call_fails_even_marked(precommit, tmp_path):
    files = plant(tmp_path, {"a.py": f"x = y.to('cpu')\nx = y{CUDA_CALL}  #ignore-cuda\n"})
    findings = precommit.torchcuda_findings(str(tmp_path), files)
    assert places(findings) == ["a.py:2"] and "get_accelerator().device_name()" in findings[0]


def test_is_cuda_fails_in_python_files(precommit, tmp_path):
    files = plant(tmp_path, {"a.py": f"x = 1\nif y{IS_CUDA}:\n    pass\n", "notes.md": f"y{IS_CUDA} is a flag\n"})
    findings = precommit.torchcuda_findings(str(tmp_path), files)
    assert places(findings) == ["a.py:2"] and "on_accelerator" in findings[0]


def test_torch_distributed_fails_outside_its_exclusions(precommit, tmp_path):
    line = f"import {TORCH_DIST} as dist\n"
    files = plant(
        tmp_path,
        {
            "a.py": f"import torch\n{line}gathered = {TORCH_DIST}.nn.functional.all_gather(x)\n",
            "tests/benchmarks/b.py": line,
            "README.md": f"Run `python -m {TORCH_DIST}.run`.\n",
            "benchmarks/c.py": line,  # the repository's root benchmarks/ and docs/ are excluded
            "docs/d.md": line,
        })
    findings = precommit.torchdist_findings(str(tmp_path), files)
    assert places(findings) == ["README.md:1", "a.py:2", "tests/benchmarks/b.py:1"]
    assert all("deepspeed.comm" in finding for finding in findings)


def test_a_missing_license_line_fails(precommit, tmp_path):
    files = plant(
        tmp_path, {
            "licensed.py": f"{LICENSE}x = 1\n",
            "licensed.cpp": "// SPDX-License-Identifier: Apache-2.0\n\n// DeepSpeed Team\n",
            "no_team.py": "# SPDX-License-Identifier: Apache-2.0\nx = 1\n",
            "no_spdx.cu": "// DeepSpeed Team\n",
            "trailing_space.py": "# SPDX-License-Identifier: Apache-2.0 \n# DeepSpeed Team\n",
            "notes.md": "No license here.\n",
        })
    findings = precommit.license_findings(str(tmp_path), files)
    assert findings == [
        "no_spdx.cu: no line '# SPDX-License-Identifier: Apache-2.0'", "no_team.py: no line '# DeepSpeed Team'",
        "trailing_space.py: no line '# SPDX-License-Identifier: Apache-2.0'"
    ]


def test_hygiene_fixers_fail_what_they_would_change(precommit, tmp_path):
    files = plant(
        tmp_path, {
            "a.txt": "no line ending",
            "b.txt": "blank lines\n\n",
            "c.txt": "trailing \nspace\n",
            "d.txt": "windows\r\nline\r\n",
            "e.py": "# -*- coding: utf-8 -*-\nx = 1\n",
            "requirements/requirements-dev.txt": "pytest\n# the benchmark's\naccelerate\n",
        })
    root = str(tmp_path)
    assert places(precommit.end_of_file_findings(root, files)) == ["a.txt:1", "b.txt:2"]
    assert places(precommit.trailing_whitespace_findings(root, files)) == ["c.txt:1"]
    assert places(precommit.line_ending_findings(root, files)) == ["d.txt:1"]
    assert places(precommit.encoding_pragma_findings(root, files)) == ["e.py:1"]
    assert places(precommit.requirements_findings(root, files)) == ["requirements/requirements-dev.txt:1"]
    assert precommit.requirements_fixed(b"pytest\n# the benchmark's\naccelerate\n") == (
        b"# the benchmark's\naccelerate\npytest\n")


def test_clean_files_pass_every_rule(precommit, tmp_path):
    files = plant(
        tmp_path, {
            "module.py": f"{LICENSE}import deepspeed.comm as dist\n\nrank = dist.get_rank()\n",
            "gpu.py": f"{LICENSE}import torch\n\nCUDA = {TORCH_CUDA}.is_available()  #ignore-cuda\n",
            "README.md": "Start it with `torchrun --nproc_per_node 2`.\n",
            "requirements/requirements.txt": "# CI's\n\ndeepspeed==0.19.8\n# its floor\ntorch>=2.11\n",
            "data.json": '{"a": 1}\n',
        })
    for name, check in precommit.RULE_CHECKS:
        assert check(str(tmp_path), files) == [], name


def test_codespell_fails_a_misspelling_and_passes_the_apis_names(precommit, tmp_path):
    """codespell with DeepSpeed's arguments and this repository's words (flash-attn's dout, PyTorch's OVERRIDEABLE, in
    any case), which 2.1.0 takes in lower case; its exit status fails the check."""
    pytest.importorskip("codespell_lib", reason="codespell is not installed (requirements/requirements-dev.txt)")
    files = plant(tmp_path, {
        "notes.md": f"dout and OVERRIDEABLE\n{MISSPELLED} end\n",
        "clean.md": "Overrideable dout.\n"
    })
    process = precommit.start_tool(str(tmp_path), precommit.codespell_command(files))
    assert precommit.tool_findings(process) == [f"notes.md:2: {MISSPELLED} ==> the"]


def test_the_tools_are_the_pinned_releases(precommit, monkeypatch):
    pins, problems = precommit.version_problems(REPO)
    assert pins == {"yapf": "0.43.0", "flake8": "5.0.4", "codespell": "2.1.0"}
    versions = {"yapf": "0.40.2", "flake8": "5.0.4"}

    def version(name):
        if name not in versions:
            raise precommit.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(precommit.importlib.metadata, "version", version)
    _, problems = precommit.version_problems(REPO)
    assert problems == {
        "yapf":
        "yapf 0.40.2 is installed, requirements/requirements-dev.txt pins 0.43.0: pip install yapf==0.43.0",
        "codespell":
        "codespell is not installed, requirements/requirements-dev.txt pins 2.1.0: pip install "
        "codespell==2.1.0",
    }


def test_the_script_prints_each_check_and_fails(precommit, monkeypatch, tmp_path, capsys):
    """Over a repository's files (untracked ones git does not ignore count): one line per check, the offending file and
    line under a failed one, exit status 1. The tools stay out (reported as not run), as where none is installed."""
    if shutil.which("git") is None:
        pytest.skip("the script lists the files with git, which this machine lacks")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    plant(tmp_path, {"a.py": f"{LICENSE}import torch\n\nx = torch.ones(1){CUDA_CALL}\n", "ignored.py": "x\n"})
    plant(tmp_path, {".gitignore": "ignored.py\n", "requirements/requirements-dev.txt": "pytest\n"})
    assert precommit.main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "FAIL  tool versions"
    assert "PASS  check-license" in out and "PASS  check-torchdist" in out
    failed = out.index("FAIL  check-torchcuda")
    assert out[failed + 1].startswith("      a.py:6: ")
    assert "FAIL  yapf" in out and "      not run: requirements/requirements-dev.txt pins no yapf" in out
    assert out[-1].startswith("precommit: 15 of 20 checks passed over 3 files in ") and out[-1].endswith("; 5 failed")
