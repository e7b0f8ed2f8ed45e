"""Cohort admission: shortest buffered input first, bounded by ``max_wait_time`` ticks.

The clock is the engine's tick counter: a stream's wait at tick ``t`` is
``t - arrival_tick`` (``arrival_tick`` = the ticks completed when ``add_stream``
ran), so every scenario here is exact and repeatable.
"""

from __future__ import annotations

import pytest
import torch

from oasr.engine import StreamingEngine
from oasr.models import ConformerConfig, StreamingConformer

CHUNK = 16  # feature frames per chunk (4 * chunk_size)


def make_engine(twin, max_batch_size=1, **kwargs):
    model = StreamingConformer(ConformerConfig(chunk_size=4, num_left_chunks=2, seed=2))
    cfg = model.config.cache_config(max_batch_size=max_batch_size)
    return StreamingEngine(model, cfg, twin=twin, decoder="greedy", **kwargs)


def add(engine, sid, frames):
    engine.add_stream(sid)
    engine.push(sid, torch.randn(frames, 20, generator=torch.Generator().manual_seed(len(str(sid)) + frames)))
    engine.end_stream(sid)


def admission_sequence(engine, max_ticks=200):
    """Stream ids in the order they became active."""
    order = []
    for _ in range(max_ticks):
        engine.step()
        for sid in engine.active_ids:
            if sid not in order:
                order.append(sid)
        if engine.num_waiting == 0 and engine.num_active == 0:
            break
    return order


def test_waiting_streams_are_admitted_shortest_first(twin):
    engine = make_engine(twin, max_batch_size=2, max_wait_time=100)
    for sid, chunks in [("a", 6), ("b", 3), ("c", 5), ("d", 2), ("e", 4)]:
        add(engine, sid, chunks * CHUNK)
    assert engine.admission_order() == ["d", "b", "e", "c", "a"]
    assert admission_sequence(engine) == ["d", "b", "e", "c", "a"]


def test_ties_keep_arrival_order_and_not_ready_streams_wait(twin):
    engine = make_engine(twin, max_batch_size=1, max_wait_time=100)
    for sid in ("x", "y", "z"):
        add(engine, sid, 2 * CHUNK)
    engine.add_stream("quiet")  # no input: not ready, takes no slot
    assert engine.admission_order()[:3] == ["quiet", "x", "y"]  # fewest frames first (0) ...
    engine.step()
    assert engine.active_ids == ["x"]  # ... but a stream with nothing to encode is skipped


def test_a_long_waiting_stream_goes_before_shorter_newcomers_once_past_max_wait_time(twin):
    """One slot. A long stream waits while a short newcomer arrives every tick; shortest-first alone would
    starve it. After ``max_wait_time`` ticks it is admitted ahead of every shorter newcomer."""
    max_wait = 6
    engine = make_engine(twin, max_batch_size=1, max_wait_time=max_wait)
    add(engine, "long", 8 * CHUNK)
    add(engine, "short0", CHUNK)
    for tick in range(1, 40):
        add(engine, f"short{tick}", CHUNK)  # a one-chunk stream finishes in its tick: the slot frees every tick
        engine.step()
        if engine.status("long") == "active":
            break
    assert engine.tick == max_wait  # arrival tick 0: admitted at the first tick it had waited max_wait ticks
    admitted = {sid: r.admitted_tick for sid, r in engine.results.items()}
    assert admitted == {f"short{t}": t + 1 for t in range(max_wait - 1)}  # newcomers went first until then
    later = [sid for sid in engine.admission_order() if sid.startswith("short")]
    assert later and f"short{max_wait}" in later  # a shorter newcomer that was passed over


def test_without_the_bound_shortest_first_starves(twin):
    """The same arrivals with a bound longer than the run: the long stream never gets in."""
    engine = make_engine(twin, max_batch_size=1, max_wait_time=1000)
    add(engine, "long", 8 * CHUNK)
    add(engine, "short0", CHUNK)
    for tick in range(1, 30):
        add(engine, f"short{tick}", CHUNK)
        engine.step()
    assert engine.status("long") == "waiting"


def test_arrival_policy_admits_in_arrival_order(twin):
    engine = make_engine(twin, max_batch_size=2, admission="arrival")
    for sid, chunks in [("a", 5), ("b", 2), ("c", 4), ("d", 3)]:
        add(engine, sid, chunks * CHUNK)
    assert engine.admission_order() == ["a", "b", "c", "d"]
    assert admission_sequence(engine) == ["a", "b", "c", "d"]


def test_admission_arguments_are_checked(twin):
    with pytest.raises(ValueError, match="admission must be one of"):
        make_engine(twin, admission="random")
    with pytest.raises(ValueError, match="max_wait_time must be an int >= 0"):
        make_engine(twin, max_wait_time=-1)
    with pytest.raises(ValueError, match="max_wait_time must be an int >= 0"):
        make_engine(twin, max_wait_time=2.5)
