# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Import this tree's modules under their in-tree names, ahead of the installed DeepSpeed's; and find the packages
that the README's test command puts in the repository's ``.test-packages`` folder, never in site-packages."""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# flash-attn 2.8.3's Python layer built without its CUDA kernels (and its hopper/ interface), for the flash tests
# alone: installed, it would tell transformers that flash-attn 2 is available on a CUDA machine. A flash-attn the
# environment has is used as it is; the folder goes last on the path, so it never shadows an installed package.
TEST_PACKAGES = os.path.join(_ROOT, ".test-packages")
if (os.path.isdir(TEST_PACKAGES) and TEST_PACKAGES not in sys.path and importlib.util.find_spec("flash_attn") is None):
    sys.path.append(TEST_PACKAGES)

import deepspeed.runtime.activation_checkpointing as _activation_checkpointing  # noqa: E402

_TREE = os.path.join(_ROOT, "deepspeed", "runtime", "activation_checkpointing")
if _TREE not in _activation_checkpointing.__path__:
    _activation_checkpointing.__path__.insert(0, _TREE)
