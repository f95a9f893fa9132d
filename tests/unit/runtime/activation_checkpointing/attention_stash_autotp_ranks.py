# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run by test_attention_stash_autotp.py under torchrun with two ranks over gloo (three for "qwen3_tp3", AutoTP at TP 3,
whose ranks are every rank torchrun starts): the stash under DeepSpeed's AutoTP
(tensor parallelism), which shards q/k/v/o and the MLP by the model's tp_plan at ``deepspeed.initialize`` when the
config has ``"tensor_parallel": {"autotp_size": 2}`` (or after ``deepspeed.tp_model_init``), so that each rank's
attention runs on its own heads.

Each case trains one step of a tiny model through a DeepSpeed engine with AutoTP alone, which is the reference, then
with the stash on every layer, installed before ``deepspeed.initialize`` (with ``tensor_parallel_size``) and after it
(on ``engine.module``): loss, this rank's local gradients and parameters after the step bitwise, every recompute
served, nothing kept after the step, and the planner's bytes (before the sharding, given the size; after it, found)
against what the rank kept. The implementations after the first argument ("sdpa", "flash_attention_2", ...) run one
after the other, each set up as the single-process tests set it up and undone before the next. Each rank writes its
report as JSON to ``rank<N>.json`` in the folder given as the first argument.
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
import pytest  # noqa: E402
import torch  # noqa: E402

from attention_stash_flash import make_batch  # noqa: E402
from attention_stash_helpers import CPU_FORWARD, NUM_LAYERS, CountOps, assert_stock_process, checkpointed  # noqa: E402
from attention_stash_helpers import deepspeed_config  # noqa: E402
from attention_stash_helpers import _tiny, live_checkpoint_calls, llama_model, mixtral_model, param_grads  # noqa: E402
from attention_stash_ulysses_flash_ranks import FlashForwardCalls, use_flash  # noqa: E402
from deepspeed.runtime.activation_checkpointing import attention_stash  # noqa: E402
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError  # noqa: E402

# The tensor-parallel size: every rank torchrun starts (two; three for "qwen3_tp3").
RANKS = int(os.environ.get("WORLD_SIZE", "2"))


def qwen3_model(heads=6, key_heads=3):
    """A tiny dense Qwen3 (norms of the queries and keys before RoPE) with ``heads`` query and ``key_heads``
    key/value heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _tiny(Qwen3ForCausalLM, Qwen3Config, torch.float32, dict(head_dim=16),
                 dict(num_attention_heads=heads, num_key_value_heads=key_heads))


def config(stage=0, **extra):
    return deepspeed_config(stage, tensor_parallel={"autotp_size": RANKS}, **extra)


def train(make_model, ds_config, use_reentrant, kind, implementation="sdpa", stash=None, init="config"):
    """One step of ``make_model()`` through a DeepSpeed engine under AutoTP: the stash installed "before" or "after"
    ``deepspeed.initialize``, or None; AutoTP from the config or (``init`` "tp_model_init") from tp_model_init."""
    inputs, (batch, sequence) = make_batch(kind)
    model = checkpointed(make_model(), use_reentrant=use_reentrant)
    model.config._attn_implementation = implementation
    handle, case = None, {}
    if stash == "before":
        case["planned_given"] = attention_stash.attention_stash_layer_bytes(model,
                                                                            batch,
                                                                            sequence,
                                                                            device="cpu",
                                                                            tensor_parallel_size=RANKS)
        handle = attention_stash.install_attention_stash(model, NUM_LAYERS, tensor_parallel_size=RANKS)
    if init == "tp_model_init":
        deepspeed.tp_model_init(model, tp_size=RANKS, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if stash == "after":
        handle = attention_stash.install_attention_stash(engine.module,
                                                         NUM_LAYERS,
                                                         micro_batch_size=batch,
                                                         sequence_length=sequence)
    with CountOps() as ops, FlashForwardCalls() as flash_calls:
        loss = engine(**inputs).loss
    forwards = [ops.calls[CPU_FORWARD] + sum(flash_calls.calls.values())]
    if handle is not None:
        case["kept_after_forward"] = handle.kept_bytes
    with CountOps() as ops, FlashForwardCalls() as flash_calls:
        engine.backward(loss)
    # The attention forward kernels run in the forward and in the backward (the recomputes): CPU flash attention's
    # for sdpa, flash-attn's forward ops and flash-attn 4's kernel function runs.
    case["attention_forwards"] = forwards + [ops.calls[CPU_FORWARD] + sum(flash_calls.calls.values())]
    grads = param_grads(engine.module)
    engine.step()
    loss = loss.detach()  # the step's graph, and the checkpoints' calls it holds, go with it
    params = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    if handle is not None:
        case.update(
            served=handle.recomputes_served,
            kept_after_step=handle.num_kept,
            # What gc finds alive of the stash's per-call objects, which hold what a first pass kept.
            live_after_step=len(live_checkpoint_calls()),
            peak_kept_bytes=handle.peak_kept_bytes,
            planned=attention_stash.attention_stash_layer_bytes(engine.module, batch, sequence, device="cpu"),
            fitting=attention_stash.attention_stash_layers_for_budget(engine.module,
                                                                      handle.peak_kept_bytes,
                                                                      batch,
                                                                      sequence,
                                                                      device="cpu"),
            install_line=handle.summary)
        handle.remove()
    return (loss, grads, params), case


def same(first, second):
    """Whether two steps' losses, gradients and parameters after the step are bitwise equal."""
    return torch.equal(first[0], second[0]) and all(
        ours.keys() == theirs.keys() and all(torch.equal(tensor, theirs[name]) for name, tensor in ours.items())
        for ours, theirs in zip(first[1:], second[1:]))


# The install orders of a setup that runs each mode and each order once, where plain sdpa, the uneven splits and a rank
# without heads run every pair: the reentrant step installs after deepspeed.initialize, the non-reentrant one before.
ALTERNATE = {True: ("after", ), False: ("before", )}


def cases(report,
          name,
          make_model,
          ds_config,
          kind,
          orders,
          implementation="sdpa",
          init="config",
          modes=(True, False)):
    """The reference and the stashed steps of one setup in each checkpoint mode, one case per install order (``orders``,
    or ALTERNATE's for the mode)."""
    for use_reentrant in modes:
        reference, reference_case = train(make_model, ds_config, use_reentrant, kind, implementation, init=init)
        for order in orders[use_reentrant] if orders is ALTERNATE else orders:
            result, case = train(make_model, ds_config, use_reentrant, kind, implementation, order, init)
            case.update(bitwise=same(result, reference),
                        reference_attention_forwards=reference_case["attention_forwards"])
            report[f"{name}_{'reentrant' if use_reentrant else 'non_reentrant'}_{order}"] = case


def sdpa(report):
    both = ("before", "after")
    for kind in ("plain", "padded", "packed"):
        cases(report, f"sdpa_{kind}", llama_model, config(), kind, both if kind == "plain" else ALTERNATE)
    cases(report, "tp_model_init", llama_model, config(), "plain", ALTERNATE, init="tp_model_init")
    for stage in (1, 2):
        cases(report, f"zero{stage}", llama_model, config(stage), "plain", ALTERNATE)
    # Heads that do not split evenly: 3 key/value heads over 2 ranks (DeepSpeed gives rank 0 two of them), and one
    # key/value head over 2 ranks (rank 1 holds no attention heads).
    cases(report, "qwen3_uneven", qwen3_model, config(), "plain", both)
    cases(report, "no_heads_on_rank_1", lambda: llama_model(num_key_value_heads=1), config(), "plain", both)
    mismatches(report)
    autoep(report)


def mismatches(report):
    """A tensor_parallel_size other than AutoTP's: given before the sharding, the first training forward raises,
    keeping nothing; given after it, the install and the planner raise."""
    model = checkpointed(llama_model())
    handle = attention_stash.install_attention_stash(model, NUM_LAYERS, tensor_parallel_size=4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config())
    inputs, (batch, sequence) = make_batch("plain")
    try:
        engine(**inputs)
    except AttentionStashError as error:
        report["mismatch_at_forward"] = str(error)
    # What the refused forward left: counted, and what gc finds of the stash's per-call objects.
    report["mismatch_kept"] = [handle.num_kept, len(live_checkpoint_calls())]
    handle.remove()
    for name, call in ((
            "mismatch_at_install",
            lambda: attention_stash.install_attention_stash(engine.module, NUM_LAYERS, tensor_parallel_size=4)),
                       ("mismatch_in_planner", lambda: attention_stash.attention_stash_layer_bytes(
                           engine.module, batch, sequence, device="cpu", tensor_parallel_size=4))):
        try:
            call()
        except ValueError as error:
            report[name] = str(error)


def autoep(report):
    """AutoEP folded with AutoTP (expert parallel within the tensor-parallel ranks), where DeepSpeed 0.19.8 runs it on
    CPU: else the line DeepSpeed raises."""
    ds_config = config(expert_parallel={"enabled": True, "autoep_size": RANKS, "preset_model": "mixtral"})
    try:
        cases(report, "autoep", mixtral_model, ds_config, "plain", ("after", ), modes=(True, ))
    except Exception as error:  # DeepSpeed's own refusal, reported as it is
        report["autoep_refused"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"


def flash(report, implementation, folder, rank):
    monkeypatch = pytest.MonkeyPatch()
    use_flash(implementation, folder, rank, monkeypatch)
    # In bfloat16: Hugging Face's flash path casts a float32 query to the dtype of the attention module's first
    # torch.nn.Linear, and AutoTP leaves none (transformers' get_target_dtype raises StopIteration without the stash).
    for kind in ("plain", "packed"):
        cases(report, f"{implementation}_{kind}", lambda: llama_model(torch.bfloat16), config(bf16=True), kind,
              ALTERNATE, implementation)
    monkeypatch.undo()
    assert_stock_process()


def main():
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    report = {"rank": rank}
    for implementation in sys.argv[2:]:
        if implementation == "sdpa":
            sdpa(report)
        elif implementation == "qwen3_tp3":
            # 8 query and 4 key/value heads over 3 ranks: DeepSpeed gives rank 0 two key/value heads, ranks 1 and 2 one.
            cases(report, "qwen3_tp3", lambda: qwen3_model(8, 4), config(), "plain", ("before", "after"))
        else:
            flash(report, implementation, sys.argv[1], rank)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as file:
        json.dump(report, file)
    dist.barrier()


if __name__ == "__main__":
    main()
