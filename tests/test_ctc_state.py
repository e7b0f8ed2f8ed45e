"""``CtcStateCacheManager`` and ``StreamHandle`` over both decoder twins.

Scenario tests pin the exact pool behaviour (which state object is reused,
the counters); a poisoned state must decode exactly as a fresh one after
``reset_state``; a hypothesis state machine drives long random sequences of
allocate / decode / free through a reference and a fast manager in lockstep.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from oasr.ctc.config import CtcDecoderConfig
from oasr.fast import ctc_decoder as fast_dec
from oasr.fast import ctc_state as fast_state
from oasr.reference import ctc_decoder as ref_dec
from oasr.reference import ctc_state as ref_state

TWINS = {
    "reference": (ref_dec.StreamingCtcDecoder, ref_state.CtcStateCacheManager),
    "fast": (fast_dec.StreamingCtcDecoder, fast_state.CtcStateCacheManager),
}
CONFIG = CtcDecoderConfig(beam_size=4, nbest=3, token_topk=3, max_prefix_len=24)
VOCAB = 7


@pytest.fixture(params=list(TWINS))
def twin(request):
    return TWINS[request.param]


def log_probs(batch, T, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, T, VOCAB, generator=g) * 2).log_softmax(-1)


def fresh_result(Decoder, lp):
    dec = Decoder(CONFIG)
    state = dec.create_state(lp.shape[0], VOCAB)
    dec.decode_chunk(state, lp)
    return dec.finalize_stream(state)


def poison(state):
    """Fill everything a state holds with values a correct reset must overwrite."""
    state.frames_decoded = 12345
    if isinstance(state, ref_dec.CtcBeamState):
        junk = ref_dec.Prefix(tokens=(3, 3, 1), frames=(9, 8, 7), pb=5.0, pnb=math.nan)
        for beam in state.beams:
            beam[:] = [junk] * 7
    else:
        g = torch.Generator().manual_seed(0)
        for buf in state.buffers:
            if buf.is_floating_point():
                buf.fill_(math.nan)
                buf[..., ::2] = 3.0
            else:
                buf.copy_(torch.randint(-5, 50, buf.shape, generator=g).to(buf.dtype))


# ---- scenarios ---------------------------------------------------------------------------------


def test_pool_lifecycle_and_counters(twin):
    Decoder, Manager = twin
    mgr = Manager(Decoder(CONFIG))
    assert (mgr.num_created, mgr.num_pooled, mgr.num_active) == (0, 0, 0)
    mgr.allocate_stream("a", 1, VOCAB)
    mgr.allocate_stream("b", 1, VOCAB)
    state_a, state_b = mgr.get_state("a"), mgr.get_state("b")
    assert state_a is not state_b
    assert (mgr.num_created, mgr.num_pooled, mgr.num_active) == (2, 0, 2)
    mgr.free_stream("a")
    mgr.free_stream("b")
    assert not mgr.has_stream("a") and not mgr.has_stream("b")
    assert (mgr.num_created, mgr.num_pooled, mgr.num_active) == (2, 2, 0)
    # LIFO: the state freed last comes back first, and nothing new is created
    mgr.allocate_stream(7, 1, VOCAB)
    assert mgr.get_state(7) is state_b
    mgr.allocate_stream(8, 1, VOCAB)
    assert mgr.get_state(8) is state_a
    assert (mgr.num_created, mgr.num_pooled, mgr.num_active) == (2, 0, 2)
    mgr.allocate_stream(9, 1, VOCAB)
    assert (mgr.num_created, mgr.num_pooled, mgr.num_active) == (3, 0, 3)
    assert mgr.active_stream_ids == [7, 8, 9]


def test_errors_change_nothing(twin):
    Decoder, Manager = twin
    mgr = Manager(Decoder(CONFIG))
    mgr.allocate_stream("a", 1, VOCAB)
    mgr.allocate_stream("b", 1, VOCAB)
    mgr.free_stream("b")
    counters = (mgr.num_created, mgr.num_pooled, mgr.num_active)
    with pytest.raises(ValueError, match="already allocated"):
        mgr.allocate_stream("a", 1, VOCAB)
    with pytest.raises(ValueError, match="batch"):
        mgr.allocate_stream("c", 0, VOCAB)
    with pytest.raises(ValueError, match="vocab"):
        mgr.allocate_stream("c", 1, 1)
    for call in (mgr.free_stream, mgr.get_decoder, mgr.get_state):
        with pytest.raises(KeyError):
            call("b")
    with pytest.raises(KeyError):
        mgr.decode_cohort(["a", "zzz"], [log_probs(1, 2, 0)] * 2)
    assert (mgr.num_created, mgr.num_pooled, mgr.num_active) == counters
    assert not mgr.has_stream("c")
    with pytest.raises(TypeError):
        Manager(object())


def test_handle_mirrors_the_decoder(twin):
    Decoder, Manager = twin
    dec = Decoder(CONFIG)
    mgr = Manager(dec)
    handle = mgr.allocate_stream("s", 2, VOCAB)
    assert handle.config is dec.config and handle.decoder is dec
    assert handle.stream_id == "s"
    lp = log_probs(2, 9, seed=1)
    handle.decode_chunk(lp[:, :5])
    mgr.get_decoder("s").step(lp[:, 5])  # a second handle to the same stream
    handle.decode_chunk(lp[:, 6:])
    assert handle.finalize_stream() == fresh_result(Decoder, lp)
    assert handle.peek() == [row[0] for row in handle.finalize_stream()]
    assert handle.state is mgr.get_state("s")


def test_standalone_handle(twin):
    Decoder, _ = twin
    dec = Decoder(CONFIG)
    handle = ref_state.StreamHandle(dec, dec.create_state(1, VOCAB))
    lp = log_probs(1, 6, seed=2)
    handle.decode_chunk(lp)
    assert handle.finalize_stream() == fresh_result(Decoder, lp)
    assert handle.stream_id is None and handle.config is CONFIG


def test_stale_handle_raises(twin):
    Decoder, Manager = twin
    mgr = Manager(Decoder(CONFIG))
    old = mgr.allocate_stream("s", 1, VOCAB)
    mgr.free_stream("s")
    with pytest.raises(KeyError, match="stale"):
        old.peek()
    mgr.allocate_stream("s", 1, VOCAB)  # same id, and the very same pooled state object
    with pytest.raises(KeyError, match="stale"):
        old.decode_chunk(log_probs(1, 2, 0))
    assert mgr.get_decoder("s").peek()[0].tokens == []


@pytest.mark.parametrize("batch_before, batch_after", [(1, 1), (3, 2), (1, 3)])
def test_poisoned_pooled_state_decodes_as_fresh(twin, batch_before, batch_after):
    Decoder, Manager = twin
    mgr = Manager(Decoder(CONFIG))
    first = mgr.allocate_stream("old", batch_before, VOCAB)
    first.decode_chunk(log_probs(batch_before, 11, seed=3))
    state = mgr.get_state("old")
    mgr.free_stream("old")
    poison(state)
    handle = mgr.allocate_stream("new", batch_after, VOCAB)
    assert mgr.get_state("new") is state and mgr.num_created == 1
    lp = log_probs(batch_after, 13, seed=4)
    handle.decode_chunk(lp[:, :6])
    handle.decode_chunk(lp[:, 6:])
    assert handle.finalize_stream() == fresh_result(Decoder, lp)


def test_fast_reset_reuses_buffers():
    mgr = fast_state.CtcStateCacheManager(fast_dec.StreamingCtcDecoder(CONFIG))
    mgr.allocate_stream(0, 3, VOCAB)
    state = mgr.get_state(0)
    pointers = [buf.data_ptr() for buf in state.buffers]
    mgr.free_stream(0)
    mgr.allocate_stream(1, 2, VOCAB)  # smaller batch: same storage
    assert [buf.data_ptr() for buf in state.buffers] == pointers and state.capacity == 3
    mgr.free_stream(1)
    mgr.allocate_stream(2, 5, VOCAB)  # larger batch: the state grows
    assert state.capacity == 5 and state.batch == 5


def test_fast_twin_reuses_the_reference_manager():
    # the manager is bookkeeping only; one class serves both twins (see oasr.fast.ctc_state)
    assert fast_state.CtcStateCacheManager is ref_state.CtcStateCacheManager
    assert fast_state.StreamHandle is ref_state.StreamHandle


def test_decode_cohort(twin):
    Decoder, Manager = twin
    mgr = Manager(Decoder(CONFIG))
    lps = {sid: log_probs(1, 8, seed=sid) for sid in range(4)}
    for sid in lps:
        mgr.allocate_stream(sid, 1, VOCAB)
    mgr.get_decoder(2).decode_chunk(lps[2][:, :3])
    mgr.decode_cohort([0, 1, 3], [lps[sid][:, :3] for sid in (0, 1, 3)])
    mgr.decode_cohort([0, 1, 2, 3], [lps[sid][:, 3:] for sid in range(4)])
    for sid, lp in lps.items():
        assert mgr.get_decoder(sid).finalize_stream() == fresh_result(Decoder, lp)


def test_decode_cohort_mixed_chunk_lengths(twin):
    """One call per round over streams whose chunks differ in length (0 included) == each stream alone."""
    Decoder, Manager = twin
    mgr = Manager(Decoder(CONFIG))
    plans = {0: [5, 0, 3], 1: [1, 4, 4], 2: [0, 2, 7], 3: [3, 3, 3]}
    lps = {sid: log_probs(1 + sid % 2, sum(plan), seed=sid) for sid, plan in plans.items()}
    for sid, lp in lps.items():
        mgr.allocate_stream(sid, lp.shape[0], VOCAB)
    start = dict.fromkeys(plans, 0)
    for r in range(3):
        mgr.decode_cohort(list(plans), [lps[sid][:, start[sid] : start[sid] + plans[sid][r]] for sid in plans])
        start = {sid: start[sid] + plans[sid][r] for sid in plans}
    for sid, lp in lps.items():
        assert mgr.get_decoder(sid).finalize_stream() == fresh_result(Decoder, lp)


# ---- both twins in lockstep ---------------------------------------------------------------------


class LockstepManagers(RuleBasedStateMachine):
    """Random allocate / decode / free sequences on a reference and a fast manager at once."""

    @initialize()
    def setup(self):
        self.ref = ref_state.CtcStateCacheManager(ref_dec.StreamingCtcDecoder(CONFIG))
        self.fast = fast_state.CtcStateCacheManager(fast_dec.StreamingCtcDecoder(CONFIG))
        self.live: dict[int, int] = {}  # sid -> batch
        self.next_sid = 0
        self.seed = 0

    @rule(batch=st.integers(1, 3))
    def allocate(self, batch):
        sid = self.next_sid
        self.next_sid += 1
        self.ref.allocate_stream(sid, batch, VOCAB)
        self.fast.allocate_stream(sid, batch, VOCAB)
        self.live[sid] = batch

    @precondition(lambda self: self.live)
    @rule(data=st.data(), T=st.integers(0, 6))
    def decode(self, data, T):
        """A chunk of ``T`` frames; rows commit their shared prefix past ``commit_at`` (both twins alike).

        The prefixes stay within ``max_prefix_len`` however long the stream, and both twins' states
        (beams and committed parts) stay equal.
        """
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.seed += 1
        lp = log_probs(self.live[sid], T, self.seed)
        for mgr in (self.ref, self.fast):
            mgr.get_decoder(sid).decode_chunk(lp)
        snaps = [mgr.snapshot_stream(sid) for mgr in (self.ref, self.fast)]
        assert snaps[0].committed == snaps[1].committed
        assert [[(e.tokens, e.frames) for e in row] for row in snaps[0].rows] == \
            [[(e.tokens, e.frames) for e in row] for row in snaps[1].rows]
        assert all(len(e.tokens) <= CONFIG.max_prefix_len for row in snaps[0].rows for e in row)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.compare(sid)
        self.ref.free_stream(sid)
        self.fast.free_stream(sid)
        del self.live[sid]

    def compare(self, sid):
        a = self.ref.get_decoder(sid).finalize_stream()
        b = self.fast.get_decoder(sid).finalize_stream()
        assert [[(h.tokens, h.frames) for h in row] for row in a] == [[(h.tokens, h.frames) for h in row] for row in b]
        for row_a, row_b in zip(a, b, strict=True):
            for ha, hb in zip(row_a, row_b, strict=True):
                assert abs(ha.log_score - hb.log_score) <= 1e-9

    @invariant()
    def counters_agree(self):
        for mgr in (self.ref, self.fast):
            assert mgr.num_active == len(self.live)
            assert mgr.num_created == mgr.num_active + mgr.num_pooled


LockstepManagers.TestCase.settings = settings(max_examples=20, stateful_step_count=25, deadline=None)
test_lockstep_managers = LockstepManagers.TestCase
