"""Shared pages (issue 12): reference-counted blocks, copy-on-write beams, rewind and trim (both twins)."""

from __future__ import annotations

import pytest
import torch

from oasr import fast, reference
from oasr.config import CacheConfig

TWINS = {"reference": reference, "fast": fast}


@pytest.fixture(params=list(TWINS))
def ops(request):
    return TWINS[request.param]


def pool_config(**overrides) -> CacheConfig:
    fields = dict(num_layers=2, n_kv_head=2, head_dim=8, hidden_dim=16, kernel_size=3, chunk_size=4,
                  num_left_chunks=2, block_size_frames=4, max_num_blocks=8, max_batch_size=2, max_blocks_per_seq=8)
    fields.update(overrides)
    return CacheConfig(**fields)


# ---- reference counts in the pool ------------------------------------------------------------------


def test_shared_blocks_free_at_the_last_reference(ops):
    pool = ops.BlockPool(pool_config())
    me = pool.new_owner("m")
    a, b, c = pool.allocate(3, me)
    pool.share([a, a, b], me)
    assert [pool.ref_count(i) for i in (a, b, c)] == [3, 2, 1]
    pool.free([b, a], me)  # one reference each: nothing reaches 0
    assert pool.num_free_blocks == 5 and [pool.ref_count(i) for i in (a, b)] == [2, 1]
    pool.free([a, c, b, a], me)  # c, then b, then a (its last place) reach 0, in that order
    assert pool.free_block_ids()[-3:] == [c, b, a]
    assert pool.ref_counts() == [0] * 8


def test_share_and_free_refuse_atomically(ops):
    pool = ops.BlockPool(pool_config())
    me, other = pool.new_owner("m"), pool.new_owner("o")
    a, b = pool.allocate(2, me)
    (x,) = pool.allocate(1, other)
    pool.share([a], me)
    before = (pool.free_block_ids(), pool.ref_counts())
    with pytest.raises(ValueError, match=f"block {x} is held by o#2, not by m#1"):
        pool.share([a, x], me)
    with pytest.raises(ValueError, match="block 7 is free"):
        pool.share([b, 7], me)
    with pytest.raises(ValueError, match=f"block {b} is already free \\(double free\\)"):
        pool.free([a, a, b, b], me)  # a has 2 holders, b only 1
    with pytest.raises(ValueError, match=f"block {x} is owned by o#2"):
        pool.free([a, x], me)
    assert (pool.free_block_ids(), pool.ref_counts()) == before


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_copy_blocks_copies_whole_blocks(ops, kv_cache_dtype):
    pool = ops.BlockPool(pool_config(kv_cache_dtype=kv_cache_dtype))
    g = torch.Generator().manual_seed(0)
    pool.k_pool.copy_(torch.randn(pool.k_pool.shape, generator=g).to(pool.k_pool.dtype))
    pool.v_pool.copy_(torch.randn(pool.v_pool.shape, generator=g).to(pool.v_pool.dtype))
    if pool.k_scale is not None:
        pool.k_scale.copy_(torch.rand(pool.k_scale.shape, generator=g))
    want = pool.gather_kv_blocks([1, 5])
    pool.copy_blocks([1, 5], [6, 2])
    assert torch.equal(pool.gather_kv_blocks([6, 2]), want)
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        pool.copy_blocks([1, 2], [3])
