"""Prefix caching through the Python package (StateCache.materialize, read_records, restore,
fork, truncate) against the float64 oracle: the state at a position is the oracle's state after
that many committed tokens.

- materialize at every position in reach (folded..committed of every layer), both kinds, every
  checkpoint precision, across folds and speculative windows with random acceptance;
  bit-exact against the checkpoint a fold to the committed end stores;
- fork then decode = the source truncated to the same position, then decode (bit for bit);
  with share_forked_checkpoints (copy on fold) the same bytes as a cache that copies at fork;
- restore (state + records) then decode = the uninterrupted slot's decode;
- truncate then decode = decoding from that position (the oracle's state there);
- bad slots, positions, shapes and dtypes refused with nothing changed;
- replayssm.torch: the same bytes with CPU tensors, torch.compile(fullgraph=True) on the CPU,
  opcheck; on CUDA (marker `cuda`): CUDA against the CPU backend, a CUDA graph, torch.compile.

Tolerances (relative to max|S_ref|, as test_decode.py's exports): an fp32 master checkpoint
1e-5; a shared bf16 checkpoint one bf16 unit per rounding (every fold, and a restore)."""

import numpy as np
import pytest

import replayssm
from conftest import (Driver, assert_same_bytes, bf16_bits, bf16_value, config, from_output,
                      gdn_inputs, layer_params, mamba2_inputs, snapshot)
from test_decode import BF16_U, export_tolerance, output_tolerance

CHECKPOINTS = ["fp32", "fp32+bf16", "bf16", "fp32+fp8"]
KINDS = ["mamba2", "gdn"]


class History(Driver):
    """A Driver that keeps the oracle's state of each of its slots at every committed position:
    history[layer][i][p] is the float64 state after p tokens (p = 0: the loaded state; slots
    start at position 0)."""

    def __init__(self, cache, rng, **kw):
        super().__init__(cache, rng, **kw)
        self.history = [[[S.copy()] for S in per_slot] for per_slot in self.states]
        self._trace = {}

    def step(self, T=1, accept=None):
        self._trace = {}
        k = super().step(T, accept)
        ids = self.rows()
        real = [b for b in range(len(ids)) if ids[b] >= 0]
        for layer in range(self.cfg.num_layers):
            for i, b in enumerate(real):
                self.history[layer][i] += [self._trace[layer, b, t] for t in range(k[i])]
        return k

    def _oracle(self, layer, S, seen, b, t):
        S, y = super()._oracle(layer, S, seen, b, t)
        self._trace[layer, b, t] = S
        return S, y

    def set_position(self, i, p, source=None):
        """Slot i now holds the state of slot `source` (default: itself) at position p."""
        source = i if source is None else source
        for layer in range(self.cfg.num_layers):
            self.history[layer][i] = [S.copy() for S in self.history[layer][source][:p + 1]]
            self.states[layer][i] = self.history[layer][i][p].copy()


def cursors(cache, slot):
    """(max over layers of folded, committed) of a slot: its reach is [first, second]."""
    folded = np.asarray(cache.buffers["folded"]).view(np.uint32)[:, slot]
    committed = np.asarray(cache.buffers["committed"]).view(np.uint32)[slot]
    return int(folded.max()), int(committed)


def i32(*v):
    return np.array(v, np.int32)


def rel_error(got, ref):
    assert np.isfinite(got).all()
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def materialize_tolerance(cfg, p):
    """materialize reads the master copy: fp32 unless the checkpoint is a shared bf16 one, which
    was rounded when loaded and at every fold (at most one per buffer_len tokens)."""
    if cfg.checkpoint == "bf16":
        return (p // cfg.buffer_len + 2) * BF16_U
    return 1e-5


def same_inputs_step(cache, slots, rng, T=1, accept=None, arr=None, back=np.asarray):
    """One step (every layer, then a commit of `accept` tokens, default T) of `slots` all fed the
    same inputs: rows that hold the same state must give the same bytes. `arr` turns NumPy
    arrays into what the cache takes, `back` its outputs into NumPy. Returns the outputs,
    [layer] -> float32 [len(slots), T, ...]."""
    cfg = cache.config
    arr = arr or (lambda a: a)
    ids = arr(np.array(slots, np.int32))
    n = len(slots)
    outs = []
    for layer in range(cfg.num_layers):
        if cfg.kind == "mamba2":
            given, _ = mamba2_inputs(cfg, rng, 1, T, True)
            p = layer_params(cfg, np.random.default_rng(layer))[layer]
            tile = {k: arr(np.repeat(v, n, axis=0)) for k, v in given.items()}
            y = replayssm.mamba2_decode(cache, layer, ids, tile["x"], tile["dt"], tile["B"],
                                        tile["C"], arr(p.A), arr(p.D), arr(p.dt_bias),
                                        z=tile["z"])
        else:
            given, _ = gdn_inputs(cfg, rng, 1, T)
            tile = {k: arr(np.repeat(v, n, axis=0)) for k, v in given.items()}
            y = replayssm.gdn_decode(cache, layer, ids, tile["q"], tile["k"], tile["v"],
                                     tile["g"], tile["beta"])
        outs.append(from_output(back(y), cfg.input_dtype))
    cache.commit(ids, arr(np.full(n, T if accept is None else accept, np.int32)))
    return outs


# ---- materialize -------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_materialize_every_position_in_reach(kind, checkpoint, rng):
    """After every step of T = 2 windows with random acceptance, over several folds of L = 4:
    the states of all slots at every position in reach, in one batched call with a pad row,
    equal the oracle's states at those positions."""
    cfg = config(kind, num_layers=2, checkpoint=checkpoint, buffer_len=4, max_spec_tokens=2)
    d = History(replayssm.StateCache(cfg), rng)
    seen_positions = 0
    for _ in range(14):
        d.step(T=2, accept=lambda T: int(rng.integers(0, T + 1)))
        pairs = [(i, p) for i, slot in enumerate(d.slots)
                 for p in range(cursors(d.cache, slot)[0], cursors(d.cache, slot)[1] + 1)]
        pairs.insert(1, (None, 0))  # a pad row: its output stays as it was
        ids = np.array([-1 if i is None else d.slots[i] for i, _ in pairs], np.int32)
        positions = np.array([p for _, p in pairs], np.int32)
        before = snapshot(d.cache)
        out = np.full((len(pairs), cfg.num_layers, *cfg.state_shape), np.nan, np.float32)
        assert d.cache.materialize(ids, positions, out) is out
        assert_same_bytes(snapshot(d.cache), before)  # the cache is only read
        assert np.isnan(out[1]).all(), "the pad row was written"
        for row, (i, p) in enumerate(pairs):
            if i is None:
                continue
            for layer in range(cfg.num_layers):
                ref = d.history[layer][i][p]
                assert rel_error(out[row, layer], ref) <= materialize_tolerance(cfg, p), (
                    f"slot {d.slots[i]} position {p} layer {layer}")
        seen_positions += len(pairs) - 1
    assert seen_positions > 3 * 14  # windows of more than one position were checked


@pytest.mark.parametrize("kind", KINDS)
def test_materialize_bf16_inputs_and_odd_shapes(kind, rng):
    cfg = config(kind, odd=True, num_layers=2, input_dtype="bfloat16", buffer_len=3)
    d = History(replayssm.StateCache(cfg), rng)
    for _ in range(7):
        d.step()
        for i, slot in enumerate(d.slots):
            lo, hi = cursors(d.cache, slot)
            out = d.cache.materialize(np.full(hi - lo + 1, slot, np.int32),
                                      np.arange(lo, hi + 1, dtype=np.int32))
            for j, p in enumerate(range(lo, hi + 1)):
                for layer in range(cfg.num_layers):
                    assert rel_error(out[j, layer], d.history[layer][i][p]) <= 1e-5


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_materialize_at_the_end_is_the_folded_checkpoint(kind, checkpoint, rng):
    """Materialize at the committed end, then fold and export: the same bits (fp32 master), or
    the bits the fold rounds to bf16 (shared bf16 checkpoint)."""
    cfg = config(kind, num_layers=2, checkpoint=checkpoint, buffer_len=5)
    d = Driver(replayssm.StateCache(cfg), rng)
    for _ in range(8):  # one fold, then 3 tokens since
        d.step()
    ids = np.array(d.slots, np.int32)
    ends = np.array([cursors(d.cache, s)[1] for s in d.slots], np.int32)
    out = d.cache.materialize(ids, ends)
    d.cache.fold(ids)
    for i, slot in enumerate(d.slots):
        for layer in range(cfg.num_layers):
            exported = d.cache.export_state(layer, slot)
            got = out[i, layer]
            if checkpoint == "bf16":
                got = bf16_value(bf16_bits(got))
            assert np.array_equal(got.view(np.uint32), exported.view(np.uint32))


# ---- fork, truncate, restore -------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_fork_then_decode_equals_the_source(kind, checkpoint, rng):
    """Fork slot s at every position in reach onto t, truncate s to the same position, decode
    both with the same inputs over a fold: the same output bytes, and the same state."""
    cfg = config(kind, num_layers=2, checkpoint=checkpoint, buffer_len=4, max_spec_tokens=2,
                 capacity=3)
    cache = replayssm.StateCache(cfg)
    s, t = cache.allocate(), cache.allocate()
    for _ in range(6):
        same_inputs_step(cache, [s], rng, T=2, accept=1)
    lo, hi = cursors(cache, s)
    assert hi - lo >= 1
    base = snapshot(cache)
    for p in range(lo, hi + 1):
        for name, a in base.items():
            np.copyto(cache.buffers[name], a)
        src_before = {n: np.take(a, s, axis=0 if a.ndim == 1 else 1) for n, a in base.items()}
        got = cache.fork(i32(s), i32(t),
                         i32(p))
        assert got.tolist() == [t]
        after = snapshot(cache)
        for n, a in after.items():  # the source is only read
            assert np.array_equal(np.take(a, s, axis=0 if a.ndim == 1 else 1), src_before[n]), n
        assert cursors(cache, t) == (lo, p)
        cache.truncate(i32(s), i32(p))
        for _ in range(5):  # past the next fold
            ys = same_inputs_step(cache, [s, t], rng)
            for y in ys:
                assert np.array_equal(y[0], y[1])
        m = cache.materialize(np.array([s, t], np.int32),
                              np.full(2, cursors(cache, s)[1], np.int32))
        assert np.array_equal(m[0], m[1])


def shared_fork_run(kind, make_cache, arr=None, back=np.asarray, seed=7):
    """A source decoded past a fold, forked at its end onto a second slot, both decoded on over
    two folds (T = 2 windows, accepting 1 or 2), on a cache that copies at fork and one that
    shares (share_forked_checkpoints): per step, both caches' outputs must be the same bytes.
    Returns the sharing cache's ckpt_source right after the fork and at the end."""
    arr = arr or (lambda a: a)
    caches = [make_cache(share) for share in (False, True)]
    slots = [(c.allocate(), c.allocate()) for c in caches]
    assert slots[0] == slots[1]
    s, t = slots[0]
    rngs = [np.random.default_rng(seed) for _ in caches]
    for _ in range(5):
        for c, r in zip(caches, rngs):
            same_inputs_step(c, [s], r, T=2, accept=1, arr=arr, back=back)
    end = int(back(caches[0].buffers["committed"]).view(np.uint32)[s])
    for c in caches:
        c.fork(arr(i32(s)), arr(i32(t)), arr(i32(end)))
    after_fork = back(caches[1].buffers["ckpt_source"]).view(np.uint32).copy()
    for step in range(8):
        accept = 1 + step % 2
        a, b = (same_inputs_step(c, [s, t], r, T=2, accept=accept, arr=arr, back=back)
                for c, r in zip(caches, rngs))
        for ya, yb in zip(a, b):
            assert ya.tobytes() == yb.tobytes(), f"step {step}"
    return after_fork, back(caches[1].buffers["ckpt_source"]).view(np.uint32).copy()


@pytest.mark.parametrize("kind", KINDS)
def test_shared_fork_decodes_as_a_copying_cache(kind):
    """share_forked_checkpoints: the fork points the copy at the source's checkpoint (copy on
    fold), decoding gives the bytes a cache that copies at fork gives, and once both have
    folded nothing is shared any more. Eager caches refuse the option."""
    def make(share):
        return replayssm.StateCache(config(kind, num_layers=2, buffer_len=4, max_spec_tokens=2,
                                           capacity=3, share_forked_checkpoints=share))
    assert "ckpt_source" not in make(False).buffers
    after_fork, end = shared_fork_run(kind, make)
    assert (after_fork[:, 1] == 1).all()  # slot 1 reads slot 0's rows in every layer
    assert (end == 0).all()
    with pytest.raises(ValueError, match="share_forked_checkpoints"):
        config(kind, mode="eager", share_forked_checkpoints=True)


@pytest.mark.parametrize("kind", KINDS)
def test_fork_onto_new_slots_and_against_the_oracle(kind, rng):
    """fork(src, None, positions) allocates the copies; each then decodes as the oracle does
    from the source's state at that position."""
    cfg = config(kind, num_layers=2, buffer_len=4, capacity=6)
    d = History(replayssm.StateCache(cfg), rng)  # slots 0..2
    for _ in range(6):
        d.step()
    lo, hi = cursors(d.cache, d.slots[0])
    src = np.array([d.slots[0], d.slots[1]], np.int32)
    positions = np.array([lo, hi], np.int32)
    free = d.cache.free_slots
    dst = d.cache.fork(src, None, positions)
    assert d.cache.free_slots == free - 2 and sorted(dst.tolist()) == [3, 4]
    # Follow the copies instead of slots 1 and 2 from here on.
    d.slots[1:] = dst.tolist()
    d.set_position(2, hi, source=1)  # before row 1's history is replaced
    d.set_position(1, lo, source=0)
    for _ in range(6):
        d.step()
    assert d.max_error <= output_tolerance(cfg, 12)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_truncate_then_decode_from_there(kind, checkpoint, rng):
    """Truncate each slot to another position in reach (the end, the fold, between), then keep
    decoding with speculative windows: the oracle from its state at that position."""
    cfg = config(kind, num_layers=2, checkpoint=checkpoint, buffer_len=4, max_spec_tokens=2)
    d = History(replayssm.StateCache(cfg), rng)
    for _ in range(5):
        d.step(T=2, accept=lambda T: int(rng.integers(0, T + 1)))
    d.max_error = 0.0
    targets = []
    for i, slot in enumerate(d.slots):
        lo, hi = cursors(d.cache, slot)
        targets.append([hi, lo, (lo + hi) // 2][i])
    assert len(set(t - cursors(d.cache, s)[1] for t, s in zip(targets, d.slots))) > 1
    ids = d.rows()
    positions = np.array([targets[0], 12345, *targets[1:]], np.int32)  # pad row: ignored
    d.cache.truncate(ids, positions)
    for i, p in enumerate(targets):
        d.set_position(i, p)
        assert cursors(d.cache, d.slots[i])[1] == p
    for _ in range(8):
        d.step(T=2, accept=lambda T: int(rng.integers(0, T + 1)))
    assert d.max_error <= output_tolerance(cfg, 26)
    assert d.export_error() <= export_tolerance(cfg, 26)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_restore_then_decode_equals_uninterrupted(kind, checkpoint, rng):
    """An entry taken at position p of slot s (its materialized state and the records of the
    committed tokens after p) restored into a fresh slot t: t continues as s does, for every
    p in reach; with no records, t continues from p itself."""
    cfg = config(kind, num_layers=2, checkpoint=checkpoint, buffer_len=4, max_spec_tokens=2,
                 capacity=3)
    cache = replayssm.StateCache(cfg)
    s, t = cache.allocate(), cache.allocate()
    for layer in range(cfg.num_layers):
        cache.load_state(layer, s, (0.5 * rng.standard_normal(cfg.state_shape)).astype(np.float32))
    for _ in range(6):
        same_inputs_step(cache, [s], rng, T=2, accept=1)
    lo, hi = cursors(cache, s)
    assert hi - lo >= 2
    base = snapshot(cache)
    bf16 = checkpoint == "bf16"
    # t's checkpoint (and read copy) is rounded from the state at p, s's from the state at its
    # fold: each output is within output_tolerance of the oracle, so of each other within twice
    # that.
    tol = 2 * output_tolerance(cfg, 30)
    for p in range(lo, hi + 1):
        for name, a in base.items():
            np.copyto(cache.buffers[name], a)
        state = cache.materialize(i32(s), i32(p))[0]
        records = cache.read_records(s, p, hi - p)
        assert records.vec.shape[1] == hi - p
        cache.restore(t, p, state, records)
        assert cursors(cache, t) == (p, hi)
        for _ in range(5):  # past the next fold
            y = same_inputs_step(cache, [s, t], rng)
            for out in y:
                assert rel_error(out[1], out[0]) <= tol
        m = cache.materialize(i32(s, t), np.full(2, cursors(cache, s)[1], np.int32))
        assert rel_error(m[1], m[0]) <= (3 * BF16_U if bf16 else 1e-5)
    # No records: t continues from p = lo, as s truncated to lo does.
    for name, a in base.items():
        np.copyto(cache.buffers[name], a)
    state = cache.materialize(i32(s), i32(lo))[0]
    cache.restore(t, lo, state)
    cache.truncate(i32(s), i32(lo))
    assert cursors(cache, t) == (lo, lo)
    for _ in range(3):
        for out in same_inputs_step(cache, [s, t], rng):
            assert rel_error(out[1], out[0]) <= tol


def test_restore_at_other_positions_and_the_oracle(rng):
    """An entry restored at another position (positions are the slot's to set, as an engine's
    token index), and a state a NumPy float64 oracle gave: decoding follows the oracle."""
    cfg = config("gdn", num_layers=2, buffer_len=4)
    d = History(replayssm.StateCache(cfg), rng)
    for _ in range(3):
        d.step()
    for i, slot in enumerate(d.slots):
        entry = np.stack([d.states[layer][i] for layer in range(cfg.num_layers)]).astype(np.float32)
        d.cache.restore(slot, 1000 + 7 * i if i else 2**32 - 2, entry)
    assert cursors(d.cache, d.slots[0]) == (2**32 - 2, 2**32 - 2)
    for _ in range(6):  # slot 0's positions wrap past 2^32
        d.step()
    assert cursors(d.cache, d.slots[0])[1] == 4
    assert d.max_error <= 1e-5


# ---- refusals ------------------------------------------------------------------------------

@pytest.fixture(params=KINDS)
def busy(request, rng):
    """A 2-layer replay cache (L = 4, T <= 2) with slots 0 and 1 at committed 6, folded 4, and
    slot 2 allocated, slot 3 free."""
    cfg = config(request.param, num_layers=2, buffer_len=4, max_spec_tokens=2)
    cache = replayssm.StateCache(cfg)
    slots = [cache.allocate() for _ in range(3)]
    for _ in range(6):
        same_inputs_step(cache, slots[:2], rng)
    assert cursors(cache, 0) == (4, 6)
    return cache


def refused(cache, call, error, match, *outs):
    """`call()` raises `error` matching `match`, and no byte of the cache or of `outs` changed."""
    before = snapshot(cache)
    copies = [np.array(o, copy=True) for o in outs]
    with pytest.raises(error, match=match):
        call()
    assert_same_bytes(snapshot(cache), before)
    for o, c in zip(outs, copies):
        assert np.array_equal(o.view(np.uint8), c.view(np.uint8))


def test_materialize_refusals(busy):
    cache, cfg = busy, busy.config
    out = np.full((2, 2, *cfg.state_shape), 7.0, np.float32)
    mat = cache.materialize
    refused(cache, lambda: mat(i32(0, 3), i32(5, 5), out), ValueError,
            r"^state_cache_materialize: row 1: slot 3 is not allocated$", out)
    refused(cache, lambda: mat(i32(0, 4), i32(5, 5), out), ValueError,
            r"row 1: slot 4 out of range \[0, 4\)$", out)
    refused(cache, lambda: mat(i32(0, 1), i32(5, 3), out), ValueError,
            r"^state_cache_materialize: row 1: position 3 is out of reach of slot 1: layer 0 is "
            r"folded to 4 and the slot is committed to 6", out)
    refused(cache, lambda: mat(i32(0, 1), i32(7, 5), out), ValueError,
            r"row 0: position 7 is out of reach of slot 0", out)
    refused(cache, lambda: mat(i32(0, 1), i32(-1, 5), out), ValueError,
            r"row 0: position 4294967295 is out of reach", out)
    refused(cache, lambda: mat(i32(0, 1), np.array([5, 5], np.int64), out), ValueError,
            r"^materialize: positions has dtype int64, expected int32 \(or uint32\)$", out)
    refused(cache, lambda: mat(i32(0, 1), i32(5), out), ValueError,
            r"^materialize: positions has shape \[1\], expected \[2\]", out)
    refused(cache, lambda: mat(i32(0, 1), i32(5, 5), out[:, :1]), ValueError,
            r"^materialize: out has shape \[2, 1, .*\], expected \[2, 2, .*\] "
            r"\(\[batch, num_layers, heads, rows, cols\]\)$", out)
    bad = np.zeros(out.shape, np.float64)
    refused(cache, lambda: mat(i32(0, 1), i32(5, 5), bad), ValueError,
            r"^materialize: out has dtype float64, expected float32$", bad)
    refused(cache, lambda: mat(np.array([0, 1], np.float32), i32(5, 5), out), ValueError,
            r"^materialize: slot_ids has dtype float32, expected int32$", out)
    refused(cache, lambda: mat([0, 1], i32(5, 5), out), TypeError,
            r"^materialize: slot_ids must be a DLPack array", out)


def test_read_records_and_restore_refusals(busy, rng):
    cache, cfg = busy, busy.config
    gdn = cfg.kind == "gdn"
    refused(cache, lambda: cache.read_records(0, 3, 1), ValueError,
            r"^state_cache_read_records: position 3 is out of reach of slot 0")
    refused(cache, lambda: cache.read_records(0, 5, 2), ValueError,
            r"^state_cache_read_records: position 7 is out of reach of slot 0")
    refused(cache, lambda: cache.read_records(0, 0, 6), ValueError,
            r"^state_cache_read_records: 6 records; a slot holds 0 to 5 committed records")
    refused(cache, lambda: cache.read_records(3, 4, 1), ValueError, r"^slot 3 is not allocated$")
    out = cache.read_records(0, 4, 2)
    wrong = out._replace(write=np.zeros((2, 2, 3), np.float32))
    refused(cache, lambda: cache.read_records(0, 4, 2, wrong), ValueError,
            r"^read_records: write has shape \[2, 2, 3\], expected \[2, 2, \d+\] "
            r"\(\[num_layers, count, heads\]\)$", wrong.vec)

    states = cache.materialize(i32(0), i32(4))[0]
    records = cache.read_records(0, 4, 2)
    rest = cache.restore
    nan = states.copy()
    nan[1, 0, 0, 0] = np.inf
    refused(cache, lambda: rest(2, 4, nan, records), ValueError,
            r"^state_cache_restore: layer 1: state\[0\] is inf; a loaded state must be finite$")
    refused(cache, lambda: rest(3, 4, states, records), ValueError, r"^slot 3 is not allocated$")
    refused(cache, lambda: rest(2, 4, states[:1], records), ValueError,
            r"^restore: states has shape \[1, .*\], expected \[2, .*\] "
            r"\(\[num_layers, heads, rows, cols\]\)$")
    refused(cache, lambda: rest(2, 4, states.astype(np.float64)), ValueError,
            r"^restore: states has dtype float64, expected float32$")
    refused(cache, lambda: rest(2, 2**32, states), ValueError,
            r"^restore: position 4294967296 is not a 32-bit cursor value$")
    refused(cache, lambda: rest(2, 4, states, records._replace(decay=None)), ValueError,
            r"^restore: records.decay is missing$")
    if gdn:
        refused(cache, lambda: rest(2, 4, states, records._replace(key_scale=None)), ValueError,
                r"^restore: records.key_scale is missing$")
    else:
        refused(cache, lambda: rest(2, 4, states, records._replace(key_scale=records.write)),
                ValueError, r"^restore: records.key_scale is GDN's")
    # Too many records: more than the ring holds committed (L - 1 + T = 5).
    big = replayssm.CacheRecords(*(None if s is None else np.zeros(s, a.dtype) for s, a in
                                   zip(cfg.record_shapes(6), records)))
    refused(cache, lambda: rest(2, 4, states, big), ValueError,
            r"^state_cache_restore: 6 records; a slot holds 0 to 5 committed records")
    # An uncommitted window: decode without committing.
    ids = i32(2)
    for layer in range(cfg.num_layers):
        if gdn:
            given, _ = gdn_inputs(cfg, rng, 1, 2)
            replayssm.gdn_decode(cache, layer, ids, given["q"], given["k"], given["v"],
                                 given["g"], given["beta"])
        else:
            given, _ = mamba2_inputs(cfg, rng, 1, 2, True)
            p = layer_params(cfg, rng)[layer]
            replayssm.mamba2_decode(cache, layer, ids, given["x"], given["dt"], given["B"],
                                    given["C"], p.A, p.D, p.dt_bias, z=given["z"])
    refused(cache, lambda: rest(2, 4, states, records), ValueError,
            r"^state_cache_restore: layer 0 of slot 2 has an uncommitted window of 2 tokens; "
            r"commit first$")


def test_fork_and_truncate_refusals(busy):
    cache = busy
    fork, trunc = cache.fork, cache.truncate
    refused(cache, lambda: fork(i32(0), i32(0), i32(5)), ValueError,
            r"^state_cache_fork: row 0: slot 0 forked onto itself$")
    refused(cache, lambda: fork(i32(0, 1), i32(2, 2), i32(5, 5)), ValueError,
            r"^state_cache_fork: row 1: dst slot 2 appears twice in one batch$")
    refused(cache, lambda: fork(i32(0, 1), i32(1, 2), i32(5, 5)), ValueError,
            r"^state_cache_fork: row 0: dst slot 1 is the src of a row of the same batch")
    refused(cache, lambda: fork(i32(0), i32(3), i32(5)), ValueError,
            r"^state_cache_fork: row 0: slot 3 is not allocated$")
    refused(cache, lambda: fork(i32(0), i32(2), i32(7)), ValueError,
            r"^state_cache_fork: row 0: position 7 is out of reach of slot 0")
    refused(cache, lambda: fork(i32(0), i32(2, 3), i32(5)), ValueError,
            r"^fork: dst_slots has shape \[2\], expected \[1\]")
    # Onto new slots: a refused fork gives them back.
    free = cache.free_slots
    refused(cache, lambda: fork(i32(0), None, i32(3)), ValueError, r"position 3 is out of reach")
    assert cache.free_slots == free

    refused(cache, lambda: trunc(i32(0), i32(7)), ValueError,
            r"^state_cache_truncate: row 0: position 7 is out of reach of slot 0")
    refused(cache, lambda: trunc(i32(0, 1), i32(5, 3)), ValueError,
            r"^state_cache_truncate: row 1: position 3 is out of reach of slot 1")
    refused(cache, lambda: trunc(i32(1, 1), i32(5, 5)), ValueError,
            r"^row 1: slot 1 appears twice in one batch$")
    refused(cache, lambda: trunc(i32(0, 3), i32(5, 5)), ValueError,
            r"^row 1: slot 3 is not allocated$")
    refused(cache, lambda: trunc(i32(0), np.array([5], np.int16)), ValueError,
            r"^truncate: positions has dtype int16, expected int32 \(or uint32\)$")


@pytest.mark.parametrize("kind", KINDS)
def test_eager_caches_are_refused(kind):
    cfg = config(kind, mode="eager")
    cache = replayssm.StateCache(cfg)
    cache.allocate()
    message = r"needs a replay cache: an eager cache holds only the state at its committed end"
    refused(cache, lambda: cache.materialize(i32(0), i32(0)), NotImplementedError,
            r"^state_cache_materialize " + message)
    refused(cache, lambda: cache.truncate(i32(0), i32(0)), NotImplementedError, message)
    refused(cache, lambda: cache.fork(i32(0), i32(1), i32(0)), NotImplementedError, message)
    refused(cache, lambda: cache.read_records(0, 0, 1), NotImplementedError, message)
    refused(cache, lambda: cache.restore(0, 0, np.zeros((1, *cfg.state_shape), np.float32)),
            NotImplementedError, message)


def test_uint32_positions_and_empty_batches(busy):
    """Positions may be the cursors' own uint32 (NumPy's view of the buffers); empty batches do
    nothing."""
    cache = busy
    committed = cache.buffers["committed"]
    assert committed.dtype == np.uint32
    a = cache.materialize(i32(0, 1), committed[:2].copy())
    b = cache.materialize(i32(0, 1), i32(6, 6))
    assert np.array_equal(a, b)
    before = snapshot(cache)
    empty = np.zeros(0, np.int32)
    assert cache.materialize(empty, empty).shape == (0, 2, *cache.config.state_shape)
    cache.fork(empty, empty, empty)
    cache.truncate(empty, empty)
    assert cache.read_records(0, 6, 0).vec.shape[1] == 0
    assert_same_bytes(snapshot(cache), before)


def test_a_wrong_oracle_is_caught(rng):
    """The comparison sees a small error: a state off by one token's worth (the position before)
    fails the bound materialize passes."""
    cfg = config("mamba2", num_layers=1, buffer_len=8)
    d = History(replayssm.StateCache(cfg), rng)
    for _ in range(5):
        d.step()
    out = d.cache.materialize(i32(d.slots[0]), i32(5))
    assert rel_error(out[0, 0], d.history[0][0][5]) <= 1e-5
    assert rel_error(out[0, 0], d.history[0][0][4]) > 1e-3


# ---- replayssm.torch ---------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def test_torch_cpu_tensors_give_numpy_bytes(rng):
    torch = _torch()
    import replayssm.torch as rt
    from test_torch import tensor_snapshot, to_numpy, torch_array
    cfg = config("gdn", num_layers=2, checkpoint="fp32+bf16", input_dtype="bfloat16",
                 buffer_len=4, capacity=3)
    caches = [replayssm.StateCache(cfg), rt.StateCache(cfg)]
    convert = [lambda a: a, torch_array("cpu")]
    for cache in caches:
        cache.allocate(), cache.allocate()
    for _ in range(6):
        seed = int(rng.integers(1 << 30))
        for cache, arr in zip(caches, convert):
            same_inputs_step(cache, [0, 1], np.random.default_rng(seed), arr=arr, back=to_numpy)
    results = []
    for cache, arr in zip(caches, convert):
        m = cache.materialize(arr(i32(0, 1, 0)), arr(i32(4, 5, 6)))
        r = cache.read_records(0, 4, 2)
        cache.restore(1, 4, m[0], r)
        dst = cache.fork(arr(i32(0)), None, arr(i32(5)))
        cache.truncate(arr(i32(0)), arr(i32(4)))
        results.append([m, *(a for a in r if a is not None), dst])
    assert all(isinstance(a, torch.Tensor) for a in results[1])
    assert results[1][1].dtype == torch.bfloat16 and results[1][-1].dtype == torch.int32
    results[1] = [to_numpy(a) for a in results[1]]
    for a, b in zip(*results):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert_same_bytes(tensor_snapshot(caches[1]), snapshot(caches[0]))


def prefix_step(cache, ids, positions, entry_slot, entry_position, truncate_to):
    """What an engine's step might do around the decodes: store entries for `ids` at
    `positions`, load the first into `entry_slot`, fork it, roll a slot back, read the state
    there."""
    import torch
    states = cache.materialize(ids, positions)
    cache.restore(entry_slot, entry_position, states[0])
    cache.fork(ids[:1], torch.tensor([entry_slot + 1], dtype=torch.int32), positions[:1])
    cache.truncate(ids[1:], truncate_to)
    after = cache.materialize(ids[1:], truncate_to)  # reads what the ops above wrote
    return torch.cat([states, after]) * 2


def test_torch_compile_fullgraph_on_the_cpu(rng):
    """materialize, restore, fork and truncate in one torch.compile(fullgraph=True) function:
    the same outputs and cache bytes as eager calls, on the cache's own buffers."""
    torch = _torch()
    import replayssm.torch as rt
    from test_torch import tensor_snapshot, to_numpy, torch_array
    cfg = config("mamba2", num_layers=2, buffer_len=4, capacity=4)
    eager, compiled = rt.StateCache(cfg), rt.StateCache(cfg)
    for cache in (eager, compiled):
        cache.allocate(), cache.allocate(), cache.allocate(), cache.allocate()
    for _ in range(6):
        seed = int(rng.integers(1 << 30))
        for cache in (eager, compiled):
            same_inputs_step(cache, [0, 1], np.random.default_rng(seed), arr=torch_array("cpu"),
                             back=to_numpy)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    step = torch.compile(prefix_step, fullgraph=True)
    for positions, back in (([5, 6], [4]), ([4, 4], [4])):
        p, b = torch.tensor(positions, dtype=torch.int32), torch.tensor(back, dtype=torch.int32)
        want = prefix_step(eager, ids, p, 2, 100, b)
        got = step(compiled, ids, p, 2, 100, b)
        assert torch.equal(got, want)
        assert_same_bytes(tensor_snapshot(compiled), tensor_snapshot(eager))
    assert compiled.calls_on_other_buffers == 0, "the compiled graph ran the ops on copies"


def test_torch_opcheck_on_the_cpu(rng):
    torch = _torch()
    import replayssm.torch as rt
    from test_torch import tensor_snapshot, to_numpy, torch_array
    cfg = config("gdn", num_layers=1, buffer_len=4, capacity=3)
    cache = rt.StateCache(cfg)
    cache.allocate(), cache.allocate(), cache.allocate()
    for _ in range(5):
        same_inputs_step(cache, [0, 1], rng, arr=torch_array("cpu"), back=to_numpy)
    ids, pos = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32)
    ops = torch.ops.replayssm
    out = torch.empty((2, 1, *cfg.state_shape))
    state = cache.materialize(ids[:1], pos[:1])[0]
    r = cache.read_records(0, 4, 1)
    before = tensor_snapshot(cache)
    b = cache._buffer_list
    torch.library.opcheck(ops.materialize.default, (cache._id, ids, pos, out, b))
    torch.library.opcheck(ops.read_records.default, (cache._id, 0, 4, *r, b))
    torch.library.opcheck(ops.restore.default, (cache._id, 2, 4, state, *r, b))
    torch.library.opcheck(ops.fork.default, (cache._id, ids[:1], ids[1:] + 1, pos[:1], b))
    torch.library.opcheck(ops.truncate.default, (cache._id, ids, pos, b))
    assert_same_bytes(tensor_snapshot(cache), before)
    assert ops.truncate.default._schema.arguments[-1].alias_info.is_write
    assert ops.materialize.default._schema.arguments[-1].alias_info is None  # buffers: read


# ---- CUDA ------------------------------------------------------------------------------------

def _cuda():
    torch = _torch()
    if not (torch.cuda.is_available() and replayssm.cuda_available()):
        pytest.skip("needs a CUDA GPU, PyTorch with CUDA and a CUDA build")
    return torch


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_prefix_ops_match_the_cpu(kind, checkpoint, rng):
    """On a CUDA cache: materialize at every position in reach against the oracle and the CPU
    backend; fork, truncate and restore then decode as on the CPU; bad rows skipped (NaN
    states for positions out of reach)."""
    torch = _cuda()
    from test_torch import cuda_vs_cpu_tolerance, to_numpy, torch_array
    import replayssm.torch as rt
    kw = dict(num_layers=2, checkpoint=checkpoint, buffer_len=4, max_spec_tokens=2, capacity=4)
    cfg = config(kind, device="cuda", **kw)
    d = History(rt.StateCache(cfg), rng, to_array=torch_array("cuda"), to_numpy=to_numpy)
    for _ in range(6):
        d.step(T=2, accept=lambda T: int(rng.integers(0, T + 1)))
    arr = torch_array("cuda")
    folded = to_numpy(d.cache.buffers["folded"]).view(np.uint32)
    committed = to_numpy(d.cache.buffers["committed"]).view(np.uint32)
    pairs = [(i, p) for i, s in enumerate(d.slots)
             for p in range(int(folded[:, s].max()), int(committed[s]) + 1)]
    ids = arr(np.array([d.slots[i] for i, _ in pairs], np.int32))
    out = to_numpy(d.cache.materialize(ids, arr(np.array([p for _, p in pairs], np.int32))))
    for row, (i, p) in enumerate(pairs):
        for layer in range(cfg.num_layers):
            ref = d.history[layer][i][p]
            assert rel_error(out[row, layer], ref) <= (
                materialize_tolerance(cfg, p) + cuda_vs_cpu_tolerance(cfg))
    # Out of reach on the device: NaN, nothing else written; a slot out of range: skipped.
    s0 = d.slots[0]
    bad = torch.full((2, cfg.num_layers, *cfg.state_shape), 7.0, device="cuda")
    d.cache.materialize(arr(i32(s0, 9)), arr(i32(int(committed[s0]) + 1, 0)), bad)
    assert torch.isnan(bad[0]).all() and (bad[1] == 7).all()
    # Truncate, fork onto slot 3 and restore into slot 3: decoding follows the oracle.
    lo = int(folded[:, s0].max())
    d.cache.truncate(arr(i32(s0)), arr(i32(lo)))
    d.set_position(0, lo)
    d.max_error = 0.0
    for _ in range(3):
        d.step()
    tol = output_tolerance(cfg, 24) + cuda_vs_cpu_tolerance(cfg)  # up to 20 tokens by the end
    assert d.max_error <= tol
    s1, copy = d.slots[1], d.cache.allocate()
    end = int(to_numpy(d.cache.buffers["committed"]).view(np.uint32)[s1])
    d.cache.fork(arr(i32(s1)), arr(i32(copy)), arr(i32(end)))
    entry = d.cache.materialize(arr(i32(s1)), arr(i32(end)))[0]
    d.cache.restore(d.slots[2], end, entry)
    d.set_position(2, end, source=1)
    d.slots[0] = copy
    d.set_position(0, end, source=1)
    d.max_error = 0.0
    for _ in range(5):
        d.step()
    # A bf16 checkpoint was rounded once more by the restore.
    assert d.max_error <= tol + (BF16_U if checkpoint == "bf16" else 0.0)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_of_materialize_fork_truncate(kind, rng):
    """materialize, fork and truncate with device lists captured in a CUDA graph and replayed:
    the bytes of the same calls made eagerly."""
    torch = _cuda()
    import replayssm.torch as rt
    from test_torch import tensor_snapshot, torch_array
    cfg = config(kind, num_layers=2, buffer_len=4, capacity=4, device="cuda")
    eager, graphed = rt.StateCache(cfg), rt.StateCache(cfg)
    for cache in (eager, graphed):
        for _ in range(4):
            cache.allocate()

    def feed(cache, seed):
        g = np.random.default_rng(seed)
        to = torch_array("cuda")
        for layer in range(cfg.num_layers):
            if kind == "mamba2":
                given, _ = mamba2_inputs(cfg, g, 2, 1, True)
                p = layer_params(cfg, np.random.default_rng(layer))[layer]
                replayssm.mamba2_decode(cache, layer, to(i32(0, 1)), to(given["x"]),
                                        to(given["dt"]), to(given["B"]), to(given["C"]),
                                        to(p.A), to(p.D), to(p.dt_bias), z=to(given["z"]))
            else:
                given, _ = gdn_inputs(cfg, g, 2, 1)
                replayssm.gdn_decode(cache, layer, to(i32(0, 1)),
                                     *(to(given[k]) for k in ("q", "k", "v", "g", "beta")))
        cache.commit(to(i32(0, 1)), torch.ones(2, dtype=torch.int32, device="cuda"))

    for step in range(6):
        for cache in (eager, graphed):
            feed(cache, step)
    ids = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    positions = torch.tensor([5, 6], dtype=torch.int32, device="cuda")
    src, dst = ids.clone(), torch.tensor([2, 3], dtype=torch.int32, device="cuda")
    out = torch.empty((2, cfg.num_layers, *cfg.state_shape), device="cuda")

    def ops(cache, out):
        cache.materialize(ids, positions, out)
        cache.fork(src, dst, positions)
        cache.truncate(ids, positions)

    ops(graphed, out)  # first launches outside the capture, on both caches alike
    ops(eager, torch.empty_like(out))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops(graphed, out)
    for step in range(6, 9):
        for cache in (eager, graphed):
            feed(cache, step)
        positions.copy_(torch.tensor([step - 1, step], dtype=torch.int32))
        graph.replay()
        want = torch.empty_like(out)
        ops(eager, want)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert_same_bytes(tensor_snapshot(graphed), tensor_snapshot(eager))


@pytest.mark.cuda
def test_cuda_torch_compile_of_prefix_ops(rng):
    torch = _cuda()
    import replayssm.torch as rt
    from test_torch import tensor_snapshot, torch_array
    cfg = config("gdn", num_layers=2, buffer_len=4, capacity=4, device="cuda")
    eager, compiled = rt.StateCache(cfg), rt.StateCache(cfg)
    for cache in (eager, compiled):
        for _ in range(4):
            cache.allocate()
    to = torch_array("cuda")
    for step in range(6):
        given = [gdn_inputs(cfg, np.random.default_rng(step * 10 + layer), 2, 1)[0]
                 for layer in range(cfg.num_layers)]
        for cache in (eager, compiled):
            for layer in range(cfg.num_layers):
                replayssm.gdn_decode(cache, layer, to(i32(0, 1)),
                                     *(to(given[layer][k]) for k in ("q", "k", "v", "g", "beta")))
            cache.commit(to(i32(0, 1)), torch.ones(2, dtype=torch.int32, device="cuda"))
    ids = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    step = torch.compile(prefix_step_cuda, fullgraph=True)
    p = torch.tensor([5, 6], dtype=torch.int32, device="cuda")
    b = torch.tensor([4], dtype=torch.int32, device="cuda")
    want = prefix_step_cuda(eager, ids, p, b)
    got = step(compiled, ids, p, b)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert_same_bytes(tensor_snapshot(compiled), tensor_snapshot(eager))
    assert compiled.calls_on_other_buffers == 0


def prefix_step_cuda(cache, ids, positions, truncate_to):
    """prefix_step without restore (it synchronises; fine under torch.compile, but the point
    here is the graph of the device-side ops)."""
    states = cache.materialize(ids, positions)
    cache.fork(ids[:1], ids[:1] + 2, positions[:1])
    cache.truncate(ids[1:], truncate_to)
    return states * 2


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_shared_fork_decodes_as_a_copying_cache(kind):
    """test_shared_fork_decodes_as_a_copying_cache on CUDA caches (the release pass and the
    repointing run on the device)."""
    _cuda()
    import replayssm.torch as rt
    from test_torch import to_numpy, torch_array

    def make(share):
        return rt.StateCache(config(kind, num_layers=2, buffer_len=4, max_spec_tokens=2,
                                    capacity=3, device="cuda", share_forked_checkpoints=share))
    after_fork, end = shared_fork_run(kind, make, arr=torch_array("cuda"), back=to_numpy)
    assert (after_fork[:, 1] == 1).all()
    assert (end == 0).all()
