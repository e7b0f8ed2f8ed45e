"""Bench section: the engine's tick, CUDA-graphed against eager (fast twin).

One ``StreamingEngine`` per path over the same steady workload: every stream
holds input for every measured tick, so each tick runs the full cohort. Rows
give the median ms of a whole ``engine.step()`` (model step, commit, readback
and decoding) and of the model step alone (``engine.tick_monitor`` times the
region the graph replaces, synchronising the device at its end), plus what
capture cost: graphs, seconds, MiB. Widths are padded up to powers of two, so a
32-stream pool needs 6 captures (32, 16, 8, 4, 2, 1) rather than one per width.

CUDA only: on the CPU there is nothing to capture and the section says so in
one row.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

from oasr.bench import sync


class _RegionTimer:
    """``engine.tick_monitor`` that times each model step (device-synchronised at its end)."""

    def __init__(self, device):
        self.device = device
        self.times: list[float] = []

    @contextmanager
    def region(self, label):
        sync(self.device)
        start = time.perf_counter()
        yield
        sync(self.device)
        self.times.append((time.perf_counter() - start) * 1e3)


def _engine(streams: int, layers: int, device, graphs: bool):
    from oasr.engine import StreamingEngine
    from oasr.models import ConformerConfig, StreamingConformer

    dtype = torch.bfloat16
    model = StreamingConformer(ConformerConfig(input_dim=80, hidden_dim=256, num_layers=layers, n_head=4, n_kv_head=2,
                                               head_dim=64, ffn_dim=1024, kernel_size=15, vocab_size=256,
                                               chunk_size=16, num_left_chunks=4, subsample_channels=256))
    model = model.to(device=device, dtype=dtype)
    cfg = model.config.cache_config(max_batch_size=streams, block_size_frames=16, device=device, dtype=dtype)
    return StreamingEngine(model, cfg, twin="fast", cuda_graphs=graphs, decoder="greedy")


def _measure(engine, streams: int, ticks: int, warmup: int):
    g = torch.Generator().manual_seed(0)
    frames = engine.chunk_input_frames * (ticks + warmup + 1)
    for sid in range(streams):
        engine.add_stream(sid)
        engine.push(sid, torch.randn(frames, engine.input_dim, generator=g).to(engine.config.dtype))
    for _ in range(warmup):
        engine.step()
    timer = _RegionTimer(engine.config.device)
    engine.tick_monitor = timer
    steps = []
    for _ in range(ticks):
        sync(engine.config.device)
        start = time.perf_counter()
        engine.step()
        sync(engine.config.device)
        steps.append((time.perf_counter() - start) * 1e3)
    return statistics.median(steps), statistics.median(timer.times)


def section(quick: bool, device="cpu") -> list[dict]:
    """This section's rows (``quick``: the reduced grid) on ``device``; see the module docstring."""
    device = torch.device(device)
    if device.type != "cuda":
        return [{"section": "graphs", "case": "skipped", "note": "CUDA graphs need a CUDA device (run --device cuda)"}]
    layers = 4 if quick else 12
    ticks, warmup = (10, 3) if quick else (30, 5)
    rows = []
    for streams in ((1, 8) if quick else (1, 8, 32)):
        eager = _engine(streams, layers, device, graphs=False)
        eager_step, eager_model = _measure(eager, streams, ticks, warmup)
        graphed = _engine(streams, layers, device, graphs=True)
        stats = graphed.model_tick.graph_stats
        graphed_step, graphed_model = _measure(graphed, streams, ticks, warmup)
        rows.append({
            "section": "graphs", "case": f"streams={streams} layers={layers} bf16",
            "eager_step_ms": eager_step, "graphed_step_ms": graphed_step,
            "eager_model_ms": eager_model, "graphed_model_ms": graphed_model,
            "model_speedup": eager_model / graphed_model if graphed_model else None,
            "graphs": stats.num_graphs, "capture_s": stats.capture_seconds,
            "graph_MiB": stats.memory_bytes / 2**20,
        })
        del eager, graphed
    return rows
