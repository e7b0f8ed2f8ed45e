# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · K/V page formats: bytes, rules and error
#
# A page can store the model dtype, or a quantized form of it: fp8 e4m3 and int8 (one fp32 scale per
# `head_dim` vector), GGML's q8_0 (int8 in blocks of 32 with one fp16 scale each) and a 4-bit affine
# format (two codes per byte, a scale and a bias in the model dtype per group of 32 or 64 values, as
# MLX quantizes). Each format's rule is stated once in `oasr/kv_formats/<format>.py`; the fast twin
# and the kernels restate it and must store the same bytes.
#
# This notebook steps through the formats: what one vector costs, the bytes each rule stores, checked
# here against oracles written from the rules (gguf-py's own quantizer for q8_0), and the error each
# costs on random K/V. What a format costs in recognition (its word error rate) needs a trained model
# and is the bench's `wer_rows`.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import oasr
from oasr import fast
from oasr import reference as ref
from oasr.cache import memory
from oasr.fast import kv_formats as fast_formats
from oasr.kv_formats import FORMATS, get_format

dtype, head_dim = torch.float16, 64
print(f"{'format':12s} {'bytes/vector':>12s} {'vs fp16':>8s} {'blocks in 1 GiB':>16s}   rule")
for name, f in FORMATS.items():
    cfg = oasr.CacheConfig(head_dim=head_dim, dtype=dtype, kv_cache_dtype=name)
    b = f.bytes_per_vector(head_dim, dtype)
    print(f"{name:12s} {b:12d} {128 / b:7.2f}x {memory.blocks_per_gib(cfg):16d}   {f.summary}")
expected = {"model": 128, "fp8_e4m3": 64 + 4, "int8": 64 + 4, "q8_0": 2 * (2 + 32),
            "affine4": 32 + 2 * 2 * 2, "affine4_g64": 32 + 1 * 2 * 2}
assert {n: f.bytes_per_vector(head_dim, dtype) for n, f in FORMATS.items()} == expected

# %% [markdown]
# ## q8_0: the bytes are GGML's
#
# Per block of 32 values: `d = amax / 127` in fp32, `q = roundf(x * (1 / d))` (halves away from
# zero), `d` stored as fp16. A page keeps the 32 `q` of each block contiguous and the fp16 `d` in its
# scale plane; interleaving them gives GGML's 34-byte blocks, which we compare with gguf-py.

# %%
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from oasr.kv_formats import q8_0

x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
x[0, :32] = 0  # a zero block
x[1, :32] = torch.arange(32) - 15.5  # exact ties
for q, d in (q8_0.quantize(x), fast_formats.quantize_q8_0(x)):  # the reference rule, then the fast twin's
    ours = q8_0.to_ggml_blocks(q, d).numpy()
    theirs = gguf_quantize(x.float().numpy(), GGMLQuantizationType.Q8_0).reshape(-1, 34)
    assert np.array_equal(ours, theirs)
print("q8_0 blocks equal gguf-py's Q8_0 bytes:", ours.shape[0], "blocks of 34 bytes")

# %% [markdown]
# ## int8 and affine4 against their rules
#
# int8: `scale = max(amax / 127, 2**-149)`, `q = round_half_even(x / scale)`. affine4 (group G):
# `scale = M((hi - lo) / 15)`, `bias = M(lo)`, `q = round_half_even((x - bias) / scale)` in 0..15, two
# codes per byte. The oracles below are numpy, written from those lines.

# %%
xf = x.float().numpy()
scale = np.maximum(np.abs(xf).max(-1) / np.float32(127), np.float32(2.0**-149)).astype(np.float32)
q, s = get_format("int8").quantize(x)
assert np.array_equal(q.numpy(), np.rint(xf / scale[:, None]).astype(np.int8)) and np.array_equal(s.numpy(), scale)

g = xf.reshape(6, -1, 32)
lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
a_scale = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
a_bias = lo.astype(np.float16).astype(np.float32)
codes = np.where(a_scale == 0, 0, np.clip(np.rint((g - a_bias) / np.where(a_scale == 0, 1, a_scale)), 0, 15))
codes = codes.astype(np.uint8).reshape(6, -1)
packed, params = get_format("affine4").quantize(x)
assert np.array_equal(packed.numpy(), codes[:, 0::2] | (codes[:, 1::2] << 4))
assert np.array_equal(params[..., 0].float().numpy(), a_scale[..., 0])
assert np.array_equal(params[..., 1].float().numpy(), a_bias[..., 0])
print("int8 and affine4 bytes equal their oracles; affine4 stores", packed.shape[-1], "bytes of codes per",
      x.shape[-1], "values")

# %% [markdown]
# ## The error each format costs
#
# Quantize then dequantize random K/V (N(0, 1) in fp16) and compare with the fp16 values. int8 and
# q8_0 keep 8 bits; fp8 keeps 3 mantissa bits; affine4 keeps 16 levels per group.

# %%
sample = torch.randn(2048, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
errors = {}
for name, f in FORMATS.items():
    data, sc = f.quantize(sample, dtype)
    errors[name] = (f.dequantize(data, sc, torch.float32) - sample.float()).abs().flatten()
names = [n for n in FORMATS if n != "model"]
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.bar(names, [float(errors[n].pow(2).mean().sqrt()) for n in names])
ax.set_title("Quantization error on random K/V (fp16 model, head_dim 64)")
ax.set_xlabel("page format")
ax.set_ylabel("RMS error")
plt.show()
rms = {n: float(errors[n].pow(2).mean().sqrt()) for n in FORMATS}
assert rms["model"] == 0 and rms["int8"] < rms["fp8_e4m3"] and rms["q8_0"] < rms["fp8_e4m3"] < rms["affine4"]
assert rms["affine4"] < rms["affine4_g64"]  # a larger group: a coarser scale
print({n: round(v, 4) for n, v in rms.items()})

# %% [markdown]
# ## Both twins, one pool each, the same bytes
#
# Each twin builds a pool in every format, appends the same chunk through a paged view, and the two
# pools hold identical bytes; attention over them agrees.

# %%
for name in names:
    cfg = oasr.CacheConfig(num_layers=1, n_kv_head=2, head_dim=head_dim, chunk_size=8, block_size_frames=8,
                           max_num_blocks=8, max_batch_size=2, max_blocks_per_seq=4, dtype=torch.float32,
                           kv_cache_dtype=name)
    outs, pools = [], []
    for twin in (ref, fast):
        att = twin.AttentionCacheManager(twin.BlockPool(cfg), cfg)
        att.allocate_stream("a")
        att.prepare_chunk("a", 8)
        (view,) = att.get_paged_caches(["a"])
        g = torch.Generator().manual_seed(3)
        k, v = (torch.randn(1, 8, 2, head_dim, generator=g) for _ in range(2))
        twin.append_kv(view, k, v)
        outs.append(twin.paged_attention(torch.randn(1, 4, 8, head_dim, generator=g), view))
        pools.append(att.pool)
    for a, b in ((pools[0].k_pool, pools[1].k_pool), (pools[0].k_scale, pools[1].k_scale)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
print("both twins store the same bytes in", names)
