"""What both twins' ``DecoderKVCacheManager`` share: requests, refusals, row records, argument checks.

The admission arithmetic lives here once, so the twins refuse the same batches
with the same words::

    available = pool.num_free_blocks - reserved
    reserved  = sum over admitted rows of (self ceiling pages - self pages held)
    a batch fits  iff  free rows >= len(batch)  and  every ceiling <= the config's
                  and  sum of (self ceiling pages + cross pages) <= available

Cross pages are mapped at admission (their extent is fixed), so they are held,
not reserved. Self pages are taken one at a time as a row crosses a page
boundary, always out of its own reservation, so ``available`` never goes
negative and an admitted row can always reach its ceiling.

Shared pages (copy-on-write). A ``select`` with repeated indices forks rows:
the fork maps the same pages and each page's reference count goes up. A row
writes token ``length`` into logical page ``length // page``; when that page is
shared, the step first copies it to a fresh block (all of a step's copies in
one batched ``copy_blocks``) and drops one reference on the original. The rows
of one step that write into one shared block copy in row order and the last one
keeps the original (its count is then 1). So the reservation also counts the
copies still owed::

    reserved = sum over rows of (ceiling pages - self pages held)
             + sum over blocks b of (writers(b) - [writers(b) == holders(b)])

    writers(b): rows whose logical pages from length // page on include b
    holders(b): table entries (self and cross) pointing at b (its reference count)

Each copy takes one block and lowers that sum by one, so ``free - reserved``
stays >= 0 through any interleaving, as before.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from oasr.cache.validate import check_kv_numbers, same_device
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest


class AdmissionError(RuntimeError):
    """``admit`` refused a batch; ``reason`` is ``can_admit``'s sentence. Nothing was changed."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"DecoderKVCacheManager.admit refused the batch: {reason}")


@dataclass(frozen=True)
class Admission:
    """``can_admit``'s answer: truthy when the batch fits; otherwise ``reason`` names the numbers."""

    ok: bool
    reason: str = ""
    blocks: int = 0  # pages the batch would reserve (self ceilings + cross extents)

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class DecoderRowInfo:
    """A snapshot of one row (tests, notebooks): blocks in logical order and lengths."""

    row: int
    self_blocks: tuple
    cross_blocks: tuple
    length: int
    cross_length: int
    ceiling_tokens: int
    cross_ceiling: int


def check_requests(requests) -> list[DecoderRequest]:
    """One request or a list of them, as a list of ``DecoderRequest`` (``ValueError`` naming any other)."""
    reqs = list(requests) if isinstance(requests, (list, tuple)) else [requests]
    for i, r in enumerate(reqs):
        if not isinstance(r, DecoderRequest):
            raise ValueError(f"can_admit: request {i} must be a DecoderRequest, got {type(r).__name__}")
    return reqs


def judge(config: DecoderCacheConfig, requests: list[DecoderRequest], free_rows: int, free_blocks: int,
          reserved: int) -> Admission:
    """The admission rule (module docstring) on plain numbers; never mutates anything."""
    if len(requests) > free_rows:
        return Admission(False, f"the batch needs {len(requests)} rows, only {free_rows} of "
                                f"max_rows={config.max_rows} are free")
    for i, r in enumerate(requests):
        if r.self_tokens > config.max_self_tokens:
            return Admission(False, f"request {i} declares prompt_len={r.prompt_len} + max_new_tokens="
                                    f"{r.max_new_tokens} = {r.self_tokens} tokens, above max_self_tokens="
                                    f"{config.max_self_tokens}")
        if r.cross_len > config.max_cross_tokens:
            return Admission(False, f"request {i} declares cross_len={r.cross_len}, above max_cross_tokens="
                                    f"{config.max_cross_tokens}")
    self_pages = sum(config.pages_for(r.self_tokens) for r in requests)
    cross_pages = sum(config.pages_for(r.cross_len) for r in requests)
    need = self_pages + cross_pages
    available = free_blocks - reserved
    if need > available:
        return Admission(False, f"the batch's ceilings need {need} blocks ({self_pages} self + {cross_pages} "
                                f"cross, page_size={config.page_size}), only {available} are available "
                                f"({free_blocks} free minus {reserved} reserved by admitted rows)", need)
    return Admission(True, "", need)


def as_index(value, what: str, op: str) -> int:
    """``value`` as a Python int: an ``int`` or a numpy integer (taken by its value, so ids read back
    from numpy arrays work); anything else, bools included (``True`` is not row 1), is a ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{op}: {what} must be ints (or numpy integers), got {value!r}")
    return int(value)


def check_row(row, admitted, op: str) -> int:
    """One admitted row id as an int (``as_index``): ValueError for a non-integer, KeyError when the row
    is not admitted (``admitted(row) -> bool``)."""
    r = as_index(row, "row ids", op)
    if not admitted(r):
        raise KeyError(f"{op}: row {r} is not admitted (never admitted, or finished)")
    return r


def check_rows(rows, admitted, op: str, unique: bool = True) -> list[int]:
    """``rows`` (one id, or a list or tuple of them) as a list of admitted row ids, each an int
    (``check_row``); a repeated row is a ValueError."""
    given = list(rows) if isinstance(rows, (list, tuple)) else [rows]
    if all(type(r) is int for r in given):  # plain ints, as the managers hand them out (never a bool)
        ids = given
    else:
        ids = [as_index(r, "row ids", op) for r in given]  # every type first, then admission
    for r in ids:
        if not admitted(r):
            raise KeyError(f"{op}: row {r} is not admitted (never admitted, or finished)")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{op}: duplicate rows in {ids}")
    return ids


def check_pad_to(pad_to, rows: int, op: str) -> int:
    """Padding rows a view call adds after ``rows`` real ones to reach ``pad_to`` (None: none). A padding
    row maps only the scratch block at length 0: a step writes its token there and reads nothing else;
    its cross read has no query. ``ValueError`` for a non-integer or a ``pad_to`` below ``rows``."""
    if pad_to is None:
        return 0
    pad_to = as_index(pad_to, "pad_to", op)
    if pad_to < rows:
        raise ValueError(f"{op}: pad_to={pad_to} is smaller than the {rows} rows")
    return pad_to - rows


def check_kv(config: DecoderCacheConfig, k: torch.Tensor, v: torch.Tensor, op: str, lead: tuple,
             convert: bool, numbers: bool = True) -> int:
    """``k, v`` must be ``(L, *lead, T, H, D)`` (``T`` free when ``lead`` ends with None) on the pool's device.

    Self writes keep the strict rule: the model dtype only. Cross fills convert (``convert=True``).
    ``numbers``: refuse NaN for a format whose rule does (``oasr.cache.validate.check_kv_numbers``), here, before
    any layer is written; False where the kernels write (they read nothing back: the fast twin's kernel
    backends). Returns T.
    """
    L, H, D = config.num_layers, config.n_kv_head, config.head_dim
    want = (L, *lead, "T", H, D)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        shape = tuple(t.shape)
        if len(shape) != len(want) or shape[0] != L or shape[-2:] != (H, D) or \
                tuple(shape[1:1 + len(lead)]) != tuple(lead):
            raise ValueError(f"{op}: {name} must be {want}, got {shape}")
        if not same_device(t.device, config.device):
            raise ValueError(f"{op}: {name} is on {t.device}, the pool on {config.device}")
        if not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be floating point, got {t.dtype}")
        if not convert and t.dtype != config.dtype:
            raise ValueError(f"{op}: {name} is {t.dtype}, the decoder serves {config.dtype} (no silent conversion)")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if numbers:
        check_kv_numbers(op, config.kv_cache_dtype, (("k", k), ("v", v)))
    return k.shape[-3]


def check_step_kv(config: DecoderCacheConfig, k, v, batch: int, numbers: bool = True) -> None:
    """``append``'s one token per row: ``k, v (L, B, H, D)`` in the model dtype (``numbers`` as ``check_kv``'s)."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"append: {name} must be (L={config.num_layers}, B={batch}, "
                             f"H={config.n_kv_head}, D={config.head_dim}), got {got}")
    check_kv(config, k[:, :, None], v[:, :, None], "append", (batch,), convert=False, numbers=numbers)


@dataclass(frozen=True)
class RowPages:
    """What the reservation needs of one row: its tables in logical order, its length and ceiling."""

    self_blocks: tuple
    cross_blocks: tuple
    length: int
    ceiling: int


def reserved_pages(config: DecoderCacheConfig, rows, pinned=()) -> int:
    """The reservation of the module docstring over ``rows`` (``RowPages``); ``pinned`` blocks (published
    in a prefix cache) count one more holder, so a write into one always copies."""
    page = config.page_size
    holders, writers = Counter(pinned), Counter()
    growth = 0
    for r in rows:
        holders.update(r.self_blocks)
        holders.update(r.cross_blocks)
        writers.update(r.self_blocks[r.length // page:])
        growth += config.pages_for(r.ceiling) - len(r.self_blocks)
    return growth + sum(w - (w == holders[b]) for b, w in writers.items())


def select_sources(ids: list[int], idx) -> list[int]:
    """The source row of each position of ``select(rows, idx)``: each index an int or a numpy integer
    (``as_index``: ``1.5`` or ``True`` is refused, not read as 1); an index out of range raises."""
    picks = list(idx) if isinstance(idx, (list, tuple)) else None
    if picks is None or not all(type(i) is int for i in picks):  # (plain ints, as a search hands them: no call)
        picks = [as_index(i, "indices", "select") for i in idx]
    bad = [i for i in picks if not 0 <= i < len(ids)]
    if bad:
        raise ValueError(f"select: index {bad[0]} outside [0, {len(ids)})")
    return [ids[i] for i in picks]


def plan_select(config: DecoderCacheConfig, manager, ids: list[int], idx) -> tuple[list[int], list[int]]:
    """Validate a copy-on-write ``select`` before anything changes; returns ``(sources, dropped)``.

    ``manager`` gives ``rows``, ``num_free_rows``, ``pool.num_free_blocks``, ``row_pages(row)`` and
    ``pinned_blocks()``. A repeated source becomes a fork in a fresh row (sharing every page); the
    select is refused when the forks need more rows than are free after the dropped rows finish, or
    when the copies the forks owe do not fit the free blocks after the dropped rows' pages return.
    A page only dropped rows hold returns whether it goes to the free list or parks (a published
    page): parked pages count as free, as in ``pool.num_free_blocks``.
    """
    sources = select_sources(ids, idx)
    dropped = [r for r in ids if r not in sources]
    forks = len(sources) - len(set(sources))
    if forks > manager.num_free_rows + len(dropped):
        raise ValueError(f"select: {forks} forked rows need {forks} free rows, only "
                         f"{manager.num_free_rows + len(dropped)} are free after the dropped rows finish")
    others = [r for r in manager.rows if r not in ids]
    before = [manager.row_pages(r) for r in manager.rows]
    after = [manager.row_pages(r) for r in sources + others]
    pinned = manager.pinned_blocks()
    held_after = set()  # a pinned page no kept row holds parks, and parked pages count as free
    for r in after:
        held_after.update(r.self_blocks + r.cross_blocks)
    freed = {b for r in before for b in r.self_blocks + r.cross_blocks} - held_after
    need = reserved_pages(config, after, pinned)
    have = manager.pool.num_free_blocks + len(freed)
    if need > have:
        raise ValueError(f"select: the selected rows reserve {need} blocks (ceilings and copy-on-write copies "
                         f"owed), only {have} are free after the dropped rows' pages return")
    return sources, dropped


def check_rewind(config: DecoderCacheConfig, manager, row: int, n) -> None:
    """``rewind(row, n)``'s rules, before anything changes: ``0 <= n <= length``, and the copy-on-write
    copies the rewound row would owe (its landing page moves back into pages it may share) must fit."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"rewind: n must be an int >= 0, got {n!r}")
    pages = manager.row_pages(row)
    if n > pages.length:
        raise ValueError(f"rewind: row {row} holds {pages.length} tokens, cannot drop {n}")
    rows = [manager.row_pages(r) for r in manager.rows if r != row]
    rows.append(RowPages(pages.self_blocks, pages.cross_blocks, pages.length - n, pages.ceiling))
    need = reserved_pages(config, rows, manager.pinned_blocks())
    if need > manager.pool.num_free_blocks:
        raise ValueError(f"rewind: row {row} rewound by {n} would make admitted rows reserve {need} blocks "
                         f"(its pages from token {pages.length - n} on are shared and would be copied), only "
                         f"{manager.pool.num_free_blocks} are free")


def cow_writes(blocks: list[int], counts) -> list[bool]:
    """Which of one step's writes into ``blocks`` (the block each row's next token lands in, in row order,
    -1 for none) must copy first: a block still shared by another holder when the row comes to it;
    ``counts(b)`` is its current reference count (pins included)."""
    left: dict[int, int] = {}
    copy = []
    for b in blocks:
        if b < 0:
            copy.append(False)
            continue
        n = left.get(b, counts(b))
        copy.append(n > 1)
        left[b] = n - 1
    return copy


def check_cross_fill(row: int, T: int, declared: int, held: int) -> None:
    """``fill_cross``'s rules: at most the declared extent; a refill must keep the length it has."""
    if T > declared:
        raise ValueError(f"fill_cross: row {row} declared cross_len={declared}, got T={T} frames")
    if held and T != held:
        raise ValueError(f"fill_cross: row {row} already holds {held} cross frames; a refill must have the "
                         f"same length, got T={T} (finish the row first)")


def check_pool(config: DecoderCacheConfig, pool) -> None:
    """A decoder's pool must store its format (fp8 or not, model dtype) and its geometry, with a scratch block."""
    if not isinstance(config, DecoderCacheConfig):
        raise ValueError(f"DecoderKVCacheManager: config must be a DecoderCacheConfig, got {type(config).__name__}")
    pc = pool.config
    if pc.kv_cache_dtype != config.kv_cache_dtype or pc.dtype != config.dtype:
        raise ValueError(
            f"DecoderKVCacheManager: the pool stores kv_cache_dtype={pc.kv_cache_dtype!r} (model dtype "
            f"{pc.dtype}) but the decoder declares kv_cache_dtype={config.kv_cache_dtype!r} ({config.dtype}); "
            f"the pool's format must equal the decoder's"
        )
    geometry = (pc.num_layers, pc.n_kv_head, pc.head_dim, pc.block_size_frames)
    want = (config.num_layers, config.n_kv_head, config.head_dim, config.page_size)
    if geometry != want or pool.scratch_blocks < 1:
        raise ValueError(
            f"DecoderKVCacheManager: pool geometry (layers, kv heads, head_dim, page) = {geometry} with "
            f"{pool.scratch_blocks} scratch blocks; the decoder needs {want} and >= 1 scratch block"
        )


def judge_restore(config: DecoderCacheConfig, requests: list[DecoderRequest], self_pages, cross_pages, lengths,
                  num_pages: int, published, free_rows: int, free_blocks: int, reserved: int) -> Admission:
    """``restore_rows``' rule, never mutating: rows carrying ``num_pages`` saved pages (row ``i``'s
    columns name pages ``self_pages[i]`` / ``cross_pages[i]``; ``published`` pages will be pinned).

    Malformed input is a ``ValueError`` (counts that disagree with the lengths and requests, a page
    index out of range or named by no row). The answer is no when the rows or the ceilings do not fit
    (``judge``'s rule), or when the pages plus the rows' reservation (growth to their ceilings and the
    copy-on-write copies the shared pages owe) exceed the free blocks not reserved already.
    """
    if not len(requests) == len(self_pages) == len(cross_pages) == len(lengths):
        raise ValueError(f"restore_rows: {len(requests)} requests, {len(self_pages)} self and {len(cross_pages)} "
                         f"cross page lists, {len(lengths)} lengths")
    named = set()
    for i, (req, s, c, n) in enumerate(zip(requests, self_pages, cross_pages, lengths, strict=True)):
        if not 0 <= n <= req.self_tokens or len(s) != config.pages_for(n) or len(c) != config.pages_for(req.cross_len):
            raise ValueError(f"restore_rows: row {i} of length {n} names {len(s)} self and {len(c)} cross pages; "
                             f"its request {req} needs {config.pages_for(n)} and {config.pages_for(req.cross_len)}")
        named.update(s, c)
    if named != set(range(num_pages)) or not set(published) <= named:
        raise ValueError(f"restore_rows: the rows must name every one of the {num_pages} pages, and only those")
    basic = judge(config, requests, free_rows, 1 << 62, 0)  # rows and ceilings (blocks counted below)
    if not basic:
        return basic
    rows = [RowPages(tuple(-1 - p for p in s), tuple(-1 - p for p in c), n, req.self_tokens)
            for req, s, c, n in zip(requests, self_pages, cross_pages, lengths, strict=True)]
    need = num_pages + reserved_pages(config, rows, [-1 - p for p in published])
    available = free_blocks - reserved
    if need > available:
        return Admission(False, f"the restored rows need {need} blocks ({num_pages} saved pages, the rest their "
                                f"reservation), only {available} are available ({free_blocks} free minus {reserved} "
                                f"reserved by admitted rows)", need)
    return Admission(True, "", need)


class ViewStep:
    """One decode step of ``rows`` over per-layer views: what ``open_step`` returns in general.

    ``open_step(rows)`` has run the manager's ``prepare_step``; this holds its ``self_caches(rows)``
    and writes and reads them with the twin's ``append_kv`` / ``paged_attention`` (``kw``: their
    keyword arguments, the backend). ``commit`` is the manager's ``commit_step``. Like the views
    themselves it is a snapshot of the rows' tables: valid until another manager call changes the rows.
    """

    __slots__ = ("_manager", "_rows", "_views", "_append", "_attend", "_kw")

    def __init__(self, manager, rows: list[int], append_kv, paged_attention, kw: dict):
        self._manager, self._rows, self._kw = manager, rows, kw
        self._append, self._attend = append_kv, paged_attention
        self._views = manager.self_caches(rows)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's ``k, v (B, 1, n_kv_head, head_dim)`` at each row's length, at ``layer``."""
        self._append(self._views[layer], k, v, **self._kw)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q (B, n_head, 1, head_dim)``: causal attention over each row's tokens, this step's included."""
        return self._attend(q, self._views[layer], causal=True, **self._kw)

    def commit(self) -> None:
        """Every row is one token longer (the manager's ``commit_step``)."""
        self._manager.commit_step(self._rows)
