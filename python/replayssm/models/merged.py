"""Several projections of one input as one GEMM, as serving engines run them (vLLM's merged
column-parallel linears): an MLP's gate and up, attention's q, k and v, the Gated DeltaNet's
four input projections. At batch 256 a step of Qwen3.5-4B ran 48 GEMMs of 32 output columns
(the GDN's a and b) at ~6 µs each, as long as a GEMM a hundred times their size; merged, their
columns ride along in the large one.

The modules keep their own parameters and names (checkpoints load and save as before): the
merged weight is one tensor whose row blocks the modules' weights then view, so it costs no
memory and a copy into a module's weight (loading) reaches it. When a module's weight no longer
views it (the model moved to another device or dtype, or a parameter was replaced), the next call
merges again. The product is the same dot products as the separate projections'; cuBLAS may
order a dot product's sum differently for another output width, so results agree to the
activations' rounding, not bit for bit.

The merged weight gets zero rows up to a multiple of 16 bytes of output, whose columns the
outputs leave out: cuBLAS takes its fast kernels only for 16-byte aligned rows. Qwen3.5-35B-A3B's
router, shared-expert gate and shared expert (256 + 1 + 2 x 512 = 1281 columns) otherwise ran
an align-1 kernel of 39 µs per layer at batch 512 on an H200, 3.5% of the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MergedLinear"]


class MergedLinear:
    """``MergedLinear(a, b, c)(x)`` = ``(a(x), b(x), c(x))`` in one GEMM; the outputs are
    column slices of one [..., sum of widths] tensor (channels contiguous, rows strided)."""

    def __init__(self, *linears: nn.Linear) -> None:
        if not linears or len({m.in_features for m in linears}) != 1:
            raise ValueError("MergedLinear: one or more projections of the same input width")
        if len({m.bias is None for m in linears}) != 1:
            raise ValueError("MergedLinear: the projections must all have a bias or none")
        self._linears = linears
        self.sizes = [m.out_features for m in linears]
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._weight is None or not self._viewed(self._weight, "weight"):
            self._weight = self._merge("weight")
        if self._linears[0].bias is not None and (self._bias is None or
                                                  not self._viewed(self._bias, "bias")):
            self._bias = self._merge("bias")
        out = F.linear(x, self._weight, self._bias)
        return out.split(self.sizes + [out.shape[-1] - sum(self.sizes)], -1)[:-1]

    def _merge(self, name: str) -> torch.Tensor:
        parts = [getattr(m, name) for m in self._linears]
        rows = sum(self.sizes)
        per_16_bytes = max(1, 16 // parts[0].element_size())
        pad = -rows % per_16_bytes
        with torch.no_grad():
            merged = torch.cat([p.detach() for p in parts] +
                               [parts[0].new_zeros((pad,) + tuple(parts[0].shape[1:]))])
        row = 0
        for p in parts:
            p.data = merged[row:row + p.shape[0]]
            row += p.shape[0]
        return merged

    def _viewed(self, merged: torch.Tensor, name: str) -> bool:
        """Whether every module's ``name`` is still its row block of ``merged``."""
        row_bytes = merged.stride(0) * merged.element_size()
        row = 0
        for m in self._linears:
            p = getattr(m, name)
            if (p.device != merged.device or p.dtype != merged.dtype
                    or p.data_ptr() != merged.data_ptr() + row * row_bytes):
                return False
            row += p.shape[0]
        return True
