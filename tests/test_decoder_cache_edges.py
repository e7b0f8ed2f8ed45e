"""DecoderKVCacheManager and the decode groups at their edges, both twins: one error, nothing changed.

* row ids: a bool is refused everywhere (``True`` is not row 1); a numpy integer is its value;
* an empty cohort is a no-op (``append``, ``append_kv``, ``paged_attention`` over zero rows);
* dense storage checks ``append`` / ``write`` whole before it stores a layer;
* ``select``: indices must be integers; pages of dropped rows that park (published) count as free;
* ``BlockPool.copy_blocks`` is one batched copy (old contents) and refuses a repeated destination.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasr import fast, reference
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.decoder.kv import PagedDecoderKV

TWINS = {"reference": reference, "fast": fast}
PROMPT = list(range(1, 10))


@pytest.fixture(params=list(TWINS))
def ops(request):
    return TWINS[request.param]


def dcfg(**overrides) -> DecoderCacheConfig:
    values = dict(num_layers=2, n_kv_head=2, head_dim=8, page_size=4, max_num_blocks=24, max_rows=4,
                  max_self_tokens=16, max_cross_tokens=10)
    values.update(overrides)
    return DecoderCacheConfig(**values)


def kv(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def snap(m) -> dict:
    return {"free": m.pool.free_block_ids(), "parked": m.pool.parked_block_ids(),
            "rows": {r: m.describe(r) for r in m.rows}, "reserved": m.reserved_blocks,
            "k": m.pool.k_pool.view(torch.uint8).clone(), "v": m.pool.v_pool.view(torch.uint8).clone()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[x], b[x]) if isinstance(a[x], torch.Tensor) else a[x] == b[x] for x in a)


def two_rows(ops):
    """Rows 0 and 1 admitted, row 1 with a 5-token prompt and its cross K/V."""
    m = ops.DecoderKVCacheManager(dcfg())
    rows = m.admit([DecoderRequest(4, 4, 6), DecoderRequest(5, 6, 6)])
    assert rows == [0, 1]
    m.prefill(1, *kv(2, 5, 2, 8))
    m.fill_cross(1, *kv(2, 6, 2, 8, seed=1))
    return m


# ---- row ids ---------------------------------------------------------------------------------------


def single_row_calls(m):
    k5, v5 = kv(2, 5, 2, 8, seed=3)
    k1, v1 = kv(2, 1, 2, 8, seed=4)
    return {
        "prefill": lambda r: m.prefill(r, k5, v5),
        "extend": lambda r: m.extend(r, k1, v1),
        "fill_cross": lambda r: m.fill_cross(r, *kv(2, 6, 2, 8, seed=1)),
        "finish": m.finish, "evict": m.evict, "abandon": m.abandon,
        "describe": m.describe, "length": m.length, "row_pages": m.row_pages,
        "gather_self": m.gather_self, "gather_cross": m.gather_cross,
        "admit_prompt": lambda r: m.admit_prompt(r, PROMPT[:3]),
        "retire": lambda r: m.retire(r, PROMPT[:5]),
        "rewind": lambda r: m.rewind(r, 1), "trim": m.trim,
    }


def test_bool_row_ids_are_refused_everywhere(ops):
    m = two_rows(ops)
    before = snap(m)
    for name, call in single_row_calls(m).items():
        for row in (True, False, np.bool_(True)):
            with pytest.raises(ValueError, match=r"row ids must be ints \(or numpy integers\), got"):
                call(row)
            assert same(snap(m), before), name
    k1, v1 = kv(2, 1, 2, 8, seed=4)
    many = {"append": lambda rows: m.append(rows, k1, v1), "prepare_step": m.prepare_step,
            "commit_step": m.commit_step, "self_caches": m.self_caches, "cross_caches": m.cross_caches,
            "cross_query_lens": m.cross_query_lens, "select": lambda rows: m.select(rows, [0])}
    for name, call in many.items():
        with pytest.raises(ValueError, match="row ids must be ints"):
            call([True])
        assert same(snap(m), before), name


def test_numpy_integer_row_ids_are_their_value(ops):
    """The same op sequence with int ids and with numpy ids leaves the same state, and ids come back as ints."""
    states = []
    for wrap in (int, np.int64, np.int32):
        m = two_rows(ops)
        one, zero = wrap(1), wrap(0)
        m.extend(one, *kv(2, 2, 2, 8, seed=5))
        m.prefill(zero, *kv(2, 3, 2, 8, seed=6))
        m.append([zero, one], *kv(2, 2, 2, 8, seed=7))
        assert m.length(one) == 8 and type(m.describe(one).row) is int
        assert m.select([zero, one], [np.int64(1), 1]) == [1, 0]  # row 0 dropped, then row 1 forked into it
        m.rewind(one, 2)
        m.finish(wrap(0))
        assert m.rows == [1] and all(type(r) is int for r in m.rows)
        assert torch.equal(m.gather_self(one), m.gather_self(1))
        states.append(snap(m))
    assert same(states[0], states[1]) and same(states[0], states[2])
    with pytest.raises(KeyError, match="finish: row 3 is not admitted"):
        ops.DecoderKVCacheManager(dcfg()).finish(np.int64(3))


def test_row_ids_that_are_not_integers(ops):
    m = two_rows(ops)
    before = snap(m)
    for row in (1.0, "1", None, torch.tensor(1), (1,)):
        with pytest.raises(ValueError, match="row ids must be ints"):
            m.describe(row)
        with pytest.raises(ValueError, match="row ids must be ints"):
            m.prepare_step([0, row])
    assert same(snap(m), before)


# ---- empty cohorts ---------------------------------------------------------------------------------


def test_an_empty_cohort_is_a_no_op(ops):
    m = two_rows(ops)
    before = snap(m)
    k, v = kv(2, 0, 2, 8)
    m.append([], k, v)
    m.prepare_step([])
    m.commit_step([])
    assert same(snap(m), before)
    (view, _) = m.self_caches([])
    ops.append_kv(view, *kv(0, 1, 2, 8))
    out = ops.paged_attention(torch.randn(0, 4, 1, 8), view, causal=True)
    assert out.shape == (0, 4, 1, 8)
    (cross, _) = m.cross_caches([])
    assert ops.paged_attention(torch.randn(0, 4, 1, 8), cross, chunk_lens=m.cross_query_lens([])).shape[0] == 0
    assert same(snap(m), before)
    with pytest.raises(ValueError, match="append: k must be"):
        m.append([], *kv(2, 1, 2, 8))  # one row of K/V for no rows: still refused


# ---- dense storage ---------------------------------------------------------------------------------


def dense_state(group) -> list:
    return [t.clone() for name in group._TENSORS if getattr(group, name) is not None
            for t in getattr(group, name)] + [list(group.lengths)]


def dense_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_dense_append_and_write_check_everything_first(ops, kv_cache_dtype):
    cfg = dcfg(kv_cache_dtype=kv_cache_dtype)
    group = ops.DenseDecoderKV(cfg, batch=3, capacity=4)
    group.append(*kv(2, 3, 2, 8))
    before = dense_state(group)
    bad_steps = {
        "int64": kv(2, 3, 2, 8, dtype=torch.int64),
        "float64": kv(2, 3, 2, 8, dtype=torch.float64),
        "one layer short": kv(1, 3, 2, 8),
        "two rows": kv(2, 2, 2, 8),
        "head_dim 4": kv(2, 3, 2, 4),
        "3-d": kv(2, 3, 16),
    }
    for name, (k, v) in bad_steps.items():
        with pytest.raises(ValueError, match="append: "):
            group.append(k, v)
        assert dense_equal(dense_state(group), before), name
    with pytest.raises(ValueError, match="append: k and v shapes differ|append: v must be"):
        group.append(kv(2, 3, 2, 8)[0], kv(2, 2, 2, 8)[1])
    bad_writes = {
        "int64": (0, *kv(3, 1, 2, 8, dtype=torch.int64)),
        "float64": (0, *kv(3, 1, 2, 8, dtype=torch.float64)),
        "two frames": (0, *kv(3, 2, 2, 8)),
        "four rows": (0, *kv(4, 1, 2, 8)),
        "layer 2": (2, *kv(3, 1, 2, 8)),
        "layer True": (True, *kv(3, 1, 2, 8)),
    }
    for name, (layer, k, v) in bad_writes.items():
        with pytest.raises(ValueError, match="write: "):
            group.write(layer, k, v)
        assert dense_equal(dense_state(group), before), name
    group.write(1, *kv(3, 1, 2, 8, seed=9))  # a good write still works


def test_group_rows_refuse_bools(ops):
    m = two_rows(ops)
    paged = PagedDecoderKV(m, [0, 1], ops)
    dense = ops.DenseDecoderKV(dcfg(), batch=2, capacity=8, cross_capacity=6)
    for group in (paged, dense):
        with pytest.raises(ValueError, match="group rows must be ints"):
            group.prefill(True, *kv(2, 3, 2, 8))
        with pytest.raises(ValueError, match="group rows must be ints"):
            group.gather_self(False)
        with pytest.raises(KeyError, match="outside the group's"):
            group.prefill(2, *kv(2, 3, 2, 8))
    dense.prefill(np.int64(1), *kv(2, 3, 2, 8))
    assert dense.lengths == [0, 3]


# ---- select --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("idx", [[1.5], [True], [1, False], [np.float64(1.0)], [np.bool_(True)], ["1"]])
def test_select_refuses_non_integer_indices(ops, idx):
    m = two_rows(ops)
    before = snap(m)
    with pytest.raises(ValueError, match=r"select: indices must be ints \(or numpy integers\)"):
        m.select([0, 1], idx)
    assert same(snap(m), before)
    dense = ops.DenseDecoderKV(dcfg(), batch=2, capacity=4)
    with pytest.raises(ValueError, match="select: indices must be ints"):
        dense.select(idx)


def published_then_shared(ops, num_blocks: int):
    """Row b holds two published pages (a prefix hit) and one of its own; row c holds two pages."""
    m = ops.DecoderKVCacheManager(dcfg(max_num_blocks=num_blocks))
    (a,) = m.admit([DecoderRequest(8, 0)])
    m.prefill(a, *kv(2, 8, 2, 8))
    m.retire(a, PROMPT[:8])  # its two pages are published and park
    (b,) = m.admit([DecoderRequest(9, 0)])
    cached = m.admit_prompt(b, PROMPT)  # takes both back
    m.extend(b, *[x[:, cached:] for x in kv(2, 9, 2, 8, seed=1)])
    (c,) = m.admit([DecoderRequest(6, 6)])
    m.prefill(c, *kv(2, 6, 2, 8, seed=2))
    return m, b, c


def test_select_counts_the_dropped_rows_published_pages_as_free(ops):
    """Dropping b parks its two published pages: they count as free, so forking c fits."""
    m, b, c = published_then_shared(ops, 6)
    twin, _, _ = published_then_shared(ops, 6)
    twin.finish(b)
    free_after_drop = twin.pool.num_free_blocks
    assert free_after_drop == 4 and twin.pool.num_parked_blocks == 2
    rows = m.select([b, c], [1, 1])
    assert sorted(rows) == [0, 1] and m.available_blocks >= 0
    assert m.pool.num_free_blocks - m.reserved_blocks == m.available_blocks
    # each fork writes its own copy of the shared landing page; both reach their ceilings
    for _ in range(6):
        m.append(rows, *kv(2, 2, 2, 8, seed=_))
    assert [m.length(r) for r in rows] == [12, 12]


def test_select_refusal_states_the_free_count_after_the_drop(ops):
    m, b, c = published_then_shared(ops, 6)
    before = snap(m)
    with pytest.raises(ValueError, match=r"only 4 are free after the dropped rows' pages return"):
        m.select([b, c], [1, 1, 1])  # two forks of c: more copies and ceilings than 4 blocks
    assert same(snap(m), before)


# ---- copy_blocks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
@pytest.mark.parametrize("src, dst", [([1, 2], [2, 3]), ([1, 2], [2, 1]), ([3, 2, 1], [2, 1, 0]), ([4], [4])])
def test_copy_blocks_copies_the_old_contents(ops, kv_cache_dtype, src, dst):
    """One batched copy: a destination that is also a source still gets its source's old contents."""
    pool = ops.BlockPool(dcfg(max_num_blocks=6, kv_cache_dtype=kv_cache_dtype).pool_config())
    tensors = [t for t in (pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale) if t is not None]
    g = torch.Generator().manual_seed(0)
    for t in tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    old = [t.view(torch.uint8).clone() for t in tensors]
    pool.copy_blocks(src, dst)
    for t, o in zip(tensors, old, strict=True):
        want = o.clone()
        for s, d in zip(src, dst, strict=True):
            want[:, d] = o[:, s]
        assert torch.equal(t.view(torch.uint8), want)


def test_copy_blocks_refuses_a_repeated_destination(ops):
    pool = ops.BlockPool(dcfg(max_num_blocks=6).pool_config())
    pool.k_pool.normal_(generator=torch.Generator().manual_seed(0))
    before = pool.k_pool.clone()
    with pytest.raises(ValueError, match="copy_blocks: destination block 3 given more than once"):
        pool.copy_blocks([1, 2], [3, 3])
    assert torch.equal(pool.k_pool, before)
