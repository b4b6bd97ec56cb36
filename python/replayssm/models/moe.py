"""Routed experts of mixture-of-experts MLPs (Nemotron-H's ``E`` layers, Qwen3.5-MoE's sparse
blocks): each token's hidden state goes through its ``k`` chosen experts and the results are
summed with the router's weights. Routing (which experts, what weights) is each family's own;
this module runs the experts once they are chosen.

The experts' weights are stacked as transformers (5.17) holds them: ``up`` [E, U, H] (U = I, or
2I for gated experts: the gate's rows, then the up projection's) and ``down`` [E, H, I].

The tokens' (token, expert) pairs are sorted by expert and multiplied by each expert's weights
in one grouped matrix product per projection (PyTorch's ``torch.nn.functional.grouped_mm``): the
group ends are computed on the device, so a decode step that routes stays capturable in a CUDA
graph, and each expert's weights are read once per step however many tokens chose it. Where
PyTorch has no grouped product for the tensors at hand (an older PyTorch, or fp32 on a GPU,
whose kernel takes bf16) every expert multiplies every row and each row keeps its own
expert's product: E times the arithmetic, but still no host synchronisation, so a test model
in fp32 captures as a served one does.

A token's k results are summed in its routing slots' order (in ``accumulate`` dtype), without
atomic adds, so a step gives the same bits run after run; transformers sums them by expert with
``index_add_``, the same terms in another order (within the dtype's rounding). As with any matrix
product, the rounding of a token's products may vary with how many rows share its group.

On a GPU (:func:`replayssm.models.fused.available`) the activation and the weighted sum are
Triton kernels: the sum gathers each token's k rows of the sorted products and writes the
token's output in one launch, where the torch path converts, multiplies, scatters back to token
order and sums (five launches through fp32 copies of all T*k rows). With the fused activation,
Nemotron-3-Nano-30B-A3B's steps on an H200 got 1.2 and 2.4 ms shorter at batch 256 and 512 (of 28
and 40 ms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused

__all__ = ["ACTIVATIONS", "routed_experts"]

#: The experts' activations: ``relu2`` relu(u)^2 (Nemotron-H, not gated); ``swiglu``
#: silu(gate) * up (Qwen3.5-MoE, gated: ``up`` holds the gate's rows first).
ACTIVATIONS = ("relu2", "swiglu")


def _activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = (h, None) if activation == "relu2" else h.chunk(2, dim=-1)
    if fused.available(h):
        return fused.relu_square(h) if up is None else fused.silu_mul(gate, up)
    return torch.relu(h).square() if up is None else F.silu(gate) * up


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether PyTorch's grouped product takes these tensors: present (2.10+), and on a GPU
    in bf16 (its CUDA kernel's dtype); on the CPU in any floating dtype."""
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype:
        return False
    return x.device.type == "cpu" or x.dtype == torch.bfloat16


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [P, in] sorted by expert (expert e's rows end at ``ends[e]``), each times
    its expert's ``weight[e]`` [out, in] transposed: [P, out]."""
    if _grouped_mm_fits(x, weight):
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    # Every expert over every row, each row keeping its own expert's product: the fallback's
    # row -> expert map is derived here, so the grouped product's path computes none of it.
    rows = torch.arange(x.shape[0], device=x.device, dtype=ends.dtype)
    row_experts = torch.bucketize(rows, ends, right=True)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        out = torch.where(row_experts[:, None] == e, F.linear(x, weight[e]), out)
    return out


def routed_experts(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                   up: torch.Tensor, down: torch.Tensor, activation: str,
                   accumulate: torch.dtype | None = None) -> torch.Tensor:
    """sum_j expert_weights[t, j] * down[e] @ act(up[e] @ x[t]), e = expert_ids[t, j], for
    each token t of ``x`` [T, H]; ``expert_ids`` [T, k] (integers below E), ``expert_weights``
    [T, k]. Each product is rounded to ``x``'s dtype (as transformers' experts' are), weighted
    and summed in ``accumulate`` (default: ``x``'s dtype), and returned in ``x``'s dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    T, H = x.shape
    E = up.shape[0]
    if expert_ids.shape != expert_weights.shape or expert_ids.shape[0] != T:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} and expert_weights "
                         f"{tuple(expert_weights.shape)} must both be [{T}, k]")
    k = expert_ids.shape[1]
    accumulate = accumulate or x.dtype
    flat = expert_ids.reshape(-1).to(torch.int64)
    # Pairs by expert, tokens in order within; sorted on the narrowest integer type that holds
    # an expert id: PyTorch's radix sort takes fewer passes (H200, 1536-4096 pairs in a CUDA
    # graph: 16-18 µs on int16 keys against 31-37 µs on int64; bench/moe_sort_sweep.py).
    keys = flat.to(torch.int16 if E <= torch.iinfo(torch.int16).max else torch.int32)
    order = torch.argsort(keys, stable=True)
    # position[pair] = its row in the sorted order (order's inverse), to gather the products back
    position = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=x.device))
    # Group ends from counts, on the device (no host synchronisation in a captured step).
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
    rows = x[order // k]                            # [T*k, H], sorted by expert
    h = _activate(_grouped_linear(rows, up, ends), activation)
    y = _grouped_linear(h, down, ends)  # [T*k, H], rounded to x's dtype
    if fused.available(y):
        return fused.weighted_rows_sum(y, position.view(T, k), expert_weights, accumulate)
    by_token = y[position].view(T, k, H)            # back to (token, slot) order
    weighted = by_token.to(accumulate) * expert_weights[..., None].to(accumulate)
    return weighted.sum(dim=1).to(x.dtype)
