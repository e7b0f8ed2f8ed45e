"""Serving speed of the trained model: real-time factor and per-chunk latency at 1, 8 and 64 streams,
and the training recipe's throughput.

Streams play shipped clips as live sources at real time (``oasr.asr.playback.play``), all
started together, so ``streams`` chunks are ready at each chunk boundary and the engine batches them.
Latency is from the moment a chunk's last audio was sent to its partial result; when the engine
cannot keep up, chunks queue and the latency grows with the audio, which the row shows. The training
row times a few optimizer steps of the recipe on the shipped clips' features.
"""

from __future__ import annotations

import time

import numpy as np

NOTES = "rtf: compute seconds per second of audio; latency in ms (real-time playback, wall clock); 1 torch thread"


def serving_row(streams: int, device: str, clips_per_stream: int = 1) -> dict:
    """Real-time factor and chunk latency percentiles (ms) of ``streams`` live streams of shipped clips."""
    from oasr.asr.audio import load_audio
    from oasr.asr.playback import play
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset

    clips = load_testset(limit=streams * clips_per_stream)
    audio = [load_audio(c.path) for c in clips]
    rec = Recognizer(device=device, max_streams=streams)
    transcripts, run = play(rec, audio, streams, 640, realtime=True)
    lat = np.array([x for t in transcripts for x in t.latencies]) * 1000
    seconds = sum(len(a) for a in audio) / 16000
    p50, p95, p99 = np.percentile(lat, [50, 95, 99])
    return {"section": "speech", "case": f"{streams} live streams", "audio_s": seconds,
            "rtf": rec.busy_seconds / seconds, "latency_p50_ms": p50, "latency_p95_ms": p95,
            "latency_p99_ms": p99, "peak_streams": run["peak_streams"]}


def training_row(steps: int = 4) -> dict:
    """Median time of ``steps`` training steps on 32 shipped clips, as utterances and audio seconds per second."""
    import torch

    from oasr.asr.audio import load_audio
    from oasr.asr.model import AsrSpec, build
    from oasr.asr.testset import load_testset
    from oasr.asr.train import joint_loss
    from oasr.features.fbank import GlobalCmvn, fbank

    spec = AsrSpec()
    tok = spec.tokenizer()
    clips = load_testset(limit=32)
    feats = [torch.from_numpy(fbank(load_audio(c.path))) for c in clips]
    cmvn = GlobalCmvn(torch.cat(feats).mean(0), 1 / torch.cat(feats).std(0))
    lens = torch.tensor([len(f) for f in feats])
    x = torch.zeros(len(feats), int(lens.max()), 80)
    for i, f in enumerate(feats):
        x[i, : len(f)] = cmvn.normalize(f)
    targets = [tok.encode(c.text) for c in clips]
    enc, dec = build(spec)
    opt = torch.optim.AdamW(list(enc.parameters()) + list(dec.parameters()), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss, _, _ = joint_loss(enc, dec, tok, x, lens, targets, 8, 4)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times[1:]))
    audio = float(lens.sum()) / 100
    return {"section": "speech", "case": f"training step ({len(clips)} utterances, {audio:.0f} s)",
            "utt_per_s": len(clips) / step_s, "x_real_time": audio / step_s, "threads": torch.get_num_threads()}


def section(quick: bool, device: str = "cpu") -> list[dict]:
    """This section's rows (``quick``: 1 and 8 streams, 2 training steps) on ``device``; see the module docstring."""
    rows = [serving_row(n, device) for n in ((1, 8) if quick else (1, 8, 64))]
    rows.append(training_row(2 if quick else 4))
    return rows
