"""Fast ``DecoderKVCacheManager``: slot-indexed persistent tables, numpy bookkeeping, one batched append.

Fast twin of ``oasr.reference.decoder_cache.DecoderKVCacheManager``: same
methods, same errors, same atomicity, and the same block ids in the same table
columns for the same op sequence. Geometry and admission are drawn in
``oasr.decoder.config`` and ``oasr.decoder.common``.

Where the state lives (``R = max_rows``)::

    host mirror (numpy, the source of truth)          device (persistent, fixed address)
    _self_table   int32 (R, self_pages)           ->  self_table    int32 (R, self_pages)
    _cross_table  int32 (R, cross_pages)          ->  cross_table   int32 (R, cross_pages)
    _length, _cross_length  int64 (R,)            ->  _meta         int32 (2, R): length, max(cross_length - 1, 0)
    _held, _cross_held, _ceiling, _cross_ceiling, _admitted (host only)
    (the six counts are the rows of one ``_counts`` (6, R): a finish or a fork moves them in one op)

One decode step for ``B`` rows (``append``): a constant number of numpy
operations, one ``pool.allocate_array`` for every row that crosses a page
boundary, one staged copy (the rows, their table rows, their lengths), then on
the device: two ``index_copy_`` into the persistent tables, the cohort's views
gathered with ``index_select``, one ``append_kv`` per layer for all rows (one
quantize-and-scatter per layer with fp8), and one ``index_add_`` that advances
the lengths. Decode attention is ``oasr.fast.paged_ops.paged_attention`` with
one query per row (GQA rows packed by the chunk kernel), on any backend.

A decode group's step (``open_step``, what ``oasr.decoder.kv.PagedDecoderKV``
runs): ``prepare_step`` and a handle that writes and reads every layer. On a
CPU device with model-dtype pages and the torch backend the handle is a
``HostStep``: the write slots and the read vectors of all rows, computed once
from the host tables, then one ``index_copy_`` pair and one gather-and-attend
per layer (no per-layer view, dispatch or length check). Elsewhere it holds the
views and calls the twin's ops, as the reference's does.

Block ownership goes through ``_take`` / ``_drop`` (the pool) and ``_bind`` /
``_unbind`` (table entries) as in the reference; pages are reference-counted in
the pool and forked rows share them. A step's copy-on-write copies
(``oasr.decoder.common``) are taken in the step's one allocation and made by one
block copy per pool tensor (``pool._copy_ids``), before the step's writes.

A beam (at most ``sizes.FEW_ROWS`` rows) takes element-wise paths with the
same results (``oasr.fast.decoder_cache.sizes`` says which and why).

The class is assembled from one part per idea, each a mixin in its own module of
this package (the package docstring lists them; the parts hold no state: this
module draws it above and owns ``__init__``, block ownership, the device mirror
and the counts).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from oasr.decoder.common import DecoderRowInfo, RowPages, check_pool, check_row, check_rows
from oasr.decoder.config import DecoderCacheConfig
from oasr.decoder.prefix_cache import PrefixIndex
from oasr.fast.block_pool import BlockPool
from oasr.fast.decoder_cache import sizes
from oasr.fast.decoder_cache.admission import AdmissionMixin
from oasr.fast.decoder_cache.beams import BeamsMixin
from oasr.fast.decoder_cache.prefix import PrefixMixin
from oasr.fast.decoder_cache.steps import StepsMixin
from oasr.fast.decoder_cache.views import ViewsMixin
from oasr.fast.decoder_cache.writes import WritesMixin
from oasr.fast.kv_formats import check_format_supported
from oasr.fast.staging import Stager

_I32, _I64 = torch.int32, torch.int64


class DecoderKVCacheManager(AdmissionMixin, ViewsMixin, WritesMixin, StepsMixin, PrefixMixin,
                            BeamsMixin):
    SHARED_CROSS_READ = True  # see the reference: decode groups read a shared cross region once

    def __init__(self, config: DecoderCacheConfig, pool: BlockPool | None = None, *, backend: str | None = None):
        if not isinstance(config, DecoderCacheConfig):
            check_pool(config, None)  # raises: not a DecoderCacheConfig
        self.config = config
        self.backend = backend
        if config.kv_quantized:  # the format gate: refuse now, by name, what the chosen backend cannot serve
            check_format_supported(config.kv_cache_dtype, config.head_dim, config.device, dtype=config.dtype,
                                   backend=backend)
        if pool is None:
            pool = BlockPool(config.pool_config(), scratch_blocks=1)
        check_pool(config, pool)
        self.pool = pool
        self._owner = pool.new_owner(type(self).__name__)  # the pool refuses to free our pages for others
        self._prefix = PrefixIndex(config.page_size)
        R, SW, CW = config.max_rows, max(config.self_pages, 1), max(config.cross_pages, 1)
        null, device = pool.null_block, config.device
        self._self_table = np.full((R, SW), null, dtype=np.int32)
        self._cross_table = np.full((R, CW), null, dtype=np.int32)
        # the per-row counts, one row of ``_counts`` each (views: a finish clears all six in one
        # assignment, a fork copies them in one)
        self._counts = np.zeros((6, R), dtype=np.int64)
        (self._held, self._cross_held, self._length, self._cross_length,
         self._ceiling, self._cross_ceiling) = self._counts  # _ceiling: self tokens declared
        self._both_cols = np.concatenate([np.arange(SW), np.arange(CW)])[None, :]  # (self then cross) columns
        self._requests: list = [None] * R
        self._admitted = np.zeros(R, dtype=bool)
        self._dirty = np.zeros(R, dtype=bool)  # rows whose device mirror is stale (see _flush)
        # bumped by every change to a row's records (``_sync``, ``abandon``): a handle that saw the same
        # number at its commit knows no row changed in between (``HostStep.commit`` skips its re-checks)
        self._version = 0
        self.self_table = torch.full((R, SW), null, dtype=_I32, device=device)
        self.cross_table = torch.full((R, CW), null, dtype=_I32, device=device)
        self._meta = torch.zeros((2, R), dtype=_I32, device=device)
        self._zeros = torch.zeros(R, dtype=_I32, device=device)
        self._ones = torch.ones(R, dtype=_I32, device=device)
        self._stager = Stager([(R, _I64), (R * SW, _I32), (R * CW, _I32), (2 * R, _I32)], device)
        self._layer_kv = [pool.get_kv_view(layer) for layer in range(config.num_layers)]
        # per layer the pool's K and V as (slots, n_kv_head, head_dim): what a HostStep writes and gathers
        self._layer_slots = [(k.view(-1, *k.shape[-2:]), v.view(-1, *v.shape[-2:])) for k, v in self._layer_kv]
        self._layer_scales = [pool.get_kv_scale_view(layer) for layer in range(config.num_layers)]
        self._host_direct = device.type == "cpu"  # views from the host mirror (see self_caches)
        self._host_pages = device.type == "cpu" and not config.kv_quantized  # (see _host_writes)
        # HostStep's index arithmetic per table position t: its column t // page, and per KV head h the
        # vector offset (t % page) * Hkv + h inside the column's block
        positions = np.arange(SW * config.page_size)
        self._position_column = positions // config.page_size
        self._position_vectors = (positions % config.page_size)[None, :] * config.n_kv_head + \
            np.arange(config.n_kv_head)[:, None]
        self._widths: dict[tuple, tuple] = {}  # (width, cross) -> persistent view buffers (pad_to views)
        self._query_scale = 1.0 / math.sqrt(config.head_dim)
        # how many cross regions were written (fill_cross, restore_rows): a decode group's copy of a shared
        # region (``PagedDecoderKV.attend_cross``) is read again when the count moved since
        self.cross_writes = 0

    # ---- block ownership (the only places that touch the pool's free list or a table entry) ----
    def _take(self, n: int) -> np.ndarray:
        return self.pool.allocate_array(n, self._owner)

    def _drop(self, ids: np.ndarray) -> None:
        self.pool.free_array(ids, owner=self._owner)

    def _bind(self, table: np.ndarray, rows: np.ndarray, cols: np.ndarray, ids: np.ndarray, share: bool = False):
        if share:
            self.pool.share(ids, self._owner)
        table[rows, cols] = ids

    def _rebind(self, table: np.ndarray, rows: np.ndarray, cols: np.ndarray, ids: np.ndarray) -> None:
        """Point table entries at their private copies (copy-on-write; the caller drops the originals)."""
        table[rows, cols] = ids

    def _unbind(self, table: np.ndarray, row: int, count: int, start: int = 0) -> np.ndarray:
        ids = table[row, start:count].astype(np.int64)
        table[row, start:count] = self.pool.null_block
        return ids

    # ---- device mirror ------------------------------------------------------------
    def _sync(self, ids) -> None:
        """Mark the rows' device mirror stale; the next device read (``_flush``) copies them, so a row
        changed by several host ops between two reads (admit, admit_prompt, finish ...) costs one copy."""
        self._dirty[ids] = True
        self._version += 1

    def _flush(self, ids: np.ndarray | None = None) -> torch.Tensor | None:
        """One staged copy of every stale row's tables and lengths into the persistent device tensors,
        before anything on the device reads them. With ``ids`` (rows about to be read, unique) the same
        copy carries them first and their device index is returned."""
        if ids is None:
            rows = np.flatnonzero(self._dirty)
            if not rows.size:
                return None
        else:
            self._dirty[ids] = False  # they go first, whether stale or not
            stale = np.flatnonzero(self._dirty)
            rows = np.concatenate([ids, stale]) if stale.size else ids
        B = rows.size
        meta = np.concatenate([self._length[rows], np.maximum(self._cross_length[rows] - 1, 0)])
        rows_d, self_d, cross_d, meta_d = self._stager.stage(
            rows, self._self_table[rows], self._cross_table[rows], meta
        )
        if B:
            self.self_table.index_copy_(0, rows_d, self_d.view(B, -1))
            self.cross_table.index_copy_(0, rows_d, cross_d.view(B, -1))
            self._meta.index_copy_(1, rows_d, meta_d.view(2, B))
        self._dirty[:] = False
        return None if ids is None else rows_d[: ids.size]

    # ---- counts ---------------------------------------------------------------
    def _is_admitted(self, row) -> bool:
        return 0 <= row < self._admitted.size and self._admitted.item(row)

    def _row(self, row, op: str) -> int:
        """The row id as an int (see the reference: ValueError for a non-integer, KeyError if not admitted)."""
        return check_row(row, self._is_admitted, op)

    @property
    def rows(self) -> list[int]:
        """The admitted rows, in ascending order."""
        return np.flatnonzero(self._admitted).tolist()

    @property
    def num_free_rows(self) -> int:
        """Rows that can still be admitted."""
        return int((~self._admitted).sum())

    def row_pages(self, row: int) -> RowPages:
        """``RowPages`` of an admitted row: its self and cross page ids, length and ceiling."""
        row = self._row(row, "row_pages")
        return RowPages(tuple(self._self_table[row, : self._held[row]].tolist()),
                        tuple(self._cross_table[row, : self._cross_held[row]].tolist()),
                        int(self._length[row]), int(self._ceiling[row]))

    def pinned_blocks(self) -> list[int]:
        """Blocks published in the prefix index (held or parked): a write into one always copies."""
        return self._prefix.pinned(self.pool)

    @property
    def reserved_blocks(self) -> int:
        """See the reference: ceilings minus pages held, plus copy-on-write copies owed."""
        ids = np.flatnonzero(self._admitted)
        return self._reserved(ids, self.pinned_blocks) if ids.size else 0

    def _blocks_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(self blocks, cross blocks, written blocks)`` the rows ``ids`` hold (repeats count again),
        from one mask per table: the written blocks are the self pages from ``length // page`` on."""
        cols = np.arange(self._self_table.shape[1])[None, :]
        held = cols < self._held[ids][:, None]
        written = held & (cols >= (self._length[ids] // self.config.page_size)[:, None])
        table = self._self_table[ids]
        cross = np.arange(self._cross_table.shape[1])[None, :] < self._cross_held[ids][:, None]
        return table[held], self._cross_table[ids][cross], table[written]

    def _reserved(self, ids: np.ndarray, pinned, blocks: tuple | None = None) -> int:
        """``reserved_pages`` of rows ``ids`` (repeats allowed: a planned fork) in a few numpy operations:
        the growth to every ceiling, plus per written block its writers minus one if they are all its
        holders (pinned blocks count one more holder; ``pinned()`` lists them, asked only if needed).
        ``blocks``: ``_blocks_of(ids)`` when the caller has it."""
        own, cross, written = self._blocks_of(ids) if blocks is None else blocks
        n = self.pool.num_blocks
        ceilings = -(-self._ceiling[ids] // self.config.page_size)
        growth = int((ceilings - self._held[ids]).sum())
        if not written.size:
            return growth
        holders = np.bincount(np.concatenate([own, cross, np.asarray(pinned(), dtype=np.int64)]), minlength=n)
        writers = np.bincount(written, minlength=n)
        hit = writers > 0
        return growth + int((writers[hit] - (writers[hit] == holders[hit])).sum())

    @property
    def available_blocks(self) -> int:
        """Free blocks not reserved for admitted rows' ceilings."""
        return self.pool.num_free_blocks - self.reserved_blocks

    def describe(self, row: int) -> DecoderRowInfo:
        """``DecoderRowInfo`` of an admitted row: pages, lengths and ceilings (``KeyError`` otherwise)."""
        r = self._row(row, "describe")
        return DecoderRowInfo(r, tuple(self._self_table[r, : self._held[r]].tolist()),
                              tuple(self._cross_table[r, : self._cross_held[r]].tolist()),
                              int(self._length[r]), int(self._cross_length[r]), int(self._ceiling[r]),
                              int(self._cross_ceiling[r]))

    def length(self, row: int) -> int:
        """Tokens the row holds (``KeyError`` unless admitted)."""
        return int(self._length[self._row(row, "length")])

    def lengths(self, rows) -> list[int]:
        """``length`` of each of ``rows``, in their order (``check_rows``' errors; one numpy gather)."""
        ids = check_rows(rows, self._is_admitted, "lengths")
        if len(ids) <= sizes.FEW_ROWS:  # (a beam) element reads beat a fancy-indexed gather
            return [self._length.item(r) for r in ids]
        return self._length[ids].tolist()
