"""Routed experts (replayssm.models.moe) against a float64 loop over tokens and their chosen
experts: both activations, fp32 and bf16, through PyTorch's grouped product and through the
every-expert-on-every-row path that replaces it where it does not apply; experts no token chose; a
token's output alone and in a batch; the same bits run after run.

Tolerances: fp32 agrees to float32 rounding of sums of H and I terms (1e-5 relative to the
output's scale); bf16 rounds the two products, the activation and the weighted sum (2^-6 of
the output's largest value). A wrong expert, weight or token order errs by O(1).
"""

import pytest

torch = pytest.importorskip("torch")

from replayssm.models import moe  # noqa: E402

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
    x, up, down, weights = (t.double() for t in (x, up, down, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = up[e] @ x[t]
            if activation == "relu2":
                h = torch.relu(h) ** 2
            else:
                gate, u = h.chunk(2)
                h = gate * torch.sigmoid(gate) * u
            out[t] += weights[t, j] * (down[e] @ h)
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
