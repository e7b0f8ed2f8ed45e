"""Long recordings as segments (oasr.asr.segments): the energy endpointer cuts, each segment is one stream."""

from __future__ import annotations

import numpy as np
import pytest

from oasr.asr.segments import SegmenterConfig, speech_regions, transcribe_segments


@pytest.fixture(scope="module")
def rec_and_clips():
    import torch

    from oasr.asr.audio import load_audio
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset

    torch.set_num_threads(1)
    clips = load_testset(limit=4)
    return Recognizer(), [load_audio(c.path) for c in clips]


def test_pauses_and_leading_silence_lose_nothing(rec_and_clips):
    rec, pcm = rec_and_clips
    alone = [t.text for t in rec.transcribe(pcm)]
    gaps = [3.0, 1.0, 5.0, 2.0]  # leading silence, then the pause after each clip
    parts, starts, at = [], [], 0
    for gap, x in zip(gaps, pcm, strict=True):
        parts += [np.zeros(int(gap * 16000), np.float32), x]
        at += int(gap * 16000)
        starts.append(at / 16000)
        at += len(x)
    segs = transcribe_segments(rec, np.concatenate(parts + [np.zeros(16000, np.float32)]))
    assert [s.text for s in segs] == alone
    for seg, start, x in zip(segs, starts, pcm, strict=True):  # each segment covers its clip's speech
        assert start - 0.5 <= seg.start and seg.end <= start + len(x) / 16000 + 0.6


def test_silence_and_quiet_noise_give_no_segment(rec_and_clips):
    rec, _ = rec_and_clips
    assert transcribe_segments(rec, np.zeros(2 * 16000, np.float32)) == []
    quiet = (10 ** (-75 / 20) * np.random.default_rng(0).standard_normal(3 * 16000)).astype(np.float32)
    assert speech_regions(quiet) == []


def test_regions_are_padded_disjoint_and_a_long_turn_is_cut():
    burst = 0.1 * np.random.default_rng(1).standard_normal(16000).astype(np.float32)
    x = np.concatenate([np.zeros(8000, np.float32), burst, np.zeros(3200, np.float32), burst])
    regions = speech_regions(x, config=SegmenterConfig(min_silence_seconds=0.1, pad_seconds=0.5))
    assert len(regions) == 2 and regions[0][1] <= regions[1][0]  # 0.2 s apart: they meet halfway
    assert regions[0][0] == 8000 and regions[1][1] == len(x)  # the lead's 800 samples are zeros: none is lead
    hiss = (1e-4 * np.random.default_rng(2).standard_normal(8000)).astype(np.float32)  # quiet, not digital
    regions = speech_regions(np.concatenate([hiss, burst]), config=SegmenterConfig(min_silence_seconds=0.1))
    assert regions[0][0] == 8000 - 800
    long = speech_regions(np.tile(burst, 4), config=SegmenterConfig(max_segment_seconds=1.5))
    assert len(long) == 3
