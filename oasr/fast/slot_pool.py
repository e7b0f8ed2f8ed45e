"""Fast ``StreamSlotPool``: stream ids -> slots ``[0, capacity)`` with a numpy free mask.

Fast twin of ``oasr.reference.slot_pool.StreamSlotPool``: the lowest free slot
is handed out first, so both twins bind the same slots for the same op
sequence; padding-lane rows (past ``capacity``) are never handed out.

``slot_array(stream_ids)`` is the managers' hot path: a cohort's slots as one
int64 array from a single C-level pass over the id -> slot dict. ``epoch``
counts binds and releases, so a cache of device index tensors built from a
cohort's slots can tell when it went stale.
"""

from __future__ import annotations

import numpy as np

from oasr.cache.errors import SlotsExhaustedError, duplicate_stream, unknown_stream
from oasr.cache.validate import check_count


class StreamSlotPool:
    def __init__(self, capacity: int):
        check_count("StreamSlotPool", "capacity", capacity, minimum=1)
        self.capacity = capacity
        self._is_free = np.ones(capacity, dtype=bool)
        self._num_free = capacity
        self._slot_of: dict = {}
        self.epoch = 0

    def acquire(self, stream_id) -> int:
        """Give ``stream_id`` the lowest free slot and return it (``ValueError`` if it has one,
        ``SlotsExhaustedError``).
        """
        if stream_id in self._slot_of:
            raise duplicate_stream(stream_id)
        if not self._num_free:
            raise SlotsExhaustedError(self.capacity)
        slot = int(np.argmax(self._is_free))  # the lowest free slot
        self._is_free[slot] = False
        self._num_free -= 1
        self._slot_of[stream_id] = slot
        self.epoch += 1
        return slot

    def release(self, stream_id) -> int:
        """Free ``stream_id``'s slot and return it (``KeyError`` for an unknown id)."""
        if stream_id not in self._slot_of:
            raise unknown_stream(stream_id)
        slot = self._slot_of.pop(stream_id)
        self._is_free[slot] = True
        self._num_free += 1
        self.epoch += 1
        return slot

    def slot_of(self, stream_id) -> int:
        """The slot of ``stream_id`` (``KeyError`` for an unknown id)."""
        if stream_id not in self._slot_of:
            raise unknown_stream(stream_id)
        return self._slot_of[stream_id]

    def slot_array(self, stream_ids: list) -> np.ndarray:
        """Slots of ``stream_ids`` in order as int64; ``KeyError`` names the first unknown id."""
        try:
            return np.fromiter(map(self._slot_of.__getitem__, stream_ids), dtype=np.int64, count=len(stream_ids))
        except KeyError:
            for stream_id in stream_ids:
                if stream_id not in self._slot_of:
                    raise unknown_stream(stream_id) from None
            raise

    def __contains__(self, stream_id) -> bool:
        return stream_id in self._slot_of

    @property
    def num_free(self) -> int:
        """Slots not held by a stream."""
        return self._num_free

    @property
    def stream_ids(self) -> list:
        """Bound stream ids, in admission order."""
        return list(self._slot_of)
