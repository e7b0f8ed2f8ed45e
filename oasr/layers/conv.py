"""Convolutions: :class:`Conv1d`, :class:`DepthwiseConv1d` (channels-first, ``(B, C, T)``) and :class:`Conv2d`.

Streaming models pad on the left themselves (a cached left context), so none of these pads on its own
unless the caller asks.
"""

from __future__ import annotations

from torch import nn


class Conv1d(nn.Conv1d):
    """A 1-D convolution over ``(B, C, T)``: ``torch.nn.Conv1d``'s parameters and numerics."""


class DepthwiseConv1d(nn.Conv1d):
    """A depthwise 1-D convolution (one filter per channel, ``groups == channels``) over ``(B, C, T)``.

    ``weight`` has torch's depthwise shape ``(channels, 1, kernel_size)``, so checkpoints written with a
    grouped ``nn.Conv1d`` load unchanged.
    """

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = True, stride: int = 1, padding: int = 0):
        super().__init__(channels, channels, kernel_size, stride=stride, padding=padding, groups=channels, bias=bias)


class Conv2d(nn.Conv2d):
    """A 2-D convolution over ``(B, C, H, W)``: ``torch.nn.Conv2d``'s parameters and numerics."""
