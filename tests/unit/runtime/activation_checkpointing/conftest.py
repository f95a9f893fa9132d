# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The install fixture of the attention stash tests: every test leaves the process as it found it."""

import gc
import logging
import os

import pytest
import torch

from deepspeed.runtime.activation_checkpointing.attention_stash import install_attention_stash

from attention_stash_helpers import assert_stock_process

# After attention_stash_helpers' import, which records PyTorch's default (DEFAULT_THREADS, for the test that runs at
# it): each of pytest-xdist's workers (-n) takes its share of the cores for PyTorch's intra-op threads, and so do the
# processes the tests start (through OMP_NUM_THREADS), unless OMP_NUM_THREADS is set already. PyTorch's default, a
# thread per core in every process, oversubscribed CI's 2 cores under -n 2: measured there, the benchmark and
# ZeRO files ran 2.4 times slower (87 s against 36 s), one benchmark test 7 times (32 s against 4.5 s).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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


@pytest.fixture(autouse=True)
def _collections_see_what_this_test_made():
    """Collects the garbage left so far and moves every object alive into the collector's permanent generation
    (gc.freeze), before each test: the imported libraries' millions of objects made each full collection take about
    0.3 s here, and the tests collect several times each (tensors(), live_tensors(), kept_outputs()). A collection and
    gc.get_objects() then see only what was made since, which holds whatever the test made; what was alive before is
    what those checks leave out anyway. Frozen objects are still freed when their last reference goes."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _restore_what_libraries_leave():
    """Restores, after each test, what PyTorch and DeepSpeed leave changed for the rest of the process:

    - PyTorch's checkpoint debug mode (debug=True) leaves its "LoggingTensor" logger at INFO and non-propagating.
      pytest >= 9.1 attaches its log capture to every non-propagating logger at each test's start, and torch < 2.15
      logs each op of a debug-mode checkpoint with arguments its message cannot format: the next test with
      debug=True fails with "TypeError: not all arguments converted during string formatting".
    - DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear with its own autograd Function (zero3_linear_wrap):
      "This will persist unless manually reset" (deepspeed/runtime/zero/partition_parameters.py). torch.compile then
      traces that Function in every later model, and its traced tensors outlive each compiled step, with or without
      the stash (measured: 130 to 146 tensors of the batch's shape after a compiled plain step).
    """
    linear = torch.nn.functional.linear
    yield
    logger = logging.getLogger("LoggingTensor")
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
    logger.filters.clear()
    torch.nn.functional.linear = linear
