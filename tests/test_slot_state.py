"""SlotStateCache / CnnCacheManager / StreamSlotPool conformance."""

import pytest
import torch

import oasr
from tests.conftest import small_config


def specs(twin):
    return [
        twin.StreamStateSpec("tail", (3, 5), slot_axis=0),
        twin.StreamStateSpec("conv", (2, 4, 6), slot_axis=1),
        twin.StreamStateSpec("prompt", (1,), slot_axis=0, dtype=torch.int64, persistent=True),
    ]


def test_slot_pool_lowest_first(twin):
    slots = twin.StreamSlotPool(3)
    assert [slots.acquire(s) for s in "abc"] == [0, 1, 2]
    with pytest.raises(oasr.SlotsExhaustedError, match="all 3 slots"):
        slots.acquire("d")
    assert slots.release("b") == 1
    assert slots.acquire("d") == 1
    with pytest.raises(ValueError, match="already allocated"):
        slots.acquire("a")
    with pytest.raises(KeyError):
        slots.release("zz")


def test_buffers_layout_and_zeroing(twin):
    cache = twin.SlotStateCache(specs(twin), max_batch_size=4, pad_lanes=1)
    assert cache.buffer("tail").shape == (5, 3, 5)
    assert cache.buffer("conv").shape == (2, 5, 4, 6)
    assert cache.buffer("prompt").dtype == torch.int64
    for buf in cache.buffers.values():
        buf.fill_(7)
    slot = cache.allocate_stream("s")
    assert cache.buffer("tail")[slot].eq(0).all() and cache.buffer("conv")[:, slot].eq(0).all()
    assert cache.buffer("prompt")[slot].eq(0).all()
    assert cache.buffer("tail")[slot + 1].eq(7).all()  # other slots untouched
    addresses = {n: b.data_ptr() for n, b in cache.buffers.items()}
    cache.fill_slot("s", "prompt", 3)
    cache.view("conv", ["s"]).scatter(torch.ones(2, 1, 4, 6))
    cache.reset_stream("s")
    assert cache.buffer("conv")[:, slot].eq(0).all()
    assert cache.buffer("prompt")[slot].eq(3).all()  # persistent survives reset
    assert addresses == {n: b.data_ptr() for n, b in cache.buffers.items()}


def test_views_gather_scatter_and_pad(twin):
    cache = twin.SlotStateCache(specs(twin), max_batch_size=4, pad_lanes=1)
    for s in (10, 11, 12):
        cache.allocate_stream(s)
    view = cache.view("conv", [12, 10], pad_to=4)
    assert view.shape == (2, 4, 4, 6)
    new = torch.randn(2, 4, 4, 6)
    view.scatter(new)
    buf = cache.buffer("conv")
    assert torch.equal(buf[:, cache.slot_of(12)], new[:, 0])
    assert torch.equal(buf[:, cache.slot_of(10)], new[:, 1])
    assert buf[:, cache.slot_of(11)].eq(0).all()
    got = cache.view("conv", [12, 10]).gather()
    assert torch.equal(got, new[:, :2])
    with pytest.raises(ValueError, match=r"expected shape \(2, 2, 4, 6\)"):
        cache.view("conv", [12, 10]).scatter(torch.zeros(2, 3, 4, 6))
    with pytest.raises(ValueError, match="no padding lane"):
        twin.SlotStateCache(specs(twin), max_batch_size=4).view("tail", [], pad_to=1)
    with pytest.raises(KeyError):
        cache.view("conv", [99])
    with pytest.raises(KeyError, match="no state named"):
        cache.view("nope", [10])
    assert set(cache.views([10])) == {"tail", "conv", "prompt"}


def test_cnn_cache_manager(twin):
    cfg = small_config()
    cnn = twin.CnnCacheManager(cfg, pad_lanes=1)
    assert cnn.buffer.shape == (cfg.num_layers, cfg.max_batch_size + 1, cfg.cnn_cache_frames, cfg.hidden_dim)
    cnn.allocate_stream("x")
    cnn.allocate_stream("y")
    assert cnn.get_cache("x").shape == (2, 1, 2, 16)
    new = torch.randn(2, 2, 2, 16)
    cnn.update(["y", "x"], new)
    assert torch.equal(cnn.get_cache(["x", "y"]), new[:, [1, 0]])
    with pytest.raises(ValueError, match=r"expected shape \(2, 1, 2, 16\), got \(2, 1, 3, 16\)"):
        cnn.update("x", torch.zeros(2, 1, 3, 16))
    with pytest.raises(ValueError, match="already allocated"):
        cnn.allocate_stream("x")
    cnn.free_stream("x")
    with pytest.raises(KeyError):
        cnn.get_cache("x")
    with pytest.raises(KeyError):
        cnn.update("x", torch.zeros(2, 1, 2, 16))
    cnn.allocate_stream("z")
    assert cnn.get_cache("z").eq(0).all()  # allocation zeroes a recycled slot
