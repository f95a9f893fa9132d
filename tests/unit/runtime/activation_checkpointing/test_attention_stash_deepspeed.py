# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The attention stash inside DeepSpeed training: ZeRO stages, AutoEP, two ranks, gradient accumulation, HF Trainer,
DeepSpeed's own activation checkpointing.

Every test trains the same model with and without the stash and compares. On CPU the stash replays the normal
recompute's deterministic kernels, so losses and parameters are compared bitwise.
"""

import gc
import json
import os

import pytest
import torch
import transformers

from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError, install_attention_stash

from attention_stash_helpers import (CPU_FORWARD, NUM_LAYERS, CountOps, assert_same_grads, deepspeed_config,
                                     assert_stashed_step_is_stock, batch_ids, checkpointed, free_port, mixtral_model,
                                     param_grads, qwen3_moe_model, run_on_two_ranks)

# One process group for the whole module, as deepspeed.initialize makes it from these on first use.
for _variable, _default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", free_port())):
    os.environ.setdefault(_variable, _default)

AUTOEP_BROKEN = tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 23)
requires_autoep = pytest.mark.skipif(
    AUTOEP_BROKEN,
    reason="DeepSpeed 0.19.8's AutoEP fails in deepspeed.initialize with transformers "
    ">= 5.23 (_CanRecordRegistry.get() TypeError); CI runs these under 5.22.2")


def _full_params(engine):
    """Each parameter's full FP32 master copy where DeepSpeed keeps one, else the parameter itself."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        params[name] = (param if full is None else full).detach().clone()
    return params


def _train(make_model, config, stashed, steps=3, install_after=False, use_reentrant=True):
    """Train with the stash on the last ``stashed`` layers (none for 0); returns the losses and the parameters."""
    import deepspeed

    model = checkpointed(make_model(), use_reentrant=use_reentrant)
    handle = install_attention_stash(model, stashed) if stashed and not install_after else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if stashed and install_after:
        handle = install_attention_stash(engine.module, stashed)
    losses = []
    try:
        for step in range(steps):
            ids = batch_ids(seed=step).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            assert handle is None or handle.num_kept == stashed
            engine.backward(loss)
            engine.step()
            assert handle is None or (handle.num_kept, handle.recomputes_served) == (0, stashed * (step + 1))
            losses.append(loss.detach().float())
        return torch.stack(losses), _full_params(engine)
    finally:
        if handle is not None:
            handle.remove()


def _assert_same_training(got, expected):
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    assert got[1].keys() == expected[1].keys()
    for name, param in got[1].items():
        assert torch.equal(param, expected[1][name]), name


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages(stage, bf16):
    config = deepspeed_config(stage, bf16)
    expected = _train(mixtral_model, config, 0)
    _assert_same_training(_train(mixtral_model, config, NUM_LAYERS), expected)
    # The losses must move, or equal losses would prove nothing about the steps.
    assert not torch.equal(expected[0][0], expected[0][-1])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_zero3_with_non_reentrant_checkpointing(bf16):
    """transformers' default checkpointing, served with PyTorch's own attention node in the graph, under ZeRO-3
    (whose hooks gather each layer's parameters in the recompute too)."""
    config = deepspeed_config(3, bf16)
    expected = _train(qwen3_moe_model, config, 0, use_reentrant=False)
    _assert_same_training(_train(qwen3_moe_model, config, NUM_LAYERS, use_reentrant=False), expected)
    _assert_same_training(_train(qwen3_moe_model, config, NUM_LAYERS, install_after=True, use_reentrant=False),
                          expected)
    assert not torch.equal(expected[0][0], expected[0][-1])


def test_gradient_accumulation_with_micro_batches_in_flight():
    """Three micro-batches forward, then their backwards in reverse order, per optimizer step."""
    import deepspeed

    accumulation = 3

    def train(stashed):
        model = checkpointed(mixtral_model())
        handle = install_attention_stash(model, stashed) if stashed else None
        engine, *_ = deepspeed.initialize(model=model,
                                          model_parameters=model.parameters(),
                                          config=deepspeed_config(accumulation=accumulation))
        losses = []
        try:
            for step in range(2):
                in_flight = []
                for micro in range(accumulation):
                    ids = batch_ids(seed=10 * step + micro)
                    in_flight.append(engine(input_ids=ids, labels=ids).loss)
                assert handle is None or handle.num_kept == accumulation * stashed
                for loss in reversed(in_flight):
                    engine.backward(loss)
                    engine.step()
                assert engine.global_steps == step + 1
                assert handle is None or (handle.num_kept,
                                          handle.recomputes_served) == (0, (step + 1) * accumulation * stashed)
                losses += [loss.detach() for loss in in_flight]
            return torch.stack(losses), _full_params(engine)
        finally:
            if handle is not None:
                handle.remove()

    _assert_same_training(train(NUM_LAYERS), train(0))


def test_forward_that_raises_partway_keeps_nothing():
    model = checkpointed(mixtral_model())
    handle = install_attention_stash(model, NUM_LAYERS)

    def fail(module, args, output):
        raise RuntimeError("the last layer failed")

    failing = model.model.layers[-1].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="^the last layer failed$"):
            model(input_ids=batch_ids(), labels=batch_ids())
        gc.collect()
        assert handle.num_kept == 0
        failing.remove()
        # And the next step trains as usual.
        model(input_ids=batch_ids(), labels=batch_ids()).loss.backward()
        assert (handle.num_kept, handle.recomputes_served) == (0, NUM_LAYERS)
    finally:
        handle.remove()


@requires_autoep
@pytest.mark.parametrize("model_name", ["mixtral", "qwen3_moe"])
def test_autoep_before_or_after_initialize(model_name):
    make_model = {"mixtral": mixtral_model, "qwen3_moe": qwen3_moe_model}[model_name]
    config = deepspeed_config(expert_parallel={"enabled": True, "autoep_size": 1, "preset_model": model_name})
    expected = _train(make_model, config, 0)
    _assert_same_training(_train(make_model, config, NUM_LAYERS), expected)
    _assert_same_training(_train(make_model, config, NUM_LAYERS, install_after=True), expected)


@requires_autoep
def test_autoep_two_ranks(tmp_path):
    """autoep_size=2 over gloo: the expert all-to-all runs inside each recompute."""
    run_on_two_ranks(os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_stash_two_ranks.py"),
                     str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert sorted(report["rank"] for report in reports) == [0, 1]
    for report in reports:
        assert report["stashed_losses"] == report["plain_losses"], report
        assert report["kept_after_steps"] == 0 and report["kept_after_forward"] == NUM_LAYERS
        assert report["recomputes_served"] == 3 * NUM_LAYERS
    # Both ranks see one loss: data parallel over the same batches.
    assert reports[0]["plain_losses"] == reports[1]["plain_losses"]


@pytest.mark.parametrize("reentrant", [True, None], ids=["reentrant", "trainer_default"])
def test_hugging_face_trainer_enables_checkpointing_after_install(tmp_path, reentrant):
    """The Trainer enables checkpointing itself, after the install: reentrant, or with its default kwargs
    (non-reentrant in transformers 5)."""
    from transformers import Trainer, TrainingArguments

    class Batches(torch.utils.data.Dataset):

        def __len__(self):
            return 4

        def __getitem__(self, index):
            ids = batch_ids(seed=index, batch=1)[0]
            return {"input_ids": ids, "labels": ids}

    steps = 2
    config = deepspeed_config()
    config["optimizer"]["params"]["lr"] = "auto"

    def train(stashed):
        model = mixtral_model().train()
        assert not model.is_gradient_checkpointing
        handle = install_attention_stash(model, stashed) if stashed else None
        # transformers 5.23 renamed the Trainer's gradient_checkpointing arguments, keeping deprecated aliases.
        prefix = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"
        checkpointing = {f"{prefix}_checkpointing": True}
        if reentrant:
            checkpointing[f"{prefix}_checkpointing_kwargs"] = {"use_reentrant": True}
        arguments = TrainingArguments(output_dir=str(tmp_path / f"{stashed}-{reentrant}"),
                                      per_device_train_batch_size=2,
                                      max_steps=steps,
                                      **checkpointing,
                                      deepspeed=config,
                                      use_cpu=True,
                                      report_to=[],
                                      save_strategy="no",
                                      logging_steps=1,
                                      disable_tqdm=True)
        trainer = Trainer(model=model, args=arguments, train_dataset=Batches())
        try:
            with CountOps() as counted:
                trainer.train()
            # The checkpointing the Trainer enabled: reentrant as asked, or transformers' non-reentrant default.
            checkpoint_function = model.model.layers[0].__dict__["_gradient_checkpointing_func"]
            assert checkpoint_function.keywords["use_reentrant"] is bool(reentrant)
            assert handle is None or (handle.num_kept, handle.recomputes_served) == (0, NUM_LAYERS * steps)
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            return counted.calls[CPU_FORWARD], losses
        finally:
            if handle is not None:
                handle.remove()

    plain_forwards, plain_losses = train(0)
    stashed_forwards, stashed_losses = train(NUM_LAYERS)
    # Without the stash each layer runs the attention forward twice per step, with it once: every layer is served.
    assert plain_forwards == 2 * NUM_LAYERS * steps
    assert stashed_forwards == NUM_LAYERS * steps
    assert stashed_losses == plain_losses and len(plain_losses) == steps


def deepspeed_checkpointed(model):
    """The model checkpointed by DeepSpeed's activation checkpointing, as Hugging Face's checkpoint function."""
    import deepspeed

    checkpointed(model)
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = deepspeed.checkpointing.checkpoint
    return model


@pytest.fixture
def deepspeed_checkpointing():
    """DeepSpeed's activation checkpointing, configured without a model-parallel unit; its defaults again after."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing

    deepspeed.init_distributed(dist_backend="gloo")

    def configure(**settings):
        checkpointing.configure(None, **settings)

    yield configure
    checkpointing.configure(None, partition_activations=False)
    checkpointing.reset()


@pytest.mark.parametrize("partition_activations", [False, True], ids=["plain", "partitioned"])
def test_deepspeed_checkpoint_function(install, deepspeed_checkpointing, partition_activations):
    """deepspeed.checkpointing.checkpoint as each layer's checkpoint function: served bitwise."""
    deepspeed_checkpointing(partition_activations=partition_activations)
    assert_stashed_step_is_stock(install, deepspeed_checkpointed(mixtral_model()))


def test_deepspeed_checkpoint_function_under_autocast(install, deepspeed_checkpointing):
    """DeepSpeed's checkpoint does not restore autocast in its recompute: with the backward outside autocast, the
    recompute's attention would run in another dtype than its forward's. The stash raises its own error naming it,
    and releases what it kept; under torch's checkpoint, which restores autocast, the same step is served."""
    deepspeed_checkpointing()
    ids = batch_ids()

    def autocast_step(model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), param_grads(model)

    model = deepspeed_checkpointed(mixtral_model())
    handle = install(model, NUM_LAYERS)
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of model.layers.2 to run attention in its forward's dtype, got "
                       "torch.bfloat16 in the forward and torch.float32 in the recompute \\(attention call 1\\): "
                       "autocast differs between the passes"):
        autocast_step(model)
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 0, NUM_LAYERS)

    model = checkpointed(mixtral_model())
    expected_loss, expected = autocast_step(model)
    handle = install(model, NUM_LAYERS)
    loss, grads = autocast_step(model)
    assert handle.recomputes_served == NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_a_flash_recompute_without_autocast_is_refused(install, deepspeed_checkpointing, monkeypatch):
    """The same under flash_attention_2: Hugging Face casts the forward's float32 queries to autocast's bfloat16 for
    flash-attn, but not the recompute's, outside autocast; the stash names both dtypes and releases what it kept,
    where flash-attn's path would otherwise reach its kernels in float32."""
    from attention_stash_flash import flash_attn_or_skip, use_flash_attention_2

    flash_attn_or_skip()
    use_flash_attention_2(monkeypatch)
    deepspeed_checkpointing()
    model = mixtral_model()
    model.config._attn_implementation = "flash_attention_2"
    model = deepspeed_checkpointed(model)
    handle = install(model, NUM_LAYERS)
    ids = batch_ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of model.layers.2 to run attention in its forward's dtype, got "
                       "torch.bfloat16 in the forward and torch.float32 in the recompute \\(attention call 1\\): "
                       "autocast differs between the passes"):
        loss.backward()
    # The refused layer's output goes at once; the two layers whose recompute never came, with the loss.
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (2, 0, 1)
    del loss
    gc.collect()
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 0, NUM_LAYERS)
