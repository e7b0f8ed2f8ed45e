"""A Conformer with per-layer windows over one LayeredCache: streaming == offline with per-layer masks.

Layers alternate a sliding window that is not a whole number of chunks (6 frames, chunk 4)
with a wider chunk-aligned one. The tolerance is the paged model's own (1e-5, fp32; see
tests/test_conformer_streaming.py): one wrong window in one layer moves log-probs by far more,
which the last test checks by streaming against the offline forward of the uniform model.
"""

from __future__ import annotations

import pytest
import torch

from oasr import fast, reference
from oasr.cache.layer_specs import FullAttention, SlidingWindow
from oasr.models import ConformerConfig, StreamingConformer
from oasr.models.conformer import chunk_attention_mask, window_attention_mask

ATOL = 1e-5
CHUNK = 4
MIXED = (SlidingWindow(6), FullAttention(2), SlidingWindow(6), FullAttention(2))


def make_model(specs=MIXED, seed=3, **kw):
    cfg = ConformerConfig(num_layers=len(specs), chunk_size=CHUNK, seed=seed, attention_specs=specs, **kw)
    return StreamingConformer(cfg)


def features(n, seed, dim=20):
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


class LayeredRunner:
    """The model over one ``LayeredCache`` (K/V bands, conv rows and tails in its slot-state pool)."""

    def __init__(self, model, twin, **overrides):
        self.model, self.twin = model, twin
        self.cfg = model.config.cache_config(**overrides)
        self.cache = twin.LayeredCache(self.cfg, model.layer_specs(self.cfg), pad_lanes=1)
        self.offset, self.outputs, self.held = {}, {}, {}

    def admit(self, sid):
        self.cache.allocate_stream(sid)
        self.offset[sid], self.outputs[sid], self.held[sid] = 0, [], []

    def tick(self, chunks: dict, width: int | None = None, pad_value: float = 0.0, backend=None):
        ids = list(chunks)
        width = width or len(ids)
        mc = self.model.config
        xs = torch.full((width, mc.chunk_input_frames, mc.input_dim), pad_value)
        lens = [chunks[s].shape[0] for s in ids] + [0] * (width - len(ids))
        for row, sid in enumerate(ids):
            xs[row, : lens[row]] = chunks[sid]
        enc = [n // 4 for n in lens[: len(ids)]]
        self.cache.prepare_chunks_batched(ids, enc)
        for sid in ids:
            self.held[sid].append(self.cache.blocks_held(sid))
        caches = self.cache.get_paged_caches(ids, pad_to=width)
        state = self.cache.state
        cnn = state.view("cnn", ids, pad_to=width)
        log_probs, _, new_cnn = self.model.forward_chunk_paged(
            xs, [self.offset[s] for s in ids] + [0] * (width - len(ids)), caches, cnn.gather(),
            state.views(ids, pad_to=width), lens, twin=self.twin,
        )
        self.cache.commit_chunks_batched(ids, enc)
        cnn.scatter(new_cnn)
        for row, sid in enumerate(ids):
            self.outputs[sid].append(log_probs[row, : enc[row]])
            self.offset[sid] += enc[row]

    def result(self, sid):
        return torch.cat(self.outputs[sid])


def stream_alone(model, twin, feats, **overrides):
    runner = LayeredRunner(model, twin, **overrides)
    runner.admit("s")
    ci = model.config.chunk_input_frames
    for start in range(0, feats.shape[0], ci):
        runner.tick({"s": feats[start : start + ci]}, width=2)
    return runner.result("s"), runner


def test_window_mask_is_the_chunk_mask_for_whole_chunks():
    lens = torch.tensor([13, 9])
    for n in (-1, 0, 1, 3):
        window = None if n < 0 else n * CHUNK
        for prefill in (0, 8):
            assert torch.equal(window_attention_mask(13, CHUNK, window, lens, prefill),
                               chunk_attention_mask(13, CHUNK, n, lens, prefill))


def test_attention_specs_validated():
    with pytest.raises(ValueError, match="one FullAttention / SlidingWindow per layer"):
        ConformerConfig(num_layers=2, attention_specs=(FullAttention(1),))
    with pytest.raises(ValueError, match="one FullAttention / SlidingWindow per layer"):
        ConformerConfig(num_layers=1, attention_specs=("wide",))


@pytest.mark.parametrize("block_size", [3, CHUNK, 6])
def test_mixed_windows_stream_equals_offline(twin, block_size):
    model = make_model()
    for n in (16 * 9, 16 * 9 + 7):
        feats = features(n, n)
        streamed, runner = stream_alone(model, twin, feats, block_size_frames=block_size, max_batch_size=2)
        offline = model.forward_offline(feats[None])[0][0]
        assert streamed.shape == offline.shape
        assert (streamed - offline).abs().max().item() <= ATOL
        # memory per stream follows the per-layer windows, as the layout's arithmetic says
        worst = runner.cache.layout.blocks_per_stream()
        most = [max(h[b] for h in runner.held["s"]) for b in range(len(worst))]
        assert most == worst
        assert runner.cache.cached_frames("s") == [6, 8, 6, 8]


def test_cohort_with_different_start_times(twin):
    model = make_model(seed=4)
    starts = {"a": 0, "b": 1, "c": 3}
    lengths = {"a": 16 * 7 + 3, "b": 16 * 4, "c": 16 * 3 + 9}
    feats = {s: features(n, i + 10) for i, (s, n) in enumerate(lengths.items())}
    runner = LayeredRunner(model, twin, block_size_frames=3, max_batch_size=4)
    pos = dict.fromkeys(starts, 0)
    for tick in range(9):
        chunks = {}
        for sid, start in starts.items():
            if tick == start:
                runner.admit(sid)
            if tick >= start and pos[sid] < lengths[sid]:
                chunks[sid] = feats[sid][pos[sid] : pos[sid] + 16]
                pos[sid] += 16
        if chunks:
            runner.tick(chunks, width=1 << (len(chunks) - 1).bit_length(), pad_value=1e4)
    for sid in starts:
        offline = model.forward_offline(feats[sid][None])[0][0]
        assert (runner.result(sid) - offline).abs().max().item() <= ATOL, sid


def test_twins_agree_block_for_block():
    model = make_model()
    feats = features(16 * 8 + 5, 2)
    _, ref = stream_alone(model, reference, feats, block_size_frames=3, max_batch_size=2)
    _, fst = stream_alone(model, fast, feats, block_size_frames=3, max_batch_size=2)
    assert ref.held == fst.held and ref.cache.describe("s") == fst.cache.describe("s")


def test_a_wrong_window_is_caught():
    """The oracle can fail: the mixed model's stream against the offline forward of one uniform window."""
    model = make_model()
    feats = features(16 * 9, 5)
    streamed, _ = stream_alone(model, reference, feats, max_batch_size=2)
    uniform = model.forward_offline(feats[None], num_left_chunks=2)[0][0]
    assert (streamed - uniform).abs().max().item() > 100 * ATOL


def _emulation_missing():
    from oasr.fast.kernels import emulation

    try:
        emulation.emulation_toolchain()
    except emulation.EmulationUnavailable as exc:
        return str(exc)
    return None


def test_mixed_windows_on_the_emulated_kernels(monkeypatch):
    """The fast twin's paged ops on the emulated CUDA kernels (head_dim 64, which they tile)."""
    reason = _emulation_missing()
    if reason is not None:
        pytest.skip(f"kernel emulation unavailable: {reason}")
    monkeypatch.setenv("OASR_CPU_BACKEND", "emulated")
    model = make_model(hidden_dim=32, n_head=2, n_kv_head=1, head_dim=64, seed=7)
    feats = features(16 * 6 + 5, 8)
    streamed, _ = stream_alone(model, fast, feats, block_size_frames=4, max_batch_size=2)
    offline = model.forward_offline(feats[None])[0][0]
    assert (streamed - offline).abs().max().item() <= ATOL


def test_prefilled_windows_per_layer_equal_offline_with_zero_keys(twin):
    """Each band prefills its own window with zeros; offline puts each layer's own zero keys first."""
    model = make_model(seed=6)
    feats = features(16 * 7 + 9, 12)
    streamed, runner = stream_alone(model, twin, feats, block_size_frames=3, max_batch_size=2,
                                    prefill_kv_window=True)
    assert runner.cache.cached_frames("s") == [6, 8, 6, 8]
    assert (streamed - model.forward_offline(feats[None], prefill_window=True)[0][0]).abs().max().item() <= ATOL
    assert (streamed - model.forward_offline(feats[None])[0][0]).abs().max().item() > 100 * ATOL
