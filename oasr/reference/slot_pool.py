"""Reference ``StreamSlotPool``: binds stream ids to slots ``[0, capacity)``.

A slot is a stream's row in every slot-indexed tensor (fixed-size state,
block-table rows). The lowest free slot is handed out first, so slots are
deterministic for a given op sequence. Padding-lane rows live *past*
``capacity`` and are never handed out: no stream can be bound to them.
Fast twin: ``oasr.fast.slot_pool.StreamSlotPool``.
"""

from __future__ import annotations

import heapq

from oasr.cache.errors import SlotsExhaustedError, duplicate_stream, unknown_stream
from oasr.cache.validate import check_count


class StreamSlotPool:
    def __init__(self, capacity: int):
        check_count("StreamSlotPool", "capacity", capacity, minimum=1)
        self.capacity = capacity
        self._free = list(range(capacity))  # a heap
        self._slot_of: dict = {}

    def acquire(self, stream_id) -> int:
        """Give ``stream_id`` the lowest free slot and return it (``ValueError`` if it has one,
        ``SlotsExhaustedError``).
        """
        if stream_id in self._slot_of:
            raise duplicate_stream(stream_id)
        if not self._free:
            raise SlotsExhaustedError(self.capacity)
        slot = heapq.heappop(self._free)
        self._slot_of[stream_id] = slot
        return slot

    def release(self, stream_id) -> int:
        """Free ``stream_id``'s slot and return it (``KeyError`` for an unknown id)."""
        if stream_id not in self._slot_of:
            raise unknown_stream(stream_id)
        slot = self._slot_of.pop(stream_id)
        heapq.heappush(self._free, slot)
        return slot

    def slot_of(self, stream_id) -> int:
        """The slot of ``stream_id`` (``KeyError`` for an unknown id)."""
        if stream_id not in self._slot_of:
            raise unknown_stream(stream_id)
        return self._slot_of[stream_id]

    def __contains__(self, stream_id) -> bool:
        return stream_id in self._slot_of

    @property
    def num_free(self) -> int:
        """Slots not held by a stream."""
        return len(self._free)

    @property
    def stream_ids(self) -> list:
        """Bound stream ids, in admission order."""
        return list(self._slot_of)
