"""``PagedKVCache``: the one view of a layer's paged K/V that both twins hand out.

A view describes a *cohort* of ``B`` rows (streams, or padding-lane rows) over
one layer of the shared pool::

    k_cache, v_cache   (num_pool_blocks, block_size, n_kv_head, head_dim)   one layer
    block_table        (B, W) int32   column i -> physical block of logical block i
    cache_seqlens      (B,)   int32   table position one past the last committed frame
    cache_seqstarts    (B,)   int32   first table position a query may attend to

A chunk of ``T`` frames for row ``b`` is written at table positions
``[cache_seqlens[b], cache_seqlens[b] + chunk_lens[b])`` (see ``append_kv``) and
its queries attend to ``[cache_seqstarts[b], cache_seqlens[b] + chunk_lens[b])``
(see ``paged_attention``). Table position ``p`` lives in physical block
``block_table[b, p // block_size]`` at offset ``p % block_size``.

With quantized pages (``CacheConfig(kv_cache_dtype=...)``, the formats of
``oasr.kv_formats``) ``k_cache``/``v_cache`` hold the format's data (``(...,
n_kv_head, data_dim)``: ``head_dim`` values, or ``head_dim / 2`` bytes of 4-bit
codes) and ``k_scale``/``v_scale`` its scale plane per (block, position, kv head):
one fp32 scale for fp8_e4m3 and int8, ``(head_dim / 32,)`` fp16 for q8_0,
``(head_dim / G, 2)`` scale and bias for affine4. ``kv_format`` names the format
(None with scales: fp8_e4m3, as views built before the other formats existed).

``max_seqlen`` and ``max_span`` are host-side maxima over the rows (of
``cache_seqlens`` and of ``cache_seqlens - cache_seqstarts``), filled from the
manager's host bookkeeping so that a launcher can size a grid without reading
the device tensors back. Two more host-side fields, filled by the managers and
optional for a hand-built view, let the ops refuse bad input without a device
read:

* ``prepared_frames``: per row, the most frames a chunk may write past
  ``cache_seqlens[b]`` (and so the most queries it may have): what the row's
  held blocks cover, capped at ``chunk_size`` (exactly what
  ``commit_chunk_paged`` would accept); ``chunk_size`` for a padding-lane row.
  None: not known, not checked.
* ``model_dtype``: the dtype K, V and q must come in. It is the pool's dtype
  for pages in the model dtype; for fp8 pages the manager's ``CacheConfig.dtype``.
  None on an fp8 view: K's own dtype serves, which must be fp32, fp16 or bf16.

Tensor arguments of the ops (checked by ``oasr.validate``; the same in both twins)::

    argument          shape                          dtype                       device
    q                 (B, n_head, T, head_dim)       served_dtype (no casts)     the pool's
    k, v              (B, T, n_kv_head, head_dim)    served_dtype (no casts)     the pool's
    chunk_lens        (B,) or None (all T)           integer, 0 <= len <= T,     any (fast: a CUDA tensor is not read)
                                                     len <= prepared_frames[b]
    returned out      (B, n_head, T, head_dim)       q's dtype                   q's

The view is a plain record: it owns nothing, and ``append_kv`` writes through
it into the pool but never moves ``cache_seqlens`` (the manager's commit does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oasr.kv_formats import KVFormat, get_format

# The argument checks live in oasr.validate (one place for both twins); re-exported for old callers.
from oasr.validate import check_chunk_lens, check_kv_chunk, check_query  # noqa: F401


@dataclass(frozen=True)
class PagedKVCache:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cache_seqstarts: torch.Tensor
    block_size: int
    max_seqlen: int
    max_span: int
    layer: int = 0
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    prepared_frames: tuple[int, ...] | None = None
    model_dtype: torch.dtype | None = None
    kv_format: str | None = None

    @property
    def quantized(self) -> bool:
        """True for quantized pages: ``k_scale``/``v_scale`` hold the format's scale plane."""
        return self.k_scale is not None

    @property
    def format(self) -> KVFormat:
        """The page format: ``kv_format``, else fp8_e4m3 with scales, else the model dtype."""
        if self.kv_format is not None:
            return get_format(self.kv_format)
        return get_format("fp8_e4m3" if self.quantized else None)

    @property
    def batch_size(self) -> int:
        """Rows of the view (block-table rows)."""
        return self.block_table.shape[0]

    @property
    def n_kv_head(self) -> int:
        """KV heads of the pool."""
        return self.k_cache.shape[2]

    @property
    def head_dim(self) -> int:
        """Head size of the pool (a packed format stores several values per byte)."""
        return self.k_cache.shape[3] * self.format.values_per_byte

    @property
    def served_dtype(self) -> torch.dtype | None:
        """The dtype K, V and q must have: ``model_dtype`` if given, else the pool's unless it is fp8 (None)."""
        if self.model_dtype is not None:
            return self.model_dtype
        return None if self.quantized else self.k_cache.dtype


@dataclass
class StreamKVInfo:
    """A snapshot of one stream's bookkeeping (for tests, notebooks and schedulers)."""

    slot: int
    blocks: tuple
    cache_seqlen: int
    cache_seqstart: int
    total_frames: int
