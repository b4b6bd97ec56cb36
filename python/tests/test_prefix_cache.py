"""Prefix caching with whole models (replayssm.models.prefix_cache), both families on tiny
configs: a prefill that continues a slot equals one prefill of the whole sequence (logits and
the decode steps after it, every state mode); the block states a prefill keeps equal the states
of prefills that end there; an engine with a prefix cache gives exactly the tokens of one
without, with the hits it should have; LRU eviction under a byte budget; forked sequences
(ServingCache.fork, with and without shared checkpoints) decode as their own prefills; bad input
refused with nothing changed. CPU tests run fp32 activations; the `cuda` ones the same on the GPU."""

import pytest

torch = pytest.importorskip("torch")

import models_util as mu  # noqa: E402
from models_util import one_cpu_thread  # noqa: E402,F401  (autouse fixture)
from replayssm.models import ServingCache  # noqa: E402
from replayssm.models import nemotron_h, qwen3_5  # noqa: E402
from replayssm.models.engine import Engine  # noqa: E402
from replayssm.models.prefix_cache import PrefixCache  # noqa: E402

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU = [pytest.param("cpu", id="cpu")]
CUDA = [pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, _no_cuda])]

FAMILIES = ["nemotron", "qwen"]
#: Each family's vocabulary and the block the engine tests use (Nemotron's tiny scan chunk is 8,
#: the GDN scan's 64: a block of 16 makes the GDN prefill chunk 16 where the reference's is 64).
VOCAB = {"nemotron": 128, "qwen": 96}
BLOCK = {"nemotron": 8, "qwen": 16}

#: Continuing prefill against one prefill, relative logits error (max |d| / max |ref|), fp32
#: activations on the CPU. Measured: with an fp32 state (or fp32 master) 6.3e-7 (Nemotron) and
#: 1.0e-5 (Qwen: the GDN scan's chunks end at the split points instead of every 64 tokens) at
#: prefill, at most 2.7e-6 over the decode steps after it (fp32+bf16: its bf16 copy, rounded
#: from masters that differ in their last bits); a bf16 state or checkpoint, which the slot
#: holds rounded at each split, 2.5e-4 at prefill and 4.1e-4 decoding. Bounds 4-5x that; a
#: continuation that lost the state, the conv window or the earlier keys is off by O(1).
FP32_STATE = {"eager-fp32", "replay-fp32", "replay-fp32+bf16", "replay-fp32+fp8"}
TOL_FP32_STATE = 5e-5
TOL_BF16_STATE = 2e-3


def tolerance(mode):
    return TOL_FP32_STATE if mode.split(":")[0] in FP32_STATE else TOL_BF16_STATE


MODES = ["eager-fp32", "eager-bf16", "replay-fp32:4", "replay-bf16:4", "replay-fp32+bf16:4",
         "replay-fp32+fp8:4"]


def tiny_model(family, device="cpu"):
    if family == "nemotron":
        return nemotron_h.NemotronHModel.random(nemotron_h.NemotronHConfig.tiny(), seed=1,
                                                device=device)
    return qwen3_5.Qwen35Model.random(qwen3_5.tiny_config(), seed=1, device=device)


@pytest.fixture(scope="module")
def models():
    return {f: tiny_model(f) for f in FAMILIES}


def tokens(family, seed, n):
    return torch.randint(0, VOCAB[family], (n,), generator=torch.Generator().manual_seed(seed))


def ids(slot, device="cpu"):
    return torch.tensor([slot], dtype=torch.int32, device=device)


# ---- prefill that continues a slot ------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_in_pieces_equals_one_prefill_and_decodes_on_alike(models, family, mode):
    """Pieces that split inside chunks and conv windows (2 tokens, fewer than kernel - 1 = 3,
    so the next piece's conv reads before position 0; then 14; then the rest), then 8 greedy
    steps on both slots (buffer length 4: folds)."""
    model = models[family]
    prompt = tokens(family, 0, 70)
    whole, pieces = (ServingCache(model, 2, 128, mode) for _ in range(2))
    a, b = whole.allocate(), pieces.allocate()
    ref = model.prefill(whole, a, prompt)
    cuts = [0, 2, 16, 70]
    got = torch.cat([model.prefill(pieces, b, prompt[s:e], start=s)
                     for s, e in zip(cuts, cuts[1:])])
    assert int(pieces.lengths[b]) == 70
    tol = tolerance(mode)
    assert mu.rel_err(got, ref) <= tol
    token = ref[-1].argmax()[None]
    for _ in range(8):
        ref_step = model.step(whole, ids(a), token)
        assert mu.rel_err(model.step(pieces, ids(b), token), ref_step) <= tol
        token = ref_step.argmax(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_continues_after_decode_steps(models, family):
    """A chat turn: prompt, 5 decode steps, then the next message prefilled from the slot's
    length, against one prefill of everything (eager fp32: the decode op's rounding only).
    Nemotron's prefill clamps dt at time_step_min where its decode does not (as transformers):
    a floor of 1e-9 never binds, so both compute the same recurrence."""
    model = models[family]
    if family == "nemotron":
        model = nemotron_h.NemotronHModel.random(
            nemotron_h.NemotronHConfig.tiny(time_step_min=1e-9), seed=1)
    first, second = tokens(family, 1, 11), tokens(family, 2, 9)
    turn, whole = (ServingCache(model, 1, 64, "eager-fp32") for _ in range(2))
    slot = turn.allocate()
    token = model.prefill(turn, slot, first)[-1].argmax()[None]
    generated = []
    for _ in range(5):
        generated.append(token)
        token = model.step(turn, ids(slot), token).argmax(-1)
    history = torch.cat([first, *generated])
    got = model.prefill(turn, slot, second, start=history.numel())
    ref = model.prefill(whole, whole.allocate(), torch.cat([history, second]))
    assert mu.rel_err(got, ref[history.numel():]) <= TOL_FP32_STATE


@pytest.mark.parametrize("restore_refused", [False, True], ids=["restore", "restore-refused"])
@pytest.mark.parametrize("mode", ["eager-fp32", "replay-fp32+bf16:4", "replay-bf16:4"])
def test_the_hand_off_loads_every_layer_at_once_where_the_cache_can(models, mode,
                                                                     restore_refused,
                                                                     monkeypatch):
    """A prefill ends by loading every SSM layer's state into the slot: a replay cache in one
    restore (device kernels on CUDA, not a host round trip per layer), an eager cache, or a
    replay cache whose restore refuses the state shape (NotImplementedError, as a CUDA cache
    does past 128 columns), by load_state per layer. A prompt, 5 decode steps (buffer length 4:
    a fold, a token in the ring), a continuing prefill, 4 more steps, against a cache whose
    hand-off is load_state per layer: the same logits bit for bit and the same state-cache
    buffers after the prefill (cursors included: committed kept, every layer folded there)."""
    model = models["nemotron"]
    first, second = tokens("nemotron", 60, 11), tokens("nemotron", 61, 9)
    cache, ref = ServingCache(model, 1, 64, mode), ServingCache(model, 1, 64, mode)
    monkeypatch.setattr(ref, "ssm_hand_off", lambda ctx: [
        ref.ssm.load_state(layer, ctx.slot, ctx.final_states[layer])
        for layer in range(ref.layout.num_ssm_layers)])
    calls = []

    def refuse(*args, **kwargs):
        raise NotImplementedError("restore on this device takes narrower states")

    for name in ("load_state", "restore"):
        real = refuse if name == "restore" and restore_refused else getattr(cache.ssm, name)
        monkeypatch.setattr(cache.ssm, name, lambda *a, _n=name, _f=real, **k: (
            calls.append(_n), _f(*a, **k)))

    def run(c):
        slot = c.allocate()
        out = [model.prefill(c, slot, first)]
        token = out[0][-1].argmax()[None]
        for _ in range(5):
            out.append(model.step(c, ids(slot), token))
            token = out[-1].argmax(-1)
        calls.clear()
        out.append(model.prefill(c, slot, second, start=first.numel() + 5))
        buffers = {k: v.clone() for k, v in c.ssm.buffers.items()}
        token = out[-1][-1].argmax()[None]
        for _ in range(4):
            out.append(model.step(c, ids(slot), token))
            token = out[-1].argmax(-1)
        return out, buffers

    got, got_buffers = run(cache)
    layers = cache.layout.num_ssm_layers
    loads = ["load_state"] * layers
    assert calls == (loads if cache.mode.eager else
                     ["restore"] + loads if restore_refused else ["restore"])
    want, want_buffers = run(ref)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got_buffers.keys() == want_buffers.keys()
    for name in got_buffers:
        assert torch.equal(got_buffers[name], want_buffers[name]), name
    if not cache.mode.eager:
        assert got_buffers["folded"][:, 0].tolist() == [int(got_buffers["committed"][0])] * layers


# ---- block states from prefill ----------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_block_states_are_the_states_of_prefills_ending_there(models, family):
    """prefill_blocks from position 16 (a continuing prefill) keeps, at 24, 32, 40 (block 8),
    each SSM layer's state and conv window: those of a whole prefill of the first p tokens
    (its exported fp32 state; its ring's last kernel - 1 rows, which differ only by the input
    projection's GEMM run over other row counts)."""
    model = models[family]
    prompt = tokens(family, 3, 45)
    cache = ServingCache(model, 2, 64, "eager-fp32")
    slot = cache.allocate()
    model.prefill(cache, slot, prompt[:16])
    _, ctx = model.prefill_blocks(cache, slot, prompt[16:], block=8, start=16)
    assert list(ctx.boundaries) == [24, 32, 40]
    K = cache.layout.conv_kernel
    for j, p in enumerate(ctx.boundaries):
        ref = ServingCache(model, 1, 64, "eager-fp32")
        s = ref.allocate()
        model.prefill(ref, s, prompt[:p])
        rows = torch.arange(p - K + 1, p) % ref.conv_ring
        for layer in range(cache.layout.num_ssm_layers):
            assert mu.rel_err(ctx.states[layer][j], ref.ssm.export_state(layer, s)) <= 1e-5
            assert mu.rel_err(ctx.conv_windows[layer][j], ref.conv[layer, s, rows]) <= 1e-6


def test_scan_from_a_state_keeps_the_states_at_its_chunk_ends():
    """ssd_chunk_scan from a non-zero state with every = 8 (chunks of 4, 19 tokens): the
    outputs and the states after 8 and 16 tokens against the token-by-token recurrence."""
    g = torch.Generator().manual_seed(0)
    n, H, P, G, N = 19, 4, 3, 2, 5
    x = torch.randn(n, H, P, generator=g)
    dt = torch.rand(n, H, generator=g) * 0.5
    A = -torch.rand(H, generator=g) - 0.5
    B, C = torch.randn(n, G, N, generator=g), torch.randn(n, G, N, generator=g)
    S = torch.randn(H, P, N, generator=g)
    kept = []
    y, final = nemotron_h.ssd_chunk_scan(x, dt, A, B, C, 4, S, every=8, kept=kept)
    ref_states, ref_y = [], []
    for t in range(n):
        Bt, Ct = (m[t].repeat_interleave(H // G, 0) for m in (B, C))
        S = torch.exp(dt[t] * A)[:, None, None] * S + \
            dt[t][:, None, None] * x[t][:, :, None] * Bt[:, None, :]
        ref_y.append(torch.einsum("hpn,hn->hp", S, Ct))
        ref_states.append(S)
    assert mu.rel_err(y, torch.stack(ref_y)) <= 1e-5
    assert mu.rel_err(final, ref_states[-1]) <= 1e-5
    assert len(kept) == 2
    for got, t in zip(kept, (7, 15)):
        assert mu.rel_err(got, ref_states[t]) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_hit_continues_like_one_prefill(models, family, mode):
    """A prompt whose first 32 tokens (4 blocks of 8) another prompt stored: restored, the rest
    prefilled. Its logits and 6 decode steps after it against a whole prefill in a cache
    without prefix caching, at the tolerances of a continuing prefill."""
    model = models[family]
    shared = tokens(family, 40, 32)
    first = torch.cat([shared, tokens(family, 41, 11)])
    second = torch.cat([shared, tokens(family, 42, 7)])
    cache, whole = ServingCache(model, 2, 64, mode), ServingCache(model, 1, 64, mode)
    prefix = PrefixCache(cache, block=8)
    prefix.prefill(model, cache.allocate(), first)
    slot, ref_slot = cache.allocate(), whole.allocate()
    got = prefix.prefill(model, slot, second)
    assert prefix.hit_tokens == 32 and int(cache.lengths[slot]) == second.numel()
    ref = model.prefill(whole, ref_slot, second)
    tol = tolerance(mode)
    assert mu.rel_err(got, ref[32:]) <= tol
    token = ref[-1].argmax()[None]
    for _ in range(6):
        ref_step = model.step(whole, ids(ref_slot), token)
        assert mu.rel_err(model.step(cache, ids(slot), token), ref_step) <= tol
        token = ref_step.argmax(-1)


@pytest.mark.parametrize("mode", ["eager-bf16", "replay-bf16:4", "replay-fp32+bf16:4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_hit_scans_from_the_entry_and_never_reads_the_slot_state(models, family, mode,
                                                                      monkeypatch):
    """A hit's scans start from the entry's fp32 states (start_states): the slot's SSM state is
    not read back (export_state, a host round trip per layer on CUDA) and is written only by the
    prefill's hand-off (load_state or restore, as the mode takes it); the entry is left as it
    was. So even with a bf16 state or checkpoint the hit's logits are those of one prefill at
    the fp32-state tolerance (a restore through the bf16 slot state was off by about 2e-4)."""
    model = models[family]
    shared = tokens(family, 40, 32)
    cache, whole = ServingCache(model, 2, 64, mode), ServingCache(model, 1, 64, mode)
    prefix = PrefixCache(cache, block=8)
    prefix.prefill(model, cache.allocate(), torch.cat([shared, tokens(family, 41, 11)]))
    second = torch.cat([shared, tokens(family, 42, 7)])
    slot = cache.allocate()
    writes, handing_off = [], []

    def refused(*args, **kwargs):
        raise AssertionError("a hit read the slot's SSM state back")

    def recorded(name, fn):
        return lambda *a, **k: (writes.append((name, bool(handing_off))), fn(*a, **k))

    hand_off = cache.ssm_hand_off
    monkeypatch.setattr(cache.ssm, "export_state", refused)
    for name in ("load_state", "restore"):
        monkeypatch.setattr(cache.ssm, name, recorded(name, getattr(cache.ssm, name)))
    monkeypatch.setattr(cache, "ssm_hand_off",
                        lambda ctx: (handing_off.append(1), hand_off(ctx), handing_off.clear()))
    entry = prefix._entries[prefix.keys(second)[3]].ssm
    kept = entry.clone()
    got = prefix.prefill(model, slot, second)
    assert prefix.hit_tokens == 32
    assert writes and all(in_hand_off for _, in_hand_off in writes)
    assert torch.equal(entry, kept)  # the scans read the entry's states, never write them
    ref = model.prefill(whole, whole.allocate(), second)
    assert mu.rel_err(got, ref[32:]) <= TOL_FP32_STATE


def test_start_states_of_the_wrong_shape_are_refused_with_nothing_changed(models):
    model = models["nemotron"]
    cache = ServingCache(model, 1, 64, "replay-fp32:4")
    slot = cache.allocate()
    model.prefill(cache, slot, tokens("nemotron", 50, 16))
    layers, shape = cache.layout.num_ssm_layers, cache.ssm.config.state_shape
    before = [t.clone() for t in (cache.lengths, cache.conv, cache.k, cache.v)]
    rest = tokens("nemotron", 51, 8)
    for bad, start in ((torch.zeros(layers + 1, *shape), 16),
                       (torch.zeros(layers, *shape, dtype=torch.float64), 16),
                       (torch.zeros(layers, *shape), 0)):
        with pytest.raises(ValueError, match="start_states are float32"):
            model.prefill_blocks(cache, slot, rest, 8, start=start, start_states=bad)
    after = (cache.lengths, cache.conv, cache.k, cache.v)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# ---- the engine -------------------------------------------------------------------------------

def shared_prompts(family):
    """(arrival step, prompt) of requests sharing prefixes of different lengths: a 60-token
    base, prompts taking 48, 20, 17 and all of its tokens, one equal to an earlier prompt, one
    that is exactly 48 (= whole blocks) and one with nothing shared."""
    base = tokens(family, 10, 60)
    tail = [tokens(family, 11 + i, k) for i, k in enumerate((5, 9, 3, 7, 4))]
    return [(0, torch.cat([base[:48], tail[0]])), (0, torch.cat([base[:20], tail[1]])),
            (2, base[:48].clone()), (3, torch.cat([base, tail[2]])), (5, base[:17].clone()),
            (6, tail[3]), (9, torch.cat([base[:48], tail[0]])), (9, torch.cat([base[:20],
                                                                                 tail[4]]))]


def expected_hit_tokens(prompts, block):
    """The tokens a prefix cache with room for everything restores, prompt by prompt in
    admission (= arrival) order: the longest run of whole blocks, at most n - 1 tokens, that
    an earlier prompt had whole."""
    seen, hits = set(), []
    for _, p in prompts:
        t = tuple(p.tolist())
        m = 0
        while (m + 1) * block <= len(t) - 1 and t[:(m + 1) * block] in seen:
            m += 1
        hits.append(m * block)
        seen.update(t[:i * block] for i in range(1, len(t) // block + 1))
    return hits


def run_engine(model, mode, prompts, prefix_cache=None, capacity=3, max_new=12, device="cpu",
               cache=None):
    cache = cache or ServingCache(model, capacity, 128, mode)
    engine = Engine(model, cache, buckets=(4,), prefix_cache=prefix_cache)
    pending, requests, step = list(prompts), [], 0
    while pending or engine.pending:
        while pending and pending[0][0] <= step:
            requests.append(engine.submit(pending.pop(0)[1].to(device), max_new))
        engine.step()
        step += 1
        if prefix_cache is not None:
            assert prefix_cache.nbytes <= prefix_cache.budget_bytes
    return [r.tokens for r in requests]


@pytest.mark.parametrize("device", CPU + CUDA)
@pytest.mark.parametrize("mode", ["eager-fp32", "replay-fp32:4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_with_a_prefix_cache_gives_the_tokens_of_one_without(family, mode, device):
    """Eight requests sharing prefixes, arriving at different steps into 3 slots (so some
    wait): the same greedy tokens with and without a prefix cache, and exactly the hits a
    cache with room for everything has (the test fails if the cache is never hit)."""
    model = tiny_model(family, device)
    prompts, block = shared_prompts(family), BLOCK[family]
    ref = run_engine(model, mode, prompts, device=device)
    cache = ServingCache(model, 3, 128, mode)
    prefix = PrefixCache(cache, block=block, budget_bytes=1 << 26)
    got = run_engine(model, mode, prompts, prefix, device=device, cache=cache)
    assert got == ref
    hits = expected_hit_tokens(prompts, block)
    assert sum(hits) > 0
    assert prefix.lookups == len(prompts)
    assert prefix.hits == sum(h > 0 for h in hits)
    assert prefix.hit_tokens == sum(hits)
    assert prefix.evictions == 0


# ---- forked sequences (parallel sampling, beams) -----------------------------------------------

@pytest.mark.parametrize("device", CPU + CUDA)
@pytest.mark.parametrize("mode, share", [("eager-fp32", False), ("replay-fp32:4", False),
                                         ("replay-fp32:4", True), ("replay-fp32+bf16:4", True)],
                         ids=["eager-fp32", "replay-fp32", "replay-fp32-shared",
                              "replay-fp32+bf16-shared"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forked_sequences_decode_as_their_own_prefills(family, mode, share, device):
    """ServingCache.fork: a prompt prefilled into slot a, forked onto b, and b onto c (a fork of
    a fork); the three then take different tokens, side by side over three folds of L = 4.
    Each branch's logits equal those of a slot that prefilled the same prompt itself and
    decoded the same tokens in the same batch, to fp32 rounding: the arithmetic is the same,
    but a GEMM may round rows at different positions of a batch differently (on some CPUs the
    library's kernels block the rows: Qwen3.5's rows 0-2 and 3-5 differed by up to 5e-7).
    With shared checkpoints nothing is shared any more once every branch has folded."""
    model = tiny_model(family, device)
    cache = ServingCache(model, 6, 64, mode, share_forked_checkpoints=share)
    prompt = tokens(family, 5, 21)
    a = cache.allocate()
    model.prefill(cache, a, prompt)
    b = cache.fork(a)
    c = cache.fork(b)
    refs = [cache.allocate() for _ in range(3)]
    for r in refs:
        model.prefill(cache, r, prompt)
    slots = torch.tensor([a, b, c, *refs], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(9)
    for step in range(12):
        branch = torch.randint(0, VOCAB[family], (3,), generator=g)
        logits = model.step(cache, slots, torch.cat([branch, branch]).to(device))
        assert mu.rel_err(logits[:3], logits[3:]) <= 1e-6, step
    assert len({int(cache.lengths[s]) for s in (a, b, c, *refs)}) == 1
    if share:
        assert not cache.ssm.buffers["ckpt_source"].any()


def test_fork_refusals_allocate_nothing(models):
    model = models["nemotron"]
    cache = ServingCache(model, 3, 64, "replay-fp32:4", share_forked_checkpoints=True)
    a = cache.allocate()
    model.prefill(cache, a, tokens("nemotron", 1, 9))
    free = cache.ssm.free_slots
    for args, message in [((a, a), "onto itself"), ((2,), "not an allocated slot"),
                          ((a, 2), "not an allocated slot")]:
        with pytest.raises(ValueError, match=message):
            cache.fork(*args)
        assert cache.ssm.free_slots == free


@pytest.mark.cuda
@_no_cuda
def test_host_entries_restore_into_a_device_cache():
    """Entries on the host (device="cpu") for a CUDA cache: the same tokens."""
    model = tiny_model("nemotron", "cuda")
    prompts = shared_prompts("nemotron")
    ref = run_engine(model, "replay-fp32:4", prompts, device="cuda")
    cache = ServingCache(model, 3, 128, "replay-fp32:4")
    prefix = PrefixCache(cache, block=8, budget_bytes=1 << 26, device="cpu")
    assert run_engine(model, "replay-fp32:4", prompts, prefix, device="cuda", cache=cache) == ref
    assert prefix.hit_tokens == sum(expected_hit_tokens(prompts, 8))


# ---- eviction ---------------------------------------------------------------------------------

def chain_is_whole(prefix):
    """Every entry's previous block is cached too (no entry that no lookup can reach)."""
    return all(e.parent is None or e.parent in prefix._entries for e in prefix._entries.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_eviction_under_a_small_budget_keeps_the_tokens_and_whole_chains(family):
    """Blocks of 8, a budget of 3 entries for prompts of up to 7 blocks: evictions, never over
    the budget, hits still, every cached block reachable, and the tokens of an engine without a
    cache."""
    model = tiny_model(family)
    prompts = shared_prompts(family)
    ref = run_engine(model, "eager-fp32", prompts)
    cache = ServingCache(model, 3, 128, "eager-fp32")
    probe = PrefixCache(cache, block=8)
    prefix = PrefixCache(cache, block=8, budget_bytes=3 * probe.entry_bytes)
    assert run_engine(model, "eager-fp32", prompts, prefix, cache=cache) == ref
    assert prefix.evictions > 0 and prefix.hit_tokens > 0 and len(prefix) <= 3
    assert prefix.nbytes <= prefix.budget_bytes
    assert chain_is_whole(prefix)


def test_lru_evicts_the_least_recently_used_prompts_last_block_first():
    """Budget of 4 entries, block 8: A (2 blocks) then B (2 blocks) fill it; A is used again
    (a hit), then C (2 blocks) evicts B's blocks, deepest first; A still hits, B misses."""
    model = tiny_model("nemotron")
    cache = ServingCache(model, 1, 64, "eager-fp32")
    probe = PrefixCache(cache, block=8)
    prefix = PrefixCache(cache, block=8, budget_bytes=4 * probe.entry_bytes)
    A, B, C = (tokens("nemotron", 20 + i, 17) for i in range(3))

    def admit(p):
        slot = cache.allocate()
        before = prefix.hit_tokens
        prefix.prefill(model, slot, p)
        cache.free(slot)
        return prefix.hit_tokens - before

    assert [admit(p) for p in (A, B)] == [0, 0] and len(prefix) == 4
    assert admit(A) == 16
    assert admit(C) == 0
    assert prefix.evictions == 2
    assert set(prefix._entries) == set(prefix.keys(A)) | set(prefix.keys(C))
    assert admit(A) == 16 and admit(B) == 0


# ---- bad input --------------------------------------------------------------------------------

def test_bad_input_is_refused_with_nothing_changed():
    model = tiny_model("nemotron")
    cache = ServingCache(model, 2, 64, "replay-fp32:4")
    probe = PrefixCache(cache, block=8)
    for block in (0, -8, 2.0, True, 64):
        with pytest.raises(ValueError, match="block"):
            PrefixCache(cache, block=block)
    for budget in (probe.entry_bytes - 1, 0, -1, float(1 << 30), None):
        with pytest.raises(ValueError, match="budget_bytes"):
            PrefixCache(cache, block=8, budget_bytes=budget)
    other = ServingCache(model, 2, 64, "replay-fp32:4")
    with pytest.raises(ValueError, match="PrefixCache of this engine's cache"):
        Engine(model, cache, prefix_cache=PrefixCache(other, block=8))

    slot = cache.allocate()
    prompt = tokens("nemotron", 30, 20)
    model.prefill(cache, slot, prompt)
    before = [t.clone() for t in (cache.lengths, cache.conv, cache.k, cache.v)]
    with pytest.raises(ValueError, match="holds 20 positions"):
        model.prefill(cache, slot, prompt, start=12)        # not where the slot ends
    with pytest.raises(ValueError, match="position >= 0"):
        model.prefill(cache, slot, prompt, start=-1)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model.prefill(cache, slot, torch.zeros(45, dtype=torch.long), start=20)
    with pytest.raises(ValueError, match="multiple of it"):
        model.prefill_blocks(cache, slot, prompt, block=8, start=20)
    with pytest.raises(ValueError, match="not an allocated slot"):
        model.prefill(cache, 1, prompt, start=20)
    prefix = PrefixCache(cache, block=8)
    with pytest.raises(ValueError, match="holds 20 positions"):
        prefix.prefill(model, slot, prompt)                  # not a fresh slot
    assert prefix.lookups == 0 and len(prefix) == 0
    after = (cache.lengths, cache.conv, cache.k, cache.v)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# ---- the benchmark's code path ----------------------------------------------------------------

def test_bench_prefix_runs_at_a_tiny_layout(tmp_path):
    """python -m replayssm.bench_prefix on the tiny layouts (CPU): one row per layout, a hit of
    every whole block but the last token's, the hit's last logits those of the whole prefill."""
    import json

    from replayssm import bench_prefix

    out = tmp_path / "prefix.json"
    assert bench_prefix.main(["--layouts", "nemotron-tiny", "qwen3.5-tiny", "--prompt", "40",
                              "--block", "8", "--repeats", "1", "--device", "cpu",
                              "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["nemotron-tiny", "qwen3.5-tiny"]
    for r in rows:
        assert r["hit_tokens"] == 32 and r["entries"] == 5
        assert r["prefill_ms"] > 0 and r["hit_ms"] > 0 and r["last_logits_rel_err"] <= 1e-4
