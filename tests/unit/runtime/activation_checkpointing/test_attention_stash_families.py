# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash across transformers' decoder families, on tiny random configs.

Hybrids (softmax-attention layers between linear-attention or state-space layers), attention modules not shaped like
Llama's (GPT-NeoX, BERT as a decoder, Falcon from transformers 5.25), layers with two attention calls (DiffLlama), and
families whose attention bypasses Hugging Face's attention interface (Data2Vec's vision model, Doge; Falcon up to
5.24), which are refused at install. Every served case is bitwise against the plain recompute, with every recompute
counted, and the planner's bytes equal what the stash kept. A refused install leaves the process stock. CI runs them on
both checkpoint layouts of transformers; a family that the installed transformers lacks is skipped.
"""

import pytest
import torch
import transformers
from packaging.version import Version

from deepspeed.runtime.activation_checkpointing.attention_stash import (AttentionStashError,
                                                                        attention_stash_layer_bytes,
                                                                        install_attention_stash)

from attention_stash_helpers import (CPU_FORWARD, CountOps, assert_same_grads, assert_stock_process, batch_ids,
                                     checkpointed, counted_step, every_n_layers, logged_messages, param_grads)

_SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64)
_MOE = dict(num_experts=4, num_experts_per_tok=2)
_QWEN3_NEXT = dict(num_key_value_heads=2,
                   head_dim=16,
                   intermediate_size=128,
                   moe_intermediate_size=32,
                   shared_expert_intermediate_size=32,
                   linear_num_value_heads=4,
                   linear_key_head_dim=16,
                   linear_value_head_dim=16,
                   linear_num_key_heads=2,
                   layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                   **_MOE)
_JAMBA = dict(num_key_value_heads=2,
              intermediate_size=128,
              mamba_d_state=8,
              mamba_dt_rank=32,
              attn_layer_period=2,
              attn_layer_offset=1,
              expert_layer_period=2,
              expert_layer_offset=1,
              use_mamba_kernels=False,
              **_MOE)
_BERT = dict(intermediate_size=128, is_decoder=True, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
_DIFFLLAMA = dict(num_key_value_heads=2, head_dim=16, intermediate_size=128)
# Multi-head latent attention with a sparse-attention indexer, whose top-k mask the layer builds in each pass.
_DEEPSEEK_V32 = dict(num_key_value_heads=4,
                     head_dim=8,
                     intermediate_size=128,
                     moe_intermediate_size=32,
                     n_routed_experts=4,
                     num_experts_per_tok=2,
                     n_shared_experts=1,
                     n_group=1,
                     topk_group=1,
                     kv_lora_rank=16,
                     q_lora_rank=32,
                     qk_rope_head_dim=8,
                     qk_nope_head_dim=8,
                     v_head_dim=16,
                     index_topk=4,
                     index_head_dim=16,
                     index_n_heads=2,
                     first_k_dense_replace=1)
# Falcon's attention calls F.scaled_dot_product_attention itself up to transformers 5.24, and Hugging Face's attention
# interface from 5.25: refused on CI's 5.22.2 leg, served on its main one.
FALCON_ON_INTERFACE = Version(transformers.__version__) >= Version("5.25")
_FALCON = ("FalconForCausalLM", "FalconConfig", dict(num_kv_heads=2, ffn_hidden_size=128),
           [f"transformer.h.{index}" for index in range(4)])
# family: (model class, config class, config beyond _SMALL, the attention layers among its 4 decoder layers)
FAMILIES = {
    # Three linear-attention (gated delta net) layers per full-attention layer, as Qwen3.5 and Qwen3-Next ship them.
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", _QWEN3_NEXT, ["model.layers.2"]),
    # Mamba layers between attention layers.
    "jamba": ("JambaForCausalLM", "JambaConfig", _JAMBA, ["model.layers.1", "model.layers.3"]),
    # head_size, not head_dim.
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(intermediate_size=128),
                 [f"gpt_neox.layers.{index}" for index in range(4)]),
    # attention_head_size, and a decoder made of an encoder's layers.
    "bert": ("BertLMHeadModel", "BertConfig", _BERT, [f"bert.encoder.layer.{index}" for index in range(4)]),
    "deepseek_v32":
    ("DeepseekV32ForCausalLM", "DeepseekV32Config", _DEEPSEEK_V32, [f"model.layers.{index}" for index in range(4)]),
    # Two attention calls per layer.
    "diffllama":
    ("DiffLlamaForCausalLM", "DiffLlamaConfig", _DIFFLLAMA, [f"model.layers.{index}" for index in range(4)]),
}
REFUSED = {
    # An image encoder's layers (GradientCheckpointingLayer), installed on and refused before any forward.
    "data2vec_vision":
    ("Data2VecVisionModel", "Data2VecVisionConfig", dict(intermediate_size=128, image_size=32, patch_size=8), None),
    "doge": ("DogeForCausalLM", "DogeConfig", dict(num_key_value_heads=2, intermediate_size=128, **_MOE), None),
}
if FALCON_ON_INTERFACE:
    FAMILIES["falcon"] = _FALCON
else:
    REFUSED["falcon"] = _FALCON[:3] + (None, )
DIRECT = "calls F.scaled_dot_product_attention itself, not through Hugging Face's attention interface"


def family_model(family):
    model_class, config_class, extra, _ = FAMILIES.get(family) or REFUSED[family]
    if not hasattr(transformers, model_class):
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**_SMALL, **extra, "attn_implementation": "sdpa"})
    return getattr(transformers, model_class)(config).float()


def _inputs(model):
    ids = batch_ids(sequence=16)
    return dict(input_ids=ids, labels=ids)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_served_bitwise(install, family, use_reentrant):
    model = checkpointed(family_model(family), use_reentrant=use_reentrant)
    attention_layers = FAMILIES[family][3]
    inputs = _inputs(model)
    expected_loss, expected, plain_calls = counted_step(model, inputs)
    handle = install(model, len(attention_layers))
    assert handle.layers == tuple(attention_layers)
    calls = 2 if family == "diffllama" else 1
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    assert handle.num_kept == calls * len(attention_layers)
    # The planner's bytes are what the stash keeps, calls and geometry included.
    assert handle.kept_bytes == len(attention_layers) * attention_stash_layer_bytes(model, 2, 16, device="cpu")
    with CountOps() as counted:
        loss.backward()
    # Every attention layer is stashed: no recompute runs the attention forward kernel.
    assert plain_calls[CPU_FORWARD] == calls * len(attention_layers) and counted.calls[CPU_FORWARD] == 0
    assert (handle.num_kept, handle.recomputes_served) == (0, calls * len(attention_layers))
    assert torch.equal(loss.detach(), expected_loss)
    assert_same_grads(param_grads(model), expected)


@pytest.mark.parametrize("family", ["qwen3_next", "jamba"])
def test_hybrid_counts_attention_layers(install, family):
    """num_layers counts the layers with softmax attention from the end; the range error and the log line say how
    many there are and what was left out."""
    model = checkpointed(family_model(family))
    attention_layers = FAMILIES[family][3]
    with pytest.raises(
            ValueError,
            match=f"needs num_layers from 1 to the model's {len(attention_layers)} attention layers \\(of 4 "
            f"decoder layers\\), got {len(attention_layers) + 1}"):
        install_attention_stash(model, len(attention_layers) + 1)
    assert_stock_process()
    with logged_messages() as messages:
        handle = install(model, 1)
    assert handle.layers == (attention_layers[-1], )
    (message, ) = messages
    assert f"keeping the attention output of 1 of {len(attention_layers)} attention layers" in message
    assert message.endswith(f"Left out: {4 - len(attention_layers)} decoder layers with no softmax attention (linear "
                            f"attention, a state-space or convolution mixer).")
    # The budget counts attention layers too.
    handle.remove()
    per_layer = attention_stash_layer_bytes(model, 2, 16, device="cpu")
    handle = install(model, memory_budget=10 * per_layer, micro_batch_size=2, sequence_length=16)
    assert handle.layers == tuple(attention_layers)
    inputs = _inputs(model)
    handle.remove()
    expected_loss, expected, _ = counted_step(model, inputs)
    handle = install(model, len(attention_layers))
    loss, grads, calls = counted_step(model, inputs)
    assert handle.recomputes_served == len(attention_layers) and calls[CPU_FORWARD] == 0
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


@pytest.mark.parametrize("family, why", [
    ("data2vec_vision", f"Data2VecVisionSdpaSelfAttention {DIRECT}"),
    ("doge", "DogeAttention calls attention through an attention interface of its own "
     "\\(transformers.models.doge.modeling_doge.ALL_ATTENTION_FUNCTIONS\\), not Hugging Face's"),
] + ([] if FALCON_ON_INTERFACE else [("falcon", f"FalconAttention {DIRECT}")]))
def test_attention_that_bypasses_the_interface_is_refused_at_install(family, why):
    model = checkpointed(family_model(family))
    with pytest.raises(
            AttentionStashError,
            match=f"needs decoder layers with softmax attention through Hugging Face's attention interface "
            f"\\(ALL_ATTENTION_FUNCTIONS\\), whose sdpa entry it serves, got none in {type(model).__name__}: "
            f"in .*\\.3, {why}. Train this model without the stash."):
        install_attention_stash(model, 1)
    assert_stock_process()


def test_a_mask_built_in_the_layer_that_differs_in_the_recompute_is_refused(install):
    """DeepSeek-V3.2 builds its sparse-attention mask from the indexer's top-k in each pass: a recompute whose top-k
    differs (a nondeterministic choice) gets another mask, and the stash names that cause."""
    model = checkpointed(family_model("deepseek_v32"))
    indexer = model.model.layers[3].self_attn.indexer
    forward, runs = indexer.forward, []

    def drifting(*args, **kwargs):
        indices = forward(*args, **kwargs)
        runs.append(None)
        # The recompute picks the next key over from the forward's choice.
        return indices if len(runs) == 1 else (indices + 1) % indices.shape[1]

    indexer.forward = drifting
    handle = install(model, 1)
    loss = model(**_inputs(model)).loss
    with pytest.raises(AttentionStashError,
                       match="needs the recompute of model.layers.3 to build the attention mask its forward built "
                       "inside the layer, got one with other values"):
        loss.backward()
    del loss
    assert (handle.num_kept, handle.recomputes_served) == (0, 0)


def test_hybrid_with_every_n_layers(install):
    """every_n_layers on a hybrid: num_layers counts its checkpointed attention layers; where checkpointing leaves
    every attention layer out, the install and the planner refuse, naming the layers it is on."""
    model = every_n_layers(family_model("jamba"), 3)  # layers 0 and 3: attention layer 3 is checkpointed
    inputs = _inputs(model)
    expected_loss, expected, _ = counted_step(model, inputs)
    with logged_messages() as messages:
        handle = install(model, 1)
    assert handle.layers == ("model.layers.3", )
    assert ("Left out: 2 decoder layers with no softmax attention (linear attention, a state-space or convolution "
            "mixer); 1 decoder layer with no activation checkpointing (every_n_layers leaves it out)") in messages[0]
    loss, grads, calls = counted_step(model, inputs)
    assert calls[CPU_FORWARD] == 0 and handle.recomputes_served == 1
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    handle.remove()

    model = every_n_layers(family_model("qwen3_next"), 3)  # layers 0 and 3, both linear attention
    message = ("needs activation checkpointing on attention layers, whose recompute it serves, got it on "
               "model.layers.0, model.layers.3 only, none of which has softmax attention")
    with pytest.raises(AttentionStashError, match=message):
        install_attention_stash(model, 1)
    with pytest.raises(AttentionStashError, match=message):
        attention_stash_layer_bytes(model, 2, 16, device="cpu")
    assert_stock_process()
