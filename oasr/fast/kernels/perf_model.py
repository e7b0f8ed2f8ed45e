"""The paper performance model of the attention kernels on an H200: its constants, occupancy and the time
of one tick from a kernel's main-loop counts (``oasr.fast.kernels.sass.LoopCounts``), and its calibration
against the measured points.

THIS IS A MODEL, NOT A MEASUREMENT. It is how kernel speed is judged while no GPU is lent; numbers
from ``python -m oasr bench --device cuda`` replace it wherever they exist.

Time model (one K/V tile = one main-loop iteration of every warp of a CTA; "a step" = one tile of
every CTA resident on an SM). Four terms, each with its constants in ``H200``, ``ARCH_LIMITS`` and
``CALIBRATION``::

    kernel_us = fixed + max(issue, memory)
    fixed     = launch + prologue trips x one dependent memory trip (the CTA's lengths, its block
                table, its first tile: what runs before the first mma and cannot overlap anything)
    issue     = waves x tiles x step cycles, a step = max(busiest SMSP, mio path) with
                busiest SMSP = the most instructions any one sub-partition issues for the step, warp
                w of the c-th resident CTA on SMSP (c x warps + w) % 4, warps with no query row
                issuing only their gather (warp roles), divided by the issue efficiency (an IPC
                cap: the fraction of clocks a busy sub-partition issues, latency included)
    memory    = bytes / min(achievable bandwidth, Little's law: SMs x bytes in flight per SM /
                one memory trip), bytes in flight = resident CTAs x (ring stages - 1) x stage bytes
    event_us  = host + kernel_us: what an event-timed call measured while the launcher ran inside
                the event window (the v2 table of docs/kernels.md)

The issue efficiency and the host term are fitted on the three measured v2 bf16 points (their
midpoints, least squares on the line event = host + fixed + tiles x step / efficiency); the fp8
points are not fitted and serve as the check (``calibration_check``). The shared-memory path is
priced two ways because the SASS cannot tell a broadcast from distinct words: full width (high) and
one 128-byte wavefront per LDS/STS (low); where it binds, the model gives a range.

Every constant of the model is in ``H200`` and ``ARCH_LIMITS`` below, with its source.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from oasr.fast.kernels import ops
from oasr.fast.kernels.sass import LoopCounts

# -- the model's constants: the ONE place ------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """The GPU the model prices instructions and bytes on."""

    name: str
    sms: int
    clock_ghz: float  # SM clock under load
    bandwidth_tbs: float  # achievable HBM bandwidth (a large device-to-device copy)
    peak_bandwidth_tbs: float
    sub_partitions: int  # SMSPs per SM, one warp instruction issued per SMSP per clock
    # cycles one warp instruction occupies its pipe on one SMSP, by opcode root
    pipe_cycles: dict[str, tuple[str, int]] = field(default_factory=dict)
    default_pipe: tuple[str, int] = ("alu", 2)  # integer/logic ALU: 16 lanes per SMSP
    mio_bytes_per_clk: int = 128  # shared memory / L1 per SM, shared by the SMSPs
    shfl_mio_cycles: int = 1  # 32 shuffle lanes per SM per clock
    l2_bytes: int = 50 * 2**20  # L2 (H100/H200: 50 MB): a working set below it stays resident across calls
    l2_bandwidth_tbs: float = 10.0  # ASSUMED: L2 read bandwidth (order of magnitude; Hopper microbenchmarks)


# Sources: NVIDIA H200 product brief (132 SMs in the SXM part, 4.8 TB/s HBM3e); the CUDA C++
# Programming Guide's throughput table for compute capability 9.0 (per SM per clock: 128 fp32
# FMA/MUL/ADD, 64 int32 multiply-add, 64 int32 add/compare/logic/shift, 16 special functions
# (MUFU), 16 conversions, 32 shuffles); shared memory 128 B per clock per SM; mma.sync
# m16n8k16 on Hopper measured near 1024 dense fp16 FMA per clock per SM (Luo et al. 2024,
# "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture"), i.e. 8 cycles per SMSP
# (wgmma, not used here, reaches about twice that). 4.3 TB/s is what a large copy achieves.
# Uniform-datapath (U*) and control instructions cost an issue slot only.
_PIPES = {
    **{op: ("fma", 1) for op in ("FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2")},
    **{op: ("fma", 2) for op in ("IMAD", "IMUL", "HFMA2", "HADD2", "HMUL2")},
    "HMMA": ("tensor", 8),
    "HGMMA": ("tensor", 8),
    **{op: ("xu", 8) for op in ("MUFU", "F2I", "I2F", "F2F", "F2FP", "I2FP", "FRND")},
    **{op: ("issue", 1) for op in ("BRA", "BSSY", "BSYNC", "BAR", "NOP", "EXIT", "RET", "CALL", "WARPSYNC",
                                    "DEPBAR", "LDGDEPBAR", "S2R", "S2UR", "CS2R", "LDC", "YIELD")},
}
H200 = Machine(
    name="H200 (model)",
    sms=132,
    clock_ghz=1.98,
    bandwidth_tbs=4.3,
    peak_bandwidth_tbs=4.8,
    sub_partitions=4,
    pipe_cycles=_PIPES,
)


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM residency limits (CUDA Programming Guide, compute capabilities table)."""

    registers: int = 65536
    max_threads: int = 2048
    max_ctas: int = 32
    shared_bytes: int = 233472  # largest shared-memory carveout
    reserved_shared_per_cta: int = 1024
    register_unit: int = 256  # registers are allocated per warp in units of 256


ARCH_LIMITS = {
    "sm_80": ArchLimits(shared_bytes=167936),  # A100: 164 KB
    "sm_90": ArchLimits(shared_bytes=233472),  # H100/H200: 228 KB
}

@dataclass(frozen=True)
class Calibration:
    """The time model's fitted and assumed constants (see the module docstring)."""

    issue_efficiency: float  # FITTED: clocks a busy SMSP issues / clocks (v2 bf16 slope, 1.375 us per tile)
    host_us: float  # FITTED: launcher time inside an event window (v2 bf16 intercept less the fixed term)
    launch_us: float = 4.0  # FITTED (v3 kernel-only): a kernel reaching the SMs from a graph replay
    memory_trip_us: float = 0.8  # ASSUMED: one dependent HBM round trip under load (~1,600 clocks)
    stream_bandwidth_tbs: float | None = None  # FITTED (v3 bf16 kernel-only): what a paged streaming kernel
    #                                            reaches (None: the machine's copy bandwidth)
    pipe_efficiency: float = 1.0  # FITTED (v3 fp8 kernel-only): fraction of clocks a saturated XU pipe
    #                               (conversions F2F/F2FP/I2F, MUFU) accepts an instruction


# The measured v2 points (docs/kernels.md, one H200, three runs, ranges; CUDA events around the whole
# launcher call): (pages, history) -> (low, high) microseconds.
MEASURED_V2 = {
    ("bf16", 256): (73, 123), ("bf16", 1024): (120, 148), ("bf16", 4096): (246, 286),
    ("fp8", 256): (81, 138), ("fp8", 1024): (122, 172), ("fp8", 4096): (282, 370),
}  # fmt: skip
# Least squares of event = host + fixed + tiles x (busiest-SMSP instructions / efficiency) / clock on
# the bf16 midpoints (98, 134, 266 us at 9, 33, 129 tiles of v2: 553 instructions x 4 CTAs on SMSP 0,
# NVRTC 13, sm_90): slope 1.375 us per tile -> efficiency 0.81; intercept 87.6 us less the fixed term
# (4 + 4 trips x 0.8 = 7.2 us) -> host 80 us. ``fit_calibration`` recomputes both from a report.
# v3 kernel-only (graph replay), two H200 runs of 2026-12-04 (../shared/measurements/gpu-2026-12-04.json):
# (pages, history) -> (low, high) microseconds. ``fit_kernel_calibration`` fits launch, the streaming bandwidth
# and v3's chain latency on their midpoints: bf16 at 1,024 and 4,096 frames stream from HBM; bf16 at 256 (40 MB,
# resident in L2 across the replays) and every fp8 point are bound by the chain (fp8: 64-key tiles, twice
# the chain of a 32-key one). Least squares: launch 3.24 us, 3.82 TB/s, 1,805 cycles per 32 keys.
MEASURED_V3 = {
    ("bf16", 256): (13.49, 13.70), ("bf16", 1024): (42.44, 42.48), ("bf16", 4096): (147.28, 148.45),
    ("fp8", 256): (14.39, 14.44), ("fp8", 1024): (37.21, 37.50), ("fp8", 4096): (123.88, 124.11),
}  # fmt: skip
# The v3 fp8 build the H200 measured (3e89bf9: one 16-row tile per warp, 128 registers), read off its SASS
# (sm_90, bf16 queries, D 64, block 16; NVRTC 13): the calibration prices the measured fp8 points with this
# loop and mapping, whatever the kernel has become since. The 16-bit pages' loop is the measured one (236
# instructions then, 235 now).
MEASURED_V3_FP8_BUILD = {
    "registers": 128, "shared_bytes": 32256, "mio_bytes": 8960.0, "mio_bytes_low": 7936.0,
    "classes": {"other": 340, "BAR": 1, "IMAD": 42, "LDS/LDSM": 19, "LDGSTS/LDG": 7, "HMMA": 32, "SHFL": 8, "FFMA": 18,
                "MUFU": 18},
    "roots": {"VIADD": 9, "DEPBAR": 1, "ISETP": 27, "WARPSYNC": 2, "BSSY": 3, "BAR": 1, "BRA": 5, "IMAD": 42, "UMOV": 1,
              "SHF": 4, "SEL": 1, "LOP3": 5, "LEA": 6, "IADD3": 12, "LDS": 11, "LDGSTS": 5, "BSYNC": 3, "LDGDEPBAR": 1,
              "LDC": 4, "LDG": 2, "LDSM": 8, "F2FP": 72, "HMMA": 32, "FMUL": 88, "FSEL": 18, "FMNMX": 42, "SHFL": 8,
              "FSETP": 2, "FFMA": 18, "FADD": 16, "MUFU": 18, "PRMT": 16, "UIADD3": 2},
}  # fmt: skip
# host: the v2 fit's intercept (87.6 us) less v2's fixed term with the refitted launch (3.24 + 4 x 0.8)
CALIBRATION = Calibration(issue_efficiency=0.81, host_us=81.2, launch_us=3.24, stream_bandwidth_tbs=3.82)
HISTORIES = (256, 1024, 4096)

DISCLAIMER = (
    "MODEL, NOT MEASURED: instruction counts are read from the SASS; times are an issue/bandwidth model "
    f"of an {H200.name.split()[0]} ({H200.sms} SMs, {H200.clock_ghz} GHz, {H200.bandwidth_tbs} TB/s achievable). "
    "Nothing here ran on a GPU."
)

# -- the workload the model prices: one tick of a 128-stream ASR encoder layer ---------------------


@dataclass(frozen=True)
class AttentionShape:
    """One layer of one tick: every stream's chunk queries over its history plus the chunk."""

    streams: int = 128
    chunk: int = 16
    head_dim: int = 64
    n_head: int = 8
    n_kv_head: int = 4
    block_size: int = 16
    keys: int = 1040  # history 1024 + chunk 16

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_kv_head

    def bytes_moved(self, page_bytes: float, scale_bytes: int = 0, act_bytes: int = 2) -> int:
        """K and V read once (``page_bytes`` per value, ``scale_bytes`` per vector), q read, out written."""
        vectors = self.streams * self.keys * self.n_kv_head
        kv = 2 * vectors * (self.head_dim * page_bytes + scale_bytes)
        q_out = 2 * self.streams * self.n_head * self.chunk * self.head_dim * act_bytes
        return int(kv + q_out)


ASR_SHAPE = AttentionShape()
# page kind -> (template page type, bytes per value, bytes of scale per vector); q and out are bf16
PAGES = {"bf16": ("__nv_bfloat16", 2, 0), "fp8": ("__nv_fp8_e4m3", 1, 4)}
MODEL_DTYPE = "__nv_bfloat16"


@dataclass(frozen=True)
class Tiling:
    """How an attention kernel covers the work: what the SASS cannot say (from the kernel's constants)."""

    keys_per_iteration: int  # keys one main-loop iteration consumes (16-bit pages)
    rows_per_cta: int  # (t, g) query rows of one KV head per CTA
    split_rule: str  # "v1": ops.choose_num_splits; "waves": fill SMs x resident CTAs; "filled": v3's rule
    rows_per_warp: int = 16  # a warp with none of the live rows only gathers (v2's warps 2-3 at the ASR shape)
    warps_per_row_tile: int = 1  # warps sharing one row tile (v3: two key slices)
    stages: tuple[int, int] = (1, 1)  # cp.async ring stages at head_dim 64: (16-bit pages, fp8 pages)
    prologue_trips: int = 1  # dependent memory trips before the first tile's math
    fp8_keys_per_iteration: int | None = None  # when fp8 pages use another tile
    # FITTED (kernel-only H200 points): cycles of one warp's dependent chain per 32 keys of a tile split over two
    # warps, i.e. per 16 keys of one warp's slice of one 16-row tile (load -> mma -> softmax -> mma), which the
    # few warps of a sub-partition cannot hide; None: not measured, not priced
    chain_cycles_32: float | None = None
    # fp8 pages with another warp mapping (v3 at head_dim 64: a warp takes both 16-row tiles over a quarter of
    # the tile's keys); None: the 16-bit mapping
    fp8_rows_per_warp: int | None = None
    fp8_warps_per_row_tile: int | None = None
    # ASSUMED, not measured: how much of a second independent chain in the same warp (another 16-row tile over
    # the same keys) hides behind the first: 1 = entirely (the step pays one chain, as for two warps' chains),
    # 0 = nothing (the warp pays both in turn). The recalibrated points all ran one chain per warp.
    chain_overlap: float = 1.0

    def keys(self, page: str) -> int:
        """Keys one main-loop iteration consumes for ``page`` (``"bf16"`` or ``"fp8"``)."""
        return self.fp8_keys_per_iteration if page == "fp8" and self.fp8_keys_per_iteration else self.keys_per_iteration

    def mapping(self, page: str) -> tuple[int, int]:
        """(query rows per warp, warps sharing one row tile) for ``page``."""
        if page == "fp8" and self.fp8_rows_per_warp:
            return self.fp8_rows_per_warp, self.fp8_warps_per_row_tile or self.warps_per_row_tile
        return self.rows_per_warp, self.warps_per_row_tile

    def live_warps(self, shape: AttentionShape, page: str = "bf16") -> int:
        """Warps of a CTA with query rows at ``shape`` (the others issue only their share of the gather)."""
        rows_per_warp, per_row_tile = self.mapping(page)
        rows = min(self.rows_per_cta, shape.group * shape.chunk)
        return math.ceil(rows / rows_per_warp) * per_row_tile

    def chain_cycles(self, page: str) -> float:
        """Cycles of the dependent chain per tile step (0 when not priced): the fitted chain per 16 keys of one
        warp's slice of one row tile, times the slice's keys / 16, with each further row tile of the warp (an
        independent chain over the same keys) adding ``1 - chain_overlap`` of it."""
        if self.chain_cycles_32 is None:
            return 0.0
        rows_per_warp, per_row_tile = self.mapping(page)
        chains = max(1, rows_per_warp // 16)
        slice_keys = self.keys(page) / per_row_tile
        return self.chain_cycles_32 * slice_keys / 16 * (1 + (chains - 1) * (1 - self.chain_overlap))


# By registry short name, from the launcher's and the kernels' own constants. A registered attention
# kernel missing here is reported without a model. Prologue trips: v1 reads its lengths, then loads a
# tile with plain loads (2); v2 reads its lengths, then Q, then the table window, then its first tile (4);
# v3 reads its lengths, then the table with Q beside it, then its first tile (3). Stages (head_dim 64):
# v1 loads synchronously (1), v2 3, v3 the most that fit 40 KB (4 on 16-bit pages, 3 of 64 keys on fp8).
TILINGS = {
    "paged_chunk_attention_kernel": Tiling(ops.TILE_KEYS, ops.ROWS_PER_CTA, "v1", rows_per_warp=4,
                                           stages=(1, 1), prologue_trips=2),
    "paged_chunk_attention_v2_kernel": Tiling(ops.TILE_KEYS, ops.V2_ROWS_PER_CTA, "waves", stages=(3, 3),
                                              prologue_trips=4),
    "paged_chunk_attention_v3_kernel": Tiling(ops.TILE_KEYS, ops.V3_ROWS_PER_CTA, "filled", warps_per_row_tile=2,
                                              stages=(4, 3), prologue_trips=3, fp8_keys_per_iteration=64,
                                              chain_cycles_32=1805.0, fp8_rows_per_warp=32,
                                              fp8_warps_per_row_tile=4),
}  # fmt: skip

# -- occupancy and the time model ---------------------------------------------------------------


def ctas_per_sm(registers: int, shared_bytes: int, threads: int, arch: str) -> tuple[int, str]:
    """Resident CTAs per SM and what limits them ("registers", "shared", "threads" or "ctas")."""
    lim = ARCH_LIMITS.get(arch, ARCH_LIMITS["sm_90"])
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) * 32 / lim.register_unit) * lim.register_unit
    by = {
        "registers": (lim.registers // per_warp) // warps,
        "shared": lim.shared_bytes // (shared_bytes + lim.reserved_shared_per_cta),
        "threads": lim.max_threads // (warps * 32),
        "ctas": lim.max_ctas,
    }
    limiter = min(by, key=lambda k: by[k])
    return by[limiter], limiter


def cta_tile_cycles(counts: LoopCounts, warps: int, machine: Machine = H200, *, broadcast: bool = False) -> dict:
    """Cycles one CTA needs for one main-loop iteration of all its warps, and what bounds them.

    The SASS does not say whether the lanes of an ``LDS``/``STS`` hit distinct words (``width/8 * 32``
    bytes, up to four 128-byte wavefronts) or one broadcast word (one wavefront). ``broadcast=False``
    prices every access at full width (the high estimate), ``True`` prices LDS/STS at one wavefront
    (the low estimate); LDSM and global accesses are always priced at full width.
    """
    pipes: Counter = Counter()
    for root, n in counts.roots.items():
        pipe, cycles = machine.pipe_cycles.get(root, machine.default_pipe)
        if root.startswith("U") and root not in machine.pipe_cycles:
            pipe, cycles = "issue", 1  # uniform datapath
        if root in ("LDS", "LDSM", "STS", "LDG", "LDGSTS", "STG", "SHFL", "LD", "ST", "ATOMS", "ATOMG", "RED"):
            pipe, cycles = "issue", 1  # priced on the SM-wide mio path below
        if pipe != "issue":
            pipes[pipe] += n * cycles
    per_smsp = warps / machine.sub_partitions
    smsp = max([counts.total, *pipes.values()])
    mio_bytes = counts.mio_bytes_low if broadcast else counts.mio_bytes
    mio = (mio_bytes / machine.mio_bytes_per_clk + counts.roots["SHFL"] * machine.shfl_mio_cycles) * warps
    bound = "issue" if smsp == counts.total else max(pipes, key=lambda k: pipes[k])
    cycles = max(per_smsp * smsp, mio)
    return {"cycles": cycles, "bound": "mio" if mio > per_smsp * smsp else bound, "issue_slots": counts.total}


def _idle_instructions(counts: LoopCounts) -> float:
    """What a warp without query rows issues per tile: its share of the gather (each cp.async with
    about four address instructions), the wait and the barrier. An estimate: the SASS shows one body."""
    return 5 * counts.classes["LDGSTS/LDG"] + counts.classes["BAR"] + 4


def model_attention(counts: LoopCounts, registers: int, shared_bytes: int, threads: int, arch: str,
                    tiling: Tiling, page: str, shape: AttentionShape = ASR_SHAPE,
                    machine: Machine = H200, cal: Calibration = CALIBRATION, *, rel: bool = False) -> dict:  # fmt: skip
    """The modelled tick of one attention kernel at ``shape`` with ``page`` ("bf16"/"fp8") pages.

    ``rel``: an instance with the relative-position term (``oasr.cache.rel_bias``), which also reads its fp32
    table: one entry per (query, key) pair it scores, ``streams x n_head x chunk x keys x 4`` bytes.

    Kernel-only microseconds ``kernel_us`` [low, high] (mio path priced as broadcast / full width), and
    ``event_us`` = ``cal.host_us`` + kernel, comparable with a CUDA-event timing of the launcher call.
    """
    resident, limiter = ctas_per_sm(registers, shared_bytes, threads, arch)
    resident = max(resident, 1)
    q_tiles = math.ceil(shape.group * shape.chunk / tiling.rows_per_cta)
    base = shape.streams * shape.n_kv_head * q_tiles
    if tiling.split_rule == "v1":
        splits = ops.choose_num_splits(shape.streams, shape.n_kv_head, q_tiles, shape.keys, machine.sms)
    elif tiling.split_rule == "filled":  # the launcher's rule for v3
        splits = ops.choose_num_splits_filled(base, shape.keys, machine.sms * resident, machine.sms)
    else:  # the launcher's rule for v2: ops.choose_num_splits_by_waves over SMs x resident CTAs
        splits = ops.choose_num_splits_by_waves(base, shape.keys, machine.sms * resident)
    ctas = base * splits
    keys_per_tile = tiling.keys(page)
    tiles = math.ceil(math.ceil(shape.keys / splits) / keys_per_tile)
    warps = math.ceil(threads / 32)
    live = min(warps, tiling.live_warps(shape, page))
    ctas_sm = math.ceil(ctas / machine.sms)  # the busiest SM
    concurrent = min(ctas_sm, resident)
    waves = math.ceil(ctas_sm / concurrent)

    # issue: the busiest sub-partition over one step of the `concurrent` CTAs, warp roles included
    load = [0.0] * machine.sub_partitions
    idle = _idle_instructions(counts)
    for c in range(concurrent):
        for w in range(warps):
            load[(c * warps + w) % machine.sub_partitions] += counts.total if w < live else idle
    smsp_cycles = max(load) / cal.issue_efficiency
    # the XU pipe (conversions, MUFU: 16 lanes per SM per clock, 8 cycles a warp instruction on one SMSP),
    # busiest SMSP, live warps only: what bounds a loop that converts its pages (fp8 -> f16)
    xu_per_warp = xu_cycles(counts, machine)
    xu_load = [0.0] * machine.sub_partitions
    for c in range(concurrent):
        for w in range(min(warps, live)):
            xu_load[(c * warps + w) % machine.sub_partitions] += xu_per_warp
    xu_step = max(xu_load) / cal.pipe_efficiency
    chain = tiling.chain_cycles(page)
    mio = [(mb / machine.mio_bytes_per_clk + counts.roots["SHFL"] * machine.shfl_mio_cycles) * live * concurrent
           for mb in (counts.mio_bytes_low, counts.mio_bytes)]  # fmt: skip
    step = [max(smsp_cycles, xu_step, chain, m) for m in mio]
    issue_us = [waves * tiles * c / (machine.clock_ghz * 1e3) for c in step]

    # memory: the bytes at the achievable bandwidth, capped by Little's law on the bytes in flight
    _, page_bytes, scale_bytes = PAGES[page]
    moved = shape.bytes_moved(page_bytes, scale_bytes)
    if rel:
        moved += shape.streams * shape.n_head * shape.chunk * shape.keys * 4
    # split keys: every split writes fp32 partials (O and m, l) that the combine kernel reads back
    partial_bytes = 0 if splits == 1 else splits * shape.streams * shape.n_head * shape.chunk * (shape.head_dim + 2) * 8
    stages = tiling.stages[1 if page == "fp8" else 0]
    stage_bytes = 2 * keys_per_tile * (shape.head_dim * page_bytes + scale_bytes)
    if stages > 1:
        in_flight = concurrent * (stages - 1) * stage_bytes
    else:  # synchronous loads: each warp's outstanding loads only (about one 16-byte load per thread)
        in_flight = concurrent * threads * 16
    little_tbs = machine.sms * in_flight / (cal.memory_trip_us * 1e-6) / 1e12
    streaming = cal.stream_bandwidth_tbs or machine.bandwidth_tbs
    l2_resident = moved + partial_bytes <= machine.l2_bytes  # back-to-back calls (a bench's graph replays)
    bandwidth = machine.l2_bandwidth_tbs if l2_resident else min(streaming, little_tbs)
    memory_us = (moved + partial_bytes) / (bandwidth * 1e6)

    fixed_us = cal.launch_us + tiling.prologue_trips * cal.memory_trip_us
    if splits > 1:  # the combine: one more launch and one dependent trip
        fixed_us += cal.launch_us + cal.memory_trip_us
    kernel = [fixed_us + max(t, memory_us) for t in issue_us]
    return {
        "page": page,
        "keys": shape.keys,
        "history": shape.keys - shape.chunk,
        "instr_per_tile_warp": counts.total,
        "instr_per_32_keys_warp": round(counts.total * 32 / keys_per_tile, 1),
        "keys_per_tile": keys_per_tile,
        "ffma_share": round(counts.classes["FFMA"] / max(counts.total, 1), 3),
        "live_warps": live,
        "busiest_smsp_instr": max(load),
        "step_cycles": [round(c) for c in step],
        "step_terms": {"issue": round(smsp_cycles), "xu": round(xu_step), "chain": round(chain),
                       "mio": [round(m) for m in mio]},
        "xu_per_warp": xu_per_warp,
        "l2_resident": l2_resident,
        "tile_bound": [_step_bound(smsp_cycles, xu_step, chain, m) for m in mio],
        "ctas": ctas,
        "splits": splits,
        "ctas_per_sm": resident,
        "occupancy_limiter": limiter,
        "waves": round(ctas / (machine.sms * resident), 2),
        "tiles_per_cta": tiles,
        "mbytes_moved": round(moved / 1e6, 1),
        "in_flight_kb_per_sm": round(in_flight / 1024, 1),
        "little_tbs": round(little_tbs, 2),
        "memory_us": round(memory_us, 1),
        "fixed_us": round(fixed_us, 1),
        "issue_us": [round(t, 1) for t in issue_us],
        "kernel_us": [round(t, 1) for t in kernel],  # [low, high]
        "modelled_us": [round(t, 1) for t in kernel],  # (the same: kernel-only)
        "event_us": [round(cal.host_us + t, 1) for t in kernel],
        "modelled_tbs": [round(moved / (t * 1e6), 2) for t in reversed(kernel)],  # [low, high]
        "fraction_of_bw": [round(moved / (t * 1e6) / machine.bandwidth_tbs, 3) for t in reversed(kernel)],
        "bound": "memory" if memory_us >= issue_us[1] else (
            _step_bound(smsp_cycles, xu_step, chain, mio[0]) if memory_us < issue_us[0] else "issue/memory"),
    }


def xu_cycles(counts: LoopCounts, machine: Machine = H200) -> float:
    """Cycles one warp's iteration holds the XU pipe (conversions and MUFU) of its sub-partition."""
    return float(sum(n * machine.pipe_cycles[root][1] for root, n in counts.roots.items()
                     if machine.pipe_cycles.get(root, ("",))[0] == "xu"))


def _step_bound(issue: float, xu: float, chain: float, mio: float) -> str:
    """What binds a tile step: "issue" (the sub-partition's issue slots at the fitted efficiency), "xu"
    (the conversion / MUFU pipe), "latency" (one warp's dependent chain, which the sub-partition's few
    warps do not hide) or "mio" (shared memory)."""
    return max((("issue", issue), ("xu", xu), ("latency", chain), ("mio", mio)), key=lambda kv: kv[1])[0]


def calibration_check(rep: dict) -> list[dict]:
    """The model's event-timed v2 (sm_90) against ``MEASURED_V2``: one row per measured point."""
    rows = []
    for r in rep["attention_model"]:
        key = (r["page"], r["history"])
        if r["version"] != "v2" or r["arch"] != "sm_90" or key not in MEASURED_V2:
            continue
        low, high = MEASURED_V2[key]
        rows.append({"page": r["page"], "history": r["history"], "modelled_event_us": r["event_us"],
                     "measured_us": [low, high],
                     "inside": low <= r["event_us"][0] and r["event_us"][1] <= high})  # fmt: skip
    return rows


def fit_calibration(rep: dict, cal: Calibration = CALIBRATION, machine: Machine = H200) -> tuple[float, float]:
    """(issue efficiency, host us) by least squares on the measured v2 bf16 midpoints, from ``rep``'s v2
    sm_90 counts: event = host + fixed + tiles x busiest-SMSP instructions / (efficiency x clock)."""
    xs, ys, fixed = [], [], None
    for r in rep["attention_model"]:
        key = (r["page"], r["history"])
        if r["version"] == "v2" and r["arch"] == "sm_90" and r["page"] == "bf16" and key in MEASURED_V2:
            xs.append(r["tiles_per_cta"] * r["busiest_smsp_instr"] / (machine.clock_ghz * 1e3))
            ys.append(sum(MEASURED_V2[key]) / 2)
            fixed = r["fixed_us"]
    if len(xs) < 2 or fixed is None:
        raise ValueError("fit_calibration: the report has no v2 sm_90 bf16 rows at the measured histories")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return 1 / slope, my - slope * mx - fixed


def measured_v3_fp8_rows(shape: AttentionShape = ASR_SHAPE, cal: Calibration = CALIBRATION) -> list[dict]:
    """The model's rows of the v3 fp8 build the H200 measured (``MEASURED_V3_FP8_BUILD``: its loop counts and
    its mapping, one 16-row tile per warp), at ``HISTORIES``: what the calibration prices the fp8 points with."""
    b = MEASURED_V3_FP8_BUILD
    counts = LoopCounts(classes=Counter(b["classes"]), roots=Counter(b["roots"]), mio_bytes=b["mio_bytes"],
                        mio_bytes_low=b["mio_bytes_low"])  # fmt: skip
    tiling = replace(TILINGS["paged_chunk_attention_v3_kernel"], fp8_rows_per_warp=None, fp8_warps_per_row_tile=None)
    return [{"kernel": "measured build (3e89bf9)", "version": "v3", "arch": "sm_90",
             **model_attention(counts, b["registers"], b["shared_bytes"], 128, "sm_90", tiling, "fp8",
                               replace(shape, keys=h + shape.chunk), cal=cal)}
            for h in HISTORIES]  # fmt: skip


def _measured_v3_rows(rep: dict) -> list[dict]:
    """``rep``'s v3 sm_90 bf16 rows (the 16-bit loop is the one measured) and the measured fp8 build's rows."""
    bf16 = [r for r in rep["attention_model"] if r["version"] == "v3" and r["arch"] == "sm_90" and r["page"] == "bf16"]
    return bf16 + (measured_v3_fp8_rows() if bf16 else [])


def calibration_check_v3(rep: dict) -> list[dict]:
    """The model's kernel-only v3 (sm_90) against ``MEASURED_V3`` (graph replay, two runs), and for each
    history the modelled fp8 speed-up over bf16 against the measured one (``ratio_error``: relative). The fp8
    points are priced with the build that was measured (``measured_v3_fp8_rows``)."""
    rows, by = [], {}
    for r in _measured_v3_rows(rep):
        key = (r["page"], r["history"])
        if key not in MEASURED_V3:
            continue
        low, high = MEASURED_V3[key]
        model = r["kernel_us"][0]
        by[key] = (model, (low + high) / 2)
        rows.append({"page": r["page"], "history": r["history"], "modelled_kernel_us": model,
                     "measured_us": [low, high], "error": round(model / ((low + high) / 2) - 1, 3),
                     "bound": r["bound"], "step_terms": r.get("step_terms")})  # fmt: skip
    for row in rows:
        if row["page"] == "fp8" and ("bf16", row["history"]) in by:
            (m_bf16, x_bf16), (m_fp8, x_fp8) = by["bf16", row["history"]], by["fp8", row["history"]]
            row["modelled_ratio"] = round(m_bf16 / m_fp8, 3)
            row["measured_ratio"] = round(x_bf16 / x_fp8, 3)
            row["ratio_error"] = round((m_bf16 / m_fp8) / (x_bf16 / x_fp8) - 1, 3)
    return rows


def fit_kernel_calibration(rep: dict, cal: Calibration = CALIBRATION, machine: Machine = H200) -> dict:
    """Launch us, streaming TB/s and v3's chain cycles per 32 keys by least squares on the ``MEASURED_V3``
    midpoints, each point priced by the term the model says binds it (memory: fixed + bytes / bandwidth;
    latency: fixed + tiles x chain x keys per tile / 32 / clock)."""
    import numpy as np

    rows_a, ys, trips = [], [], None
    for r in _measured_v3_rows(rep):
        key = (r["page"], r["history"])
        if key not in MEASURED_V3:
            continue
        trips = round((r["fixed_us"] - cal.launch_us) / cal.memory_trip_us)
        if r["bound"] == "memory":
            rows_a.append([1.0, r["mbytes_moved"], 0.0])
        else:
            rows_a.append([1.0, 0.0, r["tiles_per_cta"] * r["keys_per_tile"] / 32 / (machine.clock_ghz * 1e3)])
        ys.append(sum(MEASURED_V3[key]) / 2)
    if len(ys) < 3 or trips is None:
        raise ValueError("fit_kernel_calibration: the report has no v3 sm_90 rows at the measured histories")
    (fixed, us_per_mb, chain), *_ = np.linalg.lstsq(np.array(rows_a), np.array(ys), rcond=None)
    return {"launch_us": float(fixed - trips * cal.memory_trip_us), "stream_bandwidth_tbs": float(1 / us_per_mb),
            "chain_cycles_32": float(chain)}


def v3_predictions(rep: dict, copy_tbs: float = 4.223) -> list[dict]:
    """The model's kernel-only v3 (sm_90) for the current build beside ``MEASURED_V3``: per measured point the
    measured and modelled microseconds, the fraction of ``copy_tbs`` (the measured run's device-to-device copy,
    4,223 GB/s) and, for fp8, the speed-up over bf16. fp8 is priced twice, as ``Tiling.chain_overlap`` allows:
    ``model`` with the stored overlap (a warp's second chain hidden behind its first) and ``no_overlap`` with 0
    (the warp pays its two chains in turn). A MODEL of a build that has not run on a GPU."""
    rows = {(r["page"], r["history"]): r for r in rep["attention_model"]
            if r["version"] == "v3" and r["arch"] == "sm_90" and (r["page"], r["history"]) in MEASURED_V3}
    tiling = TILINGS["paged_chunk_attention_v3_kernel"]
    out = []
    for (page, history), r in sorted(rows.items()):
        terms, step = r["step_terms"], r["step_cycles"][0]
        chain_none = replace(tiling, chain_overlap=0.0).chain_cycles(page)
        step_none = max(terms["issue"], terms["xu"], chain_none, terms["mio"][0])
        none_us = r["fixed_us"] + max(r["issue_us"][0] * step_none / step, r["memory_us"])
        low, high = MEASURED_V3[page, history]
        moved = r["mbytes_moved"] * 1e6
        out.append({"page": page, "history": history, "measured_us": (low + high) / 2, "model_us": r["kernel_us"][0],
                    "no_overlap_us": round(none_us, 1), "bound": r["bound"], "ctas_per_sm": r["ctas_per_sm"],
                    "step_terms": terms,
                    "measured_of_copy": round(moved / ((low + high) / 2 * 1e6) / copy_tbs, 3),
                    "model_of_copy": round(moved / (r["kernel_us"][0] * 1e6) / copy_tbs, 3)})  # fmt: skip
    by = {(x["page"], x["history"]): x for x in out}
    for x in out:
        if x["page"] == "fp8" and ("bf16", x["history"]) in by:
            b = by["bf16", x["history"]]
            x["measured_ratio"] = round(b["measured_us"] / x["measured_us"], 2)
            x["model_ratio"] = round(b["model_us"] / x["model_us"], 2)
            x["no_overlap_ratio"] = round(b["model_us"] / x["no_overlap_us"], 2)
    return out
