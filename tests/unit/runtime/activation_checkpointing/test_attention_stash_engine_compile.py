# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash under DeepSpeed's ``engine.compile()`` (issue 46) on CPU: ZeRO stages 0 and 2 (whose backward runs what
stage 1's runs) served through AOTAutograd and the min-cut partitioner, and through dynamo's "eager" backend, which
DeepCompile falls back to at stage 0; ZeRO-3's hooks break dynamo's graph in each layer, refused by name. DeepCompile
itself (stages 1 to 3) needs CUDA: DeepSpeed builds its native op with CUDA headers and fails on CPU before compiling
anything.
"""

import os

import pytest
import torch

from attention_stash_helpers import (NUM_LAYERS, Graphs, attention_forwards, batch_ids, checkpointed, deepspeed_config,
                                     free_port, llama_model, param_grads)

from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError

for _variable, _default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", free_port())):
    os.environ.setdefault(_variable, _default)


@pytest.fixture
def traceable_kernels():
    """As in test_attention_stash_compile: kernels >= 0.18 needs it for dynamo to trace any checkpoint. The ZeRO-3 test
    runs at dynamo's defaults: its refusal names ZeRO-3's hooks either way."""
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield


def _engine_steps(install, stage, stashed, backend, deepcompile=False, steps=2):
    """``steps`` training steps of an engine compiled by ``engine.compile(backend)``: the losses, the last step's
    gradients, the handle (None unstashed) and the engine."""
    import deepspeed

    config = deepspeed_config(stage, compile={"deepcompile": deepcompile})
    model = checkpointed(llama_model(), use_reentrant=False)
    handle = install(model, NUM_LAYERS) if stashed else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch._dynamo.reset()
    engine.compile(backend=backend)
    losses = []
    try:
        for _ in range(steps):
            ids = batch_ids(batch=2, sequence=32)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            grads = param_grads(engine.module)
            engine.step()
            losses.append(loss.detach())
    finally:
        torch._dynamo.reset()
    return torch.stack(losses), grads, handle, engine


@pytest.mark.usefixtures("traceable_kernels")
# ZeRO-1 and ZeRO-2 are one optimizer (DeepSpeedZeroOptimizer of stage_1_and_2.py), whose gradient hooks run in the
# backward at both stages (contiguous_gradients is on by default) and which partitions the gradients at stage 2 alone:
# stage 2 runs what stage 1 runs in the compiled backward, and more (stage 1 merged in issue 58).
@pytest.mark.parametrize("stage", [0, 2])
def test_engine_compile_serves_zero_stages(install, stage):
    """Compiled plain against compiled stashed through the engine: losses and gradients bitwise, the backward graphs
    run no attention forward where the plain ones run one per layer."""
    plain, stashed = Graphs(), Graphs()
    losses, grads, _, _ = _engine_steps(install, stage, False, plain)
    stashed_losses, stashed_grads, handle, _ = _engine_steps(install, stage, True, stashed)
    assert torch.equal(stashed_losses, losses) and not torch.equal(losses[0], losses[-1])
    assert stashed_grads.keys() == grads.keys() and all(torch.equal(stashed_grads[n], grads[n]) for n in grads)
    assert attention_forwards(plain.backward) == NUM_LAYERS and attention_forwards(stashed.backward) == 0
    assert handle.compiled_layers == handle.layers and handle.num_kept == 0


@pytest.mark.usefixtures("traceable_kernels")
def test_deepcompile_at_zero_stage_0_falls_back_to_dynamos_eager_backend_and_is_served(install):
    """DeepCompile serves ZeRO stages 1 to 3 only: at stage 0 engine.compile() runs torch.compile with the backend
    given, here dynamo's "eager" (no AOTAutograd), whose checkpoint operator runs the stashed policy eagerly."""
    losses, grads, _, _ = _engine_steps(install, 0, False, "eager", deepcompile=True)
    stashed_losses, stashed_grads, handle, engine = _engine_steps(install, 0, True, "eager", deepcompile=True)
    assert engine.is_compiled and not engine.is_deepcompile_active()
    assert torch.equal(stashed_losses, losses)
    assert stashed_grads.keys() == grads.keys() and all(torch.equal(stashed_grads[n], grads[n]) for n in grads)
    assert handle.compiled_layers == handle.layers and handle.num_kept == 0


def test_engine_compile_under_zero3_is_refused_naming_its_hooks(install):
    """ZeRO-3 gathers parameters in torch.compiler.disable'd module hooks: dynamo runs each checkpoint eagerly, which
    the stash refuses, naming ZeRO-3."""
    with pytest.raises(
            AttentionStashError,
            match=r"needs dynamo's tracing for the compiled checkpoint of model\.layers\.0, got a checkpoint "
            r"run eagerly after a graph break in the layer's forward: DeepSpeed ZeRO stage 3 gathers each "
            r"submodule's parameters in forward hooks that dynamo does not trace, so plain checkpoints run "
            r"eagerly too\. Compile with ZeRO stage 0, 1 or 2, or remove the stash"):
        _engine_steps(install, 3, True, Graphs(), steps=1)
