"""``python -m oasr kernels``: NVRTC-compile every kernel and print its resources.

For each arch (default ``sm_80,sm_90``) and every instantiation in
``oasr.fast.kernels.registry``: registers per thread, static shared memory,
stack frame and spill bytes, from ptxas's verbose log. No GPU or driver is
needed. Exits 1 on any compile error (the log goes to stderr) and, with
``--fail-on-spill``, when any kernel spills. ``--json PATH`` also writes the
rows as JSON. ``--no-cache`` recompiles instead of reading the kernel cache.

``--sass`` adds the SASS report (``oasr.fast.kernels.sass_report``): each kernel's
main loop and instruction mix from the pip nvdisasm, CTAs per SM, and a MODEL
(not a measurement) of the attention kernels on an H200 at the ASR shape, v1
and v2 side by side when both are registered; with ``--json`` it goes under
the "sass" key. Exits 1 if an attention kernel's K/V loop is not found.

Output: a few summary lines (counts, the largest kernel, whether every attention
main loop was found); ``--verbose`` prints every kernel's row and the SASS tables
(some 700 lines for two archs).

``--warm`` compiles every instantiation on its own for each arch, in ``--jobs`` processes: the cache
entries a launch reads (one instantiation each), so a cold machine pays the compiles once, in parallel.

``--gaps`` prints the kernel policy's report instead (``oasr.fast.kernel_policy``): the
declared kernel gaps (in scope, no kernel: torch serves them, counted), the declared
"kernel slower than torch" routings, and what torch served out of scope. It compiles
nothing and needs no NVRTC; the counts are this process's (zero from the command line).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict

from oasr.commands import CommandParser, check_output_path

_ARCH = re.compile(r"^(?:sm|compute)_(\d+)[af]?$")


def supported_archs() -> list[int]:
    """The compute capabilities this NVRTC compiles for, e.g. [75, 80, ..., 120] (``nvrtcGetSupportedArchs``)."""
    from cuda.bindings import nvrtc

    result, archs = nvrtc.nvrtcGetSupportedArchs()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcGetSupportedArchs failed: {result}")
    return list(archs)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Every option, before any compile (one line on stderr, exit status 2); returns the archs."""
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs:
        parser.error(f"--arch: no arch in {args.arch!r}; give e.g. sm_80,sm_90")
    try:
        supported = supported_archs()
    except ImportError as exc:  # the `cuda` extra is missing: a usage error like any other (exit 2, one line)
        parser.error(f"NVRTC is not installed ({exc}); install the `cuda` extra: pip install -e '.[cuda]' "
                     "(or, from PyPI, pip install 'oasr[cuda]')")
    names = ", ".join(f"sm_{n}" for n in supported)
    for arch in archs:
        match = _ARCH.match(arch)
        if match is None or int(match.group(1)) not in supported:
            parser.error(f"--arch {arch}: not an arch this NVRTC compiles for ({names})")
    if args.json:
        check_output_path(parser, args.json, "--json")
    if args.sass:  # the disassembler and the ELF reader, before 60-odd compiles make them matter
        from oasr.fast.kernels import sass

        for tool in ("nvdisasm", "cuobjdump"):
            try:
                sass.find_tool(tool)
            except RuntimeError:
                parser.error(f"--sass needs {tool}, which is not installed; pip install nvidia-cuda-{tool} "
                             "(in the `cuda` extra), or drop --sass")
    return archs


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m oasr kernels`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = CommandParser(prog="python -m oasr kernels", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("--arch", default="sm_80,sm_90", help="comma-separated archs")
    parser.add_argument("--no-cache", action="store_true", help="recompile instead of using the kernel cache")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH (default: not written)")
    parser.add_argument("--fail-on-spill", action="store_true", help="exit 1 if any kernel spills")
    parser.add_argument("--sass", action="store_true", help="main-loop instruction mix and the attention speed model")
    parser.add_argument("--gaps", action="store_true", help="print the declared kernel gaps and exit (no compile)")
    parser.add_argument("--verbose", action="store_true",
                        help="print every kernel's resources and, with --sass, the SASS tables (else a summary)")
    parser.add_argument("--warm", action="store_true",
                        help="compile every instantiation on its own (what a launch reads from the cache), "
                             "in --jobs processes, then exit")
    parser.add_argument("--jobs", type=int, default=None, help="--warm: processes (default: the CPUs)")
    args = parser.parse_args(argv)
    if args.gaps:
        from oasr.fast.kernel_policy import format_gap_report

        print(format_gap_report())
        return 0
    archs = _check_args(parser, args)

    from oasr.fast.kernels import nvrtc, registry

    if args.warm:
        for arch in archs:
            print(f"{nvrtc.warm_cache(arch, args.jobs)} instantiations cached for {arch} in {nvrtc.cache_dir()}")
        return 0

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

    if args.verbose:
        header = f"{'kernel':70s} {'arch':6s} {'regs':>5s} {'smem B':>7s} {'stack B':>7s} {'spill st/ld B':>14s}"
        print(header)
        print("-" * len(header))
        for r in rows:
            spill = f"{r['spill_stores']}/{r['spill_loads']}"
            print(
                f"{r['kernel']:70s} {r['arch']:6s} {r['registers']:5d} {r['shared_bytes']:7d} "
                f"{r['stack_bytes']:7d} {spill:>14s}"
            )
        print()
    spilling = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"{len(rows)} kernels for {', '.join(archs)}, {len(failed)} compile errors, {len(spilling)} spilling")
    if rows and not args.verbose:
        most = max(rows, key=lambda r: r["registers"])
        print(f"most registers: {most['registers']} ({most['kernel']}, {most['arch']}); "
              f"most static shared memory: {max(r['shared_bytes'] for r in rows)} B; "
              f"largest stack frame: {max(r['stack_bytes'] for r in rows)} B (--verbose: every kernel)")
    result = {"kernels": rows, "errors": failed}
    sass_ok = True
    if args.sass and not failed:
        from oasr.fast.kernels import sass_report

        result["sass"] = report = sass_report.report(archs, use_cache=not args.no_cache)
        attention = [r for r in report["kernels"] if r["version"]]
        lost = [f"{r['kernel']} {r['arch']}" for r in attention if r["loop"] != "load-math-loop"]
        if args.verbose:
            print("\n== SASS report ==\n" + sass_report.format_report(report))
        else:
            print(f"SASS: {len(report['kernels'])} kernels' main loops read; the K/V main loop found in "
                  f"{len(attention) - len(lost)} of {len(attention)} attention kernels; "
                  f"{len(report['attention_model'])} rows of the attention speed MODEL (not measured) "
                  "(--verbose: the tables)")
        for name in lost:
            print(f"error: no K/V main loop found in {name}", file=sys.stderr)
        sass_ok = not lost
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if failed or not sass_ok:
        return 1
    if args.fail_on_spill and spilling:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
