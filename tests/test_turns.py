"""Live turns in the recognizer (oasr.asr.turns): the CTC endpointer ends a stream's turn, the stream goes on."""

from __future__ import annotations

import numpy as np
import pytest

from oasr.vad import EndpointConfig

GAPS = [0.1, 2.0, 3.0, 2.5]  # a small lead, then the pause before each following clip


@pytest.fixture(scope="module")
def clips_and_alone():
    import torch

    from oasr.asr.audio import load_audio
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset

    torch.set_num_threads(1)
    clips = [load_audio(c.path) for c in load_testset(limit=4)]
    plain = Recognizer()
    return plain, clips, [t.text for t in plain.transcribe(clips)]


@pytest.fixture(scope="module")
def turns():
    from oasr.asr.recognizer import Recognizer

    return Recognizer(endpointing=EndpointConfig())


def _joined(clips, gaps=GAPS, tail=1.0):
    parts, starts, at = [], [], 0
    for gap, x in zip(gaps, clips, strict=True):
        parts += [np.zeros(int(gap * 16000), np.float32), x]
        at += int(gap * 16000)
        starts.append(at / 16000)
        at += len(x)
    return np.concatenate(parts + [np.zeros(int(tail * 16000), np.float32)]), starts


def test_one_segment_per_clip_equal_to_the_clip_alone(clips_and_alone, turns):
    plain, clips, alone = clips_and_alone
    x, starts = _joined(clips)
    assert not plain.transcribe([x])[0].segments  # without turns: one text, no segments
    t = turns.transcribe([x])[0]
    assert [s.text for s in t.segments] == alone
    assert t.text == " ".join(alone)
    for seg, start, clip in zip(t.segments, starts, clips, strict=True):  # times on the stream's own clock
        assert start - 0.1 <= seg.start < start + 0.6 and start + len(clip) / 16000 - 0.8 < seg.end
        assert seg.end <= start + len(clip) / 16000 + 0.1
        assert " ".join(w.word for w in seg.words) == seg.text
        assert all(seg.start <= w.start < w.end <= seg.end + 0.1 for w in seg.words)
    assert t.words == [w for seg in t.segments for w in seg.words]
    # the pieces the audio comes in change nothing: segments, their times, the words' times
    assert turns.transcribe([x], piece_seconds=1.0)[0].segments == t.segments


def test_a_stream_fed_in_odd_pieces_keeps_its_id_and_reports_every_turn(clips_and_alone, turns):
    _, clips, alone = clips_and_alone
    x, _ = _joined(clips[:3], [3.0, 5.0, 2.0])  # 3 s of leading silence, a 5 s pause
    stream = turns.open_stream("caller-7")
    sizes, at, done, history = [1234, 5000, 777, 16000], 0, [], []
    while at < len(x):
        n = sizes[len(done) % len(sizes)]
        stream.accept(x[at : at + n])
        at += n
        done += turns.step()
        if turns.engine.status("caller-7") == "active":
            history.append(turns.engine.backend.history_frames("caller-7"))
    stream.end()
    while not done:
        done += turns.step()
    (t,) = done
    assert t.id == "caller-7" and [s.text for s in t.segments] == alone[:3]
    kinds = [e[0] for e in stream.turn_events]
    assert kinds == ["speech_started", "speech_stopped", "segment"] * 3
    times = [e[1] for e in stream.turn_events if e[0] != "segment"]
    assert times == sorted(times)
    # one turn's state at a time: the cache never holds more than the longest clip (25 frames/s)
    assert max(history) <= max(len(c) for c in clips[:3]) / 16000 * 25 + 32
    assert "caller-7" not in turns.turns.slots and not turns.streams


def test_silence_only_gives_no_segment_and_default_recognizers_are_unchanged(clips_and_alone, turns):
    plain, clips, alone = clips_and_alone
    t = turns.transcribe([np.zeros(3 * 16000, np.float32)])[0]
    assert t.segments == [] and t.text == ""
    assert plain.turns is None and not plain.engine.emit_speech_probs
    assert plain.transcribe(clips[:1])[0].segments == []


def test_bad_options_are_refused_and_a_cancelled_stream_frees_its_slot(turns):
    from oasr.asr.recognizer import Recognizer

    with pytest.raises(ValueError, match="does not go with rescore=True"):
        Recognizer(endpointing=EndpointConfig(), rescore=True)
    with pytest.raises(ValueError, match="must be an oasr.vad.EndpointConfig"):
        Recognizer(endpointing={"min_silence_seconds": 0.5})
    stream = turns.open_stream()
    stream.accept(np.zeros(16000, np.float32))
    turns.cancel(stream.id)
    assert stream.id not in turns.turns.slots


def test_more_open_streams_than_slots_grow_the_endpointer_bank(clips_and_alone):
    from oasr.asr.recognizer import Recognizer

    _, clips, alone = clips_and_alone
    rec = Recognizer(endpointing=EndpointConfig(), max_streams=1)
    x, _ = _joined(clips[:2], [0.5, 2.0])
    streams = [rec.open_stream() for _ in range(3)]  # two wait for the one slot
    assert rec.turns.bank.max_streams >= 3 and len(set(rec.turns.slots.values())) == 3
    for s in streams:
        s.accept(x)
        s.end()
    done = []
    while len(done) < 3:
        done += rec.step()
    assert all([seg.text for seg in t.segments] == alone[:2] for t in done)


def test_word_times_group_tokens_into_words():
    from oasr.asr.words import Word, word_times
    from oasr.tokenizers.char import CharTokenizer

    tok = CharTokenizer()
    tokens = tok.encode("hi yo")
    frames = [3, 4, 6, 9, 11]
    assert word_times(tok, tokens, frames, 0.04, 1.0) == [Word("hi", 1.12, 1.2), Word("yo", 1.36, 1.48)]
    with pytest.raises(ValueError, match="5 tokens but 4 frames"):
        word_times(tok, tokens, frames[:4], 0.04)


def test_word_times_one_pass_equals_the_decode_rule_on_random_tokens():
    """CharTokenizer.word_index (one pass) gives the same words and times as the generic rule (a decode per
    prefix), on random ids with blanks, sos/eos, spaces and apostrophes anywhere."""
    import random
    from types import SimpleNamespace

    from oasr.asr.words import word_times
    from oasr.tokenizers.char import CharTokenizer

    tok = CharTokenizer()
    generic = SimpleNamespace(decode=tok.decode)  # no word_index: the decode-per-prefix rule
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([0, 1, 1, 2, tok.sos_eos_id] + list(range(3, 8))) for _ in range(rng.randrange(0, 25))]
        frames = sorted(rng.sample(range(200), len(ids)))
        assert word_times(tok, ids, frames, 0.04, 0.5) == word_times(generic, ids, frames, 0.04, 0.5)
    with pytest.raises(ValueError, match="outside"):
        tok.word_index([1, 99])


def test_char_tokenizer_decode_equals_the_per_character_rule():
    """decode (a table lookup per id) equals the rule spelled out per character, on random ids, and names
    the first id outside the vocabulary."""
    import random
    import re

    import torch

    from oasr.tokenizers.char import CharTokenizer

    tok = CharTokenizer()

    def by_character(ids):
        chars = [tok.alphabet[i - 1] for i in ids if 0 < i < tok.sos_eos_id]
        return re.sub(" +", " ", "".join(chars)).strip()

    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 30))]
        assert tok.decode(ids) == by_character(ids) == tok.decode(torch.tensor(ids, dtype=torch.long))
    with pytest.raises(ValueError, match=r"id -1 outside \[0, 30\)"):
        tok.decode([3, -1, 99])
    with pytest.raises(ValueError, match=r"id 99 outside"):
        tok.decode([3, 99, -1])


def test_engine_new_turn_refusals_change_nothing(clips_and_alone):
    import torch

    plain, clips, alone = clips_and_alone
    engine = plain.engine
    with pytest.raises(KeyError):
        engine.new_turn("nobody")
    stream = plain.open_stream("t")
    stream.accept(clips[0][: 3 * 16000])
    plain.step()
    before = (engine.status("t"), engine.buffered_input("t").shape)
    with pytest.raises(ValueError, match=r"pending must be finite float \(T, input_dim=80\)"):
        engine.new_turn("t", torch.zeros(3, 7))
    assert (engine.status("t"), engine.buffered_input("t").shape) == before
    result = engine.new_turn("t")  # the turn so far; the stream goes on under its id from position 0
    assert result.tokens and engine.status("t") == "waiting" and engine.stream_ids.count("t") == 1
    plain.cancel("t")
