"""NaN in K/V for the formats whose rule refuses it (int8, q8_0, affine4): refused whole, or stored by rule.

Where a twin quantizes with torch code (the reference; the fast twin's torch backend, dense ``commit``,
dense decoder groups), a NaN anywhere in what a call would write is refused with a ``ValueError``
before anything is written: K before V, layer 0 before layer 1, blocks before frames. Every structure
(pool bytes and scale planes, free list, lengths, tables) is as it was. Padding frames past a row's
``chunk_lens`` are not written and may hold anything.

Where the kernels quantize (the "emulated" backend here, CUDA on a GPU) nothing is read back: NaN is
stored by the rule ``oasr.fast.paged_ops`` documents, checked here byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from oasr import fast, reference
from oasr.cache.config import CacheConfig
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.fast import paged_ops as fast_ops
from oasr.fast.kernels.testing import bits
from oasr.kv_formats import get_format
from oasr.reference import paged_ops as ref_ops

FORMATS = ["int8", "q8_0", "affine4", "affine4_g64"]
TWINS = {"reference": reference, "fast": fast}
NAN = float("nan")


def _config(fmt, **overrides) -> CacheConfig:
    fields = dict(num_layers=2, n_kv_head=2, head_dim=64, hidden_dim=4, kernel_size=3, chunk_size=4,
                  num_left_chunks=2, block_size_frames=4, max_num_blocks=16, max_batch_size=3, max_blocks_per_seq=8,
                  kv_cache_dtype=fmt)
    fields.update(overrides)
    return CacheConfig(**fields)


def _pool_state(pool) -> list:
    tensors = [pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale]
    return [bits(t.contiguous()) if t.is_floating_point() else t.clone() for t in tensors] + [pool.free_block_ids()]


def _same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


def _cohort(ops, cfg, streams=("a", "b", "c")):
    pool = ops.BlockPool(cfg)
    m = ops.AttentionCacheManager(pool, cfg)
    for s in streams:
        m.allocate_stream(s)
    m.prepare_chunks_batched(list(streams), 4)
    return pool, m


def _append(twin, view, k, v, lens):
    if twin == "reference":
        ref_ops.append_kv(view, k, v, lens)
    else:
        fast_ops.append_kv(view, k, v, lens, backend="torch")


# ---- paged append_kv ---------------------------------------------------------------------------------

@pytest.mark.parametrize("twin", list(TWINS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_kv_refuses_nan_in_v_before_writing_k(twin, fmt):
    cfg = _config(fmt)
    pool, m = _cohort(TWINS[twin], cfg)
    view = m.get_paged_caches(["a", "b", "c"])[1]
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 4, 2, 64, generator=g), torch.randn(3, 4, 2, 64, generator=g)
    v[2, 1, 1, 17] = NAN  # row 2, frame 1: written
    before = _pool_state(pool)
    with pytest.raises(ValueError, match=r"append_kv: v holds NaN at row 2, frame 1; .* refuse NaN"):
        _append(twin, view, k, v, torch.tensor([4, 4, 2]))
    assert _same(_pool_state(pool), before)
    # a NaN in a frame past the row's chunk_lens is not written: accepted
    _append(twin, view, k, v, torch.tensor([4, 4, 1]))
    assert not _same(_pool_state(pool), before)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", None])
def test_formats_without_the_refusal_still_take_nan(fmt):
    """fp8 leaves NaN unspecified and the model dtype stores it: no refusal there (unchanged behaviour)."""
    cfg = _config(fmt)
    _, m = _cohort(fast, cfg)
    k = torch.randn(3, 4, 2, 64)
    k[0, 0, 0, 0] = NAN
    fast_ops.append_kv(m.get_paged_caches(["a", "b", "c"])[0], k, k.clone(), backend="torch")


# ---- dense commit ------------------------------------------------------------------------------------

@pytest.mark.parametrize("twin", list(TWINS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_commit_refuses_nan_before_taking_blocks(twin, fmt):
    cfg = _config(fmt)
    pool = TWINS[twin].BlockPool(cfg)
    m = TWINS[twin].AttentionCacheManager(pool, cfg)
    m.allocate_stream("s")
    m.commit("s", torch.randn(2, 2, 3, 128))
    chunk = torch.randn(2, 2, 4, 128)
    chunk[1, 1, 3, 100] = NAN  # layer 1, head 1, frame 3, in V: the last value written
    before, info = _pool_state(pool), m.describe("s")
    with pytest.raises(ValueError, match=r"commit: kv_chunk holds NaN .* refuse NaN"):
        m.commit("s", chunk)
    assert _same(_pool_state(pool), before) and m.describe("s") == info


# ---- the decoder's K/V: paged managers and dense groups ---------------------------------------------

def _dcfg(fmt) -> DecoderCacheConfig:
    return DecoderCacheConfig(num_layers=2, n_kv_head=2, head_dim=64, page_size=4, max_num_blocks=24, max_rows=4,
                              max_self_tokens=16, max_cross_tokens=10, kv_cache_dtype=fmt)


def _manager(twin, fmt):
    cfg = _dcfg(fmt)
    if twin == "reference":
        return reference.DecoderKVCacheManager(cfg)
    return fast.DecoderKVCacheManager(cfg, backend="torch")


def _decoder_state(m) -> list:
    return _pool_state(m.pool) + [{r: m.describe(r) for r in m.rows}, m.reserved_blocks]


@pytest.mark.parametrize("twin", list(TWINS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_decoder_manager_refuses_nan_before_any_layer(twin, fmt):
    m = _manager(twin, fmt)
    rows = m.admit([DecoderRequest(3, 4, 6), DecoderRequest(2, 4, 6)])
    g = torch.Generator().manual_seed(2)
    m.prefill(rows[0], torch.randn(2, 3, 2, 64, generator=g), torch.randn(2, 3, 2, 64, generator=g))
    cases = []
    k, v = torch.randn(2, 2, 2, 64, generator=g), torch.randn(2, 2, 2, 64, generator=g)
    v[1, 1, 0, 3] = NAN  # the last layer's V of row 1: the old code wrote every other value first
    cases.append(("append", lambda: m.append(rows, k, v)))
    pk, pv = torch.randn(2, 2, 2, 64, generator=g), torch.randn(2, 2, 2, 64, generator=g)
    pv[1, 1, 1, 63] = NAN
    cases.append(("prefill", lambda: m.prefill(rows[1], pk, pv)))
    ck, cv = torch.randn(2, 6, 2, 64, generator=g), torch.randn(2, 6, 2, 64, generator=g)
    cv[1, 5, 1, 0] = NAN
    cases.append(("fill_cross", lambda: m.fill_cross(rows[1], ck, cv)))
    ek, ev = torch.randn(2, 1, 2, 64, generator=g), torch.randn(2, 1, 2, 64, generator=g)
    ev[1, 0, 0, 0] = NAN
    cases.append(("extend", lambda: m.extend(rows[0], ek, ev)))
    for op, call in cases:
        before = _decoder_state(m)
        with pytest.raises(ValueError, match=rf"{op}: v holds NaN .* refuse NaN"):
            call()
        assert _same(_decoder_state(m), before), op


@pytest.mark.parametrize("twin", list(TWINS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_decoder_group_refuses_nan_before_any_layer(twin, fmt):
    group = TWINS[twin].DenseDecoderKV(_dcfg(fmt), batch=2, capacity=8, cross_capacity=6)
    g = torch.Generator().manual_seed(3)
    group.prefill(0, torch.randn(2, 3, 2, 64, generator=g), torch.randn(2, 3, 2, 64, generator=g))
    state = lambda: [bits(t.contiguous()) for name in group._TENSORS for t in getattr(group, name)] + [  # noqa: E731
        list(group.lengths), list(group.cross_lengths)]
    k, v = torch.randn(2, 2, 2, 64, generator=g), torch.randn(2, 2, 2, 64, generator=g)
    v[1, 1, 1, 5] = NAN
    wk, wv = torch.randn(2, 1, 2, 64, generator=g), torch.randn(2, 1, 2, 64, generator=g)
    wv[1, 0, 0, 0] = NAN
    pk, pv = torch.randn(2, 3, 2, 64, generator=g), torch.randn(2, 3, 2, 64, generator=g)
    pv[1, 2, 1, 1] = NAN
    calls = (("append", lambda: group.append(k, v)), ("write", lambda: group.write(1, wk, wv)),
             ("prefill", lambda: group.prefill(1, pk, pv)), ("fill_cross", lambda: group.fill_cross(1, pk, pv)))
    for op, call in calls:
        before = state()
        with pytest.raises(ValueError, match=rf"{op}: v holds NaN"):
            call()
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(state(), before, strict=True)), op


# ---- the kernel path: NaN stored by the documented rule -----------------------------------------------

def _kernel_rule(fmt, x, dtype):
    """What ``oasr.fast.paged_ops`` documents the kernels store for ``x`` (vectors along the last dim)."""
    f = get_format(fmt)
    nan = x.float().isnan()
    if fmt == "q8_0":  # NaN skipped by the max and stored as q = 0: the rule applied with NaN -> 0
        return f.quantize(torch.where(nan, 0.0, x.float()).to(dtype), dtype)
    if fmt == "int8":  # NaN skipped by the max, stored as q = -127
        data, scale = f.quantize(torch.where(nan, 0.0, x.float()).to(dtype), dtype)
        return torch.where(nan, torch.tensor(-127, dtype=torch.int8), data), scale
    # affine4: NaN skipped by the min and max, stored as code 0: the rule applied with NaN -> the group's min
    groups = x.float().unflatten(-1, (-1, f.group))
    gnan = groups.isnan()
    lo = torch.where(gnan, torch.inf, groups).amin(dim=-1, keepdim=True)
    filled = torch.where(gnan, lo.expand_as(groups), groups)
    all_nan = gnan.all(dim=-1)
    data, params = f.quantize(torch.where(filled.isinf(), 0.0, filled).flatten(-2).to(dtype), dtype)
    params = torch.where(all_nan[..., None], torch.tensor(NAN, dtype=dtype), params)
    codes = get_format(fmt).module.unpack(data)
    codes = torch.where(all_nan.repeat_interleave(f.group, dim=-1), 0, codes)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), params


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_store_nan_by_the_documented_rule(fmt, dtype):
    from oasr.fast.kernels import emulation

    missing = emulation.unavailable_reason()
    if missing is not None:
        pytest.skip(f"kernel emulation unavailable: {missing}")
    cfg = _config(fmt, dtype=dtype, max_batch_size=1, n_kv_head=1)
    pool, m = _cohort(fast, cfg, streams=("s",))
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(1, 4, 1, 64, generator=g) * 3).to(dtype)
    x[0, 0, 0, 5] = NAN  # one NaN in a vector
    x[0, 1, 0, :] = NAN  # a vector of NaN
    x[0, 2, 0, :32] = NAN  # a group of NaN (a half vector)
    x[0, 3, 0, 31] = NAN  # a NaN at a lane's end
    fast_ops.append_kv(m.get_paged_caches(["s"])[0], x, -x, backend="emulated")
    block = m.describe("s").blocks[0]
    for src, data, scale in ((x, pool.k_pool, pool.k_scale), (-x, pool.v_pool, pool.v_scale)):
        want_data, want_scale = _kernel_rule(fmt, src[0, :, 0], dtype)
        got_data, got_scale = data[0, block, :4, 0], scale[0, block, :4, 0]
        assert torch.equal(got_data.view(torch.uint8), want_data.view(torch.uint8))
        same = (bits(got_scale) == bits(want_scale)) | (got_scale.isnan() & want_scale.isnan())
        assert same.all()
