"""The graph-replayed chunk search (``oasr.fast.ctc_graph``) equals the eager search and the reference.

On the CPU the capture is ``StandInCapture`` (eager calls that check a replay reads only what the
capture saw: static inputs); the chunk loop is checked capture-safe by ``CaptureSafetyChecker``
(no host sync, no data-dependent shape, no pageable upload). The ``cuda`` tests capture real
CUDA graphs and compare graph == eager == reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from oasr.ctc.config import CtcDecoderConfig
from oasr.fast import ctc_decoder as fast_mod
from oasr.fast.capture_check import CaptureSafetyChecker
from oasr.fast.ctc_graph import width_bucket
from oasr.reference import ctc_decoder as ref_mod
from tests.test_ctc_decoder import assert_same_nbest, random_log_probs
from tests.test_graph_runner import StandInCapture

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def graphed(config, device="cpu"):
    if device == "cpu":
        return fast_mod.StreamingCtcDecoder(config, cuda_graphs=True, graph_capture=StandInCapture)
    return fast_mod.StreamingCtcDecoder(config, device=device, cuda_graphs=True)


def run_streams(dec, V, plan, seed, device="cpu"):
    """Streams of 1 row each; ``plan``: per call, each stream's chunk length (None: not in the call).

    Returns each stream's n-best and a peek after every call.
    """
    n = len(plan[0])
    states = [dec.create_state(1, V) for _ in range(n)]
    peeks = []
    for c, lengths in enumerate(plan):
        picked = [i for i, t in enumerate(lengths) if t is not None]
        chunks = [random_log_probs(1, lengths[i], V, seed * 1000 + c * 37 + i).to(device) for i in picked]
        dec.decode_chunks([states[i] for i in picked], chunks)
        peeks.append([dec.peek(states[i])[0] for i in picked])
    return [dec.finalize_stream(s) for s in states], peeks


def random_plan(n, calls, T, rng):
    """Streams joining late (positions differ), skipping calls, and ending with short chunks."""
    ends = [rng.randint(1, calls) for _ in range(n)]
    starts = [rng.randint(0, e - 1) for e in ends]
    plan = []
    for c in range(calls):
        row = []
        for i in range(n):
            if c < starts[i] or c >= ends[i] or rng.random() < 0.15:
                row.append(None)
            else:
                row.append(rng.randint(1, T) if c == ends[i] - 1 else T)
        if all(t is None for t in row):
            row[0] = T
        plan.append(row)
    return plan


CASES = [  # (streams, beam, vocab, topk, T, max_prefix_len)
    (1, 1, 5, None, 4, 512), (3, 2, 7, None, 6, 512), (5, 4, 12, 3, 8, 512), (9, 4, 30, 4, 5, 512),
    (6, 8, 16, 5, 7, 512), (17, 3, 9, 2, 3, 512), (4, 3, 6, None, 8, 6),  # the last commits its shared prefix
]


def assert_same_runs(a, b, tol):
    for x, y in zip(a[0], b[0], strict=True):
        assert_same_nbest(x, y, tol)
    for px, py in zip(a[1], b[1], strict=True):
        assert_same_nbest([[h] for h in px], [[h] for h in py], tol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_graphed_equals_eager_and_reference_cpu(case, seed):
    n, beam, V, topk, T, limit = case
    config = CtcDecoderConfig(beam_size=beam, token_topk=topk, nbest=min(beam, 3), max_prefix_len=limit)
    plan = random_plan(n, 4, T, random.Random(seed * 7 + n))
    dec = graphed(config)
    got = run_streams(dec, V, plan, seed)
    eager = run_streams(fast_mod.StreamingCtcDecoder(config, host_loop_max_work=0), V, plan, seed)
    ref = run_streams(ref_mod.StreamingCtcDecoder(config), V, plan, seed)
    assert_same_runs(got, eager, 0.0)  # the same ops in the same order: bit-identical
    assert_same_runs(got, ref, 1e-9)
    assert dec.graphs.replays >= len(plan)
    # shorter chunks and smaller cohorts replay graphs already captured: widths are buckets, T pads up
    assert all(k[0] == width_bucket(k[0]) for k in dec.graphs.keys)


def test_a_short_chunk_replays_the_longer_graph():
    config = CtcDecoderConfig(beam_size=3)
    dec = graphed(config)
    states = [dec.create_state(1, 6) for _ in range(3)]
    dec.decode_chunks(states, [random_log_probs(1, 8, 6, i) for i in range(3)])
    dec.decode_chunks(states, [random_log_probs(1, n, 6, 10 + n) for n in (3, 1, 2)])  # streams ending
    assert [k[:2] for k in dec.graphs.keys] == [(4, 8)]  # 3 rows: bucket 4; T = 3 pads to the 8 captured
    dec.decode_chunks(states[:2], [random_log_probs(1, 3, 6, 20 + i) for i in range(2)])
    assert sorted(k[:2] for k in dec.graphs.keys) == [(2, 3), (4, 8)]
    assert dec.execution == "graphed"


def test_failed_calls_change_nothing():
    config = CtcDecoderConfig(beam_size=3, nbest=3)
    dec = graphed(config)
    good, other = dec.create_state(1, 4), dec.create_state(1, 4)
    lp = random_log_probs(1, 5, 4, seed=0)
    dec.decode_chunk(good, lp)

    def snap():
        return [(dec.finalize_stream(s), dec.peek(s), s.frames_decoded, s.longest) for s in (good, other)]

    before = snap()
    nan_chunk = lp.clone()
    nan_chunk[0, 2, 1] = float("nan")
    for chunks in ([lp, nan_chunk], [lp, lp.clone().fill_(float("inf"))]):
        with pytest.raises(ValueError):
            dec.decode_chunks([good, other], chunks)
        assert snap() == before
    dec.decode_chunks([good, other], [lp, lp[:, :2]])  # the NaN left in the static input is overwritten
    eager = fast_mod.StreamingCtcDecoder(config, host_loop_max_work=0)
    g2, o2 = eager.create_state(1, 4), eager.create_state(1, 4)
    eager.decode_chunk(g2, lp)
    eager.decode_chunks([g2, o2], [lp, lp[:, :2]])
    assert_same_nbest(dec.finalize_stream(good) + dec.finalize_stream(other),
                      eager.finalize_stream(g2) + eager.finalize_stream(o2), 0.0)


def test_host_work_per_call_does_not_grow_with_the_frames():
    """Outside the replay, a call runs the same torch ops for 2 frames as for 24 (the copies in and out,
    the read): the frames loop is all inside the graph."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.paused = 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not self.paused
            return func(*args, **(kwargs or {}))

    counter = Count()

    class Paused(StandInCapture):
        def replay(self, handle):
            counter.paused = True
            try:
                super().replay(handle)
            finally:
                counter.paused = False

    config = CtcDecoderConfig(beam_size=4, token_topk=3)
    ops = {}
    for T in (2, 24):
        dec = fast_mod.StreamingCtcDecoder(config, cuda_graphs=True, graph_capture=Paused)
        states = [dec.create_state(1, 9) for _ in range(5)]
        chunks = [random_log_probs(1, T, 9, i) for i in range(5)]
        dec.decode_chunks(states, chunks)  # captures
        counter.ops = 0
        with counter:
            dec.decode_chunks(states, chunks)
        ops[T] = counter.ops
    assert ops[2] == ops[24] < 100, ops  # the eager search runs ~80 ops per frame


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA device"):
        fast_mod.StreamingCtcDecoder(CtcDecoderConfig(), cuda_graphs=True)


@pytest.mark.parametrize("mixed", [False, True])
def test_the_chunk_loop_is_capture_safe(mixed):
    """The whole chunk's search (``search_chunk``, what a graph holds) on static inputs: no host sync,
    no data-dependent shape, no pageable upload."""
    config = CtcDecoderConfig(beam_size=4, token_topk=3)
    dec = fast_mod.StreamingCtcDecoder(config, host_loop_max_work=0)
    R, T, V = 5, 6, 11
    beams = fast_mod._allocate(R, config, "cpu")
    fast_mod._fill_initial(beams)
    lp = random_log_probs(R, T, V, 3)
    ints = torch.tensor([[0, 4, 8, 0, 2], [6, 6, 3, 0, 6]])
    checker = CaptureSafetyChecker()
    checker.declare_device(list(beams), lp, ints, dec)
    dec._candidates(lp)  # fills the decoder's cached token ids (as the preflight does)
    with checker.region("chunk search") as record:
        fast_mod.search_chunk(beams, lp, ints[0], ints[1] if mixed else None, config, dec._candidates)
    assert record.violations == [] and record.num_ops > 50 * T, record.summary()


def test_the_checker_sees_the_old_host_read_per_call():
    """The checker can fail here: the eager decode's host read inside the region is a violation."""
    config = CtcDecoderConfig(beam_size=4)
    dec = fast_mod.StreamingCtcDecoder(config, host_loop_max_work=0)
    state = dec.create_state(2, 7)
    lp = random_log_probs(2, 4, 7, 1)
    checker = CaptureSafetyChecker()
    checker.declare_device(state, lp, dec)
    with checker.region("eager decode") as record:
        dec.decode_chunk(state, lp)
    assert record.violations


# ---- CUDA: real graphs ----------------------------------------------------------------------------
@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("case", CASES + [(64, 4, 128, 4, 16, 512), (96, 4, 257, None, 12, 512)])
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_graphed_equals_eager_and_reference(case, seed):
    n, beam, V, topk, T, limit = case
    config = CtcDecoderConfig(beam_size=beam, token_topk=topk, nbest=min(beam, 3), max_prefix_len=limit)
    plan = random_plan(n, 4, T, random.Random(seed * 7 + n))
    dec = graphed(config, "cuda")
    got = run_streams(dec, V, plan, seed, "cuda")
    eager = run_streams(fast_mod.StreamingCtcDecoder(config, device="cuda"), V, plan, seed, "cuda")
    ref = run_streams(ref_mod.StreamingCtcDecoder(config), V, plan, seed)
    assert_same_runs(got, eager, 0.0)
    assert_same_runs(got, ref, 1e-9)
    assert dec.graphs.replays >= len(plan) and dec.graphs.keys


@pytest.mark.cuda
@CUDA
def test_cuda_graphed_search_syncs_once_per_call():
    config = CtcDecoderConfig(beam_size=4)
    dec = graphed(config, "cuda")
    states = [dec.create_state(1, 33) for _ in range(12)]
    chunks = [random_log_probs(1, 16, 33, i).cuda() for i in range(12)]
    dec.decode_chunks(states, chunks)  # captures
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dec.decode_chunks(states, chunks)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 1 <= len(syncs) <= 2, [str(w.message) for w in syncs]  # the header read (and its copy)


# ---- the engine ------------------------------------------------------------------------------------
def test_engine_with_graphs_decodes_through_the_graphed_search():
    """A graphed engine (stand-in capture on the CPU) runs the CTC search through the chunk graphs and
    gives the eager engine's transcripts."""
    from oasr.engine import StreamingEngine
    from tests.test_graph_runner import drive_streams, make_model

    model = make_model()
    cfg = model.config.cache_config(max_batch_size=8, block_size_frames=3)
    graphed_engine = StreamingEngine(model, cfg, twin="fast", cuda_graphs=True, graph_capture=StandInCapture())
    eager = StreamingEngine(model, cfg, twin="fast", cuda_graphs=False)
    search = graphed_engine.ctc.decoder
    assert search.execution == "graphed" and "CTC search: graphed" in graphed_engine.execution_note
    assert eager.ctc.decoder.graphs is None and "CTC search: fast twin on the host" in eager.execution_note
    prepared = search.graphs.keys  # captured at construction: every cohort width for a full chunk
    assert [k[:2] for k in prepared] == [(w, 4) for w in sorted([1, 2, 4, 8], key=str)]
    got, want = drive_streams(graphed_engine), drive_streams(eager)
    assert search.graphs.replays > 0 and search.graphs.keys == prepared  # nothing captured while serving
    for sid in want:
        assert got[sid].tokens == want[sid].tokens, sid


@pytest.mark.cuda
@CUDA
def test_cuda_engine_graphed_search_matches_the_reference_on_its_log_probs():
    """On CUDA the engine's streamed, graphed search gives what the reference search gives on the
    whole utterance's log-probs (``decode_utterance``, the engine's oracle)."""
    from oasr.engine import StreamingEngine
    from oasr.engine.decoding import decode_utterance
    from tests.test_graph_runner import drive_streams, make_model

    model = make_model().to("cuda")
    cfg = model.config.cache_config(max_batch_size=8, block_size_frames=3, device="cuda")
    engine = StreamingEngine(model, cfg, twin="fast", keep_log_probs=True)
    assert engine.ctc.decoder.execution == "graphed"  # even where the model step's preflight ran eager
    got = drive_streams(engine)
    assert engine.ctc.decoder.graphs.replays > 0
    for sid, result in got.items():
        want = decode_utterance(result.log_probs.float().cpu(), "beam", engine.ctc_config)
        assert result.tokens == want, sid
