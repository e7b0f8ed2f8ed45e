"""The streaming-backend registry and the slot / stateful runtimes on the fixed-extent encoder.

The slot runtime (slot cache, static batch per width, padding lane) must equal the stateful
runtime (per-stream lists, batch N) bit for bit on the CPU, and streaming must equal the
offline forward; its device step must be capture-safe (``CaptureSafetyChecker``) and its
stand-in graph replay equal to eager. The ``cuda`` test replays real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from oasr import fast, reference
from oasr.engine import StreamingEngine
from oasr.engine.streaming_backend import (
    STREAMING_BACKENDS,
    PagedStreamingBackend,
    SlotStreamingBackend,
    StatefulStreamingBackend,
    build_streaming_backend,
    register_streaming_backend,
)
from oasr.fast.capture_check import CaptureSafetyChecker
from oasr.models import ConformerConfig, StreamingConformer
from oasr.models.conv_recurrent import ConvRecurrentConfig, ConvRecurrentEncoder
from tests.test_graph_runner import StandInCapture

CHUNK = 8


def make_encoder(kind="slot", seed=1, **kw):
    return ConvRecurrentEncoder(ConvRecurrentConfig(chunk_frames=CHUNK, streaming_kind=kind, seed=seed, **kw))


def workload(seed=0, streams=5):
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(CHUNK * 4 + 3 * i, 20, generator=g) for i in range(streams)}, {i: i // 2 for i in
                                                                                          range(streams)}


def drive(backend, feats, starts, device="cpu", check=None):
    """Streams join at their start tick; each tick every stream with input left is one cohort."""
    outs, pos = {}, dict.fromkeys(feats, 0)
    for tick in range(20):
        for sid, start in starts.items():
            if tick == start:
                backend.allocate(sid)
        ids = [s for s in feats if starts[s] <= tick and pos[s] < feats[s].shape[0]]
        if not ids:
            if all(pos[s] >= feats[s].shape[0] for s in feats):
                break
            continue
        chunks = [feats[s][pos[s] : pos[s] + CHUNK] for s in ids]
        T = max(c.shape[0] for c in chunks)
        xs = torch.zeros(len(ids), T, 20)
        for row, c in enumerate(chunks):
            xs[row, : c.shape[0]] = c
        lens = [c.shape[0] for c in chunks]
        log_probs, out_lens = backend.forward_step(ids, xs.to(device), lens)
        assert out_lens == lens
        for row, sid in enumerate(ids):
            outs.setdefault(sid, []).append(log_probs[row, : lens[row]].cpu())
            pos[sid] += lens[row]
        for sid in ids:
            if pos[sid] >= feats[sid].shape[0]:
                backend.free(sid)
    return {sid: torch.cat(chunks) for sid, chunks in outs.items()}


# ---- the registry --------------------------------------------------------------------------------
def test_registry_builds_each_runtime_from_the_declaration():
    assert {"paged", "slot", "stateful"} <= set(STREAMING_BACKENDS)
    assert isinstance(build_streaming_backend(make_encoder("slot")), SlotStreamingBackend)
    assert isinstance(build_streaming_backend(make_encoder("stateful")), StatefulStreamingBackend)
    conformer = StreamingConformer(ConformerConfig(chunk_size=4))
    paged = build_streaming_backend(conformer, conformer.config.cache_config(), "reference")
    assert isinstance(paged, PagedStreamingBackend) and paged.att.config is paged.pool.config
    with pytest.raises(ValueError, match="streaming_kind='none'.*offline"):
        build_streaming_backend(make_encoder("none"))


def test_registry_refuses_unknown_kinds_and_duplicates():
    class Odd(torch.nn.Module):
        streaming_kind = "mystery"

    with pytest.raises(ValueError, match="'mystery', which no backend serves"):
        build_streaming_backend(Odd())
    with pytest.raises(ValueError, match="declares no streaming_kind"):
        build_streaming_backend(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already served"):
        register_streaming_backend("slot")(type("Again", (), {}))
    with pytest.raises(ValueError, match="other than 'none'"):
        register_streaming_backend("none")


def test_a_new_runtime_plugs_in_by_registration():
    @register_streaming_backend("test-echo")
    class Echo(StatefulStreamingBackend):
        pass

    try:
        enc = make_encoder()
        enc.config.streaming_kind = "test-echo"
        assert type(build_streaming_backend(enc)) is Echo and Echo.kind == "test-echo"
    finally:
        del STREAMING_BACKENDS["test-echo"]


def test_engine_refuses_none_and_builds_each_runtime_at_construction():
    conformer = StreamingConformer(ConformerConfig(chunk_size=4))
    cfg = conformer.config.cache_config()
    with pytest.raises(ValueError, match="streaming_kind='none'.*offline"):
        StreamingEngine(make_encoder("none"), cfg, twin="reference")
    assert type(StreamingEngine(make_encoder("slot"), cfg, twin="reference").backend) is SlotStreamingBackend
    assert type(StreamingEngine(make_encoder("stateful"), cfg).backend) is StatefulStreamingBackend
    engine = StreamingEngine(conformer, cfg, twin="reference")
    assert isinstance(engine.backend, PagedStreamingBackend) and engine.att is engine.backend.att


# ---- the runtimes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("twin", [reference, fast], ids=["reference", "fast"])
def test_slot_equals_stateful_bit_for_bit_and_offline(twin):
    enc = make_encoder()
    feats, starts = workload()
    slot = drive(SlotStreamingBackend(enc, max_batch_size=8, twin=twin), feats, starts)
    stateful = drive(StatefulStreamingBackend(enc, max_batch_size=8), feats, starts)
    for sid, f in feats.items():
        assert torch.equal(slot[sid], stateful[sid]), sid
        offline = enc.forward_offline(f[None])[0][0]
        assert (slot[sid] - offline).abs().max().item() <= 1e-5


def test_streaming_state_matters():
    """The oracle can fail: a stream whose state is reset every chunk differs from offline."""
    enc = make_encoder()
    f = workload()[0][0]
    outs = []
    for start in range(0, f.shape[0], CHUNK):
        chunk = f[start : start + CHUNK][None]
        outs.append(enc.streaming_forward(chunk, torch.tensor([chunk.shape[1]]),
                                          enc.get_streaming_init_states(1))[0][0])
    assert (torch.cat(outs) - enc.forward_offline(f[None])[0][0]).abs().max().item() > 1e-3


def test_padding_rows_and_freed_slots_stay_clean():
    enc = make_encoder()
    backend = SlotStreamingBackend(enc, max_batch_size=4)
    backend.allocate("a")
    backend.forward_step(["a"], torch.randn(1, CHUNK, 20), [CHUNK])  # width 1
    backend.allocate("b")
    backend.allocate("c")
    backend.forward_step(["a", "b", "c"], torch.randn(3, CHUNK, 20), [CHUNK, 3, 0])  # width 4: one padding row
    lane = backend.state.rows([], pad_to=1)[0]
    for spec in backend.specs:
        buf = backend.state.buffer(spec.name)
        assert buf.select(spec.slot_axis, lane).abs().max().item() == 0  # the padding lane is still zero
        assert buf.select(spec.slot_axis, backend.state.slot_of("c")).abs().max().item() == 0  # 0 frames: untouched
    with pytest.raises(KeyError):
        backend.forward_step(["zz"], torch.randn(1, CHUNK, 20), [CHUNK])
    with pytest.raises(ValueError, match="input_lens"):
        backend.forward_step(["a"], torch.randn(1, CHUNK, 20), [CHUNK + 1])
    with pytest.raises(ValueError, match="xs must be"):
        backend.forward_step(["a"], torch.randn(1, CHUNK + 1, 20), [CHUNK])


def test_slot_step_is_capture_safe():
    enc = make_encoder()
    backend = SlotStreamingBackend(enc, max_batch_size=8)
    checker = CaptureSafetyChecker()
    checker.declare_device(enc, backend.state, *[t for w in backend.widths for t in backend.static_buffers(w)])
    checker.declare_pinned(*backend.pinned_host_tensors())
    backend.step_monitor = checker
    feats, starts = workload(seed=3)
    drive(backend, feats, starts)
    assert checker.records and all(not r.violations for r in checker.records), \
        [v for r in checker.records for v in r.violations][:5]
    widths = {r.label.rsplit(" ", 1)[-1] for r in checker.records}
    assert len(widths) >= 2  # several widths were checked


def test_capture_checker_catches_a_host_sync():
    """The check can fail: an encoder that reads a length on the host is reported."""
    enc = make_encoder()

    class Syncing(ConvRecurrentEncoder):
        def streaming_forward(self, xs, input_lens, states):
            int(input_lens.max())
            return super().streaming_forward(xs, input_lens, states)

    bad = Syncing(enc.config)
    backend = SlotStreamingBackend(bad, max_batch_size=2)
    checker = CaptureSafetyChecker()
    checker.declare_device(bad, backend.state, *[t for w in backend.widths for t in backend.static_buffers(w)])
    checker.declare_pinned(*backend.pinned_host_tensors())
    backend.step_monitor = checker
    backend.allocate(0)
    backend.forward_step([0], torch.randn(1, CHUNK, 20), [CHUNK])
    assert checker.records[0].violations


def test_stand_in_graph_replay_equals_eager():
    enc = make_encoder()
    feats, starts = workload(seed=5)
    capture = StandInCapture()
    graphed = SlotStreamingBackend(enc, max_batch_size=8, graphs=True, capture=capture)
    assert sorted(capture.captured) == list(range(len(graphed.widths)))
    a = drive(graphed, feats, starts)
    b = drive(SlotStreamingBackend(enc, max_batch_size=8), feats, starts)
    assert capture.replays > 0
    for sid in feats:
        assert torch.equal(a[sid], b[sid])
    with pytest.raises(ValueError, match="needs a CUDA device"):
        SlotStreamingBackend(enc, graphs=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager():
    enc = make_encoder().to("cuda")
    feats, starts = workload(seed=6)
    graphed = drive(SlotStreamingBackend(enc, max_batch_size=8, device="cuda", graphs=True), feats, starts, "cuda")
    eager = drive(SlotStreamingBackend(enc, max_batch_size=8, device="cuda"), feats, starts, "cuda")
    stateful = drive(StatefulStreamingBackend(enc, max_batch_size=8, device="cuda"), feats, starts, "cuda")
    for sid, f in feats.items():
        assert torch.equal(graphed[sid], eager[sid]), sid
        offline = enc.forward_offline(f[None].cuda())[0][0].cpu()
        assert (graphed[sid] - offline).abs().max().item() <= 1e-5
        assert (stateful[sid] - offline).abs().max().item() <= 1e-5


def test_paged_backend_takes_a_layered_cache_for_per_layer_windows_only():
    from oasr.cache.layer_specs import FullAttention, SlidingWindow

    mixed = StreamingConformer(ConformerConfig(chunk_size=4, attention_specs=(SlidingWindow(6), FullAttention(2))))
    engine = StreamingEngine(mixed, mixed.config.cache_config(), twin="reference")
    assert engine.backend.layered and isinstance(engine.att, reference.LayeredCache)
    assert engine.backend.blocks_per_stream == sum(engine.att.layout.blocks_per_stream())
    uniform = StreamingConformer(ConformerConfig(chunk_size=4, attention_specs=(SlidingWindow(6),) * 2))
    engine = StreamingEngine(uniform, uniform.config.cache_config(), twin="reference")
    assert not engine.backend.layered and isinstance(engine.att, reference.AttentionCacheManager)
    assert engine.config.window_frames == 6  # one window for every layer: the engine's own case


@pytest.mark.parametrize("twin", ["reference", "fast"])
def test_engine_streams_a_frame_window_equal_to_offline(twin):
    """A window of 6 frames (chunk 4) through the engine's own tick: CacheConfig.window_frames end to end."""
    from oasr.cache.layer_specs import SlidingWindow

    model = StreamingConformer(ConformerConfig(chunk_size=4, attention_specs=(SlidingWindow(6),) * 2, seed=9))
    engine = StreamingEngine(model, model.config.cache_config(max_batch_size=2, block_size_frames=3), twin=twin,
                             keep_log_probs=True)
    g = torch.Generator().manual_seed(1)
    feats = {sid: torch.randn(16 * 6 + 7 * sid, 20, generator=g) for sid in range(2)}
    for sid, f in feats.items():
        engine.add_stream(sid)
        engine.push(sid, f)
        engine.end_stream(sid)
    engine.run()
    for sid, f in feats.items():
        offline = model.forward_offline(f[None])[0][0]
        assert (engine.result(sid).log_probs - offline).abs().max().item() <= 1e-5
    assert engine.longest_extent == 6 + 4  # a chunk saw exactly its 6 frames of history and itself
