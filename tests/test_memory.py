"""The memory arithmetic is pinned against real allocations."""

import pytest
import torch

import oasr
from oasr.cache import memory
from tests.conftest import small_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_footprint_matches_allocations(twin, dtype):
    cfg = small_config(dtype=dtype, num_left_chunks=-1, max_num_blocks=24, max_blocks_per_seq=6)
    pool = twin.BlockPool(cfg, scratch_blocks=1)
    att = twin.AttentionCacheManager(pool, cfg, pad_lanes=1)
    cnn = twin.CnnCacheManager(cfg, pad_lanes=1)
    fp = memory.footprint(cfg, scratch_blocks=1, pad_lanes=1)
    assert fp.kv_pool + fp.scratch == pool.k_pool.nbytes + pool.v_pool.nbytes
    assert memory.kv_pool_bytes(cfg, 1) == pool.k_pool.nbytes + pool.v_pool.nbytes
    assert memory.bytes_per_kv_block(cfg) * (cfg.max_num_blocks + 1) == pool.k_pool.nbytes * 2
    assert fp.conv_cache == cnn.buffer.nbytes
    # the fast twin's persistent tables are exactly what footprint counts
    rows = cfg.max_batch_size + 1
    assert fp.block_tables == rows * cfg.max_blocks_per_seq * torch.tensor([], dtype=torch.int32).element_size()
    assert fp.seq_meta == 2 * rows * 4
    assert fp.total == sum(v for k, v in fp.as_dict().items() if k != "total")
    del att


def test_seed_numbers():
    cfg = oasr.CacheConfig(dtype=torch.float16)
    assert memory.bytes_per_kv_block(cfg) == 192 * 1024
    assert memory.bytes_per_kv_block(cfg) * 2048 == 384 * 1024 * 1024


def test_budget_inverts_bytes_per_block(twin):
    cfg = small_config()
    per = memory.bytes_per_kv_block(cfg)
    assert memory.max_num_blocks_for_budget(cfg, per * 11 + per // 2) == 10
    with pytest.raises(ValueError, match="holds no block"):
        memory.max_num_blocks_for_budget(cfg, per)
    n = memory.max_num_blocks_for_budget(cfg, 1 << 20)
    cfg2 = small_config(max_num_blocks=n)
    pool = twin.BlockPool(cfg2)
    assert pool.k_pool.nbytes + pool.v_pool.nbytes <= 1 << 20
    assert pool.k_pool.nbytes + pool.v_pool.nbytes + per > 1 << 20
