"""The CUDA kernels, run on the CPU by the SIMT emulator, against the reference.

Same `.cu` sources as the GPU build (see oasr/kernels_cu/emu/simt_emu.h for what the
emulator can and cannot show). Every case uses a shuffled block table and a
pool poisoned with NaN wherever the op must not read; append is compared
bitwise over the whole pool, gather bitwise over its whole output, attention
against the fp32 reference with the calibrated bounds below. Geometries are
small (emulated blocks run one after another on real threads) but many.
"""

from __future__ import annotations

import random

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
    v2_bound,
    with_abs_v,
    written_slots,
)
from oasr.reference import paged_ops as ref

try:
    emulation.emulation_toolchain()
    _MISSING = None
except emulation.EmulationUnavailable as exc:  # say exactly what is missing
    _MISSING = str(exc)

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"kernel emulation unavailable: {_MISSING}")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [8, 16, 24, 32, 64]
V2_DTYPES = [torch.float16, torch.bfloat16]  # v2 and v3 (tensor cores) serve 16-bit dtypes and these block sizes
V2_BLOCK_SIZES = list(registry.V2_BLOCK_SIZES)
TENSOR_CORE = ("v2", "v3")

# fp32 kernels against the fp32 reference: the only difference is summation
# order (keys tiled by 32, online rescaling, exp2 with a folded log2(e)). The
# largest difference measured over 48 such cases (D 64/128, causal or not, 1 or
# 3 splits, histories to 250) was 2.1e-6 relative on outputs of size ~1;
# 1e-5 * (1 + |ref|) leaves a 5x margin and is still ~100x below one fp16 ulp.
FP32_FLOOR = 1e-5


@pytest.fixture(scope="module")
def emu():
    executor = emulation.executor()
    executor.load_all()  # one parallel g++ build per session (cached on disk)
    return executor


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


# -- the emulator itself -------------------------------------------------------------------------


def test_emulator_builtins(tmp_path):
    # Shuffles (xor / down / idx), __shared__ and __syncthreads on a 3-block grid
    # of 96-thread blocks, against torch sums of small integers (exact in any order).
    import ctypes
    import subprocess

    cxx, include = emulation.emulation_toolchain()
    shim = tmp_path / "selftest.cpp"
    shim.write_text(
        '#include "emu/selftest.cu"\n'
        'extern "C" void run(unsigned grid, unsigned block, const float* in, float* a, float* b, float* c,'
        " float* d) {\n"
        "    oasr_emu::launch(dim3(grid), dim3(block),\n"
        "                     [&] { oasr_emu::invoke(&emu_selftest_kernel, in, a, b, c, d); });\n"
        "}\n"
    )
    lib = tmp_path / "selftest.so"
    cmd = [cxx, *emulation.CXX_FLAGS, f"-I{emulation.registry.KERNELS_DIR}", f"-I{include}", str(shim), "-o", str(lib)]
    subprocess.run(cmd, check=True)
    grid, block = 3, 96
    x = torch.randint(-50, 50, (grid * block,)).float()
    xor_sum, down_sum, bcast = (torch.full_like(x, float("nan")) for _ in range(3))
    block_sum = torch.full((grid,), float("nan"))
    run = ctypes.CDLL(str(lib)).run
    run.argtypes = [ctypes.c_uint, ctypes.c_uint] + [ctypes.c_void_p] * 5
    run(grid, block, *(t.data_ptr() for t in (x, xor_sum, down_sum, bcast, block_sum)))

    warps = x.view(-1, 32)
    assert torch.equal(xor_sum.view(-1, 32), warps.sum(1, keepdim=True).expand(-1, 32))
    assert torch.equal(down_sum.view(-1, 32)[:, 0], warps.sum(1))
    # Past the warp's end shfl_down returns the caller's own value (CUDA's rule),
    # so lane 31 doubles its value at each of the 5 steps.
    assert torch.equal(down_sum.view(-1, 32)[:, 31], 32 * warps[:, 31])
    assert torch.equal(bcast.view(-1, 32), warps[:, 3:4].expand(-1, 32))
    assert torch.equal(block_sum, x.view(grid, block).sum(1))


# -- append ----------------------------------------------------------------------------------------


def _cases(head_dims, seeds):
    return [
        pytest.param(d, hd, seed, id=f"{str(d).split('.')[-1]}-D{hd}-s{seed}")
        for d in DTYPES
        for hd in head_dims
        for seed in range(seeds)
    ]


APPEND_CASES = _cases((64, 128), 2)


@pytest.mark.parametrize("dtype,head_dim,seed", APPEND_CASES)
def test_append_matches_reference_bitwise(emu, dtype, head_dim, seed):
    s = make_scenario(seed, **_geometry(seed, head_dim, dtype))
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, s.k, s.v, s.chunk_lens)
    fast.append_kv(got.cache, s.k, s.v, s.chunk_lens, backend="emulated")
    # Whole pool, bitwise: what was written and every untouched (NaN) byte.
    assert torch.equal(bits(got.cache.k_cache), bits(want.cache.k_cache))
    assert torch.equal(bits(got.cache.v_cache), bits(want.cache.v_cache))
    untouched = ~written_slots(s)
    assert torch.equal(bits(got.cache.k_cache)[untouched], bits(s.cache.k_cache)[untouched])


def test_append_two_byte_units_and_refused_cast(emu):
    # A misaligned chunk forces the 2-byte copy path. An fp32 chunk into a bf16 pool is refused by
    # both twins alike (never cast silently), before anything is written.
    s = make_scenario(7, **_geometry(7, 64, torch.bfloat16))
    k32 = torch.randn(s.k.shape)
    storage = torch.empty(k32.numel() + 1, dtype=torch.bfloat16)
    k_misaligned = storage[1:].view(s.k.shape)
    k_misaligned.copy_(k32)
    assert k_misaligned.data_ptr() % 16 != 0
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, k_misaligned, k32.bfloat16(), s.chunk_lens)
    fast.append_kv(got.cache, k_misaligned, k32.bfloat16(), s.chunk_lens, backend="emulated")
    assert torch.equal(bits(got.cache.k_cache), bits(want.cache.k_cache))
    assert torch.equal(bits(got.cache.v_cache), bits(want.cache.v_cache))
    message = "v must be torch.bfloat16, the pool's dtype, got torch.float32"
    for op, kwargs in ((ref.append_kv, {}), (fast.append_kv, {"backend": "emulated"})):
        untouched = s.clone()
        with pytest.raises(ValueError, match=message):
            op(untouched.cache, k_misaligned, k32, s.chunk_lens, **kwargs)
        assert torch.equal(bits(untouched.cache.v_cache), bits(s.cache.v_cache))


def test_append_default_chunk_lens(emu):
    s = make_scenario(3, **_geometry(3, 64, torch.float16))
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, s.k, s.v)
    fast.append_kv(got.cache, s.k, s.v, backend="emulated")
    assert torch.equal(bits(got.cache.k_cache), bits(want.cache.k_cache))


# -- attention -------------------------------------------------------------------------------------

ATTN_CASES = [pytest.param("v1", *p.values, id=f"v1-{p.id}") for p in _cases((64, 128), 6)] + [
    pytest.param(v, d, hd, seed, id=f"{v}-{str(d).split('.')[-1]}-D{hd}-s{seed}")
    for v in TENSOR_CORE
    for d in V2_DTYPES
    for hd in (64, 128)
    for seed in range(6)
]


def _check_attention(out, s_lowp, s32, causal, scale=None, version="v1"):
    """out (kernel, pool dtype) against the fp32 reference on the same numbers.

    v1 computes in fp32 and rounds once (low_precision_bound); v2 and v3 also
    round P for their tensor-core P V (v2_bound: that rounding's worst case,
    from the reference run on |V|)."""
    lens = s32.chunk_lens
    ref32 = ref.paged_attention(s32.q, s32.cache, lens, softmax_scale=scale, causal=causal)
    assert not out.isnan().any()
    if version in TENSOR_CORE:
        ref_abs_v = ref.paged_attention(s32.q, with_abs_v(s32.cache), lens, softmax_scale=scale, causal=causal)
        bound = v2_bound(ref32, ref_abs_v, out.dtype, False, FP32_FLOOR)
    elif out.dtype == torch.float32:
        bound = FP32_FLOOR * (1 + ref32.abs())
    else:
        ref_lowp = ref.paged_attention(s_lowp.q, s_lowp.cache, lens, softmax_scale=scale, causal=causal)
        bound = low_precision_bound(ref32, ref_lowp, FP32_FLOOR)
    err = (out.float() - ref32).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}, at {(err - bound).argmax()}"
    for b, n in enumerate(lens.tolist()):  # queries past a row's chunk: exact zeros
        assert (out[b, :, n:] == 0).all()


@pytest.mark.parametrize("version,dtype,head_dim,seed", ATTN_CASES)
def test_attention_matches_reference(emu, version, dtype, head_dim, seed):
    blocks = V2_BLOCK_SIZES if version in TENSOR_CORE else BLOCK_SIZES
    s = make_scenario(100 + seed, **_geometry(100 + seed, head_dim, dtype, block_sizes=blocks))
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)  # the chunk's own K/V are part of the range
    s32 = s.to(torch.float32)
    causal = seed % 2 == 1
    scale = None if seed < 4 else 0.3
    out = emulated_attention(version, s.q, s.cache, s.chunk_lens, softmax_scale=scale, causal=causal)
    _check_attention(out, s, s32, causal, scale, version)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize(
    "version,dtype,causal",
    [
        ("v1", torch.float32, False),
        ("v1", torch.bfloat16, True),
        ("v1", torch.float16, False),
        ("v2", torch.bfloat16, True),
        ("v2", torch.float16, False),
        ("v3", torch.bfloat16, True),
        ("v3", torch.float16, False),
    ],
    ids=["v1-float32", "v1-bfloat16-causal", "v1-float16", "v2-bfloat16-causal", "v2-float16", "v3-bfloat16-causal",
         "v3-float16"],
)
def test_attention_forced_splits(emu, version, dtype, causal, num_splits):
    # Long histories over few CTAs: the split path and its combine, whatever
    # the launcher would have chosen.
    blocks = V2_BLOCK_SIZES if version in TENSOR_CORE else BLOCK_SIZES
    geo = _geometry(200 + num_splits, 64, dtype, max_history=300, block_sizes=blocks)
    geo.update(batch=2, max_history=300)
    s = make_scenario(200 + num_splits, **geo)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = emulated_attention(version, s.q, s.cache, s.chunk_lens, causal=causal, num_splits=num_splits)
    _check_attention(out, s, s.to(torch.float32), causal, version=version)


@pytest.mark.parametrize("version,dtype", [("v1", torch.float32), ("v2", torch.bfloat16), ("v3", torch.bfloat16)])
def test_attention_stale_max_span_never_drops_keys(emu, version, dtype):
    # The launcher sizes splits from the host-side max_span. If it is too small,
    # the last split still runs to the end of each row's range.
    from dataclasses import replace

    s = make_scenario(11, batch=1, n_kv_head=1, group=2, num_frames=8, head_dim=64, block_size=16,
                      max_history=200, dtype=dtype)  # fmt: skip
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    stale = replace(s.cache, max_span=1)
    out = emulated_attention(version, s.q, stale, s.chunk_lens, softmax_scale=0.125, num_splits=4)
    _check_attention(out, s, s.to(torch.float32), False, 0.125, version)


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_attention_empty_rows_write_zeros(emu, version):
    # chunk_len 0, an empty range (seqstart == seqlen, chunk 0), and causal rows.
    s = make_scenario(5, batch=3, n_kv_head=2, group=2, num_frames=6, head_dim=128, block_size=8,
                      max_history=40, dtype=torch.float16)  # fmt: skip
    s.chunk_lens[:] = torch.tensor([0, 6, 0], dtype=torch.int32)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = emulated_attention(version, s.q, s.cache, s.chunk_lens)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    _check_attention(out, s, s.to(torch.float32), False, version=version)


@pytest.mark.parametrize("version,dtype", [("v1", torch.float32), ("v2", torch.float16), ("v3", torch.float16)])
def test_attention_strided_table_and_chunk_lens_forms(emu, version, dtype):
    # A table that is a column slice of a wider one (row stride > W), and
    # chunk_lens given as a list and as None.
    from dataclasses import replace

    s = make_scenario(21, batch=3, n_kv_head=2, group=2, num_frames=8, head_dim=64, block_size=16,
                      max_history=60, dtype=dtype)  # fmt: skip
    s.chunk_lens.fill_(8)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    table = s.cache.block_table
    wide = torch.full((table.shape[0], table.shape[1] + 5), -7, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    strided = replace(s.cache, block_table=wide[:, : table.shape[1]])
    assert strided.block_table.stride(0) != strided.block_table.shape[1]
    for lens in (s.chunk_lens.tolist(), None):
        out = emulated_attention(version, s.q, strided, lens)
        _check_attention(out, s, s.to(torch.float32), False, version=version)


@pytest.mark.parametrize("version", TENSOR_CORE)
def test_tensor_core_rows_past_their_length_are_zero_despite_nan_in_visible_v(emu, version):
    # Queries t >= len see no key; v2 and v3 must write exact zeros there even when V
    # holds NaN and Inf inside the visible range (p = 0 times NaN is NaN, so the
    # kernel has to select zero, not multiply by it). Causal rows too.
    s = make_scenario(31, batch=2, n_kv_head=2, group=2, num_frames=8, head_dim=64, block_size=16,
                      max_history=50, dtype=torch.bfloat16)  # fmt: skip
    s.chunk_lens[:] = torch.tensor([3, 5], dtype=torch.int32)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    c = s.cache
    for b in range(2):  # poison one visible V vector per row: the first frame of the chunk
        pos = int(c.cache_seqlens[b])
        c.v_cache[c.block_table[b, pos // 16].long(), pos % 16, 0, :2] = torch.tensor([float("nan"), float("inf")])
    for causal in (False, True):
        want = ref.paged_attention(s.q, c, s.chunk_lens, causal=causal)
        got = emulated_attention(version, s.q, c, s.chunk_lens, causal=causal)
        for b, n in enumerate(s.chunk_lens.tolist()):
            assert (got[b, :, n:] == 0).all() and (want[b, :, n:] == 0).all()
            # rows inside the length attend to the NaN: NaN exactly where the reference has it
            assert torch.equal(got[b, :, :n].isnan(), want[b, :, :n].isnan())


@pytest.mark.parametrize("version", TENSOR_CORE)
def test_tensor_core_long_range(emu, version):
    # One CTA over more keys than v2's shared block-table window holds (128 entries x block 8 = 1024
    # keys; v3 reads the table per tile), in one split and with the last split running long (stale max_span).
    from dataclasses import replace

    s = make_scenario(16, batch=1, n_kv_head=1, group=2, num_frames=4, head_dim=64, block_size=8,
                      max_history=1400, dtype=torch.float16, with_seqstarts=False)  # fmt: skip
    assert int(s.cache.cache_seqlens[0]) > 1100  # the precondition this test is about
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    for cache, splits in ((s.cache, 1), (replace(s.cache, max_span=1), 3)):
        out = emulated_attention(version, s.q, cache, s.chunk_lens, num_splits=splits)
        _check_attention(out, s, s.to(torch.float32), False, version=version)


def test_attention_version_choice_and_refusals(emu):
    s = make_scenario(1, batch=1, n_kv_head=1, group=1, num_frames=2, head_dim=64, block_size=24, max_history=8,
                      dtype=torch.float16)  # fmt: skip

    class Cuda:  # only the executor's kind matters to the choice
        kind = "cuda"

    assert ops.choose_attention_version(emu, s.cache, torch.float16, 64) == "v1"  # the emulator: v1 unless asked
    assert ops.choose_attention_version(Cuda, s.cache, torch.float16, 64) == "v1"  # block 24: no v2 instance
    s16 = make_scenario(1, batch=1, n_kv_head=1, group=1, num_frames=2, head_dim=64, block_size=16, max_history=8,
                        dtype=torch.float16)  # fmt: skip
    assert ops.choose_attention_version(Cuda, s16.cache, torch.float16, 64) == ops.CUDA_ATTENTION_VERSION == "v3"
    s32 = s16.to(torch.float32)
    assert ops.choose_attention_version(Cuda, s32.cache, torch.float32, 64) == "v1"  # fp32 pools stay on v1
    with pytest.raises(ValueError, match="block_size in"):
        ops.paged_attention(emu, s.q, s.cache, None, 0.125, False, version="v2")
    with pytest.raises(ValueError, match="block_size in"):
        ops.paged_attention(emu, s.q, s.cache, None, 0.125, False, version="v3")
    with pytest.raises(ValueError, match="v2 takes fp16/bf16"):
        ops.paged_attention(emu, s32.q, s32.cache, None, 0.125, False, version="v2")
    with pytest.raises(ValueError, match="v3 takes fp16/bf16"):
        ops.paged_attention(emu, s32.q, s32.cache, None, 0.125, False, version="v3")
    with pytest.raises(ValueError, match="version must be one of"):
        ops.paged_attention(emu, s16.q, s16.cache, None, 0.125, False, version="v4")


def test_split_count_by_waves():
    # modelled time waves(s) / s; the fewest splits within 10% of the best
    assert ops.choose_num_splits_by_waves(512, 1040, 132 * 4) == 1  # 128 streams x 4 KV heads, H200: 0.97 waves
    assert ops.choose_num_splits_by_waves(512, 1040, 132 * 3) == 3  # 2 waves at s=1; 4 waves of thirds = 1.33
    assert ops.choose_num_splits_by_waves(4, 1040, 132 * 4) == 15  # few CTAs: 1/15 is within 10% of 1/16 (the most)
    assert ops.choose_num_splits_by_waves(4, 100, 8) == 1  # too short to split
    assert ops.choose_num_splits_by_waves(3, 10_000, 8) == 5  # 15 CTAs, 2 waves: 0.4, within 10% of 3/8


# -- v2 and v3 over random geometries (hypothesis) --------------------------------------------------------

V2_GEOMETRIES = st.fixed_dictionaries(
    dict(
        batch=st.integers(1, 2),
        n_kv_head=st.integers(1, 2),
        group=st.sampled_from([1, 2, 3, 4, 8]),  # group x chunk up to 128 rows: 1 or 2 query tiles of 64
        num_frames=st.integers(1, 16),
        head_dim=st.sampled_from([64, 128]),
        block_size=st.sampled_from(V2_BLOCK_SIZES),
        max_history=st.integers(0, 100),
        dtype=st.sampled_from(V2_DTYPES),
    )
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    geo=V2_GEOMETRIES,
    seed=st.integers(0, 2**16),
    causal=st.booleans(),
    fp8=st.booleans(),
    num_splits=st.sampled_from([None, 1, 2, 3]),
    version=st.sampled_from(TENSOR_CORE),
)
def test_tensor_core_matches_reference_on_random_geometries(emu, geo, seed, causal, fp8, num_splits, version):
    from oasr.fast.kernels.testing import to_fp8

    s = make_scenario(seed, **geo)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    if fp8:
        s = to_fp8(s)
    out = emulated_attention(version, s.q, s.cache, s.chunk_lens, causal=causal, num_splits=num_splits)
    q32 = s.q.float()
    c32 = s.cache if fp8 else s.to(torch.float32).cache
    ref32 = ref.paged_attention(q32, c32, s.chunk_lens, causal=causal)
    ref_abs_v = ref.paged_attention(q32, with_abs_v(c32), s.chunk_lens, causal=causal)
    assert not out.isnan().any()
    err = (out.float() - ref32).abs()
    assert (err <= v2_bound(ref32, ref_abs_v, out.dtype, fp8, FP32_FLOOR)).all(), f"max err {err.max():.3g}"
    for b, n in enumerate(s.chunk_lens.tolist()):
        assert (out[b, :, n:] == 0).all()


def test_v3_split_count_fills_the_machine_first():
    # v3 splits keys only when the grid leaves SMs with fewer than two CTAs: at 128 streams x 4 KV heads
    # on an H200 that is 1 split even at 5 resident CTAs (the wave rule would take 5 and pay the partials).
    assert ops.choose_num_splits_by_waves(512, 1040, 132 * 5) == 5
    assert ops.choose_num_splits_filled(512, 1040, 132 * 5, 132) == 1
    assert ops.choose_num_splits_filled(8, 1040, 132 * 5, 132) == ops.choose_num_splits_by_waves(8, 1040, 132 * 5) > 1
    # between one and two waves (fp8 pages' 3 resident CTAs: 512 > 396 slots) the waves decide: 3 splits
    assert ops.choose_num_splits_filled(512, 1040, 132 * 3, 132) == ops.choose_num_splits_by_waves(512, 1040, 396) == 3
    assert ops.choose_num_splits_filled(512, 1040, 132 * 4, 132) == 1  # one wave
    assert ops.choose_num_splits_filled(1024, 1040, 132 * 3, 132) == 1  # two full waves or more
