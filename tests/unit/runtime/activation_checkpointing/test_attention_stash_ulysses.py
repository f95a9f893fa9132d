# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash under DeepSpeed's Ulysses sequence parallelism (ALST) on two ranks over gloo, on CPU.

ALST puts a wrapper in Hugging Face's "sdpa" entry that all-to-alls query, key and value to the whole sequence and a
rank's share of the heads, calls the core attention function it captured, and all-to-alls the output back. The stash
serves that core call in either order: installed first, its entry is what ALST captures; installed after, it goes
behind ALST's wrapper, in place of the captured function. attention_stash_ulysses_ranks.py runs every case on both
ranks; each is bitwise against the same setup without the stash, every recompute counted, and the bytes kept are one
rank's as the planner counts them. CI runs it on both checkpoint layouts of transformers.
"""

import os
import re

import pytest

from attention_stash_helpers import NUM_LAYERS, reports_of_two_ranks

SEQUENCES = (16, 24)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return reports_of_two_ranks(
        tmp_path_factory, "ulysses",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_stash_ulysses_ranks.py"))


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("order", ["stash_first", "alst_first"])
def test_both_install_orders_are_served_bitwise(reports, order, mode):
    """Two steps of different sequence lengths on each rank's shard: bitwise equal to ALST without the stash, every
    layer served, nothing kept after the step, and ALST's own behaviour back after remove()."""
    for report in reports:
        case = report[f"{order}_{mode}"]
        assert case["bitwise"] == [True, True], report["rank"]
        assert case["served"] == 2 * NUM_LAYERS
        assert case["kept_after_backward"] == [0, 0]
        assert case["removed_bitwise"] == [True, True]


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("order", ["stash_first", "alst_first"])
def test_the_planner_counts_one_ranks_bytes(reports, order, mode):
    """Each rank keeps its share of the heads (2 of 4) over the whole sequence: what the planner counts with ALST's
    registration found or its size given; the budget that fits what was kept fits every layer; the install line says
    it is one rank's figure and how the ranks are known."""
    for report in reports:
        case = report[f"{order}_{mode}"]
        # 3 layers x micro-batch 2 x 2 heads x sequence x (16 x 4 bytes of output + 4 of log-sum-exp).
        expected = [NUM_LAYERS * 2 * 2 * sequence * (16 * 4 + 4) for sequence in SEQUENCES]
        assert case["kept_after_forward"] == expected
        assert case["planned_found"] == expected and case["planned_given"] == expected
        assert case["layers_for_budget"] == NUM_LAYERS
        # The install line is every rank's handle.summary, and logged by rank 0 alone.
        assert case["logged"] == ([f"[Rank 0] {case['install_line']}"] if report["rank"] == 0 else [])
        if order == "stash_first":
            # Without a batch shape, per token: 3 layers x 2 heads x (16 x 4 bytes of output + 4 of log-sum-exp).
            assert (f"{NUM_LAYERS * 2 * (16 * 4 + 4):,} bytes per token of each micro-batch in flight in "
                    f"torch.float32 on each rank of Ulysses sequence parallelism over 2 ranks (given): its share of "
                    f"the heads over the whole sequence") in case["install_line"]
        else:
            assert (f"{expected[0]:,} bytes per micro-batch in flight on each rank of Ulysses sequence parallelism "
                    f"over 2 ranks (found registered): its share of the heads over the whole sequence (micro-batch 2, "
                    f"sequence 16)") in case["install_line"]


@pytest.mark.parametrize("setup", [
    "tiled_mlp", "data_loader_adapter", "hidden_states_offload", "hidden_states_offload_reentrant",
    "host_offloaded_checkpoint"
])
def test_the_rest_of_an_alst_setup_composes(reports, setup):
    """DeepSpeed's TiledMLP in every layer, batches from UlyssesSPDataLoaderAdapter, CheckpointHiddenStatesOffload
    (in both checkpoint modes, its engine copying on CPU), and a checkpoint that keeps each layer's input on the host:
    bitwise against the same setup without the stash, every layer served, nothing kept after the step. Under
    CheckpointHiddenStatesOffload each rank's kept outputs and log-sum-exps, its share of the heads over the whole
    sequence, went to the host with the hidden states and came back, byte for byte; its log-sum-exps, below the
    engine's min_offload_bytes (1,024 bytes by default), stayed on the device."""
    expected = {"served": NUM_LAYERS, "kept": 0, "bitwise": True}
    if setup.startswith("hidden_states_offload"):
        # 3 layers x micro-batch 2 x 2 heads x sequence 16 x 16 x 4 bytes of output (log-sum-exps: 256 bytes each).
        expected.update(dict.fromkeys(("offloaded", "restored"), NUM_LAYERS * 2 * 2 * SEQUENCES[0] * 16 * 4))
    for report in reports:
        assert report[setup] == expected, report["rank"]


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_fewer_key_value_heads_than_ranks_are_planned_and_served(reports, mode):
    """One key/value head over two ranks (ALST replicates it): bitwise against ALST alone, every layer served, the
    bytes kept one rank's two query heads, as the planner counts them."""
    expected = NUM_LAYERS * 2 * 2 * SEQUENCES[0] * (16 * 4 + 4)
    for report in reports:
        assert report[f"fewer_key_heads_{mode}"] == {
            "served": NUM_LAYERS,
            "kept_after_forward": expected,
            "kept_after_backward": 0,
            "planned": expected,
            "bitwise": True
        }, report["rank"]


def test_a_core_function_the_stash_cannot_serve_is_refused(reports):
    """ALST around a core function that never calls F.scaled_dot_product_attention: the install raises naming it and
    where ALST holds it, and leaves ALST's wrapper in place and nothing of the stash installed."""
    for report in reports:
        assert report["refused_core"].startswith(
            "attention stash needs Hugging Face's sdpa attention function, which calls "
            "torch.nn.functional.scaled_dot_product_attention in its own code, as the core attention function of "
            "DeepSpeed's Ulysses sequence parallelism (UlyssesSPAttentionHF.attn, behind "
            "ALL_ATTENTION_FUNCTIONS[\"sdpa\"]), got <function refused_core.<locals>.other_kernel")
        assert report["refused_core_left_alone"]


def test_what_changes_after_an_alst_first_install_is_named(reports):
    """ALST's core function replaced after the install, or ALST's entry taken out of the interface: the stashed
    layer raises naming the function and where it is; a size given against the registration found is refused."""
    for report in reports:
        assert report["core_replaced"].startswith(
            "attention stash needs the attention of model.layers.0 to reach the sdpa entry it installed as the core "
            "attention function of DeepSpeed's Ulysses sequence parallelism (UlyssesSPAttentionHF.attn, behind "
            "ALL_ATTENTION_FUNCTIONS[\"sdpa\"]), got <function changed_after_the_install.<locals>.direct")
        assert re.match(
            r'attention stash needs the attention of model.layers.0 to reach the sdpa entry it installed in '
            r'ALL_ATTENTION_FUNCTIONS, got <function sdpa_attention_forward .*> in ALL_ATTENTION_FUNCTIONS\["sdpa"\], '
            r'put there after the install in place of <function UlyssesSPAttentionHF.register_with_transformers.'
            r'<locals>.uattn_wrapper', report["alst_unregistered"])
        for name in ("size_against_registration_install", "size_against_registration_planner"):
            assert report[name] == ("attention stash needs sequence_parallel_size to be that of the Ulysses "
                                    "sequence parallelism registered, 2, got 4. Leave it out to plan with the "
                                    "registration's.")
