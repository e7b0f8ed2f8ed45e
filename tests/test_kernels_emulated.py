"""The CUDA kernels, run on the CPU by the SIMT emulator, against the reference.

Same `.cu` sources as the GPU build (see kernels_cu/emu/simt_emu.h for what the
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

from oasr.fast import paged_ops as fast
from oasr.fast.kernels import emulation, ops
from oasr.fast.kernels.testing import bits, low_precision_bound, make_scenario, written_slots
from oasr.reference import paged_ops as ref

try:
    emulation.emulation_toolchain()
    _MISSING = None
except emulation.EmulationUnavailable as exc:  # say exactly what is missing
    _MISSING = str(exc)

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"kernel emulation unavailable: {_MISSING}")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [8, 16, 24, 32, 64]

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


def _geometry(seed: int, head_dim: int, dtype: torch.dtype, max_history: int = 100) -> dict:
    rng = random.Random(seed)
    return dict(
        batch=rng.randint(1, 3),
        n_kv_head=rng.choice([1, 2]),
        group=rng.choice([1, 2, 4]),
        num_frames=rng.randint(1, 20),
        head_dim=head_dim,
        block_size=rng.choice(BLOCK_SIZES),
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
    # both twins alike (issue 14: it used to be cast silently), before anything is written.
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

ATTN_CASES = _cases((64, 128), 6)


def _check_attention(out, s_lowp, s32, causal, scale=None):
    """out (kernel, pool dtype) against the fp32 reference on the same numbers."""
    lens = s32.chunk_lens
    ref32 = ref.paged_attention(s32.q, s32.cache, lens, softmax_scale=scale, causal=causal)
    assert not out.isnan().any()
    if out.dtype == torch.float32:
        bound = FP32_FLOOR * (1 + ref32.abs())
    else:
        ref_lowp = ref.paged_attention(s_lowp.q, s_lowp.cache, lens, softmax_scale=scale, causal=causal)
        bound = low_precision_bound(ref32, ref_lowp, FP32_FLOOR)
    err = (out.float() - ref32).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}, at {(err - bound).argmax()}"
    for b, n in enumerate(lens.tolist()):  # queries past a row's chunk: exact zeros
        assert (out[b, :, n:] == 0).all()


@pytest.mark.parametrize("dtype,head_dim,seed", ATTN_CASES)
def test_attention_matches_reference(emu, dtype, head_dim, seed):
    s = make_scenario(100 + seed, **_geometry(100 + seed, head_dim, dtype))
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)  # the chunk's own K/V are part of the range
    s32 = s.to(torch.float32)
    causal = seed % 2 == 1
    scale = None if seed < 4 else 0.3
    out = fast.paged_attention(s.q, s.cache, s.chunk_lens, softmax_scale=scale, causal=causal, backend="emulated")
    _check_attention(out, s, s32, causal, scale)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize(
    "dtype,causal",
    [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)],
    ids=["float32", "bfloat16-causal", "float16"],
)
def test_attention_forced_splits(emu, dtype, causal, num_splits):
    # Long histories over few CTAs: the split path and its combine, whatever
    # the launcher would have chosen.
    geo = _geometry(200 + num_splits, 64, dtype, max_history=300)
    geo.update(batch=2, max_history=300)
    s = make_scenario(200 + num_splits, **geo)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = ops.paged_attention(emu, s.q, s.cache, s.chunk_lens, s.q.shape[-1] ** -0.5, causal, num_splits=num_splits)
    _check_attention(out, s, s.to(torch.float32), causal)


def test_attention_stale_max_span_never_drops_keys(emu):
    # The launcher sizes splits from the host-side max_span. If it is too small,
    # the last split still runs to the end of each row's range.
    from dataclasses import replace

    s = make_scenario(11, batch=1, n_kv_head=1, group=2, num_frames=8, head_dim=64, block_size=16,
                      max_history=200, dtype=torch.float32)  # fmt: skip
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    stale = replace(s.cache, max_span=1)
    out = ops.paged_attention(emu, s.q, stale, s.chunk_lens, 0.125, False, num_splits=4)
    _check_attention(out, s, s, False)


def test_attention_empty_rows_write_zeros(emu):
    # chunk_len 0, an empty range (seqstart == seqlen, chunk 0), and causal rows.
    s = make_scenario(5, batch=3, n_kv_head=2, group=2, num_frames=6, head_dim=128, block_size=8,
                      max_history=40, dtype=torch.float16)  # fmt: skip
    s.chunk_lens[:] = torch.tensor([0, 6, 0], dtype=torch.int32)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    out = fast.paged_attention(s.q, s.cache, s.chunk_lens, backend="emulated")
    assert (out[0] == 0).all() and (out[2] == 0).all()
    _check_attention(out, s, s.to(torch.float32), False)


def test_attention_strided_table_and_chunk_lens_forms(emu):
    # A table that is a column slice of a wider one (row stride > W), and
    # chunk_lens given as a list and as None.
    from dataclasses import replace

    s = make_scenario(21, batch=3, n_kv_head=2, group=2, num_frames=8, head_dim=64, block_size=16,
                      max_history=60, dtype=torch.float32)  # fmt: skip
    s.chunk_lens.fill_(8)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    table = s.cache.block_table
    wide = torch.full((table.shape[0], table.shape[1] + 5), -7, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    strided = replace(s.cache, block_table=wide[:, : table.shape[1]])
    assert strided.block_table.stride(0) != strided.block_table.shape[1]
    for lens in (s.chunk_lens.tolist(), None):
        out = fast.paged_attention(s.q, strided, lens, backend="emulated")
        _check_attention(out, s, s, False)


def test_append_strided_table(emu):
    from dataclasses import replace

    s = make_scenario(22, **_geometry(22, 64, torch.float16))
    table = s.cache.block_table
    wide = torch.full((table.shape[0], table.shape[1] + 3), -7, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, s.k, s.v, s.chunk_lens)
    fast.append_kv(replace(got.cache, block_table=wide[:, : table.shape[1]]), s.k, s.v, s.chunk_lens.tolist(),
                   backend="emulated")  # fmt: skip
    assert torch.equal(bits(got.cache.k_cache), bits(want.cache.k_cache))


@pytest.mark.parametrize("op", ["append_kv", "paged_attention"])
def test_chunk_lens_errors_match_reference(emu, op):
    s = make_scenario(2, batch=2, n_kv_head=1, group=1, num_frames=4, head_dim=64, block_size=4, max_history=8)
    args = (s.cache, s.k, s.v) if op == "append_kv" else (s.q, s.cache)
    with pytest.raises(ValueError) as want:
        getattr(ref, op)(*args, torch.tensor([1, 5]))
    with pytest.raises(ValueError) as got:
        getattr(fast, op)(*args, torch.tensor([1, 5]), backend="emulated")
    assert str(got.value) == str(want.value)


# -- gather ----------------------------------------------------------------------------------------


def _gather_case(seed, dtype, head_dim, block_size):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    L, Hkv, NB = rng.randint(1, 3), rng.randint(1, 2), 12
    n_blocks = rng.randint(1, 4)
    ids = torch.randperm(NB, generator=g)[:n_blocks].to(torch.int32)
    start = rng.randint(0, n_blocks * block_size - 1)
    T = rng.randint(0, n_blocks * block_size - start)
    shape = (L, NB, block_size, Hkv, head_dim)
    k_pool = torch.full(shape, float("nan"), dtype=dtype)
    v_pool = torch.full(shape, float("nan"), dtype=dtype)
    pos = start + torch.arange(T)
    blocks, offs = ids[pos // block_size].long(), pos % block_size
    k_pool[:, blocks, offs] = torch.randn(L, T, Hkv, head_dim, generator=g).to(dtype)
    v_pool[:, blocks, offs] = torch.randn(L, T, Hkv, head_dim, generator=g).to(dtype)
    return k_pool, v_pool, ids, start, T


def _plain_gather(k_pool, v_pool, ids, start, T):
    L, _, bs, Hkv, D = k_pool.shape
    out = torch.empty(L, Hkv, T, 2 * D, dtype=k_pool.dtype)
    for f in range(T):
        block, off = int(ids[(start + f) // bs]), (start + f) % bs
        out[:, :, f, :D] = k_pool[:, block, off]
        out[:, :, f, D:] = v_pool[:, block, off]
    return out


GATHER_CASES = _cases((64, 128, 36), 2)


@pytest.mark.parametrize("dtype,head_dim,seed", GATHER_CASES)
def test_gather_matches_plain_gather_bitwise(emu, dtype, head_dim, seed):
    k_pool, v_pool, ids, start, T = _gather_case(seed, dtype, head_dim, BLOCK_SIZES[seed % len(BLOCK_SIZES)])
    out = torch.full((k_pool.shape[0], k_pool.shape[3], T, 2 * head_dim), float("nan"), dtype=dtype)
    got = fast.gather_kv_blocks(k_pool, v_pool, ids, start, T, out=out, backend="emulated")
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(bits(got), bits(_plain_gather(k_pool, v_pool, ids, start, T)))
    assert not got.isnan().any()
