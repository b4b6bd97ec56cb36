"""Host overhead per op call: what Python, the binding and the library's checks cost a decode
before (and besides) its kernels.

    python -m replayssm.bench_overhead [--device cuda|cpu] [--json FILE]

Each line is the median over `--repeats` windows of `--calls` back-to-back calls, timed on the
host before synchronising (a window enqueues fewer launches than CUDA's queue holds, so the
host never waits for the GPU inside it). Rows:
  batch 0   every array read and checked, the library's per-call checks, no kernel: the
            binding's own overhead (the `_C` row: without the package's Python functions);
  batch 1   the same plus the decode's launches (a replay decode is two kernels);
  torch.ops the registered op through PyTorch's dispatcher (what a torch.compile'd graph or an
            engine calling torch.ops.replayssm.* pays);
  __dlpack__ each tensor read through its `__dlpack__` method instead of the DLPack C exchange
            API (the path of arrays whose type has no exchange API).
Shapes: Nemotron-3-Super's Mamba-2 layer (128 x 64 x 128, 8 groups) and Qwen3.5-122B's GDN layer
(16 key heads, 64 value heads, 128 x 128), one layer, fp32+bf16 checkpoints, bf16 activations.
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np

import replayssm
from replayssm import _C


def median_us(call, calls, repeats, sync):
    for _ in range(calls):  # warm-up: first launches, caches, allocator
        call()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        times.append((time.perf_counter_ns() - start) / calls / 1e3)
        sync()
    return statistics.median(times)


def configs(device):
    common = dict(capacity=8, num_layers=1, checkpoint="fp32+bf16", input_dtype="bfloat16",
                  buffer_len=16, device=device)
    return {
        "mamba2": replayssm.CacheConfig(kind="mamba2", num_heads=128, head_dim=64, state_dim=128,
                                        num_groups=8, **common),
        "gdn": replayssm.CacheConfig(kind="gdn", num_k_heads=16, num_v_heads=64, head_k_dim=128,
                                     head_v_dim=128, **common),
    }


def torch_args(torch, cfg, batch, slot):
    """Arguments of one decode (after the cache and layer) as torch tensors, out last."""
    dev, bf16, f32 = cfg.device, torch.bfloat16, torch.float32
    ids = torch.full((batch,), slot, dtype=torch.int32, device=dev)
    if cfg.kind == "mamba2":
        H, P, N, G = cfg.num_heads, cfg.head_dim, cfg.state_dim, cfg.num_groups
        x = torch.randn(batch, 1, H, P, device=dev, dtype=bf16)
        return [ids, x, torch.randn(batch, 1, H, device=dev), torch.randn(batch, 1, G, N, device=dev, dtype=bf16),
                torch.randn(batch, 1, G, N, device=dev, dtype=bf16), -torch.rand(H, device=dev) - 0.5,
                torch.ones(H, device=dev), torch.full((H,), -4.0, device=dev),
                torch.randn(batch, 1, H, P, device=dev, dtype=bf16), torch.empty_like(x)]
    Hk, Hv, K, V = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    v = torch.randn(batch, 1, Hv, V, device=dev, dtype=bf16)
    return [ids, torch.randn(batch, 1, Hk, K, device=dev, dtype=bf16),
            torch.randn(batch, 1, Hk, K, device=dev, dtype=bf16), v,
            -torch.rand(batch, 1, Hv, device=dev, dtype=f32) * 0.1,
            torch.rand(batch, 1, Hv, device=dev, dtype=f32), 0.0, True, torch.empty_like(v)]


def run_torch(device, calls, repeats):
    import torch

    import replayssm.torch as rt

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for kind, cfg in configs(device).items():
        cache = rt.StateCache(cfg)
        slot = cache.allocate()
        decode = replayssm.mamba2_decode if kind == "mamba2" else replayssm.gdn_decode
        op = getattr(torch.ops.replayssm, f"{kind}_decode").default
        tensors = sum(1 for a in torch_args(torch, cfg, 1, slot) if isinstance(a, torch.Tensor))
        # A CPU replay cache refuses a second window before a commit: batch 0 only there.
        for batch in (0, 1) if device == "cuda" else (0,):
            args = torch_args(torch, cfg, batch, slot)
            *inputs, out = args

            def direct():
                decode(cache, 0, *inputs, out=out)

            rows.append((kind, f"replayssm.{kind}_decode", batch, tensors,
                         median_us(direct, calls, repeats, sync)))
            if batch == 0:
                native = getattr(_C, f"{kind}_decode")
                rows.append((kind, f"replayssm._C.{kind}_decode (no Python layer)", batch, tensors,
                             median_us(lambda: native(cache._native, 0, *args, None, None),
                                       calls, repeats, sync)))
            rows.append((kind, f"torch.ops.replayssm.{kind}_decode", batch, tensors + len(cache._buffer_list),
                         median_us(lambda: op(cache._id, 0, *args, cache._buffer_list), calls, repeats, sync)))
            _C._set_dlpack_exchange(False)
            try:
                rows.append((kind, f"replayssm.{kind}_decode, __dlpack__", batch, tensors,
                             median_us(direct, calls, repeats, sync)))
            finally:
                _C._set_dlpack_exchange(True)
        if device == "cuda":
            ids = torch.tensor([slot], dtype=torch.int32, device=device)
            accepted = torch.zeros(1, dtype=torch.int32, device=device)
            rows.append((kind, "StateCache.commit", 1, 2,
                         median_us(lambda: cache.commit(ids, accepted), calls, repeats, sync)))
    return rows


def run_numpy(calls, repeats):
    """Batch 0 on a CPU cache with NumPy arrays (read through __dlpack__: NumPy has no exchange
    API)."""
    rows = []
    for kind, cfg in configs("cpu").items():
        cache = replayssm.StateCache(cfg)
        *inputs, out = numpy_args(cfg)
        decode = replayssm.mamba2_decode if kind == "mamba2" else replayssm.gdn_decode
        arrays = sum(isinstance(a, np.ndarray) for a in inputs) + 1
        rows.append((kind, f"replayssm.{kind}_decode, NumPy", 0, arrays,
                     median_us(lambda: decode(cache, 0, *inputs, out=out), calls, repeats,
                               lambda: None)))
    return rows


def numpy_args(cfg):
    ids = np.zeros(0, np.int32)
    if cfg.kind == "mamba2":
        H, P, N, G = cfg.num_heads, cfg.head_dim, cfg.state_dim, cfg.num_groups
        act = lambda *s: np.zeros(s, np.uint16)  # noqa: E731 (bf16 bits)
        return [ids, act(0, 1, H, P), np.zeros((0, 1, H), np.float32), act(0, 1, G, N),
                act(0, 1, G, N), -np.ones(H, np.float32), np.ones(H, np.float32),
                np.zeros(H, np.float32), act(0, 1, H, P), act(0, 1, H, P)]
    Hk, Hv, K, V = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    act = lambda *s: np.zeros(s, np.uint16)  # noqa: E731
    return [ids, act(0, 1, Hk, K), act(0, 1, Hk, K), act(0, 1, Hv, V),
            np.zeros((0, 1, Hv), np.float32), np.zeros((0, 1, Hv), np.float32), 0.0, True,
            act(0, 1, Hv, V)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="cuda when a GPU and PyTorch are present, else cpu")
    parser.add_argument("--calls", type=int, default=300, help="calls per timed window")
    parser.add_argument("--repeats", type=int, default=21, help="timed windows (median)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    device = args.device or ("cuda" if torch is not None and torch.cuda.is_available()
                             and replayssm.cuda_available() else "cpu")
    rows = run_numpy(args.calls, args.repeats)
    if torch is not None:
        rows += run_torch(device, args.calls, args.repeats)
    print(f"replayssm {replayssm.__version__}, device {device}"
          + (f", torch {torch.__version__}" if torch is not None else ", no torch"))
    print(f"{'layer':7s} {'call':45s} {'batch':>5s} {'arrays':>6s} {'us/call':>8s}")
    for kind, call, batch, arrays, us in rows:
        print(f"{kind:7s} {call:45s} {batch:5d} {arrays:6d} {us:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(layer=k, call=c, batch=b, arrays=a, us_per_call=u)
                       for k, c, b, a, u in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
