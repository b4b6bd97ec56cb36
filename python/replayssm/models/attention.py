"""Attention of a decode or verify step over a static, slot-indexed KV cache.

``decode_attention(q, k_cache, v_cache, slot_rows, lengths, scale)`` is what the model families
call in ``decode``: T query tokens per row (T = 1 plain decoding, T > 1 a speculative window),
each seeing the row's committed keys ``[0, lengths[b])`` and the window's keys up to itself
(the model writes the window's keys at ``lengths[b] + 0..T-1`` before the call), so query ``t``
sees keys ``[0, lengths[b] + t + 1)``.

On CUDA it runs a Triton kernel (flash decoding); elsewhere, and as the oracle of the GPU
tests, a plain PyTorch reference. The kernel:

- reads only the live keys ``[0, lengths[b] + T)`` of each row (the loop bounds come from
  ``lengths`` on the device), so a step costs what the context holds, not the cache's length;
- takes all ``Hq / Hkv`` query heads of a key head and all T window tokens as the rows of one
  tile, so each key and value is read once per row and key head (GQA);
- splits the key range of a row over several programs when ``batch * Hkv`` programs would
  leave the GPU's multiprocessors idle (small batches), each split covering an equal share of
  that row's live keys, and combines the splits' partial softmaxes in a second small kernel;
- accumulates scores, the softmax and the output in fp32 (bf16 or fp16 in and out; fp32 in
  runs the products in IEEE fp32, for tight tests);
- chooses everything that shapes the launch (tile sizes, the number of splits) from the
  tensors' shapes alone, never from their values: no host sync, capturable in a CUDA graph, and
  a row's arithmetic depends only on that row (the batch, the other rows and the split count
  do not change which keys a row reads; the split count, fixed by the shapes, changes only the
  order its partial sums are added in).
"""

from __future__ import annotations

import functools
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves every call
    triton = None

__all__ = ["decode_attention", "decode_attention_reference"]

# Keys one split should at least cover: below this the combine step costs more than the
# parallelism gains (a split of 256 bf16 keys of head size 128 reads 128 KiB).
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 32


def _check(q, k_cache, v_cache, slot_rows, lengths) -> None:
    """Shape, dtype and device rules of :func:`decode_attention` (one-line ValueError)."""
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"decode_attention: q must be [batch, T, q_heads, head_dim] and the "
                         f"caches [rows, kv_heads, max_seq_len, head_dim]; got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: v_cache {tuple(v_cache.shape)} differs from k_cache "
                         f"{tuple(k_cache.shape)}")
    batch, _, q_heads, head_dim = q.shape
    _, kv_heads, _, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"decode_attention: head_dim {head_dim} of q differs from the caches' "
                         f"{cache_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"decode_attention: {q_heads} query heads are not a multiple of "
                         f"{kv_heads} key/value heads")
    for name, t in (("slot_rows", slot_rows), ("lengths", lengths)):
        if t.dtype != torch.int32 or t.shape != (batch,):
            raise ValueError(f"decode_attention: {name} must be int32 [{batch}]; got "
                             f"{t.dtype} {tuple(t.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, slot_rows, lengths)}
    if len(devices) > 1:
        raise ValueError(f"decode_attention: tensors on several devices: "
                         f"{', '.join(sorted(map(str, devices)))}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"decode_attention: q, k_cache and v_cache must share a dtype; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_rows: torch.Tensor, lengths: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """:func:`decode_attention` in plain PyTorch, fp32 throughout (the CPU path and the oracle
    of the kernel's tests). Gathers whole cache rows, so it costs ``max_seq_len`` per row."""
    _check(q, k_cache, v_cache, slot_rows, lengths)
    batch, T, q_heads, head_dim = q.shape
    rows, kv_heads, max_seq_len, _ = k_cache.shape
    if q.device.type == "cpu":  # value checks cost a host sync on a GPU: the CPU path only
        bad = (slot_rows < 0) | (slot_rows >= rows) | (lengths < 0) | (lengths + T > max_seq_len)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"decode_attention: row {b} has cache row {int(slot_rows[b])} of "
                             f"{rows} and {int(lengths[b])} committed keys + {T} window keys "
                             f"past max_seq_len {max_seq_len}")
    group = q_heads // kv_heads
    index = slot_rows.long()
    pos = torch.arange(max_seq_len, device=q.device)
    live = pos[None, :] < (lengths.long() + T)[:, None]                       # [B, S]
    # Keys past a row's window may be anything (never written): zero them so that 0 * NaN
    # cannot leak into a masked product.
    k = k_cache[index].float().masked_fill(~live[:, None, :, None], 0.0)      # [B, Hkv, S, D]
    v = v_cache[index].float().masked_fill(~live[:, None, :, None], 0.0)
    qf = q.float().reshape(batch, T, kv_heads, group, head_dim)
    scores = torch.einsum("bthgd,bhsd->bhgts", qf, k) * scale                 # [B, Hkv, G, T, S]
    limit = lengths.long()[:, None] + torch.arange(1, T + 1, device=q.device)[None, :]  # [B, T]
    visible = pos[None, None, :] < limit[:, :, None]                          # [B, T, S]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.einsum("bhgts,bhsd->bthgd", scores.softmax(-1), v)
    return out.reshape(batch, T, q_heads, head_dim).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_rows: torch.Tensor, lengths: torch.Tensor, scale: float, *,
                     impl: str = "auto") -> torch.Tensor:
    """Attention of T window tokens per row over a slot-indexed KV cache.

    q [batch, T, q_heads, head_dim]; k_cache, v_cache [rows, kv_heads, max_seq_len, head_dim]
    (one layer; ``q_heads`` a multiple of ``kv_heads``); slot_rows int32 [batch] (the cache row
    of each batch row: pad rows point at a scratch row); lengths int32 [batch] (keys committed
    before the window). Query ``t`` of row ``b`` sees keys ``[0, lengths[b] + t + 1)``, which
    must lie within ``max_seq_len``. Returns [batch, T, q_heads, head_dim] in q's dtype.

    ``impl``: "auto" (the Triton kernel for CUDA tensors, the reference elsewhere), "triton"
    or "torch"."""
    if impl == "torch" or (impl == "auto" and (not q.is_cuda or triton is None)):
        return decode_attention_reference(q, k_cache, v_cache, slot_rows, lengths, scale)
    if impl not in ("auto", "triton"):
        raise ValueError(f"decode_attention: unknown impl {impl!r}; choose auto, triton or torch")
    if triton is None:
        raise NotImplementedError("decode_attention: impl='triton' needs the triton package")
    _check(q, k_cache, v_cache, slot_rows, lengths)
    return _decode_attention_triton(q, k_cache, v_cache, slot_rows, lengths, float(scale))


# ---- the Triton kernel ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter: any count exercises the split path
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(programs: int, max_seq_len: int, sms: int) -> int:
    """Key splits per row: enough programs for about two per multiprocessor, no split shorter
    than _MIN_KEYS_PER_SPLIT of the cache's length, a power of two (few compiled variants)."""
    if programs >= sms:
        return 1
    want = min(-(-2 * sms // programs), -(-max_seq_len // _MIN_KEYS_PER_SPLIT), _MAX_SPLITS)
    return 1 << (want.bit_length() - 1)


def _decode_attention_triton(q, k_cache, v_cache, slot_rows, lengths, scale):
    batch, T, q_heads, head_dim = q.shape
    _, kv_heads, max_seq_len, _ = k_cache.shape
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_m = max(16, triton.next_power_of_2(group * T))
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Two K/V tiles of BLOCK_N x BLOCK_D in flight per stage: keep them at 16-32 KiB.
    block_n = 64 if block_d <= 128 else 32
    splits = _num_splits(batch * kv_heads, max_seq_len, _sm_count(q.device))
    if splits > 1:
        part_out = torch.empty(batch, q_heads, T, splits, head_dim, device=q.device,
                               dtype=torch.float32)
        part_lse = torch.empty(batch, q_heads, T, splits, device=q.device, dtype=torch.float32)
    else:  # unused: the kernel writes `out` directly
        part_out = part_lse = out
    _attention_kernel[(batch * kv_heads, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, slot_rows, lengths,
        scale * math.log2(math.e),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        kv_heads, max_seq_len,
        T=T, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, SPLITS=splits, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2)
    if splits > 1:
        _combine_kernel[(batch * q_heads * T,)](
            part_out, part_lse, out, *out.stride(), q_heads, T,
            HEAD_DIM=head_dim, SPLITS=splits, BLOCK_D=block_d, num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr, rows_ptr, lengths_ptr,
            scale_log2,
            stride_qb, stride_qt, stride_qh, stride_qd,
            stride_kr, stride_kh, stride_ks, stride_kd,
            stride_vr, stride_vh, stride_vs, stride_vd,
            stride_ob, stride_ot, stride_oh, stride_od,
            kv_heads, max_seq_len,
            T: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            SPLITS: tl.constexpr, IEEE: tl.constexpr):
        """One (row, key head, key split): tile rows m = g * T + t are query head
        kv_head * GROUP + g at window token t. Softmax in base 2 (scores pre-scaled by
        log2(e)); with SPLITS > 1 it writes the normalised partial output and its log2-sum-exp
        for the combine kernel."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // kv_heads
        h = pid % kv_heads
        row = tl.load(rows_ptr + b).to(tl.int64)
        committed = tl.load(lengths_ptr + b)
        n_keys = tl.minimum(committed + T, max_seq_len)
        # Each split an equal share of this row's live keys, in whole key blocks.
        chunk = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_keys)

        offs_m = tl.arange(0, BLOCK_M)
        g = offs_m // T
        t = offs_m % T
        m_valid = offs_m < GROUP * T
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        head = h * GROUP + g
        q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :] * stride_qd,
                    mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        limit = committed + t + 1  # keys [0, limit) visible to tile row m

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = k_ptr + row * stride_kr + h * stride_kh
        v_base = v_ptr + row * stride_vr + h * stride_vh
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < hi
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            visible = n_valid[None, :] & (offs_n[None, :] < limit[:, None])
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A tile row with no visible key yet keeps m = -inf: shift by 0 so exp2 gives 0,
            # not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(s - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        out_mask = m_valid[:, None] & d_valid[None, :]
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if SPLITS == 1:
            tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh
                     + offs_d[None, :] * stride_od,
                     result.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # part_out [batch, q_heads, T, SPLITS, HEAD_DIM], part_lse [batch, q_heads, T, SPLITS]
            part = ((b * kv_heads * GROUP + head) * T + t) * SPLITS + split
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], result,
                     mask=out_mask)
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=m_valid)

    @triton.jit
    def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr,
                        stride_ob, stride_ot, stride_oh, stride_od, q_heads, T,
                        HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (row, query head, token): the splits' outputs weighted by 2^(lse - max lse).
        Split 0 always holds key 0, which every query sees, so the max is finite."""
        pid = tl.program_id(0)
        b = pid // (q_heads * T)
        head = (pid // T) % q_heads
        t = pid % T
        offs_s = tl.arange(0, SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        lse = tl.load(part_lse_ptr + pid * SPLITS + offs_s)
        w = tl.exp2(lse - tl.max(lse, 0))
        o = tl.load(part_out_ptr + (pid * SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=d_valid[None, :], other=0.0)
        result = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
        tl.store(out_ptr + b * stride_ob + t * stride_ot + head * stride_oh + offs_d * stride_od,
                 result.to(out_ptr.dtype.element_ty), mask=d_valid)
