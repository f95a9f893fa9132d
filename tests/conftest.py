# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Import this tree's modules under their in-tree names, ahead of the installed DeepSpeed's."""

import os

import deepspeed.runtime.activation_checkpointing as _activation_checkpointing

_TREE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deepspeed", "runtime",
                     "activation_checkpointing")
if _TREE not in _activation_checkpointing.__path__:
    _activation_checkpointing.__path__.insert(0, _TREE)
