"""Bench, GPU only: the paged chunk attention kernels against SDPA and FlashInfer at the ASR shape.

One layer of one tick: 128 streams, each with a chunk of 16 queries (8 query heads over 4 KV heads,
head_dim 64, bf16) attending to its history of {256, 1024, 4096} frames plus the chunk, in pages of
16 frames spread over the pool by a shuffled block table; pages in bf16 and in fp8 (e4m3 with one
fp32 scale per vector). Contenders, each timed with CUDA events (median over the repeats):

    v1, v2, ...   every kernel in ops.ATTENTION_LAUNCHERS (registry.attention_kernels())
    sdpa-gather   gather the pages into (B, Hkv, L, D) (dequantizing fp8), then torch SDPA with GQA
    flashinfer    BatchPrefillWithPagedKVCacheWrapper (NHD pages, same table), when it imports; fp8
                  pages go in as raw e4m3 with scale 1 (FlashInfer takes one scale per tensor, not per
                  vector), so its fp8 row times the same bytes but is not the same numbers

Each row: microseconds, the bytes a tick must move (``sass.AttentionShape.bytes_moved``: K and V
pages once, their scales, q read, out written) over that time, and that as a fraction of this
device's copy bandwidth, measured once with a large device-to-device copy. ``max_err`` is the largest
difference from fp32 attention over the same (dequantized) keys: a contender that is fast and wrong
shows up here. Not a test: nothing asserts a time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import torch
import torch.nn.functional as F

from oasr.fast.kernels import ops, registry
from oasr.fast.kernels.sass import ASR_SHAPE, PAGES, AttentionShape
from oasr.paged import PagedKVCache

HISTORIES = (256, 1024, 4096)
DTYPE = torch.bfloat16


def require_cuda(device) -> torch.device:
    """``device`` as a CUDA ``torch.device``; ``ValueError`` if it is not one torch can use."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"oasr.bench.attention_gpu needs a CUDA device, got {device} "
                         f"(torch.cuda.is_available()={torch.cuda.is_available()})")  # fmt: skip
    return device


def shape_for(history: int, base: AttentionShape = ASR_SHAPE) -> AttentionShape:
    """``base`` with ``history`` frames of keys before the chunk."""
    return replace(base, keys=history + base.chunk)


def bytes_moved(history: int, page: str) -> int:
    """Bytes one tick must move at ``history`` frames with ``page`` ("bf16" or "fp8") pages."""
    _, page_bytes, scale_bytes = PAGES[page]
    return shape_for(history).bytes_moved(page_bytes, scale_bytes)


def event_us(fn, device, repeats: int, warmup: int) -> float:
    """Median time of ``fn()`` in microseconds, from CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device, nbytes: int = 1 << 30) -> float:
    """This device's device-to-device copy bandwidth (read + write bytes per second), in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = event_us(lambda: dst.copy_(src), device, repeats=10, warmup=3)
    return 2 * nbytes / (us * 1e-6) / 1e9


def make_cohort(history: int, page: str, device, seed: int = 0) -> tuple[PagedKVCache, torch.Tensor]:
    """A pool holding every stream's history and chunk (cache_seqlens = history), and the chunk's q."""
    s = shape_for(history)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the pool's values, drawn on the device
    width = math.ceil(s.keys / s.block_size)
    blocks = s.streams * width + 1
    table = torch.randperm(blocks, generator=g)[: s.streams * width].view(s.streams, width).to(torch.int32)
    pool_shape = (blocks, s.block_size, s.n_kv_head, s.head_dim)
    k = torch.randn(pool_shape, device=device, dtype=DTYPE)
    v = torch.randn(pool_shape, device=device, dtype=DTYPE)
    scales = {}
    if page == "fp8":
        from oasr.fast.paged_ops import quantize_fp8

        (k, k_scale), (v, v_scale) = quantize_fp8(k), quantize_fp8(v)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    seqlens = torch.full((s.streams,), history, dtype=torch.int32, device=device)
    starts = torch.zeros(s.streams, dtype=torch.int32, device=device)
    cache = PagedKVCache(k, v, table.to(device), seqlens, starts, s.block_size, history, history, **scales)
    q = torch.randn(s.streams, s.n_head, s.chunk, s.head_dim, device=device, dtype=DTYPE)
    return cache, q


def gathered_kv(cache: PagedKVCache, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every stream's first ``keys`` positions as (B, Hkv, keys, D) in the model dtype."""
    pos = torch.arange(keys, device=cache.k_cache.device)
    blocks = cache.block_table.long()[:, pos // cache.block_size]  # (B, keys)
    offsets = (pos % cache.block_size).expand_as(blocks)
    k, v = cache.k_cache[blocks, offsets], cache.v_cache[blocks, offsets]  # (B, keys, Hkv, D)
    if cache.quantized:
        from oasr.fast.paged_ops import dequantize_fp8

        k = dequantize_fp8(k, cache.k_scale[blocks, offsets], DTYPE)
        v = dequantize_fp8(v, cache.v_scale[blocks, offsets], DTYPE)
    return k.transpose(1, 2), v.transpose(1, 2)


def fp32_expected(cache: PagedKVCache, q: torch.Tensor, keys: int) -> torch.Tensor:
    """fp32 attention over the gathered (dequantized) keys: what ``max_err`` is measured against."""
    k, v = gathered_kv(cache, keys)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)


def _sdpa_gather(cache, q, keys):
    k, v = gathered_kv(cache, keys)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _flashinfer_runner(cache: PagedKVCache, q: torch.Tensor, keys: int):
    """A callable running FlashInfer's paged prefill on the same pages, or raise ImportError/others."""
    import flashinfer

    s = ASR_SHAPE
    device = q.device
    B, H, T, D = q.shape
    pages_per_row = math.ceil(keys / cache.block_size)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=device) * T
    kv_indptr = torch.arange(B + 1, dtype=torch.int32, device=device) * pages_per_row
    kv_indices = cache.block_table[:, :pages_per_row].contiguous().view(-1)
    last = torch.full((B,), keys - (pages_per_row - 1) * cache.block_size, dtype=torch.int32, device=device)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, H, s.n_kv_head, D, cache.block_size, causal=False,
                 q_data_type=q.dtype, kv_data_type=cache.k_cache.dtype)  # fmt: skip
    q_ragged = q.transpose(1, 2).reshape(B * T, H, D).contiguous()
    return lambda: wrapper.run(q_ragged, (cache.k_cache, cache.v_cache)).view(B, T, H, D).transpose(1, 2)


def contenders(cache: PagedKVCache, q: torch.Tensor, keys: int) -> dict:
    """name -> (callable returning (B, H, T, D), note). Kernels from ops.ATTENTION_LAUNCHERS by version."""
    from oasr.fast.kernels.nvrtc import executor_for

    executor = executor_for(q.device)
    scale = q.shape[-1] ** -0.5
    out = {}
    for kernel in registry.attention_kernels():
        launch = ops.ATTENTION_LAUNCHERS.get(registry.short_name(kernel))
        name = f"v{registry.kernel_version(kernel)}"
        if launch is None:
            out[name] = (None, f"{registry.short_name(kernel)} has no entry in ops.ATTENTION_LAUNCHERS")
        else:
            out[name] = (lambda launch=launch: launch(executor, q, cache, None, scale, False), "")
    out["sdpa-gather"] = (lambda: _sdpa_gather(cache, q, keys), "gather + dequantize + SDPA")
    try:
        out["flashinfer"] = (_flashinfer_runner(cache, q, keys), "fp8: raw e4m3, scale 1" if cache.quantized else "")
    except ImportError as exc:
        out["flashinfer"] = (None, f"not installed ({exc.name or exc})")
    except Exception as exc:  # a FlashInfer that imports but refuses this shape/dtype: say so in the row
        out["flashinfer"] = (None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
    return out


def section(quick: bool, device, peak: float | None = None) -> list[dict]:
    """The rows; ``peak``: this device's copy bandwidth in GB/s if the caller measured it already."""
    device = require_cuda(device)
    repeats, warmup = (10, 3) if quick else (50, 10)
    peak = peak or copy_bandwidth_gbs(device)
    rows = []
    for page in PAGES:
        for history in HISTORIES:
            cache, q = make_cohort(history, page, device)
            keys = history + ASR_SHAPE.chunk
            expect = fp32_expected(cache, q, keys)
            moved = bytes_moved(history, page)
            for name, (fn, note) in contenders(cache, q, keys).items():
                row = {"section": "attention", "case": f"gpu {page} pages, 128 streams, history={history}",
                       "kernel": name, "MB_moved": moved / 1e6, "copy_GBps": peak}  # fmt: skip
                if fn is not None:
                    try:
                        got = fn()
                        if not (name == "flashinfer" and cache.quantized):
                            row["max_err"] = (got.float() - expect).abs().max().item()
                        row["us"] = event_us(fn, device, repeats, warmup)
                        row["GBps"] = moved / (row["us"] * 1e-6) / 1e9
                        row["of_copy_bw"] = row["GBps"] / peak
                    except Exception as exc:  # report, keep benchmarking the others
                        note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                row["note"] = note
                rows.append(row)
            del cache, q
            torch.cuda.empty_cache()
    return rows
