"""The fast decoder cache's admission: rows admitted (fresh or restored from a session) and released.

Part of ``oasr.fast.decoder_cache.manager.DecoderKVCacheManager`` (its contract
and state are drawn there); the reference's "admission" and "sessions" sections.
The admission rule is ``oasr.decoder.common.judge`` (``judge_restore`` for saved
rows): every request's ceiling reserved, or nothing changes.
"""

from __future__ import annotations

import numpy as np

from oasr.decoder.common import Admission, AdmissionError, check_requests, judge, judge_restore
from oasr.decoder.config import DecoderRequest
from oasr.fast.decoder_cache import sizes


class AdmissionMixin:
    """``DecoderKVCacheManager``'s rows coming and going: admit, finish, restore.

    A part of the manager (``oasr.fast.decoder_cache.manager`` draws the state it reads); no state of its own."""

    # ---- admission --------------------------------------------------------------
    def can_admit(self, requests) -> Admission:
        """Whether ``requests`` fit now, with the reason when not (never changes anything)."""
        reqs = check_requests(requests)
        return judge(self.config, reqs, self.num_free_rows, self.pool.num_free_blocks, self.reserved_blocks)

    def admit(self, requests) -> list[int]:
        """Admit ``requests`` (each row's ceiling reserved) and return their rows (``AdmissionError`` if they do not
        fit).
        """
        reqs = check_requests(requests)
        answer = self.can_admit(reqs)
        if not answer:
            raise AdmissionError(answer.reason)
        cfg = self.config
        if len(reqs) == 1:  # one request (dispatch by size): the same steps in scalars
            return [self._admit_one(reqs[0])]
        rows = np.flatnonzero(~self._admitted)[: len(reqs)]
        pages = np.array([cfg.pages_for(r.cross_len) for r in reqs], dtype=np.int64)
        total = int(pages.sum())
        if total:  # (a decoder without cross-attention takes none)
            cross = self._take(total)  # one allocation for the batch, request order
            owner = np.repeat(rows, pages)
            cols = np.arange(cross.size) - np.repeat(np.cumsum(pages) - pages, pages)
            self._bind(self._cross_table, owner, cols, cross)
        self._cross_held[rows] = pages
        self._ceiling[rows] = [r.self_tokens for r in reqs]
        self._cross_ceiling[rows] = [r.cross_len for r in reqs]
        self._held[rows] = 0
        self._length[rows] = 0
        self._cross_length[rows] = 0
        self._admitted[rows] = True
        for row, req in zip(rows.tolist(), reqs, strict=True):
            self._requests[row] = req
        self._sync(rows)
        return rows.tolist()

    def _admit_one(self, req) -> int:
        """``admit`` of one checked request that fits: the lowest free row, its cross pages in one allocation."""
        row = int(np.argmin(self._admitted))  # the first False: the lowest free row
        pages = self.config.pages_for(req.cross_len)
        if pages:
            self._bind(self._cross_table, np.full(pages, row), np.arange(pages), self._take(pages))
        self._cross_held[row] = pages
        self._ceiling[row] = req.self_tokens
        self._cross_ceiling[row] = req.cross_len
        self._held[row] = self._length[row] = self._cross_length[row] = 0
        self._admitted[row] = True
        self._requests[row] = req
        self._sync(row)
        return row

    def finish(self, row: int) -> None:
        """Release the row: its pages go back to the pool (``KeyError`` unless admitted)."""
        r = self._row(row, "finish")
        self._release(r)
        self._sync(r)

    def _release(self, r) -> None:
        """The host half of ``finish`` for one row or an int64 array of distinct rows: every reference
        they hold dropped in one ``_drop``, their records cleared (no device work)."""
        self._drop(self._unbind_rows(r))

    def _held_entries(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows' self then cross table entries side by side, ``(B, SW + CW)``, and which of them the
        rows hold (each region's first ``held`` / ``cross_held`` columns)."""
        SW = self._self_table.shape[1]
        tables = np.concatenate([self._self_table[rows], self._cross_table[rows]], axis=1)
        limit = np.repeat(self._counts[:2, rows].T, [SW, tables.shape[1] - SW], axis=1)  # held, cross held
        return tables, self._both_cols < limit

    def _unbind_rows(self, r) -> np.ndarray:
        """Clear the records of one row or an int64 array of distinct rows; returns the references they
        held, in the order the reference frees them (row by row, self pages then cross pages)."""
        rows = np.atleast_1d(np.asarray(r, dtype=np.int64))
        refs = self._held_refs(rows)
        self._self_table[rows] = self._cross_table[rows] = self.pool.null_block
        self._counts[:, rows] = 0
        self._admitted[rows] = False
        for row in rows.tolist():
            self._requests[row] = None
        return refs

    def _held_refs(self, rows: np.ndarray) -> np.ndarray:
        """The references ``rows`` hold, row by row, self pages then cross pages (int64). A few rows:
        a slice of each table row; more: one mask over the rows' tables (``_held_entries``)."""
        if rows.size <= sizes.FEW_ROWS:
            return np.array(self._held_refs_few(rows.tolist()), dtype=np.int64)
        tables, held = self._held_entries(rows)
        return tables[held].astype(np.int64)

    def _held_refs_few(self, rows: list[int]) -> list[int]:
        """``_held_refs`` of a few rows as a list: element reads and row slices (numpy's fancy indexing
        costs more than the work on a few rows)."""
        refs = []
        for r in rows:
            refs += self._self_table[r, : self._held.item(r)].tolist()
            refs += self._cross_table[r, : self._cross_held.item(r)].tolist()
        return refs

    # ---- sessions (see the reference) ---------------------------------------------------------
    def request(self, row: int) -> DecoderRequest:
        """The ``DecoderRequest`` an admitted row declared (``KeyError`` otherwise)."""
        return self._requests[self._row(row, "request")]

    def can_restore(self, requests, self_pages, cross_pages, lengths, num_pages: int, published=()) -> Admission:
        """See the reference: would ``restore_rows`` succeed? Never mutates."""
        return judge_restore(self.config, check_requests(requests), self_pages, cross_pages, lengths, num_pages,
                             list(published), self.num_free_rows, self.pool.num_free_blocks, self.reserved_blocks)

    def restore_rows(self, requests, self_pages, cross_pages, lengths, cross_lengths, num_pages: int,
                     published=()) -> tuple[list[int], list[int]]:
        """See the reference: rows carrying saved pages, shared names bound as shared references."""
        reqs = check_requests(requests)
        published = list(published)
        answer = self.can_restore(reqs, self_pages, cross_pages, lengths, num_pages, [p for p, _ in published])
        if not answer:
            raise AdmissionError(answer.reason)
        blocks = self._take(num_pages)
        rows = np.flatnonzero(~self._admitted)[: len(reqs)]
        named = np.zeros(num_pages, dtype=bool)
        for row, req, s, c in zip(rows.tolist(), reqs, self_pages, cross_pages, strict=True):
            for table, names in ((self._self_table, s), (self._cross_table, c)):
                for col, p in enumerate(names):
                    self._bind(table, np.array([row]), np.array([col]), blocks[[p]], share=bool(named[p]))
                    named[p] = True
            self._requests[row] = req
        self._held[rows] = [len(s) for s in self_pages]
        self._cross_held[rows] = [len(c) for c in cross_pages]
        self._length[rows] = list(lengths)
        self._cross_length[rows] = list(cross_lengths)
        self._ceiling[rows] = [r.self_tokens for r in reqs]
        self._cross_ceiling[rows] = [r.cross_len for r in reqs]
        self._admitted[rows] = True
        self.cross_writes += 1  # (the caller writes the pages next)
        for p, (scope, tokens) in published:
            key = self._prefix.adopt(self.pool, int(blocks[p]), tokens, scope)
            if key is not None:
                self.pool.publish([int(blocks[p])], [key], self._owner)
        self._sync(rows)
        return rows.tolist(), blocks.tolist()
