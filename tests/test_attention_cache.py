"""AttentionCacheManager conformance: scenarios with exact ids, eviction, padding, prefill, errors."""

import pytest
import torch

import oasr
from tests.conftest import assert_same_snapshot, small_config, snapshot


def build(twin, pad_lanes=0, **overrides):
    cfg = small_config(**overrides)
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg, pad_lanes=pad_lanes)
    return cfg, pool, att


def table_row(att, sid):
    return att.get_paged_state_views(sid)[0][0].tolist()


# ---- scenario: exact block ids and free-list order ---------------------------------------
def test_two_streams_exact_ids(twin):
    cfg, pool, att = build(twin)  # chunk 4, block 4, W = 8 -> 3 blocks at most per stream
    null = pool.null_block
    att.allocate_stream("a")
    att.allocate_stream("b")
    assert att.slot_of("a") == 0 and att.slot_of("b") == 1
    att.prepare_chunks_batched(["a", "b"])
    assert att.describe("a").blocks == (0,) and att.describe("b").blocks == (1,)
    att.commit_chunks_batched(["a", "b"], [4, 4])
    att.prepare_chunks_batched(["a", "b"])
    att.commit_chunks_batched(["a", "b"], [4, 4])
    att.prepare_chunks_batched(["b", "a"])
    assert att.describe("b").blocks == (1, 3, 4) and att.describe("a").blocks == (0, 2, 5)
    att.commit_chunks_batched(["a", "b"], [4, 4])
    # both evicted their oldest block, a first: the free list ends ..., 0, 1
    assert pool.free_block_ids()[-2:] == [0, 1]
    assert att.describe("a") == twin.StreamKVInfo(0, (2, 5), 8, 0, 12)
    assert table_row(att, "a") == [2, 5] + [null] * 6
    att.free_stream("a")
    assert pool.free_block_ids()[-4:] == [0, 1, 2, 5]
    att.allocate_stream("c")
    assert att.slot_of("c") == 0  # lowest free slot
    att.prepare_chunk("c")
    assert att.describe("c").blocks == (6,)
    assert pool.num_used_blocks == 3


@pytest.mark.parametrize("chunk, bs, left", [(4, 2, 1), (4, 4, 2), (4, 8, 1), (6, 4, 2), (3, 8, 2), (4, 4, 0)])
def test_eviction_keeps_exactly_the_window(twin, chunk, bs, left):
    """Frame f carries the value f; after every commit the visible history is the last W frames."""
    cfg, pool, att = build(twin, chunk_size=chunk, block_size_frames=bs, num_left_chunks=left,
                           max_num_blocks=64, max_blocks_per_seq=16)
    W = left * chunk
    att.allocate_stream(0)
    total = 0
    for _ in range(12):
        att.prepare_chunk(0)
        caches = att.get_paged_caches([0])
        k = torch.arange(total, total + chunk, dtype=torch.float32).view(1, chunk, 1, 1).expand(1, chunk, 2, 8)
        for cache in caches:
            twin.append_kv(cache, k, -k)
        att.commit_chunk_paged(0, chunk)
        total += chunk
        info = att.describe(0)
        assert info.total_frames == total
        assert info.cache_seqlen - info.cache_seqstart == min(total, W) == att.cached_frames(0)
        assert info.cache_seqstart < bs  # no held block lies entirely before the window
        assert len(info.blocks) <= cfg.max_logical_blocks
        stacked = att.get_stacked_cache(0)
        expect = torch.arange(max(0, total - W), total, dtype=torch.float32)
        assert stacked.shape == (2, 2, len(expect), 16)
        assert torch.equal(stacked[..., 0], expect.expand(2, 2, -1))
        assert torch.equal(stacked[..., 8], -expect.expand(2, 2, -1))
    held = len(att.describe(0).blocks)
    assert pool.num_used_blocks == held


def test_unlimited_history_and_capacity(twin):
    cfg, pool, att = build(twin, num_left_chunks=-1, chunk_size=4, block_size_frames=4, max_num_blocks=12,
                           max_batch_size=4, max_blocks_per_seq=8)
    assert cfg.blocks_per_stream == 3 and cfg.max_stream_frames == 12
    att.allocate_stream(1)
    for _ in range(3):
        assert not att.at_capacity(1)
        att.prepare_chunk(1)
        att.commit_chunk_paged(1, 4)
    assert att.at_capacity(1)
    assert att.cached_frames(1) == 12
    before = snapshot(pool, att)
    with pytest.raises(oasr.StreamCapacityError, match="ceiling is 3"):
        att.prepare_chunk(1)
    assert_same_snapshot(before, snapshot(pool, att))


def test_chunk_spanning_blocks_allocates_on_crossing(twin):
    cfg, pool, att = build(twin, chunk_size=6, block_size_frames=4, num_left_chunks=2, max_num_blocks=64,
                           max_blocks_per_seq=8)
    att.allocate_stream(0)
    att.prepare_chunk(0)
    assert att.describe(0).blocks == (0, 1)  # 6 frames span two blocks
    att.commit_chunk_paged(0, 6)
    att.prepare_chunk(0)
    assert att.describe(0).blocks == (0, 1, 2)  # frames 6..11 need only block 2 more
    att.prepare_chunk(0, 2)  # a second prepare for fewer frames allocates nothing
    assert att.describe(0).blocks == (0, 1, 2)


# ---- dense mode ---------------------------------------------------------------------------
def test_dense_commit_roundtrip_and_chunk_larger_than_block(twin):
    cfg, pool, att = build(twin, chunk_size=6, block_size_frames=4, num_left_chunks=1, max_num_blocks=64)
    att.allocate_stream(5)
    chunks = []
    for _ in range(4):
        kv = torch.randn(2, 2, 6, 16)
        att.commit(5, kv)
        chunks.append(kv)
    history = torch.cat(chunks, dim=2)[:, :, -6:]
    assert torch.equal(att.get_stacked_cache(5), history)
    with pytest.raises(ValueError, match=r"\(2, 2, T, 16\)"):
        att.commit(5, torch.randn(2, 2, 7, 16))
    with pytest.raises(ValueError, match="got \\(2, 3, 6, 16\\)"):
        att.commit(5, torch.randn(2, 3, 6, 16))


# ---- padding lane -------------------------------------------------------------------------
def test_pad_rows_write_only_into_scratch(twin):
    cfg, pool, att = build(twin, pad_lanes=1)
    pool.k_pool.fill_(float("nan"))
    pool.v_pool.fill_(float("nan"))
    att.allocate_stream(0)
    att.prepare_chunk(0)
    caches = att.get_paged_caches([0], pad_to=4)
    assert caches[0].block_table.shape == (4, cfg.max_blocks_per_seq)
    assert (caches[0].block_table[1:] == pool.null_block).all()
    before_k = pool.k_pool.clone()
    for cache in caches:
        k = torch.randn(4, 4, 2, 8)
        twin.append_kv(cache, k, k)
    changed = ~(pool.k_pool.isnan() & before_k.isnan()) & (pool.k_pool != before_k)
    blocks_changed = changed.any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
    assert blocks_changed == [0, pool.null_block]
    # nothing of the stream was written by pad rows: block 0 holds exactly row 0's frames
    assert not pool.k_pool[:, 0].isnan().any()
    with pytest.raises(ValueError, match="padding lane"):
        build(twin)[2].get_paged_caches([], pad_to=2)


def test_no_stream_can_be_bound_to_the_lane(twin):
    cfg, pool, att = build(twin, pad_lanes=1)
    for sid in range(cfg.max_batch_size):
        att.allocate_stream(sid)
    assert sorted(att.slot_of(s) for s in range(cfg.max_batch_size)) == list(range(cfg.max_batch_size))
    with pytest.raises(oasr.SlotsExhaustedError):
        att.allocate_stream("one too many")


# ---- prefill ------------------------------------------------------------------------------
def test_prefill_hands_out_zeroed_blocks_even_when_recycled(twin):
    cfg, pool, att = build(twin, prefill_kv_window=True, chunk_size=4, block_size_frames=4, num_left_chunks=2,
                           max_num_blocks=12, max_batch_size=4)
    pool.k_pool.fill_(float("nan"))  # dirty everything
    pool.v_pool.fill_(float("nan"))
    for sid in range(4):
        att.allocate_stream(sid)
        assert att.cached_frames(sid) == 8
        assert att.get_stacked_cache(sid).abs().sum() == 0  # zeros, not NaN
    for sid in range(4):
        att.free_stream(sid)
    att.allocate_stream("again")
    assert att.get_stacked_cache("again").eq(0).all()
    for _ in range(5):  # the cached length a chunk sees stays constant
        att.prepare_chunk("again")
        for cache in att.get_paged_caches(["again"]):
            twin.append_kv(cache, torch.ones(1, 4, 2, 8), torch.ones(1, 4, 2, 8))
        att.commit_chunk_paged("again", 4)
        assert att.cached_frames("again") == 8


def test_prefill_exhaustion_leaves_no_half_admitted_stream(twin):
    cfg, pool, att = build(twin, prefill_kv_window=True, num_left_chunks=2, max_num_blocks=12, max_batch_size=4)
    att.allocate_stream(0)
    pool.allocate(pool.num_free_blocks - 1)
    before = snapshot(pool, att)
    with pytest.raises(oasr.PoolExhaustedError):
        att.allocate_stream(1)
    assert_same_snapshot(before, snapshot(pool, att))
    assert not att.has_stream(1) and att.slots.num_free == 3


# ---- the error table ------------------------------------------------------------------------
def test_errors_change_nothing(twin):
    cfg, pool, att = build(twin, max_num_blocks=12, max_batch_size=4)
    att.allocate_stream(0)
    att.allocate_stream(1)
    att.prepare_chunks_batched([0, 1])
    att.allocate_stream(2)  # never prepared
    cases = [
        (ValueError, "already allocated", lambda: att.allocate_stream(0)),
        (KeyError, "unknown stream", lambda: att.free_stream(9)),
        (KeyError, "unknown stream", lambda: att.reset_stream(9)),
        (KeyError, "unknown stream", lambda: att.prepare_chunk(9)),
        (KeyError, "unknown stream", lambda: att.prepare_chunks_batched([0, 9])),
        (KeyError, "unknown stream", lambda: att.commit_chunk_paged(9, 4)),
        (KeyError, "unknown stream", lambda: att.commit_chunks_batched([0, 9], [4, 4])),
        (KeyError, "unknown stream", lambda: att.get_paged_caches([0, 9])),
        (KeyError, "unknown stream", lambda: att.get_paged_state_views(9)),
        (KeyError, "unknown stream", lambda: att.cached_frames(9)),
        (KeyError, "unknown stream", lambda: att.at_capacity(9)),
        (KeyError, "unknown stream", lambda: att.commit(9, torch.zeros(2, 2, 4, 16))),
        (KeyError, "unknown stream", lambda: att.get_stacked_cache(9)),
        (RuntimeError, "before the first prepare_chunk", lambda: att.get_paged_caches([0, 2])),
        (RuntimeError, "before the first prepare_chunk", lambda: att.get_paged_state_views(2)),
        (ValueError, "duplicate", lambda: att.prepare_chunks_batched([0, 0])),
        (ValueError, "duplicate", lambda: att.get_paged_caches([0, 0])),
        (ValueError, "num_frames", lambda: att.prepare_chunk(0, 5)),
        (ValueError, "num_frames", lambda: att.prepare_chunk(0, -1)),
        (ValueError, "only 0 frames prepared", lambda: att.commit_chunks_batched([0, 2], [4, 4])),
        (ValueError, "one frame count each", lambda: att.commit_chunks_batched([0, 1], [4])),
        (ValueError, "expected kv_chunk", lambda: att.commit(0, torch.zeros(2, 2, 4, 15))),
        (ValueError, "pad_to", lambda: att.get_paged_caches([0, 1], pad_to=4)),
    ]
    for exc, message, call in cases:
        before = snapshot(pool, att)
        with pytest.raises(exc, match=message):
            call()
        assert_same_snapshot(before, snapshot(pool, att))
    # pool-exhausted batched prepare: three streams need a block each, two are free; nothing changes
    att.commit_chunks_batched([0, 1], [4, 4])
    pool.allocate(pool.num_free_blocks - 2)
    before = snapshot(pool, att)
    with pytest.raises(oasr.PoolExhaustedError):
        att.prepare_chunks_batched([0, 1, 2])
    assert_same_snapshot(before, snapshot(pool, att))


def test_reset_returns_to_admission(twin):
    cfg, pool, att = build(twin)
    att.allocate_stream(0)
    for _ in range(3):
        att.prepare_chunk(0)
        att.commit_chunk_paged(0, 4)
    att.reset_stream(0)
    assert att.describe(0) == twin.StreamKVInfo(0, (), 0, 0, 0)
    assert pool.num_used_blocks == 0
    with pytest.raises(RuntimeError):
        att.get_paged_state_views(0)


def test_paged_view_host_maxima(twin):
    cfg, pool, att = build(twin, pad_lanes=1)
    for sid in (0, 1):
        att.allocate_stream(sid)
    for _ in range(3):
        att.prepare_chunk(0)
        att.commit_chunk_paged(0, 4)
    att.prepare_chunks_batched([0, 1])
    caches = att.get_paged_caches([0, 1], pad_to=4)
    assert len(caches) == cfg.num_layers
    c = caches[1]
    assert c.layer == 1 and c.block_size == 4
    assert c.cache_seqlens.tolist() == [8, 0, 0, 0] and c.cache_seqstarts.tolist() == [0, 0, 0, 0]
    assert c.max_seqlen == 8 and c.max_span == 8
    assert c.k_cache.data_ptr() == pool.get_kv_view(1)[0].data_ptr()


def test_restore_stream_checks_everything_first(twin):
    """``restore_stream`` (sessions): same errors in both twins, and nothing changes on any of them."""
    from oasr.cache.errors import PoolExhaustedError, SlotsExhaustedError

    cfg = small_config(max_batch_size=2)  # chunk 4, window 8, block 4
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg)
    att.allocate_stream("a")
    before = snapshot(pool, att)
    cases = [
        (("a", 4, 0, 4), ValueError, "already allocated"),
        (("b", 8, 0, 4), ValueError, "expected seqlen=4"),  # lengths no stream could have
        (("b", -1, 0, 0), ValueError, "seqlen"),
    ]
    for args, error, words in cases:
        with pytest.raises(error, match=words):
            att.restore_stream(*args)
        assert_same_snapshot(before, snapshot(pool, att))
    taken = pool.allocate(pool.num_free_blocks)
    with pytest.raises(PoolExhaustedError):
        att.restore_stream("b", 11, 3, 19)  # 19 frames committed: 3 blocks, window [3, 11)
    pool.free(taken)
    att.restore_stream("b", 11, 3, 19)
    assert att.describe("b").cache_seqlen == 11 and len(att.describe("b").blocks) == 3
    with pytest.raises(SlotsExhaustedError):
        att.restore_stream("c", 0, 0, 0)
