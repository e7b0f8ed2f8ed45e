"""The relative-position term in the attention kernels (v1, v3) under the host emulation, against the reference.

Every case is a ``make_scenario`` cohort (a shuffled block table, NaN in every pool slot nothing may
read, rows with empty histories, empty chunks and starts inside a block) with its chunk appended,
and a ``rel_bias`` table whose every entry no valid query reads is NaN (``poisoned_bias``): a stray
read of either shows up as NaN in the output. v1 is held to fp32 round-off, v3 to the tensor-core
bound of the suite without the term (``testing.v2_bound``); fp8 and the other formats compare with
the reference on the same quantized pages.
"""

from __future__ import annotations

import math

import pytest
import torch

from oasr.cache.rel_bias import required_columns
from oasr.fast import paged_ops as fast
from oasr.fast.kernels import emulation, ops, registry
from oasr.fast.kernels.testing import (
    emulated_attention,
    make_scenario,
    to_format,
    to_fp8,
    v2_bound,
    with_abs_v,
)
from oasr.reference import paged_ops as ref
from tests.test_rel_bias import poisoned_bias, with_stream_starts

FP32_FLOOR = 1e-5  # fp32 round-off of the kernels' summation order (as tests/test_kernels_emulated.py)


@pytest.fixture(scope="module")
def emu():
    try:
        emulation.build(["paged_chunk_attention", "paged_chunk_attention_v3", "paged_kv_append"])
    except emulation.EmulationUnavailable as exc:  # the prefix makes it a failure under OASR_REQUIRE_KERNELS=1
        pytest.skip(f"kernel emulation unavailable: {exc}")
    return emulation.executor()


def case(seed, *, pages=None, dtype=torch.float32, batch=3, n_kv_head=2, group=2, num_frames=5, head_dim=64,
         block_size=16, max_history=40, causal=False, extra_columns=0):
    """A scenario with its chunk appended by the reference, over ``pages`` (None, "fp8_e4m3" or a format),
    and its poisoned table of the least width (plus ``extra_columns``)."""
    s = make_scenario(seed, batch=batch, n_kv_head=n_kv_head, group=group, num_frames=num_frames,
                      head_dim=head_dim, block_size=block_size, max_history=max_history, dtype=dtype)
    if pages == "fp8_e4m3":
        s = to_fp8(s)
    elif pages is not None:
        s = to_format(s, pages, dtype)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    bias = poisoned_bias(s, required_columns(s.cache.max_span, num_frames) + extra_columns, seed, causal)
    return s, bias


def run(version, s, bias, causal, num_splits=None):
    lens = s.chunk_lens.to(torch.int32)
    scale = s.q.shape[-1] ** -0.5
    return ops.paged_attention(emulation.executor(), s.q, s.cache, lens, scale, causal, num_splits, version=version,
                               rel_bias=bias)


def check_v1(out, expected):
    assert not out.isnan().any()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    else:  # one rounding of an fp32 result that differs from the reference's in its last bits
        step = 2.0**-8 if out.dtype == torch.bfloat16 else 2.0**-11
        assert ((out.float() - expected.float()).abs() <= 2 * step * (expected.float().abs() + 1e-3) + 1e-5).all()


def check_v3(out, s, bias, causal):
    """v3 against the fp32 reference on the same pages, within the tensor-core bound."""
    ref32 = ref.paged_attention(s.q.float(), _as_fp32(s.cache), s.chunk_lens, causal=causal, rel_bias=bias)
    abs_v = ref.paged_attention(s.q.float(), with_abs_v(_as_fp32(s.cache)), s.chunk_lens, causal=causal,
                                rel_bias=bias)
    assert not out.isnan().any()
    bound = v2_bound(ref32, abs_v, out.dtype, s.cache.quantized, FP32_FLOOR)
    excess = (out.float() - ref32).abs() - bound
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3g}"


def _as_fp32(cache):
    """The same pages as the reference reads them with fp32 queries (model-dtype pages upcast)."""
    from dataclasses import replace

    if cache.quantized:
        return replace(cache, model_dtype=torch.float32)
    return replace(cache, k_cache=cache.k_cache.float(), v_cache=cache.v_cache.float())


V1_CASES = [  # dtype, pages, head_dim, group, T, block_size, max_history, batch
    (torch.float32, None, 64, 2, 5, 16, 40, 3),
    (torch.float32, None, 128, 1, 14, 8, 70, 2),  # Nemotron: head_dim 128, chunk of lookahead 13 + 1
    (torch.float16, None, 64, 4, 1, 4, 23, 4),  # one query frame, MQA-like grouping
    (torch.bfloat16, None, 128, 2, 7, 32, 90, 3),
    (torch.float32, "fp8_e4m3", 64, 2, 6, 16, 50, 3),
    (torch.bfloat16, "fp8_e4m3", 128, 1, 14, 16, 70, 2),
    (torch.float16, "int8", 64, 2, 4, 8, 30, 3),
    (torch.bfloat16, "q8_0", 128, 2, 3, 16, 35, 2),
    (torch.float32, "affine4", 64, 1, 5, 4, 20, 3),
]


@pytest.mark.parametrize("dtype,pages,head_dim,group,T,bs,hist,batch", V1_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_v1_matches_reference(emu, dtype, pages, head_dim, group, T, bs, hist, batch, causal):
    for seed in range(2):
        s, bias = case(seed, pages=pages, dtype=dtype, batch=batch, group=group, num_frames=T, head_dim=head_dim,
                       block_size=bs, max_history=hist, causal=causal, extra_columns=3 * seed)
        expected = ref.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, rel_bias=bias)
        check_v1(run("v1", s, bias, causal), expected)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_v1_split_keys(emu, num_splits):
    s, bias = case(3, max_history=120, num_frames=6)
    expected = ref.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=bias)
    check_v1(run("v1", s, bias, False, num_splits), expected)


V3_CASES = [  # dtype, pages, head_dim, group, T, block_size, max_history, batch, num_splits
    (torch.bfloat16, None, 64, 2, 5, 16, 40, 3, None),
    (torch.float16, None, 128, 1, 14, 8, 70, 2, None),
    (torch.bfloat16, None, 128, 2, 7, 32, 90, 3, 3),
    (torch.float16, "fp8_e4m3", 64, 4, 3, 16, 50, 3, None),
    (torch.bfloat16, "fp8_e4m3", 128, 1, 14, 64, 120, 2, 2),
]


@pytest.mark.parametrize("dtype,pages,head_dim,group,T,bs,hist,batch,num_splits", V3_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_v3_matches_reference(emu, dtype, pages, head_dim, group, T, bs, hist, batch, num_splits, causal):
    s, bias = case(11, pages=pages, dtype=dtype, batch=batch, group=group, num_frames=T, head_dim=head_dim,
                   block_size=bs, max_history=hist, causal=causal)
    check_v3(run("v3", s, bias, causal, num_splits), s, bias, causal)


def test_fast_twin_emulated_matches_reference(emu):
    """Through the fast twin's own dispatch (backend="emulated": v1), chunk_lens as a list."""
    s, bias = case(4, dtype=torch.float32, group=2, num_frames=4, max_history=33)
    expected = ref.paged_attention(s.q, s.cache, s.chunk_lens.tolist(), rel_bias=bias)
    out = fast.paged_attention(s.q, s.cache, s.chunk_lens.tolist(), rel_bias=bias, backend="emulated")
    check_v1(out, expected)


def test_term_equals_a_zero_table_exactly_in_v1(emu):
    """A zero table adds exact zeros in v1: the same bits as the kernel without the term."""
    s, _ = case(2, dtype=torch.float32)
    zeros = torch.zeros(*s.q.shape[:3], required_columns(s.cache.max_span, s.q.shape[2]))
    plain = emulated_attention("v1", s.q, s.cache, s.chunk_lens, num_splits=1)
    assert torch.equal(run("v1", s, zeros, False, 1), plain)


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_short_table_under_a_stale_max_span_gives_nan_not_a_wild_read(emu, version):
    """The launcher reads no lengths: a table too short for a row's real window (a view whose max_span
    understates it) makes that row's output NaN; the rows it fits are unaffected."""
    from dataclasses import replace

    dtype = torch.float32 if version == "v1" else torch.bfloat16
    s, _ = case(6, dtype=dtype, batch=3, num_frames=4, max_history=30)
    c = s.cache
    spans = (c.cache_seqlens - c.cache_seqstarts).tolist()
    assert int(s.chunk_lens[0]) == 4  # row 0 has a full chunk (make_scenario)
    short = spans[0] + 2 * 4 - 2  # one column short for row 0's last query and its oldest key
    bias = torch.randn(3, s.q.shape[1], 4, short)
    out = run(version, replace(s, cache=replace(c, max_span=0)), bias, False)
    assert out[0, :, 3].isnan().all()
    fits = [b for b in range(3) if spans[b] + 2 * 4 - 1 <= short]
    for b in fits:
        assert not out[b].isnan().any()


def test_refusals(emu):
    s, bias = case(1, dtype=torch.bfloat16, block_size=16)
    with pytest.raises(ValueError, match="v2 has no relative-position term"):
        run("v2", s, bias, False)
    with pytest.raises(ValueError, match="float32"):
        run("v1", s, bias.double(), False)
    with pytest.raises(ValueError, match=r"needs R >= 9"):  # 2T - 1 with T = 5: the launcher's least
        run("v1", s, bias[..., :8].contiguous(), False)
    # the twin holds the table to the rows' real widest history (here on the host)
    need = required_columns(int((s.cache.cache_seqlens - s.cache.cache_seqstarts).max()), 5)
    with pytest.raises(ValueError, match=f"needs R >= {need}"):
        fast.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=bias[..., : need - 1], backend="emulated")


def test_version_choice_with_the_term():
    class Cuda:
        kind = "cuda"

    s = make_scenario(0, batch=2, n_kv_head=1, group=1, num_frames=2, head_dim=64, block_size=16, max_history=5,
                      dtype=torch.bfloat16)
    assert ops.choose_attention_version(Cuda(), s.cache, torch.bfloat16, 64, rel=True) in ops.REL_VERSIONS
    assert ops.choose_attention_version(Cuda(), s.cache, torch.float32, 64, rel=True) == "v1"
    # every instance with the term has its twin without it, and v1 and v3 have one for every instance
    for name in ("paged_chunk_attention_kernel", "paged_chunk_attention_v3_kernel"):
        instances = set(registry.BY_NAME[name].instances)
        plain = {a for a in instances if a[-1] != registry.REL_ARG}
        assert {(*a, registry.REL_ARG) for a in plain} == instances - plain
    assert all(a[-1] != registry.REL_ARG for a in registry.BY_NAME["paged_chunk_attention_v2_kernel"].instances)


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_shifted_table_positions_give_the_same_result(emu, version):
    """Eviction moves table positions by whole blocks; the distances, and so the output, stay."""
    from dataclasses import replace

    dtype = torch.float32 if version == "v1" else torch.float16
    s, bias = case(8, dtype=dtype, block_size=16, max_history=37)
    c = s.cache
    moved = replace(c, block_table=torch.cat([c.block_table[:, :1], c.block_table], dim=1),
                    cache_seqlens=c.cache_seqlens + 16, cache_seqstarts=c.cache_seqstarts + 16,
                    max_seqlen=c.max_seqlen + 16)
    assert torch.equal(run(version, s, bias, False), run(version, replace(s, cache=moved), bias, False))
    assert math.isfinite(float(run(version, s, bias, False).float().sum()))


@pytest.mark.parametrize("version,dtype,pages", [("v1", torch.float32, None), ("v1", torch.bfloat16, "fp8_e4m3"),
                                                 ("v3", torch.bfloat16, None), ("v3", torch.float16, "fp8_e4m3")])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_minus_infinity_entries_hide_keys(emu, version, dtype, pages, num_splits):
    """The Nemotron encoder's table: -inf at the distances that reach into the zeroed prefill (whole key
    tiles, whole splits of a row can be -inf)."""
    s, bias = case(9, pages=pages, dtype=dtype, batch=4, group=2, num_frames=6, head_dim=128, block_size=16,
                   max_history=100)
    bias = with_stream_starts(s, bias, 9)
    out = run(version, s, bias, False, num_splits)
    if version == "v1":
        check_v1(out, ref.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=bias))
    else:
        check_v3(out, s, bias, False)
