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

Main loop (the heuristic). Loops are read off the backward branches: a ``BRA`` to a label at or before
itself closes a loop ``[label, branch]``. The main loop ("load-math-loop") is the innermost loop whose body
(nested loops included) holds both a global load (``LDG`` or ``LDGSTS``: in attention, the K/V
gather) and math (``HMMA`` or ``FFMA``); if several qualify, the one issuing the most instructions
per iteration. A kernel without
such a loop (the copy kernels, the combine) reports its hottest loop, the most instructions per
iteration, or the whole function when it has no loop.

Instructions per iteration are dynamic counts for one warp: every instruction of the body once, and
each nested loop times its trip count. A trip count is read from the loop's induction variable when
that is a register set to a constant before the loop, stepped by an immediate and compared with an
immediate (v1's score and P.V loops); otherwise it is 1 and the loop is flagged ``trips_unknown``.
Both sides of a branch inside the body are counted, so branchy bodies are over-counted.

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
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from oasr.fast.kernels import ops

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
    # FITTED (kernel-only H200 points): cycles of one warp's dependent chain per 32 keys (load -> mma -> softmax
    # -> mma), which the few warps of a sub-partition cannot hide; None: not measured, not priced
    chain_cycles_32: float | None = None

    def keys(self, page: str) -> int:
        """Keys one main-loop iteration consumes for ``page`` (``"bf16"`` or ``"fp8"``)."""
        return self.fp8_keys_per_iteration if page == "fp8" and self.fp8_keys_per_iteration else self.keys_per_iteration

    def live_warps(self, shape: AttentionShape) -> int:
        """Warps of a CTA with query rows at ``shape`` (the others issue only their share of the gather)."""
        rows = min(self.rows_per_cta, shape.group * shape.chunk)
        return math.ceil(rows / self.rows_per_warp) * self.warps_per_row_tile


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
                                              chain_cycles_32=1805.0),
}  # fmt: skip

# -- finding the tools ---------------------------------------------------------------------------


def find_tool(name: str) -> str:
    """Path of ``nvdisasm`` or ``cuobjdump``: the pip wheel's (cuda.pathfinder, then the nvidia
    package directory), then PATH. Raises ``RuntimeError`` naming the pip package to install."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility(name)
        if found:
            return str(found)
    except Exception:  # pathfinder missing or too old: look where the wheels put the binaries
        pass
    try:
        import nvidia

        for root in nvidia.__path__:
            for hit in sorted(Path(root).glob(f"*/bin/{name}")):
                if os.access(hit, os.X_OK):
                    return str(hit)
    except ImportError:
        pass
    if on_path := shutil.which(name):
        return on_path
    raise RuntimeError(f"oasr kernels --sass: {name} not found; pip install nvidia-cuda-{name} (the `cuda` extra)")


def _run(tool: str, *args: str, cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "family.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([find_tool(tool), *args, str(path)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()[:2000]}")
    return done.stdout


# -- parsing SASS --------------------------------------------------------------------------------


@dataclass
class Instr:
    offset: int
    predicate: str  # "" or e.g. "@!P0"
    opcode: str  # full mnemonic, e.g. "LDS.128"
    operands: str

    @property
    def root(self) -> str:
        """The opcode without its modifiers (``HMMA`` of ``HMMA.16816.F32``)."""
        return self.opcode.split(".")[0]


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P(?:T|\d+)\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Function:
    name: str  # mangled
    instrs: list[Instr]
    labels: dict[str, int]  # label -> offset of the next instruction


def parse_sass(text: str) -> dict[str, Function]:
    """``nvdisasm -c`` output -> functions by mangled name."""
    out: dict[str, Function] = {}
    current: Function | None = None
    pending: list[str] = []
    for line in text.splitlines():
        if m := _SECTION.match(line):
            current = out.setdefault(m.group(1), Function(m.group(1), [], {}))
            pending = []
            continue
        if current is None:
            continue
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
            continue
        if m := _LINE.search(line):
            offset = int(m.group(1), 16)
            for label in pending:
                current.labels[label] = offset
            pending = []
            current.instrs.append(Instr(offset, (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return out


def parse_max_threads(elf_text: str) -> dict[str, int]:
    """``cuobjdump -elf`` -> launch bound (x*y*z of EIATTR_MAX_THREADS) by mangled name."""
    out: dict[str, int] = {}
    name, want = None, False
    for line in elf_text.splitlines():
        if line.startswith(".nv.info."):
            name, want = line[len(".nv.info.") :].strip(), False
        elif "EIATTR_MAX_THREADS" in line:
            want = True
        elif want and name and line.strip().startswith("Value:"):
            dims = [int(v, 16) for v in line.split(":", 1)[1].split()]
            out[name] = math.prod(dims)
            want = False
    return out


# -- instruction classes -------------------------------------------------------------------------

CLASSES = ("HMMA", "FFMA", "LDS/LDSM", "LDGSTS/LDG", "STS", "BAR", "MUFU", "SHFL", "IMAD", "other")


def instr_class(root: str) -> str:
    """The class an opcode root is counted under in the instruction mix (``HMMA``, ``LDS/LDSM``, ...)."""
    if root in ("HMMA", "HGMMA"):
        return "HMMA"
    if root in ("LDS", "LDSM"):
        return "LDS/LDSM"
    if root in ("LDG", "LDGSTS"):
        return "LDGSTS/LDG"
    if root in ("FFMA", "STS", "BAR", "MUFU", "SHFL", "IMAD"):
        return root
    return "other"


def _access_bytes(instr: Instr) -> int:
    """Bytes one warp moves through the SM's shared-memory/L1 path (0 for everything else)."""
    if instr.root not in ("LDS", "LDSM", "STS", "LDG", "LDGSTS", "STG", "LD", "ST"):
        return 0
    mods = instr.opcode.split(".")[1:]
    if instr.root == "LDSM":  # .M88.{1,2,4}: 1, 2 or 4 8x8 b16 matrices, 128 B each per warp
        n = next((int(m) for m in mods if m in ("1", "2", "4")), 4)
        return 128 * n
    width = next((int(m) for m in mods if m in ("8", "16", "32", "64", "128")), 32)
    if any(m in ("U8", "S8") for m in mods):
        width = 8
    elif any(m in ("U16", "S16") for m in mods):
        width = 16
    return 32 * width // 8


# -- loops ---------------------------------------------------------------------------------------


@dataclass
class Loop:
    head: int  # offset of the first instruction
    tail: int  # offset of the backward branch
    trips: int | None = None  # per entry; None when not read off the SASS
    children: list[Loop] = field(default_factory=list)

    def contains(self, other: Loop) -> bool:
        """Whether ``other`` is a loop strictly inside this one."""
        inside = self.head <= other.head and other.tail <= self.tail
        return inside and (self.head, self.tail) != (other.head, other.tail)


def find_loops(fn: Function) -> list[Loop]:
    """Top-level loops (nested ones in ``children``), from the backward branches."""
    spans: dict[int, int] = {}
    for ins in fn.instrs:
        if ins.root == "BRA" and (m := _TARGET.search(ins.operands)):
            target = fn.labels.get(m.group(1))
            if target is not None and target < ins.offset:  # (a branch to itself is the trailing trap)
                spans[target] = max(spans.get(target, target), ins.offset)
    loops = sorted((Loop(h, t) for h, t in spans.items()), key=lambda lp: (lp.head, -lp.tail))
    for loop in loops:
        loop.trips = _trip_count(fn, loop)
    roots: list[Loop] = []
    for loop in loops:  # sorted by head, outer first: attach each loop to its innermost container
        parent = None
        stack = list(roots)
        while stack:
            cand = stack.pop()
            if cand.contains(loop):
                parent = cand
                stack = list(cand.children)
        (parent.children if parent else roots).append(loop)
    return roots


_REG = r"(R\d+)"
_IMM = r"(-?0x[0-9a-f]+|-?\d+)"
_STEP = re.compile(rf"^{_REG},\s*{_REG}(?:\.reuse)?,\s*{_IMM}(?:,\s*RZ)?$")
_CMP = re.compile(rf"^(P\d+),\s*PT,\s*{_REG}(?:\.reuse)?,\s*{_IMM},\s*PT$")


def _imm(text: str) -> int:
    return int(text, 16) if "0x" in text else int(text)


def _const_init(fn: Function, reg: str, before: int) -> int | None:
    """The constant ``reg`` holds on entry, if its last write before ``before`` is a constant move."""
    for ins in reversed([i for i in fn.instrs if i.offset < before]):
        ops = [o.strip() for o in ins.operands.split(",")]
        if not ops or ops[0].split(".")[0] != reg:
            if ins.root == "CS2R" and ops and ops[0] == f"R{int(reg[1:]) - 1}":  # CS2R R(n-1), SRZ zeroes Rn too
                return 0 if ops[-1] == "SRZ" else None
            continue
        if ins.predicate:
            return None
        if ins.opcode in ("MOV", "IMAD.MOV.U32", "MOV.U32"):
            last = ops[-1]
            if last == "RZ":
                return 0
            return _imm(last) if re.fullmatch(_IMM, last) else None
        if ins.root == "HFMA2" and ops[1:] == ["-RZ", "RZ", "0", "0"]:
            return 0
        if ins.root == "CS2R" and ops[-1] == "SRZ":
            return 0
        return None
    return None


def _trip_count(fn: Function, loop: Loop) -> int | None:
    body = [i for i in fn.instrs if loop.head <= i.offset <= loop.tail]
    branch = body[-1]
    pred = branch.predicate.lstrip("@!")
    if not pred.startswith("P") or pred == "PT":
        return None
    cmp = next((i for i in reversed(body) if i.root == "ISETP" and i.operands.startswith(pred + ",")), None)
    if cmp is None or not (m := _CMP.match(cmp.operands)):
        return None
    reg, bound = m.group(2), _imm(m.group(3))
    steps = [(i, _STEP.match(i.operands)) for i in body if i.root in ("IADD3", "VIADD", "IADD")]
    steps = [(i, s) for i, s in steps if s and s.group(1) == reg and s.group(2) == reg]
    init = _const_init(fn, reg, loop.head)
    if len(steps) != 1 or init is None:
        return None
    step = _imm(steps[0][1].group(3))
    if step == 0:
        return None
    after = steps[0][0].offset < cmp.offset  # compare sees the stepped value
    trips = math.ceil((bound - init) / step) + (0 if after else 1)
    return trips if 0 < trips <= 1 << 16 else None


@dataclass
class LoopCounts:
    """One iteration of a loop, for one warp: counts by class and by opcode, bytes through the mio path."""

    head: int = -1
    tail: int = -1
    classes: Counter = field(default_factory=Counter)
    roots: Counter = field(default_factory=Counter)
    mio_bytes: float = 0.0  # every shared/global access priced at its full width (no broadcast)
    mio_bytes_low: float = 0.0  # LDS/STS priced at one 128-byte wavefront (a broadcast)
    trips_unknown: bool = False

    @property
    def total(self) -> float:
        """Instructions one warp issues per iteration, all classes together."""
        return sum(self.classes.values())


def _count(fn: Function, loop: Loop | None) -> LoopCounts:
    """Dynamic counts of one iteration of ``loop`` (the whole function when None)."""
    lo, hi = (loop.head, loop.tail) if loop else (-1, 1 << 62)
    out = LoopCounts(lo, hi)
    children = loop.children if loop else find_loops(fn)
    inside = [(c.head, c.tail) for c in children]
    for ins in fn.instrs:
        if lo <= ins.offset <= hi and not any(h <= ins.offset <= t for h, t in inside):
            out.classes[instr_class(ins.root)] += 1
            out.roots[ins.root] += 1
            out.mio_bytes += _access_bytes(ins)
            out.mio_bytes_low += min(_access_bytes(ins), 128) if ins.root in ("LDS", "STS") else _access_bytes(ins)
    for child in children:
        sub = _count(fn, child)
        trips = child.trips if child.trips is not None else 1
        out.trips_unknown |= child.trips is None or sub.trips_unknown
        for k, v in sub.classes.items():
            out.classes[k] += trips * v
        for k, v in sub.roots.items():
            out.roots[k] += trips * v
        out.mio_bytes += trips * sub.mio_bytes
        out.mio_bytes_low += trips * sub.mio_bytes_low
    return out


def _walk(loops: list[Loop]):
    for lp in loops:
        yield lp
        yield from _walk(lp.children)


def main_loop(fn: Function) -> tuple[LoopCounts, str]:
    """The main loop's counts and how it was chosen ("load-math-loop", "hottest-loop" or "no-loop")."""
    loops = list(_walk(find_loops(fn)))
    counted = [(lp, _count(fn, lp)) for lp in loops]

    def qualifies(c: LoopCounts) -> bool:
        return c.classes["LDGSTS/LDG"] > 0 and (c.classes["HMMA"] > 0 or c.classes["FFMA"] > 0)

    kv = [(lp, c) for lp, c in counted if qualifies(c)]
    innermost = [(lp, c) for lp, c in kv if not any(lp.contains(other) for other, _ in kv)]
    if innermost:
        return max(innermost, key=lambda pair: pair[1].total)[1], "load-math-loop"
    if counted:
        return max(counted, key=lambda pair: pair[1].total)[1], "hottest-loop"
    return _count(fn, None), "no-loop"


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
    live = min(warps, tiling.live_warps(shape))
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
    chain = 0.0 if tiling.chain_cycles_32 is None else tiling.chain_cycles_32 * keys_per_tile / 32
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


def calibration_check_v3(rep: dict) -> list[dict]:
    """The model's kernel-only v3 (sm_90) against ``MEASURED_V3`` (graph replay, two runs), and for each
    history the modelled fp8 speed-up over bf16 against the measured one (``ratio_error``: relative)."""
    rows, by = [], {}
    for r in rep["attention_model"]:
        key = (r["page"], r["history"])
        if r["version"] != "v3" or r["arch"] != "sm_90" or key not in MEASURED_V3:
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
    for r in rep["attention_model"]:
        key = (r["page"], r["history"])
        if r["version"] != "v3" or r["arch"] != "sm_90" or key not in MEASURED_V3:
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
        elf = _run("cuobjdump", "-elf", cubin=cubin)
        return parse_sass(_run("nvdisasm", "-c", cubin=cubin)), parse_max_threads(elf)

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
                        notes.append(f"{short}: no entry in sass.TILINGS, so no time model (add one)")
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
