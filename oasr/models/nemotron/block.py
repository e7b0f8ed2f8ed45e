"""One FastConformer block (the checkpoint's ``layers.i``): macaron feed-forward halves around
relative-position attention and a causal convolution module, pre-norm, a final norm::

    x = x + 0.5 * feed_forward1(norm_feed_forward1(x))
    x = x + self_attn(norm_self_att(x))                 paged K/V window + relative-position table
    x = x + conv(norm_conv(x))                          causal depthwise conv, ``kernel - 1`` cached frames
    x = x + 0.5 * feed_forward2(norm_feed_forward2(x))
    x = norm_out(x)

The convolution module: ``pointwise_conv1`` (d -> 2d) and GLU over channels, the causal
``depthwise_conv`` reading ``kernel - 1`` frames of the stream's past GLU outputs (the conv cache,
``(B, kernel - 1, d)`` time-major, as ``CnnCacheManager`` stores it), ``norm``, SiLU,
``pointwise_conv2``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oasr import layers
from oasr.models.nemotron.attention import RelPositionAttention
from oasr.models.nemotron.config import NemotronEncoderConfig
from oasr.models.subsampling import last_valid_frames


class FeedForward(nn.Module):
    """``linear2(silu(linear1(x)))``."""

    def __init__(self, config: NemotronEncoderConfig):
        super().__init__()
        self.linear1 = layers.Linear(config.hidden_size, config.intermediate_size, bias=config.attention_bias)
        self.linear2 = layers.Linear(config.intermediate_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., d) -> (..., d)``."""
        return self.linear2(F.silu(self.linear1(x)))


class ConvModule(nn.Module):
    """Pointwise + GLU, causal depthwise conv over a cached left context, norm, SiLU, pointwise."""

    def __init__(self, config: NemotronEncoderConfig):
        super().__init__()
        d, k, bias = config.hidden_size, config.conv_kernel_size, config.convolution_bias
        self.context = k - 1
        self.pointwise_conv1 = layers.Conv1d(d, 2 * d, 1, bias=bias)
        self.depthwise_conv = layers.DepthwiseConv1d(d, k, bias=bias)
        self.norm = layers.LayerNorm(d, eps=config.layer_norm_eps)
        self.pointwise_conv2 = layers.Conv1d(d, d, 1, bias=bias)

    def forward(self, x: torch.Tensor, conv_cache: torch.Tensor, chunk_lens: torch.Tensor):
        """``x (B, T, d)``, ``conv_cache (B, kernel - 1, d)`` -> ``(out (B, T, d), new_conv_cache)``.

        Frames past a row's ``chunk_lens`` are zeroed before the depthwise conv (they are no frames
        of the stream) and the new cache is the last ``kernel - 1`` valid GLU frames."""
        T = x.shape[1]
        h = F.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1).transpose(1, 2)  # (B, T, d)
        valid = torch.arange(T, device=x.device)[None, :] < chunk_lens[:, None]
        h = h * valid[..., None].to(h.dtype)
        extended = torch.cat([conv_cache.to(h.dtype), h], dim=1)  # (B, kernel - 1 + T, d)
        new_cache = last_valid_frames(extended, chunk_lens, self.context)
        h = self.depthwise_conv(extended.transpose(1, 2)).transpose(1, 2)  # (B, T, d)
        h = F.silu(self.norm(h))
        return self.pointwise_conv2(h.transpose(1, 2)).transpose(1, 2), new_cache


class FastConformerBlock(nn.Module):
    def __init__(self, config: NemotronEncoderConfig):
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.feed_forward1 = FeedForward(config)
        self.self_attn = RelPositionAttention(config)
        self.conv = ConvModule(config)
        self.feed_forward2 = FeedForward(config)
        self.norm_feed_forward1 = layers.LayerNorm(d, eps=eps)
        self.norm_self_att = layers.LayerNorm(d, eps=eps)
        self.norm_conv = layers.LayerNorm(d, eps=eps)
        self.norm_feed_forward2 = layers.LayerNorm(d, eps=eps)
        self.norm_out = layers.LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor, attend, conv_cache: torch.Tensor, chunk_lens: torch.Tensor):
        """``attend(normed_x) -> attention output``: the paged attention of this layer, bound by the encoder."""
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + attend(self.norm_self_att(x))
        conv_out, new_conv_cache = self.conv(self.norm_conv(x), conv_cache, chunk_lens)
        x = x + conv_out
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x), new_conv_cache
