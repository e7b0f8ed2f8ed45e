"""``CtcStateCacheManager``: one shared CTC decoder and a pool of per-stream decoder states.

The manager is pure bookkeeping. It never looks inside a state; it only calls
the decoder's ``create_state`` and ``reset_state``. That makes it twin-neutral:
``oasr.fast.ctc_state`` hands out this same class, driving the fast decoder
(whose states are preallocated tensors) instead of the reference one (whose
states are Python lists).

Lifecycle of a state::

    allocate_stream(sid)   pool non-empty?  state = pool.pop(); decoder.reset_state(state, ...)
                           otherwise        state = decoder.create_state(...); num_created += 1
                           active[sid] = state
    get_decoder(sid)       StreamHandle(decoder, state): the decoder's API without the state argument
    free_stream(sid)       pool.append(active.pop(sid))   (buffers are kept, not released)

Invariants:

* every state is either active under exactly one stream id or in the pool;
  ``num_created == len(active) + num_pooled``;
* the pool is LIFO: the most recently freed state is reused first;
* a reused state decodes exactly as a fresh one (``reset_state`` overwrites
  everything a previous stream left behind);
* a handle is bound to one allocation: after ``free_stream(sid)`` it raises
  ``KeyError``, even if ``sid`` is allocated again later.

Errors: allocating an active id raises ``ValueError``; an unknown (never
allocated, or freed) id raises ``KeyError``; bad ``batch`` / ``vocab_size``
raise ``ValueError``. Every check runs before anything changes. Not
thread-safe: one scheduler thread owns a manager.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from oasr.cache.errors import duplicate_stream, unknown_stream
from oasr.ctc.config import CtcDecoderConfig, check_snapshot, check_state_shape


class StreamHandle:
    """A (decoder, state) pair that reads like a stand-alone decoder of one stream.

    ``decode_chunk(log_probs)``, ``step(log_probs_frame)``, ``peek()`` and
    ``finalize_stream()`` forward to the shared decoder with this stream's
    state; ``config`` is the decoder's config. ``StreamHandle(decoder, state)``
    works on its own; the handles :meth:`CtcStateCacheManager.get_decoder`
    makes also carry a liveness check and raise ``KeyError`` once their stream
    has been freed (the state may already serve another stream by then).
    """

    def __init__(self, decoder, state, stream_id: Hashable = None, is_live: Callable[[], bool] | None = None):
        self.decoder = decoder
        self.stream_id = stream_id
        self._state = state
        self._is_live = is_live

    @property
    def config(self) -> CtcDecoderConfig:
        """The decoder's ``CtcDecoderConfig``."""
        return self.decoder.config

    @property
    def state(self):
        """This stream's decoder state (raises ``KeyError`` once a managed stream is freed)."""
        if self._is_live is not None and not self._is_live():
            raise KeyError(f"stale StreamHandle: stream id {self.stream_id!r} was freed after this handle was made")
        return self._state

    def decode_chunk(self, log_probs):
        """Decode one chunk of log-probs ``(T, V)`` into this stream's beam state."""
        return self.decoder.decode_chunk(self.state, log_probs)

    def step(self, log_probs_frame):
        """Decode one frame of log-probs ``(V,)`` into this stream's beam state."""
        return self.decoder.step(self.state, log_probs_frame)

    def peek(self):
        """The current best hypothesis, without finishing the stream."""
        return self.decoder.peek(self.state)

    def finalize_stream(self):
        """Finish the stream and return its n-best."""
        return self.decoder.finalize_stream(self.state)

    def __repr__(self) -> str:
        return f"StreamHandle(stream_id={self.stream_id!r}, decoder={type(self.decoder).__module__})"


class CtcStateCacheManager:
    """Pools decoder states across streams; see the module docstring for the lifecycle."""

    def __init__(self, decoder):
        for name in ("config", "create_state", "reset_state", "decode_chunk", "finalize_stream"):
            if not hasattr(decoder, name):
                raise TypeError(f"CtcStateCacheManager: decoder has no {name!r}; got {type(decoder).__name__}")
        self.decoder = decoder
        self._active: dict[Hashable, tuple[object, int]] = {}  # sid -> (state, lease)
        self._pool: list[object] = []
        self._next_lease = 0
        self.num_created = 0

    # ---- checks (never mutate) ----------------------------------------------
    def has_stream(self, stream_id: Hashable) -> bool:
        """Whether ``stream_id`` holds a beam state."""
        return stream_id in self._active

    @property
    def num_pooled(self) -> int:
        """States waiting in the pool for the next stream."""
        return len(self._pool)

    @property
    def num_active(self) -> int:
        """Streams holding a beam state."""
        return len(self._active)

    @property
    def active_stream_ids(self) -> list:
        """The ids of the streams holding a beam state."""
        return list(self._active)

    # ---- actions ----------------------------------------------------------------
    def allocate_stream(self, stream_id: Hashable, batch: int, vocab_size: int) -> StreamHandle:
        """Bind a fresh-decoding state of ``batch`` rows to ``stream_id``; return its handle."""
        if stream_id in self._active:
            raise duplicate_stream(stream_id)
        check_state_shape("allocate_stream", self.decoder.config, batch, vocab_size)
        if self._pool:
            state = self._pool[-1]
            self.decoder.reset_state(state, batch, vocab_size)
            self._pool.pop()
        else:
            state = self.decoder.create_state(batch, vocab_size)
            self.num_created += 1
        self._active[stream_id] = (state, self._next_lease)
        self._next_lease += 1
        return self.get_decoder(stream_id)

    def restore_stream(self, stream_id: Hashable, snapshot) -> StreamHandle:
        """Bind a state that decodes exactly as ``snapshot`` (a ``BeamSnapshot``, either twin's) to ``stream_id``.

        The snapshot is validated before a state is taken from the pool, so an error changes nothing.
        """
        if stream_id in self._active:
            raise duplicate_stream(stream_id)
        check_snapshot("restore_stream", self.decoder.config, snapshot)
        if self._pool:
            state = self._pool.pop()
        else:
            state = self.decoder.create_state(snapshot.batch, snapshot.vocab_size)
            self.num_created += 1
        self.decoder.restore_state(state, snapshot)
        self._active[stream_id] = (state, self._next_lease)
        self._next_lease += 1
        return self.get_decoder(stream_id)

    def snapshot_stream(self, stream_id: Hashable):
        """The stream's decoder state as a twin-neutral ``BeamSnapshot`` (changes nothing)."""
        if stream_id not in self._active:
            raise unknown_stream(stream_id)
        return self.decoder.snapshot_state(self._active[stream_id][0])

    def free_stream(self, stream_id: Hashable) -> None:
        """Return the stream's state to the pool; its buffers stay allocated for the next stream."""
        if stream_id not in self._active:
            raise unknown_stream(stream_id)
        state, _ = self._active.pop(stream_id)
        self._pool.append(state)

    def get_decoder(self, stream_id: Hashable) -> StreamHandle:
        """The stream's :class:`StreamHandle` (a new handle object on every call, same binding)."""
        if stream_id not in self._active:
            raise unknown_stream(stream_id)
        state, lease = self._active[stream_id]
        return StreamHandle(self.decoder, state, stream_id, lambda: self._lease_of(stream_id) == lease)

    def get_state(self, stream_id: Hashable):
        """The stream's raw decoder state, for callers that batch several streams themselves."""
        if stream_id not in self._active:
            raise unknown_stream(stream_id)
        return self._active[stream_id][0]

    def peek_cohort(self, stream_ids: list) -> list:
        """Each stream's ``peek`` (its rows' best partial hypotheses), in one decoder call (``peek_states``);
        ``KeyError`` for an unknown id, checked before anything is read."""
        for stream_id in stream_ids:
            if stream_id not in self._active:
                raise unknown_stream(stream_id)
        return self.decoder.peek_states([self._active[sid][0] for sid in stream_ids])

    def decode_cohort(self, stream_ids: list, log_probs_list: list) -> None:
        """Decode one chunk for each of several streams in one decoder call (``decode_chunks``).

        The chunks may differ in length (a stream's last chunk is often short):
        each stream advances by its own chunk's frames. All ids are checked
        first (``KeyError``); the decoder then validates the chunks and commits
        all streams or none.
        """
        for stream_id in stream_ids:
            if stream_id not in self._active:
                raise unknown_stream(stream_id)
        states = [self._active[sid][0] for sid in stream_ids]
        self.decoder.decode_chunks(states, log_probs_list)

    def _lease_of(self, stream_id: Hashable) -> int | None:
        entry = self._active.get(stream_id)
        return None if entry is None else entry[1]
