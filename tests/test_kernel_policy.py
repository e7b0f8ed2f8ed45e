"""Kernel gaps are counted, never hidden: declared gaps served and counted, undeclared ones raise."""

from __future__ import annotations

import logging

import pytest
import torch

from oasr import fast, reference
from oasr.commands import kernels as kernels_command
from oasr.fast import kernel_policy
from oasr.fast.kernel_policy import KERNEL_GAPS, KernelGapError, KernelSlower, format_gap_report
from oasr.fast.kernels.testing import make_scenario


@pytest.fixture(autouse=True)
def fresh_counts():
    kernel_policy.reset_counts()
    yield
    kernel_policy.reset_counts()


def scenario(head_dim):
    s = make_scenario(3, batch=3, n_kv_head=2, group=2, num_frames=4, head_dim=head_dim, block_size=4,
                      max_history=9)
    reference.append_kv(s.cache, s.k, s.v, s.chunk_lens)  # the chunk's own keys, then attention reads no NaN
    return s


def test_declared_gap_is_served_by_torch_and_counted():
    """head_dim 16: the kernels tile 64 / 128 only. In scope (the emulated kernels), declared: served, counted."""
    s = scenario(16)
    want = reference.paged_attention(s.q, s.cache, s.chunk_lens)
    for calls in (1, 2):
        got = fast.paged_attention(s.q, s.cache, s.chunk_lens, backend="emulated")
        assert torch.equal(got, want)
        assert kernel_policy.gaps["paged-attention-head-dim"] == calls
    report = format_gap_report()
    assert "paged-attention-head-dim  [paged_attention]  calls: 2" in report
    assert "closed by: oasr/kernels_cu/paged_chunk_attention" in report


def test_undeclared_gap_raises(monkeypatch):
    monkeypatch.setattr(kernel_policy, "KERNEL_GAPS", {})
    s = scenario(16)
    with pytest.raises(KernelGapError, match="not declared in oasr.fast.kernel_policy.KERNEL_GAPS"):
        fast.paged_attention(s.q, s.cache, s.chunk_lens, backend="emulated")
    assert not kernel_policy.gaps


def test_out_of_scope_is_reported_once_and_counted(caplog):
    s = scenario(16)
    with caplog.at_level(logging.INFO, logger="oasr.fast"):
        for _ in range(3):
            fast.paged_attention(s.q, s.cache, s.chunk_lens, backend="torch")
    assert kernel_policy.out_of_scope["paged_attention on cpu"] == 3
    assert not kernel_policy.gaps  # out of scope is not debt
    lines = [r for r in caplog.records if "out of scope" in r.getMessage()]
    assert len(lines) <= 1  # reported once per process (an earlier test may have reported it already)
    assert "paged_attention on cpu: 3 calls" in format_gap_report()


def test_slower_is_a_separate_count(monkeypatch):
    with pytest.raises(KeyError, match="not declared in KERNEL_SLOWER"):
        kernel_policy.serve_slower("tiny-gather", "gather_kv_blocks")
    entry = KernelSlower("tiny-gather", "gather_kv_blocks", "fewer than 4 blocks", "a test's number")
    monkeypatch.setitem(kernel_policy.KERNEL_SLOWER, entry.name, entry)
    kernel_policy.serve_slower("tiny-gather", "gather_kv_blocks")
    assert kernel_policy.slower["tiny-gather"] == 1 and not kernel_policy.gaps
    assert "tiny-gather  [gather_kv_blocks]  calls: 1" in format_gap_report()


def test_a_gap_cannot_be_captured():
    with pytest.raises(KernelGapError, match="during CUDA graph capture"):
        kernel_policy.serve_gap("paged-attention-head-dim", "paged_attention", "head_dim=16", capturing=True)
    assert not kernel_policy.gaps


def test_a_gap_declared_for_another_op_does_not_cover_this_one():
    with pytest.raises(KernelGapError):
        kernel_policy.serve_gap("paged-attention-head-dim", "append_kv", "anything")


def test_cli_prints_the_report(capsys):
    assert kernels_command.main(["--gaps"]) == 0
    out = capsys.readouterr().out
    for gap in KERNEL_GAPS.values():
        assert gap.name in out and gap.missing in out


def test_docs_carry_the_report():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    assert "python -m oasr kernels --gaps" in text
    for gap in KERNEL_GAPS.values():
        assert gap.name in text
