"""The fast attention cache's dense mode: a packed K/V chunk written into the pages, the history read back.

Part of ``oasr.fast.attention_cache.manager.AttentionCacheManager`` (its contract
and state are drawn there); the reference's "dense mode" section. The chunk's
slots go in one staged copy, its K and V (with their scales in a quantized
format) are scattered into the pool by indexed assignment, then ``_advance``
evicts as a paged commit does.
"""

from __future__ import annotations

import numpy as np
import torch

from oasr.cache.errors import StreamCapacityError
from oasr.cache.validate import check_dense_chunk, check_kv_numbers
from oasr.fast.kv_formats import quantize


class DenseMixin:
    """``AttentionCacheManager``'s dense mode: a packed chunk written and evicted, the visible history
    read back.

    A part of the manager (``oasr.fast.attention_cache.manager`` draws the state it reads); no state of its own."""

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
