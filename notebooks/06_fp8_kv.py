# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · fp8 K/V pages
#
# The K/V pool is most of a streaming engine's memory. Storing it as fp8 e4m3
# (1 byte a value, 3 mantissa bits) plus one fp32 scale per `head_dim` vector
# cuts it by almost half against fp16, by two thirds against fp32. This notebook
# shows the bytes saved, the rule that makes the stored bytes reproducible, the
# error it costs, and that both twins store the very same bytes.
#
# The rule, per vector `x` of `head_dim` values (one frame, one KV head):
# `scale` is the least power of two with `max|x| / scale <= 448`, the stored
# value is `fp8(x / scale)`, the restored one `fp8 * scale`. A power-of-two
# scale makes `x / scale` exact, so the bytes equal torch's own conversion; and
# each vector's bytes depend on that vector alone (no calibration, batch-invariant).

# %%
import math

import matplotlib.pyplot as plt
import torch

import oasr
from oasr import fast
from oasr import reference as ref
from oasr.cache import memory
from oasr.reference.fp8 import FP8_MAX, dequantize, quantize

rows = []
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for head_dim in (64, 128):
        plain = oasr.CacheConfig(head_dim=head_dim, dtype=dtype)
        fp8 = oasr.CacheConfig(head_dim=head_dim, dtype=dtype, kv_cache_dtype="fp8_e4m3")
        a, b = memory.bytes_per_kv_block(plain), memory.bytes_per_kv_block(fp8)
        budget = 1 << 30
        blocks = memory.max_num_blocks_for_budget(plain, budget), memory.max_num_blocks_for_budget(fp8, budget)
        rows.append((str(dtype).split(".")[1], head_dim, a, b, a / b, blocks))
        assert b == 2 * 12 * 16 * 4 * (head_dim + 4)   # data + one fp32 scale per (frame, head) vector
print(f"{'model dtype':12s} {'head_dim':>8s} {'bytes/block':>12s} {'fp8':>8s} {'ratio':>6s}   blocks in 1 GiB")
for name, d, a, b, r, (n_plain, n_fp8) in rows:
    print(f"{name:12s} {d:8d} {a:12d} {b:8d} {r:6.2f}   {n_plain} -> {n_fp8}")
assert abs(rows[4][4] - 128 / 68) < 1e-9   # fp16 at head_dim 64: 1.88x the blocks

# %% [markdown]
# ## One vector, byte for byte
#
# The scale is found from the vector's absolute maximum alone. The stored bytes
# are compared with torch's `float8_e4m3fn` conversion of `x / scale`, the
# independent oracle.

# %%
x = torch.tensor([[0.011, -3.2, 700.0, 0.5]])
stored, scale = quantize(x)
expected_scale = 2.0 ** math.ceil(math.log2(700.0 / FP8_MAX))
assert scale.item() == expected_scale == 2.0
assert torch.equal(stored.view(torch.uint8), (x / scale).to(torch.float8_e4m3fn).view(torch.uint8))
restored = dequantize(stored, scale)
print("x       ", x.tolist())
print("scale   ", scale.item(), " stored bytes", stored.view(torch.uint8).tolist())
print("restored", restored.tolist())
zero_stored, zero_scale = quantize(torch.zeros(1, 4))
assert zero_scale.item() == 1.0 and zero_stored.float().eq(0).all()   # a zero vector: scale 1, zeros

# %% [markdown]
# ## What it costs: the error distribution
#
# e4m3 keeps 3 mantissa bits, so a value in the normal range (`|x / scale| >= 2^-6`)
# is off by at most half a unit in the last place, 2^-4 of itself. Below that lies
# the subnormal range, where the spacing is a fixed `2^-9` (times the scale): the
# absolute error stays at most `2^-10 * scale`, but the relative error grows, and a
# value under `2^-10 * scale` is stored as zero.
#
# First, many Gaussian K vectors. With 64 Gaussian values a vector's maximum is
# only a few times its typical element, so almost every element is normal.

# %%
SMALLEST_NORMAL, SUBNORMAL_STEP = 2.0 ** -6, 2.0 ** -9   # e4m3, in units of the scale


def round_trip(x):
    """Per element: x, its fp8 round trip, and |x / scale| (the position in e4m3's range)."""
    stored, scale = quantize(x)
    return x, dequantize(stored, scale), (x / scale[:, None]).abs()


g = torch.Generator().manual_seed(0)
k, back, scaled = round_trip(torch.randn(4096, 64, generator=g) * torch.exp(torch.randn(4096, 1, generator=g)))
normal = scaled >= SMALLEST_NORMAL
rel = ((back - k).abs() / k.abs().clamp(min=1e-30))[normal]
assert rel.max() <= 2.0 ** -4
print(f"Gaussian vectors: {int(normal.sum())} of {normal.numel()} elements normal ({normal.float().mean():.3%}), "
      f"max relative error {rel.max():.4f} <= 2^-4 = {2**-4}")

# %% [markdown]
# ## A real subnormal case
#
# A vector with one large element and many tiny ones (an outlier channel, common
# in real keys): the large element sets the scale, so the tiny ones land in the
# subnormal range. Their absolute error is still bounded by `2^-10 * scale`, but
# their relative error is no longer 2^-4, and the tiniest become zero.

# %%
spiky = 0.004 * torch.randn(256, 64, generator=g)
spiky[:, 0] = 300.0                                         # the outlier: scale 1 for every vector
x, x_back, x_scaled = round_trip(spiky)
_, spiky_scale = quantize(spiky)
tiny = torch.ones_like(x, dtype=torch.bool)
tiny[:, 0] = False
subnormal = tiny & (x_scaled < SMALLEST_NORMAL)
zeroed = subnormal & (x_back == 0) & (x != 0)
abs_err = (x_back - x).abs()
rel_sub = abs_err[subnormal] / x[subnormal].abs().clamp(min=1e-30)
assert torch.all(spiky_scale == 1.0)
assert subnormal.sum() >= 0.9 * tiny.sum()                 # nearly every tiny element is subnormal
assert torch.all(abs_err[subnormal] <= spiky_scale[:, None].expand_as(x)[subnormal] * SUBNORMAL_STEP / 2)
assert rel_sub.max() > 2.0 ** -4 and zeroed.any()          # the relative bound no longer holds
print(f"spiky vectors: {int(subnormal.sum())} of {x.numel()} elements subnormal "
      f"({subnormal.float().mean():.1%}), {int(zeroed.sum())} stored as zero; "
      f"subnormal max |error| {abs_err[subnormal].max():.2e} <= 2^-10 * scale = {2.0 ** -10:.2e}, "
      f"median relative error {rel_sub.median():.3f}, max {rel_sub.max():.3f}")

# %% [markdown]
# And the chunk attention that reads Gaussian K/V from fp8 pages, against fp32 pages:

# %%

# chunk attention over the same history, fp32 pages against fp8 pages (reference twin)
B, H, D, T, hist, bs = 4, 4, 64, 16, 240, 16
width = (hist + T) // bs
table = torch.randperm(B * width, generator=g).view(B, width).to(torch.int32)
lens = torch.full((B,), hist, dtype=torch.int32)
starts = torch.zeros(B, dtype=torch.int32)
def pages(dtype):
    kc = torch.zeros(B * width, bs, H, D, dtype=dtype)
    vc = torch.zeros(B * width, bs, H, D, dtype=dtype)
    scales = (torch.zeros(B * width, bs, H), torch.zeros(B * width, bs, H)) if dtype != torch.float32 else (None, None)
    return oasr.PagedKVCache(kc, vc, table, lens, starts, bs, hist, hist, 0, *scales)
k_hist, v_hist = torch.randn(B, hist + T, H, D, generator=g), torch.randn(B, hist + T, H, D, generator=g)
q = torch.randn(B, H, T, D, generator=g)
outs = {}
for name, dtype in (("fp32", torch.float32), ("fp8", torch.float8_e4m3fn)):
    cache = pages(dtype)
    ref.append_kv(oasr.PagedKVCache(*[getattr(cache, f) for f in ("k_cache", "v_cache", "block_table")],
                                     torch.zeros(B, dtype=torch.int32), starts, bs, 0, 0, 0,
                                     cache.k_scale, cache.v_scale), k_hist[:, :hist], v_hist[:, :hist])
    ref.append_kv(cache, k_hist[:, hist:], v_hist[:, hist:])
    outs[name] = ref.paged_attention(q, cache)
err = (outs["fp8"] - outs["fp32"]).abs()
print(f"attention |fp8 - fp32|: median {err.median():.2e}, max {err.max():.2e} "
      f"(outputs ~{outs['fp32'].abs().mean():.2f})")
assert err.max() < 0.1 * outs["fp32"].abs().max()

FLOOR = 1e-5   # exact round trips (relative error 0) are drawn at this floor of the log axis
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
for name, (xs, backs, pos), colour in (("Gaussian vectors", (k, back, scaled), "tab:blue"),
                                       ("spiky vectors, tiny elements", (x[tiny], x_back[tiny], x_scaled[tiny]),
                                        "tab:orange")):
    every = max(1, xs.numel() // 20000)                    # thin the Gaussian cloud for drawing
    r = ((backs - xs).abs() / xs.abs().clamp(min=1e-30)).flatten()[::every].clamp(min=FLOOR)
    axes[0].scatter(pos.flatten()[::every], r, s=2, alpha=0.4, color=colour, label=name)
axes[0].axvline(SMALLEST_NORMAL, color="k", ls=":", label="smallest normal, 2^-6")
axes[0].axhline(2 ** -4, color="r", ls="--", label="normal-range bound, 2^-4")
axes[0].set(xscale="log", yscale="log", title="fp8 round trip: relative error per element",
            xlabel="|x / scale|  (position in e4m3's range)", ylabel="|x' - x| / |x|")
axes[0].legend(fontsize=7, loc="lower left")
axes[1].hist(err.flatten().numpy(), bins=60, log=True)
axes[1].set(title="chunk attention: |fp8 pages - fp32 pages|", xlabel="absolute error",
            ylabel="output elements")
fig.suptitle("what fp8 e4m3 pages cost")
plt.tight_layout()

# %% [markdown]
# ## Both twins store the same bytes
#
# The same cohort through each twin's pool and manager: the fp8 pages and their
# scales must be bit-identical, and so must the dequantized dense gather;
# attention agrees to fp32 rounding.

# %%
cfg = oasr.CacheConfig(num_layers=2, n_kv_head=2, head_dim=64, hidden_dim=64, kernel_size=3, chunk_size=8,
                       num_left_chunks=2, block_size_frames=4, max_num_blocks=32, max_batch_size=4,
                       max_blocks_per_seq=8, kv_cache_dtype="fp8_e4m3")
def run(twin):
    gen = torch.Generator().manual_seed(3)
    pool = twin.BlockPool(cfg)
    att = twin.AttentionCacheManager(pool, cfg)
    outs = []
    for sid in ("a", "b", "c"):
        att.allocate_stream(sid)
    for _ in range(5):
        ids = att.stream_ids
        att.prepare_chunks_batched(ids)
        for cache in att.get_paged_caches(ids):
            kk = torch.randn(3, 8, 2, 64, generator=gen) * 10
            twin.append_kv(cache, kk, -kk)
            outs.append(twin.paged_attention(torch.randn(3, 4, 8, 64, generator=gen), cache))
        att.commit_chunks_batched(ids, [8, 8, 8])
    return pool, att, outs

(rp, ra, ro), (fp, fa, fo) = run(ref), run(fast)
assert torch.equal(rp.k_pool.view(torch.uint8), fp.k_pool.view(torch.uint8))
assert torch.equal(rp.v_pool.view(torch.uint8), fp.v_pool.view(torch.uint8))
assert torch.equal(rp.k_scale, fp.k_scale) and torch.equal(rp.v_scale, fp.v_scale)
for sid in ra.stream_ids:
    assert torch.equal(ra.get_stacked_cache(sid), fa.get_stacked_cache(sid))
for a, b in zip(ro, fo, strict=True):   # fp32 summation order only: 2e-6 of the output's magnitude (|out| ~ 40 here)
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * a.abs().max().item())
print("reference and fast twins: identical fp8 pages, scales and gathers; attention equal to fp32 rounding")
