# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the stash keeps for digests outlives no stash: position_ids that the checkpoint does not hold (ALST's
gathered ones, here a fresh copy made in the layer) are compared by a float64 digest against random weights over the
keys, cached per device and extended to the longest sequence seen; removing the last stash releases them, so that
after ``handle.remove()``, ``del model`` and a collection no tensor of the step is alive."""

import pytest
import torch

from deepspeed.runtime.activation_checkpointing import attention_stash

from attention_stash_flash import flash_attn_or_skip, use_flash_attention_2
from attention_stash_helpers import NUM_LAYERS, batch_ids, checkpointed, live_tensors, llama_model, tensors

flash_attn_or_skip()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_nothing_of_a_digest_outlives_the_stash(install, monkeypatch, use_reentrant):
    use_flash_attention_2(monkeypatch)
    monkeypatch.setattr(attention_stash, "_DIGEST_WEIGHTS", {})
    model = checkpointed(llama_model(), use_reentrant=use_reentrant)
    model.config._attn_implementation = "flash_attention_2"

    def fresh_position_ids(module, args, kwargs):
        # A copy the checkpoint does not hold, as ALST's all-gathered position_ids are: compared by digest.
        return args, {**kwargs, "position_ids": kwargs["position_ids"].clone()}

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(fresh_position_ids, with_kwargs=True)
    before = tensors()
    handle = install(model, NUM_LAYERS)
    for sequence in (32, 48):  # a new, longer sequence extends the digest weights
        ids = batch_ids(batch=2, sequence=sequence)
        positions = torch.arange(sequence).unsqueeze(0).expand(2, -1)
        model(input_ids=ids, position_ids=positions).logits.float().pow(2).mean().backward()
    assert handle.recomputes_served == 2 * NUM_LAYERS and handle.num_kept == 0
    assert [tuple(weights.shape) for weights in attention_stash._DIGEST_WEIGHTS.values()] == [(48, )]
    handle.remove()
    del model, ids, positions
    assert live_tensors(before) == []
    assert attention_stash._DIGEST_WEIGHTS == {}
