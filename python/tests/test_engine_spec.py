"""Speculative decoding inside the engine (Engine(..., drafter, spec_tokens)) on tiny fp32
models of both families: under continuous batching (requests arriving while others run, waiting
for a slot, finishing at different steps, max_new_tokens 1 and values that end inside a window)
every request gets exactly the plain engine's tokens, in replay-fp32 (replay verify) and
eager-fp32 (per-draft state copies), with the n-gram drafter, a draft model and the target as
its own draft model; the counters; refusals. CUDA: the same with each bucket's speculative step
captured in a CUDA graph."""

import pytest

torch = pytest.importorskip("torch")

from replayssm.models import ServingCache  # noqa: E402
from replayssm.models.engine import Engine  # noqa: E402
from replayssm.models.prefix_cache import PrefixCache  # noqa: E402
from replayssm.models.speculative import DraftModelDrafter, NgramDrafter  # noqa: E402

from models_util import one_cpu_thread  # noqa: E402,F401  (autouse)
from models_util import perturbed, tiny  # noqa: E402

T = 4
MAX_SEQ = 80
CAPACITY = 3
BUCKETS = (1, 2, 4)  # capacity 3 runs in buckets 1, 2 and 4 as the active set changes
FAMILIES = ["nemotron_h", "qwen3_5"]
# Replay folds every 4 tokens: folds land inside windows, at other offsets in each row.
MODES = ["replay-fp32:4", "eager-fp32"]
DRAFTERS = ["ngram", "draft-model", "self"]


def echoes(model, starts, n=12):
    """Prompts ``x + g + x``, g the model's greedy continuation of x: the model then partly
    repeats g, which the n-gram drafter finds in the prompt (random prompts or repeated motifs
    get few drafts accepted: a random model does not copy)."""
    engine = Engine(model, ServingCache(model, len(starts), MAX_SEQ, "eager-fp32"),
                    buckets=(len(starts),))
    requests = [engine.submit(x, n) for x in starts]
    engine.run()
    return [torch.cat([x, torch.tensor(r.tokens), x]) for x, r in zip(starts, requests)]


def schedule(model, device="cpu"):
    """(the step() call before which it is submitted, prompt, max_new_tokens): seven requests
    for three slots; the fourth waits for the slot of the second, which finishes on admission
    (max_new_tokens 1). Full windows of 4 tokens take a request to 1, 5, 9, ... tokens, so 2,
    7, 11, 24 and 30 end inside a window, 5 on a window's last token. Three prompts are echoes,
    for the n-gram drafter."""
    g = torch.Generator().manual_seed(11)

    def noise(n):
        return torch.randint(0, model.config.vocab_size, (n,), generator=g)

    e = echoes(model, [noise(5), noise(3), noise(8)])
    plan = [(0, e[0], 30), (0, noise(5), 1), (0, noise(13), 7), (0, e[1], 11),
            (2, noise(4), 2), (5, e[2], 24), (9, noise(6), 5)]
    return [(at, p.to(device), n) for at, p, n in plan]


def serve(engine, plan):
    """Submits each request of ``plan`` before its step() call, steps until all are done;
    returns the requests in ``plan``'s order."""
    requests, calls = [None] * len(plan), 0
    while engine.pending or calls <= max(at for at, _, _ in plan):
        for i, (at, p, n) in enumerate(plan):
            if at == calls:
                requests[i] = engine.submit(p, n)
        engine.step()
        calls += 1
    return requests


def make_drafter(kind, family, model, mode):
    if kind == "ngram":
        return NgramDrafter()
    draft = model if kind == "self" else perturbed(family, model)
    return DraftModelDrafter(draft, ServingCache(draft, CAPACITY, MAX_SEQ, mode,
                                                 max_spec_tokens=T))


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request):
    torch.set_num_threads(1)  # as one_cpu_thread, which a module fixture runs before
    model = tiny(request.param)
    return request.param, model, schedule(model)


@pytest.fixture(scope="module")
def plain(family_case):
    """The plain engine's requests per mode (one-token steps, a cache without windows)."""
    family, model, plan = family_case
    out = {}
    for mode in MODES:
        engine = Engine(model, ServingCache(model, CAPACITY, MAX_SEQ, mode), buckets=BUCKETS)
        out[mode] = serve(engine, plan)
        # One step per token after the prefill's.
        assert engine.row_steps == engine.accepted_tokens == sum(n - 1 for _, _, n in plan)
        assert engine.tokens_per_step == 1 and engine.mean_drafts_accepted == 0
    return out


@pytest.mark.parametrize("drafter_kind", DRAFTERS)
@pytest.mark.parametrize("mode", MODES)
def test_speculative_engine_gives_the_plain_tokens(family_case, plain, mode, drafter_kind):
    family, model, plan = family_case
    drafter = make_drafter(drafter_kind, family, model, mode)
    cache = ServingCache(model, CAPACITY, MAX_SEQ, mode, max_spec_tokens=T)
    engine = Engine(model, cache, buckets=BUCKETS, drafter=drafter, spec_tokens=T)
    requests = serve(engine, plan)
    reference = plain[mode]
    for r, ref, (_, _, n) in zip(requests, reference, plan):
        assert len(r.tokens) == n
        assert r.tokens == ref.tokens, r.id
    # Continuous batching: arrivals and finishes at several steps, a wait for a slot, and
    # every bucket used.
    assert len({r.admitted_step for r in requests}) > 2
    assert len({r.finished_step for r in requests}) > 2
    assert any(r.admitted_step > r.submitted_step for r in requests)
    assert sorted(engine._runners) == [1, 2, 4]
    assert cache.ssm.free_slots == CAPACITY and int(cache.lengths.sum()) == 0
    if drafter_kind != "ngram":
        assert drafter.cache.ssm.free_slots == CAPACITY  # the engine freed the draft's slots

    # Speculation took place: drafts were accepted.
    assert engine.mean_drafts_accepted > 0
    # Tokens the steps produced beyond each request's max_new_tokens - 1 (the first one comes
    # from the prefill): the surplus of windows that ran past a request's end, dropped.
    surplus = engine.accepted_tokens - sum(n - 1 for _, _, n in plan)
    assert surplus >= 0
    if drafter_kind == "self":
        # A draft model equal to the target proposes the target's tokens: every window is
        # accepted whole, a request of n tokens takes ceil((n - 1) / T) steps, and those of
        # 2, 7, 11, 24 and 30 tokens end inside a window (schedule).
        assert engine.row_steps == sum(-(-(n - 1) // T) for _, _, n in plan)
        assert engine.tokens_per_step == T and engine.mean_drafts_accepted == T - 1
        assert surplus == sum((1 - n) % T for _, _, n in plan) > 0
    if drafter_kind == "draft-model":
        assert surplus > 0


@pytest.mark.parametrize("mode", MODES)
def test_speculative_engine_with_a_prefix_cache_gives_the_plain_tokens(family_case, plain, mode):
    """Both engine options at once: the schedule served twice by one speculative engine with a
    prefix cache (the second pass's prompts hit the blocks the first stored) gives the plain
    engine's tokens both times."""
    family, model, plan = family_case
    cache = ServingCache(model, CAPACITY, MAX_SEQ, mode, max_spec_tokens=T)
    prefix = PrefixCache(cache, block=4)
    engine = Engine(model, cache, buckets=BUCKETS, drafter=NgramDrafter(), spec_tokens=T,
                    prefix_cache=prefix)
    first = serve(engine, plan)
    hits_before = prefix.stats()["hit_tokens"]
    second = serve(engine, plan)
    assert prefix.stats()["hit_tokens"] > hits_before  # the second pass restored prefixes
    for requests in (first, second):
        for r, ref in zip(requests, plain[mode]):
            assert r.tokens == ref.tokens, r.id
    assert engine.mean_drafts_accepted > 0


def test_the_last_window_needs_room_in_the_cache():
    """A request needs prompt + max_new_tokens + T - 1 positions: the last window writes its
    predictions up to T - 1 positions past the last token. One more is refused, and nothing
    changes; the largest request that fits gets the plain tokens, its last window (every window
    accepted whole: the target drafts for itself) writing up to the cache's last position."""
    model = tiny("nemotron_h")
    S, n = 32, 11
    # 18 new tokens: full windows give 1, 5, 9, 13, 17, then the last window starts at position
    # n + 16 = n + largest - 2 and writes its predictions up to n + 16 + T = S - 1.
    largest = S - n - (T - 1)
    prompt = torch.arange(n)
    drafter = DraftModelDrafter(model, ServingCache(model, 2, S, "replay-fp32",
                                                    max_spec_tokens=T))
    cache = ServingCache(model, 2, S, "replay-fp32", max_spec_tokens=T)
    engine = Engine(model, cache, drafter=drafter, spec_tokens=T)
    with pytest.raises(ValueError, match=r"\+ 3 draft positions exceed the cache's max_seq_len"):
        engine.submit(prompt, largest + 1)
    assert engine.pending == 0 and cache.ssm.free_slots == 2
    request = engine.submit(prompt, largest)
    engine.run()
    assert engine.tokens_per_step == T
    plain = Engine(model, ServingCache(model, 2, S, "replay-fp32"))
    reference = plain.submit(prompt, S - n)  # a plain engine needs no room past the end
    plain.run()
    assert request.tokens == reference.tokens[:largest]


@pytest.mark.parametrize("kwargs, message", [
    (dict(drafter="ngram", spec_tokens=0), r"T >= 1 tokens, got T = 0"),
    (dict(spec_tokens=0), r"T >= 1 tokens, got T = 0"),
    (dict(drafter="ngram", spec_tokens=T + 1), r"exceeds the cache's max_spec_tokens \(4\)"),
    (dict(drafter="ngram", spec_tokens=1), r"drafter needs a window of spec_tokens > 1"),
    (dict(drafter="ngram"), r"drafter needs a window of spec_tokens > 1"),
    (dict(spec_tokens=2), r"needs a drafter"),
    (dict(drafter="small-draft-cache", spec_tokens=T), r"capacity \(2\) must equal"),
    (dict(drafter="short-draft-window", spec_tokens=T), r"needs max_spec_tokens >= 4"),
])
def test_bad_arguments_are_refused(kwargs, message):
    model = tiny("nemotron_h")
    cache = ServingCache(model, 3, 32, "replay-fp32", max_spec_tokens=T)
    drafter = {
        "ngram": NgramDrafter(),
        "small-draft-cache": DraftModelDrafter(model, ServingCache(model, 2, 32, "replay-fp32",
                                                                   max_spec_tokens=T)),
        "short-draft-window": DraftModelDrafter(model, ServingCache(model, 3, 32, "replay-fp32",
                                                                    max_spec_tokens=2)),
    }.get(kwargs.pop("drafter", None))
    with pytest.raises(ValueError, match=message):
        Engine(model, cache, drafter=drafter, **kwargs)
    assert cache.ssm.free_slots == 3 and int(cache.lengths.sum()) == 0


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family, mode", [(f, m) for f in FAMILIES for m in MODES])
def test_cuda_graph_speculative_engine_gives_the_plain_tokens(family, mode):
    """fp32 on the GPU: each bucket's speculative step (drafter included) a CUDA graph, against
    the plain engine there (its steps graphs too)."""
    model = tiny(family, "cuda")
    plan = schedule(model, "cuda")
    engine = Engine(model, ServingCache(model, CAPACITY, MAX_SEQ, mode), buckets=BUCKETS)
    reference = [r.tokens for r in serve(engine, plan)]
    for kind in DRAFTERS:
        drafter = make_drafter(kind, family, model, mode)
        cache = ServingCache(model, CAPACITY, MAX_SEQ, mode, max_spec_tokens=T)
        engine = Engine(model, cache, buckets=BUCKETS, drafter=drafter, spec_tokens=T)
        assert [r.tokens for r in serve(engine, plan)] == reference, kind
        assert all(r.graph is not None for r in engine._runners.values())
        assert engine.mean_drafts_accepted > 0, kind
