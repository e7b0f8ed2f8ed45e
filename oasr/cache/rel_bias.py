"""The relative-position term of ``paged_attention`` (``rel_bias=``): its convention and its checks.

A Transformer-XL style encoder (Nemotron's FastConformer) adds to every attention score a term
that depends on the query and on the *distance* between the query's frame and the key's frame,
not on the key's content. It arrives as a small per-head table, queries x distances, never as a
dense queries x keys bias::

    rel_bias    (B, n_head, T, R) float32     B = the view's rows, T = q's query frames (q's dim 2)

    score(b, h, t, p_k) = scale * (q[b, h, t] . k[p_k])  +  rel_bias[b, h, t, (p_q - p_k) + (T - 1)]
                          (fp32; added after the softmax scale, before masking and the softmax)

Positions are the *table positions* the cache already uses for keys (``oasr.paged``,
``oasr.config``): query ``t`` of row ``b`` sits at ``p_q = cache_seqlens[b] + t`` (where
``append_kv`` wrote its key), and the keys it sees are ``p_k`` in ``[cache_seqstarts[b],
cache_seqlens[b] + chunk_lens[b])`` (causal: ``p_k <= p_q``)::

    row b, T = 4 frames in the chunk, s = cache_seqstarts[b], n = cache_seqlens[b]

    table position p_k:  s     s+1    ...    n-1 | n     n+1   n+2   n+3
                         [ history (the window)  ][ this chunk (append_kv wrote it) ]
    query t (p_q):                                 t=0   t=1   t=2   t=3   (p_q = n + t)

    distance  d = p_q - p_k        query t=0: from n - s (key s)  down to -3 (key n+3)
                                   query t=3: from n - s + 3      down to  0 (key n+3)
    column    c = d + (T - 1)      in [0, (n - s) + 2T - 2]

                           c:  0     1     2     3    ...   (n - s) + 2T - 2
                           d: -3    -2    -1     0    ...   (n - s) + T - 1
                               keys ahead of the     the query's   the oldest key of the window,
                               query (non-causal)    own frame     seen by the last query

So column ``T - 1`` is distance 0 (a query and its own frame), lower columns are keys ahead of
the query inside the chunk (a lookahead chunk; never read with ``causal=True``), higher columns
reach back into the history. The table needs ``R >= max_b(cache_seqlens[b] - cache_seqstarts[b])
+ 2T - 1`` columns (``required_columns``); a shorter one is a ``ValueError`` naming the need.

Distances do not move when the cache does: eviction shifts a row's table left by whole blocks and
drops ``cache_seqlens`` and ``cache_seqstarts`` by the same amount, so ``p_q - p_k`` of a given
pair of frames is unchanged. A prefilled window (``CacheConfig.prefill_kv_window``) counts as
frames like any other: at admission ``cache_seqlens = W`` and the zeroed window sits at positions
``[0, W)``, distances ``W + t`` down to ``t + 1`` from query ``t``; every stream of a cohort then
has the same ``n - s`` (``W``), which is what lets one table serve the whole cohort.

What is read, and what is not: only the entries of valid queries (``t < chunk_lens[b]``) at the
columns of the keys they see. Entries of queries past a row's chunk and columns outside a
query's window are never read (they may hold anything, NaN included). Masked keys stay masked:
the term never unmasks a key, and a row with no key still gets zeros. The term is independent of
the page format (model dtype, fp8 and the other quantized formats alike).

Who checks what (the same words in both twins): shape, dtype and device always; the column count
against the rows' real widest history wherever their lengths are on the host (the reference, the
fast twin's CPU backends, a view with a ``HostPlan``). On CUDA the fast twin reads no lengths
(no device sync); it holds the table to the view's ``max_span`` instead, the host maximum every
view carries (the engine's captured ticks pin it to the worst case), so a table of
``required_columns(view.max_span, T)`` columns passes everywhere. If a stale ``max_span`` lets a
short table by anyway, the kernels give NaN to each query whose window needs a missing column:
never an out-of-bounds read, never a silent clamp.

Kernels: attention v1 (every dtype and page format) and v3 (fp16 / bf16 queries, model-dtype and
fp8 pages) have instances with the term (``oasr.fast.kernels.registry.REL_ARG``); v2 has none and
refuses it by name. ``python -m oasr kernels --sass`` reports those instances as ``v1+rel`` and
``v3+rel``; ``kernels --gaps`` states the coverage.
"""

from __future__ import annotations

import torch

from oasr.cache.validate import same_device


def required_columns(max_span: int, num_frames: int) -> int:
    """Columns ``R`` a table needs for rows whose widest history is ``max_span`` (``cache_seqlens -
    cache_seqstarts``, at least 0) and chunks of ``num_frames`` queries: ``max_span + 2T - 1`` (0 for T = 0)."""
    if num_frames <= 0:
        return 0
    return max(int(max_span), 0) + 2 * int(num_frames) - 1


def check_rel_bias(cache, q: torch.Tensor, rel_bias) -> None:
    """Shape, dtype and device of ``rel_bias`` (``q`` already checked): a float32 ``(B, n_head, T, R)``
    tensor on ``q``'s device. ``ValueError`` naming what was expected and what came."""
    B, H, T, _ = q.shape
    if not isinstance(rel_bias, torch.Tensor):
        raise ValueError(f"paged_attention: rel_bias must be None or a float32 tensor (B={B}, n_head={H}, T={T}, R), "
                         f"got {type(rel_bias).__name__}")
    if rel_bias.dim() != 4 or tuple(rel_bias.shape[:3]) != (B, H, T):
        raise ValueError(f"paged_attention: rel_bias must be (B={B}, n_head={H}, T={T}, R) (queries x distances, "
                         f"see oasr.cache.rel_bias), got {tuple(rel_bias.shape)}")
    if rel_bias.dtype != torch.float32:
        raise ValueError(f"paged_attention: rel_bias must be float32, got {rel_bias.dtype}; convert it before the call")
    if not same_device(rel_bias.device, q.device):
        raise ValueError(f"paged_attention: rel_bias is on {rel_bias.device}, q on {q.device}")


def check_rel_bias_columns(rel_bias: torch.Tensor, max_span: int, num_frames: int, known: str) -> None:
    """``rel_bias``'s ``R`` against ``required_columns(max_span, num_frames)``; ``known`` says where
    ``max_span`` came from (for the message)."""
    need = required_columns(max_span, num_frames)
    R = rel_bias.shape[3]
    if R < need:
        raise ValueError(
            f"paged_attention: rel_bias has R={R} distance columns, but this cohort needs R >= {need}: the widest "
            f"history max(cache_seqlens - cache_seqstarts)={max(int(max_span), 0)} ({known}) + 2T - 1 with "
            f"T={num_frames} (column (p_q - p_k) + T - 1, see oasr.cache.rel_bias)"
        )


def host_span(seqlens, seqstarts) -> int:
    """``max(seqlens - seqstarts)`` over the rows (0 for none), from host sequences of ints."""
    return max((a - b for a, b in zip(seqlens, seqstarts, strict=True)), default=0)


def columns_of(seqlens: torch.Tensor, num_frames: int, query_frames: int, key_pos: torch.Tensor) -> torch.Tensor:
    """The column of each (query, key) pair: ``(seqlens + t) - key_pos + (T - 1)`` broadcast, int64.

    ``seqlens``: ``(...,)`` query row positions (``cache_seqlens``); ``num_frames``: queries per row
    (``t`` in ``[0, num_frames)``); ``query_frames``: ``T`` (q's dim 2); ``key_pos``: ``(..., L)``
    table positions of the keys. Returns ``(..., num_frames, L)``."""
    t = torch.arange(num_frames, device=key_pos.device)
    query_pos = seqlens.long()[..., None] + t  # (..., n)
    return query_pos[..., :, None] - key_pos.long()[..., None, :] + (query_frames - 1)
