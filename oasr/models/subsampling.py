"""Causal 4x subsampling whose left tails are declared stream state.

Two stride-2 1-D convolutions. Each stage is causal: with kernel ``k`` its
output frame ``j`` reads input frames ``[2j + 2 - k, 2j + 1]``, which is a
plain convolution over the input left-padded with ``k - 2`` frames::

    input:   ... x[s-3] x[s-2] x[s-1] | x[s] x[s+1] x[s+2] x[s+3] ...      (s even, k = 5)
                 '------ tail -----'    '---- this chunk ----------'
    output j = s/2 reads x[s-3 .. s+1];  j = s/2 + 1 reads x[s-1 .. s+3]

So ``T`` input frames give ``T // 2`` outputs, and a chunk whose first frame is
even needs exactly the ``k - 2`` input frames before it: that tail is the
stage's whole streaming state. It is *declared* (``state_specs``) and lives in
a ``SlotStateCache`` row like any other fixed-extent state; nothing in the
cache layer knows it is a subsampling tail. A zero tail is exactly the zero
padding the offline pass applies, so the first chunk needs no special case.

Every chunk but a stream's last has ``4 * chunk_size`` input frames, so both
stages always start a chunk on an even frame and streaming is exact. A short
last chunk of ``n`` frames yields ``n // 4`` encoder frames, the same frames the
offline pass computes for the valid prefix (``T // 4`` over the whole stream).
"""

from __future__ import annotations

import torch
from torch import nn

from oasr import layers
from oasr.cache.state_spec import StreamStateSpec


def last_valid_frames(extended: torch.Tensor, valid_lens: torch.Tensor, count: int) -> torch.Tensor:
    """The last ``count`` valid frames of each row of ``extended = cat(previous_tail, chunk)``.

    ``extended`` is ``(B, count + T, C)``; row ``b`` has ``valid_lens[b]`` valid chunk
    frames, so its last ``count`` valid frames are ``extended[b, n : n + count]``. A row with
    ``n == 0`` (a padding row) keeps its previous tail.
    """
    B, _, C = extended.shape
    index = valid_lens.to(torch.long)[:, None] + torch.arange(count, device=extended.device)[None, :]
    return torch.gather(extended, 1, index[:, :, None].expand(B, count, C))


class CausalConvStage(nn.Module):
    """One causal stride-2 convolution (kernel ``k >= 2``) and its ``k - 2``-frame tail."""

    def __init__(self, in_dim: int, out_dim: int, kernel: int):
        super().__init__()
        if kernel < 2:
            raise ValueError(f"CausalConvStage: kernel must be >= 2 for a stride-2 causal conv, got {kernel}")
        self.conv = layers.Conv1d(in_dim, out_dim, kernel, stride=2)
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.tail_frames = kernel - 2

    def forward(self, x: torch.Tensor, tail: torch.Tensor, lens: torch.Tensor):
        """``x (B, T, in)``, ``tail (B, k-2, in)`` -> ``(y (B, T//2, out), out_lens, new_tail)``."""
        extended = torch.cat([tail, x], dim=1)
        out_frames = x.shape[1] // 2
        if out_frames == 0:
            y = x.new_zeros((x.shape[0], 0, self.out_dim))
        else:
            y = layers.silu(self.conv(extended.transpose(1, 2)).transpose(1, 2))
        return y, lens // 2, last_valid_frames(extended, lens, self.tail_frames)


class CausalSubsampling4(nn.Module):
    """``(B, T, input_dim)`` features -> ``(B, T // 4, hidden_dim)`` encoder input."""

    rate = 4

    def __init__(self, input_dim: int, channels: int, hidden_dim: int, kernels=(5, 3), prefix: str = "subsample"):
        super().__init__()
        k1, k2 = kernels
        self.stage1 = CausalConvStage(input_dim, channels, k1)
        self.stage2 = CausalConvStage(channels, channels, k2)
        self.proj = layers.Linear(channels, hidden_dim)
        self.prefix = prefix

    @property
    def state_specs(self) -> tuple:
        """The two tails, one row per stream slot (``slot_axis=0``)."""
        return (
            StreamStateSpec(f"{self.prefix}.conv1", (self.stage1.tail_frames, self.stage1.in_dim)),
            StreamStateSpec(f"{self.prefix}.conv2", (self.stage2.tail_frames, self.stage2.in_dim)),
        )

    def zero_tails(self, batch: int, like: torch.Tensor) -> list:
        """Zeroed convolution tails for ``batch`` streams, on ``like``'s device and dtype."""
        return [like.new_zeros(spec.batch_shape(batch)) for spec in self.state_specs]

    def forward(self, x: torch.Tensor, tails, lens: torch.Tensor):
        """Returns ``(encoder_input (B, T//4, hidden), out_lens (B,), [new_tail1, new_tail2])``."""
        h, lens1, tail1 = self.stage1(x, tails[0], lens)
        h, lens2, tail2 = self.stage2(h, tails[1], lens1)
        return self.proj(h), lens2, [tail1, tail2]
