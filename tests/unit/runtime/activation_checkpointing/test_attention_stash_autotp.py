# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash under DeepSpeed's AutoTP (tensor parallelism) on two ranks over gloo (three for Qwen3 at TP 3), on CPU, and
attention calls with an empty dimension.

AutoTP shards q/k/v/o by the model's tp_plan at ``deepspeed.initialize`` (the config's
``tensor_parallel.autotp_size``, or ``deepspeed.tp_model_init``), so each rank's attention runs on its share of the
heads: DeepSpeed splits the key/value heads, the remainder to the first ranks, and each rank takes their query heads.
attention_stash_autotp_ranks.py trains one step per case on both ranks, each against the same setup without the
stash: loss, local gradients and parameters after the step bitwise, every recompute served without an attention
forward, nothing kept after the step, and the planner's bytes this rank's (rank 0's where the size is given before the
sharding). A rank that AutoTP gives no attention heads (more ranks than key/value heads) is served without a kernel:
PyTorch's CPU flash kernel dies of SIGFPE on a call with no heads.
"""

import os

import pytest
import torch
import torch.nn.functional as F
import transformers

from attention_stash_flash import flash_attn_or_skip, use_flash_attention_2
from attention_stash_flash3 import flash_kernels_or_skip
from attention_stash_helpers import (NUM_LAYERS, STOCK_FLASH, CountOps, assert_stock_process, bare_call, batch_ids,
                                     checkpointed, live_checkpoint_calls, llama_model, logged_messages,
                                     reports_of_two_ranks)
from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import (AttentionStashError,
                                                                        attention_stash_layer_bytes,
                                                                        attention_stash_layers_for_budget,
                                                                        install_attention_stash)
from test_attention_stash_meta import BACKENDS, use_backend_on_meta

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_stash_autotp_ranks.py")
MODES = ("reentrant", "non_reentrant")
ORDERS = ("before", "after")
# (mode, install order) of a setup run in each mode and each order once (the script's ALTERNATE), and of one run in
# every pair: plain sdpa, the uneven splits, a rank without heads.
ALTERNATED = [("reentrant", "after"), ("non_reentrant", "before")]
EVERY_PAIR = [(mode, order) for mode in MODES for order in ORDERS]
# Every tiny model's head dimension 16; float32 for sdpa, bfloat16 for flash; the log-sum-exp float32.
HEAD_DIM = 16
# transformers >= 5.23 breaks DeepSpeed 0.19.8's AutoEP in deepspeed.initialize (test_attention_stash_deepspeed.py).
AUTOEP_BROKEN = tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 23)
# flash-attn 2 and 3 (their Python layers over CPU stand-ins), the three Hub builds (mirrored local repositories), and
# flash-attn 4's double at its newest release read.
FLASH = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2", "kernels-community/flash-attn3",
         "kernels-community/vllm-flash-attn3", "flash_attention_4")


def layer_bytes(heads, sequence, batch=2, element=4):
    """One layer's kept bytes on a rank holding ``heads`` query heads: output plus float32 log-sum-exp."""
    return batch * heads * sequence * (HEAD_DIM * element + 4)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return reports_of_two_ranks(tmp_path_factory, "autotp", SCRIPT, "sdpa")


@pytest.fixture(scope="module")
def flash_reports(tmp_path_factory):
    flash_attn_or_skip()
    flash_kernels_or_skip()
    return reports_of_two_ranks(tmp_path_factory, "autotp_flash", SCRIPT, *FLASH)


def assert_served(case, expected_bytes, forwards=NUM_LAYERS):
    """A stashed step bitwise against AutoTP alone, every recompute served without an attention forward, nothing kept
    after it, and the planner's bytes per layer (found after the sharding) what the rank kept."""
    assert case["bitwise"] is True
    assert case["served"] == NUM_LAYERS and case["kept_after_step"] == case["live_after_step"] == 0
    assert case["kept_after_forward"] == case["peak_kept_bytes"] == NUM_LAYERS * expected_bytes
    assert case["planned"] == expected_bytes
    assert case["fitting"] == NUM_LAYERS
    assert case["reference_attention_forwards"] == [forwards, forwards]
    assert case["attention_forwards"] == [forwards, 0]


@pytest.mark.parametrize("setup, mode, order", [("sdpa_plain", mode, order) for mode, order in EVERY_PAIR] +
                         [(setup, mode, order)
                          for setup in ("sdpa_padded", "sdpa_packed", "tp_model_init", "zero1", "zero2")
                          for mode, order in ALTERNATED])
def test_autotp_is_served_bitwise_and_planned_per_rank(reports, setup, mode, order):
    """4 query and 2 key/value heads over 2 ranks: each rank keeps 2 query heads, as the planner counts them before
    the sharding (the size given) and after it (found); the install line says whose share and how it is known."""
    packed = setup == "sdpa_packed"
    expected = layer_bytes(2, 64, batch=1) if packed else layer_bytes(2, 32)
    for report in reports:
        case = report[f"{setup}_{mode}_{order}"]
        assert_served(case, expected)
        if order == "before":
            assert case["planned_given"] == expected
            assert ("on this rank of AutoTP over 2 ranks (given: rank 0's share, the largest): its share of the "
                    "heads") in case["install_line"]
        else:
            assert (f"{NUM_LAYERS * expected:,} bytes per micro-batch in flight on this rank of AutoTP over 2 ranks "
                    f"(found sharded by AutoTP): its share of the heads (micro-batch {1 if packed else 2}, sequence "
                    f"{64 if packed else 32})") in case["install_line"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
def test_key_value_heads_that_do_not_divide_follow_deepspeeds_split(reports, mode, order):
    """A dense Qwen3 with 6 query and 3 key/value heads over 2 ranks: DeepSpeed gives rank 0 two key/value heads (4 query
    heads) and rank 1 one (2): each rank keeps and is planned its own after the sharding; before it, the size given
    plans rank 0's, the largest."""
    for report in reports:
        case = report[f"qwen3_uneven_{mode}_{order}"]
        assert_served(case, layer_bytes(4 if report["rank"] == 0 else 2, 32))
        if order == "before":
            assert case["planned_given"] == layer_bytes(4, 32)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return reports_of_two_ranks(tmp_path_factory, "autotp_three", SCRIPT, "qwen3_tp3", ranks=3)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
def test_qwen3_at_tp_3_follows_deepspeeds_split(three_ranks, mode, order):
    """A dense Qwen3 with 8 query and 4 key/value heads over 3 ranks (AutoTP at TP 3): DeepSpeed gives rank 0 two
    key/value heads (4 query heads), ranks 1 and 2 one each (2): each rank is served bitwise and keeps and is planned
    its own share after the sharding; before it, the size given plans rank 0's."""
    for report in three_ranks:
        case = report[f"qwen3_tp3_{mode}_{order}"]
        assert_served(case, layer_bytes(4 if report["rank"] == 0 else 2, 32))
        if order == "before":
            assert case["planned_given"] == layer_bytes(4, 32)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_without_attention_heads_is_served_without_a_kernel(reports, mode, order):
    """One key/value head over 2 ranks: rank 0 holds all 4 query heads, rank 1 none. Rank 1's calls, empty, run no
    fused kernel in either pass (the stock step runs none either) and keep nothing; each recompute is still served,
    bitwise, and the install line says so."""
    for report in reports:
        case = report[f"no_heads_on_rank_1_{mode}_{order}"]
        if report["rank"] == 0:
            assert_served(case, layer_bytes(4, 32))
            continue
        assert_served(case, 0, forwards=0)
        if order == "after":
            assert ("0 bytes per micro-batch in flight on this rank of AutoTP over 2 ranks (found sharded by AutoTP): "
                    "its share of the heads (none: its calls are served without a kernel)") in case["install_line"]


def test_a_size_other_than_autotps_is_refused_naming_both(reports):
    """tensor_parallel_size 4 given before AutoTP shards over 2 ranks: the first training forward raises, keeping
    nothing; given after the sharding, the install and the planner raise."""
    message = ("attention stash needs tensor_parallel_size to be the size AutoTP sharded the model with, 2, got 4. "
               "Leave it out, or give the config's tensor_parallel.autotp_size.")
    for report in reports:
        assert report["mismatch_at_forward"] == message
        assert report["mismatch_kept"] == [0, 0]
        assert report["mismatch_at_install"] == message
        assert report["mismatch_in_planner"] == message


def test_autoep_with_autotp_is_refused_by_deepspeed_itself(reports):
    """AutoEP folded with AutoTP on a tiny Mixtral does not run in DeepSpeed 0.19.8 on CPU, with or without the stash:
    up to transformers 5.22 AutoTP rejects Mixtral's tp_plan (its expert styles), from 5.23 AutoEP's initialize fails
    (as in test_attention_stash_deepspeed.py). The line DeepSpeed raises, on each rank."""
    expected = ("TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given" if AUTOEP_BROKEN
                else "ValueError: HuggingFace tp_plan contains unsupported partition style(s): ['moe_tp_experts', "
                "'packed_colwise']. Applying only the supported entries could shard one half of a column/row pair, "
                "so the plan is rejected as a whole. Provide an explicit 'tensor_parallel.partition_config' for this "
                "model instead.")
    for report in reports:
        assert report["autoep_refused"] == expected


@pytest.mark.parametrize("mode, order", ALTERNATED)
@pytest.mark.parametrize("kind", ["plain", "packed"])
@pytest.mark.parametrize("implementation", FLASH)
def test_flash_implementations_under_autotp(flash_reports, implementation, kind, mode, order):
    """Each flash implementation in bfloat16 (Hugging Face's flash path looks for a torch.nn.Linear to cast a float32
    query, and AutoTP leaves none): a plain batch through flash_attn_func, a packed one through flash_attn_varlen_func,
    each rank its 2 query heads, served bitwise without a flash forward in the backward."""
    packed = kind == "packed"
    expected = layer_bytes(2, 64, batch=1, element=2) if packed else layer_bytes(2, 32, element=2)
    for report in flash_reports:
        case = report[f"{implementation}_{kind}_{mode}_{order}"]
        assert_served(case, expected)
        if order == "before":
            assert case["planned_given"] == expected


def test_hugging_faces_flash_path_refuses_a_rank_without_heads(monkeypatch):
    """A rank that AutoTP gives no attention heads under flash_attention_2 fails without the stash: Hugging Face's
    flash path refuses a query with a zero dimension before calling flash-attn, so AutoTP does not train that setup
    and the stash has nothing to serve there (under sdpa it does: above)."""
    flash_attn_or_skip()
    use_flash_attention_2(monkeypatch)
    module = llama_model(torch.bfloat16, num_key_value_heads=1).model.layers[0].self_attn
    empty = torch.empty(2, 0, 32, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Tensor query has shape  with a zero dimension"):
        STOCK_FLASH(module, empty, empty, empty, None)


@pytest.mark.parametrize("heads, key_heads, ranks, rank_0_heads", [(4, 2, 2, 2), (6, 3, 2, 4), (8, 4, 3, 4),
                                                                   (4, 1, 2, 4), (8, 2, 4, 4)])
def test_a_size_given_before_the_sharding_plans_rank_0s_share(install, heads, key_heads, ranks, rank_0_heads):
    """tensor_parallel_size on an unsharded model: rank 0's share, the largest, by DeepSpeed's split (its key/value
    heads split, the remainder to the first ranks; each with its query heads), as the planners and the install line
    count it, with a batch shape and without."""
    model = checkpointed(
        llama_model(hidden_size=heads * HEAD_DIM, num_attention_heads=heads, num_key_value_heads=key_heads))
    expected = layer_bytes(rank_0_heads, 32)
    assert attention_stash_layer_bytes(model, 2, 32, device="cpu", tensor_parallel_size=ranks) == expected
    assert attention_stash_layers_for_budget(model, 2 * expected, 2, 32, device="cpu", tensor_parallel_size=ranks) == 2
    with logged_messages() as messages:
        install(model, NUM_LAYERS, micro_batch_size=2, sequence_length=32, tensor_parallel_size=ranks).remove()
        install(model, memory_budget=expected, micro_batch_size=2, sequence_length=32, tensor_parallel_size=ranks)
    assert (f"keeping the attention output of {NUM_LAYERS} of {NUM_LAYERS} attention layers (model.layers.0 to "
            f"model.layers.2) for their recompute: {NUM_LAYERS * expected:,} bytes per micro-batch in flight on this "
            f"rank of AutoTP over {ranks} ranks (given: rank 0's share, the largest): its share of the heads "
            f"(micro-batch 2, sequence 32)") in messages[0]
    assert f"keeping the attention output of 1 of {NUM_LAYERS}" in messages[1]


def test_autotp_composes_with_ulysses_in_the_planner():
    """8 query and 4 key/value heads, AutoTP over 2 ranks and ALST over 2: a rank keeps 2 query heads over the whole
    sequence (4 of AutoTP's, halved by ALST)."""
    model = checkpointed(llama_model(num_attention_heads=8, num_key_value_heads=4, head_dim=HEAD_DIM))
    assert attention_stash_layer_bytes(model, 2, 32, device="cpu", sequence_parallel_size=2,
                                       tensor_parallel_size=2) == layer_bytes(2, 32)


@pytest.mark.parametrize("size, error, message", [(0, ValueError, "a positive tensor_parallel_size, got 0"),
                                                  (2.0, TypeError, "an integer tensor_parallel_size, got float"),
                                                  (True, TypeError, "an integer tensor_parallel_size, got bool")])
def test_a_tensor_parallel_size_that_is_not_a_positive_integer_is_refused(size, error, message):
    model = checkpointed(llama_model())
    with pytest.raises(error, match=message):
        install_attention_stash(model, 1, tensor_parallel_size=size)
    with pytest.raises(error, match=message):
        attention_stash_layer_bytes(model, 2, 32, device="cpu", tensor_parallel_size=size)
    assert_stock_process()


def test_a_size_given_for_a_model_that_is_never_sharded_is_refused_at_the_first_forward(install):
    """tensor_parallel_size 2 given, and no AutoTP ever shards the model: the first training forward raises, naming
    both sizes, before any attention call keeps anything; the next forward is served (asked once per install)."""
    model = checkpointed(llama_model())
    handle = install(model, NUM_LAYERS, tensor_parallel_size=2)
    ids = batch_ids()
    with pytest.raises(AttentionStashError,
                       match=r"tensor_parallel_size to be the size AutoTP sharded the model with, 1, got 2\."):
        model(input_ids=ids, labels=ids)
    assert (handle.num_kept, handle.kept_bytes) == (0, 0) and live_checkpoint_calls() == []
    model(input_ids=ids, labels=ids).loss.backward()
    assert handle.recomputes_served == NUM_LAYERS


# (query shape, key and value shape) of attention calls with an empty dimension: no heads (a rank AutoTP gives none),
# no batch, no tokens, no keys (a sum over no keys: zero).
EMPTY_CALLS = {
    "heads": ((2, 0, 16, 8), (2, 0, 16, 8)),
    "batch": ((0, 4, 16, 8), (0, 2, 16, 8)),
    "sequence": ((2, 4, 0, 8), (2, 2, 0, 8)),
    "keys": ((2, 4, 16, 8), (2, 2, 0, 8)),
}


def _sdpa_layer(query, key, value):
    return attention_stash._state.call.sdpa(query, key, value, enable_gqa=True)


def _empty_call_steps(device, shapes, use_reentrant):
    """An empty call through a stashed layer's checkpoint call under torch.utils.checkpoint in either mode (its first
    pass and its recompute), then the backward, counted: the output, the gradients of query, key and value, the aten
    ops run, and the stash's counters."""
    query_shape, key_shape = shapes
    inputs = [torch.randn(shape, device=device) for shape in (query_shape, key_shape, key_shape)]
    call, counters = bare_call(_sdpa_layer)
    leaves = [tensor.detach().requires_grad_() for tensor in inputs]
    with CountOps() as ops:
        out = torch.utils.checkpoint.checkpoint(call, *leaves, use_reentrant=use_reentrant)
        out.sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves], ops.calls, counters, inputs


def _fused(calls):
    return sorted(name for name in calls if name.startswith("_scaled_dot_product"))


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("dimension", list(EMPTY_CALLS))
def test_an_empty_call_reaches_no_fused_kernel_on_cpu(dimension, use_reentrant):
    """On CPU, each empty call runs no fused SDPA kernel (the CPU flash kernel dies of SIGFPE on one without heads or
    length), and its output and gradients are F.scaled_dot_product_attention's, bitwise; the recompute is served and
    keeps nothing."""
    out, grads, calls, counters, inputs = _empty_call_steps("cpu", EMPTY_CALLS[dimension], use_reentrant)
    assert _fused(calls) == []
    leaves = [tensor.detach().requires_grad_() for tensor in inputs]
    expected = F.scaled_dot_product_attention(*leaves, enable_gqa=True)
    expected.sum().backward()
    assert out.shape == expected.shape and torch.equal(out, expected.detach())
    for grad, leaf in zip(grads, leaves):
        assert torch.equal(grad, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
    assert (counters.recomputes_served, counters.kept, counters.kept_bytes) == (1, 0, 0)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dimension", list(EMPTY_CALLS))
def test_an_empty_call_reaches_no_fused_kernel_on_cuda_backends(monkeypatch, backend, dimension, use_reentrant):
    """On the meta device as each CUDA backend (cuDNN, flash, memory-efficient): no fused kernel, forward or backward,
    for an empty call; outputs and gradients of the inputs' shapes; served."""
    use_backend_on_meta(monkeypatch, backend)
    out, grads, calls, counters, inputs = _empty_call_steps("meta", EMPTY_CALLS[dimension], use_reentrant)
    assert _fused(calls) == []
    assert out.shape == (*inputs[0].shape[:-1], inputs[2].shape[-1])
    assert [grad.shape for grad in grads] == [tensor.shape for tensor in inputs]
    assert counters.recomputes_served == 1 and counters.kept == 0
