# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The attention stash's docs, in two places (issue 72): a short section of docs/code-docs/source/autoep.rst, what a
user reads in five minutes, and the tutorial docs/_tutorials/attention-stash.md, with the rest.

When the section was cut from about 1,150 lines to 200, its facts moved to the tutorial. These tests keep them from
being dropped later: every public name of the module and every argument of its functions is named as code in the
section or the tutorial (read from the module with inspect, so a new name or argument has to be documented too); every
cause of AttentionStashError that the refused-setups table named before the move is named still (frozen below, one
phrase per row of that table as it was); the section stays at most 200 lines and links to the tutorial; the tutorial
opens with DeepSpeed's front matter. Nothing trains here: the files are read and, where Sphinx is installed, the
section is built, with warnings as errors.
"""

import inspect
import os
import re
import shutil
import subprocess
import sys

import pytest

from deepspeed.runtime.activation_checkpointing import attention_stash

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 4)
SECTION_FILE = os.path.join(ROOT, "docs", "code-docs", "source", "autoep.rst")
TUTORIAL_FILE = os.path.join(ROOT, "docs", "_tutorials", "attention-stash.md")
LABEL = ".. _attention-stash:"
MAX_SECTION_LINES = 200
# How DeepSpeed's API pages link a tutorial: its address on the site, which Jekyll builds from docs/_tutorials/.
TUTORIAL_URL = "https://www.deepspeed.ai/tutorials/attention-stash/"
TUTORIAL_PATH = "docs/_tutorials/attention-stash.md"
# The planner's and installer's functions, whose every argument is documented.
FUNCTIONS = ("install_attention_stash", "attention_stash_layer_bytes", "attention_stash_layers_for_budget")

# The "Cause" column of autoep.rst's refused-setups table before the move (git show d40f7fb:docs/code-docs/source/
# autoep.rst, 19 rows), one distinctive phrase per row, in the table's order; matched in lower case, without code
# markup, across line breaks.
REFUSED_CAUSES = (
    "bypasses hugging face's attention interface",  # an implementation refused, or attention around the interface
    "flash implementation that does not load",  # or whose functions are no interface the stash knows
    "fp8 descales",  # flash-attn 3's qv, descales, attention_chunk, seqused_*; softcap tensors, ALiBi, block tables
    "attention sinks that require grad",  # vLLM's flash-attn 3, flash-attn 4 before 4.0.0b26
    "mask that requires grad",  # with attention dropout
    "torch.func transform",
    "kernel functions dynamo cannot trace",  # the torch.compile row
    "second-order gradients",  # and a second backward through a retained graph
    "sdpa backend without an exact replay",
    "flash-attn arguments differ from its forward's",  # a recompute's mask, position_ids or flash-attn arguments
    "forward calls no attention",  # or a recompute making other attention calls
    "attention runs in another dtype",
    "attention output changed in place",
    "wrapper around another function",  # an "sdpa" entry at the first install
    'registered as "sdpa" after the install',
    "scaled_dot_product_attention replaced in the process",
    "checkpointing was never on",
    "attention module replaced",  # or a _gradient_checkpointing_func given to a decoder class
    "attention module shared between a stashed decoder layer",
)


def read(path):
    with open(path, encoding="utf-8") as file:
        return file.read()


def section_lines():
    """The attention stash's part of autoep.rst: from its label to the next title of its level or above, or the end."""
    lines = read(SECTION_FILE).splitlines()
    assert LABEL in lines, f"autoep.rst has no '{LABEL}' label"
    start = lines.index(LABEL)
    title = next(i for i in range(start + 1, len(lines)) if lines[i].strip())
    level = lines[title + 1][0]
    assert set(lines[title + 1]) == {level}, f"no title under '{LABEL}'"
    for i in range(title + 2, len(lines) - 1):
        underline = lines[i + 1]
        if (lines[i].strip() and underline and set(underline) <= {level, "="} and len(set(underline)) == 1
                and len(underline) >= len(lines[i].rstrip())):
            return lines[start:i]
    return lines[start:]


def plain(text):
    """Text as matched: lower case, without code markup, whitespace collapsed over line breaks."""
    return " ".join(text.replace("`", "").lower().split())


def named_in_code(text):
    """The identifiers in code markup: rst and Markdown inline code and fenced blocks, rst code blocks."""
    names = set()
    for _, code in re.findall(r"(`+)(.+?)\1", text, flags=re.DOTALL):
        names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))
    for block in re.findall(r"^\.\. code-block::[^\n]*\n((?:[ \t]*\n|[ \t]+[^\n]*\n)*)", text, flags=re.MULTILINE):
        names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    return names


@pytest.fixture(scope="module")
def docs():
    return "\n".join(section_lines()) + "\n" + read(TUTORIAL_FILE)


def public_names():
    """The module's __all__, the handle's public attributes, and every argument of the public functions."""
    names = set(attention_stash.__all__)
    handle = attention_stash.AttentionStashHandle
    names.update(name for name, _ in inspect.getmembers(handle) if not name.startswith("_"))
    names.update(name for name in vars(handle([], None)) if not name.startswith("_"))  # set in __init__: summary
    for function in FUNCTIONS:
        parameters = inspect.signature(getattr(attention_stash, function)).parameters.values()
        names.update(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names


def test_every_public_name_and_argument_is_named_as_code(docs):
    names = public_names()
    # What the docs named before the move, so that a change in the module's reading cannot empty the check.
    assert {
        "AttentionStashError", "summary", "recomputes_served", "offloaded_bytes", "memory_budget", "offload",
        "tensor_parallel_size", "micro_batches_in_flight", "device"
    } <= names
    missing = sorted(names - named_in_code(docs))
    assert not missing, f"the section and the tutorial name none of {missing} as code"


def test_every_refused_cause_is_named(docs):
    assert len(REFUSED_CAUSES) == len(set(REFUSED_CAUSES)) == 19
    text = plain(docs)
    missing = [cause for cause in REFUSED_CAUSES if cause not in text]
    assert not missing, f"the section and the tutorial no longer name these causes of AttentionStashError: {missing}"


def test_the_section_is_short_and_links_the_tutorial():
    lines = section_lines()
    assert len(lines) <= MAX_SECTION_LINES, f"the attention stash section has {len(lines)} lines"
    text = "\n".join(lines)
    assert TUTORIAL_URL in text and TUTORIAL_PATH in text
    # The rest of the section is what a user reads first: install, the served table, refusals, compile, ALST, AutoTP.
    for name in ("install_attention_stash", "AttentionStashError", "AutoTP", "ALST", "torch.compile", "offload"):
        assert name in text, f"the section does not name {name}"


def test_the_tutorial_opens_with_front_matter():
    lines = read(TUTORIAL_FILE).splitlines()
    assert lines[0] == "---", "the tutorial does not open with YAML front matter"
    end = lines.index("---", 1)
    fields = dict(line.split(":", 1) for line in lines[1:end] if ":" in line)
    assert fields.get("title", "").strip(" \"'"), "the tutorial's front matter has no title"
    assert "tags" in fields


def test_the_section_builds_without_warnings(tmp_path):
    """Sphinx, where installed, builds autoep.rst alone as a page, with warnings as errors."""
    pytest.importorskip("sphinx", reason="the build check needs sphinx")
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(SECTION_FILE, source / "index.rst")
    (source / "conf.py").write_text('project = "x"\nextensions = []\n')
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-W", "-b", "html",
         str(source), str(tmp_path / "build")],
        capture_output=True,
        text=True,
        timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
