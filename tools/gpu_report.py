"""tools/gpu_report.py BENCH_JSON [--device NAME] [--append DOC] -- the GPU attention rows as a markdown table.

Reads the rows ``python -m oasr bench --device cuda --json`` wrote (oasr/bench/attention_gpu.py: the
rows whose case starts with "gpu "), prints one table per page kind (kernel-only from graph replay,
per call with the launcher from events, the launcher's host time, GB/s and the fraction of the copy
bandwidth both ways, max error), and with ``--append`` adds it, under a dated heading naming the
device, to the end of DOC (docs/kernels.md in tools/gpu_check.sh). Every number it prints was
measured by that bench run; it computes nothing but ratios of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

COLUMNS = ["history", "kernel", "graph us (kernel only)", "event us (with launcher)", "host us / call",
           "graph GB/s", "graph of copy bw", "event of copy bw", "max err", "note"]  # fmt: skip


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def tables(rows: list[dict]) -> str:
    """Markdown for the GPU attention rows, one table per page kind, in the bench's order."""
    gpu = [r for r in rows if r.get("section") == "attention" and str(r.get("case", "")).startswith("gpu ")]
    if not gpu:
        raise ValueError("no GPU attention rows in the bench JSON (was it run with --device cuda?)")
    out = []
    copy = {round(r["copy_GBps"]) for r in gpu if r.get("copy_GBps")}
    out.append(f"Copy bandwidth (1 GiB device-to-device, this run): {', '.join(f'{c:,} GB/s' for c in sorted(copy))}.")
    for page in ("bf16", "fp8"):
        mine = [r for r in gpu if r["case"].startswith(f"gpu {page} ")]
        if not mine:
            continue
        out += ["", f"{page} pages:", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for r in mine:
            history = r["case"].rsplit("history=", 1)[-1]
            cells = [history, r["kernel"], _cell(r, "graph_us", "{:.1f}"), _cell(r, "us", "{:.1f}"),
                     _cell(r, "host_us", "{:.1f}"), _cell(r, "graph_GBps", "{:,.0f}"),
                     _cell(r, "graph_of_copy_bw", "{:.0%}"), _cell(r, "of_copy_bw", "{:.0%}"),
                     _cell(r, "max_err", "{:.1e}"), (r.get("note") or "").replace("|", "/")]  # fmt: skip
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_report.py", description=__doc__.split("\n")[0])
    parser.add_argument("bench_json")
    parser.add_argument("--device", default="a CUDA device", help="the device's name, for the heading")
    parser.add_argument("--append", metavar="DOC", help="append the tables under a dated heading to DOC")
    args = parser.parse_args(argv)
    try:
        text = tables(json.loads(Path(args.bench_json).read_text()))
    except (OSError, ValueError) as exc:
        print(f"tools/gpu_report.py: {exc}", file=sys.stderr)
        return 2
    print(text)
    if args.append:
        day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        heading = (f"\n\n### Measured by tools/gpu_check.sh on {args.device}, {day}\n\n"
                   "`python -m oasr bench --quick --device cuda --sections attention` (oasr/bench/attention_gpu.py), "
                   "one run: read it with the ranges of the earlier runs in mind.\n\n")  # fmt: skip
        with open(args.append, "a") as handle:
            handle.write(heading + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
