"""Layer specs composed over one pool: the uniform special case, per-band eviction, twin agreement, footprint."""

from __future__ import annotations

import math
import random

import pytest
import torch

from oasr import fast, reference
from oasr.cache.config import CacheConfig
from oasr.cache.errors import PoolExhaustedError, SlotsExhaustedError, StreamCapacityError
from oasr.cache.layer_specs import (
    CacheLayout,
    FixedState,
    FullAttention,
    SlidingWindow,
    conv_state_spec,
    layout_for_budget,
    uniform_specs,
)
from oasr.cache.memory import footprint

TWINS = [reference, fast]


def _config(**kw):
    base = dict(num_layers=4, n_kv_head=2, head_dim=8, hidden_dim=16, kernel_size=3, chunk_size=4,
                block_size_frames=4, max_num_blocks=200, max_batch_size=4, max_blocks_per_seq=32)
    base.update(kw)
    return CacheConfig(**base)


MIXED = [SlidingWindow(6), FullAttention(3), SlidingWindow(6), FullAttention(3)]


def _simulate_max_blocks(W, chunk, bs, prefill, chunks=40):
    """Brute force: the most blocks a stream holds while a chunk is in flight, window W frames."""
    seqlen = W if prefill else 0
    most = 0
    for _ in range(chunks):
        start = max(0, seqlen - W)
        first_block = start // bs
        most = max(most, math.ceil((seqlen + chunk) / bs) - first_block)
        seqlen += chunk
    return most


@pytest.mark.parametrize("W", [0, 1, 3, 5, 6, 7, 8, 13, 16])
@pytest.mark.parametrize("chunk,bs", [(4, 4), (4, 8), (6, 4), (3, 5), (8, 4)])
@pytest.mark.parametrize("prefill", [False, True])
def test_window_frames_max_logical_blocks_is_exact(W, chunk, bs, prefill):
    if prefill and W == 0:
        pytest.skip("prefill needs a window")
    cfg = CacheConfig(num_layers=1, chunk_size=chunk, block_size_frames=bs, window_frames=W, max_num_blocks=4096,
                      max_batch_size=1, prefill_kv_window=prefill)
    assert cfg.max_logical_blocks == _simulate_max_blocks(W, chunk, bs, prefill)


def test_window_frames_refuses_two_windows():
    with pytest.raises(ValueError, match="give the window once"):
        _config(window_frames=5, num_left_chunks=1)
    with pytest.raises(ValueError, match="window_frames must be"):
        _config(window_frames=-2)


def test_layout_groups_bands_and_unit():
    layout = CacheLayout(_config(), MIXED)
    assert layout.unit == 2
    assert [b.layers for b in layout.bands] == [(0, 2), (1, 3)]
    assert [b.window for b in layout.bands] == [6, 12]
    # the 12-frame window is chunk aligned: it is stored as num_left_chunks
    assert layout.bands[1].config.num_left_chunks == 3 and layout.bands[1].config.window_frames is None
    assert layout.bands[0].config.window_frames == 6
    specs3 = [SlidingWindow(4), FullAttention(-1), FullAttention(-1), SlidingWindow(4), FullAttention(-1),
              FullAttention(-1)]
    lay3 = CacheLayout(_config(num_layers=6), specs3)
    assert lay3.unit == 2 and [b.layers for b in lay3.bands] == [(0, 3), (1, 2), (4, 5)]


def test_uniform_layout_is_the_config_itself():
    cfg = _config(num_left_chunks=2)
    layout = CacheLayout(cfg)
    assert layout.uniform and layout.unit == cfg.num_layers and layout.bands[0].config is cfg
    with_conv = CacheLayout(cfg, uniform_specs(cfg, (conv_state_spec(cfg),)))
    for pad_lanes in (0, 1):
        assert with_conv.footprint(pad_lanes=pad_lanes) == footprint(cfg, pad_lanes=pad_lanes)


def test_bad_specs_refused():
    cfg = _config()
    with pytest.raises(ValueError, match="attention specs for num_layers"):
        CacheLayout(cfg, MIXED[:3])
    with pytest.raises(ValueError, match="expected FullAttention"):
        CacheLayout(cfg, MIXED + ["conv"])
    with pytest.raises(ValueError, match="names repeat"):
        CacheLayout(cfg, MIXED + [FixedState("a", (2,)), FixedState("a", (3,))])
    with pytest.raises(ValueError, match="too small"):
        CacheLayout(_config(max_num_blocks=8), MIXED)
    with pytest.raises(ValueError, match="left_chunks"):
        FullAttention(-2)
    with pytest.raises(ValueError, match="window_frames"):
        SlidingWindow(-1)


def _drive(twin, cfg, specs, seed, steps=120):
    """A random op sequence; returns the per-step block lists of every stream in every band."""
    rng = random.Random(seed)
    cache = twin.LayeredCache(cfg, specs, pad_lanes=1)
    history = []
    next_id = 0
    live = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.15 and len(live) < cfg.max_batch_size:
            cache.allocate_stream(next_id)
            live.append(next_id)
            next_id += 1
        elif op < 0.22 and live:
            sid = live.pop(rng.randrange(len(live)))
            cache.free_stream(sid)
        elif live:
            cohort = rng.sample(live, rng.randint(1, len(live)))
            frames = [cfg.chunk_size] * len(cohort)
            cache.prepare_chunks_batched(cohort, frames)
            cache.get_paged_caches(cohort, pad_to=len(cohort) + 1)
            cache.commit_chunks_batched(cohort, frames)
        history.append({sid: [tuple(i.blocks) for i in cache.describe(sid)] for sid in live})
    return cache, history


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_twins_hand_out_the_same_blocks(seed):
    cfg = _config()
    _, ref = _drive(reference, cfg, MIXED, seed)
    _, fst = _drive(fast, cfg, MIXED, seed)
    assert ref == fst


@pytest.mark.parametrize("twin", TWINS, ids=["reference", "fast"])
@pytest.mark.parametrize("seed", [0, 3])
def test_uniform_composition_is_the_plain_manager(twin, seed):
    """The uniform special case: the same blocks in the same columns as AttentionCacheManager over BlockPool."""
    cfg = _config(num_left_chunks=2)
    cache, hist = _drive(twin, cfg, None, seed)
    rng = random.Random(seed)
    pool = twin.BlockPool(cfg, scratch_blocks=1)
    att = twin.AttentionCacheManager(pool, cfg, pad_lanes=1)
    next_id, live, plain = 0, [], []
    for _ in range(120):
        op = rng.random()
        if op < 0.15 and len(live) < cfg.max_batch_size:
            att.allocate_stream(next_id)
            live.append(next_id)
            next_id += 1
        elif op < 0.22 and live:
            att.free_stream(live.pop(rng.randrange(len(live))))
        elif live:
            cohort = rng.sample(live, rng.randint(1, len(live)))
            frames = [cfg.chunk_size] * len(cohort)
            att.prepare_chunks_batched(cohort, frames)
            att.get_paged_caches(cohort, pad_to=len(cohort) + 1)
            att.commit_chunks_batched(cohort, frames)
        plain.append({sid: [tuple(att.describe(sid).blocks)] for sid in live})
    assert hist == plain
    assert cache.pool.k_pool.shape == pool.k_pool.shape


@pytest.mark.parametrize("twin", TWINS, ids=["reference", "fast"])
@pytest.mark.parametrize("chunk,bs", [(4, 4), (4, 2), (6, 4)])
def test_each_band_evicts_by_its_own_window(twin, chunk, bs):
    cfg = _config(chunk_size=chunk, block_size_frames=bs, max_blocks_per_seq=64, max_num_blocks=400)
    cache = twin.LayeredCache(cfg, MIXED)
    windows = [b.window for b in cache.layout.bands]
    cache.allocate_stream("s")
    most = [0] * len(cache.bands)
    for k in range(1, 16):
        cache.prepare_chunk("s", chunk)
        most = [max(m, h) for m, h in zip(most, cache.blocks_held("s"), strict=True)]
        cache.commit_chunk_paged("s", chunk)
        for W, info in zip(windows, cache.describe("s"), strict=True):
            assert info.cache_seqlen - info.cache_seqstart == min(k * chunk, W)
            assert len(info.blocks) == math.ceil(info.cache_seqlen / bs)
            assert info.cache_seqstart < bs  # every block wholly before the window is gone
        assert cache.cached_frames("s") == [min(k * chunk, windows[cache.layout.band_of_layer[i][0]])
                                            for i in range(4)]
    # the worst case the arithmetic promises is reached, never passed
    assert most == cache.layout.blocks_per_stream()


@pytest.mark.parametrize("twin", TWINS, ids=["reference", "fast"])
def test_refusals_change_nothing(twin):
    cfg = _config(max_num_blocks=4 * 7, max_batch_size=4)  # exactly the bounded bands' worst case
    cache = twin.LayeredCache(cfg, MIXED, pad_lanes=1)
    for sid in range(4):
        cache.allocate_stream(sid)
    with pytest.raises(SlotsExhaustedError):
        cache.allocate_stream(9)
    with pytest.raises(ValueError, match="already"):
        cache.allocate_stream(0)
    cache.prepare_chunk(0)
    before = [cache.describe(s) for s in range(4)], cache.pool.num_free_blocks
    with pytest.raises(ValueError, match="frames prepared"):
        cache.commit_chunks_batched([0, 1], [4, 4])  # stream 1 prepared nothing
    with pytest.raises(ValueError, match="num_frames"):
        cache.prepare_chunks_batched([1], [99])
    with pytest.raises(KeyError):
        cache.prepare_chunk("nobody")
    assert ([cache.describe(s) for s in range(4)], cache.pool.num_free_blocks) == before


@pytest.mark.parametrize("twin", TWINS, ids=["reference", "fast"])
def test_pool_exhaustion_is_atomic(twin):
    cfg = _config(max_num_blocks=300)
    specs = [FullAttention(-1), SlidingWindow(6), FullAttention(-1), SlidingWindow(6)]
    cache = twin.LayeredCache(cfg, specs)
    cap = cache.layout.bands[0].config.blocks_per_stream
    cache.allocate_stream("a")
    for _ in range(cap):
        cache.prepare_chunk("a")
        cache.commit_chunk_paged("a", 4)
    assert cache.at_capacity("a")
    before = cache.describe("a"), cache.pool.num_free_blocks
    with pytest.raises(StreamCapacityError):
        cache.prepare_chunk("a")
    assert (cache.describe("a"), cache.pool.num_free_blocks) == before
    # drain the pool behind the cache's back, then ask for a chunk: refused whole
    other = cache.pool.new_owner("test")
    cache.allocate_stream("b")
    cache.pool.allocate(cache.pool.num_free_blocks - 1, other)
    before = cache.describe("b"), cache.pool.num_free_blocks
    with pytest.raises(PoolExhaustedError):
        cache.prepare_chunk("b")  # needs one block in each of the two bands
    assert (cache.describe("b"), cache.pool.num_free_blocks) == before


def test_footprint_matches_allocations():
    cfg = _config(max_num_blocks=120)
    states = [FixedState("cnn", (4, 2, 16), slot_axis=1), FixedState("rnn", (16,))]
    cache = fast.LayeredCache(cfg, MIXED + states, pad_lanes=1, scratch_blocks=1)
    fp = cache.layout.footprint(scratch_blocks=1, pad_lanes=1)
    pool_bytes = sum(t.numel() * t.element_size() for t in (cache.pool.k_pool, cache.pool.v_pool))
    assert pool_bytes == fp.kv_pool + fp.scratch
    assert sum(b.block_table.numel() * 4 for b in cache.bands) == fp.block_tables
    assert sum(cache.state.buffer(s.name).numel() * 4 for s in states) == fp.conv_cache
    # memory per stream follows the windows: a local band holds fewer blocks than a wide one
    local, wide = cache.layout.blocks_per_stream()
    assert local < wide
    assert cache.layout.bytes_per_stream() == (local + wide) * cache.layout.bytes_per_block + (4 * 2 * 16 + 16) * 4


def test_layout_for_budget():
    cfg = _config()
    budget = 1 << 20
    layout = layout_for_budget(cfg, MIXED, budget)
    assert layout.bytes_per_block * (layout.config.max_num_blocks + 1) <= budget
    assert layout.bytes_per_block * (layout.config.max_num_blocks + 2) > budget
    per = 2 * 2 * 4 * 2 * 8 * torch.tensor([], dtype=torch.float32).element_size()  # 2 x unit x bs x H x D x 4
    assert layout.bytes_per_block == per


def test_sessions_refuse_a_frame_window():
    from oasr.sessions.format import SessionError, SessionGeometry

    with pytest.raises(SessionError, match="window_frames=6"):
        SessionGeometry.of(_config(window_frames=6))
    assert SessionGeometry.of(_config(num_left_chunks=2)).num_left_chunks == 2
