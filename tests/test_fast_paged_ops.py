"""The fast twin's CPU path (vectorised torch) against the reference, and backend selection.

Same scenarios as the kernel tests (shuffled block tables, NaN-poisoned pools;
see oasr.fast.kernels.testing) but many more of them, since no kernel is
emulated here: hypothesis draws the geometry.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oasr.fast import backend as fast_backend
from oasr.fast import cpu_rows
from oasr.fast import paged_ops as fast
from oasr.fast.kernels.testing import bits, low_precision_bound, make_scenario, written_slots
from oasr.reference import paged_ops as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Vectorised torch runs the same fp32 math as the reference over a padded key
# axis (padding has p = 0 exactly); measured differences are ~1e-6 relative at
# most, so the floor is the same as for the kernels.
FP32_FLOOR = 1e-5

geometries = st.fixed_dictionaries(
    dict(
        batch=st.integers(1, 5),
        n_kv_head=st.integers(1, 3),
        group=st.sampled_from([1, 2, 3, 4]),
        num_frames=st.integers(1, 24),
        head_dim=st.sampled_from([8, 32, 64, 80, 128]),
        block_size=st.sampled_from([1, 3, 8, 16, 24, 32, 64]),
        max_history=st.integers(0, 200),
        dtype=st.sampled_from(DTYPES),
    )
)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["rows", "tiles", "by_size"], autouse=True)
def cpu_path(request):
    """Every test here runs on each CPU path of the torch backend: the row loop, the vectorised
    row tiles, and the dispatch by size (oasr.fast.cpu_rows.use_row_loop) that picks one."""
    if request.param == "by_size":
        yield request.param
        return
    with mock.patch.object(cpu_rows, "use_row_loop", lambda cache, rows, T: request.param == "rows"):
        yield request.param


@SETTINGS
@given(geo=geometries, seed=st.integers(0, 2**16))
def test_append_matches_reference_bitwise(geo, seed):
    s = make_scenario(seed, **geo)
    want, got = s.clone(), s.clone()
    ref.append_kv(want.cache, s.k, s.v, s.chunk_lens)
    fast.append_kv(got.cache, s.k, s.v, s.chunk_lens, backend="torch")
    assert torch.equal(bits(got.cache.k_cache), bits(want.cache.k_cache))
    assert torch.equal(bits(got.cache.v_cache), bits(want.cache.v_cache))
    untouched = ~written_slots(s)
    assert torch.equal(bits(got.cache.v_cache)[untouched], bits(s.cache.v_cache)[untouched])


@SETTINGS
@given(
    geo=geometries, seed=st.integers(0, 2**16), causal=st.booleans(), lens_as=st.sampled_from(["tensor", "list", None])
)
def test_attention_matches_reference(geo, seed, causal, lens_as):
    s = make_scenario(seed, **geo)
    if lens_as is None:  # every row's chunk is full: append all T frames too
        s.chunk_lens.fill_(s.q.shape[2])
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    lens = {"tensor": s.chunk_lens, "list": s.chunk_lens.tolist(), None: None}[lens_as]
    out = fast.paged_attention(s.q, s.cache, lens, causal=causal, backend="torch")
    s32 = s.to(torch.float32)
    ref32 = ref.paged_attention(s32.q, s32.cache, lens, causal=causal)
    assert out.dtype == s.q.dtype and out.shape == s.q.shape
    assert not out.isnan().any()
    if out.dtype == torch.float32:
        bound = FP32_FLOOR * (1 + ref32.abs())
    else:
        # The reference on the low-precision inputs computes in fp32 and rounds
        # once; so does this path. See low_precision_bound for why 2x + floor.
        bound = low_precision_bound(ref32, ref.paged_attention(s.q, s.cache, lens, causal=causal), FP32_FLOOR)
    assert ((out.float() - ref32).abs() <= bound).all()


decode_geometries = st.fixed_dictionaries(
    dict(
        batch=st.integers(2, 9),
        n_kv_head=st.integers(1, 3),
        group=st.sampled_from([1, 2, 4]),
        num_frames=st.just(1),
        head_dim=st.sampled_from([8, 16, 64]),
        block_size=st.sampled_from([1, 4, 16]),
        max_history=st.integers(0, 100),
        dtype=st.sampled_from(DTYPES),
    )
)


@SETTINGS
@given(geo=decode_geometries, seed=st.integers(0, 2**16), causal=st.booleans(), starts=st.booleans(),
       full=st.booleans())
def test_decode_steps_match_reference(geo, seed, causal, starts, full):
    """One query per row over short spans (the decoder's steps, ``cpu_rows.attend_decode_batch`` and the
    one-gather write): shuffled tables, NaN-poisoned pools, rows without a query, starts past 0."""
    s = make_scenario(seed, with_seqstarts=starts, **geo)
    if full:
        s.chunk_lens.fill_(1)
    assert cpu_rows.use_decode_batch(s.cache, geo["batch"], 1)
    want = s.clone()
    lens = None if full else s.chunk_lens
    ref.append_kv(want.cache, s.k, s.v, lens)
    fast.append_kv(s.cache, s.k, s.v, lens, backend="torch")
    assert torch.equal(bits(s.cache.k_cache), bits(want.cache.k_cache))
    assert torch.equal(bits(s.cache.v_cache), bits(want.cache.v_cache))
    out = fast.paged_attention(s.q, s.cache, lens, causal=causal, backend="torch")
    s32 = s.to(torch.float32)
    ref32 = ref.paged_attention(s32.q, s32.cache, lens, causal=causal)
    assert out.dtype == s.q.dtype and not out.isnan().any()
    if out.dtype == torch.float32:
        bound = FP32_FLOOR * (1 + ref32.abs())
    else:
        bound = low_precision_bound(ref32, ref.paged_attention(s.q, s.cache, lens, causal=causal), FP32_FLOOR)
    assert ((out.float() - ref32).abs() <= bound).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geo=geometries, seed=st.integers(0, 2**16), causal=st.booleans(), group_bytes=st.sampled_from([1, 3000]))
def test_attention_in_row_tiles_equals_one_pass(geo, seed, causal, group_bytes):
    """Large cohorts run in row tiles sized to stay in cache; force tiny tiles and compare with the
    one-pass result: each row's arithmetic is the same, only the padding width (padded keys add
    exact zeros) and the matmul's batch shape differ, so they agree to fp32 rounding (in fp32) and
    to one ulp of a low-precision output dtype."""
    s = make_scenario(seed, **geo)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    whole = fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, backend="torch")
    with mock.patch.object(fast, "_CPU_GROUP_BYTES", group_bytes):
        tiled = fast.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, backend="torch")
    # fp32 rounding differences, then one rounding to the output dtype: at most one ulp of that dtype.
    # In fp32 itself the bound is the reordered sums: a padded width changes the matmuls' blocking, and
    # an output near 0 that sums ~60 terms of magnitude ~1 moves by ~1e-6 (found at head_dim 128,
    # 59 keys: 1.4e-6), so 1e-5 there
    ulp = max(torch.finfo(s.q.dtype).eps, 1e-5)
    torch.testing.assert_close(tiled.float(), whole.float(), rtol=ulp, atol=ulp)


def test_attention_softmax_scale_and_strided_table():
    s = make_scenario(1, batch=3, n_kv_head=2, group=2, num_frames=8, head_dim=64, block_size=16,
                      max_history=60)  # fmt: skip
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    table = s.cache.block_table
    wide = torch.full((table.shape[0], table.shape[1] + 5), -7, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    strided = replace(s.cache, block_table=wide[:, : table.shape[1]])
    out = fast.paged_attention(s.q, strided, s.chunk_lens, softmax_scale=0.05, backend="torch")
    want = ref.paged_attention(s.q, s.cache, s.chunk_lens, softmax_scale=0.05)
    assert ((out - want).abs() <= FP32_FLOOR * (1 + want.abs())).all()


@pytest.mark.parametrize("op", ["append_kv", "paged_attention"])
@pytest.mark.parametrize("bad", [[-1, 2], [2, 9]])
def test_chunk_lens_errors_match_reference(op, bad):
    s = make_scenario(2, batch=2, n_kv_head=1, group=1, num_frames=4, head_dim=8, block_size=4, max_history=8)
    args = (s.cache, s.k, s.v) if op == "append_kv" else (s.q, s.cache)
    with pytest.raises(ValueError) as want:
        getattr(ref, op)(*args, bad)
    with pytest.raises(ValueError) as got:
        getattr(fast, op)(*args, bad, backend="torch")
    assert str(got.value) == str(want.value)


def test_shape_errors_match_reference():
    s = make_scenario(2, batch=2, n_kv_head=2, group=1, num_frames=4, head_dim=8, block_size=4, max_history=8)
    for call in (
        lambda m: m.append_kv(s.cache, s.k[:, :, :1], s.v[:, :, :1]),
        lambda m: m.paged_attention(s.q[:, :1], s.cache),
        lambda m: m.paged_attention(s.q, s.cache, [1, 2, 3]),
    ):
        with pytest.raises(ValueError) as want:
            call(ref)
        with pytest.raises(ValueError) as got:
            call(fast)
        assert str(got.value) == str(want.value)


# -- gather_kv_blocks ------------------------------------------------------------------------------


@SETTINGS
@given(
    L=st.integers(1, 3),
    Hkv=st.integers(1, 3),
    D=st.sampled_from([8, 64, 128]),
    bs=st.sampled_from([1, 8, 16, 64]),
    n_blocks=st.integers(1, 5),
    data=st.data(),
)
def test_gather_matches_plain_gather(L, Hkv, D, bs, n_blocks, data):
    NB = n_blocks + 3
    ids = torch.randperm(NB)[:n_blocks].to(torch.int32)
    start = data.draw(st.integers(0, n_blocks * bs))
    T = data.draw(st.integers(0, n_blocks * bs - start))
    k_pool, v_pool = torch.randn(2, L, NB, bs, Hkv, D).unbind(0)
    got = fast.gather_kv_blocks(k_pool, v_pool, ids, start, T, backend="torch")
    assert got.shape == (L, Hkv, T, 2 * D)
    for f in range(T):
        block, off = int(ids[(start + f) // bs]), (start + f) % bs
        assert torch.equal(got[:, :, f, :D], k_pool[:, block, off])
        assert torch.equal(got[:, :, f, D:], v_pool[:, block, off])


def test_gather_rejects_bad_arguments():
    k_pool = torch.zeros(2, 4, 8, 1, 8)
    ids = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        fast.gather_kv_blocks(k_pool, k_pool, ids, 10, 7, backend="torch")
    with pytest.raises(ValueError, match="out must be"):
        fast.gather_kv_blocks(k_pool, k_pool, ids, 0, 4, out=torch.empty(2, 1, 4, 8), backend="torch")


# -- backend selection -----------------------------------------------------------------------------


def test_backend_selection_is_explicit(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv(fast_backend.ENV_VAR, raising=False)
    assert fast_backend.resolve_backend(cpu) == "torch"
    assert fast_backend.backend_choices() == {"cpu": "torch", "cuda": "cuda"}
    monkeypatch.setenv(fast_backend.ENV_VAR, "emulated")
    assert fast_backend.resolve_backend(cpu) == "emulated"
    assert fast_backend.resolve_backend(cpu, "torch") == "torch"  # the argument wins
    assert fast_backend.backend_choices()["cpu"] == "emulated"
    monkeypatch.setenv(fast_backend.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="OASR_CPU_BACKEND"):
        fast_backend.resolve_backend(cpu)
    with pytest.raises(ValueError):
        fast_backend.resolve_backend(cpu, "fastest")
    with pytest.raises(ValueError, match="CUDA tensors"):
        fast_backend.resolve_backend(cuda, "torch")  # no silent CPU path for GPU tensors
    assert fast_backend.resolve_backend(cuda) == "cuda"  # choosing needs no GPU


def test_backend_reported_once(monkeypatch, caplog):
    monkeypatch.setattr(fast_backend, "_reported", set())
    with caplog.at_level(logging.INFO, logger="oasr.fast"):
        for _ in range(3):
            fast_backend.resolve_backend(torch.device("cpu"), "torch")
    lines = [r for r in caplog.records if r.name == "oasr.fast"]
    assert len(lines) == 1 and "'torch'" in lines[0].getMessage()
    assert fast_backend.backends_used()["cpu"] == "torch"
