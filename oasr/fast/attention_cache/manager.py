"""Fast ``AttentionCacheManager``: slot-indexed persistent tables, numpy bookkeeping.

Fast twin of ``oasr.reference.attention_cache.AttentionCacheManager``: same
methods, same errors, same atomicity, and the same block ids in the same table
columns for the same op sequence. The position arithmetic is drawn once in
``oasr.cache.config``.

Where the state lives
---------------------
Rows are stream slots ``[0, max_batch_size)`` then ``pad_lanes`` padding rows::

    host mirror (numpy, the source of truth)        device (persistent, fixed address)
    _table       int32 (R, max_blocks_per_seq)  ->  block_table      int32 (R, max_blocks_per_seq)
    _seqlen      int64 (R,)                     ->  cache_seqlens    int32 (R,)  = _seq_meta[0]
    _seqstart    int64 (R,)                     ->  cache_seqstarts  int32 (R,)  = _seq_meta[1]
    _num_blocks, _total, _prepared  (R,)            (host only)

The two length vectors are the rows of one ``(2, R)`` tensor, so one op
updates or gathers both.

A padding row maps only ``pool.null_block`` at length ``prefill_frames``, start
0, and never changes. A free slot's row is all null at length 0.

One tick, for a cohort of B streams
-----------------------------------
Each call is a constant number of numpy operations on the cohort's rows, then
at most one staged host-to-device copy (``oasr.fast.staging``), then a constant
number of device operations. No Python loop runs over the streams (a loop runs
only to raise the reference's error for the first bad id, once a vectorised
check has found one), nothing reads the device back, and no tensor is
allocated once each cohort width has been seen once.

* ``prepare_chunks_batched``: one ``pool.allocate_array`` for all B streams in
  stream order; the new ``(flat table index, block id)`` pairs and the cohort's
  slots go in one staged copy; one ``index_copy_`` writes the new ids into
  ``block_table``. The staged slots stay on the device for the
  ``get_paged_caches`` of the same cohort.
* ``get_paged_caches``: the cohort's rows are gathered (``index_select`` with
  ``out=``) into persistent per-width buffers, reusing the slots staged by the
  prepare of the same cohort; padding rows are filled with scalars.
* ``commit_chunks_batched``: advance and evict on the host (blocks leave in
  stream order, then logical order); one staged copy carries the cohort's slots,
  new lengths and starts, and for eviction a ``(B, K)`` column index
  ``min(col + dropped, K)``; on the device the rows' first ``K`` columns are
  gathered into a scratch whose column ``K`` is null, shifted left with one
  ``gather`` and written back with one ``index_copy_``: eviction moves the
  table rows on the device. ``K = min(max_blocks_per_seq, blocks_per_stream)``
  bounds the columns a stream can ever hold, so the rest stay null untouched.

One stream (dispatch by size): ``prepare_chunks_batched`` and
``commit_chunks_batched`` of a single id run ``_prepare_one`` / ``_commit_one``,
the same checks, frees and allocations in Python ints instead of ~25 numpy
vector calls (which cost more than the work at one stream on a CPU). On CUDA
prepare still stages once; commit sends the stream's shifted host row and
lengths in one ``_row_stager`` copy and writes them with two ``index_copy_``.
Tables, errors and block order are the batched path's (the two-twin state
machine drives both).

On a CPU device (dispatch by device, reported once, INFO ``oasr.fast``)
there is no host-to-device copy to avoid, so the manager keeps numpy views of
``block_table`` and of the length pair (``Tensor.numpy()`` shares the storage)
and writes through them what the staged path sends: prepare the new ids,
commit the lengths and, on eviction, the shifted host rows;
``get_paged_caches`` gathers rows into the width's buffers with ``np.take``
through numpy views of those buffers. No stager runs and no torch op but the
views of new records. At one stream the staged copies and index ops cost more
than the rest of the tick; at every size they cost more than the numpy writes.
``get_paged_caches`` of one id also checks in scalars (``_paged_one``). The
numbers the views and tables hold are the staged path's (tests compare them
tick by tick). ``_stage_like_cuda()`` switches a CPU manager to the staged
path for good: the capture-safety checker's ``watch_engine`` does it so that a
CPU run checks the code CUDA runs, and the tests and the two-twin state
machine run both paths.

Graph-stable addresses
----------------------
``block_table``, ``cache_seqlens`` and ``cache_seqstarts`` keep their storage
for the manager's life; ``get_paged_state_views`` returns ``(1, .)`` row views
of them (live: later commits show through, as the reference's per-stream
tensors do). ``get_paged_caches`` returns views over persistent buffers owned
by the cohort *width* (``len(ids)`` or ``pad_to``): a graph captured at a width
reads the same addresses on every replay. Unlike the reference's fresh
``torch.cat``, those buffers are rewritten by the next ``get_paged_caches`` of
the same width; a view is a snapshot valid until then.

Beyond ``oasr.cache.memory.footprint`` (tables and lengths), a manager holds the
per-width view buffers, an eviction scratch of ``2 * max_batch_size * (K + 1)``
int32 and its stagers (a few KiB of device memory and of pinned host memory
each, four host copies per stager on CUDA).

The class is assembled from one part per idea, each a mixin in its own module of
this package (the parts hold no state; this module draws it above and owns
``__init__`` and the lifecycle: allocate, restore, free, reset, describe):

    chunks.py   paged mode's tick: prepare_chunks_batched, commit_chunks_batched, eviction
    views.py    paged mode's reads: get_paged_state_views, get_paged_caches, cached_frames
    dense.py    dense mode: commit a packed chunk, get_stacked_cache
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from oasr.cache.config import CacheConfig
from oasr.cache.errors import PoolExhaustedError, duplicate_stream
from oasr.cache.paged import StreamKVInfo
from oasr.cache.validate import check_count, check_restore_lengths, check_restore_room
from oasr.fast.attention_cache.chunks import ChunksMixin
from oasr.fast.attention_cache.dense import DenseMixin
from oasr.fast.attention_cache.views import ViewsMixin
from oasr.fast.block_pool import BlockPool
from oasr.fast.slot_pool import StreamSlotPool
from oasr.fast.staging import Stager

_I32, _I64 = torch.int32, torch.int64
_logger = logging.getLogger("oasr.fast")
_reported = []


def _report_cpu_direct() -> None:
    if not _reported:
        _reported.append(True)
        _logger.info(
            "oasr.fast: attention cache: on a CPU device prepare / get_paged_caches / commit write the persistent "
            "tables directly (numpy views of their storage, one stream in scalars); CUDA stages one copy per call"
        )


class AttentionCacheManager(ChunksMixin, ViewsMixin, DenseMixin):
    def __init__(self, pool: BlockPool, config: CacheConfig, pad_lanes: int = 0):
        check_count("AttentionCacheManager", "pad_lanes", pad_lanes)
        if pad_lanes and pool.scratch_blocks == 0:
            raise ValueError("AttentionCacheManager: pad_lanes > 0 needs a pool with scratch_blocks >= 1")
        self.pool = pool
        self.config = config
        self.pad_lanes = pad_lanes
        self.slots = StreamSlotPool(config.max_batch_size)
        self._owner = pool.new_owner(type(self).__name__)  # the pool refuses to free our blocks for others

        streams, rows, width = config.max_batch_size, config.max_batch_size + pad_lanes, config.max_blocks_per_seq
        active = min(width, config.blocks_per_stream)
        null, device = pool.null_block, config.device
        self._active_cols = active
        self._cols = np.arange(active)
        self._row_index = np.arange(streams)[:, None]
        self._host_shift = np.full((streams, active + 1), null, dtype=np.int32)  # col K stays null

        self._table = np.full((rows, width), null, dtype=np.int32)
        self._num_blocks = np.zeros(rows, dtype=np.int64)
        self._seqlen = np.zeros(rows, dtype=np.int64)
        self._seqlen[streams:] = config.prefill_frames
        self._seqstart = np.zeros(rows, dtype=np.int64)
        self._total = np.zeros(rows, dtype=np.int64)
        self._prepared = np.zeros(rows, dtype=bool)

        self.block_table = torch.full((rows, width), null, dtype=_I32, device=device)
        self._seq_meta = torch.zeros((2, rows), dtype=_I32, device=device)
        self._seq_meta[0, streams:].fill_(config.prefill_frames)
        self.cache_seqlens, self.cache_seqstarts = self._seq_meta[0], self._seq_meta[1]
        self._flat_table = self.block_table.view(-1)
        # CPU (dispatch by device): numpy views of the persistent tensors' own storage; every call writes
        # rows through them instead of staging (on a CPU there is no host-to-device copy).
        self._host_table = self._host_meta = None
        if self.block_table.device.type == "cpu":
            self._host_table, self._host_meta = self.block_table.numpy(), self._seq_meta.numpy()
            _report_cpu_direct()
        self._active_table = self.block_table[:, :active]
        self._shift_src = torch.full((streams, active + 1), null, dtype=_I32, device=device)  # col K stays null
        self._shift_dst = torch.empty((streams, active), dtype=_I32, device=device)

        per_chunk = math.ceil(config.chunk_size / config.block_size_frames)  # most new blocks per stream
        new_max = streams * per_chunk
        self._prepare_stager = Stager([(streams, _I64), (new_max, _I64), (new_max, _I32)], device)
        self._commit_stager = Stager([(streams, _I64), (2 * streams, _I32), (streams * active, _I64)], device)
        self._cohort_stager = Stager([(streams, _I64)], device)
        self._row_stager = Stager([(1, _I64), (width, _I32), (2, _I32)], device)
        chunk = config.chunk_size
        self._dense_stager = Stager([(per_chunk, _I64), (per_chunk, _I32), (chunk, _I64), (chunk, _I64)], device)
        self._prepared_cohort = None  # (slot epoch, ids, staged device slots) of the last prepare
        self._cohorts: dict[int, tuple] = {}  # width -> (block_table (w, W), seq meta (2, w))
        self._host_cohorts: dict[int, tuple] = {}  # CPU only: width -> numpy views of those two buffers
        self._views: dict[int, tuple] = {}  # width -> (max_seqlen, max_span, prepared_frames, views per layer)
        self._layer_kv = [pool.get_kv_view(layer) for layer in range(config.num_layers)]
        self._layer_scales = [pool.get_kv_scale_view(layer) for layer in range(config.num_layers)]

    def _stage_like_cuda(self) -> None:
        """Turn the CPU direct writes off for good: every call then stages and runs the device ops
        exactly as on CUDA. The capture-safety checker (``watch_engine``) does this, so that a CPU run
        checks the code a CUDA device runs; tests do it to cover that path on the CPU."""
        self._host_table = self._host_meta = None
        self._prepared_cohort = None

    # ---- lifecycle --------------------------------------------------------------
    def allocate_stream(self, stream_id) -> None:
        """Admit ``stream_id``: a slot, and the prefill window's blocks when the config prefills (``ValueError`` if
        already allocated; ``PoolExhaustedError`` / ``SlotsExhaustedError``; nothing changes on a refusal).
        """
        if stream_id in self.slots:
            raise duplicate_stream(stream_id)
        need = self.config.prefill_blocks
        if need > self.pool.num_free_blocks:
            raise PoolExhaustedError(need, self.pool.num_free_blocks)
        slot = self.slots.acquire(stream_id)  # may raise SlotsExhaustedError; nothing changed yet
        self._write_row(np.array([slot]), self._admit_blocks(), self.config.prefill_frames)

    def restore_stream(self, stream_id, seqlen: int, seqstart: int, total_frames: int) -> list[int]:
        """Admit ``stream_id`` holding the lengths of a stream that committed ``total_frames`` frames.

        Same contract as the reference: a slot and ``ceil(seqlen / block_size_frames)`` zeroed
        blocks, their ids returned oldest first for the caller to write the visible frames into;
        everything checked before anything changes.
        """
        if stream_id in self.slots:
            raise duplicate_stream(stream_id)
        need = check_restore_lengths(self.config, seqlen, seqstart, total_frames)
        check_restore_room(self.config, stream_id, need, self.pool.num_free_blocks, [self.slots])
        slot = self.slots.acquire(stream_id)
        blocks = self.pool.allocate_array(need, self._owner)
        if blocks.size:
            self.pool.zero_blocks(blocks)
        self._write_row(np.array([slot]), blocks, seqlen, seqstart, total_frames)
        return blocks.tolist()

    def free_stream(self, stream_id) -> None:
        """Release ``stream_id``'s blocks and slot (``KeyError`` for an unknown id)."""
        slot = self.slots.slot_of(stream_id)
        self.pool.free_array(self._table[slot, : self._num_blocks[slot]], owner=self._owner)
        self.slots.release(stream_id)
        self._write_row(np.array([slot]), np.empty(0, dtype=np.int64), 0)

    def reset_stream(self, stream_id) -> None:
        """Back to the admission state (blocks freed, the prefilled window re-zeroed); the slot is kept."""
        slot = self.slots.slot_of(stream_id)
        held = int(self._num_blocks[slot])
        need = self.config.prefill_blocks
        if need > self.pool.num_free_blocks + held:
            raise PoolExhaustedError(need, self.pool.num_free_blocks + held)
        self.pool.free_array(self._table[slot, :held], owner=self._owner)
        self._write_row(np.array([slot]), self._admit_blocks(), self.config.prefill_frames)

    def has_stream(self, stream_id) -> bool:
        """Whether ``stream_id`` is allocated."""
        return stream_id in self.slots

    @property
    def stream_ids(self) -> list:
        """The allocated stream ids, in allocation order."""
        return self.slots.stream_ids

    def slot_of(self, stream_id) -> int:
        """The slot (block-table row) of ``stream_id`` (``KeyError`` for an unknown id)."""
        return self.slots.slot_of(stream_id)

    def blocks_held_total(self, stream_ids) -> int:
        """``sum(len(describe(s).blocks) for s in stream_ids)`` in one host read (``KeyError`` for an unknown id)."""
        return int(self._num_blocks[self.slots.slot_array(list(stream_ids))].sum())

    def describe(self, stream_id) -> StreamKVInfo:
        """``StreamKVInfo``: the stream's slot, block ids, seqlen, seqstart and total frames."""
        slot = self.slots.slot_of(stream_id)
        blocks = tuple(self._table[slot, : self._num_blocks[slot]].tolist())
        return StreamKVInfo(
            slot, blocks, int(self._seqlen[slot]), int(self._seqstart[slot]), int(self._total[slot])
        )

    # ---- the lifecycle's helpers ---------------------------------------------------
    def _write_row(self, slots: np.ndarray, blocks: np.ndarray, seqlen: int, seqstart: int = 0,
                   total: int = 0) -> None:
        """(Re)initialise one slot's row with ``blocks``, host and device (admission, reset, free, restore)."""
        slot = int(slots[0])
        row = self._table[slot]
        row[:] = self.pool.null_block
        row[: blocks.size] = blocks
        self._num_blocks[slot] = blocks.size
        self._seqlen[slot] = seqlen
        self._seqstart[slot] = seqstart
        self._total[slot] = total
        self._prepared[slot] = False
        meta = np.array([seqlen, seqstart])
        slot_d, row_d, meta_d = self._row_stager.stage(slots, row, meta)
        self.block_table.index_copy_(0, slot_d, row_d.view(1, -1))
        self._seq_meta.index_copy_(1, slot_d, meta_d.view(2, 1))

    def _admit_blocks(self) -> np.ndarray:
        """Blocks a stream holds at admission: the zeroed window with prefill, else none."""
        ids = self.pool.allocate_array(self.config.prefill_blocks, self._owner)
        if ids.size:
            self.pool.zero_blocks(ids)
        return ids
