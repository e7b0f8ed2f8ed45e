"""Memory utilisation of a finished engine run, in the manner of the vLLM paper.

At the tick of peak pool occupancy we count *live* K/V frames: every frame an
active stream's attention can still read (``cache_seqlens - cache_seqstarts``,
plus the chunk in flight; a prefilled zero window counts, since it is read).
Two ways of holding them are compared:

* paged: the blocks actually allocated from the shared pool
  (``used_blocks * block_size_frames``);
* contiguous: one buffer per active stream, pre-allocated for the longest
  stream's worst case (the most K/V frames any stream of the run ever attended
  to at once), as a cache without paging has to reserve up front.

Utilisation is live frames over reserved frames; bytes are frames times
``bytes_per_kv_block / block_size_frames``.
"""

from __future__ import annotations

from oasr.cache.memory import bytes_per_kv_block


def memory_utilisation(engine) -> dict:
    """Live K/V against paged and per-stream contiguous storage at the run's peak pool occupancy (a dict;
    ``ValueError`` before any block was held).
    """
    cfg = engine.config
    busy = [s for s in engine.stats if s.used_blocks]
    if not busy:
        raise ValueError("memory_utilisation: the engine has not held any block yet")
    peak = max(busy, key=lambda s: (s.used_blocks, s.live_frames))
    bs = cfg.block_size_frames
    frame_bytes = bytes_per_kv_block(cfg) // bs
    longest = engine.longest_extent
    paged_frames = peak.used_blocks * bs
    contiguous_frames = peak.active * longest
    return {
        "tick": peak.tick,
        "active_streams": peak.active,
        "live_frames": peak.live_frames,
        "live_bytes": peak.live_frames * frame_bytes,
        "paged_blocks": peak.used_blocks,
        "paged_frames": paged_frames,
        "paged_bytes": paged_frames * frame_bytes,
        "paged_utilisation": peak.live_frames / paged_frames,
        "longest_stream_frames": longest,
        "contiguous_frames": contiguous_frames,
        "contiguous_bytes": contiguous_frames * frame_bytes,
        "contiguous_utilisation": peak.live_frames / contiguous_frames if contiguous_frames else 0.0,
        "pool_blocks": cfg.max_num_blocks,
    }
