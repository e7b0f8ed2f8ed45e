"""DecoderKVCacheManager (both twins): admission by reserved ceilings, growth, the cross region, beams, fp8."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasr import fast, reference
from oasr.cache.errors import PoolExhaustedError
from oasr.decoder.common import AdmissionError
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.reference.fp8 import FP8_DTYPE, fp8_scales

TWINS = {"reference": reference, "fast": fast}


@pytest.fixture(params=list(TWINS))
def ops(request):
    return TWINS[request.param]


def dcfg(**overrides) -> DecoderCacheConfig:
    values = dict(num_layers=2, n_kv_head=2, head_dim=8, page_size=4, max_num_blocks=24, max_rows=4,
                  max_self_tokens=16, max_cross_tokens=10)
    values.update(overrides)
    return DecoderCacheConfig(**values)


def snap(m) -> dict:
    rows = {r: m.describe(r) for r in m.rows}
    return {"free": m.pool.free_block_ids(), "rows": rows, "reserved": m.reserved_blocks,
            "k": m.pool.k_pool.view(torch.uint8).clone(), "v": m.pool.v_pool.view(torch.uint8).clone()}


def assert_same(a: dict, b: dict) -> None:
    assert a["free"] == b["free"] and a["rows"] == b["rows"] and a["reserved"] == b["reserved"]
    assert torch.equal(a["k"], b["k"]) and torch.equal(a["v"], b["v"])


def shuffle_free_list(pool, seed: int) -> None:
    """Allocate every block and free them in a random order: later pages land anywhere in the pool."""
    ids = pool.allocate(pool.num_free_blocks)
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    pool.free([ids[i] for i in order])


def kv(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


# ---- config --------------------------------------------------------------------------------------


def test_config_errors_name_fields_and_numbers():
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        dcfg(page_size=0)
    with pytest.raises(ValueError, match="exactly one of max_num_blocks and budget_bytes"):
        dcfg(budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="budget_bytes=100 holds no block: one block is 1024 bytes"):
        dcfg(max_num_blocks=None, budget_bytes=100)
    with pytest.raises(ValueError, match="kv_storage must be one of"):
        dcfg(kv_storage="ring")
    with pytest.raises(ValueError, match="kv_cache_dtype must be None"):
        dcfg(kv_cache_dtype="int4")


def test_budget_and_storage_resolution():
    c = dcfg(max_num_blocks=None, budget_bytes=1024 * 11 + 100)
    assert c.bytes_per_block == 1024 and c.max_num_blocks == 10  # one scratch block first
    assert dcfg(kv_storage="auto", graph_captured=True).storage == "paged"
    assert dcfg(kv_storage="auto", graph_captured=False).storage == "dense"
    assert dcfg(kv_storage="dense", graph_captured=True).storage == "dense"


def test_bytes_per_token_fp8_formula(ops):
    for q, per_vector in ((None, 8 * 4), ("fp8_e4m3", 8 + 4)):
        c = dcfg(kv_cache_dtype=q)
        assert c.bytes_per_token == 2 * c.num_layers * c.n_kv_head * per_vector
        m = ops.DecoderKVCacheManager(c)
        pool = m.pool
        real = pool.k_pool.nbytes + pool.v_pool.nbytes
        if q:
            real += pool.k_scale.nbytes + pool.v_scale.nbytes
        assert real == c.bytes_per_block * (c.max_num_blocks + 1)


# ---- admission ---------------------------------------------------------------------------------------


def test_admission_reserves_ceilings_and_refuses_atomically(ops):
    m = ops.DecoderKVCacheManager(dcfg(max_num_blocks=12))
    req = DecoderRequest(prompt_len=3, max_new_tokens=5, cross_len=10)  # 2 self + 3 cross pages
    assert m.can_admit([req, req]).blocks == 10
    rows = m.admit([req, req])
    assert rows == [0, 1]
    assert m.pool.num_free_blocks == 6 and m.reserved_blocks == 4 and m.available_blocks == 2
    before = snap(m)
    answer = m.can_admit([DecoderRequest(1, 4, 0), DecoderRequest(1, 4, 0)])
    assert not answer
    assert ("the batch's ceilings need 4 blocks (4 self + 0 cross, page_size=4), only 2 are available "
            "(6 free minus 4 reserved by admitted rows)") in answer.reason
    with pytest.raises(AdmissionError, match="only 2 are available"):
        m.admit([DecoderRequest(1, 4, 0), DecoderRequest(1, 4, 0)])
    assert_same(before, snap(m))
    with pytest.raises(AdmissionError, match="request 0 declares prompt_len=10 \\+ max_new_tokens=10 = 20"):
        m.admit([DecoderRequest(10, 10)])
    with pytest.raises(AdmissionError, match="cross_len=11, above max_cross_tokens=10"):
        m.admit([DecoderRequest(1, 1, 11)])
    with pytest.raises(AdmissionError, match="needs 3 rows, only 2 of max_rows=4"):
        m.admit([DecoderRequest(1, 1)] * 3)
    assert_same(before, snap(m))


def test_growth_takes_a_page_at_each_boundary_and_finish_frees_the_row(ops):
    m = ops.DecoderKVCacheManager(dcfg())
    (row,) = m.admit([DecoderRequest(2, 9, 5)])
    assert m.describe(row).cross_blocks == (0, 1)
    k, v = kv(2, 2, 2, 8)
    m.prefill(row, k, v)
    assert m.describe(row).self_blocks == (2,)
    held = []
    for _ in range(9):
        k, v = kv(2, 1, 2, 8)
        m.append([row], k, v)
        held.append(len(m.describe(row).self_blocks))
    assert held == [1, 1, 2, 2, 2, 2, 3, 3, 3]  # lengths 3..11 with page 4
    assert m.available_blocks == m.pool.num_free_blocks  # the whole ceiling is held now
    with pytest.raises(ValueError, match="row 0 is at its ceiling of 11 tokens"):
        m.append([row], *kv(2, 1, 2, 8))
    m.finish(row)
    assert m.pool.num_free_blocks == 24 and m.rows == [] and m.num_free_rows == 4
    with pytest.raises(KeyError, match="not admitted"):
        m.finish(row)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_admitted_rows_reach_their_ceilings_in_any_interleaving(data):
    """Once admitted, stepping every row to its ceiling never raises PoolExhaustedError (both twins)."""
    cfg = dcfg(max_num_blocks=data.draw(st.integers(6, 30)), max_rows=6, max_cross_tokens=8)
    ms = [reference.DecoderKVCacheManager(cfg), fast.DecoderKVCacheManager(cfg)]
    live: dict[int, int] = {}  # row -> tokens still allowed
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["admit", "step", "step", "step", "finish", "select", "cross"]))
        if op == "admit":
            reqs = data.draw(st.lists(st.builds(DecoderRequest, st.integers(0, 5), st.integers(0, 10),
                                                st.integers(0, 8)), min_size=1, max_size=3))
            answers = [m.can_admit(reqs) for m in ms]
            assert answers[0] == answers[1]
            if answers[0]:
                rows = [m.admit(reqs) for m in ms]
                assert rows[0] == rows[1]
                for r, q in zip(rows[0], reqs, strict=True):
                    live[r] = q.self_tokens
            else:
                before = [snap(m) for m in ms]
                for m, b in zip(ms, before, strict=True):
                    with pytest.raises(AdmissionError):
                        m.admit(reqs)
                    assert_same(b, snap(m))
        elif op == "step" and live:
            rows = [r for r in data.draw(st.permutations(sorted(live))) if live[r] > 0]
            rows = rows[: data.draw(st.integers(0, len(rows)))]
            if rows:
                k, v = kv(2, len(rows), 2, 8, seed=len(rows))
                for m in ms:
                    m.append(rows, k, v)  # must never raise PoolExhaustedError
                for r in rows:
                    live[r] -= 1
        elif op == "select" and live:
            group = data.draw(st.permutations(sorted(live)))
            picks = data.draw(st.lists(st.integers(0, len(group) - 1), unique=True))
            kept = [m.select(group, picks) for m in ms]
            assert kept[0] == kept[1] == [group[i] for i in picks]
            for r in group:
                if r not in kept[0]:
                    del live[r]
        elif op == "cross" and live:
            r = data.draw(st.sampled_from(sorted(live)))
            n = ms[0].describe(r).cross_ceiling
            k, v = kv(2, n, 2, 8, seed=r)
            for m in ms:
                m.fill_cross(r, k, v)
            assert torch.equal(ms[0].gather_cross(r), ms[1].gather_cross(r))
        elif op == "finish" and live:
            r = data.draw(st.sampled_from(sorted(live)))
            for m in ms:
                m.finish(r)
            del live[r]
        for m in ms:
            assert m.available_blocks >= 0
            assert m.pool.num_used_blocks == sum(len(m.describe(r).self_blocks) + len(m.describe(r).cross_blocks)
                                                 for r in m.rows)
        assert snap(ms[0])["free"] == snap(ms[1])["free"]
        assert {r: ms[0].describe(r) for r in ms[0].rows} == {r: ms[1].describe(r) for r in ms[1].rows}
    # finally: every live row steps to its ceiling, row by row, in a drawn order
    order = data.draw(st.permutations(sorted(live)))
    for r in order:
        for _ in range(live[r]):
            for m in ms:
                try:
                    m.append([r], *kv(2, 1, 2, 8))
                except PoolExhaustedError as exc:  # the property: never
                    pytest.fail(f"an admitted row ran the pool dry: {exc}")
    for m in ms:
        for r in order:
            assert m.describe(r).length == m.describe(r).ceiling_tokens


# ---- the cross region --------------------------------------------------------------------------


def test_fill_cross_rules(ops):
    m = ops.DecoderKVCacheManager(dcfg())
    (row,) = m.admit([DecoderRequest(1, 3, 6)])
    k, v = kv(2, 6, 2, 8, dtype=torch.float64)
    m.fill_cross(row, k, v)  # converted to fp32
    got = m.gather_cross(row)
    assert got.dtype == torch.float32 and got.shape == (2, 2, 6, 16)
    assert torch.equal(got[..., :8], k.float().transpose(1, 2))
    m.fill_cross(row, k, v)  # same length: idempotent
    assert torch.equal(m.gather_cross(row), got)
    before = snap(m)
    with pytest.raises(ValueError, match="already holds 6 cross frames; a refill must have the same length, got T=5"):
        m.fill_cross(row, *kv(2, 5, 2, 8))
    with pytest.raises(ValueError, match="declared cross_len=6, got T=7"):
        m.fill_cross(row, *kv(2, 7, 2, 8))
    with pytest.raises(ValueError, match=r"k must be \(2, 'T', 2, 8\)"):
        m.fill_cross(row, *kv(2, 6, 3, 8))
    assert_same(before, snap(m))


def test_self_writes_keep_the_strict_dtype_rule(ops):
    m = ops.DecoderKVCacheManager(dcfg())
    (row,) = m.admit([DecoderRequest(2, 3, 0)])
    before = snap(m)
    with pytest.raises(ValueError, match="is torch.float64, the decoder serves torch.float32"):
        m.prefill(row, *kv(2, 2, 2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="is torch.float16, the decoder serves torch.float32"):
        m.append([row], *kv(2, 1, 2, 8, dtype=torch.float16))
    assert_same(before, snap(m))


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_cross_views_attend_exactly_the_extent(ops, kv_cache_dtype):
    """paged_attention over cross views with one query per row (T queries packed as heads) == textbook."""
    from oasr.decoder.kv import PagedDecoderKV

    m = ops.DecoderKVCacheManager(dcfg(kv_cache_dtype=kv_cache_dtype))
    group = PagedDecoderKV.admit(m, [DecoderRequest(1, 1, 7), DecoderRequest(1, 1, 3)], ops)
    poison = torch.full_like(m.pool.k_pool, float("nan"))
    m.pool.k_pool.copy_(poison.to(m.pool.k_pool.dtype))
    m.pool.v_pool.copy_(poison.to(m.pool.v_pool.dtype))
    lens = (7, 3)
    for b, n in enumerate(lens):
        group.fill_cross(b, *kv(2, n, 2, 8, seed=b))
    q = torch.randn(2, 4, 3, 8)
    for layer in range(2):
        out = group.attend_cross(layer, q)
        for b in range(len(lens)):
            packed = m.gather_cross(group.rows[b])[layer]  # (H, n, 2D)
            k, v = packed[..., :8].repeat_interleave(2, 0), packed[..., 8:].repeat_interleave(2, 0)
            want = torch.softmax(q[b] @ k.transpose(1, 2) / math.sqrt(8), -1) @ v
            torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)


# ---- beams ---------------------------------------------------------------------------------------


def test_paged_select_reorders_drops_and_refuses_out_of_range(ops):
    """(Repeated indices fork onto shared pages: tests/test_shared_pages.py.)"""
    m = ops.DecoderKVCacheManager(dcfg())
    rows = m.admit([DecoderRequest(2, 4, 3)] * 3)
    for r in rows:
        m.prefill(r, *kv(2, 2, 2, 8, seed=r))
    before = snap(m)
    with pytest.raises(ValueError, match="index 3 outside"):
        m.select(rows, [3])
    assert_same(before, snap(m))
    kept = m.select(rows, [2, 0])
    assert kept == [2, 0] and m.rows == [0, 2]
    assert m.pool.num_free_blocks == before["free"].__len__() + 2  # row 1's self page and cross page


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_dense_select_repeats_and_merge_move_scales(ops, kv_cache_dtype):
    c = dcfg(kv_cache_dtype=kv_cache_dtype)
    group = ops.DenseDecoderKV(c, 2, capacity=8, cross_capacity=4)
    for b in range(2):
        group.prefill(b, *kv(2, 3, 2, 8, seed=b))
    group.append(*kv(2, 2, 2, 8, seed=5))
    beams = group.select([1, 1, 0])
    assert beams.lengths == [4, 4, 4]
    for new, old in ((0, 1), (1, 1), (2, 0)):
        assert torch.equal(beams.gather_self(new), group.gather_self(old))
    merged = beams.merge(group)
    assert merged.batch_size == 5
    assert torch.equal(merged.gather_self(4), group.gather_self(1))
    if kv_cache_dtype:
        assert torch.equal(merged.k_scale[0][3], group.k_scale[0][0])


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_paged_equals_dense_storage(ops, kv_cache_dtype):
    c = dcfg(kv_cache_dtype=kv_cache_dtype)
    m = ops.DecoderKVCacheManager(c)
    shuffle_free_list(m.pool, seed=4)
    for pages in (m.pool.k_pool, m.pool.v_pool):  # NaN wherever nothing should be read
        pages.copy_(torch.full_like(pages, float("nan"), dtype=torch.float32).to(pages.dtype))
    rows = m.admit([DecoderRequest(3, 5, 0)] * 2)
    dense = ops.DenseDecoderKV(c, 2, capacity=8)
    for b, r in enumerate(rows):
        k, v = kv(2, 3, 2, 8, seed=b)
        m.prefill(r, k, v)
        dense.prefill(b, k, v)
    for s in range(5):
        k, v = kv(2, 2, 2, 8, seed=10 + s)
        m.append(rows, k, v)
        dense.append(k, v)
    for b, r in enumerate(rows):
        assert torch.equal(m.gather_self(r), dense.gather_self(b))
    assert m.describe(rows[0]).self_blocks != (0, 2)  # the shuffled free list put the pages anywhere
    q = torch.randn(2, 4, 1, 8)
    for layer, view in enumerate(m.self_caches(rows)):  # attention over NaN-poisoned, shuffled pages
        last = dataclasses.replace(view, cache_seqlens=view.cache_seqlens - 1, prepared_frames=None)
        got = ops.paged_attention(q, last, causal=True)  # the last token's query over the row
        dense.lengths = [n - 1 for n in dense.lengths]
        want = dense.attend_self(layer, q)
        dense.lengths = [n + 1 for n in dense.lengths]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- fp8 --------------------------------------------------------------------------------------------


def test_fp8_bytes_equal_torch_conversion_at_power_of_two_scales(ops):
    c = dcfg(kv_cache_dtype="fp8_e4m3")
    m = ops.DecoderKVCacheManager(c)
    (row,) = m.admit([DecoderRequest(3, 2, 0)])
    k, v = kv(2, 3, 2, 8)
    k[0, 1, 0] *= 1000.0  # a large vector: its own scale
    m.prefill(row, k, v)
    m.append([row], *kv(2, 1, 2, 8, seed=3))
    block = m.describe(row).self_blocks[0]
    scale = fp8_scales(k.abs().amax(-1))  # (L, T, H)
    assert torch.equal(m.pool.k_scale[:, block, :3], scale)
    assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))
    want = (k / scale[..., None]).to(FP8_DTYPE)
    assert torch.equal(m.pool.k_pool[:, block, :3].view(torch.uint8), want.view(torch.uint8))


def test_pool_format_must_equal_the_decoders(ops):
    c8 = dcfg(kv_cache_dtype="fp8_e4m3")
    pool = ops.BlockPool(dcfg().pool_config())
    with pytest.raises(ValueError, match="the pool's format must equal the decoder's"):
        ops.DecoderKVCacheManager(c8, pool)
    with pytest.raises(ValueError, match="pool geometry"):
        ops.DecoderKVCacheManager(dcfg(head_dim=16), pool)


def test_fast_fp8_refusal_names_head_dim_for_the_kernels():
    """The kernels tile fp8 pages for head_dim 64/128 only: refused at construction, by name."""
    c = dcfg(kv_cache_dtype="fp8_e4m3", head_dim=8)
    with pytest.raises(ValueError, match="tile head_dim in .* got head_dim=8"):
        fast.DecoderKVCacheManager(c, backend="emulated")
    fast.DecoderKVCacheManager(c, backend="torch")  # the torch backend serves any head_dim


# ---- the twins agree ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_twins_identical(kv_cache_dtype):
    c = dcfg(kv_cache_dtype=kv_cache_dtype)
    ms = [reference.DecoderKVCacheManager(c), fast.DecoderKVCacheManager(c)]
    for m in ms:
        rows = m.admit([DecoderRequest(3, 6, 10), DecoderRequest(1, 8, 4)])
        m.fill_cross(rows[0], *kv(2, 10, 2, 8, dtype=torch.float64))
        m.prefill(rows[0], *kv(2, 3, 2, 8))
        m.prefill(rows[1], *kv(2, 1, 2, 8, seed=2))
        for s in range(5):
            m.append(rows, *kv(2, 2, 2, 8, seed=10 + s))
        m.finish(rows[0])
        (again,) = m.admit([DecoderRequest(0, 4, 2)])
        m.append([again, rows[1]], *kv(2, 2, 2, 8, seed=99))
    a, b = snap(ms[0]), snap(ms[1])
    assert_same(a, b)
    for r in ms[0].rows:
        assert torch.equal(ms[0].gather_self(r), ms[1].gather_self(r))
        for x, y in zip(ms[0].self_caches([r]), ms[1].self_caches([r]), strict=True):
            assert torch.equal(x.block_table, y.block_table) and torch.equal(x.cache_seqlens, y.cache_seqlens)


# ---- memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_footprint_reports_the_decoder_pool_pinned_to_allocations(ops, kv_cache_dtype):
    from oasr.cache import memory
    from tests.conftest import small_config

    c = dcfg(kv_cache_dtype=kv_cache_dtype, dtype=torch.float16)
    m = ops.DecoderKVCacheManager(c)
    pool = m.pool
    real = pool.k_pool.nbytes + pool.v_pool.nbytes
    if kv_cache_dtype:
        real += pool.k_scale.nbytes + pool.v_scale.nbytes
    fp = memory.footprint(small_config(), decoder=c)
    assert fp.decoder_pool == memory.decoder_pool_bytes(c) == real
    per_vector = c.head_dim + 4 if kv_cache_dtype else 2 * c.head_dim
    assert c.bytes_per_token == 2 * c.num_layers * c.n_kv_head * per_vector
    assert fp.total == memory.footprint(small_config()).total + fp.decoder_pool + fp.decoder_tables
    if ops is fast:
        assert fp.decoder_tables == m.self_table.nbytes + m.cross_table.nbytes + m._meta.nbytes


def test_fast_fp8_refusal_names_the_model_dtype():
    # The format gate refuses a model dtype no format rule takes when the configuration is built (both twins).
    with pytest.raises(ValueError, match="model dtype must be one of .* got torch.float64"):
        dcfg(kv_cache_dtype="fp8_e4m3", head_dim=64, dtype=torch.float64)


@pytest.mark.parametrize("captured", [True, False])
def test_auto_storage_builds_paged_groups_for_captured_steps(ops, captured):
    from oasr.decoder.kv import DenseDecoderKV, PagedDecoderKV, decode_group

    c = dcfg(kv_storage="auto", graph_captured=captured)
    reqs = [DecoderRequest(2, 5, 4), DecoderRequest(1, 9, 3)]
    group = decode_group(c, ops, reqs, ops.DecoderKVCacheManager(c))
    if captured:
        assert isinstance(group, PagedDecoderKV) and group.rows == [0, 1]
        with pytest.raises(ValueError, match="needs the DecoderKVCacheManager"):
            decode_group(c, ops, reqs)
    else:
        assert isinstance(group, DenseDecoderKV) and (group.capacity, group.cross_capacity) == (10, 4)


def test_the_pool_refuses_to_free_a_rows_pages_from_outside(ops):
    m = ops.DecoderKVCacheManager(dcfg())
    (row,) = m.admit([DecoderRequest(2, 2, 3)])
    block = m.describe(row).cross_blocks[0]
    assert m.pool.owner_of(block).startswith("DecoderKVCacheManager")
    with pytest.raises(ValueError, match=f"block {block} is owned by DecoderKVCacheManager"):
        m.pool.free([block])
    m.finish(row)
    assert m.pool.num_free_blocks == m.pool.num_blocks


def test_fast_device_tables_follow_the_host_at_the_next_read():
    """Host ops only mark rows stale; the next read copies every stale row in one staged copy, and
    then the device tables equal the host mirror (a row that came and went costs nothing extra)."""
    m = fast.DecoderKVCacheManager(dcfg())
    m._stage_like_cuda()  # a CPU manager reads views from the host mirror; this is the path CUDA runs
    copies = m._stager.copies
    rows = m.admit([DecoderRequest(3, 4, 2)] * 3)
    for r in rows:
        m.prefill(r, *kv(2, 3, 2, 8, seed=r))
    m.finish(rows[1])
    (again,) = m.admit([DecoderRequest(2, 2, 0)])
    m.append([rows[0], rows[2]], *kv(2, 2, 2, 8, seed=7))
    assert m._stager.copies == copies  # CPU writes go through the host table: nothing read the device yet
    m.self_caches([rows[0]])
    assert m._stager.copies == copies + 1  # one copy for every stale row
    assert not m._dirty.any()
    assert torch.equal(m.self_table, torch.from_numpy(m._self_table))
    assert torch.equal(m.cross_table, torch.from_numpy(m._cross_table))
    want = np.stack([m._length, np.maximum(m._cross_length - 1, 0)]).astype(np.int32)
    assert torch.equal(m._meta, torch.from_numpy(want))
    m.self_caches([rows[0], again])
    assert m._stager.copies == copies + 2  # a read with nothing stale still stages its rows (once)


def _view_numbers(views):
    return [(v.block_table.tolist(), v.cache_seqlens.tolist(), v.cache_seqstarts.tolist(), v.max_seqlen,
             v.max_span, v.prepared_frames) for v in views]


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_fast_host_views_equal_the_staged_device_views(kv_cache_dtype):
    """On a CPU device the views come from the host mirror; a manager on the staged (CUDA) path, driven
    by the same ops (admit, prefill, steps, a copy-on-write fork, finish), hands out the same numbers."""
    managers = [fast.DecoderKVCacheManager(dcfg(kv_cache_dtype=kv_cache_dtype)) for _ in range(2)]
    managers[1]._stage_like_cuda()
    seen = []
    for m in managers:
        rows = m.admit([DecoderRequest(3, 6, 2)] * 2)
        for r in rows:
            m.prefill(r, *kv(2, 3, 2, 8, seed=r))
            m.fill_cross(r, *kv(2, 2, 2, 8, seed=10 + r))
        rows = m.select(rows, [1, 1, 0])  # a fork: row 1 twice
        got = []
        for _ in range(4):
            m.prepare_step(rows)
            got.append(_view_numbers(m.self_caches(rows)) + _view_numbers(m.cross_caches(rows[::-1])))
            m.commit_step(rows)
        m.finish(rows[0])
        got.append(_view_numbers(m.self_caches(rows[1:])))
        seen.append(got)
    assert seen[0] == seen[1]
