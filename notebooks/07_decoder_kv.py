# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · The autoregressive decoder's K/V
#
# An attention decoder (the second pass of a U2/WeNet system, or a Whisper-like
# AED) keeps its own K/V: one token per row per step, never evicted, plus the
# cross-attention K/V of the encoder output it listens to. oasr serves it from
# its own `BlockPool` through `DecoderKVCacheManager`, in both twins. This
# notebook shows four things:
#
# 1. why admission **refuses** a batch up front instead of failing later;
# 2. the **cross region**: a fixed-extent slot per row, filled once;
# 3. **beams**: dense buffers repeat rows, paged rows fork onto shared pages;
# 4. what **fp8** saves: `2·L·H·(D+4)` bytes per token.

# %%
import matplotlib.pyplot as plt
import torch

from oasr import fast
from oasr import reference as ref
from oasr.cache import memory
from oasr.cache.errors import PoolExhaustedError
from oasr.decoder.common import AdmissionError
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest

cfg = DecoderCacheConfig(num_layers=2, n_kv_head=2, head_dim=8, page_size=4, max_num_blocks=16, max_rows=8,
                         max_self_tokens=24, max_cross_tokens=8)


def kv(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# %% [markdown]
# ## 1. Refuse at admission, not mid-answer
#
# A decoder row cannot give pages back until it finishes. Suppose a pool only
# checked that the *prompt* fits: four requests of 4 prompt tokens (one page
# each) and up to 16 new tokens (5 pages each at their ceiling) all fit at
# first, then run the 16-block pool dry while generating, after every row had
# already produced part of its answer. Below, that naive "allocate as you go"
# run, then the manager's answer for the same batch.

# %%
naive = ref.BlockPool(cfg.pool_config())
tables = {r: [] for r in range(4)}
failed_at = None
for step in range(20):  # token position 0..19 of every row; a page every page_size tokens
    try:
        for r in tables:
            if step % cfg.page_size == 0:
                tables[r] += naive.allocate(1)
    except PoolExhaustedError as exc:
        failed_at = (step, r, str(exc))
        break
print(f"naive growth: token {failed_at[0]} of row {failed_at[1]}: {failed_at[2]}")
assert failed_at is not None and failed_at[0] == 16  # 16 tokens into every answer, then nothing

manager = ref.DecoderKVCacheManager(cfg)
batch = [DecoderRequest(prompt_len=4, max_new_tokens=16)] * 4
answer = manager.can_admit(batch)
print("can_admit:", answer.ok, "-", answer.reason)
assert not answer and "need 20 blocks" in answer.reason and "only 16 are available" in answer.reason
try:
    manager.admit(batch)
except AdmissionError as exc:
    print("admit raised:", exc)
assert manager.rows == [] and manager.pool.num_free_blocks == 16  # a refused batch changes nothing

# %% [markdown]
# Three such rows need 3 × 5 = 15 pages, which fit in 16: the manager admits
# them, and refuses a fourth, naming the numbers. Once admitted, the rows step
# to their ceilings in any order and the pool never runs dry (a hypothesis test
# checks random interleavings in both twins). The plot: free blocks fall as the
# rows grow, but never below what the admitted rows may still claim.

# %%
rows = manager.admit(batch[:3])
refusal = manager.can_admit([DecoderRequest(4, 16)])
print(refusal.reason)
assert not refusal and "need 5 blocks" in refusal.reason and "only 1 are available" in refusal.reason
free, reserved = [], []
for r in rows:
    manager.prefill(r, *kv(2, 4, 2, 8, seed=r))
order = [rows[i % 3] for i in range(48)]  # round robin, 16 tokens each
for r in order:
    manager.append([r], *kv(2, 1, 2, 8))
    free.append(manager.pool.num_free_blocks)
    reserved.append(manager.reserved_blocks)
assert min(f - s for f, s in zip(free, reserved, strict=True)) >= 0
assert all(manager.describe(r).length == 20 for r in rows)

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(free, label="free blocks")
ax.plot(reserved, label="reserved (still claimable by admitted rows)")
ax.set_title("Admitted rows draw their pages from their own reservation")
ax.set_xlabel("decode step (one token, one row)")
ax.set_ylabel("blocks")
ax.legend()
plt.show()

# %% [markdown]
# ## 2. The cross region
#
# Each row's second slot holds the encoder output's K/V: its extent is declared
# at admission and its pages mapped then. `fill_cross` writes it once; the same
# length again overwrites (idempotent), another length raises, and the dtype is
# converted (the encoder may run in another precision; the self region keeps
# the strict dtype rule). The decoder reads it with the same paged attention,
# one query per row.

# %%
m = ref.DecoderKVCacheManager(cfg)
(row,) = m.admit([DecoderRequest(1, 4, cross_len=6)])
enc_k, enc_v = kv(2, 6, 2, 8, seed=9)
m.fill_cross(row, enc_k.double(), enc_v.double())
m.fill_cross(row, enc_k.double(), enc_v.double())  # same length: a no-op rewrite
try:
    m.fill_cross(row, *kv(2, 5, 2, 8))
except ValueError as exc:
    print(exc)
print("cross pages:", m.describe(row).cross_blocks, "dtype stored:", m.gather_cross(row).dtype)
assert m.gather_cross(row).dtype == torch.float32 and m.describe(row).cross_length == 6

# %% [markdown]
# ## 3. Beams: dense repeats rows, paged forks onto shared pages
#
# Beam expansion is a `select` with repeated indices. Dense storage copies rows
# (and their fp8 scales); a paged row is forked: the new row maps the same
# pages, whose reference counts go up, and the first write into a shared page
# copies it (notebook 08 draws this). `kv_storage="auto"` picks paged for
# captured steps and dense otherwise.

# %%
dense = ref.DenseDecoderKV(cfg, batch=2, capacity=8)
for b in range(2):
    dense.prefill(b, *kv(2, 3, 2, 8, seed=b))
beams = dense.select([0, 0, 1, 1])
assert beams.lengths == [3, 3, 3, 3] and torch.equal(beams.gather_self(1), dense.gather_self(0))

paged = ref.DecoderKVCacheManager(cfg)
prow = paged.admit([DecoderRequest(3, 4)] * 2)
for b, r in enumerate(prow):
    paged.prefill(r, *kv(2, 3, 2, 8, seed=b))
forked = paged.select(prow, [0, 0, 1, 1])
shared_page = paged.describe(forked[0]).self_blocks[0]
print("beams:", forked, "page", shared_page, "has", paged.pool.ref_count(shared_page), "holders")
assert paged.describe(forked[1]).self_blocks == paged.describe(forked[0]).self_blocks
assert paged.pool.ref_count(shared_page) == 2 and torch.equal(paged.gather_self(forked[1]), dense.gather_self(0))
print("auto storage:", DecoderCacheConfig(**{**cfg.__dict__, "graph_captured": True}).storage, "when captured,",
      cfg.storage, "otherwise")

# %% [markdown]
# ## 4. fp8 bytes
#
# With `kv_cache_dtype="fp8_e4m3"` each (token, head) vector is one byte per
# value plus a 4-byte power-of-two scale: `2·L·H·(D+4)` bytes per token. The
# pools are allocated and measured; the twins store identical bytes.

# %%
dims = [64, 128]
per_token = {}
for dtype in (torch.float16, torch.float32):
    for q in (None, "fp8_e4m3"):
        for d in dims:
            c = DecoderCacheConfig(num_layers=6, n_kv_head=4, head_dim=d, page_size=16, max_num_blocks=4,
                                   kv_cache_dtype=q, dtype=dtype)
            pool = ref.DecoderKVCacheManager(c).pool
            real = sum(t.nbytes for t in (pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale) if t is not None)
            assert real == memory.decoder_pool_bytes(c) == c.bytes_per_token * 16 * 5
            per_token[str(dtype).split(".")[1], q or "model dtype", d] = c.bytes_per_token
for d in dims:
    assert per_token["float16", "fp8_e4m3", d] == 2 * 6 * 4 * (d + 4)
print({k: v for k, v in per_token.items()})
ratio = per_token["float16", "model dtype", 64] / per_token["float16", "fp8_e4m3", 64]
print(f"fp16 -> fp8 at head_dim 64: {ratio:.2f}x the tokens in the same bytes")
assert abs(ratio - 128 / 68) < 1e-9

fig, ax = plt.subplots(figsize=(6, 3))
labels = [f"{dt}\n{q}\nD={d}" for dt, q, d in per_token]
ax.bar(range(len(per_token)), [v / 1024 for v in per_token.values()])
ax.set_xticks(range(len(per_token)), labels, fontsize=6)
ax.set_title("Decoder K/V per token (6 layers, 4 KV heads)")
ax.set_xlabel("model dtype / storage / head_dim")
ax.set_ylabel("KiB per token")
plt.show()

c8 = DecoderCacheConfig(num_layers=2, n_kv_head=2, head_dim=64, page_size=4, max_num_blocks=8, max_rows=2,
                        max_self_tokens=8, kv_cache_dtype="fp8_e4m3")
twins = [ref.DecoderKVCacheManager(c8), fast.DecoderKVCacheManager(c8)]
for mm in twins:
    rr = mm.admit([DecoderRequest(2, 4)] * 2)
    for r in rr:
        mm.prefill(r, *kv(2, 2, 2, 64, seed=r))
    for s in range(3):
        mm.append(rr, *kv(2, 2, 2, 64, seed=10 + s))
a, b = twins
assert torch.equal(a.pool.k_pool.view(torch.uint8), b.pool.k_pool.view(torch.uint8))
assert torch.equal(a.pool.k_scale, b.pool.k_scale) and torch.equal(a.pool.v_scale, b.pool.v_scale)
print("reference and fast twins: identical fp8 bytes and scales")
