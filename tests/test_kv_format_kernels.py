"""int8, q8_0 and affine4 pages in the kernels (host emulation) against the reference twin.

Append: the whole pool (data bytes and scale planes) bitwise equal to the reference's after the same
append, on a shuffled block table with 0x7F bytes and NaN scale planes everywhere (``to_format``), so
a write outside the chunk's slots shows. Gather: the dequantizing gather bitwise equal to the
reference pool's. Attention v1: against the reference on the *same* pages, both dequantizing to the
same fp32 values, so only the fp32 accumulation order differs and the floor of tests/test_fp8_kernels.py
applies (the format-against-model-dtype error is tests/test_kv_formats.py's and the bench's job).
"""

from __future__ import annotations

import random

import pytest
import torch

from oasr.fast import paged_ops as fast
from oasr.fast.kernels import ops
from oasr.fast.kernels.testing import bits, low_precision_bound, make_scenario, to_format, written_slots
from oasr.kv_formats import get_format
from oasr.reference import paged_ops as ref
from oasr.reference.block_pool import BlockPool as ReferenceBlockPool
from tests.conftest import small_config

FORMATS = ["int8", "q8_0", "affine4", "affine4_g64"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP32_FLOOR = 1e-5  # fp32 summation order (tests/test_fp8_kernels.py calibrates it)



def _geometry(seed: int, head_dim: int, dtype: torch.dtype, max_history: int = 100) -> dict:
    rng = random.Random(seed)
    return dict(batch=rng.randint(1, 3), n_kv_head=rng.choice([1, 2]), group=rng.choice([1, 2, 4]),
                num_frames=rng.randint(1, 20), head_dim=head_dim, block_size=rng.choice([8, 16, 24, 32]),
                max_history=rng.randint(0, max_history), dtype=dtype)


def _pool_bits(c):
    return [bits(t.contiguous()) if t.dtype.is_floating_point else t.view(torch.uint8)
            for t in (c.k_cache, c.v_cache, c.k_scale, c.v_scale)]


def _copy(c):
    from dataclasses import replace

    return replace(c, k_cache=c.k_cache.clone(), v_cache=c.v_cache.clone(), k_scale=c.k_scale.clone(),
                   v_scale=c.v_scale.clone())


CASES = [pytest.param(f, d, hd, id=f"{f}-{str(d).split('.')[-1]}-D{hd}") for f in FORMATS for d in DTYPES
         for hd in (64, 128)]


@pytest.mark.parametrize("fmt,dtype,head_dim", CASES)
def test_append_stores_the_reference_bytes(emu, fmt, dtype, head_dim):
    seed = 11 + head_dim + DTYPES.index(dtype)
    s = to_format(make_scenario(seed, **_geometry(seed, head_dim, dtype)), fmt)
    # exact ties for every rounding rule (amax 127: q8_0's d and int8's scale are 1), a zero vector and a
    # constant one (affine4: scale 0)
    s.k[0, 0] = (torch.arange(head_dim) % 16 - 7.5).to(dtype)
    s.k[0, 0, :, 0] = 127
    s.v[0, 0] = 0
    if s.k.shape[1] > 1:
        s.v[0, 1] = 0.75
    want, got = _copy(s.cache), _copy(s.cache)
    ref.append_kv(want, s.k, s.v, s.chunk_lens)
    fast.append_kv(got, s.k, s.v, s.chunk_lens, backend="emulated")
    for a, b in zip(_pool_bits(want), _pool_bits(got), strict=True):
        assert torch.equal(a, b)
    assert written_slots(s).any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_dequantizes_like_the_reference_pool(emu, fmt, dtype):
    cfg = small_config(head_dim=64, dtype=dtype, kv_cache_dtype=fmt, block_size_frames=8)
    pool = ReferenceBlockPool(cfg)
    g = torch.Generator().manual_seed(9)
    f = get_format(fmt)
    for target, scales in ((pool.k_pool, pool.k_scale), (pool.v_pool, pool.v_scale)):
        x = torch.randn(cfg.num_layers, target.shape[1], 8, cfg.n_kv_head, 64, generator=g).to(dtype) * 3
        data, scale = f.quantize(x, dtype)
        target.copy_(data)
        scales.copy_(scale)
    ids = [5, 2, 7]
    want = pool.gather_kv_blocks(ids, start=3, num_frames=17)
    got = fast.gather_kv_blocks(pool.k_pool, pool.v_pool, torch.tensor(ids, dtype=torch.int32), 3, 17,
                                k_scale=pool.k_scale, v_scale=pool.v_scale, out_dtype=dtype, kv_format=fmt,
                                backend="emulated")
    assert torch.equal(bits(got), bits(want))


def _check_attention(out, s, causal, scale=None):
    lens = s.chunk_lens
    ref32 = ref.paged_attention(s.q.float(), s.cache, lens, softmax_scale=scale, causal=causal)
    assert out.dtype == s.q.dtype and not out.isnan().any()
    if out.dtype == torch.float32:
        bound = FP32_FLOOR * (1 + ref32.abs())
    else:
        ref_lowp = ref.paged_attention(s.q, s.cache, lens, softmax_scale=scale, causal=causal)
        bound = low_precision_bound(ref32, ref_lowp, FP32_FLOOR)
    err = (out.float() - ref32).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}"
    for b, n in enumerate(lens.tolist()):
        assert (out[b, :, n:] == 0).all()


@pytest.mark.parametrize("fmt,dtype,head_dim", CASES)
def test_attention_v1_matches_reference_on_the_same_pages(emu, fmt, dtype, head_dim):
    seed = 200 + head_dim + 7 * DTYPES.index(dtype) + FORMATS.index(fmt)
    s = to_format(make_scenario(seed, **_geometry(seed, head_dim, dtype, max_history=200)), fmt)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)  # the chunk's own K/V, quantized, are in the range
    causal = seed % 2 == 1
    out = fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, backend="emulated")
    _check_attention(out, s, causal)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_v1_forced_splits(emu, fmt, num_splits):
    geo = _geometry(300 + num_splits, 64, torch.bfloat16, max_history=300)
    geo.update(batch=2, max_history=300)
    s = to_format(make_scenario(300 + num_splits, **geo), fmt)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = ops.paged_attention(emu, s.q, s.cache, s.chunk_lens, 64**-0.5, True, num_splits=num_splits)
    _check_attention(out, s, True)


def test_v2_refuses_these_pages_by_name(emu):
    s = to_format(make_scenario(3, **_geometry(3, 64, torch.float16)), "q8_0")
    assert not ops.v2_supports(s.cache, torch.float16, 64)
    with pytest.raises(ValueError, match="v2 takes fp16/bf16 queries with pages in that dtype or fp8"):
        ops.paged_attention(emu, s.q, s.cache, s.chunk_lens, 0.125, False, version="v2")


# ---- on a device (skipped without one; not yet run: no GPU was lent while this was written) ---------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_append_and_attention_match_the_reference(fmt, dtype, head_dim):
    seed = 500 + head_dim + FORMATS.index(fmt)
    s = to_format(make_scenario(seed, **_geometry(seed, head_dim, dtype, max_history=200)), fmt)
    want = _copy(s.cache)
    ref.append_kv(want, s.k, s.v, s.chunk_lens)
    d = s.to(device="cuda")
    fast.append_kv(d.cache, d.k, d.v, d.chunk_lens)  # the NVRTC kernels
    for a, b in zip(_pool_bits(want), _pool_bits(d.cache), strict=True):
        assert torch.equal(a, b.cpu())
    out = fast.paged_attention(d.q, d.cache, d.chunk_lens).cpu()
    s_after = type(s)(want, s.q, s.k, s.v, s.chunk_lens)
    _check_attention(out, s_after, False)
