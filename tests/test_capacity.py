"""Many live streams per thread: the batched front end, bfloat16 GEMMs, the live audio clock,
the capacity bench, and the tick's host work per stream (counted in Python calls, never timed)."""

import collections
import sys

import numpy as np
import pytest
import torch

from oasr.asr.audio import load_audio
from oasr.asr.batched_fbank import FBANK_TOLERANCE, PcmBuffer, fbank_frames, frame_windows
from oasr.asr.recognizer import Recognizer
from oasr.asr.testset import load_testset
from oasr.features.fbank import fbank, num_frames


@pytest.fixture(scope="module")
def clips():
    chosen = load_testset()
    return chosen, [load_audio(c.path) for c in chosen]


def test_batched_fbank_equals_kaldi_native_fbank_on_every_shipped_clip(clips):
    worst, medians = 0.0, []
    for pcm in clips[1]:
        kaldi = fbank(pcm)
        ours = fbank_frames(frame_windows(pcm, num_frames(len(pcm)))).numpy()
        assert ours.shape == kaldi.shape and ours.dtype == np.float32
        diff = np.abs(ours - kaldi)
        worst = max(worst, float(diff.max()))
        medians.append(float(np.median(diff)))
    assert worst <= FBANK_TOLERANCE
    assert max(medians) < 1e-4  # speech frames agree to float32 rounding; only near-silence differs more


def test_pcm_buffer_in_pieces_gives_the_whole_clips_frames(clips):
    pcm = clips[1][0]
    whole = fbank_frames(frame_windows(pcm, num_frames(len(pcm))))
    rng = np.random.default_rng(0)
    buf, got, i = PcmBuffer(capacity=16), [], 0
    while i < len(pcm):  # random pieces (single samples, empty, bigger than the buffer), random takes
        n = int(rng.choice([0, 1, 7, 160, 399, 640, 5000]))
        buf.append(pcm[i : i + n])
        i += n
        if rng.random() < 0.3:
            got.append(fbank_frames(buf.take_windows(buf.frames_ready())))
    got.append(fbank_frames(buf.take_windows(buf.frames_ready())))
    assert buf.size < 400
    # the same windows; a frame's float32 rounding may depend on how many frames share the call (the
    # BLAS and FFT take other code paths for a few rows), as the model's GEMM rows do: a few ulp
    torch.testing.assert_close(torch.cat(got), whole, rtol=0, atol=1e-5)


def test_fbank_frames_equals_the_plain_formulation_bit_for_bit():
    """fbank_frames writes pre-emphasis and window into the padded FFT input in place; the plain ops (a cat, a
    product, a pad, a sum of squares) give the same float32 bits."""
    from oasr.asr.batched_fbank import _BANKS, _EPS, _WINDOW, PADDED, PREEMPHASIS

    windows = np.random.default_rng(1).standard_normal((300, 400)).astype(np.float32) * 0.05
    x = torch.as_tensor(windows * np.float32(32768.0))
    x = x - x.mean(1, keepdim=True)
    x = torch.cat([x[:, :1] * (1 - PREEMPHASIS), x[:, 1:] - PREEMPHASIS * x[:, :-1]], 1)
    padded = torch.nn.functional.pad(x * _WINDOW, (0, PADDED - 400))
    power = torch.view_as_real(torch.fft.rfft(padded)[:, : PADDED // 2]).square().sum(-1)
    assert torch.equal(fbank_frames(windows), (power @ _BANKS).clamp_(min=_EPS).log_())


def test_frame_windows_refuses_too_few_samples():
    with pytest.raises(ValueError, match="3 frames need 720 samples, got 719"):
        frame_windows(np.zeros(719, np.float32), 3)
    with pytest.raises(ValueError, match=r"expected \(n, 400\) windows"):
        fbank_frames(np.zeros((2, 399), np.float32))


def _engine_tokens(rec, pcm):
    """Today's path: kaldi-native-fbank features of the whole clip pushed straight into the engine."""
    sid = rec.engine.add_stream()
    rec.engine.push(sid, rec.cmvn.normalize(fbank(pcm)))
    rec.engine.end_stream(sid)
    rec.engine.run()
    return rec.tokenizer.decode(rec.engine.result(sid).tokens)


def test_recognizer_transcripts_equal_the_kaldi_front_end(clips):
    audio = clips[1][:12]
    rec = Recognizer(max_streams=12, language_model=None)  # the engine's own text: the token search
    kaldi = [_engine_tokens(rec, pcm) for pcm in audio]
    assert [t.text for t in Recognizer(max_streams=12, language_model=None).transcribe(audio)] == kaldi


def test_bfloat16_matmuls_keep_the_transcripts(clips):
    audio = clips[1][:16]
    fp32 = [t.text for t in Recognizer(max_streams=16).transcribe(audio)]
    bf16 = [t.text for t in Recognizer(max_streams=16, matmul_dtype="bfloat16").transcribe(audio)]
    # bfloat16 rounds the projections: the shipped model's words may change where two are close (one of the
    # 120 shipped clips with the word search, docs/speech.md), never more than one of these 16
    assert sum(a != b for a, b in zip(fp32, bf16, strict=True)) <= 1
    with pytest.raises(ValueError, match="matmul_dtype must be one of"):
        Recognizer(matmul_dtype="float16")


def test_live_lanes_deliver_every_clip_as_the_batch_path_does(clips):
    from oasr.asr.live_source import plan_lanes, play_lanes

    audio = clips[1]
    lanes = plan_lanes([len(a) for a in audio], 3, 2.0, stagger=0.5)
    rec = Recognizer(max_streams=8, max_seconds=8.0)
    run = play_lanes(rec, audio, lanes)
    expected = {(i, k): audio[c] for i, lane in enumerate(lanes) for k, c in enumerate(lane.clips)}
    assert sorted(run.transcripts) == sorted(expected)
    batch = Recognizer(max_streams=8).transcribe(list(expected.values()))
    assert [run.transcripts[key].text for key in expected] == [t.text for t in batch]
    chunks = sum(-(-num_frames(len(pcm)) // rec.engine.chunk_input_frames) for pcm in expected.values())
    assert len(run.latencies) == chunks and (run.latencies > 0).all()
    assert not rec.streams and run.last_delivered >= run.last_sent > 0
    with pytest.raises(ValueError, match="lanes >= 1"):
        plan_lanes([16000], 0, 1.0, 0.5)


def test_capacity_rows_and_stage_clock():
    from oasr.bench.capacity import capacity
    from oasr.engine.stage_clock import STAGES

    rows = capacity("cpu", latency_budget_ms=1e6, start=2, max_streams=4, seconds=1.5, progress=None,
                    matmul_dtype=None)
    assert [r["case"] for r in rows] == ["2 live streams", "4 live streams", "capacity"]
    assert rows[-1]["max_streams_held"] == 4 and rows[-1]["matmul"] == "float32"
    for row in rows[:2]:
        assert row["held"] and row["chunks"] > 0 and row["wer"] < 0.5
        assert all(row[f"{stage}_us"] > 0 for stage in STAGES)
        assert "dev_model_us" not in row  # CPU: no device events
    with pytest.raises(ValueError, match="start <= max_streams"):
        capacity("cpu", start=8, max_streams=4)


def test_bench_refuses_a_bad_latency_budget(capsys):
    from oasr.commands.bench import main

    with pytest.raises(SystemExit) as exc:
        main(["--sections", "capacity", "--latency-budget-ms", "0"])
    assert exc.value.code == 2 and "--latency-budget-ms" in capsys.readouterr().err


# ---- the tick's host work ---------------------------------------------------------------------

# Python-level calls (functions and C functions, as sys.setprofile sees them) one tick spends per stream
# of its cohort, past the tick's fixed part. Measured: ~154 (the attention's CPU row loop, ~90 over the five
# layers; the native CTC search's pointer lists, peek and commits, ~15; admission and the engine's
# per-stream outputs); ~210 before the CTC search went native. A per-token or per-frame loop per stream
# (the partial-prefix comparison replaced earlier cost ~3 calls per token) breaks the bound below as the
# streams' hypotheses grow.
PER_STREAM_CALLS = 180
PER_STREAM_CALLS_TORCH_SEARCH = 260  # where no C++ compiler builds the native search (the torch search's ~40 more)


def _tick_calls(engine, feats, cohort: int, chunks_before: int) -> int:
    ids = [engine.add_stream() for _ in range(cohort)]
    frames = engine.chunk_input_frames
    for sid in ids:
        engine.push(sid, feats[: frames * (chunks_before + 1)])
    for _ in range(chunks_before):
        engine.step()
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    assert engine.stats[-1].cohort == cohort
    for sid in ids:
        engine.cancel(sid)
    return calls


def test_tick_host_calls_per_stream_are_a_small_constant(clips):
    pcm = np.concatenate(clips[1][:6])  # ~18 s: hypotheses keep growing over the chunks
    rec = Recognizer(max_streams=32, max_seconds=30.0)
    feats = rec.cmvn.normalize(fbank(pcm))
    slopes = collections.OrderedDict()
    for chunks_before in (1, 8):
        small, large = (_tick_calls(rec.engine, feats, n, chunks_before) for n in (8, 32))
        slopes[chunks_before] = (large - small) / 24
    from oasr.fast.ctc_native import unavailable_reason

    bound = PER_STREAM_CALLS if unavailable_reason() is None else PER_STREAM_CALLS_TORCH_SEARCH
    assert all(slope <= bound for slope in slopes.values()), slopes
    # longer histories and hypotheses add no per-stream calls (beyond a few percent of noise)
    assert slopes[8] <= slopes[1] * 1.1 + 5, slopes


@pytest.mark.parametrize("twin", ["reference", "fast"])
def test_peek_states_reads_every_states_peek_at_once(twin):
    import oasr.fast as fast
    import oasr.reference as reference
    from oasr.ctc.config import CtcDecoderConfig

    module = {"reference": reference, "fast": fast}[twin]
    decoder = module.StreamingCtcDecoder(CtcDecoderConfig(beam_size=4))
    torch.manual_seed(0)
    states = [decoder.create_state(batch, 7) for batch in (1, 3, 2)]
    for state, frames in zip(states, (0, 5, 9), strict=True):  # one state never decoded: the empty prefix
        if frames:
            decoder.decode_chunk(state, torch.log_softmax(torch.randn(state.batch, frames, 7) * 3, -1))
    assert decoder.peek_states(states) == [decoder.peek(state) for state in states]
    assert decoder.peek_states([]) == []
    assert any(len(h.tokens) > 1 for rows in decoder.peek_states(states) for h in rows)


def test_live_lanes_stop_at_their_timeout_and_leave_the_recognizer_idle(clips):
    from oasr.asr.live_source import plan_lanes, play_lanes

    audio = clips[1]
    lanes = plan_lanes([len(a) for a in audio], 2, 3.0, stagger=0.5)
    rec = Recognizer(max_streams=4, max_seconds=8.0)
    run = play_lanes(rec, audio, lanes, timeout=0.8)
    assert run.timed_out and not rec.streams and rec.engine.num_active == 0
    assert len(run.transcripts) < sum(len(lane.clips) for lane in lanes)
    again = play_lanes(rec, audio, plan_lanes([len(a) for a in audio], 1, 1.0, stagger=0.5))
    assert not again.timed_out and len(again.transcripts) == 1
