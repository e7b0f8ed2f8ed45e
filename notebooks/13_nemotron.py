# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 13 · A Nemotron chunk over pages, equal to transformers
#
# NVIDIA's cache-aware FastConformer (the encoder of Nemotron streaming ASR) is served by
# `oasr.models.nemotron.NemotronEncoder`, loaded by `oasr.from_pretrained` from a Hugging Face
# directory. Here a tiny random checkpoint is written by transformers' own `save_pretrained`
# (nothing is downloaded), loaded by oasr, and streamed chunk by chunk through the paged caches of
# both twins; every chunk is compared with transformers' `NemotronAsrStreamingEncoder` fed the same
# chunks with its own caches.
#
# The one idea: the Transformer-XL relative-position term is a **table of queries x distances**
# that `paged_attention` adds per key it reads from the pages, not a dense queries x keys bias.

# %%
import tempfile

import matplotlib.pyplot as plt
import torch
from transformers import NemotronAsrStreamingConfig, NemotronAsrStreamingForRNNT

import oasr
from oasr.models import available_twins, twin_module

TWINS = available_twins()  # the reference, then the fast twin: each check below runs on both
assert TWINS == ["reference", "fast"], TWINS

torch.manual_seed(0)
hf_config = NemotronAsrStreamingConfig(
    encoder_config=dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, sliding_window=9,
                        default_num_lookahead_tokens=1, conv_kernel_size=5, subsampling_conv_channels=8,
                        num_mel_bins=16),
    vocab_size=9, decoder_hidden_size=16, blank_token_id=8)
hf_model = NemotronAsrStreamingForRNNT(hf_config).eval()
with torch.no_grad():  # every parameter random, so no bias or norm is trivially 0 or 1
    for p in hf_model.parameters():
        p.copy_(torch.randn_like(p) * (0.3 if p.dim() < 2 else p[0].numel() ** -0.5))
ckpt = tempfile.mkdtemp()
hf_model.save_pretrained(ckpt)

loaded = oasr.from_pretrained(ckpt)
encoder = loaded.model
print(loaded.source_format, "->", type(encoder).__name__)
print(f"chunk C = {encoder.chunk_size} frames, window W = {encoder.window} frames, "
      f"first chunk {encoder.first_chunk_input_frames} feature frames, later {encoder.chunk_input_frames}")
print("transducer tensors handed on:", sorted(loaded.extra["tensors"])[:3], "...")

# %% [markdown]
# ## The table for one chunk
#
# A chunk of `T = C` queries over `W` frames of history needs distances `-(T-1) .. W+T-1`: `R = W + 2T - 1`
# columns. Column `d + T - 1` holds `s * (q + bias_v) . relative_k_proj(pe(d))`. At the start of a
# stream the prefilled (zero) window is not the stream's: its distances get `-inf`.

# %%
attn = encoder.layers[0].self_attn
T, W = encoder.chunk_size, encoder.window
x = torch.randn(2, T, 32)
with torch.no_grad():
    q, _, _ = attn.project(x)
    pos_keys = attn.positional_keys(T, W, x)
    table = attn.rel_bias(q, pos_keys, offsets=torch.tensor([0, 10]))  # a first chunk, and one 10 frames in
print("table", tuple(table.shape), "= (B, n_head, T, R); R =", W + 2 * T - 1)
fig, axes = plt.subplots(1, 2, figsize=(9, 2.4))
for ax, row, title in zip(axes, (0, 1), ("first chunk (offset 0)", "offset 10: a full window"), strict=True):
    shown = table[row, 0].clone()
    shown[torch.isinf(shown)] = float("nan")
    ax.imshow(shown, aspect="auto", cmap="coolwarm")
    ax.set_title(f"head 0, {title}")
    ax.set_xlabel("column = distance + T - 1")
    ax.set_ylabel("query t")
plt.tight_layout()
assert torch.isinf(table[0, :, 0, T:]).all() and torch.isfinite(table[1]).all()

# %% [markdown]
# ## Streaming through the pages, both twins, against transformers

# %%
a = encoder.lookahead
g = torch.Generator().manual_seed(1)
chunks = [torch.randn(encoder.first_chunk_input_frames, 16, generator=g)] + [
    torch.randn(encoder.chunk_input_frames, 16, generator=g) for _ in range(5)]

cache = padding_cache = None
oracle = []
with torch.no_grad():
    for chunk in chunks:
        out = hf_model.encoder(chunk[None], cache=cache, padding_cache=padding_cache, use_cache=True,
                               num_lookahead_tokens=a)
        cache, padding_cache = out.cache, out.padding_cache
        oracle.append(out.last_hidden_state[0])

errors = {}
for twin in TWINS:
    ops = twin_module(twin)
    cfg = encoder.cache_config(max_batch_size=2)
    pool = ops.BlockPool(cfg, scratch_blocks=1)
    att = ops.AttentionCacheManager(pool, cfg, pad_lanes=1)
    cnn = ops.CnnCacheManager(cfg, pad_lanes=1)
    states = ops.SlotStateCache(encoder.streaming_state_specs, cfg.max_batch_size, pad_lanes=1)
    for manager in (att, cnn, states):
        manager.allocate_stream("s")
    offset, errors[twin] = 0, []
    for chunk in chunks:
        xs = torch.zeros(1, encoder.chunk_input_frames, 16)
        xs[0, : chunk.shape[0]] = chunk
        n = encoder.output_frames(chunk.shape[0], first=offset == 0)
        att.prepare_chunks_batched(["s"], [n])                          # blocks for the chunk
        caches = att.get_paged_caches(["s"])                            # one PagedKVCache per layer
        hidden, lens, new_conv = encoder.forward_chunk_paged(
            xs, [offset], caches, cnn.get_cache(["s"]), states.views(["s"]), [chunk.shape[0]], twin=ops)
        att.commit_chunks_batched(["s"], [n])                           # advance the window
        cnn.update(["s"], new_conv)
        errors[twin].append((hidden[0, :n] - oracle[len(errors[twin])]).abs().max().item())
        offset += n
    print(f"{twin:9s} max |oasr - transformers| per chunk:", [f"{e:.1e}" for e in errors[twin]])
    assert max(errors[twin]) <= 1e-5

# %%
fig, ax = plt.subplots(figsize=(5, 2.6))
for twin in TWINS:
    ax.semilogy(range(len(chunks)), errors[twin], "o-", label=twin)
ax.axhline(1e-5, color="gray", linestyle="--", label="tolerance")
ax.set_title("oasr over pages vs transformers' streaming encoder (fp32)")
ax.set_xlabel("chunk")
ax.set_ylabel("max abs difference")
ax.legend()
plt.tight_layout()
