"""StreamingEngine over every streaming kind: slot, stateful, and the paged Conformer with per-layer windows.

The engine builds its runtime from the model's ``streaming_kind`` and runs the same tick
(admission, cohort, model step, CTC decoding, finish) over it. Checks, per kind:

* slot == stateful bit for bit on the CPU through the engine, and both equal the runtime
  driven directly (``tests/test_streaming_backends.py``'s ``drive``) and the offline forward;
* the mixed-window Conformer through the engine equals its offline forward with per-layer
  masks (<= 1e-5, the paged model's own fp32 tolerance), with many streams arriving and
  pushing at different ticks, and its blocks per stream follow the per-layer windows;
* what a kind cannot offer is refused with a ``ValueError`` naming the kind, and the refusal
  changes nothing.
"""

from __future__ import annotations

import pytest
import torch

from oasr.cache.config import CacheConfig
from oasr.cache.layer_specs import FullAttention, SlidingWindow
from oasr.engine import StreamingEngine
from oasr.engine.streaming_backend import SlotStreamingBackend
from oasr.models import ConformerConfig, StreamingConformer
from oasr.models.conv_recurrent import ConvRecurrentConfig, ConvRecurrentEncoder
from tests.test_graph_runner import StandInCapture
from tests.test_streaming_backends import drive

ATOL = 1e-5
TWINS = ["reference", "fast"]
CHUNK = 8  # the fixed-extent encoder's input frames per chunk
MIXED = (SlidingWindow(6), FullAttention(2), SlidingWindow(6), FullAttention(2))  # chunk 4: 6 and 8 frames


def fixed_extent_encoder(kind: str, seed: int = 1) -> ConvRecurrentEncoder:
    return ConvRecurrentEncoder(ConvRecurrentConfig(chunk_frames=CHUNK, streaming_kind=kind, seed=seed))


def mixed_model(specs=MIXED, seed: int = 3) -> StreamingConformer:
    return StreamingConformer(ConformerConfig(num_layers=len(specs), chunk_size=4, seed=seed, attention_specs=specs))


def features(lengths: dict, dim: int = 20, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {sid: torch.randn(n, dim, generator=g) for sid, n in lengths.items()}


def serve(engine, feats: dict, arrivals: dict, piece: int, max_ticks: int = 400) -> dict:
    """Streams join at their arrival tick and push ``piece`` frames a tick (odd sizes, so a push is not a chunk);
    each ends once all its frames are pushed. Returns every stream's result."""
    pos = dict.fromkeys(feats, 0)
    for tick in range(max_ticks):
        for sid, f in feats.items():
            if tick == arrivals[sid]:
                engine.add_stream(sid)
            if tick >= arrivals[sid] and not engine.input_ended(sid) and engine.status(sid) != "finished":
                engine.push(sid, f[pos[sid] : pos[sid] + piece])
                pos[sid] += piece
                if pos[sid] >= f.shape[0]:
                    engine.end_stream(sid)
        engine.step()
        if all(sid in engine.results for sid in feats):
            return {sid: engine.result(sid) for sid in feats}
    raise AssertionError(f"not finished in {max_ticks} ticks: {sorted(set(feats) - set(engine.results), key=str)}")


# ---- slot and stateful through the engine ---------------------------------------------------------------
def fixed_extent_workload():
    lengths = {sid: 3 * CHUNK + 5 * sid + 1 for sid in range(7)}  # short last chunks of every size
    return features(lengths, seed=4), {sid: sid // 2 for sid in lengths}


@pytest.mark.parametrize("twin", TWINS)
def test_slot_engine_equals_stateful_engine_bit_for_bit(twin):
    feats, arrivals = fixed_extent_workload()
    results = {}
    for kind in ("slot", "stateful"):
        engine = StreamingEngine(fixed_extent_encoder(kind), CacheConfig(max_batch_size=4), twin=twin,
                                 keep_log_probs=True)
        assert engine.backend.kind == kind and engine.pool is None and engine.att is None
        results[kind] = serve(engine, feats, arrivals, piece=5)
        assert max(st.active for st in engine.stats) == 4  # admission held streams back: 7 streams, 4 slots
        assert engine.num_active == 0 and not engine.backend.states.has_stream(0)
    encoder = fixed_extent_encoder("slot")
    for sid, f in feats.items():
        slot, stateful = results["slot"][sid], results["stateful"][sid]
        assert torch.equal(slot.log_probs, stateful.log_probs), sid
        assert slot.tokens == stateful.tokens and slot.finish_reason == "eos"
        assert slot.num_frames == f.shape[0] == slot.log_probs.shape[0]
        offline = encoder.forward_offline(f[None])[0][0]
        assert (slot.log_probs - offline).abs().max().item() <= ATOL


@pytest.mark.parametrize("twin", TWINS)
def test_slot_engine_equals_the_runtime_driven_directly(twin):
    """Same streams, same arrival ticks, whole chunks: the engine's cohorts are the direct driver's."""
    encoder = fixed_extent_encoder("slot", seed=2)
    lengths = {sid: 4 * CHUNK + 3 * sid for sid in range(5)}
    feats, arrivals = features(lengths, seed=5), {sid: sid // 2 for sid in lengths}
    direct = drive(SlotStreamingBackend(encoder, max_batch_size=8, twin=twin), feats, arrivals)
    engine = StreamingEngine(encoder, CacheConfig(max_batch_size=8), twin=twin, keep_log_probs=True,
                             admission="arrival")  # cohort rows in arrival order, as the driver's
    pos = dict.fromkeys(feats, 0)
    for tick in range(20):  # the driver's tick t is engine tick t + 1; a whole chunk is pushed ahead of it
        for sid, f in feats.items():
            if tick == arrivals[sid]:
                engine.add_stream(sid)
            if tick >= arrivals[sid] and pos[sid] < f.shape[0]:
                engine.push(sid, f[pos[sid] : pos[sid] + CHUNK])
                pos[sid] += CHUNK
                if pos[sid] >= f.shape[0]:
                    engine.end_stream(sid)
        engine.step()
    for sid in feats:
        assert torch.equal(engine.result(sid).log_probs, direct[sid]), sid


def test_fixed_extent_engine_greedy_is_the_argmax_collapse():
    """The greedy decoder through the slot engine: the argmax of the log-probs, repeats and blanks collapsed."""
    encoder = fixed_extent_encoder("slot", seed=6)
    feats = features({0: 5 * CHUNK + 3}, seed=6)
    engine = StreamingEngine(encoder, CacheConfig(max_batch_size=2), decoder="greedy", keep_log_probs=True)
    result = serve(engine, feats, {0: 0}, piece=CHUNK)[0]
    best = result.log_probs.argmax(-1).tolist()
    collapsed = [t for i, t in enumerate(best) if t != 0 and (i == 0 or best[i - 1] != t)]
    assert result.tokens == collapsed and collapsed


def test_slot_engine_graphed_with_a_stand_in_equals_eager():
    feats, arrivals = fixed_extent_workload()
    capture = StandInCapture()
    graphed = StreamingEngine(fixed_extent_encoder("slot"), CacheConfig(max_batch_size=4), cuda_graphs=True,
                              graph_capture=capture, keep_log_probs=True)
    assert graphed.execution == "graphed" and graphed.backend.graphed and graphed.model_tick is None
    eager = StreamingEngine(fixed_extent_encoder("slot"), CacheConfig(max_batch_size=4), keep_log_probs=True)
    assert eager.execution == "eager" and not eager.backend.graphed
    a, b = serve(graphed, feats, arrivals, piece=7), serve(eager, feats, arrivals, piece=7)
    assert capture.replays > 0
    for sid in feats:
        assert torch.equal(a[sid].log_probs, b[sid].log_probs) and a[sid].tokens == b[sid].tokens


def test_stateful_engine_runs_eager_and_says_why():
    engine = StreamingEngine(fixed_extent_encoder("stateful"), CacheConfig(max_batch_size=2))
    assert engine.execution == "eager" and "'stateful' captures nothing" in engine.execution_note


# ---- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["slot", "stateful"])
def test_fixed_extent_kinds_refuse_what_they_cannot_offer(kind):
    encoder = fixed_extent_encoder(kind)
    name = f"streaming_kind='{kind}'"
    with pytest.raises(ValueError, match=f"rescore=True is not offered.*{name}.*encoder output"):
        StreamingEngine(encoder, CacheConfig(max_batch_size=2), rescore=True)
    with pytest.raises(ValueError, match=f"kv_cache_dtype='fp8_e4m3' is not offered.*{name}.*no K/V pages"):
        StreamingEngine(encoder, CacheConfig(max_batch_size=2, kv_cache_dtype="fp8_e4m3"))
    if kind == "stateful":
        with pytest.raises(ValueError, match=f"cuda_graphs=True is not offered.*{name}.*captures nothing"):
            StreamingEngine(encoder, CacheConfig(max_batch_size=2), cuda_graphs=True, graph_capture=StandInCapture())


@pytest.mark.parametrize("model", ["slot", "stateful", "mixed"])
def test_sessions_refused_for_kinds_without_a_session_format_and_nothing_changes(model):
    if model == "mixed":
        encoder, kind, piece = mixed_model(), "paged", 16
        config = encoder.config.cache_config(max_batch_size=2)
    else:
        encoder, config, kind, piece = fixed_extent_encoder(model), CacheConfig(max_batch_size=2), model, CHUNK
    f = features({0: 6 * piece + 3}, seed=8)[0]
    untouched = StreamingEngine(encoder, config, keep_log_probs=True)
    expected = serve(untouched, {0: f}, {0: 0}, piece=piece)[0]

    engine = StreamingEngine(encoder, config, keep_log_probs=True)
    engine.add_stream(0)
    engine.push(0, f[: 2 * piece])
    engine.step()
    assert engine.status(0) == "active"
    with pytest.raises(ValueError, match=f"suspend is not offered.*streaming_kind='{kind}'"):
        engine.suspend(0)
    with pytest.raises(ValueError, match=f"resume is not offered.*streaming_kind='{kind}'"):
        engine.resume(b"not a session")
    assert engine.status(0) == "active" and engine.stream_ids == [0]
    engine.push(0, f[2 * piece :])
    engine.end_stream(0)
    engine.run()
    assert torch.equal(engine.result(0).log_probs, expected.log_probs)


# ---- the paged Conformer with per-layer windows through the engine ----------------------------------------------
@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("block_size", [3, 4])
def test_mixed_windows_engine_equals_offline_with_per_layer_masks(twin, block_size):
    model = mixed_model()
    lengths = {sid: 16 * (4 + sid % 3) + 5 * sid for sid in range(6)}
    feats, arrivals = features(lengths, seed=9), {sid: (sid * 3) // 2 for sid in lengths}
    config = model.config.cache_config(max_batch_size=3, block_size_frames=block_size)
    engine = StreamingEngine(model, config, twin=twin, keep_log_probs=True)
    assert engine.backend.layered
    held = {}

    def watch():
        for sid in engine.active_ids:
            per_band = engine.att.blocks_held(sid)
            held.setdefault(sid, []).append(per_band)

    original_forward = engine._forward

    def forward(cohort, *args):  # blocks held while the cohort's chunk is in flight (prepared, not committed)
        watch()
        return original_forward(cohort, *args)

    engine._forward = forward
    results = serve(engine, feats, arrivals, piece=11)
    for sid, f in feats.items():
        offline = model.forward_offline(f[None])[0][0]
        assert results[sid].log_probs.shape == offline.shape
        assert (results[sid].log_probs - offline).abs().max().item() <= ATOL, sid
    # memory per stream follows the per-layer windows: each band at most its own ceiling, and a long stream reaches it
    worst = engine.att.layout.blocks_per_stream()
    assert all(h[b] <= worst[b] for hs in held.values() for h in hs for b in range(len(worst)))
    assert [max(h[b] for hs in held.values() for h in hs) for b in range(len(worst))] == worst
    assert max(st.used_blocks for st in engine.stats) <= config.max_batch_size * sum(worst)
    assert engine.longest_extent == 8 + 4  # the widest layer's 8 frames of history and the chunk itself
    assert engine.pool.num_used_blocks == 0  # every finished stream gave its blocks back


def test_mixed_windows_engine_on_the_emulated_kernels(monkeypatch):
    """The fast engine's tick over every band on the emulated CUDA kernels (head_dim 64, which they tile)."""
    from oasr.fast.backend import backends_used
    from tests.test_layered_conformer import _emulation_missing

    reason = _emulation_missing()
    if reason is not None:
        pytest.skip(f"kernel emulation unavailable: {reason}")
    monkeypatch.setenv("OASR_CPU_BACKEND", "emulated")
    model = StreamingConformer(ConformerConfig(num_layers=4, chunk_size=4, attention_specs=MIXED, hidden_dim=32,
                                               n_head=2, n_kv_head=1, head_dim=64, seed=7))
    feats = features({sid: 16 * 4 + 5 * sid for sid in range(3)}, seed=15)
    engine = StreamingEngine(model, model.config.cache_config(max_batch_size=4, block_size_frames=4),
                             twin="fast", keep_log_probs=True)
    results = serve(engine, feats, {sid: sid for sid in feats}, piece=13)
    assert backends_used()["cpu"] == "emulated"
    for sid, f in feats.items():
        assert (results[sid].log_probs - model.forward_offline(f[None])[0][0]).abs().max().item() <= ATOL, sid


def test_mixed_windows_twins_hand_out_the_same_blocks():
    model = mixed_model(seed=5)
    lengths = {sid: 16 * 5 + 7 * sid for sid in range(4)}
    feats, arrivals = features(lengths, seed=10), {sid: sid for sid in lengths}
    traces = {}
    for twin in TWINS:
        engine = StreamingEngine(model, model.config.cache_config(max_batch_size=2, block_size_frames=3), twin=twin)
        trace = []
        original = engine._forward

        def forward(cohort, *args, engine=engine, trace=trace, original=original):
            trace.append([(sid, [info.blocks for info in engine.att.describe(sid)]) for sid in cohort])
            return original(cohort, *args)

        engine._forward = forward
        results = serve(engine, feats, arrivals, piece=16)
        traces[twin] = (trace, [st.used_blocks for st in engine.stats], {s: r.tokens for s, r in results.items()})
    assert traces["reference"] == traces["fast"]


def test_mixed_windows_cost_less_per_stream_than_the_widest_window_everywhere():
    """The same streams through the mixed model and through its widest window on every layer: the mixed engine's
    pool holds fewer blocks at its peak, by the layout's arithmetic."""
    lengths = {sid: 16 * 7 for sid in range(3)}
    feats, arrivals = features(lengths, seed=11), dict.fromkeys(lengths, 0)
    peaks = {}
    local, wide = SlidingWindow(2), FullAttention(4)  # 2 and 16 frames of history, chunk 4
    for name, specs in (("mixed", (local, wide, local, wide)), ("widest", (wide,) * 4)):
        model = mixed_model(specs)
        engine = StreamingEngine(model, model.config.cache_config(max_batch_size=3, block_size_frames=2),
                                 twin="reference")
        serve(engine, feats, arrivals, piece=16)
        per_block_layers = engine.att.layout.unit if engine.backend.layered else 4
        peaks[name] = max(st.used_blocks for st in engine.stats) * per_block_layers  # in layer-blocks
        peaks[name + " per stream"] = engine.backend.blocks_per_stream * per_block_layers
    # 2-frame blocks, aligned chunks: a local layer holds (2 + 4) / 2 = 3 blocks, a wide one (16 + 4) / 2 = 10
    assert peaks["mixed per stream"] == 2 * 3 + 2 * 10 and peaks["widest per stream"] == 4 * 10
    assert peaks["mixed"] == 3 * peaks["mixed per stream"] < peaks["widest"] == 3 * peaks["widest per stream"]


def test_mixed_windows_unlimited_band_finishes_a_stream_at_its_ceiling():
    """A band with unlimited history has a per-stream ceiling; the engine finishes the stream with "length"."""
    model = mixed_model((SlidingWindow(6), FullAttention(-1)), seed=2)
    config = model.config.cache_config(max_batch_size=2, max_blocks_per_seq=6)
    engine = StreamingEngine(model, config, twin="reference", keep_log_probs=True)
    f = features({0: 16 * 12}, seed=12)[0]
    result = serve(engine, {0: f}, {0: 0}, piece=16)[0]
    assert result.finish_reason == "length"
    assert result.num_frames == 6 * 4  # the unlimited band's 6 blocks of 4 frames
    offline = model.forward_offline(f[None, : result.num_input_frames])[0][0]
    assert (result.log_probs - offline).abs().max().item() <= ATOL


# ---- capture safety and graphs on the CPU -------------------------------------------------------------------
@pytest.mark.parametrize("model", ["slot", "mixed"])
def test_the_engine_step_is_capture_safe_for_each_kind(model):
    """``watch_engine`` checks the device step of every tick (the slot runtime's gather / step / scatter; the
    paged tick over every band of the layered cache, staged as on CUDA); results are unchanged by watching."""
    from oasr.fast.capture_check import watch_engine

    if model == "slot":
        encoder, config, piece = fixed_extent_encoder("slot"), CacheConfig(max_batch_size=4), 5
        feats, arrivals = fixed_extent_workload()
    else:
        encoder, piece = mixed_model(seed=8), 11
        config = encoder.config.cache_config(max_batch_size=4, block_size_frames=3)
        feats = features({sid: 16 * 4 + 5 * sid for sid in range(5)}, seed=13)
        arrivals = {sid: sid for sid in feats}
    watched = StreamingEngine(encoder, config, keep_log_probs=True)
    checker = watch_engine(watched)
    a = serve(watched, feats, arrivals, piece=piece)
    b = serve(StreamingEngine(encoder, config, keep_log_probs=True), feats, arrivals, piece=piece)
    assert len(checker.records) >= 4
    assert not [v for r in checker.records for v in r.violations]
    for sid in feats:
        assert torch.equal(a[sid].log_probs, b[sid].log_probs)


def test_mixed_windows_graphed_with_a_stand_in_equals_eager():
    model = mixed_model(seed=9)
    config = model.config.cache_config(max_batch_size=4, block_size_frames=3)
    feats = features({sid: 16 * 4 + 7 * sid for sid in range(5)}, seed=14)
    arrivals = {sid: sid // 2 for sid in feats}
    capture = StandInCapture()
    graphed = StreamingEngine(model, config, cuda_graphs=True, graph_capture=capture, keep_log_probs=True)
    assert graphed.execution == "graphed" and graphed.backend.layered
    a = serve(graphed, feats, arrivals, piece=16)
    b = serve(StreamingEngine(model, config, keep_log_probs=True), feats, arrivals, piece=16)
    assert capture.replays > 0
    for sid in feats:
        assert torch.equal(a[sid].log_probs, b[sid].log_probs), sid


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", ["slot", "mixed"])
def test_cuda_graphed_engine_equals_eager_and_the_stateful_oracle(model):
    """On a CUDA device the engine captures by default: one graph per width (the slot step, or the paged tick
    over every band); replay == eager bit for bit, and == the stateful oracle / the offline forward."""
    if model == "slot":
        encoder, config, piece = fixed_extent_encoder("slot").cuda(), CacheConfig(max_batch_size=4, device="cuda"), 5
        feats, arrivals = fixed_extent_workload()
    else:
        encoder, piece = mixed_model(seed=8).cuda(), 11
        config = encoder.config.cache_config(max_batch_size=4, block_size_frames=3, device="cuda")
        feats = features({sid: 16 * 4 + 5 * sid for sid in range(5)}, seed=13)
        arrivals = {sid: sid for sid in feats}
    graphed = StreamingEngine(encoder, config, keep_log_probs=True)
    if model == "slot":
        assert graphed.execution == "graphed"
    else:  # head_dim 16 on fp32 pages is a declared kernel gap: decided before capture, the engine runs eager
        assert graphed.execution == "eager" and "kernel gap" in graphed.execution_note, graphed.execution_note
    a = serve(graphed, feats, arrivals, piece=piece)
    b = serve(StreamingEngine(encoder, config, keep_log_probs=True, cuda_graphs=False), feats, arrivals, piece=piece)
    for sid in feats:
        assert torch.equal(a[sid].log_probs, b[sid].log_probs), sid
    if model == "slot":
        stateful = serve(StreamingEngine(fixed_extent_encoder("stateful").cuda(), config, keep_log_probs=True),
                         feats, arrivals, piece=piece)
        for sid in feats:
            assert (a[sid].log_probs - stateful[sid].log_probs).abs().max().item() <= ATOL, sid
    else:
        cpu = mixed_model(seed=8)
        for sid, f in feats.items():
            assert (a[sid].log_probs - cpu.forward_offline(f[None])[0][0]).abs().max().item() <= ATOL, sid
