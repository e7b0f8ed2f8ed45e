"""The streaming engine's input and queries: streams registered, fed, ended, cancelled; what the engine holds.

Part of ``oasr.engine.streaming.engine.StreamingEngine`` (its contract and state are drawn there).
The engine's streams from the caller's side: ids claimed, input pushed and ended, a stream
cancelled, a new turn started on a live stream (``new_turn``: the endpointer's reset), and the queries on them
(states, counts, buffered input).
"""

from __future__ import annotations

import torch

from oasr.engine.decoding import GreedyCtcDecoder
from oasr.engine.streaming.records import (
    ACTIVE,
    FINISHED,
    RESCORING,
    WAITING,
    StreamResult,
    _Stream,
    check_stream_id,
)


class StreamsMixin:
    """A part of ``StreamingEngine``: its input and queries; no state of its own."""

    # ---- input ---------------------------------------------------------------------------
    def _stream(self, stream_id) -> _Stream:
        if stream_id not in self._streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        return self._streams[stream_id]

    # ---- sessions (oasr.sessions.format, .stream) --------------------------------------------------------
    def _claim_id(self, stream_id):
        """``stream_id``, or a fresh int id for None; ``ValueError`` if it is not an int or a str
        (``check_stream_id``) or is in use."""
        self._check_open()
        if stream_id is None:
            stream_id = next(self._ids)
            while stream_id in self._streams:
                stream_id = next(self._ids)
        else:
            check_stream_id(stream_id)
            if stream_id in self._streams:
                raise ValueError(f"stream id {stream_id!r} is already in use")
        return stream_id

    def add_stream(self, stream_id=None):
        """Register a stream (it waits for admission); returns its id."""
        stream_id = self._claim_id(stream_id)
        greedy = GreedyCtcDecoder(self.model.config.vocab_size) if self.decoder == "greedy" else None
        self._streams[stream_id] = _Stream(stream_id, greedy, arrival_tick=self.tick)
        self._waiting.append(stream_id)
        return stream_id

    def push(self, stream_id, features) -> None:
        """Append ``(T, input_dim)`` feature frames, any ``T >= 0``, to a stream's input."""
        self._check_open()
        s = self._stream(stream_id)
        if s.state == FINISHED:
            raise ValueError(f"stream {stream_id!r} has finished (finish_reason={s.finish_reason!r}); "
                             f"it takes no more input")
        if s.ended:
            raise ValueError(f"stream {stream_id!r}: push after end_stream")
        feats = torch.as_tensor(features)
        if feats.dim() != 2 or feats.shape[1] != self.input_dim:
            raise ValueError(f"stream {stream_id!r}: features must be (T, input_dim={self.input_dim}), "
                             f"got {tuple(feats.shape)}")
        if not feats.is_floating_point():
            raise ValueError(f"stream {stream_id!r}: features must be floating point, got {feats.dtype}")
        if not bool(torch.isfinite(feats).all()):
            raise ValueError(f"stream {stream_id!r}: features contain NaN or inf")
        if feats.shape[0]:
            s.pending.append(feats.detach().to("cpu", self.config.dtype))
            s.num_pending += feats.shape[0]

    def end_stream(self, stream_id) -> None:
        """No more input: the stream finishes once its buffered frames are encoded."""
        self._check_open()
        s = self._stream(stream_id)
        if s.ended:
            raise ValueError(f"stream {stream_id!r}: end_stream called twice")
        s.ended = True

    def cancel(self, stream_id) -> None:
        """Drop a stream at once, whatever its state: a waiting stream leaves the queue, an active one
        gives back its slot, its blocks and its decoder state, a stream being rescored drops its job,
        a finished one its result. The id is forgotten (it may be used again). A client that went away
        is the use: nothing of it stays in the engine. ``KeyError`` for an unknown id; nothing changes."""
        s = self._stream(stream_id)
        if s.state == ACTIVE:
            self._contexts.pop(stream_id).free()
            self.states.free_stream(stream_id)
            self._active.remove(stream_id)
        elif s.state == WAITING:
            self._waiting.remove(stream_id)
        elif s.state == RESCORING:
            self._rescoring = [(sid, job) for sid, job in self._rescoring if sid != stream_id]
        self.results.pop(stream_id, None)
        del self._streams[stream_id]

    def buffered_input(self, stream_id) -> torch.Tensor:
        """A copy of the stream's feature frames pushed but not yet encoded, ``(T, input_dim)`` on the CPU."""
        s = self._stream(stream_id)
        if not s.pending:
            return torch.zeros(0, self.input_dim, dtype=self.config.dtype)
        return torch.cat(s.pending).clone()

    def num_buffered(self, stream_id) -> int:
        """How many feature frames the stream has pushed that are not yet encoded (``buffered_input``'s length)."""
        return self._stream(stream_id).num_pending

    def admitted(self, stream_id) -> bool:
        """Whether the stream holds cache state that ``suspend`` can save: it is active, or it was
        resumed and waits to be admitted again. A new stream still waiting for its first admission, and
        a stream that is being rescored or has finished, hold none."""
        s = self._stream(stream_id)
        return s.state == ACTIVE or (s.state == WAITING and s.session is not None)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        """Streams that hold a slot now."""
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Streams with input ready that wait for admission."""
        return len(self._waiting)

    @property
    def active_ids(self) -> list:
        """The ids of the streams that hold a slot, in admission order."""
        return list(self._active)

    def status(self, stream_id) -> str:
        """``"waiting"``, ``"active"``, ``"rescoring"`` (first pass done, its caches freed, the attention
        rescoring job still running: ``rescore=True`` with a tick budget) or ``"finished"``."""
        return self._stream(stream_id).state

    @property
    def stream_ids(self) -> list:
        """Every stream the engine knows (waiting, active or finished), in the order they were added.

        A suspended stream is no longer known here; ``resume`` adds it again.
        """
        return list(self._streams)

    def input_ended(self, stream_id) -> bool:
        """Whether ``end_stream`` was called for the stream: it takes no more input.

        True from ``end_stream`` on, also while its buffered frames are still being
        encoded (``status`` tells when it has finished); ``KeyError`` for an unknown id.
        """
        return self._stream(stream_id).ended

    @property
    def longest_extent(self) -> int:
        """Most K/V frames (history plus chunk) any stream's chunk has attended to so far."""
        return max((s.max_extent for s in self._streams.values()), default=0)

    def new_turn(self, stream_id, pending: torch.Tensor | None = None) -> StreamResult:
        """End the stream's current turn without closing the stream; returns the turn's ``StreamResult``.

        The turn's first pass is finalized (the CTC beam's best, as if the stream had ended here), its
        slot, blocks and decoder state go back to the pools, and the same id starts afresh: a new stream
        waiting for admission, positions from 0, holding the frames pushed but not yet encoded, or
        ``pending`` instead (``(T, input_dim)`` frames, e.g. those of ``buffered_input`` less a silence), and
        ended if the old one was. The turn's result is returned, not kept in ``results``. Raises
        ``ValueError`` for a finished stream or one being rescored, and with ``rescore=True`` (a turn's
        second pass is not run), ``KeyError`` for an unknown id; nothing changes on an error.
        """
        self._check_open()
        s = self._stream(stream_id)
        if self.rescore:
            raise ValueError("StreamingEngine.new_turn: not with rescore=True (a turn has no second pass)")
        if s.state not in (ACTIVE, WAITING) or s.session is not None:
            raise ValueError(f"stream {stream_id!r} is {s.state}{' (resumed, not yet admitted)' if s.session else ''}"
                             f"; only a running stream starts a new turn")
        if pending is not None:
            pending = torch.as_tensor(pending)
            if pending.dim() != 2 or pending.shape[1] != self.input_dim or not pending.is_floating_point() \
                    or not bool(torch.isfinite(pending).all()):
                raise ValueError(f"StreamingEngine.new_turn: pending must be finite float (T, input_dim="
                                 f"{self.input_dim}) frames, got {tuple(pending.shape)} {pending.dtype}")
            pending = [pending.detach().to("cpu", self.config.dtype)] if pending.shape[0] else []
            num_pending = sum(p.shape[0] for p in pending)
        else:
            pending, num_pending = s.pending, s.num_pending
        ended = s.ended
        outputs: dict = {}
        self._finish(s, "eos", outputs)  # clears pending, frees the caches
        result = self.results.pop(stream_id)
        greedy = GreedyCtcDecoder(self.model.config.vocab_size) if self.decoder == "greedy" else None
        fresh = self._streams[stream_id] = _Stream(stream_id, greedy, arrival_tick=self.tick)
        fresh.pending, fresh.num_pending, fresh.ended = pending, num_pending, ended
        self._waiting.append(stream_id)
        return result
