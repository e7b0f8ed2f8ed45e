"""fp8 (e4m3) K/V pages: bit-exact storage, dequantized reads, and a derived attention bound."""

import math

import pytest
import torch

import oasr
from oasr.cache import memory
from oasr.kv_formats.fp8_e4m3 import saturation_bound
from oasr.reference.fp8 import FP8_MAX, dequantize, quantize
from tests.conftest import small_config
from tests.test_paged_attention import make_case, sdpa_oracle

FP8 = torch.float8_e4m3fn


def scale_oracle(amax: float) -> float:
    """The least power of two p with amax / p <= 448, by counting (Python floats are doubles)."""
    if amax == 0.0:
        return 1.0
    k = -149
    while amax / 2.0**k > FP8_MAX:
        k += 1
    return 2.0**k


def fp8_twin(twin):
    if not getattr(twin, "SUPPORTS_FP8", twin.__name__ == "oasr.reference"):
        pytest.skip(f"{twin.__name__} has no fp8 K/V yet")
    return twin


def quantized_copy(cache):
    """An fp8 twin of a PagedKVCache: same table and lengths, NaN-poisoned fp8 pages, zero scales."""
    shape = cache.k_cache.shape
    k = torch.full(shape, float("nan")).to(FP8)
    v = torch.full(shape, float("nan")).to(FP8)
    ks = torch.full(shape[:-1], float("nan"), dtype=torch.float32)
    vs = torch.full(shape[:-1], float("nan"), dtype=torch.float32)
    return oasr.PagedKVCache(k, v, cache.block_table, cache.cache_seqlens, cache.cache_seqstarts, cache.block_size,
                             cache.max_seqlen, cache.max_span, cache.layer, ks, vs)


@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 300.0, 1e20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stored_bytes_and_scales_match_torch(twin, magnitude, dtype):
    twin = fp8_twin(twin)
    if dtype is torch.float16 and magnitude > 6e4 or dtype is torch.float16 and magnitude < 1e-7:
        pytest.skip("outside fp16's range")
    B, T, H, D, bs = 3, 5, 2, 16, 4
    cache = make_case(B, T, 2, H, D, bs, torch.float32, 11)[0]
    cache = quantized_copy(cache)
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(B, T, H, D, generator=g) * magnitude).to(dtype)
    k[0, 1, 0] = 0.0  # a zero vector: scale 1, stored zeros
    v = (torch.rand(B, T, H, D, generator=g) * magnitude).to(dtype)
    twin.append_kv(cache, k, v)
    for b in range(B):
        start = int(cache.cache_seqlens[b])
        for t in range(T):
            p = start + t
            blk, off = int(cache.block_table[b, p // bs]), p % bs
            for h in range(H):
                for src, data, scales in ((k, cache.k_cache, cache.k_scale), (v, cache.v_cache, cache.v_scale)):
                    x = src[b, t, h].float()
                    s = scale_oracle(float(x.abs().max()))
                    assert float(scales[blk, off, h]) == s
                    expect = (x / s).to(FP8)
                    assert torch.equal(data[blk, off, h].view(torch.uint8), expect.view(torch.uint8))


def test_attention_within_derived_bound(twin):
    """Bound, per output element (query t, head h, dim d), derived from e4m3's 3 mantissa bits.

    Rounding a value y = x / s to e4m3 errs by at most 2^-4 |y| (normal: half of a 2^-3 ulp)
    or 2^-10 (subnormal step 2^-9), so with s < 2 amax / 448:
        |x' - x| <= e(x) = 2^-4 |x| + 2^-10 * 2 * amax / 448.
    Scores move by at most delta = c * max_j sum_d |q_d| e(k_jd), so each softmax weight moves by a
    factor within [exp(-2 delta), exp(2 delta)]:  |p'_j - p_j| <= (exp(2 delta) - 1) p_j.  Then
        |o' - o| <= (exp(2 delta) - 1) max_j |v'_jd| + max_j e(v_jd)     (+ fp32 slack).
    """
    twin = fp8_twin(twin)
    B, T, Hq, H, D, bs = 4, 6, 4, 2, 32, 4
    base, q, ck, cv, kf, vf, hist, starts, lens = make_case(B, T, Hq, H, D, bs, torch.float32, 21)
    cache = quantized_copy(base)
    # history through append_kv too, one frame at a time, so every K/V vector is quantized
    for b in range(B):
        for p in range(int(hist[b])):
            blk, off = int(cache.block_table[b, p // bs]), p % bs
            for data, scale, src in ((cache.k_cache, cache.k_scale, kf), (cache.v_cache, cache.v_scale, vf)):
                x = src[b, p].float()
                s = torch.tensor([scale_oracle(float(row.abs().max())) for row in x])
                data[blk, off] = (x / s[:, None]).to(FP8)
                scale[blk, off] = s
    twin.append_kv(cache, ck, cv, chunk_lens=lens)
    out = twin.paged_attention(q, cache, chunk_lens=lens).double()
    exact = sdpa_oracle(q, kf, vf, hist, starts, lens, False, torch.float64)
    c = 1 / math.sqrt(D)
    group = Hq // H

    def err_bound(x):  # (L, H, D) -> elementwise bound e(x)
        amax = x.abs().amax(-1, keepdim=True)
        return 2**-4 * x.abs() + 2**-10 * 2 * amax / FP8_MAX

    for b in range(B):
        n = int(lens[b])
        if n == 0:
            assert out[b].eq(0).all()
            continue
        lo, hi = int(starts[b]), int(hist[b]) + n
        kk, vv = kf[b, lo:hi].double(), vf[b, lo:hi].double()
        ek, ev = err_bound(kk), err_bound(vv)
        for h in range(Hq):
            kv_head = h // group
            delta = c * (q[b, h, :n].double().abs() @ ek[:, kv_head].T).amax(-1)  # (n,)
            vmax = (vv[:, kv_head].abs() + ev[:, kv_head]).amax(0)  # (D,)
            bound = (torch.exp(2 * delta)[:, None] - 1) * vmax + ev[:, kv_head].amax(0) + 1e-5
            err = (out[b, h, :n] - exact[b, h, :n]).abs()
            assert (err <= bound).all(), float((err - bound).max())
    # fp8 really is lossy here, so the comparison is not vacuous
    assert (out - exact).abs().max() > 1e-4


def test_pool_scales_memory_and_dense_gather(twin):
    twin = fp8_twin(twin)
    cfg = small_config(kv_cache_dtype="fp8_e4m3")
    pool = twin.BlockPool(cfg)
    assert pool.k_pool.dtype == FP8 and pool.k_scale.shape == pool.k_pool.shape[:-1]
    assert pool.k_scale.dtype == torch.float32 and pool.k_scale.eq(0).all()
    assert memory.kv_pool_bytes(cfg, 1) == sum(t.nbytes for t in (pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale))
    att = twin.AttentionCacheManager(pool, cfg)
    att.allocate_stream(0)
    kv = torch.randn(2, 2, 4, 16)
    att.commit(0, kv)
    got = att.get_stacked_cache(0)
    assert got.dtype == cfg.dtype
    expect = dequantize(*quantize(kv[..., :8]))
    assert torch.equal(got[..., :8], expect)
    att.prepare_chunk(0)
    view = att.get_paged_caches([0])[1]
    assert view.quantized and view.k_scale.data_ptr() == pool.k_scale[1].data_ptr()
    pool.k_scale.fill_(5.0)
    pool.zero_blocks([0])
    assert pool.k_scale[:, 0].eq(0).all() and pool.k_scale[:, 1].eq(5.0).all()


def test_budget_affords_more_blocks():
    fp16 = oasr.CacheConfig(dtype=torch.float16)
    fp8 = oasr.CacheConfig(dtype=torch.float16, kv_cache_dtype="fp8_e4m3")
    assert memory.bytes_per_kv_block(fp8) == 2 * 12 * 16 * 4 * (64 + 4)
    budget = 1 << 30
    ratio = memory.max_num_blocks_for_budget(fp8, budget) / memory.max_num_blocks_for_budget(fp16, budget)
    assert abs(ratio - 128 / 68) < 1e-3


def test_refusals_at_construction():
    with pytest.raises(ValueError, match="kv_cache_dtype must be None"):
        oasr.CacheConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize(
    "dtype,value",
    [(torch.float16, 65000.0), (torch.float16, -65504.0), (torch.float32, 3.3e38), (torch.float32, -3.4028234e38),
     (torch.bfloat16, 3.3e38), (torch.bfloat16, 3.3895314e38)],
)  # fmt: skip
def test_values_near_the_model_dtype_max_dequantize_finite(twin, dtype, value):
    """fp16 65000 once got scale 256 and e4m3 256, 256 * 256 = 65536 > 65504: inf in attention and
    in get_stacked_cache (fp32/bf16 likewise from ~3.3e38). Under the amended rule the value saturates
    at L = 1.875 * 2**emax (61440 for fp16), in the paged path and the dense path of both twins."""
    twin = fp8_twin(twin)
    cfg = small_config(dtype=dtype, kv_cache_dtype="fp8_e4m3", num_layers=1)
    bound = saturation_bound(dtype)
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg)
    att.allocate_stream("paged")
    att.prepare_chunk("paged", 1)
    cache = att.get_paged_caches(["paged"])[0]
    x = torch.zeros(1, 1, cfg.n_kv_head, cfg.head_dim, dtype=dtype)
    x[..., 0] = value
    x[..., 1] = 1.0
    twin.append_kv(cache, x, x, [1])
    q = torch.zeros(1, 2 * cfg.n_kv_head, 1, cfg.head_dim, dtype=dtype)
    out = twin.paged_attention(q, cache, [1])  # one key: out is that V row, dequantized
    assert torch.isfinite(out).all()
    assert float(out[0, 0, 0, 0]) == math.copysign(bound, value)
    att.commit_chunk_paged("paged", 1)
    stacked = att.get_stacked_cache("paged")
    assert torch.isfinite(stacked).all() and float(stacked[0, 0, 0, 0]) == math.copysign(bound, value)

    att.allocate_stream("dense")
    kv = torch.zeros(1, cfg.n_kv_head, 2, 2 * cfg.head_dim, dtype=dtype)
    kv[..., 0] = value
    kv[..., cfg.head_dim] = value
    att.commit("dense", kv)
    stacked = att.get_stacked_cache("dense")
    assert torch.isfinite(stacked).all()
    assert float(stacked[0, 0, 0, 0]) == float(stacked[0, 0, 0, cfg.head_dim]) == math.copysign(bound, value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_saturation_changes_only_what_overflowed(dtype):
    """The clamp at L changes a stored byte or a scale only where the plain rule dequantized to inf:
    checked on every finite fp16 value and on the top 2**21 (fp32) / 2**14 (bf16) below their max."""
    if dtype is torch.float16:
        x = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)
    elif dtype is torch.bfloat16:
        x = torch.arange(0x7F80 - 0x4000, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    else:
        x = torch.arange(0x7F800000 - 0x200000, 0x7F800000, dtype=torch.int32).view(torch.float32)
    x = x.view(-1, 1)
    data, scale = quantize(x, dtype)
    a = x.double().abs().view(-1)  # the plain rule's scale, least 2**j with a / 2**j <= 448 (all normal here)
    plain_scale = torch.where(a > 0, torch.exp2(torch.ceil(torch.log2(a / 448.0))), 1.0)
    plain_scale = torch.where(a / plain_scale > 448.0, plain_scale * 2, plain_scale).float()
    assert (x.double().abs().view(-1) / plain_scale > 224.0).logical_or(a < 2.0**-100).all()
    plain = (x.float() / plain_scale[:, None]).to(FP8)
    assert torch.equal(scale, plain_scale)
    differs = data.view(torch.uint8) != plain.view(torch.uint8)
    assert torch.isinf(dequantize(plain, plain_scale, dtype)[differs]).all()
    assert differs.any()  # the top of the range did overflow before
    assert torch.isfinite(dequantize(data, scale, dtype)).all()
