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

A beam (at most ``_FEW_ROWS`` rows) takes element-wise paths with the same
results: its select (``_select_few``: rows by plain indexing, the dropped and
forked references in one ``pool._free_and_share``), its step's decision
(``_prepare_few``), the select's bound and the handle's commit. On a few rows
numpy's per-call cost, not the work, is what a numpy path pays; the tests run
both paths against the oracle.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch

from oasr.cache.paged import HostPlan, PagedKVCache
from oasr.decoder.common import (
    Admission,
    AdmissionError,
    DecoderRowInfo,
    RowPages,
    ViewStep,
    check_cross_fill,
    check_kv,
    check_pad_to,
    check_pool,
    check_requests,
    check_rewind,
    check_row,
    check_rows,
    check_step_kv,
    cow_writes,
    judge,
    judge_restore,
    select_sources,
)
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.decoder.kv import DenseDecoderKV as DenseDecoderKVBase
from oasr.decoder.prefix_cache import PrefixIndex, check_tokens
from oasr.fast.backend import resolve_backend
from oasr.fast.block_pool import BlockPool
from oasr.fast.cpu_rows import attend_gathered
from oasr.fast.kv_formats import check_format_supported
from oasr.fast.kv_formats import dequantize as _dequantize
from oasr.fast.kv_formats import quantize as _quantize
from oasr.fast.paged_ops import append_kv, paged_attention
from oasr.fast.staging import Stager

_I32, _I64 = torch.int32, torch.int64
_FEW_ROWS = 8  # _prepare: up to this many rows (a beam), Python scalars beat the numpy calls' setup
_QUERY_SHAPE = "(B={B}, n_head (a multiple of n_kv_head={H}), 1, head_dim={D})"  # HostStep.attend's message
_FEW_CANCEL = 192  # _cancel: up to this many ids in all, the counting loop beats the numpy ops' setup


class DecoderKVCacheManager:
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
        if len(ids) <= _FEW_ROWS:  # (a beam) element reads beat a fancy-indexed gather
            return [self._length.item(r) for r in ids]
        return self._length[ids].tolist()

    # ---- admission --------------------------------------------------------------
    def can_admit(self, requests) -> Admission:
        """Whether ``requests`` fit now, with the reason when not (never changes anything)."""
        reqs = check_requests(requests)
        return judge(self.config, reqs, self.num_free_rows, self.pool.num_free_blocks, self.reserved_blocks)

    def admit(self, requests) -> list[int]:
        """Admit ``requests`` (each row's ceiling reserved) and return their rows (``AdmissionError`` if they do not
        fit).
        """
        reqs = check_requests(requests)
        answer = self.can_admit(reqs)
        if not answer:
            raise AdmissionError(answer.reason)
        cfg = self.config
        if len(reqs) == 1:  # one request (dispatch by size): the same steps in scalars
            return [self._admit_one(reqs[0])]
        rows = np.flatnonzero(~self._admitted)[: len(reqs)]
        pages = np.array([cfg.pages_for(r.cross_len) for r in reqs], dtype=np.int64)
        total = int(pages.sum())
        if total:  # (a decoder without cross-attention takes none)
            cross = self._take(total)  # one allocation for the batch, request order
            owner = np.repeat(rows, pages)
            cols = np.arange(cross.size) - np.repeat(np.cumsum(pages) - pages, pages)
            self._bind(self._cross_table, owner, cols, cross)
        self._cross_held[rows] = pages
        self._ceiling[rows] = [r.self_tokens for r in reqs]
        self._cross_ceiling[rows] = [r.cross_len for r in reqs]
        self._held[rows] = 0
        self._length[rows] = 0
        self._cross_length[rows] = 0
        self._admitted[rows] = True
        for row, req in zip(rows.tolist(), reqs, strict=True):
            self._requests[row] = req
        self._sync(rows)
        return rows.tolist()

    def _admit_one(self, req) -> int:
        """``admit`` of one checked request that fits: the lowest free row, its cross pages in one allocation."""
        row = int(np.argmin(self._admitted))  # the first False: the lowest free row
        pages = self.config.pages_for(req.cross_len)
        if pages:
            self._bind(self._cross_table, np.full(pages, row), np.arange(pages), self._take(pages))
        self._cross_held[row] = pages
        self._ceiling[row] = req.self_tokens
        self._cross_ceiling[row] = req.cross_len
        self._held[row] = self._length[row] = self._cross_length[row] = 0
        self._admitted[row] = True
        self._requests[row] = req
        self._sync(row)
        return row

    def finish(self, row: int) -> None:
        """Release the row: its pages go back to the pool (``KeyError`` unless admitted)."""
        r = self._row(row, "finish")
        self._release(r)
        self._sync(r)

    def _release(self, r) -> None:
        """The host half of ``finish`` for one row or an int64 array of distinct rows: every reference
        they hold dropped in one ``_drop``, their records cleared (no device work)."""
        self._drop(self._unbind_rows(r))

    def _held_entries(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows' self then cross table entries side by side, ``(B, SW + CW)``, and which of them the
        rows hold (each region's first ``held`` / ``cross_held`` columns)."""
        SW = self._self_table.shape[1]
        tables = np.concatenate([self._self_table[rows], self._cross_table[rows]], axis=1)
        limit = np.repeat(self._counts[:2, rows].T, [SW, tables.shape[1] - SW], axis=1)  # held, cross held
        return tables, self._both_cols < limit

    def _unbind_rows(self, r) -> np.ndarray:
        """Clear the records of one row or an int64 array of distinct rows; returns the references they
        held, in the order the reference frees them (row by row, self pages then cross pages)."""
        rows = np.atleast_1d(np.asarray(r, dtype=np.int64))
        refs = self._held_refs(rows)
        self._self_table[rows] = self._cross_table[rows] = self.pool.null_block
        self._counts[:, rows] = 0
        self._admitted[rows] = False
        for row in rows.tolist():
            self._requests[row] = None
        return refs

    def _held_refs(self, rows: np.ndarray) -> np.ndarray:
        """The references ``rows`` hold, row by row, self pages then cross pages (int64). A few rows:
        a slice of each table row; more: one mask over the rows' tables (``_held_entries``)."""
        if rows.size <= _FEW_ROWS:
            return np.array(self._held_refs_few(rows.tolist()), dtype=np.int64)
        tables, held = self._held_entries(rows)
        return tables[held].astype(np.int64)

    def _held_refs_few(self, rows: list[int]) -> list[int]:
        """``_held_refs`` of a few rows as a list: element reads and row slices (numpy's fancy indexing
        costs more than the work on a few rows)."""
        refs = []
        for r in rows:
            refs += self._self_table[r, : self._held.item(r)].tolist()
            refs += self._cross_table[r, : self._cross_held.item(r)].tolist()
        return refs

    # ---- views ------------------------------------------------------------------
    def _rows_index(self, rows, op: str) -> tuple[np.ndarray, torch.Tensor]:
        ids = np.array(check_rows(rows, self._is_admitted, op), dtype=np.int64)
        return ids, self._flush(ids)

    def _views(self, table: torch.Tensor, seqlens: torch.Tensor, max_len: int, max_span: int, prepared,
               starts: torch.Tensor | None = None, host_lens: list[int] | None = None) -> list:
        """One view per layer over ``table``; with ``host_lens`` (the lengths ``seqlens`` holds, as ints;
        the starts are zeros) the views share one ``HostPlan``."""
        starts = self._zeros[: table.shape[0]] if starts is None else starts
        prepared = tuple(np.asarray(prepared, dtype=np.int64).tolist())
        plan = None if host_lens is None else HostPlan.build(table, seqlens, starts, host_lens, [0] * len(host_lens))
        return [
            PagedKVCache(k, v, table, seqlens, starts, self.config.page_size, max_len, max_span, layer, ks, vs,
                         prepared, self.config.dtype, self.config.kv_cache_dtype, host=plan)
            for layer, ((k, v), (ks, vs)) in enumerate(zip(self._layer_kv, self._layer_scales, strict=True))
        ]

    def _stage_like_cuda(self) -> None:
        """Read views through the staged device tables, as a CUDA device does (the capture-safety
        checks run the CUDA code path on the CPU); see ``self_caches``."""
        self._host_direct = False

    def _host_views(self, ids: np.ndarray, cross: bool) -> list:
        """CPU device: the views' table rows and lengths taken from the host mirror (fresh tensors
        sharing numpy's copies): no staged copy, no device gather. The same numbers as the staged path."""
        if cross:
            lens = self._cross_length[ids]
            longest = int(lens.max()) if ids.size else 0
            seqlens = np.maximum(lens - 1, 0).astype(np.int32)
            return self._views(torch.from_numpy(self._cross_table[ids]), torch.from_numpy(seqlens),
                               max(longest - 1, 0), longest, lens > 0, host_lens=seqlens.tolist())
        lens = self._length[ids]
        longest = int(lens.max()) if ids.size else 0
        prepared = self._held[ids] * self.config.page_size - lens
        seqlens = lens.astype(np.int32)
        return self._views(torch.from_numpy(self._self_table[ids]), torch.from_numpy(seqlens),
                           longest, longest, prepared, host_lens=seqlens.tolist())

    def _self_views(self, ids: np.ndarray, rows_d: torch.Tensor) -> list:
        lens = self._length[ids]
        longest = int(lens.max()) if ids.size else 0
        prepared = self._held[ids] * self.config.page_size - lens
        return self._views(self.self_table.index_select(0, rows_d), self._meta[0].index_select(0, rows_d),
                           longest, longest, prepared)

    def _width_buffers(self, width: int, cross: bool) -> tuple:
        """The persistent ``(table (w, pages), seqlens (w,), starts (w,))`` of one width and region
        (allocated on first use; a captured decode step reads these addresses on every replay)."""
        key = (width, cross)
        buffers = self._widths.get(key)
        if buffers is None:
            device, table = self.config.device, self.cross_table if cross else self.self_table
            buffers = self._widths[key] = (torch.empty((width, table.shape[1]), dtype=_I32, device=device),
                                           torch.empty(width, dtype=_I32, device=device),
                                           torch.zeros(width, dtype=_I32, device=device))
        return buffers

    def _padded_views(self, ids: np.ndarray, pad: int, cross: bool) -> list:
        """``self_caches`` / ``cross_caches`` with ``pad_to``: the rows then ``pad`` padding rows in the
        width's persistent buffers (on a CPU device through numpy views of them, else one staged copy and
        an ``index_select`` into them; padding rows filled with scalars). A snapshot: the next padded
        call of the same width and region rewrites it."""
        B = ids.size
        table, seqlens, starts = self._width_buffers(B + pad, cross)
        host_table, host_lens = (self._cross_table, self._cross_length) if cross else (self._self_table, self._length)
        lens = np.maximum(host_lens[ids] - 1, 0) if cross else host_lens[ids]
        if self._host_direct:
            np.take(host_table, ids, axis=0, out=table.numpy()[:B])
            seqlens.numpy()[:B] = lens
            table.numpy()[B:] = self.pool.null_block
            seqlens.numpy()[B:] = 0
        else:
            rows_d = self._flush(ids)
            torch.index_select(self.cross_table if cross else self.self_table, 0, rows_d, out=table[:B])
            torch.index_select(self._meta[1 if cross else 0], 0, rows_d, out=seqlens[:B])
            table[B:].fill_(self.pool.null_block)
            seqlens[B:].fill_(0)
        if cross:
            spans = self._cross_length[ids]
            longest = int(spans.max()) if B else 0
            reads = np.concatenate([spans > 0, np.zeros(pad, dtype=bool)])
            return self._views(table, seqlens, max(longest - 1, 0), longest, reads, starts)
        longest = int(lens.max()) if B else 0
        prepared = np.concatenate([self._held[ids] * self.config.page_size - lens, np.ones(pad, dtype=np.int64)])
        return self._views(table, seqlens, longest, longest, prepared, starts)

    def self_caches(self, rows, pad_to: int | None = None) -> list[PagedKVCache]:
        """Per layer, the paged view of ``rows``' self-attention K/V (after ``prepare_step``).

        On a CPU device the table rows come straight from the host mirror (``_host_views``); else one
        staged copy of the stale rows and a gather of the persistent device tables. With ``pad_to``
        (see the reference) the views are over the width's persistent buffers (``_padded_views``)."""
        if pad_to is not None:
            ids = np.array(check_rows(rows, self._is_admitted, "self_caches"), dtype=np.int64)
            return self._padded_views(ids, check_pad_to(pad_to, ids.size, "self_caches"), cross=False)
        if self._host_direct:
            return self._host_views(np.array(check_rows(rows, self._is_admitted, "self_caches"), dtype=np.int64),
                                    cross=False)
        ids, rows_d = self._rows_index(rows, "self_caches")
        return self._self_views(ids, rows_d)

    def cross_caches(self, rows, pad_to: int | None = None) -> list[PagedKVCache]:
        """See the reference: ``cache_seqlens`` is ``cross_length - 1``; read with ``cross_query_lens``.
        ``pad_to`` as for ``self_caches``."""
        if pad_to is not None:
            ids = np.array(check_rows(rows, self._is_admitted, "cross_caches"), dtype=np.int64)
            return self._padded_views(ids, check_pad_to(pad_to, ids.size, "cross_caches"), cross=True)
        if self._host_direct:
            return self._host_views(np.array(check_rows(rows, self._is_admitted, "cross_caches"), dtype=np.int64),
                                    cross=True)
        ids, rows_d = self._rows_index(rows, "cross_caches")
        lens = self._cross_length[ids]
        longest = int(lens.max()) if ids.size else 0
        return self._views(self.cross_table.index_select(0, rows_d), self._meta[1].index_select(0, rows_d),
                           max(longest - 1, 0), longest, lens > 0)

    def shares_cross(self, rows) -> bool:
        """See the reference: every row maps the same cross pages over the same extent (three numpy
        comparisons)."""
        ids = np.array(check_rows(rows, self._is_admitted, "shares_cross"), dtype=np.int64)
        if not ids.size:
            return False
        first = ids[0]
        return bool((self._cross_length[ids] == self._cross_length[first]).all()
                    and (self._cross_held[ids] == self._cross_held[first]).all()
                    and (self._cross_table[ids] == self._cross_table[first]).all())

    def cross_query_lens(self, rows, pad_to: int | None = None) -> list[int]:
        """Per row, 1 if it holds cross-attention K/V, else 0 (the cross read's query lengths); a padding
        row (``pad_to``) 0."""
        ids = np.array(check_rows(rows, self._is_admitted, "cross_query_lens"), dtype=np.int64)
        pad = check_pad_to(pad_to, ids.size, "cross_query_lens")
        return (self._cross_length[ids] > 0).astype(np.int64).tolist() + [0] * pad

    def gather_self(self, row: int) -> torch.Tensor:
        """The row's self-attention K/V, all layers, as one dense tensor (for checks)."""
        r = self._row(row, "gather_self")
        return self.pool.gather_kv_blocks(self._self_table[r, : self._held[r]], 0, int(self._length[r]))

    def gather_cross(self, row: int) -> torch.Tensor:
        """The row's cross-attention K/V, all layers, as one dense tensor (for checks)."""
        r = self._row(row, "gather_cross")
        return self.pool.gather_kv_blocks(self._cross_table[r, : self._cross_held[r]], 0, int(self._cross_length[r]))

    def read_cross(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The row's cross region as a decode group reads it when its rows share it (``SHARED_CROSS_READ``,
        ``oasr.decoder.kv.PagedDecoderKV.attend_cross``): per layer ``(K^T (Hkv, D, S), V (Hkv, S, D))`` in
        fp32, fresh tensors. Model-dtype pages only (quantized pages: ``ValueError``). One gather of the
        row's pages per pool tensor and layer; the same values as ``gather_cross``."""
        r = self._row(row, "read_cross")
        if self.config.kv_quantized:
            raise ValueError(f"read_cross: pages in {self.config.kv_cache_dtype} are read through views, not gathered")
        ids = self._cross_table[r, : self._cross_held[r]].astype(np.int64)
        S, H, D = int(self._cross_length[r]), self.config.n_kv_head, self.config.head_dim
        index = torch.from_numpy(ids) if self._host_direct else self.pool._device_ids(ids)
        out = []
        for k_pool, v_pool in self._layer_kv:
            k = k_pool.index_select(0, index).view(-1, H, D)[:S]
            v = v_pool.index_select(0, index).view(-1, H, D)[:S]
            out.append((k.permute(1, 2, 0).float().contiguous(), v.transpose(0, 1).float().contiguous()))
        return out

    # ---- writes -------------------------------------------------------------------
    def _host_writes(self, backend: str | None = None) -> bool:
        """Whether writes take the host shortcut: model-dtype pages on the CPU's torch backend
        (``backend``: the call's, else the manager's)."""
        backend = self.backend if backend is None else backend
        return self._host_pages and resolve_backend(self.config.device, backend) == "torch"

    def _torch_writes(self) -> bool:
        """Whether this manager's page writes quantize with torch code (the torch backend), which refuses NaN
        for a format whose rule does: then the write's checks refuse it before any layer is written. The
        kernel backends read nothing back and store what ``oasr.fast.paged_ops`` documents."""
        return self.config.kv_quantized and resolve_backend(self.config.device, self.backend) == "torch"

    def _write_host(self, table: np.ndarray, rows: np.ndarray, positions: np.ndarray, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """``k, v (L, N, H, D)`` at (``rows[i]``, ``positions[i]``) of ``table``'s region: the slots from the
        host table, one ``index_copy_`` per layer; the same bytes as ``append_kv`` writes, without views,
        device table reads or launch validation (the callers checked the shapes)."""
        cfg = self.config
        page = cfg.page_size
        slots = torch.from_numpy(table[rows, positions // page].astype(np.int64) * page + positions % page)
        dtype = cfg.kv_storage_dtype
        if k.dtype != dtype or v.dtype != dtype:
            k, v = k.to(dtype), v.to(dtype)
        for layer, (k_slots, v_slots) in enumerate(self._layer_slots):
            k_slots.index_copy_(0, slots, k[layer])
            v_slots.index_copy_(0, slots, v[layer])

    def _write_row(self, table: torch.Tensor, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens ``[start, start + T)`` of one row's region: one append_kv (quantize-and-scatter) per layer
        (on the CPU with model-dtype pages, ``_write_host``)."""
        if self._host_writes():
            host = self._self_table if table is self.self_table else self._cross_table
            T = k.shape[1]
            self._write_host(host, np.full(T, row), np.arange(start, start + T), k, v)
            return
        rows_d = self._flush(np.array([row], dtype=np.int64))
        seqlen = torch.full((1,), start, dtype=_I32, device=self.config.device)
        held = self._held[row] if table is self.self_table else self._cross_held[row]
        views = self._views(table.index_select(0, rows_d), seqlen, start, start, [held * self.config.page_size - start])
        for layer, view in enumerate(views):
            append_kv(view, k[layer][None], v[layer][None], backend=self.backend)

    def fill_cross(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the row's cross K/V once (see the reference for the rules and why the dtype converts)."""
        r = self._row(row, "fill_cross")
        T = check_kv(self.config, k, v, "fill_cross", (), convert=True, numbers=self._torch_writes())
        check_cross_fill(r, T, int(self._cross_ceiling[r]), int(self._cross_length[r]))
        blocks = self._cross_table[r, : self._cross_held[r]]
        shared = blocks[self.pool._refs[blocks] > 1].tolist()
        if shared:
            raise ValueError(f"fill_cross: row {r}'s cross pages {shared} are shared with forked rows; "
                             f"fill before select forks the row")
        dtype = self.config.dtype
        self._write_row(self.cross_table, r, 0, k.to(dtype), v.to(dtype))
        self._cross_length[r] = T
        self.cross_writes += 1
        self._sync(r)

    def prefill(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write an empty row's prompt K/V ``(L, T, n_kv_head, head_dim)`` (``ValueError`` past its ceiling)."""
        r = self._row(row, "prefill")
        T = check_kv(self.config, k, v, "prefill", (), convert=False, numbers=self._torch_writes())
        if self._length[r]:
            raise ValueError(f"prefill: row {r} already holds {int(self._length[r])} tokens; prefill an empty row")
        if T > self._ceiling[r]:
            raise ValueError(f"prefill: row {r} declared {int(self._ceiling[r])} tokens, got a prompt of {T}")
        self._extend(r, k, v, T)

    def extend(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """See the reference: ``T`` more tokens at the row's length; shared pages it writes are copied first."""
        r = self._row(row, "extend")
        T = check_kv(self.config, k, v, "extend", (), convert=False, numbers=self._torch_writes())
        if self._length[r] + T > self._ceiling[r]:
            raise ValueError(f"extend: row {r} holds {int(self._length[r])} tokens and declared "
                             f"{int(self._ceiling[r])}, got {T} more")
        self._extend(r, k, v, T)

    def _extend(self, r: int, k: torch.Tensor, v: torch.Tensor, T: int) -> None:
        """Copies of the shared pages ``[length, length + T)`` lands in and new pages (one allocation, one
        batched copy), one staged sync, then one append_kv per layer."""
        page, held, length = self.config.page_size, int(self._held[r]), int(self._length[r])
        end = self.config.pages_for(length + T)
        columns = np.arange(length // page, min(end, held))
        landing = self._self_table[r, columns].astype(np.int64)
        shared = (self.pool._refs[landing] > 1) | self.pool._keyed[landing]  # shared or published
        src = landing[shared]
        need = max(0, end - held)
        if src.size or need:  # (most extends write into pages the row already owns alone)
            new = self._take(int(src.size) + need)
            if src.size:
                self.pool.copy_blocks(src, new[: src.size])
                self._rebind(self._self_table, np.full(src.size, r), columns[shared], new[: src.size])
            self._bind(self._self_table, np.full(need, r), np.arange(held, held + need), new[src.size :])
            self._held[r] += need
            if src.size:
                self._drop(src)
            self._sync(r)
        self._write_row(self.self_table, r, length, k, v)
        self._length[r] = length + T
        self._sync(r)

    def _step_needs(self, ids: np.ndarray, length: np.ndarray | None = None) -> np.ndarray:
        """The pages each row needs for one more token, 0 or 1 (a row holds ``ceil(length / page)`` pages
        or one more); ``ValueError`` for a row at its ceiling. ``length``: the rows' lengths if read."""
        length = self._length[ids] if length is None else length
        full = length >= self._ceiling[ids]
        if full.any():
            r = int(ids[np.argmax(full)])
            req = self._requests[r]
            raise ValueError(f"row {r} is at its ceiling of {int(self._ceiling[r])} tokens (prompt_len="
                             f"{req.prompt_len} + max_new_tokens={req.max_new_tokens})")
        return np.maximum(0, length // self.config.page_size + 1 - self._held[ids])

    def _prepare(self, ids: np.ndarray) -> None:
        """Copies of shared landing pages (row order) then new pages: one allocation, one batched copy.
        The decision by size: a few rows (a beam) in Python scalars, more in numpy; the same answer."""
        if ids.size <= _FEW_ROWS:
            self._prepare_few(ids.tolist())
            return
        plan = self._prepare_many(ids)
        if plan is None:  # (most steps: every row writes into a page it owns alone)
            return
        src, copy_rows, copy_cols, owners = plan
        new = self._take(src.size + owners.size)  # inside the rows' reservations: cannot run dry
        if src.size:
            self.pool._copy_ids(src, new[: src.size])  # (held blocks onto blocks just taken: nothing to check)
            self._rebind(self._self_table, copy_rows, copy_cols, new[: src.size])
        if owners.size:
            self._bind(self._self_table, owners, self._held[owners], new[src.size :])
            self._held[owners] += 1
        if src.size:
            self._drop(src)

    def _prepare_many(self, ids: np.ndarray) -> tuple | None:
        """``_prepare``'s decision in numpy: ``(copied blocks, their rows, their columns, growing rows)``
        as int64 arrays, or None when there is nothing to copy or take."""
        length = self._length[ids]
        needs = self._step_needs(ids, length)
        col = length // self.config.page_size
        inside = needs == 0  # the next token lands in a page the row holds
        refs, keyed = self.pool._refs, self.pool._keyed  # keyed: published in the prefix index (pinned)
        # (a row that needs a page reads its table's null entry here: clipped into range, masked out)
        landing = np.minimum(self._self_table[ids, np.minimum(col, self._self_table.shape[1] - 1)], refs.size - 1)
        shared = inside & ((refs[landing] > 1) | keyed[landing])
        grow = needs.astype(bool)
        if shared.any():  # (a step right after a fork): the reference's rule, row by row
            copy = np.zeros(ids.size, dtype=bool)
            copy[shared] = cow_writes(landing[shared].tolist(), lambda b: int(refs[b]) + int(keyed[b]))
        elif not grow.any():
            return None
        else:
            copy = shared
        return landing[copy].astype(np.int64), ids[copy], col[copy], ids[grow]

    def _prepare_few(self, rows: list[int]) -> None:
        """``_prepare`` for a few rows, element by element (a beam's step: a handful of Python reads beat
        a dozen numpy calls): the same checks in the same order, the same copies, pages and order."""
        page, table = self.config.page_size, self._self_table
        length, held, ceiling = self._length.item, self._held.item, self._ceiling.item
        for r in rows:
            if length(r) >= ceiling(r):
                self._step_needs(np.array([r], dtype=np.int64))  # raises the ceiling's message
        landing, cols, owners = [], [], []
        for r in rows:
            col = length(r) // page
            cols.append(col)
            if col < held(r):
                landing.append(table.item(r, col))
            else:  # the row crosses into a page it does not hold yet
                landing.append(-1)
                owners.append(r)
        refs, keyed = self.pool._refs.item, self.pool._keyed.item
        copy = cow_writes(landing, lambda b: refs(b) + keyed(b))
        picked = [i for i, c in enumerate(copy) if c]
        if not owners and not picked:  # (most steps: every row writes into a page it owns alone)
            return
        src = np.array([landing[i] for i in picked], dtype=np.int64)
        new = self._take(src.size + len(owners))  # inside the rows' reservations: cannot run dry
        if src.size:
            self.pool._copy_ids(src, new[: src.size])  # (held blocks onto blocks just taken: nothing to check)
            for i, j in zip(picked, new[: src.size].tolist(), strict=True):
                table[rows[i], cols[i]] = j
        for r, j in zip(owners, new[src.size :].tolist(), strict=True):
            table[r, held(r)] = j
            self._held[r] += 1
        if src.size:
            self._drop(src)

    def prepare_step(self, rows) -> None:
        """Make room for one more token in each of ``rows`` (a page where a row crosses a boundary)."""
        ids = np.array(check_rows(rows, self._is_admitted, "prepare_step"), dtype=np.int64)
        self._prepare(ids)
        self._sync(ids)

    def open_step(self, rows, backend: str | None = None):
        """See the reference: ``prepare_step(rows)`` and a handle on the step (``write``, ``attend``,
        ``commit``). ``backend`` as for ``append_kv`` (None: the manager's). On a CPU device with
        model-dtype pages and the torch backend the handle is a ``HostStep``: the slots every layer
        writes and reads come from the host tables once, not from per-layer views (the same bytes
        and the same arithmetic as the views' decode batch); elsewhere the views (``ViewStep``)."""
        ids = np.array(check_rows(rows, self._is_admitted, "open_step"), dtype=np.int64)
        self._prepare(ids)
        self._sync(ids)
        backend = self.backend if backend is None else backend
        if self._host_direct and ids.size and self._host_writes(backend):
            return HostStep(self, ids)
        kw = {} if backend is None else {"backend": backend}
        return ViewStep(self, ids.tolist(), append_kv, paged_attention, kw)

    def _check_prepared(self, ids: np.ndarray) -> None:
        length = self._length[ids]
        bad = (length + 1 > self._held[ids] * self.config.page_size) | (length >= self._ceiling[ids])
        if bad.any():
            r = int(ids[np.argmax(bad)])
            raise ValueError(f"commit_step: row {r} has no prepared slot for token {int(self._length[r])} "
                             f"(call prepare_step first)")

    def commit_step(self, rows) -> None:
        """Each of ``rows`` is one token longer (after ``prepare_step`` and the step's writes)."""
        self._commit(np.array(check_rows(rows, self._is_admitted, "commit_step"), dtype=np.int64))

    def _commit(self, ids: np.ndarray) -> None:
        """``commit_step`` of checked int64 rows; an open step's handle calls it too, so the rows are
        checked again: admitted (a row finished since ``open_step``), then a prepared slot each."""
        if ids.size <= _FEW_ROWS:  # (a beam) the same checks in Python scalars
            for r, admitted in zip(ids.tolist(), self._admitted[ids].tolist(), strict=True):
                if not admitted:
                    raise KeyError(f"commit_step: row {r} is not admitted (never admitted, or finished)")
            held, _, length, _, ceiling, _ = self._counts[:, ids].tolist()
            page = self.config.page_size
            if any(n + 1 > h * page or n >= c for h, n, c in zip(held, length, ceiling, strict=True)):
                self._check_prepared(ids)  # raises the first such row's message
        else:
            if not self._admitted[ids].all():
                r = int(ids[np.argmin(self._admitted[ids])])
                raise KeyError(f"commit_step: row {r} is not admitted (never admitted, or finished)")
            self._check_prepared(ids)
        self._length[ids] += 1
        self._sync(ids)

    def append(self, rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """One decode step for many rows, ``k, v (L, B, H, D)``: one staged copy, one append_kv per layer."""
        ids = np.array(check_rows(rows, self._is_admitted, "append"), dtype=np.int64)
        check_step_kv(self.config, k, v, ids.size, numbers=self._torch_writes())
        if not ids.size:  # an empty cohort: nothing to write (the reference's loops run zero times)
            return
        self._prepare(ids)  # validates every row's ceiling before its one allocation
        self._sync(ids)
        if self._host_writes():  # the device mirror follows at the next read
            self._write_host(self._self_table, ids, self._length[ids], k, v)
            self._length[ids] += 1
            return
        rows_d = self._flush(ids)
        for layer, view in enumerate(self._self_views(ids, rows_d)):
            append_kv(view, k[layer][:, None], v[layer][:, None], backend=self.backend)
        self._length[ids] += 1
        self._meta[0].index_add_(0, rows_d, self._ones[: ids.size])

    # ---- sessions (see the reference) ---------------------------------------------------------
    def request(self, row: int) -> DecoderRequest:
        """The ``DecoderRequest`` an admitted row declared (``KeyError`` otherwise)."""
        return self._requests[self._row(row, "request")]

    def can_restore(self, requests, self_pages, cross_pages, lengths, num_pages: int, published=()) -> Admission:
        """See the reference: would ``restore_rows`` succeed? Never mutates."""
        return judge_restore(self.config, check_requests(requests), self_pages, cross_pages, lengths, num_pages,
                             list(published), self.num_free_rows, self.pool.num_free_blocks, self.reserved_blocks)

    def restore_rows(self, requests, self_pages, cross_pages, lengths, cross_lengths, num_pages: int,
                     published=()) -> tuple[list[int], list[int]]:
        """See the reference: rows carrying saved pages, shared names bound as shared references."""
        reqs = check_requests(requests)
        published = list(published)
        answer = self.can_restore(reqs, self_pages, cross_pages, lengths, num_pages, [p for p, _ in published])
        if not answer:
            raise AdmissionError(answer.reason)
        blocks = self._take(num_pages)
        rows = np.flatnonzero(~self._admitted)[: len(reqs)]
        named = np.zeros(num_pages, dtype=bool)
        for row, req, s, c in zip(rows.tolist(), reqs, self_pages, cross_pages, strict=True):
            for table, names in ((self._self_table, s), (self._cross_table, c)):
                for col, p in enumerate(names):
                    self._bind(table, np.array([row]), np.array([col]), blocks[[p]], share=bool(named[p]))
                    named[p] = True
            self._requests[row] = req
        self._held[rows] = [len(s) for s in self_pages]
        self._cross_held[rows] = [len(c) for c in cross_pages]
        self._length[rows] = list(lengths)
        self._cross_length[rows] = list(cross_lengths)
        self._ceiling[rows] = [r.self_tokens for r in reqs]
        self._cross_ceiling[rows] = [r.cross_len for r in reqs]
        self._admitted[rows] = True
        self.cross_writes += 1  # (the caller writes the pages next)
        for p, (scope, tokens) in published:
            key = self._prefix.adopt(self.pool, int(blocks[p]), tokens, scope)
            if key is not None:
                self.pool.publish([int(blocks[p])], [key], self._owner)
        self._sync(rows)
        return rows.tolist(), blocks.tolist()

    # ---- prefix caching (see the reference) ---------------------------------------------------
    def admit_prompt(self, row: int, tokens, scope=0) -> int:
        """See the reference: bind the longest published prefix; returns the cached token count."""
        r = self._row(row, "admit_prompt")
        ids = check_tokens(tokens, "admit_prompt")
        if self._length[r] or self._held[r]:
            raise ValueError(f"admit_prompt: row {r} already holds {int(self._length[r])} tokens; admit its "
                             f"prompt first")
        if len(ids) > self._ceiling[r]:
            raise ValueError(f"admit_prompt: row {r} declared {int(self._ceiling[r])} tokens, got a prompt "
                             f"of {len(ids)}")
        hits = np.array(self._prefix.lookup(self.pool, ids, scope), dtype=np.int64)
        if hits.size:
            self._bind(self._self_table, np.full(hits.size, r), np.arange(hits.size), hits, share=True)
        self._held[r] = hits.size
        self._length[r] = hits.size * self.config.page_size
        self._sync(r)
        return int(self._length[r])

    def retire(self, row: int, tokens, scope=0) -> None:
        """See the reference: publish the row's full pages under its history, then finish it."""
        r = self._row(row, "retire")
        ids = check_tokens(tokens, "retire")
        if len(ids) != self._length[r]:
            raise ValueError(f"retire: row {r} holds {int(self._length[r])} tokens, got a history of {len(ids)}")
        blocks = self._self_table[r, : self._held[r]]
        self.pool.publish(*self._prefix.publish(self.pool, ids, blocks, scope), self._owner)
        self.finish(r)

    def evict(self, row: int) -> None:
        """See the reference: finish publishing nothing new; published pages park."""
        self.finish(row)

    def abandon(self, row: int) -> None:
        """See the reference: host bookkeeping only (no staged copy, no launch, no wait); the row's
        device table entries are stale until its next admission rewrites them, and nothing reads them."""
        self._release(self._row(row, "abandon"))
        self._version += 1

    def reset(self) -> None:
        """See the reference: finish every row, drop the parked pages and the prefix index."""
        for row in self.rows:
            self.finish(row)
        self.pool.drop_parked()
        self._prefix.clear()

    # ---- rewind and trim ------------------------------------------------------------------
    def rewind(self, row: int, n: int) -> None:
        """See the reference: drop the last ``n`` tokens; pages stay bound and are re-served first."""
        r = self._row(row, "rewind")
        check_rewind(self.config, self, r, n)
        self._length[r] -= n
        self._sync(r)

    def trim(self, row: int) -> int:
        """See the reference: the pages past ``ceil(length / page)`` go back to the pool."""
        r = self._row(row, "trim")
        keep = self.config.pages_for(int(self._length[r]))
        tail = self._unbind(self._self_table, r, int(self._held[r]), keep)
        self._drop(tail)
        self._held[r] = min(keep, int(self._held[r]))
        self._sync(r)
        return int(tail.size)

    # ---- beams ----------------------------------------------------------------------
    def select(self, rows, idx) -> list[int]:
        """See the reference: keep and reorder rows, finish the rest, fork repeats onto shared pages."""
        ids = check_rows(rows, self._is_admitted, "select")
        sources, dropped = self._plan_select(ids, idx)
        if len(ids) <= _FEW_ROWS:
            return self._select_few(sources, dropped)
        released = np.zeros(0, dtype=np.int64)
        if dropped:  # finished together; their references are dropped with the forks' (_fork)
            gone = np.array(dropped, dtype=np.int64)
            released = self._unbind_rows(gone)
            self._sync(gone)
        out, forks, parents = self._place(sources)
        self._fork(np.array(parents, dtype=np.int64), np.array(forks, dtype=np.int64), released)
        return out

    def _place(self, sources: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Where each source of a select lands, after its dropped rows are gone: a source's first place
        keeps its row, a repeat forks into the lowest free row. ``(rows, forks, their parents)``."""
        out, seen, forks, parents, free_rows = [], set(), [], [], None
        for src in sources:
            if src in seen:
                if free_rows is None:
                    free_rows = np.flatnonzero(~self._admitted).tolist()
                out.append(free_rows[len(forks)])
                forks.append(out[-1])
                parents.append(src)
            else:
                out.append(src)
            seen.add(src)
        return out, forks, parents

    def _select_few(self, sources: list[int], dropped: list[int]) -> list[int]:
        """``select``'s changes for a few rows (a beam) in Python lists, with one pool call
        (``_free_and_share``): the same rows, references, records, and pages freed in the same order,
        as the numpy path (``_unbind_rows``, ``_fork``)."""
        table, cross, counts, null = self._self_table, self._cross_table, self._counts, self.pool.null_block
        released = self._held_refs_few(dropped)
        for r in dropped:
            self._admitted[r] = False
        out, forks, parents = self._place(sources)
        taken = self._held_refs_few(parents)
        if released and taken:  # the pairs that would go down and up again are left out
            released, taken = _cancel_few(released, taken)
        if released or taken:
            self.pool._free_and_share(released, taken, self._owner)
        for f, p in zip(forks, parents, strict=True):  # whole rows: past what a parent holds its entries are null
            table[f] = table[p]
            cross[f] = cross[p]
            counts[:, f] = counts[:, p]
            self._admitted[f] = True
            self._requests[f] = self._requests[p]
        reused = set(forks)  # (a fork mostly lands in a row the select dropped: written once, not cleared first)
        for r in dropped:
            if r not in reused:
                table[r] = cross[r] = null
                counts[:, r] = 0
                self._requests[r] = None
        if dropped or forks:
            self._sync(dropped + forks)
        return out

    def _plan_select(self, ids: list[int], idx) -> tuple[list[int], list[int]]:
        """``plan_select`` (the same checks, order and messages) with the reservation in numpy:
        ``(sources, dropped)``, nothing changed."""
        sources = select_sources(ids, idx)
        kept = set(sources)
        dropped = [r for r in ids if r not in kept]
        forks = len(sources) - len(kept)
        admitted = int(np.count_nonzero(self._admitted))
        free_rows = self.config.max_rows - admitted
        if forks > free_rows + len(dropped):
            raise ValueError(f"select: {forks} forked rows need {forks} free rows, only "
                             f"{free_rows + len(dropped)} are free after the dropped rows finish")
        others = []
        if admitted > len(ids):  # rows outside the group keep their reservations
            outside = self._admitted.copy()
            outside[ids] = False
            others = np.flatnonzero(outside).tolist()
        after = sources + others
        # an upper bound first: every written block costs at most one copy per writer, so when the growth
        # to every ceiling plus every written block fits the free blocks, the exact count below does too
        # (beams in a pool sized for them: most selects stop here)
        page = self.config.page_size
        if len(after) <= _FEW_ROWS:  # (a beam) the same sum in Python scalars
            held, length, ceiling = self._held.item, self._length.item, self._ceiling.item
            bound = sum(-(-ceiling(r) // page) - held(r) + max(held(r) - length(r) // page, 0) for r in after)
        else:
            after = np.array(after, dtype=np.int64)
            held = self._held[after]
            written = np.maximum(held - self._length[after] // page, 0)
            bound = int((-(-self._ceiling[after] // page) - held).sum() + written.sum())
        if bound <= self.pool.num_free_blocks:
            return sources, dropped
        after = np.asarray(after, dtype=np.int64)
        blocks = self._blocks_of(after)
        need = self._reserved(after, self.pinned_blocks, blocks)
        freed = 0
        if dropped:  # pages only dropped rows hold go back (or park: parked pages count as free)
            before = np.concatenate(self._blocks_of(np.array(dropped, dtype=np.int64))[:2])
            freed = len(set(before.tolist()).difference(blocks[0].tolist(), blocks[1].tolist()))
        have = self.pool.num_free_blocks + freed
        if need > have:
            raise ValueError(f"select: the selected rows reserve {need} blocks (ceilings and copy-on-write copies "
                             f"owed), only {have} are free after the dropped rows' pages return")
        return sources, dropped

    def _fork(self, parents: np.ndarray, forks: np.ndarray, released: np.ndarray) -> None:
        """Fresh rows ``forks`` mapping their ``parents``' pages (a shared bind per region: counts up),
        after the references ``released`` (the rows the same select dropped) go down. A page in both
        (a prompt or cross page the dropped and the kept beams all hold) would go down and up again
        without reaching 0, so those pairs are left out: the same counts, and the same pages freed in
        the same order, for far fewer pool updates."""
        if not forks.size:  # (a select that only keeps and drops rows)
            if released.size:
                self._drop(released)
            return
        taken = self._held_refs(parents)
        if released.size and taken.size:
            released, taken = _cancel(released, taken)
        if released.size:
            self._drop(released)
        if taken.size:
            self.pool.share(taken, self._owner)  # one more holder each, at once
        # whole table rows: a fork row is all null, and a parent's entries past what it holds are null
        self._bind(self._self_table, forks, slice(None), self._self_table[parents])
        self._bind(self._cross_table, forks, slice(None), self._cross_table[parents])
        self._counts[:, forks] = self._counts[:, parents]
        self._admitted[forks] = True
        for f, p in zip(forks.tolist(), parents.tolist(), strict=True):
            self._requests[f] = self._requests[p]
        self._sync(forks)


class HostStep:
    """``open_step``'s handle on a CPU device with model-dtype pages and the torch backend.

    Built once per step from the host tables (the rows' lengths and page ids after ``prepare_step``):
    ``dest (B,)``, the pool slot of each row's new token, and ``vector (B * Hkv * L,)``, the pool
    vectors (slot, KV head) of every row's keys ``[0, length + 1)`` padded to the longest row's ``L``,
    with ``hidden (B, L)`` marking the padding (None when every row has ``L`` keys). Every layer then
    writes with one ``index_copy_`` each for K and V and reads with ``attend_gathered`` (the views'
    decode batch: one gather each, two batched matmuls, padding masked and zeroed, NaN-safe). No
    per-layer view, dispatch or length check: the plan answered them. Valid until another manager
    call changes the rows (like the views)."""

    __slots__ = ("_manager", "_ids", "_dest", "_vector", "_hidden", "_want", "_dtype", "_slots", "_scale",
                 "_version")

    def __init__(self, manager: DecoderKVCacheManager, ids: np.ndarray):
        cfg = manager.config
        page, Hkv, B = cfg.page_size, cfg.n_kv_head, ids.size
        lengths = manager._length[ids].tolist()
        L = max(lengths) + 1
        blocks = manager._self_table[ids][:, manager._position_column[:L]].astype(np.int64)  # (B, L)
        self._manager, self._ids, self._dtype = manager, ids, cfg.dtype
        self._version = manager._version  # (open_step synced the rows: nothing changed since)
        short = lengths.count(L - 1) < B  # rows with fewer keys than the longest: their tail is padding
        if not short:  # (beams: one length) the landing slots are one column of the blocks
            self._dest = torch.from_numpy(blocks[:, L - 1] * page + (L - 1) % page)
        else:
            length = np.array(lengths, dtype=np.int64)
            self._dest = torch.from_numpy(blocks[np.arange(B), length] * page + length % page)
        vectors = blocks[:, None, :] * (page * Hkv) + manager._position_vectors[:, :L]  # (B, Hkv, L)
        self._vector = torch.from_numpy(vectors.reshape(-1))
        self._hidden = (torch.from_numpy(np.arange(L)[None, :] > np.array(lengths)[:, None]) if short else None)
        self._want = (B, 1, Hkv, cfg.head_dim)
        self._slots = manager._layer_slots
        self._scale = manager._query_scale

    def _check(self, op: str, name: str, t, shape: tuple, what: str | None = None) -> None:
        """``t`` must be a CPU tensor of ``shape`` in the model dtype (``what``: the shape as the message
        names it, a template of ``B``, ``H`` (KV heads) and ``D``, filled only to raise); ValueError naming
        what came otherwise."""
        if (not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != self._dtype
                or t.device.type != "cpu"):
            got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            B, _, H, D = self._want
            what = shape if what is None else what.format(B=B, H=H, D=D)
            raise ValueError(f"{op}: {name} must be {what} {self._dtype} on cpu, got {got}")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """See ``ViewStep.write``: one ``index_copy_`` each for K and V (checked first: nothing written)."""
        self._check("write", "k", k, self._want)
        self._check("write", "v", v, self._want)
        k_slots, v_slots = self._slots[layer]
        B, _, H, D = self._want
        k_slots.index_copy_(0, self._dest, k.reshape(B, H, D))
        v_slots.index_copy_(0, self._dest, v.reshape(B, H, D))

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """See ``ViewStep.attend``: ``attend_gathered`` over the step's vectors."""
        B, _, H, D = self._want
        heads = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] % H == 0 else None
        self._check("attend", "q", q, (B, heads, 1, D), _QUERY_SHAPE)
        k_slots, v_slots = self._slots[layer]
        return attend_gathered(q, k_slots, v_slots, self._vector, self._hidden, None, self._scale)

    def commit(self) -> None:
        """Every row is one token longer (``commit_step``'s checks and update, rows already checked). When
        no row's records changed since the step opened (the manager's version is the one the plan read),
        every row is still admitted and holds its prepared slot: the re-checks are skipped."""
        manager = self._manager
        if manager._version != self._version:
            manager._commit(self._ids)
            return
        if self._ids.size <= _FEW_ROWS:  # (a beam) element updates beat a fancy-indexed one
            length = manager._length
            for r in self._ids.tolist():
                length[r] += 1
        else:
            manager._length[self._ids] += 1
        manager._sync(self._ids)


def _cancel(released: np.ndarray, taken: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``released`` less the first occurrences of each id in ``taken`` (order kept: the remaining
    occurrences are the later ones, so an id still reaches 0 at its last place), and ``taken`` less
    what was matched: the references a select still drops and still takes. A few ids (a short
    hypothesis): a counting loop; more: in numpy, each released id's occurrence rank (a stable sort)
    against the count ``taken`` holds of it (the loop's result, in a constant number of operations)."""
    if released.size + taken.size <= _FEW_CANCEL:
        left, still = _cancel_few(released.tolist(), taken.tolist())
        return np.array(left, dtype=np.int64), np.array(still, dtype=np.int64)
    n = int(max(released.max(), taken.max())) + 1
    want = np.bincount(taken, minlength=n)
    order = np.argsort(released, kind="stable")
    ordered = released[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    rank = np.empty(released.size, dtype=np.int64)
    rank[order] = np.arange(released.size) - np.repeat(starts, np.diff(np.append(starts, released.size)))
    left = want - np.minimum(want, np.bincount(released, minlength=n))
    still = np.flatnonzero(left)
    return released[rank >= want[released]], np.repeat(still, left[still])


def _cancel_few(released: list[int], taken: list[int]) -> tuple[list[int], list[int]]:
    """``_cancel`` of int lists by a counting loop."""
    want, left = Counter(taken), []
    for b in released:
        if want.get(b):
            want[b] -= 1
        else:
            left.append(b)
    return left, list(want.elements())


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
