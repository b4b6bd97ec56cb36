"""Speculative decoding throughput of whole hybrid models: replay verify against per-draft-state
verify against plain decoding, in the same run and the same harness.

    python -m replayssm.bench_spec [--layouts ...] [--batches 16 64 256] [--window 4]
                                   [--acceptance P1 ... PT] [--json FILE]
    python -m replayssm.bench_spec --measure MODEL_DIR ... [--measure-windows 2 ... 8]

Methods (each a :class:`~replayssm.models.speculative.SpeculativeDecoder` step captured in a
CUDA graph: the n-gram drafter on the device, the window's decode through the whole model,
argmax, acceptance, commit):

- ``replay-verify``: a replay cache verifies windows of T tokens from its checkpoint and ring,
  writing no state; rollback is the commit's cursor. Its state mode (``--replay-mode MODE`` for
  every layout, ``LAYOUT=MODE`` for one) defaults to the faster one per family,
  ``REPLAY_MODE``: replay-fp32+bf16:8 for both families.
- ``per-draft-state``: an eager cache (``--eager-mode``, default eager-fp32: fp32 state, as
  Nemotron-H's configuration asks, ``mamba_ssm_cache_dtype``) with ``max_spec_tokens = T``: the window writes a
  state copy per token and commit selects one, as engines verify drafts today.
- ``plain``: no speculation, one token per step on the eager cache.

Acceptance. Random weights (``--layouts``: the real Nemotron-3-Nano-4B and Qwen3.5-4B layouts,
random bf16 weights) make drafts that are never right, so the accepted counts are forced: each
row's count per step (1..T tokens: the pending token plus the accepted drafts) is drawn from a
fixed distribution (``--acceptance``, else the table ``ACCEPTANCE`` measured below for the
layout's family and T), seeded, one table of ``--steps`` steps replayed on the device. Costs
that depend on the accepted counts (folds, cursors) follow them; the tokens themselves are not
the greedy ones, which changes nothing in the cost.

``ACCEPTANCE`` was measured with ``--measure`` on the CPU: the n-gram drafter (``max_ngram``
3, lookback 1024) driving greedy speculative decoding (replay-fp32 cache, fp32) of two small
trained byte-level models of the accuracy study (``study/models``: Nemotron-H and Qwen3.5
layouts of 6.8 M and 6.4 M parameters, 1.24 and 1.22 nats/byte on their held-out text), over
their held-out files of the Python standard library's sources (heldout.txt: 33 paths; the 28
that exist under Python 3.11's library with at least 512 bytes, the models having trained on
Python 3.12's other paths): per file a prompt of its first 512 bytes, then 256 new tokens, every
row-step's accepted count recorded, for each T (about a minute per model and T on 2 cores):

    python -m replayssm.bench_spec --measure study/models/nemotron_h study/models/qwen3_5 \
        --files-root /usr/lib/python3.11 --measure-windows 2 3 4 5 6 7 8

At T = 4, Nemotron-H accepts 1, 2, 3, 4 tokens in 34%, 5%, 3%, 59% of the steps (mean 2.86),
Qwen3.5 in 39%, 8%, 3%, 49% (mean 2.63): all or nothing, mostly. Greedy generation of models
this small repeats itself more than a 4B model's would, which favours prompt lookup: the
distribution is optimistic for real models. The speedup of replay verify over per-draft state
depends on it only through the fold and cursor costs (both methods emit the same tokens per
step); the speedup over plain decoding depends on it directly.

Timing, context. Every row holds ``--context`` tokens of synthetic context laid down as
bench_e2e does (no prefill). After warm-up steps, ``--repeats`` windows of ``--steps`` steps are
timed with CUDA events (each window replays the whole acceptance table once); ms per step is
the median window's mean. Accepted tokens/s = batch x mean accepted per step / ms per step.

Memory. Per request: the serving cache's bytes per slot (SSM state cache, conv windows, KV rows
for ``--request-tokens`` tokens); the maximum concurrent requests is ``--budget-gb`` GiB of
cache divided by that (defaults: 8192 tokens, 64 GiB). Also PyTorch's peak allocation per configuration (weights included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import sysconfig
import time
from typing import Any

import torch

import replayssm
from replayssm.bench_e2e import (arg_parser, breakdown, check_profile_batches, device_label,
                                 fill_context, run_configurations, sync, time_steps,
                                 top_kernel_lines)
from replayssm.models import ServingCache, StateMode
from replayssm.models.speculative import NgramDrafter, SpecRunner, SpeculativeDecoder

DEFAULT_BATCHES = (16, 64, 256)
METHODS = ("replay-verify", "per-draft-state", "plain")
BASELINE = "per-draft-state"

#: Row-steps that accepted 1, 2, ..., T tokens, by family and T (module doc: measured).
#: Mean accepted tokens per step: Nemotron-H 1.75, 2.36, 2.86, 3.30, 3.64, 3.94, 4.16 and
#: Qwen3.5 1.70, 2.23, 2.63, 2.95, 3.21, 3.41, 3.61 at T = 2 .. 8.
ACCEPTANCE: dict[str, dict[int, list[int]]] = {
    family: {len(counts): counts for counts in rows} for family, rows in {
        # One row per T = 2 .. 8: T counts, so each row's length is its T.
        "nemotron_h": ([1003, 3076], [875, 202, 1961], [854, 123, 63, 1473],
                       [776, 136, 65, 65, 1137], [781, 125, 54, 41, 30, 951],
                       [771, 115, 35, 62, 21, 28, 798], [788, 107, 39, 39, 29, 26, 26, 684]),
        "qwen3_5": ([1253, 2950], [1109, 255, 1847], [1072, 215, 94, 1349],
                    [1050, 187, 85, 64, 1049], [1007, 202, 72, 61, 55, 841],
                    [1022, 184, 55, 65, 46, 43, 700], [990, 181, 62, 51, 43, 40, 22, 607]),
    }.items()
}

#: The layouts' families, for ACCEPTANCE.
FAMILY = {"nemotron-nano-4b": "nemotron_h", "nemotron-tiny": "nemotron_h",
          "qwen3.5-4b": "qwen3_5", "qwen3.5-tiny": "qwen3_5"}

#: Accepted tokens/s of replay verify over per-draft state aimed at (batch 256, T = 4, H200).
TARGETS = {"nemotron-nano-4b": 1.8, "qwen3.5-4b": 1.5}

#: The replay mode each family verifies windows with by default: the faster one at batch 256,
#: T = 4 on an H200 (docs/BENCHMARKS.md). L = 8 (a window's outputs combine up to L - 1 + T
#: records) and a bf16 read copy beside the fp32 master for both: both verify kernels read
#: bf16 copies on the tensor cores (Qwen3.5-4B 1.57x with it against 1.50x with an fp32
#: checkpoint alone, one device call).
REPLAY_MODE = {"nemotron_h": "replay-fp32+bf16:8", "qwen3_5": "replay-fp32+bf16:8"}


def acceptance_for(layout: str, window: int, given: list[float] | None) -> list[float]:
    """The accepted-count distribution (fractions of 1..T tokens) a run forces."""
    if given is None:
        table = ACCEPTANCE.get(FAMILY[layout], {})
        if window not in table:
            raise ValueError(f"no measured acceptance for {FAMILY[layout]} at T = {window}: "
                             "pass --acceptance")
        given = table[window]
    if len(given) != window or any(p < 0 for p in given) or sum(given) <= 0:
        raise ValueError(f"--acceptance takes {window} non-negative weights (1..{window} "
                         f"tokens), got {given}")
    return [p / sum(given) for p in given]


def ssm_bytes_per_slot(cache: ServingCache) -> int:
    """The state cache's bytes per slot: its buffers at capacity 2 minus at capacity 1."""
    config = cache.ssm.config
    at = [sum(b.nbytes for b in replayssm.cache_buffers(dataclasses.replace(config, capacity=c)))
          for c in (1, 2)]
    return at[1] - at[0]


def bytes_per_request(cache: ServingCache, request_tokens: int) -> int:
    """A request's serving-cache bytes with KV rows for ``request_tokens`` tokens."""
    layout = cache.layout
    item = torch.finfo(cache.dtype).bits // 8
    kv = 2 * layout.num_attn_layers * layout.kv_heads * request_tokens * layout.head_dim * item
    conv = layout.num_ssm_layers * cache.conv_ring * layout.conv_channels * item
    return ssm_bytes_per_slot(cache) + kv + conv


class ForcedAcceptance:
    """A table of accepted counts [steps, batch] on the device, one row per step in turn
    (capturable: a device counter picks the row)."""

    def __init__(self, probs: list[float], steps: int, batch: int, device: Any, seed: int):
        g = torch.Generator().manual_seed(seed)
        draws = torch.multinomial(torch.tensor(probs), steps * batch, replacement=True,
                                  generator=g)
        self.table = (draws + 1).int().view(steps, batch).to(device)
        self.counter = torch.zeros(1, dtype=torch.long, device=device)

    @property
    def mean(self) -> float:
        return float(self.table.float().mean())

    def __call__(self) -> torch.Tensor:
        row = self.table.index_select(0, self.counter % self.table.shape[0])[0]
        self.counter.add_(1)
        return row


def method_mode(method: str, layout: str, args: argparse.Namespace) -> tuple[str, int]:
    """The state mode and window of ``method`` on ``layout``."""
    if method == "plain":
        return args.eager_mode, 1
    if method == "replay-verify":
        return args.replay_modes[layout], args.window
    return args.eager_mode, args.window


def replay_modes(given: list[str] | None, layouts: list[str]) -> dict[str, str]:
    """Each layout's replay mode: ``REPLAY_MODE`` for its family, then ``given`` (entries MODE,
    for every layout, or LAYOUT=MODE), the later entries winning. Raises ValueError on a mode
    that is not a replay one or a layout that is not run."""
    modes = {layout: REPLAY_MODE[FAMILY[layout]] for layout in layouts}
    for entry in given or []:
        layout, _, mode = entry.rpartition("=")
        if layout and layout not in modes:
            raise ValueError(f"--replay-mode {entry}: {layout!r} is not among the layouts run "
                             f"({', '.join(layouts)})")
        if StateMode.parse(mode).eager:
            raise ValueError(f"--replay-mode takes replay modes, got {mode!r}")
        for key in ([layout] if layout else layouts):
            modes[key] = mode
    return modes


def bench_one(model, layout: str, method: str, batch: int, probs: list[float],
              args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    mode, T = method_mode(method, layout, args)
    parsed = StateMode.parse(mode)
    warm_up = max(2, -(-(1 if parsed.eager else parsed.buffer_len) // T))  # a fold period
    profiled = batch in args.profile_batches
    # Tokens a row may take: the warm-up, the timed windows, and a profiled pass (graph
    # replays, or eager steps where the profiler sees no graph kernels: at most two passes).
    used = (warm_up + 3 + args.steps * (args.repeats + (2 if profiled else 0))) * T
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = ServingCache(model, capacity=batch, max_seq_len=args.context + used + T + 2,
                         mode=mode, max_spec_tokens=T)
    drafter = NgramDrafter(lookback=args.lookback) if T > 1 else None
    spec = SpeculativeDecoder(model, cache, drafter, T)
    forced = ForcedAcceptance(probs, args.steps, batch, device, seed=batch) if T > 1 else None
    runner = SpecRunner(spec, batch, cuda_graph=device == "cuda", forced=forced)
    slots = fill_context(cache, spec.history, batch, args.context, seed=batch)
    runner.set_slots(slots)
    for _ in range(warm_up):
        runner.run()
    sync(device)
    ms = time_steps(runner, args.steps, args.repeats, device)
    ms_step = statistics.median(ms)
    mean_accepted = forced.mean if forced is not None else 1.0
    per_request = bytes_per_request(cache, args.request_tokens)
    row = dict(layout=layout, method=method, mode=mode, window=T, batch=batch,
               context=args.context, ms_per_step=ms_step, ms_windows=ms,
               mean_accepted=mean_accepted,
               accepted_tokens_per_s=batch * mean_accepted * 1e3 / ms_step,
               steps_per_window=args.steps, bytes_per_request=per_request,
               request_tokens=args.request_tokens, budget_gb=args.budget_gb,
               max_requests=int(args.budget_gb * 2**30 // per_request),
               ssm_bytes_per_request=ssm_bytes_per_slot(cache))
    if profiled:
        # One pass of the acceptance table: the same folds and cursor moves as the timing.
        shares, profiled_ms, source, top = breakdown(runner, args.steps, device)
        row.update(breakdown=shares, ssm_share=shares["ssm"], profiled_ms_per_step=profiled_ms,
                   profiled=source, top_kernels=top)
    if device == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    runner.release()
    return row


def add_speedups(runs: list[dict[str, Any]]) -> None:
    for ref_method, key in ((BASELINE, "speedup_vs_per_draft_state"),
                            ("plain", "speedup_vs_plain")):
        base = {(r["layout"], r["batch"]): r["accepted_tokens_per_s"]
                for r in runs if r["method"] == ref_method and "error" not in r}
        for r in runs:
            ref = base.get((r["layout"], r["batch"]))
            r[key] = None if ref is None or "error" in r else r["accepted_tokens_per_s"] / ref


def summary_lines(runs: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'layout':<17}{'batch':>6} {'method':<16}{'mode':<17}{'T':>2}{'ms/step':>9}"
             f"{'accepted':>9}{'tok/s':>10}{'vs draft-state':>15}{'vs plain':>9}"
             f"{'MB/request':>11}{'max req':>8}"]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['layout']:<17}{r['batch']:>6} {r['method']:<16}{r['mode']:<17}"
                         f"{r['window']:>2}  {r['error']}")
            continue
        a, b = r.get("speedup_vs_per_draft_state"), r.get("speedup_vs_plain")
        lines.append(
            f"{r['layout']:<17}{r['batch']:>6} {r['method']:<16}{r['mode']:<17}{r['window']:>2}"
            f"{r['ms_per_step']:>9.3f}{r['mean_accepted']:>9.2f}{r['accepted_tokens_per_s']:>10.0f}"
            f"{'' if a is None else f'{a:.2f}x':>15}{'' if b is None else f'{b:.2f}x':>9}"
            f"{r['bytes_per_request'] / 2**20:>11.1f}{r['max_requests']:>8}")
    for r in runs:
        lines += top_kernel_lines(r, f"{r['layout']} batch {r['batch']} {r['method']} {r['mode']}")
    for layout, target in TARGETS.items():
        got = [r["speedup_vs_per_draft_state"] for r in runs
               if r["layout"] == layout and r["method"] == "replay-verify" and r["batch"] == 256
               and r["window"] == 4 and r.get("speedup_vs_per_draft_state")]
        if got:
            verdict = "met" if got[0] >= target else "MISSED"
            lines.append(f"target {layout} replay verify vs per-draft state, batch 256, T = 4: "
                         f"{got[0]:.2f}x speedup (aim {target}x) {verdict}")
    return lines


# ---- measuring the acceptance ---------------------------------------------------------------

def measure(model_dir: str, windows: list[int], files_root: str, prompt_bytes: int,
            new_tokens: int) -> dict[str, Any]:
    """The n-gram drafter's accepted counts on a trained byte-level model over its held-out
    files (module doc)."""
    from replayssm.models import load

    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    model = load(model_dir)
    with open(os.path.join(model_dir, "heldout.txt")) as f:
        names = [line.strip() for line in f if line.strip()]
    prompts, used = [], []
    for name in names:
        path = os.path.join(files_root, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read(prompt_bytes)
        if len(data) == prompt_bytes:
            prompts.append(torch.tensor(list(data), dtype=torch.long))
            used.append(name)
    if not prompts:
        raise ValueError(f"none of the {len(names)} held-out files of {model_dir} is under "
                         f"{files_root} with {prompt_bytes} bytes or more (--files-root)")
    result: dict[str, Any] = dict(model=model_dir, model_type=model_type, files=used,
                                  files_root=files_root, prompt_bytes=prompt_bytes,
                                  new_tokens=new_tokens, windows={})
    for T in windows:
        cache = ServingCache(model, len(prompts), prompt_bytes + new_tokens + T + 1,
                             "replay-fp32", max_spec_tokens=T)
        spec = SpeculativeDecoder(model, cache, NgramDrafter(), T)
        t0 = time.perf_counter()
        out = spec.generate(prompts, new_tokens)
        counts = out.accepted_counts()
        result["windows"][T] = dict(counts=counts,
                                    fractions=[c / sum(counts) for c in counts],
                                    mean_accepted=sum((i + 1) * c for i, c in enumerate(counts))
                                    / sum(counts), steps=out.steps,
                                    seconds=time.perf_counter() - t0)
        print(f"[bench_spec] {model_type} T = {T}: mean accepted "
              f"{result['windows'][T]['mean_accepted']:.3f}, counts {counts}",
              file=sys.stderr, flush=True)
    return result


# ---- command line ---------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = arg_parser("bench_spec", __doc__, DEFAULT_BATCHES)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--window", "-T", type=int, default=4, help="T: tokens per window, 2..8")
    p.add_argument("--acceptance", nargs="+", type=float,
                   help="weights of accepting 1..T tokens per step (default: ACCEPTANCE)")
    p.add_argument("--replay-mode", nargs="+", metavar="[LAYOUT=]MODE",
                   help="replay verify's state mode, for every layout or one "
                        "(default: " + ", ".join(f"{f} {m}" for f, m in REPLAY_MODE.items())
                        + ")")
    p.add_argument("--eager-mode", default="eager-fp32")
    p.add_argument("--lookback", type=int, default=1024, help="the n-gram drafter's lookback")
    p.add_argument("--steps", type=int, default=16, help="steps per timed window")
    p.add_argument("--request-tokens", type=int, default=8192,
                   help="tokens a request's KV rows are sized for (memory per request)")
    p.add_argument("--budget-gb", type=float, default=64.0,
                   help="serving-cache memory budget for the maximum concurrent requests (GiB)")
    p.add_argument("--measure", nargs="+", metavar="MODEL_DIR",
                   help="measure the n-gram acceptance on trained models instead of timing")
    p.add_argument("--measure-windows", nargs="+", type=int, default=list(range(2, 9)))
    p.add_argument("--files-root", default=sysconfig.get_paths()["stdlib"],
                   help="where the held-out files listed in heldout.txt are (--measure)")
    p.add_argument("--prompt-bytes", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--profile-batches", nargs="*", type=int, default=[],
                   help="profile the step at these batches (bench_e2e's breakdown: SSM, "
                        "attention, GEMM, other, and the top kernels)")
    args = p.parse_args(argv)
    try:
        args.replay_modes = replay_modes(args.replay_mode, args.layouts)
        if not StateMode.parse(args.eager_mode).eager:
            raise ValueError(f"--eager-mode takes an eager mode, got {args.eager_mode!r}")
    except ValueError as e:
        p.error(str(e))
    if not 2 <= args.window <= 8 or any(not 2 <= w <= 8 for w in args.measure_windows):
        p.error("windows are 2..8 tokens")
    if any(b < 1 for b in args.batches) or min(args.context, args.steps, args.repeats,
                                               args.lookback, args.request_tokens) < 1 \
            or args.budget_gb <= 0:
        p.error("batches, context, steps, repeats, lookback, request tokens and the budget "
                "must be positive")
    check_profile_batches(p, args)
    try:
        NgramDrafter(lookback=args.lookback)
    except ValueError as e:
        p.error(str(e))
    if args.measure is None:
        try:
            args.probs = {layout: acceptance_for(layout, args.window, args.acceptance)
                          for layout in args.layouts}
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m replayssm.bench_spec " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.measure:
        # Small models: one thread is faster than several on a shared machine.
        torch.set_num_threads(1)
        results = [measure(d, args.measure_windows, args.files_root, args.prompt_bytes,
                           args.new_tokens) for d in args.measure]
        out = dict(command=command, measurements=results)
        text = json.dumps(out, indent=1)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text)
        print(text)
        return 0
    meta = dict(device=device_label(args.device), torch=torch.__version__, replayssm=replayssm.__version__,
                dtype=args.dtype, context=args.context, window=args.window,
                acceptance=args.probs, repeats=args.repeats, steps=args.steps, command=command)

    def run(model, layout: str, batch: int, method: str) -> list[dict[str, Any]]:
        try:
            return [bench_one(model, layout, method, batch, args.probs[layout], args)]
        except (torch.OutOfMemoryError, MemoryError) as e:
            # A cache that does not fit is a result (per-draft state at large T and batch).
            if args.device == "cuda":
                torch.cuda.empty_cache()
            mode, T = method_mode(method, layout, args)
            return [dict(layout=layout, method=method, mode=mode, window=T, batch=batch,
                         error="out of memory: " + str(e).splitlines()[0][:120])]

    runs = run_configurations("bench_spec", args, meta,
                              [(b, m) for b in args.batches for m in args.methods], run,
                              add_speedups)
    print("\n".join(summary_lines(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
