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
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from oasr.cache.config import CacheConfig
from oasr.cache.errors import PoolExhaustedError, StreamCapacityError, duplicate_stream
from oasr.cache.paged import PagedKVCache, StreamKVInfo
from oasr.cache.validate import (
    as_id_list,
    check_count,
    check_dense_chunk,
    check_kv_numbers,
    check_restore_lengths,
    check_restore_room,
)
from oasr.fast.block_pool import BlockPool
from oasr.fast.kv_formats import quantize
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



class AttentionCacheManager:
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

    # ---- helpers --------------------------------------------------------------
    def _frames(self, num_frames) -> int:
        n = self.config.chunk_size if num_frames is None else num_frames
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.config.chunk_size:
            raise ValueError(f"num_frames must be an int in [0, chunk_size={self.config.chunk_size}], got {n!r}")
        return n

    def _frame_values(self, num_frames, count: int):
        """``(frames, invalid)``: per-stream frame counts as int64 (0 where invalid) and a mask or None."""
        cs = self.config.chunk_size
        if not isinstance(num_frames, (list, tuple)):
            n = cs if num_frames is None else num_frames
            if not isinstance(n, bool) and isinstance(n, int) and 0 <= n <= cs:
                return np.full(count, n, dtype=np.int64), None
            return np.zeros(count, dtype=np.int64), np.ones(count, dtype=bool)
        if set(map(type, num_frames)) <= {int}:
            try:
                frames = np.array(num_frames, dtype=np.int64)
            except OverflowError:
                frames = None
            if frames is not None:
                invalid = (frames < 0) | (frames > cs)
                if not invalid.any():
                    return frames, None
                frames[invalid] = 0
                return frames, invalid
        values = [cs if n is None else n for n in num_frames]  # odd element types: the slow path
        invalid = np.array(
            [isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= cs for n in values], dtype=bool
        )
        frames = np.array([0 if bad else n for n, bad in zip(values, invalid, strict=True)], dtype=np.int64)
        return frames, invalid

    @staticmethod
    def _raw_frames(num_frames, k: int):
        return num_frames[k] if isinstance(num_frames, (list, tuple)) else num_frames

    def _blocks_for(self, seqlen: np.ndarray, num_blocks: np.ndarray) -> np.ndarray:
        """New blocks to cover table positions up to ``seqlen`` (exclusive)."""
        bs = self.config.block_size_frames
        return np.maximum(0, -(-seqlen // bs) - num_blocks)

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

    def _advance(self, slots: np.ndarray, seqlen: np.ndarray) -> None:
        """Set the cohort's lengths to ``seqlen`` (frames already counted), evict, mirror to the device."""
        cfg = self.config
        bs = cfg.block_size_frames
        drop = None
        if cfg.eviction:
            visible = np.maximum(0, seqlen - cfg.history_frames)
            drop = visible // bs
            seqstart = visible - drop * bs
            seqlen = seqlen - drop * bs
            if not drop.any():
                drop = None
        else:
            seqstart = self._seqstart[slots]
        columns = np.empty(0, dtype=np.int64)
        if drop is not None:
            K = self._active_cols
            B = len(slots)
            held = self._host_shift[:B]
            held[:, :K] = self._table[slots, :K]  # each row's blocks, oldest first, then null
            evicted = held[:, :K][self._cols < drop[:, None]]  # stream order, then logical order
            self.pool.free_array(evicted, owner=self._owner)
            columns = np.minimum(self._cols + drop[:, None], K)  # column K of the shift scratch is null
            self._table[slots, :K] = held[self._row_index[:B], columns]
            self._num_blocks[slots] -= drop
        self._seqlen[slots] = seqlen
        self._seqstart[slots] = seqstart
        if self._host_table is not None:  # CPU: the host rows are the device rows; write them directly
            self._host_meta[0, slots] = seqlen
            self._host_meta[1, slots] = seqstart
            if drop is not None:
                self._host_table[slots, : self._active_cols] = self._table[slots, : self._active_cols]
            return

        B = len(slots)
        slot_d, meta_d, col_d = self._commit_stager.stage(slots, np.concatenate([seqlen, seqstart]), columns)
        self._seq_meta.index_copy_(1, slot_d, meta_d.view(2, B))
        if drop is not None:
            src = self._shift_src[:B]
            torch.index_select(self._active_table, 0, slot_d, out=src[:, : self._active_cols])
            torch.gather(src, 1, col_d.view(B, self._active_cols), out=self._shift_dst[:B])
            self._active_table.index_copy_(0, slot_d, self._shift_dst[:B])

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

    def describe(self, stream_id) -> StreamKVInfo:
        """``StreamKVInfo``: the stream's slot, block ids, seqlen, seqstart and total frames."""
        slot = self.slots.slot_of(stream_id)
        blocks = tuple(self._table[slot, : self._num_blocks[slot]].tolist())
        return StreamKVInfo(
            slot, blocks, int(self._seqlen[slot]), int(self._seqstart[slot]), int(self._total[slot])
        )

    # ---- paged mode ---------------------------------------------------------------
    def at_capacity(self, stream_id, num_frames: int | None = None) -> bool:
        """True when preparing the next ``num_frames`` would pass the stream's block ceiling."""
        slot = self.slots.slot_of(stream_id)
        n = self._frames(num_frames)
        held = int(self._num_blocks[slot])
        need = max(0, -(-(int(self._seqlen[slot]) + n) // self.config.block_size_frames) - held)
        return held + need > self.config.blocks_per_stream

    def prepare_chunk(self, stream_id, num_frames: int | None = None) -> None:
        """``prepare_chunks_batched`` for one stream: blocks for its next ``num_frames`` (default chunk_size) frames."""
        self.prepare_chunks_batched([stream_id], num_frames)

    def prepare_chunks_batched(self, stream_ids, num_frames=None) -> None:
        """Make sure each stream holds blocks for its next chunk; one pool allocation for all.

        ``num_frames`` is None (``chunk_size`` each), an int, or one int per stream.
        """
        ids = as_id_list(stream_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"prepare_chunks_batched: duplicate stream ids in {ids}")
        if isinstance(num_frames, (list, tuple)) and len(num_frames) != len(ids):
            raise ValueError(f"prepare_chunks_batched: {len(num_frames)} frame counts for {len(ids)} streams")
        if len(ids) == 1:  # dispatch by size: one stream in scalar arithmetic (same checks, same copies)
            return self._prepare_one(ids, self._raw_frames(num_frames, 0))
        slots = self.slots.slot_array(ids)
        frames, invalid = self._frame_values(num_frames, len(ids))
        held = self._num_blocks[slots]
        need = self._blocks_for(self._seqlen[slots] + frames, held)
        bad = held + need > self.config.blocks_per_stream
        if invalid is not None:
            bad |= invalid
        if bad.any():
            k = int(np.argmax(bad))
            if invalid is not None and invalid[k]:
                self._frames(self._raw_frames(num_frames, k))
            raise StreamCapacityError(ids[k], int(held[k] + need[k]), self.config.blocks_per_stream)

        new_ids = self.pool.allocate_array(int(need.sum()), self._owner)  # raises PoolExhaustedError before any change
        total = new_ids.size
        flat = np.empty(0, dtype=np.int64)
        if total:
            rows = np.repeat(slots, need)
            first = np.cumsum(need) - need  # where each stream's ids start in new_ids
            cols = np.arange(total) - np.repeat(first - held, need)
            self._table[rows, cols] = new_ids
            self._num_blocks[slots] = held + need
            flat = rows * self.config.max_blocks_per_seq + cols
        self._prepared[slots] = True
        if self._host_table is not None:  # CPU: the tensor's own memory, no copy
            if total:
                self._host_table[rows, cols] = new_ids
            self._prepared_cohort = None
            return
        slot_d, flat_d, ids_d = self._prepare_stager.stage(slots, flat, new_ids)
        if total:
            self._flat_table.index_copy_(0, flat_d, ids_d)
        self._prepared_cohort = (self.slots.epoch, ids, slot_d)

    def _prepare_one(self, ids: list, num_frames) -> None:
        """``prepare_chunks_batched`` of one stream: Python ints instead of numpy vectors.

        At one stream the batched path's ~25 numpy calls cost more than the work; this does
        the same checks in the same order, the same pool allocation, the same one staged copy
        and the same device op, so the tables, the errors and the copies are identical.
        """
        slot = self.slots.slot_of(ids[0])
        n = self._frames(num_frames)
        held, seqlen = int(self._num_blocks[slot]), int(self._seqlen[slot])
        need = max(0, -(-(seqlen + n) // self.config.block_size_frames) - held)
        if held + need > self.config.blocks_per_stream:
            raise StreamCapacityError(ids[0], held + need, self.config.blocks_per_stream)
        new_ids = self.pool.allocate_array(need, self._owner)  # raises PoolExhaustedError before any change
        if need:
            self._table[slot, held : held + need] = new_ids
            self._num_blocks[slot] = held + need
        self._prepared[slot] = True
        if self._host_table is not None:  # CPU: the tensor's own memory, no copy
            if need:
                self._host_table[slot, held : held + need] = new_ids
            self._prepared_cohort = None
            return
        flat = np.empty(0, dtype=np.int64)
        if need:
            flat = slot * self.config.max_blocks_per_seq + np.arange(held, held + need)
        slot_d, flat_d, ids_d = self._prepare_stager.stage(np.array([slot]), flat, new_ids)
        if need:
            self._flat_table.index_copy_(0, flat_d, ids_d)
        self._prepared_cohort = (self.slots.epoch, ids, slot_d)

    def commit_chunk_paged(self, stream_id, num_frames: int) -> None:
        """``commit_chunks_batched`` for one stream: its length grows by ``num_frames``; evicts out-of-window blocks."""
        self.commit_chunks_batched([stream_id], [num_frames])

    def commit_chunks_batched(self, stream_ids, num_frames) -> None:
        """Advance each stream by its committed frames (already written with ``append_kv``), then evict."""
        ids = as_id_list(stream_ids)
        count = len(num_frames) if isinstance(num_frames, (list, tuple)) else len(ids)
        if len(set(ids)) != len(ids) or count != len(ids):
            frames = list(num_frames) if isinstance(num_frames, (list, tuple)) else [num_frames] * len(ids)
            raise ValueError(f"commit_chunks_batched: need unique ids and one frame count each: {ids}, {frames}")
        if len(ids) == 1:  # dispatch by size, as in prepare_chunks_batched
            return self._commit_one(ids[0], self._raw_frames(num_frames, 0))
        slots = self.slots.slot_array(ids)
        frames, invalid = self._frame_values(num_frames, len(ids))
        if invalid is not None and invalid.any():
            self._frames(self._raw_frames(num_frames, int(np.argmax(invalid))))
        seqlen = self._seqlen[slots]
        room = self._num_blocks[slots] * self.config.block_size_frames - seqlen
        short = frames > room
        if short.any():
            k = int(np.argmax(short))
            raise ValueError(
                f"commit of {int(frames[k])} frames for stream {ids[k]!r}: only {int(room[k])} "
                f"frames prepared (call prepare_chunk first)"
            )
        self._total[slots] += frames
        self._advance(slots, seqlen + frames)

    def _commit_one(self, stream_id, num_frames) -> None:
        """``commit_chunks_batched`` of one stream: scalar checks, then ``_advance`` (same errors)."""
        slot = self.slots.slot_of(stream_id)
        n = self._frames(num_frames)
        seqlen = int(self._seqlen[slot])
        room = int(self._num_blocks[slot]) * self.config.block_size_frames - seqlen
        if n > room:
            raise ValueError(
                f"commit of {n} frames for stream {stream_id!r}: only {room} frames prepared (call prepare_chunk first)"
            )
        self._total[slot] += n
        self._advance_one(slot, seqlen + n)

    def _advance_one(self, slot: int, seqlen: int) -> None:
        """``_advance`` of one stream in Python ints: the same frees in the same order. On the device
        the row is not shifted in place: the shifted host row travels with the lengths in one
        staged copy (``_row_stager``) and two ``index_copy_`` write it (fewer ops for one row)."""
        cfg = self.config
        bs = cfg.block_size_frames
        drop = 0
        if cfg.eviction:
            visible = max(0, seqlen - cfg.history_frames)
            drop = visible // bs
            seqstart = visible - drop * bs
            seqlen -= drop * bs
        else:
            seqstart = int(self._seqstart[slot])
        row = self._table[slot]
        if drop:
            K = self._active_cols
            blocks = row[:K].copy()  # the stream's blocks, oldest first, then null
            self.pool.free_array(blocks[: min(drop, K)], owner=self._owner)
            row[: max(K - drop, 0)] = blocks[drop:]
            row[max(K - drop, 0) : K] = self.pool.null_block
            self._num_blocks[slot] -= drop
        self._seqlen[slot] = seqlen
        self._seqstart[slot] = seqstart
        if self._host_table is not None:  # CPU: write the persistent tensors' memory directly
            if drop:
                self._host_table[slot] = row
            self._host_meta[0, slot] = seqlen
            self._host_meta[1, slot] = seqstart
            return
        slot_d, row_d, meta_d = self._row_stager.stage(np.array([slot]), row, np.array([seqlen, seqstart]))
        if drop:
            self.block_table.index_copy_(0, slot_d, row_d.view(1, -1))
        self._seq_meta.index_copy_(1, slot_d, meta_d.view(2, 1))

    def get_paged_state_views(self, stream_id):
        """``(block_table (1, W), cache_seqlens (1,), cache_seqstarts (1,))``: row views of the persistent tensors."""
        slot = self.slots.slot_of(stream_id)
        if not self._prepared[slot]:
            raise RuntimeError(f"stream {stream_id!r}: paged state read before the first prepare_chunk")
        return (
            self.block_table[slot : slot + 1],
            self.cache_seqlens[slot : slot + 1],
            self.cache_seqstarts[slot : slot + 1],
        )

    def _cohort_buffers(self, width: int):
        """The persistent ``(table (w, W), seq meta (2, w))`` of one cohort width (allocated on first use)."""
        buffers = self._cohorts.get(width)
        if buffers is None:
            device = self.config.device
            buffers = (
                torch.empty((width, self.config.max_blocks_per_seq), dtype=_I32, device=device),
                torch.empty((2, width), dtype=_I32, device=device),
            )
            self._cohorts[width] = buffers
        return buffers

    def _device_slots(self, ids: list, slots: np.ndarray) -> torch.Tensor:
        """The cohort's slots on the device: the ones the last prepare staged if it was this cohort."""
        cached = self._prepared_cohort
        if cached is not None and cached[0] == self.slots.epoch and cached[1] == ids:
            return cached[2]
        (slot_d,) = self._cohort_stager.stage(slots)
        return slot_d

    def get_paged_caches(self, stream_ids, pad_to: int | None = None) -> list[PagedKVCache]:
        """One ``PagedKVCache`` per layer over the cohort ``stream_ids`` (padded to ``pad_to`` rows);
        ``prepared_frames`` and ``model_dtype`` as in the reference (host numbers, no device read)."""
        ids = as_id_list(stream_ids)
        if len(ids) == 1 and self._host_table is not None:  # one stream on a CPU: scalar checks (module docstring)
            return self._paged_one(ids[0], pad_to)
        if len(set(ids)) != len(ids):
            raise ValueError(f"get_paged_caches: duplicate stream ids in {ids}")
        try:
            slots = self.slots.slot_array(ids)
        except KeyError:
            slots = None
        if slots is None or not self._prepared[slots].all():
            for stream_id in ids:  # raise the reference's error for the first bad id
                self.get_paged_state_views(stream_id)
        pad = self._padding(pad_to, len(ids))
        B = len(ids)
        if B + pad == 0:
            # The reference's torch.cat of no rows raises ValueError; say why in words.
            raise ValueError("get_paged_caches: an empty cohort (no stream ids, no padding) has no view")

        table, meta = self._cohort_buffers(B + pad)
        prefill, chunk = self.config.prefill_frames, self.config.chunk_size
        max_seqlen = max_span = prefill if pad else 0
        prepared = ()
        host = self._host_buffers(B + pad)
        if B and host is not None:  # CPU: gather through numpy views of the same storage
            np.take(self._host_table, slots, axis=0, out=host[0][:B])
            np.take(self._host_meta, slots, axis=1, out=host[1][:, :B])
        elif B:
            slot_d = self._device_slots(ids, slots)
            torch.index_select(self.block_table, 0, slot_d, out=table[:B])
            torch.index_select(self._seq_meta, 1, slot_d, out=meta[:, :B])
        if B:
            lens = self._seqlen[slots]
            max_seqlen = max(max_seqlen, int(lens.max()))
            max_span = max(max_span, int((lens - self._seqstart[slots]).max()))
            room = self._num_blocks[slots] * self.config.block_size_frames - lens
            prepared = tuple(np.minimum(room, chunk).tolist())
        prepared += (chunk,) * pad
        if pad:
            self._fill_padding(table, meta, host, B)
        return self._views_of(B + pad, max_seqlen, max_span, prepared)

    def _host_buffers(self, width: int):
        """CPU device only: numpy views of width ``width``'s ``(table, seq meta)`` buffers; else None."""
        if self._host_table is None:
            return None
        host = self._host_cohorts.get(width)
        if host is None:
            host = self._host_cohorts[width] = tuple(t.numpy() for t in self._cohort_buffers(width))
        return host

    def _fill_padding(self, table, meta, host, B: int) -> None:
        """Padding rows ``B:`` of a width's buffers: null blocks at length ``prefill_frames``, start 0."""
        null, prefill = self.pool.null_block, self.config.prefill_frames
        if host is not None:
            host[0][B:] = null
            host[1][0, B:] = prefill
            host[1][1, B:] = 0
        else:
            table[B:].fill_(null)
            meta[0, B:].fill_(prefill)
            meta[1, B:].zero_()

    def _padding(self, pad_to, streams: int) -> int:
        """Padding rows of a ``get_paged_caches`` call (checked as the reference does)."""
        pad = 0 if pad_to is None else pad_to - streams
        if pad < 0:
            raise ValueError(f"get_paged_caches: pad_to={pad_to} is smaller than the {streams} streams")
        if pad and not self.pad_lanes:
            raise ValueError(f"get_paged_caches: pad_to={pad_to} needs a padding lane (pad_lanes=0)")
        return pad

    def _views_of(self, width: int, max_seqlen: int, max_span: int, prepared: tuple) -> list[PagedKVCache]:
        """The per-layer records over width ``width``'s buffers, rebuilt only when a host number changed."""
        cached = self._views.get(width)
        if cached is None or cached[:3] != (max_seqlen, max_span, prepared):
            table, meta = self._cohort_buffers(width)
            bs, dtype = self.config.block_size_frames, self.config.dtype
            views = [
                PagedKVCache(k, v, table, meta[0], meta[1], bs, max_seqlen, max_span, layer, *scales, prepared, dtype,
                             self.config.kv_cache_dtype)
                for layer, ((k, v), scales) in enumerate(zip(self._layer_kv, self._layer_scales, strict=True))
            ]
            cached = self._views[width] = (max_seqlen, max_span, prepared, views)
        return list(cached[3])  # the records are frozen; the same ones serve while nothing in them changes

    def _paged_one(self, stream_id, pad_to) -> list[PagedKVCache]:
        """``get_paged_caches`` of one stream on a CPU device: the same checks in the same order, the
        row and lengths copied through numpy views of the width's buffers (no torch op), the same records."""
        slot = self.slots.slot_of(stream_id)
        if not self._prepared[slot]:
            self.get_paged_state_views(stream_id)  # raises the reference's error
        pad = self._padding(pad_to, 1)
        host = self._host_buffers(1 + pad)
        host[0][0] = self._host_table[slot]
        host[1][:, 0] = self._host_meta[:, slot]
        seqlen = int(self._seqlen[slot])
        max_seqlen, max_span = seqlen, seqlen - int(self._seqstart[slot])
        chunk = self.config.chunk_size
        prepared = (min(int(self._num_blocks[slot]) * self.config.block_size_frames - seqlen, chunk),)
        if pad:
            self._fill_padding(None, None, host, 1)
            prefill = self.config.prefill_frames
            max_seqlen, max_span = max(max_seqlen, prefill), max(max_span, prefill)
            prepared += (chunk,) * pad
        return self._views_of(1 + pad, max_seqlen, max_span, prepared)

    def cached_frames(self, stream_ids):
        """History a stream's next chunk attends to (``seqlen - seqstart``); a list for a list."""
        if isinstance(stream_ids, (list, tuple)):
            if any(isinstance(s, (list, tuple)) for s in stream_ids):
                return [self.cached_frames(s) for s in stream_ids]
            slots = self.slots.slot_array(list(stream_ids))
            return (self._seqlen[slots] - self._seqstart[slots]).tolist()
        slot = self.slots.slot_of(stream_ids)
        return int(self._seqlen[slot] - self._seqstart[slot])

    # ---- dense mode --------------------------------------------------------------
    def commit(self, stream_id, kv_chunk: torch.Tensor) -> None:
        """Write a packed ``(num_layers, n_kv_head, T, 2 * head_dim)`` chunk, then evict."""
        cfg = self.config
        slot = self.slots.slot_of(stream_id)
        T = check_dense_chunk(cfg, kv_chunk)
        check_kv_numbers("commit", cfg.kv_format, (("kv_chunk", kv_chunk),))  # before a block is taken
        bs = cfg.block_size_frames
        held, seqlen = int(self._num_blocks[slot]), int(self._seqlen[slot])
        need = max(0, -(-(seqlen + T) // bs) - held)
        if held + need > cfg.blocks_per_stream:
            raise StreamCapacityError(stream_id, held + need, cfg.blocks_per_stream)
        new_ids = self.pool.allocate_array(need, self._owner)
        self._table[slot, held : held + need] = new_ids
        self._num_blocks[slot] = held + need
        positions = seqlen + np.arange(T)
        flat = slot * cfg.max_blocks_per_seq + np.arange(held, held + need)
        flat_d, ids_d, block_d, offset_d = self._dense_stager.stage(
            flat, new_ids, self._table[slot, positions // bs], positions % bs
        )
        if need:
            self._flat_table.index_copy_(0, flat_d, ids_d)
        device = self.pool.k_pool.device
        k = kv_chunk[..., : cfg.head_dim].transpose(1, 2).to(device=device)  # (L, T, H, D)
        v = kv_chunk[..., cfg.head_dim :].transpose(1, 2).to(device=device)
        pool = self.pool
        if cfg.kv_quantized:  # from the chunk's own values, as the reference's quantize(x) does
            fmt = cfg.kv_cache_dtype
            k_data, k_scale = quantize(fmt, k, cfg.dtype, nan_checked=True)  # refused above
            v_data, v_scale = quantize(fmt, v, cfg.dtype, nan_checked=True)
            pool.k_pool[:, block_d, offset_d], pool.k_scale[:, block_d, offset_d] = k_data, k_scale
            pool.v_pool[:, block_d, offset_d], pool.v_scale[:, block_d, offset_d] = v_data, v_scale
        else:
            pool.k_pool[:, block_d, offset_d] = k.to(cfg.dtype)
            pool.v_pool[:, block_d, offset_d] = v.to(cfg.dtype)
        slots = np.array([slot])
        self._total[slot] += T
        self._advance(slots, np.array([seqlen + T]))

    def get_stacked_cache(self, stream_id) -> torch.Tensor:
        """Visible history as packed ``(num_layers, n_kv_head, seqlen - seqstart, 2 * head_dim)``."""
        slot = self.slots.slot_of(stream_id)
        start, end = int(self._seqstart[slot]), int(self._seqlen[slot])
        return self.pool.gather_kv_blocks(self._table[slot, : self._num_blocks[slot]], start, end - start)
