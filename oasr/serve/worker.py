"""``EngineWorker``: the one thread that owns the ``Recognizer`` (and so its ``StreamingEngine``).

Request handlers run on the asyncio event loop and never touch the recognizer. They send
commands through one thread-safe queue; the worker thread applies them in arrival order, runs
one engine tick, sends what the tick produced back to each stream's asyncio queue, and repeats.
When nothing is buffered it sleeps on the command queue::

    event loop (handlers)                       worker thread (owns Recognizer)
    ---------------------                       --------------------------------
    await worker.open()  --- open ----------->  grant a slot, or queue the request
         <------------------ granted / busy --  (busy after admit_timeout seconds)
    worker.audio(h, pcm) --- audio ---------->  AudioStream.accept (fbank, push)
    worker.end(h)        --- end ------------>  AudioStream.end
    worker.cancel(h)     --- cancel --------->  Recognizer.cancel (blocks and slot back)
                                                Recognizer.step()  one tick, all streams
    h.events (asyncio.Queue) <--- partial / final / error / suspended

Capacity: a stream holds one of the recognizer's ``max_streams`` slots from the moment it is
granted until it finishes, is cancelled or is suspended. ``open`` waits at most
``admit_timeout`` seconds for a slot, then fails with ``Busy`` (the HTTP layer answers 503 with
``Retry-After``).

Shutdown (``suspend_live``): new opens are refused; every live stream that is still taking audio
is suspended (``Recognizer.suspend``: front end and engine state in one checked blob) and written
to ``state_dir/<stream id>.session``; streams whose audio has ended run to their final
transcript. A later worker on the same ``state_dir`` resumes a saved stream when its client
reconnects with the id (``open(stream_id=..., resume=True)``) and deletes the file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from oasr.asr.audio import AudioError
from oasr.asr.features import FRAME_SHIFT, SAMPLE_RATE
from oasr.cache.errors import StreamCapacityError

logger = logging.getLogger("oasr.serve")
STATS_KEPT = 1024  # engine TickStats kept (the newest); older ones are dropped as the server runs
CHUNK_LATENCIES_KEPT = 4096  # server-side chunk latencies kept for /health's percentiles


def latency_percentiles(seconds) -> dict:
    """``{"p50", "p95", "p99", "chunks"}`` in ms of ``seconds`` (empty: ``{"chunks": 0}``)."""
    import numpy as np

    if not seconds:
        return {"chunks": 0}
    p50, p95, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 95, 99])
    return {"p50": round(float(p50), 1), "p95": round(float(p95), 1), "p99": round(float(p99), 1),
            "chunks": len(seconds)}


class Busy(RuntimeError):
    """Every slot stayed taken for the whole admission timeout; ``retry_after`` is a suggestion in seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class NoSession(KeyError):
    """No suspended stream with that id in the state directory."""


@dataclass
class StreamHandle:
    """The event-loop side of one stream: its id and the queue its events arrive on.

    Events are tuples: ``("partial", text, audio_seconds)`` after each chunk the engine encoded,
    ``("final", transcript)``, ``("error", message)`` (bad audio, refused; the stream goes on),
    ``("suspended", samples)`` at shutdown, ``("gone", reason)`` when the stream was dropped.
    """

    id: str
    kind: str  # "upload" or "live"
    events: asyncio.Queue
    samples: int = 0  # audio the worker holds for the stream (16 kHz samples), as of open
    resumed: bool = False
    loop: asyncio.AbstractEventLoop | None = None

    def post(self, event: tuple) -> None:
        """Hand ``event`` to the handler (thread-safe; called by the worker; dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the event loop has closed: nobody is listening


@dataclass
class _Open:
    handle: StreamHandle
    future: object  # concurrent.futures.Future -> StreamHandle or exception
    deadline: float
    resume: bool = False


@dataclass
class WorkerStats:
    """A snapshot the worker publishes after each loop (read by /health and /metrics without locks)."""

    streams_active: int = 0
    streams_waiting: int = 0
    engine_active: int = 0
    engine_waiting: int = 0
    pool: dict = field(default_factory=dict)
    ticks: int = 0
    audio_seconds: float = 0.0
    busy_seconds: float = 0.0
    suspended_on_disk: int = 0
    accepting: bool = True
    ended: dict = field(default_factory=dict)  # streams ended since start: completed / cancelled / suspended

    @property
    def real_time_factor(self) -> float:
        """Compute seconds (features and ticks) per second of audio taken so far."""
        return self.busy_seconds / self.audio_seconds if self.audio_seconds else 0.0


class EngineWorker:
    """Owns ``recognizer`` on one thread; see the module docstring.

    ``admit_timeout``: seconds an ``open`` waits for a slot before ``Busy``. ``state_dir``: where
    shutdown writes suspended streams (None: streams still live at shutdown are cancelled).
    ``on_tick(seconds)``: called on the worker thread after every tick that encoded something.
    """

    def __init__(self, recognizer, *, admit_timeout: float = 5.0, state_dir=None, on_tick=None):
        if not admit_timeout >= 0:
            raise ValueError(f"admit_timeout must be >= 0 seconds, got {admit_timeout!r}")
        self.rec = recognizer
        self.admit_timeout = float(admit_timeout)
        self.state_dir = Path(state_dir) if state_dir is not None else None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        self.on_tick = on_tick
        # seconds, server side; read by /health as tuple(...) (one C-level copy under the GIL), the
        # percentiles computed there, not on the worker's loop
        self.chunk_latencies: deque = deque(maxlen=CHUNK_LATENCIES_KEPT)
        self.max_streams = recognizer.cache_config.max_batch_size
        self._on_disk = len(self.saved_sessions())
        self._ended = {"completed": 0, "cancelled": 0, "suspended": 0}
        self.stats = WorkerStats(pool=recognizer.pool_usage(), suspended_on_disk=self._on_disk,
                                 ended=dict(self._ended))
        self._commands: queue.Queue = queue.Queue()
        self._handles: dict = {}  # stream id -> StreamHandle (granted, not finished)
        self._opens: list[_Open] = []  # waiting for a slot, oldest first
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._audio_seconds = 0.0
        self.error: BaseException | None = None

    # ---- event-loop side ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (once)."""
        self._thread = threading.Thread(target=self._run, name="oasr-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after the commands already queued; streams still live are cancelled."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self._thread = None

    async def open(self, stream_id: str, kind: str = "live", resume: bool = False) -> StreamHandle:
        """A granted stream under ``stream_id`` (``resume``: the saved session of that id).

        Waits up to ``admit_timeout`` for a slot; ``Busy`` after it, or at once while shutting
        down. ``resume``: ``NoSession`` without a saved session, ``ValueError`` for one this
        recognizer cannot take (another model); ``ValueError`` for an id already live.
        """
        import concurrent.futures

        loop = asyncio.get_running_loop()
        handle = StreamHandle(stream_id, kind, asyncio.Queue(), loop=loop)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("open", _Open(handle, future, time.monotonic() + self.admit_timeout, resume)))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._commands.put(("cancel", stream_id))  # withdraws the request, or drops a stream just granted
            raise

    def audio(self, handle: StreamHandle, pcm) -> None:
        """Queue 16 kHz float PCM for the stream (errors come back as an ``error`` event)."""
        self._commands.put(("audio", handle.id, pcm))

    def end(self, handle: StreamHandle) -> None:
        """The stream's audio has ended: its final transcript follows."""
        self._commands.put(("end", handle.id))

    def cancel(self, handle_or_id) -> None:
        """Drop the stream now (its blocks and slot go back); nothing more is sent for it."""
        self._commands.put(("cancel", getattr(handle_or_id, "id", handle_or_id)))

    async def suspend_live(self) -> int:
        """Shutdown: refuse new opens, save every stream still taking audio; returns how many were saved.

        Streams whose audio ended are left to finish (the caller keeps serving until they do).
        """
        import concurrent.futures

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("suspend_live", future))
        return await asyncio.wrap_future(future)

    def saved_sessions(self) -> list[str]:
        """Ids of the suspended streams waiting in ``state_dir``."""
        if self.state_dir is None:
            return []
        return sorted(p.stem for p in self.state_dir.glob("*.session"))

    def session_path(self, stream_id: str) -> Path:
        """Where the stream's session is written at shutdown (ids are checked by the caller)."""
        return self.state_dir / f"{stream_id}.session"

    # ---- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        idle = True
        try:
            while True:
                if not self._drain(block=idle):
                    break
                self._grant()
                idle = not self._tick()
                self._publish()
        except BaseException as exc:  # a bug: tell every waiting handler instead of hanging it
            logger.exception("the engine worker stopped")
            self.error = exc
            for handle in self._handles.values():
                handle.post(("gone", f"server error: {exc}"))
            for request in self._opens:
                request.future.set_exception(RuntimeError(f"server error: {exc}"))
            raise
        finally:
            for sid, handle in list(self._handles.items()):
                self._drop(sid)
                handle.post(("gone", "the server stopped"))

    def _drain(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one when idle); False on ``stop``."""
        timeout = None
        if self._opens:
            timeout = max(0.0, min(r.deadline for r in self._opens) - time.monotonic())
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            getattr(self, f"_do_{command[0]}")(*command[1:])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _do_open(self, request: _Open) -> None:
        if not self._accepting:
            request.future.set_exception(Busy("the server is shutting down", retry_after=5))
        elif request.handle.id in self._handles or any(r.handle.id == request.handle.id for r in self._opens):
            request.future.set_exception(ValueError(f"stream {request.handle.id!r} is already live"))
        elif request.resume and not self.session_path(request.handle.id).is_file():
            request.future.set_exception(NoSession(f"no suspended stream {request.handle.id!r} on this server"))
        else:
            self._opens.append(request)

    def _grant(self) -> None:
        now = time.monotonic()
        while self._opens and len(self.rec.streams) < self.max_streams:
            request = self._opens.pop(0)
            handle = request.handle
            try:
                if request.resume:
                    path = self.session_path(handle.id)
                    stream = self.rec.resume(path.read_bytes(), stream_id=handle.id)
                    path.unlink()
                    self._on_disk -= 1
                    handle.resumed = True
                else:
                    stream = self.rec.open_stream(handle.id)
            except (ValueError, KeyError, OSError, StreamCapacityError) as exc:
                request.future.set_exception(ValueError(f"stream {handle.id!r}: {exc}"))
                continue
            handle.samples = stream.samples
            self._handles[handle.id] = handle
            request.future.set_result(handle)
        for request in [r for r in self._opens if r.deadline <= now]:
            self._opens.remove(request)
            request.future.set_exception(Busy(
                f"all {self.max_streams} streams are taken and none came free within {self.admit_timeout:g} s",
                retry_after=max(1, round(self.admit_timeout))))

    def _do_audio(self, sid: str, pcm) -> None:
        stream = self.rec.streams.get(sid)
        if stream is None or sid not in self._handles:
            return  # cancelled or finished meanwhile
        t0 = time.perf_counter()
        try:
            stream.accept(pcm)
        except (AudioError, ValueError) as exc:
            self._handles[sid].post(("error", str(exc)))
            return
        finally:
            self.rec.busy_seconds += time.perf_counter() - t0
        self._audio_seconds += len(pcm) / SAMPLE_RATE

    def _do_end(self, sid: str) -> None:
        stream = self.rec.streams.get(sid)
        if stream is None or sid not in self._handles or self.rec.engine.input_ended(sid):
            return
        t0 = time.perf_counter()
        stream.end()
        self.rec.busy_seconds += time.perf_counter() - t0

    def _do_cancel(self, sid: str) -> None:
        for request in self._opens:
            if request.handle.id == sid:
                self._opens.remove(request)
                request.future.cancel()
                return
        self._drop(sid)

    def _drop(self, sid: str) -> None:
        """Cancel a granted stream in the recognizer (no event: its handler is gone or stopping)."""
        self._handles.pop(sid, None)
        if sid in self.rec.streams:
            self.rec.cancel(sid)
            self._ended["cancelled"] += 1

    def _do_suspend_live(self, future) -> None:
        self._accepting = False
        for request in self._opens:
            request.future.set_exception(Busy("the server is shutting down", retry_after=5))
        self._opens.clear()
        saved = 0
        for sid, handle in list(self._handles.items()):
            if self.rec.engine.input_ended(sid) or handle.kind != "live":
                continue  # uploads and ended streams run to their transcript
            samples = self.rec.streams[sid].samples
            if self.state_dir is None:
                self._drop(sid)
                handle.post(("gone", "the server shut down without a state directory: the stream was dropped"))
                continue
            try:
                blob = self.rec.suspend(sid)
            except ValueError:
                continue  # being rescored (its audio ended): it finishes like an ended stream
            path = self.session_path(sid)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, path)
            self._on_disk += 1
            self._handles.pop(sid)
            handle.post(("suspended", samples))
            saved += 1
            self._ended["suspended"] += 1
        future.set_result(saved)

    def _tick(self) -> bool:
        """One engine tick if any stream is open; True if it encoded or finished something."""
        if not self.rec.streams:
            return False
        before = {sid: (s.frames_done, len(s.latencies)) for sid, s in self.rec.streams.items()}
        t0 = time.perf_counter()
        finished = self.rec.step()
        seconds = time.perf_counter() - t0
        stats = self.rec.engine.stats[-1] if self.rec.engine.stats else None
        progressed = bool(finished) or bool(stats and (stats.cohort or stats.decode_steps))
        if progressed and self.on_tick is not None:
            self.on_tick(seconds)
        for sid, (frames, timed) in before.items():
            stream = self.rec.streams.get(sid)
            handle = self._handles.get(sid)
            if stream is not None:  # the recognizer's own clock: audio accepted here -> this tick returned
                self.chunk_latencies.extend(stream.latencies[timed:])
            if stream is not None and handle is not None and stream.frames_done > frames:
                covered = min(stream.frames_done * FRAME_SHIFT, stream.samples)  # the last chunk is padded
                handle.post(("partial", stream.text, covered / SAMPLE_RATE))
        for transcript in finished:
            self.rec.engine.cancel(transcript.id)  # the engine keeps finished results; a server must not
            self._ended["completed"] += 1
            handle = self._handles.pop(transcript.id, None)
            if handle is not None:
                handle.post(("final", transcript))
        if len(self.rec.engine.stats) > 2 * STATS_KEPT:
            del self.rec.engine.stats[:-STATS_KEPT]  # the engine logs every tick; a server runs for days
        return progressed

    def _publish(self) -> None:
        engine = self.rec.engine
        self.stats = WorkerStats(
            streams_active=len(self._handles), streams_waiting=len(self._opens), engine_active=engine.num_active,
            engine_waiting=engine.num_waiting, pool=self.rec.pool_usage(), ticks=engine.tick,
            audio_seconds=self._audio_seconds, busy_seconds=self.rec.busy_seconds,
            suspended_on_disk=self._on_disk, accepting=self._accepting, ended=dict(self._ended))
