"""The graphed engine on a real GPU: equal to eager bit for bit, and a model step with no host sync.

Marked ``cuda`` and skipped without a device (``tools/gpu_check.sh DIR`` runs them).
The CPU counterparts are tests/test_capture_safety.py (the same region, checked
op by op) and tests/test_graph_runner.py (the runner's bookkeeping).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from oasr.engine import StreamingEngine
from oasr.engine.tick import engine_widths
from oasr.models import ConformerConfig, StreamingConformer
from tests.test_engine import drive

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FORMATS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp8": (torch.bfloat16, "fp8_e4m3"),
}


def build(fmt: str, cuda_graphs: bool, num_left_chunks: int = 2, max_batch_size: int = 8, **engine_kw):
    dtype, kv = FORMATS[fmt]
    model = StreamingConformer(ConformerConfig(input_dim=20, hidden_dim=64, n_head=4, n_kv_head=2, head_dim=64,
                                               chunk_size=4, num_left_chunks=num_left_chunks, seed=4))
    model = model.to(device="cuda", dtype=dtype)
    cfg = model.config.cache_config(max_batch_size=max_batch_size, block_size_frames=8, device="cuda", dtype=dtype,
                                    kv_cache_dtype=kv)
    return StreamingEngine(model, cfg, twin="fast", cuda_graphs=cuda_graphs, keep_log_probs=True, **engine_kw)


def drive_streams(engine, streams: int = 11, seed: int = 0):
    """Streams of mixed lengths arriving over time, pushed in uneven pieces (tests/test_engine.py's driver)."""
    g = torch.Generator().manual_seed(seed)
    feats = {f"s{i}": torch.randn(int(torch.randint(9, 16 * 9, (1,), generator=g)), 20, generator=g)
             for i in range(streams)}
    drive(engine, feats, {sid: i for i, sid in enumerate(feats)}, seed, max_ticks=400)
    return {sid: engine.result(sid) for sid in feats}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("num_left_chunks", [2, -1])
def test_graphed_engine_equals_eager_bit_for_bit(fmt, num_left_chunks):
    graphed = build(fmt, True, num_left_chunks)
    eager = build(fmt, False, num_left_chunks)
    assert graphed.execution == "graphed" and eager.execution == "eager"
    stats = graphed.model_tick.graph_stats
    assert stats.widths == tuple(sorted(engine_widths(8), reverse=True)) and stats.memory_bytes >= 0
    got, want = drive_streams(graphed), drive_streams(eager)
    assert len({s.width for s in graphed.stats} - {0}) >= 3
    for sid in want:
        assert got[sid].tokens == want[sid].tokens, sid
        a, b = got[sid].log_probs, want[sid].log_probs
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), sid  # bits, NaN-safe


class SyncDebugMonitor:
    """An ``engine.tick_monitor`` that runs each model step under ``set_sync_debug_mode("error")``."""

    def __init__(self):
        self.regions = 0

    @contextmanager
    def region(self, label):
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        self.regions += 1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_model_step_never_synchronises(fmt, cuda_graphs):
    engine = build(fmt, cuda_graphs)
    for sid in range(6):
        engine.add_stream(sid)
        engine.push(sid, torch.randn(16 * 12, 20).to(engine.config.dtype))
    for _ in range(3):  # warm: every index cache and width buffer seen once
        engine.step()
    monitor = SyncDebugMonitor()
    engine.tick_monitor = monitor
    for _ in range(5):  # eviction runs on these ticks (num_left_chunks=2)
        engine.step()
    assert monitor.regions == 5


def test_cuda_graphs_default_on_for_the_fast_twin():
    model = StreamingConformer(ConformerConfig(hidden_dim=64, n_head=4, n_kv_head=2, head_dim=64)).to("cuda")
    engine = StreamingEngine(model, model.config.cache_config(max_batch_size=4, device="cuda"), twin="fast")
    assert engine.execution == "graphed" and engine.model_tick.graph_stats.num_graphs == 3
    assert engine.pool.num_used_blocks == 0  # capture ran on the padding lane


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_graphed_rescoring_equals_eager_bit_for_bit(fmt):
    """rescore=True keeps the graphs: the replayed step returns the encoder output the second pass reads."""
    from tests.test_graph_runner import RecordingRescorer

    engines, rescorers = {}, {}
    for graphs in (True, False):
        rescorers[graphs] = RecordingRescorer(build(fmt, False).model)  # its config only (CPU, fp32 weights)
        engines[graphs] = build(fmt, graphs, rescore=True, rescorer=rescorers[graphs])
    assert engines[True].execution == "graphed" and engines[False].execution == "eager"
    got, want = drive_streams(engines[True]), drive_streams(engines[False])
    for sid in want:
        assert got[sid].tokens == want[sid].tokens and got[sid].first_pass == want[sid].first_pass
        assert torch.equal(got[sid].log_probs, want[sid].log_probs), sid
    assert len(rescorers[True].seen) == len(want)
    for a, b in zip(rescorers[True].seen, rescorers[False].seen, strict=True):
        assert torch.equal(a, b)
