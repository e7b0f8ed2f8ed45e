"""Reference ``AttentionCacheManager``: per-stream block lists over the shared pool.

Readable oracle; its fast twin is ``oasr.fast.attention_cache``. The position
arithmetic (table positions, ``cache_seqlens``, ``cache_seqstarts``, which
blocks eviction frees) is drawn once in ``oasr.cache.config``.

Per stream the reference keeps a plain Python record: its slot, its logical
blocks (physical ids, oldest first), ``seqlen`` (table position one past the
last committed frame), ``seqstart`` (first visible table position) and, after
the first ``prepare_chunk``, its own ``(1, max_blocks_per_seq)`` block table
and ``(1,)`` length tensors. A batched paged view concatenates the rows.

Two modes share that record:

* paged: ``prepare_chunk`` (blocks for the next chunk) -> the model writes
  through ``get_paged_caches`` with ``append_kv`` -> ``commit_chunk_paged``
  (advance, evict);
* dense: ``commit(kv_chunk)`` writes a packed ``(L, H, T, 2D)`` chunk itself;
  ``get_stacked_cache`` gathers the visible history back.

Invariants:
  * a stream's table columns ``[0, len(blocks))`` hold its blocks in logical
    order; every other column holds ``pool.null_block``;
  * ``0 <= seqstart <= seqlen <= len(blocks) * block_size_frames``;
  * with eviction on, no held block lies entirely before ``seqstart``;
  * no block is held by two streams; held + free == ``max_num_blocks``.
Every public method validates everything before it changes anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from oasr.cache.config import CacheConfig
from oasr.cache.errors import PoolExhaustedError, StreamCapacityError, duplicate_stream, unknown_stream
from oasr.cache.paged import PagedKVCache, StreamKVInfo
from oasr.cache.validate import (
    as_id_list,
    check_count,
    check_dense_chunk,
    check_kv_numbers,
    check_restore_lengths,
    check_restore_room,
)
from oasr.reference.block_pool import BlockPool
from oasr.reference.slot_pool import StreamSlotPool


@dataclass
class _StreamKVState:
    slot: int
    blocks: list = field(default_factory=list)
    seqlen: int = 0
    seqstart: int = 0
    total_frames: int = 0
    block_table: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None
    cache_seqstarts: torch.Tensor | None = None



class AttentionCacheManager:
    def __init__(self, pool: BlockPool, config: CacheConfig, pad_lanes: int = 0):
        check_count("AttentionCacheManager", "pad_lanes", pad_lanes)
        if pad_lanes and pool.scratch_blocks == 0:
            raise ValueError("AttentionCacheManager: pad_lanes > 0 needs a pool with scratch_blocks >= 1")
        self.pool = pool
        self.config = config
        self.pad_lanes = pad_lanes
        self.slots = StreamSlotPool(config.max_batch_size)
        self._streams: dict = {}
        self._owner = pool.new_owner(type(self).__name__)  # the pool refuses to free our blocks for others

    # ---- helpers --------------------------------------------------------------
    def _state(self, stream_id) -> _StreamKVState:
        if stream_id not in self._streams:
            raise unknown_stream(stream_id)
        return self._streams[stream_id]

    def _frames(self, num_frames) -> int:
        n = self.config.chunk_size if num_frames is None else num_frames
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.config.chunk_size:
            raise ValueError(f"num_frames must be an int in [0, chunk_size={self.config.chunk_size}], got {n!r}")
        return n

    def _blocks_needed(self, st: _StreamKVState, num_frames: int) -> int:
        """New blocks for table positions ``[seqlen, seqlen + num_frames)``."""
        bs = self.config.block_size_frames
        return max(0, math.ceil((st.seqlen + num_frames) / bs) - len(st.blocks))

    def _check_capacity(self, stream_id, st: _StreamKVState, new_blocks: int) -> None:
        if len(st.blocks) + new_blocks > self.config.blocks_per_stream:
            raise StreamCapacityError(stream_id, len(st.blocks) + new_blocks, self.config.blocks_per_stream)

    def _write_table(self, st: _StreamKVState) -> None:
        if st.block_table is None:
            return
        row = [self.pool.null_block] * self.config.max_blocks_per_seq
        row[: len(st.blocks)] = st.blocks
        st.block_table.copy_(torch.tensor([row], dtype=torch.int32))
        st.cache_seqlens.fill_(st.seqlen)
        st.cache_seqstarts.fill_(st.seqstart)

    def _evict(self, st: _StreamKVState) -> None:
        """Free every block lying entirely before the next chunk's first visible position."""
        cfg = self.config
        if cfg.eviction:
            visible = max(0, st.seqlen - cfg.history_frames)
            drop = visible // cfg.block_size_frames
            if drop:
                evicted, st.blocks = st.blocks[:drop], st.blocks[drop:]
                self.pool.free(evicted, self._owner)
                st.seqlen -= drop * cfg.block_size_frames
                visible -= drop * cfg.block_size_frames
            st.seqstart = visible
        self._write_table(st)

    def _admit_blocks(self) -> list[int]:
        """Blocks a stream holds at admission: the zeroed window with prefill, else none."""
        ids = self.pool.allocate(self.config.prefill_blocks, self._owner)
        self.pool.zero_blocks(ids)
        return ids

    # ---- lifecycle --------------------------------------------------------------
    def allocate_stream(self, stream_id) -> None:
        """Admit ``stream_id``: a slot, and the prefill window's blocks when the config prefills (``ValueError`` if
        already allocated; ``PoolExhaustedError`` / ``SlotsExhaustedError``; nothing changes on a refusal).
        """
        if stream_id in self._streams:
            raise duplicate_stream(stream_id)
        need = self.config.prefill_blocks
        if need > self.pool.num_free_blocks:
            raise PoolExhaustedError(need, self.pool.num_free_blocks)
        slot = self.slots.acquire(stream_id)  # may raise SlotsExhaustedError; nothing changed yet
        st = _StreamKVState(slot=slot, blocks=self._admit_blocks(), seqlen=self.config.prefill_frames)
        self._streams[stream_id] = st

    def restore_stream(self, stream_id, seqlen: int, seqstart: int, total_frames: int) -> list[int]:
        """Admit ``stream_id`` holding the lengths of a stream that committed ``total_frames`` frames.

        Takes a slot and ``ceil(seqlen / block_size_frames)`` zeroed blocks for table positions
        ``[0, seqlen)`` and returns their ids, oldest first: the caller writes the visible frames
        ``[seqstart, seqlen)`` into them (``oasr.sessions.format``). The stream then behaves as the one the
        lengths came from. Everything is checked first (``check_restore_lengths``, the block
        ceiling, the pool, a free slot); on an error nothing changed.
        """
        if stream_id in self._streams:
            raise duplicate_stream(stream_id)
        need = check_restore_lengths(self.config, seqlen, seqstart, total_frames)
        check_restore_room(self.config, stream_id, need, self.pool.num_free_blocks, [self.slots])
        slot = self.slots.acquire(stream_id)
        blocks = self.pool.allocate(need, self._owner)
        self.pool.zero_blocks(blocks)
        self._streams[stream_id] = _StreamKVState(slot, blocks, seqlen, seqstart, total_frames)
        return list(blocks)

    def free_stream(self, stream_id) -> None:
        """Release ``stream_id``'s blocks and slot (``KeyError`` for an unknown id)."""
        st = self._state(stream_id)
        self.pool.free(st.blocks, self._owner)
        self.slots.release(stream_id)
        del self._streams[stream_id]

    def reset_stream(self, stream_id) -> None:
        """Back to the admission state (blocks freed, the prefilled window re-zeroed); the slot is kept."""
        st = self._state(stream_id)
        need = self.config.prefill_blocks
        if need > self.pool.num_free_blocks + len(st.blocks):
            raise PoolExhaustedError(need, self.pool.num_free_blocks + len(st.blocks))
        self.pool.free(st.blocks, self._owner)
        self._streams[stream_id] = _StreamKVState(
            slot=st.slot, blocks=self._admit_blocks(), seqlen=self.config.prefill_frames
        )

    def has_stream(self, stream_id) -> bool:
        """Whether ``stream_id`` is allocated."""
        return stream_id in self._streams

    @property
    def stream_ids(self) -> list:
        """The allocated stream ids, in allocation order."""
        return list(self._streams)

    def slot_of(self, stream_id) -> int:
        """The slot (block-table row) of ``stream_id`` (``KeyError`` for an unknown id)."""
        return self._state(stream_id).slot

    def describe(self, stream_id) -> StreamKVInfo:
        """``StreamKVInfo``: the stream's slot, block ids, seqlen, seqstart and total frames."""
        st = self._state(stream_id)
        return StreamKVInfo(st.slot, tuple(st.blocks), st.seqlen, st.seqstart, st.total_frames)

    # ---- paged mode ---------------------------------------------------------------
    def at_capacity(self, stream_id, num_frames: int | None = None) -> bool:
        """True when preparing the next ``num_frames`` would pass the stream's block ceiling."""
        st = self._state(stream_id)
        return len(st.blocks) + self._blocks_needed(st, self._frames(num_frames)) > self.config.blocks_per_stream

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
        frames = num_frames if isinstance(num_frames, (list, tuple)) else [num_frames] * len(ids)
        if len(frames) != len(ids):
            raise ValueError(f"prepare_chunks_batched: {len(frames)} frame counts for {len(ids)} streams")
        states = [self._state(s) for s in ids]
        needs = []
        for sid, st, n in zip(ids, states, frames, strict=True):
            need = self._blocks_needed(st, self._frames(n))
            self._check_capacity(sid, st, need)
            needs.append(need)
        new_ids = self.pool.allocate(sum(needs), self._owner)  # raises PoolExhaustedError before any change
        cursor = 0
        for st, need in zip(states, needs, strict=True):
            st.blocks.extend(new_ids[cursor : cursor + need])
            cursor += need
            if st.block_table is None:
                device = self.config.device
                st.block_table = torch.empty((1, self.config.max_blocks_per_seq), dtype=torch.int32, device=device)
                st.cache_seqlens = torch.empty((1,), dtype=torch.int32, device=device)
                st.cache_seqstarts = torch.empty((1,), dtype=torch.int32, device=device)
            self._write_table(st)

    def commit_chunk_paged(self, stream_id, num_frames: int) -> None:
        """``commit_chunks_batched`` for one stream: its length grows by ``num_frames``; evicts out-of-window blocks."""
        self.commit_chunks_batched([stream_id], [num_frames])

    def commit_chunks_batched(self, stream_ids, num_frames) -> None:
        """Advance each stream by its committed frames (already written with ``append_kv``), then evict."""
        ids = as_id_list(stream_ids)
        frames = list(num_frames) if isinstance(num_frames, (list, tuple)) else [num_frames] * len(ids)
        if len(set(ids)) != len(ids) or len(frames) != len(ids):
            raise ValueError(f"commit_chunks_batched: need unique ids and one frame count each: {ids}, {frames}")
        states = [self._state(s) for s in ids]
        frames = [self._frames(n) for n in frames]
        bs = self.config.block_size_frames
        for sid, st, n in zip(ids, states, frames, strict=True):
            if st.seqlen + n > len(st.blocks) * bs:
                raise ValueError(
                    f"commit of {n} frames for stream {sid!r}: only {len(st.blocks) * bs - st.seqlen} "
                    f"frames prepared (call prepare_chunk first)"
                )
        for st, n in zip(states, frames, strict=True):
            st.seqlen += n
            st.total_frames += n
            self._evict(st)

    def get_paged_state_views(self, stream_id):
        """``(block_table (1, W), cache_seqlens (1,), cache_seqstarts (1,))`` of one stream."""
        st = self._state(stream_id)
        if st.block_table is None:
            raise RuntimeError(f"stream {stream_id!r}: paged state read before the first prepare_chunk")
        return st.block_table, st.cache_seqlens, st.cache_seqstarts

    def _pad_rows(self, count: int):
        W = self.config.max_blocks_per_seq
        start = self.config.prefill_frames
        device = self.config.device
        table = torch.full((count, W), self.pool.null_block, dtype=torch.int32, device=device)
        seqlens = torch.full((count,), start, dtype=torch.int32, device=device)
        seqstarts = torch.zeros((count,), dtype=torch.int32, device=device)
        return table, seqlens, seqstarts

    def get_paged_caches(self, stream_ids, pad_to: int | None = None) -> list[PagedKVCache]:
        """One ``PagedKVCache`` per layer over the cohort ``stream_ids`` (padded to ``pad_to`` rows).

        Each view carries ``model_dtype`` (``config.dtype``) and ``prepared_frames``: per stream row,
        the frames its held blocks cover past its length, at most ``chunk_size`` (what a commit would
        accept); ``chunk_size`` for a padding row. ``append_kv`` and ``paged_attention`` refuse more.
        """
        ids = as_id_list(stream_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"get_paged_caches: duplicate stream ids in {ids}")
        views = [self.get_paged_state_views(s) for s in ids]
        pad = 0 if pad_to is None else pad_to - len(ids)
        if pad < 0:
            raise ValueError(f"get_paged_caches: pad_to={pad_to} is smaller than the {len(ids)} streams")
        if pad and not self.pad_lanes:
            raise ValueError(f"get_paged_caches: pad_to={pad_to} needs a padding lane (pad_lanes=0)")
        if not ids and not pad:
            raise ValueError("get_paged_caches: an empty cohort (no stream ids, no padding) has no view")
        tables = [v[0] for v in views]
        seqlens = [v[1] for v in views]
        seqstarts = [v[2] for v in views]
        if pad:
            t, l, s = self._pad_rows(pad)
            tables.append(t)
            seqlens.append(l)
            seqstarts.append(s)
        block_table = torch.cat(tables)
        cache_seqlens = torch.cat(seqlens)
        cache_seqstarts = torch.cat(seqstarts)
        host_lens = [self._streams[s].seqlen for s in ids] + [self.config.prefill_frames] * pad
        host_spans = [self._streams[s].seqlen - self._streams[s].seqstart for s in ids]
        host_spans += [self.config.prefill_frames] * pad
        cfg = self.config
        prepared = [min(len(self._streams[s].blocks) * cfg.block_size_frames - self._streams[s].seqlen, cfg.chunk_size)
                    for s in ids] + [cfg.chunk_size] * pad  # fmt: skip
        caches = []
        for layer in range(self.config.num_layers):
            k, v = self.pool.get_kv_view(layer)
            k_scale, v_scale = self.pool.get_kv_scale_view(layer)
            caches.append(
                PagedKVCache(
                    k_cache=k,
                    v_cache=v,
                    block_table=block_table,
                    cache_seqlens=cache_seqlens,
                    cache_seqstarts=cache_seqstarts,
                    block_size=self.config.block_size_frames,
                    max_seqlen=max(host_lens, default=0),
                    max_span=max(host_spans, default=0),
                    layer=layer,
                    k_scale=k_scale,
                    v_scale=v_scale,
                    prepared_frames=tuple(prepared),
                    model_dtype=cfg.dtype,
                    kv_format=cfg.kv_cache_dtype,
                )
            )
        return caches

    def cached_frames(self, stream_ids):
        """History a stream's next chunk attends to (``seqlen - seqstart``); a list for a list."""
        if isinstance(stream_ids, (list, tuple)):
            return [self.cached_frames(s) for s in stream_ids]
        st = self._state(stream_ids)
        return st.seqlen - st.seqstart

    # ---- dense mode --------------------------------------------------------------
    def commit(self, stream_id, kv_chunk: torch.Tensor) -> None:
        """Write a packed ``(num_layers, n_kv_head, T, 2 * head_dim)`` chunk, then evict."""
        cfg = self.config
        st = self._state(stream_id)
        T = check_dense_chunk(cfg, kv_chunk)
        check_kv_numbers("commit", cfg.kv_format, (("kv_chunk", kv_chunk),))  # before a block is taken
        need = self._blocks_needed(st, T)
        self._check_capacity(stream_id, st, need)
        st.blocks.extend(self.pool.allocate(need, self._owner))
        bs = cfg.block_size_frames
        k, v = kv_chunk[..., : cfg.head_dim], kv_chunk[..., cfg.head_dim :]
        pool = self.pool
        for t in range(T):
            pos = st.seqlen + t
            block, offset = st.blocks[pos // bs], pos % bs
            if cfg.kv_quantized:
                fmt = cfg.kv_format
                pool.k_pool[:, block, offset], pool.k_scale[:, block, offset] = fmt.quantize(k[:, :, t], cfg.dtype)
                pool.v_pool[:, block, offset], pool.v_scale[:, block, offset] = fmt.quantize(v[:, :, t], cfg.dtype)
            else:
                pool.k_pool[:, block, offset] = k[:, :, t].to(cfg.dtype)
                pool.v_pool[:, block, offset] = v[:, :, t].to(cfg.dtype)
        st.seqlen += T
        st.total_frames += T
        self._evict(st)

    def get_stacked_cache(self, stream_id) -> torch.Tensor:
        """Visible history as packed ``(num_layers, n_kv_head, seqlen - seqstart, 2 * head_dim)``."""
        st = self._state(stream_id)
        return self.pool.gather_kv_blocks(st.blocks, st.seqstart, st.seqlen - st.seqstart)
