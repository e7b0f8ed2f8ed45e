"""The graph runner's bookkeeping on the CPU, with a stand-in for CUDA-graph capture.

The stand-in does what a capture fixes and nothing more: it records the storages
the step reads that it did not allocate itself (a graph replays those addresses)
and, on every replay, reruns the step and fails if it read any storage the
capture did not see. So a step that reads a per-tick tensor -- a fresh index, a
new view buffer -- fails here the way a CUDA graph would silently read stale
memory. The outputs are copied into the captured ones, as a replay writes them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oasr.engine import StreamingEngine
from oasr.engine.tick import engine_widths
from oasr.fast.capture_check import iter_tensors
from oasr.fast.graph_runner import CudaGraphCapture, GraphRunner
from oasr.models import ConformerConfig, StreamingConformer
from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig
from tests.test_engine import drive


class _ExternalReads(TorchDispatchMode):
    """Storages an op read that no earlier op of the same call produced."""

    def __init__(self):
        super().__init__()
        self.made, self.read = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._schema.name in ("aten::lift_fresh", "aten::lift_fresh_copy"):  # made from Python data just now
            self.made.update(t.untyped_storage().data_ptr() for t in iter_tensors(args))
        for t in iter_tensors((args, kwargs)):
            p = t.untyped_storage().data_ptr()
            if p not in self.made:
                self.read.add(p)
        for t in iter_tensors(out):
            p = t.untyped_storage().data_ptr()
            if p not in self.read:
                self.made.add(p)
        return out


class StandInCapture:
    """Capture strategy for the CPU: eager calls, with the address discipline of a graph checked."""

    def __init__(self):
        self.captured = []  # widths, in capture order
        self.warmups = 0
        self.replays = 0
        self.began = self.ended = False
        self.capturing = False  # True while the captured call runs (what torch.cuda reports during a capture)
        self.left_open = False  # a capture that raised and was not discarded (CUDA: every later capture fails)
        self.aborted = []  # the handles each abort() discarded

    def begin(self):
        assert not self.left_open, "operation failed due to a previous error during capture"
        self.began = True

    def capture(self, fn, warmup):
        assert not self.left_open, "operation failed due to a previous error during capture"
        for _ in range(warmup):
            fn()
            self.warmups += 1
        self.capturing = True
        try:
            with _ExternalReads() as reads:
                outputs = fn()
        except BaseException:
            self.left_open = True  # as a CUDA stream capture an exception interrupted
            raise
        finally:
            self.capturing = False
        self.captured.append(len(self.captured))
        return {"fn": fn, "reads": reads.read, "outputs": outputs}, outputs

    def abort(self, handles):
        self.aborted.append(list(handles))
        self.left_open = False

    def replay(self, handle):
        with _ExternalReads() as reads:
            fresh = handle["fn"]()
        extra = reads.read - handle["reads"]
        assert not extra, f"a replay read {len(extra)} storage(s) the capture never saw (not static)"
        self.replays += 1
        for mine, new in zip(iter_tensors(handle["outputs"]), iter_tensors(fresh), strict=True):
            mine.copy_(new)  # a replay writes the captured outputs

    def end(self):
        self.ended = True
        return 12345


# ---- GraphRunner on its own -------------------------------------------------------------------
def test_runner_captures_each_width_once_largest_first_and_replays_into_the_captured_outputs():
    static = {w: torch.zeros(w) for w in (1, 2, 4)}
    calls = []

    def step(width):
        calls.append(width)
        return static[width] * 2 + 1

    capture = StandInCapture()
    prepared = []
    runner = GraphRunner(step, [2, 1, 4, 4], capture, prepare=lambda: prepared.append(True), warmup=2)
    assert runner.widths == (4, 2, 1) and not runner.captured
    stats = runner.capture_all()
    assert prepared == [True] and capture.began and capture.ended
    assert stats.widths == (4, 2, 1) and stats.num_graphs == 3 and stats.memory_bytes == 12345
    assert calls == [4] * 4 + [2] * 4 + [1] * 4  # per width: the preflight, two warm-ups, one capture
    assert runner.capture_all() is stats and len(calls) == 12  # captured once
    out4 = runner.outputs(4)
    static[4].fill_(3.0)
    assert runner.replay(4) is out4 and torch.equal(out4, torch.full((4,), 7.0))
    out2 = runner.replay(2)
    assert torch.equal(out4, torch.full((4,), 7.0))  # another width leaves it alone
    assert torch.equal(out2, torch.ones(2))
    with pytest.raises(KeyError, match="no graph for width 8"):
        runner.replay(8)


def test_stand_in_fails_a_step_that_reads_a_fresh_tensor():
    holder = {"x": torch.ones(3)}
    runner = GraphRunner(lambda w: holder["x"] * 2, [1], StandInCapture())
    runner.capture_all()
    runner.replay(1)
    holder["x"] = torch.ones(3)  # a new tensor at a new address: a graph would read the old one
    with pytest.raises(AssertionError, match="not static"):
        runner.replay(1)


def test_runner_refuses_bad_widths():
    with pytest.raises(ValueError, match="positive"):
        GraphRunner(lambda w: None, [], StandInCapture())
    with pytest.raises(ValueError, match="positive"):
        GraphRunner(lambda w: None, [0, 2], StandInCapture())


def test_cuda_capture_refuses_the_cpu():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CudaGraphCapture("cpu")


# ---- the engine -------------------------------------------------------------------------------
def make_model():
    return StreamingConformer(ConformerConfig(chunk_size=4, num_left_chunks=2, seed=5))


def test_engine_on_cpu_runs_eager_and_says_so():
    model = make_model()
    engine = StreamingEngine(model, model.config.cache_config(max_batch_size=4), twin="fast")
    assert engine.execution == "eager" and "CUDA graphs need a CUDA device" in engine.execution_note
    assert engine.model_tick is not None and not engine.model_tick.graphed
    ref = StreamingEngine(model, model.config.cache_config(max_batch_size=4), twin="reference")
    assert ref.execution == "eager" and ref.model_tick is None and "reference" in ref.execution_note


def test_engine_refuses_graphs_on_cpu_and_for_the_reference_twin():
    model = make_model()
    cfg = model.config.cache_config(max_batch_size=4)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        StreamingEngine(model, cfg, twin="fast", cuda_graphs=True)
    with pytest.raises(ValueError, match="needs twin='fast'"):
        StreamingEngine(model, cfg, twin="reference", cuda_graphs=True)
    with pytest.raises(ValueError, match="None, True or False"):
        StreamingEngine(model, cfg, twin="fast", cuda_graphs="yes")


@pytest.mark.parametrize("max_batch_size,widths", [(8, [1, 2, 4, 8]), (6, [1, 2, 4, 6]), (1, [1])])
def test_engine_widths_are_the_cohort_widths(max_batch_size, widths):
    """A graphed engine's cohort widths are the captured ones; an eager CPU engine's are the model step's finer
    ladder (every width up to 8)."""
    model = make_model()
    cfg = model.config.cache_config(max_batch_size=max_batch_size)
    assert engine_widths(max_batch_size) == widths
    graphed = StreamingEngine(model, cfg, twin="fast", cuda_graphs=True, graph_capture=StandInCapture())
    assert sorted({graphed.cohort_width(n) for n in range(1, max_batch_size + 1)}) == widths
    eager = StreamingEngine(model, cfg, twin="fast")
    assert [eager.cohort_width(n) for n in range(1, max_batch_size + 1)] == list(range(1, max_batch_size + 1))
    assert eager.model_tick.widths == list(range(1, max_batch_size + 1))


def drive_streams(engine, seed=0):
    """Seven streams of mixed lengths arriving over time (tests/test_engine.py's driver); their results."""
    g = torch.Generator().manual_seed(seed)
    lengths = [16 * 7 + 3, 40, 9, 16 * 5, 16 * 9 + 11, 33, 16 * 3]
    feats = {f"s{i}": torch.randn(n, 20, generator=g) for i, n in enumerate(lengths)}
    drive(engine, feats, {sid: i // 2 for i, sid in enumerate(feats)}, seed)
    return {sid: engine.result(sid) for sid in feats}


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_graphed_engine_with_stand_in_captures_every_width_and_matches_eager(kv_cache_dtype):
    model = make_model()
    cfg = model.config.cache_config(max_batch_size=8, block_size_frames=3, kv_cache_dtype=kv_cache_dtype)
    capture = StandInCapture()
    graphed = StreamingEngine(model, cfg, twin="fast", cuda_graphs=True, graph_capture=capture, keep_log_probs=True)
    eager = StreamingEngine(model, cfg, twin="fast", cuda_graphs=False, keep_log_probs=True)
    tick = graphed.model_tick
    assert graphed.execution == "graphed" and tick.graphed and eager.execution == "eager"
    assert tick.graph_stats.widths == (8, 4, 2, 1) and capture.warmups == 2 * 4
    assert graphed.execution_note.startswith("graphed: 4 CUDA graphs")
    # capture ran every row on the padding lane: no stream exists, nothing was allocated from the pool
    assert graphed.pool.num_used_blocks == 0
    static = {w: [t.data_ptr() for t in tick.static_buffers(w)] for w in tick.widths}
    got, want = drive_streams(graphed), drive_streams(eager)
    assert capture.replays == sum(1 for s in graphed.stats if s.width)
    assert len({s.width for s in graphed.stats} - {0}) >= 3  # several widths replayed
    assert static == {w: [t.data_ptr() for t in tick.static_buffers(w)] for w in tick.widths}
    for sid in want:
        assert got[sid].tokens == want[sid].tokens
        assert torch.equal(got[sid].log_probs, want[sid].log_probs), sid


# ---- the demo says which path ran -------------------------------------------------------------
def test_demo_prints_the_path_and_refuses_graphs_on_cpu(capsys):
    from oasr.__main__ import main as oasr_main

    assert oasr_main(["engine-demo", "--streams", "3", "--check-sample", "0", "--quiet", "--plot", ""]) == 0
    out = capsys.readouterr().out
    assert "model step  eager: CUDA graphs need a CUDA device" in out
    assert oasr_main(["engine-demo", "--streams", "3", "--check-sample", "0", "--quiet", "--plot", "",
                      "--no-cuda-graphs", "--twin", "reference"]) == 0
    assert "model step  eager: the reference twin" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # a usage error, before any work
        oasr_main(["engine-demo", "--streams", "3", "--quiet", "--plot", "", "--cuda-graphs"])
    assert exit_info.value.code == 2
    assert "--cuda-graphs needs --device cuda and --twin fast" in capsys.readouterr().err


def test_graphs_bench_section_says_it_needs_cuda_on_the_cpu():
    from oasr.bench.graphs import section

    rows = section(quick=True, device="cpu")
    assert len(rows) == 1 and rows[0]["case"] == "skipped" and "CUDA" in rows[0]["note"]


# ---- rescoring under graphs: the step returns the encoder output -----------------------------------
class RecordingRescorer(AttentionDecoder):
    """An ``AttentionDecoder`` that remembers every encoder output it scored against."""

    def __init__(self, model):
        cfg = model.config
        super().__init__(DecoderConfig(vocab_size=cfg.vocab_size, encoder_dim=cfg.hidden_dim, seed=2))
        self.seen = []

    def cross_kv(self, enc):  # a rescoring job computes its encoder output's cross K/V once
        self.seen.append(enc.clone())
        return super().cross_kv(enc)


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_graphed_rescoring_equals_eager_bit_for_bit(kv_cache_dtype):
    model = make_model()
    cfg = model.config.cache_config(max_batch_size=8, block_size_frames=3, kv_cache_dtype=kv_cache_dtype)
    capture = StandInCapture()
    rescorers = {"graphed": RecordingRescorer(model), "eager": RecordingRescorer(model)}
    engines = {
        "graphed": StreamingEngine(model, cfg, twin="fast", cuda_graphs=True, graph_capture=capture, rescore=True,
                                   rescorer=rescorers["graphed"]),
        "eager": StreamingEngine(model, cfg, twin="fast", cuda_graphs=False, rescore=True,
                                 rescorer=rescorers["eager"]),
    }
    assert engines["graphed"].execution == "graphed" and engines["graphed"].model_tick.with_hidden
    assert not model.ctc._forward_hooks  # nothing hooks into the model: a replay would not run it
    got, want = drive_streams(engines["graphed"]), drive_streams(engines["eager"])
    assert capture.replays > 0
    for sid in want:
        assert got[sid].tokens == want[sid].tokens and got[sid].first_pass == want[sid].first_pass
        assert [h.tokens for h in got[sid].nbest] == [h.tokens for h in want[sid].nbest]
    seen_g, seen_e = rescorers["graphed"].seen, rescorers["eager"].seen
    assert len(seen_g) == len(want) and len(seen_g) == len(seen_e)
    for a, b in zip(seen_g, seen_e, strict=True):
        assert a.shape[0] > 0 and torch.equal(a, b)  # the second pass read the same encoder output, bit for bit


def test_model_step_hidden_is_the_ctc_heads_input():
    """The hidden states a step returns are exactly what the CTC head turns into its log-probs."""
    model = make_model()
    cfg = model.config.cache_config(max_batch_size=4, block_size_frames=3)
    engine = StreamingEngine(model, cfg, twin="fast", rescore=True)
    sid = engine.add_stream()
    engine.push(sid, torch.randn(16 * 3, 20, generator=torch.Generator().manual_seed(1)))
    engine.step()
    tick = engine.model_tick
    hidden, log_probs = tick.hidden(1), tick.log_probs(1)
    with torch.no_grad():
        assert torch.equal(torch.log_softmax(model.ctc(hidden), -1), log_probs)
    plain = StreamingEngine(model, cfg, twin="fast")
    with pytest.raises(ValueError, match="hidden=False"):
        plain.model_tick.hidden(1)
