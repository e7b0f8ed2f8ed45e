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
from oasr import session as S
from oasr.config import CacheConfig
from oasr.fast.kernels.testing import bits

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
    data = S.save_stream("s", att, [cnn])
    att2, cnn2 = _stack(TWINS[dst], config)
    S.load_stream(data, "s", att2, [cnn2])
    assert S.save_stream("s", att2, [cnn2]) == data
    assert torch.equal(bits(att2.pool.k_scale), bits(att.pool.k_scale))


def test_q8_0_loader_still_refuses_nan_and_negative_d():
    from oasr.session import SessionError, _decode_attention

    config = CacheConfig(num_layers=1, n_kv_head=1, head_dim=32, hidden_dim=4, kernel_size=3, chunk_size=4,
                         num_left_chunks=2, block_size_frames=4, max_num_blocks=8, max_batch_size=1,
                         max_blocks_per_seq=8, kv_cache_dtype="q8_0")
    att, cnn = _stack(fast, config)
    att.allocate_stream("s")
    cnn.allocate_stream("s")
    att.commit("s", torch.randn(1, 1, 4, 64))
    session = S.capture_stream("s", att, [cnn])
    for bad in (float("nan"), -1.0, float("-inf")):
        kv = session.kv
        scale = kv.k_scale.clone()
        scale.view(-1)[0] = bad
        raw = S._encode_attention(type(kv)(kv.seqlen, kv.seqstart, kv.total_frames, kv.k, kv.v, scale, kv.v_scale))
        with pytest.raises(SessionError, match="K scale is negative or NaN"):
            _decode_attention(raw, session.geometry)
