"""A hypothesis state machine over one twin's AttentionCacheManager.

Long random sequences of allocate / prepare / commit / dense commit / free /
reset; after every step the invariants hold:
  * no block is owned twice; owned + free + scratch == every pool block;
  * each stream's table columns [0, n) are its blocks, the rest the null block;
  * 0 <= seqstart <= seqlen <= n * block_size, blocks <= blocks_per_stream,
    and with eviction the visible history is exactly min(total, W) frames;
  * failed calls (random invalid ops are mixed in) change nothing.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import oasr
from tests.conftest import assert_same_snapshot, load_twin, snapshot

GEOMETRIES = [
    dict(chunk_size=4, block_size_frames=4, num_left_chunks=2),
    dict(chunk_size=6, block_size_frames=4, num_left_chunks=1),
    dict(chunk_size=3, block_size_frames=8, num_left_chunks=2),
    dict(chunk_size=4, block_size_frames=2, num_left_chunks=-1, max_num_blocks=40),
    dict(chunk_size=4, block_size_frames=4, num_left_chunks=2, prefill_kv_window=True),
]


def make_machine(twin_name):
    class CacheMachine(RuleBasedStateMachine):
        @initialize(geometry=st.sampled_from(GEOMETRIES))
        def setup(self, geometry):
            twin = load_twin(twin_name)
            fields = dict(num_layers=1, n_kv_head=1, head_dim=2, hidden_dim=4, kernel_size=2,
                          max_num_blocks=48, max_batch_size=4, max_blocks_per_seq=12)
            fields.update(geometry)
            self.cfg = oasr.CacheConfig(**fields)
            self.pool = twin.BlockPool(self.cfg)
            self.att = twin.AttentionCacheManager(self.pool, self.cfg, pad_lanes=1)
            self.next_id = 0
            self.total = {}

        def ids(self):
            return self.att.stream_ids

        @rule()
        def allocate(self):
            sid = self.next_id
            self.next_id += 1
            before = snapshot(self.pool, self.att)
            try:
                self.att.allocate_stream(sid)
                self.total[sid] = 0
            except (oasr.SlotsExhaustedError, oasr.PoolExhaustedError):
                assert_same_snapshot(before, snapshot(self.pool, self.att))

        @precondition(lambda self: self.att.stream_ids)
        @rule(data=st.data(), frames=st.integers(0, 8), batched=st.booleans())
        def prepare(self, data, frames, batched):
            ids = data.draw(st.lists(st.sampled_from(self.ids()), min_size=1, max_size=4, unique=True))
            frames = min(frames, self.cfg.chunk_size)
            before = snapshot(self.pool, self.att)
            try:
                if batched:
                    self.att.prepare_chunks_batched(ids, frames)
                else:
                    self.att.prepare_chunk(ids[0], frames)
            except (oasr.PoolExhaustedError, oasr.StreamCapacityError):
                assert_same_snapshot(before, snapshot(self.pool, self.att))

        @precondition(lambda self: self.att.stream_ids)
        @rule(data=st.data(), frames=st.integers(0, 8))
        def commit(self, data, frames):
            sid = data.draw(st.sampled_from(self.ids()))
            frames = min(frames, self.cfg.chunk_size)
            info = self.att.describe(sid)
            room = len(info.blocks) * self.cfg.block_size_frames - info.cache_seqlen
            if frames and room >= frames:  # write recognisable K first, then commit
                self.att.commit_chunk_paged(sid, frames)
                self.total[sid] += frames
            else:
                before = snapshot(self.pool, self.att)
                if frames > room:
                    with pytest.raises(ValueError):
                        self.att.commit_chunk_paged(sid, frames)
                    assert_same_snapshot(before, snapshot(self.pool, self.att))

        @precondition(lambda self: self.att.stream_ids)
        @rule(data=st.data(), frames=st.integers(1, 8))
        def dense_commit(self, data, frames):
            sid = data.draw(st.sampled_from(self.ids()))
            frames = min(frames, self.cfg.chunk_size)
            kv = torch.randn(1, 1, frames, 4)
            before = snapshot(self.pool, self.att)
            try:
                self.att.commit(sid, kv)
                self.total[sid] += frames
                assert torch.equal(self.att.get_stacked_cache(sid)[:, :, -frames:], kv)
            except (oasr.PoolExhaustedError, oasr.StreamCapacityError):
                assert_same_snapshot(before, snapshot(self.pool, self.att))

        @precondition(lambda self: self.att.stream_ids)
        @rule(data=st.data())
        def free(self, data):
            sid = data.draw(st.sampled_from(self.ids()))
            self.att.free_stream(sid)
            del self.total[sid]

        @precondition(lambda self: self.att.stream_ids)
        @rule(data=st.data())
        def reset(self, data):
            sid = data.draw(st.sampled_from(self.ids()))
            self.att.reset_stream(sid)
            self.total[sid] = 0

        @rule(sid=st.integers(1000, 1002))
        def unknown_id_changes_nothing(self, sid):
            before = snapshot(self.pool, self.att)
            with pytest.raises(KeyError):
                self.att.prepare_chunk(sid)
            assert_same_snapshot(before, snapshot(self.pool, self.att))

        @invariant()
        def blocks_are_conserved(self):
            if not hasattr(self, "att"):
                return
            owned = [b for sid in self.ids() for b in self.att.describe(sid).blocks]
            free = self.pool.free_block_ids()
            assert len(set(owned)) == len(owned)
            assert sorted(owned + free) == list(range(self.cfg.max_num_blocks))
            assert self.pool.null_block not in owned

        @invariant()
        def tables_and_lengths_are_consistent(self):
            if not hasattr(self, "att"):
                return
            cfg = self.cfg
            for sid in self.ids():
                info = self.att.describe(sid)
                n = len(info.blocks)
                assert 0 <= info.cache_seqstart <= info.cache_seqlen <= max(n * cfg.block_size_frames,
                                                                          cfg.prefill_frames)
                assert n <= cfg.blocks_per_stream
                assert info.total_frames == self.total[sid]
                if cfg.eviction:
                    visible = info.cache_seqlen - info.cache_seqstart
                    assert visible == min(self.total[sid] + cfg.prefill_frames, cfg.history_frames)
                try:
                    table, lens, starts = self.att.get_paged_state_views(sid)
                except RuntimeError:
                    continue
                row = table[0].tolist()
                assert row[:n] == list(info.blocks)
                assert all(b == self.pool.null_block for b in row[n:])
                assert lens.tolist() == [info.cache_seqlen] and starts.tolist() == [info.cache_seqstart]

    CacheMachine.TestCase.settings = settings(
        max_examples=25, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return CacheMachine


TestReferenceMachine = make_machine("reference").TestCase
TestFastMachine = make_machine("fast").TestCase
