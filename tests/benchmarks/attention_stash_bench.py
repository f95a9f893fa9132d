# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Benchmark of the attention stash against plain recompute and TRL's selective activation checkpointing.

Trains a Hugging Face Qwen3-MoE model built from a config (no download) through a DeepSpeed engine with per-layer
checkpointing, in one process, arm after arm: plain reentrant recompute, the stash on half and on all layers, plain
non-reentrant recompute and the stash on all layers under it, and TRL's selective activation checkpointing
(``gradient_checkpointing_kwargs={"selective": True}``: TRL's own where it is installed), which saves the attention
kernels' outputs. The arms run in order, then in reverse, to
expose drift. Every run starts from the same weights and optimizer state and trains on the same batches, so the losses
of all arms must agree.

The op-level gate times the attention forward kernel at the model's shapes: the most the stash can save per stashed
layer and micro-batch. The table printed last is what a reviewer pastes into a pull request.

With --compile the model runs under torch.compile, as one pair of arms: non-reentrant recompute against the stash on
every attention layer, whose compiled graph saves the SDPA kernel's outputs instead of recomputing them.

With --offload, four arms instead, all reentrant: plain recompute, the same with the checkpoints' inputs offloaded
to pinned host memory (transformers' activation_checkpointing_enable(offload=True), or DeepSpeed's
CheckpointHiddenStatesOffload around each step), the stash on every attention layer, and the stash with that offload,
whose kept outputs follow the inputs to the host (install_attention_stash's offload=None). It prints whether the stash
with offload peaks within one layer's kept bytes of the offload alone, and steps within 2% of the stash alone. On CPU
DeepSpeed's offload engine copies nothing (a synchronized device): the arms run, no byte moves.

    python tests/benchmarks/attention_stash_bench.py                       # CPU default, a few minutes on 2 cores
    python tests/benchmarks/attention_stash_bench.py --preset qwen3-30b-a3b # one GPU, Qwen3-30B-A3B attention shapes
    python tests/benchmarks/attention_stash_bench.py --compile             # compiled: aot_eager, or inductor on a GPU
"""

import argparse
import contextlib
import copy
import functools
import inspect
import json
import os
import socket
import statistics
import sys
import threading
import time
import warnings
import weakref

import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

# Attention is a large share of a CPU step only at long sequences; GQA as in Qwen3-MoE.
_CPU = dict(device="cpu",
            dtype="float32",
            layers=4,
            sequence=2048,
            micro_batch=1,
            hidden=256,
            heads=8,
            kv_heads=2,
            head_dim=64,
            experts=4,
            top_k=2,
            moe_intermediate=128,
            vocab=1024,
            warmup=1,
            steps=8)
PRESETS = {
    "cpu":
    _CPU,
    # A hybrid, Qwen3-Next-shaped: three gated-delta-net (linear attention) layers per full-attention layer, so the
    # stash serves a quarter of the layers; the saving is per stashed attention layer. The CPU preset's shapes.
    "qwen3-next-cpu":
    dict(_CPU, model="qwen3_next", layers=8),
    # Qwen3-30B-A3B's attention (32 query heads, 4 key/value heads, head dim 128, hidden 2048) at its training shape,
    # with fewer layers and experts to fit one GPU.
    "qwen3-30b-a3b":
    dict(device="cuda",
         dtype="bfloat16",
         layers=8,
         sequence=4096,
         micro_batch=4,
         hidden=2048,
         heads=32,
         kv_heads=4,
         head_dim=128,
         experts=16,
         top_k=8,
         moe_intermediate=768,
         vocab=32768,
         warmup=2,
         steps=6),
    # Llama-8B's attention (32 query heads, 8 key/value heads, head dim 128, hidden 4096) in two dense layers, for
    # long sequences on one GPU: gpu_check.sh long sweeps it over 8k, 16k and 32k tokens.
    "llama-8b-long":
    dict(device="cuda",
         dtype="bfloat16",
         model="llama",
         layers=2,
         sequence=8192,
         micro_batch=1,
         hidden=4096,
         heads=32,
         kv_heads=8,
         head_dim=128,
         intermediate=14336,
         experts=1,
         top_k=1,
         moe_intermediate=1,
         vocab=32768,
         warmup=1,
         steps=3),
    # The same model at tiny shapes on CPU: the GPU check's dry run of its long-sequence leg.
    "llama-long-cpu":
    dict(device="cpu",
         dtype="float32",
         model="llama",
         layers=2,
         sequence=64,
         micro_batch=1,
         hidden=64,
         heads=4,
         kv_heads=2,
         head_dim=16,
         intermediate=128,
         experts=1,
         top_k=1,
         moe_intermediate=1,
         vocab=128,
         warmup=1,
         steps=1),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for name in ("layers", "micro_batch", "warmup", "steps", "experts"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="overrides the preset")
    parser.add_argument("--sequence",
                        type=_lengths,
                        metavar="N[,N...]",
                        help="overrides the preset; several lengths, comma-separated, sweep them: plain recompute "
                        "against the stash on every attention layer at each length")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="overrides the preset")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="overrides the preset; must be DeepSpeed's")
    parser.add_argument("--autoep", action="store_true", help="AutoEP (autoep_size 1); needs transformers <= 5.22")
    parser.add_argument(
        "--pad-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="pad each row of the batch: row i of n has its last F*(i+1)/n of positions padded, so the "
        "attention runs with a padding mask")
    parser.add_argument("--no-sac",
                        action="store_true",
                        help="skip the selective activation checkpointing arm and its non-reentrant control")
    parser.add_argument("--sequence-parallel",
                        action="store_true",
                        help="under torchrun with N ranks: DeepSpeed's Ulysses sequence parallelism (ALST) over them, "
                        "each rank training 1/N of each sequence; sweeps --sequence (plain against the stash)")
    parser.add_argument("--compile",
                        nargs="?",
                        const="",
                        metavar="BACKEND",
                        help="run the model compiled (torch.compile through the engine, dynamic=False): non-reentrant "
                        "recompute against the stash on every attention layer, both compiled; BACKEND defaults to "
                        f"{_COMPILE_BACKENDS['cuda']} on cuda and {_COMPILE_BACKENDS['cpu']} on cpu")
    parser.add_argument("--offload",
                        nargs="?",
                        const="auto",
                        choices=("auto", ) + OFFLOAD_ROUTES,
                        help="the offload arms: plain recompute, the checkpoints' inputs offloaded, the stash, the "
                        "stash with the offload; ROUTE transformers (activation_checkpointing_enable(offload=True): "
                        "save_on_cpu, transformers >= 5.23 on an accelerator) or deepspeed "
                        "(CheckpointHiddenStatesOffload); auto: transformers where it can, else deepspeed")
    parser.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of step time and peak memory (needs matplotlib)")
    args = parser.parse_args(argv)
    settings = dict(PRESETS[args.preset])
    for name in ("layers", "micro_batch", "warmup", "steps", "experts", "dtype", "device"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    settings["sequences"] = args.sequence or [settings["sequence"]]
    settings["sequence"] = settings["sequences"][0]
    settings["top_k"] = min(settings["top_k"], settings["experts"])
    settings["compile"] = None
    settings["offload"] = None
    if args.offload is not None:
        if args.compile is not None or args.sequence_parallel or args.autoep or len(settings["sequences"]) > 1:
            parser.error("--offload takes no --compile, --sequence-parallel or --autoep, and one --sequence length")
        settings["offload"], why = offload_route(args.offload, settings["device"])
        if settings["offload"] is None:
            parser.error(f"--offload {args.offload}: {why}")
        settings["offload_why"] = why
    if args.compile is not None:
        settings["compile"] = args.compile or _COMPILE_BACKENDS[settings["device"]]
        # The first step of each compiled run compiles, the second measures memory: neither is timed.
        if args.warmup is not None and args.warmup < 2:
            parser.error("--compile needs at least 2 warm-up steps: the first compiles, the second measures memory")
        settings["warmup"] = max(settings["warmup"], 2)
        if args.sequence_parallel or args.autoep:
            parser.error("--compile takes no --sequence-parallel and no --autoep: the stash's compiled path serves "
                         "sdpa layers (not ALST's), and AutoEP needs transformers <= 5.22, whose Qwen3-MoE block "
                         "breaks dynamo's graph inside the checkpointed layer")
    if attention_layers(settings) < 2 or settings["steps"] < 1 or settings["warmup"] < 1:
        parser.error("needs at least 2 attention layers, 1 warm-up step and 1 timed step")
    if not 0.0 <= args.pad_fraction < 1.0:
        parser.error("needs --pad-fraction from 0 up to, not including, 1")
    settings["pad_fraction"] = args.pad_fraction
    settings["sequence_parallel"] = int(os.environ.get("WORLD_SIZE", "1")) if args.sequence_parallel else 1
    if args.sequence_parallel:
        if settings["sequence_parallel"] < 2:
            parser.error("--sequence-parallel needs 2 or more ranks: start it with torchrun --nproc_per_node N")
        if args.pad_fraction or args.autoep:
            parser.error("--sequence-parallel takes no --pad-fraction (ALST drops masks) and no --autoep")
        if any(sequence % settings["sequence_parallel"] for sequence in settings["sequences"]):
            parser.error(f"--sequence-parallel needs sequences divisible by the {settings['sequence_parallel']} ranks")
    return args, settings


# torch.compile's backend for --compile without one: Inductor on a GPU; on a CPU AOTAutograd running its graphs
# eagerly, which compiles in seconds (Inductor's C++ takes minutes on 2 cores) and partitions by the same policies.
_COMPILE_BACKENDS = {"cuda": "inductor", "cpu": "aot_eager"}


def _lengths(text):
    """A comma-separated list of sequence lengths, each positive."""
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs whole numbers separated by commas, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"needs positive lengths, got {text!r}")
    return lengths


# --offload's ways to offload the checkpoints' inputs: transformers' own (torch's save_on_cpu around each checkpoint)
# and DeepSpeed's CheckpointHiddenStatesOffload around each step.
OFFLOAD_ROUTES = ("transformers", "deepspeed")


def offload_route(requested, device):
    """The route --offload REQUESTED takes on DEVICE, and why; (None, why) where it cannot. transformers' offload=True
    came with activation_checkpointing_enable (5.23) and pins host memory, which needs an accelerator."""
    import transformers

    enable = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None)
    if enable is None or "offload" not in inspect.signature(enable).parameters:
        lacking = f"is not in transformers {transformers.__version__} (5.23 added it)"
    elif device == "cpu":
        lacking = "pins host memory, which a CPU run cannot"
    else:
        lacking = None
    if requested == "deepspeed":
        return "deepspeed", "asked for"
    if lacking is None:
        return "transformers", "asked for" if requested == "transformers" else "transformers offers it here"
    why = f"transformers' offload=True {lacking}"
    return (None, why) if requested == "transformers" else ("deepspeed", why)


def offload_title(settings):
    """What the offload arms offload the checkpoints' inputs with, in words."""
    if settings["offload"] == "transformers":
        route = "transformers' activation_checkpointing_enable(offload=True), torch's save_on_cpu per checkpoint"
    else:
        route = "DeepSpeed's CheckpointHiddenStatesOffload around each step"
    return f"{route} ({settings['offload_why']})"


def _init_deepspeed(device):
    import deepspeed.runtime.activation_checkpointing as activation_checkpointing

    # Run this tree's module, not an older installed copy.
    tree = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deepspeed",
                        "runtime", "activation_checkpointing")
    if os.path.isfile(os.path.join(tree, "attention_stash.py")) and tree not in activation_checkpointing.__path__:
        activation_checkpointing.__path__.insert(0, tree)
    for variable, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(variable, default)
    if "MASTER_PORT" not in os.environ:
        # A free port: a fixed one collides with a second run on the machine.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != device:
        sys.exit(
            f"attention_stash_bench needs DeepSpeed's accelerator to be the benchmark's device, got {accelerator} "
            f"for --device {device}. Set DS_ACCELERATOR={device} or pass --device {accelerator}.")
    return deepspeed


# A hybrid preset's layers: this many linear-attention layers before each full-attention layer.
_LINEAR_PER_FULL = 3


def attention_layers(settings):
    """The layers the stash can serve: every layer, or a hybrid's full-attention layers."""
    return settings["layers"] // (_LINEAR_PER_FULL +
                                  1) if settings.get("model") == "qwen3_next" else settings["layers"]


def build_model(settings):
    import transformers

    shared = dict(vocab_size=settings["vocab"],
                  hidden_size=settings["hidden"],
                  intermediate_size=settings["moe_intermediate"] * 2,
                  moe_intermediate_size=settings["moe_intermediate"],
                  num_hidden_layers=settings["layers"],
                  num_attention_heads=settings["heads"],
                  num_key_value_heads=settings["kv_heads"],
                  head_dim=settings["head_dim"],
                  num_experts=settings["experts"],
                  num_experts_per_tok=settings["top_k"],
                  max_position_embeddings=settings["sequence"],
                  attn_implementation="sdpa")
    if settings.get("compile"):
        # Else Hugging Face's warning that checkpointing turns the cache off (a logger call) breaks dynamo's graph.
        shared["use_cache"] = False
    if settings.get("model") == "qwen3_next":
        pattern = ["linear_attention"] * _LINEAR_PER_FULL + ["full_attention"]
        model_class = transformers.Qwen3NextForCausalLM
        config = transformers.Qwen3NextConfig(**shared,
                                              shared_expert_intermediate_size=settings["moe_intermediate"],
                                              linear_num_key_heads=settings["kv_heads"],
                                              linear_num_value_heads=settings["heads"],
                                              linear_key_head_dim=settings["head_dim"],
                                              linear_value_head_dim=settings["head_dim"],
                                              layer_types=[
                                                  pattern[index % len(pattern)] for index in range(settings["layers"])
                                              ])
    elif settings.get("model") == "llama":
        model_class = transformers.LlamaForCausalLM
        config = transformers.LlamaConfig(**{**shared, "intermediate_size": settings["intermediate"]})
    else:
        model_class, config = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(**shared)
    torch.manual_seed(0)
    # Built on its device: initializing the GPU preset's weights on the CPU would take longer than the benchmark.
    with torch.device(settings["device"]):
        return model_class(config).to(getattr(torch, settings["dtype"]))


# The fused SDPA forward kernels: what TRL's selective checkpointing saves, and the attention forwards the benchmark
# counts in a backward.
_SDPA_FORWARDS = {
    getattr(torch.ops.aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)
}


def _selective_policy(ctx, op, *args, **kwargs):
    """TRL's selective-checkpointing policy, written out for where TRL is not installed (TRL 1.16,
    trl/models/selective_activation_checkpointing.py): MUST_SAVE the fused SDPA ops and any op whose name holds
    "flash_attn", PREFER_RECOMPUTE the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = op in _SDPA_FORWARDS or "flash_attn" in str(op)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


class _AttentionForwards(TorchDispatchMode):
    """Counts the fused SDPA forward kernels run under it (the autograd engine carries it to its device threads): in a
    backward, the attention forwards its recomputes run. Python runs on every op, so only an untimed step counts."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in _SDPA_FORWARDS
        return func(*args, **(kwargs or {}))


def selective_checkpointing(model, kwargs):
    """Per-layer checkpointing as TRL's ``gradient_checkpointing_kwargs={"selective": True}`` sets it: selective
    activation checkpointing whose policy saves the attention kernels' outputs, on non-reentrant checkpointing, the one
    mode it has. TRL's own enable_selective_activation_checkpointing where TRL is installed, else its policy written
    out here; returns which, in words."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    try:
        import trl
        from trl.models import enable_selective_activation_checkpointing
    except ImportError:
        _checkpointing(
            model, {
                **kwargs, "context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            })
        return "TRL's policy written out (TRL is not installed)"
    # TRL wraps the model's gradient_checkpointing_enable (the deprecated alias of activation_checkpointing_enable from
    # transformers 5.23), which sets the policy and use_reentrant=False; the wrapper goes once it has.
    enable_selective_activation_checkpointing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    del model.gradient_checkpointing_enable
    return f"TRL {trl.__version__}'s enable_selective_activation_checkpointing"


def _checkpointing(model, kwargs, offload=False):
    # transformers 5.23 renamed gradient_checkpointing_enable, keeping the old name as a deprecated alias; offload only
    # the new name takes (offload_route checks).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_disable()
        extra = {"offload": True} if offload else {}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
    else:
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# The arms whose checkpoints offload their inputs (--offload), and the stash among them.
OFFLOAD_KINDS = ("offload", "stash_offload")


def set_checkpointing(model, kind, compiled=False, offload=None):
    """Per-layer checkpointing: reentrant for the stash, plain and offload arms, non-reentrant for the others (TRL's
    selective checkpointing for the selective arm); non-reentrant for every arm ``compiled`` (dynamo traces every
    checkpoint as non-reentrant; the stash refuses reentrant ones). The offload arms on the transformers route
    (``offload``) offload each checkpoint's inputs (save_on_cpu); on the deepspeed route run_arm does. Returns the
    selective arm's source, else None."""
    kwargs = {"use_reentrant": kind in ("plain", "stash") + OFFLOAD_KINDS and not compiled}
    if kind == "selective":
        source = selective_checkpointing(model, kwargs)
    else:
        source = _checkpointing(model, kwargs, offload=kind in OFFLOAD_KINDS and offload == "transformers")
    model.train()
    return source


class _PeakRss:
    """Samples the process's resident set size; on CPU the allocator's caching blurs it, so it is reported as is."""

    def __init__(self):
        import psutil

        self._process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(0.002)

    def __enter__(self):
        self.peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class _LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created during a step and still alive: CPU's stand-in for CUDA's max allocated.

    Every aten op's outputs are counted once per storage until the last tensor on that storage is freed. Tensors made
    before the step (parameters, optimizer state, the batch) are not counted. Python runs on every op, so only an
    untimed step runs under it.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages = {}  # data pointer -> [bytes, tensors alive on it]

    def _release(self, pointer):
        entry = self._storages[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[pointer]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer == 0:
                continue
            entry = self._storages.setdefault(pointer, [storage.nbytes(), 0])
            if entry[1] == 0:
                self.live += entry[0]
                self.peak = max(self.peak, self.live)
            entry[1] += 1
            weakref.finalize(tensor, self._release, pointer)
        return out


def _synchronized_accelerator():
    """Whether DeepSpeed's accelerator runs synchronized (the CPU's): its offload engine then copies nothing."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_synchronized_device()


def _synchronize(device):
    if device == "cuda":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()


def attention_forward_ms(settings, padding=None, repeats=7):
    """The op-level gate: the attention forward the recompute runs, at the model's shapes, as F.sdpa dispatches it.

    With ``padding`` (a batch's attention_mask), as Hugging Face calls it for a padded batch: a boolean causal mask
    that also masks the padded keys, and key/value heads repeated to the query heads. Returns the median time in
    milliseconds, the SDPA backend PyTorch chose, which the stash replays, and the quartiles of the times.
    """
    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    generator = torch.Generator(device=device).manual_seed(0)
    key_heads = settings["kv_heads"] if padding is None else settings["heads"]

    def projected(heads):
        # Laid out as Hugging Face's attention passes them: a projection's output viewed per head and transposed.
        shape = (settings["micro_batch"], settings["sequence"], heads, settings["head_dim"])
        return torch.randn(shape, device=device, dtype=dtype, generator=generator).transpose(1, 2).requires_grad_()

    query, key, value = projected(settings["heads"]), projected(key_heads), projected(key_heads)
    arguments = dict(attn_mask=None, is_causal=True, enable_gqa=True)
    if padding is not None:
        causal = torch.ones(settings["sequence"], settings["sequence"], dtype=torch.bool, device=device).tril()
        mask = causal[None, None] & padding.bool()[:, None, None, :]
        arguments = dict(attn_mask=mask, is_causal=False, enable_gqa=False)
    choice = torch._fused_sdp_choice(query,
                                     key,
                                     value,
                                     arguments["attn_mask"],
                                     0.0,
                                     arguments["is_causal"],
                                     enable_gqa=arguments["enable_gqa"])
    backend = next(name for name, member in SDPBackend.__members__.items() if member.value == choice)
    times = []
    for _ in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        # With inputs that require grad, as in the recompute, so the kernel computes its log-sum-exp too.
        torch.nn.functional.scaled_dot_product_attention(query, key, value, **arguments)
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:]), backend, _quartiles(times[1:])


def make_batches(settings, count):
    """The same batches for every arm; with a pad fraction, rows padded at their ends and labels -100 there."""
    generator = torch.Generator().manual_seed(1)
    rows, sequence = settings["micro_batch"], settings["sequence"]
    batches = []
    for _ in range(count):
        ids = torch.randint(0, settings["vocab"], (rows, sequence), generator=generator)
        batch = {"input_ids": ids, "labels": ids}
        if settings["pad_fraction"]:
            mask = torch.ones_like(ids)
            for row in range(rows):
                mask[row, sequence - int(settings["pad_fraction"] * sequence * (row + 1) / rows):] = 0
            batch.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        batches.append({name: tensor.to(settings["device"]) for name, tensor in batch.items()})
    return batches


def forward_loss(engine, batch):
    """The training loss of a batch: Hugging Face's, or under sequence parallelism the rank's shard's, from labels
    shifted over the whole sequence, as ALST recipes compute it."""
    if "shift_labels" not in batch:
        return engine(**batch).loss
    logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["shift_labels"].flatten())


def shard_batches(batches, rank, ranks):
    """Each batch's share of one rank of Ulysses sequence parallelism: its slice of the sequence, with the positions
    and the labels shifted over the whole sequence."""
    shards = []
    for batch in batches:
        ids = batch["input_ids"]
        length = ids.shape[1] // ranks
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        piece = slice(rank * length, (rank + 1) * length)
        shards.append({
            "input_ids": ids[:, piece],
            "position_ids": positions[:, piece],
            "shift_labels": shifted[:, piece]
        })
    return shards


def _compiling(settings):
    """Where the arms run compiled: dynamo traces the layers' checkpoints although kernels >= 0.18's wrapper of Hugging
    Face's attention forward sets a context variable inside them, which the recompute may skip (it leaves nothing)."""
    if not settings.get("compile"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def run_arm(engine, initial, batches, settings, arm):
    from deepspeed.runtime.activation_checkpointing.attention_stash import install_attention_stash

    device, compiled = settings["device"], settings.get("compile")
    model = engine.module
    engine.module.load_state_dict(initial["module"])
    engine.optimizer.load_state_dict(copy.deepcopy(initial["optimizer"]))
    selective_source = set_checkpointing(model, arm["kind"], compiled, settings.get("offload"))
    handle = install_attention_stash(model, arm["stashed"]) if arm["stashed"] else None
    if compiled:
        # Each compiled run compiles its own graphs in its first step, with its stash installed before.
        torch._dynamo.reset()
    # The step that measures memory: the first, or compiled the second, after the compile.
    measured = 1 if compiled else 0
    times, losses, peak_live, peak_rss, kept, compiled_layers = [], [], None, None, 0, []
    # The offload arms on the deepspeed route: DeepSpeed's offload of the checkpoints' inputs around each step, whose
    # engine the stash's kept outputs go through too.
    if arm["kind"] in OFFLOAD_KINDS and settings.get("offload") == "deepspeed":
        from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
        offload = CheckpointHiddenStatesOffload()
    else:
        offload = contextlib.nullcontext()
    # What each recompute runs, counted in the first step where it is untimed; compiled, the graphs say it instead.
    counted, in_backward = not compiled and settings["warmup"] > 0, None
    try:
        with _compiling(settings):
            for index, batch in enumerate(batches):
                if device == "cuda" and index == measured:
                    torch.cuda.reset_peak_memory_stats()  #ignore-cuda
                # On CPU an untimed step measures memory: live tensor bytes and the process's resident set. Not live
                # bytes compiled: under their dispatch mode dynamo would run the frames eagerly.
                measure = device == "cpu" and index == measured
                live = _LiveTensorBytes() if measure and not compiled else contextlib.nullcontext()
                rss = _PeakRss() if measure else contextlib.nullcontext()
                _synchronize(device)
                start = time.perf_counter()
                forwards = _AttentionForwards() if counted and index == 0 else contextlib.nullcontext()
                with rss, live:
                    with offload:
                        loss = forward_loss(engine, batch)
                        with forwards:
                            engine.backward(loss)
                    engine.step()
                if counted and index == 0:
                    in_backward = forwards.calls
                _synchronize(device)
                elapsed = (time.perf_counter() - start) * 1e3
                losses.append(loss.item())
                if measure:
                    peak_live, peak_rss = getattr(live, "peak", None), rss.peak
                if index >= settings["warmup"]:
                    times.append(elapsed)
                if handle is not None and handle.num_kept:
                    raise RuntimeError(f"{handle.num_kept} stashed outputs left after the backward")
        # A silent fallback would time plain recompute under the stash's name. Compiled, the stash counts no
        # recompute: its proof is the layers whose compiled checkpoint saved the attention kernel's outputs.
        compiled_layers = list(handle.compiled_layers) if handle is not None else []
        if handle is not None and compiled and tuple(compiled_layers) != handle.layers:
            raise RuntimeError(f"attention_stash_bench needs the compiled graph to save the attention of every "
                               f"stashed layer of {arm['label']}, got {len(compiled_layers)} of {len(handle.layers)}.")
        if handle is not None and not compiled and handle.recomputes_served != arm["stashed"] * len(batches):
            raise RuntimeError(f"attention_stash_bench needs the stash to serve every recompute of {arm['label']}, "
                               f"got {handle.recomputes_served} of {arm['stashed']} layers x {len(batches)} steps.")
        # Likewise a stash with offload that kept its outputs on an accelerator, or did not take back all it handed
        # over, would time the stash alone under the offload's name. On CPU DeepSpeed's engine moves nothing.
        if arm["kind"] == "stash_offload" and not _synchronized_accelerator() and (
                handle.offloaded_bytes == 0 or handle.restored_bytes != handle.offloaded_bytes):
            raise RuntimeError(f"attention_stash_bench needs {arm['label']} to offload its kept outputs and take all "
                               f"of them back, got {handle.offloaded_bytes:,} B offloaded and "
                               f"{handle.restored_bytes:,} B restored.")
        kept = handle.peak_kept_bytes if handle is not None else 0
        # Selective checkpointing saves every attention output, the stash those of its layers: a recompute that runs
        # another attention forward falls back, timed under the arm's name.
        expected = 0 if arm["kind"] == "selective" else attention_layers(settings) - arm["stashed"]
        if in_backward is not None and in_backward != expected:
            raise RuntimeError(f"attention_stash_bench needs {arm['label']} to run {expected} attention forwards in "
                               f"each backward, got {in_backward}: its recompute ran attention it should have saved.")
    finally:
        if handle is not None:
            handle.remove()
        if compiled:
            torch._dynamo.reset()
    return {
        "recomputes_served": handle.recomputes_served if handle is not None else 0,
        "offloaded_bytes": handle.offloaded_bytes if handle is not None else 0,
        "restored_bytes": handle.restored_bytes if handle is not None else 0,
        "compiled_layers": compiled_layers,
        "times_ms": times,
        "median_ms": statistics.median(times),
        "losses": losses,
        "kept_bytes": kept,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,  #ignore-cuda
        "peak_rss_bytes": peak_rss,
        "peak_live_bytes": peak_live,
        "selective_source": selective_source,
        "attention_forwards_in_backward": in_backward,
    }


# Stash arm kinds and the kind of the recompute each replaces.
STASH_KINDS = {"stash": "plain", "stash_nr": "non_reentrant", "stash_offload": "offload"}


def _largest(values):
    values = [value for value in values if value is not None]
    return max(values) if values else None


def _range(values):
    values = [value for value in values if value is not None]
    return [min(values), max(values)] if values else None


def _quartiles(times):
    """First and third quartile of the timed steps: the spread a saving must stand out from."""
    if len(times) < 2:
        return [times[0], times[0]]
    first, _, third = statistics.quantiles(times, n=4, method="inclusive")
    return [first, third]


def verdict(difference, noise, bound=None):
    """The one rule every comparison the benchmark prints is judged by.

    ``noise`` is the wider interquartile range of the two arms compared (for memory, the wider range of their runs),
    in the difference's units. A difference within its noise is UNRESOLVED; so is any difference whose ``bound`` (the
    most it can physically be: the attention forward, for the saving per stashed layer) is within the noise. A
    difference beyond its bound plus the noise is NOISY: the machine moved the timings. Returns None for a result.
    """
    if bound is not None and difference > bound + noise:
        return "NOISY"
    if (noise > 0 and abs(difference) <= noise) or (bound is not None and noise >= bound):
        return "UNRESOLVED"
    return None


def _width(interval):
    low, high = interval
    return high - low


def compare(row, base, key="median_ms"):
    """``row`` against ``base``: the difference of their step-time medians (or of a memory figure, ``key``), its noise
    and the verdict. Relative figures are fractions of ``base``'s value."""
    if key == "median_ms":
        noise = max(_width(row["quartiles_ms"]), _width(base["quartiles_ms"]))
    else:
        noise = max(_width(row[f"{key}_range"]), _width(base[f"{key}_range"]))
    difference = row[key] - base[key]
    return {
        "against": base["label"],
        "difference": difference,
        "noise": noise,
        "relative": difference / base[key],
        "relative_noise": noise / base[key],
        "verdict": verdict(difference, noise),
    }


def summarize(settings, arms, runs, attention_ms):
    by_arm = []
    plain = None
    for arm in arms:
        results = [run for label, run in runs if label == arm["label"]]
        median = statistics.median([t for run in results for t in run["times_ms"]])
        row = {
            **arm,
            "run_medians_ms": [run["median_ms"] for run in results],
            "median_ms":
            median,
            "spread_ms":
            [min(t for run in results for t in run["times_ms"]),
             max(t for run in results for t in run["times_ms"])],
            "quartiles_ms":
            _quartiles([t for run in results for t in run["times_ms"]]),
            # Each device reports its own memory figures; the others are None.
            "peak_allocated_bytes":
            _largest(run["peak_allocated_bytes"] for run in results),
            "peak_rss_bytes":
            _largest(run["peak_rss_bytes"] for run in results),
            "peak_live_bytes":
            _largest(run["peak_live_bytes"] for run in results),
            # The lowest and highest of each memory figure over the arm's runs: its noise.
            **{
                f"{key}_range": _range(run[key] for run in results)
                for key in ("peak_allocated_bytes", "peak_rss_bytes", "peak_live_bytes")
            },
            "kept_bytes":
            max(run["kept_bytes"] for run in results),
            "recomputes_served":
            sum(run["recomputes_served"] for run in results),
            "offloaded_bytes":
            sum(run.get("offloaded_bytes", 0) for run in results),
            "restored_bytes":
            sum(run.get("restored_bytes", 0) for run in results),
            # Compiled, each run's layers whose graph saved the attention kernel's outputs.
            "compiled_layers": [run.get("compiled_layers", []) for run in results],
            "steps_run":
            sum(len(run["losses"]) for run in results),
            "losses": [run["losses"] for run in results],
        }
        # Counted in each run's first step, and checked there.
        row["attention_forwards_in_backward"] = results[0].get("attention_forwards_in_backward")
        if arm["kind"] == "selective":
            row["selective_source"] = results[0]["selective_source"]
        by_arm.append(row)
    # Each stash arm against the recompute it replaces: reentrant for the stash, non-reentrant for its non-reentrant
    # arm.
    baselines = {row["kind"]: row for row in by_arm if row["kind"] in ("plain", "non_reentrant", "offload")}
    plain = baselines["plain"]
    for row in by_arm:
        vs_plain = compare(row, plain)
        row["vs_plain"], row["vs_plain_noise"], row["vs_plain_verdict"] = (vs_plain["relative"],
                                                                           vs_plain["relative_noise"],
                                                                           vs_plain["verdict"])
        if row["kind"] in STASH_KINDS:
            base_row = baselines[STASH_KINDS[row["kind"]]]
            row["baseline"] = base_row["label"]
            row["saved_per_layer_ms"] = (base_row["median_ms"] - row["median_ms"]) / row["stashed"]
            # The same from each sweep's runs alone (forward order, then reverse): how far noise moves it.
            row["saved_per_layer_by_sweep_ms"] = [
                (base - mine) / row["stashed"] for base, mine in zip(base_row["run_medians_ms"], row["run_medians_ms"])
            ]
            row["saved_fraction_of_attention"] = row["saved_per_layer_ms"] / attention_ms
            row["kept_per_layer_bytes"] = row["kept_bytes"] / row["stashed"]
            # The step-time noise per stashed layer: the wider interquartile range of this arm and its baseline's.
            spread = max(high - low for low, high in (row["quartiles_ms"], base_row["quartiles_ms"]))
            row["noise_per_layer_ms"] = spread / row["stashed"]
            # The stash saves at most one attention forward per stashed layer and micro-batch; a larger saving than
            # that plus the noise says the machine moved the timings, not the stash.
            row["saved_verdict"] = verdict(row["saved_per_layer_ms"], row["noise_per_layer_ms"], bound=attention_ms)
            row["noisy"] = row["saved_verdict"] == "NOISY"

    # Same-arm repeat noise against the spread across arms, step by step.
    repeat_noise = max(
        abs(a - b) for row in by_arm for first, second in [row["losses"]] for a, b in zip(first, second))
    reference = plain["losses"][0]
    cross_arm = max(abs(a - b) for row in by_arm for losses in row["losses"] for a, b in zip(losses, reference))
    return by_arm, repeat_noise, cross_arm


def _memory_columns(settings):
    if settings["device"] == "cuda":
        return [("peak alloc", "peak_allocated_bytes")]
    if settings.get("compile"):
        return [("peak RSS", "peak_rss_bytes")]
    return [("peak live", "peak_live_bytes"), ("peak RSS", "peak_rss_bytes")]


def _percent(comparison):
    """A relative comparison with its noise, and its verdict where it is not a result."""
    text = f"{comparison['relative']:+.1%} ± {comparison['relative_noise']:.1%}"
    return text if comparison["verdict"] is None else f"{text} {comparison['verdict']}"


def _mib_change(comparison):
    text = f"{comparison['difference'] / 2**20:+,.1f} ± {comparison['noise'] / 2**20:,.1f} MiB"
    return text if comparison["verdict"] is None else f"{text} {comparison['verdict']}"


def comparisons(settings, by_arm):
    """The arm comparisons the table prints below the per-layer savings, each with its noise and verdict."""
    memory_label, memory_key = _memory_columns(settings)[0]
    kinds = {row["kind"]: row for row in by_arm if row["kind"] != "stash"}
    stashed = [row for row in by_arm if row["kind"] == "stash"]
    lines = []
    if not stashed:
        return lines
    full = max(stashed, key=lambda row: row["stashed"])
    if "stash_offload" in kinds:
        stash_offload = kinds["stash_offload"]
        lines.append((f"{stash_offload['label']} against {kinds['offload']['label']}", [
            (memory_label, _mib_change(compare(stash_offload, kinds["offload"], memory_key))),
        ]))
        lines.append((f"{stash_offload['label']} against {full['label']}", [
            ("step time", _percent(compare(stash_offload, full))),
        ]))
    if "stash_nr" in kinds:
        lines.append((f"{kinds['stash_nr']['label']} against {full['label']} (reentrant)", [
            ("step time", _percent(compare(kinds["stash_nr"], full))),
        ]))
    if "selective" in kinds:
        selective = kinds["selective"]
        # Against TRL's selective checkpointing: the stash in each mode, the non-reentrant one on the same checkpoint.
        for stash in [full] + [kinds["stash_nr"]] * ("stash_nr" in kinds):
            lines.append((f"{stash['label']} against {selective['label']}", [
                ("step time", _percent(compare(stash, selective))),
                (memory_label, _mib_change(compare(stash, selective, memory_key))),
            ]))
        # Each over its own checkpointing without saving: what keeping the attention outputs costs in memory.
        lines.append((f"{full['label']} over {kinds['plain']['label']}", [
            (memory_label, _mib_change(compare(full, kinds["plain"], memory_key))),
        ]))
        lines.append((f"{selective['label']} over {kinds['non_reentrant']['label']}", [
            (memory_label, _mib_change(compare(selective, kinds["non_reentrant"], memory_key))),
        ]))
    return lines


def _at_most(value, noise, bound):
    """Whether VALUE is at most BOUND by the noise rule: UNRESOLVED where the bound lies within the noise of the value
    (exact figures, noise 0, resolve), else holds or DOES NOT HOLD."""
    if noise > 0 and abs(value - bound) <= noise:
        return "UNRESOLVED"
    return "holds" if value <= bound else "DOES NOT HOLD"


# The most the stash with offload may add to the offload's step, a fraction of the stash alone's step.
OFFLOAD_STEP_BOUND = 0.02


def offload_expectations(settings, by_arm, predicted_bytes):
    """With --offload, the offload's two expectations, each with what was measured and its verdict by the noise rule:
    the stash with offload peaks within one layer's kept bytes (the planner's) of the offload alone, and steps within
    2% of the stash alone. Where nothing was offloaded (a synchronized accelerator, the CPU's) the memory one says so
    instead of a verdict: the stash kept its outputs where it runs."""
    kinds = {row["kind"]: row for row in by_arm}
    if "stash_offload" not in kinds:
        return []
    both, offload = kinds["stash_offload"], kinds["offload"]
    stash = max((row for row in by_arm if row["kind"] == "stash"), key=lambda row: row["stashed"])
    memory_label, memory_key = _memory_columns(settings)[0]
    memory, step = compare(both, offload, memory_key), compare(both, stash)
    if both["offloaded_bytes"]:
        memory_verdict = _at_most(memory["difference"], memory["noise"], predicted_bytes)
    else:
        memory_verdict = "NOT JUDGED: nothing was offloaded (DeepSpeed's offload engine copies nothing on CPU)"
    return [{
        "expected": (f"{both['label']} peaks within one layer's kept bytes ({predicted_bytes:,} B, "
                     f"{predicted_bytes / 2**20:,.1f} MiB) of {offload['label']} alone"),
        "measured":
        f"{memory_label} {memory['difference'] / 2**20:+,.1f} ± {memory['noise'] / 2**20:,.1f} MiB",
        "verdict":
        memory_verdict,
    }, {
        "expected": f"{both['label']} steps within {OFFLOAD_STEP_BOUND:.0%} of {stash['label']}",
        "measured": f"step time {step['relative']:+.1%} ± {step['relative_noise']:.1%}",
        "verdict": _at_most(step["relative"], step["relative_noise"], OFFLOAD_STEP_BOUND),
    }]


def offload_moved(by_arm):
    """What the stash with offload handed to the offload engine and took back, in words (None without the arm)."""
    both = next((row for row in by_arm if row["kind"] == "stash_offload"), None)
    if both is None:
        return None
    return (f"{both['label']}: offloaded {both['offloaded_bytes']:,} B and restored {both['restored_bytes']:,} B of "
            f"kept outputs and log-sum-exps in {both['steps_run']} steps; recomputes served "
            f"{both['recomputes_served']:,} = {both['stashed']} layers x {both['steps_run']} steps")


def format_table(settings, by_arm, attention_ms, backend, predicted_bytes, repeat_noise, cross_arm):
    device = settings["device"]
    columns, compiled = _memory_columns(settings), settings.get("compile")
    header = (f"{'arm':<24}{'stashed':>6}  {'fwd / rev sweep (ms)':<22}{'median (ms)':>12}{'IQR (ms)':>20}"
              f"{'vs plain (± noise)':>30}" + "".join(f"{label:>15}" for label, _ in columns) + f"{'kept/layer':>14}")
    lines = [header, "-" * len(header)]

    def mib(value):
        return "-" if value is None else f"{value / 2**20:,.1f} MiB"

    for row in by_arm:
        # Compiled, the graph keeps the attention outputs, the stash nothing.
        kept = "-" if row["kind"] not in STASH_KINDS or compiled else f"{row['kept_per_layer_bytes'] / 2**20:.2f} MiB"
        quartiles = " - ".join(f"{q:,.1f}" for q in row["quartiles_ms"])
        if row["kind"] == "plain":
            vs_plain = "-"
        else:
            vs_plain = f"{row['vs_plain']:+.1%} ± {row['vs_plain_noise']:.1%}"
            if row["vs_plain_verdict"] is not None:
                vs_plain += f" {row['vs_plain_verdict']}"
        lines.append(f"{row['label']:<24}{row['stashed'] if row['stashed'] else '-':>6}  "
                     f"{' / '.join(f'{m:,.1f}' for m in row['run_medians_ms']):<22}{row['median_ms']:>12,.1f}"
                     f"{quartiles:>20}{vs_plain:>30}" + "".join(f"{mib(row[key]):>15}"
                                                                for _, key in columns) + f"{kept:>14}")
    lines.append("")
    lines.append("fwd / rev sweep: the arm's median step time in the forward sweep (arms in table order), then in the "
                 "reverse sweep; median and IQR (interquartile range): over the timed steps of both sweeps.")
    lines.append("every comparison: the difference of two medians ± its noise, the wider IQR of the two arms (for "
                 "memory, the wider range of their runs); within its noise it is UNRESOLVED, not a result.")
    lines.append("")
    lines.append(f"attention forward (op-level gate): {attention_ms:.2f} ms per layer and micro-batch, query "
                 f"({settings['micro_batch']}, {settings['heads']}, {settings['sequence']}, {settings['head_dim']}), "
                 f"{settings['kv_heads']} key/value heads, {settings['dtype']}, {device}, SDPA backend {backend}")
    for row in by_arm:
        if row["kind"] in STASH_KINDS:
            saved = (f"{row['saved_per_layer_ms']:.2f} ± {row['noise_per_layer_ms']:.2f} ms against "
                     f"{row['baseline']} (sweeps "
                     f"{' / '.join(f'{saved:.1f}' for saved in row['saved_per_layer_by_sweep_ms'])})")
            if row["saved_verdict"] == "NOISY":
                verdict = (f"NOISY: more than the attention forward ({attention_ms:.2f} ms) plus the noise allows; "
                           f"the machine moved the timings, repeat the run on an idle machine")
            elif row["saved_verdict"] == "UNRESOLVED":
                verdict = (f"UNRESOLVED: within the noise, or the noise as large as the attention forward "
                           f"({attention_ms:.2f} ms); time longer sequences or more steps, on an idle machine")
            else:
                verdict = f"{row['saved_fraction_of_attention']:.0%} of the attention forward"
            if compiled:
                # The compiled graph keeps the attention outputs; the stash keeps nothing itself, counts no recompute.
                served = (f"compiled layers served {' / '.join(str(len(names)) for names in row['compiled_layers'])} "
                          f"of {row['stashed']} in the {len(row['compiled_layers'])} runs: the compiled graph saves "
                          f"their attention outputs instead of recomputing them")
            else:
                served = (f"kept {row['kept_per_layer_bytes']:,.0f} B per layer against the planner's "
                          f"{predicted_bytes:,} B (output + FP32 LSE), "
                          f"{row['kept_per_layer_bytes'] / predicted_bytes - 1:+.2%}; recomputes served "
                          f"{row['recomputes_served']:,} = {row['stashed']} layers x {row['steps_run']} steps")
            lines.append(f"saved per stashed layer and micro-batch, {row['label']}: {saved} = {verdict}; {served}")
    for subject, parts in comparisons(settings, by_arm):
        lines.append(f"{subject}: " + ", ".join(f"{name} {text}" for name, text in parts))
    agree = "agree" if cross_arm <= repeat_noise else "DIFFER"
    lines.append(f"losses: largest difference across arms {cross_arm:.3g}, same-arm repeat noise {repeat_noise:.3g}: "
                 f"arms {agree}")
    if device == "cpu" and compiled:
        lines.append("peak RSS: the process, blurred by the allocator's caching, in each run's untimed second step "
                     "(the first compiles); peak live is not measured compiled: its dispatch mode runs frames eagerly")
    elif device == "cpu":
        lines.append("peak live: tensor storage created during a step and alive at once; peak RSS: the process, "
                     "blurred by the allocator's caching; both in each run's untimed first step")
    return "\n".join(lines)


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        sys.exit("attention_stash_bench --plot needs matplotlib: pip install matplotlib")
    return matplotlib


def plot(path, settings, by_arm):
    """Step time and memory against stashed layers, each arm's median with its spread; returns the figure.

    Time: the median with the interquartile range as error bars. Memory: the largest run with the range of the runs
    as error bars, on an axis from zero. Each checkpointing mode is one line from its recompute (0 stashed layers) to
    its stash arms; a stash arm whose saving per layer is not a result (UNRESOLVED or NOISY) is drawn hollow and
    labelled. Selective AC, which stashes no layer, is a horizontal line with its spread as a band.
    """
    matplotlib = _matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory_label, memory_key = _memory_columns(settings)[0]
    mib = 2**20
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    first = (f"compiled ({settings['compile']}), non-reentrant: recompute, stash"
             if settings.get("compile") else "reentrant: plain recompute, stash")
    series = [(first, ("plain", "stash"), "C0", 0.0),
              ("non-reentrant: recompute, stash", ("non_reentrant", "stash_nr"), "C1",
               0.06 * attention_layers(settings))]
    unresolved_label = "saving per layer UNRESOLVED or NOISY"
    for label, kinds, color, offset in series:
        rows = sorted((row for row in by_arm if row["kind"] in kinds), key=lambda row: row["stashed"])
        if len(rows) < 2:
            continue
        x = [row["stashed"] + offset for row in rows]
        medians = [row["median_ms"] for row in rows]
        time_axis.errorbar(x,
                           medians,
                           yerr=[[m - row["quartiles_ms"][0] for m, row in zip(medians, rows)],
                                 [row["quartiles_ms"][1] - m for m, row in zip(medians, rows)]],
                           fmt="o-",
                           color=color,
                           capsize=4,
                           label=label)
        memory = [row[memory_key] / mib for row in rows]
        memory_axis.errorbar(x,
                             memory,
                             yerr=[[m - row[f"{memory_key}_range"][0] / mib for m, row in zip(memory, rows)],
                                   [row[f"{memory_key}_range"][1] / mib - m for m, row in zip(memory, rows)]],
                             fmt="o-",
                             color=color,
                             capsize=4,
                             label=label)
        for axis, values in ((time_axis, medians), (memory_axis, memory)):
            hollow = [(position, value, row["saved_verdict"]) for position, value, row in zip(x, values, rows)
                      if row.get("saved_verdict")]
            if hollow:
                axis.plot([h[0] for h in hollow], [h[1] for h in hollow],
                          "o",
                          markersize=9,
                          markerfacecolor="white",
                          markeredgecolor=color,
                          label=unresolved_label)
                unresolved_label = None  # one legend entry for both modes
            if axis is time_axis:
                for position, value, word in hollow:
                    axis.annotate(word, (position, value), textcoords="offset points", xytext=(6, 6), fontsize=8)
    for row in by_arm:
        if row["kind"] == "selective":
            time_axis.axhline(row["median_ms"], color="gray", linestyle="--", label=f"{row['label']}, IQR band")
            time_axis.axhspan(*row["quartiles_ms"], color="gray", alpha=0.2)
            memory_axis.axhline(row[memory_key] / mib, color="gray", linestyle="--", label=row["label"])
            memory_axis.axhspan(*(value / mib for value in row[f"{memory_key}_range"]), color="gray", alpha=0.2)
    time_axis.set(xlabel="stashed layers", ylabel="step time (ms): median, bars the IQR")
    memory_axis.set(xlabel="stashed layers", ylabel=f"{memory_label} (MiB): bars the runs' range")
    # From zero: an axis around the data alone would make the stash's bytes look large. Headroom for the legend.
    memory_axis.set_ylim(0, 1.3 * max(row[f"{memory_key}_range"][1] for row in by_arm) / mib)
    layers = sorted({row["stashed"] for row in by_arm})
    for axis in (time_axis, memory_axis):
        axis.set_xticks(layers)
    time_axis.legend(fontsize=8)
    memory_axis.legend(fontsize=8, loc="lower right")
    figure.suptitle(f"attention stash, {settings['layers']} layers, sequence {settings['sequence']}, micro-batch "
                    f"{settings['micro_batch']}, {settings['dtype']} on {settings['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return figure


def make_engine(deepspeed, settings, config, mpu=None):
    """The model in a DeepSpeed engine, and its weights and optimizer state to start every run from."""
    model = build_model(settings)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    if settings.get("compile"):
        # The engine compiles the module it wraps in place; each run's first step traces it, stash installed.
        engine.compile(backend=settings["compile"], compile_kwargs={"dynamic": False})
    initial = {
        "module": {
            name: tensor.detach().clone()
            for name, tensor in engine.module.state_dict().items()
        },
        "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
    }
    return engine, initial


def sweep_row(settings, runs, arms, attention):
    """One sequence length of a sweep: the attention forward's share of the plain step (the op-level gate, every
    attention layer's forward over the plain step), the stash's saving of the step, and the saving over the share,
    each with its noise and verdict."""
    attention_ms, backend, attention_quartiles = attention
    by_arm, _, cross_arm = summarize(settings, arms, runs, attention_ms)
    plain, stash = by_arm
    layers = stash["stashed"]
    # The saving as a fraction of the plain step (compare() gives fractions of its second arm's).
    difference = plain["median_ms"] - stash["median_ms"]
    noise = max(_width(plain["quartiles_ms"]), _width(stash["quartiles_ms"]))
    # The share's noise: the spread of the timed attention forwards, over the plain step.
    share = layers * attention_ms / plain["median_ms"]
    share_noise = layers * _width(attention_quartiles) / plain["median_ms"]
    return {
        "sequence": settings["sequence"],
        "backend": backend,
        "attention_forward_ms": attention_ms,
        "plain_ms": plain["median_ms"],
        "plain_quartiles_ms": plain["quartiles_ms"],
        "stash_ms": stash["median_ms"],
        "stash_quartiles_ms": stash["quartiles_ms"],
        "share": share,
        "share_noise": share_noise,
        "share_verdict": verdict(share, share_noise),
        "saving": difference / plain["median_ms"],
        "saving_noise": noise / plain["median_ms"],
        "saving_verdict": verdict(difference, noise, bound=layers * attention_ms),
        # The saving over the share is the saving per stashed layer over one attention forward.
        "saving_over_share": stash["saved_fraction_of_attention"],
        "saving_over_share_noise": stash["noise_per_layer_ms"] / attention_ms,
        "saving_over_share_verdict": stash["saved_verdict"],
        "saved_per_layer_ms": stash["saved_per_layer_ms"],
        "noise_per_layer_ms": stash["noise_per_layer_ms"],
        "kept_per_layer_bytes": stash["kept_per_layer_bytes"],
        "recomputes_served": stash["recomputes_served"],
        "compiled_layers": stash["compiled_layers"],
        "steps_run": stash["steps_run"],
        "losses_agree": cross_arm == 0,
    }


def _judged(value, noise, word):
    text = f"{value:.1%} ± {noise:.1%}"
    return text if word is None else f"{text} {word}"


def format_sweep(settings, rows, target):
    header = (f"{'sequence':>9}{'plain (ms)':>13}{'stash (ms)':>13}{'attn fwd (ms)':>15}{'attention share':>28}"
              f"{'step saving':>32}{'saving / share':>34}{'saved/layer (ms)':>20}{'kept/layer vs planner':>30}")
    lines = [header, "-" * len(header)]
    for row in rows:
        share, saving, ratio = (_judged(row[key], row[f"{key}_noise"], row[f"{key}_verdict"])
                                for key in ("share", "saving", "saving_over_share"))
        saved = f"{row['saved_per_layer_ms']:.2f} ± {row['noise_per_layer_ms']:.2f}"
        planner = row.get("planner_bytes")
        kept = f"{row['kept_per_layer_bytes'] / 2**20:,.2f} MiB" + (
            f" {row['kept_per_layer_bytes'] / planner - 1:+.2%}" if planner else "")
        if settings.get("compile"):
            kept = "in the compiled graph"
        lines.append(f"{row['sequence']:>9,}{row['plain_ms']:>13,.1f}{row['stash_ms']:>13,.1f}"
                     f"{row['attention_forward_ms']:>15,.2f}{share:>28}{saving:>32}{ratio:>34}{saved:>20}{kept:>30}")
    lines.append("")
    lines.append("attention share: every stashed layer's attention forward (the op-level gate) over the plain step, "
                 "± the spread of the timed forwards; step saving: plain minus stash over plain, ± the wider IQR of "
                 "the two; saving / share: the saving per stashed layer over one attention forward. Each within "
                 "its noise, or with a noise as large as the attention forwards it can save, is UNRESOLVED, beyond "
                 "what those forwards allow NOISY: not a result. "
                 "saved/layer: per stashed layer and micro-batch, ± the step noise per layer; kept/layer: the "
                 "stash's peak per layer, against the planner's attention_stash_layer_bytes.")
    if settings.get("compile"):
        lines.append("compiled: the graph keeps the stashed layers' attention outputs, the stash nothing; every "
                     "stashed layer's compiled checkpoint saved them in every run.")
    # The target is judged by the same rule: a ratio below it by less than its noise is not a miss, but unresolved.
    resolved = [row for row in rows if row["saving_over_share_verdict"] is None]
    met = [row["sequence"] for row in resolved if row["saving_over_share"] >= target]
    missed = [
        row["sequence"] for row in resolved if row["saving_over_share"] + row["saving_over_share_noise"] < target
    ]
    near = [row for row in resolved if row["sequence"] not in met + missed]
    head = f"target (saving at least {target:.0%} of the share), at the {len(resolved)} lengths that resolved:"
    if not resolved:
        lines.append(f"target (saving at least {target:.0%} of the share): no length resolved; repeat on an idle "
                     f"machine, with longer sequences or more steps")
    elif missed:
        lines.append(f"{head} MISSED at {missed}")
    elif near:
        lines.append(f"{head} met at {met}; below it within the noise at " + ", ".join(
            f"{row['sequence']} ({row['saving_over_share']:.1%} ± {row['saving_over_share_noise']:.1%})"
            for row in near) + ": UNRESOLVED there")
    else:
        lines.append(f"{head} met at every one ({', '.join(str(length) for length in met)})")
    return "\n".join(lines)


def plot_sweep(path, settings, rows):
    """Saving and share against sequence length, each with its noise; lengths whose saving is not a result hollow."""
    matplotlib = _matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    x = [row["sequence"] for row in rows]
    for key, label, color in (("share", "attention forward's share of the plain step", "C1"),
                              ("saving", "the stash's step saving", "C0")):
        axis.errorbar(x, [100 * row[key] for row in rows],
                      yerr=[100 * row[f"{key}_noise"] for row in rows],
                      fmt="o-",
                      color=color,
                      capsize=4,
                      label=label)
        hollow = [row for row in rows if row[f"{key}_verdict"]]
        if hollow:
            axis.plot([row["sequence"] for row in hollow], [100 * row[key] for row in hollow],
                      "o",
                      markersize=9,
                      markerfacecolor="white",
                      markeredgecolor=color,
                      label=f"{label}: UNRESOLVED or NOISY")
    axis.set_xscale("log", base=2)
    axis.set_xticks(x, [str(length) for length in x])
    axis.set(xlabel="sequence length", ylabel="% of the plain step")
    axis.set_ylim(bottom=min(0, *(100 * (row["saving"] - row["saving_noise"]) for row in rows)))
    axis.legend(fontsize=8)
    figure.suptitle(f"attention stash on all {attention_layers(settings)} attention layers, micro-batch "
                    f"{settings['micro_batch']}, {settings['dtype']} on {settings['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return figure


# The share of the attention forward that the stash's saving must reach, at every length that resolves.
SWEEP_TARGET = 0.9


def sweep(args, settings, deepspeed, config, started):
    """Plain reentrant recompute against the stash on every attention layer, at each sequence length: forward, then
    reverse sweep of the two arms, from the same weights and batches."""
    import transformers

    from deepspeed.runtime.activation_checkpointing.attention_stash import attention_stash_layer_bytes

    full = attention_layers(settings)
    arms = [
        dict(label="plain recompute", kind="plain", stashed=0),
        dict(label=f"stash {full} layers", kind="stash", stashed=full)
    ]
    ranks, rank, mpu = settings["sequence_parallel"], 0, None
    # Under sequence parallelism each rank's attention runs its share of the heads over the whole sequence.
    gate = dict(heads=settings["heads"] // ranks, kv_heads=max(1, settings["kv_heads"] // ranks))
    rows = []
    for sequence in settings["sequences"]:
        at = {**settings, "sequence": sequence}
        model = build_model(at) if ranks > 1 and mpu is None else None
        if model is not None:
            # ALST registers once per process, before the engines: its wrapper serves every model of its shapes.
            import deepspeed.comm as dist
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            deepspeed.init_distributed(dist_backend="gloo" if at["device"] == "cpu" else None)
            rank = dist.get_rank()
            mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model,
                                                                  core_attn_implementation="sdpa",
                                                                  sequence_parallel_size=ranks,
                                                                  micro_batch_size=at["micro_batch"],
                                                                  seq_length_is_variable=True)
            del model
        engine, initial = make_engine(deepspeed, at, config, mpu)
        batches = make_batches(at, at["warmup"] + at["steps"])
        if ranks > 1:
            batches = shard_batches(batches, rank, ranks)
        # Compiled, each run's own first steps compile and warm up.
        if not at["compile"]:
            for arm in arms:
                run_arm(engine, initial, batches[:1], {**at, "warmup": 0}, arm)
        runs = [(arm["label"], run_arm(engine, initial, batches, at, arm)) for arm in arms + arms[::-1]]
        row = sweep_row(at, runs, arms, attention_forward_ms({**at, **gate}, batches[0].get("attention_mask")))
        row["planner_bytes"] = attention_stash_layer_bytes(engine.module,
                                                           at["micro_batch"],
                                                           sequence,
                                                           device=at["device"])
        rows.append(row)
        # After each length, so that a run stopped by a time limit leaves the lengths it finished.
        if args.json and rank == 0:
            with open(args.json, "w") as file:
                json.dump({"settings": settings, "target": SWEEP_TARGET, "rows": rows}, file, indent=2)
        if rank == 0:
            print(
                f"[{len(rows)}/{len(settings['sequences'])}] sequence {sequence}: plain {row['plain_ms']:,.1f} ms, "
                f"stash {row['stash_ms']:,.1f} ms, losses agree: {row['losses_agree']}",
                flush=True)
        del engine, initial, batches
    if rank != 0:
        return rows
    if args.plot:
        plot_sweep(args.plot, settings, rows)
    wall_s = time.perf_counter() - started
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"settings": settings, "target": SWEEP_TARGET, "rows": rows, "wall_s": wall_s}, file, indent=2)
    parallel = (f", Ulysses sequence parallelism over {ranks} ranks (figures of rank 0: {gate['heads']} of "
                f"{settings['heads']} query heads over the whole sequence)" if ranks > 1 else "")
    print()
    print(f"attention stash sweep: {settings['layers']} layers ({full} with softmax attention), micro-batch "
          f"{settings['micro_batch']}, {settings['dtype']} on {settings['device']}{parallel}"
          f"{_compiled_title(settings)}, {settings['steps']} timed step{'s' * (settings['steps'] != 1)} after "
          f"{settings['warmup']} per run, two runs per arm; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")
    print(format_sweep(settings, rows, SWEEP_TARGET))
    print(f"wall time: {int(wall_s // 60)} min {int(wall_s % 60):02d} s ({wall_s:.1f} s), from the start to the "
          f"table, for {len(rows)} length{'s' * (len(rows) != 1)}")
    return rows


def _compiled_title(settings):
    """What the table's title says of a compiled run."""
    if not settings.get("compile"):
        return ""
    return (f", compiled (torch.compile, backend {settings['compile']}, dynamic=False, non-reentrant checkpointing; "
            f"each run's first step compiles)")


def main(argv=None):
    started = time.perf_counter()
    args, settings = parse_args(argv)
    if args.plot:
        _matplotlib()  # before the runs, not after them
    if settings["device"] == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        # The cores shared among the ranks that torchrun starts on this machine; OMP_NUM_THREADS, where set, says
        # instead (torch starts with it): one thread on cores that other processes keep busy spares OpenMP's waits.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    deepspeed = _init_deepspeed(settings["device"])
    import transformers

    from deepspeed.runtime.activation_checkpointing.attention_stash import attention_stash_layer_bytes

    config = {
        "train_micro_batch_size_per_gpu": settings["micro_batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-4,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 0
        },
    }
    if args.autoep:
        if tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 23):
            sys.exit(f"attention_stash_bench --autoep needs transformers <= 5.22 with DeepSpeed's AutoEP, got "
                     f"{transformers.__version__}.")
        config["expert_parallel"] = {"enabled": True, "autoep_size": 1, "preset_model": "qwen3_moe"}

    if len(settings["sequences"]) > 1 or settings["sequence_parallel"] > 1:
        return sweep(args, settings, deepspeed, config, started)
    engine, initial = make_engine(deepspeed, settings, config)
    batches = make_batches(settings, settings["warmup"] + settings["steps"])

    full = attention_layers(settings)
    half = full // 2
    arms = [
        dict(label="plain recompute", kind="plain", stashed=0),
        dict(label=f"stash {half} layers", kind="stash", stashed=half),
        dict(label=f"stash {full} layers", kind="stash", stashed=full),
    ]
    if settings["offload"]:
        arms = [
            arms[0],
            dict(label="offload", kind="offload", stashed=0), arms[2],
            dict(label=f"stash {full} + offload", kind="stash_offload", stashed=full)
        ]
        print(f"--offload: plain recompute, the checkpoints' inputs offloaded to host memory by "
              f"{offload_title(settings)}, the stash on all {full} attention layers, and the stash with that offload "
              f"(installed with offload=None: its kept outputs follow the inputs); reentrant checkpointing. The other "
              f"arms are left out." +
              (" DeepSpeed's accelerator is synchronized here (the CPU's): its offload engine copies nothing, so no "
               "byte moves and the memory expectation is not judged." if _synchronized_accelerator() else ""),
              flush=True)
    elif settings["compile"]:
        # The pair of plain and stash kinds, each run non-reentrant and compiled.
        arms = [
            dict(label="compiled recompute", kind="plain", stashed=0),
            dict(label=f"compiled stash {full} layers", kind="stash", stashed=full)
        ]
        print(
            f"--compile ({settings['compile']}): non-reentrant recompute against the stash on all {full} attention "
            f"layers. Left out: the reentrant arms (dynamo traces every checkpoint as non-reentrant; the stash "
            f"refuses reentrant checkpointing compiled), the half-stashed arm (every compiled run compiles anew) and "
            f"selective AC (TRL), whose policy the stash's compiled checkpoint applies: saving the SDPA outputs.",
            flush=True)
    elif not args.no_sac:
        # Selective checkpointing builds on non-reentrant checkpointing; its plain form is the control that separates
        # what saving the SDPA outputs costs from what the other checkpoint implementation costs.
        arms.append(dict(label="non-reentrant recompute", kind="non_reentrant", stashed=0))
        arms.append(dict(label=f"stash {full}, non-reentrant", kind="stash_nr", stashed=full))
        arms.append(dict(label="selective AC (TRL)", kind="selective", stashed=0))
    # A global warm-up, untimed: first-use costs (allocator growth, kernel and library initialization) would otherwise
    # land on the first arm, the plain one. One step of each checkpointing kind. Compiled, each run's own first steps
    # compile and warm up.
    if not settings["compile"]:
        for arm in {arm["kind"]: arm for arm in arms}.values():
            run_arm(engine, initial, batches[:1], {**settings, "warmup": 0}, arm)
    order = arms + arms[::-1]
    runs = []
    for index, arm in enumerate(order, 1):
        run = run_arm(engine, initial, batches, settings, arm)
        runs.append((arm["label"], run))
        print(
            f"[{index}/{len(order)}] {arm['label']}: median {run['median_ms']:,.1f} ms, losses "
            f"{', '.join(f'{loss:.6f}' for loss in run['losses'])}",
            flush=True)
    attention_ms, backend, _ = attention_forward_ms(settings, batches[0].get("attention_mask"))
    # What the stash's memory planner predicts one layer keeps per micro-batch, for the same shapes.
    predicted_bytes = attention_stash_layer_bytes(engine.module,
                                                  settings["micro_batch"],
                                                  settings["sequence"],
                                                  device=settings["device"])
    by_arm, repeat_noise, cross_arm = summarize(settings, arms, runs, attention_ms)
    if args.plot:
        plot(args.plot, settings, by_arm)
    # Everything the command did, DeepSpeed's start and the warm-up included: what the README's estimate claims.
    wall_s = time.perf_counter() - started

    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                {
                    "settings":
                    settings,
                    "versions": {
                        "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "deepspeed": deepspeed.__version__
                    },
                    "autoep":
                    args.autoep,
                    "attention_forward_ms":
                    attention_ms,
                    "sdpa_backend":
                    backend,
                    "kept_bytes_predicted":
                    predicted_bytes,
                    "loss_repeat_noise":
                    repeat_noise,
                    "loss_cross_arm":
                    cross_arm,
                    "arms":
                    by_arm,
                    "comparisons": [{
                        "subject": subject,
                        "parts": dict(parts)
                    } for subject, parts in comparisons(settings, by_arm)],
                    "offload_route":
                    offload_title(settings) if settings["offload"] else None,
                    "offload_moved":
                    offload_moved(by_arm),
                    "offload_expectations":
                    offload_expectations(settings, by_arm, predicted_bytes),
                    "wall_s":
                    wall_s,
                },
                file,
                indent=2)
    for row in by_arm:
        if row["kind"] == "selective":
            print(f"{row['label']}: {row['selective_source']}, non-reentrant (its one mode)")
    if by_arm[0]["attention_forwards_in_backward"] is not None:
        print("attention forwards in each backward (counted in each run's first step, untimed): " +
              ", ".join(f"{row['label']} {row['attention_forwards_in_backward']}" for row in by_arm))
    print()
    padding = f"rows padded up to {settings['pad_fraction']:.0%}, " if settings["pad_fraction"] else ""
    experts = f"{settings['experts']} experts (top {settings['top_k']})"
    shape = {
        "qwen3_next":
        f"Qwen3-Next-shaped hybrid, {settings['layers']} layers ({attention_layers(settings)} with softmax "
        f"attention), {experts}",
        "llama": f"Llama {settings['layers']} dense layers",
    }.get(settings.get("model"), f"Qwen3-MoE {settings['layers']} layers, {experts}")
    print(
        f"attention stash benchmark: {shape}, sequence {settings['sequence']}, micro-batch {settings['micro_batch']}, "
        f"{settings['dtype']} on {settings['device']}{_compiled_title(settings)}, {padding}{settings['steps']} "
        f"timed steps after {settings['warmup']} per run{', AutoEP' if args.autoep else ''}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")
    print(format_table(settings, by_arm, attention_ms, backend, predicted_bytes, repeat_noise, cross_arm))
    if settings["offload"]:
        print(f"offload of the checkpoints' inputs: {offload_title(settings)}")
        print(offload_moved(by_arm))
    for expectation in offload_expectations(settings, by_arm, predicted_bytes):
        print(f"expected: {expectation['expected']}: {expectation['measured']}: {expectation['verdict']}")
    print(
        f"wall time: {int(wall_s // 60)} min {int(wall_s % 60):02d} s ({wall_s:.1f} s), from the start to the table, "
        f"for {len(order)} runs of {settings['warmup'] + settings['steps']} steps" +
        (", each compiling in its first" if settings["compile"] else " after a warm-up of each mode"))


if __name__ == "__main__":
    main()
