# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Train a small Hugging Face model for a few steps through deepspeed.initialize with the attention stash, on CPU.

Start it with a launcher, as DeepSpeed jobs are started; either one sets what deepspeed.initialize needs to make its
process group (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):

    deepspeed --num_gpus 1 examples/attention_stash_train.py
    torchrun --standalone --nproc_per_node 1 examples/attention_stash_train.py

The model is a 4-layer Qwen3-MoE built from a config (nothing is downloaded) with per-layer activation checkpointing;
the stash serves the recompute of its last ``--stash-layers`` attention layers. The script prints the stash's install
line from DeepSpeed's logger, the loss of each step and the handle's counters, and fails if any recompute was not
served. The first run on a machine builds DeepSpeed's CPU communication op (a C++ compiler is needed, about 20 s).
"""

import argparse
import os
import sys

import deepspeed
import torch
from deepspeed.runtime.activation_checkpointing.attention_stash import install_attention_stash
from deepspeed.utils import set_log_level_from_string
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    # torch_adam: PyTorch's AdamW, not DeepSpeed's fused CPU Adam, which would compile another C++ op first.
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": 1e-3,
            "torch_adam": True
        }
    },
    "zero_optimization": {
        "stage": 0
    },
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    parser.add_argument("--stash-layers", type=int, default=2, help="stash the last N of the 4 layers (default 2)")
    parser.add_argument("--non-reentrant",
                        action="store_true",
                        help="transformers' default non-reentrant checkpointing instead of reentrant")
    # The deepspeed launcher passes --local_rank to the script; torchrun sets LOCAL_RANK only.
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def small_model():
    config = Qwen3MoeConfig(vocab_size=512,
                            hidden_size=64,
                            intermediate_size=128,
                            moe_intermediate_size=64,
                            num_hidden_layers=4,
                            num_attention_heads=4,
                            num_key_value_heads=2,
                            head_dim=16,
                            num_experts=4,
                            num_experts_per_tok=2,
                            max_position_embeddings=128,
                            use_cache=False,
                            attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def enable_checkpointing(model, use_reentrant):
    kwargs = {"use_reentrant": use_reentrant}
    # transformers 5.23 renamed gradient_checkpointing_enable; up to 5.22 only the old name exists.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def main():
    args = parse_args()
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if missing:
        # Without them deepspeed.initialize looks for an MPI launch and fails with "No module named 'mpi4py'".
        sys.exit(f"attention_stash_train.py needs the launcher's environment, got no {', '.join(missing)}. Start it "
                 f"with `deepspeed --num_gpus 1 {sys.argv[0]}` or `torchrun --standalone --nproc_per_node 1 "
                 f"{sys.argv[0]}`.")
    model = small_model()
    enable_checkpointing(model, use_reentrant=not args.non_reentrant)
    # DeepSpeed's logger (deepspeed.utils.logger) and its handler stop at WARNING unless told otherwise: at INFO they
    # show the stash's install line. Back at WARNING for deepspeed.initialize, whose INFO lines print its whole config.
    set_log_level_from_string("info")
    handle = install_attention_stash(model, num_layers=args.stash_layers)
    set_log_level_from_string("warning")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)

    # One fixed batch, trained on again and again: the loss falls.
    shape = (DS_CONFIG["train_micro_batch_size_per_gpu"], 64)
    ids = torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(0)).to(engine.device)
    for step in range(1, args.steps + 1):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)  # each stashed layer's recompute takes the kept attention output
        engine.step()
        print(f"step {step}/{args.steps}: loss {loss.item():.4f}", flush=True)

    expected = args.stash_layers * args.steps
    print(f"stashed layers: {', '.join(handle.layers)}")
    print(f"recomputes served: {handle.recomputes_served} of {expected} ({args.stash_layers} layers x {args.steps} "
          f"steps); peak kept: {handle.peak_kept_bytes:,} bytes; kept now: {handle.kept_bytes:,} bytes")
    served = handle.recomputes_served
    handle.remove()
    if served != expected:
        raise RuntimeError(f"attention_stash_train.py needs the stash to serve every recompute, got {served} of "
                           f"{expected}. Report it with this output.")


if __name__ == "__main__":
    main()
