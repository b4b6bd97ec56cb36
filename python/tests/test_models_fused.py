"""The decode step's fused Triton kernels (replayssm.models.fused) against the plain-torch path
they replace: the RMSNorm variants of both families (with the residual add), the causal conv1d
decode (ring written, output split), the GDN gates, and whole tiny models decoding with and
without them.

On the CPU the kernels run through Triton's interpreter (in a subprocess: it must be switched on
before triton is imported), fp32 and bf16; on the GPU (marker ``cuda``) at the real layouts'
shapes in bf16. One check function serves both.

Tolerances: fp32 agrees to a few float32 ulps (the mean's sum order, exp). In bf16 the kernels
round where the torch path rounds, but a 1-ulp difference of the fp32 value before a rounding
can flip it, and the norm rounds twice (normalised row, weight product): 2 bf16 ulps of the
output's largest value, 2^-6 relative. A wrong group, gate or weight index errs by O(1).
"""

import os
import textwrap

import pytest

torch = pytest.importorskip("torch")

from replayssm.models import ServingCache, fused  # noqa: E402
from replayssm.models import nemotron_h as nh  # noqa: E402
from replayssm.models import qwen3_5 as qw  # noqa: E402
from replayssm.models.base import conv_decode_reference  # noqa: E402

import models_util as mu  # noqa: E402
from models_util import one_cpu_thread  # noqa: E402,F401  (autouse)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6}
#: mu.INTERPRETER_BF16_TOL: in bf16 the conv's 2K + 2 roundings may each be 1 ulp off there.
INTERPRETER_BF16_TOL = mu.INTERPRETER_BF16_TOL

#: (rows, hidden, mamba intermediate, groups, conv channels, GDN value heads x head dim).
TINY = dict(rows=3, hidden=48, inner=64, groups=2, conv=80, heads=2, head_dim=16, B=3)
#: Nemotron-Nano-4B's and Qwen3.5-4B's widths at batch 256.
REAL = dict(rows=256, hidden=3136, inner=7680, groups=8, conv=9728, heads=32, head_dim=128,
            B=256)


def err(got, ref):
    got, ref = got.detach().float(), ref.detach().float()
    return float((got - ref).abs().max() / ref.abs().max())


def check_norms(device, dtype, s):
    """Every family's norm, fused against torch: the worst relative error."""
    g = torch.Generator().manual_seed(1)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device, dtype)

    rows, inner = s["rows"], s["inner"]
    nem = nh._RMSNorm(s["hidden"], 1e-5)
    gated = nh._GatedRMSNorm(inner, inner // s["groups"], 1e-5)
    qn = qw._RMSNorm(s["hidden"], 1e-6)
    gdn = qw._GatedRMSNorm(s["head_dim"], 1e-6)
    for m in (nem, gated, qn, gdn):
        m.to(device, dtype)
        m.weight.data = (m.weight.data + randn(*m.weight.shape, scale=0.1)).to(dtype)
    # x as a strided slice (a projection's output split), gate likewise.
    wide = randn(rows, 1, 2 * inner, scale=3.0)
    x, z = wide[..., :inner], wide[..., inner:]
    h = randn(rows, 1, s["hidden"], scale=3.0)
    o = randn(rows, 1, s["heads"], s["head_dim"], scale=3.0)
    # The GDN's gate: a column slice of the merged input projections' output.
    zo = randn(rows, 1, 3 * s["heads"] * s["head_dim"], scale=3.0)[..., s["head_dim"]:][
        ..., :s["heads"] * s["head_dim"]]
    delta = randn(rows, 1, s["hidden"], scale=3.0)
    cases = {"nemotron": lambda: nem(h), "nemotron-gated": lambda: gated(x, z),
             "nemotron-grouped": lambda: gated(x), "qwen": lambda: qn(h),
             "qwen-gdn-output": lambda: gdn(o, zo),
             # The prefill's form: the scan's fp32 output, the weight and gate in dtype.
             "nemotron-gated-fp32-input": lambda: gated(x.float(), z),
             "nemotron-add": lambda: torch.cat(nem.add(h, delta), -1),
             "qwen-add": lambda: torch.cat(qn.add(h, delta), -1)}
    worst = {}
    for name, fn in cases.items():
        got, ref = mu.both_paths(fn)
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        worst[name] = err(got, ref)
    return worst


def check_gates(device, dtype, s):
    """The GDN's gates, fused against torch: the worst relative error of (g, beta)."""
    gen = torch.Generator().manual_seed(3)
    c = qw.tiny_config(hidden_size=32, linear_num_value_heads=s["heads"])
    m = qw._GatedDeltaNet(c).to(device, dtype)
    with torch.no_grad():
        for p in (m.A_log, m.dt_bias, m.in_proj_a.weight, m.in_proj_b.weight):
            p.copy_(3 * torch.randn(p.shape, generator=gen))
    x = torch.randn(s["rows"], 1, 32, generator=gen).to(device, dtype)
    _, _, b, a = m.project(x)  # column slices of one GEMM's output: strided rows
    (g, beta), (g_ref, beta_ref) = mu.both_paths(lambda: m.gates(a, b))
    assert g.dtype == beta.dtype == torch.float32 and g.shape == g_ref.shape
    return max(err(g, g_ref), err(beta, beta_ref))


def check_activations(device, dtype, s):
    """The MLPs' activations and Qwen3.5 attention's output gate, fused against torch, on column
    slices of one wide tensor (the merged gate-and-up projection's output), and its rotary
    embedding (rotary dims a quarter of the head, as Qwen3.5's): the worst relative error of
    each."""
    gen = torch.Generator().manual_seed(4)
    rows, n, H, D = s["rows"], s["inner"], s["heads"], s["head_dim"]
    wide = (3 * torch.randn(rows, 1, 2 * n + 8, generator=gen)).to(device, dtype)
    gate, up = wide[..., 8:8 + n], wide[..., 8 + n:]
    x = (3 * torch.randn(rows, 1, H, D, generator=gen)).to(device, dtype)
    angle = torch.randn(rows, 1, D // 8, generator=gen) * 100
    cos = torch.cat([angle.cos()] * 2, -1).to(device, dtype)
    sin = torch.cat([angle.sin()] * 2, -1).to(device, dtype)
    attention = qw._Attention(qw.tiny_config())
    worst = {}
    for name, fn in {"silu_mul": lambda: qw._MLP.activation(gate, up),
                     "relu_square": lambda: nh._MLP.activation(gate),
                     "sigmoid_mul": lambda: attention.output_gate(x, up[..., :H * D]),
                     "rope": lambda: qw._rotate(x, cos, sin)}.items():
        got, ref = mu.both_paths(fn)
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        worst[name] = err(got, ref)
    return worst


def check_conv(device, dtype, s, T, bias, ring_dtype=None, oracle=False):
    """The conv decode, fused against torch, on a ring (of ``ring_dtype``, default x's) with
    live and pad rows (one scratch row), x a strided slice: (output error, ring error, splits'
    shapes and contiguity). ``oracle``: the torch path runs in float64 (for fp32 inputs: the
    kernel against exact arithmetic on the same values)."""
    g = torch.Generator().manual_seed(2)
    B, C, K = s["B"], s["conv"], 4
    ring_len = K - 1 + T
    rows = torch.arange(B)
    rows[-1] = B  # a pad row: the scratch row
    lengths = torch.randint(0, 50, (B,), generator=g)
    lengths[-1] = 0
    ring_base = rows[:, None] * ring_len
    write = (ring_base + (lengths[:, None] + torch.arange(T)) % ring_len).reshape(-1)
    read = (ring_base + (lengths[:, None] + torch.arange(-(K - 1), T)) % ring_len).reshape(-1)
    ring = torch.randn((B + 1) * ring_len, C, generator=g).to(device, ring_dtype or dtype)
    wide = torch.randn(B, T, C + 40, generator=g).to(device, dtype)
    x = wide[..., 20:20 + C]
    weight = (0.5 * torch.randn(C, 1, K, generator=g)).to(device, dtype)[:, 0]
    b = (0.1 * torch.randn(C, generator=g)).to(device, dtype) if bias else None
    write, read = write.to(device), read.to(device)
    splits = [C // 2, C // 4, C - C // 2 - C // 4]
    exact = (lambda t: t.double()) if oracle else (lambda t: t)
    rings = [exact(ring.clone()), ring.clone()]
    ref = conv_decode_reference(exact(x), rings[0], write, read, exact(weight),
                                None if b is None else exact(b), "silu")
    outs = fused.conv_decode(x, rings[1], write, read, weight, b, "silu", splits)
    got = torch.cat(outs, -1)
    shapes_ok = all(o.is_contiguous() and o.shape == (B, T, n) for o, n in zip(outs, splits))
    live = slice(0, (B - 1) * ring_len)  # the scratch row's contents do not matter
    return err(got[:-1], ref[:-1]), err(rings[1][live], rings[0][live]), shapes_ok


def check_models(device, dtype, steps=5):
    """Tiny Nemotron-H and Qwen3.5 models decoding ``steps`` tokens (replay, 2-token windows
    then single steps), fused against torch: the worst relative logits error per family."""
    worst = {}
    models = {"nemotron": nh.NemotronHModel.random(nh.NemotronHConfig.tiny(), seed=3,
                                                   device=device, dtype=dtype),
              "qwen": qw.Qwen35Model.random(qw.tiny_config(), seed=3, device=device,
                                            dtype=dtype)}
    for name, model in models.items():
        def run():
            cache = ServingCache(model, capacity=3, max_seq_len=32, mode="replay-fp32:4",
                                 max_spec_tokens=2)
            slots = [cache.allocate() for _ in range(2)]
            for i, slot in enumerate(slots):
                model.prefill(cache, slot, torch.arange(3 + 2 * i, device=device) % 50)
            ids = torch.tensor(slots + [-1], dtype=torch.int32, device=device)
            tokens = torch.tensor([[5, 6], [7, 8], [0, 0]], device=device)
            out = [model.decode(cache, ids, tokens)[:2]]  # pad rows: any values
            model.commit(cache, ids, torch.tensor([2, 1, 0], dtype=torch.int32, device=device))
            tok = tokens[:, 0]
            for _ in range(steps):
                logits = model.step(cache, ids, tok)
                out.append(logits[:2])
                tok = logits.argmax(-1)
            return torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
        got, ref = mu.both_paths(run)
        worst[name] = err(got, ref)
    return worst


# ---- on the CPU, through Triton's interpreter -----------------------------------------------

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import sys
    import test_models_fused as t
    fails = []
    for dtype in (torch.float32, torch.bfloat16):
        tol = t.TOL[dtype] if dtype == torch.float32 else t.INTERPRETER_BF16_TOL
        for name, e in t.check_norms("cpu", dtype, t.TINY).items():
            if not e <= tol:
                fails.append(f"norm {{name}} {{dtype}}: {{e}} > {{tol}}")
        e = t.check_gates("cpu", dtype, t.TINY)
        if not e <= tol:
            fails.append(f"gdn gates {{dtype}}: {{e}} > {{tol}}")
        for name, e in t.check_activations("cpu", dtype, t.TINY).items():
            if not e <= tol:
                fails.append(f"activation {{name}} {{dtype}}: {{e}} > {{tol}}")
        for T in (1, 3):
            for bias in (False, True):
                out, ring, shapes = t.check_conv("cpu", dtype, t.TINY, T, bias)
                if not (out <= tol and ring == 0 and shapes):
                    fails.append(f"conv T={{T}} bias={{bias}} {{dtype}}: output {{out}}, "
                                 f"ring {{ring}}, split shapes {{shapes}}")
    for T in (1, 3):  # fp32 against the float64 oracle
        out, ring, shapes = t.check_conv("cpu", torch.float32, t.TINY, T, True, oracle=True)
        if not (out <= t.TOL[torch.float32] and ring == 0 and shapes):
            fails.append(f"conv T={{T}} fp32 against float64: output {{out}}, ring {{ring}}")
    for name, e in t.check_models("cpu", torch.float32).items():
        if not e <= {model_tol}:
            fails.append(f"model {{name}} fp32: logits {{e}} > {model_tol}")
    sys.exit("\\n".join(fails) or None)
""")

#: Whole tiny models, fp32: the kernels' few-ulp differences through the stack (the GDN output
#: norm divides by each head's RMS, so they grow a little), far below a wrong kernel's O(1).
MODEL_TOL_FP32 = 1e-4


def test_fused_kernels_in_interpreter():
    proc = mu.run_in_triton_interpreter(_INTERPRETER_SCRIPT.format(model_tol=MODEL_TOL_FP32))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_fused_path_is_off_on_the_cpu_and_refuses_bad_arguments():
    x = torch.zeros(2, 1, 8)
    assert not fused.available(x) or os.environ.get("TRITON_INTERPRET") == "1"
    if fused.triton is None:
        pytest.skip("needs the triton package")
    with pytest.raises(ValueError, match="splits"):
        fused.conv_decode(x, torch.zeros(4, 8), torch.zeros(2, dtype=torch.long),
                          torch.zeros(6, dtype=torch.long), torch.zeros(8, 4), None, "silu",
                          [4, 3])
    with pytest.raises(ValueError, match="groups of 3"):
        fused.rms_norm(x, torch.ones(8), 1e-5, group_size=3)
    with pytest.raises(ValueError, match="gate"):
        fused.rms_norm(x, torch.ones(8), 1e-5, gate=x)


def test_weight_constants_are_kept_until_a_weight_changes():
    from replayssm.models.base import weight_constant

    m = torch.nn.Linear(2, 2)
    calls = []

    def neg(w):
        calls.append(1)
        return -w.float()

    first = weight_constant(m, "neg", neg, m.weight)
    assert weight_constant(m, "neg", neg, m.weight) is first and len(calls) == 1
    with torch.no_grad():
        m.weight.mul_(2)  # in place: the version counter moves
    assert torch.equal(weight_constant(m, "neg", neg, m.weight), -m.weight) and len(calls) == 2
    m.weight = torch.nn.Parameter(torch.ones(2, 2))  # another tensor
    assert torch.equal(weight_constant(m, "neg", neg, m.weight), -torch.ones(2, 2))


# ---- on the GPU, at the real layouts' shapes -----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shapes", [TINY, REAL], ids=["tiny", "real"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_norms_on_gpu(shapes, dtype):
    worst = check_norms("cuda", dtype, shapes)
    assert all(e <= TOL[dtype] for e in worst.values()), worst


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_gdn_gates_on_gpu(dtype):
    assert check_gates("cuda", dtype, REAL) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_activations_on_gpu(dtype):
    worst = check_activations("cuda", dtype, REAL)
    assert all(e <= TOL[dtype] for e in worst.values()), worst


@pytest.mark.parametrize("T", [1, 3, 4, 8])
@pytest.mark.parametrize("shapes", [TINY, REAL], ids=["tiny", "real"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_conv_on_gpu(shapes, T):
    for bias in (False, True):
        out, ring, shapes_ok = check_conv("cuda", torch.bfloat16, shapes, T, bias)
        assert out <= TOL[torch.bfloat16] and ring == 0 and shapes_ok, (out, ring, bias)
    # fp32 inputs over a bf16 ring: the window's own taps are rounded as the ring holds them.
    # (GPU only: Triton's interpreter truncates fp32 to bf16 where the GPU rounds to nearest.)
    out, ring, shapes_ok = check_conv("cuda", torch.float32, shapes, T, True, torch.bfloat16)
    assert out <= TOL[torch.float32] and ring == 0 and shapes_ok, (out, ring)
    # fp32 against the float64 oracle.
    out, ring, shapes_ok = check_conv("cuda", torch.float32, shapes, T, True, oracle=True)
    assert out <= TOL[torch.float32] and ring == 0 and shapes_ok, (out, ring)


@pytest.mark.parametrize("where", mu.DEVICES_FP32[1:] + mu.DEVICES[1:])
def test_fused_models_on_gpu(where):
    device, dtype = where
    worst = check_models(device, dtype)
    tol = MODEL_TOL_FP32 if dtype == torch.float32 else mu.BF16_ACTIVATIONS_TOLERANCE
    assert all(e <= tol for e in worst.values()), worst


def test_merged_projections_view_one_weight_and_follow_changes():
    from replayssm.models.merged import MergedLinear

    gen = torch.Generator().manual_seed(5)
    a, b = torch.nn.Linear(6, 4), torch.nn.Linear(6, 3)
    merged = MergedLinear(a, b)
    x = torch.randn(5, 6, generator=gen)
    outs = merged(x)
    assert len(outs) == 2
    for got, module in zip(outs, (a, b)):
        torch.testing.assert_close(got, module(x))
    # 7 output columns padded to 8 (16-byte rows for cuBLAS's fast kernels), the pad left out.
    assert outs[0].stride(0) == 8 and merged._weight.shape == (8, 6)
    assert not merged._weight[7].any() and not merged._bias[7]
    # The modules' weights now view the merged one (no second copy), so a load into a module's
    # weight reaches it.
    assert b.weight.data_ptr() == a.weight.data_ptr() + 4 * 6 * a.weight.element_size()
    with torch.no_grad():
        b.weight.copy_(torch.ones(3, 6))
        b.bias.zero_()
    torch.testing.assert_close(merged(x)[1], x.sum(-1, keepdim=True).expand(5, 3))
    # Moved to another dtype (new storage): merged again, from the moved weights.
    a.double()
    b.double()
    for got, module in zip(merged(x.double()), (a, b)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, module(x.double()))
    # A replaced parameter likewise.
    a.weight = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.float64))
    torch.testing.assert_close(merged(x.double())[0], a.bias.expand(5, 4))
    with pytest.raises(ValueError, match="same input"):
        MergedLinear(a, torch.nn.Linear(5, 2))
    with pytest.raises(ValueError, match="bias"):
        MergedLinear(a, torch.nn.Linear(6, 2, bias=False))
