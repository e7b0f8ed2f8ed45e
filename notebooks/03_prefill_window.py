# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · The prefilled window: a zeroed, constant-length history
#
# With `CacheConfig(prefill_kv_window=True)` every stream is admitted already
# holding its whole K/V window, `W = num_left_chunks * chunk_size` frames, all
# zero. From the first chunk on, every stream reports the same cached length
# `W`. That uniformity is what an encoder with a trained window needs (a relative
# position table shared by the whole cohort is only right when every row has the
# same history), and it keeps the set of shapes a graph capture sees small.
#
# The window must be **zeroed**, not merely reserved: a zero key scores 0 and a
# zero value adds nothing, so the prefilled frames act like the zero padding of
# an offline pass. A block recycled from a finished stream holds that stream's
# old K/V; a NaN there poisons every chunk that reads it. This notebook shows
#
# * the constant cached length across a cohort that started at different times;
# * a poisoned pool whose blocks are recycled into prefilled windows: every twin
#   hands out zeros, while blocks that were only reserved would turn the output to NaN;
# * streaming with the prefilled window equals offline with `W` zero keys.

# %%
import matplotlib.pyplot as plt
import torch

import oasr
from oasr.engine import StreamingEngine, decode_utterance
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
model = StreamingConformer(ConformerConfig(num_left_chunks=2, chunk_size=4, seed=0))
cfg = model.config.cache_config(block_size_frames=3, max_batch_size=4, prefill_kv_window=True)
W = cfg.history_frames
print(f"W = {W} frames, prefilled in {cfg.prefill_blocks} blocks of {cfg.block_size_frames}")

def cached_lengths(cache_config, twin):
    """Three streams joining at ticks 0, 2, 5; each active stream's cached length after every tick."""
    engine = StreamingEngine(model, cache_config, twin=twin)
    joins = {"a": 0, "b": 2, "c": 5}
    history = {s: [] for s in joins}
    for tick in range(10):
        for sid, start in joins.items():
            if tick == start:
                engine.add_stream(sid)
            if tick >= start:
                engine.push(sid, features(16, tick))
        engine.step()
        for sid in history:
            history[sid].append(engine.att.cached_frames(sid) if sid in engine.active_ids else None)
    return history

plain_cfg = model.config.cache_config(block_size_frames=3, max_batch_size=4)
fig, axes = plt.subplots(1, 2, figsize=(9, 2.8), sharey=True)
for ax, (name, c) in zip(axes, [("no prefill", plain_cfg), ("prefilled window", cfg)], strict=True):
    for sid, values in cached_lengths(c, TWINS[-1]).items():
        ax.plot(range(10), [float("nan") if v is None else v for v in values], marker="o", label=sid)
    ax.set_title(name)
    ax.set_xlabel("tick")
    ax.set_ylabel("cached frames before the chunk")
axes[1].legend()
fig.suptitle("cached length each stream reports, tick by tick")
plt.tight_layout()
plt.show()

for twin in TWINS:
    for sid, values in cached_lengths(cfg, twin).items():
        assert {v for v in values if v is not None} == {W}, (twin, sid, values)
    plain = cached_lengths(plain_cfg, twin)
    assert len({v for values in plain.values() for v in values if v is not None}) > 1
print("prefilled: every stream reports", W, "cached frames at every tick, on", TWINS)

# %% [markdown]
# ## Why zeroed, not reserved
#
# We poison a pool with NaN (standing for any stale K/V a finished stream left
# behind), recycle every block through the free list, and then admit a stream
# with a prefilled window. Each twin's admission zeroes exactly
# the blocks it hands out: its window reads zeros and its first chunk is finite.
#
# The counter-example takes the same recycled blocks with a bare
# `pool.allocate` (reserved, not zeroed) and runs paged attention over them as a
# window: the output is NaN, which no mask can repair once it is multiplied in.

# %%
torch.manual_seed(0)
for twin in TWINS:
    mod = twin_module(twin)
    pool = mod.BlockPool(cfg)
    att = mod.AttentionCacheManager(pool, cfg)
    pool.k_pool.fill_(float("nan"))                   # stale K/V everywhere; NaN stands for any of it
    pool.v_pool.fill_(float("nan"))
    taken = pool.allocate(cfg.max_num_blocks)         # recycle every block: the free list is now
    pool.free(taken[::-1])                            # a permutation of used, still-poisoned blocks
    att.allocate_stream("fresh")
    window = list(att.describe("fresh").blocks)
    assert window == taken[::-1][: cfg.prefill_blocks]
    assert len(window) == cfg.prefill_blocks and att.cached_frames("fresh") == W
    assert torch.equal(pool.k_pool[:, window], torch.zeros_like(pool.k_pool[:, window]))
    assert torch.equal(pool.v_pool[:, window], torch.zeros_like(pool.v_pool[:, window]))
    assert torch.isnan(pool.k_pool[:, pool.free_block_ids()]).all()   # zeroed exactly what it handed out
    att.prepare_chunk("fresh")
    cache = att.get_paged_caches(["fresh"])[0]
    k = torch.randn(1, cfg.chunk_size, cfg.n_kv_head, cfg.head_dim)
    q = torch.randn(1, 4, cfg.chunk_size, cfg.head_dim)
    mod.append_kv(cache, k, k)
    zeroed_out = mod.paged_attention(q, cache)
    assert torch.isfinite(zeroed_out).all()

    reserved = pool.allocate(cfg.prefill_blocks)     # the same kind of blocks, only reserved
    assert torch.isnan(pool.k_pool[:, reserved]).all()
    bad = oasr.PagedKVCache(cache.k_cache, cache.v_cache,
                            torch.tensor([reserved + [pool.null_block] * (cfg.max_blocks_per_seq - len(reserved))],
                                         dtype=torch.int32),
                            torch.tensor([W], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                            cfg.block_size_frames, W, W)
    mod.append_kv(bad, k, k)
    reserved_out = mod.paged_attention(q, bad)
    assert torch.isnan(reserved_out).all()
    print(f"{twin:9s}: prefilled window blocks {window} read zeros, output finite; "
          f"reserved blocks {reserved} -> NaN output")

# %% [markdown]
# ## Streaming with the prefilled window equals offline with zero keys
#
# Offline, the same window is `W` zero keys and values placed before frame 0:
# chunk 0 sees them, chunk `L` and later do not. The engine run with prefilled
# streams equals that forward within 1e-5, and is far from the forward without
# the zero keys (so the zeros are really read).

# %%
streams = {f"s{i}": features(n, 10 + i) for i, n in enumerate([16 * 8 + 3, 16 * 3, 50, 16 * 11])}
for twin in TWINS:
    engine = run_engine(model, cfg, twin, streams)
    for sid, f in streams.items():
        got = engine.result(sid).log_probs
        with_zeros = model.forward_offline(f[None], prefill_window=True)[0][0]
        without = model.forward_offline(f[None])[0][0]
        assert (got - with_zeros).abs().max() <= 1e-5, (twin, sid)
        assert (got - without).abs().max() > 1e-3, (twin, sid)
        assert engine.result(sid).tokens == decode_utterance(with_zeros, engine.decoder, engine.ctc_config)
    print(twin, ": streaming with the prefilled window == offline with", W, "zero keys")
