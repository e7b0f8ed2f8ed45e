"""Projections: :class:`Linear`, the one GEMM every model's projections go through."""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    """``y = x @ W^T + b`` with ``W (out_features, in_features)``: ``torch.nn.Linear``'s parameters and numerics.

    The seam for a quantized or fused GEMM: a future weight format replaces :meth:`forward` here, and
    every architecture built on the waist gets it. Parameter names (``weight``, ``bias``) are torch's, so
    checkpoints load unchanged.
    """
