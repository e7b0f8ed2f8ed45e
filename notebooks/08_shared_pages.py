# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Shared pages: copy-on-write beams, prefix hits, rewind
#
# A decoder page can be held by several rows at once. The pool keeps a
# **reference count** per block; a row that only reads a page shares it, and the
# first row that writes into a shared page gets a private copy first
# (copy-on-write). This notebook shows three uses, each with asserting cells:
#
# 1. a **beam tree**: `select` with repeated indices forks beams onto the same
#    pages, and beams pay only for the pages where they differ;
# 2. a **prefix hit**: a retired row publishes its full pages, and a later row
#    with the same prompt start binds them instead of recomputing them;
# 3. a **rewind**: a rejected speculative draft is dropped, its pages stay bound
#    and are written again before any new page is taken.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

from oasr import fast
from oasr import reference as ref
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest

cfg = DecoderCacheConfig(num_layers=2, n_kv_head=2, head_dim=8, page_size=4, max_num_blocks=24, max_rows=4,
                         max_self_tokens=16)


def kv(T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, T, 2, 8, generator=g), torch.randn(2, T, 2, 8, generator=g)


def tables(m):
    """Each row's self pages and their reference counts (rows in order)."""
    return {r: [(b, m.pool.ref_count(b)) for b in m.describe(r).self_blocks] for r in m.rows}


# %% [markdown]
# ## 1. A beam tree as block tables
#
# One row holds a 6-token prompt: page A is full, page B half full. Expanding to
# three beams forks the row twice: all three map A and B (counts 3). The next
# step writes token 6 into B, so two beams copy B first (one batched copy for the
# step) and the third keeps it. Page A stays shared: the beams differ only in
# their last page. Then the search keeps beams 0, 0 and 2: beam 1 finishes, its
# copy of B returns to the pool, and beam 0 forks again.

# %%
stages = []
m = ref.DecoderKVCacheManager(cfg)
(root,) = m.admit([DecoderRequest(6, 6)])
m.prefill(root, *kv(6, 0))
stages.append(("prompt", tables(m)))
beams = m.select([root], [0, 0, 0])
stages.append(("3 beams forked", tables(m)))
m.append(beams, *kv(3, 1))
stages.append(("step 1 (copies of B)", tables(m)))
beams = m.select(beams, [0, 0, 2])
m.append(beams, *kv(3, 2))
stages.append(("pruned + step 2", tables(m)))
for name, t in stages:
    print(f"{name:>22}:", {r: [f"{b}x{n}" for b, n in pages] for r, pages in t.items()})

shared_a = stages[1][1][0][0][0]
assert [pages[0] for pages in stages[2][1].values()] == [(shared_a, 3)] * 3  # A stays shared by all beams
assert len({pages[1][0] for pages in stages[2][1].values()}) == 3  # each beam owns its own B
assert m.pool.num_free_blocks == 24 - 1 - 3  # A + three B pages: the beams pay only where they differ

# %%
fig, axes = plt.subplots(1, len(stages), figsize=(13, 2.6), sharey=True)
for ax, (name, t) in zip(axes, stages, strict=True):
    grid = np.zeros((cfg.max_rows, 2))
    for r, pages in t.items():
        for c, (b, n) in enumerate(pages):
            grid[r, c] = n
            ax.text(c, r, f"blk {b}\nref {n}", ha="center", va="center", fontsize=8)
    ax.imshow(grid, cmap="Blues", vmin=0, vmax=4, aspect="auto")
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("logical page")
    ax.set_xticks([0, 1])
axes[0].set_ylabel("row")
fig.suptitle("Beam tree as block tables (colour and label: reference count)")
plt.tight_layout()
plt.show()

# %% [markdown]
# The fast twin runs the same op sequence to the same block ids, counts and
# bytes, with each step's copies made by one indexed copy.

# %%
f = fast.DecoderKVCacheManager(cfg)
(froot,) = f.admit([DecoderRequest(6, 6)])
f.prefill(froot, *kv(6, 0))
fb = f.select([froot], [0, 0, 0])
f.append(fb, *kv(3, 1))
fb = f.select(fb, [0, 0, 2])
f.append(fb, *kv(3, 2))
assert fb == beams and tables(f) == tables(m) and f.pool.free_block_ids() == m.pool.free_block_ids()
assert all(torch.equal(f.gather_self(r), m.gather_self(r)) for r in beams)

# %% [markdown]
# ### The beams' cross region, read once
#
# Every beam of one utterance maps the same cross-attention pages (the encoder
# output), and `shares_cross(rows)` says so. Those pages cannot change while more
# than one row holds them (`fill_cross` refuses shared pages), so the fast twin's
# decode group (`oasr.decoder.kv.PagedDecoderKV`) reads the region once per
# search and attends every beam's queries in one grouped matmul. The oracle reads
# each beam's pages itself (`SHARED_CROSS_READ`), so its paged beams equal dense
# beams bit for bit; the two twins agree to float rounding.

# %%
from oasr.decoder.kv import PagedDecoderKV

xcfg = DecoderCacheConfig(num_layers=2, n_kv_head=2, head_dim=8, page_size=4, max_num_blocks=24, max_rows=4,
                          max_self_tokens=16, max_cross_tokens=10)
q = torch.randn(3, 4, 1, 8, generator=torch.Generator().manual_seed(5))
outs = {}
for twin in (ref, fast):
    mgr = twin.DecoderKVCacheManager(xcfg)
    group = PagedDecoderKV.admit(mgr, [DecoderRequest(1, 6, 10)], twin)
    group.fill_cross(0, *kv(10, 20))
    group.prefill(0, *kv(1, 21))
    group = group.select([0, 0, 0])  # three beams over one cross region
    assert mgr.shares_cross(group.rows)
    outs[twin.__name__] = group.attend_cross(0, q)
    print(f"{twin.__name__:>15}: reads a shared cross region once: {twin.DecoderKVCacheManager.SHARED_CROSS_READ}")
torch.testing.assert_close(outs["oasr.fast"], outs["oasr.reference"], atol=1e-6, rtol=1e-6)

# %% [markdown]
# ### One step through one handle
#
# A decode group steps its beams through `open_step(rows)`: the step's pages are
# prepared (the copy-on-write copy of a shared landing page, a new page at a
# boundary), and the handle writes and reads every layer, then commits. The
# oracle's handle is the `self_caches` views and its ops; the fast twin on a CPU
# plans the step once from its host tables (`HostStep`: each beam's write slot
# and the pool vectors of every beam's keys) and runs each layer as one scatter
# and one gather-and-attend.

# %%
q = torch.randn(3, 4, 1, 8, generator=torch.Generator().manual_seed(6))
outs = {}
for twin in (ref, fast):
    mgr = twin.DecoderKVCacheManager(xcfg)
    (root,) = mgr.admit([DecoderRequest(3, 6)])
    mgr.prefill(root, *kv(3, 30))
    beams3 = mgr.select([root], [0, 0, 0])  # three beams on the same partly written page
    step = mgr.open_step(beams3)  # the first two copy the page; the last keeps it
    new_k, new_v = kv(3, 31)
    outs[twin.__name__] = []
    for layer in range(2):
        step.write(layer, new_k[layer][:, None], new_v[layer][:, None])
        outs[twin.__name__].append(step.attend(layer, q))
    step.commit()
    print(f"{twin.__name__:>15}: {type(step).__name__}, pages {[list(mgr.row_pages(r).self_blocks) for r in beams3]}")
for a, b in zip(outs["oasr.fast"], outs["oasr.reference"], strict=True):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)

# %% [markdown]
# ## 2. A prefix hit
#
# `retire(row, tokens)` publishes a finished row's full pages under a chained
# hash (each block's token ids plus its parent's hash); with no holder left they
# are **parked**: they count as free, and an allocation reclaims them least
# recently parked first. `admit_prompt(row, tokens)` binds the longest cached
# prefix: whole pages, strictly fewer tokens than the prompt (the last token is
# always computed). An attention decoder with cross-attention in every layer
# shares only within one utterance (`scope=`): its K/V past the first layer
# depend on the encoder output.


# %%
def token_kv(tokens, start=0):
    """K/V as a pure function of (token, position), as a model's projections would give."""
    parts = [kv(1, 1000 * t + p) for p, t in enumerate(tokens, start)]
    return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)


p = ref.DecoderKVCacheManager(cfg)
task = [7, 3, 3, 1, 9, 2, 4, 4]  # a shared task prompt: two full pages
(a,) = p.admit([DecoderRequest(11, 0)])
assert p.admit_prompt(a, task + [5, 6, 8], scope="utt") == 0  # nothing cached yet
p.extend(a, *token_kv(task + [5, 6, 8]))
p.retire(a, task + [5, 6, 8], scope="utt")
print("parked after retire:", p.pool.parked_block_ids(), "free (parked count as free):", p.pool.num_free_blocks)

(b,) = p.admit([DecoderRequest(10, 0)])
cached = p.admit_prompt(b, task + [1, 1], scope="utt")
p.extend(b, *token_kv((task + [1, 1])[cached:], cached))
print("cached tokens:", cached, "prefill computed only", 10 - cached)
cold = ref.DecoderKVCacheManager(cfg)
(c,) = cold.admit([DecoderRequest(10, 0)])
cold.prefill(c, *token_kv(task + [1, 1]))
assert cached == 8 and p.pool.num_parked_blocks == 0
assert torch.equal(p.gather_self(b), cold.gather_self(c))  # the hit reads exactly what a cold prefill wrote

# %% [markdown]
# ## 3. A rewind
#
# A speculative step writes three draft tokens; the verifier rejects them.
# `rewind(row, 3)` drops them: the row's pages stay bound, the free count does
# not move, and the accepted tokens are written into the same pages. The
# rejected bytes remain in the page past the row's length, where no view reads.
# `trim(row)` would return pages past the length to the pool.

# %%
r = ref.DecoderKVCacheManager(cfg)
(row,) = r.admit([DecoderRequest(5, 8)])
r.prefill(row, *kv(5, 10))
for _ in range(3):
    r.append([row], *kv(1, 11))  # the draft
blocks, free = r.describe(row).self_blocks, r.pool.num_free_blocks
r.rewind(row, 3)
r.extend(row, *kv(2, 12))  # the accepted tokens
print("blocks before/after:", blocks, r.describe(row).self_blocks, "free:", free, r.pool.num_free_blocks)
assert r.describe(row).self_blocks == blocks and r.pool.num_free_blocks == free and r.length(row) == 7
