"""``max_num_blocks=None``: the pool sized from a budget (CPU) or from free device memory less headroom (CUDA)."""

from __future__ import annotations

import logging

import pytest
import torch

from oasr import fast
from oasr.cache.config import POOL_HEADROOM_FRACTION, CacheConfig
from oasr.cache.layer_specs import CacheLayout, FullAttention, SlidingWindow
from oasr.cache.memory import bytes_per_kv_block

GEOMETRY = dict(num_layers=4, n_kv_head=2, head_dim=8, hidden_dim=16, kernel_size=3, chunk_size=4,
                block_size_frames=4, max_batch_size=2, max_blocks_per_seq=32, num_left_chunks=2)


def test_cpu_needs_a_budget():
    with pytest.raises(ValueError, match="give pool_budget_bytes"):
        CacheConfig(max_num_blocks=None, **GEOMETRY)
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(max_num_blocks=10, pool_budget_bytes=1 << 20, **GEOMETRY)
    with pytest.raises(ValueError, match="holds no block"):
        CacheConfig(max_num_blocks=None, pool_budget_bytes=100, **GEOMETRY)
    with pytest.raises(ValueError, match="positive int"):
        CacheConfig(max_num_blocks=None, pool_budget_bytes=-5, **GEOMETRY)


def test_budget_sizes_the_pool_and_the_log_says_so(caplog):
    budget = 300_000
    with caplog.at_level(logging.INFO, logger="oasr.cache.config"):
        cfg = CacheConfig(max_num_blocks=None, pool_budget_bytes=budget, **GEOMETRY)
    per = bytes_per_kv_block(cfg)
    assert cfg.max_num_blocks == budget // per - 1
    assert per * (cfg.max_num_blocks + 1) <= budget < per * (cfg.max_num_blocks + 2)
    assert cfg.pool_sized_from == f"pool_budget_bytes={budget}" and cfg.pool_budget == budget
    assert any(f"max_num_blocks={cfg.max_num_blocks}" in r.getMessage() and "pool_budget_bytes" in r.getMessage()
               for r in caplog.records)
    pool = fast.BlockPool(cfg, scratch_blocks=1)
    assert (pool.k_pool.numel() + pool.v_pool.numel()) * 4 <= budget


def test_cuda_sizes_from_free_memory_less_headroom(monkeypatch, caplog):
    free, total = 3 << 30, 8 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    with caplog.at_level(logging.INFO, logger="oasr.cache.config"):
        cfg = CacheConfig(max_num_blocks=None, device="cuda", **GEOMETRY)
    budget = int(free - POOL_HEADROOM_FRACTION * total)
    assert cfg.max_num_blocks == budget // bytes_per_kv_block(cfg) - 1
    assert "free memory of cuda" in cfg.pool_sized_from
    assert any("headroom" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("twin", [fast])
def test_a_composition_spends_the_same_budget(twin):
    budget = 400_000
    cfg = CacheConfig(max_num_blocks=None, pool_budget_bytes=budget, **GEOMETRY)
    specs = [SlidingWindow(6), FullAttention(2), SlidingWindow(6), FullAttention(2)]
    layout = CacheLayout(cfg, specs)
    assert layout.unit == 2
    N = layout.config.max_num_blocks
    assert N == budget // layout.bytes_per_block - 1 and N > cfg.max_num_blocks  # half-size blocks: ~twice as many
    cache = twin.LayeredCache(cfg, specs)
    assert cache.pool.num_blocks == N
    assert (cache.pool.k_pool.numel() + cache.pool.v_pool.numel()) * 4 <= budget
