"""Bench section: per-chunk cost against stream length, paged (eviction on) against dense.

One stream of the demo's model at a growing position in its audio, from 10 s
to 30 min (40 ms encoder frames):

* ``reference_ms`` column = dense: ``forward_chunk`` with unlimited history,
  WeNet's concatenation; its cache holds every frame so far, so each chunk
  copies and attends over all of them;
* ``fast_ms`` column = paged: ``prepare_chunk`` + ``forward_chunk_paged`` +
  ``commit_chunk_paged`` through the fast twin (the reference if the fast twin
  is not there), ``num_left_chunks = 4``; the stream really is at that
  position: the manager was advanced chunk by chunk, evicting as it went.

The paged cost stays flat because the window bounds what a chunk reads; the
dense cost grows with the stream. ``ratio`` = dense / paged. The section runs
on one intra-op thread (restored afterwards): with multi-threaded kernels a
shared CPU made these small ops vary by 10-100x between runs. No test times this.
"""

from __future__ import annotations

import torch

from oasr.bench import median_ms
from oasr.models import ConformerConfig, StreamingConformer, twin_module, twin_ready

FRAME_SECONDS = 0.04  # one encoder frame
LEFT_CHUNKS = 4


def demo_sized_model(num_left_chunks: int) -> StreamingConformer:
    """The demo's model (2 layers, hidden 64, chunk 16, seed 0) with the given attention window."""
    return StreamingConformer(ConformerConfig(input_dim=40, hidden_dim=64, num_layers=2, n_head=4, n_kv_head=2,
                                              head_dim=16, ffn_dim=128, kernel_size=15, vocab_size=64,
                                              chunk_size=16, num_left_chunks=num_left_chunks, subsample_channels=64))


def _label(frames: int) -> str:
    seconds = frames * FRAME_SECONDS
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.0f} min"


class PagedStream:
    """One stream of ``model`` on a twin's managers, advanced by bookkeeping alone to any position.

    ``advance_to(frames)`` commits unwritten chunks until the stream is at ``frames`` (its window's
    pages hold whatever they held); ``chunk()`` then runs one real chunk: prepare, the paged forward,
    commit. ``att`` is the stream's ``AttentionCacheManager`` (stream id 0).
    """

    def __init__(self, model, twin):
        self.model, self.ops = model, twin_module(twin)
        self.cfg = model.config.cache_config(max_batch_size=1)
        self.pool = self.ops.BlockPool(self.cfg)
        self.att = self.ops.AttentionCacheManager(self.pool, self.cfg)
        self.cnn = self.ops.CnnCacheManager(self.cfg)
        self.states = self.ops.SlotStateCache(model.streaming_state_specs, 1)
        for manager in (self.att, self.cnn, self.states):
            manager.allocate_stream(0)
        self.offset = 0
        g = torch.Generator().manual_seed(0)
        self.xs = torch.randn(1, model.config.chunk_input_frames, model.config.input_dim, generator=g)

    def advance_to(self, frames: int) -> None:
        """Commit (unwritten) chunks until the stream is at ``frames``: the window's pages hold old values."""
        chunk = self.cfg.chunk_size
        while self.offset + chunk <= frames:
            self.att.prepare_chunk(0)
            self.att.commit_chunk_paged(0, chunk)
            self.offset += chunk

    def chunk(self) -> None:
        """Run one chunk of the stream through the paged model: prepare, forward, commit."""
        self.att.prepare_chunk(0)
        caches = self.att.get_paged_caches([0])
        _, lens, new_cnn = self.model.forward_chunk_paged(self.xs, [self.offset], caches, self.cnn.get_cache([0]),
                                                          self.states.views([0]), twin=self.ops)
        self.att.commit_chunk_paged(0, int(lens[0]))
        self.cnn.update([0], new_cnn)
        self.offset += int(lens[0])


def section(quick: bool) -> list[dict]:
    """This section's rows (``quick``: the reduced grid), timed on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _rows(quick)
    finally:
        torch.set_num_threads(threads)


def _rows(quick: bool) -> list[dict]:
    minutes = 60 / FRAME_SECONDS
    lengths = [250, int(minutes), int(10 * minutes)] if quick else \
        [250, int(minutes), int(5 * minutes), int(10 * minutes), int(30 * minutes)]
    repeats = 5 if quick else 9
    twin = "fast" if twin_ready("fast") else "reference"
    dense_model, paged_model = demo_sized_model(-1), demo_sized_model(LEFT_CHUNKS)
    cfg = dense_model.config
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(1, cfg.chunk_input_frames, cfg.input_dim, generator=g)
    cnn = torch.zeros(cfg.num_layers, 1, cfg.kernel_size - 1, cfg.hidden_dim)
    states = dense_model.new_states(1)
    paged = PagedStream(paged_model, twin)
    for _ in range(3):  # first calls build kernels and allocator pools; keep them out of every row
        dense_model.forward_chunk(xs, 0, -1, torch.zeros(cfg.num_layers, cfg.n_kv_head, 0, 2 * cfg.head_dim), cnn,
                                  states)
        paged.chunk()
    rows = []
    for frames in lengths:
        att_cache = 0.1 * torch.randn(cfg.num_layers, cfg.n_kv_head, frames, 2 * cfg.head_dim, generator=g)
        dense_ms = median_ms(lambda f=frames, a=att_cache: dense_model.forward_chunk(xs, f, -1, a, cnn, states),
                             repeats=repeats, warmup=2)
        paged.advance_to(frames)
        paged_ms = median_ms(paged.chunk, repeats=repeats, warmup=2)
        rows.append({
            "section": "stream_cost",
            "case": f"at {_label(frames)} ({frames} frames)",
            "reference_ms": dense_ms,
            "fast_ms": paged_ms,
            "dense_history": frames,
            "paged_history": paged.att.cached_frames(0),
            "note": f"reference_ms=dense forward_chunk, unlimited history; fast_ms=paged ({twin} twin), "
                    f"num_left_chunks={LEFT_CHUNKS}; 1 thread",
        })
    return rows
