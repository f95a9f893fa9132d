# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run by test_attention_stash_ulysses.py under torchrun with two ranks over gloo: the stash under DeepSpeed's Ulysses
sequence parallelism (ALST, UlyssesSPAttentionHF.register_with_transformers with core "sdpa").

For each checkpoint mode, a tiny Llama trains two steps of different sequence lengths (ALST's variable sequence
length) on each rank's shard with ALST alone, which is the reference; then with the stash installed before ALST
registers, and with ALST registered before the install (DeepSpeed's tutorial's order); then the same model after
``remove()``. Then the rest of an ALST setup, each against the same setup without the stash: DeepSpeed's TiledMLP in
every layer, batches from UlyssesSPDataLoaderAdapter, CheckpointHiddenStatesOffload around either checkpoint mode
(its engine made to copy on CPU, which the stash's kept outputs follow to the host), and a reentrant checkpoint function that moves each layer's input to the host in the forward and back
for the recompute. Each rank writes its report as JSON to ``rank<N>.json`` in the folder given as the first argument.
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
import torch  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from attention_stash_helpers import NUM_LAYERS, assert_stock_process, batch_ids, checkpointed  # noqa: E402
from attention_stash_helpers import llama_model, logged_messages, offload_copies_on_cpu, param_grads  # noqa: E402
from deepspeed.runtime.activation_checkpointing import attention_stash  # noqa: E402
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError  # noqa: E402
from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu  # noqa: E402
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, UlyssesSPAttentionHF  # noqa: E402
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter  # noqa: E402

RANKS = 2
BATCH = 2
# Whole sequences of the two steps (ALST's variable sequence length); each rank trains its half.
SEQUENCES = (16, 24)


def register_alst(model):
    return UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model,
                                                           core_attn_implementation="sdpa",
                                                           sequence_parallel_size=RANKS,
                                                           micro_batch_size=BATCH,
                                                           seq_length_is_variable=True)


def unregister_alst():
    """Back to transformers' own sdpa entry (ALST's registration writes the interface's local mapping) and no
    sequence-parallel groups, for the next registration."""
    ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa", None)
    mpu._release_sequence_parallel_groups()
    assert_stock_process()


def shard(tensor, rank):
    length = tensor.shape[1] // RANKS
    return tensor[:, rank * length:(rank + 1) * length]


def step(model, sequence, rank, handle=None):
    """One training step on this rank's shard: the loss and the gradients, and the stash's counts after the forward
    and after the backward."""
    ids = batch_ids(seed=sequence, sequence=sequence)
    positions = torch.arange(sequence).unsqueeze(0).expand(BATCH, -1)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=shard(ids, rank), position_ids=shard(positions, rank)).logits
    loss = logits.float().pow(2).mean()
    counts = {}
    if handle is not None:
        counts["kept_after_forward"] = handle.kept_bytes
    loss.backward()
    if handle is not None:
        counts["kept_after_backward"] = handle.kept_bytes
    return loss.detach(), param_grads(model), counts


def same(first, second):
    """Whether two steps' losses and gradients are bitwise equal."""
    return torch.equal(first[0], second[0]) and first[1].keys() == second[1].keys() and all(
        torch.equal(grad, second[1][name]) for name, grad in first[1].items())


def orders(rank, use_reentrant, report):
    """ALST alone, then the stash installed before and after ALST's registration, each step against ALST alone."""
    model = checkpointed(llama_model(), use_reentrant=use_reentrant)
    register_alst(model)
    reference = [step(model, sequence, rank) for sequence in SEQUENCES]
    unregister_alst()
    for order in ("stash_first", "alst_first"):
        model = checkpointed(llama_model(), use_reentrant=use_reentrant)
        with logged_messages() as messages:
            if order == "stash_first":
                handle = attention_stash.install_attention_stash(model, NUM_LAYERS, sequence_parallel_size=RANKS)
                register_alst(model)
            else:
                register_alst(model)
                handle = attention_stash.install_attention_stash(model,
                                                                 NUM_LAYERS,
                                                                 micro_batch_size=BATCH,
                                                                 sequence_length=SEQUENCES[0])
        results = [step(model, sequence, rank, handle) for sequence in SEQUENCES]
        key = f"{order}_{'reentrant' if use_reentrant else 'non_reentrant'}"
        report[key] = {
            "install_line":
            handle.summary,
            # The install lines this rank logged: rank 0's alone, as DeepSpeed's log_dist(..., ranks=[0]) logs.
            "logged": [message for message in messages if "keeping the attention output" in message],
            "bitwise": [same(result, expected) for result, expected in zip(results, reference)],
            "served":
            handle.recomputes_served,
            "kept_after_forward": [result[2]["kept_after_forward"] for result in results],
            "kept_after_backward": [result[2]["kept_after_backward"] for result in results],
            # One rank's bytes, from the ALST registration found, and with its size given.
            "planned_found": [
                NUM_LAYERS * attention_stash.attention_stash_layer_bytes(model, BATCH, sequence, device="cpu")
                for sequence in SEQUENCES
            ],
            "planned_given": [
                NUM_LAYERS * attention_stash.attention_stash_layer_bytes(
                    model, BATCH, sequence, device="cpu", sequence_parallel_size=RANKS) for sequence in SEQUENCES
            ],
            "layers_for_budget":
            attention_stash.attention_stash_layers_for_budget(model,
                                                              results[0][2]["kept_after_forward"],
                                                              BATCH,
                                                              SEQUENCES[0],
                                                              device="cpu"),
        }
        handle.remove()
        # ALST's own behaviour after the removal: its wrapper still in front, the core function stock.
        after = [step(model, sequence, rank) for sequence in SEQUENCES]
        report[key]["removed_bitwise"] = [same(result, expected) for result, expected in zip(after, reference)]
        unregister_alst()


def tiled_mlp_forward(self, hidden_states):
    """DeepSpeed's TiledMLP on a Llama MLP, as its docstring patches it: a fixed number of shards here."""

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    return TiledMLP.apply(mlp_forward, self, hidden_states, 2,
                          [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])


class HostOffloadedCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint that keeps the layer's input on the host between the forward and the recompute, as ALST
    recipes patch checkpointing to do."""

    @staticmethod
    def forward(ctx, run_function, hidden_states, *args):
        ctx.run_function, ctx.args, ctx.device = run_function, args, hidden_states.device
        ctx.save_for_backward(hidden_states.to("cpu", copy=True))
        with torch.no_grad():
            return run_function(hidden_states, *args)

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states = ctx.saved_tensors[0].to(ctx.device).detach().requires_grad_()
        with torch.enable_grad():
            output = ctx.run_function(hidden_states, *ctx.args)
        torch.autograd.backward(output, grad_output)
        return (None, hidden_states.grad) + (None, ) * len(ctx.args)


def host_offloaded_checkpoint(function, hidden_states, *args, **kwargs):
    return HostOffloadedCheckpoint.apply(lambda hidden, *rest: function(hidden, *rest, **kwargs), hidden_states, *args)


def with_and_without_the_stash(rank, prepare, run, report, key):
    """``run`` on a model that ``prepare`` set up under ALST, without and then with the stash: bitwise, every layer
    served, nothing kept after, the bytes offloaded and brought back."""
    results = []
    for stashed in (False, True):
        model = prepare(llama_model())
        register_alst(model)
        handle = attention_stash.install_attention_stash(model, NUM_LAYERS) if stashed else None
        results.append(run(model))
        if handle is not None:
            report[key] = {"served": handle.recomputes_served, "kept": handle.kept_bytes}
            if handle.offloaded_bytes:
                report[key].update(offloaded=handle.offloaded_bytes, restored=handle.restored_bytes)
            handle.remove()
        unregister_alst()
    report[key]["bitwise"] = same(*results)


def rest_of_the_setup(rank, report):
    sequence = SEQUENCES[0]

    def tiled(model):
        for layer in model.model.layers:
            layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)
        return checkpointed(model, use_reentrant=False)

    with_and_without_the_stash(rank, tiled, lambda model: step(model, sequence, rank)[:2], report, "tiled_mlp")

    def from_adapter(model):
        ids = batch_ids(seed=5, sequence=sequence)
        samples = [{"input_ids": row, "position_ids": torch.arange(sequence), "labels": row} for row in ids]
        loader = torch.utils.data.DataLoader(samples, batch_size=BATCH)
        batches = UlyssesSPDataLoaderAdapter(loader,
                                             sp_rank=rank,
                                             sp_group=mpu.get_sequence_parallel_group(),
                                             sp_world_size=RANKS,
                                             device="cpu")
        batch = next(iter(batches))
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        # The adapter shifts the labels for the whole sequence, so the loss is the caller's, as in ALST recipes.
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["shift_labels"].flatten())
        loss.backward()
        return loss.detach(), param_grads(model)

    with_and_without_the_stash(rank, lambda model: checkpointed(model, use_reentrant=False), from_adapter, report,
                               "data_loader_adapter")

    def offloaded(model):
        from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

        # Its engine copies on CPU here: the stash's kept outputs follow the hidden states to the host.
        with offload_copies_on_cpu({}), CheckpointHiddenStatesOffload():
            return step(model, sequence, rank)[:2]

    for use_reentrant in (False, True):
        with_and_without_the_stash(rank, lambda model: checkpointed(model, use_reentrant=use_reentrant), offloaded,
                                   report, "hidden_states_offload" + "_reentrant" * use_reentrant)

    def host_checkpoint(model):
        model = checkpointed(model, use_reentrant=True)
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = host_offloaded_checkpoint
        return model

    with_and_without_the_stash(rank, host_checkpoint, lambda model: step(model, sequence, rank)[:2], report,
                               "host_offloaded_checkpoint")


def refused_core(report):
    """ALST registered around a core function that is not Hugging Face's sdpa function (one that never calls
    F.scaled_dot_product_attention): the install refuses, naming it and where it is, and leaves ALST as it was."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def other_kernel(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = other_kernel
    model = checkpointed(llama_model())
    register_alst(model)
    wrapper = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        attention_stash.install_attention_stash(model, NUM_LAYERS)
    except AttentionStashError as error:
        report["refused_core"] = str(error)
    report["refused_core_left_alone"] = (ALL_ATTENTION_FUNCTIONS["sdpa"] is wrapper and attention_stash._held is None
                                         and not attention_stash._STASHES)
    unregister_alst()


def changed_after_the_install(report):
    """ALST registered first, the stash installed: a core function set on ALST's object after the install, and ALST's
    entry taken out of the interface after it, each raise naming what changed where; a size given against the
    registration is refused."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def direct(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    for case in ("core_replaced", "alst_unregistered"):
        model = checkpointed(llama_model())
        register_alst(model)
        handle = attention_stash.install_attention_stash(model, NUM_LAYERS)
        if case == "core_replaced":
            attention_stash._ulysses_attention(ALL_ATTENTION_FUNCTIONS["sdpa"]).attn = direct
        else:
            ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa")
        try:
            step(model, SEQUENCES[0], dist.get_rank())
        except AttentionStashError as error:
            report[case] = str(error)
        handle.remove()
        unregister_alst()
    model = checkpointed(llama_model())
    register_alst(model)
    for name, call in (("size_against_registration_install",
                        lambda: attention_stash.install_attention_stash(model, 1, sequence_parallel_size=4)),
                       ("size_against_registration_planner", lambda: attention_stash.attention_stash_layer_bytes(
                           model, BATCH, SEQUENCES[0], device="cpu", sequence_parallel_size=4))):
        try:
            call()
        except ValueError as error:
            report[name] = str(error)
    unregister_alst()


def fewer_key_heads(rank, report):
    """One key/value head over two ranks, which ALST replicates on each: planned and served, bitwise against ALST
    alone, in both checkpoint modes; the bytes kept (the rank's two query heads) are the planner's."""
    sequence = SEQUENCES[0]
    for use_reentrant in (True, False):
        results, case = [], {}
        for stashed in (False, True):
            model = checkpointed(llama_model(num_key_value_heads=1), use_reentrant=use_reentrant)
            register_alst(model)
            handle = attention_stash.install_attention_stash(model, NUM_LAYERS) if stashed else None
            results.append(step(model, sequence, rank, handle))
            if handle is not None:
                case = {
                    "served":
                    handle.recomputes_served,
                    "kept_after_forward":
                    results[-1][2]["kept_after_forward"],
                    "kept_after_backward":
                    results[-1][2]["kept_after_backward"],
                    "planned":
                    NUM_LAYERS * attention_stash.attention_stash_layer_bytes(model, BATCH, sequence, device="cpu"),
                }
                handle.remove()
            unregister_alst()
        case["bitwise"] = same(results[0], results[1])
        report[f"fewer_key_heads_{'reentrant' if use_reentrant else 'non_reentrant'}"] = case


def main():
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    report = {"rank": rank}
    for use_reentrant in (True, False):
        orders(rank, use_reentrant, report)
    rest_of_the_setup(rank, report)
    fewer_key_heads(rank, report)
    refused_core(report)
    changed_after_the_install(report)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as file:
        json.dump(report, file)
    dist.barrier()


if __name__ == "__main__":
    main()
