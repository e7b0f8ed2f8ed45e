"""``LayeredCache``: a composition of layer specs over one block pool and one slot-state pool.

One class serves both twins: it touches the pool, the per-band attention managers
and the slot-state cache only through their public API, and
``oasr.reference.LayeredCache`` / ``oasr.fast.LayeredCache`` bind the twin's own
``BlockPool``, ``AttentionCacheManager`` and ``SlotStateCache``. The layout (which
layers share a table, how many layers a block id holds, each band's window) is
``oasr.cache.layer_specs.CacheLayout``; its diagram is drawn there.

Per stream the cache holds one table row in every band and one slot in the state
cache. Every call goes to every band in band order, so both twins hand out the
same block ids for the same op sequence, and every call checks everything for
every band before the first band changes (a refusal leaves every band, the pool
and the slots as they were):

* ``allocate_stream``: a slot in every band and in the state cache, each band's
  prefilled window (``PoolExhaustedError`` if the pool cannot hold them all);
* ``prepare_chunks_batched``: each band's blocks for the next chunk, all bands'
  needs counted against the free list first (``StreamCapacityError`` /
  ``PoolExhaustedError``);
* ``commit_chunks_batched``: each band advances by the same frames and evicts by
  its own window;
* ``get_paged_caches``: one ``PagedKVCache`` per attention layer, in layer order,
  each over its band's rows (``cache_seqstarts`` per band: its own window).
"""

from __future__ import annotations

import math

from oasr.cache.config import CacheConfig
from oasr.cache.errors import (
    PoolExhaustedError,
    SlotsExhaustedError,
    StreamCapacityError,
    duplicate_stream,
    unknown_stream,
)
from oasr.cache.layer_specs import CacheLayout
from oasr.cache.validate import as_id_list


class LayeredCacheBase:
    """See the module docstring. ``specs`` None is ``config``'s uniform composition (no fixed states)."""

    pool_cls = manager_cls = state_cls = None  # each twin binds its own

    def __init__(self, config: CacheConfig, specs=None, pad_lanes: int = 0, scratch_blocks: int = 1):
        self.layout = CacheLayout(config, specs)
        self.config = config
        self.pad_lanes = pad_lanes
        self.pool = self.pool_cls(self.layout.pool_config, scratch_blocks=scratch_blocks)
        self.bands = [self.manager_cls(self.pool, band.config, pad_lanes=pad_lanes) for band in self.layout.bands]
        self.state = None
        if self.layout.state_specs:
            self.state = self.state_cls(list(self.layout.state_specs), config.max_batch_size, pad_lanes,
                                        device=config.device, dtype=config.dtype)

    # ---- lifecycle ----------------------------------------------------------------------
    def has_stream(self, stream_id) -> bool:
        """Whether ``stream_id`` is allocated."""
        return self.bands[0].has_stream(stream_id)

    @property
    def stream_ids(self) -> list:
        """The allocated stream ids."""
        return self.bands[0].stream_ids

    def _check_known(self, stream_id) -> None:
        if not self.has_stream(stream_id):
            raise unknown_stream(stream_id)

    def allocate_stream(self, stream_id) -> None:
        """Allocate ``stream_id`` in every band (and its states); checked first, so a refusal changes nothing."""
        if self.has_stream(stream_id):
            raise duplicate_stream(stream_id)
        need = sum(band.config.prefill_blocks for band in self.bands)
        if need > self.pool.num_free_blocks:
            raise PoolExhaustedError(need, self.pool.num_free_blocks)
        if self.bands[0].slots.num_free == 0:
            raise SlotsExhaustedError(self.config.max_batch_size)
        for band in self.bands:
            band.allocate_stream(stream_id)
        if self.state is not None:
            self.state.allocate_stream(stream_id)

    def free_stream(self, stream_id) -> None:
        """Free ``stream_id``'s blocks in every band and its states."""
        self._check_known(stream_id)
        for band in self.bands:
            band.free_stream(stream_id)
        if self.state is not None:
            self.state.free_stream(stream_id)

    def reset_stream(self, stream_id) -> None:
        """Back to the admission state in every band and state (slots kept)."""
        self._check_known(stream_id)
        held = sum(len(band.describe(stream_id).blocks) for band in self.bands)
        need = sum(band.config.prefill_blocks for band in self.bands)
        if need > self.pool.num_free_blocks + held:
            raise PoolExhaustedError(need, self.pool.num_free_blocks + held)
        for band in self.bands:
            band.reset_stream(stream_id)
        if self.state is not None:
            self.state.reset_stream(stream_id)

    # ---- the chunk cycle ------------------------------------------------------------------
    def _frames(self, num_frames, count: int) -> list[int]:
        frames = list(num_frames) if isinstance(num_frames, (list, tuple)) else [num_frames] * count
        if len(frames) != count:
            raise ValueError(f"LayeredCache: {len(frames)} frame counts for {count} streams")
        cs = self.config.chunk_size
        out = []
        for n in frames:
            n = cs if n is None else n
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= cs:
                raise ValueError(f"num_frames must be an int in [0, chunk_size={cs}], got {n!r}")
            out.append(n)
        return out

    def blocks_needed(self, stream_id, num_frames: int | None = None) -> list[int]:
        """Per band, the new blocks ``stream_id``'s next ``num_frames`` would take (changes nothing)."""
        self._check_known(stream_id)
        (n,) = self._frames(num_frames, 1)
        bs = self.config.block_size_frames
        needs = []
        for band in self.bands:
            info = band.describe(stream_id)
            needs.append(max(0, math.ceil((info.cache_seqlen + n) / bs) - len(info.blocks)))
        return needs

    def at_capacity(self, stream_id, num_frames: int | None = None) -> bool:
        """True when any band would pass its block ceiling preparing the next ``num_frames``."""
        return any(band.at_capacity(stream_id, num_frames) for band in self.bands)

    def prepare_chunk(self, stream_id, num_frames: int | None = None) -> None:
        """``prepare_chunks_batched`` for one stream."""
        self.prepare_chunks_batched([stream_id], num_frames)

    def prepare_chunks_batched(self, stream_ids, num_frames=None) -> None:
        """Blocks for each stream's next chunk in every band; all checked before the first allocation."""
        ids = as_id_list(stream_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"prepare_chunks_batched: duplicate stream ids in {ids}")
        frames = self._frames(num_frames, len(ids))
        total = 0
        for sid, n in zip(ids, frames, strict=True):
            needs = self.blocks_needed(sid, n)
            for band, need in zip(self.bands, needs, strict=True):
                held = len(band.describe(sid).blocks)
                if held + need > band.config.blocks_per_stream:
                    raise StreamCapacityError(sid, held + need, band.config.blocks_per_stream)
            total += sum(needs)
        if total > self.pool.num_free_blocks:
            raise PoolExhaustedError(total, self.pool.num_free_blocks)
        for band in self.bands:
            band.prepare_chunks_batched(ids, frames)

    def commit_chunk_paged(self, stream_id, num_frames: int) -> None:
        """``commit_chunks_batched`` for one stream."""
        self.commit_chunks_batched([stream_id], [num_frames])

    def commit_chunks_batched(self, stream_ids, num_frames) -> None:
        """Advance every band by the committed frames; each evicts by its own window."""
        ids = as_id_list(stream_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"commit_chunks_batched: duplicate stream ids in {ids}")
        frames = self._frames(num_frames, len(ids))
        bs = self.config.block_size_frames
        for sid, n in zip(ids, frames, strict=True):
            self._check_known(sid)
            for band in self.bands:
                info = band.describe(sid)
                room = len(info.blocks) * bs - info.cache_seqlen
                if n > room:
                    raise ValueError(f"commit of {n} frames for stream {sid!r}: only {room} frames prepared "
                                     f"(call prepare_chunk first)")
        for band in self.bands:
            band.commit_chunks_batched(ids, frames)

    def get_paged_caches(self, stream_ids, pad_to: int | None = None) -> list:
        """One ``PagedKVCache`` per attention layer, layer order, over the cohort (padded to ``pad_to``)."""
        per_band = [band.get_paged_caches(stream_ids, pad_to) for band in self.bands]
        views = []
        for layer in range(self.config.num_layers):
            b, j = self.layout.band_of_layer[layer]
            views.append(per_band[b][j])
        return views

    # ---- queries ----------------------------------------------------------------------------
    def describe(self, stream_id) -> list:
        """Per band, the stream's ``StreamKVInfo``."""
        self._check_known(stream_id)
        return [band.describe(stream_id) for band in self.bands]

    def blocks_held(self, stream_id) -> list[int]:
        """Per band, how many blocks ``stream_id`` holds."""
        return [len(info.blocks) for info in self.describe(stream_id)]

    def cached_frames(self, stream_id) -> list[int]:
        """Per attention layer, the history its next chunk attends to."""
        spans = [band.cached_frames(stream_id) for band in self.bands]
        return [spans[self.layout.band_of_layer[layer][0]] for layer in range(self.config.num_layers)]
