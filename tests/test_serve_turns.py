"""Turns through the server: verbose_json segments of an upload cut by the endpointer, and the WebSocket's
speech-started / speech-stopped / one completed event per turn (OpenAI's realtime names)."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("websockets")

import soundfile as sf  # noqa: E402

from oasr.asr.audio import load_audio  # noqa: E402
from oasr.asr.recognizer import Recognizer  # noqa: E402
from oasr.asr.testset import load_testset  # noqa: E402
from oasr.serve import protocol  # noqa: E402
from oasr.serve.app import ServeOptions, ServerThread, create_app  # noqa: E402
from oasr.serve.client import realtime_url  # noqa: E402
from oasr.serve.worker import EngineWorker  # noqa: E402

GAPS = [0.1, 2.0, 3.0]


@pytest.fixture(scope="module")
def joined():
    """Three shipped clips with a small lead and 2-3 s pauses, their texts alone, the clips' start times."""
    audio = [load_audio(c.path) for c in load_testset(limit=3)]
    alone = [t.text for t in Recognizer(max_streams=4).transcribe(audio)]
    parts, starts, at = [], [], 0
    for gap, x in zip(GAPS, audio, strict=True):
        parts += [np.zeros(int(gap * 16000), np.float32), x]
        at += int(gap * 16000)
        starts.append(at / 16000)
        at += len(x)
    return np.concatenate(parts + [np.zeros(16000, np.float32)]), alone, starts


@pytest.fixture(scope="module")
def server():
    worker = EngineWorker(Recognizer(max_streams=4, max_seconds=60.0), admit_timeout=5.0)
    srv = ServerThread(create_app(worker, ServeOptions(max_audio_seconds=60.0)))
    yield srv
    srv.stop()


def _wav(pcm) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, pcm, 16000, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def test_verbose_json_with_chunking_strategy_has_one_segment_per_turn(server, joined):
    pcm, alone, starts = joined
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    verbose = client.audio.transcriptions.create(model="oasr", file=("long.wav", _wav(pcm)),
                                                 response_format="verbose_json", chunking_strategy="auto")
    assert [s.text for s in verbose.segments] == alone and verbose.text == " ".join(alone)
    assert [s.id for s in verbose.segments] == [0, 1, 2]
    for seg, start in zip(verbose.segments, starts, strict=True):
        assert start - 0.1 <= seg.start < start + 0.6 < seg.end
    plain = client.audio.transcriptions.create(model="oasr", file=("long.wav", _wav(pcm)),
                                               response_format="verbose_json")
    assert len(plain.segments) == 1 and plain.segments[0].start == 0.0  # without it: one segment, as before
    bad = httpx.post(server.url + "/v1/audio/transcriptions", files={"file": ("a.wav", _wav(pcm[:16000]))},
                     data={"chunking_strategy": "fixed"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_chunking_strategy"


def test_websocket_turn_detection_events(server, joined):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    pcm, alone, starts = joined

    async def run():
        events = []
        url = realtime_url(server.url, audio_format="float32") + "&turn_detection=server_vad"
        async with connect(url, max_size=None) as ws:
            created = json.loads(await ws.recv())
            for first in range(0, len(pcm), 2560):
                await ws.send(protocol.float_to_float32(pcm[first : first + 2560]))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            async for message in ws:
                events.append(json.loads(message))
            return created, events, ws.close_code

    created, events, code = asyncio.run(run())
    sid = created["session"]["id"]
    assert code == protocol.CLOSE_NORMAL and not [e for e in events if e["type"] == "error"]
    turn_events = [(e["type"], e["item_id"]) for e in events if not e["type"].endswith(".delta")]
    assert turn_events == [(kind, f"{sid}-turn{n}") for n in range(3) for kind in (
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "conversation.item.input_audio_transcription.completed")]
    completed = [e for e in events if e["type"].endswith(".completed")]
    assert [e["transcript"] for e in completed] == alone
    for e, start in zip(completed, starts, strict=True):
        assert start * 1000 - 100 <= e["audio_start_ms"] < e["audio_end_ms"]
    for n, text in enumerate(alone):  # each turn's deltas add up to its text
        assert "".join(e["delta"] for e in events if e["type"].endswith(".delta")
                       and e["item_id"] == f"{sid}-turn{n}") == text

    async def refused():
        async with connect(realtime_url(server.url) + "?turn_detection=semantic"):
            pass

    with pytest.raises(InvalidStatus) as info:
        asyncio.run(refused())
    assert info.value.response.status_code == 400


def test_word_timestamps_from_the_ctc_alignment(server, joined):
    pcm, alone, starts = joined
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    verbose = client.audio.transcriptions.create(model="oasr", file=("long.wav", _wav(pcm)),
                                                 response_format="verbose_json", chunking_strategy="auto",
                                                 timestamp_granularities=["word", "segment"])
    words = verbose.words
    assert " ".join(w.word for w in words) == verbose.text == " ".join(alone)
    assert all(a.end <= b.start for a, b in zip(words, words[1:], strict=False))  # in order, disjoint
    for seg in verbose.segments:  # a turn's words lie inside its clip's speech
        inside = [w for w in words if seg.start - 0.05 <= w.start and w.end <= seg.end + 0.1]
        assert " ".join(w.word for w in inside) == seg.text
    clip = pcm[int(GAPS[0] * 16000) : int(starts[1] * 16000)]  # one clip, no turns: words of the whole
    only_words = client.audio.transcriptions.create(model="oasr", file=("one.wav", _wav(clip)),
                                                    response_format="verbose_json", timestamp_granularities=["word"])
    assert " ".join(w.word for w in only_words.words) == only_words.text and only_words.segments is None
    bad = httpx.post(server.url + "/v1/audio/transcriptions", files={"file": ("a.wav", _wav(clip))},
                     data={"timestamp_granularities[]": "word"}, timeout=60)
    assert bad.status_code == 400 and "needs response_format=verbose_json" in bad.json()["error"]["message"]
