"""How long a decode step's sort of (token, expert) pairs by expert takes on a GPU, by the
integer type of its keys (python/replayssm/models/moe.py sorts on the narrowest that holds an
expert id). Each variant must give the int64 sort's order; times are per sort, 20 sorts
captured in a CUDA graph and replayed 10 times.

    python bench/moe_sort_sweep.py
"""

import torch

#: (tokens, experts per token, experts): batch 1, 256 and 512 of the 30B-A3B layouts.
SHAPES = [(1, 6, 128), (256, 6, 128), (512, 6, 128), (256, 8, 256), (512, 8, 256)]
KEYS = (torch.int64, torch.int32, torch.int16)


def us_per_call(fn, calls=20, replays=10):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T, k, E in SHAPES:
        ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)])
        flat = ids.reshape(-1)
        want = torch.argsort(flat, stable=True)
        for dtype in KEYS:
            def sort(dtype=dtype):
                return torch.argsort(flat.to(dtype), stable=True)
            assert torch.equal(sort(), want), dtype
            print(f"{T:4d} tokens x {k} of {E:3d} experts, {str(dtype):12s} keys: "
                  f"{us_per_call(sort):6.2f} us", flush=True)


if __name__ == "__main__":
    main()
