"""``EngineReplica``: one recognizer engine as a Serve deployment; one task owns it and runs its ticks."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor


class EngineReplica:
    """One ``Recognizer`` and the task that runs its ticks (the body of each ``engineK`` deployment).

    ``name`` is the engine's name in the router's tables; ``recognizer_options`` go to ``Recognizer``
    (``device``, ``max_streams``, ``twin``, ...); ``torch_threads`` pins ``torch.set_num_threads`` in this
    process (None leaves it). Every public method is a coroutine the router calls through a handle. A stream's
    transcript stays here once finished until ``pop_result``, ``cancel`` or a move takes it.
    """

    def __init__(self, name: str, recognizer_options: dict | None = None, torch_threads: int | None = 1):
        import torch

        from oasr.asr.recognizer import Recognizer

        if torch_threads is not None:
            torch.set_num_threads(int(torch_threads))
        self.name = name
        self.recognizer = Recognizer(**(recognizer_options or {}))
        self.finished: dict = {}  # stream id -> result dict, until collected or moved
        self.ticks = 0
        self._commands: asyncio.Queue | None = None
        self._owner: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"oasr-{name}-tick")

    # -- the calls (each one a command for the owning task) --
    async def open(self, stream_id) -> object:
        """Start a stream under ``stream_id`` (unique across engines: the router chooses it); returns it."""
        return await self._command(lambda: self.recognizer.open_stream(stream_id).id)

    async def accept(self, stream_id, pcm, sample_rate: int = 16000) -> None:
        """Feed mono PCM to a live stream; ``AudioError`` (stream unchanged) for bad audio, ``KeyError`` unknown."""
        return await self._command(lambda: self._live(stream_id).accept(pcm, sample_rate))

    async def end(self, stream_id) -> None:
        """End a live stream's audio; its transcript follows within the next ticks."""
        return await self._command(lambda: self._live(stream_id).end())

    async def poll(self, stream_id) -> dict:
        """``{"id", "engine", "text", "final"}``: the partial text of a live stream, or the final transcript."""
        return await self._command(lambda: self._poll(stream_id))

    async def pop_result(self, stream_id) -> dict | None:
        """The final result of a finished stream, removed from this engine; None while it is still live."""
        return await self._command(lambda: self._pop_result(stream_id))

    async def cancel(self, stream_id) -> None:
        """Drop a stream, live (its blocks and slot go back) or finished (its transcript is discarded)."""
        return await self._command(lambda: self._cancel(stream_id))

    async def suspend(self, stream_id) -> dict:
        """Take a stream out of this engine to move it: ``{"session": bytes}`` (live, also while its second
        pass, rescoring, runs) or ``{"result": dict}`` (finished)."""
        return await self._command(lambda: self._suspend(stream_id))

    async def resume(self, moved: dict, stream_id) -> None:
        """Take in a stream that ``suspend`` took out of another engine, under the same ``stream_id``."""
        return await self._command(lambda: self._resume(moved, stream_id))

    async def load(self) -> dict:
        """This engine's load: live and finished streams, pool usage, ticks run."""
        return await self._command(lambda: {"engine": self.name, "live": len(self.recognizer.streams),
                                            "finished": len(self.finished), "ticks": self.ticks,
                                            "pool": self.recognizer.pool_usage()})

    def check_health(self) -> None:
        """Serve's health check: fails once the tick task has died, so Serve replaces this replica."""
        if self._failure is not None:
            raise RuntimeError(f"engine {self.name}: the tick task failed: {self._failure!r}")

    # -- the owning task --
    async def _command(self, action):
        self.check_health()
        if self._owner is None:
            self._commands = asyncio.Queue()
            self._owner = asyncio.get_running_loop().create_task(self._own())
        done = asyncio.get_running_loop().create_future()
        self._commands.put_nowait((action, done))
        return await done

    def _apply(self, command) -> None:
        action, done = command
        try:
            result = action()
        except Exception as exc:  # the caller gets it; the engine goes on
            if not done.done():
                done.set_exception(exc)
        else:
            if not done.done():
                done.set_result(result)

    async def _own(self) -> None:
        """Apply queued commands between ticks; tick while the last tick made progress, else wait for a command."""
        loop = asyncio.get_running_loop()
        progress = False
        try:
            while True:
                if not progress:
                    self._apply(await self._commands.get())
                while not self._commands.empty():
                    self._apply(self._commands.get_nowait())
                if not self.recognizer.streams:
                    progress = False
                    continue
                done = await loop.run_in_executor(self._executor, self.recognizer.step)
                self.ticks += 1
                for transcript in done:
                    self.finished[transcript.id] = self._result(transcript)
                last = self.recognizer.engine.stats[-1]
                progress = bool(done or last.cohort or last.finished or last.decode_steps)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # health check reports it; waiting callers are told
            self._failure = exc
            while not self._commands.empty():
                _, waiting = self._commands.get_nowait()
                if not waiting.done():
                    waiting.set_exception(RuntimeError(f"engine {self.name}: the tick task failed: {exc!r}"))
            raise

    # -- what the commands do (run by the owning task only) --
    def _live(self, stream_id):
        if stream_id not in self.recognizer.streams:
            state = "finished" if stream_id in self.finished else "unknown"
            raise KeyError(f"engine {self.name}: no live stream {stream_id!r} ({state})")
        return self.recognizer.streams[stream_id]

    def _result(self, transcript) -> dict:
        return {"id": transcript.id, "engine": self.name, "text": transcript.text, "final": True,
                "first_pass": transcript.first_pass, "audio_seconds": transcript.audio_seconds,
                "partials": list(transcript.partials)}

    def _poll(self, stream_id) -> dict:
        if stream_id in self.finished:
            return dict(self.finished[stream_id], engine=self.name)
        stream = self._live(stream_id)
        return {"id": stream_id, "engine": self.name, "text": stream.text, "final": False}

    def _pop_result(self, stream_id):
        if stream_id in self.finished:
            return self.finished.pop(stream_id)
        self._live(stream_id)  # KeyError when unknown
        return None

    def _cancel(self, stream_id) -> None:
        if stream_id in self.finished:
            del self.finished[stream_id]
            return
        self._live(stream_id)
        self.recognizer.cancel(stream_id)

    def _suspend(self, stream_id) -> dict:
        if stream_id in self.finished:
            return {"result": self.finished.pop(stream_id)}
        self._live(stream_id)
        return {"session": self.recognizer.suspend(stream_id)}  # one being rescored travels with its job

    def _resume(self, moved: dict, stream_id) -> None:
        if stream_id in self.finished or stream_id in self.recognizer.streams:
            raise ValueError(f"engine {self.name}: stream {stream_id!r} is already here")
        if "result" in moved:
            self.finished[stream_id] = dict(moved["result"], engine=self.name)
        else:
            self.recognizer.resume(moved["session"], stream_id=stream_id)
