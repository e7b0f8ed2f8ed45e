"""Fast ``SlotStateCache`` and ``CnnCacheManager``: fixed-extent state, one index op per access.

Fast twin of ``oasr.reference.slot_state``: same buffers (one persistent tensor
per ``StreamStateSpec``, shape ``spec.buffer_shape(max_batch_size + pad_lanes)``,
fixed address for the cache's life), same methods, same errors.

Where the reference stacks and copies one row at a time, a fast ``StateView``
holds the cohort's slots as a device index tensor: ``gather()`` is one
``index_select`` along the slot axis and ``scatter(new)`` one ``index_copy_``.
Padding rows all name the first padding lane; the reference lets the last of
them win, so a padded scatter writes the stream rows with ``index_copy_`` and
the padding lane from the last row (a duplicate index would leave the winner
to the device's whim).

Index tensors are built once per distinct row list (slots plus padding) and
kept in a small LRU keyed by that tuple, so a steady cohort reuses the same
tensor tick after tick; a new row list costs one staged copy and one device
tensor.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from oasr.cache.cnn_cache import CnnCacheManagerBase
from oasr.cache.errors import duplicate_stream
from oasr.cache.state_spec import StreamStateSpec
from oasr.cache.validate import check_count, same_device
from oasr.fast.slot_pool import StreamSlotPool
from oasr.fast.staging import Stager

_INDEX_CACHE_SIZE = 64


class StateView:
    """Rows ``slots`` of one state buffer along its slot axis.

    ``num_streams`` is how many leading rows are distinct stream slots; the
    rest are padding rows (all the same lane). ``index`` is ``slots`` on the
    buffer's device; both are built from ``slots`` when not given.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        spec: StreamStateSpec,
        slots: list[int],
        index: torch.Tensor | None = None,
        num_streams: int | None = None,
    ):
        self.buffer = buffer
        self.spec = spec
        self.slots = slots
        self.index = torch.tensor(slots, dtype=torch.int64, device=buffer.device) if index is None else index
        if num_streams is None and len(set(slots)) == len(slots):
            num_streams = len(slots)
        self.num_streams = num_streams  # None: arbitrary repeats, scattered row by row as the reference does

    @property
    def shape(self) -> tuple:
        """The shape of the gathered batch: the spec's shape with ``len(slots)`` rows on its slot axis."""
        return self.spec.batch_shape(len(self.slots))

    def gather(self) -> torch.Tensor:
        """The rows' states as one batch (``RuntimeError`` for an empty cohort)."""
        if not self.slots:  # the reference's torch.stack of no rows raises RuntimeError; say why in words
            raise RuntimeError(f"state {self.spec.name!r}: gather of an empty cohort (no rows)")
        return self.buffer.index_select(self.spec.slot_axis, self.index)

    def scatter(self, new: torch.Tensor) -> None:
        """Write a batch of ``shape`` back to the rows' slots (``ValueError`` for another shape)."""
        if tuple(new.shape) != self.shape:
            raise ValueError(
                f"state {self.spec.name!r}: expected shape {self.shape}, got {tuple(new.shape)}"
            )
        axis, buffer = self.spec.slot_axis, self.buffer
        if new.dtype != buffer.dtype or not same_device(new.device, buffer.device):
            new = new.to(device=buffer.device, dtype=buffer.dtype)
        B, width = self.num_streams, len(self.slots)
        if B is None:
            for row, s in enumerate(self.slots):
                buffer.select(axis, s).copy_(new.select(axis, row))
            return
        if B == width:
            buffer.index_copy_(axis, self.index, new)
            return
        if B:
            buffer.index_copy_(axis, self.index[:B], new.narrow(axis, 0, B))
        buffer.select(axis, self.slots[-1]).copy_(new.select(axis, width - 1))


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
        self.device = torch.device(device)
        self._stager = None  # built on the first index-cache miss
        self._index_cache: OrderedDict = OrderedDict()

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

    def _rows(self, stream_ids: list, pad_to: int | None) -> tuple[list[int], int]:
        """``rows`` and how many of them are streams."""
        slots = self.slots.slot_array(stream_ids).tolist()
        if len(set(stream_ids)) != len(stream_ids):
            raise ValueError(f"duplicate stream ids in {list(stream_ids)}")
        if pad_to is not None and pad_to > len(slots):
            if self.pad_lanes == 0:
                raise ValueError(f"pad_to={pad_to} > {len(slots)} streams, but this cache has no padding lane")
            return slots + [self.max_batch_size] * (pad_to - len(slots)), len(slots)
        if pad_to is not None and pad_to < len(slots):
            raise ValueError(f"pad_to={pad_to} is smaller than the {len(slots)} streams given")
        return slots, len(slots)

    def rows(self, stream_ids, pad_to: int | None = None) -> list[int]:
        """Slots of ``stream_ids`` in order, then padding-lane slots up to ``pad_to`` rows."""
        return self._rows(list(stream_ids), pad_to)[0]

    def _index(self, rows: list[int]) -> torch.Tensor:
        """The device index tensor of ``rows`` (cached; a miss costs one staged copy and one tensor)."""
        key = tuple(rows)
        index = self._index_cache.get(key)
        if index is not None:
            self._index_cache.move_to_end(key)
            return index
        if self._stager is None:
            self._stager = Stager([(self.max_batch_size + self.pad_lanes, torch.int64)], self.device)
        if len(rows) <= self.max_batch_size + self.pad_lanes:
            (staged,) = self._stager.stage(np.asarray(rows, dtype=np.int64))
            index = staged.clone()
        else:  # wider than every slot (long padding): rare, built directly
            index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._index_cache[key] = index
        if len(self._index_cache) > _INDEX_CACHE_SIZE:
            self._index_cache.popitem(last=False)
        return index

    def view(self, name: str, stream_ids, pad_to: int | None = None) -> StateView:
        """A ``StateView`` of state ``name`` over ``stream_ids`` (padded to ``pad_to`` rows with the padding lane)."""
        buffer = self.buffer(name)
        rows, num_streams = self._rows(list(stream_ids), pad_to)
        return StateView(buffer, self.specs[name], rows, self._index(rows), num_streams)

    def views(self, stream_ids, pad_to: int | None = None) -> dict:
        """One ``StateView`` per declared state, for a chunk forward's ``states`` argument."""
        rows, num_streams = self._rows(list(stream_ids), pad_to)
        index = self._index(rows)
        return {
            name: StateView(self.buffers[name], spec, rows, index, num_streams) for name, spec in self.specs.items()
        }

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
