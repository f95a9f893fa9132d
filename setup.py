# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Installs the attention stash into the stock DeepSpeed package.

Only the one module ships: no ``__init__.py`` of this tree is packaged, so DeepSpeed's own stay untouched on install
and uninstall.
"""

from setuptools import setup

setup(
    name="deepspeed-attention-stash",
    version="0.1.0",
    description="Attention-output stash for Hugging Face activation checkpointing (reentrant or not) in DeepSpeed",
    license="Apache-2.0",
    python_requires=">=3.10",
    py_modules=["deepspeed.runtime.activation_checkpointing.attention_stash"],
    install_requires=["deepspeed==0.19.8", "torch>=2.11", "transformers>=5.0,<6"],
)
