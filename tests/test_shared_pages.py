"""Shared pages: reference-counted blocks, copy-on-write beams, rewind and trim (both twins)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from oasr import fast, reference
from oasr.cache.config import CacheConfig
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest

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


# ---- copy-on-write beams ---------------------------------------------------------------------------


def dcfg(**overrides) -> DecoderCacheConfig:
    values = dict(num_layers=2, n_kv_head=2, head_dim=8, page_size=4, max_num_blocks=24, max_rows=4,
                  max_self_tokens=16, max_cross_tokens=10)
    values.update(overrides)
    return DecoderCacheConfig(**values)


def kv(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def table_refs(m) -> Counter:
    refs = Counter()
    for r in m.rows:
        info = m.describe(r)
        refs.update(info.self_blocks + info.cross_blocks)
    return refs


def check_counts(m) -> None:
    """Sum of counts == table references; a block with count 0 is free; held + free == total."""
    counts = m.pool.ref_counts()
    refs = table_refs(m)
    assert {b: n for b, n in enumerate(counts) if n} == dict(refs)
    free = set(m.pool.free_block_ids())
    assert free == {b for b, n in enumerate(counts) if n == 0}
    assert len(refs) + len(free) == m.pool.num_blocks
    assert m.available_blocks >= 0


def test_select_forks_share_pages_and_the_first_write_copies(ops):
    m = ops.DecoderKVCacheManager(dcfg())
    (row,) = m.admit([DecoderRequest(6, 6, 3)])
    m.fill_cross(row, *kv(2, 3, 2, 8, seed=1))
    m.prefill(row, *kv(2, 6, 2, 8, seed=2))  # pages [p0 full | p1 half]
    donor = m.gather_self(row)
    rows = m.select([row], [0, 0, 0])
    assert rows == [0, 1, 2]
    info = [m.describe(r) for r in rows]
    assert info[0].self_blocks == info[1].self_blocks == info[2].self_blocks
    assert [m.pool.ref_count(b) for b in info[0].self_blocks + info[0].cross_blocks] == [3, 3, 3]
    check_counts(m)
    free = m.pool.num_free_blocks
    k, v = kv(2, 3, 2, 8, seed=3)
    m.append(rows, k, v)  # rows 0 and 1 copy the half page, row 2 keeps it: beams differ only there
    after = [m.describe(r) for r in rows]
    assert m.pool.num_free_blocks == free - 2
    assert after[2].self_blocks == info[2].self_blocks
    assert len({a.self_blocks[1] for a in after}) == 3 and len({a.self_blocks[0] for a in after}) == 1
    assert m.pool.ref_count(after[0].self_blocks[0]) == 3
    for b, r in enumerate(rows):
        got = m.gather_self(r)
        assert torch.equal(got[:, :, :6], donor)
        want = torch.cat([k[:, b:b + 1], v[:, b:b + 1]], dim=-1).transpose(1, 2)
        assert torch.equal(got[:, :, 6:], want)
    check_counts(m)
    for r in rows:
        m.finish(r)
    assert m.pool.num_free_blocks == m.pool.num_blocks and m.pool.ref_counts() == [0] * 24


def test_select_refuses_atomically_when_forks_find_no_rows_or_blocks(ops):
    m = ops.DecoderKVCacheManager(dcfg(max_rows=3, max_num_blocks=7))
    rows = m.admit([DecoderRequest(2, 2, 0)] * 2)
    for r in rows:
        m.prefill(r, *kv(2, 2, 2, 8, seed=r))
    before = (m.pool.free_block_ids(), m.pool.ref_counts(), [m.describe(r) for r in m.rows])
    with pytest.raises(ValueError, match="3 forked rows need 3 free rows, only 1"):
        m.select(rows, [0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="index 2 outside"):
        m.select(rows, [2])
    assert before == (m.pool.free_block_ids(), m.pool.ref_counts(), [m.describe(r) for r in m.rows])
    m2 = ops.DecoderKVCacheManager(dcfg(max_rows=4, max_num_blocks=3))
    (r,) = m2.admit([DecoderRequest(2, 6, 0)])
    m2.prefill(r, *kv(2, 2, 2, 8))
    with pytest.raises(ValueError, match="reserve 3 blocks .* only 2 are free"):
        m2.select([r], [0, 0])


def test_twins_identical_through_forks_and_copies():
    ms = [mod.DecoderKVCacheManager(dcfg()) for mod in (reference, fast)]
    for step in range(6):
        outs = []
        for m in ms:
            if step == 0:
                rows = m.admit([DecoderRequest(3, 9, 2)] * 2)
                for r in rows:
                    m.prefill(r, *kv(2, 3, 2, 8, seed=r))
            rows = m.rows
            idx = [[0, 0, 1], [2, 2, 0, 1], [0, 1, 1, 1], [3, 3, 1], [0, 2, 2, 2], [1, 1, 0]][step][: 4]
            idx = [i % len(rows) for i in idx]
            rows = m.select(rows, idx)
            m.append(rows, *kv(2, len(rows), 2, 8, seed=10 + step))
            outs.append((rows, [m.describe(r) for r in m.rows], m.pool.free_block_ids(), m.pool.ref_counts(),
                         [m.gather_self(r) for r in m.rows]))
            check_counts(m)
        a, b = outs
        assert a[:4] == b[:4] and all(torch.equal(x, y) for x, y in zip(a[4], b[4], strict=True))


def test_shares_cross_and_lengths_answer_without_changing_anything(ops):
    m = ops.DecoderKVCacheManager(dcfg())
    rows = m.admit([DecoderRequest(2, 6, 3)] * 2)
    for r in rows:
        m.fill_cross(r, *kv(2, 3, 2, 8, seed=r))
        m.prefill(r, *kv(2, 2, 2, 8, seed=5 + r))
    assert not m.shares_cross(rows)  # two utterances: their own cross pages
    beams = m.select(rows, [0, 0, 1])  # row 0 forked: the first two beams map the same cross pages
    m.append(beams, *kv(2, 3, 2, 8, seed=9))
    before = (m.pool.free_block_ids(), m.pool.ref_counts(), [m.describe(r) for r in m.rows])
    assert m.shares_cross(beams[:2]) and not m.shares_cross(beams) and m.shares_cross(beams[2:])
    assert not m.shares_cross([])
    assert m.lengths(beams[::-1]) == [m.length(r) for r in beams[::-1]] == [3, 3, 3]
    assert m.lengths([]) == []
    for call in (m.shares_cross, m.lengths):
        with pytest.raises(KeyError, match="row 3 is not admitted"):
            call([beams[0], 3])
        with pytest.raises(ValueError, match="row ids must be ints"):
            call([True])
        with pytest.raises(ValueError, match="duplicate rows"):
            call([beams[0], beams[0]])
    assert before == (m.pool.free_block_ids(), m.pool.ref_counts(), [m.describe(r) for r in m.rows])


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_fast_beams_read_their_shared_cross_region_once(monkeypatch, kv_cache_dtype):
    """The fast twin's decode groups attend a cross region every beam shares once (``read_cross`` once
    per search in the model dtype; a packed single-row read on quantized pages) and get what row-by-row
    reads give; the oracle reads row by row. A region refilled while one row holds it alone is read
    again, not from the kept copy."""
    from oasr.decoder.kv import PagedDecoderKV

    def group(ops):
        m = ops.DecoderKVCacheManager(dcfg(kv_cache_dtype=kv_cache_dtype, max_num_blocks=40))
        g = PagedDecoderKV.admit(m, [DecoderRequest(1, 8, 5)], ops)
        g.fill_cross(0, *kv(2, 5, 2, 8, seed=1))
        g.prefill(0, *kv(2, 1, 2, 8, seed=2))
        return m, g

    calls = Counter()
    for ops in (reference, fast):
        original = getattr(ops.DecoderKVCacheManager, "read_cross", ops.DecoderKVCacheManager.gather_cross)

        def counted(self, row, original=original, name=ops.__name__):
            calls[name] += 1
            return original(self, row)

        monkeypatch.setattr(ops.DecoderKVCacheManager, original.__name__, counted)
    q = torch.randn(3, 4, 2, 8, generator=torch.Generator().manual_seed(3))
    outs = {}
    for ops in (reference, fast):
        m, g = group(ops)
        g = g.select([0, 0, 0])
        got = [g.attend_cross(layer, q) for layer in range(2)]
        g = g.select([2, 0, 1])  # the kept copy goes on with the beams
        got += [g.attend_cross(layer, q) for layer in range(2)]
        rowwise = []
        for _ in range(2):
            for layer in range(2):
                view = m.cross_caches(g.rows)[layer]
                rowwise.append(ops.paged_attention(q.reshape(3, 8, 1, 8), view).reshape(3, 4, 2, 8))
        for a, b in zip(got, rowwise, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        outs[ops.__name__] = got
    shared_once = 0 if kv_cache_dtype else 1
    assert calls == Counter({"oasr.fast": shared_once}) if shared_once else not calls
    for a, b in zip(outs["oasr.reference"], outs["oasr.fast"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    if kv_cache_dtype:
        return
    m, g = group(fast)
    g = g.select([0, 0])
    g.attend_cross(0, q[:2])
    g = g.select([1])  # one row holds the region alone: it may be refilled
    m.fill_cross(g.rows[0], *kv(2, 5, 2, 8, seed=7))
    g = g.select([0, 0])
    view = m.cross_caches(g.rows)[0]
    want = fast.paged_attention(q[:2].reshape(2, 8, 1, 8), view).reshape(2, 4, 2, 8)
    torch.testing.assert_close(g.attend_cross(0, q[:2]), want, atol=1e-6, rtol=1e-6)
    # a lone row reads through a kept copy too (the prefill's read, handed on to the beams); a refill
    # through the manager, behind the group's back, moves ``cross_writes``: the next read gathers again
    m, g = group(fast)
    calls.clear()
    first = g.attend_cross(1, q[:1])
    m.fill_cross(g.rows[0], *kv(2, 5, 2, 8, seed=9))
    got = g.attend_cross(1, q[:1])
    want = fast.paged_attention(q[:1].reshape(1, 8, 1, 8), m.cross_caches(g.rows)[1]).reshape(1, 4, 2, 8)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(first, got) and calls == Counter({"oasr.fast": 2})
    g = g.select([0, 0, 0])
    torch.testing.assert_close(g.attend_cross(1, q[:1].expand(3, -1, -1, -1).contiguous()), want.expand(3, -1, -1, -1),
                               atol=1e-6, rtol=1e-6)
    assert calls == Counter({"oasr.fast": 2})  # the beams read the lone row's copy


def test_fast_read_cross_is_gather_cross_split_and_laid_out_for_the_shared_read():
    """``read_cross`` (the shared read's gather) holds ``gather_cross``'s values: per layer K^T and V in
    fp32, over shuffled pages poisoned with NaN past the region; quantized pages are refused by name."""
    m = fast.DecoderKVCacheManager(dcfg(max_num_blocks=40))
    for pool in (m.pool.k_pool, m.pool.v_pool):
        pool.fill_(float("nan"))
    m.pool.free(m.pool.allocate(7)[::-1])  # the free list reversed: the region's pages out of order
    (row,) = m.admit([DecoderRequest(1, 8, 5)])
    m.fill_cross(row, *kv(2, 5, 2, 8, seed=4))
    packed = m.gather_cross(row)  # (L, Hkv, S, 2D)
    read = m.read_cross(row)
    assert len(read) == packed.shape[0]
    for (k_t, v), layer in zip(read, packed, strict=True):
        assert k_t.dtype == v.dtype == torch.float32 and k_t.is_contiguous() and v.is_contiguous()
        assert torch.equal(k_t, layer[..., :8].transpose(1, 2).float()) and torch.equal(v, layer[..., 8:].float())
    q = fast.DecoderKVCacheManager(dcfg(kv_cache_dtype="fp8_e4m3", max_num_blocks=40))
    (row,) = q.admit([DecoderRequest(1, 8, 5)])
    with pytest.raises(ValueError, match="fp8_e4m3"):
        q.read_cross(row)
    with pytest.raises(KeyError):
        m.read_cross(row + 1)


def test_host_plan_serves_only_the_tensors_it_was_built_with():
    """A view's HostPlan (host lengths and a memo of index tensors) is used while the view holds the very
    tensors it describes, unwritten; a replaced or written table or length is read afresh, so the ops
    give what a view without a plan gives, bit for bit."""
    m = fast.DecoderKVCacheManager(dcfg(max_num_blocks=40))
    rows = m.admit([DecoderRequest(3, 8, 0)] * 3)
    for r in rows:
        m.prefill(r, *kv(2, 3, 2, 8, seed=r))
    m.prepare_step(rows)
    views = m.self_caches(rows)
    assert views[0].host is views[1].host and views[0].host.describes(views[0])
    q = torch.randn(3, 4, 1, 8, generator=torch.Generator().manual_seed(4))
    k, v = kv(3, 1, 2, 8, seed=6)
    bare = [dataclasses.replace(view, host=None) for view in views]
    assert bare[0].host is None
    for layer in range(2):  # the planned decode step and the generic path agree bit for bit
        fast.append_kv(views[layer], k, v)
        planned = fast.paged_attention(q, views[layer], causal=True)
        pools = m.pool.k_pool.clone(), m.pool.v_pool.clone()
        fast.append_kv(bare[layer], k, v)
        assert torch.equal(pools[0], m.pool.k_pool) and torch.equal(pools[1], m.pool.v_pool)
        assert torch.equal(planned, fast.paged_attention(q, bare[layer], causal=True))
    shorter = dataclasses.replace(views[0], cache_seqlens=views[0].cache_seqlens - 1, prepared_frames=None)
    assert not shorter.host.describes(shorter)
    want = fast.paged_attention(q, dataclasses.replace(shorter, host=None), causal=True)
    assert torch.equal(fast.paged_attention(q, shorter, causal=True), want)
    views[1].cache_seqlens.sub_(1)  # written in place: the plan no longer describes it
    assert not views[1].host.describes(views[1])
    assert torch.equal(fast.paged_attention(q, views[1], causal=True),
                       fast.paged_attention(q, dataclasses.replace(views[1], host=None), causal=True))
    m.commit_step(rows)
    m.prepare_step(rows)
    with torch.inference_mode():  # its tensors keep no version counter: views without a plan
        inference = m.self_caches(rows)
        assert inference[0].host is None
        fast.append_kv(inference[0], k, v)
        got = fast.paged_attention(q, inference[0], causal=True)
    planned = m.self_caches(rows)[0]
    assert planned.host is not None and torch.equal(got, fast.paged_attention(q, planned, causal=True))


# ---- rewind, trim, extend ----------------------------------------------------------------------------


def packed(k, v):
    """(L, T, H, D) K and V as gather_self's (L, H, T, 2D)."""
    return torch.cat([k, v], dim=-1).transpose(1, 2)


def test_rewind_reserves_bound_pages_first_and_stale_bytes_are_never_read(ops):
    m = ops.DecoderKVCacheManager(dcfg())
    (row,) = m.admit([DecoderRequest(5, 8, 0)])
    k, v = kv(2, 5, 2, 8, seed=1)
    m.prefill(row, k, v)
    nan = torch.full((2, 1, 2, 8), float("nan"))
    for _ in range(3):
        m.append([row], nan, nan)  # a rejected draft: 3 NaN tokens, into a second page
    blocks, free = m.describe(row).self_blocks, m.pool.num_free_blocks
    before = (m.pool.free_block_ids(), m.describe(row))
    with pytest.raises(ValueError, match="holds 8 tokens, cannot drop 9"):
        m.rewind(row, 9)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        m.rewind(row, -1)
    assert before == (m.pool.free_block_ids(), m.describe(row))
    m.rewind(row, 3)
    assert m.length(row) == 5 and m.describe(row).self_blocks == blocks and m.pool.num_free_blocks == free
    q = torch.randn(1, 4, 1, 8)
    for view in m.self_caches([row]):  # the stale NaN tokens lie past length: unread
        last = dataclasses.replace(view, cache_seqlens=view.cache_seqlens - 1, prepared_frames=None)
        out = ops.paged_attention(q, last, causal=True)
        assert torch.isfinite(out).all()
    k2, v2 = kv(2, 2, 2, 8, seed=2)
    m.extend(row, k2, v2)  # the accepted tokens land in the bound pages: nothing taken
    assert m.describe(row).self_blocks == blocks and m.pool.num_free_blocks == free
    assert torch.equal(m.gather_self(row), packed(torch.cat([k, k2], 1), torch.cat([v, v2], 1)))
    m.rewind(row, 4)  # length 3: the second page holds nothing any more
    assert m.trim(row) == 1 and m.pool.num_free_blocks == free + 1
    assert m.describe(row).self_blocks == blocks[:1] and m.available_blocks >= 0
    m.append([row], *kv(2, 1, 2, 8, seed=3))
    assert m.length(row) == 4


def test_rewind_into_a_shared_page_copies_before_writing(ops):
    m = ops.DecoderKVCacheManager(dcfg())
    (row,) = m.admit([DecoderRequest(8, 4, 0)])
    k, v = kv(2, 8, 2, 8, seed=1)
    m.prefill(row, k, v)  # two full pages
    a, b = m.select([row], [0, 0])
    donor = m.gather_self(a)
    m.rewind(b, 3)  # b's landing page is now the shared second page
    k2, v2 = kv(2, 3, 2, 8, seed=2)
    m.extend(b, k2, v2)
    assert torch.equal(m.gather_self(a), donor)  # the donor is untouched
    assert m.describe(a).self_blocks[0] == m.describe(b).self_blocks[0]
    assert m.describe(a).self_blocks[1] != m.describe(b).self_blocks[1]
    assert torch.equal(m.gather_self(b), packed(torch.cat([k[:, :5], k2], 1), torch.cat([v[:, :5], v2], 1)))
    check_counts(m)


def test_rewind_refuses_when_the_copies_it_would_owe_do_not_fit(ops):
    m = ops.DecoderKVCacheManager(dcfg(max_num_blocks=2))
    (row,) = m.admit([DecoderRequest(8, 0, 0)])
    m.prefill(row, *kv(2, 8, 2, 8))
    a, b = m.select([row], [0, 0])
    with pytest.raises(ValueError, match="rewind: row 1 rewound by 1 would make admitted rows reserve 1 blocks"):
        m.rewind(b, 1)
    assert m.length(b) == 8


# ---- prefix caching ------------------------------------------------------------------------------


def token_kv(tokens, start=0):
    """K/V as a pure function of (token id, position): what a model's projections of a prompt give."""
    ks, vs = [], []
    for p, t in enumerate(tokens, start):
        g = torch.Generator().manual_seed(1000 * int(t) + p)
        ks.append(torch.randn(2, 1, 2, 8, generator=g))
        vs.append(torch.randn(2, 1, 2, 8, generator=g))
    return torch.cat(ks, 1), torch.cat(vs, 1)


def serve(m, prompt, new_tokens=()):
    """Admit a row for ``prompt``, take its cached prefix, write the rest and ``new_tokens``; returns
    (row, cached)."""
    (row,) = m.admit([DecoderRequest(len(prompt), 4, 0)])
    cached = m.admit_prompt(row, prompt)
    m.extend(row, *token_kv(prompt[cached:], cached))
    history = list(prompt)
    for t in new_tokens:
        m.append([row], *token_kv([t], len(history)))
        history.append(t)
    return row, cached


def test_prefix_hit_is_block_aligned_below_the_prompt_and_attends_like_a_cold_prefill(ops):
    m = ops.DecoderKVCacheManager(dcfg(max_num_blocks=12))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    row, cached = serve(m, prompt, [40, 41])
    assert cached == 0
    m.retire(row, prompt + [40, 41])  # 11 tokens: two full pages published, they park
    assert m.pool.num_parked_blocks == 2 and m.pool.num_free_blocks == 12
    cold = ops.DecoderKVCacheManager(dcfg(max_num_blocks=12))
    for p, want in ((prompt, 8), (prompt[:8], 4), (prompt[:5] + [0, 0, 0, 0], 4), ([1] + prompt, 0)):
        hot, hit = serve(m, p)
        assert hit == want
        c, _ = serve(cold, p)
        q = torch.randn(1, 4, 1, 8)
        for vh, vc in zip(m.self_caches([hot]), cold.self_caches([c]), strict=True):
            hot_out, cold_out = (ops.paged_attention(q, dataclasses.replace(x, cache_seqlens=x.cache_seqlens - 1,
                                                                             prepared_frames=None), causal=True)
                                 for x in (vh, vc))
            assert torch.equal(hot_out, cold_out)
        assert torch.equal(m.gather_self(hot), cold.gather_self(c))
        m.evict(hot)
        cold.evict(c)
    assert m.pool.num_parked_blocks == 2
    m.reset()
    assert m.pool.num_parked_blocks == 0 and m.pool.num_free_blocks == 12
    assert serve(m, prompt)[1] == 0


def test_a_hash_collision_never_aliases_two_prompts(ops, monkeypatch):
    from oasr.decoder.prefix_cache import PrefixIndex

    monkeypatch.setattr(PrefixIndex, "hash_block", staticmethod(lambda parent, tokens: 7))  # every block collides
    m = ops.DecoderKVCacheManager(dcfg())
    row, _ = serve(m, [1, 2, 3, 4, 5])
    m.retire(row, [1, 2, 3, 4, 5])
    assert serve(m, [9, 9, 9, 9, 5])[1] == 0  # same hash, other tokens: a miss
    assert serve(m, [1, 2, 3, 4, 6])[1] == 4


def test_parked_blocks_count_as_free_and_are_reclaimed_least_recently_parked_first(ops):
    m = ops.DecoderKVCacheManager(dcfg(max_num_blocks=6, max_rows=2, max_cross_tokens=0, max_self_tokens=24))
    a, _ = serve(m, [1, 2, 3, 4, 0])
    b, _ = serve(m, [5, 6, 7, 8, 0])
    pa, pb = m.describe(a).self_blocks[0], m.describe(b).self_blocks[0]
    m.retire(a, [1, 2, 3, 4, 0])
    m.retire(b, [5, 6, 7, 8, 0])
    assert m.pool.parked_block_ids() == [pa, pb] and m.pool.num_free_blocks == 6
    (r,) = m.admit([DecoderRequest(24, 0, 0)])  # six pages: the free list, then pa, then pb
    m.prefill(r, *token_kv(range(20, 44)))
    assert m.describe(r).self_blocks[-2:] == (pa, pb) and m.pool.num_parked_blocks == 0
    m.finish(r)
    assert serve(m, [1, 2, 3, 4, 0])[1] == 0  # pa was reclaimed: its key is forgotten


def test_abandon_is_host_only(ops):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    m = ops.DecoderKVCacheManager(dcfg())
    rows = m.admit([DecoderRequest(5, 4, 3)] * 2)
    for r in rows:
        m.fill_cross(r, *kv(2, 3, 2, 8, seed=r))
        m.prefill(r, *kv(2, 5, 2, 8, seed=r))
    forks = m.select(rows, [0, 0, 1])
    m.append(forks, *kv(2, 3, 2, 8, seed=9))
    with Record() as rec:
        m.abandon(forks[1])
    assert rec.ops == []  # no launch, no copy, no wait
    check_counts(m)
    with Record() as rec:
        m.finish(forks[0])
        m.self_caches([forks[2]])  # a read of the device tables syncs them: the probe sees ops
    assert rec.ops
    (again,) = m.admit([DecoderRequest(5, 4, 3)])  # the abandoned row's device entries are rewritten on reuse
    m.prefill(again, *kv(2, 5, 2, 8, seed=3))
    assert torch.equal(m.gather_self(again), packed(*kv(2, 5, 2, 8, seed=3)))
    check_counts(m)


def test_rows_of_different_scopes_never_share(ops):
    """An attention decoder's prompt K/V past layer 0 depend on the encoder output: scope = the utterance."""
    m = ops.DecoderKVCacheManager(dcfg())
    (row,) = m.admit([DecoderRequest(5, 0, 0)])
    m.admit_prompt(row, [1, 2, 3, 4, 5], scope="utt-1")
    m.extend(row, *token_kv([1, 2, 3, 4, 5]))
    m.retire(row, [1, 2, 3, 4, 5], scope="utt-1")
    for scope, want in (("utt-2", 0), (0, 0), ("utt-1", 4)):
        (r,) = m.admit([DecoderRequest(5, 0, 0)])
        assert m.admit_prompt(r, [1, 2, 3, 4, 5], scope=scope) == want
        m.evict(r)


def test_bench_section_runs_and_reports_the_savings():
    from oasr.bench.shared_pages import section

    rows = section(quick=True)
    beams = {r["case"]: r for r in rows if "beam=" in r["case"]}
    for model in ("shipped decoder", "seeded toy decoder"):
        for beam in (4, 8):
            paged, dense = beams[f"{model}, beam={beam} paged (copy-on-write)"], beams[f"{model}, beam={beam} dense"]
            assert paged["same_tokens"] and 0 < paged["kv_bytes"] < dense["kv_bytes"]
            assert paged["tokens"] > 0 and paged["fast_paged_over_dense"] > 0
    off, on = rows[-2:]
    assert on["tokens_saved"] == off["prefill_tokens"] - on["prefill_tokens"] > 0
