"""Projections: :class:`Linear`, the one GEMM every model's projections go through."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Linear):
    """``y = x @ W^T + b`` with ``W (out_features, in_features)``: ``torch.nn.Linear``'s parameters and numerics.

    The seam for a quantized or fused GEMM: a future weight format replaces :meth:`forward` here, and
    every architecture built on the waist gets it. Parameter names (``weight``, ``bias``) are torch's, so
    checkpoints load unchanged.

    ``set_compute_dtype(torch.bfloat16)`` runs the GEMM in bfloat16 (inputs rounded to it, fp32
    accumulation inside the BLAS, the output back in the input's dtype): on a CPU with AVX512-BF16
    about 3-4x the fp32 GEMM's speed. It keeps a bfloat16 copy of the weights taken at the call (a
    serving switch: call it again after changing the weights); ``set_compute_dtype(None)`` returns to
    torch's numerics.
    """

    _compute: tuple | None = None  # (dtype, weight, bias) of set_compute_dtype, or None

    def set_compute_dtype(self, dtype: torch.dtype | None) -> None:
        """Run the GEMM in ``dtype`` (None: the parameters' own, torch's numerics); see the class docstring."""
        if dtype is None:
            self._compute = None
            return
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"Linear.set_compute_dtype: expected a floating torch dtype or None, got {dtype!r}")
        with torch.no_grad():
            bias = None if self.bias is None else self.bias.detach().to(dtype)
            self._compute = (dtype, self.weight.detach().to(dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b``: torch's, or in the compute dtype of ``set_compute_dtype`` (output in ``x``'s dtype)."""
        if self._compute is None:
            return super().forward(x)
        dtype, weight, bias = self._compute
        return F.linear(x.to(dtype), weight, bias).to(x.dtype)
