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

Tensor arguments of the ops (checked by ``oasr.cache.validate``; the same in both twins)::

    argument          shape                          dtype                       device
    q                 (B, n_head, T, head_dim)       served_dtype (no casts)     the pool's
    k, v              (B, T, n_kv_head, head_dim)    served_dtype (no casts)     the pool's
    chunk_lens        (B,) or None (all T)           integer, 0 <= len <= T,     any (fast: a CUDA tensor is not read)
                                                     len <= prepared_frames[b]
    returned out      (B, n_head, T, head_dim)       q's dtype                   q's

The view is a plain record: it owns nothing, and ``append_kv`` writes through
it into the pool but never moves ``cache_seqlens`` (the manager's commit does).

``host`` (optional, a ``HostPlan``): the rows' lengths and starts as host ints,
shared by the views one manager call builds for every layer, with a memo of the
index tensors an op derives from them (physical slots, gather indices). The
fast twin's CPU ops then compute those once per cohort instead of once per
layer. A plan describes the very tensors it was built with, unchanged
(``HostPlan.describes``); a view built by ``dataclasses.replace`` with other
tables, or whose index tensors were written in place, is read without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

# The argument checks live in oasr.cache.validate (one place for both twins); re-exported for old callers.
from oasr.cache.validate import check_chunk_lens, check_kv_chunk, check_query  # noqa: F401
from oasr.kv_formats import KVFormat, get_format


class HostPlan:
    """Host facts of one cohort's index tensors (see the module docstring): ``seqlens`` and ``seqstarts``
    as lists of ints, and ``memo(key, make)``, ``make()``'s result kept under ``key`` for the next layer.

    Built by a manager from its host bookkeeping (the same numbers it copied into the tensors); it
    records the tensors' identities and version counters, so ``describes(view)`` is False once a view
    holds other tensors or one of them was written in place. ``build`` gives None for tensors made
    under ``torch.inference_mode`` (they keep no version counter: a write could not be seen)."""

    __slots__ = ("seqlens", "seqstarts", "_tensors", "_versions", "_memo")

    @classmethod
    def build(cls, block_table: torch.Tensor, cache_seqlens: torch.Tensor, cache_seqstarts: torch.Tensor,
              seqlens: list[int], seqstarts: list[int]) -> HostPlan | None:
        """A plan for these tensors, or None where one of them keeps no version counter."""
        if block_table.is_inference() or cache_seqlens.is_inference() or cache_seqstarts.is_inference():
            return None
        return cls(block_table, cache_seqlens, cache_seqstarts, seqlens, seqstarts)

    def __init__(self, block_table: torch.Tensor, cache_seqlens: torch.Tensor, cache_seqstarts: torch.Tensor,
                 seqlens: list[int], seqstarts: list[int]):
        self.seqlens, self.seqstarts = seqlens, seqstarts
        self._tensors = (block_table, cache_seqlens, cache_seqstarts)
        self._versions = tuple(t._version for t in self._tensors)
        self._memo: dict = {}

    def describes(self, view: PagedKVCache) -> bool:
        """Whether ``view``'s table, lengths and starts are the tensors this plan was built with, unwritten."""
        a, b, c = self._tensors
        return (view.block_table is a and view.cache_seqlens is b and view.cache_seqstarts is c
                and (a._version, b._version, c._version) == self._versions)

    def memo(self, key, make):
        """``make()`` the first time ``key`` is asked, the kept result afterwards."""
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = make()
        return value


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
    host: HostPlan | None = field(default=None, compare=False, repr=False)

    @property
    def quantized(self) -> bool:
        """True for quantized pages: ``k_scale``/``v_scale`` hold the format's scale plane."""
        return self.k_scale is not None

    @cached_property
    def format(self) -> KVFormat:
        """The page format: ``kv_format``, else fp8_e4m3 with scales, else the model dtype (looked up once
        per view)."""
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
