"""``python -m oasr serve`` under faults: bad resumes, failing streams, a stuck engine, huge uploads, crashes.

Every server listens on 127.0.0.1 on a free port and stops at the end of its test; every client
call has a timeout, so a server that hangs fails the test instead of hanging it. Faults are
injected by patching one stream's work (``AudioStream._advance``), the engine's tick, or the
recognizer's step; the other streams' transcripts are compared with ``Recognizer().transcribe``
(the offline run) exactly.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
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
from oasr.serve.client import LiveResult, stream_audio  # noqa: E402
from oasr.serve.state import SessionWriter, write_atomic  # noqa: E402
from oasr.serve.worker import EngineWorker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def clips():
    """The first 4 shipped clips' PCM and their offline transcripts."""
    audio = [load_audio(c.path) for c in load_testset(limit=4)]
    return audio, [t.text for t in Recognizer(max_streams=4).transcribe(audio)]


def start(state_dir=None, max_streams=8, admit_timeout=5.0, checkpoint_every=None, **options) -> ServerThread:
    worker = EngineWorker(Recognizer(max_streams=max_streams, max_seconds=60.0), admit_timeout=admit_timeout,
                          state_dir=state_dir, checkpoint_every=checkpoint_every)
    return ServerThread(create_app(worker, ServeOptions(**{"max_audio_seconds": 30.0, **options})))


def worker_of(srv: ServerThread) -> EngineWorker:
    return srv.server.config.app.state.serve.worker


def health(srv) -> httpx.Response:
    return httpx.get(srv.url + "/health", timeout=10)


def wav_bytes(pcm, rate) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, pcm, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def upload(srv, data: bytes, name="a.wav") -> httpx.Response:
    return httpx.post(srv.url + protocol.TRANSCRIPTION_PATH, files={"file": (name, data)}, data={"model": "oasr"},
                      timeout=TIMEOUT)


def ws_url(srv, query="") -> str:
    return srv.url.replace("http", "ws") + protocol.REALTIME_PATH + query


async def handshake_status(url: str) -> int:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    try:
        async with connect(url):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


# ---- 1: a resume on a server without a state directory --------------------------------------------------
def test_resume_without_state_dir_is_404_and_the_engine_goes_on(clips):
    audio, offline = clips
    srv = start(state_dir=None)
    try:
        status = asyncio.run(asyncio.wait_for(handshake_status(ws_url(srv, "?stream_id=x")), TIMEOUT))
        assert status == 404
        assert health(srv).json()["status"] == "ok"
        assert upload(srv, wav_bytes(audio[0], 16000)).json()["text"] == offline[0]  # the engine still serves
    finally:
        srv.stop()


# ---- 3: one stream's exception --------------------------------------------------------------------------
async def doomed_socket(srv, pcm, doomed: set) -> tuple[list, int]:
    """A WebSocket stream marked to fail as soon as it exists; returns its events and close code."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosedError

    events = []
    async with connect(ws_url(srv)) as ws:
        created = json.loads(await ws.recv())
        doomed.add(created["session"]["id"])
        await ws.send(protocol.float_to_pcm16(pcm))
        await ws.send('{"type": "input_audio_buffer.commit"}')
        try:
            async for message in ws:
                events.append(json.loads(message))
        except ConnectionClosedError:
            pass  # 1011 is not a normal close
        return events, ws.close_code


def test_one_streams_exception_fails_that_stream_alone(clips, monkeypatch):
    audio, offline = clips
    srv = start()
    doomed: set = set()
    advance = recognizer_module.AudioStream._advance

    def failing_advance(self, encoder_frames, now):
        if self.id in doomed or str(self.id).startswith("upload-"):
            raise RuntimeError("injected fault")
        return advance(self, encoder_frames, now)

    monkeypatch.setattr(recognizer_module.AudioStream, "_advance", failing_advance)
    try:
        async def run():
            healthy = [stream_audio(srv.url, pcm, piece_ms=160, timeout=TIMEOUT) for pcm in audio[:3]]
            victim_upload = asyncio.to_thread(upload, srv, wav_bytes(audio[3], 16000))
            return await asyncio.gather(*healthy, doomed_socket(srv, audio[3], doomed), victim_upload)

        *results, (events, close_code), failed_upload = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
        assert [r.transcript for r in results] == offline[:3]  # the others went on, exactly
        assert close_code == protocol.CLOSE_INTERNAL_ERROR
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "stream_failed"
        assert "injected fault" in events[-1]["error"]["message"]
        assert failed_upload.status_code == 500, failed_upload.text
        assert failed_upload.json()["error"]["code"] == "stream_failed"
        report = health(srv)
        assert report.status_code == 200 and report.json()["status"] == "degraded"
        assert report.json()["streams_failed"] == 2 and "injected fault" in report.json()["last_failure"]["message"]
        assert report.json()["pool"]["blocks_used"] == 0  # the failed streams gave their blocks back
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'oasr_streams_ended_total{reason="failed"} 2.0' in metrics
        assert "oasr_engine_up 1.0" in metrics
        monkeypatch.setattr(recognizer_module.AudioStream, "_advance", advance)
        assert upload(srv, wav_bytes(audio[3], 16000)).json()["text"] == offline[3]
    finally:
        srv.stop()


def test_an_engine_tick_that_raises_fails_its_streams_and_the_server_goes_on(clips):
    audio, offline = clips
    srv = start()
    engine = worker_of(srv).rec.engine
    step, armed = engine.step, threading.Event()

    def failing_step():
        outputs = step()
        if armed.is_set() and outputs:  # a tick that encoded the stream, then raised
            armed.clear()
            raise RuntimeError("injected tick fault")
        return outputs

    engine.step = failing_step
    try:
        armed.set()
        failed = upload(srv, wav_bytes(audio[0], 16000))
        assert failed.status_code == 500 and "injected tick fault" in failed.json()["error"]["message"]
        assert upload(srv, wav_bytes(audio[1], 16000)).json()["text"] == offline[1]
        assert health(srv).json()["streams_failed"] == 1
        assert health(srv).json()["pool"]["blocks_used"] == 0
    finally:
        srv.stop()


def test_a_stuck_engine_answers_503_and_stops_within_its_bounds(clips, monkeypatch):
    """The engine thread blocks inside a tick: admission times out on the event loop's clock, /health
    says so, and the server's shutdown still ends (every step bounded)."""
    import oasr.serve.app as app_module

    audio, _ = clips
    monkeypatch.setattr(app_module, "STALL_SECONDS", 0.5)
    srv = start(admit_timeout=0.2, drain_timeout=1.0)
    rec = worker_of(srv).rec
    release, stuck = threading.Event(), threading.Event()
    step = rec.step

    def stuck_step(on_error=None):
        stuck.set()
        release.wait(120)
        return step(on_error)

    rec.step = stuck_step
    try:
        with pytest.raises(httpx.TimeoutException):  # its stream's tick never returns; the client gives up
            httpx.post(srv.url + protocol.TRANSCRIPTION_PATH, files={"file": ("a.wav", wav_bytes(audio[0], 16000))},
                       timeout=2.0)
        assert stuck.wait(TIMEOUT)
        status = asyncio.run(asyncio.wait_for(handshake_status(ws_url(srv)), TIMEOUT))
        assert status == 503  # the engine never answered: refused after admit_timeout + ADMIT_GRACE
        time.sleep(0.6)
        report = health(srv)
        assert report.status_code == 503 and report.json()["status"] == "stalled"
        stopper = threading.Thread(target=srv.stop, daemon=True)
        stopper.start()
        stopper.join(TIMEOUT)
        assert not stopper.is_alive() and not srv.thread.is_alive()
    finally:
        release.set()


STUCK_CHILD = """
import sys, threading
from oasr.asr.recognizer import Recognizer
step = Recognizer.step
def stuck(self, on_error=None):
    if self.streams:
        threading.Event().wait()  # forever
    return step(self, on_error)
Recognizer.step = stuck
from oasr.commands.serve import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_ends_the_process_even_with_a_stuck_engine(clips, tmp_path):
    audio, _ = clips
    proc = subprocess.Popen([sys.executable, "-c", STUCK_CHILD, "--port", "0", "--max-streams", "2", "--threads", "1",
                             "--log-level", "critical", "--shutdown-timeout", "3", "--state-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        url = None
        for line in proc.stdout:
            if "listening on" in line:
                url = line.split("listening on ")[1].strip()
                break
        assert url, "the server did not start"
        with pytest.raises(httpx.TimeoutException):  # the engine gets stuck in this stream's tick
            httpx.post(url + protocol.TRANSCRIPTION_PATH, files={"file": ("a.wav", wav_bytes(audio[0], 16000))},
                       timeout=2.0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)  # --shutdown-timeout 3: the process ends (a hang raises TimeoutExpired)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- 4: upload size from the header, and while reading a chunked body ------------------------------------
def raw_request(srv, head: bytes, chunks=(), wait: float = 20.0) -> bytes:
    """Send ``head``, then ``chunks`` from another thread (errors ignored: the server may close first), and
    return the first bytes the server answers within ``wait`` s (b"" for none)."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(head)

        def send_body():
            try:
                for chunk in chunks:
                    sock.sendall(chunk)
            except OSError:
                pass

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        try:
            return sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return b""


def test_an_upload_larger_than_the_limit_is_refused_before_its_body(clips):
    srv = start(max_upload_bytes=1 << 20)
    try:
        head = (b"POST " + protocol.TRANSCRIPTION_PATH.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: multipart/form-data; boundary=b\r\n")
        answer = raw_request(srv, head + b"Content-Length: 1073741824\r\n\r\n", [b"--b\r\n"])
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"request_too_large" in answer
        part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        pieces = [part] + [b"x" * 65536] * ((2 << 20) // 65536)  # a valid multipart file part of 2 MiB...
        chunked = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces]  # ...chunked, never terminated
        answer = raw_request(srv, head + b"Transfer-Encoding: chunked\r\n\r\n", chunked)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'oasr_requests_total{endpoint="transcriptions",status="413"} 2.0' in metrics
        audio, offline = clips
        assert upload(srv, wav_bytes(audio[0], 16000)).json()["text"] == offline[0]  # a file within it still works
    finally:
        srv.stop()


# ---- 5: a state directory that cannot be made -----------------------------------------------------------
@pytest.mark.parametrize("state_dir", ["/proc/nope", "/proc/self/nope/deeper"])
def test_state_dir_that_cannot_be_written_is_one_line_exit_2(capsys, state_dir):
    from oasr.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--state-dir", state_dir])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--state-dir {state_dir}: not a writable directory" in err[0], err


# ---- 19: /v1/models, float frames --------------------------------------------------------------------------
def test_models_list_and_float_frames_equal_the_upload(clips, tmp_path):
    audio, _ = clips
    srv = start(model_name="oasr-test")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["oasr-test"]
        assert client.models.retrieve("oasr-test").id == "oasr-test"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("whisper-1")
        # a 22.05 kHz file: uploaded, and streamed as float32 after the same resampling (load_audio)
        import soxr

        resampled = soxr.resample(audio[2], 16000, 22050).astype(np.float32)
        data = wav_bytes(np.clip(resampled, -1, 1), 22050)
        path = tmp_path / "r.wav"
        path.write_bytes(data)
        uploaded = client.audio.transcriptions.create(model="oasr-test", file=("r.wav", data)).text
        received = []
        worker = worker_of(srv)
        original = worker.audio
        worker.audio = lambda handle, pcm: (received.append(np.array(pcm)), original(handle, pcm))[1]
        pcm = load_audio(path)
        live = asyncio.run(stream_audio(srv.url, pcm, piece_ms=160, audio_format="float32", timeout=TIMEOUT))
        assert live.transcript == uploaded
        assert np.array_equal(np.concatenate(received), pcm)  # bit for bit what the client had
    finally:
        srv.stop()


# ---- checkpoints and crashes -------------------------------------------------------------------------------
def test_write_atomic_leaves_the_old_file_when_a_write_fails(tmp_path, monkeypatch):
    import oasr.serve.state as state_module

    path = tmp_path / "s.session"
    write_atomic(path, b"old")

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state_module.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, b"new bytes")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["s.session"]


def test_session_writer_keeps_the_order_asked(tmp_path):
    writer = SessionWriter()
    a, b = tmp_path / "a.session", tmp_path / "b.session"
    for k in range(20):
        writer.write(a, b"a%d" % k)
    writer.write(b, b"b")
    writer.delete(b)
    assert writer.flush(30)
    assert a.read_bytes() == b"a19" and not b.exists()  # the newest state of each file, deletes after writes
    assert writer.stats["written"] + writer.stats["superseded"] == 21 and writer.stats["failed"] == 0
    writer.close(30)


def test_a_checkpoint_resumes_exactly_and_leaves_the_stream_running(clips):
    audio, _ = clips
    pcm = np.concatenate(audio[:2])
    rec = Recognizer(max_streams=2, max_seconds=60.0)
    expected = rec.transcribe([pcm])[0].text
    stream, piece, blobs, final = rec.open_stream("s"), 5120, [], None
    for k, first in enumerate(range(0, len(pcm), piece)):
        stream.accept(pcm[first : first + piece])
        rec.step()
        if k in (1, 12):  # before the first admission (features only), and mid-stream (engine session)
            blobs.append(rec.checkpoint("s"))
    stream.end()
    while final is None:
        final = next((t.text for t in rec.step()), None)
    assert final == expected  # checkpointing did not disturb the stream
    for blob in blobs:
        other = Recognizer(max_streams=2, max_seconds=60.0)
        resumed = other.resume(blob)
        assert 0 < resumed.samples < len(pcm)
        resumed.accept(pcm[resumed.samples :])
        resumed.end()
        text = None
        while text is None:
            text = next((t.text for t in other.step()), None)
        assert text == expected
    with pytest.raises(KeyError):
        rec.checkpoint("s")  # finished and gone


@pytest.mark.parametrize("twin", ["reference", "fast"])
def test_a_checkpoint_is_the_suspension_s_bytes(clips, twin):
    """``checkpoint`` then ``suspend`` of the same state: the same bytes, on both twins, admitted or not."""
    audio, _ = clips
    rec = Recognizer(twin=twin, max_streams=2, max_seconds=60.0)
    for samples in (3200, 3 * 16000):  # less than a chunk (never admitted: features), then mid-stream
        stream = rec.open_stream(f"s{samples}")
        stream.accept(audio[0][:samples])
        rec.step()
        assert rec.engine.admitted(stream.id) == (samples > 3200)
        assert rec.checkpoint(stream.id) == rec.suspend(stream.id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpointing_server(state_dir, port: int):
    """``(process, url)``: ``python -m oasr serve`` (2 streams, CPU) on ``port``, checkpointing every live stream
    to ``state_dir`` every 0.2 s; a second call with the same arguments is the restarted server."""
    from oasr.bench.serve import start_server

    args = ("--state-dir", str(state_dir), "--checkpoint-every", "0.2", "--port", str(port))
    return start_server(2, "cpu", 180, extra_args=args, env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)


def test_a_live_stream_survives_sigkill_of_the_server(clips, tmp_path):
    """SIGKILL mid-stream; a new process on the same port and state directory; the shipped client
    reconnects by itself, resends from the checkpoint's offset, and the transcript is the uninterrupted one."""
    audio, _ = clips
    pcm = np.concatenate(audio[:3])
    expected = Recognizer(max_streams=1, max_seconds=60.0).transcribe([pcm])[0].text
    port = free_port()
    proc, url = checkpointing_server(tmp_path, port)
    procs = [proc]
    try:
        async def run():
            result = LiveResult()
            task = asyncio.ensure_future(stream_audio(url, pcm, piece_ms=40, realtime=True, result=result,
                                                      reconnect=180, timeout=360))
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline and not (
                    result.deltas and result.stream_id and (tmp_path / f"{result.stream_id}.session").is_file()):
                await asyncio.sleep(0.05)
            assert result.transcript is None, "the stream ended before the kill"
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, TIMEOUT)
            procs.append((await asyncio.to_thread(checkpointing_server, tmp_path, port))[0])  # same port and state
            return await task

        result = asyncio.run(asyncio.wait_for(run(), 420))
        assert result.transcript == expected
        (first, *later) = result.connections
        assert not first[1] and later and later[-1][1] and 0 < later[-1][2] < len(pcm)  # resumed mid-stream
        deadline = time.monotonic() + TIMEOUT  # the finished stream's checkpoint goes (on the writer's thread)
        while list(tmp_path.glob("*.session")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not list(tmp_path.glob("*.session"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_live_stream_with_turns_survives_sigkill_with_the_same_turn_events(clips, tmp_path):
    """``?turn_detection=server_vad``: SIGKILL after the first turn completed (a checkpoint taken since); the
    new process resumes the stream with its turn state, so every turn event sent after the resume (item ids
    numbered on from the saved turns, times, texts) is the uninterrupted stream's, and the turns add up."""
    from oasr.vad import EndpointConfig

    audio, _ = clips
    gaps = [0.3, 1.5, 2.0]
    pcm = np.concatenate([part for gap, x in zip(gaps, audio[:3], strict=True)
                          for part in (np.zeros(int(gap * 16000), np.float32), x)] + [np.zeros(16000, np.float32)])
    offline = Recognizer(max_streams=1, max_seconds=60.0, endpointing=EndpointConfig())
    stream = offline.open_stream()
    stream.accept(pcm)
    stream.end()
    done = []
    while not done:
        done = offline.step()
    segments = done[0].segments
    assert len(segments) == 3

    def expected(sid):
        events, turn = [], 0
        for kind, value in stream.turn_events:
            item = f"{sid}-turn{turn}"
            if kind == "segment":
                events.append(protocol.ws_turn_completed(item, value))
                turn += 1
            else:
                events.append((protocol.ws_speech_started if kind == "speech_started" else
                               protocol.ws_speech_stopped)(item, value))
        return events

    port = free_port()
    proc, url = checkpointing_server(tmp_path, port)
    procs = [proc]
    try:
        async def run():
            result = LiveResult()
            task = asyncio.ensure_future(stream_audio(url, pcm, piece_ms=40, realtime=True, result=result,
                                                      reconnect=180, timeout=360, turn_detection="server_vad"))
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline and not result.turns:
                await asyncio.sleep(0.05)
            first_turn = time.time()
            path = tmp_path / f"{result.stream_id}.session"
            while time.monotonic() < deadline and not (path.is_file() and path.stat().st_mtime > first_turn + 0.3):
                await asyncio.sleep(0.05)
            assert result.transcript is None and len(result.turns) < 3, "the stream ended before the kill"
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, TIMEOUT)
            procs.append((await asyncio.to_thread(checkpointing_server, tmp_path, port))[0])  # same port and state
            return await task

        result = asyncio.run(asyncio.wait_for(run(), 420))
        want = expected(result.stream_id)
        assert result.transcript == " ".join(s.text for s in segments)
        (first, *later) = result.connections
        assert not first[1] and later and later[-1][1] and 0 < later[-1][2] < len(pcm)  # resumed mid-stream
        before = [e for n, e in result.turn_events if n == 0]
        after = [e for n, e in result.turn_events if n == len(result.connections) - 1]
        assert before == want[: len(before)] and after == want[len(want) - len(after) :]
        assert len(before) + len(after) >= len(want)  # nothing missing between the two
        assert any(e["item_id"] != f"{result.stream_id}-turn0" for e in after)  # numbered on, not from 0 again
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_serving_docs_client_example_runs(clips, monkeypatch):
    """docs/serving.md's ``stream_audio`` example, pointed at a test server, prints the offline transcript."""
    import re

    _, offline = clips
    page = (ROOT / "docs" / "serving.md").read_text()
    (code,) = [b for b in re.findall(r"^```python\n(.*?)^```", page, re.MULTILINE | re.DOTALL) if "stream_audio" in b]
    srv = start()
    printed: list = []
    try:
        monkeypatch.chdir(ROOT)
        exec(compile(code.replace("http://127.0.0.1:8000", srv.url), "docs/serving.md", "exec"),
             {"print": lambda *a: printed.append(" ".join(map(str, a)))})
    finally:
        srv.stop()
    assert printed[0] == offline[0]
