# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Eviction: a left-context window over whole blocks
#
# With `num_left_chunks = L >= 0` a chunk attends to the last `W = L * chunk_size`
# frames of its stream plus itself, nothing older. The attention cache therefore
# only has to *hold* that window: at every commit the blocks lying entirely before
# the next chunk's first visible position go back to the pool (first in, first
# out), and the stream's block table shifts left by that many columns.
#
# Because blocks are freed whole, the first visible position can sit *inside* the
# first held block; that is why a paged view carries `cache_seqstarts` as well as
# `cache_seqlens` (the arithmetic is drawn once, in `oasr/cache/config.py`).
#
# This notebook shows
#
# * the block table shifting, chunk by chunk, and the first visible position inside a block,
# * FIFO eviction of whole blocks into the tail of the free list,
# * memory that stays flat however long a stream runs,
# * that streaming the Conformer with the window equals its offline chunk-masked forward,
# * that both twins take the same decisions.

# %%
import matplotlib.pyplot as plt
import torch

import oasr
from oasr.engine import StreamingEngine
from oasr.models import ConformerConfig, StreamingConformer, available_twins, twin_module

TWINS = available_twins()  # the reference, then the fast twin: each check below runs on both
assert TWINS == ["reference", "fast"], TWINS
print("twins checked in this notebook:", TWINS)


def features(num_frames, seed, dim=20):
    return torch.randn(num_frames, dim, generator=torch.Generator().manual_seed(seed))


def run_engine(model, cache_config, twin, streams, piece=24):
    """Push every stream in pieces of ``piece`` frames, one engine tick per piece; return the engine."""
    engine = StreamingEngine(model, cache_config, twin=twin, keep_log_probs=True)
    for sid in streams:
        engine.add_stream(sid)
    pos = dict.fromkeys(streams, 0)
    while any(engine.status(s) != "finished" for s in streams):
        for sid, f in streams.items():
            if not engine.input_ended(sid):
                engine.push(sid, f[pos[sid]:pos[sid] + piece])
                pos[sid] += piece
                if pos[sid] >= f.shape[0]:
                    engine.end_stream(sid)
        engine.step()
    return engine


# %%
# chunk 4 frames, blocks of 3 (neither divides the other), window 2 chunks = 8 frames
cfg = oasr.CacheConfig(num_layers=2, n_kv_head=2, head_dim=16, hidden_dim=32, kernel_size=5, chunk_size=4,
                       num_left_chunks=2, block_size_frames=3, max_num_blocks=16, max_batch_size=2,
                       max_blocks_per_seq=8)
print("W =", cfg.history_frames, "frames; a stream holds at most", cfg.max_logical_blocks, "blocks")


def bookkeeping(twin, chunks):
    """One stream, ``chunks`` chunks: prepare and commit (no model), snapshotting the table each time."""
    mod = twin_module(twin)
    pool = mod.BlockPool(cfg)
    att = mod.AttentionCacheManager(pool, cfg)
    att.allocate_stream("s")
    rows = []
    for i in range(chunks):
        first_visible = att.describe("s").cache_seqstart   # prepare never shifts the table
        att.prepare_chunk("s")
        in_flight = list(att.describe("s").blocks)
        att.commit_chunk_paged("s", cfg.chunk_size)
        info = att.describe("s")
        evicted = [b for b in in_flight if b not in info.blocks]
        rows.append(dict(chunk=i, first_visible=first_visible, in_flight=in_flight, held=list(info.blocks),
                         evicted=evicted, seqstart=info.cache_seqstart, seqlen=info.cache_seqlen,
                         total=info.total_frames, free=pool.free_block_ids(), used=pool.num_used_blocks))
    return rows


rows = bookkeeping("reference", 12)
print(f"{'chunk':>5} {'in flight':18} {'held after commit':18} {'evicted':8} seqstart seqlen total")
for r in rows:
    print(f"{r['chunk']:5d} {str(r['in_flight']):18} {str(r['held']):18} {str(r['evicted']):8} "
          f"{r['seqstart']:8d} {r['seqlen']:6d} {r['total']:5d}")

# %% [markdown]
# ## The table shifting
#
# Each row is the stream's block table while a chunk is in flight (column = logical
# block, number = physical block). The red bar is the chunk's first visible table
# position, often inside block 0. At the commit the grey blocks, which lie
# entirely before the *next* chunk's first visible position, return to the pool;
# the remaining columns slide left and new blocks enter on the right.

# %%
width = cfg.max_logical_blocks
fig, ax = plt.subplots(figsize=(6.5, 5))
for r in rows:
    i = r["chunk"]
    for j, block in enumerate(r["in_flight"]):
        freed = block in r["evicted"]
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="lightgrey" if freed else plt.cm.Pastel1(block % 8)))
        ax.text(j, i, block, ha="center", va="center", fontsize=9, color="grey" if freed else "black")
    start = r["first_visible"] / cfg.block_size_frames - 0.5
    ax.plot([start, start], [i - 0.45, i + 0.45], color="red", lw=2)
ax.set_xlim(-0.5, width - 0.5)
ax.set_ylim(len(rows) - 0.5, -0.5)
ax.set_xticks(range(width))
ax.set_xlabel("table column (logical block)")
ax.set_ylabel("chunk")
ax.set_title("table while each chunk is in flight\nred: first visible position, grey: freed at the chunk's commit",
             fontsize=10)
plt.show()

# %% [markdown]
# What must hold, checked on every chunk:
#
# * a stream never holds more than `max_logical_blocks` blocks, and reaches that bound;
# * after a commit it keeps exactly `min(frames so far, W)` visible frames;
# * the first visible position lies inside the first held block (`0 <= seqstart < block_size`);
# * evicted blocks are appended to the tail of the free list, oldest first.

# %%
W, bs = cfg.history_frames, cfg.block_size_frames
assert max(len(r["in_flight"]) for r in rows) == cfg.max_logical_blocks
for r in rows:
    assert len(r["in_flight"]) <= cfg.max_logical_blocks
    assert r["seqlen"] - r["seqstart"] == min(r["total"], W)
    assert 0 <= r["seqstart"] < bs
    if r["evicted"]:
        assert r["free"][-len(r["evicted"]):] == r["evicted"]          # FIFO, to the tail
        assert r["in_flight"][: len(r["evicted"])] == r["evicted"]     # whole blocks from the front
assert any(0 < r["seqstart"] for r in rows), "some chunk starts its window inside a block"
for twin in TWINS[1:]:
    assert bookkeeping(twin, 12) == rows, twin
print("window, FIFO eviction and seqstart hold;", " and ".join(TWINS), "agree block for block")

# %% [markdown]
# ## Memory stays flat
#
# A stream that runs for a long time holds a constant number of blocks once its
# window is full. 3,000 chunks of 4 frames (8 minutes of audio at 40 ms a frame)
# of bookkeeping. Chunk by chunk the count cycles (blocks of 3 frames under chunks
# of 4: a chunk sometimes needs a new block, a commit sometimes frees two), so the
# left panel shows the first chunks one by one, and the right panel the whole
# stream in windows of 100 chunks, each window's lowest and highest count.

# %%
long_rows = bookkeeping(TWINS[-1], 3000)
in_flight = [len(r["in_flight"]) for r in long_rows]
held = [r["used"] for r in long_rows]
window = 100
starts = range(0, len(long_rows), window)
window_minutes = [long_rows[i]["total"] * 0.04 / 60 for i in starts]

fig, (first, whole) = plt.subplots(1, 2, figsize=(10, 3), gridspec_kw={"width_ratios": [1, 1.4]})
shown = 24
first.step(range(shown), in_flight[:shown], where="mid", marker="o", label="while a chunk is in flight")
first.step(range(shown), held[:shown], where="mid", marker="s", label="after commit and eviction")
first.set(title=f"first {shown} chunks, one by one", xlabel="chunk", ylabel="blocks held",
          ylim=(0, cfg.max_logical_blocks + 1))
first.legend(loc="lower right", fontsize=8)
whole.plot(window_minutes, [max(in_flight[i:i + window]) for i in starts], marker="o", label="in flight, highest")
whole.plot(window_minutes, [max(held[i:i + window]) for i in starts], marker="^", label="after commit, highest")
whole.plot(window_minutes, [min(held[i:i + window]) for i in starts], marker="v", label="after commit, lowest")
whole.set(title=f"8 minutes, per window of {window} chunks", xlabel="stream position (minutes)",
          ylabel="blocks held", ylim=(0, cfg.max_logical_blocks + 1))
whole.legend(loc="lower right", fontsize=8)
fig.suptitle("one stream, eviction on: the blocks it holds stay bounded")
fig.tight_layout()
plt.show()

window_blocks = -(-W // bs)
assert max(in_flight) == cfg.max_logical_blocks
assert set(held[10:]) <= {window_blocks, window_blocks + 1}
assert max(r["seqlen"] for r in long_rows) < W + bs            # table positions stay small
print("blocks held after the window filled:", sorted(set(held[10:])), "in flight at most", max(in_flight))

# %% [markdown]
# ## Streaming with the window equals offline
#
# The model's offline forward applies the same window as a mask: a frame in
# chunk `c` sees chunks `[c - L, c]`. Streams of different lengths run through
# the engine (the window, eviction and blocks of 3 under a chunk of 4) and each
# equals its offline forward within 1e-5 in fp32. The unlimited offline forward
# is far off, so the check would notice a window that is too wide.

# %%
model = StreamingConformer(ConformerConfig(num_left_chunks=2, chunk_size=4, seed=0))
cache_config = model.config.cache_config(block_size_frames=3, max_batch_size=4)
streams = {f"s{i}": features(n, i) for i, n in enumerate([16 * 20 + 5, 16 * 9, 77])}
for twin in TWINS:
    engine = run_engine(model, cache_config, twin, streams)
    for sid, f in streams.items():
        got = engine.result(sid).log_probs
        windowed = model.forward_offline(f[None])[0][0]
        unlimited = model.forward_offline(f[None], num_left_chunks=-1)[0][0]
        assert (got - windowed).abs().max() <= 1e-5, (twin, sid)
        if sid == "s0":
            assert (got - unlimited).abs().max() > 1e-3
    assert engine.pool.num_used_blocks == 0
    print(twin, ": streaming == offline with the window for", list(streams))
