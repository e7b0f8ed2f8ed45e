"""The causal Conv2d subsampling stack (``factor = 2 ** stages``) and its fixed-size streaming state.

Checkpoint names: ``conv_in`` (1 -> channels, strided), ``layers.i.depthwise_conv`` (strided,
one filter per channel) + ``layers.i.pointwise_conv`` (1x1), then ``linear`` over the flattened
``channels x bins`` of each frame. ReLU after the stem and after every pointwise conv.

Every strided conv is causal on the time axis and pads the frequency axis by ``(k - 1, s - 1)``.
Streaming, stage ``i`` reads ``k - s`` cached input frames (its *tail*) before the chunk; a
stream's first chunk instead reads ``k - 1`` zeros (what an offline pass pads)::

    stage input      first chunk:  [ 0 ... 0 (k - 1) | x0 x1 x2 ... ]     out = (n - 1) // s + 1 frames
                     later chunks: [ tail (k - s)     | x0 x1 x2 ... ]     out = n // s frames
                     new tail:     the last k - s valid input frames (the previous tail's end when n < k - s)

Both forms give ``T / s`` frames on an input of ``T`` (``T`` a multiple of ``s``), so a cohort of
first and later chunks is one batch: each stage computes both forms and keeps the one a row needs
(``first`` per row, a device tensor; nothing is read back). The tails are declared state
(``state_specs``: one ``(channels_in, k - s, bins + k + s - 2)`` tensor per stage, zero-initialised).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oasr import layers
from oasr.cache.state_spec import StreamStateSpec
from oasr.models.nemotron.config import NemotronEncoderConfig


class SubsamplingStage(nn.Module):
    """A depthwise strided causal Conv2d and a 1x1 pointwise Conv2d (``layers.i`` of the checkpoint)."""

    def __init__(self, channels: int, kernel: int, stride: int):
        super().__init__()
        self.depthwise_conv = layers.Conv2d(channels, channels, kernel, stride=stride, groups=channels)
        self.pointwise_conv = layers.Conv2d(channels, channels, 1)


def _time_pad(x: torch.Tensor, frames: int) -> torch.Tensor:
    """``frames`` zero frames before ``x (B, C, T, F)`` on the time axis."""
    return F.pad(x, (0, 0, frames, 0))


def _last_frames(extended: torch.Tensor, end: torch.Tensor, count: int) -> torch.Tensor:
    """Per row ``b`` the ``count`` time frames ``extended[b, :, end[b] - count : end[b]]`` (``end >= count``)."""
    B, C, _, Fq = extended.shape
    index = end.to(torch.long)[:, None] - count + torch.arange(count, device=extended.device)[None, :]
    return torch.gather(extended, 2, index[:, None, :, None].expand(B, C, count, Fq))


class CausalConv2dSubsampling(nn.Module):
    """``(B, T_in, num_mel_bins)`` features -> ``(B, T_in / factor, hidden_size)`` encoder frames (unscaled)."""

    def __init__(self, config: NemotronEncoderConfig):
        super().__init__()
        ch, k, s = config.subsampling_conv_channels, config.subsampling_conv_kernel_size, config.subsampling_conv_stride
        self.config = config
        self.kernel, self.stride = k, s
        self.conv_in = layers.Conv2d(1, ch, k, stride=s)
        self.layers = nn.ModuleList(SubsamplingStage(ch, k, s) for _ in range(config.subsampling_stages - 1))
        bins = config.freq_bins()
        self.linear = layers.Linear(ch * bins[-1], config.hidden_size)
        self.tail_frames = k - s
        self._channels_in = [1] + [ch] * (config.subsampling_stages - 1)
        self._padded_bins = [b + (k - 1) + (s - 1) for b in bins[:-1]]

    @property
    def state_specs(self) -> tuple:
        """One tail per strided conv, ``(channels_in, k - s, padded bins)``, in stage order."""
        return tuple(
            StreamStateSpec(f"nemotron_subsampling_tail{i}", (c, self.tail_frames, b))
            for i, (c, b) in enumerate(zip(self._channels_in, self._padded_bins, strict=True))
        )

    def zero_tails(self, batch: int, like: torch.Tensor) -> list:
        """Zero tails for ``batch`` rows, ``like``'s dtype and device (a stream's initial state)."""
        return [like.new_zeros(spec.batch_shape(batch)) for spec in self.state_specs]

    def _strided(self, conv, h, tail, lens, first):
        """One strided causal conv over ``h (B, C, T, F)`` (frequency already padded), both forms.

        Returns ``(out (B, C', T / s, F'), out_lens, new_tail)``."""
        k, s = self.kernel, self.stride
        later_in = torch.cat([tail, h], dim=2)  # (B, C, k - s + T, F)
        out_later = conv(later_in)
        out_first = conv(_time_pad(h, k - 1))
        pick = first[:, None, None, None]
        out = torch.where(pick, out_first, out_later)
        out_lens = torch.where(first, torch.div(lens - 1, s, rounding_mode="floor") + 1, torch.div(lens, s,
                                                                                                    rounding_mode="floor"))
        out_lens = out_lens.clamp(min=0)
        if self.tail_frames:
            # the first chunk's extended input starts with k - 1 zeros; a later one with the k - s frame tail
            ext_first = _time_pad(h, self.tail_frames)  # zeros stand for the frames before the stream
            new_tail = torch.where(pick, _last_frames(ext_first, lens + self.tail_frames, self.tail_frames),
                                   _last_frames(later_in, lens + self.tail_frames, self.tail_frames))
        else:
            new_tail = tail
        return out, out_lens, new_tail

    def forward(self, xs: torch.Tensor, tails: list, input_lens: torch.Tensor, first: torch.Tensor):
        """``xs (B, T_in, bins)``, ``tails`` (``state_specs`` order, gathered), ``input_lens (B,)`` valid
        feature frames, ``first (B,)`` bool (a stream's first chunk) -> ``(x (B, T_in / factor, hidden),
        chunk_lens (B,), new_tails)``. Frames past a row's length are garbage no valid frame reads."""
        k, s = self.kernel, self.stride
        if xs.shape[1] % self.config.subsampling_factor:
            raise ValueError(f"CausalConv2dSubsampling: T_in={xs.shape[1]} must be a multiple of "
                             f"subsampling_factor={self.config.subsampling_factor}")
        h = F.pad(xs[:, None], (k - 1, s - 1))  # (B, 1, T, bins + k + s - 2)
        lens = input_lens.to(torch.long)
        new_tails = []
        h, lens, tail = self._strided(self.conv_in, h, tails[0], lens, first)
        new_tails.append(tail)
        h = F.relu(h)
        for i, stage in enumerate(self.layers):
            h = F.pad(h, (k - 1, s - 1))
            h, lens, tail = self._strided(stage.depthwise_conv, h, tails[i + 1], lens, first)
            new_tails.append(tail)
            h = F.relu(stage.pointwise_conv(h))
        B, C, T, Fq = h.shape
        x = self.linear(h.transpose(1, 2).reshape(B, T, C * Fq))
        return x, lens, new_tails
