"""Endpointing policy (oasr.vad) on synthetic probability traces: no model, no GPU.

The per-stream ``Endpointer`` is checked against hand-drawn traces; ``EndpointerBank`` (the vectorised
twin) must emit exactly the per-stream machine's events for random traces cut into random chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oasr.vad import EndpointConfig, Endpointer, EndpointerBank, EndpointEvent, EnergyDetector
from oasr.vad.detectors import ctc_speech_probability

F = 0.04  # seconds per frame


def trace(spec: str) -> np.ndarray:
    """'..xx.x...' -> probabilities (x: 0.9, .: 0.1)."""
    return np.array([0.9 if ch == "x" else 0.1 for ch in spec])


def run(config, spec):
    e = Endpointer(config)
    return e.push(trace(spec)) + e.flush()


def test_a_turn_starts_at_its_first_speech_frame_and_ends_after_the_trailing_silence():
    c = EndpointConfig(frame_seconds=F, min_speech_seconds=2 * F, min_silence_seconds=3 * F)
    events = run(c, "..x.xxx.x....")
    assert events == [EndpointEvent("speech_started", 4), EndpointEvent("speech_stopped", 4, 9, "silence")]
    assert events[1].times(F) == pytest.approx((0.16, 0.36))


def test_single_frame_spikes_keep_a_turn_alive_and_a_lone_spike_does_not_start_one():
    c = EndpointConfig(frame_seconds=F, min_speech_seconds=2 * F, min_silence_seconds=4 * F)
    assert run(c, "x...x...x...") == []  # never two speech frames in a row outside a turn
    events = run(c, "xx..x..x..x.....")
    assert events == [EndpointEvent("speech_started", 0), EndpointEvent("speech_stopped", 0, 11, "silence")]


def test_a_long_turn_is_cut_at_the_maximum_and_a_new_one_starts():
    c = EndpointConfig(frame_seconds=F, min_speech_seconds=F, min_silence_seconds=10 * F, max_utterance_seconds=4 * F)
    events = run(c, "xxxxxxxxx")
    assert events == [EndpointEvent("speech_started", 0), EndpointEvent("speech_stopped", 0, 4, "max_length"),
                      EndpointEvent("speech_started", 4), EndpointEvent("speech_stopped", 4, 8, "max_length"),
                      EndpointEvent("speech_started", 8), EndpointEvent("speech_stopped", 8, 9, "end_of_stream")]


def test_silence_and_leading_silence():
    c = EndpointConfig(frame_seconds=F)
    assert run(c, "." * 200) == []  # 8 s of silence: nothing
    events = run(c, "." * 75 + "x.x.xx" + "." * 30)  # 3 s of leading silence lose nothing
    assert events[0] == EndpointEvent("speech_started", 75) and events[1].end_frame == 81


def test_pauses_shorter_than_the_silence_stay_in_one_turn():
    c = EndpointConfig(frame_seconds=F, min_silence_seconds=0.8)
    events = run(c, "xx" + "." * 19 + "xx" + "." * 20)
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"] and events[1].end_frame == 23


def test_chunking_does_not_change_the_events():
    c = EndpointConfig(frame_seconds=F, min_speech_seconds=2 * F, min_silence_seconds=3 * F)
    spec = "..xx.x....xxx..x.....xx"
    whole = run(c, spec)
    e = Endpointer(c)
    pieces = []
    for i in range(0, len(spec), 4):
        pieces += e.push(trace(spec[i : i + 4]))
    assert pieces + e.flush() == whole


@pytest.mark.parametrize("bad", [dict(frame_seconds=0), dict(min_silence_seconds=-1), dict(speech_threshold=1.0),
                                 dict(max_utterance_seconds=float("inf")),
                                 dict(min_speech_seconds=1.0, max_utterance_seconds=0.5)])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError, match="EndpointConfig"):
        EndpointConfig(**bad)


def test_bad_input_is_refused_and_changes_nothing():
    c = EndpointConfig(frame_seconds=F)
    bank = EndpointerBank(c, 3)
    bank.push([0, 1], np.array([[0.9, 0.9], [0.1, 0.9]]))
    before = [a.copy() for a in (bank.frame, bank.in_turn, bank.run, bank.start, bank.last_end)]
    for slots, probs in [([0, 0], np.zeros((2, 2))), ([3], np.zeros((1, 2))), ([0], np.zeros((2, 2))),
                         ([1], np.array([[np.nan, 0.1]]))]:
        with pytest.raises(ValueError, match="EndpointerBank.push"):
            bank.push(slots, probs)
    after = [bank.frame, bank.in_turn, bank.run, bank.start, bank.last_end]
    assert all((a == b).all() for a, b in zip(before, after, strict=True))
    with pytest.raises(ValueError, match="1-D"):
        Endpointer(c).push(np.zeros((2, 2)))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_bank_emits_the_per_stream_machine_s_events(data):
    c = EndpointConfig(frame_seconds=F, min_speech_seconds=data.draw(st.integers(1, 3)) * F,
                       min_silence_seconds=data.draw(st.integers(1, 6)) * F,
                       max_utterance_seconds=data.draw(st.integers(3, 12)) * F)
    n = data.draw(st.integers(1, 5))
    length = data.draw(st.integers(0, 60))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    traces = (rng.random((n, length)) < rng.random((n, 1))).astype(float) * 0.8 + 0.1
    singles = [Endpointer(c) for _ in range(n)]
    bank = EndpointerBank(c, n + 2)
    slots = rng.permutation(n + 2)[:n]
    expected = [[] for _ in range(n)]
    got = [[] for _ in range(n)]
    at = 0
    while at < length:
        step = data.draw(st.integers(1, 7))
        chunk = traces[:, at : at + step]
        for i in range(n):
            expected[i] += singles[i].push(chunk[i])
        for slot, events in bank.push(slots, chunk).items():
            got[list(slots).index(slot)] += events
        at += step
    for i in range(n):
        expected[i] += singles[i].flush()
    for slot, events in bank.flush(slots).items():
        got[list(slots).index(slot)] += events
    assert got == expected


def test_energy_detector_streams_like_the_whole_signal_and_silence_is_zero():
    rng = np.random.default_rng(0)
    x = np.concatenate([np.zeros(16000), 0.1 * rng.standard_normal(8000), np.zeros(8000)])
    whole = EnergyDetector().push(x)
    d = EnergyDetector()
    pieces = np.concatenate([d.push(x[i : i + 333]) for i in range(0, x.size, 333)])
    np.testing.assert_array_equal(pieces, whole)
    assert whole.shape == (50,) and (whole[:25] == 0).all() and (whole[25:37] > 0.99).all() and (whole[38:] == 0).all()
    with pytest.raises(ValueError, match="finite"):
        d.push(np.array([np.inf]))


def test_ctc_speech_probability():
    import torch

    lp = torch.log_softmax(torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0]]), dim=-1)
    p = ctc_speech_probability(lp, blank=0)
    assert p[0] < 0.05 and p[1] > 0.95
    with pytest.raises(ValueError, match="blank"):
        ctc_speech_probability(lp, blank=3)
