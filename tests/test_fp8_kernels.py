"""fp8 (e4m3) pages in the fast twin: the kernels (host emulation) and the torch path, against the reference.

Two oracles. Stored bytes and scales are compared bitwise (uint8 / int32 views)
with the reference twin over the *whole* pool, and the written vectors also
with torch's own conversion, ``(x.float() / s).to(float8_e4m3fn)``, where ``s``
comes from ``scale_oracle`` below: a plain count over powers of two in float64
that shares no code with either twin. Attention is compared with the reference
on the *same* fp8 pages: both dequantize to the same fp32 values, so the only
difference is fp32 accumulation order, and the calibrated floor of the other
kernel tests applies (the fp8-against-fp32 error is tests/test_fp8.py's job).

Every case uses a shuffled block table, e4m3 NaN bytes (0x7f) in every pool
slot and NaN in every scale that the op must not read (``to_fp8`` in
oasr.fast.kernels.testing), chunk lengths including 0, and histories that start
inside a block.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oasr.fast import paged_ops as fast
from oasr.fast.kernels import emulation, ops, registry
from oasr.fast.kernels.testing import (
    bits,
    emulated_attention,
    low_precision_bound,
    make_scenario,
    to_fp8,
    v2_bound,
    with_abs_v,
    written_slots,
)
from oasr.reference import paged_ops as ref
from oasr.reference.block_pool import BlockPool as ReferenceBlockPool
from oasr.reference.fp8 import quantize
from tests.conftest import small_config

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [8, 16, 24, 32, 64]
# Same floor as tests/test_kernels_emulated.py (fp32 summation order; at most 2.1e-6 relative there).
# fp8 pages change only the tile load: the dequantized tile is an fp32 tile like any other. Measured
# on fp8 pages with fp32 queries (24 scenarios, D 64/128, causal or not, histories to 250): at most
# 1.3e-6 relative for the emulated kernels (1, 3 or the launcher's splits), 4e-7 for the torch path.
FP32_FLOOR = 1e-5

_MISSING = emulation.unavailable_reason()

BACKENDS = [
    "torch",
    pytest.param(
        "emulated", marks=pytest.mark.skipif(_MISSING is not None, reason=f"kernel emulation unavailable: {_MISSING}")
    ),
]


@pytest.fixture
def backend(request):
    """The CPU backend under test ("torch" or "emulated"; the latter builds the kernels once)."""
    if request.param == "emulated":
        request.getfixturevalue("emu")
    return request.param


def scale_oracle(amax: torch.Tensor) -> torch.Tensor:
    """Least 2**j (j >= -149) with amax / 2**j <= 448, by trying every j in float64; 1 for amax == 0."""
    a = amax.double().reshape(-1, 1)
    j = torch.arange(-149, 129, dtype=torch.float64)
    fits = a / torch.exp2(j) <= 448.0  # exact: a is an fp32 value, 2**j a power of two
    s = torch.exp2(j[fits.int().argmax(dim=1)])  # the first j that fits
    return torch.where(a[:, 0] == 0, 1.0, s).float().reshape(amax.shape)


def saturation_oracle(dtype: torch.dtype) -> float:
    """The largest value of 4 significant bits below ``dtype``'s largest finite (``15 * 2**(emax - 3)``),
    found by walking down from the max in float64: the clamp bound of the amended rule."""
    top = torch.finfo(dtype).max
    value = 2.0 ** math.floor(math.log2(top))
    step = value / 8  # 3 fraction bits
    while value + step <= top:
        value += step
    return value


def spread(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with each vector scaled by its own power of two, over most of the dtype's range (fp32 and bf16
    vectors reach denormal maxima, below 448 * 2**-149), one zero vector and one with a single value."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-20, 10) if x.dtype == torch.float16 else (-145, 120)
    e = torch.randint(lo, hi + 1, x.shape[:-1], generator=g)
    y = (x.float() * torch.exp2(e.double()).float().unsqueeze(-1)).to(x.dtype)
    flat = y.view(-1, y.shape[-1])
    flat[0] = 0.0
    if flat.shape[0] > 1:
        flat[1] = 0.0
        flat[1, -1] = -3.0
    return y


def written_vectors(s, k: torch.Tensor):
    """(chunk vectors written, their pool blocks, offsets): frames t < chunk_lens[b], in (b, t) order."""
    c = s.cache
    T = k.shape[1]
    valid = torch.arange(T)[None, :] < s.chunk_lens.long()[:, None]
    rows = torch.arange(k.shape[0])[:, None].expand(-1, T)[valid]
    pos = (c.cache_seqlens.long()[:, None] + torch.arange(T)[None, :])[valid]
    return valid, c.block_table[rows, pos // c.block_size].long(), pos % c.block_size


def _geometry(seed: int, head_dim: int, dtype: torch.dtype, max_history: int = 100, block_sizes=BLOCK_SIZES) -> dict:
    rng = random.Random(seed)
    return dict(
        batch=rng.randint(1, 3),
        n_kv_head=rng.choice([1, 2]),
        group=rng.choice([1, 2, 4]),
        num_frames=rng.randint(1, 20),
        head_dim=head_dim,
        block_size=rng.choice(block_sizes),
        max_history=rng.randint(0, max_history),
        dtype=dtype,
    )


def _cases(seeds: int):
    return [
        pytest.param(d, hd, seed, id=f"{str(d).split('.')[-1]}-D{hd}-s{seed}")
        for d in DTYPES
        for hd in (64, 128)
        for seed in range(seeds)
    ]


# -- append: bytes and scales ------------------------------------------------------------------------


def _check_append(s, got, want, k, v):
    """Whole pools bitwise against the reference; written vectors against torch; the rest untouched."""
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert torch.equal(bits(getattr(got.cache, name)), bits(getattr(want.cache, name))), name
    untouched = ~written_slots(s)
    for name in ("k_cache", "v_scale"):
        assert torch.equal(bits(getattr(got.cache, name))[untouched], bits(getattr(s.cache, name))[untouched])
    valid, blocks, offsets = written_vectors(s, k)
    bound = saturation_oracle(k.dtype)
    for x, data, scale in ((k, got.cache.k_cache, got.cache.k_scale), (v, got.cache.v_cache, got.cache.v_scale)):
        x = x[valid].float().clamp(-bound, bound)  # (N, Hkv, D), saturated as the rule says
        expect_scale = scale_oracle(x.abs().amax(dim=-1))
        assert torch.equal(scale[blocks, offsets], expect_scale)
        expect = (x / expect_scale.unsqueeze(-1)).to(FP8)
        assert torch.equal(data[blocks, offsets].view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype,head_dim,seed", _cases(4))
def test_append_matches_reference_and_torch_bitwise(backend, dtype, head_dim, seed):
    s = to_fp8(make_scenario(seed, **_geometry(seed, head_dim, dtype)))
    k, v = spread(s.k, seed), spread(s.v, seed + 1)
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, k, v, s.chunk_lens)
    fast.append_kv(got.cache, k, v, s.chunk_lens, backend=backend)
    _check_append(s, got, want, k, v)


def rounding_sweep() -> torch.Tensor:
    """Every positive e4m3 value, each midpoint between neighbours (ties go to even) and the fp32
    values just either side of it, both signs; packed into 64-wide vectors whose first value is
    448 so that the scale is 1 and the sweep values are converted as they are."""
    grid = torch.arange(1, 0x7F, dtype=torch.uint8).view(FP8).float()  # 2**-9 .. 448
    grid = torch.cat([torch.zeros(1), grid])
    mid = (grid[:-1] + grid[1:]) / 2  # exact in fp32
    values = torch.cat([grid, mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(1e3))])
    values = torch.cat([values, -values, torch.tensor([-0.0])])
    per_vector = 63
    n = -(-values.numel() // per_vector)
    padded = torch.cat([values, torch.zeros(n * per_vector - values.numel())]).view(n, per_vector)
    return torch.cat([torch.full((n, 1), 448.0), padded], dim=1)  # (n, 64)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_append_rounds_like_torch_on_every_e4m3_boundary(backend):
    sweep = rounding_sweep()
    vectors = torch.cat([sweep, sweep * 2.0**-130, sweep * 2.0**100])  # scales 1, 2**-130, 2**100
    n = vectors.shape[0]
    s = to_fp8(make_scenario(0, batch=2, n_kv_head=1, group=1, num_frames=n, head_dim=64, block_size=16,
                             max_history=20))  # fmt: skip
    assert int(s.chunk_lens[0]) == n  # row 0 writes the whole sweep (row 1 some of it, reversed)
    k = torch.stack([vectors, vectors.flip(0)]).view(2, n, 1, 64)
    v = -k
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, k, v, s.chunk_lens)
    fast.append_kv(got.cache, k, v, s.chunk_lens, backend=backend)
    _check_append(s, got, want, k, v)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize(
    "dtype,head_dim", [(torch.float32, 128), (torch.float16, 64)], ids=["float32-D128", "float16-D64"]
)
def test_append_many_vectors(backend, dtype, head_dim):
    # More vectors than the emulated grid has warps (32 CTAs x 4 warps, 1 or 4 vectors per warp), so
    # the kernel's grid-stride loop wraps; chunk lengths end mid-warp.
    s = to_fp8(make_scenario(9, batch=4, n_kv_head=2, group=1, num_frames=90, head_dim=head_dim, block_size=32,
                             max_history=70, dtype=dtype))  # fmt: skip
    k, v = spread(s.k, 9), spread(s.v, 10)
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, k, v, s.chunk_lens)
    fast.append_kv(got.cache, k, v, s.chunk_lens, backend=backend)
    _check_append(s, got, want, k, v)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_append_input_forms(backend):
    # A misaligned chunk is served (copied to an aligned one). A float64 chunk and k/v of different
    # dtypes are refused by both twins, before anything is written (they used to be widened silently).
    s = to_fp8(make_scenario(7, **_geometry(7, 64, torch.bfloat16)))
    storage = torch.empty(s.k.numel() + 1, dtype=torch.bfloat16)
    k_misaligned = storage[1:].view(s.k.shape)
    k_misaligned.copy_(s.k)
    assert k_misaligned.data_ptr() % 16 != 0
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, k_misaligned, s.v, s.chunk_lens)
    fast.append_kv(got.cache, k_misaligned, s.v, s.chunk_lens.tolist(), backend=backend)
    _check_append(s, got, want, k_misaligned, s.v)
    for k, v, message in ((s.k.double() / 3, s.v.double(), "k must be in a model dtype"),
                          (s.k, s.v.float() * 1e-3, "k and v dtypes differ")):
        for op, kwargs in ((ref.append_kv, {}), (fast.append_kv, {"backend": backend})):
            before = s.clone()
            with pytest.raises(ValueError, match=message):
                op(before.cache, k, v, s.chunk_lens, **kwargs)
            assert bits(before.cache.k_cache).equal(bits(s.cache.k_cache))


NEAR_MAX = {  # values at the top of each model dtype: the plain rule rounded most of them up to inf
    torch.float16: [65504.0, 65000.0, 63488.0, 63487.0, 62000.0, 61440.0, -65504.0, -64000.0],
    torch.float32: [3.4028234e38, 3.3e38, 3.2969e38, 3.25e38, 3.19e38, -3.4028234e38, 1e38, -3.3e38],
    torch.bfloat16: [3.3895314e38, 3.3e38, 3.2e38, 3.19e38, -3.3895314e38, 1e38, -3.3e38, 3.25e38],
}


def near_max_scenario(dtype: torch.dtype):
    """Two rows of 8 frames whose K/V vectors each hold one value from ``NEAR_MAX`` (the rest small),
    plus one K vector entirely at the top; NaN-poisoned fp8 pages. Returns ``(scenario, k, v)``."""
    s = to_fp8(make_scenario(3, batch=2, n_kv_head=2, group=2, num_frames=8, head_dim=64, block_size=16,
                             max_history=30, dtype=dtype))  # fmt: skip
    s.chunk_lens[:] = 8
    top = torch.tensor(NEAR_MAX[dtype], dtype=torch.float64).to(dtype)
    k, v = s.k.clone(), s.v.clone()
    for t in range(8):  # frame t: one near-max value in each vector (others stay small)
        k[:, t, :, t] = top[t]
        v[:, t, :, -1 - t] = top[-1 - t]
    k[1, 7] = top[0]  # a whole vector at the top: V keeps one near-max value per column, because the
    # kernel sums exp-weighted V rows before dividing (flash attention), and two fp32 values near
    # 3.3e38 overflow that sum with or without fp8; the plain rule made even one of them inf.
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    return s, k, v


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_append_saturates_near_the_model_dtype_max(backend, dtype):
    # A regression: fp16 65000 was stored as 256 * scale 256 = 65536, inf in fp16 (fp32/bf16 from ~3.3e38).
    # Amended rule: clamp to L first. Bytes still equal torch's conversion of the clamped values, and
    # every written vector, the gather and attention over those pages are finite in the model dtype.
    s, k, v = near_max_scenario(dtype)
    top = torch.tensor(NEAR_MAX[dtype], dtype=torch.float64).to(dtype)
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, k, v, s.chunk_lens)
    fast.append_kv(got.cache, k, v, s.chunk_lens, backend=backend)
    _check_append(s, got, want, k, v)
    valid, blocks, offsets = written_vectors(s, k)
    for data, scale in ((got.cache.k_cache, got.cache.k_scale), (got.cache.v_cache, got.cache.v_scale)):
        restored = (data[blocks, offsets].float() * scale[blocks, offsets].unsqueeze(-1)).to(dtype)
        assert torch.isfinite(restored).all()
    c = got.cache
    for b in range(2):  # gather the row's new frames: dequantized into the model dtype, finite
        start = int(c.cache_seqlens[b])
        ids = c.block_table[b].contiguous()
        out = fast.gather_kv_blocks(c.k_cache[None], c.v_cache[None], ids, start, 8, k_scale=c.k_scale[None],
                                    v_scale=c.v_scale[None], out_dtype=dtype, backend=backend)  # fmt: skip
        assert torch.isfinite(out).all() and out.abs().max() >= 0.9 * float(top.float().abs().max()) / 1.1
    q = torch.zeros_like(s.q)  # uniform weights: out is a mean of V rows, so at most L, never inf
    out = fast.paged_attention(q, c, s.chunk_lens, backend=backend)
    assert torch.isfinite(out).all()
    assert torch.isfinite(ref.paged_attention(q, want.cache, s.chunk_lens)).all()


# -- attention on fp8 pages --------------------------------------------------------------------------


def _check_attention(out, s, causal, scale=None, version="v1"):
    """``out`` (model dtype) against the reference on the same fp8 pages: fp32 queries give the fp32
    result, the model-dtype queries its own rounding (see low_precision_bound); v2 also rounds P to
    bf16 for its P V, v3 to f16 after a per-row power-of-two rescale (both held to v2_bound)."""
    lens = s.chunk_lens
    ref32 = ref.paged_attention(s.q.float(), s.cache, lens, softmax_scale=scale, causal=causal)
    assert out.dtype == s.q.dtype and not out.isnan().any()
    if version in ("v2", "v3"):
        ref_abs_v = ref.paged_attention(s.q.float(), with_abs_v(s.cache), lens, softmax_scale=scale, causal=causal)
        bound = v2_bound(ref32, ref_abs_v, out.dtype, True, FP32_FLOOR)
    elif out.dtype == torch.float32:
        bound = FP32_FLOOR * (1 + ref32.abs())
    else:
        ref_lowp = ref.paged_attention(s.q, s.cache, lens, softmax_scale=scale, causal=causal)
        bound = low_precision_bound(ref32, ref_lowp, FP32_FLOOR)
    err = (out.float() - ref32).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}"
    for b, n in enumerate(lens.tolist()):
        assert (out[b, :, n:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype,head_dim,seed", _cases(6))
def test_attention_matches_reference_on_the_same_pages(backend, dtype, head_dim, seed):
    s = to_fp8(make_scenario(100 + seed, **_geometry(100 + seed, head_dim, dtype, max_history=250)))
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)  # the chunk's own K/V, quantized, are in the range
    causal = seed % 2 == 1
    scale = 0.3 if seed >= 4 else None
    out = fast.paged_attention(s.q, s.cache, s.chunk_lens, softmax_scale=scale, causal=causal, backend=backend)
    _check_attention(out, s, causal, scale)


V2_CASES = [
    pytest.param(d, hd, seed, id=f"{str(d).split('.')[-1]}-D{hd}-s{seed}")
    for d in (torch.float16, torch.bfloat16)
    for hd in (64, 128)
    for seed in range(4)
]


@pytest.mark.parametrize("version", ["v2", "v3"])
@pytest.mark.parametrize("dtype,head_dim,seed", V2_CASES)
def test_attention_tensor_core_matches_reference_on_the_same_pages(emu, dtype, head_dim, seed, version):
    # The tensor-core kernels on fp8 pages: bytes widened in shared memory (v2) or in registers after
    # ldmatrix (v3), scales folded into S and P.
    geo = _geometry(400 + seed, head_dim, dtype, max_history=250, block_sizes=list(registry.V2_BLOCK_SIZES))
    s = to_fp8(make_scenario(400 + seed, **geo))
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    causal = seed % 2 == 1
    scale = 0.3 if seed >= 2 else None
    out = emulated_attention(version, s.q, s.cache, s.chunk_lens, softmax_scale=scale, causal=causal)
    _check_attention(out, s, causal, scale, version=version)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype,head_dim,causal", [(torch.bfloat16, 128, True), (torch.float16, 64, False)],
                         ids=["bfloat16-D128-causal", "float16-D64"])  # fmt: skip
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_attention_tensor_core_forced_splits(emu, dtype, head_dim, causal, num_splits, version):
    geo = _geometry(300 + num_splits, head_dim, dtype, max_history=300, block_sizes=list(registry.V2_BLOCK_SIZES))
    geo.update(batch=2, max_history=300)
    s = to_fp8(make_scenario(300 + num_splits, **geo))
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = emulated_attention(version, s.q, s.cache, s.chunk_lens, causal=causal, num_splits=num_splits)
    _check_attention(out, s, causal, version=version)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_attention_tensor_core_empty_rows_write_zeros(emu, version):
    s = to_fp8(make_scenario(5, batch=3, n_kv_head=2, group=2, num_frames=6, head_dim=128, block_size=8,
                             max_history=40, dtype=torch.float16))  # fmt: skip
    s.chunk_lens[:] = torch.tensor([0, 6, 0], dtype=torch.int32)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = emulated_attention(version, s.q, s.cache, s.chunk_lens)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    _check_attention(out, s, False, version=version)


# v3 runs both mma in f16 on fp8 pages (paged_chunk_attention_v3.cu, "fp8 pages"): bf16 queries are
# rescaled per row by a power of two before their f16 rounding, and P' = p * v_scale is kept in units of a
# per-row power of two. Powers of two then pass through exactly: scaling q, the k scales and the v scales
# by powers of two (softmax_scale compensating) scales the output by the same power, bit for bit. A plain
# f16 rounding of q (2^-40 flushes, 2^30 overflows) or of p * v_scale (2^-40 flushes) cannot.
F16_SHIFTS = [  # (dtype, q, k scales, v scales): powers of two
    pytest.param(torch.bfloat16, -40, 16, -40, id="bfloat16-small"),
    pytest.param(torch.bfloat16, 30, -20, 20, id="bfloat16-large"),
    # f16 queries go in as they are; v stays (an f16 out scaled by 2^k rounds differently where subnormal)
    pytest.param(torch.float16, 0, 16, 0, id="float16"),
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype,q_shift,k_shift,v_shift", F16_SHIFTS)
def test_attention_v3_fp8_scales_by_powers_of_two_exactly(emu, dtype, q_shift, k_shift, v_shift, head_dim):
    s = to_fp8(make_scenario(610 + head_dim, batch=3, n_kv_head=2, group=2, num_frames=9, head_dim=head_dim,
                             block_size=16, max_history=180, dtype=dtype))  # fmt: skip
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    base = emulated_attention("v3", s.q, s.cache, s.chunk_lens, causal=True, num_splits=2)
    _check_attention(base, s, True, version="v3")
    cache = replace(s.cache, k_scale=s.cache.k_scale * 2.0**k_shift, v_scale=s.cache.v_scale * 2.0**v_shift)
    q = s.q * 2.0**q_shift
    scale = head_dim**-0.5 * 2.0 ** -(q_shift + k_shift)
    out = emulated_attention("v3", q, cache, s.chunk_lens, softmax_scale=scale, causal=True, num_splits=2)
    assert torch.equal(bits(out), bits(base * 2.0**v_shift)), (out.float() - base.float() * 2.0**v_shift).abs().max()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_v3_fp8_keeps_precision_beside_a_large_key_it_does_not_see(emu, head_dim):
    # The last key of each chunk gets a v scale 2^30 times its own: only the chunk's last frame sees it
    # (causal). A unit for P' taken from the largest v scale among the keys read (not from p * v_scale)
    # would flush every other row's weights below f16's range; v3's per-row unit keeps them.
    s = to_fp8(make_scenario(620 + head_dim, batch=3, n_kv_head=2, group=2, num_frames=9, head_dim=head_dim,
                             block_size=16, max_history=180, dtype=torch.bfloat16))  # fmt: skip
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    c = s.cache
    v_scale = c.v_scale.clone()
    for b, n in enumerate(s.chunk_lens.tolist()):
        if n > 1:
            pos = int(c.cache_seqlens[b]) + n - 1
            v_scale[int(c.block_table[b, pos // c.block_size]), pos % c.block_size] *= 2.0**30
    s = replace(s, cache=replace(c, v_scale=v_scale))
    out = emulated_attention("v3", s.q, s.cache, s.chunk_lens, causal=True)
    _check_attention(out, s, True, version="v3")


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize(
    "dtype,head_dim,causal",
    [(torch.float32, 64, False), (torch.bfloat16, 128, True), (torch.float16, 64, False)],
    ids=["float32-D64", "bfloat16-D128-causal", "float16-D64"],
)
def test_attention_forced_splits(emu, dtype, head_dim, causal, num_splits):
    # Long histories over few CTAs: the split path and its combine, whatever the launcher would choose.
    geo = _geometry(300 + num_splits, head_dim, dtype, max_history=300)
    geo.update(batch=2, max_history=300)
    s = to_fp8(make_scenario(300 + num_splits, **geo))
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = ops.paged_attention(emu, s.q, s.cache, s.chunk_lens, head_dim**-0.5, causal, num_splits=num_splits)
    _check_attention(out, s, causal)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_attention_empty_rows_write_zeros(backend):
    s = to_fp8(make_scenario(5, batch=3, n_kv_head=2, group=2, num_frames=6, head_dim=128, block_size=8,
                             max_history=40, dtype=torch.float16))  # fmt: skip
    s.chunk_lens[:] = torch.tensor([0, 6, 0], dtype=torch.int32)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = fast.paged_attention(s.q, s.cache, s.chunk_lens, backend=backend)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    _check_attention(out, s, False)


# -- gather: dequantized, bitwise against the reference pool ------------------------------------------


def fp8_pool(seed: int, dtype: torch.dtype, head_dim: int, block_size: int):
    """A reference fp8 BlockPool with NaN bytes and NaN scales everywhere except the gathered frames."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cfg = small_config(num_layers=rng.randint(1, 3), n_kv_head=rng.randint(1, 2), head_dim=head_dim,
                       block_size_frames=block_size, chunk_size=block_size, num_left_chunks=-1, max_num_blocks=12,
                       max_batch_size=1, max_blocks_per_seq=12, dtype=dtype, kv_cache_dtype="fp8_e4m3")  # fmt: skip
    pool = ReferenceBlockPool(cfg)
    NB = pool.k_pool.shape[1]
    n_blocks = rng.randint(1, 4)
    ids = torch.randperm(NB, generator=g)[:n_blocks].to(torch.int32)
    start = rng.randint(0, n_blocks * block_size - 1)
    T = rng.randint(0, n_blocks * block_size - start)
    for data, scale in ((pool.k_pool, pool.k_scale), (pool.v_pool, pool.v_scale)):
        data.view(torch.uint8).fill_(0x7F)
        scale.fill_(float("nan"))
        pos = start + torch.arange(T)
        blocks, offs = ids[pos // block_size].long(), pos % block_size
        x = spread(torch.randn(cfg.num_layers, T, cfg.n_kv_head, head_dim, generator=g).to(dtype), seed)
        data[:, blocks, offs], scale[:, blocks, offs] = quantize(x)  # the reference's rule sets up the pool
    return pool, ids, start, T


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype,head_dim,seed", _cases(3))
def test_gather_dequantizes_like_the_reference_pool(backend, dtype, head_dim, seed):
    pool, ids, start, T = fp8_pool(seed, dtype, head_dim, BLOCK_SIZES[seed % len(BLOCK_SIZES)])
    want = pool.gather_kv_blocks(ids.tolist(), start, T)
    out = torch.full(want.shape, float("nan"), dtype=dtype)
    got = fast.gather_kv_blocks(pool.k_pool, pool.v_pool, ids, start, T, out=out, k_scale=pool.k_scale,
                                v_scale=pool.v_scale, backend=backend)  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(bits(got), bits(want))
    assert not got.isnan().any()
    fresh = fast.gather_kv_blocks(pool.k_pool, pool.v_pool, ids, start, T, k_scale=pool.k_scale,
                                  v_scale=pool.v_scale, out_dtype=dtype, backend=backend)  # fmt: skip
    assert torch.equal(bits(fresh), bits(want))


# -- refusals ----------------------------------------------------------------------------------------


def test_check_fp8_supported_names_head_dim_and_the_supported_set():
    for device, backend in (("cpu", "emulated"), ("cuda", None)):  # choosing a backend needs no GPU
        with pytest.raises(ValueError, match=r"head_dim in \(64, 128\), got head_dim=96"):
            fast.check_fp8_supported(96, device, backend=backend)
        with pytest.raises(ValueError, match="model dtype"):
            fast.check_fp8_supported(64, device, dtype=torch.float64, backend=backend)
        fast.check_fp8_supported(128, device, dtype=torch.bfloat16, backend=backend)
    fast.check_fp8_supported(96, "cpu", dtype=torch.float64, backend="torch")  # vectorised torch: any geometry


def test_check_fp8_supported_follows_the_default_backend(monkeypatch):
    monkeypatch.setenv("OASR_CPU_BACKEND", "emulated")
    with pytest.raises(ValueError, match="head_dim=32"):
        fast.check_fp8_supported(32, "cpu")
    monkeypatch.setenv("OASR_CPU_BACKEND", "torch")
    fast.check_fp8_supported(32, "cpu")


def test_ops_refuse_what_the_fp8_kernels_cannot_tile():
    s = to_fp8(make_scenario(2, batch=2, n_kv_head=1, group=1, num_frames=4, head_dim=32, block_size=4,
                             max_history=8))  # fmt: skip
    message = r"'emulated' kernels tile head_dim in \(64, 128\), got head_dim=32"
    with pytest.raises(ValueError, match=message):
        fast.append_kv(s.cache, s.k, s.v, backend="emulated")
    with pytest.raises(ValueError, match=message):
        fast.paged_attention(s.q, s.cache, backend="emulated")
    k_pool, v_pool = s.cache.k_cache[None], s.cache.v_cache[None]
    k_scale, v_scale = s.cache.k_scale[None], s.cache.v_scale[None]
    ids = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        fast.gather_kv_blocks(k_pool, v_pool, ids, 0, 1, k_scale=k_scale, v_scale=v_scale, out_dtype=torch.float32,
                              backend="emulated")  # fmt: skip


def test_gather_refuses_inconsistent_scale_arguments():
    s = to_fp8(make_scenario(2, batch=1, n_kv_head=1, group=1, num_frames=4, head_dim=64, block_size=4,
                             max_history=8))  # fmt: skip
    k_pool, v_pool = s.cache.k_cache[None], s.cache.v_cache[None]
    k_scale, v_scale = s.cache.k_scale[None], s.cache.v_scale[None]
    ids = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        fast.gather_kv_blocks(k_pool, v_pool, ids, 0, 1, k_scale=k_scale, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="model dtype"):
        fast.gather_kv_blocks(k_pool, v_pool, ids, 0, 1, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="k_scale must be"):
        fast.gather_kv_blocks(k_pool, v_pool, ids, 0, 1, k_scale=k_scale[:, :1], v_scale=v_scale,
                              out_dtype=torch.float32)  # fmt: skip
    plain = torch.zeros(1, 4, 4, 1, 64)
    with pytest.raises(ValueError, match="not torch.float8_e4m3fn"):
        fast.gather_kv_blocks(plain, plain, ids, 0, 1, k_scale=k_scale, v_scale=v_scale, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="copied, not converted"):
        fast.gather_kv_blocks(plain, plain, ids, 0, 1, out_dtype=torch.float16)


# -- the torch path over many geometries (no emulation: hypothesis can afford many) --------------------

geometries = st.fixed_dictionaries(
    dict(
        batch=st.integers(1, 5),
        n_kv_head=st.integers(1, 3),
        group=st.sampled_from([1, 2, 3, 4]),
        num_frames=st.integers(1, 24),
        head_dim=st.sampled_from([8, 32, 64, 80, 128]),
        block_size=st.sampled_from([1, 3, 8, 16, 24, 32, 64]),
        max_history=st.integers(0, 200),
        dtype=st.sampled_from(DTYPES),
    )
)
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(geo=geometries, seed=st.integers(0, 2**16), causal=st.booleans())
def test_torch_path_append_and_attention(geo, seed, causal):
    s = to_fp8(make_scenario(seed, **geo))
    k, v = spread(s.k, seed), s.v
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, k, v, s.chunk_lens)
    fast.append_kv(got.cache, k, v, s.chunk_lens, backend="torch")
    _check_append(s, got, want, k, v)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, backend="torch")
    _check_attention(out, s, causal)
