"""Decoder rows in sessions: paged rows with shared pages, and streams suspended mid-rescoring.

* Paged rows of a ``DecoderKVCacheManager`` (both twins, fp32 and fp8 pages) with copy-on-write
  forks and prefix-cache hits: saved once per page, loaded with the saved reference counts (the
  pages shared again, not duplicated), the prefix entries published again, bit-identical K/V, and
  the rows go on (a step after the load copies exactly the pages a step before the save would
  have); across the twins the re-saved bytes are the same. A property test drives random op
  sequences through one twin and loads the rows into the other.
* ``StreamingEngine.suspend`` of a stream being rescored: resumed in a fresh process (and across
  the twins) its rescoring job runs to the uninterrupted result, before and after the job's first
  step (the encoder output, then the decoder rows, travel).
* The fuzz: every truncation, bit flips, and wrong fields under a valid checksum of decoder-row
  sessions are refused and change nothing (engine, job queue, manager, pool).
"""

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from session_helpers import (
    engine_snapshot,
    features,
    make_engine,
    make_model,
    recording_results,
    rescored,
    rescoring_engine,
    same_snapshot,
    until_rescoring,
    with_checksum,
)

from oasr.decoder.common import AdmissionError
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.fast.decoder_cache import DecoderKVCacheManager as FastManager
from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig
from oasr.reference.decoder_cache import DecoderKVCacheManager as RefManager
from oasr.sessions import decoder_rows as DS
from oasr.sessions import format as S
from oasr.sessions import stream as SS

ROOT = Path(__file__).resolve().parent.parent
MANAGERS = {"reference": RefManager, "fast": FastManager}
TWINS = ("reference", "fast")


def twin_score_tolerance(want: dict, sid) -> float:
    """Across the twins a resumed job runs its remaining steps on the other twin's dense attention (a
    grouped matmul against a repeated-head one), so its combined scores differ by float32 rounding. The
    bound is calibrated on the twins' own difference: twice that of the uninterrupted runs, plus two
    float32 ulps of the largest score (measured on this workload: scores near -200, the uninterrupted
    twins 1.6e-5 apart, resumed ones at most 3.1e-5)."""
    ref, fast = ([float.fromhex(c) for c in want[t][sid]["combined"]] for t in TWINS)
    own = max(abs(a - b) for a, b in zip(ref, fast, strict=True))
    return 2 * own + 2 * torch.finfo(torch.float32).eps * max(abs(x) for x in ref)


# ---- paged rows -------------------------------------------------------------------------------------------


def decoder_config(fmt=None, **kw) -> DecoderCacheConfig:
    values = dict(num_layers=2, n_kv_head=2, head_dim=16, page_size=4, max_num_blocks=64, max_rows=8,
                  max_self_tokens=32, max_cross_tokens=8, kv_storage="paged", kv_cache_dtype=fmt)
    return DecoderCacheConfig(**{**values, **kw})


def kv(T: int, seed: int, L: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, T, 2, 16, generator=g), torch.randn(L, T, 2, 16, generator=g)


def beams_and_prefixes(manager) -> list[int]:
    """Three forked beams (a page shared three ways, a partly written one) and a row that binds a retired
    row's published prefix: the rows to save."""
    (row,) = manager.admit([DecoderRequest(5, 10, 6)])
    manager.fill_cross(row, *kv(6, 1))
    manager.prefill(row, *kv(9, 2))
    beams = manager.select([row], [0, 0, 0])
    manager.append(beams, *kv(3, 3))
    manager.retire(beams[2], list(range(10)))
    (hit,) = manager.admit([DecoderRequest(9, 3, 6)])
    assert manager.admit_prompt(hit, list(range(9))) == 8
    manager.extend(hit, *kv(1, 4))
    return [beams[0], beams[1], hit]


def manager_snapshot(m) -> dict:
    pool = m.pool
    return {"rows": {r: m.describe(r) for r in m.rows}, "free": pool.num_free_blocks, "refs": pool.ref_counts(),
            "pinned": sorted(m.pinned_blocks()), "reserved": m.reserved_blocks,
            "bytes": [t.view(torch.uint8).clone() for t in (pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale)
                      if t is not None]}


def same_manager(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True)) if k == "bytes" else a[k] == b[k] for k in a)


def holders(m, rows) -> dict:
    """Per (row position, region, column): how many of ``rows``' columns name the same block."""
    infos = [m.describe(r) for r in rows]
    count = {}
    for info in infos:
        for b in info.self_blocks[: m.config.pages_for(info.length)] + info.cross_blocks:
            count[b] = count.get(b, 0) + 1
    return {(i, region, j): count[b] for i, info in enumerate(infos)
            for region, blocks in (("self", info.self_blocks[: m.config.pages_for(info.length)]),
                                   ("cross", info.cross_blocks)) for j, b in enumerate(blocks)}


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"], ids=["fp32", "fp8"])
@pytest.mark.parametrize("src,dst", [(a, b) for a in TWINS for b in TWINS])
def test_paged_rows_are_saved_once_per_page_and_shared_again(src, dst, fmt):
    saved = MANAGERS[src](decoder_config(fmt))
    rows = beams_and_prefixes(saved)
    state = DS.capture_paged(saved, rows)
    raw = DS.encode_decoder_rows(state)
    blocks = {b for r in rows for b in saved.describe(r).self_blocks[:3] + saved.describe(r).cross_blocks}
    assert len(state.pages) == len(blocks)  # each page once, however many rows name it
    assert max(state.references()) == 3  # the first prompt page: two beams and the prefix hit
    assert sum(p.prefix is not None for p in state.pages) == 2  # the retired beam's two full pages

    loaded = MANAGERS[dst](decoder_config(fmt))
    (decoy,) = loaded.admit([DecoderRequest(3, 1, 2)])  # other rows, other blocks
    free = loaded.pool.num_free_blocks
    new = DS.restore_paged(DS.decode_decoder_rows(raw), loaded)
    assert set(new).isdisjoint({decoy})
    assert loaded.pool.num_free_blocks == free - len(state.pages)  # shared, not duplicated
    assert holders(loaded, new) == holders(saved, rows)
    for a, b in zip(rows, new, strict=True):
        assert torch.equal(saved.gather_self(a), loaded.gather_self(b))
        assert torch.equal(saved.gather_cross(a), loaded.gather_cross(b))
        assert loaded.request(b) == saved.request(a)
    names = [x for r in new for x in loaded.describe(r).self_blocks + loaded.describe(r).cross_blocks]
    assert all(loaded.pool.ref_count(x) == names.count(x) for x in names)  # the pool counts every name
    assert len(loaded.pinned_blocks()) == 2  # published again
    # a row with the same prompt hits the restored prefix
    (hit,) = loaded.admit([DecoderRequest(9, 1, 0)])
    assert loaded.admit_prompt(hit, list(range(9))) == 8
    loaded.finish(hit)
    # both go on alike: one more step, copy-on-write into the shared pages included
    saved.append(rows, *kv(3, 9))
    loaded.append(new, *kv(3, 9))
    for a, b in zip(rows, new, strict=True):
        assert torch.equal(saved.gather_self(a), loaded.gather_self(b))
    assert DS.encode_decoder_rows(DS.capture_paged(loaded, new)) == DS.encode_decoder_rows(
        DS.capture_paged(saved, rows))
    for r in new + [decoy]:  # no leaked block: every reference goes back
        loaded.finish(r)
    loaded.reset()
    assert loaded.pool.num_free_blocks == loaded.config.max_num_blocks


def test_foreign_decoder_rows_are_refused_and_change_nothing():
    state = DS.capture_paged(m := RefManager(decoder_config("fp8_e4m3")), beams_and_prefixes(m))
    for other, words in ((decoder_config(None), "kv_cache_dtype"), (decoder_config("fp8_e4m3", page_size=8),
                                                                   "page_size"),
                         (decoder_config("fp8_e4m3", num_layers=3), "num_layers")):
        target = FastManager(other)
        before = manager_snapshot(target)
        with pytest.raises(S.SessionError, match=words):
            DS.restore_paged(state, target)
        assert same_manager(before, manager_snapshot(target))
    tight = FastManager(decoder_config("fp8_e4m3", max_num_blocks=10))  # rows fit, pages plus reservations do not
    before = manager_snapshot(tight)
    with pytest.raises(AdmissionError, match="restored rows need"):
        DS.restore_paged(state, tight)
    assert same_manager(before, manager_snapshot(tight))


def test_an_unknown_page_format_code_is_refused():
    state = DS.capture_paged(m := RefManager(decoder_config()), beams_and_prefixes(m))
    raw = bytearray(DS.encode_decoder_rows(state))
    raw[17] = 99  # the K/V format code
    with pytest.raises(S.SessionError, match="unknown K/V format code 99"):
        DS.decode_decoder_rows(bytes(raw))


# ---- paged rows in a stream's session (cache-level save_stream / load_stream) -----------------------------


def test_a_stream_session_carries_its_decoder_rows():
    model = make_model("fp32", num_left_chunks=1)
    src = make_engine(model, "fast")
    src.add_stream("a")
    src.push("a", features()[:40])
    src.step()
    decoder = RefManager(decoder_config())
    rows = beams_and_prefixes(decoder)
    data = SS.save_stream("a", src.att, [src.cnn, src.states], src.ctc, decoder_rows=DS.capture_paged(decoder, rows))
    assert S.read_session(data).flags & S.FLAG_DECODER_ROWS

    dst = make_engine(model, "reference")
    target = FastManager(decoder_config())
    before, before_m = engine_snapshot(dst), manager_snapshot(target)
    with pytest.raises(S.SessionError, match="decoder rows"):  # rows, but no decoder cache to take them
        SS.load_stream(data, "a", dst.att, [dst.cnn, dst.states], dst.ctc)
    with pytest.raises(S.SessionError, match="decoder rows"):  # the engine keeps none outside rescoring
        dst.resume(S.encode_session(_with_engine(S.read_session(data), src)))
    with pytest.raises(S.SessionError, match="kv_cache_dtype"):
        SS.load_stream(data, "a", dst.att, [dst.cnn, dst.states], dst.ctc,
                      decoder=FastManager(decoder_config("fp8_e4m3")))
    assert same_snapshot(before, engine_snapshot(dst)) and same_manager(before_m, manager_snapshot(target))
    session = SS.load_stream(data, "a", dst.att, [dst.cnn, dst.states], dst.ctc, decoder=target)
    assert dst.att.has_stream("a") and len(session.decoder_row_ids) == 3
    for a, b in zip(rows, session.decoder_row_ids, strict=True):
        assert torch.equal(decoder.gather_self(a), target.gather_self(b))


def _with_engine(session, engine):
    """``session`` as if an engine had saved it (the engine stream section of a fresh suspension)."""
    other = make_engine(engine.model, "fast")
    other.add_stream("x")
    other.push("x", features()[:40])
    other.step()
    session.engine = S.read_session(other.suspend("x")).engine
    return session


def test_cache_level_decoder_row_sessions_refuse_truncations_and_bit_flips():
    model = make_model("fp32", num_left_chunks=1)
    src = make_engine(model, "fast")
    src.add_stream("a")
    src.push("a", features()[:40])
    src.step()
    decoder = RefManager(decoder_config("fp8_e4m3"))
    rows = DS.capture_paged(decoder, beams_and_prefixes(decoder))
    data = SS.save_stream("a", src.att, [src.cnn, src.states], src.ctc, decoder_rows=rows)
    dst = make_engine(model, "reference")
    target = FastManager(decoder_config("fp8_e4m3"))
    target.admit([DecoderRequest(2, 2, 3)])
    before, before_m = engine_snapshot(dst), manager_snapshot(target)
    caches = (dst.att, [dst.cnn, dst.states], dst.ctc)
    for n in range(len(data)):
        with pytest.raises(S.SessionError):
            SS.load_stream(data[:n], "a", *caches, decoder=target)
    at = section_at(data, S.SEC_DECODER_ROWS)
    rng = random.Random(3)
    for _ in range(200):
        raw = bytearray(data)
        raw[rng.randrange(at, len(data))] ^= 1 << rng.randrange(8)
        with pytest.raises(S.SessionError, match="corrupt session"):
            SS.load_stream(bytes(raw), "a", *caches, decoder=target)
    assert same_snapshot(before, engine_snapshot(dst)) and same_manager(before_m, manager_snapshot(target))
    SS.load_stream(data, "a", *caches, decoder=target)  # the untouched bytes load


# ---- a property test: random op sequences, loaded into the other twin ------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["append", "fork", "drop", "retire_hit", "rewind"]),
                         st.integers(0, 7)), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, src=st.sampled_from(TWINS), seed=st.integers(0, 2**16))
def test_any_op_sequence_loads_into_the_other_twin(ops, src, seed):
    m = MANAGERS[src](decoder_config())
    (row,) = m.admit([DecoderRequest(3, 12, 5)])
    m.fill_cross(row, *kv(5, seed))
    m.prefill(row, *kv(3, seed + 1))
    rows = [row]
    for i, (op, n) in enumerate(ops):
        try:
            if op == "append":
                m.append(rows, *kv(len(rows), seed + i))
            elif op == "fork":
                rows = m.select(rows, [j % len(rows) for j in range(min(len(rows) + 1, 4))] + [n % len(rows)])
            elif op == "drop" and len(rows) > 1:
                rows = m.select(rows, list(range(len(rows) - 1)))
            elif op == "retire_hit":
                r = rows[n % len(rows)]
                tokens = list(range(m.length(r)))
                if len(rows) > 1:
                    m.retire(r, tokens)
                    rows.remove(r)
                (hit,) = m.admit([DecoderRequest(len(tokens) + 1, 4, 5)])
                m.fill_cross(hit, *kv(5, seed))
                m.admit_prompt(hit, tokens + [1])
                m.extend(hit, *kv(len(tokens) + 1 - m.length(hit), seed + 7))
                rows.append(hit)
            elif op == "rewind":
                m.rewind(rows[n % len(rows)], min(n, m.length(rows[n % len(rows)])))
        except (ValueError, AdmissionError):
            pass  # a refused op changes nothing; the sequence goes on
    state = DS.decode_decoder_rows(DS.encode_decoder_rows(DS.capture_paged(m, rows)))
    other = MANAGERS["fast" if src == "reference" else "reference"](decoder_config())
    new = DS.restore_paged(state, other)
    assert holders(other, new) == holders(m, rows)
    for a, b in zip(rows, new, strict=True):
        assert torch.equal(m.gather_self(a), other.gather_self(b))
        assert torch.equal(m.gather_cross(a), other.gather_cross(b))
    assert DS.encode_decoder_rows(DS.capture_paged(other, new)) == DS.encode_decoder_rows(state)


# ---- a stream suspended mid-rescoring ------------------------------------------------------------------------

CASES = [(extra, src, dst) for extra in (0, 3) for src in TWINS for dst in TWINS]


@pytest.fixture(scope="module")
def rescoring_runs(tmp_path_factory):
    """Uninterrupted runs per twin; sessions of "a" and "b" suspended mid-rescoring; every case resumed in
    one fresh child process. Returns (want, sessions, child records)."""
    patch = pytest.MonkeyPatch()
    seen = recording_results(patch)
    try:
        model = make_model()
        want = {}
        for twin in TWINS:
            engine = rescoring_engine(model, twin)
            until_rescoring(engine, 0)
            engine.run()
            want[twin] = {sid: rescored(engine, seen, sid) for sid in "ab"}
        sessions = {}
        for extra in (0, 3):
            for twin in TWINS:
                engine = rescoring_engine(model, twin)
                until_rescoring(engine, extra)
                steps = {sid: job.steps for sid, job in engine._rescoring}
                assert steps == {"a": 1 + extra, "b": 0}
                sessions[(extra, twin)] = {sid: engine.suspend(sid) for sid in "ab"}
                assert not engine._rescoring and engine.stream_ids == []
    finally:
        patch.undo()
    tmp = tmp_path_factory.mktemp("rescoring")
    jobs = [{"kind": "rescoring", "twin": dst, "session": sessions[(extra, src)][sid].hex()}
            for extra, src, dst in CASES for sid in "ab"]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "tests" / "session_child.py"), str(tmp / "jobs.json"),
                    str(tmp / "out.json")], check=True, cwd=ROOT, env=env, timeout=540)
    records = iter(json.loads((tmp / "out.json").read_text()))
    got = {(case, sid): next(records) for case in CASES for sid in "ab"}
    return want, sessions, got


def test_a_suspended_job_carries_its_progress(rescoring_runs):
    _, sessions, _ = rescoring_runs
    a, b = (S.read_session(sessions[(3, "fast")][sid]) for sid in "ab")
    assert a.rescoring and a.kv is None and a.encoder_out is None and a.decoder_rows.geometry.storage == "dense"
    assert a.engine.rescoring.steps == 4 and {r.length for r in a.decoder_rows.rows} == {4}
    rows = a.decoder_rows
    cross = {p for r in rows.rows for p in r.cross_pages}
    assert len(cross) == -(-a.engine.offset // rows.geometry.page_size)  # every row's cross K/V written once
    assert b.rescoring and b.decoder_rows is None and b.encoder_out.shape[0] == b.engine.offset  # before step 1
    for twin in TWINS:  # both twins save the same sections (their values differ by each twin's rounding)
        assert S.read_session(sessions[(3, twin)]["a"]).flags == a.flags
        assert S.read_session(sessions[(0, twin)]["b"]).flags == b.flags


@pytest.mark.parametrize("extra,src,dst", CASES, ids=[f"step{1 + e}-{s}-to-{d}" for e, s, d in CASES])
def test_a_stream_suspended_mid_rescoring_resumes_in_a_fresh_process(rescoring_runs, extra, src, dst):
    want, _, got = rescoring_runs
    for sid in "ab":
        mine, theirs = got[((extra, src, dst), sid)], want[src][sid]
        if src == dst:
            assert mine == theirs  # first pass, n-best, log-probs, rescored tokens, combined scores: bit for bit
            continue
        assert mine["tokens"] == theirs["tokens"] and mine["first_pass"] == theirs["first_pass"]
        assert mine["nbest"] == theirs["nbest"] and mine["log_probs"] == theirs["log_probs"]  # the first pass
        diff = max(abs(float.fromhex(x) - float.fromhex(y)) for x, y in zip(mine["combined"], theirs["combined"],
                                                                              strict=True))
        assert diff <= twin_score_tolerance(want, sid)


@pytest.mark.parametrize("src,dst", [(a, b) for a in TWINS for b in TWINS])
def test_a_job_resumed_at_any_step_ends_as_the_uninterrupted_one(src, dst):
    """``RescoreJob`` alone: saved after every step through the section's bytes, resumed on either twin."""
    from oasr.ctc.config import CtcHypothesis
    from oasr.engine.rescoring import RescoreJob
    from oasr.models.twins import twin_module

    decoder = AttentionDecoder(DecoderConfig(vocab_size=32, encoder_dim=32, seed=1))
    enc = torch.randn(11, 32, generator=torch.Generator().manual_seed(2))
    nbest = [CtcHypothesis([3, 4, 5, 6], -1.5, [0, 2, 4, 6]), CtcHypothesis([3, 4, 7], -2.0, [0, 2, 5]),
             CtcHypothesis([3], -4.0, [0]), CtcHypothesis([], -9.0, [])]
    def uninterrupted(twin):
        plain = RescoreJob(decoder, enc, nbest, 0.3, twin_module(twin))
        while not plain.advance():
            pass
        return plain

    plain = uninterrupted(src)
    want = plain.result()
    own = max(abs(a - b) for a, b in zip(want[1], uninterrupted(dst).result()[1], strict=True))
    tolerance = 2 * own + 2 * torch.finfo(torch.float32).eps * max(map(abs, want[1]))  # as twin_score_tolerance
    for steps in range(1, plain.total_steps):
        job = RescoreJob(decoder, enc, nbest, 0.3, twin_module(src))
        for _ in range(steps):
            job.advance()
        rows = DS.decode_decoder_rows(DS.encode_decoder_rows(DS.capture_dense(job.kv)))
        assert len({p for r in rows.rows for p in r.cross_pages}) == 3  # 11 frames, pages of 4: once for all rows
        again = RescoreJob.resume(decoder, nbest, 0.3, twin_module(dst), steps, job.scores, rows=rows)
        while not again.advance():
            pass
        got = again.result()
        if src == dst:
            assert got[0] == want[0] and [x.hex() for x in got[1]] == [x.hex() for x in want[1]]
        else:
            assert got[0] == want[0]
            assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) <= tolerance


def test_a_resumed_job_suspends_again():
    model = make_model()
    engine = rescoring_engine(model, "fast")
    until_rescoring(engine, 2)
    data = engine.suspend("a")
    other = rescoring_engine(model, "reference")
    other.resume(data)
    assert other.status("a") == "rescoring"
    again = other.suspend("a")
    assert S.read_session(again).engine.rescoring.steps == 3
    assert _pages(S.read_session(again)) == _pages(S.read_session(data))


def _pages(session):
    return [DS._page_bytes(p) for p in session.decoder_rows.pages]


# ---- the fuzz ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job_session():
    model = make_model()
    engine = rescoring_engine(model, "fast")
    until_rescoring(engine, 1)
    return model, engine.suspend("a"), engine.suspend("b")


def busy_target(model, **kw):
    """A rescoring engine with a job of its own in flight and a stream holding caches."""
    engine = rescoring_engine(model, "fast", **kw)
    until_rescoring(engine, 0)
    engine.add_stream("busy")
    engine.push("busy", features(30, seed=5))
    engine.step()
    return engine


def full_snapshot(engine) -> dict:
    snap = engine_snapshot(engine)
    snap["jobs"] = [(sid, job.steps, job.scores.clone().numpy().tobytes()) for sid, job in engine._rescoring]
    return snap


def refused_here(engine, data, match=None) -> str:
    before = full_snapshot(engine)
    with pytest.raises(S.SessionError, match=match) as info:
        engine.resume(data)
    assert same_snapshot(before, full_snapshot(engine))
    return str(info.value)


def section_at(data: bytes, kind: int) -> int:
    pos, end = S.HEADER_BYTES, len(data) - S.CHECKSUM_BYTES
    while pos < end:
        k, length = S.SECTION.unpack_from(data, pos)
        if k == kind:
            return pos
        pos += S.SECTION.size + length
    raise AssertionError(f"no section {kind}")


def test_every_truncation_of_a_decoder_row_session_is_refused(job_session):
    model, data, _ = job_session
    engine = busy_target(model)
    before = full_snapshot(engine)
    for n in range(len(data)):
        with pytest.raises(S.SessionError):
            engine.resume(data[:n])
    assert same_snapshot(before, full_snapshot(engine))


def test_bit_flips_in_the_decoder_rows_are_refused(job_session):
    model, data, _ = job_session
    engine = busy_target(model)
    before = full_snapshot(engine)
    at = section_at(data, S.SEC_DECODER_ROWS)
    rng = random.Random(7)
    for _ in range(300):
        raw = bytearray(data)
        raw[rng.randrange(at, len(data))] ^= 1 << rng.randrange(8)
        with pytest.raises(S.SessionError, match="corrupt session"):
            engine.resume(bytes(raw))
    assert same_snapshot(before, full_snapshot(engine))


def _mutated(data: bytes, change) -> bytes:
    session = S.read_session(data)
    change(session)
    return S.encode_session(session)


def _page(session, i=0):
    return session.decoder_rows.pages[i]


def _row(session, i, **kw):
    import dataclasses

    rows = session.decoder_rows.rows
    rows[i] = dataclasses.replace(rows[i], **kw)


def _nan_page(s):
    _page(s).k.view(-1)[0] = float("nan")


def _extra_page(s):
    s.decoder_rows.pages.append(_page(s))


def _prog(s, **kw):
    import dataclasses

    s.engine.rescoring = dataclasses.replace(s.engine.rescoring, **kw)


def _fewer_used(s):
    p = next(p for p in s.decoder_rows.pages if p.used > 1)
    p.used, p.k, p.v = p.used - 1, p.k[:, :-1], p.v[:, :-1]


def _storage_paged(s):
    import dataclasses

    s.decoder_rows.geometry = dataclasses.replace(s.decoder_rows.geometry, storage="paged")


def _other_page_size(s):
    import dataclasses

    s.decoder_rows.geometry = dataclasses.replace(s.decoder_rows.geometry, page_size=8)


def _attention_too(s):
    s.kv = S.read_session(_plain_session(s)).kv


def _plain_session(s):
    engine = make_engine(make_model(), "fast", rescore=True)
    engine.add_stream("x")
    engine.push("x", features()[:40])
    engine.step()
    return engine.suspend("x")


MUTATIONS = {  # name: (change to the parsed session, what the refusal says)
    "a row one token longer": (lambda s: _row(s, 0, length=s.decoder_rows.rows[0].length + 1), "decoder rows"),
    "a row on other cross frames": (lambda s: _row(s, 1, cross_length=1), "cross"),
    "a page index out of range": (lambda s: _row(s, 0, self_pages=(99,) + s.decoder_rows.rows[0].self_pages[1:]),
                                  "page 99"),
    "a page named by no row": (_extra_page, "named by no row"),
    "a page holding fewer tokens than read": (_fewer_used, "reads"),
    "a NaN in a page": (_nan_page, "NaN"),
    "paged storage": (_storage_paged, "dense rows"),
    "another page size": (_other_page_size, "cross pages"),
    "one step further": (lambda s: _prog(s, steps=s.engine.rescoring.steps + 1), "rescoring job at step"),
    "step 0 with decoder rows": (lambda s: _prog(s, steps=0), "encoder output before its first step"),
    "a NaN score": (lambda s: _prog(s, scores=torch.full_like(s.engine.rescoring.scores, float("nan"))),
                    "not finite"),
    "another first pass": (lambda s: _prog(s, first_pass=[0]), "first pass"),
    "another rescorer": (lambda s: _prog(s, rescorer_digest=bytes(32)), "rescorer weights"),
    "another model": (lambda s: setattr(s.engine, "model_digest", bytes(32)), "model weights"),
    "a hypothesis fewer": (lambda s: _prog(s, nbest=s.engine.rescoring.nbest[:-1],
                                           scores=s.engine.rescoring.scores[:-1]), "hypotheses"),
    "caches beside the job": (_attention_too, "holds no caches"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_wrong_field_under_a_valid_checksum_is_refused(job_session, name):
    model, data, _ = job_session
    change, words = MUTATIONS[name]
    assert words in refused_here(busy_target(model), _mutated(data, change)), name


def test_byte_level_fields_of_the_section_are_refused(job_session):
    model, data, _ = job_session
    engine = busy_target(model)
    at = section_at(data, S.SEC_DECODER_ROWS) + S.SECTION.size
    for offset, fmt, value, words in ((16, "B", 9, "dtype code"), (17, "B", 77, "K/V format code"),
                                      (18, "B", 3, "storage code"), (19, "B", 1, "reserved"),
                                      (0, "I", 0, "geometry"), (20, "I", 10**9, "cannot fit")):
        raw = bytearray(data)
        struct.pack_into("<" + fmt, raw, at + offset, value)
        assert words in refused_here(engine, with_checksum(raw)), words


def test_the_job_state_and_the_engine_must_match(job_session):
    model, data, encoder_only = job_session
    plain = make_engine(model, "fast")  # rescore=False
    assert "does not rescore" in refused_here(plain, data)
    assert "does not rescore" in refused_here(plain, encoder_only)
    other = busy_target(model, rescorer=AttentionDecoder(DecoderConfig(vocab_size=32, encoder_dim=32, seed=9)))
    assert "rescorer weights" in refused_here(other, data)
    engine = busy_target(model)
    with pytest.raises(ValueError, match="already in use"):  # "a" is rescored here already
        engine.resume(data)
    assert engine.resume(data, "c") == "c" and engine.status("c") == "rescoring"
    engine.run()
    assert engine.result("c").tokens == engine.result("a").tokens  # the same stream, rescored twice alike
