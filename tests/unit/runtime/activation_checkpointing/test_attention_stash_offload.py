# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The stash's offload: a stashed layer's kept attention output and log-sum-exp go where its checkpoint's inputs go.

Each route trains a tiny Llama one step with the stash and one without, from the same weights, on the same route:
DeepSpeed's CheckpointHiddenStatesOffload, DeepSpeed's cpu_checkpointing, transformers' offload=True (torch's
save_on_cpu around each checkpoint), and offload=True over plain checkpointing, each in both checkpoint modes. Loss and
gradients are bitwise equal and every recompute is served. Between the forward and the backward the device holds one
layer's attention output, the last (the offload engine's keep-last window), and nothing else the stash kept; the host
holds the rest, in distinct buffers whose bytes are the handle's; after the backward nothing is left, and the buffers
went back to the engine's pool, which serves the next step without pinning another.

DeepSpeed's CPU accelerator is a synchronized device, on which the offload engine never copies. The ``host`` fixture
makes it answer as an unsynchronized device to DeepSpeed's offload modules (it has no streams, so the engine copies on
the calling thread) and records each buffer the engine pins through ``get_accelerator().pin_memory``: on CPU, a
tensor lives "on the host" where its storage is such a buffer, and "on the device" anywhere else. torch's save_on_cpu
pins where ``torch.cpu.is_available()``, which a CPU-only build cannot: the fixture turns that off.
"""

import contextlib
import gc
import os
from collections import Counter

import pytest
import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.activation_checkpointing.attention_stash import (AttentionStashError,
                                                                        attention_stash_layer_bytes,
                                                                        attention_stash_layers_for_budget)
from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

from attention_stash_helpers import (NUM_LAYERS, FORWARD_LAYOUT, assert_same_grads, batch_ids, checkpointed, free_port,
                                     live_checkpoint_calls, llama_model, offload_copies_on_cpu, param_grads, tensors)
from test_attention_stash_readme import launcher_process  # noqa: F401 (a fixture)

# One process group for the module, as deepspeed.init_distributed makes it from these (cpu_checkpointing's routes).
for _variable, _default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", free_port())):
    os.environ.setdefault(_variable, _default)

# The tiny models' attention output and log-sum-exp at batch 2, sequence 32: 4 heads of dimension 16, in float32.
OUTPUT, LSE = (2, 4, 32, 16), (2, 4, 32)
OUTPUT_BYTES, LSE_BYTES = 2 * 4 * 32 * 16 * 4, 2 * 4 * 32 * 4


@pytest.fixture
def host():
    """DeepSpeed's offload engines copy on CPU (offload_copies_on_cpu); yields the host buffers they pin."""
    pinned = {}
    with offload_copies_on_cpu(pinned):
        yield pinned


def where_kept(before, pinned, shapes=(OUTPUT, LSE)):
    """(on the device, on the host): Counters of the distinct storages of attention outputs and log-sum-exps (tensors
    of the ``shapes``) alive now and not in ``before``, by shape; and the host ones' bytes."""
    owned, seen = {id(tensor) for tensor in before}, set()
    device, host, host_bytes = Counter(), Counter(), 0
    for tensor in tensors():
        storage = tensor.untyped_storage().data_ptr()
        if id(tensor) in owned or tuple(tensor.shape) not in shapes or storage in seen:
            continue
        seen.add(storage)
        if storage in pinned:
            host[tuple(tensor.shape)] += 1
            host_bytes += tensor.untyped_storage().nbytes()
        else:
            device[tuple(tensor.shape)] += 1
    return device, host, host_bytes


def offload_enabled(model, use_reentrant):
    """transformers' activation checkpointing with offload=True: torch's save_on_cpu around each checkpoint."""
    kwargs = {"use_reentrant": use_reentrant}
    if FORWARD_LAYOUT:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=True)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, offload=True)
    return model.train()


@pytest.fixture
def cpu_checkpointing():
    """DeepSpeed's activation checkpointing with cpu_checkpointing, its defaults again after."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    ds_checkpointing.configure(None, checkpoint_in_cpu=True)
    yield
    ds_checkpointing.configure(None, checkpoint_in_cpu=False)
    ds_checkpointing.reset()


def _deepspeed(function):

    def checkpointed_by(model):
        checkpointed(model)
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = function
        return model

    return checkpointed_by


# route: (how the model is checkpointed per mode, what makes the context a model's steps run in, the install's offload).
ROUTES = {
    "hidden_states_offload": (lambda reentrant: lambda model: checkpointed(model, use_reentrant=reentrant),
                              lambda: CheckpointHiddenStatesOffload(use_pin_memory=True, use_streams=False), None),
    "cpu_checkpointing":
    (lambda reentrant: _deepspeed(ds_checkpointing.checkpoint
                                  if reentrant else ds_checkpointing.non_reentrant_checkpoint), None, None),
    "transformers_offload": (lambda reentrant: lambda model: offload_enabled(model, reentrant), None, None),
    "offload_true": (lambda reentrant: lambda model: checkpointed(model, use_reentrant=reentrant), None, True),
}


def offloaded_step(model, ids, context=None, handle=None, pinned=None, shapes=(OUTPUT, LSE)):
    """One step on ``ids`` (token ids, or the model's inputs) in ``context`` (a context manager, entered anew each
    step): loss, gradients, and with ``handle`` where the stash's kept tensors (of the ``shapes``) were between the
    forward and the backward and after it (where_kept's), and the host buffers pinned during the step."""
    model.zero_grad(set_to_none=True)
    before, pinned_before = tensors(), len(pinned or ())
    inputs = ids if isinstance(ids, dict) else dict(input_ids=ids, labels=ids)
    with context or contextlib.nullcontext():
        loss = model(**inputs).loss
        between = where_kept(before, pinned, shapes) if handle else None
        loss.backward()
    loss = loss.detach()
    after = where_kept(before, pinned, shapes) if handle else None
    return loss, param_grads(model), between, after, len(pinned or ()) - pinned_before


def assert_offloaded_step(step, handle, expected_loss, expected, output, lse):
    """An offloaded_step of a stashed model with offloaded kept outputs: bitwise as ``expected`` (loss and gradients),
    every recompute served; between the passes one layer's output on the device at most (the engine keeps its last
    tensor there, which a reentrant checkpoint's inputs, saved after its function, may be instead), the rest on the
    host, one copy each, the host's bytes the handle's; after the step nothing on the device. ``output`` and ``lse``:
    (shape, bytes) of one layer's."""
    loss, grads, (device, hosted, host_bytes), after, _ = step
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    assert (handle.recomputes_served, handle.num_kept, handle.released_without_backward) == (NUM_LAYERS, 0, 0)
    (output, output_bytes), (lse, lse_bytes) = output, lse
    on_device = device[output]
    assert on_device <= 1 and device == Counter({output: on_device})
    assert hosted == Counter({output: NUM_LAYERS - on_device, lse: NUM_LAYERS})
    assert handle.offloaded_bytes == NUM_LAYERS * (output_bytes + lse_bytes)
    assert host_bytes == handle.offloaded_bytes - on_device * output_bytes
    assert handle.restored_bytes == handle.offloaded_bytes
    # The host buffers are in the engine's pool after the step (the routes' test: the next step pins none).
    assert after[0] == Counter() and live_checkpoint_calls() == []


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("route", ROUTES)
def test_kept_outputs_follow_the_checkpoint_to_host_memory(install, host, route, use_reentrant, request):
    if route == "cpu_checkpointing":
        request.getfixturevalue("cpu_checkpointing")
    prepare, make_context, offload = ROUTES[route]
    ids = batch_ids()
    expected_loss, expected, *_ = offloaded_step(
        prepare(use_reentrant)(llama_model()), ids, make_context and make_context())
    model, context = prepare(use_reentrant)(llama_model()), make_context and make_context()
    handle = install(model, NUM_LAYERS, offload=offload)
    layer_bytes = attention_stash_layer_bytes(model, 2, 32)
    assert layer_bytes == OUTPUT_BYTES + LSE_BYTES

    assert_offloaded_step(offloaded_step(model, ids, context, handle, host), handle, expected_loss, expected,
                          (OUTPUT, OUTPUT_BYTES), (LSE, LSE_BYTES))
    *_, pinned_in_second_step = offloaded_step(model, ids, context, handle, host)
    assert pinned_in_second_step == 0
    assert handle.recomputes_served == 2 * NUM_LAYERS and handle.restored_bytes == 2 * NUM_LAYERS * layer_bytes


@pytest.mark.parametrize("offload", [None, False])
def test_without_an_offloading_checkpoint_or_with_offload_false_the_device_keeps_all(install, host, offload):
    """offload=None over a checkpoint that offloads nothing, and offload=False over one that does (transformers'
    offload=True): every kept output and log-sum-exp stays on the device until its recompute, none is handed over."""
    ids = batch_ids()
    prepare = checkpointed if offload is None else lambda model: offload_enabled(model, True)
    model = prepare(llama_model())
    handle = install(model, NUM_LAYERS, offload=offload)
    _, _, between, after, pinned = offloaded_step(model, ids, None, handle, host)
    assert between[:2] == (Counter({OUTPUT: NUM_LAYERS, LSE: NUM_LAYERS}), Counter())
    assert (handle.offloaded_bytes, handle.restored_bytes, handle.recomputes_served) == (0, 0, NUM_LAYERS)
    assert after[0] == Counter() and pinned == 0


def test_on_a_synchronized_device_nothing_moves(install):
    """DeepSpeed's CPU accelerator as it is (synchronized): its offload engine leaves every tensor where it is, and the
    stash counts nothing offloaded, with offload=True too; served bitwise."""
    ids = batch_ids()
    expected_loss, expected, *_ = offloaded_step(checkpointed(llama_model()), ids, None)
    model = checkpointed(llama_model())
    handle = install(model, NUM_LAYERS, offload=True)
    loss, grads, *_ = offloaded_step(model, ids, None)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    assert (handle.offloaded_bytes, handle.restored_bytes, handle.recomputes_served) == (0, 0, NUM_LAYERS)


def test_the_next_recompute_is_prefetched(install, host, monkeypatch):
    """Each recompute takes its own kept tensors back and starts bringing back those of the layer whose recompute
    comes next: the engine's restores come one layer ahead of the recomputes, in the backward's order."""
    from deepspeed.runtime.activation_checkpointing import attention_stash

    model = checkpointed(llama_model())
    handle = install(model, NUM_LAYERS, offload=True)
    engine, events = handle._counters.engine, []
    restore = type(engine).restore_input
    monkeypatch.setattr(type(engine), "restore_input",
                        lambda self, token: events.append(token) or restore(self, token))
    recompute = attention_stash._CheckpointCall._restore

    def recomputing(call):
        events.append(call.stash.name)
        return recompute(call)

    monkeypatch.setattr(attention_stash._CheckpointCall, "_restore", recomputing)
    offloaded_step(model, batch_ids(), None, handle, host)
    # Ids 1 to 6: layer 0's log-sum-exp and output, then layer 1's and layer 2's.
    assert events == ["model.layers.2", 5, 6, 3, 4, "model.layers.1", 1, 2, "model.layers.0"]
    assert handle.recomputes_served == NUM_LAYERS


def test_the_planner_counts_the_offload_window(install):
    """Offloaded, the device holds two stashed layers' kept bytes at most, the one recomputed and the next one: a
    budget of two layers stashes every layer, one byte less only one."""
    model = checkpointed(llama_model())
    layer = attention_stash_layer_bytes(model, 2, 32)
    assert attention_stash_layers_for_budget(model, 2 * layer, 2, 32, offload=True) == NUM_LAYERS
    assert attention_stash_layers_for_budget(model, 2 * layer - 1, 2, 32, offload=True) == 1
    assert attention_stash_layers_for_budget(model, 2 * layer, 2, 32) == 2
    handle = install(model, memory_budget=2 * layer, micro_batch_size=2, sequence_length=32, offload=True)
    assert len(handle.layers) == NUM_LAYERS
    assert (f"for their recompute: {NUM_LAYERS * layer:,} bytes per micro-batch in flight (micro-batch 2, sequence "
            f"32), in host memory, two layers' on the device at most; reentrant checkpointing") in handle.summary
    handle.remove()
    handle = install(model, memory_budget=2 * layer, micro_batch_size=2, sequence_length=32)
    assert len(handle.layers) == 2
    assert (f"for their recompute: {2 * layer:,} bytes per micro-batch in flight (micro-batch 2, sequence 32), in "
            f"host memory where a layer's checkpoint offloads its inputs, else on the device; ") in handle.summary
    handle.remove()
    handle = install(model, 1, offload=False)
    assert ("bytes per token of each micro-batch in flight in torch.float32 (give micro_batch_size and "
            "sequence_length for the exact figure), on the device; ") in handle.summary


def test_offload_takes_none_true_or_false(install):
    with pytest.raises(TypeError, match=r"needs offload None \(follow the checkpoint\), True or False, got 'yes'\."):
        install(checkpointed(llama_model()), NUM_LAYERS, offload="yes")


def test_a_reset_engine_is_refused_and_nothing_is_left(install, host):
    """An offload engine reset between a forward and its backward (deepspeed.checkpointing.reset(), an offload context
    entered again) no longer holds what its ids name, and restarts them: the recompute raises naming it, and what the
    stash kept goes, with the graph."""
    model = checkpointed(llama_model())
    handle = install(model, NUM_LAYERS, offload=True)
    before = tensors()
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    handle._counters.engine.reset()
    with pytest.raises(AttentionStashError,
                       match=r"needs the offload engine of model.layers.2 to hold its kept output until the "
                       r"recompute, got it reset since \(deepspeed.checkpointing.reset\(\), an offload "
                       r"context entered again\). Run the backward first."):
        loss.backward()
    del loss
    gc.collect()
    assert (handle.num_kept, handle.kept_bytes, handle.released_without_backward) == (0, 0, NUM_LAYERS)
    assert where_kept(before, host)[0] == Counter() and live_checkpoint_calls() == []


@pytest.mark.parametrize("backward", [True, False], ids=["refused_mid_step", "no_backward"])
def test_what_no_recompute_takes_goes_back_to_the_pool(install, host, backward):
    """Offloaded outputs that no recompute takes (the graph dropped without a backward, a refusal in the recompute)
    are let go of, their host buffers back to the engine's pool: nothing alive after, on the device or the host but
    the pool, and the next step pins no buffer."""
    model = checkpointed(llama_model())
    handle = install(model, NUM_LAYERS, offload=True)
    before = tensors()
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids).loss
    if backward:
        # The last layer's recompute changes the checkpoint's attention: refused there.
        model.model.layers[-1].self_attn.scaling *= 2
        with pytest.raises(AttentionStashError, match="with its forward's arguments, got another scale"):
            loss.backward()
        model.model.layers[-1].self_attn.scaling /= 2
    del loss
    gc.collect()
    assert (handle.num_kept, handle.released_without_backward) == (0, NUM_LAYERS)
    assert where_kept(before, host)[0] == Counter() and live_checkpoint_calls() == []
    *_, pinned = offloaded_step(model, ids, None, handle, host)
    assert pinned == 0 and handle.recomputes_served == NUM_LAYERS


def test_an_in_place_change_of_an_offloaded_output_is_refused(install, host):
    """The host copy of an offloaded output is taken as its layer's forward ends, so the copy brought back for the
    recompute has a version of its own: a change in place of the output after the attention call, in the forward,
    still makes the recompute raise, as without offload, and release what the stash kept."""
    model = checkpointed(llama_model())
    handle = install(model, NUM_LAYERS, offload=True)
    before = tensors()
    model.model.layers[-1].self_attn.o_proj.register_forward_pre_hook(lambda module, args: args[0].mul_(2.0))
    loss = model(input_ids=batch_ids(), labels=batch_ids()).loss
    assert handle.offloaded_bytes == NUM_LAYERS * (OUTPUT_BYTES + LSE_BYTES)
    with pytest.raises(AttentionStashError,
                       match="needs the attention output of model.layers.2 unchanged from its forward to its "
                       "recompute, got an in-place change of it"):
        loss.backward()
    del loss
    gc.collect()
    assert (handle.num_kept, handle.kept_bytes, handle.released_without_backward) == (0, 0, NUM_LAYERS)
    assert where_kept(before, host)[0] == Counter() and live_checkpoint_calls() == []


@pytest.mark.parametrize("policy", ["trl_selective", "user_policy"])
def test_beside_a_saving_policy_the_kept_outputs_leave_the_device_too(install, host, policy):
    """A selective-checkpointing policy that saves the attention kernel (TRL's selective=True, or a user's) caches its
    outputs in no saved tensor, so no offload moves them: beside the stash, whose recompute never reads that cache,
    the policy recomputes the kernel the stash serves instead, and the kept outputs follow transformers' offload=True
    to host memory as without a policy. Bitwise as the policy and the offload without the stash, every recompute
    served."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from attention_stash_helpers import CPU_FORWARD

    kernel = getattr(torch.ops.aten, CPU_FORWARD.partition(".")[0]).default

    def saving_policy(model):
        if policy == "trl_selective":
            pytest.importorskip("trl", reason="TRL's selective checkpointing needs trl (requirements-dev.txt)")
            import warnings

            from trl.models import enable_selective_activation_checkpointing

            enable_selective_activation_checkpointing(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the deprecated name, which TRL wraps
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={}, offload=True)
            return model.train()

        def saved(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op is kernel else CheckpointPolicy.PREFER_RECOMPUTE

        checkpointing = {"use_reentrant": False, "context_fn": lambda: create_selective_checkpoint_contexts(saved)}
        if FORWARD_LAYOUT:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing, offload=True)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing, offload=True)
        return model.train()

    ids = batch_ids()
    expected_loss, expected, *_ = offloaded_step(saving_policy(llama_model()), ids)
    model = saving_policy(llama_model())
    handle = install(model, NUM_LAYERS)
    loss, grads, between, after, _ = offloaded_step(model, ids, None, handle, host)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    assert handle.recomputes_served == NUM_LAYERS
    device, hosted, _ = between
    assert device[LSE] == 0 and device[OUTPUT] <= 1
    assert hosted == Counter({OUTPUT: NUM_LAYERS - device[OUTPUT], LSE: NUM_LAYERS})
    assert after[0] == Counter() and live_checkpoint_calls() == []


def test_the_trainer_with_zero3_and_offload(install, host, launcher_process):  # noqa: F811 (a fixture)
    """The Hugging Face Trainer with DeepSpeed ZeRO-3 and its activation checkpointing's offload=True (transformers'
    save_on_cpu), the stash installed before train(), which turns the checkpointing on: the losses of two steps equal
    those without the stash, every recompute served; after each forward one attention output at most on the device,
    the rest on the host; every byte offloaded brought back."""
    from transformers import Trainer, TrainingArguments

    from test_attention_stash_readme import deepspeed_config

    steps, seen = 2, []
    config = deepspeed_config()
    config["zero_optimization"]["stage"] = 3

    class Rows(torch.utils.data.Dataset):

        def __len__(self):
            return 4

        def __getitem__(self, index):
            ids = batch_ids(seed=index, batch=1)[0]
            return {"input_ids": ids, "labels": ids}

    def train(stashed):
        model = llama_model().train()
        handle = install(model, NUM_LAYERS) if stashed else None
        if stashed:
            # After the last layer's forward, before the backward: where the kept outputs are.
            model.lm_head.register_forward_hook(lambda *_: seen.append(where_kept(tensors(), host)[0]))
        prefix = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"
        arguments = TrainingArguments(output_dir=str(launcher_process / str(stashed)),
                                      per_device_train_batch_size=2,
                                      max_steps=steps,
                                      deepspeed=config,
                                      use_cpu=True,
                                      report_to=[],
                                      save_strategy="no",
                                      logging_steps=1,
                                      disable_tqdm=True,
                                      **{
                                          f"{prefix}_checkpointing": True,
                                          f"{prefix}_checkpointing_kwargs": {
                                              "offload": True
                                          }
                                      })
        trainer = Trainer(model=model, args=arguments, train_dataset=Rows())
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], handle

    plain, _ = train(False)
    losses, handle = train(True)
    assert losses == plain and len(losses) == steps
    assert (handle.recomputes_served, handle.num_kept) == (steps * NUM_LAYERS, 0)
    assert handle.offloaded_bytes == handle.restored_bytes == steps * NUM_LAYERS * (OUTPUT_BYTES + LSE_BYTES)
    assert len(seen) == steps and all(device[LSE] == 0 and device[OUTPUT] <= 1 for device in seen), seen


def test_the_unsynchronized_cpu_is_deepspeeds_cpu_accelerator_but_for_synchronization():
    """The double the offload tests hand DeepSpeed's offload modules answers as DeepSpeed's CPU accelerator in all that
    the offload engine reads, but is_synchronized_device: no streams, CPU tensors on the accelerator, pin_memory the
    accelerator's (the tensor itself, recorded); so DeepSpeed's engine made under it copies, on the calling thread."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import _ActivationOffloadEngine

    from attention_stash_helpers import UnsynchronizedCPU

    real, pinned = get_accelerator(), {}
    double = UnsynchronizedCPU(real, pinned)
    assert real.is_synchronized_device() and not double.is_synchronized_device()
    assert double.Stream is real.Stream is None and double.current_stream() is real.current_stream() is None
    tensor = torch.ones(256)
    assert double.on_accelerator(tensor) and real.on_accelerator(tensor)
    assert double.pin_memory(tensor, make_copy=False) is tensor and pinned == {
        tensor.untyped_storage().data_ptr(): tensor
    }
    with offload_copies_on_cpu(pinned):
        engine = _ActivationOffloadEngine(min_offload_bytes=0)
        token = engine.offload_input(tensor)
        engine.offload_input(torch.zeros(256))  # past the keep-last window: the first one is copied to a host buffer
        assert not engine.use_streams and token is not None
        back = engine.restore_input(token)
    assert torch.equal(back, tensor) and back.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert len(pinned) == 2
