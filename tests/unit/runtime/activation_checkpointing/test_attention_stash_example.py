# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""examples/attention_stash_train.py as the README starts it: through the deepspeed launcher and torchrun, on CPU.

The example runs in its own processes with this tree's module (a sitecustomize on PYTHONPATH points its import here,
as tests/conftest.py does in-process), so the suite tests the tree, not an installed copy.
"""

import os
import re
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
EXAMPLE = os.path.join(REPO, "examples", "attention_stash_train.py")
MODULE = "deepspeed.runtime.activation_checkpointing.attention_stash"
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
STEPS = 2
STASHED = 2

SITECUSTOMIZE = f'''
import importlib.abc
import importlib.util
import sys


class _TreeModule(importlib.abc.MetaPathFinder):

    def find_spec(self, name, path=None, target=None):
        if name == {MODULE!r}:
            return importlib.util.spec_from_file_location(name, {os.path.join(REPO, *MODULE.split(".")) + ".py"!r})
        return None


sys.meta_path.insert(0, _TreeModule())
'''


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _script(name):
    """The launcher installed with this Python, as a user's shell finds it in the same environment."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.isfile(path):
        pytest.fail(f"the example test needs the {name} launcher next to {sys.executable}, got none. Install "
                    f"requirements/requirements-dev.txt into this Python.")
    return path


def _run(command, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # The DeepSpeed tests set the launcher's variables in this process; the launcher must set its own.
    environment = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return subprocess.run(command, env=environment, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_example_trains_through_the_launcher(tmp_path, launcher):
    arguments = [EXAMPLE, "--steps", str(STEPS), "--stash-layers", str(STASHED)]
    if launcher == "deepspeed":
        # The launcher's default port is fixed (29500): two runs on one machine would collide.
        command = [_script("deepspeed"), "--num_gpus", "1", "--master_port", str(_free_port()), *arguments]
        mode = "reentrant"
    else:
        command = [_script("torchrun"), "--standalone", "--nproc_per_node", "1", *arguments, "--non-reentrant"]
        mode = "non-reentrant"
    result = _run(command, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    # The install line, shown by DeepSpeed's logger at INFO through log_dist (rank 0, or -1 before the process group
    # exists), names the layers and the checkpointing mode.
    install = re.findall(
        r"\[INFO\] \[logging\.py:\d+:log_dist\] \[Rank (?:-1|0)\] attention stash: keeping "
        r"the attention output of (\d) of 4 attention layers .*; ([a-z-]+) checkpointing:", output)
    assert install == [(str(STASHED), mode)], output[-6000:]
    losses = [float(loss) for loss in re.findall(r"^step \d+/\d+: loss (\d+\.\d+)$", output, re.MULTILINE)]
    assert len(losses) == STEPS and losses[-1] < losses[0], output[-6000:]
    assert "stashed layers: model.layers.2, model.layers.3\n" in output
    served = re.search(r"^recomputes served: (\d+) of (\d+) .*peak kept: ([\d,]+) bytes; kept now: 0 bytes$", output,
                       re.MULTILINE)
    assert served is not None, output[-6000:]
    # Every recompute of every stashed layer was served, and each kept the formula's bytes: micro-batch 2 x 4 heads x
    # sequence 64 x (head dim 16 x 4 bytes + an FP32 log-sum-exp) per layer, both layers held at once.
    assert int(served[1]) == int(served[2]) == STASHED * STEPS
    assert int(served[3].replace(",", "")) == STASHED * 2 * 4 * 64 * (16 * 4 + 4)


def test_example_without_a_launcher_says_how_to_start_it(tmp_path):
    result = _run([sys.executable, EXAMPLE], tmp_path)
    assert result.returncode == 1
    assert "needs the launcher's environment, got no RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in (
        result.stderr)
    assert "deepspeed --num_gpus 1" in result.stderr and "torchrun --standalone --nproc_per_node 1" in result.stderr
