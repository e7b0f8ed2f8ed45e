"""The fast decoder cache's decode step: prepare, the step's handle (``HostStep``), commit, append.

Part of ``oasr.fast.decoder_cache.manager.DecoderKVCacheManager`` (its contract
and state are drawn there). ``prepare_step`` makes room for one token per row
(copy-on-write copies then new pages, one allocation), ``open_step`` returns the
handle a decode group writes and reads every layer through, ``commit_step``
counts the token, ``append`` does all three for one step's K/V.
"""

from __future__ import annotations

import numpy as np
import torch

from oasr.decoder.common import ViewStep, check_rows, check_step_kv, cow_writes
from oasr.fast.cpu_rows import attend_gathered
from oasr.fast.decoder_cache import sizes
from oasr.fast.paged_ops import append_kv, paged_attention

_QUERY_SHAPE = "(B={B}, n_head (a multiple of n_kv_head={H}), 1, head_dim={D})"  # HostStep.attend's message


class StepsMixin:
    """``DecoderKVCacheManager``'s decode step: prepare, open (the handle), commit, append.

    A part of the manager (``oasr.fast.decoder_cache.manager`` draws the state it reads); no state of its own."""

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
        if ids.size <= sizes.FEW_ROWS:
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
        if ids.size <= sizes.FEW_ROWS:  # (a beam) the same checks in Python scalars
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

    def __init__(self, manager: StepsMixin, ids: np.ndarray):
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
        if self._ids.size <= sizes.FEW_ROWS:  # (a beam) element updates beat a fancy-indexed one
            length = manager._length
            for r in self._ids.tolist():
                length[r] += 1
        else:
            manager._length[self._ids] += 1
        manager._sync(self._ids)
