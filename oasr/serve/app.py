"""The ASGI app of ``python -m oasr serve`` (FastAPI on uvicorn) and the server that runs it.

Endpoints (docs/serving.md has the full protocol):

* ``POST /v1/audio/transcriptions``: OpenAI's transcription API (multipart ``file``, ``model``,
  ``response_format`` json / text / verbose_json, ``stream=true`` for server-sent events);
* ``WebSocket /v1/realtime``: live 16-bit PCM in, partial and final transcripts out
  (``oasr.serve.protocol``);
* ``GET /v1/models``: OpenAI's model list (the one model served), which OpenAI-compatible tools call first;
* ``GET /health``: JSON, the streams, the pool, whether the server takes new streams, failures;
* ``GET /metrics``: Prometheus text (``oasr.serve.metrics``).

Handlers never call the recognizer: they talk to the ``EngineWorker`` (``oasr.serve.worker``),
the one thread that owns it. A request that finds every slot taken waits up to the worker's
``admit_timeout`` and then gets 503 with ``Retry-After``.

``OasrServer`` is ``uvicorn.Server`` with one more shutdown step, taken before uvicorn closes
the connections: the worker suspends every live WebSocket stream into the state directory and
each of those sessions is told so (``transcription_session.suspended``, close code 1012). Every
step of the shutdown is bounded, whatever the worker thread does; ``exit_deadline`` (the command's
process) ends the process outright if a signal's shutdown has not finished in that many seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.websockets import WebSocketDisconnect

from oasr.asr.audio import AudioError, check_pcm
from oasr.features.fbank import SAMPLE_RATE
from oasr.serve import protocol as p
from oasr.serve.metrics import CONTENT_TYPE, ServeMetrics
from oasr.serve.worker import (
    DEGRADED_SECONDS,
    STALL_SECONDS,
    Busy,
    EngineWorker,
    NoSession,
    StreamFailed,
    latency_percentiles,
)

logger = logging.getLogger("oasr.serve")
UPLOAD_SLACK = 64 << 10  # bytes a multipart body may hold beyond the largest file: part headers, small fields


@dataclass
class ServeOptions:
    """What the app accepts: the model name it reports, the longest stream, the largest upload."""

    model_name: str = "oasr"
    max_audio_seconds: float = 300.0
    max_upload_bytes: int = 64 << 20
    drain_timeout: float = 10.0  # seconds each shutdown step waits: the worker, the told sessions, its thread


class ServeState:
    """What the handlers share: the worker, the metrics, the options, the live WebSocket sessions."""

    def __init__(self, worker: EngineWorker, options: ServeOptions, metrics: ServeMetrics):
        self.worker, self.options, self.metrics = worker, options, metrics
        self.live_sockets = 0
        self.sockets_closed = asyncio.Event()
        self.sockets_closed.set()

    def socket_opened(self) -> None:
        """A WebSocket session holds a stream."""
        self.live_sockets += 1
        self.sockets_closed.clear()

    def socket_closed(self) -> None:
        """A WebSocket session ended."""
        self.live_sockets -= 1
        if not self.live_sockets:
            self.sockets_closed.set()

    async def drain(self) -> int:
        """Shutdown: suspend the live streams, wait (``drain_timeout``) until their sessions were told.

        Bounded: a worker that does not answer within ``drain_timeout`` saves nothing (logged)."""
        try:
            saved = await self.worker.suspend_live(timeout=self.options.drain_timeout)
        except Exception as exc:  # TimeoutError from a stuck worker, or the suspension itself failed
            logger.error("shutdown: the live streams were not suspended (%r)", exc)
            return 0
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.sockets_closed.wait(), self.options.drain_timeout)
        logger.info("shutdown: %d live stream(s) suspended to %s", saved, self.worker.state_dir)
        return saved


def error_response(exc: p.RequestError, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-shaped error body with the refusal's status."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def busy_response(exc: Busy) -> JSONResponse:
    """503 with ``Retry-After`` (seconds) for a request that found no free slot in time."""
    return error_response(p.RequestError(503, "server_busy", str(exc)), {"Retry-After": str(exc.retry_after)})


def health_status(worker: EngineWorker) -> str:
    """``ok``, ``draining`` (shutting down), ``degraded`` (a stream failed in the last ``DEGRADED_SECONDS``),
    ``stalled`` (one worker loop has run ``STALL_SECONDS``) or ``error`` (the worker thread is not running)."""
    if not worker.alive:
        return "error"
    if worker.stalled_seconds > STALL_SECONDS:
        return "stalled"
    if not worker.stats.accepting:
        return "draining"
    failure = worker.last_failure
    if failure is not None and time.time() - failure["at"] < DEGRADED_SECONDS:
        return "degraded"
    return "ok"


def create_app(worker: EngineWorker, options: ServeOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``worker``'s recognizer (the worker thread starts with the app)."""
    options = options or ServeOptions()
    metrics = ServeMetrics()
    metrics.watch(worker)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.serve = ServeState(worker, options, metrics)
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop, options.drain_timeout)

    app = FastAPI(title="oasr", summary="streaming speech recognition", lifespan=lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness and load: streams, pool usage, suspended sessions, whether new streams are taken,
        failed streams; HTTP 503 while the worker is not running or stalled."""
        s = worker.stats
        status = health_status(worker)
        failure = worker.last_failure
        body = {"status": status, "model": options.model_name, "streams_active": s.streams_active,
                "streams_waiting": s.streams_waiting, "max_streams": worker.max_streams, "pool": s.pool,
                "suspended_sessions": s.suspended_on_disk, "real_time_factor": s.real_time_factor,
                "ticks": s.ticks, "streams_ended": s.ended, "streams_failed": s.ended.get("failed", 0),
                "last_failure": None if failure is None else {
                    "stream": failure["stream"], "message": failure["message"],
                    "seconds_ago": round(time.time() - failure["at"], 1)},
                "checkpoints": s.checkpoints, "worker_loop_seconds": round(worker.stalled_seconds, 3),
                "chunk_latency_ms": latency_percentiles(tuple(worker.chunk_latencies))}
        return JSONResponse(body, status_code=503 if status in ("error", "stalled") else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        """OpenAI's ``models.list``: the one model this server runs (any name works in a request)."""
        return {"object": "list", "data": [p.model_card(options.model_name)]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> Response:
        """OpenAI's ``models.retrieve`` (404 for a name that is not the served model's)."""
        if model_id != options.model_name:
            return error_response(p.RequestError(404, "model_not_found", f"this server runs one model, "
                                                 f"{options.model_name!r}; got {model_id!r}", "model"))
        return JSONResponse(p.model_card(options.model_name))

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition (see ``oasr.serve.metrics``)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post(p.TRANSCRIPTION_PATH)
    async def transcriptions(request: Request) -> Response:
        """OpenAI's ``audio.transcriptions.create``: one uploaded file, one transcript (or its SSE stream)."""
        state: ServeState = request.app.state.serve
        try:
            request = _limit_body(request, options.max_upload_bytes)
            form = await _read_form(request)
            return await _transcribe(request, state, form)
        except p.RequestError as exc:
            metrics.count("transcriptions", exc.status)
            return error_response(exc, {"Connection": "close"} if exc.code == "request_too_large" else None)
        except Busy as exc:
            metrics.count("transcriptions", 503)
            return busy_response(exc)
        except StreamFailed as exc:
            metrics.count("transcriptions", 500)
            return error_response(p.RequestError(500, "stream_failed", str(exc)))

    @app.websocket(p.REALTIME_PATH)
    async def realtime(websocket: WebSocket) -> None:
        """Live audio in, partial and final transcripts out (``oasr.serve.protocol``)."""
        await _realtime(websocket, websocket.app.state.serve)

    return app


# ---- uploads ---------------------------------------------------------------------------------
def _limit_body(request: Request, max_file_bytes: int) -> Request:
    """The request, refused at once (413) if its ``Content-Length`` says more than a file of
    ``max_file_bytes`` and the multipart around it (``UPLOAD_SLACK``); a body without one (chunked)
    is counted as it is read and refused as soon as it passes that size: nothing more is read."""
    limit = max_file_bytes + UPLOAD_SLACK

    def too_large(size: str) -> p.RequestError:
        return p.RequestError(413, "request_too_large", f"the request body is {size}, this server takes files up "
                              f"to {max_file_bytes} bytes (--max-upload-mb) and {limit} bytes of body", "file")

    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise p.RequestError(400, "invalid_request", f"Content-Length must be an int, got {declared[:40]!r}") \
                from None
        if length > limit:
            raise too_large(f"{length} bytes (Content-Length)")
    receive, seen = request.receive, 0

    async def limited() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large(f"more than {limit} bytes (read so far: {seen})")
        return message

    return Request(request.scope, limited)


async def _read_form(request: Request) -> dict:
    """The multipart fields, checked: a ``file``, a known ``response_format``, ``stream`` as a bool."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise p.RequestError(400, "invalid_request", f"expected a multipart/form-data body with a 'file' field, "
                             f"got content type {request.headers.get('content-type')!r}")
    try:
        form = await request.form(max_files=1, max_fields=32)
    except p.RequestError:
        raise  # the body passed the size limit (_limit_body)
    except Exception as exc:  # starlette: MultiPartException / HTTPException for a malformed body
        raise p.RequestError(400, "invalid_request", f"unreadable multipart body: {exc}") from None
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise p.RequestError(400, "missing_file", "the form has no 'file' field with an audio file", "file")
    response_format = str(form.get("response_format") or "json")
    if response_format not in p.RESPONSE_FORMATS:
        raise p.RequestError(400, "unsupported_response_format", f"response_format must be one of "
                             f"{', '.join(p.RESPONSE_FORMATS)}, got {response_format!r}", "response_format")
    stream = str(form.get("stream") or "false").lower()
    if stream not in ("true", "false"):
        raise p.RequestError(400, "invalid_request", f"stream must be true or false, got {stream!r}", "stream")
    turns = p.parse_chunking_strategy(form.get("chunking_strategy"))
    granularities = p.parse_granularities(form.getlist("timestamp_granularities[]"), response_format)
    return {"file": upload, "response_format": response_format, "stream": stream == "true",
            "model": str(form.get("model") or ""), "turns": turns, "granularities": granularities}


async def _transcribe(request: Request, state: ServeState, form: dict) -> Response:
    upload: UploadFile = form["file"]
    options, worker = state.options, state.worker
    if upload.size is not None and upload.size > options.max_upload_bytes:
        raise p.RequestError(413, "file_too_large", f"{upload.filename}: {upload.size} bytes, this server takes "
                             f"files up to {options.max_upload_bytes} bytes", "file")
    data = await upload.read()
    pcm = await asyncio.to_thread(p.decode_upload, data, upload.filename or "file", options.max_audio_seconds)
    try:
        handle = await worker.open(f"upload-{uuid.uuid4().hex[:16]}", kind="upload", turns=form["turns"])
    except ValueError as exc:  # turns asked of a recognizer that cannot cut them (rescoring, a transducer)
        raise p.RequestError(400, "unsupported_chunking_strategy", str(exc), "chunking_strategy") from None
    worker.audio(handle, pcm)
    worker.end(handle)
    model = form["model"] or options.model_name
    if form["stream"]:
        state.metrics.count("transcriptions", 200)
        return StreamingResponse(_sse_events(worker, handle), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    transcript = await _final_unless_disconnected(request, worker, handle)
    if transcript is None:
        state.metrics.count("transcriptions", 499)
        return Response(status_code=499)
    state.metrics.count("transcriptions", 200)
    body = p.transcription_body(transcript, form["response_format"], model,
                                worker.rec.tokenizer.encode(transcript.text), form["granularities"])
    if form["response_format"] == "text":
        return PlainTextResponse(body)
    return JSONResponse(body)


async def _final_unless_disconnected(request: Request, worker: EngineWorker, handle):
    """The stream's final ``Transcript``, or None (the stream cancelled) if the client went away first."""

    async def final():
        while True:
            event = await handle.events.get()
            if event[0] == "final":
                return event[1]
            if event[0] == "gone":
                raise p.RequestError(503, "server_error", event[1])
            if event[0] == "failed":
                raise p.RequestError(500, "stream_failed", event[1])

    async def disconnected():
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)

    result, gone = asyncio.ensure_future(final()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (result, gone):
            task.cancel()
    if result.done() and not result.cancelled():
        return result.result()
    worker.cancel(handle)
    return None


async def _sse_events(worker: EngineWorker, handle):
    """Server-sent events of one upload: a ``transcript.text.delta`` per change, then ``transcript.text.done``."""
    delta_text, last, finished = p.DeltaText(), None, False
    try:
        while True:
            event = await handle.events.get()
            if event[0] == "partial" and event[1] != last:
                last = event[1]
                yield p.sse(p.upload_event_delta(delta_text.update(last), last, int(round(event[2] * 1000))))
            elif event[0] == "final":
                transcript = event[1]
                delta = delta_text.update(transcript.text, final=True)
                if delta:
                    yield p.sse(p.upload_event_delta(delta, transcript.text, int(round(transcript.audio_seconds
                                                                                         * 1000))))
                yield p.sse(p.upload_event_done(transcript.text, transcript.audio_seconds))
                finished = True
                return
            elif event[0] in ("gone", "failed"):
                finished = True
                code = "stream_failed" if event[0] == "failed" else "server_error"
                yield p.sse({"type": "error", "error": {"type": "server_error", "code": code, "message": event[1]}})
                return
    finally:
        if not finished:
            worker.cancel(handle)  # the client went away mid-stream


# ---- live audio --------------------------------------------------------------------------------
async def _deny(websocket: WebSocket, state: ServeState, exc: p.RequestError, headers: dict | None = None):
    """Refuse the WebSocket handshake with an HTTP status and an OpenAI-shaped body."""
    state.metrics.count("realtime", exc.status)
    await websocket.send_denial_response(error_response(exc, headers))


async def _realtime(websocket: WebSocket, state: ServeState) -> None:
    worker, options = state.worker, state.options
    query = websocket.query_params
    try:
        rate = int(query.get("sample_rate", SAMPLE_RATE))
    except ValueError:
        rate = -1
    if not 8000 <= rate <= 192000:
        return await _deny(websocket, state, p.RequestError(
            400, "invalid_sample_rate", f"sample_rate must be an int in [8000, 192000] Hz, got "
            f"{query.get('sample_rate')!r}", "sample_rate"))
    audio_format = query.get("input_audio_format", "pcm16")
    if audio_format not in p.INPUT_AUDIO_FORMATS:
        return await _deny(websocket, state, p.RequestError(
            400, "invalid_audio_format", f"input_audio_format must be one of {', '.join(p.INPUT_AUDIO_FORMATS)}, "
            f"got {audio_format[:40]!r}", "input_audio_format"))
    turn_detection = query.get("turn_detection")
    if turn_detection not in (None, p.TURN_DETECTION):
        return await _deny(websocket, state, p.RequestError(
            400, "invalid_turn_detection", f"turn_detection must be {p.TURN_DETECTION!r} (or absent), got "
            f"{turn_detection[:40]!r}", "turn_detection"))
    resume_id = query.get("stream_id")
    if resume_id is not None and not p.SESSION_ID_PATTERN.fullmatch(resume_id):
        return await _deny(websocket, state, p.RequestError(
            400, "invalid_stream_id", f"stream_id must be 1-64 of [A-Za-z0-9_-], got {resume_id[:80]!r}",
            "stream_id"))
    try:
        handle = await worker.open(resume_id or f"live-{uuid.uuid4().hex[:16]}", kind="live",
                                   resume=resume_id is not None, turns=turn_detection is not None)
    except Busy as exc:
        return await _deny(websocket, state, p.RequestError(503, "server_busy", str(exc)),
                           {"Retry-After": str(exc.retry_after)})
    except NoSession as exc:
        return await _deny(websocket, state, p.RequestError(404, "no_such_session", exc.args[0], "stream_id"))
    except ValueError as exc:
        return await _deny(websocket, state, p.RequestError(409, "session_refused", str(exc), "stream_id"))
    except StreamFailed as exc:
        return await _deny(websocket, state, p.RequestError(500, "stream_failed", str(exc)))
    state.socket_opened()
    outcome = "disconnected"
    try:
        await websocket.accept()
        await websocket.send_json(p.ws_session_created(handle.id, handle.resumed, handle.samples, audio_format))
        reader = asyncio.ensure_future(_read_audio(websocket, worker, handle, rate, options, handle.samples,
                                                   audio_format))
        writer = asyncio.ensure_future(_write_events(websocket, handle))
        done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        if writer in done and not writer.cancelled() and writer.exception() is None:
            outcome = writer.result()
        reader.cancel()
        writer.cancel()
    except (WebSocketDisconnect, RuntimeError):
        pass  # the socket went away while the session was being set up
    finally:
        if outcome == "disconnected":
            worker.cancel(handle)  # blocks and slot back at once
        state.metrics.count("realtime", outcome)
        state.socket_closed()


async def _read_audio(websocket: WebSocket, worker: EngineWorker, handle, rate: int, options: ServeOptions,
                      samples: int, audio_format: str = "pcm16") -> None:
    """Client -> worker until the client disconnects (returns) or commits and the writer finishes."""
    committed = False
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        try:
            if message.get("bytes") is not None:
                data = message["bytes"]
            else:
                kind, data = p.parse_client_message(message.get("text") or "")
                if kind == "input_audio_buffer.commit":
                    if not committed:
                        committed = True
                        worker.end(handle)
                    continue
            if committed:
                raise p.RequestError(400, "audio_after_commit", "the audio was committed (ended); this stream takes "
                                     "no more audio")
            if not data:
                continue
            pcm = p.decode_frame(data, audio_format)
            if rate != SAMPLE_RATE:
                try:
                    pcm = check_pcm(pcm, rate, f"stream {handle.id}")
                except AudioError as exc:
                    raise p.RequestError(400, "invalid_audio", str(exc)) from None
            p.check_duration(samples + len(pcm), options.max_audio_seconds, f"stream {handle.id}")
        except p.RequestError as exc:
            await websocket.send_json(p.ws_error(exc.code, str(exc)))
            continue
        samples += len(pcm)
        worker.audio(handle, np.ascontiguousarray(pcm))


async def _write_events(websocket: WebSocket, handle) -> str:
    """Worker -> client until the stream completes, is suspended or is gone; returns the outcome."""
    delta_text = p.DeltaText()
    # the current turn's number (a resumed stream's go on from its saved count); whether turns have been seen
    turn = handle.turns or 0
    turned = turn > 0
    while True:
        event = await handle.events.get()
        kind = event[0]
        item = f"{handle.id}-turn{turn}" if turned else handle.id
        if kind == "turn":
            turned, (what, value) = True, event[1]
            item = f"{handle.id}-turn{turn}"
            if what == "speech_started":
                await websocket.send_json(p.ws_speech_started(item, value))
            elif what == "speech_stopped":
                await websocket.send_json(p.ws_speech_stopped(item, value))
            else:  # a finished turn: the rest of its text as a delta, its completed event, then the next turn
                delta = delta_text.update(value.text, final=True)
                if delta:
                    await websocket.send_json(p.ws_delta(item, delta, value.text, int(round(value.end * 1000))))
                await websocket.send_json(p.ws_turn_completed(item, value))
                turn, delta_text = turn + 1, p.DeltaText()
        elif kind == "partial":
            text = event[1]
            await websocket.send_json(p.ws_delta(item, delta_text.update(text), text, int(round(event[2] * 1000))))
        elif kind == "error":
            await websocket.send_json(p.ws_error("invalid_audio", event[1]))
        elif kind == "final" and (turned or getattr(event[1], "segments", None)):
            await websocket.close(p.CLOSE_NORMAL)  # every turn has had its completed event
            return "completed"
        elif kind == "final":
            transcript = event[1]
            delta = delta_text.update(transcript.text, final=True)
            if delta:
                await websocket.send_json(p.ws_delta(handle.id, delta, transcript.text,
                                                     int(round(transcript.audio_seconds * 1000))))
            await websocket.send_json(p.ws_completed(handle.id, transcript.text, transcript.audio_seconds))
            await websocket.close(p.CLOSE_NORMAL)
            return "completed"
        elif kind == "suspended":
            await websocket.send_json(p.ws_suspended(handle.id, event[1]))
            await websocket.close(p.CLOSE_SERVICE_RESTART, "server restarting: reconnect with stream_id")
            return "suspended"
        elif kind in ("gone", "failed"):
            await websocket.send_json(p.ws_error("stream_failed" if kind == "failed" else "server_error", event[1],
                                                 server=True))
            await websocket.close(p.CLOSE_INTERNAL_ERROR)
            return kind


# ---- running it -------------------------------------------------------------------------------
class OasrServer(uvicorn.Server):
    """``uvicorn.Server`` that suspends live streams before it closes connections; prints where it listens."""

    def __init__(self, config: uvicorn.Config, announce: bool = False, exit_deadline: float | None = None):
        super().__init__(config)
        self.announce = announce
        self.exit_deadline = exit_deadline
        self.port: int | None = None
        self._watchdog: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        """uvicorn's signal handler; with ``exit_deadline`` the first signal also arms a timer that ends
        the process (``os._exit(1)``) if the shutdown has not finished by then: SIGTERM always ends it."""
        if self.exit_deadline is not None and self._watchdog is None:
            def overdue() -> None:
                logger.error("shutdown took more than %g s: exiting now", self.exit_deadline)
                os._exit(1)

            self._watchdog = threading.Timer(self.exit_deadline, overdue)
            self._watchdog.daemon = True
            self._watchdog.start()
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        """Start listening; record (and with ``announce`` print) the bound port."""
        await super().startup(sockets)
        if self.servers and self.servers[0].sockets:
            self.port = self.servers[0].sockets[0].getsockname()[1]
            if self.announce:
                print(f"oasr serve: listening on http://{self.config.host}:{self.port}", flush=True)

    async def shutdown(self, sockets=None) -> None:
        """Suspend the live streams (each session is told), then uvicorn's own shutdown."""
        state = getattr(self.config.app.state, "serve", None) if hasattr(self.config.app, "state") else None
        if state is not None:
            await state.drain()
        await super().shutdown(sockets)


class ServerThread:
    """An ``OasrServer`` on a background thread of this process (tests, benches): ``url``, ``stop()``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0):
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", ws="websockets-sansio",
                                timeout_graceful_shutdown=30)
        self.server = OasrServer(config)
        self.thread = threading.Thread(target=self.server.run, name="oasr-serve", daemon=True)
        self.thread.start()
        deadline = startup_timeout
        while not self.server.started and self.thread.is_alive() and deadline > 0:
            threading.Event().wait(0.02)
            deadline -= 0.02
        if not self.server.started:
            raise RuntimeError("the server did not start")
        self.url = f"http://{host}:{self.server.port}"

    def stop(self, timeout: float = 60.0) -> None:
        """Shut down as on SIGTERM (live streams suspended) and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout)
