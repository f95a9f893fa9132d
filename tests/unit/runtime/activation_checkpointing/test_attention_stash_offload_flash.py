# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash's offload on flash-attn 2 and on its Hub build ("kernels-community/flash-attn2"), on CPU: the kept output
and log-sum-exp of flash_attn_func (a plain batch) and flash_attn_varlen_func (a packed one) follow transformers'
offload=True to host memory, as test_attention_stash_offload.py checks for sdpa, with its ``host`` fixture; the
varlen call's cu_seqlens, the batch's own, stay where they are."""

import pytest
import torch

from attention_stash_flash import flash_attn_or_skip, use_flash_attention_2
from attention_stash_flash3 import use_hub_kernel
from attention_stash_helpers import NUM_LAYERS, llama_model
from attention_stash_flash import DOCUMENTS, make_batch
from test_attention_stash_offload import assert_offloaded_step, host, offload_enabled, offloaded_step  # noqa: F401

flash_attn_or_skip()

MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
HUB = "kernels-community/flash-attn2"
# flash-attn 2's layouts of the tiny Llama's output (tokens, 4 heads of dimension 16) and log-sum-exp, per batch kind.
SHAPES = {
    "plain": ((2, 32, 4, 16), (2, 4, 32)),
    "packed_position_ids": ((sum(DOCUMENTS), 4, 16), (4, sum(DOCUMENTS))),
}


@pytest.fixture(params=["flash_attention_2", HUB])
def implementation(request, monkeypatch, tmp_path_factory):
    if request.param == HUB:
        use_hub_kernel(monkeypatch, tmp_path_factory, HUB)
    else:
        use_flash_attention_2(monkeypatch)
    return request.param


@MODES
@pytest.mark.parametrize("kind", SHAPES)
def test_a_flash_step_follows_the_offload(install, host, implementation, kind, use_reentrant):  # noqa: F811
    inputs, _ = make_batch(kind)
    output, lse = SHAPES[kind]

    def model():
        made = llama_model(torch.bfloat16)
        made.config._attn_implementation = implementation
        return offload_enabled(made, use_reentrant)

    expected_loss, expected, *_ = offloaded_step(model(), inputs)
    stashed = model()
    handle = install(stashed, NUM_LAYERS)
    output_bytes, lse_bytes = torch.Size(output).numel() * 2, torch.Size(lse).numel() * 4
    assert_offloaded_step(offloaded_step(stashed, inputs, None, handle, host, (output, lse)), handle, expected_loss,
                          expected, (output, output_bytes), (lse, lse_bytes))
