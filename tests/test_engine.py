"""StreamingEngine: incremental input, batched ticks, admission, capacity, errors; both twins.

Every stream's output is checked against the offline forward of its whole
input (log-probs within 1e-5, see tests/test_conformer_streaming.py for why)
and its tokens against the reference CTC prefix beam search (or, with
``decoder="greedy"``, the greedy collapse) run once over the offline
log-probs: chunked, batched, pooled decoding must not change a token.
"""

import pytest
import torch

from oasr.engine import StreamingEngine, decode_utterance, memory_utilisation
from oasr.models import ConformerConfig, StreamingConformer

ATOL = 1e-5


def make_model(num_left_chunks=-1, seed=3):
    return StreamingConformer(ConformerConfig(num_left_chunks=num_left_chunks, chunk_size=4, seed=seed))


def make_engine(model, twin, decoder="beam", **cache_overrides):
    cfg = model.config.cache_config(**{"block_size_frames": 3, "max_batch_size": 4, **cache_overrides})
    return StreamingEngine(model, cfg, twin=twin, decoder=decoder, keep_log_probs=True)


def offline_tokens(engine, log_probs):
    """What the engine's decoder must produce, decoded once over the whole utterance."""
    return decode_utterance(log_probs, engine.decoder, engine.ctc_config)


def features(num_frames, seed):
    return torch.randn(num_frames, 20, generator=torch.Generator().manual_seed(seed))


def drive(engine, feats: dict, starts: dict, seed=0, max_ticks=200):
    """Push each stream in random pieces from its start tick, one engine tick per driver tick."""
    g = torch.Generator().manual_seed(seed)
    pos = {sid: 0 for sid in feats}
    ended, outputs = set(), []
    for tick in range(max_ticks):
        for sid, f in feats.items():
            if tick == starts[sid]:
                engine.add_stream(sid)
            if tick < starts[sid] or sid in ended or engine.status(sid) == "finished":
                continue
            n = int(torch.randint(0, 40, (1,), generator=g))
            engine.push(sid, f[pos[sid] : pos[sid] + n])
            pos[sid] += n
            if pos[sid] >= f.shape[0]:
                engine.end_stream(sid)
                ended.add(sid)
        outputs.append(engine.step())
        if all(engine.status(s) == "finished" for s in feats if tick >= starts[s]) and tick >= max(starts.values()):
            break
    return outputs


def check_against_offline(model, engine, feats, prefill=False, prefix_frames=None):
    for sid, f in feats.items():
        r = engine.result(sid)
        n_in = f.shape[0] if prefix_frames is None else prefix_frames[sid]
        off = model.forward_offline(f[None, :n_in], prefill_window=prefill)[0][0]
        assert r.log_probs.shape == off.shape, sid
        if off.numel():
            assert (r.log_probs - off).abs().max().item() <= ATOL, sid
        assert r.tokens == offline_tokens(engine, off), sid


def replay_edits(outputs, sid):
    """Apply each tick's (retracted, new_tokens) edit; check it matches the reported partial."""
    shown = []
    for out in (o[sid] for o in outputs if sid in o):
        del shown[len(shown) - out.retracted :]
        shown += out.new_tokens
        if out.num_frames:
            assert shown == out.partial
    return shown


@pytest.mark.parametrize("num_left_chunks,prefill,decoder", [(-1, False, "beam"), (2, False, "beam"),
                                                             (2, True, "beam"), (2, False, "greedy")])
def test_many_streams_equal_offline(twin, num_left_chunks, prefill, decoder):
    model = make_model(num_left_chunks)
    engine = make_engine(model, twin, decoder, prefill_kv_window=prefill)
    lengths = [16 * 7 + 3, 40, 2, 0, 16 * 5, 16 * 9 + 11, 33]
    feats = {f"s{i}": features(n, i) for i, n in enumerate(lengths)}
    starts = {f"s{i}": t for i, t in enumerate([0, 0, 1, 2, 3, 3, 6])}
    outputs = drive(engine, feats, starts)
    check_against_offline(model, engine, feats, prefill)
    for sid in feats:
        r = engine.result(sid)
        assert r.finish_reason == "eos" and r.num_frames == feats[sid].shape[0] // 4
        # what step() reported adds up to the result
        assert replay_edits(outputs, sid) == r.tokens
        assert sum(o[sid].num_frames for o in outputs if sid in o) == r.num_frames
    assert engine.pool.num_used_blocks == 0 and engine.num_active == 0
    # a CPU engine's cohorts run unpadded up to 8 streams (the finer CPU ladder)
    assert all(s.width == s.cohort for s in engine.stats) and max(s.cohort for s in engine.stats) > 1


def test_cohort_width_ladders(twin):
    from oasr.engine.tick import engine_widths

    engine = make_engine(make_model(), twin, max_batch_size=6, max_blocks_per_seq=16)
    assert [engine.cohort_width(n) for n in range(1, 7)] == [1, 2, 3, 4, 5, 6]  # CPU, eager: every width to 8
    assert engine_widths(6) == [1, 2, 4, 6]  # powers of two, capped: a CUDA engine's (graph) widths
    assert engine_widths(40, 4) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40]
    big = make_engine(make_model(), twin, max_batch_size=40, max_blocks_per_seq=16)
    assert [big.cohort_width(n) for n in (9, 11, 17, 29, 33, 40)] == [10, 12, 20, 32, 40, 40]
    with pytest.raises(ValueError, match="per_octave must be a power of two"):
        engine_widths(8, 3)


def test_admission_waits_for_a_slot(twin):
    model = make_model(2)
    engine = make_engine(model, twin, max_batch_size=2)
    feats = {i: features(16 * 3 + i, i) for i in range(5)}
    for sid, f in feats.items():
        engine.add_stream(sid)
        engine.push(sid, f)
        engine.end_stream(sid)
    engine.step()
    assert engine.num_active == 2 and engine.num_waiting == 3
    assert not engine.can_admit()
    assert engine.active_ids == [0, 1] and engine.status(4) == "waiting"
    engine.run()
    assert all(engine.result(s).finish_reason == "eos" for s in feats)
    assert max(s.active for s in engine.stats) == 2
    admitted = [engine.result(s).admitted_tick for s in feats]
    assert admitted == sorted(admitted) and admitted[2] > admitted[1]  # arrival order, later
    check_against_offline(model, engine, feats)


def test_admission_reserves_the_worst_case_of_every_active_stream(twin):
    """With unlimited history the pool, not the slots, binds: each stream reserves blocks_per_stream."""
    model = make_model(-1)
    engine = make_engine(model, twin, max_batch_size=4, max_blocks_per_seq=6, max_num_blocks=24)
    # a foreign tenant of the same pool leaves room for only two more worst cases
    taken = engine.pool.allocate(24 - 2 * engine.config.blocks_per_stream)
    for sid in range(3):
        engine.add_stream(sid)
        engine.push(sid, features(16, sid))
    engine.step()
    assert engine.num_active == 2 and engine.status(2) == "waiting"
    engine.pool.free(taken)
    engine.step()
    assert engine.status(2) == "active"


def test_stream_at_capacity_finishes_with_length_while_others_continue(twin):
    model = make_model(-1)
    # unlimited history, blocks_per_stream = 4 blocks of 3 frames: 12 encoder frames = 3 chunks
    engine = make_engine(model, twin, max_batch_size=2, max_blocks_per_seq=4, max_num_blocks=8)
    assert engine.config.max_stream_frames == 12
    feats = {"long": features(16 * 6, 1), "short": features(16 * 2 + 5, 2)}
    starts = {"long": 0, "short": 1}
    drive(engine, feats, starts)
    long, short = engine.result("long"), engine.result("short")
    assert long.finish_reason == "length" and long.num_frames == 12 and long.num_input_frames == 48
    assert short.finish_reason == "eos"
    check_against_offline(model, engine, feats, prefix_frames={"long": 48, "short": feats["short"].shape[0]})
    with pytest.raises(ValueError, match="finish_reason='length'"):
        engine.push("long", features(4, 0))
    assert engine.pool.num_used_blocks == 0
    # a new stream gets the slot and the blocks back
    engine.add_stream("next")
    engine.push("next", feats["short"])
    engine.end_stream("next")
    engine.run()
    assert engine.result("next").tokens == short.tokens


def test_prefilled_window_keeps_every_cached_length_constant(twin):
    model = make_model(2)
    engine = make_engine(model, twin, prefill_kv_window=True)
    W = engine.config.history_frames
    feats = {i: features(16 * (3 + i) + i, i) for i in range(4)}
    starts = {0: 0, 1: 1, 2: 1, 3: 4}
    g = torch.Generator().manual_seed(9)
    pos = {s: 0 for s in feats}
    for tick in range(60):
        for sid, f in feats.items():
            if tick == starts[sid]:
                engine.add_stream(sid)
            if tick >= starts[sid] and pos[sid] < f.shape[0]:
                n = int(torch.randint(8, 24, (1,), generator=g))
                engine.push(sid, f[pos[sid] : pos[sid] + n])
                pos[sid] += n
                if pos[sid] >= f.shape[0]:
                    engine.end_stream(sid)
        engine.step()
        active = engine.active_ids
        assert engine.att.cached_frames(active) == [W] * len(active)
    check_against_offline(model, engine, feats, prefill=True)


def test_bad_input_raises_and_harms_no_other_stream(twin):
    model = make_model(2)
    feats = {"a": features(16 * 4 + 2, 1), "b": features(16 * 3, 2)}

    def run(with_errors):
        engine = make_engine(model, twin)
        for sid in feats:
            engine.add_stream(sid)
        engine.add_stream("victim")
        engine.push("victim", features(16, 7))
        for sid, f in feats.items():
            engine.push(sid, f[:20])
        engine.step()
        if with_errors:
            with pytest.raises(KeyError, match="unknown stream id 'ghost'"):
                engine.push("ghost", features(4, 0))
            with pytest.raises(KeyError):
                engine.end_stream("ghost")
            with pytest.raises(ValueError, match=r"\(T, input_dim=20\), got \(4, 19\)"):
                engine.push("a", torch.zeros(4, 19))
            with pytest.raises(ValueError, match="input_dim=20"):
                engine.push("a", torch.zeros(20))
            with pytest.raises(ValueError, match="NaN or inf"):
                engine.push("b", torch.full((3, 20), float("nan")))
            with pytest.raises(ValueError, match="floating point"):
                engine.push("b", torch.zeros(3, 20, dtype=torch.long))
            with pytest.raises(ValueError, match="already in use"):
                engine.add_stream("a")
            engine.end_stream("victim")
            with pytest.raises(ValueError, match="push after end_stream"):
                engine.push("victim", features(4, 0))
            with pytest.raises(ValueError, match="end_stream called twice"):
                engine.end_stream("victim")
            with pytest.raises(ValueError, match="not finished"):
                engine.result("a")
        else:
            engine.end_stream("victim")
        for sid, f in feats.items():
            engine.push(sid, f[20:])
            engine.end_stream(sid)
        engine.run()
        return {sid: engine.result(sid) for sid in [*feats, "victim"]}

    clean, dirty = run(False), run(True)
    for sid in clean:
        assert clean[sid].tokens == dirty[sid].tokens
        assert torch.equal(clean[sid].log_probs, dirty[sid].log_probs)


def test_engine_refuses_a_mismatched_config(twin):
    model = make_model()
    other = ConformerConfig(chunk_size=8).cache_config()
    with pytest.raises(ValueError, match="chunk_size: cache 8 vs model 4"):
        StreamingEngine(model, other, twin=twin)
    with pytest.raises(ValueError, match="twin must be one of"):
        StreamingEngine(model, model.config.cache_config(), twin="turbo")


def test_run_stops_when_waiting_for_input_and_memory_utilisation(twin):
    model = make_model(-1)
    engine = make_engine(model, twin)
    engine.add_stream("x")
    engine.push("x", features(40, 1))  # two chunks and 8 frames
    assert engine.run() == {}
    assert engine.status("x") == "active" and engine.stats[-1].cohort == 0
    assert sum(s.encoder_frames for s in engine.stats) == 8
    engine.end_stream("x")
    finished = engine.run()
    assert list(finished) == ["x"] and finished["x"].num_frames == 10
    util = memory_utilisation(engine)
    assert util["live_frames"] == 8 + 2  # the last tick: 8 cached + a 2-frame short chunk in flight
    assert util["paged_frames"] == util["paged_blocks"] * 3 >= util["live_frames"]
    assert 0 < util["paged_utilisation"] <= 1 and 0 < util["contiguous_utilisation"] <= 1


def test_decoder_states_are_pooled_and_reused(twin):
    """Eight streams through two slots: two decoder states serve them all, and a reused state decodes
    exactly as a fresh one (each stream's tokens equal a one-shot decode of its offline log-probs)."""
    model = make_model(2)
    engine = make_engine(model, twin, max_batch_size=2)
    feats = {i: features(16 * 2 + 5 * i, 100 + i) for i in range(8)}
    for sid, f in feats.items():
        engine.add_stream(sid)
        engine.push(sid, f)
        engine.end_stream(sid)
    engine.run()
    assert engine.ctc.num_created == 2
    assert engine.ctc.num_pooled == 2 and engine.ctc.num_active == 0
    check_against_offline(model, engine, feats)
    assert all(engine.result(sid).nbest for sid in feats if feats[sid].shape[0] >= 4)


def test_input_ended_is_public_and_refuses_an_unknown_id(twin):
    model = make_model()
    engine = make_engine(model, twin)
    engine.add_stream("a")
    engine.push("a", features(64, 0))
    assert engine.input_ended("a") is False
    engine.step()
    assert engine.input_ended("a") is False and engine.status("a") == "active"
    engine.end_stream("a")
    assert engine.input_ended("a") is True and engine.status("a") != "finished"  # frames still buffered
    engine.run()
    assert engine.status("a") == "finished" and engine.input_ended("a") is True
    with pytest.raises(KeyError, match="unknown stream id 'ghost'"):
        engine.input_ended("ghost")


def test_stream_ids_lists_every_known_stream_in_order(twin):
    engine = make_engine(make_model(), twin)
    assert engine.stream_ids == []
    engine.add_stream("b")
    engine.add_stream("a")
    engine.push("a", features(16, 0))
    engine.end_stream("a")
    engine.run()
    assert engine.status("a") == "finished" and engine.status("b") == "waiting"
    assert engine.stream_ids == ["b", "a"]  # finished streams stay known
    ids = engine.stream_ids
    ids.append("mine")
    assert engine.stream_ids == ["b", "a"]  # a copy


def test_one_decoder_call_per_tick_with_mixed_chunk_lengths(twin):
    """Streams whose last chunks are short share a tick with full chunks: the engine still makes
    one decode_cohort call per tick (the decoder masks each row past its own length), and every
    stream's tokens equal the offline decode."""
    model = make_model()
    engine = make_engine(model, twin)
    calls, mixed = [], []
    decode_cohort = engine.ctc.decode_cohort

    def spy(stream_ids, chunks):
        calls.append(engine.tick)
        if len({c.shape[1] for c in chunks}) > 1:
            mixed.append(engine.tick)
        return decode_cohort(stream_ids, chunks)

    engine.ctc.decode_cohort = spy
    feats = {"a": features(16 * 3 + 5, 1), "b": features(16 * 4, 2), "c": features(16 * 2 + 9, 3)}
    for sid, f in feats.items():
        engine.add_stream(sid)
        engine.push(sid, f)
        engine.end_stream(sid)
    engine.run()
    assert mixed and len(calls) == len(set(calls))  # mixed lengths happened, never two calls in a tick
    check_against_offline(model, engine, feats)


def test_blocks_held_by_sums_blocks_held(twin):
    """The admission's count of the blocks every active stream holds (one read on the fast twin) equals the
    per-stream sum, as streams grow, slide their windows and leave."""
    model = make_model(num_left_chunks=2)
    engine = make_engine(model, twin, max_batch_size=4, max_blocks_per_seq=16)
    g = torch.Generator().manual_seed(3)
    ids = [engine.add_stream() for _ in range(3)]
    for tick in range(12):
        for k, sid in enumerate(ids):
            if engine.status(sid) != "finished" and tick < 4 + 3 * k:
                engine.push(sid, torch.randn(model.config.chunk_size * 4, model.config.input_dim, generator=g))
            elif engine.status(sid) != "finished" and not engine._streams[sid].ended:
                engine.end_stream(sid)
        engine.step()
        active = list(engine._active)
        assert engine.backend.blocks_held_by(active) == sum(engine.backend.blocks_held(s) for s in active)
    assert engine.backend.blocks_held_by([]) == 0
