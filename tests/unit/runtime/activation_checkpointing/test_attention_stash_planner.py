# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The memory planner, the budget install, the handle's counters and the install log line."""

import gc

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import (AttentionStashError,
                                                                        attention_stash_layer_bytes,
                                                                        attention_stash_layers_for_budget,
                                                                        install_attention_stash)

from attention_stash_helpers import (NUM_LAYERS, assert_stock_process, batch_ids, checkpointed, llama_model,
                                     logged_messages, mixtral_model, qwen3_moe_model)


def _forward(model, batch, sequence, seed=1):
    ids = batch_ids(seed=seed, batch=batch, sequence=sequence)
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("make_model, dtype, batch, sequence, heads, head_dim", [
    (mixtral_model, torch.float32, 2, 32, 4, 16),
    (mixtral_model, torch.bfloat16, 2, 17, 4, 16),
    (qwen3_moe_model, torch.float32, 1, 64, 4, 16),
    (qwen3_moe_model, torch.bfloat16, 3, 40, 4, 16),
],
                         ids=["mixtral-fp32", "mixtral-bf16", "qwen3_moe-fp32", "qwen3_moe-bf16"])
def test_formula_matches_the_bytes_kept(install, make_model, dtype, batch, sequence, heads, head_dim):
    """Grouped key/value heads (2 of 4) do not count: the output has the query heads."""
    model = checkpointed(make_model(dtype))
    predicted = attention_stash_layer_bytes(model, batch, sequence, device="cpu")
    # The CPU kernel's layout: the output in the model's dtype, the log-sum-exp in FP32.
    assert predicted == batch * heads * sequence * (head_dim * dtype.itemsize + 4)
    handle = install(model, 2)
    loss = _forward(model, batch, sequence)
    assert handle.kept_bytes == 2 * predicted
    loss.backward()
    assert handle.kept_bytes == 0


def test_qwen3_30b_a3b_example():
    """The documented example: 136 MB per layer at micro-batch 4 and sequence 4096 in bfloat16, on each backend."""
    shape = dict(batch=4, heads=32, sequence=4096, head_dim=128, dtype=torch.bfloat16)
    for ops in (attention_stash._CUDNN, attention_stash._FLASH, attention_stash._CPU_FLASH,
                attention_stash._EFFICIENT):
        assert ops.kept_bytes(**shape) == 4 * 32 * 4096 * (128 * 2 + 4) == 136_314_880
    # Layouts that differ: flash pads the head dimension to 8, memory-efficient the log-sum-exp rows to 32.
    assert attention_stash._FLASH.kept_bytes(1, 2, 10, 12, torch.float16) == 1 * 2 * 10 * (16 * 2 + 4)
    assert attention_stash._EFFICIENT.kept_bytes(1, 2, 10, 12, torch.float16) == 1 * 2 * (10 * 12 * 2 + 32 * 4)


def test_budget_at_the_edges(install):
    model = checkpointed(mixtral_model())
    per_layer = attention_stash_layer_bytes(model, 2, 32, device="cpu")

    def fitting(budget, in_flight=1):
        return attention_stash_layers_for_budget(model, budget, 2, 32, in_flight, device="cpu")

    assert fitting(per_layer - 1) == 0
    assert fitting(per_layer) == 1
    assert fitting(2 * per_layer) == 2 and fitting(3 * per_layer - 1) == 2
    assert fitting(2 * per_layer, in_flight=2) == 1
    assert fitting(100 * per_layer) == NUM_LAYERS

    with pytest.raises(ValueError, match=f"needs a memory_budget of at least one layer's {per_layer:,} bytes"):
        install_attention_stash(model, memory_budget=per_layer - 1, micro_batch_size=2, sequence_length=32)
    handle = install(model, memory_budget=2 * per_layer + 1, micro_batch_size=2, sequence_length=32)
    assert handle.layers == ("model.layers.1", "model.layers.2")
    loss = _forward(model, 2, 32)
    assert handle.kept_bytes == 2 * per_layer
    loss.backward()


def test_counters_across_steps(install):
    model = checkpointed(mixtral_model())
    per_layer = attention_stash_layer_bytes(model, 2, 32, device="cpu")
    handle = install(model, NUM_LAYERS)

    loss = _forward(model, 2, 32)
    assert handle.num_kept == NUM_LAYERS
    assert handle.kept_bytes == handle.peak_kept_bytes == NUM_LAYERS * per_layer
    loss.backward()
    assert handle.num_kept == handle.kept_bytes == handle.released_without_backward == 0
    assert handle.recomputes_served == NUM_LAYERS

    # A dropped forward.
    loss = _forward(model, 2, 32)
    del loss
    gc.collect()
    assert (handle.num_kept, handle.kept_bytes, handle.released_without_backward) == (0, 0, NUM_LAYERS)

    # Gradient accumulation with three micro-batches in flight.
    losses = [_forward(model, 2, 32, seed=seed) for seed in range(3)]
    assert handle.kept_bytes == handle.peak_kept_bytes == 3 * NUM_LAYERS * per_layer
    for loss in losses:
        loss.backward()
    assert (handle.num_kept, handle.kept_bytes, handle.recomputes_served) == (0, 0, 4 * NUM_LAYERS)
    assert handle.peak_kept_bytes == 3 * NUM_LAYERS * per_layer


def test_install_log_line(install):
    with logged_messages() as messages:
        model = checkpointed(mixtral_model())
        install(model, 2)
        install(checkpointed(mixtral_model(), use_reentrant=False), 1, micro_batch_size=2, sequence_length=32)
        install(mixtral_model(), 1)
    assert len(messages) == 3
    # The mode each serves in, as far as the enabled checkpointing tells at install.
    replayed = (": the recompute replays the kept output through the kernel's backward, in either mode; under "
                "torch.compile, the compiled checkpoint saves the kernel's outputs instead (a model compiled before "
                'this install recompiles once); attn_implementation "sdpa".')
    assert messages[0].endswith(f"; reentrant checkpointing{replayed}")
    assert messages[1].endswith(f"; non-reentrant checkpointing{replayed}")
    assert messages[2].endswith(f"; checkpointing not enabled yet{replayed}")
    assert "keeping the attention output of 2 of 3 attention layers (model.layers.1 to model.layers.2)" in messages[0]
    # Two layers of 4 query heads of dimension 16: the output and an FP32 log-sum-exp per head and token.
    assert f"{2 * 4 * (16 * 4 + 4):,} bytes per token of each micro-batch in flight" in messages[0]
    per_layer = 2 * 4 * 32 * (16 * 4 + 4)
    assert f"{per_layer:,} bytes per micro-batch in flight (micro-batch 2, sequence 32)" in messages[1]
    assert all("Left out" not in message for message in messages)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_layers=1, memory_budget=10**9), TypeError, "exactly one of num_layers and memory_budget, got both"),
    (dict(), TypeError, "exactly one of num_layers and memory_budget, got neither"),
    (dict(memory_budget=10**9), TypeError, "needs micro_batch_size and sequence_length with memory_budget"),
    (dict(num_layers=1, micro_batch_size=2), TypeError, "needs both micro_batch_size and sequence_length, or neither"),
    (dict(memory_budget=-1, micro_batch_size=2,
          sequence_length=32), ValueError, "memory_budget in bytes of 0 or more"),
    (dict(memory_budget=True, micro_batch_size=2, sequence_length=32), ValueError, "memory_budget in bytes of 0 or"),
    (dict(memory_budget="1GB", micro_batch_size=2, sequence_length=32), ValueError, "memory_budget in bytes of 0"),
    (dict(memory_budget=10**9, micro_batch_size=0,
          sequence_length=32), ValueError, "a positive micro_batch_size, got 0"),
    (dict(memory_budget=10**9, micro_batch_size=2, sequence_length=2.5), TypeError, "an integer sequence_length, got"),
    (dict(memory_budget=10**9, micro_batch_size=2, sequence_length=32,
          micro_batches_in_flight=0), ValueError, "a positive micro_batches_in_flight, got 0"),
])
def test_rejects_bad_arguments(kwargs, error, message):
    model = checkpointed(mixtral_model())
    with pytest.raises(error, match=message):
        install_attention_stash(model, **kwargs)
    assert model.model.layers[2] not in attention_stash._STASHES


def test_planner_rejects_what_the_stash_cannot_serve():
    model = checkpointed(mixtral_model())
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(AttentionStashError,
                                                     match="a fused SDPA backend it can replay: .*got MATH"):
        attention_stash_layer_bytes(model, 2, 32, device="cpu")
    for layer in model.model.layers:
        del layer.self_attn.head_dim
        layer.self_attn.config = None
    with pytest.raises(AttentionStashError,
                       match="needs the head count and head dimension of MixtralAttention in model.layers.2 to plan "
                       "its memory"):
        attention_stash_layer_bytes(model, 2, 32, device="cpu")


def test_planner_rejects_a_model_without_decoder_layers():
    with pytest.raises(AttentionStashError,
                       match="needs a model with Hugging Face decoder layers .*got Linear without any"):
        attention_stash_layer_bytes(torch.nn.Linear(2, 2), 2, 32, device="cpu")


def test_install_without_geometry_logs_that_the_cost_is_unknown(install, monkeypatch):
    """The install never fails for the sake of its log line: without a batch shape it needs no plan."""
    model = checkpointed(mixtral_model())
    for layer in model.model.layers:
        monkeypatch.delattr(layer.self_attn, "head_dim")
        monkeypatch.setattr(layer.self_attn, "config", None)
    with logged_messages() as messages:
        handle = install(model, 1)
    assert handle.layers == ("model.layers.2", )
    (message, ) = messages
    assert ("for their recompute: a cost the planner cannot tell for these attention modules, in host memory where a "
            "layer's checkpoint offloads its inputs, else on the device;") in message


@pytest.mark.parametrize("shape", [{}, dict(micro_batch_size=2, sequence_length=32)], ids=["no_shape", "shape"])
def test_a_sequence_parallel_size_that_does_not_split_the_heads_is_refused(shape):
    """4 query heads over 3 ranks: refused at the install, with a batch shape or without, as ALST refuses it; the
    process stays stock."""
    model = checkpointed(llama_model())
    with pytest.raises(ValueError,
                       match="needs query heads divisible by the sequence-parallel size to plan them, got 4 heads and "
                       "3 ranks"):
        install_attention_stash(model, 1, sequence_parallel_size=3, **shape)
    assert_stock_process()


def test_the_planner_sizes_the_layers_the_stash_serves(install):
    """A model whose first attention layer runs another implementation (its attention module's own config says
    "eager") than its last two ("sdpa"): the install with a batch shape and the budget planner size the layers they
    take from the end, and never the eager one; a budget that would reach it takes the layers after it, and an install
    of every layer names it. With sequence_parallel_size the install line's figure is one rank's, half the heads."""
    import copy

    model = checkpointed(llama_model())
    attention = model.model.layers[0].self_attn
    attention.config = copy.copy(attention.config)
    attention.config._attn_implementation = "eager"
    per_layer = 2 * 32 * 4 * (16 * 4 + 4)
    assert attention_stash_layer_bytes(model, 2, 32, device="cpu") == per_layer
    assert attention_stash_layers_for_budget(model, 2 * per_layer, 2, 32, device="cpu") == 2
    with logged_messages() as messages:
        handle = install(model, 2, micro_batch_size=2, sequence_length=32, sequence_parallel_size=2)
    assert (f"keeping the attention output of 2 of 3 attention layers (model.layers.1 to model.layers.2) for their "
            f"recompute: {per_layer:,} bytes per micro-batch in flight on each rank of Ulysses sequence parallelism "
            f"over 2 ranks (given)") in messages[0]
    handle.remove()
    handle = install(model, memory_budget=3 * per_layer, micro_batch_size=2, sequence_length=32)
    assert handle.layers == ("model.layers.1", "model.layers.2")
    ids = batch_ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert (handle.recomputes_served, handle.peak_kept_bytes) == (2, 2 * per_layer)
    handle.remove()
    assert attention_stash_layers_for_budget(model, 3 * per_layer, 2, 32, device="cpu") == 2
    with pytest.raises(AttentionStashError, match=r"got 'eager' on LlamaForCausalLM \(model\.layers\.0\)"):
        install_attention_stash(model, 3)
    # Where the last attention layer is the one the stash would not serve, the budget planner names it.
    model.model.layers[2].self_attn.config = attention.config
    with pytest.raises(AttentionStashError, match=r"got 'eager' on LlamaForCausalLM \(model\.layers\.2\)"):
        attention_stash_layers_for_budget(model, 3 * per_layer, 2, 32, device="cpu")
    assert_stock_process()
