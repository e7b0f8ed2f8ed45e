# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Sessions: a stream moves to another engine
#
# A live stream's state is spread over several caches: K/V pages in the shared
# pool, conv and subsampling tails in slot-indexed tensors, a CTC beam, and what
# the engine itself keeps (input not yet encoded, counters). `oasr.sessions.format` puts
# all of it in one versioned, checksummed byte string, so a stream can leave one
# engine and go on in another, in the same process or elsewhere.
#
# This notebook suspends a stream mid-utterance, draws what the bytes hold,
# resumes it in a second engine under other slot and block ids, and asserts the
# output is exactly that of a run that never stopped. Then it corrupts the bytes
# and shows the second engine refuse them without changing anything.

# %%
import hashlib

import matplotlib.pyplot as plt
import torch

from oasr.engine import StreamingEngine
from oasr.models import ConformerConfig, StreamingConformer
from oasr.sessions import format as S

model = StreamingConformer(ConformerConfig(num_left_chunks=2, chunk_size=4, seed=3))
feats = torch.randn(150, 20, generator=torch.Generator().manual_seed(1))
SPLIT = 70


def new_engine(twin="fast"):
    cfg = model.config.cache_config(block_size_frames=3, max_batch_size=4, kv_cache_dtype="fp8_e4m3")
    return StreamingEngine(model, cfg, twin=twin, keep_log_probs=True)


def first_half(engine):
    engine.add_stream("call")
    engine.push("call", feats[:SPLIT])
    for _ in range(3):
        engine.step()


def second_half(engine, sid="call"):
    engine.push(sid, feats[SPLIT:])
    engine.end_stream(sid)
    return engine.run()[sid]


never_stopped = new_engine()
first_half(never_stopped)
want = second_half(never_stopped)

a = new_engine()
first_half(a)
before = a.att.describe("call")
data = a.suspend("call")
print(f"session: {len(data)} bytes; the stream held slot {before.slot}, blocks {list(before.blocks)}, "
      f"cache_seqlen {before.cache_seqlen}, {'call' not in a.stream_ids and 'now gone from engine A'}")
assert a.num_active == 0 and a.pool.num_used_blocks == 0

# %% [markdown]
# ## What the bytes hold
#
# A 64-byte header (magic, version 1, flags, the geometry: layers, heads,
# head_dim, block size, chunk, window, dtypes, K/V format), then length-prefixed
# sections, then a blake2b checksum over everything before it:
#
# ```
#  0        64                                                   64+B     64+B+32
#  +--------+----------------------------------------------------+--------+
#  | header | attention | slot states | CTC beam | engine stream | blake2b|
#  +--------+----------------------------------------------------+--------+
# ```
#
# The attention section holds only the visible window, as the pool stores it:
# here fp8 bytes followed by one fp32 scale per (frame, head) vector.
# `docs/sessions.md` gives every field's offset and type.

# %%
header = S.HEADER.unpack_from(data, 0)
print(dict(zip(["magic", "version", "header bytes", "flags", "layers", "kv heads", "head_dim", "hidden", "kernel",
                "chunk", "block", "left chunks", "dtype", "K/V format", "prefill", "reserved", "sections", "body"],
               header, strict=True)))
spans, pos = [("header", 0, S.HEADER_BYTES)], S.HEADER_BYTES
for _ in range(header[16]):
    kind, length = S.SECTION.unpack_from(data, pos)
    spans.append((S.SECTION_NAMES[kind], pos, S.SECTION.size + length))
    pos += S.SECTION.size + length
spans.append(("checksum", pos, S.CHECKSUM_BYTES))
assert pos + S.CHECKSUM_BYTES == len(data)

# the attention section split into its parts: lengths, K, V, K scales, V scales
cfg = a.config
frames = before.cache_seqlen - before.cache_seqstart
kv_bytes = cfg.num_layers * frames * cfg.n_kv_head * cfg.head_dim  # fp8: one byte a value
scale_bytes = cfg.num_layers * frames * cfg.n_kv_head * 4
att_start = spans[1][1] + S.SECTION.size + 24
parts = [("K fp8", att_start, kv_bytes), ("V fp8", att_start + kv_bytes, kv_bytes),
         ("K scales", att_start + 2 * kv_bytes, scale_bytes), ("V scales", att_start + 2 * kv_bytes + scale_bytes,
                                                                scale_bytes)]
assert parts[-1][1] + scale_bytes == spans[1][1] + spans[1][2]  # the section ends where its parts do

fig, ax = plt.subplots(figsize=(10, 3))
colors = plt.cm.tab10.colors
for i, (name, start, size) in enumerate(spans):
    ax.broken_barh([(start, size)], (1.1, 0.8), color=colors[i % 10])
    ax.text(start + size / 2, 2.05, f"{name}\n{size} B", ha="center", va="bottom", fontsize=8)
for i, (name, start, size) in enumerate(parts):
    ax.broken_barh([(start, size)], (0.1, 0.8), color=colors[(i + 5) % 10], label=f"{name} ({size} B)")
ax.legend(loc="lower right", fontsize=8, ncol=2, title="inside the attention section", title_fontsize=8)
ax.set_yticks([0.5, 1.5], ["attention\nsection", "file"])
ax.set_ylim(-0.5, 3)
ax.set_xlabel("byte offset")
ax.set_title(f"One session: {len(data)} bytes, window of {frames} frames in fp8 pages")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Moved to a second engine
#
# Engine B already serves another client, so the stream comes back in another
# slot and other blocks. The other client is held in the caches only (it never
# joins a forward), so the resumed stream runs the same one-stream forwards as
# the uninterrupted one: the log-probs must be equal bit for bit, not merely close.

# %%
b = new_engine()
b.att.allocate_stream("other client")
b.cnn.allocate_stream("other client")
b.states.allocate_stream("other client")
b.pool.allocate(5)

sid = b.resume(data)
assert sid == "call" and b.status("call") == "waiting"  # admission is the next tick's, like any stream
b.push("call", feats[SPLIT:])
b.end_stream("call")
b.step()
after = b.att.describe("call")
print(f"resumed in slot {after.slot}, blocks {list(after.blocks)}")
assert after.slot != before.slot and not set(after.blocks) & set(before.blocks)
got = b.run()["call"]

assert got.tokens == want.tokens
assert torch.equal(got.log_probs, want.log_probs)
assert [(h.tokens, h.log_score) for h in got.nbest] == [(h.tokens, h.log_score) for h in want.nbest]
print(f"identical: {len(got.tokens)} tokens, {got.log_probs.shape[0]} log-prob frames, "
      f"best log p {got.nbest[0].log_score:.4f}")

# %% [markdown]
# The format is twin-neutral: the reference twin reads the fast twin's session
# and continues with its own arithmetic (same tokens, log-probs within the
# twins' usual 1e-5; the frames before the suspension are carried exactly).

# %%
r = new_engine("reference")
r.resume(data)
cross = second_half(r)
assert cross.tokens == want.tokens
assert torch.equal(cross.log_probs[: before.total_frames], want.log_probs[: before.total_frames])
print(f"reference twin: max |d log-prob| {(cross.log_probs - want.log_probs).abs().max().item():.1e}")
assert (cross.log_probs - want.log_probs).abs().max().item() <= 1e-5

# %% [markdown]
# ## Refused, and nothing changes
#
# A flipped bit fails the checksum; a session of another geometry is refused
# with the fields that differ, even when its checksum is valid. Either way the
# engine is exactly as it was (here: its pool bytes and free list).


# %%
def pool_state(engine):
    return engine.pool.free_block_ids(), engine.pool.k_pool.view(torch.uint8).clone(), engine.stream_ids


c = new_engine()
c.add_stream("busy")
c.push("busy", feats[:40])
c.step()
snapshot = pool_state(c)

flipped = bytearray(data)
flipped[len(data) // 2] ^= 0x10
fields = list(header)
fields[10] = 4  # block_size_frames 3 -> 4, checksum recomputed
foreign = bytearray(data)
foreign[:64] = S.HEADER.pack(*fields)
body = bytes(foreign[:-32])
foreign = body + hashlib.blake2b(body, digest_size=32).digest()

for name, bad in (("one bit flipped", bytes(flipped)), ("another block size", foreign),
                  ("truncated", data[:1000])):
    try:
        c.resume(bad)
    except S.SessionError as exc:
        print(f"{name:20s} -> {exc}")
    else:
        raise AssertionError(f"{name} was accepted")
    after_refusal = pool_state(c)
    assert after_refusal[0] == snapshot[0] and torch.equal(after_refusal[1], snapshot[1])
    assert after_refusal[2] == snapshot[2]
