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
