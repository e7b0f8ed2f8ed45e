"""Bench section: the bookkeeping of one streaming tick, reference against fast.

A tick for a cohort of N streams is ``prepare_chunks_batched`` +
``get_paged_caches`` + ``commit_chunks_batched``, eviction included: with
chunk 16 = block 16 and ``num_left_chunks=4`` every stream allocates one block
and evicts one per tick once its window is full. Geometry: 12 layers, 4 KV
heads, head_dim 64, ``max_blocks_per_seq=8`` (a stream holds at most 5 blocks),
one padding lane. Bookkeeping never touches K/V, so the pool behind each
manager is built with 1 KV head of dim 1 in fp16 (same layers, same block
count) to keep 512 streams' worth of pool out of memory; the managers see the
full geometry. Times are medians over steady-state ticks, after the windows
have filled. CPU only: it measures host bookkeeping (on a GPU the fast twin's
device work is asynchronous and the host cost is what bounds a tick).
"""

from __future__ import annotations

import dataclasses

import torch

from oasr.bench import paired_ms
from oasr.cache.config import CacheConfig

STREAMS = (1, 8, 32, 128, 512)
NOTES = (
    "on a CPU device the fast manager writes its persistent tables through numpy views (no staged copy, "
    "no index ops; one stream in Python ints); on CUDA it stages one copy per call; twins timed alternately"
)


def _manager(twin, streams: int):
    cfg = CacheConfig(
        num_layers=12, n_kv_head=4, head_dim=64, chunk_size=16, block_size_frames=16, num_left_chunks=4,
        max_batch_size=streams, max_blocks_per_seq=8, max_num_blocks=streams * 5,
    )
    pool_cfg = dataclasses.replace(cfg, n_kv_head=1, head_dim=1, dtype=torch.float16)
    att = twin.AttentionCacheManager(twin.BlockPool(pool_cfg), cfg, pad_lanes=1)
    ids = list(range(streams))
    for sid in ids:
        att.allocate_stream(sid)
    return att, ids


def _tick(att, ids) -> None:
    att.prepare_chunks_batched(ids)
    att.get_paged_caches(ids)
    att.commit_chunks_batched(ids, 16)


def section_bookkeeping(quick: bool) -> list[dict]:
    """The bookkeeping section's rows (``quick``: fewer repeats); see the module docstring."""
    from oasr import fast, reference

    repeats = 5 if quick else 15
    rows = []
    for streams in STREAMS:
        row = {"section": "bookkeeping", "case": f"streams={streams}"}
        (ref, ref_ids), (fast_att, fast_ids) = _manager(reference, streams), _manager(fast, streams)
        # 6 warm-up ticks fill the 4-chunk window; every measured tick then evicts.
        for _ in range(5):
            _tick(ref, ref_ids)
            _tick(fast_att, fast_ids)
        row["reference_ms"], row["fast_ms"] = paired_ms(
            lambda a=ref, i=ref_ids: _tick(a, i), lambda a=fast_att, i=fast_ids: _tick(a, i), repeats=repeats
        )
        for att, ids in ((ref, ref_ids), (fast_att, fast_ids)):
            assert att.describe(ids[0]).cache_seqlen == 64  # steady state reached
        rows.append(row)
    return rows
