"""The fast twin's CPU row loop for ``append_kv`` / ``paged_attention``: one small pass per row.

It must agree with ``oasr.reference.paged_ops`` (same semantics, checked by the
same tests as the vectorised path in ``oasr.fast.paged_ops``). On a CPU the
vectorised path pays ~50 torch ops per call whatever the cohort, plus a padded
key axis and a gather into memory that is new on every call; the row loop pays
a few ops per row over exactly that row's keys, read in place. So
``paged_ops`` dispatches by size (``use_row_loop``): few rows, or long spans,
take the row loop; many short rows take the vectorised tiles.

What makes it cheaper than the reference's own per-row loop:

* the physical slot of every table position of every row comes from one
  broadcast (``block_table * block_size + offset``), computed once per call,
  instead of an ``arange``, a division and a gather per row;
* a row's K and V are read with ``index_select`` straight into a per-thread
  workspace (``_Workspace``) that is allocated once and reused, so a steady
  tick touches the same, already mapped memory;
* GQA needs no ``repeat_interleave``: the ``G`` query heads of a KV head are
  stacked along the query axis, ``(Hkv, G * T, D)``, and attend together;
* no transposing copies: the ``bmm`` calls read K and V as ``(Hkv, span, D)``
  views of the gathered rows (row stride ``Hkv * D``), queries where they are.

Only pages in the model dtype; fp8 pages take the vectorised path.
"""

from __future__ import annotations

import threading

import torch

from oasr.cache.paged import PagedKVCache

# Dispatch rule (measured with ``python -m oasr bench`` on a 2-core CPU, fp32, 12 layers, head_dim 64):
# the row loop wins for up to ROW_LOOP_MAX_ROWS rows at any history, and for any number of rows
# once the mean key span reaches ROW_LOOP_MIN_SPAN (a row's own keys stay in cache; the tiles'
# padded gathers do not).
ROW_LOOP_MAX_ROWS = 16
ROW_LOOP_MIN_SPAN = 128


def use_row_loop(cache: PagedKVCache, rows: int, num_frames: int) -> bool:
    """Whether a call over ``rows`` rows takes the row loop (host-known sizes only; no read)."""
    if cache.quantized or not (cache.k_cache.is_contiguous() and cache.v_cache.is_contiguous()):
        return False
    mean_span = cache.max_span + num_frames  # the view's host maximum: an upper bound per row
    return rows <= ROW_LOOP_MAX_ROWS or mean_span >= ROW_LOOP_MIN_SPAN


class _Workspace(threading.local):
    """Per-thread scratch buffers by (dtype, name), grown to the largest request and then reused.

    The row loop asks for what its table can address (a fixed size per geometry), so its
    buffers never move once the first call has run; the tiles' gathers ask for the tile's
    size and may grow while the spans grow (they are not used under graph capture: CUDA runs
    the kernels)."""

    def __init__(self):
        self.buffers: dict[tuple[torch.dtype, str], torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        key = (dtype, name)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1 << 16), dtype=dtype)
            self.buffers[key] = buf
        return buf[:numel]


_workspace = _Workspace()


def gather_vectors(k_cache: torch.Tensor, v_cache: torch.Tensor, vector: torch.Tensor, shape: tuple):
    """K and V vectors ``vector`` (rows of ``cache.reshape(-1, head_dim)``) gathered into workspace
    buffers of ``shape``; valid until this thread's next gather. Used by the vectorised tiles."""
    numel = vector.numel() * k_cache.shape[-1]
    k = _workspace.take(numel, k_cache.dtype, "tile_k").view(shape)
    v = _workspace.take(numel, v_cache.dtype, "tile_v").view(shape)
    D = k_cache.shape[-1]
    torch.index_select(k_cache.reshape(-1, D), 0, vector, out=k.view(-1, D))
    torch.index_select(v_cache.reshape(-1, D), 0, vector, out=v.view(-1, D))
    return k, v


def workspace_storages() -> set[int]:
    """Storage addresses of this thread's workspace buffers (for tests)."""
    return {t.untyped_storage().data_ptr() for t in _workspace.buffers.values()}


_OFFSETS: dict[int, torch.Tensor] = {}  # block size -> arange(block_size), int64 (made once, read only)


def _plan(cache: PagedKVCache):
    """The view's ``HostPlan`` when it still describes the view's tensors, else None (``oasr.cache.paged``)."""
    plan = cache.host
    return plan if plan is not None and plan.describes(cache) else None


def _host_rows(cache: PagedKVCache) -> tuple[list[int], list[int]]:
    """``(cache_seqlens, cache_seqstarts)`` as lists of ints: the plan's, else read from the tensors."""
    plan = _plan(cache)
    if plan is not None:
        return plan.seqlens, plan.seqstarts
    return cache.cache_seqlens.tolist(), cache.cache_seqstarts.tolist()


def _memo(cache: PagedKVCache, key, make):
    """``make()``, kept in the view's plan under ``key`` for the cohort's other layers (if it has one)."""
    plan = _plan(cache)
    return make() if plan is None else plan.memo(key, make)


def _slots(cache: PagedKVCache, end: int) -> torch.Tensor:
    """(B, ceil(end / block_size) * block_size) int64: the physical slot of every table position
    below ``end`` (rounded up to whole blocks) of every row, in one broadcast (once per cohort when
    the view has a plan)."""
    return _memo(cache, ("slots", -(-end // cache.block_size)), lambda: _table_slots(cache, end))


def _table_slots(cache: PagedKVCache, end: int) -> torch.Tensor:
    bs = cache.block_size
    offsets = _OFFSETS.get(bs)
    if offsets is None:
        offsets = _OFFSETS[bs] = torch.arange(bs, dtype=torch.int64)
    columns = min(cache.block_table.shape[1], -(-end // bs))
    table = cache.block_table[:, :columns, None]
    return torch.add(offsets, table, alpha=bs).view(table.shape[0], -1)  # int32 table promotes to int64


def planned_decode_step(cache: PagedKVCache, B: int, T: int, chunk_lens) -> bool:
    """Whether a call is one decode step of a planned cohort: one frame for every one of ``B > 1`` rows
    (``chunk_lens`` None), over a view with a ``HostPlan`` whose rows all have a prepared frame, on
    contiguous model-dtype pages (asked once per cohort). Such a call skips the per-row length checks
    (the plan answered them) and goes to ``append_kv_rows`` / ``attend_decode_batch`` directly."""
    if T != 1 or B < 2 or chunk_lens is not None:
        return False
    plan = _plan(cache)
    return plan is not None and plan.memo("decode step", lambda: _decode_ready(cache))


def _decode_ready(cache: PagedKVCache) -> bool:
    prepared = cache.prepared_frames
    return (not cache.quantized and cache.k_cache.is_contiguous() and cache.v_cache.is_contiguous()
            and (prepared is None or (len(prepared) == cache.batch_size and min(prepared) >= 1)))


def _step_slots(cache: PagedKVCache) -> torch.Tensor:
    """(B,) int64: the physical slot of each row's table position ``cache_seqlens[b]``."""
    seqlens = _host_rows(cache)[0]
    return _slots(cache, max(seqlens) + 1).gather(1, cache.cache_seqlens.long()[:, None]).view(-1)


def append_kv_rows(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> None:
    """Write row ``b``'s first ``lens[b]`` frames at table positions ``cache_seqlens[b] + t``."""
    B, T = k.shape[:2]
    k_flat = cache.k_cache.view(-1, *cache.k_cache.shape[2:])
    v_flat = cache.v_cache.view(-1, *cache.v_cache.shape[2:])
    if k.dtype != k_flat.dtype:
        k, v = k.to(k_flat.dtype), v.to(v_flat.dtype)
    if T == 1 and B > 1 and all(lens):  # a decode step: one slot per row (the cohort's, with a plan)
        dest = _memo(cache, "step_slots", lambda: _step_slots(cache))
        k_flat.index_copy_(0, dest, k.reshape(B, *k.shape[2:]))
        v_flat.index_copy_(0, dest, v.reshape(B, *v.shape[2:]))
        return
    seqlens = _host_rows(cache)[0]
    slots = _slots(cache, max(s + n for s, n in zip(seqlens, lens, strict=True)))
    if all(n == T for n in lens):
        dest = slots[0, seqlens[0] : seqlens[0] + T]
        if B > 1:
            dest = torch.cat([slots[b, seqlens[b] : seqlens[b] + T] for b in range(B)])
        k_flat.index_copy_(0, dest, k.reshape(B * T, *k.shape[2:]))
        v_flat.index_copy_(0, dest, v.reshape(B * T, *v.shape[2:]))
        return
    for b in range(B):
        n = lens[b]
        if n:
            dest = slots[b, seqlens[b] : seqlens[b] + n]
            k_flat.index_copy_(0, dest, k[b, :n])
            v_flat.index_copy_(0, dest, v[b, :n])


def attend_rows(q: torch.Tensor, cache: PagedKVCache, lens: list[int], scale: float, causal: bool,
                rel_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row ``b``'s first ``lens[b]`` queries attend to table positions ``[seqstart, seqlen + lens[b])``
    (``rel_bias``: plus the relative-position term, ``oasr.cache.rel_bias``)."""
    B, H, T, D = q.shape
    Hkv = cache.n_kv_head
    G = H // Hkv
    seqlens, starts = _host_rows(cache)
    slots = _slots(cache, max(s + n for s, n in zip(seqlens, lens, strict=True)))
    k_flat, v_flat = cache.k_cache.view(-1, Hkv, D), cache.v_cache.view(-1, Hkv, D)
    full = all(n == T and seqlens[b] + n > starts[b] for b, n in enumerate(lens))
    # contiguous whatever q's strides; rows with nothing to attend to get zeros
    out = (torch.empty if full else torch.zeros)(q.shape, dtype=q.dtype)
    fp32 = q.dtype == torch.float32 and k_flat.dtype == torch.float32
    # sized by what the table can address, not by this call's spans: the workspace is allocated
    # once per geometry and a later call never swaps it for a bigger one (a captured graph, or
    # a stand-in for one, keeps reading the same storage)
    # (taken before the loop, so that even a call whose rows all skip touches the same buffers)
    capacity = cache.block_table.shape[1] * cache.block_size * Hkv * D
    k_work, v_work = _workspace.take(capacity, k_flat.dtype, "k"), _workspace.take(capacity, v_flat.dtype, "v")
    for b in range(B):
        n = lens[b]
        start, end = starts[b], seqlens[b] + n
        if n == 0 or end <= start:
            continue
        span = end - start
        rows = slots[b, start:end]
        k = k_work[: span * Hkv * D].view(span, Hkv, D)
        v = v_work[: span * Hkv * D].view(span, Hkv, D)
        torch.index_select(k_flat, 0, rows, out=k)
        torch.index_select(v_flat, 0, rows, out=v)
        # (Hkv, span, D) views with row stride Hkv * D: BLAS reads them in place, no transposing copy
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        qb = q[b] if n == T else q[b, :, :n]
        if not fp32:  # compute in fp32 (float() copies fp16/bf16)
            k, v, qb = k.float(), v.float(), qb.float()
        qb = qb.reshape(Hkv, G * n, D)  # query head h = kv_head * G + g, rows (g, t)
        scores = torch.bmm(qb, k.transpose(1, 2)).mul_(scale)  # (Hkv, G * n, span)
        if rel_bias is not None:  # query t, key start + j: column (seqlen + t) - (start + j) + T - 1
            columns = _row_columns(seqlens[b] - start + T - 1, n, span)
            scores += rel_bias[b, :, :n].gather(2, columns.expand(H, n, span)).view(Hkv, G * n, span)
        if causal:  # query t (position seqlen + t) sees keys up to its own position
            hidden = torch.arange(start, end)[None, :] > (seqlens[b] + torch.arange(n))[:, None]  # (n, span)
            scores.view(Hkv, G, n, span).masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(-1)
        if fp32 and n == T:
            torch.bmm(probs, v, out=out[b].view(Hkv, G * T, D))  # straight into the output row
        else:
            out[b, :, :n] = torch.bmm(probs, v).view(H, n, D)
    return out


def _row_columns(first: int, n: int, span: int) -> torch.Tensor:
    """(n, span) int64 table columns of a row: ``first + t - j`` (query t, the row's j-th key)."""
    return (torch.arange(first, first + n)[:, None] - torch.arange(span)[None, :])


# Decode steps (one query frame per row) over short spans: one batched pass for all rows beats the
# row loop's few ops per row once there are several rows (a beam, a batch of decoder rows).
DECODE_BATCH_MIN_ROWS = 2
DECODE_BATCH_MAX_SPAN = 128


def use_decode_batch(cache: PagedKVCache, rows: int, num_frames: int) -> bool:
    """Whether a call takes ``attend_decode_batch`` (host-known sizes only; no read)."""
    return (num_frames == 1 and rows >= DECODE_BATCH_MIN_ROWS and not cache.quantized
            and cache.max_span + 1 <= DECODE_BATCH_MAX_SPAN)


def attend_decode_batch(q: torch.Tensor, cache: PagedKVCache, lens: list[int], scale: float,
                        causal: bool, rel_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``attend_rows`` for one query frame per row (``T == 1``), all rows in one pass.

    Every row's keys ``[seqstart, seqlen + 1)`` are gathered into a padded ``(B, Hkv, L, D)``: one
    ``index_select`` each for K and V over the pool's ``(slot, kv head)`` vectors, so they land in
    the layout the batched matmuls read (no transposing copy); padding keys are masked out of the
    scores and zeroed in V (the pool may hold NaN there, and 0 * NaN is NaN); a row with no key
    (its length 0, or nothing in range) gets zeros, like the reference. With one query at position
    ``seqlen``, causal and non-causal read the same keys. The row bounds are host numbers (the
    view's lengths read once), so no other value is read back.
    """
    seqlens, starts = _host_rows(cache)
    ends = tuple(s + n if n else 0 for s, n in zip(seqlens, lens, strict=True))  # a row without its query: no keys
    # (no key anywhere still reads one masked column: the same tensors are read whatever the lengths,
    # as a kernel reads its arguments, which a stand-in for graph capture checks on the CPU)
    L = max(max(ends), 1)
    vector, hidden, keyless = _memo(cache, ("decode", ends), lambda: _decode_indices(cache, ends, starts, L))
    bias = None
    if rel_bias is not None:  # the one query sits at seqlen (T == 1): key j (table position j) reads column seqlen - j
        columns = (cache.cache_seqlens.long()[:, None] - torch.arange(L)[None, :]).clamp_(0, rel_bias.shape[3] - 1)
        bias = rel_bias[:, :, 0].gather(2, columns[:, None].expand(-1, q.shape[1], L))  # (B, H, L); hidden: masked
    return attend_gathered(q, cache.k_cache, cache.v_cache, vector, hidden, keyless, scale, bias)


def attend_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, vector: torch.Tensor,
                    hidden: torch.Tensor | None, keyless: torch.Tensor | None, scale: float,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The compute of ``attend_decode_batch``: one query per row ``q (B, H, 1, D)`` over the pool
    vectors ``vector (B * Hkv * L,)`` (row, KV head, key), ``hidden (B, L)`` the padding keys (None:
    none) and ``keyless (B, 1, 1, 1)`` the rows with no key (None: none), as ``_decode_indices``
    builds them; ``bias`` (B, H, L) fp32, added to the scaled scores before the mask (None: none).
    Also the body of the fast decoder manager's host decode step."""
    B, H, T, D = q.shape
    Hkv = k_cache.shape[-2]
    G = H // Hkv
    L = vector.numel() // (B * Hkv)
    k = k_cache.view(-1, D).index_select(0, vector).view(B * Hkv, L, D)
    v = v_cache.view(-1, D).index_select(0, vector).view(B * Hkv, L, D)
    if k.dtype != torch.float32:
        k, v = k.float(), v.float()
    if hidden is not None:
        v.view(B, Hkv, L, D).masked_fill_(hidden[:, None, :, None], 0.0)  # NaN-safe: zeros, not 0 * NaN
    qf = q.float().reshape(B * Hkv, G, D)  # query head h = kv_head * G + g
    scores = torch.baddbmm(_NO_BIAS, qf, k.transpose(1, 2), beta=0.0, alpha=scale).view(B, Hkv, G, L)
    if bias is not None:
        scores += bias.view(B, Hkv, G, L)
    if hidden is not None:
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    if keyless is not None:  # no key: zeros
        probs.masked_fill_(keyless, 0.0)
    out = torch.bmm(probs.view(B * Hkv, G, L), v)  # (B * Hkv, G, D)
    return out.view(B, H, 1, D).to(q.dtype)


def _decode_indices(cache: PagedKVCache, ends: tuple, starts: list[int], L: int) -> tuple:
    """``attend_decode_batch``'s index tensors, a function of the table and the rows' key ranges alone
    (so the cohort's layers share them): the ``(B * Hkv * L,)`` pool vectors to gather, the ``(B, L)``
    padding keys (None when every row has ``L`` keys from 0) and the ``(B, 1, 1, 1)`` rows with no key
    (None when every row has one)."""
    Hkv = cache.n_kv_head
    slots = _slots(cache, L)[:, :L]  # (B, L) physical slots; columns past a row's table are masked below
    heads = _HEADS.get(Hkv)
    if heads is None:
        heads = _HEADS[Hkv] = torch.arange(Hkv, dtype=torch.int64)[None, :, None]
    vector = torch.add(heads, slots[:, None, :], alpha=Hkv).view(-1)  # (B, Hkv, L) pool vectors
    hidden = keyless = None  # (B, L) padding keys, when a row has fewer than L keys
    if min(ends) < L or any(starts):
        key = torch.arange(L)  # fresh, not cached per L: a stand-in capture must see the same storages
        hidden = key[None, :] >= torch.tensor(ends)[:, None]
        if any(starts):
            hidden |= key[None, :] < cache.cache_seqstarts.long()[:, None]
        if any(e <= s for e, s in zip(ends, starts, strict=True)):
            keyless = hidden.all(dim=1)[:, None, None, None]
    return vector, hidden, keyless


_NO_BIAS = torch.zeros(1, 1, 1)  # baddbmm's input, ignored (beta=0): the scores are scale * q @ k^T alone
_HEADS: dict[int, torch.Tensor] = {}  # n_kv_head -> arange, shaped (1, Hkv, 1) (made once, read only)
