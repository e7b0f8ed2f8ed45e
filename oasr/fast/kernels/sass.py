"""SASS reading: disassemble a compiled family, parse its functions, find each kernel's main loop and count
what it issues (the instruction mix). ``oasr.fast.kernels.perf_model`` prices those counts on an H200 and
``oasr.fast.kernels.sass_report`` runs both over the registry (``python -m oasr kernels --sass``).

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
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

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


def run_tool(tool: str, *args: str, cubin: bytes) -> str:
    """The standard output of ``tool`` (cuobjdump, nvdisasm) run with ``args`` on ``cubin`` written to a
    temporary file."""
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
