"""Bench section: one attention tick (append + attention over every layer).

12 layers, head_dim 64, 4 KV heads (4 query heads), chunk 16, at 1, 8, 32 and
128 streams with 0 to 1024 frames of history; reference against fast. On a
GPU each row adds the bytes moved (K/V pages read, chunk K/V written, q and
out) and the achieved GB/s against the device's measured copy bandwidth.
"""

from __future__ import annotations

import math

import torch

from oasr.bench import paired_ms
from oasr.cache.paged import PagedKVCache
from oasr.fast import cpu_rows

LAYERS, N_KV, N_HEAD, HEAD_DIM, CHUNK, BLOCK = 12, 4, 4, 64, 16, 16
NOTES = (
    "on the CPU the fast twin picks its path by size (oasr.fast.cpu_rows.use_row_loop; column fast_path): "
    f"the row loop for <= {cpu_rows.ROW_LOOP_MAX_ROWS} rows or spans >= {cpu_rows.ROW_LOOP_MIN_SPAN} keys, "
    "the vectorised row tiles otherwise; reference and fast are timed alternately"
)


def _cohort(streams: int, history: int, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = math.ceil((history + CHUNK) / BLOCK)
    num_blocks = streams * width + 1
    table = torch.randperm(num_blocks - 1, generator=g)[: streams * width].view(streams, width).to(torch.int32)
    k_pool = torch.randn(LAYERS, num_blocks, BLOCK, N_KV, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    v_pool = torch.randn(LAYERS, num_blocks, BLOCK, N_KV, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    seqlens = torch.full((streams,), history, dtype=torch.int32, device=device)
    seqstarts = torch.zeros(streams, dtype=torch.int32, device=device)
    caches = [
        PagedKVCache(k_pool[layer], v_pool[layer], table.to(device), seqlens, seqstarts, BLOCK, history, history, layer)
        for layer in range(LAYERS)
    ]
    k = torch.randn(streams, CHUNK, N_KV, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(streams, N_HEAD, CHUNK, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    return caches, q, k


def _tick(ops, caches, q, k):
    for cache in caches:
        ops.append_kv(cache, k, k)
        ops.paged_attention(q, cache)


def bytes_moved(streams: int, history: int, elem: int) -> int:
    """Bytes one tick's attention must move at least: the history K/V read, the chunk's K/V written, q and out."""
    per_layer = streams * (
        2 * (history + CHUNK) * N_KV * HEAD_DIM  # K and V read
        + 2 * CHUNK * N_KV * HEAD_DIM  # chunk K and V written
        + 2 * N_HEAD * CHUNK * HEAD_DIM  # q read, out written
    )
    return LAYERS * per_layer * elem


def section(quick: bool, device="cpu") -> list[dict]:
    """This section's rows (``quick``: the reduced grid) on ``device``; see the module docstring."""
    from oasr import fast, reference

    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    grid = [(1, 0), (8, 256), (32, 1024), (128, 0)] if quick else [
        (s, h) for s in (1, 8, 32, 128) for h in (0, 256, 1024)
    ]
    peak = None
    if device.type == "cuda":  # one measurement of the copy bandwidth serves both tables
        from oasr.bench import attention_gpu

        peak = attention_gpu.copy_bandwidth_gbs(device)
    rows = []
    for streams, history in grid:
        caches, q, k = _cohort(streams, history, device, dtype)
        row = {"section": "attention", "case": f"streams={streams} history={history}"}
        reps = 3 if (streams * (history + CHUNK) > 8 * 1040) else 5
        args = (caches, q, k)
        row["reference_ms"], row["fast_ms"] = paired_ms(
            lambda a=args: _tick(reference, *a), lambda a=args: _tick(fast, *a), repeats=reps, device=device
        )
        if device.type == "cpu":
            row["fast_path"] = "rows" if cpu_rows.use_row_loop(caches[0], streams, CHUNK) else "tiles"
        moved = bytes_moved(streams, history, dtype.itemsize)
        row["MB_moved"] = moved / 1e6
        if peak:
            achieved = moved / (row["fast_ms"] * 1e-3) / 1e9
            row["fast_GBps"] = achieved
            row["of_copy_bw"] = achieved / peak
        rows.append(row)
    if device.type == "cuda":  # one layer at the ASR shape: v1, v2, SDPA, FlashInfer (oasr/bench/attention_gpu.py)
        rows += attention_gpu.section(quick, device, peak=peak)
    return rows
