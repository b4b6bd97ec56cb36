"""Times the fused conv decode (``replayssm.models.fused.conv_decode``) at the real layouts'
shapes on a GPU, checking each output against the torch reference, optionally beside another
version of ``fused.py`` (a file path: e.g. a previous commit's, ``git show REV:python/replayssm/
models/fused.py > old.py``) and over a list of tile choices (channels per program, warps).

    python bench/conv_decode_sweep.py [--baseline old.py] [--cases 256x1,256x4] [--tiles 256/4,512/4]

Prints one line per layout and case (batch x window tokens): the bytes a call moves (window in,
ring write, outputs, the K - 1 ring rows read; bf16), the largest output and ring errors against
``conv_decode_reference``, then µs per call for the baseline, each tile and the package's own
choice ("rule"). Timing: 50 calls in one CUDA graph over 4 rotating input sets (so that the
reads come from memory, not L2), median of 5 replays. x is a column slice of a wider projection
output at the offset the models' decode has, so its alignment is theirs."""

from __future__ import annotations

import argparse
import importlib.util

import torch

from replayssm.models import fused
from replayssm.models.base import conv_decode_reference

#: name: (conv channels, the splits the decode asks for, projection width, x's column offset)
LAYOUTS = {"nemotron-nano-4b": (9728, [7680, 1024, 1024], 17504, 7680),
           "qwen3.5-4b": (8192, [2048, 2048, 4096], 12352, 0)}
K = 4


def inputs(B: int, T: int, C: int, width: int, offset: int, sets: int = 4):
    g = torch.Generator(device="cuda").manual_seed(0)
    ring_len = K - 1 + 8
    base = torch.arange(B, device="cuda")[:, None] * ring_len
    out = []
    for _ in range(sets):
        lengths = torch.randint(0, 1000, (B,), device="cuda", generator=g)[:, None]
        write = (base + (lengths + torch.arange(T, device="cuda")) % ring_len).reshape(-1)
        read = (base + (lengths + torch.arange(-(K - 1), T, device="cuda")) % ring_len).reshape(-1)
        ring = torch.randn(B * ring_len, C, device="cuda", generator=g).bfloat16()
        wide = torch.randn(B, T, width, device="cuda", generator=g).bfloat16()
        out.append((wide[..., offset:offset + C], ring, write, read))
    weight = (0.5 * torch.randn(C, K, device="cuda", generator=g)).bfloat16()
    bias = (0.1 * torch.randn(C, device="cuda", generator=g)).bfloat16()
    return out, weight, bias


def time_us(fn, sets, calls: int = 50) -> float:
    for s in sets:
        fn(*s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="another version's fused.py, timed beside this one")
    p.add_argument("--cases", default="256x1,64x1,16x1,256x2,256x4,256x8",
                   help="batch x window tokens, comma-separated")
    p.add_argument("--tiles", default="", help="channels/warps choices, e.g. 256/4,512/4")
    args = p.parse_args()
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("fused_baseline", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    tiles = [tuple(map(int, t.split("/"))) for t in args.tiles.split(",") if t]
    for name, (C, splits, width, offset) in LAYOUTS.items():
        for case in args.cases.split(","):
            B, T = map(int, case.split("x"))
            sets, w, bias = inputs(B, T, C, width, offset)
            x, ring, write, read = sets[0]
            ring_ref, ring_got = ring.clone(), ring.clone()
            ref = conv_decode_reference(x, ring_ref, write, read, w, bias, "silu")
            got = torch.cat(fused.conv_decode(x, ring_got, write, read, w, bias, "silu", splits), -1)
            errors = ((got.float() - ref.float()).abs().max().item(),
                      (ring_got.float() - ring_ref.float()).abs().max().item())
            times = {}

            def run(module):
                return lambda x, r, wr, rd: module.conv_decode(x, r, wr, rd, w, bias, "silu", splits)
            if baseline is not None:
                times["baseline"] = time_us(run(baseline), sets)
            rule = fused._conv_tile
            for block, warps in tiles:
                fused._conv_tile = lambda TP, b=block, n=warps: (b, n)
                times[f"{block}/{warps}"] = time_us(run(fused), sets)
            fused._conv_tile = rule
            times["rule"] = time_us(run(fused), sets)
            mb = (3 * B * T + (K - 1) * B) * C * 2 / 1e6
            print(f"{name} B={B} T={T} MB={mb:.1f} errors={errors[0]:.3g},{errors[1]:.3g} "
                  + " ".join(f"{k}:{v:.1f}" for k, v in times.items())
                  + f" (rule {mb / times['rule']:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
