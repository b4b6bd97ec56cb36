"""End-to-end decoding throughput of whole hybrid models: every SSM state mode against eager
fp32 state, in the same run.

    python -m replayssm.bench_e2e [--layouts ...] [--modes ...] [--batches ...] [--starts ...]
                                  [--context 1024] [--json FILE]
    python -m replayssm.bench_e2e --plot FILE.json [--out FILE.png]

For each layout (the real Nemotron-3-Nano-4B and Qwen3.5-4B layouts by default; the
mixture-of-experts Nemotron-3-Nano-30B-A3B and Qwen3.5-35B-A3B on request; random bf16
weights), batch and state mode, one decode step of the whole model (``model.step_argmax``: the
greedy token, the engine's :class:`~replayssm.models.engine.StepRunner`) is captured in a CUDA graph
and replayed; a row is its slot, every row is live (no pad rows). The step runs the fused Triton
kernels of :mod:`replayssm.models.fused` (conv, norms, GDN gates); ``REPLAYSSM_FUSED=0`` in the
environment times the plain-torch step instead.

Context. Every row starts with ``--context`` tokens of synthetic context, laid down without a
prefill (a real one at batch 256 would dominate the run): the KV rows [0, context) and the conv
windows are filled with N(0, 1) values, each SSM layer's state is loaded with a random state
(``StateCache.load_state`` into one slot, as a prefill hands it over, then copied on the device
to the other slots: :func:`fill_ssm_state`), and ``lengths`` is set to the context.
Decode cost depends on the lengths and shapes, not on the values. The context grows by the steps
the run decodes (a few hundred at most).

Starts. ``synchronized``: every row's ring is empty at the start, so all rows fold on the same
step (the worst case for one step, the same average). ``staggered``: row b first decodes
``b % L`` tokens alone (the other rows pad), so its folds fall on its own steps, as requests
arriving at different times have them (the realistic case). Eager modes run the same warm-up.

Timing. After ``L`` warm-up steps (one fold period; eager modes: 2), ``--repeats`` windows of
``--steps`` steps (rounded up to a multiple of L: each window holds the same folds) are timed
with CUDA events; ms per step is the median window's mean, tokens/s is batch / (ms per step).
Speedups divide eager-fp32's ms per step by each mode's, at the same layout, batch and starts,
measured in this run.

Breakdown (the largest batch, staggered starts by default: ``--profile-batches``,
``--profile-starts``; ``--profile-all`` for every batch and start). ``torch.profiler`` records L (at
least 4) more graph replays; each GPU kernel's time goes to one class by its name: ``ssm`` the
library's kernels (namespace ``replayssm::``: decode, fold, commit), ``attention`` this
package's decode-attention kernels, ``gemm`` cuBLAS/CUTLASS matrix kernels (names with gemm,
gemv, nvjet, cutlass, xmma, splitK), ``other`` the rest (norms, activations, the causal conv,
rotary, KV and conv-window writes, copies, argmax). Shares are of the summed kernel time
(kernels of one graph do not overlap). On the CPU the same classes come from the top-level
operators of eager steps (the SSM op and attention are tagged with record_function). A profiled
row also lists its top kernels by time (``top_kernels``: name, class, calls and us per step), so
the "other" class can be read; the text summary prints the first few.

``attention_gb_per_s`` is the live keys' and values' bytes per step over the attention
kernels' time per step (on CUDA): how close the attention kernel runs to memory bandwidth.

Memory: the peak of PyTorch's allocator over the configuration (the model's weights included)
and the serving cache's own bytes. Caches are freed between configurations.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch

import replayssm
from replayssm.models import ServingCache, StateMode, attention
from replayssm.models.base import slot_regions
from replayssm.models.engine import StepRunner

#: name -> (family module, config: an attribute path in it, called if callable, model class).
LAYOUTS = {
    "nemotron-nano-4b": ("nemotron_h", "NemotronHConfig.nano4b", "NemotronHModel"),
    "qwen3.5-4b": ("qwen3_5", "QWEN35_4B", "Qwen35Model"),
    # Mixture-of-experts layouts (not run by default: 60-70 GB of bf16 weights each).
    "nemotron-nano-30b-a3b": ("nemotron_h", "NemotronHConfig.nano30b_a3b", "NemotronHModel"),
    "qwen3.5-35b-a3b": ("qwen3_5", "QWEN35_MOE_35B_A3B", "Qwen35MoeModel"),
    "nemotron-tiny": ("nemotron_h", "NemotronHConfig.tiny", "NemotronHModel"),
    "qwen3.5-tiny": ("qwen3_5", "tiny_config", "Qwen35Model"),
    "nemotron-moe-tiny": ("nemotron_h", "NemotronHConfig.tiny_moe", "NemotronHModel"),
    "qwen3.5-moe-tiny": ("qwen3_5", "tiny_moe_config", "Qwen35MoeModel"),
}
DEFAULT_LAYOUTS = ("nemotron-nano-4b", "qwen3.5-4b")
DEFAULT_BATCHES = (1, 16, 64, 256)
STARTS = ("synchronized", "staggered")
BASELINE = "eager-fp32"
PROFILE_STEPS = 4  # at least; a replay mode profiles one fold period
TOP_KERNELS = 15  # kernels (operators on the CPU) a profiled row lists by time
SUMMARY_TOP = 8  # of those, the text summary prints

#: The speedups over eager-fp32 aimed at (batch 256, staggered starts, H200).
TARGETS = {
    "nemotron-nano-4b": {"replay-fp32": 1.35, "replay-fp32+bf16": 1.6},
    "qwen3.5-4b": {"replay-fp32": 1.2, "replay-fp32+bf16": 1.4},
}

CLASSES = ("ssm", "attention", "gemm", "other")
_GEMM_MARKS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")
_ATTENTION_KERNELS = ("_attention_kernel", "_combine_kernel")
_SSM_TAG, _ATTENTION_TAG = "bench_e2e.ssm", "bench_e2e.attention"


def kernel_class(name: str) -> str:
    """The breakdown class of a GPU kernel, by its (demangled) name."""
    if "replayssm::" in name:
        return "ssm"
    if any(k in name for k in _ATTENTION_KERNELS):
        return "attention"
    lower = name.lower()
    if any(m in lower for m in _GEMM_MARKS):
        return "gemm"
    return "other"


def operator_class(name: str) -> str:
    """The breakdown class of a top-level CPU operator (or record_function tag)."""
    if name == _SSM_TAG:
        return "ssm"
    if name == _ATTENTION_TAG:
        return "attention"
    if name in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm",
                "aten::_grouped_mm"):
        return "gemm"
    return "other"


def load_model(layout: str, device: str, dtype: torch.dtype, seed: int = 0):
    try:
        module_name, config_path, class_name = LAYOUTS[layout]
    except KeyError:
        raise SystemExit(f"bench_e2e: unknown layout {layout!r}; choose from "
                         f"{', '.join(LAYOUTS)}") from None
    module = importlib.import_module(f"replayssm.models.{module_name}")
    config: Any = module
    for part in config_path.split("."):
        config = getattr(config, part)
    if callable(config):
        config = config()
    return getattr(module, class_name).random(config, seed=seed, device=device, dtype=dtype)


def fill_context(cache: ServingCache, history: torch.Tensor, batch: int, context: int,
                 seed: int) -> list[int]:
    """Allocates ``batch`` slots holding ``context`` tokens of synthetic context (module doc)."""
    gen = torch.Generator(device=cache.device).manual_seed(seed)
    slots = [cache.allocate() for _ in range(batch)]
    rows = torch.tensor(slots, device=cache.device)
    for kv in (cache.k, cache.v):
        part = kv[:, rows, :, :context]
        kv[:, rows, :, :context] = torch.randn(part.shape, generator=gen, device=cache.device,
                                               dtype=kv.dtype)
    cache.conv[:, rows] = torch.randn(cache.conv[:, rows].shape, generator=gen,
                                      device=cache.device, dtype=cache.conv.dtype)
    fill_ssm_state(cache.ssm, slots, gen)
    cache.lengths[rows] = context
    history[rows, context] = torch.randint(0, 100, (batch,), generator=gen, device=cache.device)
    return slots


def fill_ssm_state(ssm, slots: list[int], gen: torch.Generator) -> None:
    """Loads one random state per layer into every slot of ``slots``, in bulk on the device:
    ``load_state`` writes the first slot's every copy the mode keeps (fp32 master, bf16 copy,
    fp8 + scales; the emptied ring and its counters), then each buffer's region of that slot is
    copied to the others, so every slot holds the same valid state (a per-slot, per-layer
    ``load_state`` took most of a configuration's setup at batch 256)."""
    first, rest = slots[0], slots[1:]
    for layer in range(ssm.config.num_layers):
        # The values do not change the cost; a small scale keeps the decode finite.
        ssm.load_state(layer, first, 0.1 * torch.randn(ssm.config.state_shape, generator=gen,
                                                       device=gen.device))
    if not rest:
        return
    others = torch.tensor(rest, device=gen.device)
    for region in slot_regions(ssm):
        region[:, others] = region[:, first:first + 1].clone()


def stagger(runner: StepRunner, slots: list[int], buffer_len: int) -> None:
    """Row b decodes b % buffer_len tokens before the others start (module doc)."""
    for s in range(buffer_len - 1):
        runner.set_slots([slot if b % buffer_len > s else -1 for b, slot in enumerate(slots)])
        runner.run()
    runner.set_slots(slots)


def kv_bytes_per_step(cache: ServingCache, slots: list[int]) -> int:
    """Bytes of keys and values a step's attention reads: each row's live keys, every
    attention layer (the lengths as they stand now, after the profiled steps)."""
    layout = cache.layout
    keys = int(cache.lengths[torch.tensor(slots, device=cache.device)].sum()) + len(slots)
    return 2 * keys * layout.num_attn_layers * layout.kv_heads * layout.head_dim \
        * cache.k.element_size()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(runner: StepRunner, steps: int, repeats: int, device: str) -> list[float]:
    """ms per step of each of ``repeats`` windows of ``steps`` back-to-back steps."""
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                runner.run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.run()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
    return times


@contextlib.contextmanager
def tagged_ops():
    """Tags the SSM ops and decode attention with record_function (the CPU breakdown): the
    families call them through these module attributes."""
    saved = {(replayssm, "mamba2_decode"), (replayssm, "gdn_decode"),
             (attention, "decode_attention")}
    originals = {(mod, name): getattr(mod, name) for mod, name in saved}

    def wrap(fn: Callable, tag: str) -> Callable:
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(tag):
                return fn(*args, **kwargs)
        return wrapped

    for (mod, name), fn in originals.items():
        setattr(mod, name, wrap(fn, _ATTENTION_TAG if name == "decode_attention" else _SSM_TAG))
    try:
        yield
    finally:
        for (mod, name), fn in originals.items():
            setattr(mod, name, fn)


def breakdown(runner: StepRunner, steps: int, device: str
              ) -> tuple[dict[str, float], float, str, list[dict[str, Any]]]:
    """(share of each class, kernel or operator ms per step, what was profiled, the top
    kernels or operators by time: name, class, calls and us per step)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore", message=".*Profiler clears events")

    totals = dict.fromkeys(CLASSES, 0.0)
    by_name: dict[str, list[float]] = {}  # name -> [calls, us]
    if device == "cuda":
        # Graph replays where the profiler sees their kernels; else the same step's eager calls.
        for source, step in (("cuda graph replays", runner.run), ("eager steps", runner.eager_step)):
            sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step()
                sync(device)
            by_name.clear()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    totals[kernel_class(e.name)] += e.device_time_total
                    entry = by_name.setdefault(e.name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += e.device_time_total
            if sum(totals.values()) > 0:
                break
        else:
            raise RuntimeError("the profiler recorded no GPU kernel")
    else:
        with tagged_ops(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.run()
        source = "cpu operators"
        for e in prof.events():
            if e.cpu_parent is None:
                totals[operator_class(e.name)] += e.cpu_time_total
                entry = by_name.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += e.cpu_time_total
    total = sum(totals.values())
    classify = kernel_class if device == "cuda" else operator_class
    top = [dict(name=name, cls=classify(name), calls_per_step=calls / steps,
                us_per_step=us / steps)
           for name, (calls, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]]
    return ({k: v / total for k, v in totals.items()}, total / 1e3 / steps, source, top)


def bench_one(model, layout: str, mode: StateMode, batch: int, starts: list[str],
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every start of one (layout, mode, batch): one cache and captured step, refilled per
    start."""
    device = args.device
    # One fold period (replay); eager state costs the same every step.
    period = 1 if mode.eager else mode.buffer_len
    steps = -(-args.steps // period) * period
    warm_up = max(period, 2)
    used = period + warm_up + max(period, PROFILE_STEPS) + steps * args.repeats
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = ServingCache(model, capacity=batch, max_seq_len=args.context + used + 2, mode=mode,
                         fold_every="auto" if mode.eager else args.fold_every)
    cache_bytes = (cache.ssm.nbytes + sum(t.numel() * t.element_size()
                                          for t in (cache.k, cache.v, cache.conv)))
    history = torch.zeros(batch + 1, cache.max_seq_len, dtype=torch.int64, device=device)
    runner = StepRunner(model, cache, history, batch, cuda_graph=device == "cuda")
    results = []
    slots: list[int] = []
    for start_kind in starts:
        for slot in slots:
            cache.free(slot)
        slots = fill_context(cache, history, batch, args.context, seed=batch)
        runner.set_slots(slots)
        if start_kind == "staggered":
            stagger(runner, slots, period)
        for _ in range(warm_up):
            runner.run()
        sync(device)
        ms = time_steps(runner, steps, args.repeats, device)
        ms_step = statistics.median(ms)
        row = dict(layout=layout, mode=str(mode), batch=batch, starts=start_kind,
                   context=args.context, ms_per_step=ms_step, ms_windows=ms,
                   tokens_per_s=batch * 1e3 / ms_step, steps_per_window=steps,
                   cache_gb=cache_bytes / 2**30,
                   fold_every=cache.fold_every(cache.layout.ssm_kind, batch, 1))
        if start_kind in args.profile_starts and batch in args.profile_batches:
            try:
                shares, profiled_ms, source, top = breakdown(runner, max(period, PROFILE_STEPS),
                                                             device)
            except RuntimeError as e:  # the timings stand without it
                row["profile_error"] = str(e)
                print(f"[bench_e2e] no breakdown: {e}", file=sys.stderr, flush=True)
            else:
                row.update(breakdown=shares, ssm_share=shares["ssm"],
                           profiled_ms_per_step=profiled_ms, profiled=source, top_kernels=top)
                if device == "cuda" and shares["attention"] > 0:
                    row["attention_gb_per_s"] = (kv_bytes_per_step(cache, slots)
                                                 / (shares["attention"] * profiled_ms * 1e6))
        if device == "cuda":
            row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        results.append(row)
    runner.release()
    del runner, cache, history
    return results


def add_speedups(runs: list[dict[str, Any]]) -> None:
    base = {(r["layout"], r["batch"], r["starts"]): r["ms_per_step"]
            for r in runs if r["mode"] == BASELINE}
    for r in runs:
        ref = base.get((r["layout"], r["batch"], r["starts"]))
        r["speedup_vs_eager_fp32"] = None if ref is None else ref / r["ms_per_step"]


def summary_lines(runs: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'layout':<17}{'starts':<13}{'batch':>6} {'mode':<18}{'ms/step':>9}{'tok/s':>10}"
             f"{'speedup':>9}{'ssm':>6}{'attn':>6}{'gemm':>6}{'other':>6}{'peak GB':>9}"
             f"{'attn GB/s':>10}"]
    for r in runs:
        s = r.get("breakdown", {})
        speed = r.get("speedup_vs_eager_fp32")
        lines.append(
            f"{r['layout']:<17}{r['starts']:<13}{r['batch']:>6} {r['mode']:<18}"
            f"{r['ms_per_step']:>9.3f}{r['tokens_per_s']:>10.0f}"
            f"{'' if speed is None else f'{speed:.2f}x':>9}"
            + "".join(f"{100 * s[c]:>5.0f}%" if c in s else f"{'':>6}" for c in CLASSES)
            + (f"{r['peak_memory_gb']:>9.1f}" if "peak_memory_gb" in r else f"{'':>9}")
            + (f"{r['attention_gb_per_s']:>10.0f}" if "attention_gb_per_s" in r else ""))
    for r in runs:
        lines += top_kernel_lines(r, f"{r['layout']} {r['starts']} batch {r['batch']} {r['mode']}")
    for layout, targets in TARGETS.items():
        for mode, target in targets.items():
            got = [r["speedup_vs_eager_fp32"] for r in runs
                   if r["layout"] == layout and r["mode"] == mode and r["batch"] == 256
                   and r["starts"] == "staggered" and r.get("speedup_vs_eager_fp32")]
            if got:
                verdict = "met" if got[0] >= target else "MISSED"
                lines.append(f"target {layout} {mode} batch 256 staggered: {got[0]:.2f}x "
                             f"(aim {target}x) {verdict}")
    return lines


def top_kernel_lines(row: dict[str, Any], label: str) -> list[str]:
    """A profiled row's breakdown by class and its top kernels, for the summary."""
    if not row.get("top_kernels"):
        return []
    shares = " ".join(f"{c} {100 * row['breakdown'][c]:.0f}%" for c in CLASSES)
    return ([f"top kernels: {label} ({row['profiled_ms_per_step']:.3f} ms/step profiled: "
             f"{shares})"]
            + [f"  {k['us_per_step']:>9.1f} us {k['calls_per_step']:>6.1f}x "
               f"{k['cls']:<9} {k['name'][:100]}" for k in row["top_kernels"][:SUMMARY_TOP]])


def plot(path: str, out: str | None) -> str:
    """Draws a run's JSON: per layout, each replay mode's speedup over eager-fp32 against batch
    (a panel for each of staggered and synchronized starts that the run has), and the step's
    breakdown at the largest batch (staggered)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        runs = json.load(f)["runs"]
    layouts = list(dict.fromkeys(r["layout"] for r in runs))
    starts_run = [s for s in STARTS if any(r["starts"] == s for r in runs)]  # a panel each
    fig, axes = plt.subplots(len(layouts), len(starts_run) + 1,
                             figsize=(6.4 * (len(starts_run) + 1), 4.2 * len(layouts)),
                             squeeze=False)
    colors = {c: plt.cm.tab10(i) for i, c in enumerate(CLASSES)}
    for row, layout in zip(axes, layouts):
        mine = [r for r in runs if r["layout"] == layout]
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        for ax, starts in zip(row[:-1], starts_run):
            for mode in modes:
                pts = sorted((r["batch"], r["speedup_vs_eager_fp32"]) for r in mine
                             if r["mode"] == mode and r["starts"] == starts
                             and r.get("speedup_vs_eager_fp32") is not None)
                if pts and mode != BASELINE:
                    ax.plot(*zip(*pts), marker="o", label=mode)
            for mode, target in TARGETS.get(layout, {}).items():
                ax.axhline(target, ls=":", lw=0.8, color="gray")
                ax.annotate(f"aim {mode} {target}x", (0.01, target), xycoords=("axes fraction", "data"),
                            fontsize=7, color="gray", va="bottom")
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xscale("log", base=2)
            batches = sorted({r["batch"] for r in mine})
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_xlabel("batch")
            ax.set_ylabel("tokens/s vs eager-fp32")
            ax.set_title(f"{layout}, {starts} starts")
            ax.legend(fontsize=7)
        ax = row[-1]
        largest = max(r["batch"] for r in mine)
        bars = [r for r in mine if r["batch"] == largest and r["starts"] == "staggered"
                and "breakdown" in r]
        bottom = [0.0] * len(bars)
        for c in CLASSES:
            heights = [r["breakdown"][c] * r["ms_per_step"] for r in bars]
            ax.bar(range(len(bars)), heights, bottom=bottom, color=colors[c], label=c)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(range(len(bars)), [r["mode"] for r in bars], rotation=30, fontsize=7,
                      ha="right")
        ax.set_ylabel("ms per step (split by the profiled shares)")
        ax.set_title(f"{layout}, batch {largest}, staggered: step breakdown")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = out or path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=120)
    return out


def arg_parser(module: str, doc: str, default_batches: tuple[int, ...]
               ) -> argparse.ArgumentParser:
    """The options every whole-model benchmark takes (what runs, where, the results' file)."""
    p = argparse.ArgumentParser(prog=f"python -m replayssm.{module}",
                                description=doc.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), choices=list(LAYOUTS),
                   metavar="LAYOUT", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--batches", nargs="+", type=int, default=list(default_batches))
    p.add_argument("--context", type=int, default=1024, help="synthetic context tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="timed windows (median)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--json", help="write the results here")
    return p


def fold_every_arg(text: str) -> "str | int":
    """--fold-every: "auto" or a non-negative integer (ServingCache checks it against L)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'auto' or a number of tokens, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of tokens >= 0, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = arg_parser("bench_e2e", __doc__, DEFAULT_BATCHES)
    p.add_argument("--modes", nargs="+", default=list(StateMode.NAMES),
                   help="state modes (':L' sets a replay mode's buffer length)")
    p.add_argument("--starts", nargs="+", default=list(STARTS), choices=STARTS)
    p.add_argument("--steps", type=int, default=16,
                   help="steps per timed window (rounded up to a multiple of L)")
    p.add_argument("--profile-starts", nargs="*", default=["staggered"], choices=STARTS,
                   help="the starts whose step breakdown is profiled (none: no profile)")
    p.add_argument("--profile-batches", nargs="*", type=int,
                   help="the batches profiled (default: the largest of --batches)")
    p.add_argument("--profile-all", action="store_true",
                   help="profile every batch and both starts")
    p.add_argument("--fold-every", default="auto", type=fold_every_arg,
                   help="the replay modes' fold cadence: auto (ServingCache's rule) or tokens, "
                        "0 = the buffer length")
    p.add_argument("--plot", metavar="JSON", help="draw a results file instead of running")
    p.add_argument("--out", help="the plot's file (default: the JSON's name with .png)")
    args = p.parse_args(argv)
    if args.plot is None:
        try:
            args.modes = [StateMode.parse(m) for m in args.modes]
        except ValueError as e:
            p.error(str(e))
        if args.profile_all:
            args.profile_starts, args.profile_batches = list(STARTS), list(args.batches)
        elif args.profile_batches is None:
            args.profile_batches = [max(args.batches)]
        if any(b < 1 for b in args.batches) or args.context < 1 or args.steps < 1 \
                or args.repeats < 1:
            p.error("batches, context, steps and repeats must be positive")
        check_profile_batches(p, args)
    return args


def check_profile_batches(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A batch to profile must be one that runs (else the profile would silently not be)."""
    missing = sorted(set(args.profile_batches) - set(args.batches))
    if missing:
        p.error(f"--profile-batches {' '.join(map(str, missing))}: not among --batches "
                f"{' '.join(map(str, args.batches))}")


def device_label(device: str) -> str:
    """The GPU's name, or the CPU's, for a result's metadata."""
    return (torch.cuda.get_device_name() if device == "cuda"
            else platform.processor() or platform.machine())


def run_configurations(bench: str, args: argparse.Namespace, meta: dict[str, Any],
                       configurations: list[tuple[int, Any]],
                       run: Callable[[Any, str, int, Any], list[dict[str, Any]]],
                       add_speedups: Callable[[list[dict[str, Any]]], None]
                       ) -> list[dict[str, Any]]:
    """The rows of ``run(model, layout, batch, what)`` for every layout of ``args.layouts``
    (its model loaded once, freed before the next) and every ``(batch, what)`` of
    ``configurations``. After each configuration: a progress line on stderr, ``add_speedups``
    over all rows, and ``args.json`` rewritten (``meta`` plus the seconds so far), so that a
    run cut short keeps its results."""
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    for layout in args.layouts:
        model = load_model(layout, args.device, dtype)
        for batch, what in configurations:
            t0 = time.perf_counter()
            runs += run(model, layout, batch, what)
            print(f"[{bench}] {layout} batch {batch} {what}: {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
            add_speedups(runs)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(meta={**meta, "seconds": time.perf_counter() - started},
                                   runs=runs), f, indent=1)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        print(plot(args.plot, args.out))
        return 0
    meta = dict(device=device_label(args.device),
                torch=torch.__version__, replayssm=replayssm.__version__, dtype=args.dtype,
                context=args.context, repeats=args.repeats,
                command="python -m replayssm.bench_e2e " + " ".join(
                    sys.argv[1:] if argv is None else argv))
    runs = run_configurations(
        "bench_e2e", args, meta, [(b, m) for b in args.batches for m in args.modes],
        lambda model, layout, batch, mode: bench_one(model, layout, mode, batch, args.starts,
                                                     args),
        add_speedups)
    print("\n".join(summary_lines(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
