"""Reference ``append_kv`` and ``paged_attention``: gather the pages, run plain attention.

This is the oracle. It loops over rows in Python, gathers each row's pages
into a contiguous tensor and runs textbook fp32 attention. Its fast twin is
``oasr.fast.paged_ops`` (vectorised torch on CPU, the CUDA kernels in
``oasr/kernels_cu/`` on a GPU), which must agree with it.

Semantics (see ``oasr.cache.paged`` for the view)::

    append_kv:        row b, frame t < chunk_lens[b]  ->  table position cache_seqlens[b] + t
    paged_attention:  row b, query t < chunk_lens[b] attends to table positions
                      [cache_seqstarts[b], cache_seqlens[b] + chunk_lens[b])
                      (causal=True: only up to cache_seqlens[b] + t, inclusive)

Quantized pages (``cache.quantized``, format ``cache.format``): ``append_kv``
quantizes each written vector with the format's readable rule
(``oasr.kv_formats.<format>.quantize``, e.g. fp8's saturating at the model
dtype's bound) and stores data and scale plane; attention reads dequantized
pages (the reference dequantizes the gathered rows to fp32; the kernels
dequantize per tile) and accumulates in fp32.

Relative-position term (``rel_bias``, a float32 ``(B, n_head, T, R)`` table of queries x
distances; the convention, with its diagram, is ``oasr.cache.rel_bias``)::

    score(b, h, t, p_k) = scale * q[b, h, t] . k[p_k] + rel_bias[b, h, t, (p_q - p_k) + T - 1]
    p_q = cache_seqlens[b] + t (the query's own table position), p_k the key's table position

added in fp32 before masking and the softmax; ``rel_bias=None`` leaves every result unchanged.

Queries past a row's length, and rows with nothing to attend to, get zeros.
Softmax runs in fp32; the output has ``q``'s dtype. GQA: query head ``h`` reads
KV head ``h // (n_head // n_kv_head)``.

Arguments (the table with devices is in ``oasr.cache.paged``; the checks in ``oasr.cache.validate``)::

    q        (B, n_head, T, head_dim)      heads before frames
    k, v     (B, T, n_kv_head, head_dim)   frames before heads
    chunk_lens  (B,) ints in [0, T], or None (every row T)

K, V and q must be in the view's served dtype (the pool's; for fp8 pages the
model dtype): anything else is refused, never cast. A row's chunk may not be
longer than the frames prepared for it (``cache.prepared_frames``, when the
view carries it). A format whose rule refuses NaN (int8, q8_0, affine4) refuses
a NaN in any written frame of K or V. Every check runs before the first write: a
refused call leaves the pool as it was.
"""

from __future__ import annotations

import math

import torch

from oasr.cache.paged import PagedKVCache
from oasr.cache.rel_bias import check_rel_bias, check_rel_bias_columns, host_span
from oasr.cache.validate import check_chunk_lens, check_kv_chunk, check_kv_numbers, check_lens_values, check_query


def _table_slots(cache: PagedKVCache, row: int, start: int, end: int):
    """Physical (block, offset) of table positions ``[start, end)`` of one row."""
    positions = torch.arange(start, end, device=cache.block_table.device)
    blocks = cache.block_table[row, positions // cache.block_size].long()
    return blocks, positions % cache.block_size


def append_kv(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, chunk_lens=None) -> None:
    """Write a cohort's chunk ``k, v`` of shape ``(B, T, n_kv_head, head_dim)`` into the pages.

    ``k``, ``v``: ``(B, T, n_kv_head, head_dim)`` in the served dtype, on the pool's device.
    ``chunk_lens``: ``(B,)`` ints in ``[0, T]`` (None: all ``T``), each at most the row's prepared
    frames. Validates everything, then writes: a ``ValueError`` leaves the pages untouched.
    """
    check_kv_chunk(cache, k, v)
    B, T = k.shape[:2]
    lens = check_chunk_lens(chunk_lens, B, T, k.device)
    check_lens_values("append_kv", cache, lens, T)
    check_kv_numbers("append_kv", cache.format, (("k", k), ("v", v)), lens)  # NaN: refused before K is written
    lens = lens.tolist()
    seqlens = cache.cache_seqlens.tolist()
    for b in range(B):
        n = lens[b]
        blocks, offsets = _table_slots(cache, b, seqlens[b], seqlens[b] + n)
        if cache.quantized:
            fmt = cache.format
            cache.k_cache[blocks, offsets], cache.k_scale[blocks, offsets] = fmt.quantize(k[b, :n], k.dtype)
            cache.v_cache[blocks, offsets], cache.v_scale[blocks, offsets] = fmt.quantize(v[b, :n], v.dtype)
        else:
            cache.k_cache[blocks, offsets] = k[b, :n].to(cache.k_cache.dtype)
            cache.v_cache[blocks, offsets] = v[b, :n].to(cache.v_cache.dtype)


def gather_row(cache: PagedKVCache, row: int, start: int, end: int):
    """Contiguous ``(end - start, n_kv_head, head_dim)`` K and V of one row's table positions
    (fp32 dequantized values for quantized pages)."""
    blocks, offsets = _table_slots(cache, row, start, end)
    k, v = cache.k_cache[blocks, offsets], cache.v_cache[blocks, offsets]
    if cache.quantized:
        k = cache.format.dequantize(k, cache.k_scale[blocks, offsets])
        v = cache.format.dequantize(v, cache.v_scale[blocks, offsets])
    return k, v


def paged_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    chunk_lens=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    rel_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunk attention of queries ``(B, n_head, T, head_dim)`` over each row's own pages.

    ``q``: ``(B, n_head, T, head_dim)`` (heads first, unlike K/V), ``n_head`` a multiple of
    ``n_kv_head``, in the served dtype. ``chunk_lens`` as for ``append_kv``. ``rel_bias``: None, or
    the relative-position term, float32 ``(B, n_head, T, R)`` with ``R >= max(cache_seqlens -
    cache_seqstarts) + 2T - 1`` (``oasr.cache.rel_bias``). Returns ``(B, n_head, T, head_dim)`` in ``q``'s dtype.
    """
    check_query(cache, q)
    B, n_head, T, D = q.shape
    if rel_bias is not None:
        check_rel_bias(cache, q, rel_bias)
    group = n_head // cache.n_kv_head
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    lens = check_chunk_lens(chunk_lens, B, T, q.device)
    check_lens_values("paged_attention", cache, lens, T, what="query frames (q's dim 2)")
    lens = lens.tolist()
    seqlens = cache.cache_seqlens.tolist()
    seqstarts = cache.cache_seqstarts.tolist()
    if rel_bias is not None:
        check_rel_bias_columns(rel_bias, host_span(seqlens, seqstarts), T, "the view's lengths")
    out = torch.zeros_like(q)
    for b in range(B):
        n = lens[b]
        start, end = seqstarts[b], seqlens[b] + n
        if n == 0 or end <= start:
            continue
        k, v = gather_row(cache, b, start, end)  # (L, Hkv, D)
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q[b, :, :n].float() @ k.transpose(1, 2) * scale  # (H, n, L)
        key_pos = torch.arange(start, end, device=q.device)  # p_k, table positions
        query_pos = seqlens[b] + torch.arange(n, device=q.device)  # p_q: where append_kv wrote frame t
        if rel_bias is not None:  # query t reads column (p_q - p_k) + T - 1 of its own table row
            columns = query_pos[:, None] - key_pos[None, :] + (T - 1)  # (n, L)
            scores = scores + rel_bias[b, :, :n].gather(-1, columns.expand(n_head, n, end - start))
        if causal:
            scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        out[b, :, :n] = (torch.softmax(scores, dim=-1) @ v).to(q.dtype)
    return out
