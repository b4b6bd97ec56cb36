"""Caches that apply the layer's causal conv1d in their decodes (``CacheConfig.conv_kernel``),
through the Python API, against a cache without one fed the conv's outputs: the conv in float64
over each row's accepted pre-conv inputs (conv window loaded after a "prefill", then every
committed token), SiLU, rounded to the input dtype. Speculative windows with random acceptance,
rows at different positions, several fold cycles, pre-conv inputs as a column slice of a wider
projection output; then the conv window's load/export and every refusal (nothing written).

The conv cache's own arithmetic (fp32 fmaf in tap order, tests/test_conv.cpp checks it against
the float64 oracle) and the reference's float64 one round to the same input-dtype value except
near a rounding boundary: fp32 inputs agree to 1e-5 of max|y|, bf16 to a few bf16 units."""

import numpy as np
import pytest

import replayssm
from conftest import (config, from_output, gdn_inputs, layer_params, mamba2_inputs, snapshot,
                      assert_same_bytes, to_input)
import reference

K = 4
TOL = {"float32": 1e-5, "bfloat16": 6 * 2.0 ** -8}


def conv_splits(cfg):
    """The conv channels' split into the op's inputs, in the models' order."""
    if cfg.kind == "mamba2":
        gn = cfg.num_groups * cfg.state_dim
        return {"x": (cfg.num_heads, cfg.head_dim), "B": (cfg.num_groups, cfg.state_dim),
                "C": (cfg.num_groups, cfg.state_dim)}, [cfg.num_heads * cfg.head_dim, gn, gn]
    kk = cfg.num_k_heads * cfg.head_k_dim
    return {"q": (cfg.num_k_heads, cfg.head_k_dim), "k": (cfg.num_k_heads, cfg.head_k_dim),
            "v": (cfg.num_v_heads, cfg.head_v_dim)}, [kk, kk, cfg.num_v_heads * cfg.head_v_dim]


class ConvReference:
    """Each row's accepted pre-conv inputs (float64, the values the cache sees), and the conv
    of a window over them: SiLU(bias + sum_i w[c, i] * in(p - (K - 1) + i))."""

    def __init__(self, windows, weight, bias):
        self.history = [list(w) for w in windows]  # per row: [C] arrays, oldest first
        self.weight = weight.astype(np.float64)
        self.bias = None if bias is None else bias.astype(np.float64)

    def window(self, row, tokens):
        """tokens [T, C] -> conv outputs [T, C] (float64)."""
        seq = self.history[row][-(K - 1):] + list(tokens)
        out = []
        for t in range(len(tokens)):
            taps = np.stack(seq[t:t + K])  # [K, C]
            u = np.einsum("kc,ck->c", taps, self.weight)
            if self.bias is not None:
                u = u + self.bias
            out.append(reference.silu(u))
        return np.stack(out)

    def commit(self, row, tokens):
        self.history[row].extend(tokens)


def run_pair(kind, input_dtype, rng, steps=24, T=2, bias=True, fold_every=(0,)):
    """Decodes the same streams through a conv cache and a plain cache fed the reference conv,
    step s folding every fold_every[s % len] tokens (0: L) in both, whose fold cursors must
    agree after every step; returns the worst relative output difference."""
    common = dict(num_layers=1, buffer_len=4, max_spec_tokens=T, input_dtype=input_dtype)
    conv_cfg = config(kind, conv_kernel=K, **common)
    plain_cfg = config(kind, **common)
    conv_cache, plain = replayssm.StateCache(conv_cfg), replayssm.StateCache(plain_cfg)
    shapes, widths = conv_splits(conv_cfg)
    C = conv_cfg.conv_channels
    assert sum(widths) == C and conv_cfg.conv_window_shape == (K - 1, C)
    batch = 3
    slots = [conv_cache.allocate() for _ in range(batch)]
    assert [plain.allocate() for _ in range(batch)] == slots
    # A "prefill": the same state in both caches, a random conv window in the conv cache.
    windows = []
    for s in slots:
        state = (0.3 * rng.standard_normal(conv_cfg.state_shape)).astype(np.float32)
        conv_cache.load_state(0, s, state)
        plain.load_state(0, s, state)
        given, seen = to_input(rng.standard_normal((K - 1, C)), input_dtype)
        conv_cache.load_conv_window(0, s, given)
        assert np.array_equal(conv_cache.export_conv_window(0, s), given)
        windows.append(seen.astype(np.float64))
    weight = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    b = (0.1 * rng.standard_normal(C)).astype(np.float32) if bias else None
    ref = ConvReference(windows, weight, b)
    params = layer_params(conv_cfg, rng)[0] if kind == "mamba2" else None
    ids = np.array(slots, np.int32)
    worst = 0.0
    for step in range(steps):
        every = fold_every[step % len(fold_every)]
        # Pre-conv inputs: a column slice of a wider [batch, T, width] projection output.
        wide = rng.standard_normal((batch, T, C + 12))
        given, seen = to_input(wide, input_dtype)
        pre, pre_seen = given[..., 5:5 + C], seen[..., 5:5 + C].astype(np.float64)
        conv_out = np.stack([ref.window(r, pre_seen[r]) for r in range(batch)])
        post, _ = to_input(conv_out, input_dtype)
        parts, start = {}, 0
        for (name, hd), w in zip(shapes.items(), widths):
            parts[name] = np.ascontiguousarray(post[..., start:start + w]).reshape(
                batch, T, *hd)
            start += w
        conv = replayssm.ConvInputs(pre, weight, b)
        if kind == "mamba2":
            extra, _ = mamba2_inputs(conv_cfg, rng, batch, T, gate=True)
            args = (extra["dt"],)
            tail = (params.A, params.D, params.dt_bias, extra["z"])
            got = replayssm.mamba2_decode(conv_cache, 0, ids, None, *args, None, None, *tail,
                                          conv=conv, fold_every=every)
            want = replayssm.mamba2_decode(plain, 0, ids, parts["x"], *args, parts["B"],
                                           parts["C"], *tail, fold_every=every)
        else:
            extra, _ = gdn_inputs(conv_cfg, rng, batch, T)
            got = replayssm.gdn_decode(conv_cache, 0, ids, None, None, None, extra["g"],
                                       extra["beta"], conv=conv, fold_every=every)
            want = replayssm.gdn_decode(plain, 0, ids, parts["q"], parts["k"], parts["v"],
                                        extra["g"], extra["beta"], fold_every=every)
        got, want = from_output(got, input_dtype), from_output(want, input_dtype)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
        # Rows at different positions: each accepts 1..T tokens (rejected drafts overwritten).
        accepted = rng.integers(1, T + 1, batch).astype(np.int32)
        conv_cache.commit(ids, accepted)
        plain.commit(ids, accepted)
        assert np.array_equal(conv_cache.buffers["folded"], plain.buffers["folded"]), step
        for r in range(batch):
            ref.commit(r, list(pre_seen[r, :accepted[r]]))
    return worst


@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_conv_cache_equals_plain_cache_fed_the_conv(kind, input_dtype, rng):
    assert run_pair(kind, input_dtype, rng) <= TOL[input_dtype]


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_conv_cache_under_a_cycling_fold_cadence(kind, rng):
    """The cadence reaches a conv cache's decodes as a plain cache's: the same folds (cursors)
    and outputs, folding every 1, 3 or 2 tokens or every L (0) by turns."""
    assert run_pair(kind, "float32", rng, steps=16, T=1, fold_every=(1, 3, 0, 2)) <= \
        TOL["float32"]


def test_conv_without_bias_and_plain_decoding(rng):
    assert run_pair("gdn", "float32", rng, steps=12, T=1, bias=False) <= TOL["float32"]


def test_a_wrong_conv_weight_is_caught(rng, monkeypatch):
    """The comparison can fail: the conv cache given a weight with one tap off."""
    real = replayssm.ConvInputs

    def shifted(inputs, weight, bias=None):
        weight = weight.copy()
        weight[:, 0] += 0.25
        return real(inputs, weight, bias)

    monkeypatch.setattr(replayssm, "ConvInputs", shifted)
    assert run_pair("mamba2", "float32", rng, steps=4) > 1e-3


def test_refusals_leave_the_cache_untouched(rng):
    cfg = config("gdn", conv_kernel=K, num_layers=1, buffer_len=4)
    plain_cfg = config("gdn", num_layers=1, buffer_len=4)
    cache, plain = replayssm.StateCache(cfg), replayssm.StateCache(plain_cfg)
    s = cache.allocate()
    plain.allocate()
    C = cfg.conv_channels
    ids = np.array([s], np.int32)
    g = np.full((1, 1, cfg.num_v_heads), -0.1, np.float32)
    beta = np.full((1, 1, cfg.num_v_heads), 0.5, np.float32)
    weight = np.zeros((C, K), np.float32)
    pre = np.zeros((1, 1, C), np.float32)
    inputs, _ = gdn_inputs(cfg, rng, 1, 1)
    before = snapshot(cache)
    cases = [
        (lambda: replayssm.gdn_decode(cache, 0, ids, inputs["q"], None, None, g, beta,
                                      conv=replayssm.ConvInputs(pre, weight)),
         "takes the pre-conv inputs"),
        (lambda: replayssm.gdn_decode(cache, 0, ids, None, None, None, g, beta),
         "takes conv=ConvInputs"),
        (lambda: replayssm.gdn_decode(cache, 0, ids, None, None, None, g, beta,
                                      out=np.zeros((1, 1, cfg.num_v_heads, cfg.head_v_dim),
                                                   np.float32)),
         "needs conv_in and conv_weight"),
        (lambda: replayssm.gdn_decode(cache, 0, ids, None, None, None, g, beta,
                                      conv=replayssm.ConvInputs(pre[..., 1:], weight)),
         "conv_channels"),
        (lambda: replayssm.gdn_decode(cache, 0, ids, None, None, None, g, beta,
                                      conv=replayssm.ConvInputs(pre, weight[:, :2].copy())),
         "conv_kernel"),
        (lambda: replayssm.gdn_decode(cache, 0, ids, None, None, None, g, beta,
                                      conv=replayssm.ConvInputs(pre.astype(np.float16), weight)),
         "dtype"),
        (lambda: replayssm.gdn_decode(cache, 0, ids, None, None, None, g, beta,
                                      conv=replayssm.ConvInputs(
                                          np.zeros((1, 2 * C, 1), np.float32)[:, ::2]
                                          .reshape(1, 1, C), weight)),
         "contiguous"),
        (lambda: cache.load_conv_window(0, s, np.zeros((K, C), np.float32)), "conv_kernel - 1"),
        (lambda: cache.load_conv_window(0, s + 1, np.zeros((K - 1, C), np.float32)), "slot"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert_same_bytes(snapshot(cache), before)
    plain_before = snapshot(plain)
    for call, message in [
        (lambda: replayssm.gdn_decode(plain, 0, ids, None, None, None, g, beta,
                                      conv=replayssm.ConvInputs(pre, weight)),
         "needs a cache with conv_kernel > 0"),
        (lambda: plain.load_conv_window(0, s, np.zeros((K - 1, C), np.float32)),
         "no conv window"),
        (lambda: plain.export_conv_window(0, s), "no conv window"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
        assert_same_bytes(snapshot(plain), plain_before)
    with pytest.raises(ValueError, match="conv_kernel"):
        config("gdn", conv_kernel=1)
    with pytest.raises((ValueError, NotImplementedError), match="conv"):
        config("gdn", conv_kernel=K, mode="eager")


def test_torch_cache_takes_a_slice_of_a_projection(rng):
    torch = pytest.importorskip("torch")
    import replayssm.torch as rt

    cfg = config("mamba2", conv_kernel=K, num_layers=1, buffer_len=4)
    numpy_cache, torch_cache = replayssm.StateCache(cfg), rt.StateCache(cfg)
    s = numpy_cache.allocate()
    assert torch_cache.allocate() == s
    C = cfg.conv_channels
    window = rng.standard_normal((K - 1, C)).astype(np.float32)
    numpy_cache.load_conv_window(0, s, window)
    torch_cache.load_conv_window(0, s, torch.from_numpy(window))
    assert torch.equal(torch_cache.export_conv_window(0, s), torch.from_numpy(window))
    p = layer_params(cfg, rng)[0]
    ids = np.array([s], np.int32)
    for _ in range(6):
        proj = rng.standard_normal((1, 1, C + 7)).astype(np.float32)
        weight = rng.standard_normal((C, K)).astype(np.float32)
        extra, _ = mamba2_inputs(cfg, rng, 1, 1, gate=False)
        a = replayssm.mamba2_decode(numpy_cache, 0, ids, None, extra["dt"], None, None, p.A, p.D,
                                    p.dt_bias, conv=replayssm.ConvInputs(proj[..., 3:3 + C],
                                                                         weight))
        t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
        b = replayssm.mamba2_decode(torch_cache, 0, t(ids), None, t(extra["dt"]), None, None,
                                    t(p.A), t(p.D), t(p.dt_bias),
                                    conv=replayssm.ConvInputs(t(proj)[..., 3:3 + C], t(weight)))
        assert isinstance(b, torch.Tensor) and b.shape == a.shape
        np.testing.assert_array_equal(b.numpy(), a)
        numpy_cache.commit(ids, np.ones(1, np.int32))
        torch_cache.commit(t(ids), torch.ones(1, dtype=torch.int32))


def test_restore_takes_every_layers_conv_window(rng):
    cfg = config("mamba2", conv_kernel=K, num_layers=2, buffer_len=4)
    cache = replayssm.StateCache(cfg)
    s = cache.allocate()
    states = (0.3 * rng.standard_normal((2, *cfg.state_shape))).astype(np.float32)
    windows = rng.standard_normal((2, *cfg.conv_window_shape)).astype(np.float32)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="conv_window is null"):
        cache.restore(s, 5, states)
    with pytest.raises(ValueError, match="conv_kernel - 1"):
        cache.restore(s, 5, states, conv_window=windows[:, 1:])
    assert_same_bytes(snapshot(cache), before)
    cache.restore(s, 5, states, conv_window=windows)
    for layer in range(2):
        assert np.array_equal(cache.export_conv_window(layer, s), windows[layer])
        np.testing.assert_array_equal(cache.export_state(layer, s), states[layer])
    plain = replayssm.StateCache(config("mamba2", num_layers=2, buffer_len=4))
    p = plain.allocate()
    plain_before = snapshot(plain)
    with pytest.raises(ValueError, match="no conv window"):
        plain.restore(p, 5, states, conv_window=windows)
    assert_same_bytes(snapshot(plain), plain_before)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_cuda_conv_cache_equals_the_cpu_one(kind, rng):
    """The same stream through a CUDA conv cache (replayssm.torch, device tensors, pre-conv
    inputs a slice of a projection output) and the CPU one checked above; the CUDA step also
    under torch.compile(fullgraph=True), on its own cache, with the same bytes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import replayssm.torch as rt

    common = dict(num_layers=1, buffer_len=4, max_spec_tokens=2, conv_kernel=K)
    # Real head sizes: the tuned CUDA kernels take conv caches (the generic ones refuse them).
    shape = (dict(num_heads=8, head_dim=64, state_dim=128, num_groups=2) if kind == "mamba2"
             else dict(num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128))
    cpu_cfg = replayssm.CacheConfig(kind=kind, capacity=4, **shape, **common)
    cuda_cfg = replayssm.CacheConfig(kind=kind, capacity=4, device="cuda", **shape, **common)
    cpu, gpu, compiled = (replayssm.StateCache(cpu_cfg), rt.StateCache(cuda_cfg),
                          rt.StateCache(cuda_cfg))
    C, batch, T = cpu_cfg.conv_channels, 2, 2
    slots = [cpu.allocate() for _ in range(batch)]
    for cache in (gpu, compiled):
        assert [cache.allocate() for _ in range(batch)] == slots
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    for s in slots:
        state = (0.3 * rng.standard_normal(cpu_cfg.state_shape)).astype(np.float32)
        window = rng.standard_normal(cpu_cfg.conv_window_shape).astype(np.float32)
        cpu.load_state(0, s, state)
        cpu.load_conv_window(0, s, window)
        for cache in (gpu, compiled):
            cache.load_state(0, s, dev(state))
            cache.load_conv_window(0, s, dev(window))
    weight = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    bias = (0.1 * rng.standard_normal(C)).astype(np.float32)
    ids = np.array(slots, np.int32)
    p = layer_params(cpu_cfg, rng)[0] if kind == "mamba2" else None

    def step(cache, ids, proj, weight, bias, extra, accepted):
        conv = replayssm.ConvInputs(proj[..., 3:3 + C], weight, bias)
        if kind == "mamba2":
            y = replayssm.mamba2_decode(cache, 0, ids, None, extra[0], None, None, *extra[1:],
                                        conv=conv)
        else:
            y = replayssm.gdn_decode(cache, 0, ids, None, None, None, *extra, conv=conv)
        cache.commit(ids, accepted)
        return y

    compiled_step = torch.compile(step, fullgraph=True)
    worst = 0.0
    for _ in range(12):
        proj = rng.standard_normal((batch, T, C + 8)).astype(np.float32)
        if kind == "mamba2":
            given, _ = mamba2_inputs(cpu_cfg, rng, batch, T, gate=False)
            extra = (given["dt"], p.A, p.D, p.dt_bias)
        else:
            given, _ = gdn_inputs(cpu_cfg, rng, batch, T)
            extra = (given["g"], given["beta"])
        accepted = rng.integers(1, T + 1, batch).astype(np.int32)
        want = step(cpu, ids, proj, weight, bias, extra, accepted)
        args = (dev(ids), dev(proj), dev(weight), dev(bias), tuple(dev(e) for e in extra),
                dev(accepted))
        got = step(gpu, *args)
        assert torch.equal(compiled_step(compiled, *args), got)
        got = got.cpu().numpy()
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    assert worst <= 1e-5
