"""Prefix caching for whole models: requests that share a prompt prefix (a system prompt, a
few-shot block, a chat history) do not prefill it again.

An SSM cannot rebuild its state at a past token, so the cache keeps what a slot holds at block
boundaries, as prefill passes them (:meth:`HybridModel.prefill_blocks`, no second pass). Block
i of a prompt (tokens [(i - 1) block, i block)) is keyed by the hash chain of token blocks:
``key_i = H(key_{i-1}, tokens of block i)`` (BLAKE2b, 16 bytes), so a key names the whole prefix
up to its block. The entry of block i holds:

- every SSM layer's fp32 state after position i block - 1 (``[n_ssm, *state_shape]``),
- every SSM layer's conv inputs of positions [i block - kernel + 1, i block) (the conv window),
- the KV rows of its own block, positions [(i - 1) block, i block), for every attention layer;

so a hit of m blocks restores the state and conv window of block m and the KV rows of blocks
1..m (a prefix's KV is the chain's; no entry repeats another's rows).

A hit into a freshly allocated slot (:meth:`PrefixCache.prefill`): the conv window into the
ring rows of its positions, the KV rows (one copy of the chain's), ``lengths = m block``; then
``prefill_blocks(start = m block)`` of the rest with the entry's fp32 states as its
``start_states``: the scans start from them, and the prefill's own hand-off loads the slot's
state at its end (any state mode). The slot's state is neither loaded nor read back before the
scans: on CUDA ``load_state`` and ``export_state`` each move a layer's whole state through host
memory with a stream sync, and doing both for every SSM layer made a hit slower than a whole
prefill. A hit saves the prefill of the m blocks: their GEMMs (O(m block) tokens through every
layer), attention over them and the scans; what it costs is copying the entry in (per block the
SSM state dominates: for Nemotron-3-Nano-4B at block 64, 21 layers x 3.9 MB = 82 MB of fp32
state against 1.2 MB of bf16 conv windows and 1 MB of bf16 KV rows). The hit never covers a
whole prompt: at least its last token is prefilled, which gives the first new token's logits.

Entries live on the ``device`` given, by default the serving cache's: on a GPU restoring is then
a device-to-device copy (no PCIe transfer of 82 MB a hit), and the byte budget caps the memory it
takes from the KV and state caches. Host entries (``device="cpu"``) trade that memory for a
host-to-device copy per hit. Eviction is LRU under ``budget_bytes`` (never exceeded, not even
while a prompt's blocks are stored); a prompt touches its chain deepest block first, so every
block is more recent than the blocks after it and eviction takes a chain's last block first
(never one a cached block after it still needs).

A hit continues exactly from the stored fp32 state, in every state mode: its logits equal
those of a whole prefill up to the fp32 scans' rounding. After it the slot holds its state as
the mode keeps it (a bf16 state or checkpoint rounded, as after a whole prefill).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from typing import Any

import torch

from .base import HybridModel, PrefillContext, ServingCache

__all__ = ["PrefixCache"]

_KEY_BYTES = 16


@dataclasses.dataclass(eq=False)
class _Entry:
    """One block: the SSM states and conv windows at its end, and its KV rows."""

    parent: bytes | None       # the previous block's key (None for block 1)
    ssm: torch.Tensor          # fp32 [n_ssm, *state_shape]
    conv: torch.Tensor         # [n_ssm, kernel - 1, conv_channels]
    k: torch.Tensor            # [n_attn, kv_heads, block, head_dim]
    v: torch.Tensor


class PrefixCache:
    """Block entries of prompt prefixes for ``cache``'s slots (see the module's documentation).

    ``block``: tokens per block (the scans' chunk becomes its gcd with their own chunk, so a
    power of two such as 64 keeps them as they are). ``budget_bytes``: the entries' bytes at
    most; it must hold one entry. ``device``: where entries live (default: ``cache.device``).
    """

    def __init__(self, cache: ServingCache, block: int = 64, budget_bytes: int = 1 << 30,
                 device: Any = None) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive number of tokens, got {block!r}")
        if block >= cache.max_seq_len:
            raise ValueError(f"a block of {block} tokens never hits in a cache of max_seq_len "
                             f"{cache.max_seq_len} (a hit leaves at least one token to prefill)")
        self.cache, self.block = cache, block
        self.device = torch.device(cache.device if device is None else device)
        layout = cache.layout
        state = math.prod(cache.ssm.config.state_shape) * 4
        act = torch.empty(0, dtype=cache.dtype).element_size()
        #: Bytes of one entry (every entry has the same shapes).
        self.entry_bytes = layout.num_ssm_layers * (
            state + (layout.conv_kernel - 1) * layout.conv_channels * act) + \
            2 * layout.num_attn_layers * layout.kv_heads * block * layout.head_dim * act
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) \
                or budget_bytes < self.entry_bytes:
            raise ValueError(f"budget_bytes ({budget_bytes!r}) must be an int holding at least "
                             f"one entry ({self.entry_bytes} bytes at block {block})")
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        # Counters.
        self.lookups = 0      # prompts looked up
        self.hits = 0         # lookups that restored at least one block
        self.hit_tokens = 0   # tokens restored instead of prefilled
        self.inserts = 0      # entries stored
        self.evictions = 0    # entries evicted

    def __repr__(self) -> str:
        return (f"PrefixCache(block={self.block}, entries={len(self)}, "
                f"bytes={self.nbytes}/{self.budget_bytes}, lookups={self.lookups}, "
                f"hits={self.hits}, hit_tokens={self.hit_tokens}, evictions={self.evictions})")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold now (at most ``budget_bytes``)."""
        return len(self._entries) * self.entry_bytes

    def stats(self) -> dict[str, int]:
        return dict(entries=len(self), bytes=self.nbytes, lookups=self.lookups, hits=self.hits,
                    hit_tokens=self.hit_tokens, inserts=self.inserts, evictions=self.evictions)

    def keys(self, tokens: torch.Tensor) -> list[bytes]:
        """The chain keys of the full blocks of ``tokens`` (int64 [n], host or device)."""
        tokens = tokens.detach().to("cpu", torch.int64).contiguous()
        keys: list[bytes] = []
        parent = b""
        for i in range(tokens.numel() // self.block):
            h = hashlib.blake2b(parent, digest_size=_KEY_BYTES)
            h.update(tokens[i * self.block:(i + 1) * self.block].numpy().tobytes())
            parent = h.digest()
            keys.append(parent)
        return keys

    # ---- a prompt through the cache -----------------------------------------------------------

    @torch.no_grad()
    def prefill(self, model: HybridModel, slot: int, tokens: torch.Tensor) -> torch.Tensor:
        """``model.prefill`` of the prompt ``tokens`` (int64 [n]) into a freshly allocated
        ``slot`` of the cache, through this cache: restores the longest cached block prefix
        (p tokens, p <= n - 1), prefills positions [p, n) keeping block states, stores the new
        blocks. Returns the logits of positions [p, n) ([n - p, vocab], float32: the last row
        is the prompt's last, as with model.prefill)."""
        cache = self.cache
        cache.prefill_context(slot, tokens)  # refuses a bad prompt or slot before any change
        keys = self.keys(tokens)
        hit = self._lookup(keys, tokens.numel())
        p = len(hit) * self.block
        states = self._restore(slot, hit) if hit else None
        logits, ctx = model.prefill_blocks(cache, slot, tokens[p:], self.block, start=p,
                                           start_states=states)
        self._insert(keys, ctx)
        return logits

    def _lookup(self, keys: list[bytes], n: int) -> list[_Entry]:
        """The entries of the longest cached chain of blocks covering at most n - 1 tokens."""
        self.lookups += 1
        hit: list[_Entry] = []
        for key in keys[:(n - 1) // self.block]:
            entry = self._entries.get(key)
            if entry is None:
                break
            hit.append(entry)
        if hit:
            self.hits += 1
            self.hit_tokens += len(hit) * self.block
        return hit

    def _restore(self, slot: int, hit: list[_Entry]) -> torch.Tensor:
        """Writes a chain's conv window and KV rows into ``slot`` (fresh: lengths 0, an empty
        ring) and sets its length; returns the last block's SSM states on the cache's device,
        for the prefill to start its scans from (the slot's SSM state is left to its hand-off)."""
        cache, last = self.cache, hit[-1]
        p = len(hit) * self.block
        dev = cache.device
        K = cache.layout.conv_kernel
        rows = torch.arange(p - (K - 1), p, device=dev) % cache.conv_ring
        cache.conv[:, slot, rows] = last.conv.to(dev)
        # The chain's rows joined where the entries live: one copy (host entries: one transfer).
        cache.k[:, slot, :, :p] = torch.cat([e.k for e in hit], 2).to(dev)
        cache.v[:, slot, :, :p] = torch.cat([e.v for e in hit], 2).to(dev)
        cache.lengths[slot] = p
        return last.ssm.to(dev)

    def _insert(self, keys: list[bytes], ctx: PrefillContext) -> None:
        """Stores the blocks ``ctx``'s prefill passed (those not cached yet) within the budget,
        evicting the least recently used entries of other prompts for them (never one of this
        prompt's chain: a block that does not fit is not stored, nor are those after it), and
        leaves the chain touched deepest block first."""
        cache, slot = self.cache, ctx.slot
        layers = range(cache.layout.num_ssm_layers)
        chain = keys  # the prompt's whole blocks
        self._touch(chain)  # the chain at the recent end: eviction reaches it last
        for j, end in enumerate(ctx.boundaries):
            i = end // self.block - 1
            if keys[i] in self._entries:
                continue
            if not self._make_room(set(chain)):
                break
            span = slice(end - self.block, end)
            self._entries[keys[i]] = _Entry(
                parent=keys[i - 1] if i else None,
                # stack copies already; the KV rows are views of the slot's.
                ssm=torch.stack([ctx.states[layer][j] for layer in layers]).to(self.device),
                conv=torch.stack([ctx.conv_windows[layer][j] for layer in layers]).to(self.device),
                k=cache.k[:, slot, :, span].to(self.device, copy=True),
                v=cache.v[:, slot, :, span].to(self.device, copy=True))
            self.inserts += 1
        self._touch(chain)

    def _touch(self, chain: list[bytes]) -> None:
        """Marks a chain's cached blocks used, deepest first: each block ends up more recent
        than every block after it, so LRU eviction takes a chain's last block first."""
        for key in reversed(chain):
            if key in self._entries:
                self._entries.move_to_end(key)

    def _make_room(self, keep: set[bytes]) -> bool:
        """Evicts least recently used entries until one more fits, none of ``keep``; False
        when only those are left."""
        while self.nbytes + self.entry_bytes > self.budget_bytes:
            victim = next(iter(self._entries))
            if victim in keep:
                return False
            del self._entries[victim]
            self.evictions += 1
        return True
