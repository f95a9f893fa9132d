# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""How the stash knows a checkpoint's passes, and how long what it keeps lives.

The stash runs inside each stashed layer's checkpoint call: the first call of that function is the first forward, the
second its recompute, and what the first keeps lives as long as the checkpoint's graph. These tests drive the programs
that break a stash that infers the pass from grad mode, or ties its outputs to the lifetime of a tensor: dropped
forwards on a tensor the caller keeps, forwards without grad in train mode, copies of the model, threads, a retained
graph, torch.compile, a checkpoint around the whole model. CI runs them on both checkpoint layouts of transformers.
"""

import copy
import dataclasses
import gc
import io
import pickle
import threading
import time

import pytest
import torch
import transformers
from transformers.modeling_layers import GradientCheckpointingLayer

from deepspeed.runtime.activation_checkpointing import attention_stash
from deepspeed.runtime.activation_checkpointing.attention_stash import AttentionStashError, install_attention_stash

from attention_stash_helpers import (CPU_FORWARD, NUM_LAYERS, STOCK_SDPA, CountOps, assert_same_grads,
                                     assert_stock_process, batch_ids, checkpointed, every_n_layers,
                                     live_checkpoint_calls, llama_model, logged_messages, mixtral_model, param_grads,
                                     qwen3_moe_model, stashed_train_step, train_step)


def _counts(handle):
    return handle.num_kept, handle.kept_bytes, handle.recomputes_served, handle.released_without_backward


def test_dropped_forwards_on_a_tensor_the_caller_keeps(install):
    """A soft prompt the caller keeps (and updates in place) as inputs_embeds: a forward whose loss is dropped, as a
    NaN check or an exception after the forward does, releases its outputs with its graph, and nothing piles up."""
    model = checkpointed(qwen3_moe_model())
    prompt = model.model.embed_tokens(batch_ids()).detach().requires_grad_()
    labels = batch_ids()
    expected_loss = model(inputs_embeds=prompt, labels=labels).loss
    expected_loss.backward()
    expected = (expected_loss.detach(), param_grads(model), prompt.grad.clone())

    handle = install(model, NUM_LAYERS)
    for dropped in range(1, 4):
        loss = model(inputs_embeds=prompt, labels=labels).loss
        assert handle.num_kept == NUM_LAYERS
        del loss
        assert _counts(handle)[:2] == (0, 0)
        assert handle.released_without_backward == dropped * NUM_LAYERS
        with torch.no_grad():
            prompt.add_(0.0)  # an in-place update: a new version of the same tensor
    assert not live_checkpoint_calls()

    model.zero_grad(set_to_none=True)
    prompt.grad = None
    loss = model(inputs_embeds=prompt, labels=labels).loss
    loss.backward()
    assert handle.recomputes_served == NUM_LAYERS and handle.num_kept == 0
    assert torch.equal(loss.detach(), expected[0])
    assert_same_grads(param_grads(model), expected[1])
    assert torch.equal(prompt.grad, expected[2])


def test_forward_that_raises_after_the_layers_keeps_nothing(install):
    model = checkpointed(mixtral_model())
    handle = install(model, NUM_LAYERS)

    def fail(module, args, output):
        raise ValueError("after the decoder layers")

    hook = model.model.norm.register_forward_hook(fail)
    with pytest.raises(ValueError, match="after the decoder layers"):
        model(input_ids=batch_ids(), labels=batch_ids())
    hook.remove()
    gc.collect()  # the traceback held the graph
    assert _counts(handle) == (0, 0, 0, NUM_LAYERS)
    assert not live_checkpoint_calls()


def test_no_grad_forwards_in_train_mode_keep_nothing(install):
    """Validation without model.eval() and generate() in train mode. Reentrant checkpointing switches on Hugging Face's
    enable_input_require_grads, so the layer inputs require grad even here; on transformers <= 5.22 such forwards run
    through the checkpoint too. A padded batch (which the stash refuses in training) runs as stock sdpa."""
    model = checkpointed(mixtral_model())
    ids = batch_ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        expected_logits = model(input_ids=ids, attention_mask=mask).logits
    expected_tokens = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
    handle = install(model, NUM_LAYERS)
    seen = []
    model.model.layers[0].register_forward_hook(lambda module, args, output: seen.append(args[0].requires_grad))

    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert seen == [True]  # the input that made the old stash take this for a checkpoint's first pass
    assert torch.equal(logits, expected_logits)
    assert torch.equal(model.generate(ids[:, :8], max_new_tokens=4, do_sample=False), expected_tokens)
    assert _counts(handle) == (0, 0, 0, 0)
    assert not live_checkpoint_calls()


def test_a_copy_of_a_stashed_model_is_a_stock_model(install):
    """copy.deepcopy takes the model, not its stash: the copy trains, switches attention implementation and trains
    without checkpointing like any model, and the original's handle counts nothing of it."""
    model = checkpointed(mixtral_model())
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    handle = install(model, NUM_LAYERS)
    twin = copy.deepcopy(model)

    loss, grads = train_step(twin, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    assert _counts(handle) == (0, 0, 0, 0)

    twin.set_attn_implementation("eager")
    train_step(twin, ids)
    getattr(twin, "activation_checkpointing_disable", twin.gradient_checkpointing_disable)()
    twin.set_attn_implementation("sdpa")
    train_step(twin, ids)
    assert _counts(handle) == (0, 0, 0, 0)

    # The original is still stashed.
    loss, grads = stashed_train_step(model, handle, ids)
    assert handle.recomputes_served == NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_a_model_that_holds_its_handle_pickles_as_it_copies(install, how):
    """A model that holds its handle (model.attention_stash = handle), pickled, saved whole with torch.save or
    deep-copied: the copy is a stock model, and the copied handle stashes nothing; the original stays stashed. (Hugging
    Face's checkpointing adds a hook that pickle cannot take, so both are checkpointed after the copy.)"""
    ids = batch_ids()
    expected_loss, expected = train_step(checkpointed(mixtral_model()), ids)
    model = mixtral_model()
    if how != "deepcopy":
        try:
            pickle.dumps(model)
        except (AttributeError, pickle.PicklingError) as error:
            # transformers 5.22 with the kernels package installed (the Hub-kernel tests' requirement) puts modules of
            # classes local to kernels' use_kernelized_func in each layer: no model pickles, with or without a stash.
            pytest.skip(f"a plain {type(model).__name__} does not pickle here: {error}")
    model.attention_stash = install(model, NUM_LAYERS)
    if how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    elif how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    else:
        twin = copy.deepcopy(model)
    copied = twin.attention_stash
    assert type(copied) is attention_stash.AttentionStashHandle and copied.layers == ()
    assert _counts(copied) == (0, 0, 0, 0)
    checkpointed(model)
    loss, grads = train_step(checkpointed(twin), ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    copied.remove()
    assert _counts(model.attention_stash) == (0, 0, 0, 0)
    loss, grads = stashed_train_step(model, model.attention_stash, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_install_and_remove_from_many_threads(monkeypatch):
    """Installs and removes racing on one process-wide sdpa entry and layer class: every thread trains its own model
    with its own stash, exactly, and transformers' own entry and class come back at the end. A pause inside the
    first install's hold widens the window in which an unguarded second install would save the wrapper as stock."""
    sdpa = attention_stash._IMPLEMENTATIONS["sdpa"]

    def slow_copy(record, function, where):
        time.sleep(0.05)
        return sdpa.copy(record, function, where)

    monkeypatch.setitem(attention_stash._IMPLEMENTATIONS, "sdpa", dataclasses.replace(sdpa, copy=slow_copy))
    threads, rounds = 6, 3
    ids = batch_ids()
    expected_loss, expected = train_step(checkpointed(mixtral_model()), ids)
    models = [checkpointed(mixtral_model()) for _ in range(threads)]
    start = threading.Barrier(threads)
    errors, served = [], []

    def work(model):
        try:
            for _ in range(rounds):
                start.wait()
                handle = install_attention_stash(model, NUM_LAYERS)
                start.wait()
                loss, grads = stashed_train_step(model, handle, ids)
                assert torch.equal(loss, expected_loss)
                assert_same_grads(grads, expected)
                served.append(handle.recomputes_served)
                start.wait()
                handle.remove()
        except BaseException as error:  # reported below, from the main thread
            start.abort()
            errors.append(error)

    workers = [threading.Thread(target=work, args=(model, )) for model in models]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    assert served == [NUM_LAYERS] * (threads * rounds)
    assert_stock_process()
    loss, grads = train_step(models[0], ids)  # stock training afterwards
    assert torch.equal(loss, expected_loss)


def test_second_backward_through_a_retained_graph_names_it(install):
    model = checkpointed(mixtral_model())
    handle = install(model, NUM_LAYERS)
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    loss.backward(retain_graph=True)
    assert handle.recomputes_served == NUM_LAYERS
    with pytest.raises(AttentionStashError,
                       match=r"needs one backward per forward of model.layers.2, got a second backward through a "
                       r"retained graph \(backward\(retain_graph=True\)\)"):
        loss.backward()


def test_reentrant_checkpoint_around_the_whole_model(install):
    """The outer checkpoint's first pass runs the layers without grad (no backward to serve, nothing kept); its
    recompute runs them with grad, through their own checkpoints, whose recomputes the stash serves."""

    def step(model, ids):
        model.zero_grad(set_to_none=True)
        embeds = model.model.embed_tokens(ids).detach().requires_grad_()
        loss = torch.utils.checkpoint.checkpoint(lambda x: model(inputs_embeds=x, labels=ids).loss,
                                                 embeds,
                                                 use_reentrant=True)
        loss.backward()
        return loss.detach(), param_grads(model)

    model = checkpointed(mixtral_model())
    ids = batch_ids()
    expected_loss, expected = step(model, ids)
    handle = install(model, NUM_LAYERS)
    with CountOps() as counted:
        loss, grads = step(model, ids)
    assert _counts(handle) == (0, 0, NUM_LAYERS, 0)
    # First pass without grad (stock), then in the outer recompute each layer's first pass; no recompute kernel.
    assert counted.calls[CPU_FORWARD] == 2 * NUM_LAYERS
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    assert not live_checkpoint_calls()


def _disable(model):
    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()


def _stand_aside_warnings(messages):
    return [message for message in messages if "run stock attention and keep nothing" in message]


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpointing_disabled_and_enabled_again(install, use_reentrant):
    """Checkpointing turned off after the install: training steps without it run stock attention, keep nothing and
    warn once, naming the layers; enabled again, the stash serves every stashed layer. So also on a model whose
    checkpointing was enabled after the install and served a step."""
    model = checkpointed(mixtral_model(), use_reentrant)
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    handle = install(model, NUM_LAYERS)
    _disable(model)
    with logged_messages() as messages:
        for _ in range(2):
            # Without checkpointing, as with it: the same loss and gradients on CPU.
            loss, grads = train_step(model, ids)
            assert torch.equal(loss, expected_loss)
            assert_same_grads(grads, expected)
            assert _counts(handle) == (0, 0, 0, 0)
    assert _stand_aside_warnings(messages) == [
        "attention stash: model.layers.0, model.layers.1, model.layers.2 run stock attention and keep nothing in "
        "training forwards without activation checkpointing, turned off on them since it was on: no recompute to "
        "serve. Enable it again to serve them."
    ]
    checkpointed(model, use_reentrant)
    loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)

    # Off again after a served step: one warning again.
    _disable(model)
    with logged_messages() as messages:
        train_step(model, ids)
    assert len(_stand_aside_warnings(messages)) == 1 and _counts(handle) == (0, 0, NUM_LAYERS, 0)
    handle.remove()

    # Installed before checkpointing was enabled: served once enabled, standing aside once it is off again.
    model = mixtral_model().train()
    handle = install(model, NUM_LAYERS)
    checkpointed(model, use_reentrant)
    stashed_train_step(model, handle, ids)
    _disable(model)
    with logged_messages() as messages:
        loss, grads = train_step(model, ids)
    assert len(_stand_aside_warnings(messages)) == 1 and _counts(handle) == (0, 0, NUM_LAYERS, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


def test_two_models_standing_aside_are_each_warned_of_once(install):
    """Two stashed models in one process (three layers and two), checkpointing turned off on both: each model's first
    training step warns once, naming its own layers, and neither warns again in its next step."""
    ids = batch_ids()
    models = [checkpointed(mixtral_model()), checkpointed(mixtral_model(num_hidden_layers=2))]
    handles = [install(model, len(model.model.layers)) for model in models]
    for model in models:
        _disable(model)
    warnings = []
    for _ in range(2):
        for model in models:
            with logged_messages() as messages:
                train_step(model, ids)
            warnings.append(_stand_aside_warnings(messages))
    layers = [", ".join(f"model.layers.{index}" for index in range(count)) for count in (3, 2)]
    assert warnings == [[
        f"attention stash: {names} run stock attention and keep nothing in training forwards without activation "
        "checkpointing, turned off on them since it was on: no recompute to serve. Enable it again to serve them."
    ] for names in layers] + [[], []]
    assert [_counts(handle) for handle in handles] == [(0, 0, 0, 0)] * 2


def test_training_refused_where_checkpointing_was_never_on(install):
    """Installed on a model whose checkpointing is off and was never on while stashed: the training forward is
    refused, not served stock, and keeps nothing."""
    model = mixtral_model().train()
    _disable(model)
    handle = install(model, NUM_LAYERS)
    with pytest.raises(AttentionStashError,
                       match="needs Hugging Face activation checkpointing for a training forward of "
                       "model.layers.0, got no activation checkpointing on it"):
        model(input_ids=batch_ids(), labels=batch_ids())
    assert _counts(handle) == (0, 0, 0, 0)


def test_every_n_layers_enabled_after_the_install(install):
    """every_n_layers=2 enabled after installing on all 3 layers: layer 1 stands aside (stock, one warning naming it
    and the layers checkpointed now, not repeated in the next step, whose other layers are served), layers 0 and 2 are
    served; installed again on those 2, all are served."""
    model = checkpointed(mixtral_model())
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    handle = install(model, NUM_LAYERS)
    _disable(model)
    every_n_layers(model, 2)
    with logged_messages() as messages:
        for step in range(1, 3):
            loss, grads = train_step(model, ids)
            assert torch.equal(loss, expected_loss)
            assert_same_grads(grads, expected)
            assert _counts(handle) == (0, 0, 2 * step, 0)
    assert _stand_aside_warnings(messages) == [
        "attention stash: model.layers.1 run stock attention and keep nothing in training forwards without activation "
        "checkpointing, turned off on them since it was on: no recompute to serve. Enable it again to serve them. The "
        "attention layers checkpointed now are model.layers.0, model.layers.2: remove() the stash and install it "
        "again, and num_layers counts those."
    ]
    handle.remove()
    handle = install(model, 2)
    assert handle.layers == ("model.layers.0", "model.layers.2")
    train_step(model, ids)
    assert _counts(handle) == (0, 0, 2, 0)


def test_every_n_layers_num_layers_counts_the_checkpointed_layers(install):
    """every_n_layers=2 on 3 layers checkpoints 2 attention layers: num_layers=3 is refused, naming the fix."""
    model = every_n_layers(mixtral_model(), 2)
    with pytest.raises(ValueError,
                       match=r"needs num_layers from 1 to the model's 2 checkpointed attention layers "
                       r"\(of 3 decoder layers\), got 3. every_n_layers leaves the others without a recompute to "
                       r"serve: num_layers=2 stashes all it checkpoints."):
        install_attention_stash(model, 3)
    assert install(model, 2).layers == ("model.layers.0", "model.layers.2")


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_every_n_layers_with_an_even_layer_count(install, use_reentrant):
    """every_n_layers=2 on 4 layers checkpoints layers 0 and 2 and leaves the last one without a recompute: installed
    after checkpointing is enabled, num_layers counts the checkpointed attention layers, and the install line says
    which layers it left out and why."""
    model = every_n_layers(mixtral_model(num_hidden_layers=4), 2, use_reentrant)
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    with pytest.raises(ValueError,
                       match="needs num_layers from 1 to the model's 2 checkpointed attention layers "
                       r"\(of 4 decoder layers\), got 3. every_n_layers leaves the others without a recompute to "
                       r"serve: num_layers=2 stashes all it checkpoints."):
        install_attention_stash(model, 3)
    assert attention_stash.attention_stash_layers_for_budget(model, 10**9, 2, 32) == 2
    with logged_messages() as messages:
        handle = install(model, 2)
    assert handle.layers == ("model.layers.0", "model.layers.2")
    assert "keeping the attention output of 2 of 2 attention layers (model.layers.0 to model.layers.2)" in messages[0]
    assert ("Left out: 2 decoder layers with no activation checkpointing (every_n_layers leaves it out), so no "
            "recompute to serve.") in messages[0]
    loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_remove_between_forward_and_backward(install, use_reentrant):
    """The forward's checkpoint calls outlive the removal, and new forwards run stock at once. Under reentrant
    checkpointing the recomputes run stock attention and release what their first passes kept as that backward runs,
    though the loss (and so the graph) is still held. Under non-reentrant checkpointing the first pass's graph holds
    the stash's node, whose saves only the stash's recompute gives: the stash serves those recomputes, and Hugging
    Face's objects come back when the last of them is done."""
    model = checkpointed(mixtral_model(), use_reentrant=use_reentrant)
    ids = batch_ids()
    expected_loss, expected = train_step(model, ids)
    handle = install(model, NUM_LAYERS)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    handle.remove()
    if use_reentrant:
        assert_stock_process()
    else:
        assert not attention_stash._STASHES and attention_stash._held is not None
    assert handle.num_kept == NUM_LAYERS
    with CountOps() as counted:
        loss.backward()
    assert_stock_process()
    assert counted.calls[CPU_FORWARD] == (NUM_LAYERS if use_reentrant else 0)
    assert (handle.num_kept, handle.kept_bytes) == (0, 0)
    served = 0 if use_reentrant else NUM_LAYERS
    assert (handle.recomputes_served, handle.released_without_backward) == (served, NUM_LAYERS - served)
    assert_same_grads(param_grads(model), expected)
    del loss
    assert not live_checkpoint_calls()


@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "full_recompute"])
def test_a_removed_stash_s_recompute_that_does_not_reach_it_is_named(install, early_stop):
    """Non-reentrant checkpointing, remove() between a forward and its backward, then an "sdpa" function registered
    that calls F.sdpa itself: the forward's graph holds the stash's node, whose saves only the stash's recompute gives,
    so that recompute is refused by name (the message read before the hold goes, not an AttributeError of a hold let
    go), what it kept is released, and the process is stock once the registration is undone."""
    from transformers.modeling_utils import AttentionInterface

    model = checkpointed(llama_model(), use_reentrant=False, early_stop=early_stop)
    handle = install(model, 1)
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids).loss
    handle.remove()

    def own_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = torch.nn.functional.scaled_dot_product_attention(query,
                                                               key,
                                                               value,
                                                               attn_mask=attention_mask,
                                                               scale=scaling,
                                                               is_causal=attention_mask is None)
        return out.transpose(1, 2).contiguous(), None

    # A registration after the removal, which the user undoes below: what the stash held goes back meanwhile.
    AttentionInterface._global_mapping["sdpa"] = own_sdpa
    try:
        with pytest.raises(AttentionStashError,
                           match=r"needs the recompute of model\.layers\.2, whose forward ran under non-reentrant "
                           r"checkpointing before handle\.remove\(\), to call attention as that forward did"):
            loss.backward()
        assert (handle.num_kept, handle.recomputes_served, handle.released_without_backward) == (0, 0, 1)
        del loss
        assert attention_stash._held is None and AttentionInterface._global_mapping["sdpa"] is own_sdpa
        assert not live_checkpoint_calls()
    finally:
        AttentionInterface._global_mapping["sdpa"] = STOCK_SDPA
    assert_stock_process()


def test_a_removed_stash_lets_go_after_a_recompute_that_waited_for_the_lock(install):
    """The last recompute that a removed stash serves ends while another thread holds the stash's lock (an install or
    a removal in progress there): the recompute waits for it and lets go of Hugging Face's objects, rather than leave
    them held with nothing stashed."""
    model = checkpointed(llama_model(), use_reentrant=False)
    handle = install(model, NUM_LAYERS)
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids).loss
    handle.remove()
    assert attention_stash._held is not None
    locked = threading.Event()

    def hold_the_lock():
        with attention_stash._LOCK:
            locked.set()
            time.sleep(0.3)

    other = threading.Thread(target=hold_the_lock)
    other.start()
    locked.wait(5)
    loss.backward()
    other.join()
    assert handle.recomputes_served == NUM_LAYERS
    assert_stock_process()


def test_rejects_a_layer_class_that_shadows_the_checkpoint_function(monkeypatch):
    model = checkpointed(mixtral_model())
    layer_class = type(model.model.layers[0])
    monkeypatch.setattr(layer_class, "_gradient_checkpointing_func", None, raising=False)
    with pytest.raises(AttentionStashError,
                       match="needs model.layers.2 to keep its checkpoint function per instance, as "
                       f"GradientCheckpointingLayer does, got a class attribute _gradient_checkpointing_func on "
                       f"{layer_class.__name__}"):
        install_attention_stash(model, 1)
    assert_stock_process()


def test_soak_dropped_forwards_validation_and_generation(install):
    """50 steps: a dropped forward every fifth, a no_grad validation pass every third, generation every tenth. After
    every step nothing is kept; every tenth step, the process holds no more tensors than after the first."""
    model = checkpointed(qwen3_moe_model())
    handle = install(model, NUM_LAYERS)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    baseline = None
    for step in range(50):
        ids = batch_ids(seed=step)
        loss = model(input_ids=ids, labels=ids).loss
        if step % 5 == 4:
            del loss
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
        if step % 3 == 0:
            with torch.no_grad():
                model(input_ids=ids, labels=ids)
        if step % 10 == 9:
            model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)
        assert (handle.num_kept, handle.kept_bytes) == (0, 0), step
        if step % 10 == 0 or step == 49:
            gc.collect()
            tensors = sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))
            baseline = tensors if baseline is None else baseline
            assert tensors <= baseline, (step, tensors, baseline)
    assert handle.recomputes_served == 40 * NUM_LAYERS
    assert handle.released_without_backward == 10 * NUM_LAYERS
    assert not live_checkpoint_calls()


def test_transformers_layout_under_test():
    """Names the checkpoint layout this run covers; CI runs the suite on both."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    checkpoints_forward = (major, minor) >= (5, 23)
    assert hasattr(GradientCheckpointingLayer, "__call__")
    assert ("__call__" in GradientCheckpointingLayer.__dict__) != checkpoints_forward
