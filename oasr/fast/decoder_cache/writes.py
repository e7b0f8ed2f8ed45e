"""The fast decoder cache's writes outside a decode step: the cross fill, prefill, extend, rewind, trim.

Part of ``oasr.fast.decoder_cache.manager.DecoderKVCacheManager`` (its contract
and state are drawn there); the reference's "writes" and "rewind and trim"
sections. A write into a shared or published page copies it first
(copy-on-write, ``oasr.decoder.common``); on the CPU with model-dtype pages the
writes take the host shortcut (``_write_host``).
"""

from __future__ import annotations

import numpy as np
import torch

from oasr.decoder.common import check_cross_fill, check_kv, check_rewind
from oasr.fast.backend import resolve_backend
from oasr.fast.paged_ops import append_kv

_I32 = torch.int32


class WritesMixin:
    """``DecoderKVCacheManager``'s writes outside a decode step: the cross fill, prefill, extend,
    rewind and trim.

    A part of the manager (``oasr.fast.decoder_cache.manager`` draws the state it reads); no state of its own."""

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
