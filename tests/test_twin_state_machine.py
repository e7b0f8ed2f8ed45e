"""Both twins, one random op sequence: after every step they agree exactly.

A hypothesis state machine drives ``oasr.reference`` and ``oasr.fast`` side by
side through the same operations, valid and invalid:

  * attention: allocate / free / reset, prepare (single and batched, scalar or
    per-stream frames), commit (single and batched), dense commit, paged views
    with and without padding, a full paged tick (prepare, ``append_kv`` of random
    K/V through each twin's views, ``paged_attention``, commit), foreign pool
    allocations that make the pool run dry, bad frees straight into the pool;
  * fixed-extent state: a ``SlotStateCache`` with two specs (slot axis 1, and a
    persistent int64 spec on axis 0) and a ``CnnCacheManager``: allocate, free,
    reset, scatter (padded or not), gather, fill_slot.

Every call runs on both twins; either both return or both raise the same
exception type with the same message. After every step we compare, exactly:
free lists, stream ids, ``describe`` (block ids included: the twins pick the
same physical ids by construction), the paged state views, every stream's
``get_stacked_cache``, both whole K/V pools, and the fast twin's persistent
device rows against the reference's records. Both twins' views are read with
the *reference* ``append_kv`` / ``paged_attention``, so any difference is a
bookkeeping difference.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import oasr
from oasr import fast, reference
from oasr.reference.paged_ops import append_kv, paged_attention

GEOMETRIES = [
    dict(chunk_size=4, block_size_frames=4, num_left_chunks=2),
    dict(chunk_size=6, block_size_frames=4, num_left_chunks=1),
    dict(chunk_size=3, block_size_frames=8, num_left_chunks=2),
    dict(chunk_size=4, block_size_frames=2, num_left_chunks=-1, max_num_blocks=24),
    dict(chunk_size=4, block_size_frames=4, num_left_chunks=2, prefill_kv_window=True),
    dict(chunk_size=3, block_size_frames=2, num_left_chunks=0),  # no history at all
    dict(chunk_size=4, block_size_frames=2, num_left_chunks=3, max_num_blocks=32),  # holds every table column
]
STREAM_IDS = list(range(6))  # max_batch_size is 4: slots run out, and unknown ids get drawn
TWINS = (reference, fast)


def run_both(op):
    """``op(i)`` on twin ``i`` for both; the same result or the same exception (type and message)."""
    results, errors = [], []
    for side in (0, 1):
        try:
            results.append(op(side))
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - compared below, re-raised if only one side fails
            results.append(None)
            errors.append(exc)
    ref_err, fast_err = errors
    if ref_err is None and fast_err is None:
        return results
    assert ref_err is not None and fast_err is not None, f"only one twin raised: {ref_err!r} vs {fast_err!r}"
    assert type(ref_err) is type(fast_err), f"{ref_err!r} vs {fast_err!r}"
    assert str(ref_err) == str(fast_err)
    return None


class TwinMachine(RuleBasedStateMachine):
    @initialize(geometry=st.sampled_from(GEOMETRIES), seed=st.integers(0, 2**31 - 1), staged=st.booleans())
    def setup(self, geometry, seed, staged):
        fields = dict(
            num_layers=2, n_kv_head=2, head_dim=4, hidden_dim=3, kernel_size=3, max_num_blocks=16,
            max_batch_size=4, max_blocks_per_seq=8,
        )
        fields.update(geometry)
        self.cfg = oasr.CacheConfig(**fields)
        self.gen = torch.Generator().manual_seed(seed)
        self.pools = [t.BlockPool(self.cfg, scratch_blocks=1) for t in TWINS]
        self.atts = [t.AttentionCacheManager(p, self.cfg, pad_lanes=1) for t, p in zip(TWINS, self.pools, strict=True)]
        if staged:  # the fast twin as on CUDA (staged copies); else its CPU direct writes
            self.atts[1]._stage_like_cuda()
        self.cnns = [t.CnnCacheManager(self.cfg, pad_lanes=1) for t in TWINS]
        specs = [
            oasr.reference.StreamStateSpec("tail", (3, 2), slot_axis=1),
            oasr.reference.StreamStateSpec("prompt", (1,), dtype=torch.int64, persistent=True),
        ]
        self.states = [t.SlotStateCache(specs, 4, pad_lanes=1) for t in TWINS]
        self.foreign = []  # blocks taken straight from both pools (another user of the pool)
        for sid in STREAM_IDS[:2]:
            for managers in (self.atts, self.cnns, self.states):
                run_both(lambda i, sid=sid, managers=managers: managers[i].allocate_stream(sid))

    # ---- draws -------------------------------------------------------------------
    def live(self):
        return self.atts[0].stream_ids

    def draw_cohort(self, data, pool_of_ids):
        """Mostly unique live ids; sometimes anything (duplicates, unknown ids, empty)."""
        if pool_of_ids and data.draw(st.integers(0, 9)) < 9:
            return data.draw(st.lists(st.sampled_from(pool_of_ids), max_size=4, unique=True))
        return data.draw(st.lists(st.sampled_from(STREAM_IDS + [99]), max_size=4))

    def draw_frames(self, data, count):
        cs = self.cfg.chunk_size
        valid = st.integers(0, cs)
        any_frame = st.one_of(st.none(), st.integers(-1, cs + 1))
        kind = data.draw(st.integers(0, 9))
        if kind < 4:
            return data.draw(st.one_of(st.none(), valid))
        if kind < 8:
            return data.draw(st.lists(valid, min_size=count, max_size=count))
        if kind < 9:
            return data.draw(st.lists(any_frame, min_size=max(count - 1, 0), max_size=count + 1))
        return data.draw(st.one_of(any_frame, st.just(True), st.just(2.0)))

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    # ---- attention: lifecycle ------------------------------------------------------
    @rule(data=st.data(), op=st.sampled_from(["allocate", "allocate", "free", "reset"]))
    def lifecycle(self, data, op):
        live = self.live()
        if op == "allocate":
            sid = data.draw(st.sampled_from(STREAM_IDS))
            run_both(lambda i: self.atts[i].allocate_stream(sid))
            return
        sid = data.draw(st.sampled_from(live)) if live and data.draw(st.integers(0, 9)) else 99
        run_both(lambda i: getattr(self.atts[i], op + "_stream")(sid))

    # ---- attention: paged ----------------------------------------------------------
    @rule(data=st.data(), batched=st.booleans())
    def prepare(self, data, batched):
        ids = self.draw_cohort(data, self.live())
        frames = self.draw_frames(data, len(ids))
        if batched or not ids:
            run_both(lambda i: self.atts[i].prepare_chunks_batched(ids, frames))
        else:
            n = frames if not isinstance(frames, list) else (frames[0] if frames else None)
            run_both(lambda i: self.atts[i].prepare_chunk(ids[0], n))

    @rule(data=st.data(), batched=st.booleans())
    def commit(self, data, batched):
        ids = self.draw_cohort(data, self.live())
        if data.draw(st.booleans()):  # usually commit what is prepared, or less
            room = []
            for sid in ids:
                info = self.atts[0].describe(sid) if self.atts[0].has_stream(sid) else None
                free = 0 if info is None else len(info.blocks) * self.cfg.block_size_frames - info.cache_seqlen
                room.append(data.draw(st.integers(0, max(0, min(free, self.cfg.chunk_size)))))
            frames = room
        else:
            frames = self.draw_frames(data, len(ids))
        if batched or not ids:
            run_both(lambda i: self.atts[i].commit_chunks_batched(ids, frames))
        else:
            n = frames if not isinstance(frames, list) else (frames[0] if frames else None)
            run_both(lambda i: self.atts[i].commit_chunk_paged(ids[0], n))

    @rule(data=st.data())
    def dense_commit(self, data):
        live = self.live()
        sid = data.draw(st.sampled_from(live)) if live and data.draw(st.integers(0, 9)) else 99
        valid = data.draw(st.integers(0, 9)) > 0
        cs = self.cfg.chunk_size
        frames = data.draw(st.integers(1, cs) if valid else st.sampled_from([0, cs + 1]))
        layers = self.cfg.num_layers + (0 if valid or data.draw(st.booleans()) else 1)
        kv = self.randn(layers, self.cfg.n_kv_head, frames, self.cfg.kv_last_dim)
        run_both(lambda i: self.atts[i].commit(sid, kv))

    @rule(data=st.data())
    def paged_views(self, data):
        ids = self.draw_cohort(data, self.live())
        pad_to = data.draw(st.one_of(st.none(), st.integers(max(len(ids) - 1, 0), len(ids) + 2)))
        views = run_both(lambda i: self.atts[i].get_paged_caches(ids, pad_to))
        if views is not None:
            self.assert_same_views(*views)

    @precondition(lambda self: self.atts[0].stream_ids)
    @rule(data=st.data(), causal=st.booleans(), single=st.booleans())
    def tick(self, data, causal, single):
        """One paged step: prepare, write K/V through the views, attend, commit."""
        cfg = self.cfg
        ids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=4, unique=True))
        frames = data.draw(st.lists(st.integers(0, cfg.chunk_size), min_size=len(ids), max_size=len(ids)))
        if run_both(lambda i: self.atts[i].prepare_chunks_batched(ids, frames)) is None:
            return  # both refused the same way (capacity, pool exhausted)
        pad = data.draw(st.integers(0, 2))
        views = run_both(lambda i: self.atts[i].get_paged_caches(ids, len(ids) + pad))
        self.assert_same_views(*views)
        T = cfg.chunk_size
        lens = frames + data.draw(st.lists(st.integers(0, T), min_size=pad, max_size=pad))
        B, H, D = len(ids) + pad, cfg.n_kv_head, cfg.head_dim
        for layer in range(cfg.num_layers):
            k, v, q = self.randn(B, T, H, D), self.randn(B, T, H, D), self.randn(B, 2 * H, T, D)
            for side in (0, 1):
                append_kv(views[side][layer], k, v, lens)
            out = [paged_attention(q, views[side][layer], lens, causal=causal) for side in (0, 1)]
            assert torch.equal(out[0], out[1])
        committed = [data.draw(st.integers(0, n)) for n in frames]
        if single:
            for sid, n in zip(ids, committed, strict=True):
                run_both(lambda i, sid=sid, n=n: self.atts[i].commit_chunk_paged(sid, n))
        else:
            run_both(lambda i: self.atts[i].commit_chunks_batched(ids, committed))

    @rule(data=st.data())
    def queries(self, data):
        ids = self.draw_cohort(data, self.live())
        n = data.draw(st.one_of(st.none(), st.integers(-1, self.cfg.chunk_size + 1)))
        run_both(lambda i: self.atts[i].cached_frames(ids))
        if ids:
            run_both(lambda i: self.atts[i].cached_frames(ids[0]))
            run_both(lambda i: self.atts[i].at_capacity(ids[0], n))
            run_both(lambda i: self.atts[i].get_paged_state_views(ids[0]))

    # ---- the pool directly --------------------------------------------------------
    @rule(n=st.integers(0, 6))
    def foreign_allocate(self, n):
        got = run_both(lambda i: self.pools[i].allocate(n))
        if got is not None:
            assert got[0] == got[1]
            self.foreign += got[0]

    @precondition(lambda self: self.foreign)
    @rule(data=st.data())
    def foreign_free(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.foreign), min_size=1, unique=True))
        run_both(lambda i: self.pools[i].free(ids))
        self.foreign = [b for b in self.foreign if b not in ids]

    @rule(ids=st.lists(st.integers(-2, 18), min_size=1, max_size=4))
    def bad_free(self, ids):
        """Frees of ids the pool may not own; a success would corrupt a stream, so only errors run."""
        owned = set(self.foreign) | {b for s in self.live() for b in self.atts[0].describe(s).blocks}
        if any(b in owned for b in ids) and len(set(ids)) == len(ids):
            return
        run_both(lambda i: self.pools[i].free(ids))

    # ---- fixed-extent state -------------------------------------------------------
    @rule(
        sid=st.sampled_from(STREAM_IDS),
        which=st.sampled_from(["cnn", "state"]),
        op=st.sampled_from(["allocate_stream", "allocate_stream", "free_stream", "reset_stream", "fill_slot"]),
        value=st.integers(-3, 3),
    )
    def state_lifecycle(self, sid, which, op, value):
        if op == "fill_slot":
            run_both(lambda i: self.states[i].fill_slot(sid, "prompt", value))
        else:
            run_both(lambda i: getattr(getattr(self, which + "s")[i], op)(sid))

    @rule(data=st.data(), which=st.sampled_from(["cnn", "state"]))
    def state_scatter_gather(self, data, which):
        managers = getattr(self, which + "s")
        live = managers[0].slots.stream_ids if which == "state" else managers[0].state.slots.stream_ids
        ids = self.draw_cohort(data, live)
        pad_to = data.draw(st.one_of(st.none(), st.integers(max(len(ids) - 1, 0), len(ids) + 2)))
        rows = max(len(ids), pad_to or 0) + data.draw(st.sampled_from([0, 0, 0, 1]))  # sometimes a bad shape
        if which == "cnn":
            cfg = self.cfg
            new = self.randn(cfg.num_layers, rows, cfg.cnn_cache_frames, cfg.hidden_dim)
            run_both(lambda i: managers[i].update(ids, new, pad_to))
            got = run_both(lambda i: managers[i].get_cache(ids, pad_to))
        else:
            new = {"tail": self.randn(3, rows, 2), "prompt": torch.randint(0, 9, (rows, 1), generator=self.gen)}
            name = data.draw(st.sampled_from(["tail", "prompt", "tail", "prompt", "nope"]))
            value = new.get(name, new["tail"])
            run_both(lambda i: managers[i].view(name, ids, pad_to).scatter(value))
            got = run_both(lambda i: {n: v.gather() for n, v in managers[i].views(ids, pad_to).items()})
            if got is not None:
                got = [torch.cat([g[n].flatten().double() for n in sorted(g)]) for g in got]
        if got is not None:
            assert torch.equal(got[0], got[1])

    # ---- comparisons --------------------------------------------------------------
    def assert_same_views(self, ref_views, fast_views):
        assert len(ref_views) == len(fast_views) == self.cfg.num_layers
        for r, f in zip(ref_views, fast_views, strict=True):
            assert torch.equal(r.block_table, f.block_table)
            assert torch.equal(r.cache_seqlens, f.cache_seqlens)
            assert torch.equal(r.cache_seqstarts, f.cache_seqstarts)
            meta = (r.block_size, r.max_seqlen, r.max_span, r.layer)
            assert meta == (f.block_size, f.max_seqlen, f.max_span, f.layer)
            assert r.block_table.dtype == f.block_table.dtype == torch.int32

    @invariant()
    def twins_agree(self):
        if not hasattr(self, "atts"):
            return
        ref_att, fast_att = self.atts
        ref_pool, fast_pool = self.pools
        assert ref_pool.free_block_ids() == fast_pool.free_block_ids()
        assert ref_pool.num_free_blocks == fast_pool.num_free_blocks
        assert ref_att.stream_ids == fast_att.stream_ids
        assert torch.equal(ref_pool.k_pool, fast_pool.k_pool) and torch.equal(ref_pool.v_pool, fast_pool.v_pool)
        null = fast_pool.null_block
        for sid in ref_att.stream_ids:
            info = ref_att.describe(sid)
            assert fast_att.describe(sid) == info
            assert torch.equal(ref_att.get_stacked_cache(sid), fast_att.get_stacked_cache(sid))
            views = run_both(lambda i, sid=sid: self.atts[i].get_paged_state_views(sid))
            if views is not None:
                for r, f in zip(*views, strict=True):
                    assert torch.equal(r, f)
            # the persistent device row mirrors the stream, prepared or not
            row = list(info.blocks) + [null] * (self.cfg.max_blocks_per_seq - len(info.blocks))
            assert fast_att.block_table[info.slot].tolist() == row
            assert int(fast_att.cache_seqlens[info.slot]) == info.cache_seqlen
            assert int(fast_att.cache_seqstarts[info.slot]) == info.cache_seqstart
        pad = self.cfg.max_batch_size
        assert fast_att.block_table[pad:].eq(null).all()
        assert fast_att.cache_seqlens[pad:].eq(self.cfg.prefill_frames).all()
        assert fast_att.cache_seqstarts[pad:].eq(0).all()
        for ref_m, fast_m in (self.cnns, self.states):
            ref_state = ref_m.state if hasattr(ref_m, "state") else ref_m
            fast_state = fast_m.state if hasattr(fast_m, "state") else fast_m
            assert ref_state.slots.stream_ids == fast_state.slots.stream_ids
            for name in ref_state.buffers:
                assert torch.equal(ref_state.buffers[name], fast_state.buffers[name]), name


TwinMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
TestTwinStateMachine = TwinMachine.TestCase


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("OASR_LONG_PROPERTIES") != "1", reason="set OASR_LONG_PROPERTIES=1 (about a minute)")
def test_twin_state_machine_long():
    """The same machine, ten times longer: run before touching the fast bookkeeping."""
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        TwinMachine,
        settings=settings(
            max_examples=200, stateful_step_count=80, deadline=None, database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
