"""StreamContext: the per-stream facade, with all-or-nothing admission."""

import pytest
import torch

from tests.conftest import small_config


class FailingCtc:
    def allocate_stream(self, sid, batch, vocab):
        raise RuntimeError("ctc pool broken")

    def free_stream(self, sid):  # pragma: no cover - never reached
        raise AssertionError


def test_paged_loop_through_context(twin):
    cfg = small_config()
    pool = twin.BlockPool(cfg)
    att, cnn = twin.AttentionCacheManager(pool, cfg), twin.CnnCacheManager(cfg)
    ctx = twin.StreamContext.allocate(42, att, cnn)
    for _ in range(4):
        ctx.prepare_chunk()
        caches = ctx.get_att_caches()
        assert len(caches) == cfg.num_layers and caches[0].batch_size == 1
        for cache in caches:
            twin.append_kv(cache, torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
        ctx.commit_chunk_paged(4, torch.full((2, 1, 2, 16), 1.5))
    assert ctx.cached_frames() == 8
    assert ctx.get_cnn_cache().eq(1.5).all()
    assert ctx.get_att_cache().shape == (2, 2, 8, 16)
    with pytest.raises(RuntimeError, match="no CTC manager"):
        ctx.get_decoder()
    ctx.reset()
    assert ctx.cached_frames() == 0 and ctx.get_cnn_cache().eq(0).all()
    ctx.free()
    assert pool.num_used_blocks == 0 and not att.has_stream(42) and not cnn.has_stream(42)


def test_dense_loop_and_shape_check(twin):
    cfg = small_config()
    pool = twin.BlockPool(cfg)
    att, cnn = twin.AttentionCacheManager(pool, cfg), twin.CnnCacheManager(cfg)
    ctx = twin.StreamContext.allocate(1, att, cnn)
    ctx.commit_chunk(torch.randn(2, 2, 4, 16), torch.randn(2, 1, 2, 16))
    before = (ctx.get_att_cache().clone(), ctx.get_cnn_cache().clone())
    with pytest.raises(ValueError, match="cnn cache expected"):
        ctx.commit_chunk(torch.randn(2, 2, 4, 16), torch.randn(2, 1, 3, 16))
    assert torch.equal(before[0], ctx.get_att_cache()) and torch.equal(before[1], ctx.get_cnn_cache())


def test_allocate_rolls_back(twin):
    cfg = small_config()
    pool = twin.BlockPool(cfg)
    att, cnn = twin.AttentionCacheManager(pool, cfg), twin.CnnCacheManager(cfg)
    with pytest.raises(RuntimeError, match="ctc pool broken"):
        twin.StreamContext.allocate(3, att, cnn, FailingCtc(), vocab_size=10)
    assert not att.has_stream(3) and not cnn.has_stream(3)
    cnn.allocate_stream(4)  # the conv manager refuses: the attention admission is undone
    with pytest.raises(ValueError, match="already allocated"):
        twin.StreamContext.allocate(4, att, cnn)
    assert not att.has_stream(4)
