"""Fused Triton kernels for the decode step's small operations: one launch where the plain-torch
path (the CPU path and the reference, in base.py and the families) runs several.

- :func:`conv_decode`: a decode window's causal conv1d: writes the window's inputs into each
  row's conv ring, convolves the ring rows before the window and the window itself, applies the
  activation and writes the result split into contiguous tensors (e.g. Mamba-2's x, B, C or the
  GDN's q, k, v), as the SSM ops take them. The torch path runs an index_copy, an index_select,
  2K - 1 multiplies and adds, the bias, the activation and one copy per split. A window is one
  [tokens, channels] tile per program; a single token has a kernel of its own (the tile was
  slower there).
- :func:`rms_norm`: RMSNorm over groups of a row, with the rounding orders the families use and
  an optional SiLU gate before or after the norm: one launch against the torch path's six to
  nine; :func:`add_rms_norm` adds the residual stream's update in the same launch.
- :func:`gdn_gates`: the Gated DeltaNet's g and beta from its a and b projections: one launch
  against nine.
- :func:`silu_mul` (Qwen3.5's MLP, silu(gate) * up) and :func:`relu_square` (Nemotron-H's,
  relu(x)^2): one pass over the MLP's widest activations against two; :func:`sigmoid_mul`,
  Qwen3.5's gated attention output (o * sigmoid(gate)), likewise.
- :func:`rope`: Qwen3.5's partial rotary embedding of q or k: one launch against the torch
  path's two concatenations, three products and a sum.
- :func:`weighted_rows_sum`: a mixture-of-experts layer's output, each token's k expert
  products (rows of one tensor, in expert order) weighted and summed: one launch that reads
  the rows once, against the torch path's gather, two conversions, product and sum.

Rounding. Each kernel rounds where the torch path rounds: the conv accumulates in the weight's
dtype with a rounding after every multiply and add, as the torch path's bf16 arithmetic does;
the norms round the normalised row (and the weight product) where the families do. What
differs is the order of the mean's sum and the exp of SiLU: results equal the torch path up to
one rounding of the output's dtype, not bit for bit.

:func:`available` says whether a tensor takes the fused path: a CUDA tensor and the triton
package, unless ``REPLAYSSM_FUSED=0`` is in the environment (the plain-torch step, for
comparison and debugging). On an H200 at batch 256 the fused step is 17-28% shorter than the
plain-torch one in every state mode (docs/BENCHMARKS.md, whole models). The tests run the
kernels on the CPU through Triton's interpreter and on the GPU against the torch path.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves every call
    triton = None

__all__ = ["add_rms_norm", "available", "conv_decode", "gdn_gates", "relu_square", "rms_norm",
           "rope", "sigmoid_mul", "silu_mul", "weighted_rows_sum"]

_ENABLED = os.environ.get("REPLAYSSM_FUSED", "1") != "0"
_ACTIVATION_BLOCK = 1024
_SILU_MUL, _RELU_SQUARE, _SIGMOID_MUL = 0, 1, 2
_GATE = {None: 0, "before": 1, "after": 2}


def available(t: torch.Tensor) -> bool:
    """Whether ``t``'s operations take the fused kernels (CUDA tensor, triton present, not
    switched off). Under Triton's interpreter (``TRITON_INTERPRET=1``) CPU tensors do too."""
    if triton is None or not _ENABLED:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def conv_decode(x: torch.Tensor, ring: torch.Tensor, conv_write: torch.Tensor,
                conv_read: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None, splits: Sequence[int]) -> list[torch.Tensor]:
    """The causal conv1d of a window ``x`` [B, T, C] (channels contiguous, other strides free):
    ``ring`` [rows, C] (a layer's flat conv ring, contiguous) gets row ``conv_write[b * T + t]``
    = x[b, t]; output t of row b convolves ring rows ``conv_read[b * (K - 1 + T) + j]``, j < K - 1,
    then the window's own inputs, with ``weight`` [C, K] and ``bias`` [C]; ``activation`` "silu"
    or None. Returns contiguous [B, T, s] tensors in x's dtype, one per ``splits`` (summing to
    C; at most three)."""
    B, T, C = x.shape
    K = weight.shape[-1]
    if sum(splits) != C or not 1 <= len(splits) <= 3:
        raise ValueError(f"conv_decode: splits {list(splits)} must be 1 to 3 sizes summing to {C}")
    if x.stride(-1) != 1 or not ring.is_contiguous() or weight.stride(-1) != 1:
        raise ValueError("conv_decode: x's channels, the ring and weight's taps must be contiguous")
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported conv activation {activation!r}; choose 'silu' or None")
    outs = [torch.empty(B, T, s, dtype=x.dtype, device=x.device) for s in splits]
    ptrs = outs + [outs[0]] * (3 - len(outs))
    ends = [sum(splits[:i + 1]) for i in range(len(splits))] + [C] * (3 - len(splits))
    args = (x, ring, conv_write, conv_read, weight, weight if bias is None else bias,
            ptrs[0], ptrs[1], ptrs[2], C, ends[0], ends[1])
    flags = dict(K=K, HAS_BIAS=bias is not None, SILU=activation == "silu")
    TP = triton.next_power_of_2(T)
    block, warps = _conv_tile(TP)
    grid = (B, triton.cdiv(C, block))
    if T == 1:
        _conv_token_kernel[grid](*args, x.stride(0), weight.stride(0), **flags, BLOCK=block,
                                 num_warps=warps)
    else:
        _conv_window_kernel[grid](*args, x.stride(0), x.stride(1), weight.stride(0), T=T,
                                  TP=TP, **flags, BLOCK=block, num_warps=warps)
    return outs


def _conv_tile(TP: int) -> tuple[int, int]:
    """Channels per program and warps for a conv window of TP (a power of two) tokens: the
    fastest of a sweep on an H200 at batch 256, both real layouts (single tokens: the
    per-token kernel's 256 channels; windows of 2 and 4: 512; of 8: 256 with 8 warps)."""
    if TP == 1:
        return 256, 4
    return (512, 4) if TP <= 4 else (256, 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, group_size: int | None = None,
             gate: torch.Tensor | None = None, gate_at: str | None = None,
             one_plus: bool = False) -> torch.Tensor:
    """RMSNorm of ``x`` [..., N] over groups of ``group_size`` channels (default N), in float32,
    with ``weight`` [N] or [group_size]. Rounding as the families: ``one_plus`` (Qwen3.5's
    norm): ``(y * (1 + w)).to(dtype)``, one rounding; otherwise ``w * y.to(dtype)`` in torch's
    promoted dtype of the two (Nemotron-H's and the GDN output norm). ``gate`` [..., N]
    (``gate_at`` "before": x * silu(gate) in fp32 before the norm, Nemotron-H's; "after": the
    weighted result times silu(gate) in fp32, the GDN output norm's). Returns x's shape, in
    x's dtype, except Nemotron-H's form (neither ``one_plus`` nor a gate after), which returns
    the promoted dtype of x and the weight, as its torch path does."""
    N = x.shape[-1]
    G = N if group_size is None else group_size
    if N % G or weight.numel() not in (N, G) or (gate is None) != (gate_at is None):
        raise ValueError(f"rms_norm: {N} channels, groups of {G}, weight of {weight.numel()}, "
                         f"gate {'given' if gate is not None else 'absent'} at {gate_at!r}")
    # Rows may be strided (a slice of a projection's output); channels must be contiguous.
    x2 = _rows(x, N)
    g2 = x2 if gate is None else _rows(gate, N)
    weight = weight.contiguous()
    product = torch.promote_types(weight.dtype, x.dtype)
    plain = not one_plus and gate_at != "after"
    out = torch.empty(x2.shape, dtype=product if plain else x.dtype, device=x.device)
    # A program per row, all its groups at once (a program per group of 128-256 channels
    # left most of its threads with one element).
    _rms_norm_kernel[(x2.shape[0],)](
        x2, g2, x2, x2, weight, out, x2.stride(0), g2.stride(0), x2.stride(0), float(eps),
        G=G, NG=N // G, W_PER_GROUP=weight.numel() == G and N != G, GATE=_GATE[gate_at],
        ONE_PLUS=one_plus, ROUND_PRODUCT=product != torch.float32, HAS_RES=False,
        GROUPS=triton.next_power_of_2(N // G), BLOCK=triton.next_power_of_2(G),
        num_warps=_norm_warps(N))
    return out.view(x.shape)


def _norm_warps(n: int) -> int:
    """Warps for a program normalising one row of n channels: about 8 channels a thread."""
    return max(1, min(16, triton.next_power_of_2(n) // 256))


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 one_plus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual stream's update and the next norm (over the
    whole row, rounding as :func:`rms_norm`), the sum rounded to h's dtype first, as the torch
    path's ``h = h + delta`` does. Both [..., N] in h's dtype."""
    N = h.shape[-1]
    h2, d2 = _rows(h, N), _rows(delta, N)
    total = torch.empty(h2.shape, dtype=h.dtype, device=h.device)
    out = torch.empty_like(total)
    _rms_norm_kernel[(h2.shape[0],)](
        h2, h2, d2, total, weight.contiguous(), out, h2.stride(0), h2.stride(0), d2.stride(0),
        float(eps), G=N, NG=1, W_PER_GROUP=False, GATE=0, ONE_PLUS=one_plus,
        ROUND_PRODUCT=torch.promote_types(weight.dtype, h.dtype) != torch.float32, HAS_RES=True,
        GROUPS=1, BLOCK=triton.next_power_of_2(N), num_warps=_norm_warps(N))
    return total.view(h.shape), out.view(h.shape)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta), float32 like ``a`` [..., H]: g = -exp(A_log) * softplus(a + dt_bias) in fp32
    (softplus linear above 20, as torch's), beta = sigmoid(b) rounded to b's dtype."""
    H = a.shape[-1]
    a2, b2 = _rows(a, H), _rows(b, H)
    g = torch.empty(a2.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    _gdn_gates_kernel[(a2.shape[0],)](a2, b2, A_log.contiguous(), dt_bias.contiguous(), g, beta,
                                      a2.stride(0), b2.stride(0), H,
                                      BLOCK=triton.next_power_of_2(H))
    return g.view(a.shape), beta.view(a.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, both [..., N] (rows may be strided: column slices of one projection's
    output), rounded as torch's ``F.silu(gate) * up``: the SiLU to gate's dtype, then the
    product. A contiguous [..., N] tensor in gate's dtype."""
    return _activation(_SILU_MUL, gate, up)


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), rounded as torch's ``x * torch.sigmoid(gate)``: the sigmoid to gate's
    dtype, then the product; shapes and strides as :func:`silu_mul`."""
    return _activation(_SIGMOID_MUL, gate, x)


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 as torch's ``torch.relu(x).square()`` rounds it; [..., N], rows may be
    strided. A contiguous tensor in x's dtype."""
    return _activation(_RELU_SQUARE, x, None)


def _activation(act: int, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    if other is not None and (other.shape != x.shape or other.dtype != x.dtype):
        raise ValueError(f"fused activation: {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(other.shape)} {other.dtype} must match")
    N = x.shape[-1]
    x2 = _rows(x, N)
    other2 = x2 if other is None else _rows(other, N)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    grid = (x2.shape[0], triton.cdiv(N, _ACTIVATION_BLOCK))
    _activation_kernel[grid](x2, other2, out, x2.stride(0), other2.stride(0), N, ACT=act,
                             BLOCK=_ACTIVATION_BLOCK)
    return out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x [..., H, D] on its first R dims (rotate-half pairing: dim i
    with i + R / 2), cos and sin [..., R] broadcast over the heads, all in one dtype; rounded
    as the torch path (models/qwen3_5.py, _rotate): each product and the sum to x's dtype.
    A contiguous tensor of x's shape."""
    H, D = x.shape[-2:]
    R = cos.shape[-1]
    if sin.shape != cos.shape or R % 2 or R > D or not (x.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"rope: x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} "
                         f"{cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}")
    x2 = x.reshape(-1, H, D).contiguous()
    cos2, sin2 = cos.reshape(-1, R).contiguous(), sin.reshape(-1, R).contiguous()
    if cos2.shape[0] != x2.shape[0]:
        raise ValueError(f"rope: {cos2.shape[0]} rows of cos for {x2.shape[0]} rows of x")
    out = torch.empty_like(x2)
    _rope_kernel[(x2.shape[0], H)](x2, cos2, sin2, out, H, D=D, R=R,
                                   BLOCK=triton.next_power_of_2(D))
    return out.view(x.shape)


def weighted_rows_sum(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                      accumulate: torch.dtype) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[rows[t, j]] for y [P, H], rows and weights [T, k]: a
    contiguous [T, H] tensor in y's dtype. Rounded as the torch path's ``(y[rows].to(acc) *
    weights[..., None].to(acc)).sum(1)`` with ``accumulate`` (acc) fp32 or y's dtype: each
    term in acc, the sum in fp32 (as torch sums a bf16 tensor), then to y's dtype."""
    T, k = weights.shape
    H = y.shape[-1]
    if rows.shape != weights.shape or y.dim() != 2 or accumulate not in (torch.float32, y.dtype):
        raise ValueError(f"weighted_rows_sum: y {tuple(y.shape)} {y.dtype}, rows "
                         f"{tuple(rows.shape)}, weights {tuple(weights.shape)}, accumulate "
                         f"{accumulate} (fp32 or y's dtype)")
    y, rows, weights = y.contiguous(), rows.contiguous(), weights.contiguous()
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    grid = (T, triton.cdiv(H, _ACTIVATION_BLOCK))
    _weighted_rows_sum_kernel[grid](y, rows, weights, out, H, K=k,
                                    ROUND_TERMS=accumulate != torch.float32,
                                    BLOCK=_ACTIVATION_BLOCK)
    return out


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


if triton is not None:
    @triton.jit
    def _conv_tap(acc, v, w_ptrs, mask, k: tl.constexpr, wdt: tl.constexpr):
        """acc plus tap k's term, rounded to the weight's dtype after every operation, as the
        torch path's arithmetic in that dtype."""
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        term = (v.to(wdt).to(tl.float32) * w).to(wdt).to(tl.float32)
        if k != 0:
            term = (acc + term).to(wdt).to(tl.float32)
        return term

    @triton.jit
    def _conv_finish(acc, bias_ptrs, mask, wdt: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU: tl.constexpr):
        if HAS_BIAS:
            acc = (acc + tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)).to(wdt)
            acc = acc.to(tl.float32)
        if SILU:
            acc = (acc / (1.0 + tl.exp(-acc))).to(wdt).to(tl.float32)
        return acc

    @triton.jit
    def _conv_store(out0_ptr, out1_ptr, out2_ptr, r, c, live, acc, C, end0, end1):
        """Output row r's channels c into the split they fall in."""
        y = acc.to(out0_ptr.dtype.element_ty)
        tl.store(out0_ptr + r * end0 + c, y, mask=live & (c < end0))
        tl.store(out1_ptr + r * (end1 - end0) + (c - end0), y,
                 mask=live & (c >= end0) & (c < end1))
        tl.store(out2_ptr + r * (C - end1) + (c - end1), y, mask=live & (c >= end1))

    @triton.jit
    def _conv_token_kernel(x_ptr, ring_ptr, write_ptr, read_ptr, w_ptr, bias_ptr,
                           out0_ptr, out1_ptr, out2_ptr, C, end0, end1, stride_xb, stride_wc,
                           K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                           BLOCK: tl.constexpr):
        # A single token (T = 1) of one batch row over BLOCK channels.
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < C
        wdt: tl.constexpr = w_ptr.dtype.element_ty
        rdt: tl.constexpr = ring_ptr.dtype.element_ty
        x_in = tl.load(x_ptr + b * stride_xb + c, mask=live)
        tl.store(ring_ptr + tl.load(write_ptr + b) * C + c, x_in.to(rdt), mask=live)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            if k < K - 1:
                v = tl.load(ring_ptr + tl.load(read_ptr + b * K + k) * C + c, mask=live)
            else:  # the token itself, rounded to the ring's dtype as the torch path reads it
                v = tl.load(x_ptr + b * stride_xb + c, mask=live).to(rdt)
            acc = _conv_tap(acc, v.to(tl.float32), w_ptr + c * stride_wc + k, live, k, wdt)
        acc = _conv_finish(acc, bias_ptr + c, live, wdt, HAS_BIAS, SILU)
        _conv_store(out0_ptr, out1_ptr, out2_ptr, b, c, live, acc, C, end0, end1)

    @triton.jit
    def _conv_window_kernel(x_ptr, ring_ptr, write_ptr, read_ptr, w_ptr, bias_ptr,
                            out0_ptr, out1_ptr, out2_ptr, C, end0, end1,
                            stride_xb, stride_xt, stride_wc,
                            T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr,
                            HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr):
        # One batch row's whole window over BLOCK channels, as a [TP, BLOCK] tile (TP = T
        # rounded up to a power of two): every token's loads of a tap issue together (a loop
        # over the tokens with 256 channels a program took 4-35% longer at 2-8 tokens).
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        t = tl.arange(0, TP)[:, None]
        live = (c < C) & (t < T)
        wdt: tl.constexpr = w_ptr.dtype.element_ty
        rdt: tl.constexpr = ring_ptr.dtype.element_ty
        x_row = x_ptr + b * stride_xb
        acc = tl.zeros([TP, BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            j = t + k  # window index: the K - 1 ring rows before the window, then the window
            in_ring = j < K - 1
            # Taps that every token reads from the ring, or every token from the window, load
            # from that place only.
            if k + TP - 1 >= K - 1:
                # The window's own inputs, rounded to the ring's dtype (what the torch path
                # reads back from the ring).
                v_x = tl.load(x_row + (j - (K - 1)) * stride_xt + c,
                              mask=live & (j >= K - 1), other=0.0).to(rdt).to(tl.float32)
            if k < K - 1:
                row = tl.load(read_ptr + b * (K - 1 + T) + j, mask=in_ring & (t < T), other=0)
                v_ring = tl.load(ring_ptr + row * C + c, mask=live & in_ring,
                                 other=0.0).to(tl.float32)
            if k >= K - 1:
                v = v_x
            elif k + TP - 1 < K - 1:
                v = v_ring
            else:
                v = tl.where(in_ring, v_ring, v_x)
            acc = _conv_tap(acc, v, w_ptr + c * stride_wc + k, c < C, k, wdt)
        acc = _conv_finish(acc, bias_ptr + c, c < C, wdt, HAS_BIAS, SILU)
        # The window into the ring after the taps are read: the rows the window writes are not
        # among the K - 1 it reads (the ring holds K - 1 + T rows or more).
        x_in = tl.load(x_row + t * stride_xt + c, mask=live)
        tl.store(ring_ptr + tl.load(write_ptr + b * T + t, mask=t < T, other=0) * C + c,
                 x_in.to(rdt), mask=live)
        _conv_store(out0_ptr, out1_ptr, out2_ptr, b * T + t, c, live, acc, C, end0, end1)

    @triton.jit
    def _rms_norm_kernel(x_ptr, gate_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, stride_x, stride_g,
                         stride_r, eps, G: tl.constexpr, NG: tl.constexpr,
                         W_PER_GROUP: tl.constexpr, GATE: tl.constexpr, ONE_PLUS: tl.constexpr,
                         ROUND_PRODUCT: tl.constexpr, HAS_RES: tl.constexpr,
                         GROUPS: tl.constexpr, BLOCK: tl.constexpr):
        # One row of NG groups of G channels, as a [GROUPS, BLOCK] tile (HAS_RES: NG = 1).
        row = tl.program_id(0)
        g = tl.arange(0, GROUPS)[:, None]
        i = tl.arange(0, BLOCK)[None, :]
        live = (i < G) & (g < NG)
        col = g * G + i
        xdt = x_ptr.dtype.element_ty
        h = tl.load(x_ptr + row * stride_x + col, mask=live, other=0.0).to(tl.float32)
        if HAS_RES:  # h + delta in x's dtype (stored), then its norm
            d = tl.load(res_ptr + row * stride_r + col, mask=live, other=0.0).to(tl.float32)
            h = (h + d).to(xdt)
            tl.store(sum_ptr + row * G * NG + col, h, mask=live)
            h = h.to(tl.float32)
        if GATE == 1:
            z = tl.load(gate_ptr + row * stride_g + col, mask=live, other=0.0).to(tl.float32)
            h = h * (z / (1.0 + tl.exp(-z)))
        y = h * (1.0 / tl.sqrt(tl.sum(h * h, axis=1)[:, None] / G + eps))
        if W_PER_GROUP:
            w = tl.load(w_ptr + i, mask=i < G, other=0.0).to(tl.float32)
        else:
            w = tl.load(w_ptr + col, mask=live, other=0.0).to(tl.float32)
        if ONE_PLUS:
            y = y * (1.0 + w)
        else:
            y = w * y.to(xdt).to(tl.float32)
            if ROUND_PRODUCT:  # both 16-bit: the product rounds to the weight's dtype
                y = y.to(w_ptr.dtype.element_ty).to(tl.float32)
        if GATE == 2:
            z = tl.load(gate_ptr + row * stride_g + col, mask=live, other=0.0).to(tl.float32)
            y = y * (z / (1.0 + tl.exp(-z)))
        tl.store(out_ptr + row * G * NG + col, y.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _gdn_gates_kernel(a_ptr, b_ptr, alog_ptr, bias_ptr, g_ptr, beta_ptr, stride_a, stride_b,
                          H, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        live = i < H
        a = tl.load(a_ptr + row * stride_a + i, mask=live, other=0.0).to(tl.float32)
        u = a + tl.load(bias_ptr + i, mask=live, other=0.0).to(tl.float32)
        # torch's softplus: linear above 20; exp(u) where 1 + exp(u) would round to 1.
        e = tl.exp(tl.minimum(u, 20.0))
        softplus = tl.where(u > 20.0, u, tl.where(u < -15.0, e, tl.log(1.0 + e)))
        decay = tl.exp(tl.load(alog_ptr + i, mask=live, other=0.0).to(tl.float32))
        tl.store(g_ptr + row * H + i, -decay * softplus, mask=live)
        b = tl.load(b_ptr + row * stride_b + i, mask=live, other=0.0)
        beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
        tl.store(beta_ptr + row * H + i, beta.to(b.dtype).to(tl.float32), mask=live)

    @triton.jit
    def _activation_kernel(x_ptr, other_ptr, out_ptr, stride_x, stride_other, N,
                           ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < N
        x = tl.load(x_ptr + row * stride_x + c, mask=live, other=0.0)
        xf = x.to(tl.float32)
        if ACT == 1:  # relu(x)^2
            r = tl.maximum(xf, 0.0)
            y = r * r
        else:  # silu(x) * other or sigmoid(x) * other, the activation rounded first
            if ACT == 0:
                a = xf / (1.0 + tl.exp(-xf))
            else:
                a = 1.0 / (1.0 + tl.exp(-xf))
            other = tl.load(other_ptr + row * stride_other + c, mask=live, other=0.0)
            y = a.to(x.dtype).to(tl.float32) * other.to(tl.float32)
        tl.store(out_ptr + row * N + c, y.to(x.dtype), mask=live)

    @triton.jit
    def _weighted_rows_sum_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, H, K: tl.constexpr,
                                  ROUND_TERMS: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < H
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(rows_ptr + t * K + j).to(tl.int64)
            y = tl.load(y_ptr + row * H + c, mask=live, other=0.0)
            w = tl.load(w_ptr + t * K + j)
            if ROUND_TERMS:  # each term in y's dtype, as torch's product of two such tensors
                term = (w.to(y.dtype).to(tl.float32) * y.to(tl.float32)).to(y.dtype)
            else:
                term = w.to(tl.float32) * y.to(tl.float32)
            total += term.to(tl.float32)
        tl.store(out_ptr + t * H + c, total.to(y.dtype), mask=live)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D: tl.constexpr, R: tl.constexpr,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = (row * H + tl.program_id(1)) * D
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + i, mask=i < D, other=0.0)
        rotary = i < R
        first = i < R // 2
        # rotate_half: (-x2, x1) over the rotary dims
        pair = tl.where(first, i + R // 2, i - R // 2)
        partner = tl.load(x_ptr + base + pair, mask=rotary, other=0.0).to(tl.float32)
        partner = tl.where(first, -partner, partner)
        c = tl.load(cos_ptr + row * R + i, mask=rotary, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + row * R + i, mask=rotary, other=0.0).to(tl.float32)
        t1 = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        t2 = (partner * s).to(x.dtype).to(tl.float32)
        y = tl.where(rotary, (t1 + t2).to(x.dtype), x)
        tl.store(out_ptr + base + i, y, mask=i < D)
