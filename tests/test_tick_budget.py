"""The tick budget for autoregressive work: attention rescoring as jobs of decoder steps.

``StreamingEngine(rescore=True, decode_steps_per_tick=N, max_tick_ms=T, clock=...)`` runs at most
``N`` rescoring steps per tick and starts no step once ``T`` ms have passed since the tick's first
one. Tested with an injected fake clock (no wall-clock assertion): a tick stops at the deadline,
the rest runs next tick, and every final result is identical to an unbudgeted run's.
"""

import pytest
import torch

from oasr.ctc.config import CtcHypothesis
from oasr.engine import StreamingEngine
from oasr.engine import rescoring as R
from oasr.models import ConformerConfig, StreamingConformer
from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig, attention_rescore
from tests.test_engine import drive, features


class FakeClock:
    """Seconds that advance by ``step_ms`` on every read: each decoder step 'takes' that long."""

    def __init__(self, step_ms: float):
        self.now, self.step = 0.0, step_ms / 1e3
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.step
        return self.now


@pytest.fixture
def scored(monkeypatch):
    """Every finished job's (hypotheses, combined scores as hex): what the second pass decided."""
    calls = []
    result = R.RescoreJob.result

    def recording(self):
        best, combined = result(self)
        calls.append((tuple(map(tuple, self.hyps)), tuple(float(c).hex() for c in combined)))
        return best, combined

    monkeypatch.setattr(R.RescoreJob, "result", recording)
    return calls


def make(twin="fast", **budget):
    model = StreamingConformer(ConformerConfig(chunk_size=4, seed=3))
    cfg = model.config.cache_config(block_size_frames=3, max_batch_size=4)
    return StreamingEngine(model, cfg, twin=twin, rescore=True, ctc_weight=0.3, keep_log_probs=True, **budget)


def run(engine):
    feats = {sid: features(40 + 23 * sid, seed=sid) for sid in range(5)}
    drive(engine, feats, {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}, max_ticks=400)
    return {sid: engine.result(sid) for sid in feats}


def summary(results) -> dict:
    return {sid: (r.tokens, r.first_pass, [(h.tokens, float(h.log_score).hex()) for h in r.nbest],
                  r.log_probs.numpy().tobytes(), r.finish_reason) for sid, r in results.items()}


@pytest.mark.parametrize("twin", ["reference", "fast"])
def test_a_deadline_stops_the_tick_and_the_results_are_identical(twin, scored):
    want = summary(run(make(twin)))
    want_scores = sorted(scored)
    scored.clear()
    clock = FakeClock(step_ms=1.0)
    engine = make(twin, max_tick_ms=2.5, clock=clock)
    got = run(engine)
    steps = [s.decode_steps for s in engine.stats]
    # reads at 1, 2, 3 ms (start, +1, +2 ms: two more steps), the read at +3 ms >= 2.5 ms stops the tick
    assert max(steps) == 3 and steps.count(3) >= 2
    assert sum(steps) == sum(len(max(h, key=len)) + 1 for h, _ in scored)  # every job's steps, none twice
    assert summary(got) == want
    assert sorted(scored) == want_scores  # the same combined scores, bit for bit


def test_a_step_budget_binds_and_results_are_identical(scored):
    want = summary(run(make()))
    want_scores = sorted(scored)
    scored.clear()
    engine = make(decode_steps_per_tick=2)
    seen_rescoring = []
    feats = {sid: features(40 + 23 * sid, seed=sid) for sid in range(5)}
    starts = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    original_step = engine.step

    def step():
        out = original_step()
        seen_rescoring.extend(sid for sid in feats if sid in engine.stream_ids and engine.status(sid) == "rescoring")
        return out

    engine.step = step
    drive(engine, feats, starts, max_ticks=400)
    got = {sid: engine.result(sid) for sid in feats}
    assert max(s.decode_steps for s in engine.stats) == 2
    assert seen_rescoring  # streams waited in "rescoring" across ticks
    assert summary(got) == want and sorted(scored) == want_scores


def test_the_first_step_of_a_tick_always_runs():
    """A deadline already past when the tick's autoregressive work starts still lets one step run."""
    engine = make(max_tick_ms=1e-9, clock=FakeClock(step_ms=5.0))
    results = run(engine)
    assert all(r.finish_reason == "eos" for r in results.values())
    assert max(s.decode_steps for s in engine.stats) == 1


def test_a_stream_being_rescored_suspends_with_its_job(scored):
    """Suspended between two budgeted ticks of its job, resumed in another engine: the same result."""
    plain = make(decode_steps_per_tick=1)
    sid = plain.add_stream()
    plain.push(sid, features(64, seed=1))
    plain.end_stream(sid)
    plain.run()
    want = summary({sid: plain.result(sid)})
    engine = make(decode_steps_per_tick=1)
    engine.add_stream(sid)
    engine.push(sid, features(64, seed=1))
    engine.end_stream(sid)
    while engine.status(sid) != "rescoring":
        engine.step()
    with pytest.raises(ValueError, match="rescoring, not finished"):
        engine.result(sid)
    data = engine.suspend(sid)
    assert sid not in engine.stream_ids and not engine._rescoring
    other = make(decode_steps_per_tick=1)
    assert other.resume(data) == sid and other.status(sid) == "rescoring"
    other.run()
    assert summary({sid: other.result(sid)}) == want
    assert scored[0] == scored[1]  # the same combined scores, bit for bit


@pytest.mark.parametrize("kwargs,match", [
    ({"decode_steps_per_tick": 0}, "decode_steps_per_tick must be None or an int >= 1"),
    ({"decode_steps_per_tick": True}, "decode_steps_per_tick must be None or an int >= 1"),
    ({"decode_steps_per_tick": 1.5}, "decode_steps_per_tick must be None or an int >= 1"),
    ({"max_tick_ms": 0}, "max_tick_ms must be None or a finite number > 0"),
    ({"max_tick_ms": float("nan")}, "max_tick_ms must be None or a finite number > 0"),
    ({"max_tick_ms": float("inf")}, "max_tick_ms must be None or a finite number > 0"),
    ({"clock": 3}, "clock must be callable"),
])
def test_bad_budgets_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


# ---- the job on its own -------------------------------------------------------------------------------
def test_a_job_scores_what_the_teacher_forced_forward_scores():
    decoder = AttentionDecoder(DecoderConfig(seed=4))
    enc = torch.randn(9, decoder.config.encoder_dim, generator=torch.Generator().manual_seed(2))
    nbest = [CtcHypothesis(list(t), score, list(range(len(t)))) for t, score in
             (((3, 5, 7), -1.5), ((3, 5), -2.0), ((), -4.0), ((8, 1, 2, 2, 9), -3.0))]
    from oasr import fast, reference

    for ops in (reference, fast):
        job = R.RescoreJob(decoder, enc, nbest, 0.5, ops)
        assert job.total_steps == 6 and not job.done
        with pytest.raises(ValueError, match="step"):
            job.result()
        while not job.advance():
            pass
        assert job.steps == 6 and job.kv is None
        with pytest.raises(ValueError, match="the job is done"):
            job.advance()
        best, combined = job.result()
        want_best, want_combined = attention_rescore(decoder, enc, nbest, 0.5)
        assert best == want_best
        # one forward over all positions against one step per position: the same sums up to fp32 rounding
        # of ~20 terms of size ~10 (each position's logits also go through a differently shaped matmul)
        assert torch.allclose(torch.tensor(combined), torch.tensor(want_combined), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="empty n-best"):
        R.RescoreJob(decoder, enc, [], 0.5, reference)
