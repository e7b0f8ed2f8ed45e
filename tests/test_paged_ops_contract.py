"""``append_kv`` / ``paged_attention`` refuse bad input before writing anything.

Each case runs on both twins through a manager's views, checks the words of the
error (what was expected, what came) and that the pool, scratch block included,
is byte for byte what it was.
"""

from __future__ import annotations

import pytest
import torch

import oasr
from tests.conftest import small_config


def two_stream_setup(twin, **overrides):
    """Two streams prepared for a 5-frame chunk, 3-frame blocks."""
    fields = dict(num_layers=1, n_kv_head=1, head_dim=4, hidden_dim=4, kernel_size=3, chunk_size=5,
                  block_size_frames=3, max_num_blocks=8, max_batch_size=2, max_blocks_per_seq=4)  # fmt: skip
    fields.update(overrides)
    cfg = oasr.CacheConfig(**fields)
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg)
    att.allocate_stream("a")
    att.allocate_stream("b")
    att.prepare_chunks_batched(["a", "b"])
    return cfg, pool, att, att.get_paged_caches(["a", "b"])[0]


def pool_bytes(pool) -> list[torch.Tensor]:
    tensors = [pool.k_pool, pool.v_pool] + ([pool.k_scale, pool.v_scale] if pool.k_scale is not None else [])
    return [t.view(torch.uint8).clone() for t in tensors]


def assert_pool_unchanged(pool, before) -> None:
    for old, new in zip(before, pool_bytes(pool), strict=True):
        assert torch.equal(old, new)


@pytest.mark.parametrize("chunk_lens", [[5, 6], [5, -1], torch.tensor([5, 6]), torch.tensor([4, 9], dtype=torch.int64)])
def test_append_kv_is_atomic_on_bad_chunk_lens(twin, chunk_lens):
    # A regression: the reference wrote row 0 before finding row 1's length bad.
    _, pool, _, cache = two_stream_setup(twin)
    k = torch.ones(2, 5, 1, 4)
    before = pool_bytes(pool)
    with pytest.raises(ValueError, match=r"chunk_lens\[1\]=(6|-1|9) outside \[0, T=5\]"):
        twin.append_kv(cache, k, k, chunk_lens)
    assert_pool_unchanged(pool, before)
    twin.append_kv(cache, k, k, [5, 4])  # the same call with good lengths writes
    assert pool.k_pool.eq(1).sum() == 9 * 4


@pytest.mark.parametrize(
    "k_dtype,message",
    [(torch.float16, "k must be torch.float32, the pool's dtype, got torch.float16"),
     (torch.int64, "k must be torch.float32, the pool's dtype, got torch.int64"),
     (torch.float64, "k must be torch.float32, the pool's dtype, got torch.float64")],
)  # fmt: skip
def test_append_kv_refuses_a_dtype_other_than_the_pools(twin, k_dtype, message):
    # A regression: fp16 or int64 K into an fp32 pool were cast silently.
    _, pool, _, cache = two_stream_setup(twin)
    before = pool_bytes(pool)
    k = torch.ones(2, 5, 1, 4, dtype=k_dtype)
    with pytest.raises(ValueError, match=message):
        twin.append_kv(cache, k, k)
    with pytest.raises(ValueError, match=message.replace("k must", "v must")):
        twin.append_kv(cache, torch.ones(2, 5, 1, 4), k)
    assert_pool_unchanged(pool, before)


@pytest.mark.parametrize("q_dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_paged_attention_refuses_a_q_dtype_other_than_the_pools(twin, q_dtype):
    _, _, _, cache = two_stream_setup(twin)
    twin.append_kv(cache, torch.ones(2, 5, 1, 4), torch.ones(2, 5, 1, 4))
    with pytest.raises(ValueError, match=f"q must be torch.float32, the pool's dtype, got {q_dtype}"):
        twin.paged_attention(torch.ones(2, 1, 5, 4, dtype=q_dtype), cache)


def test_fp8_pages_take_the_model_dtype_only(twin):
    # fp8 pages: K, V and q in CacheConfig.dtype (here fp16); fp32 K used to be accepted and quantized.
    if not getattr(twin, "SUPPORTS_FP8", twin.__name__ == "oasr.reference"):
        pytest.skip(f"{twin.__name__} has no fp8 K/V")
    _, pool, _, cache = two_stream_setup(twin, dtype=torch.float16, kv_cache_dtype="fp8_e4m3")
    assert cache.model_dtype == torch.float16 and cache.served_dtype == torch.float16
    before = pool_bytes(pool)
    expected = "must be torch.float16, the model dtype \\(CacheConfig.dtype\\), got"
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        with pytest.raises(ValueError, match=f"k {expected} {dtype}"):
            twin.append_kv(cache, torch.ones(2, 5, 1, 4, dtype=dtype), torch.ones(2, 5, 1, 4, dtype=dtype))
        with pytest.raises(ValueError, match=f"q {expected} {dtype}"):
            twin.paged_attention(torch.ones(2, 1, 5, 4, dtype=dtype), cache)
    assert_pool_unchanged(pool, before)
    k = torch.ones(2, 5, 1, 4, dtype=torch.float16)
    twin.append_kv(cache, k, k)
    out = twin.paged_attention(torch.ones(2, 1, 5, 4, dtype=torch.float16), cache)
    assert out.dtype == torch.float16 and out.eq(1).all()


def prepared_setup(twin, pad_to=None):
    """One stream, chunk_size 16, 4-frame blocks, prepared for 8 frames (two blocks: room for 8)."""
    cfg = small_config(num_layers=1, chunk_size=16, block_size_frames=4, num_left_chunks=-1, max_num_blocks=16,
                       max_blocks_per_seq=8, max_batch_size=2)  # fmt: skip
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg, pad_lanes=1)
    att.allocate_stream("s")
    att.prepare_chunk("s", 8)
    cache = att.get_paged_caches(["s"], pad_to=pad_to)[0]
    return cfg, pool, att, cache


def test_append_kv_refuses_more_frames_than_prepared(twin):
    # A regression: T = 16 after preparing 8 wrote frames 8..15 into the scratch block.
    cfg, pool, att, cache = prepared_setup(twin)
    assert cache.prepared_frames == (8,)
    k = torch.randn(1, 16, cfg.n_kv_head, cfg.head_dim)
    before = pool_bytes(pool)
    with pytest.raises(ValueError, match="row 0 has a chunk of 16 frames, more than the 8 frames prepared"):
        twin.append_kv(cache, k, k)
    with pytest.raises(ValueError, match="row 0 has a chunk of 9 frames, more than the 8 frames prepared"):
        twin.append_kv(cache, k, k, [9])
    assert_pool_unchanged(pool, before)
    twin.append_kv(cache, k, k, [8])  # 16 frames of which 8 are the row's: fine
    q = torch.randn(1, 2 * cfg.n_kv_head, 16, cfg.head_dim)
    with pytest.raises(ValueError, match="row 0 has a chunk of 16 query frames"):
        twin.paged_attention(q, cache)
    assert twin.paged_attention(q, cache, [8])[:, :, 8:].eq(0).all()
    att.commit_chunk_paged("s", 8)  # what was prepared and written commits


def test_padding_rows_take_a_whole_chunk(twin):
    cfg, pool, att, cache = prepared_setup(twin, pad_to=2)
    assert cache.prepared_frames == (8, cfg.chunk_size)
    k = torch.randn(2, 16, cfg.n_kv_head, cfg.head_dim)
    twin.append_kv(cache, k, k, [8, 16])  # the padding row writes its whole chunk into scratch


def test_prepared_frames_follow_commits_and_blocks(twin):
    # The limit is what the row's blocks hold past its length, at most chunk_size: what a commit accepts.
    cfg, pool, att, cache = prepared_setup(twin)
    att.commit_chunk_paged("s", 6)  # length 6, two blocks: 2 frames of room
    assert att.get_paged_caches(["s"])[0].prepared_frames == (2,)
    att.prepare_chunk("s")  # chunk_size 16 more: blocks up to frame 24, capped at 16
    assert att.get_paged_caches(["s"])[0].prepared_frames == (16,)


def test_q_in_the_kv_layout_is_refused(twin):
    # q is (B, n_head, T, D), K/V (B, T, n_kv_head, D). A q passed as (B, T, n_head, D)
    # whose sizes fit was misread; now its T is checked against the prepared frames, its heads
    # against n_kv_head, and the message states both layouts.
    cfg = small_config(num_layers=1, n_kv_head=2, chunk_size=4, block_size_frames=4)
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg)
    att.allocate_stream("s")
    att.prepare_chunk("s")
    cache = att.get_paged_caches(["s"])[0]
    k = torch.randn(1, 4, 2, cfg.head_dim)
    twin.append_kv(cache, k, k)
    q = torch.randn(1, 8, 4, cfg.head_dim)  # n_head 8, T 4
    assert twin.paged_attention(q, cache).shape == q.shape
    with pytest.raises(ValueError, match=r"row 0 has a chunk of 8 query frames \(q's dim 2\)"):
        twin.paged_attention(q.transpose(1, 2).contiguous(), cache)  # (1, 4, 8, D): would read 4 heads, T 8
    q3 = torch.randn(1, 6, 3, cfg.head_dim)  # n_head 6, T 3, in the wrong layout: 3 "heads"
    heads = r"n_head=3 must be a multiple of n_kv_head=2; q must be .*K/V are \(B, T, n_kv_head.*got \(1, 3, 6, 8\)"
    with pytest.raises(ValueError, match=heads):
        twin.paged_attention(q3.transpose(1, 2).contiguous(), cache)
    with pytest.raises(ValueError, match=r"append_kv: k must be \(B=1, T, n_kv_head=2, head_dim=8\)"):
        twin.append_kv(cache, k[:, :3].transpose(1, 2).contiguous(), k[:, :3].transpose(1, 2).contiguous())


def test_q_in_the_kv_layout_is_named_when_chunk_lens_exceed_its_frames(twin):
    """A (B, T, n_head, D) q whose head count passes for frames: the error names q's layout, not only
    chunk_lens (it used to say "chunk_lens[0]=4 outside [0, T=2]" and nothing about the layout)."""
    cfg = small_config(num_layers=1, n_kv_head=2, chunk_size=4, block_size_frames=4)
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg)
    att.allocate_stream("s")
    att.prepare_chunk("s")
    cache = att.get_paged_caches(["s"])[0]
    k = torch.randn(1, 4, 2, cfg.head_dim)
    twin.append_kv(cache, k, k)
    q = torch.randn(1, 2, 4, cfg.head_dim)  # n_head 2, T 4
    assert twin.paged_attention(q, cache, [4]).shape == q.shape
    layout = (r"q must be \(B, n_head, T, head_dim\), heads before frames; if it is \(B, T, n_head, head_dim\), "
              r"pass q.transpose\(1, 2\)")
    wrong = q.transpose(1, 2).contiguous()  # (1, 4, 2, D): 4 "heads", T 2
    with pytest.raises(ValueError, match=r"chunk_lens\[0\]=4 is more than q's T=2 \(its dim 2\)\. " + layout):
        twin.paged_attention(wrong, cache, [4])
    with pytest.raises(ValueError, match=r"chunk_lens\[0\]=4 is more than q's T=2 .*" + layout):
        twin.paged_attention(wrong, cache, torch.tensor([4]))
