"""Bench, GPU only: the paged chunk attention kernels against SDPA, FlexAttention and FlashInfer.

One layer of one tick: 128 streams, each with a chunk of 16 queries (8 query heads over 4 KV heads,
head_dim 64, bf16) attending to its history of {256, 1024, 4096} frames plus the chunk, in pages of
16 frames spread over the pool by a shuffled block table; pages in bf16 and in fp8 (e4m3 with one
fp32 scale per vector). Contenders:

    v1, v2, v3    every kernel in ops.ATTENTION_LAUNCHERS (registry.attention_kernels())
    sdpa-gather   gather the pages into (B, Hkv, L, D) (dequantizing fp8), then torch SDPA with GQA
    flex-paged    torch FlexAttention (compiled, Triton) over the same pages: the pool laid out head-major
                  once, outside the timing, and a block mask whose KV blocks are the pages (16 slots) and
                  whose query blocks are the streams, listing each stream's own pages from its block
                  table (``flex_inputs``); bf16 pages only (on fp8 pages it would read a dequantized
                  16-bit copy: the bf16 row's work, and another compile out of the time budget)
    flashinfer    BatchPrefillWithPagedKVCacheWrapper (NHD pages, same table), when it imports; fp8
                  pages go in as raw e4m3 with scale 1 (FlashInfer takes one scale per tensor, not per
                  vector), so its fp8 row times the same bytes but is not the same numbers

Each contender is timed three ways (medians):

    graph_us   kernel-only: one CUDA graph of GRAPH_LAUNCHES calls captured, replayed, timed with events
               around each replay, divided by the calls (what the engine pays: it replays graphs)
    us         per call with the host launcher: events around each eager call (the launcher runs inside
               the window while the GPU idles, as in every earlier table of docs/kernels.md)
    host_us    the launcher's host time per call: a wall clock around HOST_CALLS back-to-back eager calls
               (no synchronization inside; the GPU queue absorbs them)

and with the bytes a tick must move (``sass.AttentionShape.bytes_moved``: K and V pages once, their
scales, q read, out written) over ``graph_us`` and over ``us``, as GB/s and as a fraction of this
device's copy bandwidth (a large device-to-device copy, measured once). ``max_err`` is the largest
difference from fp32 attention over the same (dequantized) keys: a contender that is fast and wrong
shows up here. Not a test: nothing asserts a time.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from oasr.cache.paged import PagedKVCache
from oasr.fast.kernels import ops, registry
from oasr.fast.kernels.perf_model import ASR_SHAPE, PAGES, AttentionShape

HISTORIES = (256, 1024, 4096)
DTYPE = torch.bfloat16
GRAPH_LAUNCHES = 20  # calls captured in one graph
HOST_CALLS = 50  # back-to-back eager calls timed on the host clock


def require_cuda(device) -> torch.device:
    """``device`` as a CUDA ``torch.device``; ``ValueError`` if it is not one torch can use."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"oasr.bench.attention_gpu needs a CUDA device, got {device} "
                         f"(torch.cuda.is_available()={torch.cuda.is_available()})")  # fmt: skip
    return device


def shape_for(history: int, base: AttentionShape = ASR_SHAPE, streams: int | None = None) -> AttentionShape:
    """``base`` with ``history`` frames of keys before the chunk (and ``streams`` rows, if given)."""
    return replace(base, keys=history + base.chunk, streams=streams or base.streams)


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


def graph_us(fn, device, repeats: int, launches: int = GRAPH_LAUNCHES) -> float:
    """Kernel-only microseconds per call: ``launches`` calls of ``fn`` captured in one CUDA graph (after a
    warm-up on a side stream, so module loads and allocations stay out of it), each replay timed with
    events, the median replay divided by ``launches``."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    del graph
    return statistics.median(times)


def host_us(fn, device, calls: int = HOST_CALLS) -> float:
    """The host's microseconds per eager call of ``fn``: a wall clock around ``calls`` calls issued back to
    back (synchronized before, not inside: the launcher's cost, not the kernel's)."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return elapsed / calls * 1e6


def copy_bandwidth_gbs(device, nbytes: int = 1 << 30) -> float:
    """This device's device-to-device copy bandwidth (read + write bytes per second), in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = event_us(lambda: dst.copy_(src), device, repeats=10, warmup=3)
    return 2 * nbytes / (us * 1e-6) / 1e9


def make_cohort(history: int, page: str, device, seed: int = 0, streams: int | None = None):
    """(cache, q): a pool holding every stream's history and chunk (cache_seqlens = history), and the
    chunk's q. ``streams``: the ASR shape's 128 unless given (the CPU tests use a few)."""
    s = shape_for(history, streams=streams)
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
        from oasr.fast.kv_formats import quantize_fp8

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
        from oasr.fast.kv_formats import dequantize_fp8

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


def flex_inputs(cache: PagedKVCache, q: torch.Tensor, keys: int):
    """(q, k, v, block_mask) for FlexAttention over the pool's own pages, positions [0, keys) of each row.

    Queries: all streams' chunks as one sequence, (1, H, B*T, D), stream b at rows b*T .. b*T + T - 1.
    Keys: the pool head-major, (1, Hkv, blocks * block_size, D), a copy made once (fp8 dequantized to the
    model dtype). The block mask has query blocks of T rows (one stream each) and KV blocks of one page;
    stream b's KV blocks are its table's first ceil(keys / block_size) pages, full except a last partial
    page (its slots past ``keys`` masked by ``mask_mod``, which also stands alone: a slot is visible when
    its page is the stream's, by an inverse of the table). Nothing outside a stream's pages is read.
    Assumes every page belongs to one stream (true of ``make_cohort``; shared prefix pages would not be).
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, H, T, D = q.shape
    blocks, bs, n_kv, _ = cache.k_cache.shape
    k, v = cache.k_cache, cache.v_cache
    if cache.quantized:
        from oasr.fast.kv_formats import dequantize_fp8

        k, v = dequantize_fp8(k, cache.k_scale, q.dtype), dequantize_fp8(v, cache.v_scale, q.dtype)
    k_phys = k.permute(2, 0, 1, 3).reshape(1, n_kv, blocks * bs, D).contiguous()
    v_phys = v.permute(2, 0, 1, 3).reshape(1, n_kv, blocks * bs, D).contiguous()
    q_flat = q.permute(1, 0, 2, 3).reshape(1, H, B * T, D).contiguous()
    pages = math.ceil(keys / bs)
    partial = keys % bs  # slots of the last page that count (0: the last page is full)
    table = cache.block_table[:, :pages].to(torch.int32)
    device = q.device
    n_full = pages - (1 if partial else 0)

    def padded(ids: torch.Tensor) -> torch.Tensor:  # (B, n) -> (1, 1, B, blocks): rows padded to every KV block
        out = torch.zeros((B, blocks), dtype=torch.int32, device=device)
        out[:, : ids.shape[1]] = ids
        return out.view(1, 1, B, blocks)

    full_num = torch.full((1, 1, B), n_full, dtype=torch.int32, device=device)
    part_num = torch.full((1, 1, B), 1 if partial else 0, dtype=torch.int32, device=device)
    # mask_mod must hold on its own (the block lists only skip work): a slot is visible to stream b's
    # queries when its page is b's and its position is below `keys`. Each page belongs to one stream here.
    owner = torch.full((blocks,), -1, dtype=torch.int32, device=device)
    logical = torch.zeros((blocks,), dtype=torch.int32, device=device)
    owner[table.long()] = torch.arange(B, dtype=torch.int32, device=device)[:, None].expand(B, pages)
    logical[table.long()] = torch.arange(pages, dtype=torch.int32, device=device)[None, :].expand(B, pages)

    def own_pages(b, h, q_idx, kv_idx):
        page = kv_idx // bs
        return (owner[page] == q_idx // T) & (logical[page] * bs + kv_idx % bs < keys)

    mask = BlockMask.from_kv_blocks(part_num, padded(table[:, n_full:]), full_num, padded(table[:, :n_full]),
                                    BLOCK_SIZE=(T, bs), mask_mod=own_pages,
                                    seq_lengths=(B * T, blocks * bs))  # fmt: skip
    return q_flat, k_phys, v_phys, mask


def _flex_runner(cache: PagedKVCache, q: torch.Tensor, keys: int):
    """A callable running compiled FlexAttention over the pages (``flex_inputs``), output (B, H, T, D)."""
    from torch.nn.attention.flex_attention import flex_attention

    B, H, T, D = q.shape
    q_flat, k_phys, v_phys, mask = flex_inputs(cache, q, keys)
    flex = torch.compile(flex_attention, dynamic=False)
    options = {"BLOCK_M": T, "BLOCK_N": cache.block_size}  # the mask's blocks: a stream x a page

    def run():
        out = flex(q_flat, k_phys, v_phys, block_mask=mask, enable_gqa=True, kernel_options=options)
        return out.reshape(H, B, T, D).transpose(0, 1)

    return run


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
        if cache.quantized:  # it would read the dequantized 16-bit pool: the bf16 row's computation, compiled again
            out["flex-paged"] = (None, "not run on fp8 pages: it reads 16-bit pages (see the bf16 row)")
        else:
            out["flex-paged"] = (_flex_runner(cache, q, keys), "pool head-major (one copy, untimed)")
    except Exception as exc:  # no Triton, or a torch without FlexAttention: say so in the row
        out["flex-paged"] = (None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
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
                        row["host_us"] = host_us(fn, device)
                        row["graph_us"] = graph_us(fn, device, repeats)
                        row["graph_GBps"] = moved / (row["graph_us"] * 1e-6) / 1e9
                        row["graph_of_copy_bw"] = row["graph_GBps"] / peak
                    except Exception as exc:  # report, keep benchmarking the others (what was timed stays)
                        note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                row["note"] = note
                rows.append(row)
            del cache, q
            torch.cuda.empty_cache()
    return rows
