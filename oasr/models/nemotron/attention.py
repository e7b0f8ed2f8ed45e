"""Transformer-XL relative-position self-attention over paged K/V (the checkpoint's ``self_attn``).

Parameters, by the checkpoint's names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``relative_k_proj`` (no bias: the positional key projection ``W_{k,R}``), ``bias_u`` and
``bias_v`` (``(n_head, head_dim)``, the content and positional global biases). For a query at
absolute frame ``p_q`` and a key at ``p_k``, with ``d = p_q - p_k`` and ``s = head_dim ** -0.5``::

    score = s * (q + bias_u) . k   +   s * (q + bias_v) . relative_k_proj(pe(d))
            \\____ paged_attention ____/   \\______ rel_bias: one column per distance ______/

    pe(d) = [sin(d w_0), cos(d w_0), sin(d w_1), cos(d w_1), ...]   w_i = 10000 ** (-2i / hidden_size)

The second term depends on the key only through ``d``, so it is a table of queries x distances
(``oasr.cache.rel_bias``: column ``d + T - 1``), never queries x keys. A chunk of ``T`` frames with
``W`` frames of history needs distances ``-(T - 1) .. W + T - 1``: ``R = W + 2T - 1`` columns, and
``relative_k_proj`` runs over those ``R`` positional rows once per layer for the whole cohort
(they are the same for every row: the prefilled window gives every stream the same span).

The window is prefilled with zero K/V at admission; those keys are not frames of the stream, so
the table puts ``-inf`` at every distance reaching before the stream's frame 0 (``d > offset + t``),
per row: a stream in its first chunks sees only its own frames, exactly like the oracle's growing cache.
"""

from __future__ import annotations

import torch
from torch import nn

from oasr import layers
from oasr.models.nemotron.config import NemotronEncoderConfig


def relative_positions(distances: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """``pe(d)`` for each distance: ``(R,) -> (R, hidden_size)`` fp32, sin and cos interleaved."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hidden_size, 2, dtype=torch.float32,
                                               device=distances.device) / hidden_size))
    angles = distances.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(distances.shape[0], hidden_size)


class RelPositionAttention(nn.Module):
    """Projections and the relative-position table; the attention itself is the twin's ``paged_attention``."""

    def __init__(self, config: NemotronEncoderConfig):
        super().__init__()
        d, H = config.hidden_size, config.num_attention_heads
        self.n_head, self.head_dim, self.hidden_size = H, config.head_dim, d
        self.scale = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = layers.Linear(d, d, bias=bias)
        self.k_proj = layers.Linear(d, d, bias=bias)
        self.v_proj = layers.Linear(d, d, bias=bias)
        self.o_proj = layers.Linear(d, d, bias=bias)
        self.relative_k_proj = layers.Linear(d, d, bias=False)
        self.bias_u = nn.Parameter(torch.zeros(H, self.head_dim))
        self.bias_v = nn.Parameter(torch.zeros(H, self.head_dim))

    def project(self, x: torch.Tensor):
        """``x (B, T, d)`` -> ``q, k, v`` each ``(B, T, n_head, head_dim)``."""
        B, T, _ = x.shape
        shape = (B, T, self.n_head, self.head_dim)
        return self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)

    def positional_keys(self, num_frames: int, window: int, like: torch.Tensor) -> torch.Tensor:
        """``relative_k_proj(pe(d))`` for ``d = -(T - 1) .. W + T - 1``, in column order: ``(R, n_head, head_dim)``
        with ``R = W + 2T - 1`` (column ``c`` is distance ``c - (T - 1)``)."""
        T = num_frames
        distances = torch.arange(-(T - 1), window + T, device=like.device)
        pe = relative_positions(distances, self.hidden_size).to(like.dtype)
        return self.relative_k_proj(pe).view(-1, self.n_head, self.head_dim)

    def rel_bias(self, q: torch.Tensor, pos_keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The table ``paged_attention`` adds: float32 ``(B, n_head, T, R)``.

        ``q (B, T, n_head, head_dim)`` (without ``bias_u``), ``pos_keys`` from ``positional_keys``,
        ``offsets (B,)`` each row's absolute position of its first query. Entry ``[b, h, t, c]`` is
        ``s * (q[b, t, h] + bias_v[h]) . pos_keys[c, h]``, or ``-inf`` where ``c - (T - 1) > offsets[b] + t``
        (a key before the stream's first frame: the zeroed prefill)."""
        B, T = q.shape[:2]
        qv = (q + self.bias_v.to(q.dtype)).transpose(1, 2)  # (B, H, T, D)
        table = torch.matmul(qv, pos_keys.permute(1, 2, 0)).float() * self.scale  # (B, H, T, R)
        R = pos_keys.shape[0]
        distance = torch.arange(R, device=q.device) - (T - 1)  # (R,)
        reach = offsets.to(torch.long)[:, None] + torch.arange(T, device=q.device)[None, :]  # (B, T)
        before_start = distance[None, None, :] > reach[:, :, None]  # (B, T, R)
        return table.masked_fill(before_start[:, None], float("-inf"))

    def content_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q + bias_u`` heads first, what ``paged_attention`` takes: ``(B, n_head, T, head_dim)``."""
        return (q + self.bias_u.to(q.dtype)).transpose(1, 2).contiguous()

    def attend(self, x: torch.Tensor, cache, chunk_lens32: torch.Tensor, offsets: torch.Tensor, window: int, ops,
               pos_keys: torch.Tensor | None = None) -> torch.Tensor:
        """One layer's attention for ``x (B, T, d)`` (already normed): append K/V to ``cache``, attend over
        the row's window and chunk with the relative term, project out. ``ops``: the twin module."""
        B, T, _ = x.shape
        q, k, v = self.project(x)
        ops.append_kv(cache, k.contiguous(), v.contiguous(), chunk_lens32)
        if pos_keys is None:
            pos_keys = self.positional_keys(T, window, x)
        bias = self.rel_bias(q, pos_keys, offsets)
        out = ops.paged_attention(self.content_query(q), cache, chunk_lens32, softmax_scale=self.scale,
                                  rel_bias=bias)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.hidden_size))

