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
        assert json.loads(blob[12 : 12 + int.from_bytes(blob[8:12], "little")])["version"] == 2
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

    plain = Recognizer(max_streams=2)
    s = plain.open_stream()
    s.accept(clips[0][:32000])
    plain.step()
    old = plain.suspend(s.id)
    assert meta(old)["version"] == 1 and "turns" not in meta(old)  # a stream without turns: as before
    plain.resume(old)
    assert plain.streams[s.id].segments is None
    plain.cancel(s.id)

    s = turns.open_stream()
    s.accept(joined(clips[:1], [0.5])[:48000])
    turns.step()
    blob = turns.suspend(s.id)
    assert meta(blob)["version"] == 2 and meta(blob)["turns"]["segments"] == []
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
