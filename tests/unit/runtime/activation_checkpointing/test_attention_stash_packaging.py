# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The add-on ships one module into the stock DeepSpeed package and nothing that would replace DeepSpeed's files."""

import os
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
