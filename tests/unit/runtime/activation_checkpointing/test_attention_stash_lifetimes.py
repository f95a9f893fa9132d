# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Nothing of the stash outlives its step, and a non-reentrant step runs no attention forward beyond the first pass.

Under non-reentrant checkpointing the first pass applies the stash's own node, which runs the kernel, and the
recompute's node, which returns the kept output, saves the same tensors in the same order by construction. Live
tensors are found as a user would look for a leak: every tensor object the garbage collector knows of, after a
collection, whose shape has the batch's sequence length (a length no parameter has).
"""

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from deepspeed.runtime.activation_checkpointing import attention_stash

from attention_stash_helpers import (CPU_BACKWARD, CPU_FORWARD, NUM_LAYERS, CountOps, assert_same_grads,
                                     assert_served_as_plain, batch_ids, checkpointed, counted_step, graph_nodes,
                                     live_checkpoint_calls, live_tensors, llama_model, param_grads, train_step)

# No dimension of the tiny models' parameters has this size.
SEQUENCE = 97


def of_the_batch(tensor):
    """What the live-tensor checks count: a tensor of three or more dimensions with one of SEQUENCE (a test's own
    [batch, sequence] ids and padding mask are left out)."""
    return tensor.dim() >= 3 and SEQUENCE in tensor.shape


def _inputs(masked):
    ids = batch_ids(batch=3, sequence=SEQUENCE)
    inputs = dict(input_ids=ids, labels=ids)
    if masked:
        mask = torch.ones_like(ids)
        mask[0, :11] = 0
        inputs.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    return inputs


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "padded"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_nothing_outlives_a_step(install, use_reentrant, masked):
    """After a step only what the handle counts is alive (nothing), after remove() and dropping the model nothing."""
    model = checkpointed(llama_model(num_hidden_layers=2), use_reentrant=use_reentrant)
    handle = install(model, 2)
    inputs = _inputs(masked)
    assert live_tensors(counted=of_the_batch) == []
    loss = model(**inputs).loss
    layer_bytes = attention_stash.attention_stash_layer_bytes(model, 3, SEQUENCE, device="cpu")
    assert handle.kept_bytes == 2 * layer_bytes
    loss.backward()
    del loss
    assert (handle.recomputes_served, handle.num_kept, handle.kept_bytes) == (2, 0, 0)
    assert live_tensors(counted=of_the_batch) == []
    # A second step leaves nothing either.
    model(**inputs).loss.backward()
    assert handle.recomputes_served == 4 and live_tensors(counted=of_the_batch) == []
    handle.remove()
    del model
    assert live_tensors(counted=of_the_batch) == [] and live_checkpoint_calls() == []


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "padded"])
def test_first_non_reentrant_step_runs_each_attention_forward_once(install, masked):
    """The first non-reentrant step of a process: one attention forward kernel per layer, in the first pass, none in
    the served recompute; the first pass's graph holds the stash's node of each layer, which runs the backward."""
    model = checkpointed(llama_model(), use_reentrant=False)
    inputs = _inputs(masked)
    expected_loss, expected = train_step(model, inputs["input_ids"]) if not masked else (None, None)
    handle = install(model, NUM_LAYERS)
    model.zero_grad(set_to_none=True)
    with CountOps() as forward:
        loss = model(**inputs).loss
    assert graph_nodes(loss.grad_fn).count("_AttentionNodeBackward") == NUM_LAYERS
    with CountOps() as backward:
        loss.backward()
    assert (forward.calls[CPU_FORWARD], backward.calls[CPU_FORWARD]) == (NUM_LAYERS, 0)
    assert backward.calls[CPU_BACKWARD] == NUM_LAYERS and handle.recomputes_served == NUM_LAYERS
    if not masked:
        assert torch.equal(loss.detach(), expected_loss)
        assert_same_grads(param_grads(model), expected)


def test_a_first_pass_whose_attention_needs_no_grad_records_no_node(install):
    """Attention inputs that require no grad (only the output head trained): the stash's node records nothing, and no
    backward reaches the layers; a later step with every parameter trained is served bitwise."""
    model = checkpointed(llama_model(), use_reentrant=False)
    ids = batch_ids()
    expected_loss, expected, _ = counted_step(model, dict(input_ids=ids, labels=ids))
    handle = install(model, NUM_LAYERS)
    model.requires_grad_(False).lm_head.requires_grad_(True)
    model.disable_input_require_grads()
    model(input_ids=ids, labels=ids).loss.backward()
    assert (handle.recomputes_served, handle.released_without_backward) == (0, NUM_LAYERS)
    model.requires_grad_(True).enable_input_require_grads()
    loss, grads, calls = counted_step(model, dict(input_ids=ids, labels=ids))
    assert calls[CPU_FORWARD] == 0 and handle.recomputes_served == NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_a_first_pass_with_grad_and_no_saved_tensor_hooks(install):
    """A checkpoint function that runs the layer with grad and never recomputes it (no saved-tensor hooks): the
    stash's node keeps its own saves and runs the backward, and what the first pass kept goes with the call."""
    model = checkpointed(llama_model(), use_reentrant=False)
    ids = batch_ids()
    expected_loss, expected, _ = counted_step(model, dict(input_ids=ids, labels=ids))
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = lambda function, *args, **kwargs: function(*args, **kwargs)
    handle = install(model, NUM_LAYERS)
    loss, grads, _ = counted_step(model, dict(input_ids=ids, labels=ids))
    assert (handle.recomputes_served, handle.released_without_backward, handle.kept_bytes) == (0, NUM_LAYERS, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


class _KeyIsValueAttention(LlamaAttention):
    """An attention module that passes one tensor as both the key and the value."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        output, weights = ALL_ATTENTION_FUNCTIONS["sdpa"](self,
                                                          query,
                                                          key,
                                                          key,
                                                          attention_mask,
                                                          dropout=0.0,
                                                          scaling=self.scaling,
                                                          **kwargs)
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "padded"])
def test_a_tensor_in_two_roles_is_served(install, masked):
    """A key that is the value, under non-reentrant checkpointing: the stash's node saves that tensor twice, as the
    key and as the value, in both passes. The call is served bitwise, and so is a model with distinct keys and
    values after it."""
    model = checkpointed(llama_model(num_key_value_heads=4), use_reentrant=False)
    for layer in model.model.layers:
        layer.self_attn.__class__ = _KeyIsValueAttention
    inputs = _inputs(masked)
    handle, _, _ = assert_served_as_plain(model, NUM_LAYERS, install, **inputs)
    handle.remove()
    assert_served_as_plain(checkpointed(llama_model(num_key_value_heads=4), use_reentrant=False), NUM_LAYERS, install,
                           **inputs)
