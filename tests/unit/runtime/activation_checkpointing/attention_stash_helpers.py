# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Tiny Hugging Face MoE models and helpers shared by the attention stash tests and their two-rank script."""

import contextlib
import gc
import inspect
import logging
import os
import shutil
import socket
import subprocess
import sys
import types
from collections import Counter

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

NUM_LAYERS = 3
# PyTorch's intra-op threads as the process started, before conftest.py (which imports this module first) gives each
# pytest-xdist worker its share of the cores.
DEFAULT_THREADS = torch.get_num_threads()
# transformers >= 5.23 checkpoints a decoder layer's forward; up to 5.22 its __call__, hooks inside.
FORWARD_LAYOUT = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
STOCK_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]
STOCK_FLASH = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
CPU_FORWARD = "_scaled_dot_product_flash_attention_for_cpu.default"
CPU_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward.default"

# Every tiny model: 3 layers, hidden 64, 4 query heads and 2 key/value heads of dimension 16, in sdpa.
_TINY = dict(vocab_size=128,
             hidden_size=64,
             intermediate_size=64,
             num_hidden_layers=NUM_LAYERS,
             num_attention_heads=4,
             num_key_value_heads=2,
             max_position_embeddings=64,
             attn_implementation="sdpa")

# A tiny Qwen3-Next hybrid's mixture of experts and gated-delta-net (linear attention) layers, beside _TINY's sizes.
QWEN3_NEXT_HYBRID = dict(moe_intermediate_size=32,
                         shared_expert_intermediate_size=32,
                         num_experts=4,
                         num_experts_per_tok=2,
                         linear_num_value_heads=4,
                         linear_key_head_dim=16,
                         linear_value_head_dim=16,
                         linear_num_key_heads=2)


def _tiny(model_class, config_class, dtype, defaults, overrides):
    torch.manual_seed(0)
    return model_class(config_class(**{**_TINY, **defaults, **overrides})).to(dtype)


def mixtral_model(dtype=torch.float32, **overrides):
    return _tiny(MixtralForCausalLM, MixtralConfig, dtype, dict(num_local_experts=4, num_experts_per_tok=2), overrides)


def qwen3_moe_model(dtype=torch.float32, **overrides):
    # Qwen3-MoE adds norms of the queries and keys before RoPE.
    defaults = dict(moe_intermediate_size=32, head_dim=16, num_experts=4, num_experts_per_tok=2)
    return _tiny(Qwen3MoeForCausalLM, Qwen3MoeConfig, dtype, defaults, overrides)


def llama_model(dtype=torch.float32, **overrides):
    return _tiny(LlamaForCausalLM, LlamaConfig, dtype, {}, overrides)


def mistral_model(dtype=torch.float32, **overrides):
    return _tiny(MistralForCausalLM, MistralConfig, dtype, {}, overrides)


def gemma2_model(dtype=torch.float32, **overrides):
    # Gemma 2 caps its attention logits (softcap * tanh(scores / softcap)), layers alternating sliding and full; in
    # eager attention, as sdpa takes no cap.
    defaults = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_implementation="eager")
    return _tiny(Gemma2ForCausalLM, Gemma2Config, dtype, defaults, overrides)


def gpt_oss_model(dtype=torch.bfloat16, head_dim=16, frozen_sinks=False):
    """A tiny gpt-oss, a sliding-window layer and a full one, in eager attention, whose attention sinks train or are
    frozen (as LoRA leaves them); its attention passes them to flash calls as s_aux, cast to the query's dtype."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=128,
                          hidden_size=64,
                          intermediate_size=32,
                          num_hidden_layers=2,
                          num_attention_heads=4,
                          num_key_value_heads=2,
                          head_dim=head_dim,
                          num_local_experts=4,
                          num_experts_per_tok=2,
                          sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"],
                          attn_implementation="eager")
    model = GptOssForCausalLM(config).to(dtype)
    for layer in model.model.layers:
        # Sinks of both signs and sizes that move each row's normaliser.
        torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
        layer.self_attn.sinks.requires_grad_(not frozen_sinks)
    return model


MODELS = {"mixtral": mixtral_model, "qwen3_moe": qwen3_moe_model}


@contextlib.contextmanager
def logged_messages():
    """The messages DeepSpeed's logger takes at INFO inside the block, in the list it yields, once the block ends."""
    from deepspeed.utils import logger

    records, messages = [], []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
        messages.extend(record.getMessage() for record in records)


def free_port():
    """A TCP port on the loopback that nothing listens on now: a fixed rendezvous port collides with a second run."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def torchrun():
    """The command that starts torch's launcher in this Python: torch's torchrun console script, from next to this
    interpreter (a virtual environment's bin folder), else next to the Python it was made from (a venv made with
    --system-site-packages over a Python that has torch), else from PATH, run by this interpreter whatever its first
    line names, so that the launcher and the ranks it starts (with its sys.executable) import what this process
    imports."""
    folders = [os.path.dirname(sys.executable), os.path.dirname(getattr(sys, "_base_executable", sys.executable))]
    for script in [os.path.join(folder, "torchrun") for folder in folders] + [shutil.which("torchrun")]:
        if script and os.path.isfile(script):
            return [sys.executable, script]
    raise AssertionError(f"no torchrun next to {sys.executable} or on PATH; torch installs it as a console script")


def run_on_two_ranks(script, *args, ranks=2):
    """``script`` with ``args`` under torchrun on two ranks (or ``ranks``) and a free port, outside the caller's
    launcher environment; fails with the end of its output unless it succeeds. Returns the completed process."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    command = [*torchrun(), "--nproc_per_node", str(ranks), "--master_port", free_port()]
    result = subprocess.run([*command, script, *args], env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def reports_of_two_ranks(tmp_path_factory, name, script, *args, ranks=2):
    """Each rank's JSON report (``rank<N>.json``) of ``script`` run with ``args`` by run_on_two_ranks into a folder
    ``name``, once per pytest run: under pytest-xdist, in the run's temporary folder that its workers share, the first
    worker to ask runs the pair under a file lock and the others wait for it and read what it wrote (pytest-xdist's
    way to run a session fixture once), where a module-scoped fixture would start the pair again in each worker that
    takes one of the module's tests."""
    import json

    from filelock import FileLock

    shared = os.environ.get("PYTEST_XDIST_WORKER") is not None
    folder = (tmp_path_factory.getbasetemp().parent if shared else tmp_path_factory.getbasetemp()) / name
    with FileLock(f"{folder}.lock"):
        if not (folder / "done").is_file():
            folder.mkdir(exist_ok=True)
            run_on_two_ranks(script, str(folder), *args, ranks=ranks)
            (folder / "done").touch()
    found = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    assert sorted(report["rank"] for report in found) == list(range(ranks))
    return found


def every_n_layers(model, every_n_layers, use_reentrant=True):
    """Hugging Face checkpointing on every ``every_n_layers``-th decoder layer from the first, in training mode."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    return model.train()


def checkpointed(model, use_reentrant=True, **checkpoint_kwargs):
    kwargs = {"use_reentrant": use_reentrant, **checkpoint_kwargs}
    # transformers 5.23 renamed gradient_checkpointing_enable, keeping the old name as a deprecated alias.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def batch_ids(seed=1, batch=2, sequence=32):
    return torch.randint(0, 128, (batch, sequence), generator=torch.Generator().manual_seed(seed))


def param_grads(model):
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), param_grads(model)


def stashed_train_step(model, handle, ids):
    """train_step, checking that every stashed layer keeps its output until its recompute takes it."""
    model.zero_grad(set_to_none=True)
    served = handle.recomputes_served
    loss = model(input_ids=ids, labels=ids).loss
    assert handle.num_kept == len(handle.layers)
    loss.backward()
    assert handle.num_kept == 0 and handle.recomputes_served == served + len(handle.layers)
    return loss.detach(), param_grads(model)


def assert_stashed_step_is_stock(install, model, num_layers=NUM_LAYERS, ids=None):
    """A stock step of ``model``, then a stashed one on its last ``num_layers`` attention layers: the same loss and
    gradients, bitwise, every stashed layer served. Returns the handle."""
    ids = batch_ids() if ids is None else ids
    expected_loss, expected = train_step(model, ids)
    handle = install(model, num_layers)
    loss, grads = stashed_train_step(model, handle, ids)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    return handle


def counted_step(model, inputs, op_name=None, whole_step=False):
    """A training step on ``inputs``: its loss, the parameters' gradients, and the op calls CountOps(op_name) counts
    in its backward, or in the whole step with ``whole_step``."""
    model.zero_grad(set_to_none=True)
    counter = CountOps(op_name)
    with counter if whole_step else contextlib.nullcontext():
        loss = model(**inputs).loss
    with counter:
        loss.backward()
    return loss.detach(), param_grads(model), counter.calls


def assert_served_as_plain(model, num_layers, install, **inputs):
    """A step of ``model`` without and then with the stash on its last ``num_layers`` layers: the same loss and
    gradients, bitwise, no attention forward kernel in the stashed layers' recomputes, each of them served."""
    expected_loss, expected, plain_calls = counted_step(model, inputs)
    handle = install(model, num_layers)
    loss, grads, calls = counted_step(model, inputs)
    # A policy that keeps the kernel leaves none to skip.
    assert calls[CPU_FORWARD] == max(plain_calls[CPU_FORWARD] - num_layers, 0)
    assert (handle.recomputes_served, handle.num_kept, handle.released_without_backward) == (num_layers, 0, 0)
    assert torch.equal(loss, expected_loss)
    assert_same_grads(grads, expected)
    return handle, plain_calls, calls


def assert_same_grads(grads, expected):
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name


class CountOps(TorchDispatchMode):
    """Counts op calls by the name ``op_name(op)`` gives each (an op it gives None is not counted); without
    ``op_name``, every aten call by its overload's name ("mm.default"). CPU backward runs on the calling thread, so it
    sees the recompute too. Also notes the key heads of CPU flash attention's forwards."""

    def __init__(self, op_name=None):
        super().__init__()
        self.op_name = op_name or (lambda func: func.__name__)
        self.calls = Counter()
        self.key_heads = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self.op_name(func)
        if name is not None:
            self.calls[name] += 1
        if func.__name__ == CPU_FORWARD:
            self.key_heads.add(args[1].shape[1])
        return func(*args, **(kwargs or {}))


def graph_nodes(node):
    """The names of the autograd nodes reachable from ``node``, each node once."""
    seen, names, pending = set(), [], [node]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        pending += [inner for inner, _ in node.next_functions]
    return names


def tensors():
    """Every tensor object alive after a collection."""
    gc.collect()
    # type() rather than isinstance(): the latter reads __class__, which some deprecated objects warn about.
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


def live_tensors(before=(), model=None, *gradients, counted=None):
    """(shape, dtype), sorted, of the tensors alive after a collection that ``counted`` takes (all without it), but
    for those in ``before`` (a tensors() list, which holds them so that no new tensor takes one's id), ``model``'s
    parameters, their gradients and its buffers, and the values of the ``gradients`` dicts: what a step left."""
    owned = {id(tensor) for tensor in before}
    if model is not None:
        owned.update(id(tensor) for param in model.parameters() for tensor in (param, param.grad))
        owned.update(id(buffer) for buffer in model.buffers())
    owned.update(id(grad) for grads in gradients for grad in grads.values())
    return sorted((tuple(obj.shape), str(obj.dtype)) for obj in tensors()
                  if id(obj) not in owned and (counted is None or counted(obj)))


def live_checkpoint_calls():
    """The stash's per-call objects alive now: each holds what its first pass kept, until its recompute takes it."""
    from deepspeed.runtime.activation_checkpointing.attention_stash import _CheckpointCall

    gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) is _CheckpointCall]


def bare_call(function, implementation="sdpa"):
    """A checkpoint call object of a stash on a stand-in layer, whose layer function is ``function``: each call of it
    is a pass. Returns it and the stash's counters."""
    from deepspeed.runtime.activation_checkpointing import attention_stash

    counters = attention_stash._Counters()
    layer = torch.nn.Linear(1, 1)
    # As a decoder layer with checkpointing enabled (GradientCheckpointingLayer's attribute), read by the stash.
    layer.gradient_checkpointing = True
    plan = types.SimpleNamespace(name="attention",
                                 layer=layer,
                                 config=types.SimpleNamespace(_attn_implementation=implementation),
                                 implementation=implementation)
    stash = attention_stash._LayerStash(plan, layer, counters)
    return attention_stash._CheckpointCall(stash, function), counters


def kept_outputs():
    """The attention outputs kept now, across all stashes, in the order of their layers' names (gc lists objects in no
    set order); each layer's in the order of its calls."""
    calls = sorted(live_checkpoint_calls(),
                   key=lambda call: [(int(part), "") if part.isdigit() else (-1, part)
                                     for part in call.stash.name.split(".")])
    return [entry.output for call in calls for entry in call.kept if entry is not None]


def assert_stock_process():
    """Nothing of the stash is left in the process: the sdpa entry and the layer class are transformers' own."""
    from deepspeed.runtime.activation_checkpointing import attention_stash

    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is STOCK_SDPA and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert AttentionInterface._global_mapping["sdpa"] is STOCK_SDPA
    assert AttentionInterface._global_mapping["flash_attention_2"] is STOCK_FLASH
    assert "flash_attention_2" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert "_gradient_checkpointing_func" not in GradientCheckpointingLayer.__dict__
    assert not attention_stash._STASHES and not attention_stash._LAYER_STASHES and attention_stash._held is None


def bound_arguments(function, args, kwargs):
    """One call's arguments by parameter name, defaults filled in, whatever the form of the call (positional or by
    keyword): for a plain function by its signature, for a torch op (an op packet, a custom op, whose own signature is
    (*args, **kwargs)) by its schema."""
    op = getattr(function, "_opoverload", None) or getattr(function, "default", None)
    if op is None:
        bound = inspect.signature(function).bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)
    values = dict(zip((argument.name for argument in op._schema.arguments), args), **kwargs)
    for argument in op._schema.arguments:
        if argument.name not in values:
            assert argument.has_default_value(), f"{op} called without {argument.name}"
            values[argument.name] = argument.default_value
    return values


def same_value(ours, theirs):
    """Whether two arguments are the same: tensors of one shape and dtype, equal; anything else of one type, equal."""
    if isinstance(theirs, torch.Tensor) or isinstance(ours, torch.Tensor):
        return (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor) and ours.shape == theirs.shape
                and ours.dtype == theirs.dtype and torch.equal(ours, theirs))
    return type(ours) is type(theirs) and ours == theirs


def assert_same_calls(ours, theirs):
    """The same kernel functions called with the same value for every parameter (bound_arguments' records, defaults
    filled in); dq, dk and dv, buffers the kernel fills, empty_like the (padded) query, key and value, by shape and
    dtype."""
    assert [name for name, _ in ours] == [name for name, _ in theirs]
    for (name, mine), (_, their) in zip(ours, theirs):
        assert list(mine) == list(their), name
        for parameter, value in their.items():
            if parameter in ("dq", "dk", "dv"):
                assert (mine[parameter].shape, mine[parameter].dtype) == (value.shape, value.dtype), (name, parameter)
            else:
                assert same_value(mine[parameter], value), (name, parameter)


# The fused CPU attention op, whose forwards the compiled tests count in graphs.
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class Graphs:
    """A torch.compile backend, AOTAutograd with the min-cut partitioner running the graphs eagerly, that keeps the
    forward and backward graphs it compiles."""

    def __init__(self):
        self.forward, self.backward = [], []

    def __call__(self, graph_module, example_inputs):
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def keep(graphs):

            def compiler(graph, inputs):
                graphs.append(graph)
                return make_boxed_func(graph.forward)

            return compiler

        return aot_autograd(fw_compiler=keep(self.forward),
                            bw_compiler=keep(self.backward),
                            partition_fn=min_cut_rematerialization_partition)(graph_module, example_inputs)


def attention_forwards(graphs, op=CPU_FLASH.default):
    """The attention forwards (``op``, the fused CPU one by default) the graphs run: the op itself, or inside
    AOTAutograd's rng-state wrapper (torch 2.13 and 2.14 wrap the CPU one in checkpointed regions,
    ``run_with_rng_state`` in a backward graph)."""
    wrappers = {
        getattr(torch.ops.higher_order, name, None)
        for name in ("run_with_rng_state", "run_and_save_rng_state")
    }
    return sum(1 for graph in graphs for node in graph.graph.nodes
               if node.target is op or (node.target in wrappers and op in node.args))


def deepspeed_config(stage=0, bf16=False, accumulation=1, **extra):
    """A DeepSpeed config for the CPU tests: AdamW (torch's), ZeRO ``stage``, micro-batch 2."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
        **extra,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


class UnsynchronizedCPU:
    """DeepSpeed's CPU accelerator (deepspeed/accelerator/cpu_accelerator.py, DeepSpeed 0.19.8) as DeepSpeed's offload
    modules see it in offload_copies_on_cpu: the accelerator itself in every respect the offload engine reads (Stream
    and current_stream None: no streams; on_accelerator true for a CPU tensor; pin_memory the accelerator's, which
    returns the tensor on CPU) but is_synchronized_device, which answers False, so that the engine copies; and it
    records the host buffers it pins. test_attention_stash_offload.py pins that shape."""

    def __init__(self, accelerator, pinned):
        self._accelerator, self._pinned = accelerator, pinned

    def is_synchronized_device(self):
        return False

    def pin_memory(self, tensor, *args, **kwargs):
        self._pinned[tensor.untyped_storage().data_ptr()] = tensor
        return self._accelerator.pin_memory(tensor, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def offload_copies_on_cpu(pinned):
    """A context in which DeepSpeed's offload engines copy on CPU, where DeepSpeed's CPU accelerator, a synchronized
    device, has them copy nothing: its offload modules (offload_activations.py, checkpointing.py's cpu_checkpointing)
    see an UnsynchronizedCPU, which records each host buffer pinned in ``pinned`` (a dict, by storage pointer; held,
    so that no other tensor takes one's address); only they, since ZeRO-3, for one, records streams on an
    unsynchronized device. torch's save_on_cpu (transformers' offload=True) pins where torch.cpu.is_available(), which
    a CPU-only build cannot: turned off. DeepSpeed's shared cpu_checkpointing engine is made anew inside, dropped
    after."""
    from unittest import mock

    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing import checkpointing, offload_activations

    accelerator = UnsynchronizedCPU(get_accelerator(), pinned)
    stack = contextlib.ExitStack()
    for module in (offload_activations, checkpointing):
        stack.enter_context(mock.patch.object(module, "get_accelerator", lambda: accelerator))
    stack.enter_context(mock.patch.object(torch.cpu, "is_available", lambda: False))
    stack.enter_context(mock.patch.object(checkpointing, "_cpu_offload_engine", None))
    return stack
