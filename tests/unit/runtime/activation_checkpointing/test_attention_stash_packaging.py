# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The add-on ships one module into the stock DeepSpeed package and nothing that would replace DeepSpeed's files."""

import os
import re
from importlib import metadata

import pytest

MODULE = "deepspeed/runtime/activation_checkpointing/attention_stash.py"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def test_tree_has_no_package_init():
    # An __init__.py here would overwrite stock DeepSpeed's on install and delete it on uninstall.
    found = [
        os.path.join(root, "__init__.py") for root, _, files in os.walk(os.path.join(REPO, "deepspeed"))
        if "__init__.py" in files
    ]
    assert found == []
    assert os.path.isfile(os.path.join(REPO, MODULE))


def test_installed_distribution_ships_only_the_module():
    # Only an installed distribution has a RECORD; the build's egg-info in the source tree lists the sources instead.
    installed = [dist for dist in metadata.distributions(name="deepspeed-attention-stash") if dist.read_text("RECORD")]
    if not installed:
        pytest.skip("deepspeed-attention-stash is not installed (pip install .)")
    shipped = [str(path) for path in installed[0].files if not str(path).split("/")[0].endswith(".dist-info")]
    assert [path for path in shipped if not path.endswith(".pyc")] == [MODULE]


def _torch_specifiers(path):
    """The version specifiers of each torch requirement in a requirements file."""
    from packaging.requirements import Requirement

    with open(path) as file:
        lines = [line.split("#")[0].strip() for line in file]
    requirements = [Requirement(line) for line in lines if line and not line.startswith("-")]
    return [requirement.specifier for requirement in requirements if requirement.name == "torch"]


def test_requirements_keep_an_installed_torch_the_module_supports():
    """pip install -r requirements/... must not replace a user's torch (2.15, say) with CI's: the pin is CI's alone."""
    folder = os.path.join(REPO, "requirements")
    required = _torch_specifiers(os.path.join(folder, "requirements.txt"))
    with open(os.path.join(REPO, "setup.py")) as file:
        supported = re.search(r'"torch([^"]*)"', file.read())[1]
    assert [str(specifier) for specifier in required] == [supported] == [">=2.11"]
    assert "2.15.0" in required[0] and "2.13.0+cpu" in required[0]
    for name in sorted(set(os.listdir(folder)) - {"requirements.txt", "constraints-ci.txt"}):
        assert _torch_specifiers(os.path.join(folder, name)) == [], name  # torch comes from requirements.txt only
    assert [str(specifier)
            for specifier in _torch_specifiers(os.path.join(folder, "constraints-ci.txt"))] == ["==2.13.0"]
