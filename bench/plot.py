#!/usr/bin/env python3
"""Bar charts of a `replayssm bench --json` report (or replayssm_cuda_bench's): µs per layer
step for each case, eager beside the replay modes (BENCHMARKS.md asks for a plot).

    python3 bench/plot.py bench.json                # writes bench.png next to it
    python3 bench/plot.py bench.json -o out.png --title "H200, batch 256"

One panel per (batch, L, flush) of the protocol's "cases", a group of bars per shape, one bar
per mode (eager, replay <checkpoint>), labelled with µs and the speedup over eager. When the
report has "spec_cases" (`--spec-tokens T`), a further panel per (batch, T, k, L): the eager
spec step against the replay verify in each checkpoint.
"""

import argparse
import json
import os
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")  # no display on the GPU machines
import matplotlib.pyplot as plt  # noqa: E402


def mode_label(case):
    if case["mode"] == "eager":
        return "eager"
    return "replay " + str(case["checkpoint"])


def protocol_panels(cases):
    """[(title, shapes, modes, {(shape, mode): case})] per (batch, L, flush), L reading "F/L"
    for replay decodes that fold every F tokens (fold_every; eager cases join every panel of
    their L)."""
    cadences = OrderedDict()  # (batch, buffer_len, flush) -> the replay cadences run there
    for c in cases:
        if c["mode"] != "eager":
            cadences.setdefault((c["batch"], c["buffer_len"], c["flush"]), OrderedDict())[
                c.get("fold_every", 0)] = None
    panels = OrderedDict()
    for c in cases:
        where = (c["batch"], c["buffer_len"], c["flush"])
        everys = [c.get("fold_every", 0)] if c["mode"] != "eager" else list(cadences.get(where, [0]))
        for every in everys:
            L = f"{every}/{c['buffer_len']}" if every else str(c["buffer_len"])
            panels.setdefault((c["batch"], L, c["flush"]), []).append(c)
    out = []
    for (batch, L, flush), group in panels.items():
        shapes = list(OrderedDict.fromkeys(c["shape"] for c in group))
        modes = list(OrderedDict.fromkeys(mode_label(c) for c in group))
        if "eager" in modes:  # eager first: the baseline every bar is read against
            modes.remove("eager")
            modes.insert(0, "eager")
        values = {}
        for c in group:
            values[(c["shape"], mode_label(c))] = (
                c["us_per_step_median"],
                c.get("speedup_vs_eager", 0.0) if c["mode"] != "eager" else None,
            )
        out.append((f"batch {batch}, L = {L}, {flush} flushes", shapes, modes, values))
    return out


def spec_panels(cases):
    """The same for spec_cases, per (batch, T, k, L): eager spec, then replay per checkpoint."""
    panels = OrderedDict()
    for c in cases:
        key = (c["batch"], c["window"], c["accepted"], c["buffer_len"])
        panels.setdefault(key, []).append(c)
    out = []
    for (batch, T, k, L), group in panels.items():
        shapes = list(OrderedDict.fromkeys(c["shape"] for c in group))
        modes = ["eager spec"] + list(
            OrderedDict.fromkeys("verify " + c["checkpoint"] for c in group))
        values = {}
        for c in group:
            scheme = c.get("eager_spec_scheme", "fused")
            values[(c["shape"], "eager spec")] = (c["eager_spec_us"], None, scheme)
            values[(c["shape"], "verify " + c["checkpoint"])] = (c["replay_us"], c["speedup"])
        out.append((f"spec: batch {batch}, T = {T}, k = {k}, L = {L}", shapes, modes, values))
    return out


def draw(ax, title, shapes, modes, values):
    n = len(modes)
    width = 0.8 / max(n, 1)
    colors = plt.get_cmap("tab10").colors
    for i, mode in enumerate(modes):
        xs, ys, labels = [], [], []
        for s, shape in enumerate(shapes):
            v = values.get((shape, mode))
            if v is None:
                continue
            us, speedup = v[0], v[1]
            xs.append(s - 0.4 + width * (i + 0.5))
            ys.append(us)
            label = f"{us:.0f}"
            if speedup:
                label += f"\n{speedup:.2f}x"
            elif len(v) > 2 and v[2] == "sequential":
                label += "\n(T decodes)"
            labels.append(label)
        # Eager is drawn grey: the baseline, not a contender.
        color = "0.55" if mode.startswith("eager") else colors[(i - 1) % len(colors)]
        bars = ax.bar(xs, ys, width * 0.95, label=mode, color=color)
        for bar, label in zip(bars, labels):
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes)
    ax.set_ylabel("µs per layer step (median)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.18)
    ax.legend(fontsize=8, ncol=min(n, 3))
    ax.grid(axis="y", alpha=0.3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="report written by `replayssm bench --json`")
    p.add_argument("-o", "--out", help="PNG to write (default: the JSON's name with .png)")
    p.add_argument("--title", help="figure title (default: the device and dtypes)")
    args = p.parse_args(argv)

    with open(args.json) as f:
        report = json.load(f)
    panels = protocol_panels(report.get("cases", [])) + spec_panels(report.get("spec_cases", []))
    if not panels:
        print(f"{args.json}: no cases to plot", file=sys.stderr)
        return 1
    cols = 1 if len(panels) == 1 else 2
    rows = (len(panels) + cols - 1) // cols
    max_bars = max(len(shapes) * len(modes) for _, shapes, modes, _ in panels)
    fig, axes = plt.subplots(rows, cols, squeeze=False,
                             figsize=(max(6.0, 0.55 * max_bars + 2.0) * cols, 4.2 * rows))
    for ax, panel in zip(axes.flat, panels):
        draw(ax, *panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    title = args.title or "{} — activations {}, eager state {}, {:.0f} GB/s (read + write)".format(
        report.get("device", "?"), report.get("input_dtype", "?"),
        report.get("eager_state_dtype", "?"),
        report.get("peak_gbps", report.get("copy_gbps", 0.0)))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    fig.savefig(out, dpi=130)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
