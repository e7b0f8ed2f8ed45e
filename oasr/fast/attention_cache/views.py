"""The fast attention cache's paged-mode reads: a stream's state views, a cohort's paged views.

Part of ``oasr.fast.attention_cache.manager.AttentionCacheManager`` (its contract
and state, and "Graph-stable addresses", are drawn there). ``get_paged_caches``
gathers the cohort's rows into persistent per-width buffers (through numpy views
of them on a CPU device) and reuses the per-layer records while their host
numbers hold.
"""

from __future__ import annotations

import numpy as np
import torch

from oasr.cache.paged import PagedKVCache
from oasr.cache.validate import as_id_list

_I32 = torch.int32


class ViewsMixin:
    """``AttentionCacheManager``'s paged-mode reads: a stream's state views, a cohort's per-layer views,
    cached frames.

    A part of the manager (``oasr.fast.attention_cache.manager`` draws the state it reads); no state of its own."""

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
