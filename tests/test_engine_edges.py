"""The engine at its edges: suspensions under slot pressure, row order, frame counts, ids, close().

* suspend + resume between ticks changes nothing, also with fewer slots than streams: the resumed
  stream takes its slot back before any newcomer (the demo's ``--suspend-every``, and a harsher
  driver that suspends every tick whoever waits);
* a stream's result does not depend on its row in the cohort (both twins, bit for bit, here on the CPU);
* a session whose ``offset`` disagrees with its other frame counts is refused;
* stream ids are ints within 64 bits or strs; everything else is refused at ``add_stream``;
* ``close()`` removes the rescoring hook and drops the model; a dropped engine does not linger.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref
from argparse import Namespace

import numpy as np
import pytest
import torch
from session_helpers import engine_snapshot, features, make_engine, make_model, refused, same_snapshot, start

from oasr.engine import StreamingEngine
from oasr.sessions import format as S


def demo_model(max_batch_size: int):
    from oasr.commands.demo import build

    args = Namespace(num_left_chunks=-1, eviction=True, prefill=False, layers=1, seed=0, device="cpu",
                     max_batch_size=max_batch_size, kv_cache_dtype=None)
    return build(args)


def outcome(engine: StreamingEngine, ids) -> dict:
    out = {}
    for sid in ids:
        r = engine.result(sid)
        out[sid] = (r.tokens, r.log_probs.numpy().tobytes(), [(h.tokens, h.log_score, h.frames) for h in r.nbest],
                    r.num_frames, r.finish_reason, r.finished_tick)  # a resumed stream is admitted anew
    return out


def ticks(engine: StreamingEngine) -> list:
    return [(s.cohort, s.width, s.active, s.waiting, s.finished) for s in engine.stats]


# ---- suspensions under slot pressure ---------------------------------------------------------------------


def test_demo_suspensions_change_nothing_with_fewer_slots_than_streams():
    """8 streams on 4 slots: newcomers wait; each suspension frees a slot for one tick."""
    from oasr.commands.demo import drive, make_workload

    model, cfg = demo_model(max_batch_size=4)
    workload = make_workload(8, model.config.input_dim, seed=0)  # 1 to 12 s, starting over 24 ticks
    runs = []
    for every in (0, 1, 2):
        engine = StreamingEngine(model, cfg, twin="fast", keep_log_probs=True)
        sizes = drive(engine, workload, 0, model.config.chunk_input_frames, suspend_every=every)
        runs.append((outcome(engine, [s.stream_id for s in workload]), ticks(engine), len(sizes)))
    (plain, plain_ticks, _), *suspended = runs
    assert max(waiting for _, _, _, waiting, _ in plain_ticks) >= 1  # streams did compete for slots
    for got, got_ticks, count in suspended:
        assert count >= 5
        assert got_ticks == plain_ticks
        assert got == plain


def drive_suspending_every_tick(engine: StreamingEngine, workload, seed: int, chunk: int, suspend: bool) -> int:
    """The demo's pushes, but a suspend + resume of one active stream after every tick, whether or not
    streams wait and whether or not the chosen one has input for the next tick."""
    g = torch.Generator().manual_seed(seed)
    pos = {s.stream_id: 0 for s in workload}
    ended, tick, count = set(), 0, 0
    while len(ended) < len(workload) or any(engine.status(s.stream_id) != "finished" for s in workload):
        for s in workload:
            sid = s.stream_id
            if tick == s.start_tick:
                engine.add_stream(sid)
            if tick < s.start_tick or sid in ended:
                continue
            n = int(torch.randint(0, chunk * 3 // 2, (), generator=g))  # at times too little: not ready
            engine.push(sid, s.features[pos[sid] : pos[sid] + n])
            pos[sid] += n
            if pos[sid] >= s.features.shape[0]:
                engine.end_stream(sid)
                ended.add(sid)
        engine.step()
        tick += 1
        active = engine.active_ids
        if suspend and active:
            sid = active[tick % len(active)]
            engine.resume(engine.suspend(sid))
            count += 1
    return count


@pytest.mark.parametrize("twin", ["fast", "reference"])
def test_suspending_every_tick_under_slot_pressure_changes_nothing(twin):
    from oasr.commands.demo import make_workload

    model, cfg = demo_model(max_batch_size=2)
    workload = make_workload(6, model.config.input_dim, seed=3, max_seconds=3.0, spread_ticks=3)
    chunk = model.config.chunk_input_frames
    runs = []
    for suspend in (False, True):
        engine = StreamingEngine(model, cfg, twin=twin, keep_log_probs=True)
        count = drive_suspending_every_tick(engine, workload, 1, chunk, suspend)
        runs.append((outcome(engine, [s.stream_id for s in workload]), ticks(engine), count))
    (plain, plain_ticks, _), (got, got_ticks, count) = runs
    assert count >= 6 and max(t[3] for t in plain_ticks) >= 2
    assert got_ticks == plain_ticks
    assert got == plain


def test_a_resumed_stream_goes_before_new_arrivals_even_without_input():
    model = make_model()
    engine = make_engine(model, "fast", max_batch_size=1)
    start(engine)
    engine.step()  # "a" is active with 6 frames pending: less than a chunk, it waits for input
    assert engine._streams["a"].num_pending < model.config.chunk_input_frames
    data = engine.suspend("a")
    engine.add_stream("b")
    engine.push("b", features(model.config.chunk_input_frames, seed=2))  # ready, and it arrived first
    engine.resume(data)
    assert engine.admission_order() == ["a", "b"]
    engine.step()  # "a" takes its slot back without input; "b" waits as it would have
    assert engine.active_ids == ["a"] and engine.status("b") == "waiting"


# ---- row order -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("twin", ["fast", "reference"])
def test_a_streams_result_does_not_depend_on_its_row(twin):
    """The cohort's rows shuffled before every tick: every stream's log-probs are the same bits."""
    from oasr.commands.demo import drive, make_workload

    model, cfg = demo_model(max_batch_size=8)
    workload = make_workload(8, model.config.input_dim, seed=1, max_seconds=3.0, spread_ticks=6)
    rng = random.Random(0)

    class Shuffled(StreamingEngine):
        def step(self):
            rng.shuffle(self._active)
            return super().step()

    runs = []
    for cls in (StreamingEngine, Shuffled):
        engine = cls(model, cfg, twin=twin, keep_log_probs=True)
        drive(engine, workload, 0, model.config.chunk_input_frames)
        runs.append(outcome(engine, [s.stream_id for s in workload]))
    assert runs[0] == runs[1]


# ---- frame counts in a session ---------------------------------------------------------------------------


def tampered(field: str, delta: int, decoder: str = "beam") -> tuple:
    model = make_model()
    engine = StreamingEngine(model, model.config.cache_config(block_size_frames=3, max_batch_size=4), twin="fast",
                             decoder=decoder)
    start(engine)
    session = S.read_session(engine.suspend("a"))
    e = session.engine
    session.engine = dataclasses.replace(e, **{field: getattr(e, field) + delta})
    fresh = StreamingEngine(model, model.config.cache_config(block_size_frames=3, max_batch_size=4),
                            twin="reference", decoder=decoder)
    return fresh, S.encode_session(session)


@pytest.mark.parametrize("decoder", ["beam", "greedy"])
@pytest.mark.parametrize("delta", [7, -1])
def test_an_offset_that_disagrees_with_the_frame_counts_is_refused(decoder, delta):
    fresh, data = tampered("offset", delta, decoder)
    why = refused(fresh, data, error=S.SessionError)
    assert "offset" in why and "total_frames=12" in why


def test_input_frames_must_match_the_offset():
    fresh, data = tampered("input_frames", 4)
    why = refused(fresh, data, error=S.SessionError)
    assert "52 feature frames consumed for offset 12" in why


def test_a_beam_that_decoded_other_frames_is_refused():
    model = make_model()
    engine = make_engine(model, "fast")
    start(engine)
    session = S.read_session(engine.suspend("a"))
    session.beam = session.beam._replace(frames_decoded=session.beam.frames_decoded + 1)
    with pytest.raises(S.SessionError, match="frames_decoded=13"):
        S.read_session(S.encode_session(session))


# ---- stream ids ------------------------------------------------------------------------------------------


BAD_IDS = [True, False, 1.0, float("nan"), b"a", ("a",), 2**63, -(2**63) - 1, np.int64(1), None.__class__, "\ud800"]


@pytest.mark.parametrize("twin", ["fast", "reference"])
def test_stream_ids_are_ints_or_strs(twin):
    model = make_model()
    engine = make_engine(model, twin)
    engine.add_stream(1)
    for bad in BAD_IDS:
        before = engine_snapshot(engine)
        with pytest.raises(ValueError, match="stream id"):
            engine.add_stream(bad)
        assert same_snapshot(before, engine_snapshot(engine)) and engine.stream_ids == [1]
    for good in (2**63 - 1, -(2**63), "", "\u00fc", 0):
        assert engine.add_stream(good) == good
    engine.push(2**63 - 1, features(64))
    engine.step()  # a step with every kind of id in the engine
    data = engine.suspend(2**63 - 1)
    assert engine.resume(data) == 2**63 - 1  # its own id back from the session


def test_resume_refuses_a_bad_id():
    model = make_model()
    engine = make_engine(model, "fast")
    start(engine)
    data = engine.suspend("a")
    for bad in (True, 1.5, ("a",)):
        before = engine_snapshot(engine)
        with pytest.raises(ValueError, match="stream ids are ints or strs"):
            engine.resume(data, stream_id=bad)
        assert same_snapshot(before, engine_snapshot(engine))
    assert engine.resume(data, stream_id="b") == "b"


# ---- close -----------------------------------------------------------------------------------------------


def hooks(model) -> int:
    return len(model.ctc._forward_hooks)


def test_close_drops_the_model_and_adds_no_hook():
    model = make_model()
    base = hooks(model)
    engine = make_engine(model, "fast", rescore=True)
    with make_engine(model, "reference", rescore=True) as other:
        assert hooks(model) == base  # the model step returns the encoder output: no hook is needed
        start(other)
    assert other.closed and other.model is None and hooks(model) == base
    start(engine)
    engine.push("a", features()[70:])
    engine.end_stream("a")
    engine.run()
    result = engine.result("a")
    engine.close()
    engine.close()  # idempotent
    assert hooks(model) == base and engine.model is None and engine.model_tick is None
    assert engine.result("a") is result  # results stay readable
    for call in (engine.step, lambda: engine.add_stream("b"), lambda: engine.push("a", features(4)),
                 lambda: engine.resume(b"")):
        with pytest.raises(ValueError, match="StreamingEngine is closed"):
            call()


def test_a_dropped_engine_is_collected():
    model = make_model()
    base = hooks(model)
    engine = make_engine(model, "fast", rescore=True)
    start(engine)
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    assert alive() is None and hooks(model) == base
    plain = make_engine(model, "fast")  # without rescoring: nothing to remove, close still drops the model
    plain.close()
    assert plain.model is None and hooks(model) == base


# ---- cancel ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("twin", ["fast", "reference"])
def test_cancel_in_every_state_frees_everything_and_leaves_the_others_alone(twin):
    """A client that went away: cancel a waiting, an active, a rescoring and a finished stream; the pool
    and the slots come back, the id is free again, and the stream that stayed gets its undisturbed result."""
    model = make_model()
    cfg = model.config.cache_config(block_size_frames=3, max_batch_size=2)

    def engine_():
        return StreamingEngine(model, cfg, twin=twin, rescore=True, decode_steps_per_tick=1)

    def add(engine, sid, seed):
        engine.add_stream(sid)
        engine.push(sid, features(seed=seed))

    solo = engine_()
    add(solo, "keep", 1)
    solo.end_stream("keep")
    solo.run()
    want = solo.result("keep").tokens

    engine = engine_()
    free0 = engine.pool.num_free_blocks
    for seed, sid in enumerate(("keep", "active", "waiting"), start=1):
        add(engine, sid, seed)
    engine.step()  # keep and active hold the two slots, waiting waits
    assert engine.status("active") == "active" and engine.status("waiting") == "waiting"
    engine.cancel("waiting")
    engine.cancel("active")
    assert engine.stream_ids == ["keep"] and engine.num_waiting == 0 and engine.num_active == 1
    with pytest.raises(KeyError):
        engine.cancel("active")
    engine.add_stream("active")  # the id is free again
    engine.cancel("active")
    engine.end_stream("keep")
    add(engine, "late", 4)
    engine.end_stream("late")
    while engine.status("late") != "rescoring":
        engine.step()
    engine.cancel("late")  # mid-rescoring: its job goes with it
    engine.run()
    assert engine.result("keep").tokens == want
    engine.cancel("keep")  # finished: its result goes too
    assert engine.stream_ids == [] and engine.pool.num_free_blocks == free0 and not engine._rescoring
