"""The SASS report (oasr.fast.kernels.sass): parsing, loop finding, occupancy and the model's arithmetic.

Unit tests run on hand-written SASS and known numbers; the report tests compile the attention
family for sm_80 and sm_90 and read the real disassembly (no GPU needed). v2's HMMA test is skipped
only while no v2 attention kernel is registered.
"""

from __future__ import annotations

import json
import re

import pytest

from oasr.fast.kernels import nvrtc, perf_model, registry, sass, sass_report

ARCHS = ("sm_80", "sm_90")

try:
    nvrtc.cuda_include_dir()
    from cuda.core import Program  # noqa: F401

    sass.find_tool("nvdisasm"), sass.find_tool("cuobjdump")
    _MISSING = None
except Exception as exc:  # cuda-python, the CUDA headers or the pip disassemblers are not installed
    _MISSING = str(exc)

needs_toolchain = pytest.mark.skipif(_MISSING is not None, reason=f"NVRTC unavailable: {_MISSING}")

# A loop nest the way nvdisasm prints it: an outer loop with a global load and FFMAs around an
# inner loop whose counter goes 0 -> 0x40 in steps of 0x10 (4 trips), and a loop with no loads.
SASS_TEXT = """
        .section        .text._Z6kernelv,"ax",@progbits
        /*0000*/                   MOV R2, RZ ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R8.64] ;
        /*0020*/                   HFMA2.MMA R3, -RZ, RZ, 0, 0 ;
.L_x_2:
        /*0030*/                   VIADD R3, R3, 0x10 ;
        /*0040*/                   LDS.128 R12, [R9] ;
        /*0050*/                   FFMA R5, R4, R5, R6 ;
        /*0060*/                   ISETP.NE.AND P0, PT, R3, 0x40, PT ;
        /*0070*/               @P0 BRA `(.L_x_2) ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/                   IADD3 R2, R2, 0x20, RZ ;
        /*00a0*/                   ISETP.GE.AND P1, PT, R2, R10, PT ;
        /*00b0*/              @!P1 BRA `(.L_x_1) ;
.L_x_3:
        /*00c0*/                   IMAD R1, R1, R1, RZ ;
        /*00d0*/                   BRA `(.L_x_3) ;
        /*00e0*/                   EXIT ;
.L_x_4:
        /*00f0*/                   BRA `(.L_x_4) ;
"""


def test_parse_and_loop_nest():
    fn = sass.parse_sass(SASS_TEXT)["_Z6kernelv"]
    assert len(fn.instrs) == 16 and fn.labels[".L_x_2"] == 0x30
    loops = sass.find_loops(fn)
    assert [(lp.head, lp.tail) for lp in loops] == [(0x10, 0xB0), (0xC0, 0xD0)]  # the trailing trap is no loop
    outer, _ = loops
    assert outer.trips is None  # bound is a register
    assert [(c.head, c.tail, c.trips) for c in outer.children] == [(0x30, 0x70, 4)]


def test_main_loop_weights_nested_trips():
    fn = sass.parse_sass(SASS_TEXT)["_Z6kernelv"]
    counts, how = sass.main_loop(fn)
    assert how == "load-math-loop" and (counts.head, counts.tail) == (0x10, 0xB0)
    # outer body: LDG, HFMA2, BAR, IADD3, ISETP, BRA (6) + inner 5 instructions x 4 trips
    assert counts.total == 26
    assert counts.classes["FFMA"] == 4 and counts.classes["LDS/LDSM"] == 4 and counts.classes["LDGSTS/LDG"] == 1
    assert counts.classes["BAR"] == 1 and not counts.trips_unknown
    assert counts.mio_bytes == 512 + 4 * 512 and counts.mio_bytes_low == 512 + 4 * 128


def test_trip_count_compare_before_step():
    text = SASS_TEXT.replace(
        "        /*0030*/                   VIADD R3, R3, 0x10 ;\n", ""
    ).replace("        /*0060*/                   ISETP.NE.AND P0, PT, R3, 0x40, PT ;\n",
              "        /*0060*/                   ISETP.LT.AND P0, PT, R3, 0x30, PT ;\n"
              "        /*0068*/                   VIADD R3, R3, 0x10 ;\n")  # fmt: skip
    outer = sass.find_loops(sass.parse_sass(text)["_Z6kernelv"])[0]
    assert outer.children[0].trips == 4  # 0, 0x10, 0x20, 0x30 pass the compare


@pytest.mark.parametrize(
    "regs,smem,threads,arch,expect",
    [
        (71, 25600, 128, "sm_90", (7, "registers")),  # v1 bf16 D=64 (1.11 waves at 128 streams)
        (78, 25600, 128, "sm_80", (6, "registers")),
        (122, 46080, 128, "sm_90", (4, "registers")),
        (24, 0, 128, "sm_90", (16, "threads")),
        (32, 100_000, 128, "sm_90", (2, "shared")),
        (16, 0, 32, "sm_90", (32, "ctas")),
    ],
)
def test_ctas_per_sm(regs, smem, threads, arch, expect):
    assert perf_model.ctas_per_sm(regs, smem, threads, arch) == expect


def test_bytes_moved_at_the_asr_shape():
    s = perf_model.ASR_SHAPE
    q_out = 2 * 128 * 8 * 16 * 64 * 2
    assert s.bytes_moved(2) == 2 * 128 * 1040 * 4 * 64 * 2 + q_out
    assert s.bytes_moved(1, 4) == 2 * 128 * 1040 * 4 * (64 + 4) + q_out


def test_cta_tile_cycles_picks_the_binding_resource():
    fn = sass.parse_sass(SASS_TEXT)["_Z6kernelv"]
    counts, _ = sass.main_loop(fn)
    high = perf_model.cta_tile_cycles(counts, 4)
    low = perf_model.cta_tile_cycles(counts, 4, broadcast=True)
    # 4 warps, one per SMSP: 26 issue slots; the SM's mio path moves (512 + 4*512) * 4 B at 128 B/clk
    assert high == {"cycles": 80.0, "bound": "mio", "issue_slots": 26}
    assert low["cycles"] == 32.0 and low["bound"] == "mio"  # (512 + 4*128) * 4 / 128


def test_tools_are_found():
    if _MISSING:
        pytest.skip(f"NVRTC unavailable: {_MISSING}")
    assert sass.find_tool("nvdisasm").endswith("nvdisasm")
    with pytest.raises(RuntimeError, match="pip install nvidia-cuda-no-such-tool"):
        sass.find_tool("no-such-tool")


@pytest.fixture(scope="module")
def attention_report():
    families = sorted({k.family for k in registry.attention_kernels()})
    return sass_report.report(ARCHS, families=families)


@needs_toolchain
def test_report_is_json_and_finds_v1_main_loop(attention_report):
    rep = json.loads(json.dumps(attention_report))
    assert "MODEL, NOT MEASURED" in rep["disclaimer"]
    v1 = [r for r in rep["kernels"] if r["short"] == "paged_chunk_attention_kernel"]
    assert {r["arch"] for r in v1} == set(ARCHS) and len(v1) == 2 * len(registry.BY_NAME[v1[0]["short"]].instances)
    for r in v1:
        assert r["loop"] == "load-math-loop", r["kernel"]
        assert r["mix"]["FFMA"] > 0 and r["mix"]["LDGSTS/LDG"] > 0 and r["mix"]["BAR"] > 0, r
        assert r["loop_instructions"] == sum(r["mix"].values())
        assert r["threads"] == 128 and r["threads_from"] == "launch bounds"
        assert r["mix"]["HMMA"] == 0  # v1 is the scalar kernel


@needs_toolchain
def test_model_rows_for_v1(attention_report):
    rows = [r for r in attention_report["attention_model"] if r["version"] == "v1"]
    assert {(r["arch"], r["page"], r["history"]) for r in rows} == {
        (a, p, h) for a in ARCHS for p in perf_model.PAGES for h in perf_model.HISTORIES
    }
    for r in rows:
        low, high = r["kernel_us"]
        assert r["memory_us"] + r["fixed_us"] <= low + 0.1 and low <= high
        assert r["event_us"][0] == pytest.approx(low + perf_model.CALIBRATION.host_us, abs=0.11)
        assert 0 < r["fraction_of_bw"][0] <= r["fraction_of_bw"][1] <= 1
        if r["history"] == 1024:
            assert r["ctas"] == 128 * 4 * 2 and r["tiles_per_cta"] == 33  # 32 query rows per KV head, 16 per CTA
    text = sass_report.format_report(attention_report)
    assert "| v1 | sm_90 | bf16 |" in text and "MODEL, NOT MEASURED" in text


V2 = [k for k in registry.attention_kernels() if registry.kernel_version(k) == 2]


@needs_toolchain
@pytest.mark.skipif(not V2, reason="no v2 attention kernel registered (oasr/kernels_cu/paged_chunk_attention_v2.cu)")
@pytest.mark.parametrize("arch", ARCHS)
def test_v2_main_loop_runs_on_tensor_cores(attention_report, arch):
    rows = [r for r in attention_report["kernels"] if r["version"] == 2 and r["arch"] == arch]
    assert rows
    for r in rows:
        assert r["loop"] == "load-math-loop", r["kernel"]
        assert r["mix"]["HMMA"] > 0, f"{r['kernel']} on {arch}: no HMMA in the main loop: {r['mix']}"
    modelled = [r for r in attention_report["attention_model"] if r["version"] == "v2" and r["arch"] == arch]
    assert modelled, f"v2 has no time model: add its Tiling to perf_model.TILINGS ({attention_report['notes']})"


@needs_toolchain
def test_kernels_command_sass_table_and_json(tmp_path, capsys):
    from oasr.commands.kernels import main

    path = tmp_path / "kernels.json"
    assert main(["--arch", "sm_90", "--sass", "--json", str(path), "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "MODEL, NOT MEASURED" in out and "| v1 | sm_90 | bf16 |" in out and "| v1 | sm_90 | fp8 |" in out
    # without --verbose: a summary of a few lines (the README's command printed ~685)
    assert main(["--arch", "sm_90", "--sass"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 4, lines
    assert re.search(r"the K/V main loop found in (\d+) of \1 attention kernels", lines[-1]), lines[-1]
    data = json.loads(path.read_text())
    assert {r["kernel"] for r in data["sass"]["kernels"]} == {r["kernel"] for r in data["kernels"]}


@needs_toolchain
def test_kernels_command_fails_when_an_attention_loop_is_lost(monkeypatch, capsys):
    from oasr.commands.kernels import main

    def lost(archs, use_cache=True):
        row = {"kernel": "oasr::paged_chunk_attention_kernel<...>", "arch": "sm_90", "version": 1, "loop": "no-loop"}
        return {"disclaimer": "", "shape": {}, "kernels": [row], "attention_model": [], "notes": []}

    monkeypatch.setattr(sass_report, "report", lost)
    monkeypatch.setattr(sass_report, "format_report", lambda rep: "")
    assert main(["--arch", "sm_90", "--sass"]) == 1
    assert "no K/V main loop found in oasr::paged_chunk_attention_kernel<...> sm_90" in capsys.readouterr().err


# -- the calibrated model and v3's ceilings -------------------------------------------------------

V3 = [k for k in registry.attention_kernels() if registry.kernel_version(k) == 3]
# v3's main loop on sm_90 (D 64, block 16, bf16 queries), per warp per 32 keys: the budget the kernel was
# cut to (v2: about 550 on 16-bit pages, 670 on fp8). On fp8 pages both mma run in f16 (243 per 32 keys as
# measured); with two row tiles per warp (half the conversions, twice the row statistics and Q read from
# shared memory) about 260.
V3_CEILINGS = {"__nv_bfloat16": 360, "__nv_fp8_e4m3": 265}


@needs_toolchain
@pytest.mark.skipif(not V3, reason="no v3 attention kernel registered")
def test_v3_main_loop_under_its_ceilings_without_spills(attention_report):
    rows = [r for r in attention_report["kernels"] if r["version"] == 3]
    assert rows and all(r["spill_bytes"] == 0 for r in rows), [r["kernel"] for r in rows if r["spill_bytes"]]
    tiling = perf_model.TILINGS["paged_chunk_attention_v3_kernel"]
    for page, ceiling in V3_CEILINGS.items():
        name = f"oasr::paged_chunk_attention_v3_kernel<__nv_bfloat16, {page}, 64, 16>"
        (r,) = [r for r in rows if r["kernel"] == name and r["arch"] == "sm_90"]
        assert r["loop"] == "load-math-loop" and r["mix"]["HMMA"] > 0
        per_32_keys = r["loop_instructions"] * 32 / tiling.keys("fp8" if "fp8" in page else "bf16")
        assert per_32_keys <= ceiling, f"{name}: {per_32_keys:.0f} instructions per warp per 32 keys > {ceiling}"


@needs_toolchain
def test_calibrated_model_reproduces_the_measured_v2_points(attention_report):
    check = perf_model.calibration_check(attention_report)
    assert {(r["page"], r["history"]) for r in check} == set(perf_model.MEASURED_V2)
    outside = [r for r in check if not r["inside"]]
    assert not outside, f"the model misses measured v2 points: {outside}"
    # the stored constants are the fit on the bf16 points (the fp8 points above were not fitted)
    efficiency, host = perf_model.fit_calibration(attention_report)
    assert efficiency == pytest.approx(perf_model.CALIBRATION.issue_efficiency, rel=0.03)
    assert host == pytest.approx(perf_model.CALIBRATION.host_us, abs=3)


@needs_toolchain
@pytest.mark.skipif(not V3, reason="no v3 attention kernel registered")
def test_model_prices_v3_against_v2(attention_report):
    rows = {(r["version"], r["page"], r["history"]): r for r in attention_report["attention_model"]
            if r["arch"] == "sm_90"}  # fmt: skip
    for history in (1024, 4096):
        v2, v3 = rows["v2", "bf16", history], rows["v3", "bf16", history]
        assert v3["kernel_us"][1] < v2["kernel_us"][0]  # v3 is modelled faster than v2, kernel-only
        # memory-bound on bf16 pages, at 75% or more of 4.3 TB/s (measured on the H200: 78-90% of its copy)
        assert v3["bound"] == "memory" and v3["fraction_of_bw"][0] >= 0.75, v3
        assert v3["live_warps"] == 4 and v2["live_warps"] == 2  # every v3 warp has rows; half of v2's idle



@needs_toolchain
@pytest.mark.skipif(not V3, reason="no v3 attention kernel registered")
def test_model_recalibrated_on_the_measured_v3_points(attention_report):
    """The first H200 run measured v3 kernel-only (graph replay); the model, recalibrated on those
    six points, predicts each within 10% and the fp8 / bf16 speed-up within 10%, and says what bounds
    the fp8 loop (the per-warp dependent chain: latency, not bytes, not conversions)."""
    check = perf_model.calibration_check_v3(attention_report)
    assert {(r["page"], r["history"]) for r in check} == set(perf_model.MEASURED_V3)
    for r in check:
        assert abs(r["error"]) <= 0.10, r
        if r["page"] == "fp8":
            assert abs(r["ratio_error"]) <= 0.10, r
            assert r["bound"] == "latency", r  # the chain binds: issue slots and the XU pipe are below it
            terms = r["step_terms"]
            assert terms["chain"] > terms["xu"] > terms["issue"] > terms["mio"][1], terms
    fit = perf_model.fit_kernel_calibration(attention_report)
    assert fit["launch_us"] == pytest.approx(perf_model.CALIBRATION.launch_us, abs=0.2)
    assert fit["stream_bandwidth_tbs"] == pytest.approx(perf_model.CALIBRATION.stream_bandwidth_tbs, rel=0.03)
    chain = perf_model.TILINGS["paged_chunk_attention_v3_kernel"].chain_cycles_32
    assert fit["chain_cycles_32"] == pytest.approx(chain, rel=0.03)
    assert "fp8 speed-up model / measured" in sass_report.format_report(attention_report)


@needs_toolchain
@pytest.mark.skipif(not V3, reason="no v3 attention kernel registered")
def test_model_prices_the_two_row_tile_fp8_build(attention_report):
    """fp8 pages at head_dim 64 give each warp both row tiles (two independent chains, each K/V byte widened
    once per CTA): the XU pipe's load per step halves and the chain no longer bounds the step, if a warp's
    second chain hides behind its first (``Tiling.chain_overlap``, ASSUMED). The 16-bit rows are the
    measured build's. A model of a build that has not run on a GPU: these hold the model, not the kernel."""
    rows = {(x["page"], x["history"]): x for x in perf_model.v3_predictions(attention_report)}
    measured = {x["history"]: x for x in perf_model.measured_v3_fp8_rows()}
    for history in perf_model.HISTORIES:
        fp8, bf16 = rows["fp8", history], rows["bf16", history]
        assert abs(bf16["model_us"] / bf16["measured_us"] - 1) <= 0.10  # the 16-bit loop is the measured one
        old = measured[history]["step_terms"]
        assert fp8["step_terms"]["xu"] <= 0.6 * old["xu"] and fp8["step_terms"]["chain"] < old["chain"]
        assert fp8["bound"] != "latency" and fp8["no_overlap_us"] > fp8["model_us"]
    assert rows["fp8", 4096]["model_ratio"] > rows["fp8", 4096]["measured_ratio"]
