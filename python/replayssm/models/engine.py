"""Continuous batching for a :class:`~replayssm.models.HybridModel`: requests arrive at any step
and finish at different steps, each in its own slot of a :class:`~replayssm.models.ServingCache`.

    engine = Engine(model, ServingCache(model, capacity=64, max_seq_len=4096, mode="replay-fp32"))
    request = engine.submit(prompt_tokens, max_new_tokens=128)
    while engine.pending:
        for done in engine.step():          # requests finished this step
            print(done.id, done.tokens)

A step admits waiting requests while slots are free (each prompt prefilled alone, eagerly: its
first new token is the argmax of the prompt's last logits), then decodes one token for every
active request at once: the active rows padded to a batch bucket (1, 2, 4, ..., 512 by default)
with pad rows (slot -1), ``model.step_argmax`` (the greedy token) on the device. On CUDA each
bucket's step is a CUDA graph, captured on its first use; on the CPU, plain calls.

Tokens stay on the device. The engine keeps every slot's token stream in ``history`` (int64
[capacity + 1, max_seq_len], the token at position p of a slot at ``history[slot, p]``): a step
reads each row's input at ``history[row, lengths[row]]`` and writes its output one position
later, so a step needs no token from the host and its only input is the bucket's slot list,
rewritten when the set of active requests changes. Requests run to ``max_new_tokens`` (a stop
token would need the tokens on the host every step); a finished request's tokens are copied to
the host once, when it finishes.

Batch independence. Within one bucket, every row's arithmetic is independent of the other rows:
the GEMMs run the same kernel (same M) and a row's dot products do not mix rows, attention and
the SSM ops read only their row's cache, pad rows read and write only the scratch row. So a
request gives the same tokens alone (padded) or among any other requests, and at any row
position, as long as the bucket is the same. Across buckets (a batch that grows from 4 to 5
rows moves to bucket 8) the GEMMs run with another M, for which cuBLAS (or the CPU's BLAS) may
choose another kernel with another summation order: logits may then differ in their last bits,
and a greedy choice between two near-tied logits can flip. An engine that needs bit-identical
outputs across batch sizes would pin one bucket (``buckets=(capacity,)``) at the cost of padding.

Speculative decoding. ``Engine(model, cache, drafter=NgramDrafter(), spec_tokens=T)`` (a cache
with ``max_spec_tokens >= T``) verifies a window of T tokens for every active request in each
step: its pending token and T - 1 drafts, in one ``model.decode`` (a
:class:`~replayssm.models.speculative.SpecRunner` per bucket, the drafter inside its CUDA graph;
speculative.py explains the window). A request gains its accepted count, 1 + the drafts that
match the model's greedy choices (1 to T tokens), and its tokens are those of plain greedy
decoding. The counts are copied to the host after each step (the step's one sync), to know
which requests finished. A request whose window runs past ``max_new_tokens`` keeps exactly
``max_new_tokens`` tokens; the cache has committed the surplus, past the request's end, which
is harmless: the slot is freed in the same step and a new request starts it afresh. The last
window writes its predictions up to T - 1 positions past a request's last token, so a request
needs ``prompt + max_new_tokens + T - 1 <= max_seq_len``. The drafter hears of each admitted
and finished request (``Drafter.admit`` / ``free``: a draft model prefills the prompt into the
same slot of its own cache). Greedy only: acceptance compares drafts with the argmax (sampling
would need rejection sampling against the drafter's probabilities). The verify's GEMMs run
with ``bucket * T`` rows, so between a speculative and a plain engine the across-buckets caveat
above holds: identical greedy tokens in the fp32 tests, a near-tie may flip in bf16.

Counters: ``steps`` (decode steps), ``row_steps`` (active requests summed over steps) and
``accepted_tokens`` (their accepted counts summed, a finishing request's surplus included);
``tokens_per_step`` (the mean accepted length, 1 for plain decoding) and
``mean_drafts_accepted`` (``tokens_per_step - 1``) derive from them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from .base import HybridModel, ServingCache
from .prefix_cache import PrefixCache

if TYPE_CHECKING:
    from .speculative import Drafter, SpeculativeDecoder

__all__ = ["DEFAULT_BUCKETS", "Engine", "Request", "StepRunner"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and how many tokens to generate; ``tokens`` holds them once ``done``."""

    id: int
    prompt: torch.Tensor            # int64 [n] on the host
    max_new_tokens: int
    slot: int | None = None         # while admitted
    generated: int = 0              # new tokens so far (the prefill's first one included)
    tokens: list[int] | None = None  # the new tokens, set when done
    # Engine.steps when submitted, and the index of the step() call that admitted / finished it
    # (plain decoding: a request admitted at step i with n new tokens finishes at step
    # i + n - 2, or i if n = 1; speculative steps may finish it sooner).
    submitted_step: int = 0
    admitted_step: int | None = None
    finished_step: int | None = None

    @property
    def done(self) -> bool:
        return self.tokens is not None


class StepRunner:
    """One batch bucket's decode step: the static slot list ``slot_ids`` (int32 [batch], -1 =
    pad row) is its only input; ``run()`` decodes one token for each row, reading it from
    ``history`` and writing the greedy next token back there (see the module's documentation).
    On CUDA with ``cuda_graph``, the step is captured once (first run) and replayed."""

    def __init__(self, model: HybridModel, cache: ServingCache, history: torch.Tensor,
                 batch: int, cuda_graph: bool, pool=None) -> None:
        self.model, self.cache, self.history, self.batch = model, cache, history, batch
        self.slot_ids = torch.full((batch,), -1, dtype=torch.int32, device=cache.device)
        self.use_graph = cuda_graph and cache.device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self._pool = pool

    def set_slots(self, slots: Sequence[int]) -> None:
        """Rows 0..len(slots)-1 decode these slots (-1 allowed), the rest are pad rows."""
        if len(slots) > self.batch:
            raise ValueError(f"{len(slots)} rows do not fit a batch of {self.batch}")
        host = torch.full((self.batch,), -1, dtype=torch.int32)
        host[:len(slots)] = torch.tensor(list(slots), dtype=torch.int32)
        self.slot_ids.copy_(host)

    @torch.no_grad()
    def eager_step(self) -> None:
        """The step as plain calls (what the graph captures)."""
        cache, history = self.cache, self.history
        rows = cache.rows(self.slot_ids)
        position = cache.lengths[rows].long()
        tokens = self.model.step_argmax(cache, self.slot_ids, history[rows, position])
        # Pad rows read and write the scratch row, whose length stays 0.
        history[rows, (position + 1).clamp_(max=history.shape[1] - 1)] = tokens

    def capture(self) -> None:
        """Captures the step (CUDA): warm-up calls on pad rows only (a side stream, as capture
        requires; nothing live is touched), then the capture, which runs nothing."""
        if not self.use_graph or self.graph is not None:
            return
        live = self.slot_ids.clone()
        self.slot_ids.fill_(-1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.eager_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.eager_step()
        self.graph = graph
        self.slot_ids.copy_(live)

    def run(self) -> None:
        if self.use_graph:
            if self.graph is None:
                self.capture()
            self.graph.replay()
        else:
            self.eager_step()

    def gained(self, rows: int) -> list[int]:
        """Tokens each of rows 0..rows-1 gained in the last run: one (known without a sync)."""
        return [1] * rows

    def release(self) -> None:
        """Drops the captured graph (its memory returns to the pool)."""
        self.graph = None


class Engine:
    """Continuous batching over ``cache``'s slots (see the module's documentation).

    ``buckets``: the batch sizes a step may run at (a step runs at the smallest one that holds
    its active rows); sizes past the cache's capacity are dropped and the first size that holds
    ``capacity`` rows is kept. ``cuda_graphs``: capture each bucket's step (default: on CUDA).
    ``drafter`` (a :class:`~replayssm.models.speculative.Drafter`) and ``spec_tokens`` (T, the
    verify window, 1 < T <= the cache's ``max_spec_tokens``): speculative decoding, greedy
    (module doc); without them (T = 1) plain decoding. ``prefix_cache``: a
    :class:`PrefixCache` of ``cache``; admitting a request then restores the longest cached
    block prefix of its prompt and prefills only the rest."""

    def __init__(self, model: HybridModel, cache: ServingCache,
                 buckets: Iterable[int] = DEFAULT_BUCKETS, cuda_graphs: bool | None = None,
                 drafter: "Drafter | None" = None, spec_tokens: int = 1,
                 prefix_cache: PrefixCache | None = None) -> None:
        if prefix_cache is not None and prefix_cache.cache is not cache:
            raise ValueError("prefix_cache must be a PrefixCache of this engine's cache")
        self.prefix_cache = prefix_cache
        sizes = sorted({int(b) for b in buckets})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {sizes}")
        if sizes[-1] < cache.capacity:
            sizes.append(cache.capacity)
        self.buckets = [b for b in sizes if b < cache.capacity] + \
            [next(b for b in sizes if b >= cache.capacity)]
        self.model, self.cache = model, cache
        self.cuda_graphs = cache.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.history = torch.zeros(cache.capacity + 1, cache.max_seq_len, dtype=torch.int64,
                                   device=cache.device)
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._runners: dict[int, StepRunner] = {}
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._runner: StepRunner | None = None  # the bucket the current rows are laid out in
        self._next_id = 0
        self.steps = 0  # decode steps run so far
        self.row_steps = self.accepted_tokens = 0  # module doc, "Counters"
        self.drafter, self.spec_tokens = drafter, spec_tokens
        self._decoder = self._speculative_decoder()

    @property
    def pending(self) -> int:
        """Requests not finished yet (waiting or active)."""
        return len(self._waiting) + len(self._active)

    @property
    def active(self) -> list[Request]:
        return list(self._active)

    @property
    def tokens_per_step(self) -> float:
        """Tokens an active request gained per step, on average (0 before any step)."""
        return self.accepted_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def mean_drafts_accepted(self) -> float:
        """Drafts accepted per active request and step, on average (0 before any step)."""
        return self.tokens_per_step - 1 if self.row_steps else 0.0

    def submit(self, prompt: Sequence[int] | torch.Tensor, max_new_tokens: int) -> Request:
        """Queues a request; it is admitted at the next step with a free slot."""
        prompt = torch.as_tensor(prompt).detach().to("cpu")
        if prompt.dim() != 1 or prompt.numel() == 0 or prompt.dtype.is_floating_point \
                or prompt.dtype == torch.bool:
            raise ValueError(f"a prompt must be a non-empty 1-D sequence of token ids, got "
                             f"{prompt.dtype} {tuple(prompt.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        drafts = self.spec_tokens - 1  # positions the last window writes past the end
        if prompt.numel() + max_new_tokens + drafts > self.cache.max_seq_len:
            raise ValueError(f"{prompt.numel()} prompt + {max_new_tokens} new tokens"
                             + (f" + {drafts} draft positions" if drafts else "")
                             + f" exceed the cache's max_seq_len ({self.cache.max_seq_len})")
        request = Request(self._next_id, prompt.long(), int(max_new_tokens),
                          submitted_step=self.steps)
        self._next_id += 1
        self._waiting.append(request)
        return request

    def step(self) -> list[Request]:
        """Admits what fits, decodes one token (speculative: a window, 1 to T tokens) for every
        active request; returns the requests that finished in this step (admitted ones with
        max_new_tokens 1 included)."""
        finished: list[Request] = []
        changed = False
        index = self.steps
        while self._waiting and self.cache.ssm.free_slots > 0:
            request = self._waiting.popleft()
            self._admit(request, index)
            changed = True
            if request.generated == request.max_new_tokens:
                finished.append(request)
            else:
                self._active.append(request)
        if self._active:
            if changed or self._runner is None:
                self._lay_out()
            self._runner.run()
            self.steps += 1
            gained = self._runner.gained(len(self._active))
            self.row_steps += len(gained)
            self.accepted_tokens += sum(gained)
            for request, n in zip(self._active, gained):
                # Tokens past max_new_tokens are dropped (module doc, "Speculative decoding").
                request.generated = min(request.generated + n, request.max_new_tokens)
            done = [r for r in self._active if r.generated == r.max_new_tokens]
            if done:
                self._active = [r for r in self._active if r.generated < r.max_new_tokens]
                finished.extend(done)
                self._runner = None  # the rows change: lay them out again next step
        self._finish(finished, index)
        return finished

    def run(self) -> list[Request]:
        """Steps until every submitted request is finished; returns them in finishing order."""
        finished: list[Request] = []
        while self.pending:
            if not self._active and self.cache.ssm.free_slots == 0:
                raise RuntimeError(f"{len(self._waiting)} requests wait and the cache has no "
                                   "free slot (its slots are held outside this engine)")
            finished.extend(self.step())
        return finished

    def runner(self, batch: int) -> StepRunner:
        """The step of the bucket ``batch`` (created on first use): a :class:`StepRunner`, or
        for a speculative engine a :class:`~replayssm.models.speculative.SpecRunner`."""
        if batch not in self._runners:
            if self._decoder is None:
                runner = StepRunner(self.model, self.cache, self.history, batch,
                                    self.cuda_graphs, self._pool)
            else:
                from .speculative import SpecRunner  # speculative.py imports this module
                runner = SpecRunner(self._decoder, batch, self.cuda_graphs, pool=self._pool)
            self._runners[batch] = runner
        return self._runners[batch]

    # ---- internals ----------------------------------------------------------------------------

    def _admit(self, request: Request, index: int) -> None:
        slot = self.cache.allocate()
        n = request.prompt.numel()
        prompt = request.prompt.to(self.cache.device)
        if self.prefix_cache is None:
            logits = self.model.prefill(self.cache, slot, prompt)
        else:  # restores the longest cached block prefix, prefills the rest
            logits = self.prefix_cache.prefill(self.model, slot, prompt)
        self.history[slot, :n] = prompt
        self.history[slot, n] = logits[-1].argmax()
        if self.drafter is not None:
            self.drafter.admit(slot, prompt)
        request.slot, request.generated, request.admitted_step = slot, 1, index

    def _speculative_decoder(self) -> "SpeculativeDecoder | None":
        """The speculative step over this engine's history (None: plain decoding); refuses a
        drafter without drafts to make (the decoder refuses the other bad arguments)."""
        if self.spec_tokens == 1:
            if self.drafter is not None:
                raise ValueError("a drafter needs a window of spec_tokens > 1 tokens, got 1")
            return None
        from .speculative import SpeculativeDecoder  # speculative.py imports this module
        return SpeculativeDecoder(self.model, self.cache, self.drafter, self.spec_tokens,
                                  history=self.history)

    def _lay_out(self) -> None:
        """The active requests' slots as rows 0..n-1 of the smallest bucket holding them."""
        n = len(self._active)
        batch = next(b for b in self.buckets if b >= n)
        runner = self.runner(batch)
        runner.set_slots([r.slot for r in self._active])
        self._runner = runner

    def _finish(self, finished: list[Request], index: int) -> None:
        if not finished:
            return
        # One copy for all of this step's finished requests.
        rows = torch.tensor([r.slot for r in finished], device=self.cache.device)
        tokens = self.history[rows].cpu()
        for i, request in enumerate(finished):
            n = request.prompt.numel()
            request.tokens = tokens[i, n:n + request.max_new_tokens].tolist()
            request.finished_step = index
            if self.drafter is not None:
                self.drafter.free(request.slot)
            self.cache.free(request.slot)
            request.slot = None
