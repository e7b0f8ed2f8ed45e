"""A query past its row's chunk length returns exactly zero, even when V holds NaN/Inf in range.

The reference skips rows ``t >= chunk_lens[b]`` outright, so they stay 0 whatever
the pool holds. A fast path that computes those rows with probability 0 and then
accumulates ``0 * v`` gets NaN as soon as one visible V value is NaN or Inf
(``0 * NaN = NaN``, ``0 * Inf = NaN``). Every fast path once had this bug; this
file is its regression test, on the torch CPU path, on the fast twin's emulated
kernels, and on every attention kernel in the registry (v1 and v2) through its
launcher, with one split and with the key range split
across CTAs (the combine kernel must also keep such rows at 0).

The visible rows themselves are not checked here (with NaN in V they are NaN,
as in the reference); tests/test_kernels_emulated.py checks their values.
"""

from __future__ import annotations

import pytest
import torch

from oasr.fast import cpu_rows
from oasr.fast import paged_ops as fast
from oasr.fast.kernels import emulation, ops, registry
from oasr.fast.kernels.testing import make_scenario, to_fp8
from oasr.reference import paged_ops as ref

try:
    emulation.emulation_toolchain()
    _NO_EMULATION = None
except emulation.EmulationUnavailable as exc:
    _NO_EMULATION = str(exc)

# Each registered attention kernel's launcher: (executor, q, cache, chunk_lens, scale, causal, num_splits) -> out.
# A kernel registered without one fails test_every_attention_kernel_is_launched.
LAUNCHERS = ops.ATTENTION_LAUNCHERS
ATTENTION_KERNELS = [registry.short_name(k) for k in registry.attention_kernels()]


def _poisoned_scenario(dtype, fp8: bool, seed: int = 7):
    """Rows with chunks shorter than T, and NaN and +-Inf in V inside every row's visible range."""
    s = make_scenario(seed, batch=4, n_kv_head=2, group=2, num_frames=9, head_dim=64, block_size=16,
                      max_history=70, dtype=dtype)  # fmt: skip
    s.chunk_lens[:] = torch.tensor([9, 0, 3, 5], dtype=torch.int32)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    c = s.cache
    poison = (float("nan"), float("inf"), float("-inf"))
    for b in range(c.batch_size):  # one poisoned V vector per row, inside [seqstart, seqlen + len)
        lo, hi = int(c.cache_seqstarts[b]), int(c.cache_seqlens[b]) + int(s.chunk_lens[b])
        if hi > lo:
            pos = (lo + hi) // 2
            c.v_cache[int(c.block_table[b, pos // c.block_size]), pos % c.block_size, b % 2, 5] = poison[b % 3]
    return to_fp8(s) if fp8 else s


def _check_past_length_rows(out, s):
    expect = ref.paged_attention(s.q, s.cache, s.chunk_lens)
    for b, n in enumerate(s.chunk_lens.tolist()):
        tail = out[b, :, n:]
        assert (expect[b, :, n:] == 0).all()  # the oracle's contract
        assert not tail.isnan().any(), f"row {b}: NaN in the {tail.shape[1]} queries past chunk_len={n}"
        assert (tail == 0).all(), f"row {b}: nonzero output past chunk_len={n}"


CASES = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
IDS = ["float32", "bfloat16", "bfloat16-fp8pages"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,fp8", CASES, ids=IDS)
@pytest.mark.parametrize("cpu_path", ["rows", "tiles"])  # both CPU paths of the torch backend (fp8: tiles only)
def test_torch_backend_past_length_rows_are_zero(dtype, fp8, causal, cpu_path, monkeypatch):
    monkeypatch.setattr(cpu_rows, "use_row_loop", lambda cache, rows, T: cpu_path == "rows" and not cache.quantized)
    s = _poisoned_scenario(dtype, fp8)
    _check_past_length_rows(fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, backend="torch"), s)


needs_emulation = pytest.mark.skipif(_NO_EMULATION is not None, reason=f"kernel emulation unavailable: {_NO_EMULATION}")


@needs_emulation
@pytest.mark.parametrize("dtype,fp8", CASES, ids=IDS)
def test_fast_twin_emulated_past_length_rows_are_zero(dtype, fp8):
    s = _poisoned_scenario(dtype, fp8)
    _check_past_length_rows(fast.paged_attention(s.q, s.cache, s.chunk_lens, backend="emulated"), s)


@needs_emulation
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype,fp8", CASES, ids=IDS)
@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
def test_each_attention_kernel_past_length_rows_are_zero(kernel, dtype, fp8, num_splits):
    if kernel not in LAUNCHERS:
        pytest.fail(f"{kernel} is registered but has no launcher: add it to ops.ATTENTION_LAUNCHERS")
    s = _poisoned_scenario(dtype, fp8)
    if not ops.ATTENTION_SERVES[kernel](s.cache, s.q.dtype, s.q.shape[-1]):
        pytest.skip(f"{kernel} does not serve {dtype} queries (it raises ValueError for them)")
    out = LAUNCHERS[kernel](emulation.executor(), s.q, s.cache, s.chunk_lens, 0.125, True, num_splits)
    _check_past_length_rows(out, s)


def test_every_attention_kernel_is_launched():
    assert "paged_chunk_attention_kernel" in ATTENTION_KERNELS  # v1 stays
    missing = sorted(set(ATTENTION_KERNELS) - set(LAUNCHERS) | set(ATTENTION_KERNELS) - set(ops.ATTENTION_SERVES))
    assert not missing, f"registered attention kernels without a launcher in ops.ATTENTION_LAUNCHERS: {missing}"
