# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The install fixture of the attention stash tests: every test leaves the process as it found it."""

import pytest

from deepspeed.runtime.activation_checkpointing.attention_stash import install_attention_stash

from attention_stash_helpers import assert_stock_process


@pytest.fixture
def install():
    """install_attention_stash that removes what a test left installed, and checks that nothing is left."""
    handles = []

    def _install(model, *args, **kwargs):
        handle = install_attention_stash(model, *args, **kwargs)
        handles.append(handle)
        return handle

    yield _install
    for handle in handles:
        handle.remove()
    assert_stock_process()
