# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The attention stash beside the rest of a training stack: libraries that wrap or replace Hugging Face's sdpa entry,
DeepSpeed's own activation checkpointing and activation offload, hooks that run other models, and errors that name
their true cause."""

import copy
import functools
import gc
import weakref

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.integrations import sdpa_attention
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError, install_attention_stash

from attention_stash_helpers import (NUM_LAYERS, STOCK_SDPA, assert_same_grads, assert_stashed_step_is_stock,
                                     assert_stock_process, batch_ids, checkpointed, llama_model, mixtral_model,
                                     stashed_train_step, train_step)

MODES = pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])


@pytest.fixture
def sdpa_entry():
    """Put a function in Hugging Face's sdpa entry as a library does: "local" writes ALL_ATTENTION_FUNCTIONS["sdpa"],
    "global" calls AttentionInterface.register. The library-wide entry is transformers' own again afterwards."""

    def put(where, function):
        if where == "local":
            ALL_ATTENTION_FUNCTIONS["sdpa"] = function
        else:
            AttentionInterface.register("sdpa", function)

    yield put
    ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa", None)
    AttentionInterface._global_mapping["sdpa"] = STOCK_SDPA


def counting_wrapper(inner, calls):
    """A library's wrapper around the sdpa entry it found: counts its calls and runs what it wrapped."""

    def wrapper(*args, **kwargs):
        calls.append(args[0])
        return inner(*args, **kwargs)

    return wrapper


@MODES
@pytest.mark.parametrize("where", ["local", "global"])
def test_a_wrapper_put_around_the_entry_after_the_install_outlives_the_stash(install, sdpa_entry, where,
                                                                             use_reentrant):
    """A library wraps the sdpa entry while the stash holds it: the stash serves through the wrapper, and after
    remove() every model behaves as it would have if the stash had never been installed, the wrapper still in place.
    When the library takes its wrapper off, writing back what it wrapped, the stash installs again."""
    ids = batch_ids()
    model = checkpointed(mixtral_model(), use_reentrant)
    expected_loss, expected = train_step(model, ids)

    handle = install(model, 2)
    calls = []
    wrapped = ALL_ATTENTION_FUNCTIONS["sdpa"]
    sdpa_entry(where, counting_wrapper(wrapped, calls))
    loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    # Each layer's forward, and each layer's recompute, the stashed ones included, go through the wrapper.
    assert len(calls) == 2 * NUM_LAYERS

    handle.remove()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not wrapped and attention_stash._held is None
    calls.clear()
    other = checkpointed(mixtral_model(), use_reentrant)
    for trained in (model, other):
        loss, grads = train_step(trained, ids)
        assert torch.equal(loss, expected_loss)
        assert_same_grads(grads, expected)
    assert len(calls) == 2 * 2 * NUM_LAYERS

    # The library's undo writes back the entry it wrapped, the stash's: a new install serves, and its removal
    # leaves transformers' own entry.
    sdpa_entry(where, wrapped)
    again = install(model, NUM_LAYERS)
    loss, grads = stashed_train_step(model, again, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    again.remove()
    ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa", None)
    assert_stock_process()


def scaled_sdpa(calls):
    """A numerically different sdpa function, as a user registers one: transformers' own with the query scaled."""

    def sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append(module)
        return STOCK_SDPA(module, query * 1.25, key, value, attention_mask, **kwargs)

    return sdpa


@MODES
@pytest.mark.parametrize("where", ["local", "global"])
def test_a_later_registration_is_honoured_or_named(install, sdpa_entry, where, use_reentrant):
    """A function registered as "sdpa" after the install runs in every model that is not stashed, and in the stashed
    model's unstashed layers; the stashed layers raise naming it, never bypass it; after remove() it runs
    everywhere."""
    ids = batch_ids()
    calls = []
    scaled = scaled_sdpa(calls)
    sdpa_entry(where, scaled)
    reference = {}
    for name, make in (("stashed", mixtral_model), ("plain", llama_model)):
        reference[name] = train_step(checkpointed(make(), use_reentrant), ids)
    sdpa_entry(where, STOCK_SDPA)
    assert train_step(checkpointed(mixtral_model(), use_reentrant), ids)[0] != reference["stashed"][0]

    stashed = checkpointed(mixtral_model(), use_reentrant)
    plain = checkpointed(llama_model(), use_reentrant)
    handle = install(stashed, 1)
    sdpa_entry(where, scaled)
    calls.clear()
    loss, grads = train_step(plain, ids)
    assert torch.equal(loss, reference["plain"][0])
    assert_same_grads(grads, reference["plain"][1])
    assert len(calls) == 2 * NUM_LAYERS

    calls.clear()
    with pytest.raises(AttentionStashError,
                       match=r'needs the attention of model.layers.2 to reach the sdpa entry it installed in '
                       r'ALL_ATTENTION_FUNCTIONS, got <function scaled_sdpa.<locals>.sdpa at .*> in '
                       r'ALL_ATTENTION_FUNCTIONS\["sdpa"\], put there after the install'):
        stashed(input_ids=ids, labels=ids).loss.backward()
    # Every layer's attention ran the registered function, the stashed layer's too before its forward raised, and
    # nothing stayed kept.
    assert calls == [layer.self_attn for layer in stashed.model.layers]
    assert (handle.num_kept, handle.recomputes_served) == (0, 0)

    handle.remove()
    loss, grads = train_step(stashed, ids)
    assert torch.equal(loss, reference["stashed"][0])
    assert_same_grads(grads, reference["stashed"][1])


def test_a_wrapper_installed_before_the_stash_is_refused_at_install(sdpa_entry):
    """A wrapper that reaches F.scaled_dot_product_attention only through the function it wraps cannot be served:
    refused at install, naming it, though its code reads torch."""

    def wrapper(module, query, key, value, attention_mask, **kwargs):
        query = torch.clone(query)
        return STOCK_SDPA(module, query, key, value, attention_mask, **kwargs)

    sdpa_entry("global", wrapper)
    with pytest.raises(
            AttentionStashError,
            match=r"needs Hugging Face's sdpa attention function, which calls "
            r"torch.nn.functional.scaled_dot_product_attention in its own code, as "
            r'ALL_ATTENTION_FUNCTIONS\["sdpa"\], got <function .*wrapper at .*>, which does not \(a wrapper '
            r"around another attention function"):
        install_attention_stash(checkpointed(mixtral_model()), 1)
    assert attention_stash._held is None and AttentionInterface._global_mapping["sdpa"] is wrapper


def test_an_entry_that_skips_the_sdpa_call_is_named(install, sdpa_entry):
    """An sdpa function whose code calls F.scaled_dot_product_attention on one path and another function on the
    path taken: served up to the first forward, which names the function."""

    def sometimes(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx < 0:
            return torch.nn.functional.scaled_dot_product_attention(query, key, value), None
        return STOCK_SDPA(module, query, key, value, attention_mask, **kwargs)

    sdpa_entry("local", sometimes)
    model = checkpointed(mixtral_model())
    install(model, 1)
    with pytest.raises(
            AttentionStashError,
            match=r"needs the sdpa attention function to call torch.nn.functional.scaled_dot_product_attention "
            r"in each forward of model.layers.2, got a forward in which <function .*sometimes at .*>, the "
            r"function the stash serves, did not"):
        model(input_ids=batch_ids(), labels=batch_ids())


def test_an_attention_module_replaced_after_the_install_is_named(install):
    model = checkpointed(mixtral_model())
    install(model, 1)
    model.model.layers[2].self_attn = copy.deepcopy(model.model.layers[2].self_attn)
    with pytest.raises(
            AttentionStashError,
            match="needs the attention modules of model.layers.2 to call Hugging Face's attention interface "
            "with themselves as its module, got a forward without such a call \\(an attention module "
            "replaced after the install"):
        model(input_ids=batch_ids(), labels=batch_ids())


@MODES
def test_a_class_attribute_set_after_the_install_is_named(install, monkeypatch, use_reentrant):
    """A decoder class that gains a _gradient_checkpointing_func after the install hides the stash's hold on its
    layers' checkpoint function: named, in the forward (non-reentrant) or the recompute (reentrant)."""
    model = checkpointed(mixtral_model(), use_reentrant)
    handle = install(model, 1)
    monkeypatch.setattr(MixtralDecoderLayer, "_gradient_checkpointing_func", None, raising=False)
    with pytest.raises(
            AttentionStashError,
            match="needs model.layers.2 to read its checkpoint function through GradientCheckpointingLayer, "
            "which the stash holds, got a class attribute _gradient_checkpointing_func on "
            "MixtralDecoderLayer, set after the install, that hides it"):
        model(input_ids=batch_ids(), labels=batch_ids()).loss.backward()
    assert handle.num_kept == 0


@MODES
def test_a_hook_that_runs_another_model_inside_a_stashed_layer(install, use_reentrant):
    """A forward hook inside a stashed layer runs a no_grad teacher model: the teacher's attention runs stock, only
    the stashed layer's own attention reaches its checkpoint call, and the step is the stock step with that hook."""
    ids = batch_ids()
    teacher = llama_model().eval()
    with torch.no_grad():
        expected_logits = teacher(input_ids=ids).logits
    seen = []

    def run_teacher(module, args, output):
        with torch.no_grad():
            seen.append(torch.equal(teacher(input_ids=ids).logits, expected_logits))

    model = checkpointed(mixtral_model(), use_reentrant)
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(run_teacher)
    expected_loss, expected = train_step(model, ids)
    handle = install(model, NUM_LAYERS)
    seen.clear()
    loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    assert handle.recomputes_served == NUM_LAYERS
    # The hook ran in each layer's forward and, reentrant, its recompute (a non-reentrant recompute stops at its last
    # saved tensor, before the hook), the teacher's outputs unchanged each time.
    assert seen == [True] * (2 if use_reentrant else 1) * NUM_LAYERS


def test_layers_that_share_an_attention_module(install):
    """Two stashed layers with one attention module (shared blocks, as hybrid models have): each call is its own
    layer's."""
    model = checkpointed(mixtral_model())
    model.model.layers[2].self_attn = model.model.layers[1].self_attn
    assert_stashed_step_is_stock(install, model)


def test_deepspeed_hidden_states_offload(install):
    """DeepSpeed's CheckpointHiddenStatesOffload around non-reentrant checkpointing patches the layer class's
    __call__ while active: both it and the stash keep their counts (on the CPU it marks each layer's input and
    offloads none), the stash hands each layer's kept output and log-sum-exp to the same engine, which on the CPU
    leaves them too, and the step is the stock step under the same offload."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    model = checkpointed(mixtral_model(), use_reentrant=False)
    ids = batch_ids()

    def offloaded_step(handle=None):
        offload = CheckpointHiddenStatesOffload()
        with offload:
            step = train_step(model, ids) if handle is None else stashed_train_step(model, handle, ids)
            stats = (offload.stats.marked_tensors, offload.stats.skipped_marked_tensors,
                     offload.stats.offloaded_tensors)
        return step, stats

    (expected_loss, expected), expected_stats = offloaded_step()
    assert expected_stats == (NUM_LAYERS, NUM_LAYERS, 0)
    handle = install(model, NUM_LAYERS)
    (loss, grads), stats = offloaded_step(handle)
    assert stats == (NUM_LAYERS, NUM_LAYERS + 2 * NUM_LAYERS, 0)
    assert (handle.offloaded_bytes, handle.restored_bytes) == (0, 0)
    assert handle.recomputes_served == NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


@pytest.mark.parametrize("wraps", [False, True], ids=["closure", "functools_wraps"])
def test_install_again_under_a_wrapper_that_stayed(install, sdpa_entry, wraps):
    """A library's wrapper around the stash's entry stays after remove(): a later install serves through it, found
    through its closure or its __wrapped__, and its removal leaves the wrapper as the library put it."""
    ids = batch_ids()
    model = checkpointed(mixtral_model())
    expected_loss, expected = train_step(model, ids)
    first = install(model, 1)
    inner = ALL_ATTENTION_FUNCTIONS["sdpa"]
    wrapper = counting_wrapper(
        inner, []) if not wraps else functools.wraps(inner)(lambda *args, **kwargs: inner(*args, **kwargs))
    sdpa_entry("global", wrapper)
    first.remove()
    for _ in range(2):
        handle = install(model, NUM_LAYERS)
        loss, grads = stashed_train_step(model, handle, ids)
        assert torch.equal(loss, expected_loss)
        assert_same_grads(grads, expected)
        handle.remove()
        assert AttentionInterface._global_mapping["sdpa"] is wrapper and attention_stash._held is None
    loss, grads = train_step(model, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


@MODES
def test_a_global_of_the_sdpa_module_patched_after_the_install(install, monkeypatch, use_reentrant):
    """A name that transformers' sdpa function reads from its module, patched after the install (a library's patch,
    mock.patch): stashed layers run the patched one, as the unstashed layers and a stock model do, and again the
    original once the patch is undone."""
    ids = batch_ids()
    model = checkpointed(mixtral_model(), use_reentrant)
    handle = install(model, 2)
    original = sdpa_attention.use_gqa_in_sdpa
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    stashed_train_step(model, handle, ids)
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", counted)
    stashed_train_step(model, handle, ids)
    # Each layer's forward and recompute read it once: 3 forwards, 3 recomputes.
    assert len(calls) == 2 * NUM_LAYERS
    monkeypatch.undo()
    calls.clear()
    stashed_train_step(model, handle, ids)
    assert not calls


def test_a_registration_between_a_forward_and_its_non_reentrant_backward(install, sdpa_entry):
    """A non-reentrant recompute stops at its last save; a recompute whose attention no longer reaches the stash
    saves other tensors and stops before any attention call the stash sees: it raises naming the registered function,
    never recomputes stock unnoticed, and releases what that layer kept."""
    model = checkpointed(mixtral_model(), use_reentrant=False)
    handle = install(model, 2)
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids).loss
    sdpa_entry("global", scaled_sdpa([]))
    with pytest.raises(AttentionStashError,
                       match=r"needs the attention of model.layers.2 to reach the sdpa entry it installed in "
                       r"ALL_ATTENTION_FUNCTIONS, got <function scaled_sdpa"):
        loss.backward()
    # Layer 2's output went with the error; layer 1's waits for its graph, which goes with the loss.
    assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (1, 0, 1)
    del loss
    gc.collect()
    assert (handle.num_kept, handle.kept_bytes, handle.released_without_backward) == (0, 0, 2)


def test_an_attention_module_shared_with_an_unstashed_layer_is_refused_at_install():
    model = checkpointed(mixtral_model())
    model.model.layers[2].self_attn = model.model.layers[1].self_attn
    with pytest.raises(AttentionStashError,
                       match="needs the attention modules of the layers it stashes to be theirs alone, got the "
                       "MixtralAttention of model.layers.2 shared with model.layers.1, which is not stashed"):
        install_attention_stash(model, 1)
    assert_stock_process()


def test_a_stashed_model_dropped_without_remove_leaves_nothing_installed():
    """The hold on Hugging Face's objects goes with the last stashed layer, also without handle.remove(); a model
    that is still stashed keeps it."""
    kept, dropped = checkpointed(mixtral_model()), checkpointed(mixtral_model())
    handle = install_attention_stash(kept, 1)
    install_attention_stash(dropped, NUM_LAYERS)
    ids = batch_ids()
    dropped(input_ids=ids, labels=ids).loss.backward()
    del dropped
    gc.collect()
    assert attention_stash._held is not None
    stashed_train_step(kept, handle, ids)
    del kept, handle
    gc.collect()
    assert_stock_process()


def test_a_replaced_torch_sdpa_is_refused(install, monkeypatch):
    """A process-wide replacement of F.scaled_dot_product_attention (SageAttention's suggestion) runs in stock code,
    whose sdpa function calls it through torch.nn.functional: refused at install, and in a stashed forward when it
    comes after the install, never bypassed."""
    model = checkpointed(mixtral_model())
    replacement = functools.partial(torch.nn.functional.scaled_dot_product_attention)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", replacement)
    message = "needs torch.nn.functional.scaled_dot_product_attention to be PyTorch's own, whose kernels it replays"
    with pytest.raises(AttentionStashError, match=message):
        install_attention_stash(model, 1)
    assert_stock_process()
    monkeypatch.undo()
    handle = install(model, 1)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", replacement)
    with pytest.raises(AttentionStashError, match=message):
        model(input_ids=batch_ids(), labels=batch_ids())
    assert handle.num_kept == 0


def test_an_attention_module_of_a_collected_stashed_model_runs_stock_elsewhere(install):
    """A stashed model dropped without remove() whose attention module lives on in another, unstashed model, while a
    third model holds a stash: the module runs stock there."""
    dropped = checkpointed(mixtral_model())
    install_attention_stash(dropped, 1)
    attention = dropped.model.layers[2].self_attn
    del dropped
    gc.collect()
    assert attention_stash._held is None
    model = checkpointed(mixtral_model())
    model.model.layers[2].self_attn = attention
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    stashed = checkpointed(llama_model())
    install(stashed, 1)
    assert attention_stash._held is not None
    loss, grads = train_step(model, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_install_and_remove_in_a_loop_leave_no_finalizers_behind():
    model = checkpointed(mixtral_model())
    install_attention_stash(model, NUM_LAYERS).remove()
    registered = len(weakref.finalize._registry)
    for _ in range(5):
        install_attention_stash(model, NUM_LAYERS).remove()
    assert len(weakref.finalize._registry) == registered
    assert_stock_process()


def _relative_error(grads, reference):
    """The gradients' distance from ``reference``, over all parameters, relative to its norm."""
    distance = sum(((grads[name] - grad).double()**2).sum() for name, grad in reference.items())
    return (distance / sum((grad.double()**2).sum() for grad in reference.values())).sqrt().item()


def _saves_in_bfloat16():
    """Saved-tensor hooks that keep float32 saves as bfloat16, a lossy activation compression."""

    def pack(tensor):
        return (tensor.dtype, tensor.to(torch.bfloat16)) if tensor.dtype == torch.float32 else (None, tensor)

    def unpack(packed):
        dtype, tensor = packed
        return tensor if dtype is None else tensor.to(dtype)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@MODES
def test_lossy_saved_tensor_hooks_give_the_forwards_output_with_rounded_inputs(install, use_reentrant):
    """Saved-tensor hooks that store saves lossily, around forward and backward: the recompute starts from rounded
    inputs. The plain recompute pairs them with an attention output recomputed from them, the stash with the
    forward's exact output, so the gradients differ from the plain recompute's (the loss, a forward value, does not);
    both are approximations of the gradients without the hooks, and the stash's is no further from them (at most 1.1
    times the plain recompute's relative error: on these shapes it is 0.97 to 1.0 times)."""
    model = checkpointed(llama_model(), use_reentrant=use_reentrant)
    ids = batch_ids()
    exact_loss, exact = train_step(model, ids)
    with _saves_in_bfloat16():
        plain_loss, plain = train_step(model, ids)
    handle = install(model, NUM_LAYERS)
    with _saves_in_bfloat16():
        loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, plain_loss) and torch.equal(loss, exact_loss)
    assert any(not torch.equal(grads[name], grad) for name, grad in plain.items())
    assert 0 < _relative_error(grads, exact) <= 1.1 * _relative_error(plain, exact)
    # Lossless hooks (offload to CPU) leave the stash bitwise equal to the plain recompute.
    with torch.autograd.graph.save_on_cpu():
        loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, exact_loss)
    assert_same_grads(grads, exact)


@MODES
def test_dropout_inside_a_stashed_layer(install, use_reentrant):
    """A dropout inside a stashed layer before the attention (a LoRA dropout on the query projection's input): with
    the checkpoint's default preserve_rng_state=True the recompute draws the forward's masks, and the stash is bitwise
    equal to the plain recompute. With preserve_rng_state=False the recompute draws new masks: the plain recompute then
    differentiates attention on the new masks, the stash pairs the queries of the new masks with the forward's
    attention output, so their gradients differ, though the loss is the same."""
    for preserve_rng_state in (True, False):
        model = checkpointed(llama_model(), use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)
        for layer in model.model.layers:
            layer.self_attn.q_proj = torch.nn.Sequential(torch.nn.Dropout(0.1), layer.self_attn.q_proj)
        ids = batch_ids()
        torch.manual_seed(7)
        plain_loss, plain = train_step(model, ids)
        handle = install(model, NUM_LAYERS)
        torch.manual_seed(7)
        loss, grads = stashed_train_step(model, handle, ids)
        handle.remove()
        assert torch.equal(loss, plain_loss)
        if preserve_rng_state:
            assert_same_grads(grads, plain)
        else:
            assert any(not torch.equal(grads[name], grad) for name, grad in plain.items())
