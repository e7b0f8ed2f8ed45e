"""Benchmark harness: each section returns rows; ``python -m oasr bench`` prints them.

A row is a dict with ``section``, ``case``, ``reference_ms`` and ``fast_ms``
(medians per operation), plus any extra columns a section wants to show. The
harness adds ``ratio = reference_ms / fast_ms`` (how many times faster the fast
twin is). Everything is measured in one run, on one machine, so ratios are
meaningful even where absolute times are not. No test asserts a time.

Clock: on the CPU a time is the process's CPU time (``time.process_time``),
not wall time. The bench runs one torch thread (``--threads 1``), so on an
idle machine the two are the same; on a machine shared with other jobs the
wall clock also counts the time this process waited for a core, which made
the same row vary by 2-5x between runs here, while CPU time varies by far
less. Page faults and allocator work are CPU time, so they still count. A
CUDA device is timed with the wall clock around a synchronize.

Allocator: ``fix_malloc_thresholds`` (called by ``python -m oasr bench``)
pins glibc's mmap and trim thresholds. Left dynamic, glibc serves a large
temporary with a fresh ``mmap`` (page-faulted on every touch, unmapped on
free) until some earlier free has raised the threshold, so a section's times
depended on what ran before it (the same 8-stream attention tick measured
42 ms when it ran first and 17 ms when it ran second).
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_THRESHOLD_BYTES = 1 << 30


def fix_malloc_thresholds(threshold: int = MALLOC_THRESHOLD_BYTES) -> str:
    """Pin glibc's mmap and trim thresholds (see the module docstring); returns what was done.

    Allocations below ``threshold`` then come from the heap, which is neither
    unmapped nor trimmed on free, so a steady loop reuses memory that is
    already mapped, whatever ran before. Not glibc: says so and changes nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        return "malloc thresholds: left as they are (no glibc mallopt)"
    return f"malloc thresholds: mmap and trim fixed at {threshold >> 20} MiB / {threshold >> 19} MiB (glibc mallopt)"


def clock(device="cpu"):
    """The timer for ``device``: process CPU time on the CPU, the wall clock for CUDA (see above)."""
    return time.perf_counter if torch.device(device).type == "cuda" else time.process_time


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU. Call before reading a timer."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, repeats: int = 5, warmup: int = 1, device="cpu") -> float:
    """Median time of ``fn()`` in milliseconds on ``clock(device)`` (device-synchronised around each call)."""
    now = clock(device)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = now()
        fn()
        sync(device)
        times.append((now() - start) * 1e3)
    return statistics.median(times)


def paired_ms(reference_fn, fast_fn, repeats: int = 5, warmup: int = 1, device="cpu") -> tuple[float, float]:
    """Medians of ``reference_fn()`` and ``fast_fn()`` timed alternately, so that a change in the
    machine's load during the measurement touches both columns alike."""
    reference_ms, fast_ms = alternating_ms([reference_fn, fast_fn], repeats, warmup, device)
    return reference_ms, fast_ms


def alternating_ms(fns: list, repeats: int = 5, warmup: int = 1, device="cpu") -> list[float]:
    """Median ms of each of ``fns``, timed in turn within every repeat (``paired_ms`` for any number)."""
    return [statistics.median(t) for t in alternating_samples(fns, repeats, warmup, device)]


def alternating_samples(fns: list, repeats: int = 5, warmup: int = 1, device="cpu") -> list[list[float]]:
    """``alternating_ms``'s samples: per function, its ms in each repeat (repeat ``i`` of every function
    ran back to back, so a ratio of two functions' ``i``-th samples saw one load)."""
    now = clock(device)
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync(device)
    times: list[list] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = now()
            fn()
            sync(device)
            out.append((now() - start) * 1e3)
    return times


def with_ratio(rows: list[dict]) -> list[dict]:
    """Add ``ratio = reference_ms / fast_ms`` to every row that has both times; returns the rows."""
    for row in rows:
        ref, fast = row.get("reference_ms"), row.get("fast_ms")
        if ref is not None and fast:
            row["ratio"] = ref / fast
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table: case, the two times and the ratio first, other keys after."""
    if not rows:
        return "(no rows)"
    keys = ["case", "reference_ms", "fast_ms", "ratio"]
    keys += [k for row in rows for k in row if k not in keys and k != "section"]
    keys = list(dict.fromkeys(keys))

    def cell(value):
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return "" if value is None else str(value)

    table = [[k for k in keys]] + [[cell(row.get(k)) for k in keys] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
