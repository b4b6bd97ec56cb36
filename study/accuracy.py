"""How far each SSM state mode moves a model's next-token distribution, over long held-out text.

For each trained model directory (study/train.py's output) the held-out files are concatenated
and cut into --streams streams of --length bytes. Every state mode then decodes the streams
teacher-forced with replayssm's model package (a 1-token prefill, then one `model.step` per byte,
replayed from a CUDA graph on the GPU), and its next-token distribution at every position is
compared with the eager-fp32 reference's:

    KL(p_ref || p_mode) = sum_v p_ref(v) (log p_ref(v) - log p_mode(v))      (nats, float64)

For scale, the eager-fp32 reference itself is compared with a float64 reference: transformers'
own model in float64 over the whole sequence at once, with every float32 cast inside it raised
to float64 (Float64Everywhere), so no operation of that forward runs in float32.

Free-running: from a --prompt-len-byte prompt of each stream every mode generates greedily;
the divergence is the number of tokens it generates before its first token that differs from
the eager-fp32 reference's (--gen-tokens when none does).

Every mode runs with the same activation dtype (--dtype, float32 by default, so that the state's
storage is the only difference between modes; bfloat16 is how the models are served).

    python study/accuracy.py --model study/models/nemotron_h --model study/models/qwen3_5 \
        --out results/accuracy.json            # JSON + a table (also printed)
    python study/accuracy.py --plot results/accuracy.json   # one PNG per model beside it
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

REFERENCE = "eager-fp32"
BASE_MODES = ("eager-bf16", "replay-fp32", "replay-bf16", "replay-fp32+bf16", "replay-fp32+fp8")
# Buffer lengths tried for the replay modes whose checkpoint is rounded (fp32 replay is exact
# for every L, so one L says all).
ROUNDED_REPLAY = ("replay-bf16", "replay-fp32+bf16", "replay-fp32+fp8")
DEFAULT_BUFFER_LENS = (8, 16, 32)
# Eager steps before a CUDA graph is captured: lazy initialisation (cuBLAS handles, Triton
# compilation) must happen outside the capture.
GRAPH_WARMUP_STEPS = 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mode_list(buffer_lens) -> list[str]:
    """The compared modes: the base modes, plus each rounded replay mode at every other L."""
    from replayssm.models import StateMode

    modes = list(BASE_MODES)
    default_len = StateMode.parse("replay-fp32").buffer_len
    for name in ROUNDED_REPLAY:
        modes += [f"{name}:{L}" for L in buffer_lens if L != default_len]
    return [str(StateMode.parse(m)) for m in modes]


# ---- measures ---------------------------------------------------------------------------------

def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref_logits) || softmax(logits)) over the last axis, computed in float64.
    Rounding can leave a value a few ulps below zero: clamped to 0."""
    ref = torch.log_softmax(ref_logits.double(), dim=-1)
    other = torch.log_softmax(logits.double(), dim=-1)
    return (ref.exp() * (ref - other)).sum(-1).clamp_min_(0.0)


def first_divergence(ref_tokens: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    """Per stream (axis 1 of [G, B]), the index of the first token that differs; G if none."""
    differ = ref_tokens != tokens
    G = differ.shape[0]
    index = torch.where(differ.any(0), differ.int().argmax(0), G)
    return [int(i) for i in index.tolist()]


def binned_mean(values: torch.Tensor, bin_size: int) -> list[float]:
    """Means of values [N, B] over consecutive bins of bin_size positions (and every stream);
    the last bin may be shorter."""
    N = values.shape[0]
    return [values[i:i + bin_size].mean().item() for i in range(0, N, bin_size)]


def by_phase(values: torch.Tensor, period: int) -> list[float]:
    """Means of values [N, B] over the positions p with p % period == i, for each i: a replay
    mode's error as a function of where in its buffer cycle a position falls."""
    phase = torch.arange(values.shape[0], device=values.device) % period
    return [values[phase == i].mean().item() for i in range(period)]


def summarize(kl: torch.Tensor, bin_size: int) -> dict:
    """KL [N, B] -> mean, max, the mean per position bin, and the mean of the last 1024."""
    return {"mean": kl.mean().item(), "max": kl.max().item(),
            "last_1024_mean": kl[-1024:].mean().item(),
            "by_bin": binned_mean(kl, bin_size)}


# ---- decoding -------------------------------------------------------------------------------

class Stepper:
    """`model.step` on fixed rows with static inputs: a few eager steps, then (on CUDA, when
    asked) a captured CUDA graph replayed for every later step. Returns the step's logits
    [B, vocab] (a static buffer once the graph runs: copy it before the next call)."""

    def __init__(self, model, cache, slot_ids: torch.Tensor, use_graph: bool) -> None:
        self.model, self.cache, self.slot_ids = model, cache, slot_ids
        self.use_graph = use_graph and slot_ids.is_cuda
        self.tokens = torch.zeros(slot_ids.shape[0], dtype=torch.long, device=slot_ids.device)
        self.graph = None
        self.logits = None
        self.eager_steps = 0

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        if self.graph is None:
            if not self.use_graph:
                return self.model.step(self.cache, self.slot_ids, self.tokens)
            if self.eager_steps < GRAPH_WARMUP_STEPS:
                self.eager_steps += 1
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    logits = self.model.step(self.cache, self.slot_ids, self.tokens)
                torch.cuda.current_stream().wait_stream(side)
                return logits
            # Capture records the step without running it; the replay below runs it.
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.model.step(self.cache, self.slot_ids, self.tokens)
        self.graph.replay()
        return self.logits


def open_rows(model, mode: str, prompts: torch.Tensor, max_seq_len: int):
    """A cache in `mode` with one slot per prompt row (prompts [B, P]) prefilled; returns
    (cache, slot_ids, logits of the prompts' last position [B, vocab])."""
    from replayssm.models import ServingCache

    B = prompts.shape[0]
    cache = ServingCache(model, capacity=B, max_seq_len=max_seq_len, mode=mode)
    slots, last = [], []
    for b in range(B):
        slot = cache.allocate()
        slots.append(slot)
        last.append(model.prefill(cache, slot, prompts[b])[-1])
    slot_ids = torch.tensor(slots, dtype=torch.int32, device=prompts.device)
    return cache, slot_ids, torch.stack(last)


def teacher_forced(model, mode: str, tokens: torch.Tensor, use_graph: bool) -> torch.Tensor:
    """Logits [N, B, vocab] (float32) at every position of tokens [B, N]: position t's
    distribution is over token t + 1, after reading tokens[:, :t + 1]."""
    B, N = tokens.shape
    cache, slot_ids, first = open_rows(model, mode, tokens[:, :1], N)
    out = torch.empty(N, B, first.shape[-1], dtype=torch.float32, device=tokens.device)
    out[0] = first
    step = Stepper(model, cache, slot_ids, use_graph)
    for t in range(1, N):
        out[t] = step(tokens[:, t])
    return out


def free_running(model, mode: str, prompts: torch.Tensor, gen_tokens: int,
                 use_graph: bool) -> torch.Tensor:
    """Greedy continuations [gen_tokens, B] of prompts [B, P]."""
    B, P = prompts.shape
    cache, slot_ids, logits = open_rows(model, mode, prompts, P + gen_tokens)
    out = torch.empty(gen_tokens, B, dtype=torch.long, device=prompts.device)
    step = Stepper(model, cache, slot_ids, use_graph)
    following = logits.argmax(-1)
    for t in range(gen_tokens):
        out[t] = following
        if t + 1 < gen_tokens:
            following = step(following).argmax(-1)
    return out


# ---- float64 reference ------------------------------------------------------------------------

class Float64Everywhere(TorchFunctionMode):
    """Raises every float32 request inside a forward to float64: `Tensor.float()` becomes
    `double()`, and a float32 `dtype` (keyword or positional, as `.to(torch.float32)` passes it)
    becomes float64. transformers' models upcast to float32 for numerics in many places, which
    in a float64 model would round to float32. `float32_results` counts results that are float32
    all the same (0 means the whole forward ran in float64)."""

    def __init__(self) -> None:
        super().__init__()
        self.float32_results = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func, args = torch.Tensor.double, args[:1]
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.float32_results += 1
        return out


def float64_logits(model_dir: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """transformers' model of model_dir in float64 over each whole stream of tokens [B, N]:
    logits [N, B, vocab] (float64) and the count of float32 results (0 expected)."""
    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    hf = cls.from_pretrained(model_dir, dtype=torch.float64).to(tokens.device).eval()
    for buffer in hf.buffers():
        # Constants kept in float32 on purpose (RoPE's inverse frequencies): same values, in
        # float64, so that what is computed from them is float64.
        if buffer.dtype == torch.float32:
            buffer.data = buffer.data.double()
    for module in hf.modules():
        # transformers' Mamba-2 floors dt at time_step_min in its whole-sequence scan but not in
        # its one-token step, and decoding (theirs and ours) is steps: the reference follows it.
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, float("inf"))
    mode = Float64Everywhere()
    rows = []
    with torch.no_grad():
        for b in range(tokens.shape[0]):
            with mode:
                rows.append(hf(input_ids=tokens[b:b + 1], use_cache=False).logits[0])
    del hf
    return torch.stack(rows, dim=1), mode.float32_results


# ---- the study ------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def study_model(model_dir: Path, args, modes: list[str], budget_s: float = 0.0) -> dict:
    """The study of one model. With a budget (seconds, > 0), a mode with an explicit buffer
    length (":L") is skipped when running it, at the reference's speed, would end past the
    budget; the base modes always run."""
    from replayssm import models
    from replayssm.models import StateMode

    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    root = corpus.resolve_root(args.corpus_root)
    heldout = corpus.read_list(Path(model_dir) / "heldout.txt")
    missing = [p for p in heldout if not (root / p).is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} held-out files of {model_dir} are not under "
                                f"{root} (first: {missing[0]}); pass --corpus-root")
    streams = corpus.make_streams(root, heldout, args.length, args.streams)
    tokens = torch.tensor([list(s) for s in streams], dtype=torch.long, device=device)
    prompts = tokens[:, :args.prompt_len]
    model = models.load(str(model_dir), device=device, dtype=dtype)
    result = {"model": str(model_dir), "dtype": args.dtype, "streams": args.streams,
              "length": args.length, "prompt_len": args.prompt_len,
              "gen_tokens": args.gen_tokens, "bin_size": args.bin_size, "modes": {}}
    print(f"{model_dir}: {args.streams} streams x {args.length} bytes, activations "
          f"{args.dtype}, {len(modes) + 1} modes", flush=True)

    def decode(mode: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
        synchronize(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = teacher_forced(model, mode, tokens, args.graph)
            synchronize(device)
            t1 = time.perf_counter()
            generated = free_running(model, mode, prompts, args.gen_tokens, args.graph)
            synchronize(device)
        t2 = time.perf_counter()
        timing = {"teacher_forced_s": round(t1 - t0, 3), "free_running_s": round(t2 - t1, 3),
                  "ms_per_step": round(1e3 * (t1 - t0) / max(1, args.length - 1), 4)}
        return logits, generated, timing

    ref_logits, ref_generated, timing = decode(REFERENCE)
    targets = tokens[:, 1:].t()

    def quality(logits: torch.Tensor) -> dict:
        nll = torch.nn.functional.cross_entropy(
            logits[:-1].reshape(-1, logits.shape[-1]).double(), targets.reshape(-1))
        return {"nats_per_byte": nll.item(),
                "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).double().mean().item()}

    result["reference"] = {"mode": REFERENCE, "timing": timing, **quality(ref_logits)}
    k = min(args.float64_streams, args.streams)
    if k:
        t0 = time.perf_counter()
        f64, leaks = float64_logits(model_dir, tokens[:k])
        synchronize(device)
        result["float64"] = {"streams": k, "float32_results": leaks,
                             "time_s": round(time.perf_counter() - t0, 3),
                             "kl_reference_vs_float64": summarize(
                                 kl_divergence(f64, ref_logits[:, :k]), args.bin_size)}
    per_mode_s = timing["teacher_forced_s"] + timing["free_running_s"]
    result["skipped"] = []
    for mode in modes:
        # The last mode's time predicts the next one's (the reference's includes warm-up).
        if budget_s > 0 and ":" in mode and (
                time.perf_counter() - started + per_mode_s > budget_s):
            result["skipped"].append(mode)
            print(f"  {mode:24s} skipped: over the time budget ({budget_s:.0f} s)", flush=True)
            continue
        logits, generated, timing = decode(mode)
        per_mode_s = timing["teacher_forced_s"] + timing["free_running_s"]
        kl = kl_divergence(ref_logits, logits)
        entry = {"timing": timing, "kl": summarize(kl, args.bin_size),
                 "divergence": first_divergence(ref_generated, generated), **quality(logits)}
        state_mode = StateMode.parse(mode)
        if not state_mode.eager:
            entry["kl_by_phase"] = by_phase(kl, state_mode.buffer_len)
        if k:
            entry["kl_vs_float64"] = summarize(kl_divergence(f64, logits[:, :k]), args.bin_size)
        result["modes"][mode] = entry
        print(f"  {mode:24s} KL mean {entry['kl']['mean']:.3e}  last-1k "
              f"{entry['kl']['last_1024_mean']:.3e}  divergence {sorted(entry['divergence'])}  "
              f"({timing['teacher_forced_s'] + timing['free_running_s']:.1f} s)", flush=True)
    return result


def table(results: dict) -> str:
    """A Markdown table per model: KL by position range, its ratio to eager-bf16 over the last
    1024 positions, agreement, loss and free-running divergence."""
    lines = []
    for res in results["models"]:
        if "error" in res:
            lines.append(f"\n### {Path(res['model']).name}: failed: {res['error']}\n")
            continue
        B, N, bin_size = res["streams"], res["length"], res["bin_size"]
        ranges = [(0, 1024), (N // 2 - 512, N // 2 + 512), (N - 1024, N)]
        ranges = [(max(0, a), min(N, b)) for a, b in ranges]
        lines.append(f"\n### {Path(res['model']).name}: {B} streams x {N} bytes, activations "
                     f"{res['dtype']}, KL(eager-fp32 || mode) in nats, mean over streams\n")
        head = ["mode"] + [f"KL [{a}, {b})" for a, b in ranges] + [
            "last 1k / eager-bf16", "top-1 agree", "nats/byte",
            f"divergence (median, min of {B}; cap {res['gen_tokens']})"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        ref = res["reference"]
        lines.append("| " + " | ".join([REFERENCE + " (reference)"] + ["0"] * len(ranges) + [
            "", "1", f"{ref['nats_per_byte']:.4f}", ""]) + " |")
        eager_bf16 = res["modes"].get("eager-bf16", {}).get("kl", {}).get("last_1024_mean")
        for mode, entry in res["modes"].items():
            by_bin = entry["kl"]["by_bin"]

            def over(a, b):
                chunk = by_bin[a // bin_size:max(a // bin_size + 1, math.ceil(b / bin_size))]
                return sum(chunk) / len(chunk)

            last = entry["kl"]["last_1024_mean"]
            ratio = f"{last / eager_bf16:.3g}" if eager_bf16 else ""
            div = sorted(entry["divergence"])
            lines.append("| " + " | ".join(
                [mode] + [f"{over(a, b):.3e}" for a, b in ranges] +
                [ratio, f"{entry['top1_agreement']:.5f}", f"{entry['nats_per_byte']:.4f}",
                 f"{div[len(div) // 2]}, {div[0]}"]) + " |")
        if "float64" in res:
            f = res["float64"]
            scale = f["kl_reference_vs_float64"]
            lines.append(f"\nScale, over the first {f['streams']} streams: "
                         f"KL(float64 transformers || eager-fp32 ours) mean "
                         f"{scale['mean']:.3e}, last 1k {scale['last_1024_mean']:.3e} "
                         f"(float32 results in the float64 forward: {f['float32_results']}).")
        if res.get("skipped"):
            lines.append(f"\nSkipped for time: {', '.join(res['skipped'])}.")
        t = ref["timing"]
        lines.append(f"\nStep time {t['ms_per_step']:.3f} ms ({B} rows); run "
                     f"{res['time_s']:.0f} s for this model.")
    return "\n".join(lines) + "\n"


def plot(path: Path) -> list[Path]:
    """One PNG per model beside the JSON: mean KL against position, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(Path(path).read_text())
    written = []
    for res in results["models"]:
        if "error" in res:
            continue
        bin_size = res["bin_size"]
        fig, ax = plt.subplots(figsize=(9, 5.5))
        curves = [(m, e["kl"]["by_bin"]) for m, e in res["modes"].items()]
        if "float64" in res:
            curves.append(("eager-fp32 vs float64", res["float64"]["kl_reference_vs_float64"]["by_bin"]))
        # One colour per state precision, one line style per buffer length.
        colours = dict(zip(BASE_MODES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
        styles = {None: "-", "8": "--", "32": ":"}
        for mode, values in curves:
            base, _, length = mode.partition(":")
            colour = colours.get(base, "black")
            style = "-." if base not in colours else styles.get(length or None, "-")
            x = [(i + 0.5) * bin_size for i in range(len(values))]
            # A log axis cannot show 0: those bins are left out of the line.
            points = [(a, b) for a, b in zip(x, values) if b > 0]
            if points:
                ax.plot(*zip(*points), style, color=colour, label=mode)
        ax.set_yscale("log")
        ax.set_xlabel("position (bytes)")
        ax.set_ylabel("KL(eager-fp32 || mode), nats")
        ax.set_title(f"{Path(res['model']).name}, activations {res['dtype']}: mean over "
                     f"{res['streams']} streams and {bin_size}-position bins")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        out = Path(path).with_name(f"{Path(path).stem}_{Path(res['model']).name}.png")
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        plt.close(fig)
        written.append(out)
    return written


def run(args) -> dict:
    device = torch.device(args.device)
    modes = args.modes or mode_list(args.buffer_lens)
    results = {"args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
               "torch": torch.__version__,
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "models": []}
    start = time.perf_counter()
    for model_dir in args.model:
        t0 = time.perf_counter()
        # One model's failure is recorded and the next model still runs: a GPU run is batched.
        try:
            res = study_model(Path(model_dir), args, modes, args.budget_s / len(args.model))
        except Exception as e:
            traceback.print_exc()
            res = {"model": str(model_dir), "error": f"{type(e).__name__}: {e}"}
        res["time_s"] = round(time.perf_counter() - t0, 2)
        results["models"].append(res)
        results["time_s"] = round(time.perf_counter() - start, 2)
        # Written after every model, so a run cut short keeps what it finished.
        if args.out:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1) + "\n")
            out.with_suffix(".md").write_text(table(results))
    return results


def parse_modes(text: str) -> list[str]:
    from replayssm.models import StateMode

    modes = [str(StateMode.parse(m)) for m in text.split(",") if m]
    if REFERENCE in modes:
        raise argparse.ArgumentTypeError(f"{REFERENCE} is the reference; it always runs")
    return modes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=[],
                   help="a trained model directory (config.json, model.safetensors, heldout.txt); repeat for several")
    p.add_argument("--out", help="results JSON (a Markdown table is written beside it as .md)")
    p.add_argument("--plot", metavar="JSON", help="only plot a results JSON (one PNG per model)")
    p.add_argument("--length", type=int, default=8192, help="bytes per stream")
    p.add_argument("--streams", type=int, default=16, help="streams decoded together (the batch)")
    p.add_argument("--prompt-len", type=int, default=256, help="free-running prompt bytes")
    p.add_argument("--gen-tokens", type=int, default=1024, help="free-running tokens generated")
    p.add_argument("--buffer-lens", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=DEFAULT_BUFFER_LENS, help="replay buffer lengths L, comma-separated")
    p.add_argument("--modes", type=parse_modes, default=None,
                   help="comma-separated modes to compare with eager-fp32 (default: the base "
                        "modes and the rounded replay modes at every --buffer-lens)")
    p.add_argument("--bin-size", type=int, default=64, help="positions per bin of the KL curve")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="activation (and weight) dtype of every mode")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="time for all models together: modes with an explicit ':L' that would "
                        "overrun their model's share are skipped (0: no limit)")
    p.add_argument("--float64-streams", type=int, default=4,
                   help="streams compared with the float64 transformers reference (0: none)")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="decode without CUDA graphs")
    corpus.add_root_argument(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.plot:
        return args
    if not args.model:
        p.error("give at least one --model (or --plot JSON)")
    for name in ("length", "streams", "prompt_len", "gen_tokens", "bin_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.float64_streams < 0:
        p.error("--float64-streams must be >= 0")
    if args.prompt_len >= args.length:
        p.error("--prompt-len must be shorter than --length")
    if any(L <= 0 for L in args.buffer_lens):
        p.error("--buffer-lens must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        for path in plot(Path(args.plot)):
            print(path)
        return 0
    results = run(args)
    print(table(results))
    print(f"total {results['time_s']:.0f} s")
    return 1 if any("error" in res for res in results["models"]) else 0


if __name__ == "__main__":
    sys.exit(main())
