"""Decoder rows in sessions: an attention decoder's K/V rows as pages, written once, shared again on load.

A session's decoder rows section (kind 5, ``docs/sessions.md``) holds a set of
rows of the autoregressive decoder's K/V cache, in either storage:

* ``"paged"``: rows of a ``DecoderKVCacheManager`` (either twin). A page held by
  several saved rows (a copy-on-write beam fork, a prompt prefix bound by
  ``admit_prompt``) is one page record that several rows name; loading takes one
  block per page record and binds each further name as a shared reference, so the
  reference counts among the restored rows are the saved ones (never duplicated).
  A page published in the prefix index (int scope) carries its scope and prefix
  tokens and is published again on load (unless the loader already caches that
  prefix in another block: then it stays private, which costs one copy later).
* ``"dense"``: the rows of a ``DenseDecoderKV`` group (the attention rescoring
  job's storage), cut into pages of ``page_size`` tokens; identical pages of one
  region (every row's copy of the same cross K/V, the common prefix of n-best
  hypotheses) are written once and copied back into each row on load.

Only what can be read travels: a row's self pages ``ceil(length / page)`` (pages
a row holds past its length, after a ``prepare_step`` or ``rewind``, are left
behind) and its cross pages ``ceil(cross_len / page)`` (the declared extent).
Each page stores its first ``used`` tokens (the most any row that names it
reads); the positions past them are never read and load as zeros.

Stored values are exactly the pool's (the format's data bytes and scale planes
for quantized formats), so a load is bit-exact on the same twin. The format is
recorded and a loader of another format, dtype or geometry refuses the rows.

API::

    capture_paged(manager, rows) -> DecoderRows     capture_dense(kv) -> DecoderRows   (change nothing)
    check_paged(rows_state, manager)                 check_dense(rows_state, config, batch, capacity, cross)
    restore_paged(rows_state, manager) -> row ids    restore_dense(rows_state, config, ops) -> DenseDecoderKV
    encode_decoder_rows / decode_decoder_rows        the section's bytes (``oasr.sessions.format`` calls them)
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from oasr.decoder.common import AdmissionError
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.kv_formats import get_format
from oasr.sessions.codec import (
    KV_FORMAT_CODES,
    KV_FORMATS,
    MODEL_DTYPE_CODES,
    MODEL_DTYPES,
    Reader,
    SessionError,
    tensor_bytes,
    tensor_from,
)

STORAGES = {1: "dense", 2: "paged"}
STORAGE_CODES = {v: k for k, v in STORAGES.items()}
# layers, kv heads, head_dim, page, dtype, format, storage, reserved, pages, rows
_GEOMETRY = struct.Struct("<IIIIBBBBII")
_PAGE = struct.Struct("<IBBBB")  # used tokens, published, 3 reserved
_ROW = struct.Struct("<IIIqqII")  # prompt_len, max_new_tokens, cross_len, length, cross_length, self pages, cross pages


@dataclass(frozen=True)
class DecoderGeometry:
    """What the rows were stored for; must equal the loading cache's own (``differences``)."""

    num_layers: int
    n_kv_head: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    kv_cache_dtype: str | None
    storage: str

    @classmethod
    def of(cls, config: DecoderCacheConfig, storage: str) -> DecoderGeometry:
        """The geometry of ``config`` for rows in ``storage`` ("dense" or "paged")."""
        return cls(config.num_layers, config.n_kv_head, config.head_dim, config.page_size, config.dtype,
                   config.kv_cache_dtype, storage)

    def differences(self, other: DecoderGeometry) -> list[str]:
        """One line per differing field: the session's value, then this side's."""
        return [f"{name}: session {getattr(self, name)!r}, here {getattr(other, name)!r}"
                for name in self.__dataclass_fields__ if getattr(self, name) != getattr(other, name)]

    @property
    def data_dim(self) -> int:
        """Stored elements per (token, head) vector."""
        return get_format(self.kv_cache_dtype).data_dim(self.head_dim)

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the stored K/V (the format's data dtype, else the model dtype)."""
        return get_format(self.kv_cache_dtype).data_dtype(self.dtype)

    @property
    def scale_plane(self) -> tuple:
        """Per-vector shape of a quantized format's scale plane."""
        return get_format(self.kv_cache_dtype).scale_shape(self.head_dim)

    @property
    def scale_dtype(self) -> torch.dtype:
        """dtype of a quantized format's scale plane."""
        return get_format(self.kv_cache_dtype).scale_dtype(self.dtype)


@dataclass
class DecoderPage:
    """One page: its first ``used`` tokens of K and V ``(L, used, H, D_stored)`` (and scale planes for a
    quantized format); ``prefix`` = ``(scope, tokens)`` when it is published in the prefix index."""

    used: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    prefix: tuple | None = None


@dataclass(frozen=True)
class DecoderRowState:
    """One row: its declared request, lengths, and the page records its self and cross columns name."""

    request: DecoderRequest
    length: int
    cross_length: int
    self_pages: tuple
    cross_pages: tuple


@dataclass
class DecoderRows:
    """The parsed decoder rows section: geometry, page records, rows naming them."""

    geometry: DecoderGeometry
    pages: list
    rows: list

    def references(self) -> list[int]:
        """How many row columns name each page (its reference count once loaded into a manager)."""
        counts = [0] * len(self.pages)
        for r in self.rows:
            for p in r.self_pages + r.cross_pages:
                counts[p] += 1
        return counts


# ---- capture -------------------------------------------------------------------------------------------


def _reads(length: int, columns: int, page: int) -> list[int]:
    """Tokens each of ``columns`` pages holds of a region ``length`` tokens long."""
    return [max(0, min(page, length - j * page)) for j in range(columns)]


def _int_scope(scope) -> bool:
    return isinstance(scope, int) and not isinstance(scope, bool) and -(2**63) <= scope < 2**63


def capture_paged(manager, rows) -> DecoderRows:
    """Rows ``rows`` of a ``DecoderKVCacheManager`` (either twin), pages deduplicated by block id (changes
    nothing). ``KeyError`` for a row that is not admitted."""
    cfg = manager.config
    page = cfg.page_size
    pool = manager.pool
    pinned = set(manager.pinned_blocks())
    entries = {}  # block -> (scope, tokens) of the prefix index entries that still name it
    for key, (block, (scope, tokens)) in manager._prefix._entries.items():
        if block in pinned and pool.key_of(block) == key and _int_scope(scope):
            entries[block] = (scope, tuple(tokens))
    index, used, regions, order, states = {}, [], {}, [], []
    for row in rows:
        info = manager.describe(row)
        request = manager.request(row)
        refs = []
        for region, blocks, reads in (
                ("self", info.self_blocks[: cfg.pages_for(info.length)],
                 _reads(info.length, cfg.pages_for(info.length), page)),
                ("cross", info.cross_blocks, _reads(info.cross_length, len(info.cross_blocks), page))):
            names = []
            for b, n in zip(blocks, reads, strict=True):
                if b not in index:
                    index[b] = len(order)
                    order.append(b)
                    used.append(0)
                    regions[b] = region
                used[index[b]] = max(used[index[b]], n)
                names.append(index[b])
            refs.append(tuple(names))
        states.append(DecoderRowState(request, info.length, info.cross_length, refs[0], refs[1]))
    pages = []
    for b, n in zip(order, used, strict=True):
        def part(t, n=n, b=b):
            return None if t is None else t.view(torch.uint8)[:, b, :n].cpu().view(t.dtype).clone()

        prefix = entries.get(b) if n == page and regions[b] == "self" else None
        pages.append(DecoderPage(n, part(pool.k_pool), part(pool.v_pool), part(pool.k_scale), part(pool.v_scale),
                                 prefix))
    return DecoderRows(DecoderGeometry.of(cfg, "paged"), pages, states)


def capture_dense(kv) -> DecoderRows:
    """Every row of a ``DenseDecoderKV`` group (either twin), identical pages of a region written once
    (changes nothing)."""
    cfg = kv.config
    page = cfg.page_size
    seen, pages, states = {}, [], []

    def cut(data, scales, b, j, n):
        lo = j * page
        part = [torch.stack([t[b, :, lo : lo + n] for t in data]).transpose(1, 2).contiguous().cpu()]
        if scales is not None:
            part.append(torch.stack([t[b, :, lo : lo + n] for t in scales]).transpose(1, 2).contiguous().cpu())
        return part

    for b in range(kv.batch_size):
        request = DecoderRequest(0, kv.capacity, kv.cross_capacity)
        refs = []
        for region, length, columns in (("self", kv.lengths[b], cfg.pages_for(kv.lengths[b])),
                                        ("cross", kv.cross_lengths[b], cfg.pages_for(kv.cross_capacity))):
            data = (kv.k, kv.v) if region == "self" else (kv.cross_k, kv.cross_v)
            scales = (kv.k_scale, kv.v_scale) if region == "self" else (kv.cross_k_scale, kv.cross_v_scale)
            names = []
            for j, n in enumerate(_reads(length, columns, page)):
                k, *ks = cut(data[0], scales[0], b, j, n)
                v, *vs = cut(data[1], scales[1], b, j, n)
                record = DecoderPage(n, k, v, ks[0] if ks else None, vs[0] if vs else None)
                key = (region, n, _page_bytes(record))
                if key not in seen:
                    seen[key] = len(pages)
                    pages.append(record)
                names.append(seen[key])
            refs.append(tuple(names))
        states.append(DecoderRowState(request, kv.lengths[b], kv.cross_lengths[b], refs[0], refs[1]))
    return DecoderRows(DecoderGeometry.of(cfg, "dense"), pages, states)


# ---- bytes -----------------------------------------------------------------------------------------------


def _page_bytes(p: DecoderPage) -> bytes:
    parts = [tensor_bytes(p.k), tensor_bytes(p.v)]
    if p.k_scale is not None:
        parts += [tensor_bytes(p.k_scale), tensor_bytes(p.v_scale)]
    return b"".join(parts)


def encode_decoder_rows(state: DecoderRows) -> bytes:
    """The decoder rows section's payload (``docs/sessions.md``, kind 5)."""
    g = state.geometry
    parts = [_GEOMETRY.pack(g.num_layers, g.n_kv_head, g.head_dim, g.page_size, MODEL_DTYPE_CODES[g.dtype],
                            KV_FORMAT_CODES[g.kv_cache_dtype], STORAGE_CODES[g.storage], 0, len(state.pages),
                            len(state.rows))]
    for p in state.pages:
        parts.append(_PAGE.pack(p.used, int(p.prefix is not None), 0, 0, 0))
        if p.prefix is not None:
            scope, tokens = p.prefix
            parts.append(struct.pack(f"<qI{len(tokens)}i", scope, len(tokens), *tokens))
        parts.append(_page_bytes(p))
    for r in state.rows:
        q = r.request
        parts.append(_ROW.pack(q.prompt_len, q.max_new_tokens, q.cross_len, r.length, r.cross_length,
                               len(r.self_pages), len(r.cross_pages)))
        names = r.self_pages + r.cross_pages
        parts.append(struct.pack(f"<{len(names)}I", *names))
    return b"".join(parts)


def _decode_geometry(r: Reader) -> tuple[DecoderGeometry, int, int]:
    layers, heads, head_dim, page, dtype, fmt, storage, reserved, num_pages, num_rows = r.unpack(
        _GEOMETRY.format[1:])
    if min(layers, heads, head_dim, page) < 1 or reserved:
        raise SessionError(f"decoder rows section: bad geometry (num_layers {layers}, n_kv_head {heads}, head_dim "
                           f"{head_dim}, page_size {page}, reserved {reserved})")
    if dtype not in MODEL_DTYPES:
        raise SessionError(f"decoder rows section: unknown model dtype code {dtype}")
    if fmt not in KV_FORMATS:
        raise SessionError(f"decoder rows section: unknown K/V format code {fmt} (a page format this build "
                           f"does not know)")
    if storage not in STORAGES:
        raise SessionError(f"decoder rows section: unknown storage code {storage} (1 dense, 2 paged)")
    g = DecoderGeometry(layers, heads, head_dim, page, MODEL_DTYPES[dtype], KV_FORMATS[fmt], STORAGES[storage])
    return g, num_pages, num_rows


def _decode_page(r: Reader, g: DecoderGeometry, budget: int) -> DecoderPage:
    used, published, *reserved = r.unpack(_PAGE.format[1:])
    if used > g.page_size or published > 1 or any(reserved):
        raise SessionError(f"decoder rows section: a page of {used} tokens (page_size {g.page_size}), published "
                           f"byte {published}, reserved {reserved}")
    prefix = None
    if published:
        scope, n = r.unpack("qI")
        if n > budget or n % g.page_size or not n or used != g.page_size:
            raise SessionError(f"decoder rows section: a published page with a prefix of {n} tokens (a positive "
                               f"multiple of page_size {g.page_size}, on a full page)")
        prefix = (scope, tuple(r.unpack(f"{n}i")))
    shape = (g.num_layers, used, g.n_kv_head, g.data_dim)
    size = math.prod(shape) * g.storage_dtype.itemsize
    k, v = (tensor_from(r.take(size), g.storage_dtype, shape) for _ in range(2))
    k_scale = v_scale = None
    if g.kv_cache_dtype is not None:
        sshape = shape[:-1] + tuple(g.scale_plane)
        ssize = math.prod(sshape) * g.scale_dtype.itemsize
        k_scale, v_scale = (tensor_from(r.take(ssize), g.scale_dtype, sshape) for _ in range(2))
        for s in (k_scale, v_scale):  # what append stores (KVFormat.scales_storable: q8_0's d may be +inf)
            if not get_format(g.kv_cache_dtype).scales_storable(s):
                raise SessionError("decoder rows section: a page's scale plane holds a negative, NaN or infinite "
                                   "value that no append stores")
    elif k.is_floating_point() and k.numel() and not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
        raise SessionError("decoder rows section: a page holds NaN or infinite K/V values")
    return DecoderPage(used, k, v, k_scale, v_scale, prefix)


def decode_decoder_rows(raw: bytes) -> DecoderRows:
    """Parse and verify a decoder rows section's payload (``SessionError`` for anything inconsistent)."""
    r = Reader(raw, "decoder rows")
    g, num_pages, num_rows = _decode_geometry(r)
    if num_pages > len(raw) or num_rows > len(raw):  # each record costs bytes: refuse huge counts early
        raise SessionError(f"decoder rows section: {num_pages} pages and {num_rows} rows cannot fit in "
                           f"{len(raw)} bytes")
    pages = [_decode_page(r, g, len(raw)) for _ in range(num_pages)]
    rows = []
    for _ in range(num_rows):
        prompt, new, cross, length, cross_length, n_self, n_cross = r.unpack(_ROW.format[1:])
        names = r.unpack(f"{n_self + n_cross}I")
        request = DecoderRequest(prompt, new, cross)
        rows.append(DecoderRowState(request, length, cross_length, tuple(names[:n_self]), tuple(names[n_self:])))
    r.done()
    state = DecoderRows(g, pages, rows)
    check_rows_state(state)
    return state


def check_rows_state(state: DecoderRows) -> None:
    """The section's own consistency: every row's lengths within its request, its page counts, every
    page it names holding the tokens it reads, each page in one region, every page named."""
    g, pages = state.geometry, state.pages
    page = g.page_size
    region_of = {}
    for i, r in enumerate(state.rows):
        q = r.request
        if not 0 <= r.length <= q.self_tokens or not 0 <= r.cross_length <= q.cross_len:
            raise SessionError(f"decoder rows section: row {i} holds {r.length} tokens and {r.cross_length} cross "
                               f"frames, its request declares {q.self_tokens} and {q.cross_len}")
        want = (-(-r.length // page), -(-q.cross_len // page))
        if (len(r.self_pages), len(r.cross_pages)) != want:
            raise SessionError(f"decoder rows section: row {i} names {len(r.self_pages)} self and {len(r.cross_pages)} "
                               f"cross pages, its lengths need {want[0]} and {want[1]}")
        for region, names, length in (("self", r.self_pages, r.length), ("cross", r.cross_pages, r.cross_length)):
            for j, (p, n) in enumerate(zip(names, _reads(length, len(names), page), strict=True)):
                if p >= len(pages):
                    raise SessionError(f"decoder rows section: row {i} names page {p}, there are {len(pages)}")
                if region_of.setdefault(p, region) != region:
                    raise SessionError(f"decoder rows section: page {p} is named by a self and a cross column")
                if pages[p].used < n:
                    raise SessionError(f"decoder rows section: row {i} reads {n} tokens of page {p} (its {region} "
                                       f"column {j}), the page holds {pages[p].used}")
                if pages[p].prefix is not None and (region != "self" or len(pages[p].prefix[1]) != (j + 1) * page):
                    raise SessionError(f"decoder rows section: published page {p} sits at {region} column {j}, its "
                                       f"prefix has {len(pages[p].prefix[1])} tokens")
        if g.storage == "paged" and len(set(r.self_pages + r.cross_pages)) != len(r.self_pages + r.cross_pages):
            raise SessionError(f"decoder rows section: paged row {i} names one page in two columns")
    unnamed = [p for p in range(len(pages)) if p not in region_of]
    if unnamed:
        raise SessionError(f"decoder rows section: page {unnamed[0]} is named by no row (it would leak a block)")


# ---- checks and restores ----------------------------------------------------------------------------------


def _check_geometry(state: DecoderRows, config: DecoderCacheConfig, storage: str) -> None:
    diffs = state.geometry.differences(DecoderGeometry.of(config, storage))
    if diffs:
        raise SessionError("foreign decoder rows: " + "; ".join(diffs))


def _plan(state: DecoderRows):
    requests = [r.request for r in state.rows]
    published = [(p, page.prefix) for p, page in enumerate(state.pages) if page.prefix is not None]
    return requests, published


def check_paged(state: DecoderRows, manager) -> None:
    """Raise unless ``state`` can be restored into ``manager`` now (changes nothing): geometry and format
    (``SessionError``), then rows, ceilings and blocks with every reservation (``AdmissionError``)."""
    _check_geometry(state, manager.config, "paged")
    requests, published = _plan(state)
    answer = manager.can_restore(requests, [r.self_pages for r in state.rows], [r.cross_pages for r in state.rows],
                                 [r.length for r in state.rows], len(state.pages), [p for p, _ in published])
    if not answer:
        raise AdmissionError(answer.reason)


def restore_paged(state: DecoderRows, manager) -> list[int]:
    """Admit ``state``'s rows into ``manager`` with their pages (checked first: nothing changes on a
    refusal); shared pages are bound as shared references. Returns the new row ids, in order."""
    check_paged(state, manager)
    requests, published = _plan(state)
    rows, blocks = manager.restore_rows(
        requests, [r.self_pages for r in state.rows], [r.cross_pages for r in state.rows],
        [r.length for r in state.rows], [r.cross_length for r in state.rows], len(state.pages), published)
    pool = manager.pool
    for p, b in zip(state.pages, blocks, strict=True):
        for target, saved in ((pool.k_pool, p.k), (pool.v_pool, p.v), (pool.k_scale, p.k_scale),
                              (pool.v_scale, p.v_scale)):
            if target is None:
                continue
            view = target.view(torch.uint8)[:, int(b)]
            view.zero_()  # the positions past ``used`` are never read; zeros, not another stream's bytes
            if p.used:
                view[:, : p.used] = saved.contiguous().view(torch.uint8).to(target.device)
    return rows


def check_dense(state: DecoderRows, config: DecoderCacheConfig, batch: int, capacity: int, cross_capacity: int):
    """Raise ``SessionError`` unless ``state`` is a dense group of ``batch`` rows of these capacities."""
    _check_geometry(state, config, "dense")
    sizes = {(r.request.prompt_len, r.request.self_tokens, r.request.cross_len) for r in state.rows}
    if len(state.rows) != batch or sizes - {(0, capacity, cross_capacity)}:
        raise SessionError(f"decoder rows: {len(state.rows)} dense rows of (prompt, capacity, cross) {sorted(sizes)}, "
                           f"expected {batch} of (0, {capacity}, {cross_capacity})")
    page = config.page_size
    for i, r in enumerate(state.rows):  # a dense buffer ends at its capacity: a page may not run past it
        for names, end in ((r.self_pages, capacity), (r.cross_pages, cross_capacity)):
            for j, p in enumerate(names):
                if j * page + state.pages[p].used > end:
                    raise SessionError(f"decoder rows: row {i}'s page {p} at column {j} holds {state.pages[p].used} "
                                       f"tokens, past the group's capacity of {end}")


def restore_dense(state: DecoderRows, config: DecoderCacheConfig, ops):
    """A new ``ops.DenseDecoderKV`` holding ``state``'s rows (a dense capture), bit for bit."""
    rows = state.rows
    capacity = rows[0].request.self_tokens if rows else 0
    cross_capacity = rows[0].request.cross_len if rows else 0
    check_dense(state, config, len(rows), capacity, cross_capacity)
    kv = ops.DenseDecoderKV(config, len(rows), capacity, cross_capacity)
    page = config.page_size
    for b, r in enumerate(rows):
        for names, data, scales in ((r.self_pages, (kv.k, kv.v), (kv.k_scale, kv.v_scale)),
                                    (r.cross_pages, (kv.cross_k, kv.cross_v), (kv.cross_k_scale, kv.cross_v_scale))):
            for j, p in enumerate(names):
                rec = state.pages[p]
                lo, n = j * page, rec.used
                for layers, saved in ((data[0], rec.k), (data[1], rec.v), (scales[0], rec.k_scale),
                                      (scales[1], rec.v_scale)):
                    if layers is None or not n:
                        continue
                    for layer, t in enumerate(layers):
                        t[b, :, lo : lo + n] = saved[layer].transpose(0, 1).to(t.device)
        kv.lengths[b], kv.cross_lengths[b] = r.length, r.cross_length
    return kv


__all__ = [
    "DecoderGeometry",
    "DecoderPage",
    "DecoderRowState",
    "DecoderRows",
    "capture_dense",
    "capture_paged",
    "check_dense",
    "check_paged",
    "decode_decoder_rows",
    "encode_decoder_rows",
    "restore_dense",
    "restore_paged",
]
