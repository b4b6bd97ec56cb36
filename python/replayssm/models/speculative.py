"""Greedy speculative decoding over a :class:`~replayssm.models.HybridModel` and its
:class:`~replayssm.models.ServingCache`.

    spec = SpeculativeDecoder(model, ServingCache(model, 16, 4096, "replay-fp32",
                                                  max_spec_tokens=4), NgramDrafter(), window=4)
    result = spec.generate(prompts, max_new_tokens=256)     # result.tokens, result.accepted

The window. A row's stream of tokens lives in ``history`` (int64 [capacity + 1, max_seq_len],
the token at position p of a slot at ``history[slot, p]``, as in the engine). ``lengths[slot]
= L`` tokens are committed; ``history[slot, L]`` is the *pending* token: the model's greedy
choice after them, known but not yet decoded. A step decodes the window ``[pending, d_1, ...,
d_{T-1}]`` (T = ``window``: the pending token and T - 1 drafts) at positions L .. L + T - 1 in
one ``model.decode`` (attention over the window, replay verify or per-draft state copies in the
SSM layers) and takes the greedy prediction ``p_t`` after each window token. Draft ``d_{t+1}``
is accepted while it equals ``p_t``: with ``m`` drafts accepted, ``accepted = m + 1`` tokens
(the pending one and the m drafts) are committed (``model.commit``: the SSM cache's cursor and
``lengths`` move; rejected keys, values and conv inputs are overwritten by the next window), and
``p_m``, the bonus token, becomes the new pending token. So a step emits between 1 and T tokens,
and they are the tokens of plain greedy decoding: each committed token is the greedy choice
after the ones before it (``accepted`` is the "accepted length" the benchmarks average).
``window = 1`` is plain decoding.

On the device. The step (draft, decode, argmax, accept, commit, write ``p_0 .. p_{T-1}`` at
positions L + 1 .. L + T, the ones past the new pending token being overwritten later) reads no
value on the host and has no data-dependent shape, so :class:`SpecRunner` captures it in a CUDA
graph, drafter included. Rows accept different counts; pad rows (slot -1) touch only the
scratch row. ``generate`` reads the lengths once per step to retire finished rows; it decodes
a fixed set of prompts. Under continuous batching, ``Engine(..., drafter, spec_tokens=T)`` runs
the same step over the engine's history, a SpecRunner per batch bucket (engine.py).

Drafters propose the T - 1 drafts of every row from the history (:class:`Drafter`):

- :class:`NgramDrafter` (prompt lookup, no model): the most recent earlier occurrence of the
  row's last n tokens (n = ``max_ngram`` down to ``min_ngram``, longest first), continued with
  the tokens that followed it; a continuation that runs into the pending token repeats the
  matched period. On the device: a step compares each row's history (the last ``lookback``
  positions) with its suffix, ``(max_ngram + ... + min_ngram) * B * lookback`` comparisons.
- :class:`DraftModelDrafter`: a smaller model of the same family through the same decoder, with
  its own ServingCache (same capacity, same slot numbers). It keeps its committed length D at
  most the target's: a step first decodes the window history[D .. D + T) (the tokens the target
  accepted since, then the pending token; at most T of them) and commits those ``L + 1 - D``
  tokens, its prediction after the pending token being d_1; then d_k comes from a window of
  [d_1 .. d_{k-1}] that it does not commit (commit 0): a committed token cannot be taken
  back, and the target may reject them. Per step: T - 1 draft decodes, of T, 1, 2, ..., T - 2
  tokens.

The baseline. Per-draft-state speculation is the same decoder over an eager cache with
``max_spec_tokens = T``: the window writes a state copy per token and commit selects one.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, Sequence

import torch

from .base import HybridModel, ServingCache
from .engine import StepRunner

__all__ = ["DraftContext", "DraftModelDrafter", "Drafter", "GenerateResult", "NgramDrafter",
           "SpecRunner", "SpeculativeDecoder"]


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a drafter sees of one step (all on the device)."""

    slot_ids: torch.Tensor  # int32 [B], -1 = pad row
    rows: torch.Tensor      # int64 [B]: rows of the target cache and of ``history``
    lengths: torch.Tensor   # int64 [B]: committed tokens; the pending token is at this position
    history: torch.Tensor   # int64 [capacity + 1, max_seq_len]


class Drafter(abc.ABC):
    """Proposes drafts for a :class:`SpeculativeDecoder` (module doc)."""

    def check(self, decoder: "SpeculativeDecoder") -> None:
        """Refuses a decoder this drafter cannot serve (called once, at construction)."""

    def admit(self, slot: int, prompt: torch.Tensor) -> None:
        """A new sequence in ``slot`` with ``prompt`` (int64 [n], on the device)."""

    def free(self, slot: int) -> None:
        """``slot``'s sequence is done."""

    @abc.abstractmethod
    def propose(self, ctx: DraftContext, n: int) -> torch.Tensor:
        """``n`` drafts (int64 [B, n]) following each row's pending token; capturable."""


class NgramDrafter(Drafter):
    """Prompt lookup on the device (module doc). ``lookback``: how many of a row's latest
    positions are searched (None: the whole history)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1,
                 lookback: int | None = 1024) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        if lookback is not None and lookback <= max_ngram:
            raise ValueError(f"lookback ({lookback}) must exceed max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.lookback = max_ngram, min_ngram, lookback

    def propose(self, ctx: DraftContext, n: int) -> torch.Tensor:
        history, L = ctx.history, ctx.lengths
        B, S = ctx.rows.shape[0], history.shape[1]
        W = S if self.lookback is None else min(self.lookback, S)
        # Positions start .. start + W - 1 of each row, ending at its pending token if it can.
        start = (L - (W - 1)).clamp(min=0)
        offsets = torch.arange(W, device=history.device)
        pos = start[:, None] + offsets                                   # [B, W]
        h = history[ctx.rows[:, None], pos.clamp(max=S - 1)]
        last = L - start                                                 # the pending token's index
        best = torch.full((B,), -1, dtype=torch.long, device=history.device)
        for size in range(self.max_ngram, self.min_ngram - 1, -1):
            # j matches when h[j - i] == h[last - i] for i < size, j < last, j - size + 1 >= 0.
            match = (offsets >= size - 1) & (offsets < last[:, None])
            for i in range(size):
                tok = h.gather(1, (last - i).clamp(min=0)[:, None])
                match &= torch.roll(h, i, 1) == tok
            match &= (last >= size - 1)[:, None]
            j = torch.where(match, offsets, -1).amax(1)
            best = torch.where(best < 0, j, best)
        period = (last - best).clamp(min=1)
        k = torch.arange(n, device=history.device)
        src = best[:, None] + 1 + k % period[:, None]
        # No match: propose the pending token again (a cheap guess the verify may reject).
        src = torch.where(best[:, None] >= 0, src, last[:, None])
        return h.gather(1, src)


class DraftModelDrafter(Drafter):
    """A draft model with its own ``cache`` (module doc). The cache must have the target's
    capacity and take windows of the decoder's T tokens (``max_spec_tokens >= T``)."""

    def __init__(self, model: HybridModel, cache: ServingCache) -> None:
        self.model, self.cache = model, cache

    def check(self, decoder: "SpeculativeDecoder") -> None:
        if self.cache.capacity != decoder.cache.capacity:
            raise ValueError(f"the draft cache's capacity ({self.cache.capacity}) must equal the "
                             f"target's ({decoder.cache.capacity})")
        if self.cache.max_window < decoder.window:
            raise ValueError(f"the draft cache takes windows of {self.cache.max_window} tokens; "
                             f"a window of {decoder.window} needs max_spec_tokens >= "
                             f"{decoder.window}")
        if self.cache.max_seq_len < decoder.cache.max_seq_len:
            raise ValueError(f"the draft cache's max_seq_len ({self.cache.max_seq_len}) is "
                             f"shorter than the target's ({decoder.cache.max_seq_len})")

    def admit(self, slot: int, prompt: torch.Tensor) -> None:
        own = self.cache.allocate()
        if own != slot:
            self.cache.free(own)
            raise RuntimeError(f"the draft cache gave slot {own} for the target's slot {slot}: "
                               "its slots must be allocated only through the decoder")
        self.model.prefill(self.cache, slot, prompt)

    def free(self, slot: int) -> None:
        self.cache.free(slot)

    def propose(self, ctx: DraftContext, n: int) -> torch.Tensor:
        if n == 0:
            return ctx.history.new_empty(ctx.rows.shape[0], 0)
        cache, model, T = self.cache, self.model, n + 1
        behind = cache.lengths[cache.rows(ctx.slot_ids)].long()
        catch_up = ctx.lengths + 1 - behind                              # 1 .. T tokens
        pos = (behind[:, None] + torch.arange(T, device=behind.device)).clamp(
            max=ctx.history.shape[1] - 1)
        logits = model.decode(cache, ctx.slot_ids, ctx.history[ctx.rows[:, None], pos])
        after_pending = logits.gather(
            1, (catch_up - 1)[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        model.commit(cache, ctx.slot_ids, catch_up.int())
        drafts = [after_pending.argmax(-1)]
        nothing = torch.zeros_like(ctx.slot_ids)
        for _ in range(1, n):
            logits = model.decode(cache, ctx.slot_ids, torch.stack(drafts, 1))
            model.commit(cache, ctx.slot_ids, nothing)
            drafts.append(logits[:, -1].argmax(-1))
        return torch.stack(drafts, 1)


@dataclasses.dataclass
class GenerateResult:
    """``tokens[i]``: the new tokens of prompt i; ``accepted``: int32 [steps, B] tokens each
    row committed per step (0 once the row is done); ``steps``: verify steps run; ``window``:
    T."""

    tokens: list[list[int]]
    accepted: torch.Tensor
    steps: int
    window: int

    def accepted_counts(self) -> list[int]:
        """How many row-steps accepted 1, 2, ..., T tokens (finished rows left out)."""
        a = self.accepted[self.accepted > 0].long()
        return torch.bincount(a, minlength=self.window + 1)[1:].tolist()


class SpeculativeDecoder:
    """Greedy speculative decoding of ``model`` over ``cache`` with windows of ``window``
    tokens (the pending token and window - 1 drafts from ``drafter``; module doc).
    ``history``: the token streams to read and write (int64 [capacity + 1, max_seq_len] on the
    cache's device), such as an :class:`~replayssm.models.engine.Engine`'s; default: new ones."""

    def __init__(self, model: HybridModel, cache: ServingCache, drafter: Drafter | None,
                 window: int, history: torch.Tensor | None = None) -> None:
        if window < 1:
            raise ValueError(f"a window holds T >= 1 tokens, got T = {window}")
        if window > cache.max_window:
            raise ValueError(f"a window of {window} tokens exceeds the cache's max_spec_tokens "
                             f"({cache.max_spec_tokens})")
        if drafter is None and window > 1:
            raise ValueError("a window of more than one token needs a drafter")
        shape = (cache.capacity + 1, cache.max_seq_len)
        if history is not None and (tuple(history.shape) != shape
                                    or history.dtype != torch.int64
                                    or history.device != cache.device):
            raise ValueError(f"history must be int64 {list(shape)} on {cache.device}, got "
                             f"{history.dtype} {list(history.shape)} on {history.device}")
        self.model, self.cache, self.drafter, self.window = model, cache, drafter, window
        self.history = torch.zeros(shape, dtype=torch.int64, device=cache.device) \
            if history is None else history
        self._offsets = torch.arange(1, window + 1, device=cache.device)
        if drafter is not None:
            drafter.check(self)

    @torch.no_grad()
    def admit(self, prompt: torch.Tensor) -> int:
        """Allocates a slot, prefills ``prompt`` (int64 [n]) and sets its pending token."""
        if prompt.dim() != 1 or not 0 < prompt.numel() <= self.cache.max_seq_len - self.window:
            raise ValueError(f"a prompt is int64 [n] with 0 < n <= max_seq_len - window "
                             f"({self.cache.max_seq_len} - {self.window}), got "
                             f"{tuple(prompt.shape)}")
        prompt = prompt.to(self.cache.device)
        slot = self.cache.allocate()
        try:
            logits = self.model.prefill(self.cache, slot, prompt)
            if self.drafter is not None:
                self.drafter.admit(slot, prompt)
        except BaseException:
            self.cache.free(slot)
            raise
        n = prompt.numel()
        self.history[slot, :n] = prompt
        self.history[slot, n] = logits[-1].argmax()
        return slot

    def free(self, slot: int) -> None:
        if self.drafter is not None:
            self.drafter.free(slot)
        self.cache.free(slot)

    @torch.no_grad()
    def step(self, slot_ids: torch.Tensor, forced: torch.Tensor | None = None) -> torch.Tensor:
        """One speculative step for ``slot_ids`` (int32 [B], -1 = pad row); returns the tokens
        each row committed (int32 [B], 1..T; pad rows' value is meaningless). ``forced`` (int32
        [B], 1..T) overrides the accepted counts: a benchmark's fixed acceptance pattern (the
        tokens are then not the greedy ones). Capturable."""
        cache, history, T = self.cache, self.history, self.window
        rows = cache.rows(slot_ids)
        lengths = cache.lengths[rows].long()
        pending = history[rows, lengths]
        S = history.shape[1]
        if T > 1:
            drafts = self.drafter.propose(DraftContext(slot_ids, rows, lengths, history), T - 1)
            tokens = torch.cat([pending[:, None], drafts], 1)
        else:
            tokens = pending[:, None]
        # The argmax of the LM head's own logits: widening to float32 is exact (step_argmax).
        predicted = self.model.decode_logits(cache, slot_ids, tokens).argmax(-1)  # [B, T]
        if forced is None:
            hits = (tokens[:, 1:] == predicted[:, :-1]).int()
            accepted = (hits.cumprod(1).sum(1) + 1).int()
        else:
            accepted = forced
        # p_t at L + 1 + t: the accepted drafts' own values (they equal p), then the bonus token.
        history[rows[:, None], (lengths[:, None] + self._offsets).clamp(max=S - 1)] = predicted
        self.model.commit(cache, slot_ids, accepted)
        return accepted

    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                 cuda_graph: bool | None = None) -> GenerateResult:
        """Decodes ``max_new_tokens`` new tokens for each prompt, all as one batch (a row whose
        tokens are done turns into a pad row); frees the slots at the end."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        for p in prompts:
            if p.numel() + max_new_tokens + self.window > self.cache.max_seq_len:
                raise ValueError(f"{p.numel()} prompt + {max_new_tokens} new tokens + a window "
                                 f"of {self.window} exceed max_seq_len ({self.cache.max_seq_len})")
        slots: list[int] = []
        try:
            for p in prompts:
                slots.append(self.admit(p))
            runner = SpecRunner(self, len(slots), cuda_graph)
            starts = torch.tensor([p.numel() for p in prompts])
            live = list(slots)
            accepted = []
            while True:
                done = (self.cache.lengths[torch.tensor(slots, device=self.cache.device)].cpu()
                        - starts + 1) >= max_new_tokens
                live = [-1 if d else s for s, d in zip(slots, done.tolist())]
                if all(s < 0 for s in live):
                    break
                runner.set_slots(live)
                runner.run()
                accepted.append(torch.where(runner.slot_ids < 0, 0, runner.accepted).cpu())
            rows = torch.tensor(slots, device=self.cache.device)
            history = self.history[rows].cpu()
            tokens = [history[i, n:n + max_new_tokens].tolist()
                      for i, n in enumerate(starts.tolist())]
        finally:
            for s in slots:
                self.free(s)
        return GenerateResult(tokens, torch.stack(accepted) if accepted else
                              torch.zeros(0, len(slots), dtype=torch.int32), len(accepted),
                              self.window)


class SpecRunner(StepRunner):
    """One batch size's speculative step, as the engine's :class:`StepRunner` runs a plain one
    (static slot list, a CUDA graph captured on the first run from warm-up calls on pad rows,
    then replayed): ``accepted`` (int32 [batch]) holds each row's count after a run.
    ``forced``: a function returning the counts to force (a benchmark's pattern; it runs inside
    the captured step, so it must be capturable too). ``cuda_graph``: default on CUDA."""

    def __init__(self, decoder: SpeculativeDecoder, batch: int, cuda_graph: bool | None = None,
                 forced: Callable[[], torch.Tensor] | None = None, pool=None) -> None:
        super().__init__(decoder.model, decoder.cache, decoder.history, batch,
                         cuda_graph is not False, pool)
        self.decoder, self.forced = decoder, forced
        self.accepted = torch.zeros(batch, dtype=torch.int32, device=decoder.cache.device)

    def eager_step(self) -> None:
        forced = None if self.forced is None else self.forced()
        self.accepted.copy_(self.decoder.step(self.slot_ids, forced))

    def gained(self, rows: int) -> list[int]:
        """The last run's accepted counts of rows 0..rows-1: a copy to the host, which waits for
        the step (the engine needs them to know which requests finished)."""
        return self.accepted[:rows].tolist()
