"""A state machine for shared pages through random op sequences, over both twins at once.

Ops: admit (with and without a prefix hit), append, a step through ``open_step``, select with
repeated indices, rewind, trim, retire, evict, abandon, reset, finish. After every step: held +
parked + free == total; reference counts == table references (count 0: free or parked); every
row's gathered K/V == an oracle kept as plain per-row token lists (K/V are a pure function of
token and position, so a donor's K/V staying equal to its tokens' after a borrower writes is
checked on every step); the twins are identical. A prefix hit is also compared with a cold
prefill of the same prompt, attention output bit for bit.
Derandomized under CI=true (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from oasr import fast, reference
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest

PAGE = 4
CONFIG = dict(num_layers=2, n_kv_head=2, head_dim=8, page_size=PAGE, max_num_blocks=14, max_rows=4,
              max_self_tokens=16, max_cross_tokens=0)
_KV: dict = {}


def token_kv(tokens, start=0):
    """``(L, T, H, D)`` K and V of ``tokens`` written from position ``start``: a pure function of both."""
    ks, vs = [], []
    for p, t in enumerate(tokens, start):
        if (t, p) not in _KV:
            g = torch.Generator().manual_seed(1000 * t + p)
            _KV[t, p] = (torch.randn(2, 1, 2, 8, generator=g), torch.randn(2, 1, 2, 8, generator=g))
        ks.append(_KV[t, p][0])
        vs.append(_KV[t, p][1])
    if not ks:
        return torch.zeros(2, 0, 2, 8), torch.zeros(2, 0, 2, 8)
    return torch.cat(ks, 1), torch.cat(vs, 1)


def last_query_attention(ops, m, row):
    q = torch.linspace(-1, 1, 32).view(1, 4, 1, 8)
    outs = []
    for view in m.self_caches([row]):
        view = dataclasses.replace(view, cache_seqlens=view.cache_seqlens - 1, prepared_frames=None)
        outs.append(ops.paged_attention(q, view, causal=True))
    return outs


class SharedPagesMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.ms = [reference.DecoderKVCacheManager(DecoderCacheConfig(**CONFIG)),
                   fast.DecoderKVCacheManager(DecoderCacheConfig(**CONFIG))]
        self.tokens: dict[int, list[int]] = {}  # the oracle: each row's tokens
        self.ceiling: dict[int, int] = {}
        self.hits = 0

    def both(self, op: str, *args):
        """Run ``op`` on both twins: both succeed with the same answer, or both raise the same error
        and change nothing."""
        results, errors = [], []
        before = [self.state(m) for m in self.ms]
        for m in self.ms:
            try:
                results.append(getattr(m, op)(*args))
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        assert errors[0] == errors[1], errors
        if errors[0] is not None:
            assert [self.state(m) for m in self.ms] == before
            return None, errors[0]
        assert results[0] == results[1]
        return results[0], None

    @staticmethod
    def state(m):
        return (m.rows, [m.describe(r) for r in m.rows], m.pool.free_block_ids(), m.pool.parked_block_ids(),
                m.pool.ref_counts())

    # ---- ops --------------------------------------------------------------------------------
    @rule(head=st.sampled_from([(), (1, 2, 0, 1), (1, 2, 0, 1, 2, 2, 0, 0)]),
          tail=st.lists(st.integers(0, 2), min_size=1, max_size=6), new=st.integers(0, 5))
    def admit(self, head, tail, new):
        """Prompts start with one of a few shared heads (a task prompt), so prefix hits are common."""
        prompt = (list(head) + tail)[: CONFIG["max_self_tokens"]]
        req = [DecoderRequest(len(prompt), new, 0)]
        if not self.ms[0].can_admit(req):
            assert not self.ms[1].can_admit(req)
            return
        (row,) = self.ms[0].admit(req)
        assert self.ms[1].admit(req) == [row]
        cached, _ = self.both("admit_prompt", row, prompt)
        assert cached % PAGE == 0 and cached < len(prompt)
        self.both("extend", row, *token_kv(prompt[cached:], cached))
        self.tokens[row], self.ceiling[row] = list(prompt), len(prompt) + new
        if cached:  # a prefix hit attends exactly like a cold prefill of the same prompt
            self.hits += 1
            for ops, m in zip((reference, fast), self.ms, strict=True):
                cold = ops.DecoderKVCacheManager(DecoderCacheConfig(**CONFIG))
                (c,) = cold.admit(req)
                cold.prefill(c, *token_kv(prompt))
                for got, want in zip(last_query_attention(ops, m, row), last_query_attention(ops, cold, c),
                                     strict=True):
                    assert torch.equal(got, want)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        growing = [r for r in self.tokens if len(self.tokens[r]) < self.ceiling[r]]
        if not growing:
            return
        rows = data.draw(st.lists(st.sampled_from(growing), min_size=1, unique=True))
        toks = data.draw(st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows)))
        k = torch.cat([token_kv([t], len(self.tokens[r]))[0] for r, t in zip(rows, toks, strict=True)], 1)
        v = torch.cat([token_kv([t], len(self.tokens[r]))[1] for r, t in zip(rows, toks, strict=True)], 1)
        _, err = self.both("append", rows, k, v)
        assert err is None, err
        for r, t in zip(rows, toks, strict=True):
            self.tokens[r].append(t)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append_more(self, data):
        self.append(data)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def open_step(self, data):
        """One token for some rows through ``open_step``'s handle (the fast twin's host plan on a CPU):
        write each layer, attend each layer (both twins agree, and the step's own key is read), commit."""
        growing = [r for r in self.tokens if len(self.tokens[r]) < self.ceiling[r]]
        if not growing:
            return
        rows = data.draw(st.lists(st.sampled_from(growing), min_size=1, unique=True))
        toks = data.draw(st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows)))
        kv = [token_kv([t], len(self.tokens[r])) for r, t in zip(rows, toks, strict=True)]
        q = torch.linspace(-1, 1, 32 * len(rows)).view(len(rows), 4, 1, 8)
        outs = []
        for m in self.ms:
            step = m.open_step(rows)
            got = []
            for layer in range(CONFIG["num_layers"]):
                k = torch.stack([x[0][layer] for x in kv])  # (B, 1, H, D)
                v = torch.stack([x[1][layer] for x in kv])
                step.write(layer, k, v)
                got.append(step.attend(layer, q))
            step.commit()
            outs.append(got)
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for r, t in zip(rows, toks, strict=True):
            self.tokens[r].append(t)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def select(self, data):
        rows = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        idx = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=4))
        out, err = self.both("select", rows, idx)
        if err is not None:
            return
        kept = {r: (list(self.tokens[r]), self.ceiling[r]) for r in rows}
        for r in rows:
            del self.tokens[r], self.ceiling[r]
        for new, i in zip(out, idx, strict=True):
            self.tokens[new], self.ceiling[new] = list(kept[rows[i]][0]), kept[rows[i]][1]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def rewind(self, data):
        row = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(0, len(self.tokens[row])))
        _, err = self.both("rewind", row, n)
        if err is None:
            del self.tokens[row][len(self.tokens[row]) - n :]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def trim(self, data):
        self.both("trim", data.draw(st.sampled_from(sorted(self.tokens))))

    @initialize()
    def a_task_prompt_is_cached(self):
        """Start with the longest shared head published, so hits come from the first admissions on."""
        self.admit((1, 2, 0, 1, 2, 2, 0, 0), [1], 0)
        self.end_row(min(self.tokens), "retire")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def retire(self, data):
        self.end_row(data.draw(st.sampled_from(sorted(self.tokens))), "retire")

    def end_row(self, row, op):
        args = (row, self.tokens[row]) if op == "retire" else (row,)
        _, err = self.both(op, *args)
        assert err is None, err
        del self.tokens[row], self.ceiling[row]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), op=st.sampled_from(["retire", "evict", "abandon", "finish"]))
    def end(self, data, op):
        self.end_row(data.draw(st.sampled_from(sorted(self.tokens))), op)

    @rule(now=st.integers(0, 29))
    def reset(self, now):
        if now != 13:  # rare (hypothesis favours 0): a reset forgets everything the machine has built up
            return
        self.both("reset")
        self.tokens.clear()
        self.ceiling.clear()

    # ---- invariants -------------------------------------------------------------------------------
    @invariant()
    def pages_add_up(self):
        for m in self.ms:
            counts = m.pool.ref_counts()
            refs = Counter()
            for r in m.rows:
                info = m.describe(r)
                refs.update(info.self_blocks + info.cross_blocks)
            assert {b: n for b, n in enumerate(counts) if n} == dict(refs)
            free, parked = set(m.pool.free_block_ids()), set(m.pool.parked_block_ids())
            assert not free & parked and free | parked == {b for b, n in enumerate(counts) if n == 0}
            assert len(refs) + len(parked) + len(free) == m.pool.num_blocks
            assert m.available_blocks >= 0

    @invariant()
    def rows_hold_their_tokens_and_twins_agree(self):
        a, b = self.ms
        assert self.state(a) == self.state(b)
        assert sorted(self.tokens) == a.rows
        for r, toks in self.tokens.items():
            k, v = token_kv(toks)
            want = torch.cat([k, v], dim=-1).transpose(1, 2)
            assert a.length(r) == len(toks)
            assert torch.equal(a.gather_self(r), want) and torch.equal(b.gather_self(r), want)


SharedPagesMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
TestSharedPagesMachine = SharedPagesMachine.TestCase
