"""The committed prefix: any length of audio through fixed-size beam buffers (``oasr.ctc.config``).

Before this, ~45 s of speech made both twins raise at ``max_prefix_len=512`` inside a live
stream. Rows now move the prefix all their beams share out of the beam; long chunks run in pieces.
"""

from __future__ import annotations

import math
import random
import sys
import tracemalloc

import pytest
import torch

from oasr.ctc import config as ctc_config
from oasr.ctc.config import BeamSnapshot, CtcDecoderConfig, settle_snapshot
from oasr.fast import ctc_decoder as fast_mod
from oasr.reference import ctc_decoder as ref_mod
from oasr.reference.ctc_state import CtcStateCacheManager
from tests.test_ctc_decoder import (
    FAST_PATHS,
    TWINS,
    assert_same_nbest,
    decode,
    peaked_log_probs,
    random_chunks,
    random_log_probs,
)


@pytest.fixture(params=list(TWINS))
def Decoder(request):
    return TWINS[request.param]


def alternating(T: int, V: int = 3) -> torch.Tensor:
    """Certain posteriors that emit one new token every frame (1, 2, 1, 2, ...)."""
    lp = torch.full((1, T, V), -30.0)
    lp[0, torch.arange(T), torch.tensor([1, 2] * (T // 2) + [1] * (T % 2))] = 0.0
    return lp.log_softmax(-1)


def test_a_stream_outgrows_max_prefix_len(Decoder):
    # the old behaviour: RuntimeError at max_prefix_len=4 after 4 frames (item 2's crash)
    T = 50
    dec = Decoder(CtcDecoderConfig(beam_size=2, max_prefix_len=4))
    state = dec.create_state(1, 3)
    for start in range(0, T, 3):
        dec.decode_chunk(state, alternating(T)[:, start : start + 3])
        assert state.longest <= 4
    assert dec.peek(state)[0].tokens == [1, 2] * (T // 2)
    assert dec.peek(state)[0].frames == list(range(T))
    dec.step(state, alternating(2)[:, 0])  # one frame at a time too
    assert len(dec.finalize_stream(state)[0][0].tokens) == T + 1


@pytest.mark.parametrize("beam", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_bounded_search_equals_unbounded(Decoder, seed, beam, monkeypatch):
    # committing is exact: when no row had to be forced, any chunking at a small max_prefix_len gives
    # the n-best of one unbounded call; when one was, the best hypothesis is still the unbounded best
    forced = []
    agreement = ctc_config._agreement
    monkeypatch.setattr(ctc_config, "_agreement", lambda *a: forced.append(1) or agreement(*a))
    rng = random.Random(seed)
    T, V = rng.randint(60, 160), rng.randint(3, 9)
    lp = peaked_log_probs(T, V, seed, margin=8.0)
    whole = decode(Decoder, CtcDecoderConfig(beam_size=beam, nbest=beam, max_prefix_len=T), lp)
    small = CtcDecoderConfig(beam_size=beam, nbest=beam, max_prefix_len=12)
    assert max(len(h.tokens) for h in whole[0]) > 12  # the limit is really passed
    for chunks in (None, random_chunks(T, rng)):
        forced.clear()
        bounded = decode(Decoder, small, lp, chunks=chunks)
        if beam == 1:
            assert not forced  # one prefix a row: everything but its last token is committed
        if not forced:
            assert_same_nbest(whole, bounded)
        else:
            assert bounded[0][0].tokens == whole[0][0].tokens


@pytest.mark.parametrize("fast_path", FAST_PATHS)
@pytest.mark.parametrize("seed", range(5))
def test_twins_agree_when_rows_commit_and_are_forced(fast_path, seed):
    # flat random posteriors keep beams apart: rows commit, and some are forced to drop prefixes
    rng = random.Random(seed)
    B, T, V = rng.randint(1, 3), rng.randint(40, 90), rng.randint(3, 7)
    lp = random_log_probs(B, T, V, seed, scale=rng.choice([0.5, 2.0]))
    config = CtcDecoderConfig(beam_size=4, nbest=4, token_topk=rng.choice([None, 2]), max_prefix_len=6)
    chunks = random_chunks(T, rng)
    ref = decode(TWINS["reference"], config, lp, chunks=chunks)
    assert_same_nbest(ref, decode(TWINS[fast_path], config, lp, chunks=chunks))


def test_forced_room_keeps_the_best(Decoder):
    # frame 0: tokens 1 and 2 equally likely; then a certain 3, 4, 3, 4, ...: two beams that never
    # share a token. Without room, the one that parts from the best (rank 0) earliest goes.
    T = 30
    lp = torch.full((1, T, 5), -40.0)
    lp[0, 0, 1] = lp[0, 0, 2] = math.log(0.5)
    lp[0, torch.arange(1, T), torch.tensor([3, 4] * ((T - 1) // 2) + [3] * ((T - 1) % 2))] = 0.0
    config = CtcDecoderConfig(beam_size=2, nbest=2, max_prefix_len=8)
    dec = Decoder(config)
    state = dec.create_state(1, 5)
    unbounded = decode(Decoder, CtcDecoderConfig(beam_size=2, nbest=2, max_prefix_len=T), lp)[0]
    assert len(unbounded) == 2 and unbounded[0].tokens[0] != unbounded[1].tokens[0]
    dec.decode_chunk(state, lp)
    nbest = dec.finalize_stream(state)[0]
    assert nbest[0].tokens == unbounded[0].tokens and {h.tokens[0] for h in nbest} == {1}
    assert nbest[0].log_score == pytest.approx(unbounded[0].log_score, abs=1e-9)


def test_max_prefix_len_one_still_refuses(Decoder):
    dec = Decoder(CtcDecoderConfig(beam_size=2, max_prefix_len=1))
    state = dec.create_state(1, 3)
    dec.decode_chunk(state, alternating(1))
    before = dec.snapshot_state(state)
    with pytest.raises(RuntimeError, match="max_prefix_len=1"):
        dec.decode_chunk(state, alternating(3)[:, 1:])
    assert dec.snapshot_state(state) == before


def test_bad_values_in_a_split_chunk_change_nothing(Decoder):
    dec = Decoder(CtcDecoderConfig(beam_size=2, max_prefix_len=4))
    state = dec.create_state(1, 3)
    dec.decode_chunk(state, alternating(6))
    before = dec.snapshot_state(state)
    assert before.committed  # something was committed, and is part of the snapshot
    bad = alternating(20)
    bad[0, 15, 1] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        dec.decode_chunk(state, bad)
    assert dec.snapshot_state(state) == before


@pytest.mark.parametrize("src, dst", [("reference", "fast_batched"), ("fast", "reference"), ("fast_batched", "fast")])
def test_committed_snapshots_move_between_twins(src, dst):
    config = CtcDecoderConfig(beam_size=3, nbest=3, max_prefix_len=10)
    lp = peaked_log_probs(120, 6, seed=3, margin=4.0)
    a, b = TWINS[src](config), TWINS[dst](config)
    sa = a.create_state(1, 6)
    a.decode_chunk(sa, lp[:, :70])
    snap = a.snapshot_state(sa)
    assert snap.committed and len(snap.committed[0][0]) > 10
    sb = b.create_state(1, 6)
    b.restore_state(sb, snap)
    assert b.snapshot_state(sb) == snap
    a.decode_chunk(sa, lp[:, 70:])
    b.decode_chunk(sb, lp[:, 70:])
    assert_same_nbest(a.finalize_stream(sa), b.finalize_stream(sb))
    b.reset_state(sb, 1, 6)
    assert b.snapshot_state(sb).committed == () and b.peek(sb)[0].tokens == []


def test_snapshots_with_bad_committed_parts_are_refused():
    config = CtcDecoderConfig(beam_size=2, max_prefix_len=4)
    dec = ref_mod.StreamingCtcDecoder(config)
    state = dec.create_state(1, 3)
    dec.decode_chunk(state, alternating(9))
    good = dec.snapshot_state(state)
    (ct, cf), = good.committed
    bad = [
        good._replace(committed=((ct, cf[:-1]),)),  # counts differ
        good._replace(committed=((ct[:-1] + (0,), cf),)),  # the blank
        good._replace(committed=((ct, cf[:-1] + (good.rows[0][0].frames[0],)),)),  # a frame after the beam's
        good._replace(committed=((ct, cf), (ct, cf))),  # two rows for batch 1
    ]
    for snap in bad:
        with pytest.raises(ValueError):
            dec.restore_state(state, snap)
        assert dec.snapshot_state(state) == good


def test_settle_snapshot_is_exact_and_keeps_a_token():
    config = CtcDecoderConfig(beam_size=3, max_prefix_len=4)  # commit_at 2
    e = ref_mod.BeamEntry
    row = (e((5, 6, 7), (0, 1, 2), -1.0, -2.0), e((5, 6), (0, 1), -1.5, -3.0))
    out = settle_snapshot(config, BeamSnapshot(1, 9, 3, (row,)))
    # (5, 6) is shared, but the second prefix is exactly that: only 5 is committed
    assert out.committed == (((5,), (0,)),)
    assert [x.tokens for x in out.rows[0]] == [(6, 7), (6,)]
    same_token_other_frame = (e((5, 6, 7), (0, 1, 2), -1.0, -2.0), e((5, 6, 8), (0, 2, 3), -1.5, -3.0))
    out = settle_snapshot(config, BeamSnapshot(1, 9, 4, (same_token_other_frame,)))
    assert out.committed == (((5,), (0,)),)  # 6 was emitted at different frames: not shared
    assert settle_snapshot(config, BeamSnapshot(1, 9, 3, ((e((5, 6), (0, 1), 0.0, -1.0),),))) is None


def _transcript_bytes(state) -> int:
    """What the committed part itself takes: its tuples and the int objects Python does not cache."""
    total = 0
    for tokens, frames in state.committed:
        total += sys.getsizeof(tokens) + sys.getsizeof(frames)
        total += sum(sys.getsizeof(x) for x in (*tokens, *frames) if x > 256)
    return total


@pytest.mark.slow
def test_two_hour_stream_in_bounded_memory():
    # 2 h at 25 encoder frames a second = 180,000 frames of synthetic posteriors through one pooled
    # state of the fast twin, 64 frames a call: the beam buffers never grow or move, the longest kept
    # prefix stays within max_prefix_len, and over a traced stretch mid-stream Python memory grows
    # by the committed transcript only. (It used to raise after 64 tokens.)
    frames, chunk, block, V = 2 * 3600 * 25, 64, 6000, 6
    config = CtcDecoderConfig(beam_size=2, token_topk=2, max_prefix_len=64)
    manager = CtcStateCacheManager(fast_mod.StreamingCtcDecoder(config))
    handle = manager.allocate_stream("long", 1, V)
    state = handle.state
    buffers = [(t.data_ptr(), tuple(t.shape)) for t in state.buffers]
    traced = None
    for start in range(0, frames, block):
        lp = peaked_log_probs(block, V, seed=start, margin=6.0)
        if start == frames // 2:  # trace one block in the middle of the stream
            tracemalloc.start()
            traced = tracemalloc.get_traced_memory()[0], _transcript_bytes(state)
        for s in range(0, block, chunk):
            handle.decode_chunk(lp[:, s : s + chunk])
        if traced is not None and tracemalloc.is_tracing():
            grew = tracemalloc.get_traced_memory()[0] - traced[0]
            tracemalloc.stop()
            # a list that grew was reallocated while traced: its whole buffer counts, so the bound
            # is the whole transcript's size (still a fraction of a MB), not only what it gained
            assert _transcript_bytes(state) > traced[1] and grew < _transcript_bytes(state) + 200_000, grew
        assert state.longest <= config.max_prefix_len
    assert [(t.data_ptr(), tuple(t.shape)) for t in state.buffers] == buffers
    hyp = handle.peek()[0]
    assert state.frames_decoded == frames and len(hyp.tokens) > frames // 4
    assert hyp.frames == sorted(set(hyp.frames)) and hyp.frames[-1] < frames


def test_sessions_keep_the_committed_part():
    # a stream past max_prefix_len saves, loads (other twin) and goes on to the same transcript
    from oasr.fast.ctc_state import CtcStateCacheManager as FastManager
    from oasr.sessions import format as session

    config = CtcDecoderConfig(beam_size=3, nbest=2, max_prefix_len=8)
    lp = peaked_log_probs(200, 7, seed=11, margin=6.0)
    ref = CtcStateCacheManager(ref_mod.StreamingCtcDecoder(config))
    ref.allocate_stream(1, 1, 7).decode_chunk(lp[:, :120])
    snap = ref.snapshot_stream(1)
    assert snap.committed
    raw = session._encode_beam(config, snap)
    got_config, got = session._decode_beam(raw)
    assert got_config == config and got == snap
    fast = FastManager(fast_mod.StreamingCtcDecoder(config))
    fast.restore_stream(1, got).decode_chunk(lp[:, 120:])
    ref.get_decoder(1).decode_chunk(lp[:, 120:])
    assert_same_nbest(ref.get_decoder(1).finalize_stream(), fast.get_decoder(1).finalize_stream())
    # without committed tokens the section is what it always was
    plain = ref_mod.StreamingCtcDecoder(config)
    state = plain.create_state(1, 7)
    plain.decode_chunk(state, lp[:, :3])
    assert plain.snapshot_state(state).committed == ()
    assert session._decode_beam(session._encode_beam(config, plain.snapshot_state(state)))[1].committed == ()
    for cut in (4, 12):  # a committed part cut short is refused
        with pytest.raises(session.SessionError):
            session._decode_beam(raw[:-cut])
