"""What every hybrid model family shares: the state-mode switch, the per-sequence serving cache
(SSM state cache, causal-conv windows, static KV cache, committed lengths) and the interface a
family implements (prefill, decode, commit, step).

Rows and slots. A decode takes ``slot_ids`` (int32 [B] on the model's device; -1 = a pad row
that keeps the batch's shape). Every slot-indexed tensor here has ``capacity + 1`` rows: row
``capacity`` is a scratch row that pad rows read and write, so a pad row needs no branch and
touches no live sequence; its committed length stays 0.

Positions. ``lengths[slot]`` counts the tokens committed to a slot; token ``t`` of a decode
window sits at position ``lengths[slot] + t``. A decode writes the window's keys and values and
conv inputs at those positions but commits nothing; ``commit`` advances ``lengths`` (and the SSM
cache), so rejected tokens of a speculative window are simply overwritten by the next window.

Conv windows. Each SSM layer keeps the inputs of its causal conv1d in a per-slot ring of
``conv_kernel - 1 + max_spec_tokens`` token rows, the token at position ``p`` in ring row
``p % ring``. A window reads positions ``[lengths - (kernel - 1), lengths + T)``: distinct ring
rows, none overwritten by a pending token (pending positions are at most ``ring - (kernel - 1)``
past the committed end) and, for a young sequence, the never-written rows that stand for the
zeros before position 0. So committing costs nothing beyond ``lengths += accepted``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F

import replayssm
import replayssm.torch as rt

from . import fused
from .attention import decode_attention
from .loader import check_tensors, read_config, read_tensors

__all__ = ["CacheLayout", "DecodeContext", "HybridModel", "PrefillContext", "ServingCache",
           "StateMode", "causal_attention", "weight_constant"]

_EAGER_PRECISIONS = ("fp32", "bf16")
_REPLAY_PRECISIONS = ("fp32", "bf16", "fp32+bf16", "fp32+fp8")
_DEFAULT_BUFFER_LEN = 16
#: GDN replay decodes of single tokens fold every this many tokens up to this batch
#: (:meth:`ServingCache.fold_every`): below a few waves of CTAs a GDN step waits on each CTA's
#: staging and walk of the history, which a shorter cycle shortens, more than the checkpoint
#: writes it adds cost. H200, qwen35-4b layer, staggered, 24 layers a step, fold every 16 -> 8
#: tokens (docs/BENCHMARKS.md, "A decode's fold cadence"), µs, fp32 / fp32+bf16: batch 1
#: 7.7 -> 7.1 / 7.5 -> 6.9, 16 27.1 -> 24.2 / 27.4 -> 24.8, 64 60.1 -> 52.9 / 55.4 -> 51.0, 128
#: 122.4 -> 104.2 / 109.4 -> 99.1; at 256 159.1 -> 166.2 / 134.5 -> 134.7. Every 4 was faster
#: still at 16 and 128 but slower at 4 and 32. Mamba-2 steps ran slower with shorter cycles
#: at nearly every batch (super120b). Only checkpoints with an fp32
#: master take it (SHORT_FOLD_PRECISIONS): a shared bf16 checkpoint rounds at every fold, so
#: its error would grow twice as fast; an fp8 read copy serves more of each output as the ring
#: part shrinks, and fp32+fp8 was not timed with shorter cadences. Tiny Qwen3.5, 70
#: teacher-forced steps, max logit error against eager fp32 folding every 16 / 8 / 5 tokens:
#: fp32+bf16 7.2e-4 / 7.3e-4 / 7.4e-3, fp32+fp8 0.011 / 0.011 / 0.12.
GDN_SHORT_FOLD_EVERY = 8
GDN_SHORT_FOLD_MAX_BATCH = 128
SHORT_FOLD_PRECISIONS = ("fp32", "fp32+bf16")


def default_fold_every(kind: str, precision: str, batch: int, tokens: int, buffer_len: int,
                       on_gpu: bool) -> int:
    """The measured rule for a replay decode's fold cadence (``fold_every``; 0 = buffer_len):
    GDN single tokens on a GPU up to GDN_SHORT_FOLD_MAX_BATCH rows, with a checkpoint of
    SHORT_FOLD_PRECISIONS, fold every GDN_SHORT_FOLD_EVERY tokens; everything else every
    buffer length."""
    short = (kind == "gdn" and precision in SHORT_FOLD_PRECISIONS and tokens == 1
             and batch <= GDN_SHORT_FOLD_MAX_BATCH and on_gpu)
    return min(GDN_SHORT_FOLD_EVERY, buffer_len) if short else 0


@dataclasses.dataclass(frozen=True)
class StateMode:
    """How the SSM state is kept: ``eager`` (the state itself, written every token, in fp32 or
    bf16) or ``replay`` (a checkpoint in ``fp32``, ``bf16``, ``fp32+bf16`` or ``fp32+fp8`` plus a
    ring of recent inputs folded every ``buffer_len`` tokens)."""

    kind: str
    precision: str
    buffer_len: int = _DEFAULT_BUFFER_LEN

    #: Every mode by name, in the order benchmarks list them.
    NAMES = ("eager-fp32", "eager-bf16", "replay-fp32", "replay-bf16", "replay-fp32+bf16",
             "replay-fp32+fp8")

    def __post_init__(self) -> None:
        allowed = {"eager": _EAGER_PRECISIONS, "replay": _REPLAY_PRECISIONS}.get(self.kind)
        if allowed is None:
            raise ValueError(f"unknown state mode kind {self.kind!r}; choose eager or replay")
        if self.precision not in allowed:
            raise ValueError(f"unknown {self.kind} precision {self.precision!r}; choose "
                             f"{', '.join(allowed)}")
        if self.buffer_len < 1:
            raise ValueError(f"buffer_len must be positive, got {self.buffer_len}")
        if self.kind == "eager" and self.buffer_len != _DEFAULT_BUFFER_LEN:
            raise ValueError("an eager mode has no buffer length (':L' is for replay modes)")

    @classmethod
    def parse(cls, text: "str | StateMode") -> "StateMode":
        """``"eager-fp32"``, ..., ``"replay-fp32+fp8"``, optionally ``":L"`` for buffer_len."""
        if isinstance(text, StateMode):
            return text
        m = re.fullmatch(r"(eager|replay)-([a-z0-9+]+)(?::(\d+))?", str(text).strip())
        if m is None:
            raise ValueError(f"unknown state mode {text!r}; choose one of "
                             f"{', '.join(cls.NAMES)} (replay modes take ':L' for buffer_len)")
        kind, precision, buffer_len = m.groups()
        return cls(kind, precision, int(buffer_len) if buffer_len else _DEFAULT_BUFFER_LEN)

    def __str__(self) -> str:
        suffix = f":{self.buffer_len}" if self.buffer_len != _DEFAULT_BUFFER_LEN else ""
        return f"{self.kind}-{self.precision}{suffix}"

    @property
    def eager(self) -> bool:
        return self.kind == "eager"

    def cache_config(self, kind: str, dims: dict[str, int], num_layers: int, capacity: int,
                     max_spec_tokens: int, input_dtype: Any, device: Any,
                     share_forked_checkpoints: bool = False) -> replayssm.CacheConfig:
        """The state cache's configuration for ``num_layers`` layers of ``kind`` ("mamba2" or
        "gdn") with ``dims`` (the layer's CacheConfig dimensions); ``share_forked_checkpoints``
        applies to replay modes (an eager cache copies a forked state's rows)."""
        device = torch.device(device).type
        if self.eager:
            # max_spec_tokens > 1: per-draft-state speculation, a state copy per draft token.
            return replayssm.CacheConfig(
                kind=kind, capacity=capacity, num_layers=num_layers, mode="eager",
                state_dtype="float32" if self.precision == "fp32" else "bfloat16",
                max_spec_tokens=max_spec_tokens, input_dtype=input_dtype, device=device, **dims)
        return replayssm.CacheConfig(
            kind=kind, capacity=capacity, num_layers=num_layers, mode="replay",
            checkpoint=self.precision, buffer_len=self.buffer_len,
            max_spec_tokens=max_spec_tokens, input_dtype=input_dtype, device=device,
            share_forked_checkpoints=share_forked_checkpoints, **dims)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What a model keeps per sequence, as :class:`ServingCache` sizes it."""

    ssm_kind: str                 # "mamba2" or "gdn"
    ssm_dims: dict[str, int]      # the CacheConfig dimensions of one SSM layer
    num_ssm_layers: int
    conv_channels: int            # channels of each SSM layer's causal conv1d
    conv_kernel: int
    num_attn_layers: int
    kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype            # activations: the KV cache, conv windows and SSM inputs


@dataclasses.dataclass(frozen=True)
class DecodeContext:
    """One decode call's indices, computed once and used by every layer (all on the device)."""

    slot_ids: torch.Tensor   # int32 [B], -1 = pad row
    rows: torch.Tensor       # int64 [B]: cache rows (pad rows -> the scratch row)
    rows32: torch.Tensor     # int32 [B]: the same, as decode_attention takes them
    lengths: torch.Tensor    # int32 [B]: tokens committed to each row before the window
    positions: torch.Tensor  # int64 [B, T]: the window's positions (clamped to max_seq_len - 1)
    conv_write: torch.Tensor  # int64 [B * T]: the window's rows in a layer's flat conv ring
    conv_read: torch.Tensor   # int64 [B * (kernel - 1 + T)]: the rows the conv reads
    T: int


@dataclasses.dataclass
class PrefillContext:
    """One prefill call: its slot and positions, and what it keeps at block boundaries.

    The slot already holds positions [0, start) (SSM state, conv ring, KV rows); the call runs
    positions [start, start + n). With ``block`` > 0 (start a multiple of it) the SSM mixers
    keep, at every boundary p = start + block, start + 2 block, ... <= start + n, each SSM
    layer's fp32 state after position p - 1 and the conv inputs of positions [p - kernel + 1, p)
    (zeros before position 0): what a prefix-cache entry needs beside the KV rows (those are
    the slot's own, rows [0, p)), taken from the chunked scans' chunk ends (chunks divide the
    block: :meth:`chunk`), with no second pass.

    ``start_states``, when the caller holds them (a prefix-cache hit), are every SSM layer's fp32
    state after position start - 1: the scans start from them instead of the slot's state, which
    is then never read (on CUDA reading it is a host round trip of the whole state per layer).
    """

    slot: int
    start: int
    n: int
    block: int = 0
    #: fp32 [n_ssm, *state_shape] on the cache's device, or None: the slot's own state.
    start_states: torch.Tensor | None = None
    #: SSM layer -> fp32 [len(boundaries), *state_shape]
    states: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: SSM layer -> [len(boundaries), kernel - 1, conv_channels] (activations dtype)
    conv_windows: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: SSM layer -> its fp32 state after the last position, until the hand-off loads them all
    final_states: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def boundaries(self) -> range:
        """The block boundaries this prefill passes (empty without ``block``)."""
        if not self.block:
            return range(0)
        return range(self.start + self.block, self.start + self.n + 1, self.block)

    def chunk(self, native: int) -> int:
        """The scan's chunk length: the family's own, or with ``block`` its largest divisor
        that also divides the block, so that chunk ends fall on every boundary."""
        return math.gcd(native, self.block) if self.block else native


class ServingCache:
    """Everything ``model`` keeps per sequence, slot-indexed, on the model's device.

    - ``ssm``: one :class:`replayssm.torch.StateCache` over the model's SSM layers, in ``mode``.
    - ``conv``: [n_ssm, capacity + 1, ring, conv_channels], the conv inputs' rings (module doc).
    - ``k``, ``v``: [n_attn, capacity + 1, kv_heads, max_seq_len, head_dim], static KV cache.
    - ``lengths``: int32 [capacity + 1], committed tokens per row (the scratch row's stays 0).

    A sequence past ``max_seq_len`` tokens keeps overwriting its last KV position (the index
    is clamped on the device, so a step never faults): the engine stops it before that.

    ``share_forked_checkpoints`` (replay modes): :meth:`fork` lets a copy read its source's
    SSM checkpoints until either folds, instead of copying them (the state cache's option).

    ``fold_every`` (replay modes): the SSM decodes' fold cadence (``gdn_decode``'s and
    ``mamba2_decode``'s ``fold_every``): ``"auto"`` (the default) the measured rule of
    :meth:`fold_every`, an int that cadence for every decode (0: the buffer length).
    """

    def __init__(self, model: "HybridModel", capacity: int, max_seq_len: int,
                 mode: "str | StateMode", max_spec_tokens: int = 1,
                 share_forked_checkpoints: bool = False, fold_every: "str | int" = "auto") -> None:
        if capacity < 1 or max_seq_len < 1 or max_spec_tokens < 1:
            raise ValueError(f"capacity ({capacity}), max_seq_len ({max_seq_len}) and "
                             f"max_spec_tokens ({max_spec_tokens}) must be positive")
        self.mode = StateMode.parse(mode)
        if fold_every != "auto" and not (
                isinstance(fold_every, int) and
                (fold_every == 0 or (not self.mode.eager and
                                     1 <= fold_every <= self.mode.buffer_len))):
            raise ValueError(f"fold_every must be 'auto', 0 or (replay modes) in [1, "
                             f"buffer_len = {self.mode.buffer_len}], got {fold_every!r}")
        self._fold_every = fold_every
        layout = model.cache_layout()
        self.layout = layout
        self.capacity, self.max_seq_len = capacity, max_seq_len
        self.max_spec_tokens = max_spec_tokens
        self.pad_row = capacity
        self.device, self.dtype = layout.device, layout.dtype
        self.ssm = rt.StateCache(self.mode.cache_config(
            layout.ssm_kind, layout.ssm_dims, layout.num_ssm_layers, capacity, max_spec_tokens,
            layout.dtype, layout.device, share_forked_checkpoints), device=layout.device)
        self.conv_ring = layout.conv_kernel - 1 + max_spec_tokens
        self.conv = torch.zeros(layout.num_ssm_layers, capacity + 1, self.conv_ring,
                                layout.conv_channels, dtype=layout.dtype, device=layout.device)
        kv_shape = (layout.num_attn_layers, capacity + 1, layout.kv_heads, max_seq_len,
                    layout.head_dim)
        self.k = torch.zeros(kv_shape, dtype=layout.dtype, device=layout.device)
        self.v = torch.zeros(kv_shape, dtype=layout.dtype, device=layout.device)
        self.lengths = torch.zeros(capacity + 1, dtype=torch.int32, device=layout.device)
        self._conv_taps = torch.arange(-(layout.conv_kernel - 1), max_spec_tokens,
                                       device=layout.device)
        self._window = torch.arange(max_spec_tokens, device=layout.device)

    def __repr__(self) -> str:
        return (f"ServingCache({self.mode}, capacity={self.capacity}, "
                f"max_seq_len={self.max_seq_len}, max_spec_tokens={self.max_spec_tokens}, "
                f"free={self.ssm.free_slots})")

    def fold_every(self, kind: str, batch: int, tokens: int) -> int:
        """The fold cadence of a decode of ``tokens`` tokens for ``batch`` rows of ``kind``
        ("gdn" or "mamba2") layers: the constructor's int, or default_fold_every's. It
        depends on the batch and window only, so a step captured per batch bucket keeps it."""
        if self.mode.eager:
            return 0
        if self._fold_every != "auto":
            return int(self._fold_every)
        return default_fold_every(kind, self.mode.precision, batch, tokens,
                                  self.mode.buffer_len, torch.device(self.device).type == "cuda")

    @property
    def max_window(self) -> int:
        """The longest decode window: ``max_spec_tokens`` (an eager cache keeps a state copy
        per window token, a replay cache verifies the window from its checkpoint and ring)."""
        return self.max_spec_tokens

    # ---- slots --------------------------------------------------------------------------------

    def allocate(self) -> int:
        """A free slot with an empty history (zero state, zero conv window, length 0)."""
        slot = self.ssm.allocate()
        self.conv[:, slot].zero_()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.ssm.free(slot)
        self.lengths[slot] = 0

    def fork(self, src: int, dst: int | None = None) -> int:
        """Makes slot ``dst`` (allocated here when None) a copy of sequence ``src`` at its
        committed end: its SSM state, conv window, KV rows and length. Decoding the copy then
        equals decoding the source on, so each branch of parallel sampling or a beam search can
        take its own tokens from there. A replay cache forks its SSM slot (with
        ``share_forked_checkpoints`` the checkpoints are copied on fold); an eager cache copies
        the state's rows. Reads the source's length on the host. Returns ``dst``."""
        self._check_slot(src)
        if dst is not None:
            self._check_slot(dst)
            if dst == src:
                raise ValueError(f"slot {src} cannot be forked onto itself")
        new = dst is None
        dst = self.allocate() if new else dst
        try:
            n = int(self.lengths[src])
            if self.mode.eager:
                self._copy_ssm_rows(src, dst)
            else:
                ids = lambda s: torch.tensor([s], dtype=torch.int32, device=self.device)
                position = self.ssm.buffers["committed"][src:src + 1].view(torch.int32)
                self.ssm.fork(ids(src), ids(dst), position)
        except BaseException:
            if new:
                self.free(dst)
            raise
        self.conv[:, dst] = self.conv[:, src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        return dst

    def _copy_ssm_rows(self, src: int, dst: int) -> None:
        """Every SSM buffer's rows of ``src`` onto ``dst`` (``allocated`` aside): how an eager
        slot is forked (state_cache.h, Memory)."""
        for region in slot_regions(self.ssm):
            region[:, dst] = region[:, src]

    def prefill_context(self, slot: int, tokens: torch.Tensor, start: int = 0,
                        block: int = 0, start_states: torch.Tensor | None = None
                        ) -> PrefillContext:
        """The context of a prefill of ``tokens`` (int64 [n]) at positions [start, start + n)
        into ``slot`` (``start_states``: :class:`PrefillContext`'s); refuses one this cache
        cannot hold or that does not continue the slot (its committed length must be
        ``start``: a host read of one value)."""
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"a prompt is a non-empty int64 [n], got {tuple(tokens.shape)}")
        if start < 0:
            raise ValueError(f"a prefill starts at a position >= 0, got {start}")
        if start + tokens.numel() > self.max_seq_len:
            raise ValueError(f"a prompt of {tokens.numel()} tokens from position {start} "
                             f"exceeds max_seq_len ({self.max_seq_len})")
        if block < 0 or (block and start % block):
            raise ValueError(f"block states need a block size >= 1 and a start that is a "
                             f"multiple of it, got block {block}, start {start}")
        if start_states is not None:
            shape = (self.layout.num_ssm_layers, *self.ssm.config.state_shape)
            if start == 0 or tuple(start_states.shape) != shape \
                    or start_states.dtype != torch.float32 or start_states.device != self.device:
                raise ValueError(f"start_states are float32 {shape} on {self.device} and need a "
                                 f"start > 0, got {start_states.dtype} "
                                 f"{tuple(start_states.shape)} on {start_states.device}, start "
                                 f"{start}")
        self._check_slot(slot)
        held = int(self.lengths[slot])
        if held != start:
            raise ValueError(f"slot {slot} holds {held} positions; a prefill continuing it "
                             f"starts there, not at {start}")
        return PrefillContext(slot, start, tokens.numel(), block, start_states=start_states)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or not self.ssm.is_allocated(slot):
            raise ValueError(f"slot {slot} is not an allocated slot of this cache")

    # ---- decode indices -----------------------------------------------------------------------

    def rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Cache rows (int64) of ``slot_ids``: pad rows (-1) map to the scratch row."""
        return torch.where(slot_ids < 0, self.pad_row, slot_ids).long()

    def decode_context(self, slot_ids: torch.Tensor, tokens: "torch.Tensor | int") -> DecodeContext:
        """The indices of a decode of ``tokens`` (int64 [B, T], or T) for ``slot_ids``; refuses
        what the mode cannot do (shapes only: no device value is read)."""
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 2 or tokens.shape[0] != slot_ids.shape[0]:
                raise ValueError(f"tokens must be int64 [batch, T] with batch = len(slot_ids) "
                                 f"({slot_ids.shape[0]}), got {tuple(tokens.shape)}")
            T = tokens.shape[1]
        else:
            T = tokens
        if T > self.max_window:
            raise ValueError(f"a window of {T} tokens exceeds this cache's max_spec_tokens "
                             f"({self.max_spec_tokens})")
        if slot_ids.dtype != torch.int32 or slot_ids.dim() != 1:
            raise ValueError(f"slot_ids must be int32 [batch], got {slot_ids.dtype} "
                             f"{tuple(slot_ids.shape)}")
        rows = self.rows(slot_ids)
        lengths = self.lengths[rows]
        base = lengths.long()
        positions = (base[:, None] + self._window[:T]).clamp_(max=self.max_seq_len - 1)
        ring_base = rows[:, None] * self.conv_ring
        conv_write = (ring_base + (base[:, None] + self._window[:T]) % self.conv_ring).reshape(-1)
        taps = self._conv_taps[: self.layout.conv_kernel - 1 + T]
        conv_read = (ring_base + (base[:, None] + taps) % self.conv_ring).reshape(-1)
        return DecodeContext(slot_ids, rows, rows.int(), lengths, positions, conv_write,
                             conv_read, T)

    # ---- causal conv1d ------------------------------------------------------------------------

    def conv_prefill(self, layer: int, ctx: PrefillContext, x: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str | None = "silu") -> torch.Tensor:
        """The causal conv1d of a prefill's inputs ``x`` [n, C] at positions [start, start + n)
        with ``weight`` [C, kernel], after the slot's last kernel - 1 inputs (zeros before
        position 0; a fresh slot's ring is emptied first); keeps the last inputs in the slot's
        ring and, with ``ctx.block``, the window before each boundary in ``ctx``.
        Returns [n, C] in x's dtype."""
        n, K = x.shape[0], weight.shape[-1]
        ring = self.conv[layer, ctx.slot]
        if ctx.start == 0:
            ring.zero_()
        # Positions start - K + 1 .. start - 1; those before 0 read never-written (zero) rows.
        past = torch.arange(ctx.start - (K - 1), ctx.start, device=x.device)
        inputs = torch.cat([ring[past % self.conv_ring].to(x.dtype), x])   # [K - 1 + n, C]
        out = F.conv1d(inputs.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias,
                       groups=x.shape[1])[0]
        keep = min(n, self.conv_ring)
        written = torch.arange(ctx.start + n - keep, ctx.start + n, device=x.device)
        ring[written % self.conv_ring] = x[n - keep:].to(ring.dtype)
        if ctx.block:
            # inputs[i] is position start - K + 1 + i: the window before p starts at p - start,
            # a multiple of the block (made on the device: a tensor of a host list would be a
            # blocking copy, a stream sync per layer).
            offsets = ctx.block * torch.arange(1, len(ctx.boundaries) + 1, device=x.device)
            taps = torch.arange(K - 1, device=x.device)
            ctx.conv_windows[layer] = inputs[offsets[:, None] + taps].to(ring.dtype)
        return _activate(out, activation).t().to(x.dtype)

    # ---- SSM state across a prefill -----------------------------------------------------------

    def ssm_prefill_state(self, layer: int, ctx: PrefillContext) -> torch.Tensor | None:
        """The fp32 state a prefill's scan starts from: None (zeros) for a fresh slot, the
        caller's ``ctx.start_states``, else the state the slot holds (export_state: a replay
        cache folds first; a bf16 state or checkpoint comes back as it is stored, rounded)."""
        if ctx.start == 0:
            return None
        if ctx.start_states is not None:
            return ctx.start_states[layer]
        return self.ssm.export_state(layer, ctx.slot)

    def ssm_prefill_end(self, layer: int, ctx: PrefillContext, state: torch.Tensor,
                        kept: list[torch.Tensor]) -> None:
        """Keeps a layer's final fp32 ``state`` for :meth:`ssm_hand_off` and the block-boundary
        states ``kept`` in ``ctx``."""
        ctx.final_states[layer] = state
        if ctx.block:
            ctx.states[layer] = (torch.stack(kept) if kept else
                                 state.new_empty(0, *state.shape))

    def ssm_hand_off(self, ctx: PrefillContext) -> None:
        """Loads every SSM layer's final state into the slot (the prefill hand-off). A replay
        cache takes them in one ``restore`` at the slot's committed cursor: the cursors as
        ``load_state`` leaves them (folded = committed, an empty ring) and the same checkpoint
        bytes, but on CUDA written by device kernels (its syncs read back a few small values)
        where ``load_state`` moves each layer's whole state to the host, rounds it there and
        copies it back, a stream sync per copy (``bench_prefix`` times both). An eager cache,
        which has no ``restore``, or a state shape the device's ``restore`` does not take
        (refused before anything is written) gets ``load_state`` per layer."""
        states = [ctx.final_states[layer] for layer in range(self.layout.num_ssm_layers)]
        if not self.mode.eager:
            position = int(self.ssm.buffers["committed"][ctx.slot])  # a host read of one value
            try:
                self.ssm.restore(ctx.slot, position, torch.stack(states))
                return
            except NotImplementedError:
                pass
        for layer, state in enumerate(states):
            self.ssm.load_state(layer, ctx.slot, state)

    def conv_decode(self, layer: int, ctx: DecodeContext, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, activation: str | None = "silu",
                    splits: "list[int] | None" = None) -> "torch.Tensor | list[torch.Tensor]":
        """The causal conv1d of a decode window ``x`` [B, T, C] over each row's ring (written
        here, committed by ``lengths``). Returns [B, T, C] in x's dtype, or with ``splits``
        (channel counts summing to C) one contiguous [B, T, s] tensor per split, as the SSM ops
        take them. On CUDA one fused kernel (fused.conv_decode) does it all."""
        B, T, C = x.shape
        flat = self.conv[layer].view(-1, C)
        if fused.available(x) and x.stride(-1) == 1:
            outs = fused.conv_decode(x, flat, ctx.conv_write, ctx.conv_read, weight, bias,
                                     activation, [C] if splits is None else splits)
            return outs[0] if splits is None else outs
        out = conv_decode_reference(x, flat, ctx.conv_write, ctx.conv_read, weight, bias,
                                    activation)
        return out if splits is None else [t.contiguous() for t in out.split(splits, -1)]

    # ---- attention ----------------------------------------------------------------------------

    def kv_prefill(self, layer: int, ctx: PrefillContext, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes a prefill's keys and values [n, kv_heads, head_dim] at positions
        [start, start + n); returns the keys and values [start + n, kv_heads, head_dim] its
        queries attend over (the slot's earlier ones read back from the cache)."""
        end = ctx.start + k.shape[0]
        self.k[layer, ctx.slot, :, ctx.start:end] = k.transpose(0, 1).to(self.dtype)
        self.v[layer, ctx.slot, :, ctx.start:end] = v.transpose(0, 1).to(self.dtype)
        if ctx.start == 0:
            return k, v
        return (self.k[layer, ctx.slot, :, :end].transpose(0, 1).to(k.dtype),
                self.v[layer, ctx.slot, :, :end].transpose(0, 1).to(v.dtype))

    def kv_decode(self, layer: int, ctx: DecodeContext, k: torch.Tensor,
                  v: torch.Tensor) -> None:
        """Writes a window's keys and values [B, T, kv_heads, head_dim] at its positions."""
        r = ctx.rows[:, None]
        self.k[layer][r, :, ctx.positions] = k.to(self.dtype)
        self.v[layer][r, :, ctx.positions] = v.to(self.dtype)

    def attend(self, layer: int, ctx: DecodeContext, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of a window's queries q [B, T, Hq, head_dim] (after kv_decode) over each
        row's keys [0, lengths + t] (attention.decode_attention: Triton on CUDA)."""
        return decode_attention(q, self.k[layer], self.v[layer], ctx.rows32, ctx.lengths, scale)


def slot_regions(ssm: "rt.StateCache") -> list[torch.Tensor]:
    """Every buffer of ``ssm`` but ``allocated`` (the slots' own flags) as bytes
    [outer, capacity, region], so that slot rows copy alike whatever the dtype (fp8 included):
    everything of slot s is ``region[:, s]`` (state_cache.h, Memory)."""
    out = []
    for spec in replayssm.cache_buffers(ssm.config):
        if spec.name == "allocated":
            continue
        outer = 1 if spec.slot_axis == 0 else spec.shape[0]
        out.append(ssm.buffers[spec.name].view(torch.uint8).view(
            outer, spec.shape[spec.slot_axis], -1))
    return out


def weight_constant(module: torch.nn.Module, name: str, fn: Any, *params: torch.Tensor) -> Any:
    """``fn(*params)`` (e.g. Mamba-2's -exp(A_log) in float32), computed once and kept on
    ``module`` until one of ``params`` changes (another tensor, or an in-place write: its
    version counter), so a decode step does not recompute per-weight constants every token. A
    CUDA graph captured before a weight changes keeps the old constant: capture after loading."""
    stamp = tuple((p.data_ptr(), p._version) for p in params)
    kept = module.__dict__.setdefault("_weight_constants", {})
    if name not in kept or kept[name][0] != stamp:
        with torch.no_grad():
            kept[name] = (stamp, fn(*params))
    return kept[name][1]


def conv_decode_reference(x: torch.Tensor, ring: torch.Tensor, conv_write: torch.Tensor,
                          conv_read: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          activation: str | None) -> torch.Tensor:
    """A decode window's causal conv1d in plain torch ops (the CPU path, and the fused kernel's
    reference; arguments as :func:`fused.conv_decode`'s). Returns [B, T, C] in x's dtype."""
    B, T, C = x.shape
    K = weight.shape[-1]
    ring.index_copy_(0, conv_write, x.reshape(B * T, C).to(ring.dtype))
    window = ring.index_select(0, conv_read).view(B, K - 1 + T, C).to(weight.dtype)
    out = window[:, 0:T] * weight[:, 0]
    for k in range(1, K):
        out = out + window[:, k:k + T] * weight[:, k]
    if bias is not None:
        out = out + bias
    return _activate(out, activation).to(x.dtype)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation == "silu":
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r}; choose 'silu' or None")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal self-attention of a prefill: q [n, Hq, D] at the last n of the m positions of
    k, v [m, Hkv, D] (GQA; m >= n: a prefill continuing a slot attends over its earlier keys
    too) -> [n, Hq, D]."""
    n, m = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    mask = None
    if m != n:  # query i sits at position m - n + i
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(rep, dim=1).transpose(0, 1),
        v.repeat_interleave(rep, dim=1).transpose(0, 1), attn_mask=mask, is_causal=mask is None,
        scale=scale)
    return out.transpose(0, 1)


class HybridModel(torch.nn.Module, abc.ABC):
    """A hybrid decoder (SSM mixers, attention, MLP) served from a :class:`ServingCache`.

    Families implement ``cache_layout``, ``_stack``, ``random`` and ``input_embeddings``, and
    set ``config_class`` (a config with ``from_hf`` and ``tie_word_embeddings``) and
    ``ignored_tensors``; ``prefill``, ``decode_logits``, ``decode``, ``commit``, ``step``,
    ``step_argmax``, ``from_pretrained`` and ``from_tensors`` are shared. None of the decode
    methods does a host sync or has data-dependent shapes, so an engine can capture them in a
    CUDA graph. A family's module has ``config`` and ``lm_head`` attributes.
    """

    config_class: Any
    #: Checkpoint tensor name prefixes the model does not use (skipped, not refused).
    ignored_tensors: tuple[str, ...] = ()

    @abc.abstractmethod
    def input_embeddings(self) -> torch.nn.Embedding:
        """The token embedding (which ``lm_head`` shares when the config ties them)."""

    def _tie(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.input_embeddings().weight

    @classmethod
    def _config(cls, config: Any) -> Any:
        """``config`` itself, or the family's config read from a config.json dict."""
        return cls.config_class.from_hf(config) if isinstance(config, dict) else config

    @classmethod
    def _empty(cls, config: Any, device: Any, dtype: torch.dtype) -> "HybridModel":
        """Uninitialised weights on ``device`` in ``dtype`` (built on the meta device: a 4B
        layout never passes through host memory), ready for inference."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype).to_empty(device=device)
        model._tie()  # to_empty makes new parameters: tie them again
        return model.eval().requires_grad_(False)

    @classmethod
    def _checkpoint_names(cls, names: list[str], tensors: dict[str, torch.Tensor]
                          ) -> dict[str, str]:
        """Each of the model's tensor names -> its name in ``tensors`` (a checkpoint's own
        naming); the same names by default."""
        return {n: n for n in names}

    @abc.abstractmethod
    def cache_layout(self) -> CacheLayout:
        """What a ServingCache for this model holds."""

    @abc.abstractmethod
    def _stack(self, tokens: torch.Tensor, positions: torch.Tensor,
               mix: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The logits (the LM head's dtype) of ``tokens`` at ``positions`` (same shape): the
        embedding, every layer, the final norm and the LM head, each SSM or attention layer run
        by ``mix(mixer, cache_layer, x, *extra)`` (the family's extra mixer arguments, such as
        rotary tables, last), which calls the mixer's ``prefill`` or ``decode``."""

    @torch.no_grad()
    def prefill(self, cache: ServingCache, slot: int, tokens: torch.Tensor,
                start: int = 0) -> torch.Tensor:
        """Prefills ``tokens`` (int64 [n]) at positions [start, start + n) of ``slot``, which
        holds positions [0, start) (0: a freshly allocated slot; else after an earlier prefill,
        decode steps or a prefix-cache restore): the scans start from the slot's state, the conv
        from its ring, attention covers its KV rows. Fills KV rows [start, start + n), the conv
        ring and the SSM state (loaded into ``cache.ssm``), sets ``lengths[slot] = start + n``;
        returns the logits [n, vocab] (float32). Prefilling a prompt in pieces equals one
        prefill of it, up to the fp32 scans' rounding (and a bf16 state's rounding at each
        piece's end, where the slot keeps the state in bf16)."""
        return self._prefill(cache, cache.prefill_context(slot, tokens, start), tokens)

    @torch.no_grad()
    def prefill_blocks(self, cache: ServingCache, slot: int, tokens: torch.Tensor, block: int,
                       start: int = 0, start_states: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, PrefillContext]:
        """:meth:`prefill` (``start`` a multiple of ``block``) that also keeps every SSM layer's
        state and conv window at each block boundary it passes (``PrefillContext.states``,
        ``conv_windows``): returns the logits and the context. ``start_states`` (fp32
        [n_ssm, *state_shape]): the SSM states at ``start`` when the caller holds them (a
        prefix-cache hit), which the scans start from instead of the slot's."""
        ctx = cache.prefill_context(slot, tokens, start, block, start_states)
        return self._prefill(cache, ctx, tokens), ctx

    def _prefill(self, cache: ServingCache, ctx: PrefillContext,
                 tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(cache.device)
        positions = torch.arange(ctx.start, ctx.start + ctx.n, device=tokens.device)
        logits = self._stack(tokens, positions, lambda mixer, layer, x, *extra:
                             mixer.prefill(cache, layer, ctx, x, *extra))
        cache.ssm_hand_off(ctx)
        cache.lengths[ctx.slot] = ctx.start + ctx.n
        return logits.float()

    @torch.no_grad()
    def decode_logits(self, cache: ServingCache, slot_ids: torch.Tensor,
                      tokens: torch.Tensor) -> torch.Tensor:
        """``decode``'s logits in the LM head's dtype (no float32 copy of [B, T, vocab])."""
        ctx = cache.decode_context(slot_ids, tokens)
        return self._stack(tokens, ctx.positions, lambda mixer, layer, x, *extra:
                           mixer.decode(cache, layer, ctx, x, *extra))

    def decode(self, cache: ServingCache, slot_ids: torch.Tensor,
               tokens: torch.Tensor) -> torch.Tensor:
        """A window of ``tokens`` (int64 [B, T]) for the rows ``slot_ids`` (int32 [B], -1 = pad
        row), token t at position ``lengths[slot] + t``; commits nothing. Returns the logits
        [B, T, vocab] (float32)."""
        return self.decode_logits(cache, slot_ids, tokens).float()

    def commit(self, cache: ServingCache, slot_ids: torch.Tensor,
               accepted: torch.Tensor) -> None:
        """Accepts the first ``accepted[b]`` (int32 [B]) tokens of the last window of each row:
        the SSM cache commits them and ``lengths`` advances (the conv rings and KV rows already
        hold them; the rest are overwritten by the next window)."""
        cache.ssm.commit(slot_ids, accepted)
        advance = torch.where(slot_ids < 0, 0, accepted)
        cache.lengths.index_add_(0, cache.rows(slot_ids), advance)

    def step(self, cache: ServingCache, slot_ids: torch.Tensor,
             tokens: torch.Tensor) -> torch.Tensor:
        """One decoding step: ``tokens`` (int64 [B]) decoded and committed; logits [B, vocab]."""
        logits = self.decode(cache, slot_ids, tokens[:, None])
        self.commit(cache, slot_ids, torch.ones_like(slot_ids))
        return logits[:, 0]

    def step_argmax(self, cache: ServingCache, slot_ids: torch.Tensor,
                    tokens: torch.Tensor) -> torch.Tensor:
        """``step``'s greedy tokens, ``step(...).argmax(-1)`` (int64 [B]), without float32
        logits: widening to float32 is exact, so the argmax of the LM head's own output is the
        same index (a [B, vocab] fp32 write and read saved per step)."""
        logits = self.decode_logits(cache, slot_ids, tokens[:, None])
        self.commit(cache, slot_ids, torch.ones_like(slot_ids))
        return logits[:, 0].argmax(-1)

    @classmethod
    @abc.abstractmethod
    def random(cls, config: Any, seed: int = 0, device: Any = "cpu",
               dtype: torch.dtype = torch.float32) -> "HybridModel":
        """A model of ``config`` with seeded random weights."""

    @classmethod
    def from_pretrained(cls, path: Any, device: Any = "cpu",
                        dtype: torch.dtype = torch.float32) -> "HybridModel":
        """A model from a Hugging Face model directory (config.json + safetensors, sharded or
        not)."""
        config = cls.config_class.from_hf(read_config(path))
        return cls.from_tensors(config, read_tensors(path), device=device, dtype=dtype)

    @classmethod
    def from_tensors(cls, config: Any, tensors: dict[str, torch.Tensor], device: Any = "cpu",
                     dtype: torch.dtype = torch.float32) -> "HybridModel":
        """A model over ``tensors`` (named as the family's checkpoints name them); refuses a
        missing, mis-shaped or unknown tensor by its name in ``tensors`` before building
        anything. A tied ``lm_head.weight`` may be present or not."""
        with torch.device("meta"):
            expected = {k: p.shape for k, p in cls(config).state_dict().items()}
        ignored = list(cls.ignored_tensors)
        if config.tie_word_embeddings:
            expected.pop("lm_head.weight")
            ignored.append("lm_head.weight")
        file_name = cls._checkpoint_names(list(expected), tensors)
        check_tensors({file_name[k]: s for k, s in expected.items()}, tensors, ignored)
        model = cls._empty(config, device, dtype)
        params = dict(model.named_parameters())
        for name in expected:
            params[name].copy_(tensors[file_name[name]])
        return model
