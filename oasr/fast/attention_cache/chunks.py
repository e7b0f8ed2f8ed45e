"""The fast attention cache's paged-mode tick: prepare a chunk's blocks, commit its frames, evict.

Part of ``oasr.fast.attention_cache.manager.AttentionCacheManager`` (its contract
and state, and "One tick, for a cohort of B streams", are drawn there); the
reference's "paged mode" section but for the reads (``views``). One stream takes
the scalar paths (``_prepare_one``, ``_commit_one``, ``_advance_one``);
``_advance`` (eviction and the device mirror) serves the dense mode's commit too.
"""

from __future__ import annotations

import numpy as np
import torch

from oasr.cache.errors import StreamCapacityError
from oasr.cache.validate import as_id_list


class ChunksMixin:
    """``AttentionCacheManager``'s paged-mode tick: blocks prepared for a chunk, its frames committed,
    the window evicted.

    A part of the manager (``oasr.fast.attention_cache.manager`` draws the state it reads); no state of its own."""

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
