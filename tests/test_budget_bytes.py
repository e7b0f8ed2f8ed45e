"""One bytes rule for every page format: a budget-sized pool never spends more than its budget.

``KVFormat.bytes_per_vector`` (``oasr.kv_formats``) is the rule; ``oasr.cache.memory`` (uniform configs) and
``CacheLayout`` (declared compositions) size pools, footprints and per-stream bytes with it. Each case
below allocates the pool a budget sized and counts the bytes of every tensor it holds (data and scale
planes). A rule of ``head_dim * element_size + 4`` for every quantized format would overspend with q8_0
at head_dim != 64 and leave affine4 pools 40-50% smaller than the budget allows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oasr.cache.config import CacheConfig
from oasr.cache.layer_specs import CacheLayout, FullAttention, SlidingWindow, layout_for_budget
from oasr.cache.memory import bytes_per_kv_block, footprint
from oasr.fast.layered_cache import LayeredCache
from oasr.kv_formats import FORMAT_NAMES, get_format
from oasr.reference.block_pool import BlockPool

HEAD_DIMS = (32, 64, 96, 128, 192)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SPECS = [SlidingWindow(6), FullAttention(2), SlidingWindow(6), FullAttention(2)]  # unit 2 of 4 layers


def _cases():
    for name in FORMAT_NAMES:
        for d in HEAD_DIMS:
            for dtype in DTYPES:
                if d % max(get_format(name).group, get_format(name).values_per_byte, 1) == 0:
                    yield pytest.param(name, d, dtype, id=f"{name}-D{d}-{str(dtype).split('.')[-1]}")


def _config(fmt, head_dim, dtype, **overrides) -> CacheConfig:
    fields = dict(num_layers=4, n_kv_head=2, head_dim=head_dim, hidden_dim=8, kernel_size=3, chunk_size=4,
                  num_left_chunks=2, block_size_frames=4, max_num_blocks=None, pool_budget_bytes=108_817,
                  max_batch_size=2, max_blocks_per_seq=16, dtype=dtype,
                  kv_cache_dtype=None if fmt == "model" else fmt)
    fields.update(overrides)
    return CacheConfig(**fields)


def _pool_bytes(pool) -> int:
    return sum(t.numel() * t.element_size() for t in (pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale)
               if t is not None)


@pytest.mark.parametrize("fmt,head_dim,dtype", list(_cases()))
def test_a_budget_sized_pool_fits_its_budget(fmt, head_dim, dtype):
    per_vector = get_format(fmt).bytes_per_vector(head_dim, dtype)
    budget = 2 * 4 * 4 * 2 * per_vector * 20 + 1_234  # about 20 blocks and an odd remainder
    cfg = _config(fmt, head_dim, dtype, pool_budget_bytes=budget)
    per_block = bytes_per_kv_block(cfg)
    assert per_block == 2 * cfg.num_layers * cfg.block_size_frames * cfg.n_kv_head * per_vector
    # uniform: the pool the config sized, allocated, fits and one more block would not
    spent = _pool_bytes(BlockPool(cfg))
    assert spent == per_block * (cfg.max_num_blocks + 1) == footprint(cfg).kv_pool + footprint(cfg).scratch
    assert spent <= budget < spent + per_block
    # a composition re-sized in blocks of its unit (2 layers): the same rule, the same budget
    layout = CacheLayout(cfg, SPECS)
    assert layout.unit == 2 and layout.bytes_per_block == per_block // 2
    cache = LayeredCache(cfg, SPECS)
    spent = _pool_bytes(cache.pool)
    fp = layout.footprint()
    assert spent == fp.kv_pool + fp.scratch == layout.bytes_per_block * (layout.config.max_num_blocks + 1)
    assert spent <= budget < spent + layout.bytes_per_block
    # a stream's worst case counts the same blocks
    assert layout.bytes_per_stream() == sum(layout.blocks_per_stream()) * layout.bytes_per_block
    # layout_for_budget sizes by the same rule
    sized = layout_for_budget(dataclasses.replace(cfg, max_num_blocks=64), SPECS, budget)
    assert sized.bytes_per_block * (sized.config.max_num_blocks + 1) <= budget


def test_the_issues_numbers():
    """q8_0 at head_dim 128, one KV head, a 108,817-byte budget: a two-layer block is 2 x 2 x 4 x 136 =
    2,176 bytes (the old rule said 2 x 2 x 4 x 132 = 2,112, sized 50 blocks and allocated 51 x 2,176 =
    110,976 bytes); now 49 blocks, 108,800 bytes allocated."""
    cfg = _config("q8_0", 128, torch.float32, n_kv_head=1)
    layout = CacheLayout(cfg, SPECS)
    assert layout.bytes_per_block == 2176 and layout.config.max_num_blocks == 49
    cache = LayeredCache(cfg, SPECS)
    assert _pool_bytes(cache.pool) == 108_800 <= 108_817
