# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Paging: one shared pool, one block table per stream
#
# A streaming encoder keeps every stream's attention K/V. Giving each stream a
# contiguous buffer sized for its longest possible life wastes most of it; oasr
# instead cuts K/V into **blocks** of `block_size_frames` frames, keeps all
# blocks of all streams in **one pool**, and gives each stream a **block table**
# mapping its logical blocks to physical ones.
#
# This notebook walks through the pool with three streams that come and go, and
# checks at every step that
#
# * gathering a stream's pages gives exactly the K/V a dense cache would hold, and
# * paged attention equals plain attention (torch SDPA) on that dense copy, and
# * the fast twin (`oasr.fast`) makes the same decisions as the reference.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import oasr
from oasr import reference as ref
from oasr.cache import memory

torch.manual_seed(0)
cfg = oasr.CacheConfig(num_layers=2, n_kv_head=2, head_dim=8, hidden_dim=16, kernel_size=3,
                       chunk_size=4, num_left_chunks=-1, block_size_frames=4,
                       max_num_blocks=24, max_batch_size=3, max_blocks_per_seq=8)
pool = ref.BlockPool(cfg)                      # one scratch block past the 24 allocatable ones
att = ref.AttentionCacheManager(pool, cfg)
print("pool K shape:", tuple(pool.k_pool.shape), " null/scratch block:", pool.null_block)
print("each stream may hold", cfg.blocks_per_stream, "blocks =", cfg.max_stream_frames, "frames")
print(memory.footprint(cfg).format())

# %% [markdown]
# ## Streams come and go
#
# Stream `a` starts first, `b` joins at tick 2, `c` at tick 4, and `a` leaves at
# tick 6. Each tick, every live stream prepares a chunk (a block is taken from
# the pool only when the chunk crosses into a logical block the stream does not
# hold yet), writes its chunk's K/V through its table with `append_kv`, and
# commits. Beside the pool we keep a plain dense concatenation of each stream's
# K/V, the thing paging must reproduce.

# %%
schedule = {0: ["a"], 2: ["b"], 4: ["c"]}
leaves = {6: ["a"]}
dense = {}                       # stream -> list of (layer, T, H, D) K chunks
used, tables = [], []
for tick in range(9):
    for sid in schedule.get(tick, []):
        att.allocate_stream(sid)
        dense[sid] = []
    for sid in leaves.get(tick, []):
        att.free_stream(sid)
        del dense[sid]
    live = att.stream_ids
    att.prepare_chunks_batched(live)           # one pool allocation for the whole cohort
    caches = att.get_paged_caches(live)        # one PagedKVCache per layer
    k = torch.randn(cfg.num_layers, len(live), cfg.chunk_size, cfg.n_kv_head, cfg.head_dim)
    for layer, cache in enumerate(caches):
        ref.append_kv(cache, k[layer], -k[layer])
    for row, sid in enumerate(live):
        dense[sid].append(k[:, row])
    att.commit_chunks_batched(live, [cfg.chunk_size] * len(live))
    used.append(pool.num_used_blocks)
    tables.append({sid: att.describe(sid).blocks for sid in live})
for sid in att.stream_ids:
    print(sid, att.describe(sid))
print("free list head:", pool.free_block_ids()[:8])

# %% [markdown]
# A block table as a picture: one row per slot, one column per logical block,
# the colour is the physical block id (white: unused). Stream `a`'s freed
# blocks went to the *tail* of the free list, so they are reused last.

# %%
import numpy as np

grid = np.full((cfg.max_batch_size, cfg.max_blocks_per_seq), np.nan)
for sid in att.stream_ids:
    blocks = att.describe(sid).blocks
    grid[att.slot_of(sid), : len(blocks)] = blocks
fig, axes = plt.subplots(1, 2, figsize=(10, 3))
im = axes[0].imshow(grid, cmap="viridis", vmin=0, vmax=cfg.max_num_blocks)
for (r, c), v in np.ndenumerate(grid):
    if not np.isnan(v):
        axes[0].text(c, r, int(v), ha="center", va="center", color="w", fontsize=8)
axes[0].set(title="block tables (slot x logical block)", xlabel="logical block", ylabel="slot")
axes[1].plot(used, marker="o")
axes[1].set(title="pool occupancy", xlabel="tick", ylabel="blocks in use", ylim=(0, cfg.max_num_blocks))
plt.tight_layout()

# %% [markdown]
# ## The pages hold exactly the dense cache

# %%
for sid in att.stream_ids:
    paged = att.get_stacked_cache(sid)                          # (L, H, T, 2D), gathered from pages
    k_dense = torch.cat(dense[sid], dim=1).transpose(1, 2)      # (L, H, T, D)
    assert torch.equal(paged[..., : cfg.head_dim], k_dense)
    assert torch.equal(paged[..., cfg.head_dim :], -k_dense)
blocks_owned = [b for sid in att.stream_ids for b in att.describe(sid).blocks]
assert sorted(blocks_owned + pool.free_block_ids()) == list(range(cfg.max_num_blocks))
print("paged gather == dense concatenation for", att.stream_ids)

# %% [markdown]
# ## Paged attention equals SDPA on the dense copy
#
# `paged_attention` lets each chunk query attend to its own stream's pages,
# `[cache_seqstarts, cache_seqlens + chunk)`, with no mask inside the chunk. We
# write one more chunk and compare with `torch.nn.functional.scaled_dot_product_attention`
# on the dense K/V (with grouped-query attention: 4 query heads over 2 KV heads).

# %%
live = att.stream_ids
att.prepare_chunks_batched(live)
cache = att.get_paged_caches(live)[0]
k = torch.randn(len(live), cfg.chunk_size, cfg.n_kv_head, cfg.head_dim)
q = torch.randn(len(live), 4, cfg.chunk_size, cfg.head_dim)
ref.append_kv(cache, k, -k)
out = ref.paged_attention(q, cache)
for row, sid in enumerate(live):
    keys = torch.cat([torch.cat(dense[sid], 1)[0], k[row]], 0).transpose(0, 1)  # (H, T, D)
    keys = keys.repeat_interleave(2, dim=0)
    expect = F.scaled_dot_product_attention(q[row], keys, -keys)
    torch.testing.assert_close(out[row], expect, atol=1e-5, rtol=1e-5)
print("paged attention == SDPA for", live)

# %% [markdown]
# ## The fast twin makes the same decisions
#
# `oasr.fast` keeps the same bookkeeping in slot-indexed persistent tensors and
# flat host arrays, and runs `append_kv` / `paged_attention` through its own
# backend (vectorised torch on the CPU here, CUDA kernels on a GPU). Replaying
# the same schedule with the same random K/V must give the same block ids, the
# same free list, the same pages and the same attention.

# %%
from oasr import fast
from oasr.fast.backend import backend_choices


def replay(twin):
    torch.manual_seed(1)
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg)
    outs = []
    for tick in range(9):
        for sid in schedule.get(tick, []):
            att.allocate_stream(sid)
        for sid in leaves.get(tick, []):
            att.free_stream(sid)
        live = att.stream_ids
        att.prepare_chunks_batched(live)
        caches = att.get_paged_caches(live)
        k = torch.randn(cfg.num_layers, len(live), cfg.chunk_size, cfg.n_kv_head, cfg.head_dim)
        q = torch.randn(len(live), 4, cfg.chunk_size, cfg.head_dim)
        for layer, cache in enumerate(caches):
            twin.append_kv(cache, k[layer], -k[layer])
            outs.append(twin.paged_attention(q, cache))
        att.commit_chunks_batched(live, [cfg.chunk_size] * len(live))
    return pool, att, outs


ref_pool, ref_att, ref_outs = replay(ref)
fast_pool, fast_att, fast_outs = replay(fast)
assert ref_pool.free_block_ids() == fast_pool.free_block_ids()
for sid in ref_att.stream_ids:
    assert ref_att.describe(sid) == fast_att.describe(sid)
    assert torch.equal(ref_att.get_paged_state_views(sid)[0], fast_att.get_paged_state_views(sid)[0])
    assert torch.equal(ref_att.get_stacked_cache(sid), fast_att.get_stacked_cache(sid))
assert torch.equal(ref_pool.k_pool, fast_pool.k_pool)
for a, b in zip(ref_outs, fast_outs, strict=True):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
print("fast twin == reference: tables, free list, pages, attention;  fast backend on CPU:", backend_choices())
