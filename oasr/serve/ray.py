"""Scale-out on Ray Serve: one recognizer engine per GPU behind a router that keeps streams where they live.

::

                      client (RayStreams, or an HTTP front end holding the router's handle)
                                          |
                                          v
                 +-------------------------------------------------+
                 | StreamRouter (ingress deployment, one replica)  |
                 |   stream id -> engine   (sticky)                |
                 |   new stream -> least loaded open engine        |
                 |   migrate / drain / rebalance: suspend, resume  |
                 +-------------------------------------------------+
                   | handle            | handle              | handle
                   v                   v                     v
            +-------------+     +-------------+       +-------------+
            | engine0     |     | engine1     |  ...  | engineN-1   |   one deployment each, num_replicas=1
            | Recognizer  |     | Recognizer  |       | Recognizer  |   num_gpus=1 on a GPU cluster,
            | tick task   |     | tick task   |       | tick task   |   a CPU share otherwise
            +-------------+     +-------------+       +-------------+
                GPU 0               GPU 1                 GPU N-1

Each engine is its own single-replica deployment (``engine0`` ... ``engineN-1``), so a handle reaches exactly
that engine: a stream's caches live on one engine, and Serve's own replica choice (power of two choices, or
model multiplexing, which prefers but does not promise the replica holding a model) could send a request to an
engine that has never seen the stream. Ray places the engines (one per GPU with ``num_gpus=1``), restarts one
that fails its health check, and carries every call; the router only decides which engine a stream lives on.

``EngineReplica`` owns one ``Recognizer``. One task owns it and runs its ticks: calls from the router are
commands on a queue, applied by that task between ticks; the tick itself runs on a worker thread so the replica
keeps taking calls while it computes. After a tick that moved nothing the task sleeps until the next command.

Migration (``StreamRouter.migrate``, and ``drain`` / ``rebalance``, which use it) moves a stream through its
session bytes: ``Recognizer.suspend`` on the source (the stream leaves it, its blocks and slot are freed), the
bytes through Ray, ``Recognizer.resume`` on the target under the same id. The router holds the stream's lock
for the whole move, so the stream's calls wait and then go to the new engine; the client sees one stream. A
stream that has already finished moves as its transcript; one whose second pass (rescoring) is running moves
with its rescoring job. What a session restores is the stream exactly (K/V
window, conv and CTC state, unconsumed audio features, partial text); the resumed stream then computes in
the target engine's cohorts, so its transcript equals one that never moved (the tests check it against
``Recognizer.transcribe`` on shipped clips) and is bit-identical only where the cohort widths also match.

Bad input is refused where it is found and leaves the stream as it was: audio by the engine (``AudioError``, a
``ValueError``), unknown ids (``KeyError``) and unknown engines or an impossible drain (``ValueError``) by the
router. ``RayStreams`` raises them as those types, not wrapped in Ray's task errors.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from concurrent.futures import ThreadPoolExecutor

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("oasr.serve.ray needs Ray Serve: pip install 'oasr[ray]' (ray[serve])") from exc

PLACEMENTS = ("least_loaded", "round_robin")


# ---- one engine ----------------------------------------------------------------------------------------------
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


# ---- the router ----------------------------------------------------------------------------------------------
class StreamRouter:
    """The ingress: keeps each stream on its engine, places new streams, moves streams between engines.

    ``engines`` are the engines' deployment handles and ``names`` their names, in the same order.
    ``placement``: ``"least_loaded"`` (default) puts a new stream on the open engine holding the fewest streams
    (ties: the first in order); ``"round_robin"`` cycles over the open engines. A drained engine is closed:
    it takes no new streams and no moved ones until ``restore``.

    Invariants: a stream id is in ``homes`` exactly while one engine holds it (live, or finished and not yet
    collected); every call for a stream, and every move of it, holds that stream's lock, so a stream's calls
    reach its engine in order and never while it is between engines.
    """

    def __init__(self, engines: list, names: list, placement: str = "least_loaded"):
        if placement not in PLACEMENTS:
            raise ValueError(f"StreamRouter: placement must be one of {PLACEMENTS}, got {placement!r}")
        if len(engines) != len(names) or not engines:
            raise ValueError(f"StreamRouter: need one name per engine and at least one, got {len(engines)} "
                             f"engines and {len(names)} names")
        self.engines = dict(zip(names, engines, strict=True))
        self.names = list(names)
        self.placement = placement
        self.homes: dict = {}  # stream id -> engine name
        self.closed: set = set()  # drained engines
        self._locks: dict = {}
        self._turn = itertools.count()

    # -- streams --
    async def open_stream(self, stream_id=None, engine: str | None = None) -> object:
        """Start a stream (a fresh id unless ``stream_id``) on ``engine`` or the placement's choice; its id."""
        if stream_id is None:
            stream_id = uuid.uuid4().hex
        if stream_id in self.homes:
            raise ValueError(f"StreamRouter: stream id {stream_id!r} is in use")
        target = self._check_target(engine) if engine is not None else self._choose()
        self.homes[stream_id] = target  # claimed before the first await: concurrent opens see it
        self._locks[stream_id] = lock = asyncio.Lock()
        async with lock:
            try:
                await self.engines[target].open.remote(stream_id)
            except BaseException:
                self._forget(stream_id)
                raise
        return stream_id

    async def accept(self, stream_id, pcm, sample_rate: int = 16000) -> None:
        """Feed audio to a stream on its engine."""
        async with self._lock(stream_id):
            await self.engines[self.homes[stream_id]].accept.remote(stream_id, pcm, sample_rate)

    async def end(self, stream_id) -> None:
        """End a stream's audio."""
        async with self._lock(stream_id):
            await self.engines[self.homes[stream_id]].end.remote(stream_id)

    async def poll(self, stream_id) -> dict:
        """The stream's partial text, or its final transcript (``"final": True``), and the engine holding it."""
        async with self._lock(stream_id):
            return await self.engines[self.homes[stream_id]].poll.remote(stream_id)

    async def result(self, stream_id, timeout_s: float = 60.0, poll_s: float = 0.02) -> dict:
        """Wait for the stream's final transcript and collect it (the stream is forgotten everywhere).

        ``TimeoutError`` after ``timeout_s`` seconds, the stream left as it was.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            async with self._lock(stream_id):
                final = await self.engines[self.homes[stream_id]].pop_result.remote(stream_id)
                if final is not None:
                    self._forget(stream_id)
                    return final
            if loop.time() >= deadline:
                raise TimeoutError(f"StreamRouter: stream {stream_id!r} not finished after {timeout_s} s")
            await asyncio.sleep(poll_s)

    async def cancel(self, stream_id) -> None:
        """Drop a stream wherever it is, live or finished."""
        async with self._lock(stream_id):
            await self.engines[self.homes[stream_id]].cancel.remote(stream_id)
            self._forget(stream_id)

    # -- placement and moves --
    async def migrate(self, stream_id, to: str | None = None) -> dict:
        """Move a stream to engine ``to`` (default: the least loaded other open engine) through its session.

        Returns ``{"id", "from", "to", "bytes"}`` (``bytes``: the session's size, 0 for a finished stream).
        Refused (``ValueError``, nothing moved) for an unknown or closed target or the stream's own engine.
        If the target refuses the session the stream goes back to its source, so it is never lost. A stream
        being rescored moves with its rescoring job.
        """
        async with self._lock(stream_id):
            source = self.homes[stream_id]
            target = self._check_target(to) if to is not None else self._choose(exclude=source)
            if target == source:
                raise ValueError(f"StreamRouter: stream {stream_id!r} is already on {source}")
            moved = await self.engines[source].suspend.remote(stream_id)
            try:
                await self.engines[target].resume.remote(moved, stream_id)
            except BaseException:
                await self.engines[source].resume.remote(moved, stream_id)
                raise
            self.homes[stream_id] = target
            return {"id": stream_id, "from": source, "to": target, "bytes": len(moved.get("session", b""))}

    async def drain(self, engine: str) -> list:
        """Close ``engine`` to new streams and move every stream it holds to the open engines; the moves made.

        ``ValueError`` (nothing changed) for an unknown engine or when no other engine is open.
        """
        self._check_known(engine)
        if not [name for name in self.names if name != engine and name not in self.closed]:
            raise ValueError(f"StreamRouter: cannot drain {engine}: no other open engine to take its streams")
        self.closed.add(engine)
        moves = []
        for stream_id in [sid for sid, home in self.homes.items() if home == engine]:
            if self.homes.get(stream_id) == engine:  # still there (not collected or moved meanwhile)
                moves.append(await self.migrate(stream_id))
        return moves

    async def restore(self, engine: str) -> None:
        """Open a drained engine again for new and moved streams."""
        self._check_known(engine)
        self.closed.discard(engine)

    async def rebalance(self) -> list:
        """Move streams from the most to the least loaded open engine until their counts differ by at most one."""
        moves = []
        while True:
            counts = self._counts()
            open_names = [name for name in self.names if name not in self.closed]
            busiest = max(open_names, key=lambda name: counts[name])
            idlest = min(open_names, key=lambda name: counts[name])
            if counts[busiest] - counts[idlest] <= 1:
                return moves
            stream_id = next(sid for sid, home in reversed(list(self.homes.items())) if home == busiest)
            moves.append(await self.migrate(stream_id, to=idlest))

    async def placement_of(self) -> dict:
        """``{stream id: engine name}`` for every stream the router knows."""
        return dict(self.homes)

    async def engine_names(self) -> list:
        """The engines' names, in order, and which are closed: ``[(name, closed), ...]``."""
        return [(name, name in self.closed) for name in self.names]

    async def loads(self) -> list:
        """Every engine's ``EngineReplica.load()``, in order."""
        return [await self.engines[name].load.remote() for name in self.names]

    # -- internals --
    def _lock(self, stream_id) -> asyncio.Lock:
        if stream_id not in self.homes:
            raise KeyError(f"StreamRouter: unknown stream id {stream_id!r}")
        return self._locks[stream_id]

    def _forget(self, stream_id) -> None:
        self.homes.pop(stream_id, None)
        self._locks.pop(stream_id, None)

    def _counts(self) -> dict:
        counts = dict.fromkeys(self.names, 0)
        for home in self.homes.values():
            counts[home] += 1
        return counts

    def _check_known(self, engine) -> str:
        if engine not in self.engines:
            raise ValueError(f"StreamRouter: unknown engine {engine!r}; engines: {self.names}")
        return engine

    def _check_target(self, engine) -> str:
        self._check_known(engine)
        if engine in self.closed:
            raise ValueError(f"StreamRouter: engine {engine!r} is drained; restore it first")
        return engine

    def _choose(self, exclude: str | None = None) -> str:
        candidates = [name for name in self.names if name not in self.closed and name != exclude]
        if not candidates:
            raise ValueError("StreamRouter: no open engine to place a stream on")
        if self.placement == "round_robin":
            return candidates[next(self._turn) % len(candidates)]
        counts = self._counts()
        return min(candidates, key=lambda name: counts[name])


# ---- building and running it ---------------------------------------------------------------------------------
def build_app(num_engines: int | None = None, *, gpus: bool = False, engine_cpus: float = 1.0,
              recognizer_options: dict | None = None, torch_threads: int | None = 1,
              placement: str = "least_loaded", max_ongoing_requests: int = 1024):
    """The Serve application: ``num_engines`` engine deployments and the router, unbound from any cluster.

    ``gpus=True``: each engine asks Ray for one GPU (``num_gpus=1``, so Ray puts one engine on each GPU) and
    runs its recognizer on ``cuda`` unless ``recognizer_options`` names a device; ``num_engines`` defaults to
    the cluster's GPU count (Ray must be running). On the CPU each engine asks for ``engine_cpus`` CPUs
    (fractions are fine) and ``num_engines`` defaults to 2.
    """
    options = dict(recognizer_options or {})
    if gpus:
        options.setdefault("device", "cuda")
        if num_engines is None:
            num_engines = int(ray.cluster_resources().get("GPU", 0))
        actor = {"num_gpus": 1, "num_cpus": engine_cpus}
    else:
        num_engines = 2 if num_engines is None else num_engines
        actor = {"num_cpus": engine_cpus}
    if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
        raise ValueError(f"build_app: need at least one engine, got num_engines={num_engines!r}"
                         + (" (no GPU in the Ray cluster)" if gpus else ""))
    if placement not in PLACEMENTS:
        raise ValueError(f"build_app: placement must be one of {PLACEMENTS}, got {placement!r}")
    names = [f"engine{i}" for i in range(num_engines)]
    engine = serve.deployment(EngineReplica)
    engines = [engine.options(name=name, num_replicas=1, ray_actor_options=actor,
                              max_ongoing_requests=max_ongoing_requests).bind(name, options, torch_threads)
               for name in names]
    router = serve.deployment(StreamRouter).options(name="router", num_replicas=1,
                                                     ray_actor_options={"num_cpus": 0},
                                                     max_ongoing_requests=max_ongoing_requests)
    return router.bind(engines, names, placement)


def start_local(num_cpus: int | None = None, **init_options) -> None:
    """Start a local Ray instance for Serve without the dashboard or HTTP proxy (the router is reached by handle).

    A no-op for Ray when it is already running. ``init_options`` go to ``ray.init``.
    """
    if not ray.is_initialized():
        init_options.setdefault("include_dashboard", False)
        init_options.setdefault("log_to_driver", False)
        ray.init(num_cpus=num_cpus, **init_options)
    serve.start(proxy_location="Disabled")


def deploy(num_engines: int | None = None, *, name: str = "oasr", timeout_s: float = 120.0, **app_options):
    """Run ``build_app(num_engines, **app_options)`` on the running Ray cluster as application ``name``.

    Returns a ``RayStreams`` client on the router. Needs ``start_local`` (or a cluster) first.
    """
    handle = serve.run(build_app(num_engines, **app_options), name=name, route_prefix=None)
    return RayStreams(handle, timeout_s=timeout_s)


def _unwrap(exc: BaseException) -> BaseException:
    """The user's exception inside Ray's task error wrappers (router -> engine adds one per hop)."""
    while isinstance(exc, ray.exceptions.RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


class RayStreams:
    """A synchronous client on the router's handle: each method is the router's, waited for ``timeout_s``.

    Errors come out as the router or engine raised them (``KeyError``, ``ValueError``, ``AudioError``,
    ``TimeoutError``), not wrapped in Ray's task errors.
    """

    def __init__(self, handle, timeout_s: float = 120.0):
        self.handle = handle
        self.timeout_s = timeout_s

    def _call(self, method: str, *args, **kwargs):
        try:
            return getattr(self.handle, method).remote(*args, **kwargs).result(timeout_s=self.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            raise _unwrap(exc) from None

    def open_stream(self, stream_id=None, engine: str | None = None):
        """Start a stream; returns its id (see ``StreamRouter.open_stream``)."""
        return self._call("open_stream", stream_id, engine)

    def accept(self, stream_id, pcm, sample_rate: int = 16000) -> None:
        """Feed mono PCM to a stream."""
        return self._call("accept", stream_id, pcm, sample_rate)

    def end(self, stream_id) -> None:
        """End a stream's audio."""
        return self._call("end", stream_id)

    def poll(self, stream_id) -> dict:
        """Partial or final text and the engine holding the stream."""
        return self._call("poll", stream_id)

    def result(self, stream_id, timeout_s: float = 60.0) -> dict:
        """Wait for and collect the final transcript."""
        return self._call("result", stream_id, timeout_s)

    def cancel(self, stream_id) -> None:
        """Drop a stream."""
        return self._call("cancel", stream_id)

    def migrate(self, stream_id, to: str | None = None) -> dict:
        """Move a stream to another engine through its session bytes."""
        return self._call("migrate", stream_id, to)

    def drain(self, engine: str) -> list:
        """Close an engine and move all its streams away; the moves."""
        return self._call("drain", engine)

    def restore(self, engine: str) -> None:
        """Reopen a drained engine."""
        return self._call("restore", engine)

    def rebalance(self) -> list:
        """Even out the stream counts of the open engines; the moves."""
        return self._call("rebalance")

    def placement(self) -> dict:
        """``{stream id: engine name}``."""
        return self._call("placement_of")

    def engines(self) -> list:
        """``[(engine name, closed), ...]``."""
        return self._call("engine_names")

    def loads(self) -> list:
        """Every engine's load (live and finished streams, pool usage, ticks)."""
        return self._call("loads")


# ---- python -m oasr.serve.ray: the shipped clips over the engines, every stream moved once -------------------
def main(argv: list[str] | None = None) -> int:
    """Stream shipped clips through ``num_engines`` engines, move every stream once mid-utterance, and compare
    each transcript with ``Recognizer.transcribe`` of the same clip; prints the timings. Exit 0 when all match."""
    import argparse
    import time

    import numpy as np
    import torch

    from oasr.asr.audio import load_audio
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset

    parser = argparse.ArgumentParser(prog="python -m oasr.serve.ray", description=main.__doc__)
    parser.add_argument("--engines", type=int, default=2, help="engine deployments (default 2)")
    parser.add_argument("--engine-cpus", type=float, default=0.5, help="CPUs Ray reserves per engine (CPU only)")
    parser.add_argument("--gpus", action="store_true", help="one GPU per engine (num_gpus=1), recognizers on cuda")
    parser.add_argument("--clips", type=int, default=8, help="shipped clips, one stream each (default 8)")
    parser.add_argument("--max-streams", type=int, default=8, help="stream slots per engine (default 8)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    parser.add_argument("--address", default=None, help="connect to this Ray cluster instead of starting one")
    args = parser.parse_args(argv)
    for name in ("engines", "clips", "max_streams"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.engine_cpus > 0:
        parser.error(f"--engine-cpus must be > 0, got {args.engine_cpus}")
    torch.set_num_threads(1)
    clips = load_testset(limit=args.clips)
    pcm = [load_audio(clip.path) for clip in clips]
    offline = [t.text for t in Recognizer(max_streams=args.max_streams).transcribe(pcm)]

    t0 = time.perf_counter()
    if args.address:
        ray.init(address=args.address)
        serve.start(proxy_location="Disabled")
    else:
        start_local(num_cpus=args.num_cpus)
    t1 = time.perf_counter()
    try:
        streams = deploy(args.engines, gpus=args.gpus, engine_cpus=args.engine_cpus,
                         recognizer_options={"max_streams": args.max_streams})
        t2 = time.perf_counter()
        ids = [streams.open_stream() for _ in clips]
        piece = 5120  # 0.32 s
        halves = [len(x) // 2 for x in pcm]
        for sid, x, half in zip(ids, pcm, halves, strict=True):
            for at in range(0, half, piece):
                streams.accept(sid, x[at : min(at + piece, half)])
        moves, move_s = [], []
        for sid in ids:
            t = time.perf_counter()
            moves.append(streams.migrate(sid))
            move_s.append(time.perf_counter() - t)
        for sid, x, half in zip(ids, pcm, halves, strict=True):
            for at in range(half, len(x), piece):
                streams.accept(sid, x[at : min(at + piece, len(x))])
            streams.end(sid)
        results = [streams.result(sid) for sid in ids]
        t3 = time.perf_counter()
    finally:
        serve.shutdown()
        if not args.address:
            ray.shutdown()
    same = [r["text"] == text for r, text in zip(results, offline, strict=True)]
    for clip, move, r, ok in zip(clips, moves, results, same, strict=True):
        print(f"{clip.id}  {move['from']} -> {move['to']}  {move['bytes'] / 1024:6.1f} KiB  "
              f"{'same' if ok else 'DIFFERS'}  {r['text']}")
    kib = np.array([m["bytes"] for m in moves]) / 1024
    ms = np.array(move_s) * 1e3
    print(f"Ray and Serve up in {t1 - t0:.1f} s; {args.engines} engines deployed in {t2 - t1:.1f} s; "
          f"{len(ids)} streams, each moved once mid-utterance, done in {t3 - t2:.1f} s")
    print(f"sessions {kib.mean():.1f} KiB mean, {kib.max():.1f} KiB max; a move takes {np.median(ms):.0f} ms median, "
          f"{ms.max():.0f} ms max (suspend, transfer, resume, through the router)")
    print(f"{sum(same)}/{len(same)} transcripts equal Recognizer.transcribe of the same clip")
    return 0 if all(same) else 1


if __name__ == "__main__":
    raise SystemExit(main())
