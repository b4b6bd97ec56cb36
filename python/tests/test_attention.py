"""decode_attention: the PyTorch reference against a naive float64 loop, its refusals, and the
Triton kernel against the reference (on the GPU; on the CPU through Triton's interpreter)."""

import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from replayssm.models import attention  # noqa: E402
from replayssm.models.attention import decode_attention, decode_attention_reference  # noqa: E402

import models_util as mu  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_case(batch, T, q_heads, kv_heads, head_dim, max_seq_len, lengths, dtype, device,
              seed=0, pad_rows=0):
    """A layer's caches with `batch` live rows at shuffled cache rows plus `pad_rows` pad rows on
    the scratch row; every position past a row's window holds NaN, so a kernel that reads past
    the live keys shows it."""
    g = torch.Generator().manual_seed(seed)
    capacity = batch + 2
    shape = (capacity + 1, kv_heads, max_seq_len, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    rows = torch.randperm(capacity, generator=g)[:batch]
    lengths = torch.tensor(lengths, dtype=torch.int32)
    live = torch.zeros(capacity + 1, max_seq_len, dtype=torch.bool)
    for r, n in zip(rows.tolist(), lengths.tolist()):
        live[r, :n + T] = True
    live[capacity, :T] = True  # the scratch row: pad rows see their own window
    k[~live[:, None, :, None].expand_as(k)] = float("nan")
    v[~live[:, None, :, None].expand_as(v)] = float("nan")
    rows = torch.cat([rows, torch.full((pad_rows,), capacity)]).to(torch.int32)
    lengths = torch.cat([lengths, torch.zeros(pad_rows, dtype=torch.int32)])
    q = torch.randn(batch + pad_rows, T, q_heads, head_dim, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)] + [rows.to(device),
                                                                   lengths.to(device)]


def naive(q, k_cache, v_cache, rows, lengths, scale):
    """Float64, one (row, query head, token) at a time: softmax over keys [0, lengths + t]."""
    q, k, v = (np.asarray(t.float().cpu(), np.float64) for t in (q, k_cache, v_cache))
    B, T, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        r, n = int(rows[b]), int(lengths[b])
        for h in range(Hq):
            for t in range(T):
                keys, values = k[r, h // group, :n + t + 1], v[r, h // group, :n + t + 1]
                s = keys @ q[b, t, h] * scale
                p = np.exp(s - s.max())
                out[b, t, h] = p @ values / p.sum()
    return out


CASES = [  # batch, T, q_heads, kv_heads, head_dim, max_seq_len, lengths
    (1, 1, 4, 4, 16, 8, [0]),                    # one committed key short of nothing
    (3, 1, 8, 2, 64, 300, [0, 299, 37]),         # rows of very different lengths, GQA 4
    (2, 4, 6, 2, 80, 70, [66, 3]),               # a speculative window, head size 80
    (2, 3, 16, 4, 128, 260, [0, 257]),           # window at the very end of the cache
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_T{}_Hq{}_Hkv{}_D{}_S{}".format(*c[:6]))
def test_reference_matches_naive_loop(case):
    batch, T, hq, hkv, d, s, lengths = case
    q, k, v, rows, lens = make_case(batch, T, hq, hkv, d, s, lengths, torch.float32, "cpu",
                                    pad_rows=1)
    got = decode_attention(q, k, v, rows, lens, d ** -0.5)  # the CPU path is the reference
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert torch.isfinite(got).all(), "a key past a row's window leaked in"
    np.testing.assert_allclose(got.numpy(), naive(q, k, v, rows, lens, d ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_window_is_causal():
    """Query t of a window must not see the window's later keys: changing the last key of the
    window changes only the last token's output."""
    q, k, v, rows, lens = make_case(1, 3, 4, 2, 16, 16, [5], torch.float32, "cpu")
    before = decode_attention_reference(q, k, v, rows, lens, 0.25)
    k[int(rows[0]), :, 5 + 2] += 3.0
    after = decode_attention_reference(q, k, v, rows, lens, 0.25)
    assert torch.equal(before[:, :2], after[:, :2])
    assert not torch.equal(before[:, 2], after[:, 2])


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :1]), "differs from k_cache"),
    (lambda a: a.update(q=a["q"][..., :8]), "head_dim 8"),
    (lambda a: a.update(q=a["q"][:, :, :3]), "not a multiple"),
    (lambda a: a.update(slot_rows=a["slot_rows"].long()), "slot_rows must be int32"),
    (lambda a: a.update(lengths=a["lengths"][:1]), "lengths must be int32 [2]"),
    (lambda a: a.update(q=a["q"].double()), "share a dtype"),
    (lambda a: a.update(lengths=torch.tensor([0, 15], dtype=torch.int32)), "past max_seq_len 16"),
    (lambda a: a.update(slot_rows=torch.tensor([0, 9], dtype=torch.int32)), "cache row 9"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_refused(mutate, message):
    q, k, v, rows, lens = make_case(2, 2, 4, 2, 16, 16, [3, 5], torch.float32, "cpu")
    args = dict(q=q, k_cache=k, v_cache=v, slot_rows=rows, lengths=lens, scale=0.25)
    mutate(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_attention(**args)


def test_unknown_impl_is_refused():
    q, k, v, rows, lens = make_case(1, 1, 2, 2, 16, 8, [2], torch.float32, "cpu")
    with pytest.raises(ValueError, match="unknown impl"):
        decode_attention(q, k, v, rows, lens, 0.25, impl="flash")


def test_split_count_depends_on_shapes_only():
    # Enough programs: one split. Few: about two programs per multiprocessor, a power of two,
    # never shorter than the minimum split nor more than the maximum.
    assert attention._num_splits(programs=256, max_seq_len=4096, sms=132) == 1
    assert attention._num_splits(programs=8, max_seq_len=4096, sms=132) == 16
    assert attention._num_splits(programs=8, max_seq_len=512, sms=132) == 2
    assert attention._num_splits(programs=1, max_seq_len=1 << 20, sms=132) == 32
    assert attention._num_splits(programs=64, max_seq_len=4096, sms=132) == 4


# ---- the Triton kernel on the CPU, through Triton's interpreter ------------------------------
# The interpreter runs the kernel's Python body on NumPy: the indexing, masks, splits and the
# combine are checked here in fp32 and fp16 (its bf16 tl.dot is not faithful). It must be
# switched on before triton is imported, hence a subprocess.

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import sys
    from test_attention import make_case
    from replayssm.models.attention import decode_attention, decode_attention_reference
    worst = 0.0
    for case, dtype, tol in {cases!r}:
        batch, T, hq, hkv, d, s, lengths = case
        dtype = getattr(torch, dtype)
        q, k, v, rows, lens = make_case(batch, T, hq, hkv, d, s, lengths, dtype, "cpu", pad_rows=1)
        got = decode_attention(q, k, v, rows, lens, d ** -0.5, impl="triton").float()
        ref = decode_attention_reference(q, k, v, rows, lens, d ** -0.5).float()
        err = float((got - ref).abs().max())
        if not err <= tol:
            sys.exit(f"{{case}} {{dtype}}: max error {{err}} > {{tol}}")
""")


def test_triton_kernel_in_interpreter():
    pytest.importorskip("triton")
    # The interpreter's device count is 8 multiprocessors: the first cases run several splits.
    cases = [((1, 1, 4, 4, 16, 600, [517]), "float32", 1e-5),
             ((2, 3, 8, 2, 64, 300, [0, 290]), "float32", 1e-5),
             ((3, 2, 4, 4, 80, 64, [0, 30, 62]), "float32", 1e-5),
             ((1, 4, 16, 4, 128, 700, [600]), "float16", 2e-3)]
    proc = mu.run_in_triton_interpreter(_INTERPRETER_SCRIPT.format(cases=cases), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---- the Triton kernel on the GPU --------------------------------------------------------------

GPU_CASES = CASES + [
    (1, 1, 32, 8, 128, 4096, [4000]),            # batch 1: many splits
    (64, 1, 32, 8, 128, 1100, list(range(0, 1024, 16))),
    (40, 1, 16, 4, 256, 1040, [1024] * 39 + [0]),  # Qwen3.5-like: head size 256, no split
    (5, 8, 32, 8, 128, 2048, [0, 1, 2000, 63, 64]),  # an 8-token window, GQA 4
]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "B{}_T{}_Hq{}_Hkv{}_D{}_S{}".format(*c[:6]))
def test_triton_kernel_matches_reference(case, dtype):
    batch, T, hq, hkv, d, s, lengths = case
    dtype = getattr(torch, dtype)
    q, k, v, rows, lens = make_case(batch, T, hq, hkv, d, s, lengths, dtype, "cuda", pad_rows=2)
    got = decode_attention(q, k, v, rows, lens, d ** -0.5)
    ref = decode_attention_reference(q, k, v, rows, lens, d ** -0.5)
    assert got.dtype == dtype and torch.isfinite(got).all()
    # bf16 output: one rounding of the output plus p rounded to bf16 before P @ V.
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@cuda
@pytest.mark.cuda
def test_triton_kernel_in_a_cuda_graph():
    """Captured once, replayed with other lengths and rows: the graph follows the values."""
    q, k, v, rows, lens = make_case(4, 1, 32, 8, 128, 2048, [10, 20, 30, 40], torch.bfloat16,
                                    "cuda")
    k.nan_to_num_(0.0)
    v.nan_to_num_(0.0)
    decode_attention(q, k, v, rows, lens, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, rows, lens, 0.1)
    for new_lengths in ([0, 2000, 5, 1023], [7, 7, 7, 7]):
        lens.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        rows.copy_(rows.flip(0))
        graph.replay()
        ref = decode_attention_reference(q, k, v, rows, lens, 0.1)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
