"""The relative-position term of ``paged_attention`` (``rel_bias=``, oasr.cache.rel_bias) in both twins.

Each twin is compared with an independent oracle: the keys read position by position straight from
the (shuffled, NaN-poisoned) pool, a dense queries x keys bias built entry by entry from the
convention ``rel_bias[b, h, t, (p_q - p_k) + T - 1]`` with ``p_q = cache_seqlens[b] + t``, and torch
SDPA with that bias as its float mask. Unread entries of the table are NaN, so reading one shows.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from oasr.cache.rel_bias import required_columns
from oasr.fast.kernels.testing import make_scenario


def poisoned_bias(scenario, R: int, seed: int, causal: bool) -> torch.Tensor:
    """A random ``(B, H, T, R)`` table whose entries no valid query reads (its own window's columns) are NaN."""
    q, c = scenario.q, scenario.cache
    B, H, T, _ = q.shape
    g = torch.Generator().manual_seed(seed)
    bias = torch.full((B, H, T, R), float("nan"))
    for b in range(B):
        n, s, start = int(scenario.chunk_lens[b]), int(c.cache_seqlens[b]), int(c.cache_seqstarts[b])
        for t in range(n):
            last = s + t if causal else s + n - 1  # the newest key query t sees
            lo, hi = s + t - last + T - 1, s + t - start + T - 1  # its columns, inclusive
            if hi >= lo:
                bias[b, :, t, lo : hi + 1] = torch.randn(H, hi - lo + 1, generator=g) * 2
    return bias


def dense_oracle(scenario, bias, causal: bool, scale: float) -> torch.Tensor:
    """fp32 SDPA per row with the dense bias built entry by entry (positions read one by one)."""
    q, c = scenario.q, scenario.cache
    B, H, T, D = q.shape
    group = H // c.n_kv_head
    out = torch.zeros(B, H, T, D)
    for b in range(B):
        n, s, start = int(scenario.chunk_lens[b]), int(c.cache_seqlens[b]), int(c.cache_seqstarts[b])
        keys = list(range(start, s + n))
        if n == 0 or not keys:
            continue
        k = torch.stack([c.k_cache[c.block_table[b, p // c.block_size], p % c.block_size] for p in keys]).float()
        v = torch.stack([c.v_cache[c.block_table[b, p // c.block_size], p % c.block_size] for p in keys]).float()
        dense = torch.empty(H, n, len(keys))
        for t in range(n):
            for j, p in enumerate(keys):
                if causal and p > s + t:
                    dense[:, t, j] = float("-inf")
                else:
                    dense[:, t, j] = bias[b, :, t, (s + t) - p + T - 1]
        k = k.transpose(0, 1).repeat_interleave(group, 0)
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        out[b, :, :n] = F.scaled_dot_product_attention(q[b, :, :n].float(), k, v, attn_mask=dense, scale=scale)
    return out


def scenario_with_chunk(seed, twin_module, **geometry):
    """A scenario whose chunk has been appended (so the chunk's own keys are in the pages)."""
    s = make_scenario(seed, **geometry)
    twin_module.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    return s


GEOMETRIES = [
    # batch, n_kv_head, group, num_frames, head_dim, block_size, max_history
    (3, 2, 1, 4, 16, 4, 11),
    (4, 2, 2, 6, 16, 4, 9),  # GQA, chunk across blocks
    (2, 1, 4, 3, 8, 16, 20),  # MQA, block wider than the chunk
    (5, 2, 2, 1, 8, 2, 7),  # one query frame
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("causal", [False, True])
def test_rel_bias_matches_dense_oracle(twin, geometry, causal):
    B, Hkv, G, T, D, bs, hist = geometry
    for seed in range(3):
        s = scenario_with_chunk(seed, twin, batch=B, n_kv_head=Hkv, group=G, num_frames=T, head_dim=D,
                                block_size=bs, max_history=hist)
        R = required_columns(s.cache.max_span, T) + seed  # the least table, and wider ones
        bias = poisoned_bias(s, R, seed, causal)
        out = twin.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, rel_bias=bias)
        expected = dense_oracle(s, bias, causal, 1 / math.sqrt(D))
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_rel_bias_none_and_zero_change_nothing(twin):
    s = scenario_with_chunk(7, twin, batch=3, n_kv_head=2, group=2, num_frames=4, head_dim=16, block_size=4,
                            max_history=10)
    plain = twin.paged_attention(s.q, s.cache, s.chunk_lens)
    assert torch.equal(twin.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=None), plain)
    zeros = torch.zeros(3, 4, 4, required_columns(s.cache.max_span, 4))
    torch.testing.assert_close(twin.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=zeros), plain,
                               rtol=1e-6, atol=1e-6)


def test_rel_bias_moves_the_weights_by_distance(twin):
    """A bias of -inf except at distance 0 leaves each query attending to its own frame alone."""
    s = scenario_with_chunk(3, twin, batch=2, n_kv_head=1, group=2, num_frames=5, head_dim=8, block_size=4,
                            max_history=9)
    T = 5
    R = required_columns(s.cache.max_span, T)
    bias = torch.full((2, 2, T, R), -1e30)
    bias[..., T - 1] = 0.0  # column T - 1: p_q == p_k
    out = twin.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=bias)
    for b in range(2):
        n = int(s.chunk_lens[b])
        own = s.v[b, :n].float().repeat_interleave(2, dim=1).transpose(0, 1)  # (H, n, D): frame t's own V
        torch.testing.assert_close(out[b, :, :n].float(), own)


def test_rel_bias_refusals_name_what_was_needed(twin):
    s = scenario_with_chunk(1, twin, batch=3, n_kv_head=2, group=1, num_frames=4, head_dim=8, block_size=4,
                            max_history=8)
    B, H, T = 3, 2, 4
    span = int((s.cache.cache_seqlens - s.cache.cache_seqstarts).max())
    need = span + 2 * T - 1
    with pytest.raises(ValueError, match=f"R={need - 1} .*needs R >= {need}"):
        twin.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=torch.zeros(B, H, T, need - 1))
    with pytest.raises(ValueError, match="float32"):
        twin.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=torch.zeros(B, H, T, need, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(B=3, n_head=2, T=4, R\)"):
        twin.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=torch.zeros(B, H, T + 1, need))
    with pytest.raises(ValueError, match=r"\(B=3, n_head=2, T=4, R\)"):
        twin.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=torch.zeros(H, T, need))
    with pytest.raises(ValueError, match="tensor"):
        twin.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=[[0.0]])


def test_distances_survive_a_table_shift(twin):
    """Eviction shifts a row's table positions by whole blocks: the same frames, the same result."""
    s = scenario_with_chunk(5, twin, batch=2, n_kv_head=1, group=2, num_frames=3, head_dim=8, block_size=4,
                            max_history=12)
    c = s.cache
    R = required_columns(c.max_span, 3)
    bias = poisoned_bias(s, R, 5, False)
    out = twin.paged_attention(s.q, c, s.chunk_lens, rel_bias=bias)
    # the same frames one block further right: a new first column pointing at a spare block
    table = torch.cat([c.block_table[:, :1], c.block_table], dim=1)
    moved = replace(c, block_table=table, cache_seqlens=c.cache_seqlens + 4, cache_seqstarts=c.cache_seqstarts + 4,
                    max_seqlen=c.max_seqlen + 4)
    assert torch.equal(twin.paged_attention(s.q, moved, s.chunk_lens, rel_bias=bias), out)


# -- the fast twin's CPU paths against the reference ---------------------------------------------------------


@pytest.fixture(params=["rows", "tiles", "small tiles"])
def cpu_path(request):
    """Each of the fast twin's CPU attention paths: the row loop, the vectorised tiles (one tile, and
    tiles of two rows), whatever the size-based dispatch would pick."""
    from unittest import mock

    from oasr.fast import cpu_rows
    from oasr.fast import paged_ops as fast_ops

    rows = request.param == "rows"
    group_bytes = 1 if request.param == "small tiles" else fast_ops._CPU_GROUP_BYTES
    with mock.patch.object(cpu_rows, "use_row_loop", lambda cache, n, T: rows), \
            mock.patch.object(cpu_rows, "use_decode_batch", lambda cache, n, T: False), \
            mock.patch.object(fast_ops, "_CPU_GROUP_BYTES", group_bytes):
        yield request.param


def reference_and_fast(seed, fmt=None, dtype=torch.float32, **geometry):
    """One scenario, its chunk appended by the reference, over pages of ``fmt`` (None: the model dtype)."""
    from oasr.fast.kernels.testing import to_format, to_fp8
    from oasr.reference import paged_ops as ref

    s = make_scenario(seed, dtype=dtype, **geometry)
    if fmt == "fp8_e4m3":
        s = to_fp8(s)
    elif fmt is not None:
        s = to_format(s, fmt, dtype)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    return s


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("causal", [False, True])
def test_fast_cpu_paths_match_the_reference(cpu_path, geometry, causal):
    from oasr import fast, reference

    B, Hkv, G, T, D, bs, hist = geometry
    for seed in range(2):
        s = reference_and_fast(seed, batch=B, n_kv_head=Hkv, group=G, num_frames=T, head_dim=D, block_size=bs,
                               max_history=hist)
        bias = poisoned_bias(s, required_columns(s.cache.max_span, T) + 2 * seed, seed, causal)
        expected = reference.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, rel_bias=bias)
        out = fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, rel_bias=bias, backend="torch")
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_fast_decode_batch_matches_the_reference():
    """One query frame per row over short spans: the batched decode path (a lookahead-0 chunk)."""
    from oasr import fast, reference
    from oasr.fast import cpu_rows

    for seed in range(4):
        s = reference_and_fast(seed, batch=5, n_kv_head=2, group=2, num_frames=1, head_dim=16, block_size=4,
                               max_history=13)
        assert cpu_rows.use_decode_batch(s.cache, 5, 1)
        bias = poisoned_bias(s, required_columns(s.cache.max_span, 1) + seed, seed, False)
        expected = reference.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=bias)
        out = fast.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=bias, backend="torch")
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "q8_0", "affine4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_quantized_pages_match_the_reference(fmt, dtype):
    """The term does not depend on the page format: quantized pages, the same bias, the same answer."""
    from oasr import fast, reference

    for seed in range(2):
        s = reference_and_fast(seed, fmt, dtype, batch=4, n_kv_head=2, group=2, num_frames=4, head_dim=64,
                               block_size=8, max_history=19)
        bias = poisoned_bias(s, required_columns(s.cache.max_span, 4), seed, bool(seed))
        expected = reference.paged_attention(s.q, s.cache, s.chunk_lens, causal=bool(seed), rel_bias=bias)
        out = fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=bool(seed), rel_bias=bias, backend="torch")
        assert not out.isnan().any()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 6),
    n_kv_head=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    num_frames=st.integers(1, 14),
    head_dim=st.sampled_from([8, 64, 128]),
    block_size=st.sampled_from([2, 4, 16, 32]),
    max_history=st.integers(0, 80),
    causal=st.booleans(),
    fmt=st.sampled_from([None, None, "fp8_e4m3", "int8"]),
    extra=st.integers(0, 4),
)
def test_twins_agree_on_random_geometries(seed, batch, n_kv_head, group, num_frames, head_dim, block_size,
                                          max_history, causal, fmt, extra):
    """The fast twin's torch backend (whatever path its dispatch picks) against the reference."""
    from oasr import fast, reference

    if fmt is not None and head_dim == 8:
        fmt = None  # the formats cut head_dim in groups of 32
    s = reference_and_fast(seed, fmt, batch=batch, n_kv_head=n_kv_head, group=group, num_frames=num_frames,
                           head_dim=head_dim, block_size=block_size, max_history=max_history)
    bias = poisoned_bias(s, required_columns(s.cache.max_span, num_frames) + extra, seed, causal)
    expected = reference.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, rel_bias=bias)
    out = fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, rel_bias=bias, backend="torch")
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def with_stream_starts(scenario, bias: torch.Tensor, seed: int) -> torch.Tensor:
    """The table with -inf at every column that reaches before a per-row first frame ``f_b`` in
    ``[cache_seqstarts, cache_seqlens]`` (as the Nemotron encoder hides its zeroed prefill): only columns
    a query reads are changed, so the unread ones stay NaN."""
    c = scenario.cache
    T = bias.shape[2]
    g = torch.Generator().manual_seed(seed)
    out = bias.clone()
    for b in range(bias.shape[0]):
        s, start = int(c.cache_seqlens[b]), int(c.cache_seqstarts[b])
        first = int(torch.randint(start, max(s, start) + 1, (1,), generator=g))
        for t in range(int(scenario.chunk_lens[b])):
            lo = (s + t - first) + T  # columns past distance s + t - first: keys before the first frame
            hi = (s + t - start) + T  # past the oldest key the query sees: unread
            out[b, :, t, lo:hi] = float("-inf")
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_minus_infinity_entries_hide_keys(twin, causal):
    """-inf in the table hides the keys at those distances, as a mask would; rows keep their own frame."""
    for seed in range(4):
        s = scenario_with_chunk(seed, twin, batch=4, n_kv_head=2, group=2, num_frames=5, head_dim=16, block_size=4,
                                max_history=17)
        bias = with_stream_starts(s, poisoned_bias(s, required_columns(s.cache.max_span, 5), seed, causal), seed)
        out = twin.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, rel_bias=bias)
        assert not out.isnan().any()
        torch.testing.assert_close(out, dense_oracle(s, bias, causal, 16**-0.5), rtol=1e-5, atol=1e-5)


def test_empty_cohort_is_checked_like_any_other(twin):
    s = scenario_with_chunk(0, twin, batch=1, n_kv_head=1, group=1, num_frames=3, head_dim=8, block_size=4,
                            max_history=0)
    c = s.cache
    empty = replace(c, block_table=c.block_table[:0], cache_seqlens=c.cache_seqlens[:0],
                     cache_seqstarts=c.cache_seqstarts[:0], prepared_frames=None)
    q = s.q[:0]
    assert twin.paged_attention(q, empty, rel_bias=torch.zeros(0, 1, 3, 5)).shape == q.shape
    with pytest.raises(ValueError, match="needs R >= 5"):
        twin.paged_attention(q, empty, rel_bias=torch.zeros(0, 1, 3, 4))
