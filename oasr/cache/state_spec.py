"""``StreamStateSpec``: a declaration of one fixed-extent per-stream state tensor.

A fixed-extent state (a convolution's left context, a subsampling stage's
tail, a recurrent state) never grows, so it needs no paging: it is one
persistent tensor with the stream's slot as one of its axes. An encoder
*declares* such states and reads them back by name; no new manager is written.

``shape`` is the per-stream shape; ``slot_axis`` is where the slot axis is
inserted in the buffer. ``dtype=None`` takes the cache's dtype.
``persistent=True`` marks state that describes the request rather than the
audio (e.g. a language-prompt id): ``reset_stream`` keeps it. Allocation
zeroes every spec of the slot, persistent or not: zero is the initial value
(a zero left context is exactly the padding an offline pass applies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StreamStateSpec:
    name: str
    shape: tuple
    slot_axis: int = 0
    dtype: torch.dtype | None = None
    persistent: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StreamStateSpec.name must be a non-empty str, got {self.name!r}")
        shape = tuple(int(s) for s in self.shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"StreamStateSpec {self.name!r}: negative size in shape {shape}")
        object.__setattr__(self, "shape", shape)
        if not 0 <= self.slot_axis <= len(shape):
            raise ValueError(
                f"StreamStateSpec {self.name!r}: slot_axis={self.slot_axis} outside [0, {len(shape)}]"
            )

    def buffer_shape(self, num_slots: int) -> tuple:
        """Shape of the persistent buffer holding ``num_slots`` slots."""
        s = list(self.shape)
        s.insert(self.slot_axis, num_slots)
        return tuple(s)

    def batch_shape(self, batch: int) -> tuple:
        """Shape of a gathered batch of ``batch`` rows (the slot axis becomes the batch axis)."""
        return self.buffer_shape(batch)
