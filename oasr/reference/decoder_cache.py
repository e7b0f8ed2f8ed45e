"""Reference ``DecoderKVCacheManager``: an autoregressive decoder's K/V rows on their own pool.

Readable oracle; its fast twin is ``oasr.fast.decoder_cache``. Geometry, regions
and storage modes are drawn in ``oasr.decoder.config``; the admission rule is
``oasr.decoder.common.judge``.

Per row a plain Python record: its declared request, its self-attention pages
(logical order), its cross-attention pages, ``length`` (tokens written to the
self region) and ``cross_length``. Rows are handed out lowest id first.

Lifecycle of a row::

    can_admit([req, ...])  ->  admit([req, ...]) -> rows   (ceilings reserved; cross pages mapped)
    fill_cross(row, k, v)                                  (once, from the encoder output)
    prefill(row, k, v)                                     (the prompt; the row must be empty)
    prepare_step(rows) -> self_caches(rows) -> append_kv per layer -> commit_step(rows)
        or step = open_step(rows): step.write / step.attend per layer, step.commit()
        or, in one call, append(rows, k, v)                (one token for each row)
    finish(row)                                            (every page back to the pool)

Block ownership. Every page a table maps is taken by ``_take`` and given back
by ``_drop``, and ``_bind`` / ``_unbind`` are the only writers of table entries.
Pages are reference-counted in the pool: ``_take`` sets a count of 1, a shared
bind (``_bind(..., share=True)``: a fork made by ``select``) raises it, ``_drop``
lowers it and the pool frees a block at zero; no other method touches the
pool's free list. A write into a shared page copies it first (copy-on-write,
drawn in ``oasr.decoder.common``).

Invariants (tests check them after every operation):
  * held + free == max_num_blocks; the sum of reference counts equals the
    table entries pointing at held blocks;
  * free - reserved >= 0, where reserved is what admitted rows may still take;
  * a row holds ``ceil(length / page)`` or one more (prepared) self pages and
    exactly ``ceil(cross_len / page)`` cross pages;
  * every public method validates everything before it changes anything.

Row ids are ints; a numpy integer is taken by its value (ids read back from an
array work), a bool or any other type is refused with ``ValueError`` (``True``
is not row 1), and an int that is not an admitted row is a ``KeyError``. The
same holds for ``select``'s indices and a decode group's row positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oasr.cache.paged import PagedKVCache
from oasr.decoder.common import (
    Admission,
    AdmissionError,
    DecoderRowInfo,
    RowPages,
    ViewStep,
    check_cross_fill,
    check_kv,
    check_pad_to,
    check_pool,
    check_requests,
    check_rewind,
    check_row,
    check_rows,
    check_step_kv,
    cow_writes,
    judge,
    judge_restore,
    plan_select,
    reserved_pages,
)
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.decoder.kv import DenseDecoderKV as DenseDecoderKVBase
from oasr.decoder.prefix_cache import PrefixIndex, check_tokens
from oasr.kv_formats import get_format
from oasr.reference.block_pool import BlockPool
from oasr.reference.paged_ops import append_kv, paged_attention


@dataclass
class _Row:
    request: DecoderRequest
    self_blocks: list = field(default_factory=list)
    cross_blocks: list = field(default_factory=list)
    length: int = 0
    cross_length: int = 0


class DecoderKVCacheManager:
    # Whether a decode group (``oasr.decoder.kv.PagedDecoderKV``) reads a cross region its rows share once
    # for all of them. The oracle reads every row's cross pages itself, so its paged beams compute what
    # dense beams compute, bit for bit; the fast twin reads shared regions once.
    SHARED_CROSS_READ = False

    def __init__(self, config: DecoderCacheConfig, pool: BlockPool | None = None):
        if not isinstance(config, DecoderCacheConfig):
            check_pool(config, None)  # raises: not a DecoderCacheConfig
        self.config = config
        if pool is None:
            pool = BlockPool(config.pool_config(), scratch_blocks=1)
        check_pool(config, pool)
        self.pool = pool
        self._owner = pool.new_owner(type(self).__name__)  # the pool refuses to free our pages for others
        self._prefix = PrefixIndex(config.page_size)
        self._rows: dict[int, _Row] = {}
        self._free_rows = list(range(config.max_rows))

    # ---- block ownership (the only places that touch the pool's free list or a table entry) ----
    def _take(self, n: int) -> list[int]:
        return self.pool.allocate(n, self._owner)

    def _drop(self, ids: list[int]) -> None:
        self.pool.free(ids, self._owner)

    def _bind(self, blocks: list, ids: list[int], share: bool = False) -> None:
        if share:
            self.pool.share(ids, self._owner)
        blocks.extend(ids)

    def _rebind(self, blocks: list, column: int, block_id: int) -> None:
        """Point one table entry at its private copy (copy-on-write; the caller drops the original)."""
        blocks[column] = block_id

    def _unbind(self, blocks: list, start: int = 0) -> list[int]:
        ids = list(blocks[start:])
        del blocks[start:]
        return ids

    # ---- counts ---------------------------------------------------------------
    def _row(self, row, op: str) -> tuple[int, _Row]:
        """``(row id as an int, its record)``: ``check_row``'s ValueError for a non-integer id (a bool is
        not row 1, a numpy integer is its value), KeyError for a row not admitted."""
        r = check_row(row, self._admitted, op)
        return r, self._rows[r]

    def _admitted(self, row) -> bool:
        return row in self._rows

    @property
    def rows(self) -> list[int]:
        """Admitted rows, lowest first."""
        return sorted(self._rows)

    @property
    def num_free_rows(self) -> int:
        """Rows that can still be admitted."""
        return len(self._free_rows)

    def row_pages(self, row: int) -> RowPages:
        """``RowPages`` of an admitted row: its self and cross page ids, length and ceiling."""
        row, r = self._row(row, "row_pages")
        return RowPages(tuple(r.self_blocks), tuple(r.cross_blocks), r.length, r.request.self_tokens)

    def pinned_blocks(self) -> list[int]:
        """Blocks published in the prefix index (held or parked): a write into one always copies."""
        return self._prefix.pinned(self.pool)

    @property
    def reserved_blocks(self) -> int:
        """Blocks admitted rows may still take: ceilings minus pages held, plus copy-on-write copies owed."""
        return reserved_pages(self.config, [self.row_pages(r) for r in self.rows], self.pinned_blocks())

    @property
    def available_blocks(self) -> int:
        """Free blocks no admitted row has reserved: what the next admission may claim."""
        return self.pool.num_free_blocks - self.reserved_blocks

    def describe(self, row: int) -> DecoderRowInfo:
        """``DecoderRowInfo`` of an admitted row: pages, lengths and ceilings (``KeyError`` otherwise)."""
        row, r = self._row(row, "describe")
        return DecoderRowInfo(row, tuple(r.self_blocks), tuple(r.cross_blocks), r.length, r.cross_length,
                              r.request.self_tokens, r.request.cross_len)

    def length(self, row: int) -> int:
        """Tokens the row holds (``KeyError`` unless admitted)."""
        return self._row(row, "length")[1].length

    def lengths(self, rows) -> list[int]:
        """``length`` of each of ``rows``, in their order (``check_rows``' errors)."""
        return [self._rows[r].length for r in check_rows(rows, self._admitted, "lengths")]

    # ---- admission --------------------------------------------------------------
    def can_admit(self, requests) -> Admission:
        """Would ``admit(requests)`` succeed? Never mutates."""
        reqs = check_requests(requests)
        return judge(self.config, reqs, len(self._free_rows), self.pool.num_free_blocks, self.reserved_blocks)

    def admit(self, requests) -> list[int]:
        """Reserve every request's ceiling and map its cross pages, all or nothing; returns the rows."""
        reqs = check_requests(requests)
        answer = self.can_admit(reqs)
        if not answer:
            raise AdmissionError(answer.reason)
        cfg = self.config
        cross = self._take(sum(cfg.pages_for(r.cross_len) for r in reqs))  # one allocation for the batch
        rows, cursor = [], 0
        for req in reqs:
            row = self._free_rows.pop(0)
            record = _Row(req)
            n = cfg.pages_for(req.cross_len)
            self._bind(record.cross_blocks, cross[cursor : cursor + n])
            cursor += n
            self._rows[row] = record
            rows.append(row)
        return rows

    def finish(self, row: int) -> None:
        """Free the whole row: its self and cross pages go back to the pool, the row id to the free rows."""
        row, r = self._row(row, "finish")
        self._drop(self._unbind(r.self_blocks) + self._unbind(r.cross_blocks))
        del self._rows[row]
        self._free_rows.append(row)
        self._free_rows.sort()

    # ---- views ------------------------------------------------------------------
    def _table(self, blocks: list, width: int) -> list[int]:
        return list(blocks) + [self.pool.null_block] * (width - len(blocks))

    def _views(self, tables: list, seqlens: list, width: int, spans: list, prepared: list) -> list[PagedKVCache]:
        device = self.config.device
        table = torch.tensor(tables, dtype=torch.int32, device=device).view(len(tables), width)
        lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
        starts = torch.zeros(len(tables), dtype=torch.int32, device=device)
        views = []
        for layer in range(self.config.num_layers):
            k, v = self.pool.get_kv_view(layer)
            ks, vs = self.pool.get_kv_scale_view(layer)
            views.append(PagedKVCache(k, v, table, lens, starts, self.config.page_size, max(seqlens, default=0),
                                      max(spans, default=0), layer, ks, vs, tuple(prepared), self.config.dtype,
                                      self.config.kv_cache_dtype))
        return views

    def self_caches(self, rows, pad_to: int | None = None) -> list[PagedKVCache]:
        """One view per layer of the rows' self regions; ``cache_seqlens`` = tokens written so far.

        ``pad_to``: padding rows after the real ones up to that many (``check_pad_to``): only the
        scratch block, length 0, one prepared slot (a step writes its token into the scratch block)."""
        ids = check_rows(rows, self._admitted, "self_caches")
        pad = check_pad_to(pad_to, len(ids), "self_caches")
        width = max(self.config.self_pages, 1)
        lens = [self._rows[r].length for r in ids]
        prepared = [len(self._rows[r].self_blocks) * self.config.page_size - n for r, n in zip(ids, lens, strict=True)]
        tables = [self._table(self._rows[r].self_blocks, width) for r in ids] + [self._table([], width)] * pad
        lens += [0] * pad
        return self._views(tables, lens, width, lens, prepared + [1] * pad)

    def cross_caches(self, rows, pad_to: int | None = None) -> list[PagedKVCache]:
        """One view per layer of the rows' cross regions, read by ``paged_attention`` with one query per row
        and ``chunk_lens=cross_query_lens(rows)``.

        A query attends to ``[0, cache_seqlens + chunk_len)``, so the view reports ``cross_length - 1``
        and the query length 1: the query sees exactly the cross extent (an unfilled row: 0 and 0, zeros).
        ``pad_to`` as for ``self_caches``: padding rows map the scratch block and present no query.
        """
        ids = check_rows(rows, self._admitted, "cross_caches")
        pad = check_pad_to(pad_to, len(ids), "cross_caches")
        width = max(self.config.cross_pages, 1)
        lens = [max(self._rows[r].cross_length - 1, 0) for r in ids] + [0] * pad
        spans = [self._rows[r].cross_length for r in ids] + [0] * pad
        reads = [1 if n else 0 for n in spans]  # the one query each filled row presents
        tables = [self._table(self._rows[r].cross_blocks, width) for r in ids] + [self._table([], width)] * pad
        return self._views(tables, lens, width, spans, reads)

    def shares_cross(self, rows) -> bool:
        """Whether ``rows`` (at least one) all map the same cross-attention pages over the same extent, as
        the beams ``select`` forks from one row do: a reader may then attend that region once for all of
        them. ``check_rows``' errors; never changes anything."""
        ids = check_rows(rows, self._admitted, "shares_cross")
        if not ids:
            return False
        first = self._rows[ids[0]]
        return all(self._rows[r].cross_blocks == first.cross_blocks and self._rows[r].cross_length ==
                   first.cross_length for r in ids)

    def cross_query_lens(self, rows, pad_to: int | None = None) -> list[int]:
        """Per row, 1 if it holds cross-attention K/V, else 0 (the cross read's query lengths); a padding
        row (``pad_to``) 0."""
        ids = check_rows(rows, self._admitted, "cross_query_lens")
        pad = check_pad_to(pad_to, len(ids), "cross_query_lens")
        return [1 if self._rows[r].cross_length else 0 for r in ids] + [0] * pad

    def gather_self(self, row: int) -> torch.Tensor:
        """The row's self K/V as packed ``(L, H, length, 2D)`` in the model dtype (dequantized for fp8)."""
        row, r = self._row(row, "gather_self")
        return self.pool.gather_kv_blocks(r.self_blocks, 0, r.length)

    def gather_cross(self, row: int) -> torch.Tensor:
        """The row's cross-attention K/V, all layers, as one dense tensor (for checks)."""
        row, r = self._row(row, "gather_cross")
        return self.pool.gather_kv_blocks(r.cross_blocks, 0, r.cross_length)

    # ---- writes -------------------------------------------------------------------
    def _write(self, blocks: list, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens ``[start, start + T)`` of one region, ``k, v (L, T, H, D)``: one append_kv per layer."""
        width = max(len(blocks), 1)
        views = self._views([self._table(blocks, width)], [start], width, [start],
                            [len(blocks) * self.config.page_size - start])
        for layer, view in enumerate(views):
            append_kv(view, k[layer][None], v[layer][None])

    def fill_cross(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the row's cross K/V ``(L, T, H, D)`` once, from the encoder output.

        A refill of the same ``T`` overwrites in place (idempotent); another ``T`` on a filled row, or
        ``T`` above the declared ``cross_len``, raises. The dtype is converted to the decoder's: the
        encoder is another model whose output may come in its own precision, the fill is one copy per
        request, and converting there costs nothing that a caller-side copy would not (self writes,
        made every step by the decoder's own projections, keep the strict rule).
        """
        row, r = self._row(row, "fill_cross")
        T = check_kv(self.config, k, v, "fill_cross", (), convert=True)
        check_cross_fill(row, T, r.request.cross_len, r.cross_length)
        shared = [b for b in r.cross_blocks if self.pool.ref_count(b) > 1]
        if shared:
            raise ValueError(f"fill_cross: row {row}'s cross pages {shared} are shared with forked rows; "
                             f"fill before select forks the row")
        dtype = self.config.dtype
        self._write(r.cross_blocks, 0, k.to(dtype), v.to(dtype))
        r.cross_length = T

    def prefill(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the prompt's K/V ``(L, T, H, D)`` into an empty row (its pages come from its reservation)."""
        row, r = self._row(row, "prefill")
        T = check_kv(self.config, k, v, "prefill", (), convert=False)
        if r.length:
            raise ValueError(f"prefill: row {row} already holds {r.length} tokens; prefill an empty row")
        if T > r.request.self_tokens:
            raise ValueError(f"prefill: row {row} declared {r.request.self_tokens} tokens, got a prompt of {T}")
        self._extend(r, k, v, T)

    def extend(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``T`` more tokens ``(L, T, H, D)`` at the row's length: the rest of a prompt after a prefix
        hit, a speculative draft after a ``rewind``. Shared pages it writes are copied first."""
        row, r = self._row(row, "extend")
        T = check_kv(self.config, k, v, "extend", (), convert=False)
        if r.length + T > r.request.self_tokens:
            raise ValueError(f"extend: row {row} holds {r.length} tokens and declared {r.request.self_tokens}, "
                             f"got {T} more")
        self._extend(r, k, v, T)

    def _extend(self, r: _Row, k: torch.Tensor, v: torch.Tensor, T: int) -> None:
        """Tokens ``[length, length + T)``: copies of the shared pages they land in, new pages past the held
        ones (one allocation, one batched copy), then one append_kv per layer."""
        page = self.config.page_size
        first, end = r.length // page, self.config.pages_for(r.length + T)
        columns = list(range(first, min(end, len(r.self_blocks))))
        pins = set(self.pinned_blocks())
        copy = cow_writes([r.self_blocks[c] for c in columns], lambda b: self.pool.ref_count(b) + (b in pins))
        columns = [c for c, flag in zip(columns, copy, strict=True) if flag]
        src = [r.self_blocks[c] for c in columns]
        new = self._take(len(src) + max(0, end - len(r.self_blocks)))
        self.pool.copy_blocks(src, new[: len(src)])
        for c, b in zip(columns, new, strict=False):
            self._rebind(r.self_blocks, c, b)
        self._bind(r.self_blocks, new[len(src) :])
        self._drop(src)
        self._write(r.self_blocks, r.length, k, v)
        r.length += T

    def _step_needs(self, ids: list[int]) -> list[int]:
        page = self.config.page_size
        needs = []
        for row in ids:
            r = self._rows[row]
            if r.length >= r.request.self_tokens:
                raise ValueError(f"row {row} is at its ceiling of {r.request.self_tokens} tokens (prompt_len="
                                 f"{r.request.prompt_len} + max_new_tokens={r.request.max_new_tokens})")
            needs.append(max(0, (r.length + 1 + page - 1) // page - len(r.self_blocks)))
        return needs

    def _landing(self, row: int) -> int:
        """The held block the row's next token lands in, or -1 when it needs a new page."""
        r = self._rows[row]
        p = r.length // self.config.page_size
        return r.self_blocks[p] if p < len(r.self_blocks) else -1

    def prepare_step(self, rows) -> None:
        """Make sure each row holds an unshared page for its next token: one allocation for all rows,
        copies of shared landing pages first (row order), then new pages; one batched copy."""
        ids = check_rows(rows, self._admitted, "prepare_step")
        needs = self._step_needs(ids)
        landing = [self._landing(r) for r in ids]
        pins = set(self.pinned_blocks())
        copy = cow_writes(landing, lambda b: self.pool.ref_count(b) + (b in pins))
        src = [b for b, c in zip(landing, copy, strict=True) if c]
        new = self._take(len(src) + sum(needs))  # inside the rows' reservations: cannot run dry
        self.pool.copy_blocks(src, new[: len(src)])
        copies = iter(new[: len(src)])
        for row, c in zip(ids, copy, strict=True):
            if c:
                r = self._rows[row]
                self._rebind(r.self_blocks, r.length // self.config.page_size, next(copies))
        cursor = len(src)
        for row, n in zip(ids, needs, strict=True):
            self._bind(self._rows[row].self_blocks, new[cursor : cursor + n])
            cursor += n
        self._drop(src)

    def open_step(self, rows) -> ViewStep:
        """``prepare_step(rows)``, then a handle on the step: ``write(layer, k, v)`` with ``k, v
        (B, 1, n_kv_head, head_dim)``, ``attend(layer, q)`` with ``q (B, n_head, 1, head_dim)`` (causal,
        this step's token included), ``commit()`` (``commit_step``). The oracle's handle is the views of
        ``self_caches`` and the twin's ops (``ViewStep``); the handle is valid until another manager
        call changes the rows, like the views."""
        ids = check_rows(rows, self._admitted, "open_step")
        self.prepare_step(ids)
        return ViewStep(self, ids, append_kv, paged_attention, {})

    def commit_step(self, rows) -> None:
        """Advance each row by the one token written through ``self_caches`` (after ``prepare_step``)."""
        ids = check_rows(rows, self._admitted, "commit_step")
        page = self.config.page_size
        for row in ids:
            r = self._rows[row]
            if r.length + 1 > len(r.self_blocks) * page or r.length >= r.request.self_tokens:
                raise ValueError(f"commit_step: row {row} has no prepared slot for token {r.length} "
                                 f"(call prepare_step first)")
        for row in ids:
            self._rows[row].length += 1

    def append(self, rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """One decode step for many rows: ``k, v (L, B, H, D)``, row ``b`` gets token ``length[b]``."""
        ids = check_rows(rows, self._admitted, "append")
        check_step_kv(self.config, k, v, len(ids))
        self.prepare_step(ids)  # validates every row's ceiling before its one allocation
        for layer, view in enumerate(self.self_caches(ids)):
            append_kv(view, k[layer][:, None], v[layer][:, None])
        self.commit_step(ids)

    # ---- sessions (oasr.sessions.decoder_rows: a row's pages saved once, shared again on load) ----------------
    def request(self, row: int) -> DecoderRequest:
        """The ``DecoderRequest`` an admitted row declared (``KeyError`` otherwise)."""
        return self._row(row, "request")[1].request

    def can_restore(self, requests, self_pages, cross_pages, lengths, num_pages: int, published=()) -> Admission:
        """Would ``restore_rows`` succeed? Never mutates (``oasr.decoder.common.judge_restore``)."""
        return judge_restore(self.config, check_requests(requests), self_pages, cross_pages, lengths, num_pages,
                             list(published), len(self._free_rows), self.pool.num_free_blocks, self.reserved_blocks)

    def restore_rows(self, requests, self_pages, cross_pages, lengths, cross_lengths, num_pages: int,
                     published=()) -> tuple[list[int], list[int]]:
        """Admit rows that carry saved pages: ``num_pages`` blocks in one allocation, row ``i``'s columns
        bound to the blocks its page indices name (the first name takes the allocation's reference, each
        further name shares it: a count per name, as the saved rows held them). ``published``: ``(page,
        (scope, tokens))`` pairs published again in the prefix index. Returns ``(rows, block of each
        page)``; the caller writes the pages' contents. All or nothing (``AdmissionError``, ``ValueError``)."""
        reqs = check_requests(requests)
        published = list(published)
        answer = self.can_restore(reqs, self_pages, cross_pages, lengths, num_pages, [p for p, _ in published])
        if not answer:
            raise AdmissionError(answer.reason)
        blocks, named, rows = self._take(num_pages), set(), []
        for req, s, c, n, cn in zip(reqs, self_pages, cross_pages, lengths, cross_lengths, strict=True):
            record = _Row(req, length=n, cross_length=cn)
            for table, names in ((record.self_blocks, s), (record.cross_blocks, c)):
                for p in names:
                    self._bind(table, [blocks[p]], share=p in named)
                    named.add(p)
            row = self._free_rows.pop(0)
            self._rows[row] = record
            rows.append(row)
        for p, (scope, tokens) in published:
            key = self._prefix.adopt(self.pool, blocks[p], tokens, scope)
            if key is not None:
                self.pool.publish([blocks[p]], [key], self._owner)
        return rows, blocks

    # ---- prefix caching (oasr.decoder.prefix_cache: publish, hit, retire, evict) ------------------------------
    def admit_prompt(self, row: int, tokens, scope=0) -> int:
        """Bind the longest published prefix of the row's prompt ``tokens`` (shared pages, counts up,
        parked blocks taken back) and return how many leading tokens are cached: whole pages, strictly
        fewer than the prompt. Then write the rest with ``extend(row, k[:, n:], v[:, n:])``. The row must
        be freshly admitted (empty); nothing changes on a refusal. ``scope`` (``oasr.decoder.prefix_cache``): rows
        share only within one scope; an attention decoder passes the utterance its rows attend to."""
        row, r = self._row(row, "admit_prompt")
        ids = check_tokens(tokens, "admit_prompt")
        if r.length or r.self_blocks:
            raise ValueError(f"admit_prompt: row {row} already holds {r.length} tokens; admit its prompt first")
        if len(ids) > r.request.self_tokens:
            raise ValueError(f"admit_prompt: row {row} declared {r.request.self_tokens} tokens, got a prompt "
                             f"of {len(ids)}")
        hits = self._prefix.lookup(self.pool, ids, scope)
        self._bind(r.self_blocks, hits, share=True)
        r.length = len(hits) * self.config.page_size
        return r.length

    def retire(self, row: int, tokens, scope=0) -> None:
        """Finish a row that ended normally, publishing its full pages under ``tokens`` (its whole
        committed history, ``length`` ids): they park when no row holds them, for later prompts."""
        row, r = self._row(row, "retire")
        ids = check_tokens(tokens, "retire")
        if len(ids) != r.length:
            raise ValueError(f"retire: row {row} holds {r.length} tokens, got a history of {len(ids)}")
        self.pool.publish(*self._prefix.publish(self.pool, ids, r.self_blocks, scope), self._owner)
        self.finish(row)

    def evict(self, row: int) -> None:
        """The cancel path: finish the row publishing nothing new; the published pages it held park."""
        self.finish(row)

    def abandon(self, row: int) -> None:
        """Finish a row after a failed session with host bookkeeping only: no launch, no copy, no wait
        (references dropped exactly as ``evict`` drops them; the row's device entries are rewritten at
        its next admission, before any read)."""
        row, _ = self._row(row, "abandon")
        self.finish(row)

    def reset(self) -> None:
        """Finish every row and drop the parked pages and the prefix index: nothing stays cached."""
        for row in self.rows:
            self.finish(row)
        self.pool.drop_parked()
        self._prefix.clear()

    # ---- rewind and trim (speculative drafts, revised partial results) ------------------------
    def rewind(self, row: int, n: int) -> None:
        """Drop the row's last ``n`` tokens. Its pages stay bound and are written again, in place, before
        any new page is taken (the free count does not move, unless a page it writes is shared: that
        one is copied first). Stale bytes past the new length are never read: views stop at ``length``.
        Refused, changing nothing, when ``n`` is not in ``[0, length]`` or the copies would not fit."""
        row, r = self._row(row, "rewind")
        check_rewind(self.config, self, row, n)
        r.length -= n

    def trim(self, row: int) -> int:
        """Return the row's self pages past ``ceil(length / page)`` to the pool (one reference each);
        returns how many were unbound. The row may take them again, out of its reservation."""
        row, r = self._row(row, "trim")
        tail = self._unbind(r.self_blocks, self.config.pages_for(r.length))
        self._drop(tail)
        return len(tail)

    # ---- beams ----------------------------------------------------------------------
    def select(self, rows, idx) -> list[int]:
        """Keep ``rows[i]`` for ``i`` in ``idx`` (in that order) and finish the others; returns the new rows.

        A repeated index forks: its first place keeps the row, each later place gets a fresh row (lowest
        free id, after the dropped rows finish) mapping the same self and cross pages, whose reference
        counts go up; the first write into a shared page copies it. Refused, changing nothing, when the
        forks find no rows or their copy-on-write copies do not fit (``plan_select``).
        """
        ids = check_rows(rows, self._admitted, "select")
        sources, dropped = plan_select(self.config, self, ids, idx)
        for row in dropped:
            self.finish(row)
        out, seen = [], set()
        for src in sources:
            out.append(self._fork(src) if src in seen else src)
            seen.add(src)
        return out

    def _fork(self, row: int) -> int:
        """A fresh row mapping ``row``'s pages (shared: counts up), at its length."""
        r = self._rows[row]
        new = self._free_rows.pop(0)
        record = _Row(r.request, length=r.length, cross_length=r.cross_length)
        self._bind(record.self_blocks, list(r.self_blocks), share=True)
        self._bind(record.cross_blocks, list(r.cross_blocks), share=True)
        self._rows[new] = record
        return new


class DenseDecoderKV(DenseDecoderKVBase):
    """Dense per-group storage (``oasr.decoder.kv``) quantizing with the reference rule of its format."""

    @staticmethod
    def quantize(fmt, x, model_dtype):
        """``x`` in format ``fmt``: ``(data, scale)`` for a model served in ``model_dtype``."""
        return get_format(fmt).quantize(x, model_dtype)

    @staticmethod
    def dequantize(fmt, stored, scale, dtype):
        """``stored`` (with its ``scale``) in format ``fmt`` back to values in ``dtype``."""
        return get_format(fmt).dequantize(stored, scale, dtype)
