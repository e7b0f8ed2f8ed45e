"""Recognizer streams that leave and come back: cancel, suspend and resume (what a server's shutdown and a
replica's migration rely on). The oracle is the same clip streamed without interruption."""

import pytest

from oasr.asr.audio import load_audio
from oasr.asr.recognizer import Recognizer
from oasr.asr.testset import load_testset

PIECE = 5120  # samples (320 ms), as a live client sends them


@pytest.fixture(scope="module")
def clips():
    items = load_testset()[:3]
    return [load_audio(item.path) for item in items]


@pytest.fixture(scope="module")
def recognizer():
    return Recognizer(max_streams=4)


def stream_clip(rec, pcm, suspend_at=None, target=None, end_then_suspend=False):
    """Stream ``pcm`` in pieces through ``rec``; after piece ``suspend_at`` (or after ``end``) the stream is
    suspended and resumed on ``target`` (default ``rec``), which finishes it. Returns (text, partials)."""
    stream = rec.open_stream()
    pieces = [pcm[i : i + PIECE] for i in range(0, len(pcm), PIECE)]
    moved, done = False, {}
    for k, piece in enumerate(pieces):
        stream.accept(piece)
        if k == len(pieces) - 1:
            stream.end()
        if suspend_at == k and not end_then_suspend and not moved:
            blob = rec.suspend(stream.id)
            assert stream.id not in rec.streams
            rec, moved = target or rec, True
            stream = rec.resume(blob)
        if not (end_then_suspend and k == len(pieces) - 1):  # leave it ended but unfinished for the suspend
            done.update((t.id, t) for t in rec.step())
    if end_then_suspend and not moved:
        assert stream.id not in done
        blob = rec.suspend(stream.id)
        rec = target or rec
        stream = rec.resume(blob)
    for _ in range(1000):
        if stream.id in done:
            return done[stream.id].text, done[stream.id].partials
        done.update((t.id, t) for t in rec.step())
    raise AssertionError("the stream never finished")


@pytest.mark.parametrize("suspend_at", [0, 3, 7])
def test_suspend_resume_gives_the_uninterrupted_transcript(recognizer, clips, suspend_at):
    for pcm in clips[:2]:
        want = stream_clip(recognizer, pcm)
        assert stream_clip(recognizer, pcm, suspend_at=suspend_at) == want
    assert recognizer.pool_usage()["blocks_used"] == 0


def test_resume_on_another_recognizer_and_twin(recognizer, clips):
    other = Recognizer(max_streams=2, twin="reference")
    pcm = clips[2]
    want_text, _ = stream_clip(recognizer, pcm)
    got_text, _ = stream_clip(recognizer, pcm, suspend_at=4, target=other)
    assert got_text == want_text
    got_text, _ = stream_clip(recognizer, pcm, end_then_suspend=True, target=other)
    assert got_text == want_text


def test_a_stream_never_admitted_travels_as_buffered_features(recognizer, clips):
    pcm = clips[0]
    want = stream_clip(recognizer, pcm)
    stream = recognizer.open_stream()
    stream.accept(pcm[: 3 * PIECE])  # pushed, but no tick has admitted it yet
    assert not recognizer.engine.admitted(stream.id)
    blob = recognizer.suspend(stream.id)
    assert recognizer.pool_usage()["streams_open"] == 0
    stream = recognizer.resume(blob, stream_id="again")
    stream.accept(pcm[3 * PIECE :])
    stream.end()
    done = {}
    for _ in range(1000):
        done.update((t.id, t) for t in recognizer.step())
        if "again" in done:
            break
    assert done["again"].text == want[0]


def test_cancel_frees_slot_and_blocks(recognizer, clips):
    before = recognizer.pool_usage()
    stream = recognizer.open_stream()
    chunk_samples = (recognizer.encoder.config.chunk_size + 2) * 4 * 160  # one chunk of encoder frames, and margin
    assert len(clips[0]) > chunk_samples
    stream.accept(clips[0][:chunk_samples])
    recognizer.step()
    assert recognizer.pool_usage()["blocks_used"] > before["blocks_used"]
    recognizer.cancel(stream.id)
    assert recognizer.pool_usage() == before
    with pytest.raises(KeyError):
        recognizer.cancel(stream.id)


def test_bad_bytes_are_refused_and_change_nothing(recognizer, clips):
    stream = recognizer.open_stream()
    stream.accept(clips[1][: 4 * PIECE])
    recognizer.step()
    blob = recognizer.suspend(stream.id)
    before = (recognizer.pool_usage(), recognizer.engine.stream_ids)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x10
    for bad, why in ((b"", "not a suspended stream"), (b"RIFF" + bytes(100), "not a suspended stream"),
                     (blob[:-1], "checksum"), (bytes(flipped), "checksum")):
        with pytest.raises(ValueError, match=why):
            recognizer.resume(bad)
        assert (recognizer.pool_usage(), recognizer.engine.stream_ids) == before
    recognizer.resume(blob)  # the intact bytes still resume
    recognizer.cancel(stream.id)


def test_foreign_model_is_refused(recognizer, clips, tmp_path):
    import torch

    from oasr.asr.checkpoint import default_model_path, load_checkpoint, save_checkpoint

    encoder, decoder, spec, cmvn, info = load_checkpoint(default_model_path())
    with torch.no_grad():
        next(encoder.parameters()).add_(1e-3)
    save_checkpoint(tmp_path / "other.safetensors", encoder, decoder, spec, cmvn, info)
    other = Recognizer(tmp_path / "other.safetensors", max_streams=2)
    stream = recognizer.open_stream()
    stream.accept(clips[0][: 4 * PIECE])
    recognizer.step()
    blob = recognizer.suspend(stream.id)
    with pytest.raises(ValueError, match="another model"):
        other.resume(blob)
    assert other.pool_usage()["streams_open"] == 0 and other.pool_usage()["blocks_used"] == 0


def test_a_rescoring_recognizer_resumes_to_the_same_second_pass(clips):
    rec = Recognizer(max_streams=2, rescore=True)
    pcm = clips[1]
    want_text, _ = stream_clip(rec, pcm)
    assert stream_clip(rec, pcm, suspend_at=2)[0] == want_text
    assert stream_clip(rec, pcm, end_then_suspend=True)[0] == want_text
