# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Streaming CTC prefix beam search and its pooled states
#
# A CTC model emits, for every frame, a distribution over the vocabulary plus a *blank*.
# A transcript is read off an alignment (one symbol per frame) by collapsing repeats and
# dropping blanks, so many alignments give the same label sequence:
# `a a _ b`, `_ a b b` and `a _ _ b` all read `ab`. The probability of a transcript is the
# **sum** over all of its alignments, and the decoder's job is to find the transcript with
# the largest sum without enumerating `V^T` alignments.
#
# Prefix beam search walks the frames once and keeps, for each candidate prefix `l`,
# two numbers:
#
# * `pb(l)`  — total probability of the alignments so far that read `l` and **end in blank**;
# * `pnb(l)` — the same for alignments that **end in `l`'s last token**.
#
# The split matters for repeats. If the next frame says `a` and `l` ends in `a`, an
# alignment ending in `a` just continues the same `a` (the prefix stays `l`), while one
# ending in blank starts a *second* `a` (the prefix becomes `l + a`). One frame, for every
# prefix in the beam:
#
# | move | new prefix | adds to | amount |
# |---|---|---|---|
# | blank | `l` | `pb` | `(pb + pnb) · p(blank)` |
# | repeat last token `e` | `l` | `pnb` | `pnb · p(e)` |
# | new token `c ≠ e` | `l + c` | `pnb` | `(pb + pnb) · p(c)` |
# | `c = e` after a blank | `l + e` | `pnb` | `pb · p(e)` |
#
# Equal prefixes reached in different ways are merged by adding, and the `beam_size`
# best by `pb + pnb` survive. Both twins do this in log space (float64). The exact rule,
# the tie-break order and the emission-frame rule are in `oasr/ctc/config.py`.

# %%
import itertools
import math
import random

import matplotlib.pyplot as plt
import torch

from oasr.ctc.config import CtcDecoderConfig
from oasr.fast.ctc_decoder import StreamingCtcDecoder as FastDecoder
from oasr.fast.ctc_state import CtcStateCacheManager as FastManager
from oasr.reference.ctc_decoder import StreamingCtcDecoder as RefDecoder

torch.manual_seed(0)

# %% [markdown]
# ## A worked example
#
# Three frames over `{_, a, b}` (blank is id 0). We step the reference decoder one frame at a
# time and print every prefix it keeps with its two scores, as probabilities.

# %%
NAMES = "_ab"
probs = torch.tensor([[[0.5, 0.4, 0.1],
                       [0.3, 0.6, 0.1],
                       [0.2, 0.3, 0.5]]], dtype=torch.float64)
lp = probs.log()
ref = RefDecoder(CtcDecoderConfig(beam_size=15, nbest=15))  # 1 + 2 + 4 + 8 label sequences: no pruning
state = ref.create_state(1, 3)

def show(state):
    for p in state.beams[0]:
        label = "".join(NAMES[t] for t in p.tokens) or "(empty)"
        print(f"  {label:8s} pb={math.exp(p.pb):.4f}  pnb={math.exp(p.pnb):.4f}  "
              f"total={math.exp(p.score):.4f}  frames={list(p.frames)}")

for t in range(3):
    ref.step(state, lp[:, t])
    print(f"after frame {t}:")
    show(state)


# %% [markdown]
# Check it against brute force: enumerate all `3^3 = 27` alignments, collapse each, and add up
# probabilities per label sequence. With a beam wide enough to keep every prefix, prefix beam
# search is exact.

# %%
def exhaustive(lp, blank=0):
    T, V = lp.shape
    total = {}
    for path in itertools.product(range(V), repeat=T):
        labels, prev = [], None
        for v in path:
            if v != prev and v != blank:
                labels.append(v)
            prev = v
        p = math.exp(sum(lp[t, v].item() for t, v in enumerate(path)))
        total[tuple(labels)] = total.get(tuple(labels), 0.0) + p
    return sorted(total.items(), key=lambda kv: -kv[1])

truth = exhaustive(lp[0])
nbest = ref.finalize_stream(state)[0]
assert len(nbest) == len(truth)
for h, (labels, p) in zip(nbest, truth, strict=True):
    name = "".join(NAMES[t] for t in h.tokens) or "(empty)"
    print(f"{name:6s} decoder {math.exp(h.log_score):.6f}   brute force {p:.6f}")
    assert tuple(h.tokens) == labels and abs(h.log_score - math.log(p)) < 1e-12
assert math.isclose(sum(p for _, p in truth), 1.0)


# %% [markdown]
# Note the emission frames: each token remembers the frame whose extension appended it.
# When a prefix is reached both by *staying* and by *extending* its parent, it keeps the
# frames of whichever contribution is larger (ties keep the older frames).
#
# ## A picture: posteriors and where the tokens come out
#
# A synthetic, CTC-shaped posteriorgram: mostly blank, with short peaks on tokens. The
# markers are the decoded tokens at their emission frames.

# %%
def ctc_like(T, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, T, V, generator=g)
    peak = torch.randint(1, V, (1, T), generator=g)
    peak[torch.rand(1, T, generator=g) < 0.6] = 0
    logits.scatter_add_(2, peak[:, :, None], torch.full((1, T, 1), 5.0))
    return logits.log_softmax(-1)

post = ctc_like(40, 8, seed=3)
dec = RefDecoder(CtcDecoderConfig(beam_size=4))
hyp = dec.create_state(1, 8)
dec.decode_chunk(hyp, post)
best = dec.peek(hyp)[0]

fig, ax = plt.subplots(figsize=(9, 2.8))
ax.imshow(post[0].exp().T, aspect="auto", origin="lower", cmap="Greys")
ax.scatter(best.frames, best.tokens, s=60, facecolors="none", edgecolors="tab:red", label="emitted token")
ax.set_xlabel("frame")
ax.set_ylabel("token (0 = blank)")
ax.legend(loc="upper right")
ax.set_title(f"best: {best.tokens}  log p = {best.log_score:.2f}")
plt.show()
# frames rise with the tokens, and the fast twin reads the same tokens at the same frames
assert best.frames == sorted(best.frames)
fast = FastDecoder(CtcDecoderConfig(beam_size=4))
fast_state = fast.create_state(1, 8)
fast.decode_chunk(fast_state, post)
assert fast.peek(fast_state)[0][:1] + fast.peek(fast_state)[0][2:] == best[:1] + best[2:]
assert abs(fast.peek(fast_state)[0].log_score - best.log_score) < 1e-9


# %% [markdown]
# ## Oracles
#
# **Beam 1 is greedy CTC.** Greedy takes the best *path* (argmax per frame, collapse, drop
# blanks); beam-1 prefix search keeps the best *prefix*. They agree when each frame's winner
# dominates, as in a trained model's posteriors, and the emission frames agree too.

# %%
def greedy(lp, blank=0):
    tokens, frames, prev = [], [], None
    for t, v in enumerate(lp.argmax(-1).tolist()):
        if v != prev and v != blank:
            tokens.append(v)
            frames.append(t)
        prev = v
    return tokens, frames

for seed in range(20):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 25, 6, generator=g)
    logits.scatter_add_(2, torch.randint(0, 6, (1, 25, 1), generator=g), torch.full((1, 25, 1), 8.0))
    lp_peaked = logits.log_softmax(-1)
    for Decoder in (RefDecoder, FastDecoder):
        d = Decoder(CtcDecoderConfig(beam_size=1))
        s = d.create_state(1, 6)
        d.decode_chunk(s, lp_peaked)
        h = d.peek(s)[0]
        assert (h.tokens, h.frames) == greedy(lp_peaked[0])
print("beam 1 == greedy on 20 peaked sequences, both twins")

# %% [markdown]
# **Exhaustive search on tiny problems**, both twins: with a beam as large as the label space
# and no pruning, the whole n-best list is every label sequence, in order, with its exact
# probability.

# %%
for seed in range(6):
    rng = random.Random(seed)
    T, V = rng.randint(2, 6), rng.randint(2, 4)
    lp_tiny = torch.randn(1, T, V, dtype=torch.float64).log_softmax(-1)
    truth = exhaustive(lp_tiny[0])
    W = sum((V - 1) ** n for n in range(T + 1))
    for Decoder in (RefDecoder, FastDecoder):
        d = Decoder(CtcDecoderConfig(beam_size=W, nbest=W, max_prefix_len=T))
        s = d.create_state(1, V)
        d.decode_chunk(s, lp_tiny)
        got = d.finalize_stream(s)[0]
        assert [tuple(h.tokens) for h in got] == [labels for labels, _ in truth]
        assert max(abs(h.log_score - math.log(p)) for h, (_, p) in zip(got, truth, strict=True)) < 1e-12
print("exhaustive oracle holds for both twins")

# %% [markdown]
# ## The fast twin
#
# `oasr.fast.ctc_decoder` keeps every stream's beam in preallocated tensors
# (`tokens (R, W, L)`, `frames`, `lengths`, rolling-hash `keys` and `parent_keys`, `last`,
# `log_pb`, `log_pnb`) and advances all rows × beams × candidates of a frame with a fixed
# set of tensor operations: no Python loop over streams or beams. Merging uses the hash as a
# hint (a prefix `j` whose parent's key and length match) and verifies it against the stored
# tokens. Candidates are laid out in the same *generation order* as the reference's dict
# (beam rank, stay before extensions, extensions by token id), and a stable sort breaks score
# ties by that order, so the twins agree even on exact ties.
#
# Fast against reference on random posteriors, with several configurations and random
# chunkings of the fast twin's input:

# %%
configs = [
    CtcDecoderConfig(beam_size=1),
    CtcDecoderConfig(beam_size=4, nbest=4),
    CtcDecoderConfig(beam_size=8, nbest=3, token_topk=3),
    CtcDecoderConfig(beam_size=5, nbest=5, blank_skip_threshold=0.6, blank_id=2),
]
worst = 0.0
for cfg in configs:
    for seed in range(3):
        rng = random.Random(seed)
        B, T, V = rng.randint(1, 4), rng.randint(5, 30), rng.randint(3, 12)
        x = (torch.randn(B, T, V) * 2).log_softmax(-1)
        r, f = RefDecoder(cfg), FastDecoder(cfg)
        sr, sf = r.create_state(B, V), f.create_state(B, V)
        r.decode_chunk(sr, x)
        start = 0
        while start < T:
            n = rng.randint(1, T - start)
            f.decode_chunk(sf, x[:, start:start + n])
            start += n
        for row_r, row_f in zip(r.finalize_stream(sr), f.finalize_stream(sf), strict=True):
            assert [(h.tokens, h.frames) for h in row_r] == [(h.tokens, h.frames) for h in row_f]
            worst = max([worst] + [abs(a.log_score - b.log_score) for a, b in zip(row_r, row_f, strict=True)])
print(f"identical n-best tokens and frames; largest score difference {worst:.2e}")
assert worst < 1e-9

# %% [markdown]
# **Chunking is invisible**: decoding a chunk at a time gives bit-identical results to
# decoding the whole sequence, in each twin, because the per-frame arithmetic is the same
# and the absolute frame counter lives in the state.

# %%
x = (torch.randn(2, 24, 7) * 2).log_softmax(-1)
cfg = CtcDecoderConfig(beam_size=4, nbest=4, token_topk=4)
for Decoder in (RefDecoder, FastDecoder):
    results = []
    for chunks in ([24], [1] * 24, [5, 7, 1, 11], [16, 8]):
        d = Decoder(cfg)
        s = d.create_state(2, 7)
        start = 0
        for n in chunks:
            d.decode_chunk(s, x[:, start:start + n])
            start += n
        results.append(d.finalize_stream(s))
    assert all(r == results[0] for r in results)
print("chunked == whole, exactly, in both twins")

# %% [markdown]
# ## Pooled states
#
# `CtcStateCacheManager(decoder)` holds one shared decoder and a pool of states. A new
# stream pops a pooled state and `reset_state`s it (or creates one if the pool is empty);
# a finished stream returns its state to the pool **without releasing its buffers**.
# `get_decoder(sid)` returns a `StreamHandle` with the decoder's API minus the state
# argument. The manager is bookkeeping only, so the fast twin reuses the same class over
# the fast decoder.
#
# Below, a stream of arrivals and departures: the number of states ever created stops at the
# peak number of concurrent streams.

# %%
mgr = FastManager(FastDecoder(CtcDecoderConfig(beam_size=4, token_topk=4)))
rng = random.Random(0)
active, next_id, trace = [], 0, []
for _ in range(80):
    if active and (rng.random() < 0.45 or len(active) >= 12):
        sid = active.pop(rng.randrange(len(active)))
        mgr.free_stream(sid)
    else:
        mgr.allocate_stream(next_id, 1, 30).decode_chunk(torch.randn(1, 4, 30).log_softmax(-1))
        active.append(next_id)
        next_id += 1
    trace.append((mgr.num_active, mgr.num_pooled, mgr.num_created))
    assert mgr.num_created == mgr.num_active + mgr.num_pooled

act, pool, made = zip(*trace, strict=True)
fig, ax = plt.subplots(figsize=(8, 2.6))
ax.plot(act, label="active streams")
ax.plot(pool, label="pooled states")
ax.plot(made, "--", label="states ever created")
ax.set(title="decoder states: pooled and reused, never more than the peak of active streams",
       xlabel="event (a stream starts or finishes)", ylabel="streams / states")
ax.legend()
plt.show()
assert max(made) == max(act)
print(f"{next_id} streams served by {mgr.num_created} states")

# %% [markdown]
# A reused state must decode exactly as a fresh one, whatever the previous stream (or a bug)
# left in it. Poison every buffer of a pooled fast state, then hand it to a new stream:

# %%
dec = FastDecoder(CtcDecoderConfig(beam_size=4, nbest=3))
mgr = FastManager(dec)
mgr.allocate_stream("old", 1, 9).decode_chunk(torch.randn(1, 10, 9).log_softmax(-1))
state = mgr.get_state("old")
mgr.free_stream("old")
for buf in state.buffers:
    buf.fill_(math.nan) if buf.is_floating_point() else buf.fill_(7)
state.frames_decoded = 999

x = torch.randn(1, 12, 9).log_softmax(-1)
handle = mgr.allocate_stream("new", 1, 9)
assert mgr.get_state("new") is state and mgr.num_created == 1
handle.decode_chunk(x)
fresh = dec.create_state(1, 9)
dec.decode_chunk(fresh, x)
assert handle.finalize_stream() == dec.finalize_stream(fresh)
print("pooled, poisoned, reset state == fresh state:", handle.finalize_stream()[0][0])
