"""Eager caches with ``max_spec_tokens=T > 1`` on the CPU (per-draft-state speculation): windows
of up to T tokens with random acceptance against the float64 oracle, the commit that selects a
state copy without moving any state, and the calls such a cache refuses.

Tolerances as test_decode.py's: fp32 state 1e-5 of max|y| (max|S| for exports); a bf16 state
is rounded at most once per committed token (a window carries the state in fp32 and rounds
only the copies it stores), each rounding costing at most one unit of 2^-8."""

import numpy as np
import pytest

import replayssm
from conftest import (Driver, assert_same_bytes, config, gdn_inputs, layer_params, mamba2_inputs,
                      snapshot)

BF16_U = 2.0 ** -8
T = 4


def tolerance(cfg, tokens):
    return 1e-5 if cfg.state_dtype == "float32" else (tokens + 2) * BF16_U


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_eager_windows_with_random_acceptance_match_the_oracle(kind, state_dtype, rng):
    """Windows of 1..T tokens, 0..t of them accepted at random, over many steps: every output
    of every window position and the exported states equal the oracle's on the accepted
    stream."""
    cfg = config(kind, num_layers=2, mode="eager", state_dtype=state_dtype, max_spec_tokens=T)
    d = Driver(replayssm.StateCache(cfg), rng)
    accepted = []
    for _ in range(30):
        t = int(rng.integers(1, T + 1))
        accepted.append(d.step(T=t, accept=lambda t: int(rng.integers(0, t + 1))))
    accepted = np.array(accepted)
    assert (accepted == 0).any() and (accepted == T).any()  # rollbacks and full acceptance
    tokens = int(accepted.sum(axis=0).max())
    assert d.max_error <= tolerance(cfg, tokens)
    assert d.export_error() <= tolerance(cfg, tokens)


def decode_window(cache, ids, t, rng, params):
    """Every layer decodes a window of t tokens for the rows `ids`, nothing committed."""
    cfg = cache.config
    for layer in range(cfg.num_layers):
        if cfg.kind == "mamba2":
            given, _ = mamba2_inputs(cfg, rng, len(ids), t, True)
            p = params[layer]
            replayssm.mamba2_decode(cache, layer, ids, given["x"], given["dt"], given["B"],
                                    given["C"], p.A, p.D, p.dt_bias, z=given["z"])
        else:
            given, _ = gdn_inputs(cfg, rng, len(ids), t)
            replayssm.gdn_decode(cache, layer, ids, given["q"], given["k"], given["v"],
                                 given["g"], given["beta"])


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_the_buffers_hold_a_copy_per_draft_and_commit_moves_no_state(kind, rng):
    cfg = config(kind, num_layers=2, mode="eager", max_spec_tokens=T)
    specs = {s.name: s for s in replayssm.cache_buffers(cfg)}
    assert specs["state"].shape == (2, cfg.capacity, T + 1) + tuple(cfg.state_shape)
    assert specs["state_current"].shape == (cfg.capacity,)
    plain = {s.name for s in replayssm.cache_buffers(config(kind, mode="eager"))}
    assert "state_current" not in plain  # T = 1 keeps the in-place layout

    cache = replayssm.StateCache(cfg)
    ids = np.array([cache.allocate(), cache.allocate()], np.int32)
    params = layer_params(cfg, rng) if kind == "mamba2" else None
    for layer in range(2):
        for slot in ids:
            state = (0.5 * rng.standard_normal(cfg.state_shape)).astype(np.float32)
            cache.load_state(layer, slot, state)
    for accepted in ([0, 3], [1, 0], [3, 2]):
        before = [[cache.export_state(layer, s) for s in ids] for layer in range(2)]
        decode_window(cache, ids, 3, rng, params)
        states = np.array(cache.buffers["state"], copy=True)
        current = np.array(cache.buffers["state_current"], copy=True)
        cache.commit(ids, np.array(accepted, np.int32))
        # Only cursors move: the state copies are the same bytes before and after the commit.
        assert np.array_equal(cache.buffers["state"].view(np.uint8), states.view(np.uint8))
        assert [int(cache.buffers["state_current"][s]) for s in ids] == [
            (int(current[s]) + k) % (T + 1) for s, k in zip(ids, accepted)]
        for layer in range(2):
            for i, slot in enumerate(ids):
                same = np.array_equal(cache.export_state(layer, slot), before[layer][i])
                assert same == (accepted[i] == 0)  # commit(0): the state, bit for bit


def test_refused_windows_leave_the_cache_untouched(rng):
    cfg = config("mamba2", mode="eager", max_spec_tokens=2)
    cache = replayssm.StateCache(cfg)
    ids = np.array([cache.allocate(), cache.allocate()], np.int32)
    p = layer_params(cfg, rng)[0]

    def decode(t):
        given, _ = mamba2_inputs(cfg, rng, 2, t, True)
        return replayssm.mamba2_decode(cache, 0, ids, given["x"], given["dt"], given["B"],
                                       given["C"], p.A, p.D, p.dt_bias, z=given["z"])

    before = snapshot(cache)
    with pytest.raises(ValueError, match="wider than the cache's max_spec_tokens"):
        decode(3)
    assert_same_bytes(before, snapshot(cache))
    decode(2)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="uncommitted window"):
        decode(1)  # the window must be committed first (the CPU refuses, as for replay)
    with pytest.raises(ValueError, match="cannot commit 3"):
        cache.commit(ids, np.array([3, 1], np.int32))
    assert_same_bytes(before, snapshot(cache))
    cache.commit(ids, np.array([2, 0], np.int32))
    decode(1)
