"""``CnnCacheManager``: the conv left context as the one-spec slot state cache, for either twin.

The causal depthwise convolution keeps ``kernel_size - 1`` frames per layer and
stream. That is a fixed-extent state like any declared one, so this manager is
only a ``SlotStateCache`` holding one ``StreamStateSpec`` whose slot axis is 1,
which keeps the historical ``(num_layers, slots, frames, hidden)`` layout.
It touches its cache only through the public API, so one class serves both
twins: ``oasr.reference.CnnCacheManager`` and ``oasr.fast.CnnCacheManager``
bind ``state_cache_cls`` to their own ``SlotStateCache``.
"""

from __future__ import annotations

import torch

from oasr.cache.config import CacheConfig
from oasr.cache.state_spec import StreamStateSpec
from oasr.cache.validate import as_id_list


class CnnCacheManagerBase:
    """The causal depthwise conv's left context: the single-spec ``SlotStateCache``.

    Buffer ``(num_layers, max_batch_size + pad_lanes, kernel_size - 1, hidden_dim)``.
    ``get_cache(ids)`` returns ``(num_layers, B, kernel_size - 1, hidden_dim)``;
    ``update(ids, new)`` overwrites those rows in place (shape-checked).
    """

    SPEC_NAME = "cnn"
    state_cache_cls = None  # each twin's SlotStateCache

    def __init__(self, config: CacheConfig, pad_lanes: int = 0):
        self.config = config
        spec = StreamStateSpec(
            self.SPEC_NAME, (config.num_layers, config.cnn_cache_frames, config.hidden_dim), slot_axis=1
        )
        self.state = self.state_cache_cls(
            [spec], config.max_batch_size, pad_lanes, device=config.device, dtype=config.dtype
        )

    @property
    def buffer(self) -> torch.Tensor:
        """The conv-cache buffer, ``(num_layers, slots, kernel_size - 1, hidden_dim)``; rows are slots."""
        return self.state.buffer(self.SPEC_NAME)

    def allocate_stream(self, stream_id) -> int:
        """Give ``stream_id`` a zeroed slot and return it (``SlotsExhaustedError`` when none is free)."""
        return self.state.allocate_stream(stream_id)

    def free_stream(self, stream_id) -> None:
        """Release ``stream_id``'s slot (``KeyError`` for an unknown id)."""
        self.state.free_stream(stream_id)

    def reset_stream(self, stream_id) -> None:
        """Zero ``stream_id``'s conv state, keeping its slot (a new utterance on the same stream)."""
        self.state.reset_stream(stream_id)

    def has_stream(self, stream_id) -> bool:
        """Whether ``stream_id`` holds a slot."""
        return self.state.has_stream(stream_id)

    def slot_of(self, stream_id) -> int:
        """The slot row of ``stream_id`` (``KeyError`` for an unknown id)."""
        return self.state.slot_of(stream_id)

    def get_cache(self, stream_ids, pad_to: int | None = None) -> torch.Tensor:
        """The streams' conv caches gathered into one batch, padded with the padding lane to ``pad_to`` rows."""
        return self.state.view(self.SPEC_NAME, as_id_list(stream_ids), pad_to).gather()

    def update(self, stream_ids, new_cache: torch.Tensor, pad_to: int | None = None) -> None:
        """Write a batch of new conv caches (``get_cache``'s shape) back to the streams' slots."""
        self.state.view(self.SPEC_NAME, as_id_list(stream_ids), pad_to).scatter(new_cache)
