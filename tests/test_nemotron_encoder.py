"""oasr's Nemotron encoder equals transformers' own streaming ``NemotronAsrStreamingEncoder``, chunk by chunk.

Each tiny configuration is built by transformers with random weights (every parameter drawn, so no
bias or norm is trivially 0 or 1), written by ``save_pretrained`` into a temporary directory and
loaded by ``oasr.from_pretrained``. The oracle is fed the same chunks (its first chunk ``1 + 8a``
feature frames, then ``8(a + 1)``) with its caches carried across calls; oasr streams them through
the paged caches of a twin.

Tolerances. fp32: the two differ only in summation order (one GEMM per projection against
transformers' own, a gathered window against a concatenated one); measured 1.2e-7 .. 4.8e-7 on
outputs of magnitude ~1 (each block ends in a LayerNorm), so ``FP32_ATOL = 1e-5`` leaves room for
ordering noise and none for a wrong frame, position, distance or cache entry (those move outputs
by 1e-2 and more). bf16: oasr's error against the fp32 oracle may be at most twice the bf16
oracle's own error against it, plus a floor of 1e-2 (both round every activation to 8 bits).
"""

import copy

import pytest
import torch

import oasr
from oasr.checkpoints import converters, detect_format
from oasr.models import twin_ready
from oasr.models.nemotron import NemotronEncoder, NemotronEncoderConfig

transformers = pytest.importorskip("transformers")

FP32_ATOL = 1e-5

# hidden, heads, layers, sliding window, lookahead, conv kernel, subsampling channels / kernel / factor, mels
CONFIGS = {
    "h32-w9-a1": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, sliding_window=9,
                      default_num_lookahead_tokens=1, conv_kernel_size=5, subsampling_conv_channels=8, num_mel_bins=16),
    "h48-w13-a2": dict(hidden_size=48, num_attention_heads=3, num_hidden_layers=1, sliding_window=13,
                       default_num_lookahead_tokens=2, conv_kernel_size=3, subsampling_conv_channels=4,
                       subsampling_conv_kernel_size=5, num_mel_bins=20),
    "h64-w7-a0-f4": dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=3, sliding_window=7,
                         default_num_lookahead_tokens=0, conv_kernel_size=9, subsampling_conv_channels=6,
                         subsampling_factor=4, num_mel_bins=24),
    "h128-hd64": dict(hidden_size=128, num_attention_heads=2, num_hidden_layers=1, sliding_window=9,  # a kernel tile
                      default_num_lookahead_tokens=1, conv_kernel_size=5, subsampling_conv_channels=4, num_mel_bins=16,
                      intermediate_size=64),
    "h32-w3-a3-nohistory": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, sliding_window=3,  # W=0
                                default_num_lookahead_tokens=3, conv_kernel_size=5, subsampling_conv_channels=8,
                                num_mel_bins=16),
    "h32-w6-a3": dict(hidden_size=32, num_attention_heads=8, num_hidden_layers=2, sliding_window=6,  # W=4 < 5
                      default_num_lookahead_tokens=3, conv_kernel_size=4, subsampling_conv_channels=5, num_mel_bins=17),
}

TWINS = ["reference", pytest.param("fast", marks=pytest.mark.skipif(not twin_ready("fast"), reason="fast twin"))]


def _rel_bias_ready(twin) -> bool:
    import inspect

    return "rel_bias" in inspect.signature(oasr.models.twins.twin_module(twin).paged_attention).parameters


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, the oracle encoder in fp32)."""
    from transformers import NemotronAsrStreamingConfig, NemotronAsrStreamingForRNNT

    made = {}
    for i, (name, enc) in enumerate(CONFIGS.items()):
        torch.manual_seed(100 + i)
        cfg = NemotronAsrStreamingConfig(encoder_config=enc, vocab_size=9, decoder_hidden_size=16, blank_token_id=8)
        model = NemotronAsrStreamingForRNNT(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() < 2 else p[0].numel() ** -0.5))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        made[name] = (path, model.encoder)
    return made


def chunks_of(encoder: NemotronEncoder, num_chunks: int, seed: int, tail: int = 0) -> list:
    """Random features cut as a stream is fed: the first chunk ``1 + factor * a`` frames, then
    ``factor * C`` each, and a short last chunk of ``tail`` frames when ``tail``."""
    g = torch.Generator().manual_seed(seed)
    first, rest = encoder.first_chunk_input_frames, encoder.chunk_input_frames
    sizes = [first] + [rest] * (num_chunks - 1) + ([tail] if tail else [])
    return [torch.randn(n, encoder.config.num_mel_bins, generator=g) for n in sizes]


def oracle_stream(oracle, chunks, lookahead, dtype=torch.float32) -> list:
    """transformers' streaming: one call per chunk, its caches carried."""
    cache = padding_cache = None
    outs = []
    with torch.no_grad():
        for chunk in chunks:
            out = oracle(chunk[None].to(dtype), cache=cache, padding_cache=padding_cache, use_cache=True,
                         num_lookahead_tokens=lookahead)
            cache, padding_cache = out.cache, out.padding_cache
            outs.append(out.last_hidden_state[0].float())
    return outs


class Streams:
    """The managers of one twin around the encoder: the engine's tick written out by hand."""

    def __init__(self, encoder, twin, **cache_overrides):
        self.encoder, self.twin = encoder, oasr.models.twins.twin_module(twin)
        self.cfg = encoder.cache_config(**cache_overrides)
        encoder.check_cache_config(self.cfg)
        t = self.twin
        self.pool = t.BlockPool(self.cfg, scratch_blocks=1)
        self.att = t.AttentionCacheManager(self.pool, self.cfg, pad_lanes=1)
        self.cnn = t.CnnCacheManager(self.cfg, pad_lanes=1)
        self.states = t.SlotStateCache(encoder.streaming_state_specs, self.cfg.max_batch_size, pad_lanes=1,
                                       device=self.cfg.device, dtype=self.cfg.dtype)
        self.offset, self.outputs = {}, {}

    def admit(self, sid):
        self.att.allocate_stream(sid)
        self.cnn.allocate_stream(sid)
        self.states.allocate_stream(sid)
        self.offset[sid], self.outputs[sid] = 0, []

    def tick(self, chunks: dict, width: int | None = None):
        enc = self.encoder
        ids = list(chunks)
        width = width or len(ids)
        xs = torch.zeros(width, enc.chunk_input_frames, enc.config.num_mel_bins, dtype=self.cfg.dtype,
                         device=self.cfg.device)
        lens = [chunks[s].shape[0] for s in ids] + [0] * (width - len(ids))
        for row, sid in enumerate(ids):
            xs[row, : lens[row]] = chunks[sid]
        out_lens = [enc.output_frames(n, first=self.offset[s] == 0) for s, n in zip(ids, lens, strict=False)]
        self.att.prepare_chunks_batched(ids, out_lens)
        caches = self.att.get_paged_caches(ids, pad_to=width)
        hidden, chunk_lens, new_conv = enc.forward_chunk_paged(
            xs, [self.offset[s] for s in ids] + [0] * (width - len(ids)), caches,
            self.cnn.get_cache(ids, pad_to=width), self.states.views(ids, pad_to=width), lens, twin=self.twin)
        assert chunk_lens.tolist()[: len(ids)] == out_lens
        self.att.commit_chunks_batched(ids, out_lens)
        self.cnn.update(ids, new_conv, pad_to=width)
        outs = {}
        for row, sid in enumerate(ids):
            outs[sid] = hidden[row, : out_lens[row]].float().cpu()
            self.outputs[sid].append(outs[sid])
            self.offset[sid] += out_lens[row]
        return outs


def stream_alone(encoder, twin, chunks, **cache_overrides) -> list:
    streams = Streams(encoder, twin, **cache_overrides)
    streams.admit("s")
    return [streams.tick({"s": c}, width=2)["s"] for c in chunks]  # one row and the padding lane


def max_diff(outs, refs) -> float:
    assert [o.shape for o in outs] == [r.shape for r in refs]
    return max((o - r).abs().max().item() for o, r in zip(outs, refs, strict=True))


def load(path, **kw) -> NemotronEncoder:
    loaded = oasr.from_pretrained(path, **kw)
    assert loaded.source_format == "nemotron_asr_streaming"
    return loaded.model


# ---- equality with transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_streaming_equals_transformers_fp32(checkpoints, name, twin):
    if not _rel_bias_ready(twin):
        pytest.skip(f"oasr.{twin}.paged_attention has no rel_bias yet (h/relpos)")
    path, oracle = checkpoints[name]
    encoder = load(path)
    f = encoder.config.subsampling_factor
    chunks = chunks_of(encoder, 7, seed=1, tail=f + 3 if f + 3 < encoder.chunk_input_frames else 0)
    refs = oracle_stream(oracle, chunks, encoder.lookahead)
    outs = stream_alone(encoder, twin, chunks)
    assert max_diff(outs, refs) <= FP32_ATOL
    # the bound can fail: a stream that forgets its window (no history) is far off
    forgetful = [stream_alone(encoder, twin, [c])[0] for c in chunks[1:-1]]
    assert max_diff(forgetful, refs[1:-1]) > 1e3 * FP32_ATOL


@pytest.mark.parametrize("lookahead", [0, 2])
def test_other_lookaheads_equal_transformers(checkpoints, lookahead):
    """One checkpoint, served at a lookahead other than its default (a chunk of ``a + 1`` frames)."""
    path, oracle = checkpoints["h32-w9-a1"]
    encoder = load(path, lookahead=lookahead)
    chunks = chunks_of(encoder, 6, seed=2)
    assert max_diff(stream_alone(encoder, "reference", chunks), oracle_stream(oracle, chunks, lookahead)) <= FP32_ATOL


@pytest.mark.parametrize("name", ["h32-w9-a1", "h64-w7-a0-f4"])
def test_bf16_error_is_the_oracles_own(checkpoints, name):
    path, oracle = checkpoints[name]
    encoder = load(path, dtype=torch.bfloat16)
    chunks = chunks_of(encoder, 6, seed=3)
    exact = oracle_stream(oracle, chunks, encoder.lookahead)
    oracle_bf16 = oracle_stream(copy.deepcopy(oracle).to(torch.bfloat16), chunks, encoder.lookahead, torch.bfloat16)
    own = max_diff(oracle_bf16, exact)
    ours = max_diff(stream_alone(encoder, "reference", [c.bfloat16() for c in chunks]), exact)
    print(f"bf16 {name}: oasr vs fp32 oracle {ours:.3e}, transformers bf16 vs fp32 {own:.3e}")
    assert ours <= 2 * own + 1e-2


@pytest.mark.parametrize(("name", "kv"), [("h32-w9-a1", "fp8_e4m3"), ("h32-w9-a1", "int8"),
                                         ("h64-w7-a0-f4", "q8_0"), ("h64-w7-a0-f4", "affine4")])
def test_quantized_pages_error_reported(checkpoints, name, kv):
    """K/V stored quantized: the error against model-dtype pages is reported, and bounded loosely
    (a quantized cache is an approximation, not a bug; a wrong page would be O(1) off)."""
    path, oracle = checkpoints[name]
    encoder = load(path)
    chunks = chunks_of(encoder, 6, seed=4)
    exact = stream_alone(encoder, "reference", chunks)
    quantized = stream_alone(encoder, "reference", chunks, kv_cache_dtype=kv)
    err = max_diff(quantized, exact)
    print(f"{name} {kv} pages vs fp32 pages: max abs {err:.3e}")
    assert 0 < err < 0.25


@pytest.mark.parametrize("twin", TWINS)
def test_cohort_admitted_at_different_times_equals_each_alone(checkpoints, twin):
    if not _rel_bias_ready(twin):
        pytest.skip(f"oasr.{twin}.paged_attention has no rel_bias yet (h/relpos)")
    path, _ = checkpoints["h48-w13-a2"]
    encoder = load(path)
    plans = {"a": (0, chunks_of(encoder, 8, seed=10)), "b": (2, chunks_of(encoder, 5, seed=11, tail=13)),
             "c": (3, chunks_of(encoder, 6, seed=12))}
    streams = Streams(encoder, twin)
    for tick in range(12):
        ready = {}
        for sid, (start, chunks) in plans.items():
            if tick == start:
                streams.admit(sid)
            if start <= tick < start + len(chunks):
                ready[sid] = chunks[tick - start]
        if ready:
            streams.tick(ready, width=4)
    for sid, (_, chunks) in plans.items():
        alone = stream_alone(encoder, twin, chunks)
        assert max_diff(streams.outputs[sid], alone) <= 1e-6, sid


@pytest.mark.parametrize("kv", [None, "fp8_e4m3", "int8"])
def test_emulated_kernels_serve_the_relative_term(checkpoints, monkeypatch, kv):
    """The fast twin on the g++-emulated CUDA kernels (head_dim 64: a tile the kernels have): equal to
    transformers on model-dtype pages, and to the reference twin on the same quantized pages. No
    kernel gap is counted, so the kernel, not torch, served every attention call."""
    from oasr.fast import backend, kernel_policy

    path, oracle = checkpoints["h128-hd64"]
    encoder = load(path)
    chunks = chunks_of(encoder, 5, seed=7)
    monkeypatch.setenv(backend.ENV_VAR, "emulated")
    kernel_policy.reset_counts()
    outs = stream_alone(encoder, "fast", chunks, kv_cache_dtype=kv)
    assert backend.backends_used()["cpu"] == "emulated"
    assert kernel_policy.gaps["paged-attention-head-dim"] == 0
    monkeypatch.delenv(backend.ENV_VAR)
    refs = (oracle_stream(oracle, chunks, encoder.lookahead) if kv is None
            else stream_alone(encoder, "reference", chunks, kv_cache_dtype=kv))
    assert max_diff(outs, refs) <= FP32_ATOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_serve_nemotron(checkpoints, dtype, kv):
    """The fast twin on a GPU (NVRTC kernels: append, attention with the relative term; head_dim 64) against
    the reference twin on the same device and pages: within the dtype's rounding (bf16: twice the reference's
    own bf16 error against fp32, plus a floor); fp32 model pages also against the fp32 reference on the CPU."""
    path, _ = checkpoints["h128-hd64"]
    dev = torch.device("cuda", torch.cuda.current_device())
    encoder = load(path).to(dev, dtype)
    chunks = [c.to(dev, dtype) for c in chunks_of(encoder, 6, seed=8)]
    fast = stream_alone(encoder, "fast", chunks, device=dev, kv_cache_dtype=kv)
    ref = stream_alone(encoder, "reference", chunks, device=dev, kv_cache_dtype=kv)
    # the oracle here is the reference twin in fp32 on the CPU, which the CPU tests hold equal to transformers'
    # streaming encoder (the GPU machine's transformers may predate the streaming API those tests use)
    exact = stream_alone(load(path), "reference", [c.float().cpu() for c in chunks])
    if dtype == torch.float32:
        assert max_diff(fast, ref) <= 1e-4
        if kv is None:
            assert max_diff(fast, exact) <= 1e-4
    else:
        assert max_diff(fast, exact) <= 2 * max_diff(ref, exact) + 1e-2


@pytest.mark.parametrize("twin", ["fast", "reference"])
def test_chunk_core_is_capture_safe_on_the_fast_twin(twin):
    """``paged_chunk_core`` on the fast twin does only what a CUDA graph can capture (no host sync, no
    data-dependent shape, no pageable upload), a cohort mixing a first and a later chunk included; the
    reference twin, which reads lengths on the host, is flagged (the checker can fail here)."""
    from oasr.fast.capture_check import CaptureSafetyChecker

    encoder = NemotronEncoder(NemotronEncoderConfig(**CONFIGS["h32-w9-a1"]))
    streams = Streams(encoder, twin)
    streams.admit("a")
    streams.admit("b")
    streams.tick({"a": chunks_of(encoder, 1, seed=9)[0]}, width=2)
    ids = ["a", "b"]
    lens = [encoder.chunk_input_frames, encoder.first_chunk_input_frames]
    streams.att.prepare_chunks_batched(ids, [encoder.output_frames(lens[0], False),
                                             encoder.output_frames(lens[1], True)])
    caches, conv = streams.att.get_paged_caches(ids), streams.cnn.get_cache(ids)
    views = streams.states.views(ids)
    tails = [views[spec.name].gather() for spec in encoder.streaming_state_specs]
    xs, offsets, input_lens = torch.randn(2, encoder.chunk_input_frames, 16), torch.tensor([2, 0]), torch.tensor(lens)
    checker = CaptureSafetyChecker()
    checker.declare_device(encoder, streams.pool, streams.att, streams.cnn, streams.states, xs, offsets, input_lens,
                           caches, conv, tails)
    with checker.region("nemotron chunk") as record:
        encoder.paged_chunk_core(xs, offsets, input_lens, caches, conv, tails, twin)
    assert record.num_ops > 100
    assert (record.violations == []) == (twin == "fast"), record.summary()


# ---- the engine ----------------------------------------------------------------------------------------


def engine_chunks(encoder, feats) -> list:
    """How the engine cuts a stream's features: first chunk, whole later chunks, the rest."""
    first, rest = encoder.first_chunk_input_frames, encoder.chunk_input_frames
    cuts = [feats[:first]] + [feats[i: i + rest] for i in range(first, feats.shape[0], rest)]
    return [c for i, c in enumerate(cuts) if encoder.output_frames(c.shape[0], first=i == 0)]  # a rest < factor: none


def push_in_pieces(engine, sid, feats, seed):
    g = torch.Generator().manual_seed(seed)
    start = 0
    while start < feats.shape[0]:
        n = int(torch.randint(1, 40, (1,), generator=g))
        engine.push(sid, feats[start: start + n])
        start += n


@pytest.mark.parametrize("twin", TWINS)
def test_engine_serves_a_cohort_equal_to_transformers(checkpoints, twin):
    """Streams arriving at different ticks, fed in random pieces, batched: each equals the oracle."""
    from oasr.engine.encoder_streams import EncoderStreamingEngine

    path, oracle = checkpoints["h32-w9-a1"]
    encoder = load(path)
    engine = EncoderStreamingEngine(encoder, encoder.cache_config(max_batch_size=4), twin=twin)
    feats = {sid: torch.randn(n, 16, generator=torch.Generator().manual_seed(20 + i))
             for i, (sid, n) in enumerate({"a": 150, "b": 97, "c": 61, "d": 130, "e": 5}.items())}
    arrival = {"a": 0, "b": 0, "c": 2, "d": 3, "e": 1}  # e: a stream shorter than one first chunk
    for tick in range(4):
        for sid, t in arrival.items():
            if t == tick:
                engine.add_stream(sid)
                push_in_pieces(engine, sid, feats[sid], seed=tick)
                engine.end_stream(sid)
        engine.step()
    engine.run()
    for sid, f in feats.items():
        assert engine.finished(sid)
        ref = torch.cat(oracle_stream(oracle, engine_chunks(encoder, f), encoder.lookahead))
        assert max_diff([engine.result(sid).float()], [ref]) <= FP32_ATOL, sid


def test_engine_refuses_bad_input_and_changes_nothing(checkpoints):
    from oasr.engine.encoder_streams import EncoderStreamingEngine

    encoder = load(checkpoints["h32-w9-a1"][0])
    engine = EncoderStreamingEngine(encoder, encoder.cache_config(max_batch_size=2), twin="reference")
    sid = engine.add_stream("s")
    with pytest.raises(ValueError, match=r"features must be \(n, 16\)"):
        engine.push(sid, torch.zeros(4, 15))
    with pytest.raises(ValueError, match="non-finite"):
        engine.push(sid, torch.full((4, 16), float("nan")))
    engine.push(sid, torch.zeros(3, 16))
    engine.end_stream(sid)
    with pytest.raises(ValueError, match="has ended"):
        engine.push(sid, torch.zeros(4, 16))
    with pytest.raises(ValueError, match="exists"):
        engine.add_stream("s")
    with pytest.raises(ValueError, match="cache_config|CacheConfig does not match"):
        EncoderStreamingEngine(encoder, encoder.config.cache_config(lookahead=0), twin="reference")
    engine.run()
    assert engine.finished(sid) and tuple(engine.result(sid).shape) == (1, 32)  # 3 frames: one encoder frame


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("twin", TWINS)
def test_engine_suspend_resume_is_bit_identical(checkpoints, twin, kv):
    from oasr.engine.encoder_streams import EncoderStreamingEngine

    path, _ = checkpoints["h48-w13-a2"]
    encoder = load(path)
    feats = torch.randn(200, 20, generator=torch.Generator().manual_seed(30))

    def engine():
        return EncoderStreamingEngine(encoder, encoder.cache_config(max_batch_size=2, kv_cache_dtype=kv), twin=twin)

    whole = engine()
    whole.add_stream("s")
    whole.push("s", feats)
    whole.end_stream("s")
    whole.run()
    first = engine()
    first.add_stream("s")
    first.push("s", feats[:120])
    for _ in range(3):
        first.step()
    before = first.result("s")
    data = first.suspend("s")
    assert first.num_active == 0 and first.pool.num_free_blocks == whole.pool.num_free_blocks
    second = engine()
    second.resume(data, "s")
    second.push("s", feats[120:])
    second.end_stream("s")
    second.run()
    assert torch.equal(torch.cat([before, second.result("s")]), whole.result("s"))
    with pytest.raises(ValueError, match="not a suspended stream"):
        engine().resume(b"junk", "t")


# ---- the checkpoint registry --------------------------------------------------------------------------


def test_registry_knows_both_formats_and_refuses_an_unknown_directory(tmp_path):
    assert {"oasr-asr-1", "nemotron_asr_streaming"} <= set(converters())
    (tmp_path / "config.json").write_text('{"model_type": "whisper"}')
    with pytest.raises(ValueError, match=r"no checkpoint format oasr knows \(known: .*nemotron_asr_streaming.*"
                                         r"oasr-asr-1"):
        oasr.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        oasr.from_pretrained(tmp_path / "absent")


def test_native_format_is_detected():
    from oasr.asr.checkpoint import default_model_path

    assert detect_format(default_model_path().parent) == "oasr-asr-1"


def test_missing_and_unexpected_tensors_are_named(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = checkpoints["h32-w9-a1"]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("encoder.layers.1.self_attn.bias_u")
    tensors["encoder.layers.0.self_attn.extra"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.self_attn.bias_u'\], "
                                         r"unexpected \['layers.0.self_attn.extra'\]"):
        oasr.from_pretrained(tmp_path)


def test_sharded_safetensors_load_and_pickles_are_refused(checkpoints, tmp_path):
    from transformers import NemotronAsrStreamingForRNNT

    path, oracle = checkpoints["h32-w9-a1"]
    model = NemotronAsrStreamingForRNNT.from_pretrained(path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load(path), load(tmp_path / "sharded")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((path / "config.json").read_text())
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin are pickle files"):
        oasr.from_pretrained(pickled)


def test_encoder_only_directory_loads(checkpoints, tmp_path):
    path, oracle = checkpoints["h64-w7-a0-f4"]
    oracle.save_pretrained(tmp_path)
    encoder = load(tmp_path)
    chunks = chunks_of(encoder, 3, seed=5)
    assert max_diff(stream_alone(encoder, "reference", chunks), oracle_stream(oracle, chunks, 0)) <= FP32_ATOL


def test_wrong_cache_config_is_refused(checkpoints):
    encoder = load(checkpoints["h32-w9-a1"][0])
    with pytest.raises(ValueError, match="prefill_kv_window"):
        encoder.check_cache_config(encoder.cache_config(prefill_kv_window=False))
    with pytest.raises(ValueError, match="chunk_size"):
        encoder.check_cache_config(encoder.config.cache_config(lookahead=0))


# ---- the full-size configuration ---------------------------------------------------------------------


def test_full_size_configuration_streams_a_chunk_in_bf16():
    """transformers' ``NemotronAsrStreamingConfig()`` encoder (24 x 1024, 8 heads of 128, 617M with the
    transducer), random weights drawn in bf16 (1.2 GB), one first chunk and one later chunk on the CPU."""
    from transformers import NemotronAsrStreamingConfig

    config = NemotronEncoderConfig.from_hf_dict(NemotronAsrStreamingConfig().to_dict())
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim, config.sliding_window) == (1024, 24, 128, 71)
    with torch.device("meta"):
        encoder = NemotronEncoder(config)
    encoder.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in encoder.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * (0.3 if p.dim() < 2 else p[0].numel() ** -0.5)).bfloat16())
    assert 5.5e8 < sum(p.numel() for p in encoder.parameters()) < 6.2e8
    chunks = chunks_of(encoder, 2, seed=6)
    streams = Streams(encoder, "reference", max_batch_size=1)
    streams.admit("s")
    outs = [streams.tick({"s": c.bfloat16()})["s"] for c in chunks]
    assert [tuple(o.shape) for o in outs] == [(14, 1024)] * 2
    assert all(torch.isfinite(o).all() for o in outs)

