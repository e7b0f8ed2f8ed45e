"""The page formats' corner cases, one rule in every place that stores or reads them.

* q8_0's ``d = inf`` (a block whose amax passes 127 x 65520: GGML's own corner) is stored by append,
  written by ``save_stream`` and accepted by the loader.
* affine4 groups whose minimum is a zero store ``+0`` as their bias (and a zero scale as ``+0``) in the
  reference, the fast twin and the kernels alike (not whichever zero amin, aminmax or fminf picks).
* NaN on the kernel path: what the kernels store, as documented in ``oasr.fast.paged_ops``.
"""

from __future__ import annotations

import pytest
import torch

from oasr import fast, reference
from oasr.cache.config import CacheConfig
from oasr.fast.kernels.testing import bits
from oasr.sessions import format as S
from oasr.sessions import stream as SS

TWINS = {"reference": reference, "fast": fast}


def _stack(ops, config: CacheConfig):
    pool = ops.BlockPool(config, scratch_blocks=1)
    return ops.AttentionCacheManager(pool, config, pad_lanes=1), ops.CnnCacheManager(config, pad_lanes=1)


# ---- item 10: q8_0's d = inf survives save and load ------------------------------------------------------

@pytest.mark.parametrize("src,dst", [("reference", "fast"), ("fast", "reference"), ("fast", "fast")])
def test_q8_0_infinite_d_saves_and_loads(src, dst):
    config = CacheConfig(num_layers=2, n_kv_head=2, head_dim=64, hidden_dim=4, kernel_size=3, chunk_size=4,
                         num_left_chunks=2, block_size_frames=4, max_num_blocks=32, max_batch_size=2,
                         max_blocks_per_seq=8, kv_cache_dtype="q8_0")
    g = torch.Generator().manual_seed(3)
    chunk = torch.randn(2, 2, 4, 128, generator=g)
    chunk[0, 1, 2, 5] = 1e7  # K of layer 0, head 1, frame 2: amax 1e7 > 127 * 65520, d overflows fp16
    att, cnn = _stack(TWINS[src], config)
    att.allocate_stream("s")
    cnn.allocate_stream("s")
    att.commit("s", chunk)
    assert torch.isposinf(att.pool.k_scale.float()).sum() == 1  # append stored GGML's d = inf
    data = SS.save_stream("s", att, [cnn])
    att2, cnn2 = _stack(TWINS[dst], config)
    SS.load_stream(data, "s", att2, [cnn2])
    assert SS.save_stream("s", att2, [cnn2]) == data
    assert torch.equal(bits(att2.pool.k_scale), bits(att.pool.k_scale))


@pytest.mark.parametrize("src,dst", [("reference", "fast"), ("fast", "reference")])
def test_q8_0_infinite_d_in_decoder_rows_saves_and_loads(src, dst):
    from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
    from oasr.sessions import decoder_rows as DS

    cfg = DecoderCacheConfig(num_layers=2, n_kv_head=2, head_dim=64, page_size=4, max_num_blocks=16, max_rows=2,
                             max_self_tokens=8, max_cross_tokens=4, kv_cache_dtype="q8_0")
    saved = TWINS[src].DecoderKVCacheManager(cfg)
    (row,) = saved.admit([DecoderRequest(3, 2, 0)])
    k, v = torch.randn(2, 3, 2, 64), torch.randn(2, 3, 2, 64)
    v[1, 2, 0, 40] = -2e7  # d overflows fp16: GGML's d = inf
    saved.prefill(row, k, v)
    assert torch.isposinf(saved.pool.v_scale.float()).sum() == 1
    raw = DS.encode_decoder_rows(DS.capture_paged(saved, [row]))
    loaded = TWINS[dst].DecoderKVCacheManager(cfg)
    (new,) = DS.restore_paged(DS.decode_decoder_rows(raw), loaded)
    assert DS.encode_decoder_rows(DS.capture_paged(loaded, [new])) == raw


def test_q8_0_loader_still_refuses_nan_and_negative_d():
    from oasr.sessions.format import SessionError, _decode_attention

    config = CacheConfig(num_layers=1, n_kv_head=1, head_dim=32, hidden_dim=4, kernel_size=3, chunk_size=4,
                         num_left_chunks=2, block_size_frames=4, max_num_blocks=8, max_batch_size=1,
                         max_blocks_per_seq=8, kv_cache_dtype="q8_0")
    att, cnn = _stack(fast, config)
    att.allocate_stream("s")
    cnn.allocate_stream("s")
    att.commit("s", torch.randn(1, 1, 4, 64))
    session = SS.capture_stream("s", att, [cnn])
    for bad in (float("nan"), -1.0, float("-inf")):
        kv = session.kv
        scale = kv.k_scale.clone()
        scale.view(-1)[0] = bad
        raw = S._encode_attention(type(kv)(kv.seqlen, kv.seqstart, kv.total_frames, kv.k, kv.v, scale, kv.v_scale))
        with pytest.raises(SessionError, match="K scale is negative or NaN"):
            _decode_attention(raw, session.geometry)


# ---- item 9: affine4's signed zeros, one rule in the reference, the fast twin and the kernels ----------

def _zero_groups(dtype, head_dim=64, frames=6, seed=0) -> torch.Tensor:
    """(frames, head_dim) vectors whose 32-value groups have a zero minimum of either sign, or are all
    zeros of mixed signs, or round their minimum to a zero in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(frames, head_dim, generator=g) * 4
    for f in range(frames):
        signs = torch.randint(0, 2, (head_dim,), generator=g).bool()
        zeros = torch.where(signs, torch.tensor(-0.0), torch.tensor(0.0))
        where = torch.rand(head_dim, generator=g) < (0.3 + 0.1 * f)
        x[f] = torch.where(where, zeros, x[f])
    x[0] = torch.where(torch.rand(head_dim, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))  # all zeros
    x[1, :32] = -0.0  # a group of -0 only
    x[1, 32:] = 0.0
    x[2, 0] = -1e-30  # a tiny negative minimum: M(lo) rounds to -0 in fp16 (and fp32 keeps it)
    x[2, 40] = -1e-30
    return x.to(dtype)


def _fast_append_bytes(fmt, dtype, k, v, backend):
    from oasr.fast import paged_ops as fast_ops

    cfg = CacheConfig(num_layers=1, n_kv_head=1, head_dim=64, chunk_size=k.shape[1], block_size_frames=8,
                      max_num_blocks=4, max_batch_size=1, max_blocks_per_seq=4, num_left_chunks=-1,
                      kv_cache_dtype=fmt, dtype=dtype)
    pool = fast.BlockPool(cfg)
    m = fast.AttentionCacheManager(pool, cfg)
    m.allocate_stream("s")
    m.prepare_chunk("s", k.shape[1])
    fast_ops.append_kv(m.get_paged_caches(["s"])[0], k, v, backend=backend)
    return pool.k_scale, pool.k_pool, pool.v_scale, pool.v_pool


@pytest.mark.parametrize("fmt", ["affine4", "affine4_g64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_affine4_stores_a_zero_scale_and_bias_as_plus_zero(fmt, dtype):
    from oasr.fast.kv_formats import quantize as fast_quantize
    from oasr.kv_formats import get_format

    x = _zero_groups(dtype)
    want_codes, want = get_format(fmt).quantize(x, dtype)
    got_codes, got = fast_quantize(fmt, x, dtype)
    assert torch.equal(bits(got), bits(want)) and torch.equal(got_codes, want_codes)
    zero = want.float() == 0
    assert zero.any()
    assert (bits(want)[zero] == 0).all()  # every zero scale and bias is +0
    # the kernels (host emulation) store the same bytes through append_kv; the torch backend too
    k = x[None, :, None, :]
    v = -x.flip(0)[None, :, None, :]
    ref_v_codes, ref_v = get_format(fmt).quantize(v[0, :, 0], dtype)
    for backend in ("torch", "emulated"):
        if backend == "emulated":
            from oasr.fast.kernels import emulation

            try:
                emulation.emulation_toolchain()
            except emulation.EmulationUnavailable as exc:
                pytest.skip(f"kernel emulation unavailable: {exc}")
        k_scale, k_pool, v_scale, v_pool = _fast_append_bytes(fmt, dtype, k, v, backend)
        frames = x.shape[0]
        assert torch.equal(bits(k_scale[0, 0, :frames, 0]), bits(want)), backend
        assert torch.equal(k_pool[0, 0, :frames, 0], want_codes), backend
        assert torch.equal(bits(v_scale[0, 0, :frames, 0]), bits(ref_v)), backend
        assert torch.equal(v_pool[0, 0, :frames, 0], ref_v_codes), backend
