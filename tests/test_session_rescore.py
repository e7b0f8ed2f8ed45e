"""Sessions of a rescoring engine (``StreamingEngine(rescore=True)``): the kept encoder output travels.

The second pass rescores a finished stream's n-best against every encoder frame the stream
produced. A suspended stream's frames so far live in the session's encoder output section
(kind 6, flag bit 3), so a resumed stream is rescored exactly as an uninterrupted one. Here:

* suspended mid-utterance and resumed in a fresh engine (other slot, other blocks), on each
  twin: the same first pass, n-best, rescored tokens and combined scores, and the second pass
  sees the same encoder output, bit for bit, as the uninterrupted run's;
* a session with rescoring state into an engine without rescoring, and the reverse: refused,
  naming the difference, nothing changed;
* the new section truncated, corrupted (every bit flip, and each field set wrong under a valid
  checksum), or its flag bit disagreeing with the body: refused, nothing changed;
* ``python -m oasr demo --rescore --suspend-every 3`` prints the rescored text of a run
  without suspension.
"""

import random
import re
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

from oasr.engine import rescoring
from oasr.sessions import format as S


def rescoring_engine(model, twin: str, rescore: bool = True):
    return make_engine(model, twin, rescore=rescore)


@pytest.fixture
def second_pass(monkeypatch):
    """Record what every second pass was given (the encoder output) and what it scored."""
    calls = []
    init, result = rescoring.RescoreJob.__init__, rescoring.RescoreJob.result

    def recording_init(self, decoder, enc, nbest, ctc_weight, ops):
        self.recorded_enc = enc.clone()
        init(self, decoder, enc, nbest, ctc_weight, ops)

    def recording_result(self):
        best, scores = result(self)
        calls.append((self.recorded_enc, [float(s).hex() for s in scores]))
        return best, scores

    monkeypatch.setattr(rescoring.RescoreJob, "__init__", recording_init)
    monkeypatch.setattr(rescoring.RescoreJob, "result", recording_result)
    return calls


def record(result) -> dict:
    return {
        "tokens": list(result.tokens),
        "first_pass": list(result.first_pass),
        "nbest": [(list(h.tokens), float(h.log_score).hex()) for h in result.nbest],
        "log_probs": result.log_probs.numpy().tobytes(),
        "num_frames": result.num_frames,
    }


@pytest.mark.parametrize("twin", ["reference", "fast"])
def test_a_resumed_stream_is_rescored_exactly_as_an_uninterrupted_one(twin, second_pass):
    model = make_model()
    plain = rescoring_engine(model, twin)
    start(plain)
    want = record(finish(plain))
    (want_enc, want_scores), = second_pass

    engine = rescoring_engine(model, twin)
    start(engine)
    s = engine._streams["a"]
    assert engine.status("a") == "active" and s.num_pending > 0 and 0 < s.offset  # mid-utterance
    data = engine.suspend("a")
    session = S.read_session(data)
    assert session.flags & S.FLAG_ENCODER_OUT and session.encoder_out.shape == (s.offset, model.config.hidden_dim)
    assert torch.equal(session.encoder_out, want_enc[: s.offset])  # the frames so far, exactly as kept

    fresh = rescoring_engine(model, twin)
    hold_decoy(fresh)  # slot 0 and the first blocks taken: the stream comes back under other ids
    assert fresh.resume(data) == "a"
    fresh.push("a", features()[SPLIT:])
    fresh.end_stream("a")
    fresh.step()
    assert fresh.att.describe("a").slot != 0
    got = record(fresh.run()["a"])
    (got_enc, got_scores), = second_pass[1:]
    assert torch.equal(got_enc, want_enc) and got_enc.shape[0] == want["num_frames"]  # every frame, not a part
    assert got_scores == want_scores
    assert got == want  # first pass, n-best, rescored tokens, log-probs: bit for bit
    assert len(want["nbest"]) > 1  # a real n-best was rescored


def test_a_waiting_resumed_stream_suspends_again_with_its_encoder_output():
    model = make_model()
    engine = rescoring_engine(model, "fast")
    start(engine)
    data = engine.suspend("a")
    other = rescoring_engine(model, "reference")
    other.resume(data)  # waiting: its state is still the session's
    again = other.suspend("a")
    assert torch.equal(S.read_session(again).encoder_out, S.read_session(data).encoder_out)


def suspended(model, rescore: bool) -> bytes:
    engine = rescoring_engine(model, "fast", rescore=rescore)
    start(engine)
    return engine.suspend("a")


def test_rescoring_state_and_rescoring_engines_must_match():
    model = make_model()
    with_state, without = suspended(model, True), suspended(model, False)
    assert S.read_session(without).encoder_out is None
    why = refused(rescoring_engine(model, "reference", rescore=False), with_state, error=S.SessionError)
    assert "rescoring" in why and "rescore=True" in why and "rescore=False" in why
    why = refused(rescoring_engine(model, "reference", rescore=True), without, error=S.SessionError)
    assert "rescoring" in why and "no kept encoder output" in why
    for rescore, data in ((True, with_state), (False, without)):  # the matching pairs load
        assert rescoring_engine(model, "reference", rescore=rescore).resume(data) == "a"


# ---- the new section under the fuzz ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    model, data = small_session(rescore=True)
    return model, data, encoder_section_offset(data)


def encoder_section_offset(data: bytes) -> int:
    """Where the encoder output section's header starts (the last section)."""
    pos, end = S.HEADER_BYTES, len(data) - S.CHECKSUM_BYTES
    while pos < end:
        kind, length = S.SECTION.unpack_from(data, pos)
        if kind == S.SEC_ENCODER_OUT:
            return pos
        pos += S.SECTION.size + length
    raise AssertionError("no encoder output section")


def test_the_small_rescoring_session_loads(small):
    model, data, at = small
    assert target(model, rescore=True).resume(data) == "a"
    kind, length = S.SECTION.unpack_from(data, at)
    assert kind == 6 and at + S.SECTION.size + length == len(data) - S.CHECKSUM_BYTES  # the last section
    frames, width = struct.unpack_from("<qI", data, at + S.SECTION.size)
    assert frames > 0 and width == model.config.hidden_dim and length == 12 + frames * width * 4


def test_every_truncation_of_a_rescoring_session_is_refused(small):
    model, data, _ = small
    engine = target(model, rescore=True)
    before = engine_snapshot(engine)
    for n in range(len(data)):
        with pytest.raises(S.SessionError):
            engine.resume(data[:n])
    assert same_snapshot(before, engine_snapshot(engine))


def test_bit_flips_in_the_encoder_output_are_refused(small):
    model, data, at = small
    engine = target(model, rescore=True)
    before = engine_snapshot(engine)
    rng = random.Random(99)
    for _ in range(300):
        raw = bytearray(data)
        raw[rng.randrange(at, len(data) - S.CHECKSUM_BYTES)] ^= 1 << rng.randrange(8)
        with pytest.raises(S.SessionError, match="corrupt session"):
            engine.resume(bytes(raw))
    assert same_snapshot(before, engine_snapshot(engine))


def rebuilt(data: bytes, at: int, payload: bytes | None, flags_xor: int = 0) -> bytes:
    """``data`` with the encoder output payload replaced (None: the section dropped), header and checksum fixed."""
    fields = list(S.HEADER.unpack_from(data, 0))
    body = data[S.HEADER_BYTES : at]
    if payload is not None:
        body += S.SECTION.pack(S.SEC_ENCODER_OUT, len(payload)) + payload
    else:
        fields[16] -= 1
    fields[3] ^= flags_xor
    fields[17] = len(body)
    return with_checksum(S.HEADER.pack(*fields) + body + bytes(S.CHECKSUM_BYTES))


def section_mutations(data: bytes, at: int):
    payload = data[at + S.SECTION.size : len(data) - S.CHECKSUM_BYTES]
    frames, width = struct.unpack_from("<qI", payload)
    values = payload[12:]
    nan = struct.pack("<f", float("nan"))
    yield "one frame fewer", rebuilt(data, at, struct.pack("<qI", frames - 1, width) + values[: -width * 4]), \
        "produced"
    yield "frame count past the bytes", rebuilt(data, at, struct.pack("<qI", frames + 1, width) + values), "bytes"
    yield "negative frame count", rebuilt(data, at, struct.pack("<qI", -1, width) + values), "frames >= 0"
    yield "other width", rebuilt(data, at, struct.pack("<qI", frames * 2, width // 2) + values), "hidden_dim"
    yield "a NaN value", rebuilt(data, at, payload[:12] + nan + values[4:]), "NaN"
    yield "a trailing byte", rebuilt(data, at, payload + b"\0"), "trailing"
    yield "section dropped, flag kept", rebuilt(data, at, None), "flag bit 3"
    yield "flag cleared, section kept", rebuilt(data, at, payload, S.FLAG_ENCODER_OUT), "flag bit 3"


MUTATIONS = ["one frame fewer", "frame count past the bytes", "negative frame count", "other width", "a NaN value",
             "a trailing byte", "section dropped, flag kept", "flag cleared, section kept"]


@pytest.mark.parametrize("index", range(len(MUTATIONS)), ids=MUTATIONS)
def test_each_wrong_field_of_the_section_is_refused(small, index):
    model, data, at = small
    name, bad, words = list(section_mutations(data, at))[index]
    assert name == MUTATIONS[index]
    assert words in refused(target(model, rescore=True), bad, error=S.SessionError), name


def test_an_encoder_output_section_needs_the_engine_section(small):
    model, data, _ = small
    session = S.read_session(data)
    session.engine = None
    with pytest.raises(S.SessionError, match="without the engine stream section"):
        S.read_session(S.encode_session(session))


# ---- the demo --------------------------------------------------------------------------------------


def test_demo_rescored_text_is_the_same_with_suspensions(capsys):
    from oasr.__main__ import main

    def rescoring_block(extra: list) -> list:
        code = main(["engine-demo", "--streams", "4", "--max-batch-size", "4", "--layers", "1", "--check-sample", "1",
                     "--quiet", "--plot", "", "--rescore", *extra])
        out = capsys.readouterr().out
        assert code == 0 and "-> OK" in out
        lines = out.splitlines()
        if extra:
            assert re.search(r"sessions: [1-9]\d* suspensions and resumes", out)
        first = next(i for i, line in enumerate(lines) if line.startswith("attention rescoring"))
        return lines[first : first + 9]

    plain, suspended_run = rescoring_block([]), rescoring_block(["--suspend-every", "3"])
    assert sum("rescored   [" in line for line in plain) == 4
    assert suspended_run == plain


def test_demo_drive_rescores_every_stream_the_same_with_suspensions(second_pass):
    """Every stream of the demo's workload, not only the printed sample: tokens, first pass, n-best, scores."""
    from argparse import Namespace

    from oasr.commands.demo import build, drive, make_workload
    from oasr.engine import StreamingEngine

    args = Namespace(num_left_chunks=-1, eviction=True, prefill=False, layers=1, seed=0, device="cpu",
                     max_batch_size=8, kv_cache_dtype=None)
    model, cfg = build(args)
    workload = make_workload(6, model.config.input_dim, seed=0, max_seconds=3.0, spread_ticks=6)
    runs = []
    for every in (0, 3):
        second_pass.clear()
        engine = StreamingEngine(model, cfg, twin="fast", keep_log_probs=True, rescore=True)
        sizes = drive(engine, workload, 0, model.config.chunk_input_frames, suspend_every=every)
        scores = sorted(scores for _, scores in second_pass)  # finishing order is the same; sorted to be safe
        runs.append(({s.stream_id: record(engine.result(s.stream_id)) for s in workload}, scores, sizes))
    (plain, plain_scores, none), (suspended_run, suspended_scores, sizes) = runs
    assert none == [] and len(sizes) >= 3
    assert suspended_run == plain and suspended_scores == plain_scores
