# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 12 · What the caches cost in accuracy
#
# Every other notebook proves the caches *exact*: the twins agree, streaming equals offline, fp8
# bytes equal torch's. This one asks what a user asks: with a model that actually hears, what does
# a cache choice do to recognition?
#
# The package ships a small streaming Conformer trained here on synthesized speech
# (`oasr/assets/model/MODEL_CARD.md`) and a held-out test set: sentences never trained on, spoken by
# voices never heard in training. We stream clips through the engine, watch a transcript form chunk
# by chunk, then lay out the two choices a deployment makes, the chunk (latency) and the K/V page
# format (memory), as a grid of their WER and bytes, with full context as the ceiling. To keep the
# notebook quick it uses the first 16 clips; `python -m oasr bench --sections accuracy` measures the
# cache choices on all of them.

# %%
import matplotlib.pyplot as plt
import torch

from oasr.asr.audio import load_audio
from oasr.asr.metrics import error_rates
from oasr.asr.recognizer import Recognizer
from oasr.asr.testset import load_testset
from oasr.bench.accuracy import kv_bytes_per_stream

torch.set_num_threads(1)
clips = load_testset(limit=16)
rec = Recognizer(max_streams=8)
print(rec.info)
LEFT = rec.encoder.config.num_left_chunks  # the model's serving window, in chunks
print(f"chunk {rec.encoder.config.chunk_size} frames = {rec.encoder.config.chunk_size * 40} ms, "
      f"left context {LEFT} chunks")

# %% [markdown]
# ## A transcript forms
#
# One clip, sent in 40 ms pieces. Each time a chunk is encoded the word search (the CTC prefix beam
# search steered by a lexicon and a word bigram, notebook 14) updates its best hypothesis; beam search may
# revise the last words, so a partial is not only ever extended. The final text is the last partial.

# %%
clip = clips[0]
t = rec.transcribe([clip.path], piece_seconds=0.04)[0]
for seconds, text in t.partials:
    print(f"{seconds:5.2f} s  {text}")
print("reference:", clip.text)
assert t.partials[-1][1] == t.text

# %% [markdown]
# ## The chunk against the page format
#
# The chunk is the latency choice: a stream's text for a chunk can only come once the chunk's audio has
# arrived, and the frames at a chunk's end see no future audio. The page format is the memory choice.
# For each chunk size (at the model's serving window of `LEFT` chunks) and each page format: the WER on
# the clips, and the K/V bytes one stream holds at its end (the window's frames, at most, times the
# bytes a frame takes in all layers' pages). The model was trained with dynamic chunks, so every chunk
# size runs on the same weights.

# %%
frames = [int(len(load_audio(c.path)) / 16000 * 25) for c in clips]
refs = [c.text for c in clips]
CHUNKS = (4, 8, 16, 32)  # encoder frames of 40 ms: 160 ms to 1.28 s
FORMATS = (None, "int8", "affine4")  # the model dtype (fp32 here), 8-bit, 4-bit


def measure(**config):
    r = Recognizer(max_streams=8, **config)
    texts = [x.text for x in r.transcribe([c.path for c in clips])]
    kv = 0 if config.get("full_context") else kv_bytes_per_stream(r, frames)
    return error_rates(refs, texts)["wer"] * 100, kv, texts


grid = {(chunk, fmt): measure(chunk_size=chunk, kv_cache_dtype=fmt) for chunk in CHUNKS for fmt in FORMATS}
full = measure(full_context=True)
for (chunk, fmt), (wer, kv, _) in grid.items():
    print(f"chunk {chunk:2d} ({chunk * 40:4d} ms)  {fmt or 'model dtype':11s}: WER {wer:5.2f}%  "
          f"K/V {kv / 1024:7.1f} KiB per stream")
print(f"full context (no streaming): WER {full[0]:.2f}%")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
panels = (("WER %", 0, "{:.1f}", "Reds"), ("K/V KiB held per stream", 1, "{:.0f}", "Blues"))
for ax, (title, which, fmt_text, cmap) in zip(axes, panels, strict=True):
    values = [[grid[(c, f)][which] / (1 if which == 0 else 1024) for f in FORMATS] for c in CHUNKS]
    ax.imshow(values, cmap=cmap, aspect="auto")
    top = max(max(row) for row in values)
    for i, row in enumerate(values):
        for j, v in enumerate(row):  # white on the dark cells
            ax.text(j, i, fmt_text.format(v), ha="center", va="center", fontsize=11,
                    color="white" if v > 0.55 * top else "black")
    ax.set_xticks(range(len(FORMATS)), [f or "model (fp32)" for f in FORMATS])
    ax.set_yticks(range(len(CHUNKS)), [f"{c} frames\n{c * 40} ms" for c in CHUNKS])
    ax.set_xlabel("K/V page format")
    ax.set_title(title)
axes[0].set_ylabel("chunk (latency)")
fig.suptitle(f"Latency against accuracy against memory: {len(clips)} held-out clips, left context {LEFT} chunks "
             f"(full context: WER {full[0]:.1f}%)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What holds
#
# The trade-off runs along the chunk: shorter chunks answer sooner and hear worse, and a stream's
# window (so its K/V bytes) shrinks with them. Along the format, 8-bit pages hold about a quarter of the
# model dtype's bytes (one byte per value plus a 4-byte scale per head vector, against 4 bytes per value
# in fp32) and 4-bit ones less than a fifth, for little or no WER. The twins give the same text. These
# are asserted on this subset; `python -m oasr bench --sections accuracy` reports the full set.

# %%
# the chunk is the accuracy lever: 160 ms never hears better than 1.28 s, and worse over the formats together
# (on 16 clips the word search leaves a word or two between them; the token search alone, more)
assert sum(grid[(4, fmt)][0] for fmt in FORMATS) > sum(grid[(32, fmt)][0] for fmt in FORMATS)
for fmt in FORMATS:
    assert grid[(4, fmt)][0] >= grid[(32, fmt)][0]
    assert grid[(4, fmt)][1] < grid[(32, fmt)][1]  # and a shorter chunk holds a smaller window
for chunk in CHUNKS:
    assert grid[(chunk, "int8")][1] < 0.3 * grid[(chunk, None)][1]
    assert grid[(chunk, "affine4")][1] < 0.2 * grid[(chunk, None)][1]
    assert abs(grid[(chunk, "int8")][0] - grid[(chunk, None)][0]) <= 2.0  # points
reference_texts = [x.text for x in Recognizer(twin="reference", max_streams=8).transcribe([c.path for c in clips[:6]])]
assert reference_texts == grid[(rec.encoder.config.chunk_size, None)][2][:6]
print("twins agree on", len(reference_texts), "clips; int8 within 2 WER points at every chunk")
