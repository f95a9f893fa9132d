# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Host cost of the attention stash: microseconds of Python per stashed layer and training step, beside TRL's
selective activation checkpointing, the one-flag alternative.

On a tiny Llama and a tiny Qwen3-MoE (8 layers, hidden 32, sequence 8) the kernels cost next to nothing, so what a step
costs is the host's work. Steps of a plain model and of the same model with the stash alternate, in pairs, on one
thread, under reentrant and non-reentrant checkpointing (transformers' default), all pairs interleaved; the median of
the paired differences, divided by the stashed layers, is the stash's host cost per stashed layer and step, and the
two modes' costs are compared within the 95% confidence intervals of their medians. TRL's selective checkpointing
(``gradient_checkpointing_kwargs={"selective": True}``: TRL's own where it is installed, else its policy written out,
as the step benchmark sets it) is paired with plain non-reentrant checkpointing, its one mode, the same way: its host
cost per layer, and the stash's against it. Timers around each layer's checkpointed
function split it: the first pass, the recompute, and the rest of the backward. A partly stashed model shows what its
unstashed layers pay: they must stay within noise of plain. Times are the thread's CPU time (time.thread_time), which
a descheduled process does not accumulate; the quartiles of the paired differences are the noise, and a median outside
them is not a result.

    python tests/benchmarks/attention_stash_host.py                          # both models and modes, 200 pairs
    python tests/benchmarks/attention_stash_host.py --mode non-reentrant     # transformers' default checkpointing only
    python tests/benchmarks/attention_stash_host.py --model llama            # one model
    python tests/benchmarks/attention_stash_host.py --profile 50             # and where the attention's time goes

``--attn flash_attention_2`` measures the stash on Hugging Face's flash-attn 2 path instead, with flash-attn's Python
layer (installed as the README's test command installs it) over kernels that only allocate their outputs, on CPU: what
the stash's flash entry and node cost the host, with the kernels costing about what a CUDA launch does.

``--profile`` adds a torch.profiler table of the attention's own work in each pass, per layer and step, for the plain
and the fully stashed model of each mode: F.sdpa and its kernel in the forward passes, the stash's kernel call and its
node (applied in the recompute, and in a non-reentrant checkpoint's first pass too), and each model's attention node in
the backward. The profiler's own cost is in those figures.
"""

import argparse
import gc
import math
import os
import statistics
import sys
import time

import torch

LAYERS = 8
# Hugging Face's attention implementation of the models: "sdpa", or "flash_attention_2" (--attn).
ATTENTION = "sdpa"


def _init():
    import deepspeed.runtime.activation_checkpointing as activation_checkpointing

    # Run this tree's module, not an older installed copy.
    tree = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deepspeed",
                        "runtime", "activation_checkpointing")
    if os.path.isfile(os.path.join(tree, "attention_stash.py")) and tree not in activation_checkpointing.__path__:
        activation_checkpointing.__path__.insert(0, tree)


class _PassTimer:
    """Wraps each layer's checkpoint function so that every run of the checkpointed function is timed: the first run
    of a checkpoint call is its first pass, the second its recompute."""

    def __init__(self, model):
        self.first, self.recompute = [], []
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = self._wrap(layer.__dict__["_gradient_checkpointing_func"])

    def _wrap(self, checkpoint):

        def timed_checkpoint(function, *args, **kwargs):
            runs = []

            def timed(*inner_args, **inner_kwargs):
                start = time.thread_time()
                try:
                    return function(*inner_args, **inner_kwargs)
                finally:
                    (self.first if not runs else self.recompute).append(time.thread_time() - start)
                    runs.append(None)

            return checkpoint(timed, *args, **kwargs)

        return timed_checkpoint

    def take(self):
        first, recompute = sum(self.first), sum(self.recompute)
        self.first, self.recompute = [], []
        return first, recompute


def _allocating_flash_kernels():
    """flash-attn 2's Python layer, over CPU kernels for its four ops that allocate their outputs and compute nothing
    (zeros), and transformers told that flash-attn 2 is available: the flash_attention_2 path at the cost of the
    host's work. A CPU machine has no flash-attn kernels: an empty stand-in takes their module's place."""
    import importlib.util
    import types

    try:
        import flash_attn_2_cuda  # noqa: F401
    except ImportError:
        sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    if importlib.util.find_spec("flash_attn") is None:  # the README's test command builds it into .test-packages
        sys.path.append(
            os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         ".test-packages"))
    try:
        import flash_attn  # noqa: F401
    except ImportError as error:
        sys.exit(f"attention_stash_host --attn flash_attention_2 needs flash-attn 2's Python layer, got {error}. "
                 f"Install it as the README's test command does.")
    import transformers.modeling_flash_attention_utils as flash_utils

    def forward(q, *args, **kwargs):
        varlen = "cu_seqlens_q" in kwargs or len(args) > 10
        lse = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        return (torch.zeros_like(q), torch.zeros(lse,
                                                 dtype=torch.float32), q.new_empty(0), torch.zeros(2,
                                                                                                   dtype=torch.int64))

    def backward(dout, q, k, v, out, lse, dq, dk, dv, *args, **kwargs):
        for grad in (dq, dk, dv):
            grad.zero_()
        return torch.zeros_like(lse)

    for name, kernel in (("_flash_attn_forward", forward), ("_flash_attn_varlen_forward", forward),
                         ("_flash_attn_backward", backward), ("_flash_attn_varlen_backward", backward)):
        torch.library.register_kernel(f"flash_attn::{name}", "cpu", kernel)
    flash_utils.is_flash_attn_2_available = lambda *args, **kwargs: True


# The models, by name: the tiny shapes' class and config beyond the shared ones. Qwen3-MoE: 4 experts, top 2.
MODELS = {"llama": "Llama", "qwen3_moe": "Qwen3-MoE"}


def _model(family, stashed, reentrant, selective=False):
    """A tiny model of ``family`` with per-layer checkpointing, the stash on its last ``stashed`` layers, or TRL's
    selective checkpointing; with its pass timer."""
    import transformers

    from attention_stash_bench import selective_checkpointing
    from deepspeed.runtime.activation_checkpointing.attention_stash import install_attention_stash

    shared = dict(vocab_size=128,
                  hidden_size=32,
                  num_hidden_layers=LAYERS,
                  num_attention_heads=4,
                  num_key_value_heads=2,
                  max_position_embeddings=64,
                  attn_implementation="sdpa")
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=64, **shared))
    else:
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(head_dim=8,
                                        moe_intermediate_size=32,
                                        num_experts=4,
                                        num_experts_per_tok=2,
                                        **shared))
    # Set on the built model: transformers checks for flash-attn's CUDA build when a model is made with it.
    model.config._attn_implementation = ATTENTION
    source = None
    if selective:
        source = selective_checkpointing(model, {"use_reentrant": False})
    # transformers 5.23 renamed gradient_checkpointing_enable, keeping the old name as a deprecated alias.
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    handle = install_attention_stash(model, stashed) if stashed else None
    return model, handle, _PassTimer(model), source


def _step(model, timer, ids):
    start = time.thread_time()
    loss = model(input_ids=ids, labels=ids).loss
    middle = time.thread_time()
    loss.backward()
    end = time.thread_time()
    first, recompute = timer.take()
    return {
        "step": end - start,
        "first pass": first,
        "recompute": recompute,
        "backward other": end - middle - recompute
    }


def _attention_part(name):
    """Which part of the attention's work a profiler event is, by its name; None for any other event."""
    from deepspeed.runtime.activation_checkpointing import attention_stash

    backends = set(attention_stash._BACKENDS.values())
    if name == "aten::scaled_dot_product_attention":
        return "F.sdpa (forward passes)"
    if name in {f"aten::{ops.op}" for ops in backends}:
        return "fused forward kernel"
    if name == attention_stash._AttentionNode.__name__:
        return "stash's node"
    if name in {f"aten::{ops.op}_backward" for ops in backends}:
        return "fused backward kernel"
    node = name.partition("autograd::engine::evaluate_function: ")[2]
    if node.startswith("ScaledDotProduct") or node == f"{attention_stash._AttentionNode.__name__}Backward":
        return "attention node in the backward"
    return None


def _profile(models, ids, steps):
    """Calls and microseconds per layer and step of each part of the attention's work, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    table = {}
    for name, model in models:
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(steps):
                _step(*model, ids)
        for event in profiler.key_averages():
            part = _attention_part(event.key)
            if part is not None:
                table.setdefault(part,
                                 {})[name] = (event.count / steps / LAYERS, event.cpu_time_total / steps / LAYERS)
    print(f"\nattention's own work per layer and step, torch.profiler over {steps} steps (its overhead included): "
          f"calls, microseconds (inclusive)")
    header = f"{'':<34}" + "".join(f"{name:>26}" for name, _ in models)
    print(header)
    print("-" * len(header))
    for part, cells in table.items():
        row = "".join(f"{f'{cells[name][0]:.0f} x, {cells[name][1]:.1f}' if name in cells else '-':>26}"
                      for name, _ in models)
        print(f"{part:<34}{row}")


def _paired(comparisons, ids, pairs):
    """Median and quartiles of (other - plain) per part of the step, in microseconds, over alternating pairs, for each
    (plain, other) comparison; the comparisons' pairs are interleaved, so that a drift of the machine reaches all."""
    differences = [{} for _ in comparisons]
    for index in range(pairs):
        for (plain, other), parts in zip(comparisons, differences):
            # Alternate which model runs first, so that a drift of the machine cancels.
            if index % 2:
                a, b = _step(*plain, ids), _step(*other, ids)
            else:
                b, a = _step(*other, ids), _step(*plain, ids)
            for part in a:
                parts.setdefault(part, []).append((b[part] - a[part]) * 1e6)
    return [{
        part: (statistics.median(values), *statistics.quantiles(values, n=4)[::2], *_median_interval(values))
        for part, values in parts.items()
    } for parts in differences]


def _median_interval(values):
    """A distribution-free 95% confidence interval of the median: the order statistics about n/2 +- 0.98 sqrt(n)."""
    ordered = sorted(values)
    reach = math.ceil(0.98 * math.sqrt(len(ordered)))
    middle = len(ordered) // 2
    return ordered[max(middle - reach, 0)], ordered[min(middle + reach, len(ordered) - 1)]


class _Mode:
    """The plain, fully stashed and half-stashed models of one model family and checkpoint mode; under non-reentrant
    checkpointing also TRL's selective checkpointing, which has no reentrant mode."""

    def __init__(self, family, mode):
        self.family, self.mode = family, mode
        reentrant = mode == "reentrant"
        self.plain = _model(family, 0, reentrant)[::2]
        full_model, self.full_handle, full_timer, _ = _model(family, LAYERS, reentrant)
        half_model, self.half_handle, half_timer, _ = _model(family, LAYERS // 2, reentrant)
        self.full, self.half = (full_model, full_timer), (half_model, half_timer)
        self.selective, self.source = None, None
        if not reentrant:
            selective_model, _, selective_timer, self.source = _model(family, 0, False, selective=True)
            self.selective = (selective_model, selective_timer)

    def models(self):
        return [model for model in (self.plain, self.full, self.half, self.selective) if model is not None]

    def comparisons(self):
        """(plain, other) pairs: the fully and the half-stashed model, and selective checkpointing where it runs."""
        return [(self.plain, model) for model in (self.full, self.half, self.selective) if model is not None]

    def served(self):
        return self.full_handle.recomputes_served, self.half_handle.recomputes_served


def _report(mode, plain_step, full_cost, half_cost, target):
    print(f"\n{MODELS[mode.family]}, {mode.mode} checkpointing: plain step {plain_step:,.0f} us "
          f"({plain_step / LAYERS:,.0f} us per layer)")
    header = f"{'microseconds per stashed layer and step':<44}{'median':>10}{'quartiles':>22}"
    print(header)
    print("-" * len(header))
    for part in ("step", "first pass", "recompute", "backward other"):
        median, low, high = (value / LAYERS for value in full_cost[part][:3])
        print(f"{'all 8 stashed: ' + part:<44}{median:>10.1f}{f'{low:.1f} to {high:.1f}':>22}")
    # The half-stashed model: its stashed layers should cost what the fully stashed model's do, and the rest nothing.
    median, low, high = (value / (LAYERS // 2) for value in half_cost["step"][:3])
    print(f"{'4 of 8 stashed: step, per stashed layer':<44}{median:>10.1f}{f'{low:.1f} to {high:.1f}':>22}")
    unstashed = (half_cost["step"][0] - LAYERS // 2 * full_cost["step"][0] / LAYERS) / (LAYERS // 2)
    noise = (full_cost["step"][2] - full_cost["step"][1]) / LAYERS
    print(f"4 of 8 stashed: the 4 unstashed layers pay {unstashed:+.1f} us each against plain (noise, the quartile "
          f"range per layer: {noise:.1f} us): {'within' if abs(unstashed) <= noise else 'OUTSIDE'} noise")
    cost = full_cost["step"][0] / LAYERS
    print(f"host cost of the stash, {mode.mode}: {cost:.0f} us per stashed layer and step, "
          f"{'within' if cost <= target else 'over'} the {target:.0f} us target")


def _ratio(subject, base, target):
    """``subject``'s median over ``base``'s (paired costs), the lowest and highest ratio their medians' 95% intervals
    allow, and the verdict against ``target``: within it, over it, or UNRESOLVED where the interval spans it."""
    (median, *_, low_s, high_s), (base_median, *_, low_b, high_b) = subject["step"], base["step"]
    low, high = (low_s / high_b, high_s / low_b) if low_b > 0 else (math.nan, math.nan)
    verdict = ("within" if high <= target else "over" if low > target else "UNRESOLVED by the noise against")
    return median / base_median, low, high, verdict


def _report_selective(mode, stash_costs, selective_cost, target):
    """TRL's selective checkpointing against plain non-reentrant checkpointing, and the stash against it in each mode
    measured (per stashed layer for the stash, per checkpointed layer for selective: both per layer of the model)."""
    median, low, high = (value / LAYERS for value in selective_cost["step"][:3])
    print(f"{MODELS[mode.family]}, TRL's selective checkpointing ({mode.source}; non-reentrant only: TRL has no "
          f"reentrant mode): {median:,.1f} us per layer and step over plain non-reentrant (quartiles {low:,.1f} to "
          f"{high:,.1f})")
    for stash_mode, cost in stash_costs:
        ratio, low, high, verdict = _ratio(cost, selective_cost, target)
        print(f"the stash ({stash_mode}) against selective: {cost['step'][0] / LAYERS:,.1f} against {median:,.1f} us "
              f"per layer and step, {ratio:.3f} times ({low:.3f} to {high:.3f} from the medians' 95% intervals): "
              f"{verdict} the {target:g} times target")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=200, help="paired steps per comparison")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps of each model first")
    parser.add_argument("--target", type=float, default=100.0, help="microseconds per stashed layer and step")
    parser.add_argument("--ratio-target",
                        type=float,
                        default=1.5,
                        help="the most the non-reentrant cost may be, in multiples of the reentrant cost")
    parser.add_argument("--selective-target",
                        type=float,
                        default=0.1,
                        help="the most the stash's host cost per layer may be, in multiples of selective's")
    parser.add_argument("--profile",
                        type=int,
                        default=0,
                        metavar="STEPS",
                        help="also profile this many steps of the plain and the fully stashed model of each mode")
    parser.add_argument("--mode",
                        choices=["both", "reentrant", "non-reentrant"],
                        default="both",
                        help="the checkpointing of the models, plain and stashed: both modes interleaved by default")
    parser.add_argument("--model",
                        choices=["both", *MODELS],
                        default="both",
                        help="the models: a tiny Llama and a tiny Qwen3-MoE by default, their pairs interleaved")
    parser.add_argument("--attn",
                        choices=["sdpa", "flash_attention_2"],
                        default="sdpa",
                        help="the models' attention implementation; flash_attention_2 over allocating kernels")
    args = parser.parse_args(argv)
    if args.attn == "flash_attention_2" and args.profile:
        parser.error("--profile tables sdpa's kernels: leave it out with --attn flash_attention_2")
    _init()
    global ATTENTION
    ATTENTION = args.attn
    if ATTENTION == "flash_attention_2":
        _allocating_flash_kernels()
    torch.set_num_threads(1)
    import transformers

    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    families = list(MODELS) if args.model == "both" else [args.model]
    modes = [
        _Mode(family, mode) for family in families
        for mode in (["reentrant", "non-reentrant"] if args.mode == "both" else [args.mode])
    ]
    for _ in range(args.warmup):
        for mode in modes:
            for model in mode.models():
                _step(*model, ids)
    gc.collect()
    served = [mode.served() for mode in modes]
    plain_steps = [
        statistics.median(_step(*mode.plain, ids)["step"] for _ in range(args.pairs // 4)) * 1e6 for mode in modes
    ]
    pairs = [pair for mode in modes for pair in mode.comparisons()]
    costs = iter(_paired(pairs, ids, args.pairs))
    by_mode = [[next(costs) for _ in mode.comparisons()] for mode in modes]
    for mode, before in zip(modes, served):
        got = tuple(after - start for after, start in zip(mode.served(), before))
        if got != (LAYERS * args.pairs, LAYERS // 2 * args.pairs):
            sys.exit(f"attention_stash_host needs every recompute served, got {got} in {mode.mode} checkpointing, "
                     f"of {(LAYERS * args.pairs, LAYERS // 2 * args.pairs)}.")

    print(f"attention stash host cost: {' and '.join(MODELS[family] for family in families)}, {LAYERS} layers, hidden "
          f"32, sequence 8, attn_implementation \"{ATTENTION}\", one thread, {args.pairs} paired steps per "
          f"comparison, interleaved; torch {torch.__version__}, transformers {transformers.__version__}")
    if args.mode == "reentrant":
        print("TRL's selective checkpointing is left out: it has no reentrant mode.")
    summary = []
    for family in families:
        family_modes = [(mode, mode_costs, plain_step)
                        for mode, mode_costs, plain_step in zip(modes, by_mode, plain_steps) if mode.family == family]
        for mode, mode_costs, plain_step in family_modes:
            _report(mode, plain_step, mode_costs[0], mode_costs[1], args.target)
        stash_costs = [(mode.mode, mode_costs[0]) for mode, mode_costs, _ in family_modes]
        if len(family_modes) == 2:
            ratio, low, high, verdict = _ratio(stash_costs[1][1], stash_costs[0][1], args.ratio_target)
            print(f"\nnon-reentrant against reentrant: {ratio:.2f} times the host cost per stashed layer and step "
                  f"({low:.2f} to {high:.2f} from the medians' 95% intervals): {verdict} the {args.ratio_target:.1f} "
                  f"times target")
        selective = [(mode, mode_costs[2]) for mode, mode_costs, _ in family_modes if mode.selective is not None]
        row = {
            "model": MODELS[family],
            "plain": {
                m.mode: p / LAYERS
                for m, _, p in family_modes
            },
            "stash": {
                m.mode: c[0]["step"][0] / LAYERS
                for m, c, _ in family_modes
            }
        }
        if selective:
            mode, selective_cost = selective[0]
            print()
            _report_selective(mode, stash_costs, selective_cost, args.selective_target)
            row["selective"] = selective_cost["step"][0] / LAYERS
        summary.append(row)
    _summary(summary)
    if args.profile:
        for mode in modes:
            print(f"\n{MODELS[mode.family]}, {mode.mode} checkpointing:")
            _profile([("plain", mode.plain), (f"all {LAYERS} stashed", mode.full)], ids, args.profile)


def _summary(rows):
    """One line per model: the plain step's host time per layer, and the host cost per layer and step of TRL's
    selective checkpointing and of the stash in each mode (medians of the paired differences)."""
    print("\nhost cost per layer and step (us; medians of paired differences; plain: the whole step per layer)")
    columns = ("plain (reentrant)", "plain (non-reentrant)", "selective (TRL)", "stash (reentrant)",
               "stash (non-reentrant)")
    header = f"{'model':<12}" + "".join(f"{column:>23}" for column in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = (row["plain"].get("reentrant"), row["plain"].get("non-reentrant"), row.get("selective"),
                 row["stash"].get("reentrant"), row["stash"].get("non-reentrant"))
        print(f"{row['model']:<12}" + "".join(f"{'-' if cell is None else f'{cell:,.1f}':>23}" for cell in cells))


if __name__ == "__main__":
    main()
