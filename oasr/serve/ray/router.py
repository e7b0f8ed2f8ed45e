"""``StreamRouter``: the ingress deployment that keeps each stream on its engine and moves streams between engines."""

from __future__ import annotations

import asyncio
import itertools
import uuid

PLACEMENTS = ("least_loaded", "round_robin")


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
