"""CUDA-graph capture of the Nemotron encoder's chunk step in ``EncoderStreamingEngine``.

On the CPU the capture is tests/test_graph_runner.py's stand-in (it reruns the step and fails a replay that reads
a storage the capture never saw), so the engine's choice (graphed or eager, and why), the per-width capture and
replay == eager are checked here; the ``cuda`` tests replay real graphs on a GPU (head_dim 64, which the kernels
tile; fp32 / bf16 model pages and fp8 pages) and the RNN-T decode step's own graphs through the recognizer.

Every model here is built from ``NemotronEncoderConfig`` with random weights (no transformers needed), except
the end-to-end ``cuda`` test, which needs transformers' Nemotron classes for its checkpoint and skips without.
"""

from __future__ import annotations

import logging

import pytest
import torch

from oasr.engine.encoder_streams import EncoderStreamingEngine
from oasr.models.nemotron import NemotronEncoder, NemotronEncoderConfig
from tests.test_graph_runner import StandInCapture

# head_dim 64 (hidden 128, 2 heads): a shape the attention kernels tile; head_dim 16 is the declared gap
HD64 = dict(hidden_size=128, num_attention_heads=2, num_hidden_layers=2, sliding_window=9,
            default_num_lookahead_tokens=1, conv_kernel_size=5, subsampling_conv_channels=4, num_mel_bins=16,
            intermediate_size=64)
HD16 = dict(HD64, num_attention_heads=8)


def encoder(spec, seed=0, dtype=torch.float32, device="cpu") -> NemotronEncoder:
    torch.manual_seed(seed)
    return NemotronEncoder(NemotronEncoderConfig(**spec)).to(device, dtype).eval()


def drive(engine, seed=0) -> dict:
    """Five streams of mixed lengths arriving over several ticks (different positions in one cohort), fed in
    pieces; every stream's encoder output, float32 on the host."""
    g = torch.Generator().manual_seed(seed)
    lengths = {"a": 150, "b": 97, "c": 61, "d": 130, "e": 5}
    arrival = {"a": 0, "b": 0, "c": 2, "d": 3, "e": 1}
    feats = {sid: torch.randn(n, engine.input_dim, generator=g) for sid, n in lengths.items()}
    for tick in range(4):
        for sid, t in arrival.items():
            if t == tick:
                engine.add_stream(sid)
                for i in range(0, lengths[sid], 23):
                    engine.push(sid, feats[sid][i : i + 23])
                engine.end_stream(sid)
        engine.step()
    engine.run()
    return {sid: engine.result(sid).float().cpu() for sid in lengths}


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
def test_stand_in_capture_replays_every_width_and_equals_eager(kv):
    enc = encoder(HD64)
    cfg = enc.cache_config(max_batch_size=4, kv_cache_dtype=kv)
    capture = StandInCapture()
    graphed = EncoderStreamingEngine(enc, cfg, twin="fast", cuda_graphs=True, graph_capture=capture)
    eager = EncoderStreamingEngine(enc, cfg, twin="fast", cuda_graphs=False)
    assert graphed.execution == "graphed" and graphed.execution_note.startswith("graphed: 3 CUDA graphs")
    assert graphed.model_tick.graph_stats.widths == (4, 2, 1) and capture.warmups == 2 * 3
    assert eager.execution == "eager" and eager.model_tick is None
    assert graphed.pool.num_used_blocks == 0  # capture ran the padding lane only: no stream, no block
    got, want = drive(graphed), drive(eager)
    assert capture.replays >= 5
    for sid in want:
        assert got[sid].shape == want[sid].shape and got[sid].shape[0] > 0
        assert torch.equal(got[sid], want[sid]), sid


def test_preflight_keeps_a_kernel_gap_eager_with_one_logged_reason(monkeypatch, caplog):
    """head_dim 16 on the emulated kernels: the attention is the declared gap 'paged-attention-head-dim'. Graphs
    asked for: the runner's preflight reaches the gap at every width, nothing is captured and nothing raises, the
    engine runs its eager step with one logged reason, equal to the eager engine."""
    from tests.test_graph_failures import gap_reporting_capture
    from tests.test_layered_conformer import _emulation_missing

    reason = _emulation_missing()
    if reason is not None:
        pytest.skip(f"kernel emulation unavailable: {reason}")
    monkeypatch.setenv("OASR_CPU_BACKEND", "emulated")
    capture = StandInCapture()
    gap_reporting_capture(monkeypatch, capture)  # a gap inside the stand-in's capture raises, as in a real one
    enc = encoder(HD16)
    cfg = enc.cache_config(max_batch_size=2)
    with caplog.at_level(logging.WARNING, logger="oasr.engine"):
        engine = EncoderStreamingEngine(enc, cfg, twin="fast", cuda_graphs=True, graph_capture=capture)
    assert engine.execution == "eager" and engine.model_tick is None
    assert engine.execution_note.startswith("eager: not captured:") and "paged-attention-head-dim" in \
        engine.execution_note
    assert capture.captured == [] and not capture.left_open
    assert [r.getMessage() for r in caplog.records if r.name == "oasr.engine"] == [
        f"EncoderStreamingEngine chunk step: {engine.execution_note}"]
    got, want = drive(engine), drive(EncoderStreamingEngine(enc, cfg, twin="fast", cuda_graphs=False))
    for sid in want:
        assert got[sid].shape[0] > 0 and torch.equal(got[sid], want[sid]), sid


def test_engine_defaults_and_refusals_on_the_cpu():
    enc = encoder(HD64)
    cfg = enc.cache_config(max_batch_size=2)
    engine = EncoderStreamingEngine(enc, cfg, twin="fast")
    assert engine.execution == "eager" and "CUDA graphs need a CUDA device" in engine.execution_note
    ref = EncoderStreamingEngine(enc, cfg, twin="reference")
    assert ref.execution == "eager" and "reference twin" in ref.execution_note
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EncoderStreamingEngine(enc, cfg, twin="fast", cuda_graphs=True)
    with pytest.raises(ValueError, match="needs twin='fast'"):
        EncoderStreamingEngine(enc, cfg, twin="reference", cuda_graphs=True, graph_capture=StandInCapture())
    with pytest.raises(ValueError, match="None, True or False"):
        EncoderStreamingEngine(enc, cfg, twin="fast", cuda_graphs="yes")


# ---- on a GPU --------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager(dtype, kv):
    """Real capture (one graph per width, 4 / 2 / 1) and replay against the eager fast twin on the same device:
    bit for bit (the same kernels with the same launch parameters, the views' spans pinned to the window)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    enc = encoder(HD64, dtype=dtype, device=dev)
    cfg = enc.cache_config(max_batch_size=4, kv_cache_dtype=kv, device=dev)
    graphed = EncoderStreamingEngine(enc, cfg, twin="fast")  # the default on a CUDA device
    eager = EncoderStreamingEngine(enc, cfg, twin="fast", cuda_graphs=False)
    assert graphed.execution == "graphed", graphed.execution_note
    assert graphed.model_tick.graph_stats.widths == (4, 2, 1)
    got, want = drive(graphed), drive(eager)
    for sid in want:
        assert got[sid].shape == want[sid].shape and torch.isfinite(got[sid]).all()
        assert torch.equal(got[sid], want[sid]), f"{sid}: max |diff| {(got[sid] - want[sid]).abs().max():.3g}"


@pytest.mark.cuda
@cuda
def test_cuda_gap_runs_eager_without_raising():
    dev = torch.device("cuda", torch.cuda.current_device())
    enc = encoder(HD16, device=dev)
    engine = EncoderStreamingEngine(enc, enc.cache_config(max_batch_size=2, device=dev), twin="fast")
    assert engine.execution == "eager" and "paged-attention-head-dim" in engine.execution_note
    assert all(v.shape[0] > 0 for v in drive(engine).values())


@pytest.mark.cuda
def _tiny_checkpoint(tmp_path):
    """A tiny Nemotron RNN-T checkpoint at head_dim 64 (a tile the kernels have) and oasr's test oracle module."""
    import sys
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "NemotronAsrStreamingForRNNT"):
        pytest.skip(f"transformers {transformers.__version__} has no NemotronAsrStreamingForRNNT")
    sys.path.insert(0, str(Path(__file__).parent))
    import nemotron_rnnt_oracle as oracle

    ckpt = tmp_path / "ckpt"
    model, processor = oracle.make_checkpoint(ckpt, "a", seed=11, overrides=dict(hidden_size=128,
                                                                                 num_attention_heads=2))
    return oracle, ckpt, model, processor


@cuda
def test_cuda_recognizer_graphs_the_encoder_and_the_rnnt_step_and_prints_the_cpu_text(tmp_path, monkeypatch):
    """The engine path on a GPU: ``TransducerRecognizer(device=cuda)`` (fast twin) replays the encoder's graphs
    (head_dim 64) and the RNN-T decode loop's graphs, and its text equals the recognizer's on the CPU for clips
    batched together (the CPU text is transformers' streaming generation: tests/test_nemotron_rnnt.py; the GPU
    machine's transformers may predate the streaming API, so it is not the oracle here)."""
    from oasr.asr.transducer import TransducerRecognizer

    oracle, ckpt, _, _ = _tiny_checkpoint(tmp_path)
    clips = [oracle.clip(0, 1.3), oracle.clip(4, 0.9), oracle.clip(2, 0.5)]
    want = [t.text for t in TransducerRecognizer(ckpt, max_batch_size=4).transcribe(clips)]
    assert all(want)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 convolutions, as on the CPU
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    dev = torch.device("cuda", torch.cuda.current_device())
    rec = TransducerRecognizer(ckpt, max_batch_size=4, device=dev)
    assert rec.encoder.execution == "graphed", rec.encoder.execution_note
    assert [t.text for t in rec.transcribe(clips)] == want
    assert rec.rnnt_graphs._graphs  # the decode loop was captured and replayed


def test_recognizer_over_a_graphed_encoder_prints_transformers_text(tmp_path):
    """On the CPU: the recognizer over an encoder whose chunk step replays stand-in graphs (head_dim 64) prints
    exactly transformers' streaming text, clips batched together (the graphed step's host readback feeds the
    decode as the eager step's device output does)."""
    from oasr.asr.transducer import TransducerRecognizer
    from oasr.checkpoints import from_pretrained
    from oasr.features import NemoMel

    oracle, ckpt, model, processor = _tiny_checkpoint(tmp_path)
    clips = [oracle.clip(0, 1.0), oracle.clip(4, 0.7)]
    lookahead = processor.default_num_lookahead_tokens
    want = []
    for pcm in clips:
        feats = torch.from_numpy(NemoMel.from_checkpoint(ckpt).extract(pcm))
        *_, sequence = oracle.oracle_stream(model, feats, lookahead)
        want.append(processor.decode(sequence, skip_special_tokens=True))
    capture = StandInCapture()

    def graphed(directory, la):
        enc = from_pretrained(directory, lookahead=la).model
        return EncoderStreamingEngine(enc, enc.cache_config(max_batch_size=2), twin="fast", cuda_graphs=True,
                                      graph_capture=capture)

    rec = TransducerRecognizer(ckpt, graphed, max_batch_size=2)
    assert rec.encoder.execution == "graphed"
    assert [t.text for t in rec.transcribe(clips)] == want and all(want)
    assert capture.replays > 0
