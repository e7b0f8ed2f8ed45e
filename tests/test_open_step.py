"""``DecoderKVCacheManager.open_step``: one decode step through a handle, the same in every form.

Three handles are driven by the same op sequence: the reference's (views and its ops), the fast
twin's on the staged path (views and the fast ops) and the fast twin's host plan (``HostStep``, on
a CPU device with model-dtype pages). Pools are poisoned with NaN first, block ids are shuffled,
rows hold different lengths and forked (copy-on-write) pages; the writes must leave identical
bytes and block ids, the reads agree within float tolerance, and bad input is refused before
anything is written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasr import fast, reference
from oasr.decoder.common import ViewStep
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.fast.decoder_cache import beams, sizes
from oasr.fast.decoder_cache.steps import HostStep


def _config(page: int, n_kv_head: int, head_dim: int) -> DecoderCacheConfig:
    return DecoderCacheConfig(num_layers=2, n_kv_head=n_kv_head, head_dim=head_dim, page_size=page,
                              max_num_blocks=64, max_rows=6, max_self_tokens=24, max_cross_tokens=0)


def _managers(config: DecoderCacheConfig, seed: int) -> list:
    staged = fast.DecoderKVCacheManager(config)
    staged._stage_like_cuda()
    managers = [reference.DecoderKVCacheManager(config), staged, fast.DecoderKVCacheManager(config)]
    for m in managers:
        for pool in (m.pool.k_pool, m.pool.v_pool):
            pool.fill_(float("nan"))  # nothing unwritten may be read
        ids = m.pool.allocate(m.pool.num_free_blocks)  # shuffle the free list alike in every manager
        order = np.random.default_rng(seed).permutation(len(ids)).tolist()
        m.pool.free([ids[i] for i in order])
    return managers


def _state(m) -> tuple:
    return (m.rows, [m.describe(r) for r in m.rows], m.pool.free_block_ids(), m.pool.ref_counts())


@pytest.mark.parametrize("few_rows", [0, 8], ids=["numpy-prepare", "scalar-prepare"])
@pytest.mark.parametrize("page,n_kv_head,n_head,head_dim", [(4, 2, 4, 8), (2, 1, 3, 16), (8, 4, 4, 4)])
def test_open_step_handles_agree_on_bytes_ids_and_attention(page, n_kv_head, n_head, head_dim, few_rows,
                                                            monkeypatch):
    """``few_rows``: the fast twin's ``_prepare`` decides in numpy (0) or row by row (a beam's size)."""
    monkeypatch.setattr(sizes, "FEW_ROWS", few_rows)
    config = _config(page, n_kv_head, head_dim)
    managers = _managers(config, seed=page)
    g = torch.Generator().manual_seed(page * 7 + n_head)
    L, H, D = config.num_layers, n_kv_head, head_dim
    prompts = [3, 1, 6]
    groups = []
    for m in managers:
        rows = m.admit([DecoderRequest(n, 24 - n) for n in prompts])
        groups.append(rows)
    prompt_kv = [torch.randn(2, L, n, H, D, generator=g) for n in prompts]
    for m, rows in zip(managers, groups, strict=True):
        for r, (k, v) in zip(rows, prompt_kv, strict=True):
            m.prefill(r, k, v)
    kinds = []
    for step in range(9):
        if step in (2, 5):  # forks: rows sharing partly written pages (the next write copies first)
            groups = [m.select(rows, [2, 0, 0, 1, 2][: 5 if step == 2 else 4]) for m, rows in
                      zip(managers, groups, strict=True)]
        B = len(groups[0])
        k, v = torch.randn(2, L, B, 1, H, D, generator=g)
        q = torch.randn(L, B, n_head, 1, D, generator=g)
        outs = []
        for m, rows in zip(managers, groups, strict=True):
            handle = m.open_step(rows)
            kinds.append(type(handle))
            got = []
            for layer in range(L):
                handle.write(layer, k[layer], v[layer])
                got.append(handle.attend(layer, q[layer]))
            handle.commit()
            outs.append(got)
        for got in outs[1:]:
            for a, b in zip(outs[0], got, strict=True):
                assert not b.isnan().any()
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        states = [_state(m) for m in managers]
        assert states[0] == states[1] == states[2]
        for m in managers[1:]:  # every written byte equal, the NaN poison left where nothing was written
            assert torch.equal(m.pool.k_pool.view(torch.uint8), managers[0].pool.k_pool.view(torch.uint8))
            assert torch.equal(m.pool.v_pool.view(torch.uint8), managers[0].pool.v_pool.view(torch.uint8))
    assert kinds[:3] == [ViewStep, ViewStep, HostStep]


@pytest.mark.parametrize("twin", [reference, fast])
def test_open_step_refuses_bad_tensors_before_writing(twin):
    m = twin.DecoderKVCacheManager(_config(4, 2, 8))
    rows = m.admit([DecoderRequest(1, 6)] * 2)
    good = torch.zeros(2, 1, 2, 8)
    handle = m.open_step(rows)
    before = m.pool.k_pool.clone(), m.pool.v_pool.clone()
    for k in (torch.zeros(2, 1, 2, 4), torch.zeros(3, 1, 2, 8), good.double()):
        with pytest.raises(ValueError):
            handle.write(0, k, good)
        with pytest.raises(ValueError):
            handle.write(0, good, k)
    bad_queries = (torch.zeros(2, 4, 1, 4), torch.zeros(3, 4, 1, 8), torch.zeros(2, 3, 1, 8),
                   torch.zeros(2, 4, 1, 8).double())
    for q in bad_queries:
        with pytest.raises(ValueError):
            handle.attend(0, q)
    assert torch.equal(m.pool.k_pool, before[0]) and torch.equal(m.pool.v_pool, before[1])
    handle.write(0, good, good)
    handle.commit()
    assert m.lengths(rows) == [1, 1]


@pytest.mark.parametrize("how", ["finish", "abandon"])
@pytest.mark.parametrize("twin", [reference, fast])
def test_open_step_commit_of_a_finished_row_is_refused(twin, how):
    m = twin.DecoderKVCacheManager(_config(4, 2, 8))
    rows = m.admit([DecoderRequest(1, 6)] * 2)
    handle = m.open_step(rows)
    getattr(m, how)(rows[1])
    with pytest.raises(KeyError, match="not admitted"):
        handle.commit()
    assert m.lengths(rows[:1]) == [0]


def test_interleaved_steps_of_two_groups_end_as_the_reference():
    """Two groups' steps open at once on one manager: a commit after the other group's (the manager's
    version moved since the plan) takes the checked path; a group's second step crosses into a new
    page, its fourth into a forked one. Lengths, pages and bytes end as the oracle's."""
    config = _config(2, 2, 8)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 6, 2, 2, 2, 1, 2, 8, generator=g)  # (step, group, layer, row, 1, H, D)
    ends = []
    for m in _managers(config, seed=11):
        a, b = m.admit([DecoderRequest(1, 9)] * 2), m.admit([DecoderRequest(1, 9)] * 2)
        for step in range(6):
            if step == 3:
                a = m.select(a, [1, 1])
            ha, hb = m.open_step(a), m.open_step(b)
            for layer in range(2):
                ha.write(layer, k[step, 0, layer], v[step, 0, layer])
                hb.write(layer, k[step, 1, layer], v[step, 1, layer])
            (hb.commit(), ha.commit()) if step % 2 else (ha.commit(), hb.commit())
        ends.append((_state(m), m.lengths(a + b), [m.gather_self(r) for r in a + b]))
    for state, lengths, kv in ends[1:]:
        assert (state, lengths) == ends[0][:2]
        for x, y in zip(kv, ends[0][2], strict=True):
            assert torch.equal(x, y)


def test_open_step_refuses_unknown_rows_and_a_row_at_its_ceiling():
    for twin in (reference, fast):
        m = twin.DecoderKVCacheManager(_config(4, 2, 8))
        (row,) = m.admit([DecoderRequest(1, 0)])
        m.prefill(row, torch.zeros(2, 1, 2, 8), torch.zeros(2, 1, 2, 8))
        with pytest.raises(KeyError):
            m.open_step([row + 1])
        with pytest.raises(ValueError, match="ceiling"):
            m.open_step([row])
        assert m.length(row) == 1


def test_select_cancel_loop_and_numpy_branches_agree(monkeypatch):
    """``select``'s reference cancellation (``_cancel``) by size: the counting loop for a few ids, numpy
    for many. Both drop the first occurrences (an id still reaches 0 at its last place in what remains)
    and leave the same references to take."""
    rng = np.random.default_rng(7)
    for _ in range(400):
        hi = int(rng.integers(1, 40))
        released = rng.integers(0, hi, int(rng.integers(1, 300)))
        taken = rng.integers(0, hi, int(rng.integers(1, 300)))
        results = []
        for few in (0, 10**9):
            monkeypatch.setattr(sizes, "FEW_CANCEL", few)
            results.append(beams._cancel(released, taken))
        (left_a, take_a), (left_b, take_b) = results
        assert left_a.tolist() == left_b.tolist()
        assert sorted(take_a.tolist()) == sorted(take_b.tolist())
        want = list(taken)  # the definition, element by element
        expected = []
        for b in released.tolist():
            if b in want:
                want.remove(b)
            else:
                expected.append(b)
        assert left_b.tolist() == expected and sorted(take_b.tolist()) == sorted(want)


@pytest.mark.parametrize("few_rows", [0, 64], ids=["numpy", "scalar"])
def test_select_and_steps_agree_with_the_reference_in_a_tight_pool(few_rows, monkeypatch):
    """Random beams in a pool too small for every select: the fast twin's bookkeeping in numpy (0) and
    row by row (64: every cohort counts as a few rows) accepts and refuses exactly what the reference
    does (the same message, nothing changed on a refusal) and keeps the same block ids."""
    monkeypatch.setattr(sizes, "FEW_ROWS", few_rows)
    config = DecoderCacheConfig(num_layers=1, n_kv_head=1, head_dim=4, page_size=2, max_num_blocks=40,
                                max_rows=12, max_self_tokens=9, max_cross_tokens=3)
    managers = [reference.DecoderKVCacheManager(config), fast.DecoderKVCacheManager(config)]
    rng = np.random.default_rng(11)
    groups = []
    for m in managers:
        rows = m.admit([DecoderRequest(1, 8, 3)] * 3)
        for r in rows:
            m.fill_cross(r, torch.ones(1, 3, 1, 4), torch.ones(1, 3, 1, 4))
            m.prefill(r, torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
        groups.append(rows)
    refusals = 0
    for _ in range(60):
        width = int(rng.integers(1, 13))
        idx = rng.integers(0, len(groups[0]), width).tolist()
        outcome = []
        for i, m in enumerate(managers):
            before = _state(m)
            try:
                groups[i] = m.select(groups[i], idx)
                outcome.append(None)
            except ValueError as exc:
                assert _state(m) == before
                outcome.append(str(exc))
        assert outcome[0] == outcome[1]
        refusals += outcome[0] is not None
        if all(m.length(r) < 9 for r in groups[0] for m in managers[:1]):
            for i, m in enumerate(managers):
                m.append(groups[i], torch.zeros(1, len(groups[i]), 1, 4), torch.zeros(1, len(groups[i]), 1, 4))
        assert _state(managers[0]) == _state(managers[1])
        if len(groups[0]) > 8 or rng.random() < 0.2:  # shrink again (rows reach their ceilings)
            for i, m in enumerate(managers):
                groups[i] = m.select(groups[i], [0, 1, 2][: min(3, len(groups[i]))])
            for i, m in enumerate(managers):
                for r in groups[i]:
                    if m.length(r) >= 9:
                        m.finish(r)
                groups[i] = [r for r in groups[i] if r in m.rows]
            if not groups[0]:
                for i, m in enumerate(managers):
                    groups[i] = m.admit([DecoderRequest(1, 8, 3)] * 3)
                    for r in groups[i]:
                        m.fill_cross(r, torch.ones(1, 3, 1, 4), torch.ones(1, 3, 1, 4))
                        m.prefill(r, torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
    assert refusals > 0  # the pool was tight enough to refuse
