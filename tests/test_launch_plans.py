"""Attention launch plans: checked and packed once per view key, reused while the key holds.

A plan is a function of addresses, shapes, dtypes, strides and the view's host fields only, so a call that
reuses one must give exactly what a freshly planned call gives, whatever the values in those tensors; a view
whose table or lengths need converting is never kept (its converted copy would be stale).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oasr.bench.launcher import NoopExecutor, make_view
from oasr.fast.kernels import emulation, ops
from oasr.fast.kernels.testing import make_scenario

_MISSING = emulation.unavailable_reason()


def test_a_plan_is_kept_per_key_and_reused():
    ops._PLANS.clear()
    cache, q = make_view("cpu", "bf16")
    noop = NoopExecutor()
    ops.paged_attention(noop, q, cache, None, 0.125, False, version="v3")
    assert len(ops._PLANS) == 1
    ops.paged_attention(noop, q, cache, None, 0.125, False, version="v3")
    same_tensors = dataclasses.replace(cache)  # a new view over the same tensors: the same key
    ops.paged_attention(noop, q, same_tensors, None, 0.125, False, version="v3")
    assert len(ops._PLANS) == 1 and noop.launches == 3
    ops.paged_attention(noop, q, cache, None, 0.25, False, version="v3")  # another scale: another plan
    wider = dataclasses.replace(cache, max_span=cache.max_span + 16)  # another host field: another plan
    ops.paged_attention(noop, q, wider, None, 0.125, False, version="v3")
    assert len(ops._PLANS) == 3


def test_a_view_that_needs_a_conversion_is_never_kept():
    ops._PLANS.clear()
    cache, q = make_view("cpu", "bf16")
    int64_table = dataclasses.replace(cache, block_table=cache.block_table.long())
    ops.paged_attention(NoopExecutor(), q, int64_table, None, 0.125, False, version="v3")
    assert not ops._PLANS


def test_a_bad_view_is_refused_at_every_call_not_planned():
    ops._PLANS.clear()
    cache, q = make_view("cpu", "bf16")
    for _ in range(2):
        with pytest.raises(ValueError, match="q is torch.float32 but the pool is torch.bfloat16"):
            ops.paged_attention(NoopExecutor(), q.float(), cache, None, 0.125, False, version="v3")
    assert not ops._PLANS


@pytest.mark.skipif(_MISSING is not None, reason=f"kernel emulation unavailable: {_MISSING}")
def test_a_reused_plan_reads_the_current_values():
    """Same tensors, new values (lengths, table, K/V, q): the reused plan equals a freshly planned call."""
    executor = emulation.executor()
    s = make_scenario(5, batch=3, n_kv_head=2, group=2, num_frames=4, head_dim=64, block_size=16, max_history=40,
                      dtype=torch.float32)
    lens = s.chunk_lens.to(torch.int32)
    ops.append_kv(executor, s.cache, s.k, s.v, lens)  # the chunk's own keys: attention reads them
    ops._PLANS.clear()
    ops.paged_attention(executor, s.q, s.cache, lens, 0.125, False)
    assert len(ops._PLANS) == 1
    g = torch.Generator().manual_seed(1)
    written = ~torch.isnan(s.cache.k_cache)
    s.cache.k_cache[written] = torch.randn(int(written.sum()), generator=g)
    s.q.copy_(torch.randn(s.q.shape, generator=g))
    s.cache.cache_seqlens.sub_(torch.minimum(s.cache.cache_seqlens - s.cache.cache_seqstarts,
                                             torch.full_like(s.cache.cache_seqlens, 3)))
    reused = ops.paged_attention(executor, s.q, s.cache, lens, 0.125, False)
    assert len(ops._PLANS) == 1  # the same plan served it
    ops._PLANS.clear()
    fresh = ops.paged_attention(executor, s.q, s.cache, lens, 0.125, False)
    valid = torch.zeros_like(fresh, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        valid[b, :, :n] = True
    assert not fresh[valid].isnan().any() and torch.equal(reused[valid], fresh[valid])


def test_a_plan_with_rel_bias_is_kept_only_for_a_contiguous_table():
    """The relative-position table's pointer is in the plan: a contiguous table (the caller's) is kept, a
    strided one (copied for the call) is not; a new table is a new key."""
    ops._PLANS.clear()
    cache, q = make_view("cpu", "bf16")
    B, H, T, _ = q.shape
    R = 2 * (cache.max_span + T)
    rel = torch.zeros((B, H, T, R), dtype=torch.float32)
    noop = NoopExecutor()
    ops.paged_attention(noop, q, cache, None, 0.125, False, version="v3", rel_bias=rel)
    ops.paged_attention(noop, q, cache, None, 0.125, False, version="v3", rel_bias=rel)
    assert len(ops._PLANS) == 1 and all(p.rel_table is None for p in ops._PLANS.values())
    strided = torch.zeros((B, H, T, 2 * R), dtype=torch.float32)[..., ::2]
    ops.paged_attention(noop, q, cache, None, 0.125, False, version="v3", rel_bias=strided)
    assert len(ops._PLANS) == 1 and noop.launches == 3
