"""Reference ``SlotStateCache`` and ``CnnCacheManager``: fixed-extent per-stream state.

Readable oracle; fast twin: ``oasr.fast.slot_state``.

Each declared ``StreamStateSpec`` owns one persistent buffer of shape
``spec.buffer_shape(max_batch_size + pad_lanes)``. Stream slots come from a
``StreamSlotPool`` over ``[0, max_batch_size)``; padding-lane slots are the
``pad_lanes`` rows after that, reachable only through ``view(..., pad_to=)``.
Buffers keep their address for the cache's whole life (graphs capture them).

``view(name, stream_ids, pad_to=None)`` returns a ``StateView`` whose
``gather()`` reads the rows (slot axis kept in place, one row per stream, pad
rows last) and ``scatter(new)`` writes them back in place, shape-checked.
"""

from __future__ import annotations

import torch

from oasr.cache.cnn_cache import CnnCacheManagerBase
from oasr.cache.errors import duplicate_stream
from oasr.cache.state_spec import StreamStateSpec
from oasr.cache.validate import check_count
from oasr.reference.slot_pool import StreamSlotPool


class StateView:
    """Rows ``slots`` of one state buffer along its slot axis."""

    def __init__(self, buffer: torch.Tensor, spec: StreamStateSpec, slots: list[int]):
        self.buffer = buffer
        self.spec = spec
        self.slots = slots

    @property
    def shape(self) -> tuple:
        """The shape of the gathered batch: the spec's shape with ``len(slots)`` rows on its slot axis."""
        return self.spec.batch_shape(len(self.slots))

    def gather(self) -> torch.Tensor:
        """The rows' states as one batch (``RuntimeError`` for an empty cohort)."""
        if not self.slots:
            raise RuntimeError(f"state {self.spec.name!r}: gather of an empty cohort (no rows)")
        pieces = [self.buffer.select(self.spec.slot_axis, s) for s in self.slots]
        return torch.stack(pieces, dim=self.spec.slot_axis)

    def scatter(self, new: torch.Tensor) -> None:
        """Write a batch of ``shape`` back to the rows' slots (``ValueError`` for another shape)."""
        if tuple(new.shape) != self.shape:
            raise ValueError(
                f"state {self.spec.name!r}: expected shape {self.shape}, got {tuple(new.shape)}"
            )
        for row, s in enumerate(self.slots):
            self.buffer.select(self.spec.slot_axis, s).copy_(new.select(self.spec.slot_axis, row))


class SlotStateCache:
    def __init__(
        self,
        specs,
        max_batch_size: int,
        pad_lanes: int = 0,
        device="cpu",
        dtype: torch.dtype = torch.float32,
    ):
        specs = tuple(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"SlotStateCache: duplicate spec names in {names}")
        check_count("SlotStateCache", "pad_lanes", pad_lanes)
        self.specs = {s.name: s for s in specs}
        self.max_batch_size = max_batch_size
        self.pad_lanes = pad_lanes
        self.slots = StreamSlotPool(max_batch_size)
        num_rows = max_batch_size + pad_lanes
        self.buffers = {
            s.name: torch.zeros(s.buffer_shape(num_rows), dtype=s.dtype or dtype, device=device)
            for s in specs
        }

    # ---- lifecycle ----------------------------------------------------------
    def allocate_stream(self, stream_id) -> int:
        """Give ``stream_id`` a slot with every declared state zeroed; returns the slot."""
        if stream_id in self.slots:
            raise duplicate_stream(stream_id)
        slot = self.slots.acquire(stream_id)
        self._zero(slot, include_persistent=True)
        return slot

    def free_stream(self, stream_id) -> None:
        """Release ``stream_id``'s slot (``KeyError`` for an unknown id)."""
        self.slots.release(stream_id)

    def reset_stream(self, stream_id) -> None:
        """Zero every non-persistent state of the stream; persistent state survives."""
        self._zero(self.slot_of(stream_id), include_persistent=False)

    reset_slot = reset_stream

    def _zero(self, slot: int, include_persistent: bool) -> None:
        for name, spec in self.specs.items():
            if include_persistent or not spec.persistent:
                self.buffers[name].select(spec.slot_axis, slot).zero_()

    # ---- access -------------------------------------------------------------
    def slot_of(self, stream_id) -> int:
        """The slot of ``stream_id`` (``KeyError`` for an unknown id)."""
        return self.slots.slot_of(stream_id)

    def has_stream(self, stream_id) -> bool:
        """Whether ``stream_id`` holds a slot."""
        return stream_id in self.slots

    def buffer(self, name: str) -> torch.Tensor:
        """The persistent buffer of the state ``name`` (``KeyError`` naming the declared ones)."""
        if name not in self.buffers:
            raise KeyError(f"no state named {name!r}; declared: {sorted(self.buffers)}")
        return self.buffers[name]

    def rows(self, stream_ids, pad_to: int | None = None) -> list[int]:
        """Slots of ``stream_ids`` in order, then padding-lane slots up to ``pad_to`` rows."""
        slots = [self.slot_of(s) for s in stream_ids]
        if len(set(stream_ids)) != len(stream_ids):
            raise ValueError(f"duplicate stream ids in {list(stream_ids)}")
        if pad_to is not None and pad_to > len(slots):
            if self.pad_lanes == 0:
                raise ValueError(f"pad_to={pad_to} > {len(slots)} streams, but this cache has no padding lane")
            slots += [self.max_batch_size] * (pad_to - len(slots))
        elif pad_to is not None and pad_to < len(slots):
            raise ValueError(f"pad_to={pad_to} is smaller than the {len(slots)} streams given")
        return slots

    def view(self, name: str, stream_ids, pad_to: int | None = None) -> StateView:
        """A ``StateView`` of state ``name`` over ``stream_ids`` (padded to ``pad_to`` rows with the padding lane)."""
        buffer = self.buffer(name)
        return StateView(buffer, self.specs[name], self.rows(list(stream_ids), pad_to))

    def views(self, stream_ids, pad_to: int | None = None) -> dict:
        """One ``StateView`` per declared state, for a chunk forward's ``states`` argument."""
        return {name: self.view(name, stream_ids, pad_to) for name in self.specs}

    def fill_slot(self, stream_id, name: str, value) -> None:
        """Fill one stream's state ``name`` with a scalar (e.g. a persistent prompt id)."""
        spec = self.specs[name] if name in self.specs else None
        if spec is None:
            raise KeyError(f"no state named {name!r}; declared: {sorted(self.buffers)}")
        self.buffers[name].select(spec.slot_axis, self.slot_of(stream_id)).fill_(value)


class CnnCacheManager(CnnCacheManagerBase):
    """The conv left context over this twin's ``SlotStateCache`` (see ``oasr.cache.cnn_cache``)."""

    state_cache_cls = SlotStateCache


__all__ = ["CnnCacheManager", "SlotStateCache", "StateView", "StreamStateSpec"]
