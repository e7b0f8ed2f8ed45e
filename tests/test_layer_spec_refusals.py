"""A composition's refusals name the user's specs and layers, never a band's internal values.

With ``prefill_kv_window=True`` and a ``FullAttention(-1)`` layer, a band's own config would say
"got num_left_chunks=-1" while the user's config says 2: the layout names the layer and its spec instead.
"""

from __future__ import annotations

import pytest

from oasr.cache.config import CacheConfig
from oasr.cache.layer_specs import CacheLayout, FullAttention, SlidingWindow
from oasr.fast.layered_cache import LayeredCache as FastLayered
from oasr.reference.layered_cache import LayeredCache as RefLayered


def _config(**overrides) -> CacheConfig:
    fields = dict(num_layers=2, n_kv_head=1, head_dim=8, hidden_dim=8, kernel_size=3, chunk_size=4,
                  block_size_frames=4, num_left_chunks=2, max_num_blocks=64, max_batch_size=2,
                  max_blocks_per_seq=16, prefill_kv_window=True)
    fields.update(overrides)
    return CacheConfig(**fields)


@pytest.mark.parametrize("specs,named", [
    ([FullAttention(2), FullAttention(-1)], "layer 1 is FullAttention(left_chunks=-1) (unlimited history)"),
    ([FullAttention(2), SlidingWindow(0)], "layer 1 is SlidingWindow(window_frames=0) (an empty window)"),
    ([FullAttention(0), FullAttention(2)], "layer 0 is FullAttention(left_chunks=0) (an empty window)"),
])
@pytest.mark.parametrize("build", [CacheLayout, RefLayered, FastLayered])
def test_prefill_refusal_names_the_layer_and_its_spec(build, specs, named):
    with pytest.raises(ValueError) as err:
        build(_config(), specs)
    message = str(err.value)
    assert named in message and "prefill_kv_window=True" in message
    assert "num_left_chunks=-1" not in message and "num_left_chunks=0" not in message  # internal band values


def test_a_band_refusal_names_its_layers_and_specs():
    """Any other refusal of a band's config is prefixed with the band's layers and the specs written."""
    with pytest.raises(ValueError, match=r"layers \[1\] \(FullAttention\(left_chunks=20\)\): .*max_blocks_per_seq"):
        CacheLayout(_config(prefill_kv_window=False), [FullAttention(2), FullAttention(20)])


def test_windows_of_one_frame_or_more_prefill():
    layout = CacheLayout(_config(), [FullAttention(2), SlidingWindow(3)])
    assert [band.config.prefill_frames for band in layout.bands] == [8, 3]
