# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · One pool, many kinds of layer
#
# A streaming cache is a declaration. Each attention layer says how much history it
# reads, each fixed-extent state (a convolution's left context, a subsampling tail)
# says its shape, and one constructor composes them over **one block pool** and **one
# slot-state pool**:
#
# * `FullAttention(left_chunks)`: the last `left_chunks` chunks (all history with -1);
# * `SlidingWindow(window_frames)`: the last `window_frames` frames, any number of them;
# * `FixedState(name, shape, slot_axis)`: a row per stream that never grows.
#
# Layers with the same window share a block table (a *band*); every band allocates
# from and frees into the same pool, and each evicts by its own window. So a model
# that interleaves narrow local layers with wider ones pays per stream for what each
# layer reads, not for the widest window times the number of layers.
#
# This notebook shows a composition's footprint before anything is allocated, the
# eviction of each band chunk by chunk against the arithmetic, and that streaming the
# Conformer with per-layer windows equals its offline forward with per-layer masks, in
# every available twin.

# %%
import matplotlib.pyplot as plt
import torch

from oasr.cache.layer_specs import CacheLayout, FullAttention, SlidingWindow, uniform_specs
from oasr.cache.memory import format_bytes
from oasr.engine import StreamingEngine
from oasr.models import ConformerConfig, StreamingConformer, available_twins, twin_module

TWINS = available_twins()
print("twins checked in this notebook:", TWINS)

CHUNK = 4  # encoder frames per chunk (16 feature frames)
LOCAL, WIDE = SlidingWindow(6), FullAttention(4)  # 6 frames (not a whole chunk) and 16 frames
SPECS = (LOCAL, WIDE, LOCAL, WIDE)

model = StreamingConformer(ConformerConfig(num_layers=4, chunk_size=CHUNK, attention_specs=SPECS, seed=11))
cache_config = model.config.cache_config(block_size_frames=CHUNK, max_batch_size=4)
specs = model.layer_specs(cache_config)
for spec in specs:
    print(spec)

# %% [markdown]
# ## The footprint, before anything is allocated
#
# `CacheLayout` groups the layers by window, picks how many layers a block id holds
# (`unit`, the gcd of the group sizes) and gives each band its own config. Its
# `footprint` is the bytes the composition will allocate; `bytes_per_stream` is one
# stream's worst case. The same model with every layer at the wide window is the
# uniform `CacheConfig`, for comparison.

# %%
layout = CacheLayout(cache_config, specs)
print(layout.describe())
print(layout.footprint(pad_lanes=1).format())

uniform_config = model.config.cache_config(block_size_frames=CHUNK, max_batch_size=4, num_left_chunks=4)
uniform = CacheLayout(uniform_config, uniform_specs(uniform_config, specs[4:]))
print(f"per stream: mixed windows {format_bytes(layout.bytes_per_stream())}, "
      f"every layer wide {format_bytes(uniform.bytes_per_stream())}")
assert layout.unit == 2 and [b.layers for b in layout.bands] == [(0, 2), (1, 3)]
assert layout.blocks_per_stream() == [3, 5]  # ceil((bs - g + r + W + chunk) / bs) per band
assert layout.bytes_per_stream() < uniform.bytes_per_stream()

# %% [markdown]
# ## Streaming through the composition
#
# One `LayeredCache` per twin; each tick prepares the chunk in every band, hands the
# model one paged view per layer (each with its band's `cache_seqstarts`), commits,
# and every band evicts by its own window. The conv rows and the subsampling tails live
# in the composition's slot-state pool.


# %%
def features(num_frames, seed, dim=20):
    return torch.randn(num_frames, dim, generator=torch.Generator().manual_seed(seed))


def stream(twin, feats):
    """One stream through a LayeredCache of ``twin``; returns log-probs, blocks held per band per chunk, cache."""
    ops = twin_module(twin)
    cache = ops.LayeredCache(cache_config, specs, pad_lanes=1)
    cache.allocate_stream("s")
    ci, outs, held, offset = model.config.chunk_input_frames, [], [], 0
    for start in range(0, feats.shape[0], ci):
        xs = feats[start : start + ci][None]
        n = xs.shape[1] // 4
        cache.prepare_chunk("s", n)
        held.append(cache.blocks_held("s"))  # the chunk in flight: each band's peak
        cnn = cache.state.view("cnn", ["s"])
        log_probs, _, new_cnn = model.forward_chunk_paged(
            xs, [offset], cache.get_paged_caches(["s"]), cnn.gather(), cache.state.views(["s"]), twin=ops)
        cache.commit_chunk_paged("s", n)
        cnn.scatter(new_cnn)
        outs.append(log_probs[0, :n])
        offset += n
    return torch.cat(outs), held, cache


feats = features(16 * 12 + 9, 1)
runs = {twin: stream(twin, feats) for twin in TWINS}
streamed, held, cache = runs[TWINS[0]]

fig, ax = plt.subplots(figsize=(7, 3))
for b, band in enumerate(layout.bands):
    line = ax.plot([h[b] for h in held], marker="o", label=f"band {b}: layers {list(band.layers)}, "
                   f"window {band.window} frames")[0]
    ax.axhline(layout.blocks_per_stream()[b], color=line.get_color(), linestyle="--", linewidth=1)
ax.set_title("Blocks one stream holds per band (dashed: the layout's worst case)")
ax.set_xlabel("chunk")
ax.set_ylabel("blocks held (chunk in flight)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

assert [max(h[b] for h in held) for b in range(2)] == layout.blocks_per_stream()
assert cache.cached_frames("s") == [6, 16, 6, 16]  # each layer's history is its own window

# %% [markdown]
# ## Streaming equals offline with per-layer masks
#
# The offline forward gives layer `l` the mask of its own window: a query in chunk `c`
# sees keys from `c * chunk - W_l` to the end of its chunk. Streaming through the
# composition must reproduce it within fp32 summation noise (1e-5), in every twin, and
# the twins must hand out the same blocks. A single uniform window, for contrast, does
# not match: the oracle can fail.

# %%
offline = model.forward_offline(feats[None])[0][0]
for twin, (log_probs, twin_held, twin_cache) in runs.items():
    diff = (log_probs - offline).abs().max().item()
    print(f"{twin:9s} max |streaming - offline| = {diff:.2e}")
    assert diff <= 1e-5
    assert twin_held == held and twin_cache.describe("s") == cache.describe("s")
wrong = (streamed - model.forward_offline(feats[None], num_left_chunks=4)[0][0]).abs().max().item()
print(f"against one uniform 16-frame window instead: {wrong:.2e}")
assert wrong > 1e-3

# %% [markdown]
# ## The engine serves it
#
# `StreamingEngine` builds its runtime from the model's `streaming_kind`; for this
# `"paged"` model with per-layer windows that is the same `LayeredCache`, driven by the
# engine's tick for many streams at once. Five streams arrive one tick apart and push
# odd-sized pieces; each must still equal its offline forward with per-layer masks, and
# admission reserves per stream the sum of the bands' ceilings, not the widest window
# on every layer.

# %%
clips = {sid: features(16 * (5 + sid % 3) + 7 * sid, 20 + sid) for sid in range(5)}
for twin in TWINS:
    engine = StreamingEngine(model, cache_config, twin=twin, keep_log_probs=True)
    pushed = dict.fromkeys(clips, 0)
    for tick in range(100):
        for sid, clip in clips.items():
            if tick == sid:
                engine.add_stream(sid)
            if tick >= sid and pushed[sid] < clip.shape[0]:
                engine.push(sid, clip[pushed[sid] : pushed[sid] + 11])
                pushed[sid] += 11
                if pushed[sid] >= clip.shape[0]:
                    engine.end_stream(sid)
        engine.step()
        if len(engine.results) == len(clips):
            break
    worst = max(abs(engine.result(sid).log_probs - model.forward_offline(clip[None])[0][0]).max().item()
                for sid, clip in clips.items())
    peak = max(st.used_blocks for st in engine.stats)
    print(f"{twin:9s} {len(clips)} streams, max |engine - offline| = {worst:.2e}, peak pool blocks {peak} "
          f"(reserve {engine.backend.blocks_per_stream} a stream)")
    assert engine.backend.layered and worst <= 1e-5
    assert engine.backend.blocks_per_stream == sum(layout.blocks_per_stream())
    assert peak <= cache_config.max_batch_size * engine.backend.blocks_per_stream
