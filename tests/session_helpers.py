"""Shared by tests/test_session*.py and the fresh-process child: small engines, one driven stream, snapshots.

The scenario: one stream gets ``SPLIT`` feature frames, runs ``TICKS_BEFORE`` ticks (mid-utterance,
with input still pending), is suspended, gets the rest of its input and ends. An uninterrupted run
pushes the same pieces at the same ticks. A resumed stream is put into an engine whose slot 0 and
first blocks are held by a decoy admitted through the managers alone (it never joins a cohort, so
the cohort is the same one-stream forward as the uninterrupted run's, and the ids differ).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from oasr.engine import StreamingEngine
from oasr.models import ConformerConfig, StreamingConformer
from oasr.sessions import format as S

FORMATS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp8": (torch.float32, "fp8_e4m3"),
}
SPLIT, TOTAL, TICKS_BEFORE = 70, 150, 3
DECOY_BLOCKS = 5


def make_model(fmt: str = "fp32", num_left_chunks: int = 2, seed: int = 3, **geometry) -> StreamingConformer:
    """The small session model; ``geometry`` overrides ConformerConfig fields (e.g. ``head_dim=64``: the
    CUDA kernels tile head_dim 64 or 128)."""
    dtype, _ = FORMATS[fmt]
    config = ConformerConfig(num_left_chunks=num_left_chunks, chunk_size=4, seed=seed, **geometry)
    return StreamingConformer(config).to(dtype)


def make_engine(model, twin: str, fmt: str = "fp32", decoder: str = "beam", rescore: bool = False,
                **overrides) -> StreamingEngine:
    dtype, kv = FORMATS[fmt]
    cfg = model.config.cache_config(**{"block_size_frames": 3, "max_batch_size": 4, "dtype": dtype,
                                       "kv_cache_dtype": kv, **overrides})
    return StreamingEngine(model, cfg, twin=twin, decoder=decoder, keep_log_probs=True, rescore=rescore)


def features(num_frames: int = TOTAL, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_frames, 20, generator=torch.Generator().manual_seed(seed))


def start(engine: StreamingEngine, sid="a") -> None:
    """The part before the suspension: the first piece, then TICKS_BEFORE ticks."""
    engine.add_stream(sid)
    engine.push(sid, features()[:SPLIT])
    for _ in range(TICKS_BEFORE):
        engine.step()


def finish(engine: StreamingEngine, sid="a"):
    """The part after it: the rest of the input, the end, ticks until the stream is done."""
    engine.push(sid, features()[SPLIT:])
    engine.end_stream(sid)
    return engine.run()[sid]


def uninterrupted(model, twin: str, fmt: str = "fp32"):
    engine = make_engine(model, twin, fmt)
    start(engine)
    return finish(engine)


def hold_decoy(engine: StreamingEngine) -> None:
    """Take slot 0 and the head of the free list through the managers, outside every cohort."""
    engine.att.allocate_stream("decoy")
    engine.cnn.allocate_stream("decoy")
    engine.states.allocate_stream("decoy")
    engine.pool.allocate(DECOY_BLOCKS)


def result_record(result) -> dict:
    """A result in plain JSON-able values, log-probs as the hex of their fp32 bytes (exact)."""
    return {
        "tokens": list(result.tokens),
        "num_frames": result.num_frames,
        "num_input_frames": result.num_input_frames,
        "finish_reason": result.finish_reason,
        "log_probs": result.log_probs.float().contiguous().numpy().tobytes().hex(),
        "nbest": [[list(h.tokens), float(h.log_score).hex(), list(h.frames)] for h in result.nbest],
    }


def engine_snapshot(engine: StreamingEngine) -> dict:
    """Everything a refused resume (or a refused suspend) must leave exactly as it was."""
    pool = engine.pool
    snap = {
        "free": pool.free_block_ids(),
        "pool": [t.view(torch.uint8).clone() for t in (pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale)
                 if t is not None],
        "att": {sid: engine.att.describe(sid) for sid in engine.att.stream_ids},
        "cnn": engine.cnn.buffer.clone(),
        "states": {name: buf.clone() for name, buf in engine.states.buffers.items()},
        "streams": {sid: (s.state, s.num_pending, s.offset, s.ended) for sid, s in engine._streams.items()},
        "waiting": list(engine._waiting),
        "active": list(engine._active),
        "tick": engine.tick,
    }
    if engine.ctc is not None:
        snap["ctc"] = (engine.ctc.active_stream_ids, engine.ctc.num_pooled, engine.ctc.num_created)
    return snap


def same_snapshot(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                return False
        elif isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            if len(x) != len(y) or not all(torch.equal(p, q) for p, q in zip(x, y, strict=True)):
                return False
        elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), torch.Tensor):
            if x.keys() != y.keys() or not all(torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)) for k in x):
                return False
        elif x != y:
            return False
    return True


def refused(engine: StreamingEngine, data: bytes, match=None, error=ValueError) -> str:
    """``engine.resume(data)`` raises ``error`` and changes nothing; returns the message."""
    before = engine_snapshot(engine)
    with pytest.raises(error, match=match) as info:
        engine.resume(data)
    assert same_snapshot(before, engine_snapshot(engine))
    return str(info.value)


def with_checksum(raw) -> bytes:
    """``raw`` with its checksum recomputed, so only the changed field's own check can refuse it."""
    body = bytes(raw[: -S.CHECKSUM_BYTES])
    return body + hashlib.blake2b(body, digest_size=S.CHECKSUM_BYTES).digest()


def small_session(rescore: bool = False):
    """A small session (one stream, a few chunks in, window of one chunk) and the model that made it."""
    model = make_model("fp32", num_left_chunks=1)
    src = make_engine(model, "fast", "fp32", rescore=rescore)
    src.add_stream("a")
    src.push("a", features()[:40])
    src.step()
    src.step()
    return model, src.suspend("a")


def target(model, twin: str = "fast", rescore: bool = False) -> StreamingEngine:
    """A fresh engine of a small session's kind (one other stream busy) to load it into."""
    engine = make_engine(model, twin, "fp32", rescore=rescore)
    engine.add_stream("busy")
    engine.push("busy", features(30, seed=5))
    engine.step()
    return engine


# ---- a stream suspended mid-rescoring (its attention rescoring job spread over ticks) --------------------


def rescoring_engine(model, twin: str, rescorer=None) -> StreamingEngine:
    """A rescoring engine whose tick runs one decoder step, so a job spans many ticks."""
    cfg = model.config.cache_config(block_size_frames=3, max_batch_size=4)
    return StreamingEngine(model, cfg, twin=twin, keep_log_probs=True, rescore=True, decode_steps_per_tick=1,
                           rescorer=rescorer)


def until_rescoring(engine: StreamingEngine, extra_ticks: int) -> None:
    """Streams "a" and "b" get their whole input and end together; ticks until both are being rescored
    ("a"'s job runs first), then ``extra_ticks`` more: "a" is ``1 + extra_ticks`` steps in, "b" at step 0."""
    for sid, seed in (("a", 1), ("b", 2)):
        engine.add_stream(sid)
        engine.push(sid, features(TOTAL, seed=seed))
        engine.end_stream(sid)
    while engine.status("a") != "rescoring":
        engine.step()
    for _ in range(extra_ticks):
        engine.step()


def rescored_record(result, combined) -> dict:
    """A rescored result in JSON-able values: ``result_record`` plus the first pass and the combined scores
    of the second pass (float.hex, exact)."""
    record = result_record(result)
    record.update(first_pass=list(result.first_pass), combined=[float(c).hex() for c in combined])
    return record


def recording_results(monkeypatch=None) -> dict:
    """Patch ``RescoreJob.result`` to record each finished job's combined scores by its hypotheses."""
    from oasr.engine import rescoring

    seen, result = {}, rescoring.RescoreJob.result

    def recording(self):
        best, combined = result(self)
        seen[tuple(map(tuple, self.hyps))] = list(combined)
        return best, combined

    if monkeypatch is not None:
        monkeypatch.setattr(rescoring.RescoreJob, "result", recording)
    else:
        rescoring.RescoreJob.result = recording
    return seen


def rescored(engine: StreamingEngine, seen: dict, sid) -> dict:
    result = engine.result(sid)
    return rescored_record(result, seen[tuple(tuple(h.tokens) for h in result.nbest)])
