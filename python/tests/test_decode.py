"""Both decode ops on CPU caches against the float64 oracle: eager, replay over several fold
cycles in every checkpoint mode, speculative windows with random acceptance, multi-layer caches,
every input dtype, load and export.

Tolerances are relative to max|y| (and max|S| for exports). fp32 inputs with an fp32 state or
checkpoint: 1e-5 (docs/ALGORITHM.md §10). A bf16 or f16 output is rounded once (2^-8 resp.
2^-11 of its magnitude). A bf16 read copy adds its rounding of the state once (fp32+bf16); a
shared bf16 checkpoint or eager bf16 state rounds again at every fold or token, so it gets a
few of those units; fp8 e4m3 keeps 4 significant bits (2^-4)."""

import numpy as np
import pytest

import reference
import replayssm
from conftest import Driver, config

BF16_U = 2.0 ** -8
F16_U = 2.0 ** -11
FP8_U = 2.0 ** -4
INPUT_TOL = {"float32": 0.0, "bfloat16": 2 * BF16_U, "float16": 2 * F16_U}

# (mode, checkpoint, eager state dtype)
STATE_MODES = [
    ("eager", "fp32", "float32"),
    ("eager", "fp32", "bfloat16"),
    ("replay", "fp32", "float32"),
    ("replay", "fp32+bf16", "float32"),
    ("replay", "bf16", "float32"),
    ("replay", "fp32+fp8", "float32"),
]


def roundings(cfg, tokens):
    """How often the state was rounded to bf16 after `tokens` committed tokens: every token for
    an eager bf16 state, every fold for a shared bf16 checkpoint, never for an fp32 master."""
    if cfg.mode == "eager":
        return tokens if cfg.state_dtype == "bfloat16" else 0
    return tokens // cfg.buffer_len if cfg.checkpoint == "bf16" else 0


def output_tolerance(cfg, tokens):
    """Each rounding of the state costs at most one unit; a read copy rounds the state once
    more, and an output sums a row of such errors (a few units of the copy's precision: bf16
    2^-8, fp8 e4m3 with a per-row scale 2^-4); a bf16/f16 output is rounded once."""
    n = roundings(cfg, tokens)
    if n:
        tol = (n + 2) * BF16_U
    else:
        tol = {"fp32": 1e-5, "fp32+bf16": 4 * BF16_U, "fp32+fp8": 4 * FP8_U}[
            "fp32" if cfg.mode == "eager" else cfg.checkpoint]
    return tol + INPUT_TOL[cfg.input_dtype]


def export_tolerance(cfg, tokens):
    n = roundings(cfg, tokens)
    return (n + 1) * BF16_U if n else 1e-5


def mode_id(m):
    return f"{m[0]}-{m[2]}" if m[0] == "eager" else f"{m[0]}-{m[1]}"


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", STATE_MODES, ids=mode_id)
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_decode_matches_oracle_over_fold_cycles(kind, mode, input_dtype, rng):
    mode_name, checkpoint, state_dtype = mode
    cfg = config(kind, num_layers=2, mode=mode_name, checkpoint=checkpoint,
                 state_dtype=state_dtype, input_dtype=input_dtype, buffer_len=4)
    d = Driver(replayssm.StateCache(cfg), rng)
    steps = 22  # five folds of L = 4, and a partial cycle
    for _ in range(steps):
        d.step()
    assert d.max_error <= output_tolerance(cfg, steps)
    assert d.export_error() <= export_tolerance(cfg, steps)


@pytest.mark.parametrize("checkpoint", ["fp32", "fp32+bf16", "bf16", "fp32+fp8"])
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_speculative_windows_with_random_acceptance(kind, checkpoint, rng):
    """Windows of T = 3 (1 real + 2 drafts), 0..3 tokens accepted at random: every output equals
    plain decoding of the accepted stream, over folds of L = 4."""
    cfg = config(kind, num_layers=2, checkpoint=checkpoint, buffer_len=4, max_spec_tokens=3)
    d = Driver(replayssm.StateCache(cfg), rng)
    accepted = np.array([d.step(T=3, accept=lambda T: int(rng.integers(0, T + 1)))
                         for _ in range(24)])
    assert (accepted == 0).any() and (accepted == 3).any()  # rollbacks and full acceptance
    tokens = int(accepted.sum(axis=0).max())  # the most any slot committed
    assert d.max_error <= output_tolerance(cfg, tokens)
    assert d.export_error() <= export_tolerance(cfg, tokens)


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_odd_shapes_and_float16(kind, rng):
    cfg = config(kind, odd=True, input_dtype="float16", buffer_len=3, max_spec_tokens=2)
    d = Driver(replayssm.StateCache(cfg), rng)
    for _ in range(10):
        d.step(T=2, accept=lambda T: int(rng.integers(1, T + 1)))
    assert d.max_error <= 1e-5 + INPUT_TOL["float16"]


def test_mamba2_without_gate(rng):
    d = Driver(replayssm.StateCache(config("mamba2", buffer_len=4)), rng, gate=False)
    for _ in range(9):
        d.step()
    assert d.max_error <= 1e-5


@pytest.mark.parametrize("qk_l2norm,scale", [(False, None), (True, 0.3)])
def test_gdn_normalisation_and_scale(qk_l2norm, scale, rng):
    cfg = config("gdn", buffer_len=4)
    d = Driver(replayssm.StateCache(cfg), rng, qk_l2norm=qk_l2norm, scale=scale)
    for _ in range(9):
        d.step()
    assert d.max_error <= 1e-5


def test_driver_catches_a_wrong_output(rng):
    """The comparison sees a small error (an oracle off by 0.05 in D), so the bounds above mean
    something."""

    class OffByD(Driver):
        def _oracle(self, layer, S, seen, b, t):
            p = self.params[layer]
            z = seen["z"][b, t]
            return reference.mamba2_step(S, seen["x"][b, t], seen["dt"][b, t], seen["B"][b, t],
                                         seen["C"][b, t], z, p.A, p.D + 0.05, p.dt_bias)

    d = OffByD(replayssm.StateCache(config("mamba2")), rng)
    d.step()
    assert d.max_error > 1e-3


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_fold_every_sets_each_calls_fold_cadence(kind, rng):
    """A decode folds a row's committed history first once fold_every tokens of it wait: with
    a cadence cycling through 1..L and 0 (= L), each decode leaves `folded` at `committed`
    exactly when that call's cadence was due, and every output stays the oracle's."""
    cfg = config(kind, num_layers=2, checkpoint="fp32+bf16", buffer_len=6, max_spec_tokens=2)
    cache = replayssm.StateCache(cfg)
    d = Driver(cache, rng)
    folds = 0
    for step, every in enumerate([0, 1, 3, 6, 2, 0, 1, 1, 5, 4, 2, 6] * 3):
        before = cache.buffers["folded"][:, d.slots].copy()
        committed = cache.buffers["committed"][d.slots].copy()
        d.step(T=1 + step % 2, accept=lambda T: int(rng.integers(1, T + 1)), fold_every=every)
        due = committed - before >= (every or cfg.buffer_len)  # [layers, rows]
        after = cache.buffers["folded"][:, d.slots]
        assert np.array_equal(after, np.where(due, committed, before)), (step, every)
        folds += int(due.sum())
    assert folds > 36 * cfg.num_layers * len(d.slots) // cfg.buffer_len  # more than L alone
    assert d.max_error <= 4 * BF16_U
    assert d.export_error() <= 1e-5


@pytest.mark.parametrize("fold_every", [-1, 7])
def test_fold_every_outside_one_to_buffer_len_is_refused_and_writes_nothing(fold_every, rng):
    cfg = config("gdn", buffer_len=6)
    cache = replayssm.StateCache(cfg)
    d = Driver(cache, rng)
    d.step()
    buffers = {name: b.copy() for name, b in cache.buffers.items()}
    with pytest.raises(ValueError, match="fold_every"):
        d.step(fold_every=fold_every)
    assert all(np.array_equal(cache.buffers[n], b) for n, b in buffers.items())


def test_fold_every_on_an_eager_cache_is_refused(rng):
    d = Driver(replayssm.StateCache(config("mamba2", mode="eager")), rng)
    with pytest.raises(ValueError, match="fold_every applies to replay caches"):
        d.step(fold_every=2)


def test_fold_and_fresh_slots(rng):
    """An explicit fold changes no output; a freed and reallocated slot starts from zero."""
    cfg = config("gdn", buffer_len=8)
    cache = replayssm.StateCache(cfg)
    d = Driver(cache, rng)
    for _ in range(5):
        d.step()
    cache.fold(np.array(d.slots, np.int32))
    assert cache.buffers["folded"][0, d.slots[0]] == 5
    for _ in range(5):
        d.step()
    assert d.max_error <= 1e-5
    slot = d.slots[0]
    cache.free(slot)
    assert not cache.is_allocated(slot)
    assert cache.allocate() == slot
    assert np.all(cache.export_state(0, slot) == 0)
