"""The Nemotron capacity rows: a random-weight transducer (the tiny configuration; never the full-size one in
tests) played as live lanes gives the offline transcripts, the rows' structure, the per-chunk latency rule, and
the options refused. No timings asserted."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from oasr.asr.live_source import plan_lanes, play_lanes  # noqa: E402
from oasr.bench.capacity_nemotron import (  # noqa: E402
    MODELS,
    build_recognizer,
    nemotron_capacity,
    synthetic_audio,
    write_random_checkpoint,
)


def test_live_lanes_give_the_offline_transcripts(tmp_path):
    audio = synthetic_audio(4, 1.5, seed=3)
    rec = build_recognizer("nemotron-tiny", 2, "cpu", max_streams=8, directory=tmp_path / "a", seed=5)
    lanes = plan_lanes([len(a) for a in audio], 3, 2.0, stagger=0.24)
    run = play_lanes(rec, audio, lanes)
    expected = {(i, k): c for i, lane in enumerate(lanes) for k, c in enumerate(lane.clips)}
    assert sorted(run.transcripts) == sorted(expected)
    assert not rec.streams and not rec.rec.stream_ids  # every finished stream gave its slot back
    offline = build_recognizer("nemotron-tiny", 2, "cpu", max_streams=8, directory=tmp_path / "b", seed=5)
    want = [t.text for t in offline.rec.transcribe([audio[c] for c in expected.values()])]
    got = [run.transcripts[key].text for key in expected]
    assert got == want and any(want)  # the random joint emits tokens; the live path equals the batch path
    assert len(run.latencies) == rec.stage_clock.stream_chunks > 0 and (run.latencies > 0).all()


def test_a_chunks_latency_starts_at_the_piece_holding_its_last_sample(tmp_path):
    rec = build_recognizer("nemotron-tiny", 2, "cpu", max_streams=2, directory=tmp_path)
    stream = rec.open_stream()
    pcm = synthetic_audio(1, 1.0)[0]
    base = time.perf_counter()
    sent = [base - 1000.0 * (10 - k) for k in range(10)]  # pieces sent 1000 s apart: the chosen one is unambiguous
    for k in range(10):
        stream.accept(pcm[640 * k : 640 * (k + 1)], sent_at=sent[k])
    rec.step()
    # the first chunk is 1 + 8 * 2 = 17 log-mel frames; frame 16 reads samples up to 16 * 160 + 256 = 2816,
    # which the fifth piece (samples 2560..3200) brought
    assert len(stream.latencies) == 1
    assert abs(stream.latencies[0] - (time.perf_counter() - sent[4])) < 500.0


def test_rows_per_lookahead_and_the_time_budget():
    rows = nemotron_capacity("cpu", "nemotron-tiny", [1], latency_budget_ms=1e6, start=2, max_streams=4,
                             seconds=1.5, progress=None)
    assert [r["case"] for r in rows] == ["lookahead 1, 2 live streams", "lookahead 1, 4 live streams", "lookahead 1"]
    for row in rows[:2]:
        assert row["wer"] is None and row["chunks"] > 0 and row["lookahead"] == 1 and row["chunk_ms"] == 160.0
        assert row["model_us"] > 0 and row["decode_us"] > 0 and row["ingest_us"] > 0
        assert "gpu_busy" not in row  # CPU: no device events
    assert rows[-1]["max_streams_held"] == 4 and rows[-1]["stopped"] == "max_streams"
    rows = nemotron_capacity("cpu", "nemotron-tiny", [2, 0], time_budget_s=1e-9, progress=None)
    assert [(r["case"], r["stopped"]) for r in rows] == [("lookahead 2", "time budget"), ("lookahead 0", "time budget")]


def test_the_written_checkpoint_is_the_configuration(tmp_path):
    import json

    d = write_random_checkpoint(tmp_path, "nemotron-0.6b")  # the head only: small even at full size
    config = json.loads((d / "config.json").read_text())
    assert config["encoder_config"]["hidden_size"] == 1024 and config["encoder_config"]["num_hidden_layers"] == 24
    assert config["blank_token_id"] == 1024 and config["decoder_hidden_size"] == 640
    processor = json.loads((d / "processor_config.json").read_text())
    assert processor["supported_num_lookahead_tokens"] == MODELS["nemotron-0.6b"]["lookaheads"] == [13, 6, 1, 0]


def test_an_error_in_one_lookahead_keeps_the_rows_and_goes_on(monkeypatch):
    import oasr.bench.capacity_nemotron as module

    real = module.build_recognizer

    def build(model, lookahead, *args, **kwargs):
        if lookahead == 1:
            raise RuntimeError("CUDA out of memory (a stand-in)\nmore lines")
        return real(model, lookahead, *args, **kwargs)

    monkeypatch.setattr(module, "build_recognizer", build)
    rows = nemotron_capacity("cpu", "nemotron-tiny", [1, 0], latency_budget_ms=1e6, start=2, max_streams=2,
                             seconds=1.0, progress=None)
    assert [r["case"] for r in rows] == ["lookahead 1", "lookahead 0, 2 live streams", "lookahead 0"]
    assert rows[0]["stopped"] == "error: RuntimeError: CUDA out of memory (a stand-in)"
    assert rows[0]["max_streams_held"] == 0 and rows[2]["max_streams_held"] == 2


@pytest.mark.parametrize("bad, match", [(dict(model="nemotron-7b"), "unknown model"),
                                        (dict(lookaheads=[5]), "not among"),
                                        (dict(start=8, max_streams=4), "start <= max_streams"),
                                        (dict(time_budget_s=0), "time budget > 0")])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        nemotron_capacity(**{"device": "cpu", "model": "nemotron-tiny", "progress": None, **bad})


@pytest.mark.parametrize("argv, says", [(["--lookaheads", "1"], "--lookaheads applies"),
                                        (["--capacity-model", "nemotron-tiny", "--lookaheads", "5"], "not among"),
                                        (["--capacity-model", "nemotron-tiny", "--lookaheads", "x"], "ints"),
                                        (["--time-budget-s", "0"], "--time-budget-s must be"),
                                        (["--time-budget-s", "60"], "--time-budget-s applies")])
def test_bench_refuses_bad_nemotron_options(argv, says, capsys):
    from oasr.commands.bench import main

    with pytest.raises(SystemExit) as exc:
        main(["--sections", "capacity", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_synthetic_audio_is_fixed_by_its_seed():
    a, b = synthetic_audio(3, 1.0, seed=1), synthetic_audio(3, 1.0, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)) and len(a[0]) == 16000
    assert all(x.dtype == np.float32 and np.abs(x).max() <= 1.0 for x in a)


@pytest.mark.cuda
def test_gpu_rows_say_how_busy_the_gpu_is():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rows = nemotron_capacity("cuda", "nemotron-tiny", [2], latency_budget_ms=1e6, start=4, max_streams=8,
                             seconds=1.5, progress=None)
    assert [r["case"] for r in rows] == ["lookahead 2, 4 live streams", "lookahead 2, 8 live streams", "lookahead 2"]
    for row in rows[:2]:
        assert row["dev_model_us"] > 0 and row["dev_decode_us"] > 0 and 0 < row["gpu_busy"]
    assert rows[-1]["gpu_busy_max"] == max(r["gpu_busy"] for r in rows[:2])


def test_a_cohort_padded_to_its_graph_width_decodes_as_the_cohort_alone():
    import torch

    from oasr.fast.rnnt_greedy import decode_chunk, graph_width, pad_cohort
    from oasr.models.transducer import TransducerHead, TransducerSpec

    assert [graph_width(b) for b in (1, 2, 3, 5, 8, 9, 600)] == [1, 2, 4, 8, 8, 16, 1024]
    with pytest.raises(ValueError, match=">= 1 stream"):
        graph_width(0)
    torch.manual_seed(0)
    spec = TransducerSpec(vocab_size=12, blank_id=11, encoder_dim=8, pred_hidden=6, pred_layers=2,
                          max_symbols_per_step=3)
    head = TransducerHead(spec).eval()
    with torch.no_grad():
        head.joint_net.head.bias[11] -= 1.0  # emit often: the states change
    batch, frames = 5, 4
    enc = torch.randn(batch, frames, 8) * 3
    state = {"rnnt_h": torch.randn(2, batch, 6), "rnnt_c": torch.randn(2, batch, 6),
             "rnnt_last": torch.randint(0, 12, (batch, 1))}
    lengths = [4, 2, 0, 3, 4]
    tokens, where, new = decode_chunk(head, enc, state, lengths)
    assert any(tokens)
    p_enc, p_state, p_len = pad_cohort(enc, state, lengths, graph_width(batch))
    assert p_enc.shape[0] == 8 and p_len == lengths + [0, 0, 0] and p_state["rnnt_h"].shape == (2, 8, 6)
    p_tokens, p_where, p_new = decode_chunk(head, p_enc, p_state, p_len)
    assert p_tokens[:batch] == tokens and p_where[:batch] == where and p_tokens[batch:] == [[], [], []]
    assert torch.equal(p_new["rnnt_h"][:, :batch], new["rnnt_h"]) and torch.equal(p_new["rnnt_last"][:batch],
                                                                                   new["rnnt_last"])
    assert torch.equal(p_new["rnnt_c"][:, batch:], p_state["rnnt_c"][:, batch:])  # padding rows never change
    with pytest.raises(ValueError, match="width 4 <"):
        pad_cohort(enc, state, lengths, 4)
