"""append_kv / paged_attention against an independent oracle: torch SDPA on contiguous data.

Pages are laid out through a shuffled block table in a pool poisoned with NaN
everywhere nothing may be read; the test also checks exactly which pool
entries ``append_kv`` wrote.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from oasr import PagedKVCache


def make_case(B, T, n_head, n_kv, D, bs, dtype, seed, causal=False, width=None):
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 3 * bs + 5, (B,), generator=g)
    starts = (torch.rand(B, generator=g) * (hist + 1).float()).long().clamp(max=hist)
    lens = torch.randint(0, T + 1, (B,), generator=g)
    lens[0] = T  # at least one full row
    width = width or math.ceil((int(hist.max()) + T) / bs) + 1
    num_blocks = B * width + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[: B * width].view(B, width).to(torch.int32)  # shuffled, disjoint rows
    k_cache = torch.full((num_blocks, bs, n_kv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, bs, n_kv, D), float("nan"), dtype=dtype)
    k_full = torch.randn(B, int(hist.max()) + T, n_kv, D, generator=g).to(dtype)
    v_full = torch.randn(B, int(hist.max()) + T, n_kv, D, generator=g).to(dtype)
    for b in range(B):  # history written directly, position by position (independent of append_kv)
        for p in range(int(hist[b])):
            k_cache[table[b, p // bs], p % bs] = k_full[b, p]
            v_cache[table[b, p // bs], p % bs] = v_full[b, p]
    chunk_k = torch.stack([k_full[b, int(hist[b]) : int(hist[b]) + T] for b in range(B)])
    chunk_v = torch.stack([v_full[b, int(hist[b]) : int(hist[b]) + T] for b in range(B)])
    q = torch.randn(B, n_head, T, D, generator=g).to(dtype)
    cache = PagedKVCache(
        k_cache=k_cache, v_cache=v_cache, block_table=table, cache_seqlens=hist.to(torch.int32),
        cache_seqstarts=starts.to(torch.int32), block_size=bs, max_seqlen=int(hist.max()),
        max_span=int((hist - starts).max()),
    )
    return cache, q, chunk_k, chunk_v, k_full, v_full, hist, starts, lens


def sdpa_oracle(q, k_full, v_full, hist, starts, lens, causal, compute_dtype):
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D, dtype=compute_dtype)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        lo, hi = int(starts[b]), int(hist[b]) + n
        k = k_full[b, lo:hi].to(compute_dtype).transpose(0, 1)
        v = v_full[b, lo:hi].to(compute_dtype).transpose(0, 1)
        group = H // k.shape[0]
        k = k.repeat_interleave(group, 0)
        v = v.repeat_interleave(group, 0)
        mask = None
        if causal:
            key_pos = torch.arange(lo, hi)
            query_pos = int(hist[b]) + torch.arange(n)
            mask = key_pos[None, :] <= query_pos[:, None]
        out[b, :, :n] = F.scaled_dot_product_attention(q[b, :, :n].to(compute_dtype), k, v, attn_mask=mask)
    return out


GEOMETRIES = [
    # B, T, n_head, n_kv, D, bs
    (3, 4, 4, 4, 16, 4),
    (4, 6, 4, 2, 16, 4),  # GQA, chunk spans blocks
    (2, 8, 8, 2, 32, 16),  # block larger than chunk
    (5, 3, 2, 1, 8, 2),  # MQA, tiny blocks
    (1, 16, 4, 4, 64, 8),
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_matches_sdpa_with_shuffled_tables(twin, geometry, causal):
    B, T, H, Hkv, D, bs = geometry
    for seed in range(3):
        cache, q, ck, cv, kf, vf, hist, starts, lens = make_case(B, T, H, Hkv, D, bs, torch.float32, seed)
        before_k = cache.k_cache.clone()
        twin.append_kv(cache, ck, cv, chunk_lens=lens.to(torch.int32))
        # exactly the chunk positions were written, with exactly the chunk's values
        written = torch.zeros(cache.k_cache.shape[:2], dtype=torch.bool)
        for b in range(B):
            for t in range(int(lens[b])):
                p = int(hist[b]) + t
                blk, off = int(cache.block_table[b, p // bs]), p % bs
                written[blk, off] = True
                assert torch.equal(cache.k_cache[blk, off], ck[b, t])
                assert torch.equal(cache.v_cache[blk, off], cv[b, t])
        untouched = ~written
        assert torch.equal(cache.k_cache[untouched].view(torch.int32), before_k[untouched].view(torch.int32))
        out = twin.paged_attention(q, cache, chunk_lens=lens.to(torch.int32), causal=causal)
        ref = sdpa_oracle(q, kf, vf, hist, starts, lens, causal, torch.float64)
        assert out.dtype == torch.float32 and not out.isnan().any()
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
        for b in range(B):  # queries past a row's length are zeros
            assert out[b, :, int(lens[b]) :].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_calibrated(twin, dtype):
    """Error against an fp64 oracle on the same rounded inputs is at most 2x what SDPA itself
    makes in that dtype (computing in fp32 and rounding once), plus a floor of one output ulp.
    The floor covers outputs near zero where SDPA happens to round exactly."""
    B, T, H, Hkv, D, bs = 4, 6, 4, 2, 32, 4
    cache, q, ck, cv, kf, vf, hist, starts, lens = make_case(B, T, H, Hkv, D, bs, dtype, 7)
    twin.append_kv(cache, ck, cv, chunk_lens=lens)
    out = twin.paged_attention(q, cache, chunk_lens=lens)
    assert out.dtype == dtype
    exact = sdpa_oracle(q, kf, vf, hist, starts, lens, False, torch.float64)
    lowprec = sdpa_oracle(q, kf, vf, hist, starts, lens, False, dtype).double()
    ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=1e-3)
    err = (out.double() - exact).abs()
    bound = 2 * (lowprec - exact).abs() + ulp
    assert (err <= bound).all(), float((err - bound).max())


def test_chunk_lens_zero_row_and_errors(twin):
    cache, q, ck, cv, *_ = make_case(2, 4, 2, 2, 8, 4, torch.float32, 3)
    lens = torch.tensor([4, 0], dtype=torch.int32)
    twin.append_kv(cache, ck, cv, chunk_lens=lens)
    out = twin.paged_attention(q, cache, chunk_lens=lens)
    assert out[1].eq(0).all()
    with pytest.raises(ValueError, match="n_head=3 must be a multiple of n_kv_head=2"):
        twin.paged_attention(torch.zeros(2, 3, 4, 8), cache)
    with pytest.raises(ValueError, match="head_dim=8"):
        twin.paged_attention(torch.zeros(2, 2, 4, 9), cache)
    with pytest.raises(ValueError, match="append_kv: k must be"):
        twin.append_kv(cache, torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8))
    with pytest.raises(ValueError, match="chunk_lens: expected shape"):
        twin.append_kv(cache, ck, cv, chunk_lens=[1, 2, 3])
