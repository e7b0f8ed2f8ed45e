"""The fast decoder cache's beams: ``select`` keeps and reorders rows, finishes the rest, forks repeats.

Part of ``oasr.fast.decoder_cache.manager.DecoderKVCacheManager`` (its contract
and state are drawn there); the reference's "beams" section. A fork maps its
parent's pages (reference counts up, no copy); the first write into a shared page
copies it (``oasr.decoder.common.cow_writes``, in the decode step). The references
a select drops and takes again cancel out (``_cancel``) before the pool sees them.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from oasr.decoder.common import check_rows, select_sources
from oasr.fast.decoder_cache import sizes


class BeamsMixin:
    """``DecoderKVCacheManager``'s ``select``: keep and reorder rows, finish the rest, fork repeats.

    A part of the manager (``oasr.fast.decoder_cache.manager`` draws the state it reads); no state of its own."""

    # ---- beams ----------------------------------------------------------------------
    def select(self, rows, idx) -> list[int]:
        """See the reference: keep and reorder rows, finish the rest, fork repeats onto shared pages."""
        ids = check_rows(rows, self._is_admitted, "select")
        sources, dropped = self._plan_select(ids, idx)
        if len(ids) <= sizes.FEW_ROWS:
            return self._select_few(sources, dropped)
        released = np.zeros(0, dtype=np.int64)
        if dropped:  # finished together; their references are dropped with the forks' (_fork)
            gone = np.array(dropped, dtype=np.int64)
            released = self._unbind_rows(gone)
            self._sync(gone)
        out, forks, parents = self._place(sources)
        self._fork(np.array(parents, dtype=np.int64), np.array(forks, dtype=np.int64), released)
        return out

    def _place(self, sources: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Where each source of a select lands, after its dropped rows are gone: a source's first place
        keeps its row, a repeat forks into the lowest free row. ``(rows, forks, their parents)``."""
        out, seen, forks, parents, free_rows = [], set(), [], [], None
        for src in sources:
            if src in seen:
                if free_rows is None:
                    free_rows = np.flatnonzero(~self._admitted).tolist()
                out.append(free_rows[len(forks)])
                forks.append(out[-1])
                parents.append(src)
            else:
                out.append(src)
            seen.add(src)
        return out, forks, parents

    def _select_few(self, sources: list[int], dropped: list[int]) -> list[int]:
        """``select``'s changes for a few rows (a beam) in Python lists, with one pool call
        (``_free_and_share``): the same rows, references, records, and pages freed in the same order,
        as the numpy path (``_unbind_rows``, ``_fork``)."""
        table, cross, counts, null = self._self_table, self._cross_table, self._counts, self.pool.null_block
        released = self._held_refs_few(dropped)
        for r in dropped:
            self._admitted[r] = False
        out, forks, parents = self._place(sources)
        taken = self._held_refs_few(parents)
        if released and taken:  # the pairs that would go down and up again are left out
            released, taken = _cancel_few(released, taken)
        if released or taken:
            self.pool._free_and_share(released, taken, self._owner)
        for f, p in zip(forks, parents, strict=True):  # whole rows: past what a parent holds its entries are null
            table[f] = table[p]
            cross[f] = cross[p]
            counts[:, f] = counts[:, p]
            self._admitted[f] = True
            self._requests[f] = self._requests[p]
        reused = set(forks)  # (a fork mostly lands in a row the select dropped: written once, not cleared first)
        for r in dropped:
            if r not in reused:
                table[r] = cross[r] = null
                counts[:, r] = 0
                self._requests[r] = None
        if dropped or forks:
            self._sync(dropped + forks)
        return out

    def _plan_select(self, ids: list[int], idx) -> tuple[list[int], list[int]]:
        """``plan_select`` (the same checks, order and messages) with the reservation in numpy:
        ``(sources, dropped)``, nothing changed."""
        sources = select_sources(ids, idx)
        kept = set(sources)
        dropped = [r for r in ids if r not in kept]
        forks = len(sources) - len(kept)
        admitted = int(np.count_nonzero(self._admitted))
        free_rows = self.config.max_rows - admitted
        if forks > free_rows + len(dropped):
            raise ValueError(f"select: {forks} forked rows need {forks} free rows, only "
                             f"{free_rows + len(dropped)} are free after the dropped rows finish")
        others = []
        if admitted > len(ids):  # rows outside the group keep their reservations
            outside = self._admitted.copy()
            outside[ids] = False
            others = np.flatnonzero(outside).tolist()
        after = sources + others
        # an upper bound first: every written block costs at most one copy per writer, so when the growth
        # to every ceiling plus every written block fits the free blocks, the exact count below does too
        # (beams in a pool sized for them: most selects stop here)
        page = self.config.page_size
        if len(after) <= sizes.FEW_ROWS:  # (a beam) the same sum in Python scalars
            held, length, ceiling = self._held.item, self._length.item, self._ceiling.item
            bound = sum(-(-ceiling(r) // page) - held(r) + max(held(r) - length(r) // page, 0) for r in after)
        else:
            after = np.array(after, dtype=np.int64)
            held = self._held[after]
            written = np.maximum(held - self._length[after] // page, 0)
            bound = int((-(-self._ceiling[after] // page) - held).sum() + written.sum())
        if bound <= self.pool.num_free_blocks:
            return sources, dropped
        after = np.asarray(after, dtype=np.int64)
        blocks = self._blocks_of(after)
        need = self._reserved(after, self.pinned_blocks, blocks)
        freed = 0
        if dropped:  # pages only dropped rows hold go back (or park: parked pages count as free)
            before = np.concatenate(self._blocks_of(np.array(dropped, dtype=np.int64))[:2])
            freed = len(set(before.tolist()).difference(blocks[0].tolist(), blocks[1].tolist()))
        have = self.pool.num_free_blocks + freed
        if need > have:
            raise ValueError(f"select: the selected rows reserve {need} blocks (ceilings and copy-on-write copies "
                             f"owed), only {have} are free after the dropped rows' pages return")
        return sources, dropped

    def _fork(self, parents: np.ndarray, forks: np.ndarray, released: np.ndarray) -> None:
        """Fresh rows ``forks`` mapping their ``parents``' pages (a shared bind per region: counts up),
        after the references ``released`` (the rows the same select dropped) go down. A page in both
        (a prompt or cross page the dropped and the kept beams all hold) would go down and up again
        without reaching 0, so those pairs are left out: the same counts, and the same pages freed in
        the same order, for far fewer pool updates."""
        if not forks.size:  # (a select that only keeps and drops rows)
            if released.size:
                self._drop(released)
            return
        taken = self._held_refs(parents)
        if released.size and taken.size:
            released, taken = _cancel(released, taken)
        if released.size:
            self._drop(released)
        if taken.size:
            self.pool.share(taken, self._owner)  # one more holder each, at once
        # whole table rows: a fork row is all null, and a parent's entries past what it holds are null
        self._bind(self._self_table, forks, slice(None), self._self_table[parents])
        self._bind(self._cross_table, forks, slice(None), self._cross_table[parents])
        self._counts[:, forks] = self._counts[:, parents]
        self._admitted[forks] = True
        for f, p in zip(forks.tolist(), parents.tolist(), strict=True):
            self._requests[f] = self._requests[p]
        self._sync(forks)


def _cancel(released: np.ndarray, taken: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``released`` less the first occurrences of each id in ``taken`` (order kept: the remaining
    occurrences are the later ones, so an id still reaches 0 at its last place), and ``taken`` less
    what was matched: the references a select still drops and still takes. A few ids (a short
    hypothesis): a counting loop; more: in numpy, each released id's occurrence rank (a stable sort)
    against the count ``taken`` holds of it (the loop's result, in a constant number of operations)."""
    if released.size + taken.size <= sizes.FEW_CANCEL:
        left, still = _cancel_few(released.tolist(), taken.tolist())
        return np.array(left, dtype=np.int64), np.array(still, dtype=np.int64)
    n = int(max(released.max(), taken.max())) + 1
    want = np.bincount(taken, minlength=n)
    order = np.argsort(released, kind="stable")
    ordered = released[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    rank = np.empty(released.size, dtype=np.int64)
    rank[order] = np.arange(released.size) - np.repeat(starts, np.diff(np.append(starts, released.size)))
    left = want - np.minimum(want, np.bincount(released, minlength=n))
    still = np.flatnonzero(left)
    return released[rank >= want[released]], np.repeat(still, left[still])


def _cancel_few(released: list[int], taken: list[int]) -> tuple[list[int], list[int]]:
    """``_cancel`` of int lists by a counting loop."""
    want, left = Counter(taken), []
    for b in released:
        if want.get(b):
            want[b] -= 1
        else:
            left.append(b)
    return left, list(want.elements())
