"""The streaming engine's admission: which waiting streams get a slot, and their caches.

Part of ``oasr.engine.streaming.engine.StreamingEngine`` (its contract and state are drawn there).
Admission (step 1 of a tick): the blocks a new stream may still claim, the order waiting streams are
considered in (``admission``, ``max_wait_time``), and each admitted stream's caches, fresh or restored
from a resumed stream's session.
"""

from __future__ import annotations

from oasr.cache.stream_context import StreamContext
from oasr.engine.streaming.records import (
    ACTIVE,
    _Stream,
)
from oasr.sessions.stream import restore_stream


class AdmissionMixin:
    """A part of ``StreamingEngine``: its admission; no state of its own."""

    def can_admit(self) -> bool:
        """A free slot, and free blocks for every active stream's remaining worst case plus one more."""
        if len(self._active) >= self.config.max_batch_size:
            return False
        if self.pool is None:  # fixed-extent state: a slot is all a stream needs
            return True
        per_stream = self.backend.blocks_per_stream  # every band's ceiling with per-layer windows
        held = self.backend.blocks_held_by(self._active)
        still_claimable = len(self._active) * per_stream - held
        return self.pool.num_free_blocks - still_claimable >= per_stream

    def _ready(self, s: _Stream) -> bool:
        return s.num_pending >= self.chunk_input_frames or s.ended

    def admission_order(self) -> list:
        """Waiting stream ids in the order the next admission considers them (see ``admission``).

        Resumed streams (still carrying their session) come first, in the order they were resumed.
        Then, ``"length"``: streams that have waited ``max_wait_time`` ticks or more (``tick -
        arrival_tick``, counted at the tick that admits), oldest first; then the rest by buffered
        feature frames, fewest first, ties in arrival order. ``"arrival"``: arrival order.
        """
        resumed = [sid for sid in self._waiting if self._streams[sid].session is not None]
        waiting = [sid for sid in self._waiting if self._streams[sid].session is None]
        if self.admission == "arrival":
            return resumed + waiting
        now = self.tick
        overdue = [sid for sid in waiting if now - self._streams[sid].arrival_tick >= self.max_wait_time]
        late = set(overdue)
        rest = sorted((sid for sid in waiting if sid not in late), key=lambda sid: self._streams[sid].num_pending)
        return resumed + overdue + rest

    # ---- the tick ------------------------------------------------------------------------
    def _admit(self) -> None:
        for sid in self.admission_order():
            s = self._streams[sid]
            if not self._ready(s) and s.session is None:
                continue  # nothing to encode yet: do not hold a slot for it (a resumed stream held one)
            if not self.can_admit():
                break  # every stream reserves the same worst case: if this one does not fit, none does
            self._contexts[sid] = self._allocate_caches(sid, s)
            self._waiting.remove(sid)
            self._active.append(sid)
            s.state = ACTIVE
            s.admitted_tick = self.tick

    def _allocate_caches(self, sid, s: _Stream) -> StreamContext:
        """Admit ``sid`` in every cache: fresh, or carrying a resumed stream's state."""
        if s.session is not None:
            restore_stream(s.session, sid, self.att, [self.cnn, self.states], self.ctc)
            s.session = None
            return StreamContext(sid, self.att, self.cnn, self.ctc)
        ctx = StreamContext.allocate(sid, self.att, self.cnn, self.ctc, vocab_size=self.model.config.vocab_size)
        try:
            self.states.allocate_stream(sid)
        except Exception:
            ctx.free()
            raise
        return ctx
