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
                                                checkpoint live streams every checkpoint_every s
    h.events (asyncio.Queue) <--- partial / final / error / suspended / failed / gone

Capacity: a stream holds one of the recognizer's ``max_streams`` slots from the moment it is
granted until it finishes, is cancelled, fails or is suspended. ``open`` waits at most
``admit_timeout`` seconds for a slot, then fails with ``Busy`` (the HTTP layer answers 503 with
``Retry-After``). The worker enforces that deadline, and the event loop enforces it again
``ADMIT_GRACE`` seconds later on its own clock, so a stuck or dead worker thread never leaves a
request waiting.

Failures stay with their stream: an exception while applying one stream's command or taking one
stream's output of a tick ends that stream alone (``("failed", message)``: HTTP 500, or an
``error`` event and close 1011) and the others go on. An exception of the engine's batched tick
names no stream: every stream the tick held in the engine (active or being rescored) fails, the
streams still waiting for admission go on. Each failure is counted (``WorkerStats.ended["failed"]``,
``last_failure``); the worker thread itself never stops on an ``Exception``.

Shutdown (``suspend_live``): new opens are refused; every live stream that is still taking audio
is suspended (``Recognizer.suspend``: front end and engine state in one checked blob) and written
to ``state_dir/<stream id>.session``; streams whose audio has ended run to their final
transcript. A later worker on the same ``state_dir`` resumes a saved stream when its client
reconnects with the id (``open(stream_id=..., resume=True)``).

Crashes (``checkpoint_every``): every live stream's session is also written to the same file
every ``checkpoint_every`` seconds of wall time while it changes (``Recognizer.checkpoint`` on
this thread; ``oasr.serve.state.SessionWriter`` writes it on its own thread, whole or absent).
After a SIGKILL a new worker on the directory resumes the stream from its last checkpoint;
``transcription_session.created`` tells the client ``samples_received``, the audio to send again
from. The file goes when the stream completes, is cancelled or fails; a resumed stream keeps its
file while checkpoints are on (deleted otherwise).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from oasr.asr.audio import AudioError
from oasr.cache.errors import StreamCapacityError
from oasr.features.fbank import FRAME_SHIFT, SAMPLE_RATE
from oasr.serve.state import SessionWriter, write_atomic

logger = logging.getLogger("oasr.serve")
STATS_KEPT = 1024  # engine TickStats kept (the newest); older ones are dropped as the server runs
CHUNK_LATENCIES_KEPT = 4096  # server-side chunk latencies kept for /health's percentiles
ADMIT_GRACE = 2.0  # seconds past admit_timeout after which the event loop stops waiting for the worker
STALL_SECONDS = 30.0  # one worker loop running longer than this: /health says "stalled"
DEGRADED_SECONDS = 300.0  # /health says "degraded" this long after a stream failed


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
    """No suspended stream with that id in the state directory (or no state directory)."""


class StreamFailed(RuntimeError):
    """The server could not open or resume the stream (an internal error, not the request's fault)."""


def _settle(future, result=None, exc: BaseException | None = None) -> None:
    """Resolve a ``concurrent.futures.Future`` unless its waiter already gave up (cancelled it)."""
    try:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled by the event loop between the check and the set


@dataclass
class StreamHandle:
    """The event-loop side of one stream: its id and the queue its events arrive on.

    Events are tuples: ``("partial", text, audio_seconds)`` after each chunk the engine encoded,
    ``("final", transcript)``, ``("error", message)`` (bad audio, refused; the stream goes on),
    ``("suspended", samples)`` at shutdown, ``("failed", message)`` when an internal error ended the
    stream, ``("gone", reason)`` when the stream was dropped (the worker stopped); a stream opened with
    ``turns=True`` also gets ``("turn", entry)`` for each of its ``AudioStream.turn_events`` entries
    (``("speech_started", seconds)``, ``("speech_stopped", seconds)``, ``("segment", Segment)``), in order,
    before the partial of the same tick and before its final.
    """

    id: str
    kind: str  # "upload" or "live"
    events: asyncio.Queue
    samples: int = 0  # audio the worker holds for the stream (16 kHz samples), as of open
    resumed: bool = False
    turns: int | None = None  # with turn detection: the turns it had completed as of open (None: no turns)
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
    turns: bool = False  # the endpointer cuts the stream into turns (Recognizer.open_stream(turns=True))


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
    # streams ended since start: completed / cancelled / suspended / failed
    ended: dict = field(default_factory=dict)
    # taken (sessions made on the engine thread), session_seconds (their time), and the writer's written,
    # bytes, write_seconds, superseded, failed
    checkpoints: dict = field(default_factory=dict)

    @property
    def real_time_factor(self) -> float:
        """Compute seconds (features and ticks) per second of audio taken so far."""
        return self.busy_seconds / self.audio_seconds if self.audio_seconds else 0.0


class EngineWorker:
    """Owns ``recognizer`` on one thread; see the module docstring.

    ``admit_timeout``: seconds an ``open`` waits for a slot before ``Busy``. ``state_dir``: where
    shutdown writes suspended streams (None: streams still live at shutdown are cancelled).
    ``checkpoint_every``: seconds between checkpoints of a live stream in ``state_dir`` (None or 0:
    none; needs ``state_dir``). ``on_tick(seconds)``: called on the worker thread after every tick
    that encoded something.
    """

    def __init__(self, recognizer, *, admit_timeout: float = 5.0, state_dir=None, on_tick=None,
                 checkpoint_every: float | None = None):
        if not admit_timeout >= 0:
            raise ValueError(f"admit_timeout must be >= 0 seconds, got {admit_timeout!r}")
        if checkpoint_every is not None and not checkpoint_every >= 0:
            raise ValueError(f"checkpoint_every must be >= 0 seconds (0: off), got {checkpoint_every!r}")
        if checkpoint_every and state_dir is None:
            raise ValueError("checkpoint_every needs a state_dir to write the checkpoints to")
        self.rec = recognizer
        self.admit_timeout = float(admit_timeout)
        self.checkpoint_every = float(checkpoint_every) if checkpoint_every else None
        self.state_dir = Path(state_dir) if state_dir is not None else None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            for leftover in self.state_dir.glob("*.session.tmp"):  # a write a crash cut short
                leftover.unlink(missing_ok=True)
        self.on_tick = on_tick
        # seconds, server side; read by /health as tuple(...) (one C-level copy under the GIL), the
        # percentiles computed there, not on the worker's loop
        self.chunk_latencies: deque = deque(maxlen=CHUNK_LATENCIES_KEPT)
        self.max_streams = recognizer.cache_config.max_batch_size
        self._saved = set(self.saved_sessions())  # sessions on disk whose stream is not live here
        self._ended = {"completed": 0, "cancelled": 0, "suspended": 0, "failed": 0}
        self._checkpoints = {"taken": 0, "session_seconds": 0.0}
        self.writer = SessionWriter() if self.state_dir is not None else None
        self._checkpointed: dict = {}  # stream id -> (time, samples, frames done) of its last checkpoint
        self.last_failure: dict | None = None  # {"stream", "message", "at" (time.time())}
        self.stats = WorkerStats(pool=recognizer.pool_usage(), suspended_on_disk=len(self._saved),
                                 ended=dict(self._ended), checkpoints=dict(self._checkpoints))
        self._commands: queue.Queue = queue.Queue()
        self._handles: dict = {}  # stream id -> StreamHandle (granted, not finished)
        self._opens: list[_Open] = []  # waiting for a slot, oldest first
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._audio_seconds = 0.0
        self.loop_started: float | None = None  # time.monotonic() when the running loop began (None: idle)
        self.error: BaseException | None = None

    # ---- event-loop side ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (once)."""
        self._thread = threading.Thread(target=self._run, name="oasr-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the worker thread runs (False before ``start``, after ``stop`` and if it died)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def stalled_seconds(self) -> float:
        """How long the worker has been inside one loop (0 while it waits for commands)."""
        started = self.loop_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after the commands already queued (waits at most ``timeout``; a stuck thread is
        left behind, it is a daemon); streams still live are cancelled."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine worker did not stop within %g s; leaving it behind", timeout)
        elif self.writer is not None:
            self.writer.close(timeout)  # the deletes of the streams it dropped
        self._thread = None

    async def open(self, stream_id: str, kind: str = "live", resume: bool = False,
                   turns: bool = False) -> StreamHandle:
        """A granted stream under ``stream_id`` (``resume``: the saved session of that id).

        Waits up to ``admit_timeout`` for a slot; ``Busy`` after it, or at once while shutting
        down or when the worker thread is not running (a worker that does not answer at all: ``Busy``
        after ``admit_timeout + ADMIT_GRACE`` on the event loop's clock). ``resume``: ``NoSession``
        without a saved session (or without a state directory), ``ValueError`` for one this recognizer
        cannot take (another model); ``ValueError`` for an id already live; ``StreamFailed`` when opening
        raised an internal error. ``turns``: the stream is cut into turns (``ValueError`` where the
        recognizer cannot: rescoring, full context, a transducer).
        """
        if not self.alive:
            raise Busy("the engine is not running (see /health)", retry_after=5)
        loop = asyncio.get_running_loop()
        handle = StreamHandle(stream_id, kind, asyncio.Queue(), loop=loop)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("open", _Open(handle, future, time.monotonic() + self.admit_timeout, resume, turns)))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.admit_timeout + ADMIT_GRACE)
        except asyncio.TimeoutError:
            self._commands.put(("cancel", stream_id))  # if the worker wakes up, it withdraws or drops it
            raise Busy(f"the engine did not answer within {self.admit_timeout + ADMIT_GRACE:g} s",
                       retry_after=max(1, round(self.admit_timeout))) from None
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

    async def suspend_live(self, timeout: float | None = None) -> int:
        """Shutdown: refuse new opens, save every stream still taking audio; returns how many were saved.

        Streams whose audio ended are left to finish (the caller keeps serving until they do).
        ``timeout``: seconds to wait for the worker (``TimeoutError`` after it); a worker that is not
        running saves nothing (0).
        """
        if not self.alive:
            return 0
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("suspend_live", future))
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    def saved_sessions(self) -> list[str]:
        """Ids of the sessions waiting in ``state_dir`` (suspended, or checkpointed before a crash)."""
        if self.state_dir is None:
            return []
        return sorted(p.name[: -len(".session")] for p in self.state_dir.glob("*.session"))

    def session_path(self, stream_id: str) -> Path | None:
        """Where the stream's session is written (ids are checked by the caller); None without a state_dir."""
        return None if self.state_dir is None else self.state_dir / f"{stream_id}.session"

    # ---- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        idle = True
        try:
            while True:
                try:
                    self.loop_started = None
                    if not self._drain(block=idle):
                        break
                    self.loop_started = time.monotonic()
                    self._grant()
                    idle = not self._tick()
                    self._checkpoint_due()
                    self._publish()
                except Exception:  # a bug outside any one stream's work: log it, keep serving
                    logger.exception("the engine worker's loop raised; it goes on")
                    idle = False
                    time.sleep(0.05)  # no busy loop if it keeps raising
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: tell every waiting handler, then stop
            self.error = exc
            for handle in self._handles.values():
                handle.post(("gone", f"server error: {exc!r}"))
            for request in self._opens:
                _settle(request.future, exc=Busy(f"server error: {exc!r}", retry_after=5))
            raise
        finally:
            self.loop_started = None
            for sid, handle in list(self._handles.items()):
                try:
                    self._drop(sid)
                except Exception:
                    logger.exception("dropping stream %r at the worker's stop", sid)
                handle.post(("gone", "the server stopped"))

    def _drain(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one when idle); False on ``stop``."""
        timeout = None
        if self._opens:
            timeout = max(0.0, min(r.deadline for r in self._opens) - time.monotonic())
        if self.checkpoint_every is not None and self._handles:
            timeout = min(timeout if timeout is not None else self.checkpoint_every, self.checkpoint_every)
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            try:
                getattr(self, f"_do_{command[0]}")(*command[1:])
            except Exception as exc:
                self._command_failed(command, exc)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _command_failed(self, command: tuple, exc: Exception) -> None:
        """A command raised: fail the one stream (or request) it was for."""
        kind = command[0]
        if kind == "open":
            logger.exception("opening stream %r", command[1].handle.id)
            _settle(command[1].future, exc=StreamFailed(f"stream {command[1].handle.id!r}: {exc!r}"))
        elif kind == "suspend_live":
            logger.exception("suspending the live streams")
            _settle(command[1], exc=exc)
        else:  # audio, end, cancel: the stream id comes first
            self._fail(command[1], exc, f"its {kind} command")

    def _fail(self, sid, exc: BaseException, where: str) -> None:
        """End stream ``sid`` after an internal error: out of the recognizer, its session file gone, its
        handler told (``failed``), counted. Nothing here raises."""
        logger.error("stream %r failed in %s: %r", sid, where, exc, exc_info=exc)
        handle = self._handles.pop(sid, None)
        try:
            if sid in self.rec.streams:
                self.rec.cancel(sid)
            elif sid in self.rec.engine.stream_ids:
                self.rec.engine.cancel(sid)
        except Exception:
            logger.exception("could not cancel failed stream %r; its blocks may stay taken", sid)
            self.rec.streams.pop(sid, None)
        self._forget_session(sid)
        message = f"stream {sid!r}: an internal error ended the stream ({where}: {type(exc).__name__}: {exc})"
        self._ended["failed"] += 1
        self.last_failure = {"stream": str(sid), "message": message, "at": time.time()}
        if handle is not None:
            handle.post(("failed", message))

    def _do_open(self, request: _Open) -> None:
        sid = request.handle.id
        if not self._accepting:
            _settle(request.future, exc=Busy("the server is shutting down", retry_after=5))
        elif sid in self._handles or any(r.handle.id == sid for r in self._opens):
            _settle(request.future, exc=ValueError(f"stream {sid!r} is already live"))
        elif request.resume and self.state_dir is None:
            _settle(request.future, exc=NoSession(f"no suspended stream {sid!r}: this server keeps no sessions "
                                                  "(it runs without --state-dir)"))
        elif request.resume and not self.session_path(sid).is_file():
            _settle(request.future, exc=NoSession(f"no suspended stream {sid!r} on this server"))
        else:
            self._opens.append(request)

    def _grant(self) -> None:
        now = time.monotonic()
        while self._opens and len(self.rec.streams) < self.max_streams:
            request = self._opens.pop(0)
            handle = request.handle
            if request.future.done():
                continue  # its waiter gave up; the cancel command that follows finds nothing
            try:
                if request.resume:
                    path = self.session_path(handle.id)
                    stream = self.rec.resume(path.read_bytes(), stream_id=handle.id)
                    self._saved.discard(handle.id)
                    if self.checkpoint_every is None:
                        path.unlink(missing_ok=True)
                    handle.resumed = True
                else:
                    stream = self.rec.open_stream(handle.id, turns=True) if request.turns else \
                        self.rec.open_stream(handle.id)
            except TypeError as exc:  # a recognizer without turns (the transducer's)
                _settle(request.future, exc=ValueError(f"stream {handle.id!r}: this model serves no turn "
                                                       f"detection ({exc})"))
                continue
            except (ValueError, KeyError, OSError, StreamCapacityError) as exc:
                _settle(request.future, exc=ValueError(f"stream {handle.id!r}: {exc}"))
                continue
            except Exception as exc:
                self._command_failed(("open", request), exc)
                continue
            handle.samples = stream.samples
            handle.turns = None if stream.segments is None else len(stream.segments)  # (a resumed one's go on)
            self._handles[handle.id] = handle
            self._checkpointed[handle.id] = (time.monotonic(), stream.samples, stream.frames_done)
            _settle(request.future, handle)
        for request in [r for r in self._opens if r.deadline <= now]:
            self._opens.remove(request)
            _settle(request.future, exc=Busy(
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
        if self._handles.pop(sid, None) is not None:
            self._forget_session(sid)
        if sid in self.rec.streams:
            self.rec.cancel(sid)
            self._ended["cancelled"] += 1

    def _forget_session(self, sid) -> None:
        """The stream is over here: its checkpoint file (if any) goes, after any write still queued for it."""
        self._checkpointed.pop(sid, None)
        if self.writer is not None and sid not in self._saved:
            self.writer.delete(self.session_path(sid))

    def _do_suspend_live(self, future) -> None:
        self._accepting = False
        for request in self._opens:
            _settle(request.future, exc=Busy("the server is shutting down", retry_after=5))
        self._opens.clear()
        if self.writer is not None:  # no queued checkpoint may land over a suspended stream's file
            self.writer.flush(10.0)
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
            try:
                write_atomic(self.session_path(sid), blob)
            except OSError as exc:
                self._fail(sid, exc, "writing its session at shutdown")
                continue
            self._saved.add(sid)
            self._checkpointed.pop(sid, None)
            self._handles.pop(sid)
            handle.post(("suspended", samples))
            saved += 1
            self._ended["suspended"] += 1
        _settle(future, saved)

    def _checkpoint_due(self) -> None:
        """Write the session of every live stream whose last checkpoint is ``checkpoint_every`` old and
        that changed since (``Recognizer.checkpoint`` here, the write on ``SessionWriter``'s thread)."""
        if self.checkpoint_every is None:
            return
        now = time.monotonic()
        for sid, handle in list(self._handles.items()):
            stream = self.rec.streams.get(sid)
            last = self._checkpointed.get(sid)
            if handle.kind != "live" or stream is None or last is None or now - last[0] < self.checkpoint_every:
                continue
            if (stream.samples, stream.frames_done) == last[1:]:
                continue  # nothing new since the last one (the file, if any, is still current)
            t0 = time.perf_counter()
            try:
                blob = self.rec.checkpoint(sid)
            except ValueError:
                continue  # being rescored: the last checkpoint stands (the client sends from its offset)
            except Exception as exc:
                self._fail(sid, exc, "its checkpoint")
                continue
            self.writer.write(self.session_path(sid), blob)  # whole or absent, on the writer's thread
            self._checkpointed[sid] = (now, stream.samples, stream.frames_done)
            self._checkpoints["taken"] += 1
            self._checkpoints["session_seconds"] += time.perf_counter() - t0

    def _tick(self) -> bool:
        """One engine tick if any stream is open; True if it encoded or finished something."""
        if not self.rec.streams:
            return False
        before = {sid: (s.frames_done, len(s.latencies)) for sid, s in self.rec.streams.items()}
        turning = {sid: s for sid, s in self.rec.streams.items() if getattr(s, "segments", None) is not None}
        t0 = time.perf_counter()
        try:
            finished = self.rec.step(on_error=lambda sid, exc: self._fail(sid, exc, "its part of a tick"))
        except Exception as exc:  # the batched tick names no stream: every stream it held fails
            engine = self.rec.engine
            for sid in list(self.rec.streams):
                if sid in engine.stream_ids and engine.status(sid) in ("active", "rescoring"):
                    self._fail(sid, exc, "an engine tick it was part of")
            return True
        seconds = time.perf_counter() - t0
        stats = self.rec.engine.stats[-1] if self.rec.engine.stats else None
        progressed = bool(finished) or bool(stats and (stats.cohort or stats.decode_steps))
        if progressed and self.on_tick is not None:
            self.on_tick(seconds)
        for sid, stream in turning.items():  # a finished stream's last turn too (its object outlives it)
            handle = self._handles.get(sid)
            events, stream.turn_events = stream.turn_events, []
            for entry in events if handle is not None else ():
                handle.post(("turn", entry))
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
            self._forget_session(transcript.id)
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
            suspended_on_disk=len(self._saved), accepting=self._accepting, ended=dict(self._ended),
            checkpoints={**self._checkpoints, **(self.writer.stats if self.writer is not None else {})})
