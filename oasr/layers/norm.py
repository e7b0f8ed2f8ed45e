"""Normalisation: :class:`LayerNorm` (torch's eps convention, 1e-5, unless a checkpoint says otherwise)."""

from __future__ import annotations

from torch import nn


class LayerNorm(nn.LayerNorm):
    """Layer normalisation over the last dimension: ``torch.nn.LayerNorm``'s parameters and numerics.

    ``eps`` is the caller's: torch's default 1e-5 unless the checkpoint's configuration names another.
    """
