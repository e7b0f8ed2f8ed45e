"""``python -m oasr serve``: real clients (the official ``openai`` client, WebSockets) against a live server.

Every server listens on 127.0.0.1 on a free port and stops at the end of its test or module; every
client call has a timeout. The reference is ``Recognizer().transcribe`` on the same clips (what
``python -m oasr transcribe`` prints): the engine's results do not depend on how audio is cut into
pieces or batched with other streams, so a served transcript must equal it exactly.

The default suite sends a subset of the shipped clips (``SUBSET``); ``python -m oasr bench
--sections serve`` sends all 120 through the ``openai`` client and streams 64 live clients.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("websockets")

import soundfile as sf  # noqa: E402

from oasr.asr import recognizer as recognizer_module  # noqa: E402
from oasr.asr.audio import load_audio  # noqa: E402
from oasr.asr.recognizer import Recognizer  # noqa: E402
from oasr.asr.testset import load_testset  # noqa: E402
from oasr.serve import protocol  # noqa: E402
from oasr.serve.app import ServeOptions, ServerThread, create_app  # noqa: E402
from oasr.serve.client import stream_audio  # noqa: E402
from oasr.serve.worker import EngineWorker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUBSET = 12  # clips through the openai client in the default suite (all 120: the serve bench)
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def clips():
    """The first ``SUBSET`` shipped clips, their PCM, and the offline transcripts (the reference)."""
    chosen = load_testset(limit=SUBSET)
    audio = [load_audio(c.path) for c in chosen]
    offline = [t.text for t in Recognizer(max_streams=8).transcribe(audio)]
    return chosen, audio, offline


def start(tmp_path=None, max_streams=8, admit_timeout=5.0, **options) -> ServerThread:
    """A server on a free port of 127.0.0.1, its recognizer sized for ``max_streams``."""
    worker = EngineWorker(Recognizer(max_streams=max_streams, max_seconds=60.0), admit_timeout=admit_timeout,
                          state_dir=tmp_path)
    return ServerThread(create_app(worker, ServeOptions(**{"max_audio_seconds": 30.0, **options})))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("state"))
    yield srv
    srv.stop()


def client_for(srv) -> openai.OpenAI:
    """The official client, pointed at ``srv`` (only ``base_url`` changed; the key is not checked)."""
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


def wait_for(predicate, timeout=30.0):
    """Poll ``predicate`` until it holds (bounded); returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def wav_bytes(pcm, rate, channels=1) -> bytes:
    buffer = io.BytesIO()
    data = np.stack([pcm] * channels, axis=1) if channels > 1 else pcm
    sf.write(buffer, data, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


# ---- the OpenAI transcription API --------------------------------------------------------------------
def test_openai_client_transcribes_like_offline(server, clips):
    chosen, _, offline = clips
    client = client_for(server)

    def one(clip):
        with open(clip.path, "rb") as f:
            return client.audio.transcriptions.create(model="oasr", file=f).text

    with ThreadPoolExecutor(4) as pool:  # concurrent uploads share the engine's ticks
        served = list(pool.map(one, chosen))
    assert served == offline
    assert all(served)  # the clips are speech: an empty transcript would make the comparison vacuous


def test_response_formats(server, clips):
    chosen, audio, offline = clips
    client = client_for(server)
    with open(chosen[0].path, "rb") as f:
        text = client.audio.transcriptions.create(model="oasr", file=f, response_format="text")
    assert text.strip() == offline[0]
    with open(chosen[0].path, "rb") as f:
        verbose = client.audio.transcriptions.create(model="oasr", file=f, response_format="verbose_json")
    assert verbose.text == offline[0] and verbose.duration == pytest.approx(len(audio[0]) / 16000, abs=1e-3)
    (segment,) = verbose.segments
    assert (segment.start, segment.text) == (0.0, offline[0]) and segment.end == verbose.duration
    times = [t for t, _ in segment.model_extra["partials"]]
    assert times == sorted(times) and times[-1] <= verbose.duration


def test_stream_true_yields_partials_ending_in_the_final_text(server, clips):
    chosen, _, offline = clips
    client = client_for(server)
    for clip, expected in zip(chosen[:3], offline[:3], strict=True):
        with open(clip.path, "rb") as f:
            events = list(client.audio.transcriptions.create(model="oasr", file=f, stream=True))
        *deltas, done = events
        assert done.type == "transcript.text.done" and done.text == expected
        assert len(deltas) >= 2 and all(e.type == "transcript.text.delta" for e in deltas)
        partials = [e.model_extra["text"] for e in deltas]
        assert partials[-1] == expected
        assert "".join(e.delta for e in deltas) == expected  # no word already sent was revised on these clips
        ends = [e.model_extra["audio_end_ms"] for e in deltas]
        assert ends == sorted(ends)


# ---- live audio over WebSockets ------------------------------------------------------------------------
def test_websocket_clients_concurrently_get_the_offline_transcripts(server, clips):
    _, audio, offline = clips

    async def run():
        return await asyncio.gather(*(stream_audio(server.url, pcm, piece_ms=160) for pcm in audio[:6]))

    results = asyncio.run(run())
    assert [r.transcript for r in results] == offline[:6]
    for r in results:
        assert r.close_code == protocol.CLOSE_NORMAL and not r.errors
        assert r.deltas and r.deltas[-1]["text"] == r.transcript
        assert "".join(d["delta"] for d in r.deltas) == r.transcript
        assert len(r.latencies) == len(r.deltas)
    assert wait_for(lambda: health(server)["streams_active"] == 0)
    server_side = health(server)["chunk_latency_ms"]  # the worker's own clock, one entry per encoded chunk
    assert server_side["chunks"] > 0
    assert 0 <= server_side["p50"] <= server_side["p95"] <= server_side["p99"]


def test_disconnect_mid_stream_frees_blocks_and_slot(server, clips):
    _, audio, _ = clips
    before = health(server)

    async def run():
        return await asyncio.gather(*(stream_audio(server.url, pcm, stop_at=len(pcm) // 2, close_after_delta=True)
                                      for pcm in audio[:3]))

    results = asyncio.run(run())
    assert all(r.deltas and r.transcript is None for r in results)  # each held blocks, then went away
    cancelled = before["streams_ended"]["cancelled"] + 3
    assert wait_for(lambda: health(server)["streams_ended"]["cancelled"] == cancelled), (health(server), before)
    assert wait_for(lambda: health(server)["pool"] == before["pool"]), (health(server), before)
    assert health(server)["streams_active"] == 0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'oasr_requests_total{endpoint="realtime",status="disconnected"}' in metrics


def test_upload_clients_that_go_away_free_their_streams(server, clips, monkeypatch):
    chosen, audio, _ = clips
    # every chunk of work takes at least 20 ms, so no 29 s upload can finish before its client is gone
    advance = recognizer_module.AudioStream._advance

    def slow_advance(self, encoder_frames, now):
        time.sleep(0.02)
        return advance(self, encoder_frames, now)

    monkeypatch.setattr(recognizer_module.AudioStream, "_advance", slow_advance)
    before = health(server)
    url = server.url + protocol.TRANSCRIPTION_PATH
    long_clip = np.concatenate([audio[i % len(audio)] for i in range(12)])[: 29 * 16000]
    # an event stream closed after its first delta
    with httpx.stream("POST", url, files={"file": ("long.wav", wav_bytes(long_clip, 16000))},
                      data={"model": "oasr", "stream": "true"}, timeout=TIMEOUT) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    assert json.loads(first[len("data: "):])["type"] == "transcript.text.delta"
    # a plain upload whose client gives up long before its audio is transcribed
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, files={"file": ("long.wav", wav_bytes(long_clip, 16000))}, timeout=0.3)
    was = before["streams_ended"]
    # the pool alone is no signal: the upload may not be admitted yet when its client gives up
    assert wait_for(lambda: health(server)["streams_ended"]["cancelled"] == was["cancelled"] + 2), \
        (health(server)["streams_ended"], was)
    assert wait_for(lambda: health(server)["pool"] == before["pool"]), (health(server), before)
    assert health(server)["streams_ended"]["completed"] == was["completed"]  # neither finished
    assert 'endpoint="transcriptions",status="499"} 1.0' in httpx.get(server.url + "/metrics", timeout=10).text


def test_websocket_bad_messages_are_errors_and_the_session_goes_on(server, clips):
    _, audio, offline = clips

    async def run():
        from websockets.asyncio.client import connect

        async with connect(server.url.replace("http", "ws") + protocol.REALTIME_PATH) as ws:
            created = json.loads(await ws.recv())
            await ws.send(b"\x00\x01\x02")  # odd byte count: not 16-bit PCM
            await ws.send("not json")
            await ws.send('{"type": "session.update"}')
            errors = [json.loads(await ws.recv())["error"]["code"] for _ in range(3)]
            await ws.send(protocol.float_to_pcm16(audio[1]))
            await ws.send('{"type": "input_audio_buffer.commit"}')
            events = [json.loads(m) async for m in ws]
            return created, errors, events

    created, errors, events = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert created["type"] == "transcription_session.created" and not created["session"]["resumed"]
    assert errors == ["invalid_audio", "invalid_message", "invalid_message"]
    assert events[-1]["type"] == "conversation.item.input_audio_transcription.completed"
    assert events[-1]["transcript"] == offline[1]


def test_websocket_refusals_before_the_handshake(server):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    async def status(query):
        try:
            async with connect(server.url.replace("http", "ws") + protocol.REALTIME_PATH + query):
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code

    async def run():
        return await asyncio.gather(status("?stream_id=no-such-stream"), status("?stream_id=../etc"),
                                    status("?sample_rate=100"))

    codes = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert codes == [404, 400, 400]


# ---- malformed uploads --------------------------------------------------------------------------------
def test_malformed_uploads_get_4xx_and_the_server_keeps_serving(server, clips):
    chosen, audio, offline = clips
    url = server.url + protocol.TRANSCRIPTION_PATH
    silence_31s = wav_bytes(np.zeros(31 * 16000, np.float32), 16000)
    cases = {
        "not audio": ({"file": ("notes.wav", b"this is not a wav file")}, 400, "not a readable audio file"),
        "empty": ({"file": ("empty.wav", b"")}, 400, "the file is empty"),
        "too long": ({"file": ("long.wav", silence_31s)}, 413, "at most 30 s"),
        "rate too low": ({"file": ("low.wav", wav_bytes(audio[0][::4], 4000))}, 400, "4000 Hz is outside"),
        "truncated": ({"file": ("cut.wav", wav_bytes(audio[0], 16000)[:-1000])}, 400, "truncated WAV"),
        "no file": ({"model": (None, "oasr")}, 400, "no 'file' field"),
        "bad format": ({"file": ("a.flac", chosen[0].path.read_bytes()), "response_format": (None, "srt")}, 400,
                       "response_format must be one of"),
    }
    for name, (files, status, message) in cases.items():
        response = httpx.post(url, files=files, timeout=TIMEOUT)
        assert response.status_code == status, (name, response.text)
        assert message in response.json()["error"]["message"], (name, response.text)
    not_multipart = httpx.post(url, content=b"raw", headers={"content-type": "audio/wav"}, timeout=TIMEOUT)
    assert not_multipart.status_code == 400 and "multipart/form-data" in not_multipart.json()["error"]["message"]
    client = client_for(server)  # the official client surfaces the message
    with pytest.raises(openai.BadRequestError, match="not a readable audio file"):
        client.audio.transcriptions.create(model="oasr", file=("x.wav", b"garbage"))
    with open(chosen[2].path, "rb") as f:  # and the server still serves
        assert client.audio.transcriptions.create(model="oasr", file=f).text == offline[2]
    # stereo is mixed down (two equal channels: the mono text)
    stereo = wav_bytes(audio[2], 16000, 2)
    assert client.audio.transcriptions.create(model="oasr", file=("s.wav", stereo)).text == offline[2]
    # another rate is resampled as load_audio does: the same text as the offline run on the same file
    resampled = wav_bytes(audio[3][::2], 8000)
    expected = Recognizer(max_streams=1).transcribe([load_audio_bytes(resampled)])[0].text
    assert client.audio.transcriptions.create(model="oasr", file=("r.wav", resampled)).text == expected
    assert wait_for(lambda: health(server)["streams_active"] == 0)
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'oasr_requests_total{endpoint="transcriptions",status="413"} 1.0' in metrics


def load_audio_bytes(data: bytes):
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"oasr-serve-test-{os.getpid()}.wav"
    path.write_bytes(data)
    try:
        return load_audio(path)
    finally:
        path.unlink()


# ---- capacity -------------------------------------------------------------------------------------------
def test_full_engine_answers_503_with_retry_after(clips):
    _, audio, offline = clips
    srv = start(max_streams=1, admit_timeout=0.2)
    try:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        async def run():
            async with connect(srv.url.replace("http", "ws") + protocol.REALTIME_PATH) as holder:
                await holder.recv()  # session.created: the one slot is taken
                upload = await asyncio.to_thread(httpx.post, srv.url + protocol.TRANSCRIPTION_PATH,
                                                 files={"file": ("a.wav", wav_bytes(audio[0], 16000))},
                                                 timeout=TIMEOUT)
                try:
                    async with connect(srv.url.replace("http", "ws") + protocol.REALTIME_PATH):
                        ws_status = (101, None)
                except InvalidStatus as exc:
                    ws_status = (exc.response.status_code, exc.response.headers.get("Retry-After"))
                waiting = health(srv)["streams_waiting"]
            return upload, ws_status, waiting

        upload, ws_status, waiting = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
        assert upload.status_code == 503 and upload.headers["Retry-After"] == "1"
        assert "none came free within 0.2 s" in upload.json()["error"]["message"]
        assert ws_status == (503, "1") and waiting == 0
        # the holder left: the slot is free again
        with open(load_testset(limit=1)[0].path, "rb") as f:
            assert client_for(srv).audio.transcriptions.create(model="oasr", file=f).text == offline[0]
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'oasr_requests_total{endpoint="transcriptions",status="503"} 1.0' in metrics
        assert 'oasr_requests_total{endpoint="realtime",status="503"} 1.0' in metrics
    finally:
        srv.stop()


# ---- shutdown and restart --------------------------------------------------------------------------------
STOPPED = (0, -signal.SIGTERM)  # after its graceful shutdown uvicorn re-raises the signal it caught


def start_process(state_dir) -> tuple[subprocess.Popen, str]:
    """``python -m oasr serve --port 0`` as a child process with its state in ``state_dir``; returns it and its URL."""
    from oasr.bench.serve import start_server

    return start_server(4, "cpu", TIMEOUT, extra_args=("--state-dir", str(state_dir)),
                        env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)


def test_killed_server_suspends_live_streams_and_a_restart_resumes_them(tmp_path, clips):
    _, audio, offline = clips
    chosen = [0, 4, 5]
    proc, url = start_process(tmp_path)
    try:
        async def first_half():
            from oasr.serve.client import LiveResult

            results = [LiveResult() for _ in chosen]
            tasks = [asyncio.ensure_future(stream_audio(url, audio[i], stop_at=len(audio[i]) // 2, result=r))
                     for i, r in zip(chosen, results, strict=True)]
            deadline = time.monotonic() + TIMEOUT
            while not all(r.deltas for r in results) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # every stream has been encoded at least one chunk
            proc.send_signal(signal.SIGTERM)  # what a process manager does to stop the server
            await asyncio.gather(*tasks)
            return results

        halves = asyncio.run(asyncio.wait_for(first_half(), TIMEOUT))
        assert proc.wait(TIMEOUT) in STOPPED
    finally:
        if proc.poll() is None:
            proc.kill()
    for r, i in zip(halves, chosen, strict=True):
        assert r.close_code == protocol.CLOSE_SERVICE_RESTART and r.transcript is None
        assert 0 < r.suspended <= len(audio[i]) // 2
    assert sorted(p.stem for p in tmp_path.glob("*.session")) == sorted(r.stream_id for r in halves)

    proc, url = start_process(tmp_path)
    try:
        assert httpx.get(url + "/health", timeout=10).json()["suspended_sessions"] == len(chosen)

        async def rest():
            return await asyncio.gather(*(stream_audio(url, audio[i], stream_id=r.stream_id)
                                          for i, r in zip(chosen, halves, strict=True)))

        resumed = asyncio.run(asyncio.wait_for(rest(), TIMEOUT))
        assert [r.transcript for r in resumed] == [offline[i] for i in chosen]
        assert all(r.resumed and r.samples_received == h.suspended for r, h in zip(resumed, halves, strict=True))
        assert wait_for(lambda: not list(tmp_path.glob("*.session")))  # each file goes (on the writer's thread)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) in STOPPED
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- the protocol's pieces ---------------------------------------------------------------------------------
def test_delta_text_sends_only_words_that_cannot_change():
    d = protocol.DeltaText()
    assert d.update("hel") == ""
    assert d.update("hello wor") == "hello "
    assert d.update("hello world an") == "world "
    assert d.update("yellow world and") == ""  # a revision of sent words: nothing more until it agrees
    assert d.update("hello world and more", final=True) == "and more"
    assert d.sent == "hello world and more"


def test_pcm16_round_trip_and_refusals():
    x = np.array([0.0, 0.5, -0.5, -1.0, 0.999], np.float32)
    assert np.abs(protocol.pcm16_to_float(protocol.float_to_pcm16(x)) - x).max() <= 1 / 32768
    with pytest.raises(protocol.RequestError, match="even number of bytes, got 3"):
        protocol.pcm16_to_float(b"abc")
    with pytest.raises(protocol.RequestError, match="not base64"):
        protocol.parse_client_message('{"type": "input_audio_buffer.append", "audio": "@@"}')
    kind, data = protocol.parse_client_message('{"type": "input_audio_buffer.append", "audio": "AAABAA=="}')
    assert kind == "input_audio_buffer.append" and data == b"\x00\x00\x01\x00"


@pytest.mark.parametrize("argv, expect", [
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--admit-timeout", "-1"], "--admit-timeout must be >= 0 seconds"),
    (["--max-audio-seconds", "0"], "--max-audio-seconds must be > 0"),
    (["--full-context"], "the server streams"),
    (["--max-streams", "0"], "--max-streams must be >= 1"),
])
def test_serve_bad_option_is_a_usage_error_before_any_work(capsys, argv, expect):
    from oasr.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
