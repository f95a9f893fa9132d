# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run by test_attention_stash_deepspeed.py under torchrun with two ranks: AutoEP with autoep_size=2 over gloo.

Each rank trains the same tiny Mixtral with and without the stash and writes its report as JSON to
``rank<N>.json`` in the folder given as the first argument (not to stdout, where the ranks' lines can interleave).
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))  # tests/: conftest imports this tree's module

import conftest  # noqa: E402,F401
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402

from attention_stash_helpers import NUM_LAYERS, batch_ids, checkpointed, mixtral_model  # noqa: E402
from deepspeed.runtime.activation_checkpointing.attention_stash import install_attention_stash  # noqa: E402

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": 1e-2,
            "torch_adam": True
        }
    },
    "expert_parallel": {
        "enabled": True,
        "autoep_size": 2,
        "preset_model": "mixtral"
    },
}


def train(stashed, report):
    model = checkpointed(mixtral_model())
    handle = install_attention_stash(model, stashed) if stashed else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    losses = []
    for step in range(3):
        ids = batch_ids(seed=step)
        loss = engine(input_ids=ids, labels=ids).loss
        if handle is not None:
            report["kept_after_forward"] = handle.num_kept
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if handle is not None:
        report["kept_after_steps"] = handle.num_kept
        report["recomputes_served"] = handle.recomputes_served
        handle.remove()
    return losses


def main():
    report = {"rank": int(os.environ["RANK"])}
    report["plain_losses"] = train(0, report)
    report["stashed_losses"] = train(NUM_LAYERS, report)
    with open(os.path.join(sys.argv[1], f"rank{report['rank']}.json"), "w") as file:
        json.dump(report, file)
    dist.barrier()


if __name__ == "__main__":
    main()
