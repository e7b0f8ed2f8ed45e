"""The fast decoder cache's reads: per-layer paged views of the self and cross regions, dense gathers.

Part of ``oasr.fast.decoder_cache.manager.DecoderKVCacheManager`` (its contract
and state are drawn there); the reference's "views" section. On a CPU device the
views' table rows come straight from the host mirror; elsewhere from one staged
copy and a gather of the persistent device tables; with ``pad_to`` over the
width's persistent buffers (what a captured decode step reads on every replay).
"""

from __future__ import annotations

import numpy as np
import torch

from oasr.cache.paged import HostPlan, PagedKVCache
from oasr.decoder.common import check_pad_to, check_rows

_I32 = torch.int32


class ViewsMixin:
    """``DecoderKVCacheManager``'s reads: the paged views of both regions and the dense gathers.

    A part of the manager (``oasr.fast.decoder_cache.manager`` draws the state it reads); no state of its own."""

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
