"""SASS report: each kernel's main loop, its instruction mix, and a paper model of its speed.

``python -m oasr kernels --sass`` runs ``report()``. For every kernel in the registry and every arch
it NVRTC-compiles the family (``nvrtc.compile_family``, cached), disassembles the cubin with the pip
``nvdisasm`` (launch bounds from ``cuobjdump -elf``), finds the main loop and counts what it issues.
For the attention kernels (``registry.attention_kernels()``: v1, v2 when registered) it then models
one tick at the ASR shape on an H200; instances with the relative-position term (``registry.REL_ARG``,
``oasr.cache.rel_bias``) get their own rows, ``v1+rel`` and ``v3+rel``, their table's bytes included.
Nothing here runs on a GPU.

THIS IS A MODEL, NOT A MEASUREMENT. It is how kernel speed is judged while no GPU is lent; numbers
from ``python -m oasr bench --device cuda`` replace it wherever they exist.

The pieces: ``oasr.fast.kernels.sass`` reads the SASS (main loop, instruction mix),
``oasr.fast.kernels.perf_model`` is the time model and its calibration; this module runs them over the
registry and formats the tables.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

from oasr.fast.kernels.perf_model import (
    ARCH_LIMITS,
    ASR_SHAPE,
    CALIBRATION,
    DISCLAIMER,
    H200,
    HISTORIES,
    MEASURED_V2,
    MODEL_DTYPE,
    PAGES,
    TILINGS,
    AttentionShape,
    calibration_check,
    calibration_check_v3,
    ctas_per_sm,
    model_attention,
)
from oasr.fast.kernels.sass import CLASSES, main_loop, parse_max_threads, parse_sass, run_tool

# -- the report ----------------------------------------------------------------------------------


def _matches_shape(targs: tuple[str, ...], page_type: str, shape: AttentionShape) -> bool:
    """An instantiation for bf16 q/out, ``page_type`` pages, the shape's head_dim (and, if it takes more
    numbers as template arguments, one equal to the block size)."""
    numbers = [a for a in targs if a.isdigit()]
    if not targs or targs[0] != MODEL_DTYPE or page_type not in targs[1:] or str(shape.head_dim) not in numbers:
        return False
    rest = list(numbers)
    rest.remove(str(shape.head_dim))
    return not rest or str(shape.block_size) in rest


def report(archs=("sm_80", "sm_90"), *, use_cache: bool = True, families=None, shape: AttentionShape = ASR_SHAPE,
           histories=HISTORIES):
    """Every kernel's main loop and resources per arch, and the attention model at ``shape`` with each of
    ``histories`` frames of history (keys = history + chunk). A dict (JSON-able)."""
    from oasr.fast.kernels import nvrtc, registry

    attention = {registry.short_name(k): registry.kernel_version(k) for k in registry.attention_kernels()}
    kernels, model, notes = [], [], []
    builds = [(arch, family) for arch in archs for family in families or registry.families()]
    compiled_by = {b: nvrtc.compile_family(b[1], b[0], use_cache=use_cache) for b in builds}

    def disassemble(build):
        cubin = compiled_by[build].cubin
        elf = run_tool("cuobjdump", "-elf", cubin=cubin)
        return parse_sass(run_tool("nvdisasm", "-c", cubin=cubin)), parse_max_threads(elf)

    with ThreadPoolExecutor(max_workers=4) as pool:  # the disassemblers are separate processes
        disassembled = dict(zip(builds, pool.map(disassemble, builds), strict=True))
    for arch, family in builds:
        compiled = compiled_by[arch, family]
        functions, threads = disassembled[arch, family]
        for kernel in registry.kernels_of(family):
            short = registry.short_name(kernel)
            for targs in kernel.instances:
                expr = kernel.name_expression(targs)
                mangled = compiled.symbols[expr]
                res = compiled.resources[expr]
                counts, how = main_loop(functions[mangled])
                n_threads = threads.get(mangled, 128)
                resident, limiter = ctas_per_sm(res.registers, res.shared_bytes, n_threads, arch)
                row = {
                    "kernel": expr, "short": short, "arch": arch, "version": attention.get(short),
                    "registers": res.registers, "shared_bytes": res.shared_bytes,
                    "spill_bytes": res.spill_stores + res.spill_loads, "threads": n_threads,
                    "threads_from": "launch bounds" if mangled in threads else "assumed 128",
                    "ctas_per_sm": resident, "occupancy_limiter": limiter,
                    "loop": how, "loop_offsets": [counts.head, counts.tail],
                    "trips_unknown": counts.trips_unknown, "loop_instructions": counts.total,
                    "mix": {c: counts.classes.get(c, 0) for c in CLASSES},
                }  # fmt: skip
                kernels.append(row)
                if short not in attention:
                    continue
                rel = targs[-1] == registry.REL_ARG  # the relative-position term's instance: its own rows
                label = f"v{attention[short]}" + ("+rel" if rel else "")
                for page, (page_type, _, _) in PAGES.items():
                    if not _matches_shape(targs, page_type, shape):
                        continue
                    tiling = TILINGS.get(short)
                    if tiling is None:
                        notes.append(f"{short}: no entry in perf_model.TILINGS, so no time model (add one)")
                        continue
                    for history in histories:
                        at = replace(shape, keys=history + shape.chunk)
                        entry = model_attention(counts, res.registers, res.shared_bytes, n_threads, arch, tiling,
                                                page, at, rel=rel)  # fmt: skip
                        model.append({"kernel": expr, "version": label, "arch": arch, **entry})
    model.sort(key=lambda r: (r["page"], r["arch"], r["history"], r["version"]))
    return {
        "disclaimer": DISCLAIMER,
        "machine": {**asdict(H200), "pipe_cycles": {k: list(v) for k, v in H200.pipe_cycles.items()}},
        "arch_limits": {k: asdict(v) for k, v in ARCH_LIMITS.items()},
        "shape": asdict(shape),
        "kernels": kernels,
        "attention_model": model,
        "calibration": {**asdict(CALIBRATION),
                        "measured_v2": {f"{p} {h}": list(v) for (p, h), v in MEASURED_V2.items()}},
        "notes": sorted(set(notes)),
    }


def _markdown(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


MODEL_COLUMNS = ["version", "arch", "pages", "history", "instr/tile (warp)", "per 32 keys", "live warps",
                 "busiest SMSP instr/step", "CTAs/SM", "CTAs", "tiles", "fixed us", "issue us", "memory us",
                 "in flight KB/SM", "kernel us", "TB/s", "of 4.3 TB/s", "bound", "event us (+host)"]


def _model_cells(r: dict) -> list:
    return [
        r["version"], r["arch"], r["page"], r["history"], r["instr_per_tile_warp"], r["instr_per_32_keys_warp"],
        r["live_warps"], f"{r['busiest_smsp_instr']:.0f}", f"{r['ctas_per_sm']} ({r['occupancy_limiter']})",
        r["ctas"], r["tiles_per_cta"], r["fixed_us"], _span(r["issue_us"], "{:.0f}"), r["memory_us"],
        r["in_flight_kb_per_sm"], _span(r["kernel_us"], "{:.0f}"), _span(r["modelled_tbs"], "{:.2f}"),
        _span([100 * f for f in r["fraction_of_bw"]], "{:.0f}") + "%", r["bound"], _span(r["event_us"], "{:.0f}"),
    ]  # fmt: skip


def _span(pair, fmt: str) -> str:
    low, high = (fmt.format(v) for v in pair)
    return low if low == high else f"{low}-{high}"


def format_report(rep: dict, *, all_kernels: bool = True) -> str:
    """Markdown tables: the attention model (pasteable into docs/kernels.md), then every kernel's loop."""
    s = rep["shape"]
    out = [
        rep["disclaimer"],
        "",
        f"Attention model: {s['streams']} streams x (history + {s['chunk']}) keys, chunk {s['chunk']}, "
        f"head_dim {s['head_dim']}, "
        f"{s['n_head']} query heads over {s['n_kv_head']} KV heads, block {s['block_size']}, bf16 q/out.",
        "",
        _markdown(
            MODEL_COLUMNS,
            [_model_cells(r) for r in rep["attention_model"]],
        ),  # fmt: skip
    ]
    out += [f"note: {n}" for n in rep["notes"]]
    check = calibration_check(rep)
    if check:
        c = rep.get("calibration", asdict(CALIBRATION))
        out += [
            "",
            f"Calibration (fitted on the measured v2 bf16 points: issue efficiency {c['issue_efficiency']}, host "
            f"{c['host_us']} us; assumed: launch {c['launch_us']} us, one memory trip {c['memory_trip_us']} us). "
            "v2 on sm_90, event-timed, model against the H200 measurements:",
            "",
            _markdown(["pages", "history", "modelled event us", "measured us (3 runs)", "inside"],
                      [[r["page"], r["history"], _span(r["modelled_event_us"], "{:.0f}"),
                        "{}-{}".format(*r["measured_us"]), "yes" if r["inside"] else "NO"] for r in check]),
        ]  # fmt: skip
    check3 = calibration_check_v3(rep)
    if check3:
        out += [
            "",
            "v3 on sm_90, kernel-only (graph replay), model against the H200 measurements of 2026-12-04 "
            "(launch, streaming bandwidth and v3's chain latency fitted on them; step terms in cycles of the "
            "busiest sub-partition per tile):",
            "",
            _markdown(["pages", "history", "modelled us", "measured us (2 runs)", "error", "bound",
                       "issue / xu / chain / mio cycles", "fp8 speed-up model / measured"],
                      [[r["page"], r["history"], r["modelled_kernel_us"], "{}-{}".format(*r["measured_us"]),
                        f"{100 * r['error']:+.0f}%", r["bound"],
                        "{issue} / {xu} / {chain} / {m}".format(m=r["step_terms"]["mio"][1], **r["step_terms"]),
                        f"{r['modelled_ratio']}x / {r['measured_ratio']}x" if "modelled_ratio" in r else ""]
                       for r in check3]),
        ]  # fmt: skip
    rows = [r for r in rep["kernels"] if all_kernels or r["version"]]
    out += [
        "",
        "Main loop per kernel (one warp, one iteration; heuristic in oasr/fast/kernels/sass.py):",
        "",
        _markdown(
            ["kernel", "arch", "regs", "smem B", "spill B", "CTAs/SM", "loop", "instr", *CLASSES],
            [[r["kernel"].replace("oasr::", ""), r["arch"], r["registers"], r["shared_bytes"], r["spill_bytes"],
              r["ctas_per_sm"], r["loop"] + ("*" if r["trips_unknown"] else ""), r["loop_instructions"],
              *(r["mix"][c] for c in CLASSES)] for r in rows],
        ),  # fmt: skip
        "(* a nested loop's trip count was not read off the SASS and counts once)",
    ]
    return "\n".join(out)
