"""Sessions: the file refuses everything it should, changes nothing when it does, and round-trips exactly.

Bit-identical resume in a fresh process is tests/test_session_resume.py. Here:

* the CTC beam snapshot (twin-neutral) round-trips in and across the twins;
* a session saved by one twin loads into the other and saves back to the same bytes;
* the fuzz: every truncation, 1,000 seeded bit flips, a mutation of every header field (with a
  valid checksum, so the field's own check must catch it), sessions of other geometries and
  formats: each is refused with an error naming what differs, and the engine is unchanged;
* the engine API: suspend / resume errors, waiting for room, ids;
* the demo's output with ``--suspend-every`` equals the output without.
"""

import random
import struct

import pytest
import torch
from session_helpers import (
    SPLIT,
    engine_snapshot,
    features,
    finish,
    hold_decoy,
    make_engine,
    make_model,
    refused,
    same_snapshot,
    small_session,
    start,
    target,
    with_checksum,
)

from oasr.cache.errors import PoolExhaustedError, StreamCapacityError
from oasr.ctc.config import BeamEntry, BeamSnapshot, CtcDecoderConfig
from oasr.engine import StreamingEngine
from oasr.fast.ctc_decoder import StreamingCtcDecoder as FastDecoder
from oasr.reference.ctc_decoder import StreamingCtcDecoder as RefDecoder
from oasr.sessions import format as S
from oasr.sessions import stream as SS

DECODERS = {"reference": RefDecoder, "fast": FastDecoder}


# ---- CTC beam snapshots ---------------------------------------------------------------------------


def chunks(seed: int, batch: int = 2, vocab: int = 7, sizes=(5, 3, 6)):
    g = torch.Generator().manual_seed(seed)
    return [torch.log_softmax(2 * torch.randn(batch, t, vocab, generator=g), -1) for t in sizes]


@pytest.mark.parametrize("src", DECODERS)
@pytest.mark.parametrize("dst", DECODERS)
def test_beam_snapshot_continues_in_either_twin(src, dst):
    config = CtcDecoderConfig(beam_size=3, nbest=2, token_topk=4)
    a, b = DECODERS[src](config), DECODERS[dst](config)
    first, *rest = chunks(0)
    state = a.create_state(2, 7)
    a.decode_chunk(state, first)
    snap = a.snapshot_state(state)
    moved = b.create_state(1, 7)  # another shape: restore must overwrite everything
    b.restore_state(moved, snap)
    assert b.snapshot_state(moved) == snap
    for c in rest:
        a.decode_chunk(state, c)
        b.decode_chunk(moved, c)
    got, want = b.finalize_stream(moved), a.finalize_stream(state)
    assert [[(h.tokens, h.frames) for h in row] for row in got] == [[(h.tokens, h.frames) for h in row] for row in want]
    for row_got, row_want in zip(got, want, strict=True):
        for h, w in zip(row_got, row_want, strict=True):
            assert h.log_score == w.log_score if src == dst else abs(h.log_score - w.log_score) <= 1e-9


def test_fast_restore_rebuilds_the_exact_buffers():
    """Keys, parent keys, padding and dead slots come back exactly as the search left them."""
    config = CtcDecoderConfig(beam_size=4)
    dec = FastDecoder(config)
    state = dec.create_state(2, 7)
    for c in chunks(1):
        dec.decode_chunk(state, c)
    again = dec.create_state(2, 7)
    dec.restore_state(again, dec.snapshot_state(state))
    for x, y in zip(state.rows(), again.rows(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("twin", DECODERS)
def test_bad_beam_snapshots_are_refused_and_change_nothing(twin):
    config = CtcDecoderConfig(beam_size=2)
    dec = DECODERS[twin](config)
    state = dec.create_state(1, 5)
    dec.decode_chunk(state, chunks(2, batch=1, vocab=5)[0])
    before = dec.snapshot_state(state)
    good = BeamEntry((1, 2), (0, 3), -1.0, -2.0)
    bad = {
        "blank token": BeamEntry((0,), (1,), -1.0, -1.0),
        "frames not increasing": BeamEntry((1, 2), (3, 3), -1.0, -1.0),
        "frame not decoded yet": BeamEntry((1,), (9,), -1.0, -1.0),
        "dead prefix": BeamEntry((1,), (1,), -torch.inf, -torch.inf),
        "NaN score": BeamEntry((1,), (1,), float("nan"), -1.0),
        "empty prefix ending in a token": BeamEntry((), (), -1.0, -1.0),
    }
    for why, entry in bad.items():
        with pytest.raises(ValueError):
            dec.restore_state(state, BeamSnapshot(1, 5, 5, ((entry,),)))
        assert dec.snapshot_state(state) == before, why
    for rows in (((good, good),), ((good, good, good),), ((good,), (good,))):  # duplicate, too many, wrong batch
        with pytest.raises(ValueError):
            dec.restore_state(state, BeamSnapshot(1, 5, 5, rows))
        assert dec.snapshot_state(state) == before


# ---- caches: cross-twin, byte for byte ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
@pytest.mark.parametrize("src,dst", [("reference", "fast"), ("fast", "reference")])
def test_a_session_loads_into_the_other_twin_and_saves_back_to_the_same_bytes(fmt, src, dst):
    model = make_model(fmt)
    a = make_engine(model, src, fmt)
    start(a)
    caches = lambda e: (e.att, [e.cnn, e.states], e.ctc)  # noqa: E731
    data = SS.save_stream("a", *caches(a))
    b = make_engine(model, dst, fmt)
    hold_decoy(b)
    SS.load_stream(data, "moved", *caches(b))
    assert b.att.describe("moved").slot != a.att.describe("a").slot
    assert SS.save_stream("moved", *caches(b)) == data


# ---- the fuzz ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    return small_session()


@pytest.fixture(scope="module")
def small_rescoring():
    """The same with ``rescore=True``: it also carries the kept encoder output (section 6, flag bit 3)."""
    return small_session(rescore=True)


def test_the_small_session_loads(small):
    model, data = small
    engine = target(model)
    assert engine.resume(data) == "a" and engine.status("a") == "waiting"
    assert len(data) < 8000


def test_every_truncation_is_refused(small):
    model, data = small
    engine = target(model)
    before = engine_snapshot(engine)
    for n in range(len(data)):
        with pytest.raises(S.SessionError):
            engine.resume(data[:n])
        assert same_snapshot(before, engine_snapshot(engine)), n
    with pytest.raises(S.SessionError, match="overlong"):
        engine.resume(data + b"\0")
    assert same_snapshot(before, engine_snapshot(engine))
    assert "truncated" in refused(engine, data[: len(data) // 2])


def test_a_thousand_bit_flips_are_refused(small):
    model, data = small
    engine = target(model)
    before = engine_snapshot(engine)
    rng = random.Random(1234)
    flips = [(rng.randrange(len(data)), rng.randrange(8)) for _ in range(1000)]
    seen = set()
    for byte, bit in flips:
        raw = bytearray(data)
        raw[byte] ^= 1 << bit
        with pytest.raises(S.SessionError) as info:
            engine.resume(bytes(raw))
        seen.add(str(info.value).split(":")[0])
        assert same_snapshot(before, engine_snapshot(engine)), (byte, bit)
    assert "corrupt session" in seen


HEADER_FIELDS = [  # (name, struct field index, a wrong value, what the error must mention)
    ("magic", 0, b"OASRSESX", "not an oasr session"),
    ("version", 1, 2, "version 2"),
    ("header size", 2, 72, "header size"),
    ("flags: unknown bit", 3, None, "unknown bits"),
    ("flags: CTC bit cleared", 3, None, "CTC beam"),
    ("flags: engine bit cleared", 3, None, "engine stream"),
    ("flags: decoder rows", 3, None, "decoder rows"),
    ("flags: encoder output bit flipped", 3, None, "encoder output"),
    ("num_layers", 4, 3, "num_layers"),
    ("n_kv_head", 5, 4, "n_kv_head"),
    ("head_dim", 6, 8, "head_dim"),
    ("hidden_dim", 7, 64, "hidden_dim"),
    ("kernel_size", 8, 7, "kernel_size"),
    ("chunk_size", 9, 8, "chunk_size"),
    ("block_size_frames", 10, 4, "block_size_frames"),
    ("num_left_chunks", 11, 2, "num_left_chunks"),
    ("model dtype", 12, 3, "dtype"),
    ("model dtype code", 12, 9, "dtype code"),
    ("K/V format", 13, 1, "kv_cache_dtype"),
    ("K/V format code", 13, 7, "K/V format code"),
    ("prefill", 14, 1, "prefill"),
    ("reserved", 15, 1, "reserved"),
    ("num_sections", 16, 3, "section"),
    ("body size", 17, None, "truncated"),
]


@pytest.mark.parametrize("rescore", [False, True], ids=["plain", "rescoring"])
@pytest.mark.parametrize("name,index,value,words", HEADER_FIELDS, ids=[f[0] for f in HEADER_FIELDS])
def test_every_header_field_is_checked(request, rescore, name, index, value, words):
    model, data = request.getfixturevalue("small_rescoring" if rescore else "small")
    fields = list(S.HEADER.unpack_from(data, 0))
    flags = fields[3]
    value = {
        "flags: unknown bit": flags | 1 << 9,
        "flags: CTC bit cleared": flags & ~S.FLAG_CTC_BEAM,
        "flags: engine bit cleared": flags & ~S.FLAG_ENGINE,
        "flags: decoder rows": flags | S.FLAG_DECODER_ROWS,
        "flags: encoder output bit flipped": flags ^ S.FLAG_ENCODER_OUT,  # set without the section, or cleared
        "body size": fields[17] + 8,
    }.get(name, value)
    assert fields[index] != value
    fields[index] = value
    raw = bytearray(data)
    raw[: S.HEADER_BYTES] = S.HEADER.pack(*fields)
    assert words.lower() in refused(target(model, rescore=rescore), with_checksum(raw)).lower()


def test_the_flag_bits_are_the_documented_ones():
    assert (S.FLAG_CTC_BEAM, S.FLAG_ENGINE, S.FLAG_DECODER_ROWS, S.FLAG_ENCODER_OUT) == (1, 2, 4, 8)
    assert S.KNOWN_FLAGS == 0b1111
    assert S.SECTION_NAMES == {1: "attention", 2: "slot states", 3: "CTC beam", 4: "engine stream",
                               5: "decoder rows", 6: "encoder output"}


def foreign_sessions():
    """Sessions saved by engines that differ from the target in one respect each."""
    yield "block size", dict(block_size_frames=4), {}, "block_size_frames"
    yield "window", dict(), dict(num_left_chunks=2), "num_left_chunks"
    yield "fp8 pages", dict(kv_cache_dtype="fp8_e4m3"), {}, "kv_cache_dtype"
    yield "model weights", dict(), dict(seed=4), "model weights"


@pytest.mark.parametrize("what,cache,model_kw,words", list(foreign_sessions()), ids=[f[0] for f in foreign_sessions()])
def test_sessions_of_other_geometries_and_formats_are_refused(small, what, cache, model_kw, words):
    model, _ = small
    other_model = make_model("fp32", **{"num_left_chunks": 1, **model_kw})
    src = make_engine(other_model, "reference", "fp32", **cache)
    src.add_stream("a")
    src.push("a", features()[:40])
    src.step()
    assert words in refused(target(model), src.suspend("a"))


def test_other_model_dtype_and_decoder_are_refused():
    model = make_model("fp32")
    engine = make_engine(model, "fast", "fp32")
    bf16 = make_engine(make_model("bf16"), "fast", "bf16")
    start(bf16)
    assert "dtype" in refused(engine, bf16.suspend("a"))
    greedy = make_engine(model, "fast", "fp32", decoder="greedy")
    start(greedy)
    assert "CTC" in refused(engine, greedy.suspend("a"))
    beam = make_engine(model, "fast", "fp32")
    start(beam)
    wide = StreamingEngine(model, beam.config, twin="fast", ctc_config=CtcDecoderConfig(beam_size=8),
                           keep_log_probs=True)
    assert "CTC decoder" in refused(wide, beam.suspend("a"))


def test_cache_level_load_is_atomic_too(small):
    model, data = small
    session = S.read_session(data)
    engine = target(model)
    args = (engine.att, [engine.cnn, engine.states], engine.ctc)
    before = engine_snapshot(engine)
    with pytest.raises(ValueError, match="already allocated"):
        SS.load_stream(data, "busy", *args)
    taken = engine.pool.allocate(engine.pool.num_free_blocks)
    with pytest.raises(PoolExhaustedError):
        SS.restore_stream(session, "new", *args)
    engine.pool.free(taken)
    assert same_snapshot(before, engine_snapshot(engine))
    assert not engine.att.has_stream("new") and not engine.cnn.has_stream("new")


# ---- the engine API --------------------------------------------------------------------------------


def test_suspend_refuses_what_it_cannot_carry():
    model = make_model()
    engine = make_engine(model, "fast")
    engine.add_stream("new")  # never admitted
    engine.add_stream("done")
    engine.push("done", features(12))
    engine.end_stream("done")
    engine.run()
    before = engine_snapshot(engine)
    for sid, words in (("new", "never admitted"), ("done", "finished")):
        with pytest.raises(ValueError, match=words):
            engine.suspend(sid)
    with pytest.raises(KeyError):
        engine.suspend("nobody")
    assert same_snapshot(before, engine_snapshot(engine))


def test_suspend_frees_blocks_and_slot_and_resume_waits_for_room():
    model = make_model()
    engine = make_engine(model, "fast", max_batch_size=2)
    start(engine)
    free = engine.pool.num_free_blocks
    data = engine.suspend("a")
    assert engine.pool.num_free_blocks > free and engine.num_active == 0 and not engine.att.has_stream("a")
    with pytest.raises(KeyError):
        engine.status("a")
    for sid in ("x", "y"):  # fill both slots
        engine.add_stream(sid)
        engine.push(sid, features(40, seed=7))
    engine.step()
    assert engine.resume(data) == "a" and engine.status("a") == "waiting"
    engine.push("a", features()[SPLIT:])
    engine.end_stream("a")
    engine.step()
    assert engine.status("a") == "waiting"  # no slot: it waits like any admission
    for sid in ("x", "y"):
        engine.end_stream(sid)
    result = engine.run()["a"]
    assert result.finish_reason == "eos" and result.num_input_frames == 150 and result.num_frames == 150 // 4


def test_resume_ids():
    model = make_model()
    engine = make_engine(model, "fast")
    start(engine)
    data = engine.suspend("a")
    assert engine.resume(data, stream_id="b") == "b"
    with pytest.raises(ValueError, match="already in use"):
        engine.resume(data, stream_id="b")
    assert engine.resume(data) == "a"
    with pytest.raises(ValueError, match="already in use"):
        engine.resume(data)
    assert S.read_session(engine.suspend("b")).engine.stream_id == "b"
    unnamed = S.read_session(data)
    unnamed.engine.stream_id = object()  # an id a session cannot record: resume picks a fresh one
    assert isinstance(engine.resume(S.encode_session(unnamed)), int)


def test_suspend_after_the_end_and_resume_finishes_with_the_nbest():
    """Ended with too little input for one more frame: the resumed stream finishes from its beam."""
    model = make_model()
    want_engine = make_engine(model, "reference")
    got_engine = make_engine(model, "reference")
    for engine in (want_engine, got_engine):
        engine.add_stream("a")
        engine.push("a", features(66))
        engine.run()
        engine.end_stream("a")
    data = got_engine.suspend("a")
    fresh = make_engine(model, "fast")
    fresh.resume(data)
    got, want = fresh.run()["a"], want_engine.run()["a"]
    assert got.tokens == want.tokens and [h.tokens for h in got.nbest] == [h.tokens for h in want.nbest]
    assert got.nbest and torch.equal(got.log_probs, want.log_probs)


def test_greedy_streams_resume_exactly():
    model = make_model()
    want = make_engine(model, "fast", decoder="greedy")
    start(want)
    want = finish(want)
    engine = make_engine(model, "fast", decoder="greedy")
    start(engine)
    data = engine.suspend("a")
    other = make_engine(model, "reference", decoder="greedy")
    other.resume(data)
    got = finish(other)
    assert got.tokens == want.tokens


# ---- the demo ------------------------------------------------------------------------------------


def test_demo_output_is_the_same_with_suspensions():
    from argparse import Namespace

    from oasr.commands.demo import build, drive, make_workload

    args = Namespace(num_left_chunks=-1, eviction=True, prefill=False, layers=1, seed=0, device="cpu",
                     max_batch_size=8, kv_cache_dtype=None)
    model, cfg = build(args)
    workload = make_workload(8, model.config.input_dim, seed=0, max_seconds=3.0, spread_ticks=6)
    results = []
    for every in (0, 1):
        engine = StreamingEngine(model, cfg, twin="fast", keep_log_probs=True)
        sizes = drive(engine, workload, 0, model.config.chunk_input_frames, suspend_every=every)
        results.append(({s.stream_id: engine.result(s.stream_id) for s in workload}, sizes))
    (plain, none), (suspended, sizes) = results
    assert none == [] and len(sizes) >= 5
    for sid, r in plain.items():
        s = suspended[sid]
        assert s.tokens == r.tokens and torch.equal(s.log_probs, r.log_probs) and s.nbest == r.nbest, sid


def test_demo_flag_runs(capsys):
    from oasr.__main__ import main

    code = main(["engine-demo", "--streams", "4", "--max-batch-size", "4", "--check-sample", "1", "--quiet",
                 "--plot", "", "--suspend-every", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "suspensions and resumes" in out and "-> OK" in out


def test_header_layout_is_the_documented_one():
    assert S.HEADER_BYTES == 64 and S.SECTION.size == 12
    fields = struct.unpack("<8sHH", S.encode_session(S.read_session(make_session_bytes()))[:12])
    assert fields == (b"OASRSESS", 1, 64)


def make_session_bytes() -> bytes:
    engine = make_engine(make_model(), "reference")
    start(engine)
    return engine.suspend("a")


# ---- property: any history, either twin to either twin ----------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from oasr import fast, reference  # noqa: E402
from oasr.cache.config import CacheConfig  # noqa: E402

TWIN_MODULES = {"reference": reference, "fast": fast}


def cache_stack(ops, config: CacheConfig):
    pool = ops.BlockPool(config, scratch_blocks=1)
    return ops.AttentionCacheManager(pool, config, pad_lanes=1), ops.CnnCacheManager(config, pad_lanes=1)


@settings(max_examples=40, deadline=None)
@given(
    src=st.sampled_from(list(TWIN_MODULES)),
    dst=st.sampled_from(list(TWIN_MODULES)),
    left=st.sampled_from([-1, 0, 1, 2]),
    prefill=st.booleans(),
    block=st.sampled_from([2, 3, 4]),
    chunk=st.sampled_from([2, 4]),
    fp8=st.booleans(),
    before=st.integers(0, 7),
    after=st.integers(1, 4),
    decoys=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_any_history_moves_between_any_twins(src, dst, left, prefill, block, chunk, fp8, before, after, decoys, seed):
    """Dense commits of random K/V, a save, a load into a busier stack, more commits: both stacks agree exactly."""
    prefill = prefill and left >= 1
    config = CacheConfig(num_layers=2, n_kv_head=2, head_dim=8, hidden_dim=4, kernel_size=3, chunk_size=chunk,
                         num_left_chunks=left, block_size_frames=block, max_num_blocks=64, max_batch_size=4,
                         max_blocks_per_seq=16, prefill_kv_window=prefill, kv_cache_dtype="fp8_e4m3" if fp8 else None)
    g = torch.Generator().manual_seed(seed)
    kv = lambda: 3 * torch.randn(2, 2, chunk, 16, generator=g)  # noqa: E731
    att, cnn = cache_stack(TWIN_MODULES[src], config)
    att.allocate_stream("s")
    cnn.allocate_stream("s")
    for _ in range(before):
        if not att.at_capacity("s"):
            att.commit("s", kv())
    cnn.update(["s"], torch.randn(2, 1, 2, 4, generator=g))
    data = SS.save_stream("s", att, [cnn])

    att2, cnn2 = cache_stack(TWIN_MODULES[dst], config)
    for d in range(decoys):
        att2.allocate_stream(f"d{d}")
        att2.prepare_chunk(f"d{d}")
    SS.load_stream(data, "s", att2, [cnn2])
    for a, c in ((att, cnn), (att2, cnn2)):
        lengths = lambda info: (info.cache_seqlen, info.cache_seqstart, info.total_frames)  # noqa: E731
        assert lengths(a.describe("s")) == lengths(att.describe("s"))
        assert torch.equal(c.get_cache(["s"]), cnn.get_cache(["s"]))
    assert SS.save_stream("s", att2, [cnn2]) == data
    for _ in range(after):
        if att.at_capacity("s"):
            break
        chunk_kv = kv()
        att.commit("s", chunk_kv)
        att2.commit("s", chunk_kv)
        assert torch.equal(att.get_stacked_cache("s"), att2.get_stacked_cache("s"))
    assert SS.save_stream("s", att2, [cnn2]) == SS.save_stream("s", att, [cnn])


@pytest.mark.parametrize("src,dst", [("reference", "fast"), ("fast", "reference")])
def test_stream_context_save_and_load(src, dst):
    model = make_model()
    a = make_engine(model, src)
    start(a)
    data = SS.save_context(a._contexts["a"], a.states)
    b = make_engine(model, dst)
    ctx = SS.load_context(data, "moved", b.att, b.cnn, b.ctc, states=b.states)
    assert SS.save_context(ctx, b.states) == data and ctx.cached_frames() == a._contexts["a"].cached_frames()
    with pytest.raises(S.SessionError, match="states"):
        SS.load_context(data, "again", b.att, b.cnn, b.ctc)  # without the declared states: foreign
    assert not b.att.has_stream("again")


def test_resume_refuses_a_stream_longer_than_this_engine_allows():
    """Unlimited history: the block ceiling is a capacity, not geometry; a longer stream is refused at resume."""
    model = make_model(num_left_chunks=-1)
    roomy = make_engine(model, "fast", max_blocks_per_seq=64)
    start(roomy)
    data = roomy.suspend("a")
    tight = make_engine(model, "fast", max_blocks_per_seq=3)
    before = engine_snapshot(tight)
    with pytest.raises(StreamCapacityError):
        tight.resume(data)
    assert same_snapshot(before, engine_snapshot(tight))


def test_codec_round_trips_zero_dim_and_empty_tensors():
    """A slot state of shape () (a scalar per stream) is written and read like any other."""
    import torch

    from oasr.sessions.codec import tensor_bytes, tensor_from

    for t in (torch.tensor(3.5), torch.tensor(-7, dtype=torch.int64), torch.zeros(0, 3), torch.arange(6.0).view(2, 3)):
        assert torch.equal(tensor_from(tensor_bytes(t), t.dtype, tuple(t.shape)), t)
