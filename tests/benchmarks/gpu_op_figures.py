# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The GPU check's op-level figures: the attention forward per fused SDPA backend at the benchmark's shapes, and the
bytes one stashed layer keeps, from the planner and from the benchmark's JSON.

    python tests/benchmarks/gpu_op_figures.py --out op.json --bench-json bench.json -- --preset qwen3-30b-a3b

Everything after ``--`` is the benchmark's own options (attention_stash_bench.py), parsed by the benchmark, so both
look at the same shapes. Each backend is forced in turn; the forward runs as in the recompute (causal, inputs that
require grad, key/value heads grouped as Hugging Face passes them) and is timed with CUDA events on CUDA, with
time.perf_counter on CPU, after a warm-up: the median of the timed calls is reported. What the benchmark measured
(its attention forward, the saving per stashed layer, the bytes kept, peak memory) is read from its JSON, not measured
again.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "deepspeed", "runtime", "activation_checkpointing")

# The fused backends a device has; MATH is no fused kernel, and the stash does not replay it.
FUSED = {
    "cuda": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "cpu": [SDPBackend.FLASH_ATTENTION],
}


def _backend_name(choice):
    return next(name for name, member in SDPBackend.__members__.items() if member.value == choice)


def _median_ms(function, device, warmup, repeats):
    for _ in range(warmup):
        function()
    if device == "cuda":
        torch.cuda.synchronize()  #ignore-cuda
        events = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  #ignore-cuda
            start.record()
            function()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()  #ignore-cuda
        times = [start.elapsed_time(end) for start, end in events]
    else:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            function()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


def attention_forward(settings, warmup, repeats):
    """The attention forward under each fused backend, forced, and under PyTorch's own choice."""
    device, dtype = settings["device"], getattr(torch, settings["dtype"])
    heads, key_heads = settings["heads"], settings["kv_heads"]
    generator = torch.Generator(device=device).manual_seed(0)

    def projected(count):
        # Laid out as Hugging Face's attention passes them: a projection's output viewed per head and transposed.
        shape = (settings["micro_batch"], settings["sequence"], count, settings["head_dim"])
        return torch.randn(shape, device=device, dtype=dtype, generator=generator).transpose(1, 2).requires_grad_()

    query, key, value = projected(heads), projected(key_heads), projected(key_heads)
    grouped = (query, key, value, True)
    groups = heads // key_heads
    repeated = (query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), False)

    def choice(inputs):
        with torch.enable_grad():
            return torch._fused_sdp_choice(*inputs[:3], None, 0.0, True, enable_gqa=inputs[3])

    def timed(inputs):
        query, key, value, gqa = inputs

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=gqa)

        return _median_ms(forward, device, warmup, repeats)

    rows = []
    default = _backend_name(choice(grouped))
    median, low, high = timed(grouped)
    rows.append(dict(backend=f"default ({default})", chosen=default, layout="grouped"))
    rows[0].update(median_ms=median, min_ms=low, max_ms=high)
    for backend in FUSED[device]:
        row = dict(backend=backend.name, chosen=None, layout=None, median_ms=None, min_ms=None, max_ms=None)
        try:
            with sdpa_kernel(backend):
                # Grouped key/value heads where the kernel takes them, as the model calls it; else repeated to the
                # query heads, as Hugging Face does where grouped heads are not supported.
                for layout, inputs in (("grouped", grouped), ("repeated", repeated)):
                    if choice(inputs) == backend.value:
                        row["median_ms"], row["min_ms"], row["max_ms"] = timed(inputs)
                        row["chosen"], row["layout"] = backend.name, layout
                        break
                else:
                    row["note"] = "does not run these inputs here"
        except Exception as error:  # a failure here is a figure of the check too
            row["note"] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        rows.append(row)
    return rows


def planner_bytes(bench, settings):
    """attention_stash_layer_bytes for the benchmark's model at its shapes: PyTorch's choice, then each backend."""
    import deepspeed.runtime.activation_checkpointing as activation_checkpointing

    # This tree's module, not an installed copy.
    if TREE not in activation_checkpointing.__path__:
        activation_checkpointing.__path__.insert(0, TREE)
    from deepspeed.runtime.activation_checkpointing.attention_stash import attention_stash_layer_bytes

    # The benchmark's own model, on the meta device: the planner reads its geometry, no weights.
    model = bench.build_model({**settings, "device": "meta"})
    dtype = getattr(torch, settings["dtype"])

    def planned(backend=None):
        try:
            if backend is None:
                return attention_stash_layer_bytes(model, settings["micro_batch"], settings["sequence"], dtype,
                                                   settings["device"]), None
            with sdpa_kernel(backend):
                return attention_stash_layer_bytes(model, settings["micro_batch"], settings["sequence"], dtype,
                                                   settings["device"]), None
        except Exception as error:
            return None, f"{type(error).__name__}: {error}".splitlines()[0][:200]

    rows = []
    for backend in [None] + FUSED[settings["device"]]:
        nbytes, note = planned(backend)
        rows.append(dict(backend="default" if backend is None else backend.name, bytes=nbytes, note=note))
    return rows


def from_bench(path, settings):
    """What the benchmark reported for the same shapes: per stash arm the bytes kept per layer and the saving."""
    if not path or not os.path.isfile(path):
        return None
    with open(path) as file:
        result = json.load(file)
    keys = ("micro_batch", "sequence", "heads", "kv_heads", "head_dim", "dtype", "device")
    arms = []
    for arm in result["arms"]:
        arms.append({
            name: arm.get(name)
            for name in ("label", "kind", "stashed", "median_ms", "kept_per_layer_bytes", "saved_per_layer_ms",
                         "noise_per_layer_ms", "saved_fraction_of_attention", "noisy", "recomputes_served",
                         "peak_allocated_bytes", "peak_live_bytes", "peak_rss_bytes")
        })
    return dict(path=path,
                same_shapes=all(result["settings"].get(key) == settings[key] for key in keys),
                attention_forward_ms=result["attention_forward_ms"],
                sdpa_backend=result["sdpa_backend"],
                kept_bytes_predicted=result["kept_bytes_predicted"],
                arms=arms)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    own, bench_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--bench-json", metavar="PATH", help="the benchmark's --json at the same shapes")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per backend")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per backend")
    args = parser.parse_args(own)
    sys.path.insert(0, HERE)
    import attention_stash_bench as bench

    _, settings = bench.parse_args(bench_argv)
    element = torch.empty(0, dtype=getattr(torch, settings["dtype"])).element_size()
    figures = dict(
        settings=settings,
        torch=torch.__version__,
        timer="CUDA events" if settings["device"] == "cuda" else "time.perf_counter",
        warmup=args.warmup,
        repeats=args.repeats,
        # One output in the model's dtype and its FP32 log-sum-exp per query head and position: what the planner
        # counts before any kernel's padding.
        formula_bytes=settings["micro_batch"] * settings["heads"] * settings["sequence"] *
        (settings["head_dim"] * element + 4),
        attention=attention_forward(settings, args.warmup, args.repeats),
        planner=planner_bytes(bench, settings),
        bench=from_bench(args.bench_json, settings),
    )
    with open(args.out, "w") as file:
        json.dump(figures, file, indent=2)
    for row in figures["attention"]:
        timing = "-" if row["median_ms"] is None else f"{row['median_ms']:.3f} ms ({row['layout']} key/value heads)"
        print(f"attention forward, {row['backend']}: {timing} {row.get('note') or ''}".rstrip())
    for row in figures["planner"]:
        print(f"planner, {row['backend']}: {row['bytes']} B {row['note'] or ''}".rstrip())
    # A forced backend that does not take these inputs is a figure; PyTorch's own choice failing is a failure.
    return 0 if figures["attention"][0]["median_ms"] is not None and figures["planner"][0]["bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
