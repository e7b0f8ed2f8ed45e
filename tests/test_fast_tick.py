"""The fast twin's steady tick: no allocation, no device-to-host read, one staged copy per call.

A *tick* is what an engine does per step for a cohort: ``prepare_chunks_batched``
+ ``get_paged_caches`` (padded to a captured width) + ``commit_chunks_batched``
(eviction included). On the CPU we cannot observe synchronisations, so each
property is checked by watching every aten op the tick runs
(``TorchDispatchMode``), plus the Python-side conversions that bypass the
dispatcher (``Tensor.tolist`` / ``Tensor.numpy``):

  * allocation: every op's outputs live in storage one of its inputs already
    had (views and ``out=`` / in-place ops), and no tensor is made from host
    data (``lift_fresh``). ``a + b``, ``clone``, ``index_select`` without
    ``out=``, ``torch.tensor``, ``.to`` all fail it (``test_detector_catches_*``);
  * no read-back: no ``_local_scalar_dense`` (``item``, ``int()``, ``bool()``),
    no ``tolist`` / ``numpy`` on a tensor, and every ``copy_`` reads a staging
    host buffer and writes the matching device buffer, one per staged call;
  * constant work: the number of aten ops and of Python calls does not grow
    with the cohort.
The CUDA test at the end asks the driver directly (``set_sync_debug_mode``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import oasr
from oasr import fast
from oasr.fast.capture_check import iter_tensors as _tensors
from oasr.fast.staging import Stager

GEOMETRIES = {
    "aligned": dict(chunk_size=4, block_size_frames=4, num_left_chunks=2),
    "straddling": dict(chunk_size=6, block_size_frames=4, num_left_chunks=1),
    "prefill": dict(chunk_size=4, block_size_frames=4, num_left_chunks=2, prefill_kv_window=True),
    "unlimited": dict(chunk_size=4, block_size_frames=4, num_left_chunks=-1, max_blocks_per_seq=64),
}


def build(geometry, streams=4, device="cpu", direct=False, **overrides):
    """A manager with ``streams`` admitted streams; on the CPU it runs the staged (CUDA) path unless
    ``direct``."""
    fields = dict(
        num_layers=3, n_kv_head=2, head_dim=4, max_batch_size=streams, max_num_blocks=64 * streams,
        max_blocks_per_seq=8, device=device,
    )
    fields.update(GEOMETRIES[geometry])
    fields.update(overrides)
    cfg = oasr.CacheConfig(**fields)
    pool = fast.BlockPool(cfg)
    att = fast.AttentionCacheManager(pool, cfg, pad_lanes=1)
    ids = [f"s{i}" for i in range(streams)]
    for sid in ids:
        att.allocate_stream(sid)
    if not direct:
        att._stage_like_cuda()
    return cfg, att, ids


def tick(att, ids, pad_to=None):
    att.prepare_chunks_batched(ids)
    views = att.get_paged_caches(ids, pad_to)
    att.commit_chunks_batched(ids, att.config.chunk_size)
    return views


class OpRecorder(TorchDispatchMode):
    """Every aten op run inside: its input storages, output storages and the storages it writes."""

    def __init__(self):
        super().__init__()
        self.ops = []  # (op name, input storage ptrs, output storage ptrs)
        self.written = []  # (op name, storage ptrs of arguments the schema marks as written)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        outputs = [t.untyped_storage().data_ptr() for t in _tensors(out)]
        self.ops.append((str(func), inputs, outputs))
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                self.written.append((str(func), {t.untyped_storage().data_ptr() for t in _tensors(value)}))
        return out

    def allocations(self) -> list[str]:
        fresh = {"aten.lift_fresh.default", "aten.lift_fresh_copy.default"}
        return [name for name, ins, outs in self.ops if name in fresh or any(p not in ins for p in outs)]

    def names(self) -> list[str]:
        return [name for name, _, _ in self.ops]


@contextmanager
def forbid_host_conversions():
    """Fail on ``Tensor.tolist`` / ``Tensor.numpy`` (they bypass the dispatcher)."""
    calls = []
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def spy(name):
        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return saved[name](self, *args, **kwargs)

        return wrapper

    for name in saved:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield calls
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def stagers(att):
    return [att._prepare_stager, att._commit_stager, att._cohort_stager, att._row_stager, att._dense_stager]


# ---- the detector can fail --------------------------------------------------------------
@pytest.mark.parametrize(
    "allocating_op",
    [
        lambda t, i: t + 1,
        lambda t, i: t.clone(),
        lambda t, i: t.index_select(0, i),
        lambda t, i: torch.zeros(3),
        lambda t, i: torch.empty(0),
        lambda t, i: torch.tensor([1, 2]),
        lambda t, i: t.to(torch.float64),
        lambda t, i: t[i],
    ],
    ids=["add", "clone", "index_select", "zeros", "empty0", "tensor", "to", "advanced_index"],
)
def test_detector_catches_allocations(allocating_op):
    t, i = torch.arange(6.0), torch.tensor([0, 2])
    with OpRecorder() as rec:
        allocating_op(t, i)
    assert rec.allocations()


def test_detector_accepts_views_and_out():
    t, i, out = torch.arange(6.0), torch.tensor([0, 2]), torch.empty(2)
    with OpRecorder() as rec:
        torch.index_select(t, 0, i, out=out)
        t[1:3].view(torch.int32).add_(0)
        t.index_copy_(0, i, out)
    assert rec.allocations() == []


# ---- the steady tick ----------------------------------------------------------------------
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("pad", [0, 2])
@pytest.mark.parametrize("size", [1, 3])  # 1: the one-stream path of prepare / commit
@pytest.mark.parametrize("direct", [False, True])  # True: the CPU direct writes
def test_steady_tick_allocates_nothing(geometry, pad, size, direct):
    cfg, att, ids = build(geometry, direct=direct)
    cohort = ids[1 : 1 + size]  # not the slot order of the whole pool: a real gather
    pad_to = len(cohort) + pad if pad else None
    for _ in range(6):  # warm up: past the window, every width seen once
        tick(att, cohort, pad_to)
    with OpRecorder() as rec:
        for _ in range(3):
            tick(att, cohort, pad_to)
    assert rec.allocations() == []
    if cfg.eviction and geometry != "prefill" and size > 1 and not direct:
        assert "aten.gather.out" in rec.names()  # eviction did run, and moved rows on the device


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_tick_reads_nothing_back(geometry):
    cfg, att, ids = build(geometry)
    for _ in range(6):
        tick(att, ids, pad_to=len(ids) + 1)
    host = {p for s in stagers(att) for p in s.storages()}
    device = {s._device.untyped_storage().data_ptr() for s in stagers(att)}
    copies_before = [s.copies for s in stagers(att)]
    with forbid_host_conversions() as conversions, OpRecorder() as rec:
        tick(att, ids, pad_to=len(ids) + 1)
    assert conversions == []
    names = rec.names()
    for forbidden in ("aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
                      "aten.equal.default", "aten.is_nonzero.default"):
        assert forbidden not in names
    copies = [(ins, outs) for name, ins, outs in rec.ops if name.startswith("aten.copy_")]
    assert all(ins & host and set(outs) <= device for ins, outs in copies)  # host -> device only
    assert rec.written and not any(ptrs & host for _, ptrs in rec.written)  # torch never writes a host buffer
    issued = [s.copies - c for s, c in zip(stagers(att), copies_before, strict=True)]
    # prepare stages once, get_paged_caches reuses prepare's slots, commit stages once
    assert issued == [1, 1, 0, 0, 0] and len(copies) == 2


@pytest.mark.parametrize("geometry", ["aligned", "straddling", "unlimited"])
def test_one_stream_tick_reads_nothing_back(geometry):
    """The one-stream path as on CUDA: prepare stages once, commit sends the shifted row with the
    lengths in one staged copy; nothing is read back and torch writes no host buffer."""
    cfg, att, ids = build(geometry)
    for _ in range(6):
        tick(att, ids[2:3], pad_to=2)
    host = {p for s in stagers(att) for p in s.storages()}
    device = {s._device.untyped_storage().data_ptr() for s in stagers(att)}
    copies_before = [s.copies for s in stagers(att)]
    with forbid_host_conversions() as conversions, OpRecorder() as rec:
        tick(att, ids[2:3], pad_to=2)
    assert conversions == [] and "aten._local_scalar_dense.default" not in rec.names()
    copies = [(ins, outs) for name, ins, outs in rec.ops if name.startswith("aten.copy_")]
    assert all(ins & host and set(outs) <= device for ins, outs in copies)
    assert not any(ptrs & host for _, ptrs in rec.written)
    issued = [s.copies - c for s, c in zip(stagers(att), copies_before, strict=True)]
    assert issued == [1, 0, 0, 1, 0] and len(copies) == 2  # prepare's stager, then the row stager


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("pad", [0, 1])
def test_one_stream_tick_on_cpu_writes_the_tables_directly(geometry, pad):
    """On a CPU device the one-stream tick runs no torch op but views (no stage, no copy, no index op):
    the rows go through numpy views of the persistent tensors, and the views served are the same
    as the staged path's, tick by tick, including across eviction."""
    (_, att, ids), (_, ref, _) = build(geometry, direct=True), build(geometry)
    cohort = ids[2:3]
    for step in range(8):
        copies_before = [s.copies for s in stagers(att)]
        with OpRecorder() as rec:
            views = tick(att, cohort, pad_to=1 + pad)
        ref_views = tick(ref, cohort, pad_to=1 + pad)
        if step >= 2:  # the width's buffers exist: only views (new records while the window fills)
            assert set(rec.names()) <= {"aten.select.int"} and [s.copies for s in stagers(att)] == copies_before
        for got, want in zip(views, ref_views, strict=True):
            for field in ("block_table", "cache_seqlens", "cache_seqstarts"):
                assert torch.equal(getattr(got, field), getattr(want, field))
            assert (got.max_seqlen, got.max_span, got.prepared_frames) == (
                want.max_seqlen, want.max_span, want.prepared_frames)
        assert torch.equal(att.block_table, ref.block_table) and torch.equal(att._seq_meta, ref._seq_meta)
        assert np.array_equal(att.block_table.numpy(), att._table)


def test_new_block_ids_go_through_one_staged_copy():
    """Admitting four fresh streams at once: the new ids of all of them travel in one copy."""
    cfg, att, ids = build("aligned")
    before = att._prepare_stager.copies
    with OpRecorder() as rec:
        att.prepare_chunks_batched(ids)
    assert att._prepare_stager.copies - before == 1
    assert rec.names().count("aten.copy_.default") == 1
    assert rec.names().count("aten.index_copy_.default") == 1
    assert sum(len(att.describe(s).blocks) for s in ids) == len(ids)


@pytest.mark.parametrize("geometry", ["aligned", "straddling"])
@pytest.mark.parametrize("direct", [False, True])
def test_tick_work_does_not_grow_with_the_cohort(geometry, direct):
    """Same aten ops for 2, 20 and 24 streams, and the same number of Python calls for 20 and 24."""

    def measure(streams):
        cfg, att, ids = build(geometry, streams=streams, direct=direct)
        for _ in range(6):
            tick(att, ids, pad_to=streams + 1)
        with OpRecorder():  # the dispatch mode's first use imports modules: one-time work, not the tick's
            tick(att, ids, pad_to=streams + 1)
        calls = 0

        def profiler(frame, event, arg):
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        with OpRecorder() as rec:
            sys.setprofile(profiler)
            try:
                tick(att, ids, pad_to=streams + 1)
            finally:
                sys.setprofile(None)
        return rec.names(), calls

    small, middle, large = measure(2), measure(20), measure(24)
    assert small[0] == middle[0] == large[0]
    # the pool frees a few ids in a plain loop (oasr.fast.block_pool): below that cutoff a tick makes no more
    # Python calls than above it, and above it the count does not move with the cohort
    assert small[1] <= large[1] and middle[1] == large[1]


def test_persistent_addresses_are_stable():
    """Tables keep their storage for life; a width's view buffers keep theirs from tick to tick."""
    cfg, att, ids = build("aligned")
    pointers = [t.data_ptr() for t in (att.block_table, att.cache_seqlens, att.cache_seqstarts)]
    first = tick(att, ids[:2], pad_to=4)[0]
    att.free_stream(ids[0])
    att.allocate_stream("new")
    att.reset_stream(ids[1])
    for _ in range(5):
        later = tick(att, ["new", ids[1]], pad_to=4)[0]
    assert [t.data_ptr() for t in (att.block_table, att.cache_seqlens, att.cache_seqstarts)] == pointers
    for name in ("block_table", "cache_seqlens", "cache_seqstarts"):
        assert getattr(first, name).data_ptr() == getattr(later, name).data_ptr()
    table, lens, starts = att.get_paged_state_views("new")
    slot = att.slot_of("new")
    assert table.data_ptr() == att.block_table[slot].data_ptr()
    assert lens.data_ptr() == att.cache_seqlens[slot].data_ptr()
    assert starts.data_ptr() == att.cache_seqstarts[slot].data_ptr()


def test_stager_packs_sections_in_one_copy():
    import numpy as np

    stager = Stager([(3, torch.int64), (5, torch.int32), (2, torch.int64)], "cpu")
    a, b, c = stager.stage(np.array([7, -1, 2**40]), np.arange(4), np.empty(0))
    assert a.tolist() == [7, -1, 2**40] and a.dtype == torch.int64
    assert b.tolist() == [0, 1, 2, 3] and b.dtype == torch.int32
    assert c.numel() == 0 and stager.copies == 1
    views = stager.stage(np.empty(0), np.empty(0), np.empty(0))
    assert [v.numel() for v in views] == [0, 0, 0] and stager.copies == 1  # nothing to send, no copy
    with pytest.raises(RuntimeError, match="capacity"):
        stager.stage(np.arange(4), np.empty(0), np.empty(0))


# ---- on a GPU, ask the driver ----------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("geometry", ["aligned", "prefill"])
def test_cuda_tick_never_synchronises(geometry):
    from oasr import reference

    cfg, att, ids = build(geometry, streams=8, device="cuda")
    ref_pool = reference.BlockPool(cfg)
    ref = reference.AttentionCacheManager(ref_pool, cfg, pad_lanes=1)
    for sid in ids:
        ref.allocate_stream(sid)
    for _ in range(4):
        tick(att, ids[:5], pad_to=8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            views = tick(att, ids[:5], pad_to=8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(8):
        ref_views = tick(ref, ids[:5], pad_to=8)
    assert torch.equal(views[0].block_table.cpu(), ref_views[0].block_table.cpu())
    assert torch.equal(views[0].cache_seqlens.cpu(), ref_views[0].cache_seqlens.cpu())
    assert torch.equal(views[0].cache_seqstarts.cpu(), ref_views[0].cache_seqstarts.cpu())


# ---- the attention of a tick: persistent workspaces ---------------------------------------------
class FreshStorage(TorchDispatchMode):
    """Every op output in storage none of its inputs had: (op name, bytes)."""

    def __init__(self):
        super().__init__()
        self.fresh = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if t.untyped_storage().data_ptr() not in inputs:
                self.fresh.append((str(func), t.untyped_storage().nbytes()))
        return out


@pytest.mark.parametrize("path", ["rows", "tiles"])
def test_attention_tick_gathers_into_a_persistent_workspace(path, monkeypatch):
    """A steady tick's append + attention over every layer (fp32, torch backend) gathers K and V
    into the same per-thread workspace every tick. On the row loop nothing else is large: the only
    new storage of 16 KiB or more is each layer's output. (The vectorised tiles still make their
    scores and probabilities afresh; only their gathers are in the workspace.)"""
    from oasr.fast import cpu_rows
    from oasr.fast import paged_ops as ops

    monkeypatch.setattr(cpu_rows, "use_row_loop", lambda cache, rows, T: path == "rows")
    cfg, att, ids = build("aligned", streams=8, head_dim=64, n_kv_head=2, max_blocks_per_seq=16)
    g = torch.Generator().manual_seed(0)
    B, T = len(ids), cfg.chunk_size
    q = torch.randn(B, 4, T, cfg.head_dim, generator=g)
    k = torch.randn(B, T, cfg.n_kv_head, cfg.head_dim, generator=g)

    def model_tick():
        att.prepare_chunks_batched(ids)
        outs = []
        for view in att.get_paged_caches(ids):
            ops.append_kv(view, k, k, backend="torch")
            outs.append(ops.paged_attention(q, view, backend="torch"))
        att.commit_chunks_batched(ids, T)
        return outs

    for _ in range(4):  # warm up: past the window, the workspace grown to the steady size
        model_tick()
    workspace = cpu_rows.workspace_storages()
    with FreshStorage() as rec:
        for _ in range(3):
            outs = model_tick()
    assert cpu_rows.workspace_storages() == workspace and workspace
    gathers = [name for name, _ in rec.fresh if "index_select" in name or "embedding" in name]
    assert gathers == []
    if path == "rows":
        large = [n for _, n in rec.fresh if n >= 16 << 10]
        out_bytes = outs[0].untyped_storage().nbytes()
        assert out_bytes >= 16 << 10 and large == [out_bytes] * (3 * cfg.num_layers)  # the outputs, nothing else
