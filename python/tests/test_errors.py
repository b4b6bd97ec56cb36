"""Bad input raises a Python exception with the library's (or the binding's) message and
leaves every byte of the cache, and the output array, as it was."""

import numpy as np
import pytest

import replayssm
from conftest import config, mamba2_inputs, gdn_inputs, layer_params, snapshot, assert_same_bytes


@pytest.fixture
def m2(rng):
    """A 2-layer Mamba-2 replay cache (T <= 2) with two slots that have decoded and committed a
    few tokens, and one step's arguments for those slots."""
    cfg = config("mamba2", num_layers=2, buffer_len=4, max_spec_tokens=2)
    cache = replayssm.StateCache(cfg)
    slots = np.array([cache.allocate(), cache.allocate()], np.int32)
    p = layer_params(cfg, rng)[0]
    for _ in range(3):
        for layer in range(2):
            given, _ = mamba2_inputs(cfg, rng, 2, 1, True)
            replayssm.mamba2_decode(cache, layer, slots, given["x"], given["dt"], given["B"],
                                    given["C"], p.A, p.D, p.dt_bias, z=given["z"])
        cache.commit(slots, np.ones(2, np.int32))
    given, _ = mamba2_inputs(cfg, rng, 2, 1, True)
    args = dict(slot_ids=slots, x=given["x"], dt=given["dt"], B=given["B"], C=given["C"],
                A=p.A, D=p.D, dt_bias=p.dt_bias, z=given["z"])
    return cache, args


def decode(cache, layer=0, **args):
    return replayssm.mamba2_decode(cache, layer, **args)


def expect_unchanged(cache, call, error, match):
    """`call(out)` raises `error` matching `match`; no byte of the cache or `out` changed."""
    before = snapshot(cache)
    out = np.full((2, 1, 4, 8), 7.0, np.float32)
    with pytest.raises(error, match=match):
        call(out)
    assert_same_bytes(snapshot(cache), before)
    assert np.all(out == 7.0)


def with_arg(args, **changes):
    return {**args, **changes}


BAD_DECODES = {
    # The library's checks (what varies per call).
    "unallocated slot": (dict(slot_ids=np.array([0, 3], np.int32)), ValueError,
                         r"^row 1: slot 3 is not allocated$"),
    "slot out of range": (dict(slot_ids=np.array([0, 9], np.int32)), ValueError,
                          r"^row 1: slot 9 out of range \[0, 4\)$"),
    "repeated slot": (dict(slot_ids=np.array([1, 1], np.int32)), ValueError,
                      r"^row 1: slot 1 appears twice in one batch$"),
    "A not negative": (dict(A=np.zeros(4, np.float32)), ValueError,
                       r"^mamba2_decode: A\[0\] = 0; A must be negative and finite \(a decay\)$"),
    "D not finite": (dict(D=np.full(4, np.inf, np.float32)), ValueError, r"D must be finite"),
    # The binding's checks of the arrays against the cache's configuration.
    "x shape": (dict(x=np.zeros((2, 1, 4, 9), np.float32)), ValueError,
                r"^mamba2_decode: x has shape \[2, 1, 4, 9\], expected \[2, 1, 4, 8\] "
                r"\(\[batch, T, nheads, head_dim\]\)$"),
    "x axes": (dict(x=np.zeros((2, 4, 8), np.float32)), ValueError,
               r"^mamba2_decode: x has shape \[2, 4, 8\], expected 4 axes"),
    "B batch": (dict(B=np.zeros((3, 1, 2, 16), np.float32)), ValueError, r"B has shape \[3, 1, 2, 16\]"),
    "x dtype": (dict(x=np.zeros((2, 1, 4, 8), np.float64)), ValueError,
                r"^mamba2_decode: x has dtype float64, expected float32$"),
    "dt dtype": (dict(dt=np.zeros((2, 1, 4), np.float16)), ValueError, r"dt has dtype float16"),
    "slot ids dtype": (dict(slot_ids=np.array([0, 1], np.int64)), ValueError,
                       r"slot_ids has dtype int64, expected int32"),
    "x not contiguous": (dict(x=np.zeros((2, 1, 8, 8), np.float32)[:, :, ::2]), ValueError,
                         r"^mamba2_decode: x is not contiguous"),
    "z transposed": (dict(z=np.zeros((8, 4, 1, 2), np.float32).T), ValueError, r"z is not contiguous"),
    "A not an array": (dict(A=[-1.0, -1.0, -1.0, -1.0]), TypeError,
                       r"^mamba2_decode: A must be a DLPack array"),
}


@pytest.mark.parametrize("case", BAD_DECODES, ids=list(BAD_DECODES))
def test_bad_decode_arguments(m2, case):
    cache, args = m2
    changes, error, match = BAD_DECODES[case]
    expect_unchanged(cache, lambda out: decode(cache, out=out, **with_arg(args, **changes)),
                     error, match)


def test_bad_layer_window_and_kind(m2, rng):
    cache, args = m2
    expect_unchanged(cache, lambda out: decode(cache, layer=2, out=out, **args), ValueError,
                     r"^layer 2 out of range \[0, 2\)$")
    wide = {k: (np.concatenate([v] * 3, axis=1) if k in ("x", "dt", "B", "C", "z") else v)
            for k, v in args.items()}
    expect_unchanged(cache, lambda out: decode(cache, out=np.zeros((2, 3, 4, 8), np.float32), **wide),
                     ValueError, r"window of 3 tokens is wider than the cache's max_spec_tokens \(2\)")
    gdn_cfg = config("gdn")
    given, _ = gdn_inputs(gdn_cfg, rng, 2, 1)
    expect_unchanged(cache, lambda out: replayssm.gdn_decode(cache, 0, args["slot_ids"], **given),
                     ValueError, r"^gdn_decode on a mamba2 state cache$")


def test_read_only_output(m2):
    cache, args = m2
    out = np.zeros((2, 1, 4, 8), np.float32)
    out.flags.writeable = False
    before = snapshot(cache)
    with pytest.raises(TypeError, match=r"out must be a writable DLPack array"):
        decode(cache, out=out, **args)
    assert_same_bytes(snapshot(cache), before)


def test_second_decode_before_commit(m2):
    cache, args = m2
    decode(cache, **args)
    expect_unchanged(cache, lambda out: decode(cache, out=out, **args), ValueError,
                     r"layer 0 already holds an uncommitted window of 1 tokens")


def test_bad_commits(m2):
    cache, args = m2
    ids = args["slot_ids"]
    decode(cache, layer=0, **args)
    # Layer 1 has not decoded this window yet.
    expect_unchanged(cache, lambda out: cache.commit(ids, np.ones(2, np.int32)), ValueError,
                     r"layer 1 decoded 0 tokens of this window but layer 0 decoded 1")
    decode(cache, layer=1, **args)
    expect_unchanged(cache, lambda out: cache.commit(ids, np.array([1, 2], np.int32)),
                     ValueError, r"^row 1 \(slot 1\): cannot commit 2 tokens; the last decode appended 1$")
    expect_unchanged(cache, lambda out: cache.commit(ids, np.ones(3, np.int32)), ValueError,
                     r"^commit: accepted has shape \[3\], expected \[2\]")
    cache.commit(ids, np.array([1, 0], np.int32))


def test_bad_slot_management(m2):
    cache, _ = m2
    expect_unchanged(cache, lambda out: cache.free(3), ValueError, r"^slot 3 is not allocated$")
    expect_unchanged(cache, lambda out: cache.claim(1), ValueError, r"^slot 1 is in use$")
    expect_unchanged(cache, lambda out: cache.claim(4), ValueError, r"^slot 4 out of range \[0, 4\)$")
    cache.claim(3)
    cache.allocate()
    expect_unchanged(cache, lambda out: cache.allocate(), MemoryError, r"^state cache is full \(4 slots\)$")


def test_bad_load_and_export(m2):
    cache, _ = m2
    shape = cache.config.state_shape
    bad = np.zeros(shape, np.float32)
    bad[1, 2, 3] = np.nan
    expect_unchanged(cache, lambda out: cache.load_state(0, 0, bad), ValueError,
                     r"^state\[\d+\] is nan; a loaded state must be finite$")
    expect_unchanged(cache, lambda out: cache.load_state(0, 0, np.zeros((4, 8, 15), np.float32)),
                     ValueError, r"^load_state: state has shape \[4, 8, 15\], expected \[4, 8, 16\]")
    expect_unchanged(cache, lambda out: cache.load_state(0, 2, np.zeros(shape, np.float32)),
                     ValueError, r"^slot 2 is not allocated$")
    expect_unchanged(cache, lambda out: cache.export_state(0, 0, np.zeros(shape, np.float64)),
                     ValueError, r"^export_state: out has dtype float64, expected float32$")


def test_bad_configs():
    with pytest.raises(ValueError, match=r"^buffer_len \(L\) must be in \[1, 4096\], got 0$"):
        config("mamba2", buffer_len=0)
    with pytest.raises(ValueError, match=r"^nheads must be a multiple of ngroups$"):
        replayssm.CacheConfig(kind="mamba2", num_heads=4, head_dim=8, state_dim=16, num_groups=3,
                              capacity=2)
    with pytest.raises(ValueError, match=r"^unknown checkpoint 'fp16'"):
        config("gdn", checkpoint="fp16")
    with pytest.raises(ValueError, match=r"^unsupported input_dtype 'int8'"):
        config("gdn", input_dtype="int8")
    with pytest.raises(ValueError, match=r"^unknown kind 'rwkv'"):
        replayssm.CacheConfig(kind="rwkv", capacity=1)
    with pytest.raises(TypeError, match=r"^a gdn CacheConfig needs num_k_heads"):
        replayssm.CacheConfig(kind="gdn", capacity=1, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    with pytest.raises(TypeError, match=r"num_heads belong to the other layer kind"):
        config("gdn", num_heads=4)
    with pytest.raises(ValueError, match=r"^capacity must be >= 1 slot$"):
        config("gdn", capacity=0)


@pytest.mark.skipif(replayssm.cuda_available(), reason="a GPU is present")
def test_cuda_cache_without_a_gpu():
    cfg = config("mamba2", device="cuda")
    with pytest.raises(NotImplementedError):
        replayssm.StateCache(cfg)
