"""Recurrence: :class:`LSTM` (a transducer's prediction network is built from it)."""

from __future__ import annotations

from torch import nn


class LSTM(nn.LSTM):
    """A multi-layer LSTM: ``torch.nn.LSTM``'s parameters (``weight_ih_l0``, ...) and numerics.

    Streaming callers carry ``(h, c)`` per stream themselves (fixed-size slot state) and call it one step
    or one chunk at a time.
    """
