"""The fast decoder cache's prefix caching: bind a prompt's published pages, publish a history.

Part of ``oasr.fast.decoder_cache.manager.DecoderKVCacheManager`` (its contract
and state are drawn there); the reference's "prefix caching" section, over
``oasr.decoder.prefix_cache.PrefixIndex``. Rows leave here too: ``evict`` (publishing
nothing new), ``abandon`` (host bookkeeping only) and ``reset`` (every row, and the index).
"""

from __future__ import annotations

import numpy as np

from oasr.decoder.prefix_cache import check_tokens


class PrefixMixin:
    """``DecoderKVCacheManager``'s prefix caching: a prompt's published pages bound, a history
    published, rows evicted or abandoned, the index reset.

    A part of the manager (``oasr.fast.decoder_cache.manager`` draws the state it reads); no state of its own."""

    # ---- prefix caching (see the reference) ---------------------------------------------------
    def admit_prompt(self, row: int, tokens, scope=0) -> int:
        """See the reference: bind the longest published prefix; returns the cached token count."""
        r = self._row(row, "admit_prompt")
        ids = check_tokens(tokens, "admit_prompt")
        if self._length[r] or self._held[r]:
            raise ValueError(f"admit_prompt: row {r} already holds {int(self._length[r])} tokens; admit its "
                             f"prompt first")
        if len(ids) > self._ceiling[r]:
            raise ValueError(f"admit_prompt: row {r} declared {int(self._ceiling[r])} tokens, got a prompt "
                             f"of {len(ids)}")
        hits = np.array(self._prefix.lookup(self.pool, ids, scope), dtype=np.int64)
        if hits.size:
            self._bind(self._self_table, np.full(hits.size, r), np.arange(hits.size), hits, share=True)
        self._held[r] = hits.size
        self._length[r] = hits.size * self.config.page_size
        self._sync(r)
        return int(self._length[r])

    def retire(self, row: int, tokens, scope=0) -> None:
        """See the reference: publish the row's full pages under its history, then finish it."""
        r = self._row(row, "retire")
        ids = check_tokens(tokens, "retire")
        if len(ids) != self._length[r]:
            raise ValueError(f"retire: row {r} holds {int(self._length[r])} tokens, got a history of {len(ids)}")
        blocks = self._self_table[r, : self._held[r]]
        self.pool.publish(*self._prefix.publish(self.pool, ids, blocks, scope), self._owner)
        self.finish(r)

    def evict(self, row: int) -> None:
        """See the reference: finish publishing nothing new; published pages park."""
        self.finish(row)

    def abandon(self, row: int) -> None:
        """See the reference: host bookkeeping only (no staged copy, no launch, no wait); the row's
        device table entries are stale until its next admission rewrites them, and nothing reads them."""
        self._release(self._row(row, "abandon"))
        self._version += 1

    def reset(self) -> None:
        """See the reference: finish every row, drop the parked pages and the prefix index."""
        for row in self.rows:
            self.finish(row)
        self.pool.drop_parked()
        self._prefix.clear()
