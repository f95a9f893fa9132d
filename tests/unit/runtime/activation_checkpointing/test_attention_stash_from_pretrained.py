# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A model loaded as users load one: ``from_pretrained`` at transformers' defaults, then trained with the stash.

From transformers 5.25, ``from_pretrained`` turns the Hub-kernel mapping on unless ``USE_HUB_KERNELS`` is off
(``use_kernels=None`` becomes True) and kernelizes the model again when ``train()`` changes its mode. On CUDA in
training that mapping replaces RMSNorm (liger-kernels) and the rotary embedding (kernels-community/rotary), whose
outputs reach attention only as its inputs; on CPU it finds no kernel and keeps transformers' own. The checks that
need a GPU are in tests/benchmarks/gpu_check.sh.
"""

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM

from attention_stash_helpers import MODELS, NUM_LAYERS, assert_served_as_plain, batch_ids, checkpointed, llama_model

FAMILIES = {"llama": llama_model, "qwen3_moe": MODELS["qwen3_moe"]}
# transformers 5.25 made the Hub-kernel mapping from_pretrained's default (5.24 and older: off).
KERNELS_BY_DEFAULT = Version(transformers.__version__) >= Version("5.25")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's tiny model, saved once per module with save_pretrained."""
    paths = {}
    for family, build in FAMILIES.items():
        paths[family] = tmp_path_factory.mktemp(family)
        build().save_pretrained(paths[family])
    return paths


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_model_from_pretrained_at_the_defaults_is_served(install, monkeypatch, saved, family, use_reentrant):
    """Loaded with every from_pretrained argument at its default and USE_HUB_KERNELS unset: the Hub-kernel mapping is
    on where the release turns it on, and a training step with the stash on every layer is bitwise the plain
    recompute's, every layer served."""
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    model = AutoModelForCausalLM.from_pretrained(saved[family])
    assert model.use_kernels is KERNELS_BY_DEFAULT
    model = checkpointed(model, use_reentrant=use_reentrant)
    ids = batch_ids()
    assert_served_as_plain(model, NUM_LAYERS, install, input_ids=ids, labels=ids)
    assert model.training and model.config._attn_implementation == "sdpa"
    if KERNELS_BY_DEFAULT:
        from kernels import Mode

        # train() kernelized it again, for training.
        assert model.kernels_mode == Mode.TRAINING


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")  #ignore-cuda
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_a_model_from_pretrained_at_the_defaults_is_served_on_cuda(install, monkeypatch, saved, use_reentrant):
    """gpu_check.sh's from_pretrained step: a Qwen3-MoE loaded at from_pretrained's defaults, moved to the GPU in
    bfloat16 and put in training mode, which kernelizes it for CUDA where the release turns the Hub-kernel mapping on.
    With and without the stash on every layer: the loss bitwise, every layer served, and the gradients within the
    spread of dQ's nondeterministic accumulation (as test_cuda_two_layer_training_step)."""
    from attention_stash_helpers import param_grads

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    model = AutoModelForCausalLM.from_pretrained(saved["qwen3_moe"])
    assert model.use_kernels is KERNELS_BY_DEFAULT
    model = checkpointed(model.to("cuda", torch.bfloat16), use_reentrant=use_reentrant)
    ids = batch_ids(sequence=256).to("cuda")
    model.zero_grad(set_to_none=True)
    expected_loss = model(input_ids=ids, labels=ids).loss
    expected_loss.backward()
    expected = param_grads(model)
    handle = install(model, NUM_LAYERS)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert handle.recomputes_served == NUM_LAYERS and handle.num_kept == 0
    assert torch.equal(loss.detach(), expected_loss.detach())
    for name, grad in param_grads(model).items():
        assert (grad.float() - expected[name].float()).norm() <= 1e-2 * expected[name].float().norm(), name
