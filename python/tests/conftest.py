"""Shared pieces of the Python tests: small layer shapes, realistic inputs in every input dtype,
aligned NumPy buffers for views, and a driver that runs a cache step by step against the
float64 oracle (reference.py) with random acceptance."""

import dataclasses
import os

# PyTorch and the library's CPU backend each bring an OpenMP runtime; their idle threads spin by
# default and, on a small CPU, starve each other (tiny model steps ran 10-70x slower). Sleeping
# idle threads must be chosen before either runtime loads, so before any import below.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest

import replayssm
import reference

# Grouped shapes (2 heads per key) and one with no power of two anywhere, so stride bugs show.
SHAPES = {
    "mamba2": dict(num_heads=4, head_dim=8, state_dim=16, num_groups=2),
    "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8),
}
ODD_SHAPES = {
    "mamba2": dict(num_heads=6, head_dim=5, state_dim=7, num_groups=3),
    "gdn": dict(num_k_heads=3, num_v_heads=6, head_k_dim=7, head_v_dim=5),
}


def config(kind, odd=False, **kw):
    kw.setdefault("capacity", 4)
    return replayssm.CacheConfig(kind=kind, **(ODD_SHAPES if odd else SHAPES)[kind], **kw)


# ---- dtypes -------------------------------------------------------------------------------

def bf16_bits(a):
    """float32 -> bfloat16 bits (uint16), rounded to nearest even, as the library rounds."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_value(bits):
    """bfloat16 bits (uint16) -> float32."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_input(values, dtype):
    """(array the cache takes, float32 values it sees) for activations in `dtype`."""
    values = np.asarray(values, np.float32)
    if dtype == "bfloat16":
        bits = bf16_bits(values)
        return bits, bf16_value(bits)
    if dtype == "float16":
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
    return values, values


def from_output(out, dtype):
    return bf16_value(out) if dtype == "bfloat16" else np.asarray(out, np.float32)


def empty_output(shape, dtype):
    """An output array full of NaN (bit patterns included), to see which rows were written."""
    if dtype == "bfloat16":
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, np.nan, np.float16 if dtype == "float16" else np.float32)


# ---- views over caller memory ---------------------------------------------------------------

NUMPY_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16,
                "float8_e4m3fn": np.uint8, "uint8": np.uint8, "uint32": np.uint32}


def aligned_buffers(cfg, fill=0):
    """Every buffer of `cfg` as a NumPy array at the alignment its spec asks (NumPy itself only
    promises 16 bytes), filled with `fill` so that a view that does not zero them shows."""
    out = {}
    for spec in replayssm.cache_buffers(cfg):
        raw = np.full(spec.nbytes + spec.alignment, fill, np.uint8)
        start = -raw.ctypes.data % spec.alignment
        out[spec.name] = (raw[start:start + spec.nbytes]
                          .view(NUMPY_DTYPES[spec.dtype]).reshape(spec.shape))
    return out


def snapshot(cache):
    """Every byte of a CPU cache's buffers."""
    return {name: np.array(a, copy=True) for name, a in cache.buffers.items()}


def assert_same_bytes(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), name


# ---- inputs -------------------------------------------------------------------------------

@dataclasses.dataclass
class LayerParams:
    """Per-layer parameters: Mamba-2 A (< 0), D, dt_bias near -4 (slow decay, long memory)."""
    A: np.ndarray
    D: np.ndarray
    dt_bias: np.ndarray


def layer_params(cfg, rng):
    H = cfg.num_heads
    return [LayerParams(A=-rng.uniform(0.5, 1.5, H).astype(np.float32),
                        D=rng.uniform(-1, 1, H).astype(np.float32),
                        dt_bias=(-4 + rng.uniform(-1, 1, H)).astype(np.float32))
            for _ in range(cfg.num_layers)]


def mamba2_inputs(cfg, rng, batch, T, gate):
    """(kwargs for replayssm.mamba2_decode, float32 values the library sees)."""
    H, P, N, G = cfg.num_heads, cfg.head_dim, cfg.state_dim, cfg.num_groups
    seen, given = {}, {}
    for name, shape in (("x", (batch, T, H, P)), ("B", (batch, T, G, N)), ("C", (batch, T, G, N))):
        given[name], seen[name] = to_input(rng.standard_normal(shape), cfg.input_dtype)
    if gate:
        given["z"], seen["z"] = to_input(rng.standard_normal((batch, T, H, P)), cfg.input_dtype)
    else:
        given["z"] = seen["z"] = None
    given["dt"] = seen["dt"] = (0.5 * rng.standard_normal((batch, T, H))).astype(np.float32)
    return given, seen


def gdn_inputs(cfg, rng, batch, T):
    Hk, Hv, K, V = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    seen, given = {}, {}
    for name, shape in (("q", (batch, T, Hk, K)), ("k", (batch, T, Hk, K)), ("v", (batch, T, Hv, V))):
        given[name], seen[name] = to_input(rng.standard_normal(shape), cfg.input_dtype)
    given["g"] = seen["g"] = (-rng.uniform(0.01, 0.2, (batch, T, Hv))).astype(np.float32)
    given["beta"] = seen["beta"] = (1 / (1 + np.exp(-rng.standard_normal((batch, T, Hv))))).astype(np.float32)
    return given, seen


# ---- the driver -----------------------------------------------------------------------------

class Driver:
    """Runs `cache` (all layers, `batch` allocated slots plus a pad row) step by step beside the
    oracle: every output of every window position against the oracle's, then a commit of a
    random number of the window's tokens, the oracle advancing by the same tokens."""

    def __init__(self, cache, rng, batch=3, gate=True, load_states=True, qk_l2norm=True,
                 scale=None, to_array=None, to_numpy=None):
        self.cache, self.cfg, self.rng = cache, cache.config, rng
        # The arrays the cache takes (default: the NumPy arrays themselves) and back.
        self.to_array = to_array or (lambda a: a)
        self.to_numpy = to_numpy or np.asarray
        self.outputs = []  # the last step's outputs, per layer, as float32 NumPy arrays
        self.gate, self.qk_l2norm, self.scale = gate, qk_l2norm, scale
        self.slots = [cache.allocate() for _ in range(batch)]
        self.params = layer_params(self.cfg, rng) if self.cfg.kind == "mamba2" else None
        shape = self.cfg.state_shape
        self.states = [[np.zeros(shape) for _ in self.slots] for _ in range(self.cfg.num_layers)]
        if load_states:
            for layer in range(self.cfg.num_layers):
                for i, slot in enumerate(self.slots):
                    s = (0.5 * rng.standard_normal(shape)).astype(np.float32)
                    cache.load_state(layer, slot, self.to_array(s))
                    self.states[layer][i] = s.astype(np.float64)
        self.max_error = 0.0  # max |y - y_ref| / max |y_ref| so far, over every output

    def rows(self):
        """Slot ids with a pad row (-1) in the middle: its output must stay untouched."""
        ids = list(self.slots)
        ids.insert(1, -1)
        return np.array(ids, np.int32)

    def step(self, T=1, accept=None, fold_every=0):
        cfg, ids = self.cfg, self.rows()
        batch, arr = len(ids), self.to_array
        outputs = []
        for layer in range(cfg.num_layers):
            if cfg.kind == "mamba2":
                given, seen = mamba2_inputs(cfg, self.rng, batch, T, self.gate)
                p = self.params[layer]
                out = arr(empty_output((batch, T, cfg.num_heads, cfg.head_dim), cfg.input_dtype))
                y = replayssm.mamba2_decode(
                    self.cache, layer, arr(ids), arr(given["x"]), arr(given["dt"]),
                    arr(given["B"]), arr(given["C"]), arr(p.A), arr(p.D), arr(p.dt_bias),
                    z=None if given["z"] is None else arr(given["z"]), out=out,
                    fold_every=fold_every)
            else:
                given, seen = gdn_inputs(cfg, self.rng, batch, T)
                out = arr(empty_output((batch, T, cfg.num_v_heads, cfg.head_v_dim), cfg.input_dtype))
                y = replayssm.gdn_decode(
                    self.cache, layer, arr(ids), arr(given["q"]), arr(given["k"]),
                    arr(given["v"]), arr(given["g"]), arr(given["beta"]), scale=self.scale,
                    qk_l2norm=self.qk_l2norm, out=out, fold_every=fold_every)
            assert y is out
            got = from_output(self.to_numpy(y), cfg.input_dtype)
            assert np.isnan(got[1]).all(), "the pad row's output was written"
            outputs.append((got, seen))
        self.outputs = [got for got, _ in outputs]
        # The oracle: every window position from the committed state.
        k = np.array([T if accept is None else accept(T) for _ in self.slots], np.int32)
        for layer, (got, seen) in enumerate(outputs):
            for i, row in enumerate(r for r in range(batch) if ids[r] >= 0):
                S = self.states[layer][i]
                for t in range(T):
                    S, ref = self._oracle(layer, S, seen, row, t)
                    self._record(got[row, t], ref)
                    if t + 1 == k[i]:
                        self.states[layer][i] = S
        self.cache.commit(arr(np.array(self.slots, np.int32)), arr(k))
        return k

    def _oracle(self, layer, S, seen, b, t):
        if self.cfg.kind == "mamba2":
            p = self.params[layer]
            z = None if seen["z"] is None else seen["z"][b, t]
            return reference.mamba2_step(S, seen["x"][b, t], seen["dt"][b, t], seen["B"][b, t],
                                         seen["C"][b, t], z, p.A, p.D, p.dt_bias)
        return reference.gdn_step(S, seen["q"][b, t], seen["k"][b, t], seen["v"][b, t],
                                  seen["g"][b, t], seen["beta"][b, t], self.qk_l2norm, self.scale)

    def _record(self, got, ref):
        assert np.isfinite(got).all()
        self.max_error = max(self.max_error, float(np.abs(got - ref).max() / np.abs(ref).max()))

    def export_error(self):
        """max |S - S_ref| / max |S_ref| over every layer and slot, through export_state."""
        worst = 0.0
        for layer in range(self.cfg.num_layers):
            for i, slot in enumerate(self.slots):
                ref = self.states[layer][i]
                got = self.to_numpy(self.cache.export_state(layer, slot))
                worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
        return worst


@pytest.fixture
def rng():
    return np.random.default_rng(20261)
