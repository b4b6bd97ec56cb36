"""replayssm.torch: caches over torch tensors and the ops registered with torch.library.

Without PyTorch every test here skips; tests marked `cuda` also skip without a GPU. On the CPU:
torch tensors give the same bytes as NumPy arrays. On CUDA: results against the CPU backend
(tolerances below) and the float64 oracle, a multi-layer step captured in a CUDA graph and
replayed against eager calls, the current and an explicit side stream, torch.library.opcheck,
and torch.compile(fullgraph=True).

CUDA vs CPU, as max|y_cuda - y_cpu| / max|y_cpu| per step: the backends round in another order
(FMA contraction, dot products summed in another order), so fp32 paths agree to ~1e-6; bf16
outputs may round one ulp apart (2^-8 -> 8e-3); a bf16 read copy or state element may round
the other way (2e-3); an fp8 read copy element moves a term by 2^-3 of itself (2e-2)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import replayssm  # noqa: E402
import replayssm.torch as rt  # noqa: E402
from conftest import (Driver, assert_same_bytes, config, gdn_inputs, layer_params,  # noqa: E402
                      mamba2_inputs)
from test_decode import export_tolerance, output_tolerance  # noqa: E402

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and replayssm.cuda_available()),
                          reason="needs a CUDA GPU, PyTorch with CUDA and a CUDA build")


def torch_array(device):
    """NumPy -> torch on `device` (bf16 travels as its uint16 bits, arrives as bfloat16)."""
    def convert(a):
        a = np.ascontiguousarray(a)
        if a.dtype == np.uint16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
        return torch.from_numpy(a).to(device)
    return convert


def to_numpy(t):
    if isinstance(t, np.ndarray):
        return t
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def tensor_snapshot(cache):
    return {name: to_numpy(b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b).copy()
            for name, b in cache.buffers.items()}


def cuda_vs_cpu_tolerance(cfg):
    tol = 8e-3 if cfg.input_dtype == "bfloat16" else 1e-4
    if cfg.mode == "eager" and cfg.state_dtype != "float32" or cfg.checkpoint in ("bf16", "fp32+bf16"):
        tol = max(tol, 2e-3)
    if cfg.mode == "replay" and cfg.checkpoint == "fp32+fp8":
        tol = 2e-2
    return tol


# ---- the CPU ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_torch_cpu_tensors_give_numpy_bytes(kind):
    """The same run with torch CPU tensors and with NumPy arrays: the same bytes everywhere."""
    cfg = config(kind, num_layers=2, checkpoint="fp32+bf16", input_dtype="bfloat16",
                 buffer_len=4, max_spec_tokens=2)
    a = Driver(replayssm.StateCache(cfg), np.random.default_rng(3))
    b = Driver(rt.StateCache(cfg), np.random.default_rng(3), to_array=torch_array("cpu"),
               to_numpy=to_numpy)
    for step in range(9):
        for d in (a, b):
            accept = np.random.default_rng(step)
            d.step(T=2, accept=lambda T: int(accept.integers(0, T + 1)))
        for ya, yb in zip(a.outputs, b.outputs):
            assert np.array_equal(ya, yb, equal_nan=True)
    assert_same_bytes(tensor_snapshot(b.cache), {k: np.array(v) for k, v in a.cache.buffers.items()})
    assert a.max_error <= output_tolerance(cfg, 18)


def test_torch_cpu_errors_leave_the_cache_alone(rng):
    cfg = config("gdn", num_layers=1)
    cache = rt.StateCache(cfg)
    ids = torch.tensor([cache.allocate()], dtype=torch.int32)
    given, _ = gdn_inputs(cfg, rng, 1, 1)
    t = {k: torch.from_numpy(v) for k, v in given.items()}
    before = tensor_snapshot(cache)
    with pytest.raises(ValueError, match=r"^gdn_decode: v has dtype bfloat16, expected float32$"):
        replayssm.gdn_decode(cache, 0, ids, t["q"], t["k"], t["v"].bfloat16(), t["g"], t["beta"])
    with pytest.raises(ValueError, match=r"^gdn_decode: q is not contiguous"):
        q = torch.from_numpy(np.repeat(given["q"], 2, axis=-1))[..., ::2]
        replayssm.gdn_decode(cache, 0, ids, q, t["k"], t["v"], t["g"], t["beta"])
    with pytest.raises(ValueError, match=r"^row 0: slot 3 is not allocated$"):
        replayssm.gdn_decode(cache, 0, torch.tensor([3], dtype=torch.int32), t["q"], t["k"],
                             t["v"], t["g"], t["beta"])
    assert_same_bytes(tensor_snapshot(cache), before)


# ---- CUDA -------------------------------------------------------------------------------------

CUDA_CASES = [
    ("mamba2", "replay", "fp32", "float32", "float32"),
    ("mamba2", "replay", "fp32+bf16", "float32", "bfloat16"),
    ("mamba2", "replay", "fp32+fp8", "float32", "float32"),
    ("mamba2", "eager", "fp32", "bfloat16", "bfloat16"),
    ("gdn", "replay", "fp32", "float32", "float32"),
    ("gdn", "replay", "bf16", "float32", "bfloat16"),
    ("gdn", "replay", "fp32+fp8", "float32", "bfloat16"),
    ("gdn", "eager", "fp32", "float32", "float32"),
]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=["-".join(c) for c in CUDA_CASES])
def test_cuda_matches_cpu_and_oracle(case):
    kind, mode, checkpoint, state_dtype, input_dtype = case
    T = 1 if mode == "eager" else 3
    cfg = config(kind, num_layers=2, mode=mode, checkpoint=checkpoint, state_dtype=state_dtype,
                 input_dtype=input_dtype, buffer_len=4, max_spec_tokens=T)
    cuda_cfg = config(kind, num_layers=2, mode=mode, checkpoint=checkpoint,
                      state_dtype=state_dtype, input_dtype=input_dtype, buffer_len=4,
                      max_spec_tokens=T, device="cuda")
    cpu = Driver(replayssm.StateCache(cfg), np.random.default_rng(11))
    gpu = Driver(rt.StateCache(cuda_cfg), np.random.default_rng(11),
                 to_array=torch_array("cuda"), to_numpy=to_numpy)
    tol = cuda_vs_cpu_tolerance(cfg)
    committed = np.zeros(3, np.int64)
    for step in range(16):
        for d in (cpu, gpu):
            accept = np.random.default_rng(step)
            k = d.step(T=T, accept=lambda T: int(accept.integers(1 if T == 1 else 0, T + 1)))
        committed += k
        for y_cpu, y_gpu in zip(cpu.outputs, gpu.outputs):
            rows = [0, 2, 3]  # row 1 is the pad row (NaN in both)
            err = np.abs(y_gpu[rows] - y_cpu[rows]).max() / np.abs(y_cpu[rows]).max()
            assert err <= tol, f"step {step}: CUDA vs CPU {err:.3g} > {tol}"
    tokens = int(committed.max())
    assert gpu.max_error <= output_tolerance(cfg, tokens) + tol
    assert gpu.export_error() <= export_tolerance(cfg, tokens) + 1e-4


def step_tensors(cfg, rng, batch, T):
    """One step's decode inputs for every layer: per layer, the arrays after slot_ids in the
    op's order, as CUDA tensors."""
    arr = torch_array("cuda")
    if cfg.kind == "mamba2":
        names = ("x", "dt", "B", "C", "z")
        steps = [mamba2_inputs(cfg, rng, batch, T, True)[0] for _ in range(cfg.num_layers)]
    else:
        names = ("q", "k", "v", "g", "beta")
        steps = [gdn_inputs(cfg, rng, batch, T)[0] for _ in range(cfg.num_layers)]
    return [[arr(s[name]) for name in names] for s in steps]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_cuda_graph_of_a_multi_layer_step_equals_eager_calls(kind):
    """Every layer's verify of a 2-token window plus the commit of a device-side count, captured
    once with torch.cuda.graph and replayed with new inputs and counts each step (across
    folds), gives the bytes of the same calls made eagerly."""
    cfg = config(kind, num_layers=3, buffer_len=4, max_spec_tokens=2, checkpoint="fp32+bf16",
                 input_dtype="bfloat16", device="cuda")
    rng = np.random.default_rng(5)
    eager, graphed = rt.StateCache(cfg), rt.StateCache(cfg)
    ids = torch.tensor([eager.allocate(), eager.allocate()], dtype=torch.int32, device="cuda")
    assert [graphed.allocate(), graphed.allocate()] == ids.tolist()
    for layer in range(cfg.num_layers):
        for slot in ids.tolist():
            s = torch.from_numpy(rng.standard_normal(cfg.state_shape).astype(np.float32)).cuda()
            eager.load_state(layer, slot, s)
            graphed.load_state(layer, slot, s)
    arr = torch_array("cuda")
    params = ([[arr(getattr(p, k)) for k in ("A", "D", "dt_bias")] for p in layer_params(cfg, rng)]
              if kind == "mamba2" else None)

    def step(cache, inputs, accepted, outs):
        for layer, args in enumerate(inputs):
            if kind == "mamba2":
                x, dt, B, C, z = args
                replayssm.mamba2_decode(cache, layer, ids, x, dt, B, C, *params[layer], z,
                                        out=outs[layer])
            else:
                replayssm.gdn_decode(cache, layer, ids, *args, out=outs[layer])
        cache.commit(ids, accepted)

    def counts():
        return torch.tensor(rng.integers(0, 3, 2), dtype=torch.int32, device="cuda")

    static, static_accepted = step_tensors(cfg, rng, 2, 2), counts()
    # Outputs are shaped like x (Mamba-2) or v (GDN).
    static_out = [torch.empty_like(args[2] if kind == "gdn" else args[0]) for args in static]
    # One eager step on both (first launches outside the capture), then capture.
    step(eager, static, static_accepted, [torch.empty_like(o) for o in static_out])
    step(graphed, static, static_accepted, static_out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, static, static_accepted, static_out)
    for _ in range(9):
        new, accepted = step_tensors(cfg, rng, 2, 2), counts()
        for dst_args, src_args in zip(static, new):
            for dst, src in zip(dst_args, src_args):
                dst.copy_(src)
        static_accepted.copy_(accepted)
        graph.replay()
        outs = [torch.empty_like(o) for o in static_out]
        step(eager, new, accepted, outs)
        torch.cuda.synchronize()
        for a, b in zip(static_out, outs):
            assert torch.equal(a, b)
    assert_same_bytes(tensor_snapshot(graphed), tensor_snapshot(eager))
    assert eager.buffers["committed"][:2].tolist() != [0, 0]


@cuda
@pytest.mark.cuda
def test_ops_follow_the_current_stream_and_an_explicit_one():
    """Inputs written on a side stream after a delay: a decode on that stream (current, or
    passed as stream=) reads them; one on another stream would read the stale zeros."""
    cfg = config("gdn", num_layers=1, device="cuda")
    rng = np.random.default_rng(9)
    reference, cache = rt.StateCache(cfg), rt.StateCache(cfg)
    ids = torch.tensor([reference.allocate()], dtype=torch.int32, device="cuda")
    cache.allocate()
    given, _ = gdn_inputs(cfg, rng, 1, 1)
    arr = torch_array("cuda")
    t = {k: arr(v) for k, v in given.items()}
    expected = replayssm.gdn_decode(reference, 0, ids, t["q"], t["k"], t["v"], t["g"], t["beta"])
    reference.commit(ids, torch.ones(1, dtype=torch.int32, device="cuda"))
    side = torch.cuda.Stream()
    for explicit in (False, True):
        stale = {k: torch.zeros_like(v) for k, v in t.items()}
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~25 ms on the side stream before the inputs land
            for k in stale:
                stale[k].copy_(t[k])
        if explicit:
            out = replayssm.gdn_decode(cache, 0, ids, stale["q"], stale["k"], stale["v"],
                                       stale["g"], stale["beta"], stream=side)
        else:
            with torch.cuda.stream(side):
                out = replayssm.gdn_decode(cache, 0, ids, stale["q"], stale["k"], stale["v"],
                                           stale["g"], stale["beta"])
        with torch.cuda.stream(side):
            cache.commit(ids, torch.zeros(1, dtype=torch.int32, device="cuda"))
        side.synchronize()
        assert torch.equal(out, expected), f"explicit={explicit}"


@cuda
@pytest.mark.cuda
def test_device_mismatch_is_refused():
    cpu_cache = rt.StateCache(config("gdn", num_layers=1))
    cuda_cache = rt.StateCache(config("gdn", num_layers=1, device="cuda"))
    for cache, device, where in ((cpu_cache, "cuda", r"cuda:0; the cache is on the cpu"),
                                 (cuda_cache, "cpu", r"cpu; the cache is on cuda")):
        slot = cache.allocate()
        given, _ = gdn_inputs(cache.config, np.random.default_rng(1), 1, 1)
        ok = torch_array(cache.config.device)
        t = {k: ok(v) for k, v in given.items()}
        t["k"] = t["k"].to(device)
        before = tensor_snapshot(cache)
        with pytest.raises(ValueError, match=r"^gdn_decode: k is on " + where):
            replayssm.gdn_decode(cache, 0, ok(np.array([slot], np.int32)), t["q"], t["k"], t["v"],
                                 t["g"], t["beta"])
        assert_same_bytes(tensor_snapshot(cache), before)


@cuda
@pytest.mark.cuda
def test_owning_cuda_cache_with_torch_tensors():
    """A cache that allocated its own device memory takes torch tensors too, and its buffers
    come back as DLPack arrays torch can view."""
    cfg = config("mamba2", num_layers=1, device="cuda")
    cache = replayssm.StateCache(cfg)
    d = Driver(cache, np.random.default_rng(2), to_array=torch_array("cuda"), to_numpy=to_numpy)
    for _ in range(5):
        d.step()
    assert d.max_error <= 1e-4
    committed = torch.from_dlpack(cache.buffers["committed"])
    assert committed.device.type == "cuda"
    assert committed.view(torch.int32).tolist()[: len(d.slots)] == [5] * len(d.slots)


def opcheck_args(cache, rng, kind):
    cfg = cache.config
    ids = torch.tensor([cache.allocate(), cache.allocate()], dtype=torch.int32, device="cuda")
    arr = torch_array("cuda")
    if kind == "mamba2":
        given, _ = mamba2_inputs(cfg, rng, 2, 1, True)
        p = layer_params(cfg, rng)[0]
        args = (cache._id, 0, ids, *(arr(given[k]) for k in ("x", "dt", "B", "C")),
                arr(p.A), arr(p.D), arr(p.dt_bias), arr(given["z"]), torch.empty_like(arr(given["x"])),
                cache._buffer_list)
        return ids, args
    given, _ = gdn_inputs(cfg, rng, 2, 1)
    args = (cache._id, 0, ids, *(arr(given[k]) for k in ("q", "k", "v", "g", "beta")), 0.0, True,
            torch.empty_like(arr(given["v"])), cache._buffer_list)
    return ids, args


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_opcheck(kind):
    """torch.library.opcheck on the decode, commit and fold ops. Its checks run the ops on
    copies of the arguments: the ops act on the copies, and the cache itself stays as it was."""
    cfg = config(kind, num_layers=1, buffer_len=4, device="cuda")
    cache = rt.StateCache(cfg)
    rng = np.random.default_rng(4)
    ids, args = opcheck_args(cache, rng, kind)
    decode = getattr(torch.ops.replayssm, f"{kind}_decode").default
    before = tensor_snapshot(cache)
    torch.library.opcheck(decode, args)
    assert_same_bytes(tensor_snapshot(cache), before)
    assert cache.calls_on_other_buffers > 0
    decode(*args)  # now a window is pending: commit it on copies, then for real
    accepted = torch.ones(2, dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.replayssm.commit.default, (cache._id, ids, accepted, cache._buffer_list))
    torch.library.opcheck(torch.ops.replayssm.fold.default, (cache._id, ids, cache._buffer_list))
    cache.commit(ids, accepted)
    assert torch.ops.replayssm.commit.default._schema.arguments[-1].alias_info.is_write


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_torch_compile_fullgraph_equals_eager(kind):
    """A multi-layer step (decodes + commit) under torch.compile(fullgraph=True) gives the bytes
    of eager calls, step after step across folds, on the cache's own buffers (no copies)."""
    cfg = config(kind, num_layers=2, buffer_len=4, checkpoint="fp32+bf16",
                 input_dtype="bfloat16", device="cuda")
    rng = np.random.default_rng(6)
    eager, compiled = rt.StateCache(cfg), rt.StateCache(cfg)
    ids = torch.tensor([eager.allocate(), eager.allocate()], dtype=torch.int32, device="cuda")
    compiled.allocate(), compiled.allocate()
    arr = torch_array("cuda")
    accepted = torch.ones(2, dtype=torch.int32, device="cuda")
    if kind == "mamba2":
        params = [{k: arr(getattr(p, k)) for k in ("A", "D", "dt_bias")}
                  for p in layer_params(cfg, rng)]

        def step(cache, inputs):
            ys = [replayssm.mamba2_decode(cache, layer, ids, *inputs[layer][:4], **params[layer],
                                          z=inputs[layer][4])
                  for layer in range(cfg.num_layers)]
            cache.commit(ids, accepted)
            return torch.stack(ys)

        def inputs():
            return [[arr(g[k]) for k in ("x", "dt", "B", "C", "z")]
                    for g in (mamba2_inputs(cfg, rng, 2, 1, True)[0] for _ in range(cfg.num_layers))]
    else:
        def step(cache, inputs):
            ys = [replayssm.gdn_decode(cache, layer, ids, *inputs[layer])
                  for layer in range(cfg.num_layers)]
            cache.commit(ids, accepted)
            return torch.stack(ys)

        def inputs():
            return [[arr(g[k]) for k in ("q", "k", "v", "g", "beta")]
                    for g in (gdn_inputs(cfg, rng, 2, 1)[0] for _ in range(cfg.num_layers))]

    compiled_step = torch.compile(step, fullgraph=True)
    for _ in range(9):
        x = inputs()
        assert torch.equal(compiled_step(compiled, x), step(eager, x))
    torch.cuda.synchronize()
    assert_same_bytes(tensor_snapshot(compiled), tensor_snapshot(eager))
    assert compiled.calls_on_other_buffers == 0, "the compiled graph ran the ops on copies"
