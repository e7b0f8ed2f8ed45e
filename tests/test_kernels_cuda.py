"""The kernels on a real GPU: against the reference, under CUDA-graph capture, without syncs.

Marked ``cuda`` and skipped without a device (run them with
``tools/gpu_check.sh DIR``). Same scenarios and bounds as the emulated tests:
shuffled block tables, NaN-poisoned pools, whole-pool bitwise checks for
append, calibrated bounds for attention (see oasr.fast.kernels.testing).
fp8 pages (the ``test_fp8_*`` cases) as in tests/test_fp8_kernels.py: bytes and
scales bitwise against the reference and torch's CPU conversion (on sm_89+ the
kernels convert with the hardware cvt, so this is where its rounding is checked),
attention against the reference on the same pages, gather bitwise.
"""

from __future__ import annotations

import random

import pytest
import torch

from oasr.fast import paged_ops as fast
from oasr.fast.kernels import ops
from oasr.fast.kernels.nvrtc import executor_for
from oasr.fast.kernels.testing import bits, low_precision_bound, make_scenario, to_fp8, v2_bound, with_abs_v
from oasr.reference import paged_ops as ref
from tests.test_fp8_kernels import fp8_pool, near_max_scenario, rounding_sweep, scale_oracle, spread

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP32_FLOOR = 1e-5  # calibrated in tests/test_kernels_emulated.py (same kernels, same math)


@pytest.fixture(scope="module")
def device():
    dev = torch.device("cuda", torch.cuda.current_device())
    # no load_kernels: each test runs its ops eagerly before any capture, which loads (and on a cold cache
    # compiles) only the instantiations it launches
    return dev


def _geometry(seed, head_dim, dtype, max_history=400):
    rng = random.Random(seed)
    return dict(
        batch=rng.randint(1, 8),
        n_kv_head=rng.choice([1, 2, 4]),
        group=rng.choice([1, 2, 4]),
        num_frames=rng.randint(1, 32),
        head_dim=head_dim,
        block_size=rng.choice([8, 16, 24, 32, 64]),
        max_history=rng.randint(0, max_history),
        dtype=dtype,
    )


CASES = [(d, hd, seed) for d in DTYPES for hd in (64, 128) for seed in range(6)]


@pytest.mark.parametrize("dtype,head_dim,seed", CASES)
def test_append_and_attention_match_reference(device, dtype, head_dim, seed):
    s = make_scenario(seed, **_geometry(seed, head_dim, dtype))
    want = s.clone()
    ref.append_kv(want.cache, s.k, s.v, s.chunk_lens)
    g = s.to(device=device)
    fast.append_kv(g.cache, g.k, g.v, g.chunk_lens)
    assert torch.equal(bits(g.cache.k_cache.cpu()), bits(want.cache.k_cache))
    assert torch.equal(bits(g.cache.v_cache.cpu()), bits(want.cache.v_cache))

    causal = seed % 2 == 1
    s32 = want.to(torch.float32)
    ref32 = ref.paged_attention(s32.q, s32.cache, s32.chunk_lens, causal=causal)
    if dtype == torch.float32:
        bound = FP32_FLOOR * (1 + ref32.abs())
    else:
        bound = low_precision_bound(ref32, ref.paged_attention(want.q, want.cache, want.chunk_lens, causal=causal),
                                    FP32_FLOOR)  # fmt: skip
    executor = executor_for(device)
    _check_versions(executor, g, want.cache, s32.q, s32.cache, causal, ref32, bound, quantized=False)


def _check_versions(executor, g, cpu_cache, q32, cache32, causal, ref32, v1_bound, quantized):
    """v1, and v2 and v3 where they serve the geometry (v3: the fast twin's default there), at the
    launcher's split count and at 1 and 3 splits, against the fp32 reference (v2, v3 with v2_bound)."""
    versions = ["v1"] + (["v2", "v3"] if ops.v2_supports(cpu_cache, g.q.dtype, g.q.shape[-1]) else [])
    for version in versions:
        bound = v1_bound
        if version in ("v2", "v3"):
            ref_abs_v = ref.paged_attention(q32, with_abs_v(cache32), g.chunk_lens.cpu(), causal=causal)
            bound = v2_bound(ref32, ref_abs_v, g.q.dtype, quantized, FP32_FLOOR)
        for num_splits in (None, 1, 3):
            out = ops.paged_attention(executor, g.q, g.cache, g.chunk_lens, g.q.shape[-1] ** -0.5, causal,
                                      num_splits, version=version)  # fmt: skip
            assert out.dtype == g.q.dtype and not out.isnan().any()
            err = (out.float().cpu() - ref32).abs()
            assert (err <= bound).all(), f"{version} num_splits={num_splits}: max err {err.max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_plain_gather(device, dtype):
    L, NB, bs, Hkv, D = 3, 16, 16, 2, 64
    k_pool = torch.randn(L, NB, bs, Hkv, D).to(dtype)
    v_pool = torch.randn(L, NB, bs, Hkv, D).to(dtype)
    ids = torch.tensor([9, 2, 14, 5], dtype=torch.int32)
    start, T = 5, 50
    got = fast.gather_kv_blocks(k_pool.to(device), v_pool.to(device), ids.to(device), start, T).cpu()
    pos = start + torch.arange(T)
    blocks, offs = ids[pos // bs].long(), pos % bs
    assert torch.equal(bits(got[..., :D]), bits(k_pool[:, blocks, offs].transpose(1, 2).contiguous()))
    assert torch.equal(bits(got[..., D:]), bits(v_pool[:, blocks, offs].transpose(1, 2).contiguous()))


def test_launches_follow_the_current_stream(device):
    s = make_scenario(3, **_geometry(3, 64, torch.float16)).to(device=device)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    eager = fast.paged_attention(s.q, s.cache, s.chunk_lens)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        on_side = fast.paged_attention(s.q, s.cache, s.chunk_lens)
    side.synchronize()
    assert torch.equal(bits(on_side), bits(eager))


def test_graph_replay_is_bit_identical_to_eager(device):
    s = make_scenario(4, **_geometry(4, 128, torch.bfloat16, max_history=600)).to(device=device)
    base_k, base_v = s.cache.k_cache.clone(), s.cache.v_cache.clone()

    def step():
        fast.append_kv(s.cache, s.k, s.v, s.chunk_lens)  # chunk_lens on the device: nothing to copy
        return fast.paged_attention(s.q, s.cache, s.chunk_lens)

    eager = step().clone()
    eager_k, eager_v = s.cache.k_cache.clone(), s.cache.v_cache.clone()

    warm = torch.cuda.Stream(device)  # torch's recipe: warm up on a side stream before capturing
    warm.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warm):
        step()
    torch.cuda.current_stream(device).wait_stream(warm)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    s.cache.k_cache.copy_(base_k)
    s.cache.v_cache.copy_(base_v)
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(bits(captured), bits(eager))
    assert torch.equal(bits(s.cache.k_cache), bits(eager_k))
    assert torch.equal(bits(s.cache.v_cache), bits(eager_v))


def test_no_device_sync_in_launches(device):
    s = make_scenario(5, **_geometry(5, 64, torch.float16)).to(device=device)
    ids = s.cache.block_table[0].contiguous()
    k_pool, v_pool = s.cache.k_cache[None], s.cache.v_cache[None]
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast.append_kv(s.cache, s.k, s.v, s.chunk_lens)
        fast.paged_attention(s.q, s.cache, s.chunk_lens)
        fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=True)
        fast.gather_kv_blocks(k_pool, v_pool, ids, 0, s.cache.block_size)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(device)


# -- fp8 pages ---------------------------------------------------------------------------------------

FP8_CASES = [(d, hd, seed) for d in DTYPES for hd in (64, 128) for seed in range(3)]
FP8_FIELDS = ("k_cache", "v_cache", "k_scale", "v_scale")


def _same_pools(gpu_cache, cpu_cache):
    for name in FP8_FIELDS:
        assert torch.equal(bits(getattr(gpu_cache, name).cpu()), bits(getattr(cpu_cache, name))), name


@pytest.mark.parametrize("dtype,head_dim,seed", FP8_CASES)
def test_fp8_append_and_attention_match_reference(device, dtype, head_dim, seed):
    s = to_fp8(make_scenario(seed, **_geometry(seed, head_dim, dtype)))
    k, v = spread(s.k, seed), spread(s.v, seed + 1)  # magnitudes down to fp32 denormals: no flush to zero
    want = s.clone()
    ref.append_kv(want.cache, k, v, s.chunk_lens)
    g = s.to(device=device)
    fast.append_kv(g.cache, k.to(device), v.to(device), g.chunk_lens)
    _same_pools(g.cache, want.cache)

    ref.append_kv(want.cache, s.k, s.v, s.chunk_lens)  # ordinary magnitudes for the attention check
    fast.append_kv(g.cache, g.k, g.v, g.chunk_lens)
    _same_pools(g.cache, want.cache)
    causal = seed % 2 == 1
    ref32 = ref.paged_attention(want.q.float(), want.cache, want.chunk_lens, causal=causal)
    if dtype == torch.float32:
        bound = FP32_FLOOR * (1 + ref32.abs())
    else:
        bound = low_precision_bound(ref32, ref.paged_attention(want.q, want.cache, want.chunk_lens, causal=causal),
                                    FP32_FLOOR)  # fmt: skip
    executor = executor_for(device)
    _check_versions(executor, g, want.cache, want.q.float(), want.cache, causal, ref32, bound, quantized=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_twin_runs_its_tensor_core_kernel_and_zeroes_rows_past_their_length(device, dtype):
    # On CUDA the fast twin picks v3 (ops.CUDA_ATTENTION_VERSION) for 16-bit pools with a v2/v3 block
    # size; rows past their length are exact zeros even with NaN / Inf in visible V, in v2 and v3.
    s = make_scenario(8, batch=4, n_kv_head=2, group=2, num_frames=16, head_dim=64, block_size=16,
                      max_history=300, dtype=dtype)  # fmt: skip
    s.chunk_lens[:] = torch.tensor([16, 3, 0, 9], dtype=torch.int32)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    pos = int(s.cache.cache_seqlens[1])
    poison = torch.tensor([float("nan"), float("inf")])
    s.cache.v_cache[s.cache.block_table[1, pos // 16].long(), pos % 16, 0, :2] = poison
    g = s.to(device=device)
    executor = executor_for(device)
    chosen = ops.choose_attention_version(executor, g.cache, dtype, 64)
    assert chosen == ops.CUDA_ATTENTION_VERSION
    got = fast.paged_attention(g.q, g.cache, g.chunk_lens).cpu()
    want = ops.paged_attention(executor, g.q, g.cache, g.chunk_lens, 0.125, False, version=chosen).cpu()
    assert torch.equal(bits(got), bits(want))
    other = ops.paged_attention(executor, g.q, g.cache, g.chunk_lens, 0.125, False,
                                version="v2" if chosen == "v3" else "v3").cpu()  # fmt: skip
    for out in (got, other):
        for b, n in enumerate(s.chunk_lens.tolist()):
            assert (out[b, :, n:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_append_saturates_near_the_model_dtype_max(device, dtype):
    # The saturating rule (clamp at 1.875 * 2**emax) on the GPU: bytes equal the reference's,
    # and attention over those pages is finite (the plain rule gave inf).
    s, k, v = near_max_scenario(dtype)
    want = s.clone()
    ref.append_kv(want.cache, k, v, s.chunk_lens)
    g = s.to(device=device)
    fast.append_kv(g.cache, k.to(device), v.to(device), g.chunk_lens)
    _same_pools(g.cache, want.cache)
    out = fast.paged_attention(torch.zeros_like(g.q), g.cache, g.chunk_lens)
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_fp8_conversion_rounds_like_torch(device):
    sweep = rounding_sweep()
    vectors = torch.cat([sweep, sweep * 2.0**-130, sweep * 2.0**100])
    n = vectors.shape[0]
    s = to_fp8(make_scenario(0, batch=2, n_kv_head=1, group=1, num_frames=n, head_dim=64, block_size=16,
                             max_history=20))  # fmt: skip
    assert int(s.chunk_lens[0]) == n
    k = torch.stack([vectors, vectors.flip(0)]).view(2, n, 1, 64)
    g = s.to(device=device)
    fast.append_kv(g.cache, k.to(device), (-k).to(device), g.chunk_lens)
    pos = s.cache.cache_seqlens[0] + torch.arange(n)
    blocks, offs = s.cache.block_table[0, pos // 16].long(), pos % 16
    scale = scale_oracle(vectors.abs().amax(-1))
    expect = (vectors / scale[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(g.cache.k_scale.cpu()[blocks, offs, 0], scale)
    assert torch.equal(g.cache.k_cache.cpu()[blocks, offs, 0].view(torch.uint8), expect.view(torch.uint8))
    assert torch.equal(g.cache.v_cache.cpu()[blocks, offs, 0].view(torch.uint8), (-expect.float()).to(
        torch.float8_e4m3fn).view(torch.uint8))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_gather_matches_reference_pool(device, dtype, head_dim):
    for seed in range(3):
        pool, ids, start, T = fp8_pool(seed, dtype, head_dim, [8, 16, 64][seed])
        want = pool.gather_kv_blocks(ids.tolist(), start, T)
        got = fast.gather_kv_blocks(pool.k_pool.to(device), pool.v_pool.to(device), ids.to(device), start, T,
                                    k_scale=pool.k_scale.to(device), v_scale=pool.v_scale.to(device),
                                    out_dtype=dtype)  # fmt: skip
        assert torch.equal(bits(got.cpu()), bits(want))


def test_fp8_graph_replay_is_bit_identical_to_eager(device):
    s = to_fp8(make_scenario(4, **_geometry(4, 128, torch.bfloat16, max_history=600))).to(device=device)
    base = {name: getattr(s.cache, name).clone() for name in FP8_FIELDS}

    def step():
        fast.append_kv(s.cache, s.k, s.v, s.chunk_lens)
        return fast.paged_attention(s.q, s.cache, s.chunk_lens)

    eager = step().clone()
    eager_pools = {name: getattr(s.cache, name).clone() for name in FP8_FIELDS}
    warm = torch.cuda.Stream(device)
    warm.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warm):
        step()
    torch.cuda.current_stream(device).wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for name in FP8_FIELDS:
        getattr(s.cache, name).copy_(base[name])
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(bits(captured), bits(eager))
    for name in FP8_FIELDS:
        assert torch.equal(bits(getattr(s.cache, name)), bits(eager_pools[name])), name


def test_fp8_no_device_sync_in_launches(device):
    s = to_fp8(make_scenario(5, **_geometry(5, 64, torch.float16))).to(device=device)
    ids = s.cache.block_table[0].contiguous()
    c = s.cache
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast.append_kv(c, s.k, s.v, s.chunk_lens)
        fast.paged_attention(s.q, c, s.chunk_lens)
        fast.gather_kv_blocks(c.k_cache[None], c.v_cache[None], ids, 0, c.block_size, k_scale=c.k_scale[None],
                              v_scale=c.v_scale[None], out_dtype=torch.float16)  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(device)


@pytest.mark.parametrize("pages", ["bf16", "fp8"])
def test_driver_launch_path_equals_cuda_core_bit_for_bit(device, monkeypatch, pages):
    """The prepacked cuLaunchKernel path (``CudaExecutor.prepare``, the default) and cuda.core's launch give the
    same bytes, on random pages (fp8: two row tiles per warp at head_dim 64), each path's plan used twice."""
    from oasr.bench.launcher import make_view
    from oasr.fast.kernels import nvrtc

    cache, q = make_view(device, pages)
    torch.manual_seed(0)
    for t in (cache.k_cache, cache.v_cache):
        t.copy_(torch.randn(t.shape, device=device).to(t.dtype))
    q.copy_(torch.randn(q.shape, device=device))
    executor = executor_for(device)
    outs = {}
    for path in ("cuda_core", "driver"):
        monkeypatch.setattr(nvrtc, "LAUNCH_PATH", path)
        ops._PLANS.clear()
        outs[path] = [ops.paged_attention(executor, q, cache, None, 0.125, True, version="v3") for _ in range(2)]
        assert (ops._PLANS and next(iter(ops._PLANS.values())).prepared is not None) == (path == "driver")
    torch.cuda.synchronize(device)
    for a, b in zip(outs["cuda_core"], outs["driver"], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.isfinite(outs["driver"][0].float()).all()
