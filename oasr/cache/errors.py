"""Errors shared by both twins.

Every failing call in oasr validates everything first and mutates nothing on
failure: an exception leaves pools, tables and slots exactly as they were.

===============================  =============================================
Condition                        Exception
===============================  =============================================
pool cannot serve an allocation  :class:`PoolExhaustedError` (a RuntimeError)
no free stream slot              :class:`SlotsExhaustedError` (a RuntimeError)
duplicate stream id              ``ValueError``
shape / dtype / id mismatch      ``ValueError``
chunk longer than prepared       ``ValueError``
freeing a block another owns     ``ValueError`` (names the owner)
unknown or freed stream id       ``KeyError``
paged view before first prepare  ``RuntimeError``
===============================  =============================================

Dtypes are refused, never cast: ``append_kv``'s K and V and ``paged_attention``'s
q must be in the view's served dtype (the pool's; for fp8 pages the model dtype,
``CacheConfig.dtype``). The checks live in ``oasr.cache.validate``.
"""

from __future__ import annotations


class PoolExhaustedError(RuntimeError):
    """The block pool holds fewer free blocks than a call asked for.

    ``requested`` and ``free`` carry the two numbers so a scheduler can decide
    to wait instead of parsing the message.
    """

    def __init__(self, requested: int, free: int, what: str = "blocks"):
        self.requested = int(requested)
        self.free = int(free)
        super().__init__(
            f"BlockPool exhausted: requested {self.requested} {what}, only {self.free} free"
        )


class SlotsExhaustedError(RuntimeError):
    """Every stream slot (``max_batch_size`` of them) is bound to a stream."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        super().__init__(
            f"no free stream slot: all {self.capacity} slots (max_batch_size) are in use"
        )


def unknown_stream(stream_id) -> KeyError:
    """The ``KeyError`` for a stream id that was never allocated or is already freed."""
    return KeyError(f"unknown stream id {stream_id!r} (never allocated, or already freed)")


def duplicate_stream(stream_id) -> ValueError:
    """The ``ValueError`` for allocating a stream id that is already allocated."""
    return ValueError(f"stream id {stream_id!r} is already allocated")


class StreamCapacityError(RuntimeError):
    """A stream asked for more blocks than its ceiling (``blocks_per_stream``).

    With eviction off this is the stream-length ceiling (``max_stream_frames``);
    ``AttentionCacheManager.at_capacity`` is the check that never raises.
    With eviction on it can only happen when a stream commits a short chunk
    and then goes on (only a stream's last chunk may be short).
    """

    def __init__(self, stream_id, needed: int, ceiling: int):
        self.stream_id = stream_id
        self.needed = int(needed)
        self.ceiling = int(ceiling)
        super().__init__(
            f"stream {stream_id!r} needs {self.needed} blocks for this chunk, its ceiling is "
            f"{self.ceiling} (CacheConfig.blocks_per_stream); check at_capacity() first"
        )
