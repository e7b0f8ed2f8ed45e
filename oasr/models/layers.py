"""Conformer building blocks: rotary positions, feed-forward, GQA projections, causal conv module.

The blocks hold weights and do the per-frame work. How a chunk's queries meet
their keys (chunk-masked offline, dense concatenation, paged) is the model's
business (``oasr.models.conformer``), so each block is written once and serves
all three forwards.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from oasr import layers

# ---- rotary positions ------------------------------------------------------------


def rope_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """``base ** (-2i / head_dim)`` for ``i < head_dim / 2``, in float64."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """``cos, sin`` of shape ``(B, T, 1, head_dim)`` at absolute integer ``positions (B, T)``.

    The angles are computed in float64 so a frame ten minutes into a stream gets the
    same rotation whichever forward computes it.
    """
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (B, T, heads, head_dim)`` by the half-split rotary convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---- attention over dense keys ------------------------------------------------------


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None):
    """Plain attention; ``q (B, T, n_head, D)``, ``k, v (B, S, n_kv_head, D)``, ``allowed (B, T, S)`` or None.

    Query head ``h`` reads KV head ``h // (n_head // n_kv_head)``. A query row with no
    allowed key gets zeros (not NaN), so padded frames stay finite.
    Returns ``(B, T, n_head * D)``.
    """
    B, T, n_head, D = q.shape
    group = n_head // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh.float() @ kh.float().transpose(-1, -2)) * (1.0 / math.sqrt(D))
    if allowed is not None:
        mask = allowed[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
    else:
        probs = torch.softmax(scores, dim=-1)
    out = (probs @ vh.float()).to(q.dtype)
    return out.transpose(1, 2).reshape(B, T, n_head * D)


# ---- blocks -----------------------------------------------------------------------------


class FeedForward(nn.Module):
    """LayerNorm -> Linear -> SiLU -> Linear (the Conformer's half-step FFN, scaled by the caller)."""

    def __init__(self, hidden_dim: int, ffn_dim: int):
        super().__init__()
        self.norm = layers.LayerNorm(hidden_dim)
        self.up = layers.Linear(hidden_dim, ffn_dim)
        self.down = layers.Linear(ffn_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm, up-projection, SiLU, down-projection of ``x`` (the caller scales it and adds the residual)."""
        return self.down(layers.silu(self.up(self.norm(x))))


class GroupedQueryProjections(nn.Module):
    """LayerNorm and the Q/K/V/output projections of multi-head attention with ``n_kv_head`` KV heads."""

    def __init__(self, hidden_dim: int, n_head: int, n_kv_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.norm = layers.LayerNorm(hidden_dim)
        self.q = layers.Linear(hidden_dim, n_head * head_dim)
        self.k = layers.Linear(hidden_dim, n_kv_head * head_dim)
        self.v = layers.Linear(hidden_dim, n_kv_head * head_dim)
        self.out = layers.Linear(n_head * head_dim, hidden_dim)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``q (B, T, n_head, D)`` and ``k, v (B, T, n_kv_head, D)``; q and k rotated at their positions."""
        B, T, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, T, self.n_head, self.head_dim)
        k = self.k(h).view(B, T, self.n_kv_head, self.head_dim)
        v = self.v(h).view(B, T, self.n_kv_head, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class CausalConvModule(nn.Module):
    """LayerNorm -> pointwise (2x) -> GLU -> causal depthwise conv -> LayerNorm -> SiLU -> pointwise.

    The depthwise conv reads ``kernel_size - 1`` frames of GLU output before the chunk:
    that left context is the ``CnnCacheManager`` row of this layer. LayerNorm (not
    BatchNorm) keeps every frame independent of the batch it is computed in.
    """

    def __init__(self, hidden_dim: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.norm = layers.LayerNorm(hidden_dim)
        self.pointwise_in = layers.Linear(hidden_dim, 2 * hidden_dim)
        self.depthwise = layers.DepthwiseConv1d(hidden_dim, kernel_size)
        self.conv_norm = layers.LayerNorm(hidden_dim)
        self.pointwise_out = layers.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor, left_context: torch.Tensor):
        """``x (B, T, H)``, ``left_context (B, K-1, H)`` -> ``(y (B, T, H), cat(left_context, glu) (B, K-1+T, H))``."""
        glu = F.glu(self.pointwise_in(self.norm(x)), dim=-1)
        extended = torch.cat([left_context.to(glu.dtype), glu], dim=1)
        d = self.depthwise(extended.transpose(1, 2)).transpose(1, 2)
        return self.pointwise_out(layers.silu(self.conv_norm(d))), extended


class ConformerBlock(nn.Module):
    """Half FFN, self-attention, conv module, half FFN, LayerNorm (the macaron Conformer block)."""

    def __init__(self, hidden_dim, n_head, n_kv_head, head_dim, ffn_dim, kernel_size):
        super().__init__()
        self.ffn1 = FeedForward(hidden_dim, ffn_dim)
        self.attn = GroupedQueryProjections(hidden_dim, n_head, n_kv_head, head_dim)
        self.conv = CausalConvModule(hidden_dim, kernel_size)
        self.ffn2 = FeedForward(hidden_dim, ffn_dim)
        self.norm_out = layers.LayerNorm(hidden_dim)

    def forward(self, x, cos, sin, attend, left_context):
        """One block; ``attend(q, k, v) -> (B, T, n_head * D)`` decides which keys each query sees.

        Returns ``(x, cat(left_context, glu))``: the caller takes the conv cache from the second.
        """
        x = x + 0.5 * self.ffn1(x)
        q, k, v = self.attn.qkv(x, cos, sin)
        x = x + self.attn.out(attend(q, k, v))
        y, extended = self.conv(x, left_context)
        x = x + y
        x = x + 0.5 * self.ffn2(x)
        return self.norm_out(x), extended
