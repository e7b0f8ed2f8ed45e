"""What the first H200 run found in capture, on the CPU with the stand-in capture
of tests/test_graph_runner.py and on a GPU.

* A step that reaches a declared kernel gap is decided before capture (the preflight): that width, or
  the whole engine, runs eager with one logged reason; ``KernelGapError`` is never raised in a capture.
* A capture that raises is discarded (``abort``): nothing is left open, and the next capture works.
* ``GraphStats.memory_bytes`` is what the graphs' pool holds (its segments), never negative.
"""

from __future__ import annotations

import logging

import pytest
import torch

from oasr.engine import StreamingEngine
from oasr.fast import kernel_policy
from oasr.fast.graph_runner import CudaGraphCapture, GraphRunner, GraphStats, pool_bytes
from tests.test_graph_runner import StandInCapture

GAP = ("paged-attention-head-dim", "paged_attention")


def gap_reporting_capture(monkeypatch, capture: StandInCapture) -> None:
    """``serve_gap`` told what a real capture reports: whether the call runs inside one (the stand-in's)."""
    real = kernel_policy.serve_gap

    def serve_gap(name, op, detail, capturing=False):
        return real(name, op, detail, capturing=capturing or capture.capturing)

    monkeypatch.setattr(kernel_policy, "serve_gap", serve_gap)


# ---- defect 2: a kernel gap is decided before capture ----------------------------------------------------
def test_a_width_that_reaches_a_gap_runs_eager_and_the_others_replay(monkeypatch, caplog):
    capture = StandInCapture()
    gap_reporting_capture(monkeypatch, capture)
    static = {w: torch.arange(float(w)) for w in (1, 2, 4)}

    def step(width):
        if width >= 2:  # e.g. a tile the kernels lack at this width: torch serves it
            kernel_policy.serve_gap(*GAP, f"width {width}")
        return static[width] + 1

    runner = GraphRunner(step, [1, 2, 4], capture)
    with caplog.at_level(logging.WARNING, logger="oasr.fast"):
        stats = runner.capture_all()
    assert stats.widths == (1,) and sorted(stats.eager) == [2, 4] and "paged-attention-head-dim" in stats.eager[4]
    assert runner.has_graph(1) and not runner.has_graph(2)
    assert [r for r in caplog.records if "run eager" in r.getMessage()].__len__() == 1  # one logged reason
    assert torch.equal(runner.run(4), static[4] + 1) and torch.equal(runner.run(1), static[1] + 1)
    assert capture.replays == 1  # width 4 ran eagerly, width 1 replayed
    assert "eager at widths [2, 4]" in stats.format()


def test_an_engine_whose_attention_is_a_gap_runs_eager_and_says_why(monkeypatch, caplog):
    """The mixed Conformer (head_dim 16, fp32 pages) on the emulated kernels: attention is a declared gap.
    Graphs asked for: the preflight reaches the gap, the engine runs eager (no KernelGapError), logs one
    reason, and equals the eager engine bit for bit."""
    from tests.test_engine_kinds import features, mixed_model, serve
    from tests.test_layered_conformer import _emulation_missing

    reason = _emulation_missing()
    if reason is not None:
        pytest.skip(f"kernel emulation unavailable: {reason}")
    monkeypatch.setenv("OASR_CPU_BACKEND", "emulated")
    capture = StandInCapture()
    gap_reporting_capture(monkeypatch, capture)
    model = mixed_model(seed=9)
    assert model.config.head_dim == 16
    config = model.config.cache_config(max_batch_size=4, block_size_frames=3)
    with caplog.at_level(logging.WARNING):
        engine = StreamingEngine(model, config, cuda_graphs=True, graph_capture=capture, keep_log_probs=True)
    assert engine.execution == "eager" and "kernel gap" in engine.execution_note, engine.execution_note
    assert engine.model_tick.runner is None and "paged-attention-head-dim" in engine.model_tick.graph_refusal
    assert len([r for r in caplog.records if "not captured" in r.getMessage()]) == 1
    assert capture.captured == [] and not capture.left_open
    feats = features({sid: 16 * 3 + 5 * sid for sid in range(3)}, seed=4)
    arrivals = {sid: 0 for sid in feats}
    a = serve(engine, feats, arrivals, piece=16)
    b = serve(StreamingEngine(model, config, keep_log_probs=True), feats, arrivals, piece=16)
    for sid in feats:
        assert torch.equal(a[sid].log_probs, b[sid].log_probs), sid


# ---- defect 3: a failed capture is discarded ------------------------------------------------------------
def test_a_capture_that_raises_is_discarded_and_the_next_capture_works():
    capture = StandInCapture()
    fail = {"on": True}
    static = {w: torch.ones(w) for w in (1, 2, 4)}

    def step(width):
        if fail["on"] and width == 2 and capture.capturing:
            raise RuntimeError("injected failure inside the capture")
        return static[width] * 3

    runner = GraphRunner(step, [1, 2, 4], capture)
    with pytest.raises(RuntimeError, match="injected failure"):
        runner.capture_all()
    assert not runner.captured and not runner.has_graph(4)  # width 4's graph was discarded with the failure
    assert len(capture.aborted) == 1 and len(capture.aborted[0]) == 1  # width 4's handle, reset
    assert not capture.left_open
    fail["on"] = False
    stats = GraphRunner(step, [1, 2, 4], capture).capture_all()  # the same capture strategy: usable again
    assert stats.widths == (4, 2, 1)
    again = runner.capture_all()  # and the runner itself can retry
    assert again.widths == (4, 2, 1) and torch.equal(runner.replay(2), torch.full((2,), 3.0))


def test_without_the_discard_every_later_capture_fails():
    """What the stand-in models (a capture left open poisons the next): the runner must call abort."""
    capture = StandInCapture()
    capture.abort = None  # a strategy without a discard: the failure stays behind
    runner = GraphRunner(lambda w: (_ for _ in ()).throw(RuntimeError("boom")) if capture.capturing
                         else torch.zeros(w), [1], capture)
    with pytest.raises(RuntimeError, match="boom"):
        runner.capture_all()
    with pytest.raises(AssertionError, match="previous error during capture"):
        GraphRunner(lambda w: torch.zeros(w), [1], capture).capture_all()


# ---- defect 4: graph memory is what the pool holds -----------------------------------------------------
def test_graph_stats_refuse_negative_memory():
    with pytest.raises(ValueError, match="never negative"):
        GraphStats((1,), 0.1, -20971520)


def test_pool_bytes_counts_only_the_pool_segments(monkeypatch):
    pool = (0, 7)
    segments = [
        {"device": 0, "segment_pool_id": (0, 7), "total_size": 2 << 20},
        {"device": 0, "segment_pool_id": (0, 7), "total_size": 20 << 20},
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 512 << 20},  # ordinary memory, freed or not
        {"device": 1, "segment_pool_id": (0, 7), "total_size": 1 << 20},  # another device
    ]
    seen = {}

    def snapshot(mempool_id=None):
        seen["pool"] = mempool_id
        return segments

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    assert pool_bytes(torch.device("cuda", 0), pool) == 22 << 20 and seen["pool"] == pool
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)  # a torch without the per-pool form
    assert pool_bytes("cuda:1", pool) == 1 << 20


# ---- on a GPU ----------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("failure", ["python", "sync"])
def test_cuda_capture_after_a_failed_capture(failure):
    """An exception inside a real capture (a Python error, or a host sync that invalidates the capture)
    is discarded: the next capture in the process works, replays right, and a pinned allocation works."""
    x = torch.arange(8.0, device="cuda")

    def bad(width):
        y = x[:width] * 2
        if torch.cuda.is_current_stream_capturing():
            if failure == "python":
                raise RuntimeError("injected failure inside the capture")
            y.sum().item()  # a host sync: illegal in a capture, invalidates it
        return y

    stream_before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError):
        GraphRunner(bad, [4, 2], CudaGraphCapture("cuda")).capture_all()
    assert torch.cuda.current_stream() == stream_before and not torch.cuda.is_current_stream_capturing()
    pinned = torch.zeros(16, pin_memory=True)  # failed with "invalid argument" after the undiscarded capture
    assert pinned.is_pinned()
    runner = GraphRunner(lambda w: x[:w] * 3 + 1, [4, 2], CudaGraphCapture("cuda"))
    stats = runner.capture_all()
    assert stats.widths == (4, 2) and stats.memory_bytes >= 0
    x.copy_(torch.arange(8.0, device="cuda") + 1)
    assert torch.equal(runner.replay(4).cpu(), (torch.arange(4.0) + 1) * 3 + 1)


@pytest.mark.cuda
@cuda
def test_cuda_graph_memory_is_the_pool_and_never_negative():
    """Memory freed elsewhere during capture (what made the difference -20 MiB) does not count."""
    held = {"big": torch.empty(64 << 20, dtype=torch.uint8, device="cuda")}
    x = torch.ones(1 << 20, device="cuda")

    def step(width):
        if not torch.cuda.is_current_stream_capturing() and held:  # the preflight, after begin(): a free
            held.clear()
        return x * width + 1  # a fresh 4 MiB output in the graph pool

    capture = CudaGraphCapture("cuda")
    runner = GraphRunner(step, [1], capture)
    stats = runner.capture_all()
    assert not held
    assert stats.memory_bytes >= 4 << 20 and stats.memory_bytes == pool_bytes(capture.device, capture.pool)


@pytest.mark.cuda
@cuda
def test_cuda_engine_with_an_attention_gap_runs_eager():
    """The H200 failure: graphs on by default, head_dim 16 fp32 pages (a declared gap): the engine runs
    eager with the reason, no KernelGapError, and serves streams."""
    from tests.test_engine_kinds import features, mixed_model, serve

    model = mixed_model(seed=9).to("cuda")
    config = model.config.cache_config(max_batch_size=4, block_size_frames=3, device="cuda")
    engine = StreamingEngine(model, config, keep_log_probs=True)
    assert engine.execution == "eager" and "kernel gap" in engine.execution_note
    feats = features({sid: 16 * 3 + 5 * sid for sid in range(2)}, seed=4)
    results = serve(engine, feats, {s: 0 for s in feats}, piece=16)
    assert all(torch.isfinite(r.log_probs).all() for r in results.values())
