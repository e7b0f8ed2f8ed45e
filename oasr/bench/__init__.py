"""Benchmark harness: each section returns rows; ``python -m oasr bench`` prints them.

A row is a dict with ``section``, ``case``, ``reference_ms`` and ``fast_ms``
(medians per operation), plus any extra columns a section wants to show. The
harness adds ``ratio = reference_ms / fast_ms`` (how many times faster the fast
twin is). Everything is measured in one run, on one machine, so ratios are
meaningful even where absolute times are not. No test asserts a time.
"""

from __future__ import annotations

import statistics
import time

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, repeats: int = 5, warmup: int = 1, device="cpu") -> float:
    """Median wall time of ``fn()`` in milliseconds (device-synchronised around each call)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def with_ratio(rows: list[dict]) -> list[dict]:
    for row in rows:
        ref, fast = row.get("reference_ms"), row.get("fast_ms")
        if ref is not None and fast:
            row["ratio"] = ref / fast
    return rows


def format_table(rows: list[dict]) -> str:
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
