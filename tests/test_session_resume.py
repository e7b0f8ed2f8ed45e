"""Bit-identical resume in a fresh process, both twins, every K/V format, and across the twins.

A stream is suspended mid-utterance (input still pending, K/V window partly evicted) in this
process; a child process that never saw it resumes it under other slot and block ids
(``tests/session_child.py``) and runs it to the end. On the twin that saved it, the child's
log-probs, tokens and n-best must be exactly the uninterrupted run's (bytes of the fp32 log-probs,
float.hex of the scores). Across the twins the resumed stream runs on the other twin's arithmetic,
so it must equal, exactly, the same resume done in this process, keep the uninterrupted tokens,
and carry the log-probs before the suspension bit for bit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from session_helpers import (
    FORMATS,
    SPLIT,
    features,
    finish,
    hold_decoy,
    make_engine,
    make_model,
    result_record,
    start,
    uninterrupted,
)

TWINS = ("reference", "fast")
CASES = [(fmt, src, dst) for fmt in FORMATS for src in TWINS for dst in TWINS]
ROOT = Path(__file__).resolve().parent.parent
TWIN_ATOL = 1e-5  # what the engine tests allow between a twin and the offline forward


def saved_session(fmt: str, twin: str):
    engine = make_engine(make_model(fmt), twin, fmt)
    start(engine)
    info = engine.att.describe("a")
    assert engine.status("a") == "active" and engine._streams["a"].num_pending > 0  # mid-utterance, input pending
    return engine.suspend("a"), info


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """Every case resumed in one fresh child process; returns {case: (saved info, child record)}."""
    tmp = tmp_path_factory.mktemp("sessions")
    saved = {case: saved_session(case[0], case[1]) for case in CASES}
    jobs = [{"fmt": fmt, "twin": dst, "session": saved[(fmt, src, dst)][0].hex()} for fmt, src, dst in CASES]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "tests" / "session_child.py"), str(tmp / "jobs.json"),
                    str(tmp / "out.json")], check=True, cwd=ROOT, env=env, timeout=540)
    records = json.loads((tmp / "out.json").read_text())
    return {case: (saved[case], record) for case, record in zip(CASES, records, strict=True)}


def in_process_resume(data: bytes, fmt: str, twin: str) -> dict:
    engine = make_engine(make_model(fmt), twin, fmt)
    hold_decoy(engine)
    sid = engine.resume(data)
    engine.push(sid, features()[SPLIT:])
    engine.end_stream(sid)
    return result_record(engine.run()[sid])


def log_probs(record: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(record["log_probs"]), dtype=torch.float32).view(-1, 32)


@pytest.mark.parametrize("fmt,src,dst", CASES, ids=[f"{f}-{s}-to-{d}" for f, s, d in CASES])
def test_resume_in_a_fresh_process(child, fmt, src, dst):
    (data, info), got = child[(fmt, src, dst)]
    assert got["slot"] != info.slot and not set(got["blocks"]) & set(info.blocks)  # other ids, same stream
    want = result_record(uninterrupted(make_model(fmt), src, fmt))
    got = {k: v for k, v in got.items() if k not in ("slot", "blocks")}
    if src == dst:
        assert got == want  # bit for bit: log-prob bytes, tokens, n-best scores
        return
    assert got == in_process_resume(data, fmt, dst)  # the other twin, deterministically, in any process
    assert got["tokens"] == want["tokens"] and got["num_frames"] == want["num_frames"]
    before = info.total_frames  # encoder frames produced before the suspension
    assert before > 0
    ours, theirs = log_probs(got), log_probs(want)
    assert torch.equal(ours[:before], theirs[:before])  # carried in the session
    assert (ours - theirs).abs().max().item() <= TWIN_ATOL  # then each twin's own arithmetic


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_resume_on_cuda_is_bit_identical(fmt):
    """The fast twin on a GPU (kernels, device pools): suspended, moved to a second engine, the same bits."""
    model = make_model(fmt, head_dim=64).to("cuda")  # the kernels tile head_dim 64 or 128
    want = make_engine(model, "fast", fmt, device="cuda")
    start(want)
    want = result_record(finish(want))
    a = make_engine(model, "fast", fmt, device="cuda")
    start(a)
    data = a.suspend("a")
    b = make_engine(model, "fast", fmt, device="cuda")
    hold_decoy(b)
    b.resume(data)
    assert result_record(finish(b)) == want
