# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash beside PyTorch's selective activation checkpointing (SAC).

Under non-reentrant checkpointing a ``context_fn`` built by ``create_selective_checkpoint_contexts`` with a policy that
MUST_SAVEs the attention forward kernel caches that kernel's outputs in the first forward and hands them back in the
recompute, so the recompute skips the attention forward, as the stash's does. These tests train one tiny model for a
few SGD steps from the same weights four ways: under that policy without the stash, under the stash on every layer
without a policy, under plain non-reentrant checkpointing, and under both the stash and the policy. Loss and every
gradient are bitwise equal at every step, each stashed recompute is served, and the attention forward kernel runs once
per layer and step (in the first forward only) under the policy, the stash or both, against twice under plain
checkpointing. CI runs them on both checkpoint layouts of transformers.
"""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from attention_stash_helpers import (CPU_FORWARD, NUM_LAYERS, CountOps, assert_same_grads, batch_ids, checkpointed,
                                     llama_model, mixtral_model, param_grads)

STEPS = 3
# The SDPA kernel that Hugging Face's sdpa attention reaches on CPU (in float32 and with no dropout).
KERNEL = getattr(torch.ops.aten, CPU_FORWARD.partition(".")[0]).default


def _attention_kernel_saved():
    """SAC as a user writes it for attention: keep the attention forward kernel's outputs, recompute the rest."""

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is KERNEL else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _train(model, handle=None):
    """STEPS SGD steps of ``model``, each on its own batch: per step the loss, the gradients, and how many times the
    attention forward kernel ran in the forward and in the backward (whose CPU recompute runs on this thread)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    steps = []
    for step in range(STEPS):
        ids = batch_ids(seed=step + 1)
        optimizer.zero_grad(set_to_none=True)
        with CountOps() as forward:
            loss = model(input_ids=ids, labels=ids).loss
        with CountOps() as backward:
            loss.backward()
        if handle is not None:
            # Every stashed layer's recompute took its kept output, and nothing is held past the backward.
            assert (handle.num_kept, handle.kept_bytes) == (0, 0)
            assert handle.recomputes_served == (step + 1) * NUM_LAYERS
        steps.append((loss.detach(), param_grads(model), forward.calls[CPU_FORWARD], backward.calls[CPU_FORWARD]))
        optimizer.step()
    return steps


def _assert_same_training(steps, expected):
    assert len(steps) == len(expected) == STEPS
    for (loss, grads, _, _), (expected_loss, expected_grads, _, _) in zip(steps, expected):
        assert torch.equal(loss, expected_loss)
        assert_same_grads(grads, expected_grads)


def _kernel_calls(steps):
    """(forward, backward) attention kernel calls of each step."""
    return [(forward, backward) for _, _, forward, backward in steps]


MAKE_MODEL = {"llama": llama_model, "mixtral": mixtral_model}


@pytest.mark.parametrize("model_name", MAKE_MODEL)
def test_policy_and_stash_both_skip_the_recompute_kernel(install, model_name):
    make_model = MAKE_MODEL[model_name]
    plain = _train(checkpointed(make_model(), use_reentrant=False))
    policy = _train(checkpointed(make_model(), use_reentrant=False, context_fn=_attention_kernel_saved))
    model = checkpointed(make_model(), use_reentrant=False)
    handle = install(model, num_layers=NUM_LAYERS)
    stash = _train(model, handle)

    # Plain checkpointing runs the kernel twice per layer and step: in the forward and again in the recompute.
    assert _kernel_calls(plain) == [(NUM_LAYERS, NUM_LAYERS)] * STEPS
    # The policy and the stash run it once, in the forward: neither recompute runs it.
    assert _kernel_calls(policy) == [(NUM_LAYERS, 0)] * STEPS
    assert _kernel_calls(stash) == [(NUM_LAYERS, 0)] * STEPS
    assert handle.recomputes_served == NUM_LAYERS * STEPS
    # The same training, bitwise, at every step (the later steps start from the weights the earlier ones updated).
    _assert_same_training(stash, policy)
    _assert_same_training(policy, plain)


@pytest.mark.parametrize("model_name", MAKE_MODEL)
def test_stash_under_the_policy(install, model_name):
    """Both at once: the policy runs around the stash and finds no kernel call in the recompute to look up."""
    make_model = MAKE_MODEL[model_name]
    plain = _train(checkpointed(make_model(), use_reentrant=False))
    model = checkpointed(make_model(), use_reentrant=False, context_fn=_attention_kernel_saved)
    handle = install(model, num_layers=NUM_LAYERS)
    both = _train(model, handle)

    assert _kernel_calls(both) == [(NUM_LAYERS, 0)] * STEPS
    assert handle.recomputes_served == NUM_LAYERS * STEPS
    _assert_same_training(both, plain)


def _mm_saved():
    """A user's policy that saves the matmuls, whatever kernel runs the attention."""

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@pytest.mark.parametrize("setup", ["flash_attention_3", "activation_memory_budget_0"])
def test_an_eager_policy_is_served_without_the_compiled_checks(install, monkeypatch, setup):
    """A checkpoint's own policy in eager training, beside the stash: the checks of the compiled path (kernels dynamo
    cannot trace, AOTAutograd's activation_memory_budget at 0) do not apply, since nothing is compiled. flash-attn 3,
    whose kernel functions dynamo cannot trace, and sdpa under a budget of 0: bitwise as under the policy alone, each
    recompute served."""
    from attention_stash_flash3 import flash_kernels_or_skip, use_flash_attention_3

    def make_model():
        model = llama_model()
        if setup == "flash_attention_3":
            model.config._attn_implementation = "flash_attention_3"
        return checkpointed(model, use_reentrant=False, context_fn=_mm_saved)

    if setup == "flash_attention_3":
        flash_kernels_or_skip()
        use_flash_attention_3(monkeypatch)
    with torch._functorch.config.patch(activation_memory_budget=0.0 if setup.endswith("_0") else 1.0):
        policy = _train(make_model())
        model = make_model()
        handle = install(model, num_layers=NUM_LAYERS)
        both = _train(model, handle)
    assert handle.recomputes_served == NUM_LAYERS * STEPS and handle.compiled_layers == ()
    _assert_same_training(both, policy)


# ---------------------------------------------------------------------------------------------------------------------
# TRL's selective checkpointing (gradient_checkpointing_kwargs={"selective": True}), the one-flag alternative, and the
# stash on the same model: the stash serves every recompute and keeps the one copy of every stashed layer's attention
# output and log-sum-exp from the forward to the recompute. TRL's policy would cache the kernel's outputs too, a second
# reference to the same storages (never read: the served recompute runs no kernel), which would keep them on the device
# where the stash offloads its own; the stash's checkpoint makes the policy recompute the kernel it serves instead.
# ---------------------------------------------------------------------------------------------------------------------


def _trl_selective(model):
    """TRL's own selective checkpointing on ``model``, as its SFTTrainer turns it on, then checkpointing enabled."""
    import warnings

    from trl.models import enable_selective_activation_checkpointing

    enable_selective_activation_checkpointing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated name, which TRL wraps
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})
    return model.train()


def _of_an_attention_output(tensor):
    """An attention output or its log-sum-exp of the tiny models at batch 2, sequence 32 (4 heads of dimension 16)."""
    return tuple(tensor.shape) in ((2, 4, 32, 16), (2, 4, 32))


def attention_storages(before):
    """(tensors, distinct storages) of the attention outputs and log-sum-exps alive now and not in ``before``: views
    and detached aliases share a storage, a copy (a clone, a cast) has its own."""
    from attention_stash_helpers import tensors

    owned = {id(tensor) for tensor in before}
    alive = [tensor for tensor in tensors() if id(tensor) not in owned and _of_an_attention_output(tensor)]
    return len(alive), len({tensor.untyped_storage().data_ptr() for tensor in alive})


@pytest.mark.parametrize("order", ["stash_first", "selective_first"])
@pytest.mark.parametrize("model_name", MAKE_MODEL)
def test_trls_selective_and_the_stash_train_as_selective_alone(install, model_name, order):
    """TRL's selective checkpointing and the stash, installed in either order: every step bitwise that of TRL's alone,
    the attention forward once per layer and step, every recompute served; after the forward one copy of each layer's
    output and log-sum-exp is alive, the stash's, held once (TRL's policy caches none of them), after the backward
    none."""
    pytest.importorskip("trl", reason="TRL's selective checkpointing needs trl (requirements/requirements-dev.txt)")
    from attention_stash_helpers import live_checkpoint_calls, live_tensors, tensors

    make_model = MAKE_MODEL[model_name]
    selective = _train(_trl_selective(make_model()))
    model = make_model()
    if order == "stash_first":
        handle = install(model, num_layers=NUM_LAYERS)
        _trl_selective(model)
    else:
        handle = install(_trl_selective(model), num_layers=NUM_LAYERS)
    assert model.model.layers[0].__dict__["_gradient_checkpointing_func"].keywords["context_fn"] is not None
    both = _train(model, handle)
    assert _kernel_calls(selective) == _kernel_calls(both) == [(NUM_LAYERS, 0)] * STEPS
    _assert_same_training(both, selective)

    before = tensors()
    ids = batch_ids(seed=STEPS + 1)
    loss = model(input_ids=ids, labels=ids).loss
    # Per layer: the stash's output and log-sum-exp, each in a storage of its own.
    assert attention_storages(before) == (2 * NUM_LAYERS, 2 * NUM_LAYERS)
    assert handle.num_kept == NUM_LAYERS
    loss.backward()
    del loss
    assert live_tensors(before, counted=_of_an_attention_output) == [] and live_checkpoint_calls() == []
    assert handle.recomputes_served == (STEPS + 1) * NUM_LAYERS


@pytest.mark.parametrize("order", ["stash_first", "selective_first"])
def test_sft_trainer_with_selective_and_the_stash(install, tmp_path, order):
    """TRL's SFTTrainer with gradient_checkpointing_kwargs={"selective": True} on CPU, the stash installed before the
    trainer is made or after (both before train(), which turns checkpointing on): the parameters after two steps are
    bitwise those of the same run without the stash, every recompute served, nothing kept after."""
    pytest.importorskip("trl", reason="TRL's SFTTrainer needs trl (requirements/requirements-dev.txt)")
    import datasets
    from accelerate.state import AcceleratorState
    from trl import SFTConfig, SFTTrainer

    from attention_stash_helpers import live_checkpoint_calls
    from test_attention_stash_readme import VOCAB_SIZE, token_rows, word_level_tokenizer

    rows = datasets.Dataset.from_dict({"input_ids": [ids.tolist() for ids in token_rows()]})

    def train(stashed):
        model, handle = llama_model(), None
        if stashed and order == "stash_first":
            handle = install(model, NUM_LAYERS)
        arguments = SFTConfig(output_dir=str(tmp_path / str(stashed)),
                              gradient_checkpointing=True,
                              gradient_checkpointing_kwargs={"selective": True},
                              per_device_train_batch_size=2,
                              max_steps=2,
                              bf16=False,
                              use_cpu=True,
                              report_to=[],
                              save_strategy="no",
                              disable_tqdm=True)
        trainer = SFTTrainer(model=model,
                             args=arguments,
                             train_dataset=rows,
                             processing_class=word_level_tokenizer(VOCAB_SIZE))
        if stashed and order == "selective_first":
            handle = install(model, NUM_LAYERS)
        with CountOps() as counted:
            trainer.train()
        AcceleratorState._reset_state(reset_partial_state=True)
        # TRL's policy on every layer, non-reentrant.
        keywords = model.model.layers[0].__dict__["_gradient_checkpointing_func"].keywords
        assert keywords["use_reentrant"] is False and keywords["context_fn"] is not None
        # The attention forward in each layer's first pass only, with the stash or without.
        assert counted.calls[CPU_FORWARD] == 2 * NUM_LAYERS
        return {name: param.detach().clone() for name, param in model.named_parameters()}, handle

    alone, _ = train(False)
    both, handle = train(True)
    assert_same_grads(both, alone)
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (2 * NUM_LAYERS, 0, 0)
    assert live_checkpoint_calls() == []
