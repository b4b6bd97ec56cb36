"""Routed experts (replayssm.models.moe) against a float64 loop over the experts and the tokens
that chose them: both activations, fp32 and bf16, through PyTorch's grouped product and through
the every-expert-on-every-row path that replaces it where it does not apply; experts no token
chose; a token's output alone and in a batch; the same bits run after run. The fused path (Triton
activation and weighted sum) likewise, through Triton's interpreter on the CPU and on the GPU at
the 30B-A3B layouts' widths, against the oracle and the torch path.

Tolerances: fp32 agrees to float32 rounding of sums of H and I terms (1e-5 relative to the
output's scale); bf16 rounds the two products, the activation and the weighted sum (2^-6 of
the output's largest value). A wrong expert, weight or token order errs by O(1).
"""

import pytest

torch = pytest.importorskip("torch")

from replayssm.models import fused, moe  # noqa: E402

import models_util as mu  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6}


def _case(T=7, H=24, I=16, E=6, k=3, activation="relu2", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    U = 2 * I if activation == "swiglu" else I
    x = torch.randn(T, H, generator=g).to(dtype)
    up = (torch.randn(E, U, H, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    # k distinct experts per token, never expert E - 1 (an expert no token chose).
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    return x, ids, weights, up, down


def _oracle(x, ids, weights, up, down, activation):
    x, weights = x.double(), weights.double()
    out = torch.zeros_like(x)
    for e in range(up.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = x[tokens] @ up[e].double().T
        if activation == "relu2":
            h = torch.relu(h) ** 2
        else:
            gate, u = h.chunk(2, dim=-1)
            h = gate * torch.sigmoid(gate) * u
        out.index_add_(0, tokens, weights[tokens, slots, None] * (h @ down[e].double().T))
    return out


@pytest.fixture(params=["grouped", "every_expert"])
def path(request, monkeypatch):
    if request.param == "grouped":
        if not hasattr(torch.nn.functional, "grouped_mm"):
            pytest.skip("this PyTorch has no torch.nn.functional.grouped_mm")
    else:
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda x, weight: False)
    return request.param


@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_a_float64_loop(path, activation, dtype):
    x, ids, weights, up, down = _case(activation=activation, dtype=dtype)
    got = moe.routed_experts(x, ids, weights, up, down, activation, accumulate=torch.float32)
    want = _oracle(x, ids, weights, up, down, activation)
    assert got.dtype == dtype
    scale = want.abs().max()
    assert (got.double() - want).abs().max() <= TOL[dtype] * scale


def test_a_token_alone_gets_what_it_gets_in_a_batch(path):
    # Up to the products' rounding, which a matrix product may vary with its row count: a
    # token given another's rows or weights would differ by O(1).
    x, ids, weights, up, down = _case(T=9, activation="swiglu")
    whole = moe.routed_experts(x, ids, weights, up, down, "swiglu")
    assert torch.equal(whole, moe.routed_experts(x, ids, weights, up, down, "swiglu"))
    for t in (0, 4, 8):
        alone = moe.routed_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], up, down,
                                   "swiglu")
        assert (alone[0] - whole[t]).abs().max() <= TOL[torch.float32] * whole.abs().max()


def test_refuses_bad_arguments():
    x, ids, weights, up, down = _case()
    with pytest.raises(ValueError, match="activation"):
        moe.routed_experts(x, ids, weights, up, down, "gelu")
    with pytest.raises(ValueError, match="expert_ids"):
        moe.routed_experts(x, ids[:, :2], weights, up, down, "relu2")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routing_captured_in_a_cuda_graph_follows_new_choices(dtype):
    """bf16 takes the grouped product, fp32 the every-expert path: both must capture (no host
    synchronisation) and, replayed with other choices, equal an eager call."""
    x, ids, weights, up, down = (t.cuda() for t in _case(T=16, H=64, I=32, E=8, k=2,
                                                          activation="swiglu", dtype=dtype))
    moe.routed_experts(x, ids, weights, up, down, "swiglu")  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_experts(x, ids, weights, up, down, "swiglu")
    for shift in (1, 3):
        ids.copy_((ids + shift) % 8)
        graph.replay()
        assert torch.equal(out, moe.routed_experts(x, ids, weights, up, down, "swiglu"))


# ---- the fused path ---------------------------------------------------------------------------

#: A bf16 product or sum may be 1 ulp further off under Triton's interpreter (models_util).
INTERPRETER_BF16_TOL = mu.INTERPRETER_BF16_TOL


def fused_errors(device, dtype, T=7, H=24, I=16, E=6, k=3):
    """Both activations, each accumulate dtype (fp32, the activations'): the fused path's
    relative error against the float64 oracle and against the torch path, by case."""
    errors = {}
    for activation in moe.ACTIVATIONS:
        x, ids, weights, up, down = (t.to(device) for t in _case(
            T=T, H=H, I=I, E=E, k=k, activation=activation, dtype=dtype, seed=3))
        want = _oracle(x, ids, weights, up, down, activation)
        for accumulate in {torch.float32, dtype}:
            def run():
                return fused.available(x), moe.routed_experts(x, ids, weights, up, down,
                                                              activation, accumulate)
            (fused_on, got), (_, plain) = mu.both_paths(run)
            assert fused_on
            assert got.dtype == dtype and got.shape == (T, H)
            scale = want.abs().max()
            errors[f"{activation} acc={accumulate}"] = (
                float((got.double() - want).abs().max() / scale),
                float((got.double() - plain.double()).abs().max() / scale))
    return errors


_INTERPRETER_SCRIPT = """
    import sys
    import test_moe as t
    fails = []
    for dtype in (torch.float32, torch.bfloat16):
        tol = t.TOL[dtype] if dtype == torch.float32 else t.INTERPRETER_BF16_TOL
        for case, (oracle, plain) in t.fused_errors("cpu", dtype).items():
            if not (oracle <= tol and plain <= tol):
                fails.append(f"{case} {dtype}: oracle {oracle:.3g}, torch path {plain:.3g}")
    sys.exit("\\n".join(fails) or None)
"""


def test_fused_path_in_interpreter():
    proc = mu.run_in_triton_interpreter(_INTERPRETER_SCRIPT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_fused_sum_refuses_bad_arguments():
    if fused.triton is None:
        pytest.skip("needs the triton package")
    y, rows, w = torch.zeros(6, 4), torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3)
    with pytest.raises(ValueError, match="weighted_rows_sum"):
        fused.weighted_rows_sum(y, rows[:, :2], w, torch.float32)
    with pytest.raises(ValueError, match="accumulate"):
        fused.weighted_rows_sum(y, rows, w, torch.float64)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [dict(H=2688, I=1856, E=128, k=6),
                                   dict(H=2048, I=512, E=256, k=8)],
                         ids=["nemotron-30b-a3b", "qwen3.5-35b-a3b"])
def test_fused_path_on_gpu_at_real_widths(shape):
    """Batch 256, bf16 (both routing slots' widths of the 30B-A3B layouts): against the oracle
    and the torch path within bf16's tolerance."""
    for case, (oracle, plain) in fused_errors("cuda", torch.bfloat16, T=256, **shape).items():
        assert oracle <= TOL[torch.bfloat16] and plain <= TOL[torch.bfloat16], (case, oracle, plain)
