"""What a prefix-cache hit saves at admission: a whole prompt's prefill against a hit that
restores all its whole blocks but the last token's and prefills the rest.

    python -m replayssm.bench_prefix [--layouts ...] [--mode replay-fp32+bf16] [--prompt 2048]
                                     [--block 64] [--repeats 5] [--json FILE]

For each layout (random weights; bf16 on CUDA, fp32 on the CPU) and a random prompt of
``--prompt`` tokens, each timed ``--repeats`` times into a fresh slot (the median; CUDA
synchronised around each call):

- ``prefill_ms``: ``model.prefill`` of the whole prompt (no prefix cache);
- ``store_ms``: :meth:`PrefixCache.prefill` of the prompt into an empty prefix cache (a miss:
  the prefill keeping block states, plus storing one entry per block);
- ``hit_ms``: :meth:`PrefixCache.prefill` of the same prompt again: restores
  ``hit_tokens`` = ((prompt - 1) // block) * block tokens and prefills the rest.

Also each entry's bytes, the relative error of the hit's last logits against the whole
prefill's (max |d| / max |ref|: the rounding of a prefill in two pieces), and the state cache's
whole-state calls over every SSM layer of one slot (median of ``--repeats``):

- ``load_state_ms``: ``load_state`` of every layer: the prefill hand-off of an eager cache
  (on CUDA a host round trip of each layer's state);
- ``restore_ms`` (replay modes; else None): ``restore`` of the same states, every layer in one
  call at the slot's cursor: a replay cache's hand-off (ServingCache.ssm_hand_off), which every
  prefill and hit ends with;
- ``export_state_ms``: ``export_state`` of every layer, what a prefill continuing a slot reads
  its state back with (a hit does not: it scans from the entry's states).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from replayssm.bench_e2e import device_label, load_model, sync
from replayssm.models import ServingCache
from replayssm.models.prefix_cache import PrefixCache

DEFAULT_LAYOUTS = ("nemotron-nano-4b", "qwen3.5-4b")


def timed(fn: Any, device: str) -> tuple[float, Any]:
    """(ms, fn()) with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3, out


def bench_layout(layout: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(layout, device, dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = model.input_embeddings().num_embeddings
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen).to(device)
    cache = ServingCache(model, 1, args.prompt, args.mode)

    def fresh_slot() -> int:
        for slot in range(cache.capacity):
            if cache.ssm.is_allocated(slot):
                cache.free(slot)
        return cache.allocate()

    if args.repeats < 1 or not 0 < args.block < args.prompt:
        raise SystemExit("bench_prefix: --repeats must be >= 1 and --block in [1, --prompt)")
    whole, store, hit = [], [], []
    for _ in range(args.repeats):
        slot = fresh_slot()
        ms, ref = timed(lambda: model.prefill(cache, slot, prompt), device)
        whole.append(ms)
        prefix = PrefixCache(cache, block=args.block, budget_bytes=1 << 62)
        slot = fresh_slot()
        store.append(timed(lambda: prefix.prefill(model, slot, prompt), device)[0])
        slot = fresh_slot()
        ms, got = timed(lambda: prefix.prefill(model, slot, prompt), device)
        hit.append(ms)
    err = float((got[-1].double() - ref[-1].double()).abs().max() / ref[-1].double().abs().max())
    layers = range(cache.layout.num_ssm_layers)
    states = [cache.ssm.export_state(layer, slot) for layer in layers]
    load, export, restore = [], [], []
    for _ in range(args.repeats):
        load.append(timed(lambda: [cache.ssm.load_state(layer, slot, states[layer])
                                   for layer in layers], device)[0])
        export.append(timed(lambda: [cache.ssm.export_state(layer, slot) for layer in layers],
                            device)[0])
        if not cache.mode.eager:  # eager caches have no restore
            stacked = torch.stack(states)
            position = int(cache.ssm.buffers["committed"][slot])
            restore.append(timed(lambda: cache.ssm.restore(slot, position, stacked), device)[0])
    row = dict(layout=layout, mode=args.mode, prompt=args.prompt, block=args.block,
               prefill_ms=statistics.median(whole), store_ms=statistics.median(store),
               hit_ms=statistics.median(hit), hit_tokens=((args.prompt - 1) // args.block)
               * args.block, entries=len(prefix), entry_bytes=prefix.entry_bytes,
               last_logits_rel_err=err, ssm_layers=len(layers),
               load_state_ms=statistics.median(load), export_state_ms=statistics.median(export),
               restore_ms=statistics.median(restore) if restore else None)
    row["hit_speedup"] = row["prefill_ms"] / row["hit_ms"]
    del model, cache, prefix
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replayssm.bench_prefix",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS))
    parser.add_argument("--mode", default="replay-fp32+bf16")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for layout in args.layouts:
        row = bench_layout(layout, args, args.device)
        rows.append(row)
        print(f"{layout} {args.mode} prompt {args.prompt} block {args.block}: prefill "
              f"{row['prefill_ms']:.1f} ms, miss+store {row['store_ms']:.1f} ms, hit "
              f"{row['hit_ms']:.1f} ms ({row['hit_tokens']} tokens restored, "
              f"{row['hit_speedup']:.1f}x), {row['entries']} entries of "
              f"{row['entry_bytes'] / 2**20:.1f} MiB, last logits rel err "
              f"{row['last_logits_rel_err']:.1e}; {row['ssm_layers']} SSM layers: load_state "
              f"{row['load_state_ms']:.1f} ms, export_state {row['export_state_ms']:.1f} ms"
              + ("" if row["restore_ms"] is None else
                 f", restore (all in one call) {row['restore_ms']:.1f} ms"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_label(args.device), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
