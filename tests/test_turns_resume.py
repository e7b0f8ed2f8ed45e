"""Live turns that leave and come back, and turns at their edges.

A stream with endpointing suspended (or checkpointed) mid-turn, between turns, or just after an endpoint, and
resumed on the same recognizer, on another one, or in a fresh process, gives exactly the segments (texts,
times, words) and turn events of the stream that never left. Recognizer blobs of streams without turns stay
version 1; those with turns are version 2 and say so. At a turn's edge, speech that starts in the chunk an
endpoint fired in reaches the next turn whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oasr.vad import EndpointConfig

ROOT = Path(__file__).resolve().parents[1]
PIECE = 5120  # samples (320 ms), as a live client sends them
GAPS = [0.1, 1.5, 2.5]  # a small lead, then the pause before each following clip


@pytest.fixture(scope="module")
def clips():
    import torch

    from oasr.asr.audio import load_audio
    from oasr.asr.testset import load_testset

    torch.set_num_threads(1)
    return [load_audio(c.path) for c in load_testset(limit=5)]


@pytest.fixture(scope="module")
def turns():
    from oasr.asr.recognizer import Recognizer

    return Recognizer(endpointing=EndpointConfig(), max_streams=4)


def joined(clips, gaps, tail=1.0):
    parts = []
    for gap, x in zip(gaps, clips, strict=True):
        parts += [np.zeros(int(gap * 16000), np.float32), x]
    return np.concatenate(parts + [np.zeros(int(tail * 16000), np.float32)])


def run(rec, pcm, move_at=None, target=None, checkpoint=False):
    """Stream ``pcm`` through ``rec``; after piece ``move_at`` the stream is suspended (or checkpointed and
    dropped) and resumed on ``target`` (default ``rec``). Returns (segments, turn events, blob or None)."""
    stream = rec.open_stream()
    events, blob = [], None
    pieces = [pcm[i : i + PIECE] for i in range(0, len(pcm), PIECE)]
    for k, piece in enumerate(pieces):
        stream.accept(piece)
        if k == len(pieces) - 1:
            stream.end()
        done = rec.step()
        if k == move_at:
            if checkpoint:
                blob = rec.checkpoint(stream.id)
                rec.cancel(stream.id)
            else:
                blob = rec.suspend(stream.id)
            assert stream.id not in rec.streams and stream.id not in (rec.turns.slots if rec.turns else {})
            events += stream.turn_events
            rec = target or rec
            stream = rec.resume(blob)
            stream.turn_events = []
        assert not done or k == len(pieces) - 1
    while not done:
        done = rec.step()
    (t,) = done
    return t.segments, events + stream.turn_events, blob


@pytest.fixture(scope="module")
def uninterrupted(clips, turns):
    pcm = joined(clips[:3], GAPS)
    segments, events, _ = run(turns, pcm)
    assert len(segments) == 3 and all(seg.words for seg in segments)
    return pcm, segments, events


def moments(turns, pcm):
    """Pieces after which the stream is mid-turn (in its first or second turn), between turns (gated, its
    silence dropped), or waiting with the next turn's first frames (not yet a chunk)."""
    stream = turns.open_stream()
    found: dict = {}
    for k in range(len(pcm) // PIECE):
        stream.accept(pcm[k * PIECE : (k + 1) * PIECE])
        turns.step()
        state = "mid-turn" if turns.engine.admitted(stream.id) else "between" if stream.gated else "waiting"
        if stream.segments:
            found.setdefault(state, k)
        if len(stream.segments) == 2 and state == "mid-turn":
            found.setdefault("second turn", k)
    turns.cancel(stream.id)
    assert {"between", "mid-turn", "second turn"} <= set(found), found
    return found


def test_suspend_and_resume_anywhere_gives_the_uninterrupted_turns(turns, uninterrupted):
    from oasr.asr.recognizer import Recognizer

    pcm, want, want_events = uninterrupted
    other = Recognizer(max_streams=2)  # no endpointing of its own: resuming a stream with turns enables it
    for state, k in moments(turns, pcm).items():
        got, events, blob = run(turns, pcm, move_at=k)
        assert (got, events) == (want, want_events), state
        saved = json.loads(blob[12 : 12 + int.from_bytes(blob[8:12], "little")])
        assert saved["version"] == (3 if turns.word_pass is not None else 2) and "turns" in saved
        got, events, _ = run(turns, pcm, move_at=k, target=other, checkpoint=True)
        assert (got, events) == (want, want_events), state
    assert other.turns is not None and not other.turns.slots
    assert turns.pool_usage()["blocks_used"] == 0 and not turns.turns.slots


def test_a_fresh_process_resumes_a_stream_with_turns(turns, uninterrupted, tmp_path):
    pcm, want, _ = uninterrupted
    k = moments(turns, pcm)["second turn"]
    stream = turns.open_stream()
    for piece in range(k + 1):
        stream.accept(pcm[piece * PIECE : (piece + 1) * PIECE])
        turns.step()
    blob = turns.checkpoint(stream.id)
    turns.cancel(stream.id)
    (tmp_path / "stream.blob").write_bytes(blob)
    np.save(tmp_path / "rest.npy", pcm[(k + 1) * PIECE :])
    child = ("import json, sys, numpy as np\n"
             "from oasr.asr.recognizer import Recognizer\n"
             "from oasr.vad import EndpointConfig\n"
             "rec = Recognizer(endpointing=EndpointConfig(), max_streams=2)\n"
             "stream = rec.resume(open(sys.argv[1], 'rb').read())\n"
             "rest = np.load(sys.argv[2])\n"
             "done = []\n"
             "for i in range(0, len(rest), 5120):\n"
             "    stream.accept(rest[i : i + 5120])\n"
             "    done += rec.step()\n"
             "stream.end()\n"
             "while not done:\n"
             "    done += rec.step()\n"
             "print(json.dumps([[s.start, s.end, s.text, [[w.word, w.start, w.end] for w in s.words]] "
             "for s in done[0].segments]))\n")
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path / "stream.blob"), str(tmp_path / "rest.npy")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == [[s.start, s.end, s.text, [[w.word, w.start, w.end] for w in s.words]] for s in want]


def test_blob_versions_and_refusals(turns, clips):
    from oasr.asr.recognizer import Recognizer

    def meta(blob):
        n = int.from_bytes(blob[8:12], "little")
        return json.loads(blob[12 : 12 + n])

    plain = Recognizer(max_streams=2, language_model=None)  # the token search alone: versions 1 and 2
    s = plain.open_stream()
    s.accept(clips[0][:32000])
    plain.step()
    old = plain.suspend(s.id)
    assert meta(old)["version"] == 1 and "turns" not in meta(old)  # a stream without turns: as before
    plain.resume(old)
    assert plain.streams[s.id].segments is None
    plain.cancel(s.id)

    plain_turns = Recognizer(max_streams=2, language_model=None, endpointing=EndpointConfig())
    s = plain_turns.open_stream()
    s.accept(joined(clips[:1], [0.5])[:48000])
    plain_turns.step()
    assert meta(plain_turns.suspend(s.id))["version"] == 2  # turns, no word search
    s = turns.open_stream()
    s.accept(joined(clips[:1], [0.5])[:48000])
    turns.step()
    blob = turns.suspend(s.id)
    assert meta(blob)["version"] == 3 and meta(blob)["turns"]["segments"] == [] and meta(blob)["words"]
    stricter = Recognizer(endpointing=EndpointConfig(min_silence_seconds=0.5), max_streams=2)
    with pytest.raises(ValueError, match="cut into turns with"):
        stricter.resume(blob)
    assert not stricter.streams and not stricter.turns.slots and stricter.engine.stream_ids == []
    with pytest.raises(ValueError, match="does not go with rescore=True"):
        Recognizer(rescore=True, max_streams=2).resume(blob)
    turns.resume(blob)
    turns.cancel(s.id)


def test_speech_starting_in_the_chunk_an_endpoint_fires_in_reaches_the_next_turn_whole(clips):
    """A 1.07 s pause: the endpoint fires in the chunk that holds the next sentence's first words; the
    next turn encodes them again (the ending turn's CTC left them blank), so no word is lost."""
    from oasr.asr.recognizer import Recognizer

    rec = Recognizer(endpointing=EndpointConfig(), max_streams=2)
    alone = [t.text for t in Recognizer(max_streams=2).transcribe(clips[3:5])]
    got = rec.transcribe([joined(clips[3:5], [0.3, 1.07])])[0]
    assert [s.text for s in got.segments] == alone


# ---- the endpoint's cut, on synthetic frames (no model) ---------------------------------------------------------
class _FakeEngine:
    """What ``TurnTracker._on_event`` asks of an engine: the unencoded count, and ``new_turn``'s result."""

    def __init__(self, sid, buffered: int, tokens, frames):
        from oasr.ctc.config import CtcHypothesis
        from oasr.engine.streaming.records import StreamResult

        self.sid, self.buffered, self.given = sid, buffered, None
        self.result = StreamResult(sid, list(tokens), 0, 0, "eos", None, 0, 0,
                                   nbest=[CtcHypothesis(list(tokens), 0.0, list(frames))])
        self.stream_ids = [sid]

    def num_buffered(self, sid) -> int:
        return self.buffered

    def new_turn(self, sid, pending):
        self.given = pending
        return self.result


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_an_endpoint_gives_the_next_turn_every_frame_after_its_cut(data):
    """For any turn (frames pushed, how many the engine holds unencoded, where the silence ended, which frames
    are loud, which frames emitted tokens): the next turn gets exactly the frames from the cut on, less the
    gate's silence; the ending turn keeps exactly its tokens before the cut; the stream's clock moves by the
    frames before the cut plus those the gate dropped, and its encoded count by minus what is encoded again."""
    import torch

    from oasr.asr.turns import TurnTracker
    from oasr.tokenizers.char import CharTokenizer
    from oasr.vad import EndpointEvent

    tracker = TurnTracker(EndpointConfig(), subsampling_rate=4, max_streams=1, chunk_input_frames=128)
    msf = tracker.config.min_silence_frames
    end_frame = data.draw(st.integers(1, 60))
    cut = end_frame + msf
    encoded_frames = data.draw(st.integers(cut, cut + 32))  # the endpoint fired in the last chunk encoded
    buffered = data.draw(st.integers(0, 40))
    pushed = encoded_frames * 4 + buffered
    kept = min(pushed, tracker.keep_frames + buffered)
    onset = data.draw(st.one_of(st.none(), st.integers(0, kept - 1)))  # the first loud frame kept, if any
    loud = [onset is not None and i >= onset for i in range(kept)]
    tok = CharTokenizer()
    tokens = tok.encode("ab cd")
    frames = sorted(data.draw(st.lists(st.integers(0, encoded_frames - 1), min_size=len(tokens),
                                       max_size=len(tokens))))

    class Stream:
        id = "s"
        turn_offset, frames_done, gated, gate_tail, turn_pushed, text = 1000, 0, False, None, pushed, "ab"
        segments, turn_events = [], []

    stream = Stream()
    stream.frames_done = 1000 + encoded_frames * 4
    stream.recent = torch.arange(kept, dtype=torch.float32)[:, None].repeat(1, 80) + (pushed - kept)
    stream.recent_db = np.where(loud, -20.0, -80.0)  # quiet, not digital silence (which is never lead)
    tracker.slots["s"] = 0
    engine = _FakeEngine("s", buffered, tokens, frames)

    class Rec:
        pass

    rec = Rec()
    rec.engine, rec.tokenizer, rec.streams, rec.word_pass = engine, tok, {"s": stream}, None
    tracker._on_event(rec, stream, EndpointEvent("speech_stopped", 0, end_frame, "silence"), finished=False)

    at = max(cut * 4, pushed - kept)  # the turn's frame where the next turn's audio starts (what is kept)
    rest = loud[at - (pushed - kept):]
    first_loud = next((i for i, x in enumerate(rest) if x), None)
    dropped = len(rest) - min(len(rest), tracker.lead_frames) if first_loud is None else \
        max(0, first_loud - tracker.lead_frames)
    given = engine.given[:, 0].long().tolist()
    assert given == list(range(at + dropped, pushed)) if first_loud is not None else given == []
    n = sum(1 for f in frames if f < cut)
    text = tok.decode(tokens[:n])
    assert [s.text for s in stream.segments] == ([text] if text else [])  # an empty turn is no segment
    assert all(len(s.words) == len(s.text.split()) for s in stream.segments)
    assert stream.turn_offset == 1000 + at + dropped
    assert stream.frames_done == 1000 + encoded_frames * 4 - max(0, encoded_frames * 4 - at) + dropped
    assert stream.turn_pushed == len(given) and stream.text == ""


def test_the_gate_never_gives_digital_silence_as_lead():
    """Up to ``lead_frames`` frames before the first loud one are lead, but not frames of digital silence (exact
    zeros, -inf dB): between a pause of zeros and a recording's own quiet start the shipped model wrote short
    words. Quiet frames that are not zeros stay lead; the dropped ones move the stream's clock."""
    import torch

    from oasr.asr.turns import TurnTracker

    tracker = TurnTracker(EndpointConfig(), subsampling_rate=4, max_streams=1)

    class Stream:
        turn_offset, frames_done, gated, gate_tail = 0, 0, True, None

    feats = torch.arange(12, dtype=torch.float32)[:, None].repeat(1, 80)
    for db, first in ([-np.inf] * 6 + [-80.0] * 2 + [-20.0] * 4, 6),  ([-np.inf] * 8 + [-20.0] * 4, 8), \
                     ([-80.0] * 8 + [-20.0] * 4, 8 - tracker.lead_frames):
        stream = Stream()
        kept, _ = tracker._gate_frames(stream, feats, np.array(db))
        assert kept[:, 0].long().tolist() == list(range(first, 12)), db
        assert stream.turn_offset == first and stream.frames_done == first and not stream.gated
