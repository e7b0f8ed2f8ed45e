"""``python -m oasr kernels``: NVRTC-compile every kernel and print its resources.

For each arch (default ``sm_80,sm_90``) and every instantiation in
``oasr.fast.kernels.registry``: registers per thread, static shared memory,
stack frame and spill bytes, from ptxas's verbose log. No GPU or driver is
needed. Exits 1 on any compile error (the log goes to stderr) and, with
``--fail-on-spill``, when any kernel spills. ``--json PATH`` also writes the
rows as JSON. ``--no-cache`` recompiles instead of reading the kernel cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oasr kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_80,sm_90", help="comma-separated archs, e.g. sm_80,sm_90")
    parser.add_argument("--no-cache", action="store_true", help="recompile instead of using the kernel cache")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    parser.add_argument("--fail-on-spill", action="store_true", help="exit 1 if any kernel spills")
    args = parser.parse_args(argv)

    from oasr.fast.kernels import nvrtc, registry

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    rows, failed = [], []
    for arch in archs:
        for family in registry.families():
            try:
                compiled = nvrtc.compile_family(family, arch, use_cache=not args.no_cache)
            except Exception as exc:  # report every failure, then exit non-zero
                failed.append(f"{family} {arch}")
                print(f"error: {exc}", file=sys.stderr)
                continue
            for expr, res in compiled.resources.items():
                rows.append({"kernel": expr, "arch": arch, **asdict(res)})

    header = f"{'kernel':70s} {'arch':6s} {'regs':>5s} {'smem B':>7s} {'stack B':>7s} {'spill st/ld B':>14s}"
    print(header)
    print("-" * len(header))
    for r in rows:
        spill = f"{r['spill_stores']}/{r['spill_loads']}"
        print(
            f"{r['kernel']:70s} {r['arch']:6s} {r['registers']:5d} {r['shared_bytes']:7d} "
            f"{r['stack_bytes']:7d} {spill:>14s}"
        )
    spilling = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"\n{len(rows)} kernels, {len(failed)} compile errors, {len(spilling)} spilling")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": rows, "errors": failed}, f, indent=1)
    if failed:
        return 1
    if args.fail_on_spill and spilling:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
