"""The engine's model step is capture-safe: checked on the CPU by ``CaptureSafetyChecker``.

Every test of the tick runs real engine ticks (fast twin) with the checker as
``engine.tick_monitor``; see ``oasr/fast/capture_check.py`` for how host and device
memory are told apart on a CPU-only machine. The first tests show the checker
can fail, on each kind of violation.
"""

from __future__ import annotations

import pytest
import torch

from oasr.engine import StreamingEngine
from oasr.fast.capture_check import CaptureSafetyChecker, watch_engine
from oasr.models import ConformerConfig, StreamingConformer


# ---- the checker can fail ---------------------------------------------------------------------
def _checked(fn, pinned=None, non_blocking=True):
    device_t = torch.arange(6.0)
    host = torch.arange(6.0) + 1  # made before the region, never declared: pageable host memory
    checker = CaptureSafetyChecker()
    checker.declare_device([device_t])
    if pinned is not None:
        checker.declare_pinned(pinned)
    with checker.region("probe") as record:
        fn(device_t, host)
    return record


BAD = {
    "item": lambda d, h: d.sum().item(),
    "bool": lambda d, h: bool((d > 2).any()),
    "int": lambda d, h: int(d[0]),
    "tolist": lambda d, h: d.tolist(),
    "cpu": lambda d, h: d.cpu(),
    "nonzero": lambda d, h: d.nonzero(),
    "where1": lambda d, h: torch.where(d > 1),
    "masked_select": lambda d, h: d.masked_select(d > 1),
    "bool_index": lambda d, h: d[d > 1],
    "unique": lambda d, h: torch.unique(d),
    "tensor_from_python": lambda d, h: d + torch.tensor([1.0] * 6),
    "as_tensor_device": lambda d, h: torch.as_tensor([1, 2], device=d.device),
    "pageable_copy": lambda d, h: d.copy_(h),
    "pageable_operand": lambda d, h: d.add_(h),
    "pageable_to": lambda d, h: h.to(d.device),
    "readback_pageable": lambda d, h: h.copy_(d),
    "scalar_through_index": lambda d, h: d.__setitem__(2, 5.0),  # a pageable 4-byte host-to-device copy
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_checker_catches(name):
    record = _checked(BAD[name])
    assert record.violations, name


def test_checker_wants_non_blocking_pinned_copies():
    pinned = torch.zeros(6)
    assert _checked(lambda d, h: d.copy_(pinned, non_blocking=True), pinned).violations == []
    assert _checked(lambda d, h: pinned.copy_(d, non_blocking=True), pinned).violations == []
    assert _checked(lambda d, h: d.copy_(pinned), pinned).violations  # blocking upload
    assert _checked(lambda d, h: pinned.copy_(d), pinned).violations  # blocking readback


def test_checker_accepts_device_work():
    def fine(d, h):
        idx = torch.arange(3, device=d.device)
        out = torch.empty(3)
        torch.index_select(d, 0, idx, out=out)
        d.index_copy_(0, idx, out * 2.0)
        return torch.softmax(d, 0).masked_fill(d > 3, 0.0)

    record = _checked(fine)
    assert record.violations == [] and record.num_ops > 5


def test_the_public_forward_with_host_lists_is_flagged():
    """``forward_chunk_paged`` given Python lists builds tensors from them: flagged (the engine stages instead)."""
    model = StreamingConformer(ConformerConfig(chunk_size=4, num_left_chunks=2))
    cfg = model.config.cache_config(max_batch_size=2)
    engine = StreamingEngine(model, cfg, twin="fast")
    for sid in (0, 1):
        engine.add_stream(sid)
        engine.push(sid, torch.randn(16, 20))
    engine.step()  # admitted, one chunk each
    engine.att.prepare_chunks_batched([0, 1])
    caches = engine.att.get_paged_caches([0, 1])
    checker = watch_engine(engine)
    with checker.region("public forward") as record:
        model.forward_chunk_paged(torch.zeros(2, 16, 20), [4, 4], caches, engine.cnn.get_cache([0, 1]),
                                  engine.states.views([0, 1]), [16, 16], twin="fast")
    assert any("made from Python data" in v for v in record.violations)


# ---- a whole engine tick ----------------------------------------------------------------------
FORMATS = {
    "fp32 pages": dict(dtype=torch.float32, kv_cache_dtype=None),
    "bf16 pages": dict(dtype=torch.bfloat16, kv_cache_dtype=None),
    "fp8 pages": dict(dtype=torch.float32, kv_cache_dtype="fp8_e4m3"),
}


def run_checked(fmt: str, streams: int, ticks: int = 5, num_left_chunks: int = 2):
    model = StreamingConformer(ConformerConfig(chunk_size=4, num_left_chunks=num_left_chunks))
    dtype = FORMATS[fmt]["dtype"]
    model = model.to(dtype)
    cfg = model.config.cache_config(max_batch_size=16, dtype=dtype, kv_cache_dtype=FORMATS[fmt]["kv_cache_dtype"])
    engine = StreamingEngine(model, cfg, twin="fast")
    checker = watch_engine(engine)
    g = torch.Generator().manual_seed(1)
    for sid in range(streams):
        engine.add_stream(sid)
        engine.push(sid, torch.randn(16 * (ticks + 1) + 7, 20, generator=g).to(dtype))
        engine.end_stream(sid)
    for _ in range(ticks):
        engine.step()
    return engine, checker.records


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_engine_tick_is_capture_safe(fmt):
    engine, records = run_checked(fmt, streams=16)
    assert len(records) == 5
    for record in records:
        assert record.violations == [], record.summary()
        assert record.pinned_uploads >= 2 and record.pinned_readbacks == 1  # inputs up, log-probs back: once each
    # every launch parameter is fixed per width: equal launch keys tick after tick, worst-case spans
    assert all(r.launch_keys == records[0].launch_keys for r in records)
    worst = engine.config.blocks_per_stream * engine.config.block_size_frames
    assert {key[2][:2] for key in records[0].launch_keys} == {(worst, worst)}


@pytest.mark.parametrize("fmt", ["fp32 pages", "fp8 pages"])
def test_tick_op_count_does_not_grow_with_the_width(fmt):
    _, narrow = run_checked(fmt, streams=2)
    _, wide = run_checked(fmt, streams=16)
    assert [r.num_ops for r in narrow] == [r.num_ops for r in wide]
    assert [r.op_names for r in narrow] == [r.op_names for r in wide]


def test_unlimited_history_tick_is_capture_safe():
    _, records = run_checked("fp32 pages", streams=4, num_left_chunks=-1)
    assert all(r.violations == [] for r in records)
    assert all(r.launch_keys == records[0].launch_keys for r in records)


# ---- the pinned launch plan on the kernels ----------------------------------------------------
def _emulation_missing():
    from oasr.fast.kernels import emulation

    try:
        emulation.emulation_toolchain()
    except emulation.EmulationUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.skipif(_emulation_missing() is not None, reason=f"kernel emulation unavailable: {_emulation_missing()}")
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_worst_case_plan_on_the_kernels_equals_offline(monkeypatch, kv_cache_dtype):
    """The engine's step on the emulated CUDA kernels (the launchers a GPU runs), with the worst-case plan:
    the key range is split for the longest stream the config allows, so most splits of a young stream hold
    no key at all. Streams must still equal the offline forward."""
    from oasr.fast.kernels.ops import choose_num_splits
    from oasr.reference.fp8 import dequantize, quantize

    monkeypatch.setenv("OASR_CPU_BACKEND", "emulated")
    model = StreamingConformer(ConformerConfig(hidden_dim=32, n_head=2, n_kv_head=1, head_dim=64, chunk_size=4,
                                               num_left_chunks=-1, seed=7))
    cfg = model.config.cache_config(max_batch_size=2, block_size_frames=4, max_blocks_per_seq=64,
                                    kv_cache_dtype=kv_cache_dtype)
    engine = StreamingEngine(model, cfg, twin="fast", keep_log_probs=True)
    worst = engine.model_tick.worst_span
    assert worst == 256 and choose_num_splits(2, 1, 1, worst + 4, 4) == 4  # emulated sm_count 4: four splits
    g = torch.Generator().manual_seed(0)
    feats = {sid: torch.randn(16 * 6 + 5 * sid, 20, generator=g) for sid in range(2)}
    for sid, f in feats.items():
        engine.add_stream(sid)
        engine.push(sid, f)
        engine.end_stream(sid)
    engine.run()
    transform = None if kv_cache_dtype is None else (lambda x: dequantize(*quantize(x), x.dtype))
    for sid, f in feats.items():
        offline = model.forward_offline(f[None], kv_transform=transform)[0][0]
        assert (engine.result(sid).log_probs - offline).abs().max().item() <= 1e-5, sid
