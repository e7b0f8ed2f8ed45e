"""The fast twin's ``DenseDecoderKV``: dense per-group decoder storage with grouped-query reads.

Fast twin of ``oasr.reference.decoder_cache.DenseDecoderKV`` (``oasr.decoder.kv``
draws the storage): a decode group's per-group ``(B, H, cap, D)`` buffers when its
config's ``kv_storage`` resolves to dense (``oasr.decoder.config``) instead of the
manager's pages.
"""

from __future__ import annotations

import math

import torch

from oasr.decoder.kv import DenseDecoderKV as DenseDecoderKVBase
from oasr.fast.kv_formats import dequantize as _dequantize
from oasr.fast.kv_formats import quantize as _quantize


class DenseDecoderKV(DenseDecoderKVBase):
    """Dense per-group storage (``oasr.decoder.kv``) quantizing with the fast twin's rule of its format.

    Its reads group the query heads of each KV head instead of repeating K and V per query head
    (``repeat_interleave`` copies the whole cache every layer and step): ``(B * Hkv, G * T, D)``
    queries against ``(B * Hkv, S, D)`` keys in one batched matmul each way, the same dot products
    as the reference's. Masks as the reference's: a query with no allowed key reads zeros."""

    quantize = staticmethod(_quantize)
    dequantize = staticmethod(_dequantize)

    @staticmethod
    def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q (B, nH, T, D), k/v (B, Hkv, S, D) fp32, allowed (B, T, S) -> (B, nH, T, D) in q's dtype.
        ``allowed=None``: every query sees every key (no mask to build or apply)."""
        B, nH, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        G = nH // Hkv
        qf = q.float().reshape(B * Hkv, G * T, D)  # head h = kv_head * G + g, rows (g, t)
        scores = torch.bmm(qf, k.reshape(B * Hkv, S, D).transpose(1, 2)).mul_(1.0 / math.sqrt(D))
        if allowed is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            mask = ~allowed[:, None, None]  # (B, 1, 1, T, S)
            scores = scores.view(B, Hkv, G, T, S).masked_fill_(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).masked_fill_(mask, 0.0)
        out = torch.bmm(probs.view(B * Hkv, G * T, S), v.reshape(B * Hkv, S, D))
        return out.view(B, nH, T, D).to(q.dtype)

    def attend_self(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``q`` over each row's own tokens at ``layer`` (the step's included)."""
        T = q.shape[2]
        end = max(self.lengths) + T
        k = self._load(self.k, self.k_scale, layer, end)
        v = self._load(self.v, self.v_scale, layer, end)
        if T == 1 and self.lengths.count(end - 1) == len(self.lengths):  # one query each, all at the end
            return self._grouped(q, k, v, None)
        query = torch.tensor(self.lengths)[:, None] + torch.arange(T)[None, :]
        allowed = torch.arange(end)[None, None, :] <= query[:, :, None]
        return self._grouped(q, k, v, allowed.to(q.device))

    def attend_cross(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over each row's cross-attention K/V (the encoder output) at ``layer``."""
        T = q.shape[2]
        end = max(self.cross_lengths, default=0)
        k = self._load(self.cross_k, self.cross_k_scale, layer, end)
        v = self._load(self.cross_v, self.cross_v_scale, layer, end)
        if end and self.cross_lengths.count(end) == len(self.cross_lengths):  # every row holds the same extent
            return self._grouped(q, k, v, None)
        allowed = (torch.arange(end)[None, :] < torch.tensor(self.cross_lengths)[:, None])[:, None, :]
        return self._grouped(q, k, v, allowed.expand(-1, T, -1).to(q.device))
