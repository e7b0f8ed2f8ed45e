"""Compile the kernels with NVRTC (cuda.core), cache the cubins, load and launch them.

* Compilation needs no GPU and no driver: ``compile_family(family, "sm_90")``
  runs NVRTC for an explicit arch and returns the cubin with its ptxas report.
  Results are cached on disk under ``~/.cache/oasr/kernels`` (override with
  ``OASR_KERNEL_CACHE``), keyed by the sources' hash, the arch, the options and
  the NVRTC version; the cache keeps the ptxas log too, so the resource report
  survives a cache hit.
* Loading needs a driver: ``CudaExecutor(device)`` compiles (or reads the
  cache) for the device's own arch and loads each instantiation lazily, the
  first time it is launched: one small NVRTC program per kernel a process
  reaches (a cold cache no longer compiles every family for one test; the H200's
  first ``test_decode_step.py`` test spent 22 s doing that). Nothing may compile
  inside a CUDA graph capture: run the step once eagerly first (``GraphRunner``'s
  preflight does) or call ``CudaExecutor.load_all()``.
* Every launch goes to ``torch.cuda.current_stream()``, read at the call (never
  cached), so launches follow ``torch.cuda.stream(...)`` and are captured by
  ``torch.cuda.graph``. Launching reads nothing back from the device.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from oasr.fast.kernels import registry

NVRTC_STD = "c++17"


def cache_dir() -> Path:
    """Where compiled kernels are cached: ``$OASR_KERNEL_CACHE``, else ``~/.cache/oasr/kernels``."""
    root = os.environ.get("OASR_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "oasr" / "kernels"


def cuda_include_dir() -> str:
    """Directory holding cuda_fp16.h / cuda_bf16.h for NVRTC.

    ``OASR_CUDA_INCLUDE``, when set, is the only place looked in (as for the emulation build).
    Otherwise prefers the headers that ship with the pip CUDA runtime (found by
    cuda.pathfinder; they match the pip NVRTC), then CUDA_HOME / CUDA_PATH and
    /usr/local/cuda. NVRTC does not need the toolkit's crt/ directory.
    """
    if os.environ.get("OASR_CUDA_INCLUDE"):
        candidates = [os.environ["OASR_CUDA_INCLUDE"]]
    else:
        candidates = _default_include_candidates()
    for path in candidates:
        if os.path.isfile(os.path.join(path, "cuda_fp16.h")) and os.path.isfile(os.path.join(path, "cuda_bf16.h")):
            return path
    raise RuntimeError(
        "oasr kernels: no CUDA headers (cuda_fp16.h, cuda_bf16.h) found; looked in "
        + ", ".join(candidates)
        + ". Install nvidia-cuda-runtime (pip) or set CUDA_HOME or OASR_CUDA_INCLUDE."
    )


def _default_include_candidates() -> list[str]:
    candidates: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            candidates.append(found)
    except Exception:  # pathfinder missing or failing: fall back to the usual places
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    return candidates


def nvrtc_version() -> str:
    """NVRTC's version, ``major.minor`` (part of the cache key)."""
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def program_options(family: str, arch: str):
    """NVRTC options for ``family`` on ``arch``: the kernels' and CUDA headers' include paths, ptxas verbose."""
    from cuda.core import ProgramOptions

    return ProgramOptions(
        name=f"{family}.cu",
        arch=arch,
        std=NVRTC_STD,
        include_path=[str(registry.KERNELS_DIR), cuda_include_dir()],
        ptxas_options=["-v"],
    )


@dataclass
class KernelResources:
    """One entry function's resources, from ptxas's verbose log."""

    mangled: str
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    barriers: int = 0


@dataclass
class CompiledFamily:
    family: str
    arch: str
    cubin: bytes
    symbols: dict[str, str]  # name expression -> mangled name
    log: str
    cached: bool = False
    resources: dict[str, KernelResources] = field(default_factory=dict)  # by name expression


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Per mangled entry name: registers, shared memory, stack and spill bytes."""
    out: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault(m.group(1), KernelResources(m.group(1)))
            continue
        if current is None:
            continue
        if m := _FRAME.search(line):
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        if m := _USED.search(line):
            current.registers = int(m.group(1))
            if b := _BARRIERS.search(line):
                current.barriers = int(b.group(1))
            if s := _SMEM.search(line):
                current.shared_bytes = int(s.group(1))
    return out


def _cache_key(family: str, arch: str, expressions: list[str]) -> str:
    h = hashlib.sha256()
    for name, text in sorted(registry.read_sources(family).items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    h.update(repr((arch, NVRTC_STD, expressions, ["-v"], nvrtc_version(), cuda_include_dir())).encode())
    return h.hexdigest()[:20]


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class _Log:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s


def compile_family(family: str, arch: str, *, use_cache: bool = True,
                   expressions: list[str] | None = None) -> CompiledFamily:
    """NVRTC-compile every instantiation of one kernel family for ``arch`` (e.g. "sm_90"), or only
    ``expressions`` (name expressions of that family): a launch compiles just the instantiation it
    needs, so a cold cache costs one small program per kernel a process reaches, not every family.

    Raises ``RuntimeError`` with the compiler log on a compile error.
    """
    if expressions is None:
        expressions = [k.name_expression(t) for k in registry.kernels_of(family) for t in k.instances]
    expressions = list(expressions)
    key = _cache_key(family, arch, expressions)
    base = cache_dir() / f"{family}-{arch}-{key}"
    meta_path, cubin_path = base.with_suffix(".json"), base.with_suffix(".cubin")
    if use_cache and meta_path.exists() and cubin_path.exists():
        meta = json.loads(meta_path.read_text())
        compiled = CompiledFamily(family, arch, cubin_path.read_bytes(), meta["symbols"], meta["log"], True)
    else:
        from cuda.core import Program

        source = registry.source_path(family).read_text()
        log = _Log()
        try:
            obj = Program(source, "c++", program_options(family, arch)).compile(
                "cubin", logs=log, name_expressions=expressions
            )
        except Exception as exc:
            raise RuntimeError(f"NVRTC failed to compile {family}.cu for {arch}:\n{exc}\n{log.text}") from exc
        symbols = {
            expr: (name.decode() if isinstance(name, bytes) else str(name)) for expr, name in obj.symbol_mapping.items()
        }
        compiled = CompiledFamily(family, arch, bytes(obj.code), symbols, log.text)
        if use_cache:
            _atomic_write(cubin_path, compiled.cubin)
            _atomic_write(meta_path, json.dumps({"symbols": symbols, "log": log.text}).encode())
    by_mangled = parse_ptxas_log(compiled.log)
    compiled.resources = {
        expr: by_mangled.get(mangled, KernelResources(mangled)) for expr, mangled in compiled.symbols.items()
    }
    return compiled


def _compile_one(job: tuple[str, str, str]) -> str:
    family, arch, expr = job
    compile_family(family, arch, expressions=[expr])
    return expr


def warm_cache(arch: str, jobs: int | None = None) -> int:
    """Compile every instantiation on its own for ``arch``, as a launch would (the cache entries lazy loading
    reads), in ``jobs`` processes (default: the CPUs). A cold machine then pays the compiles once, in parallel,
    before its test processes. Returns how many instantiations are cached."""
    from concurrent.futures import ProcessPoolExecutor

    work = [(k.family, arch, k.name_expression(t)) for k in registry.KERNELS for t in k.instances]
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return sum(1 for _ in pool.map(_compile_one, work))


def device_arch(device: torch.device) -> str:
    """``sm_XY`` of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _convert(kind: str, value):
    if kind == "ptr":
        return int(value)
    if kind == "i32":
        return np.int32(value)
    if kind == "f32":
        return np.float32(value)
    raise ValueError(f"unknown parameter kind {kind!r}")


def _make_current(index: int) -> None:
    from cuda.core import Device

    Device(index).set_current()


@contextlib.contextmanager
def device_current(index: int, *, current=None, make_current=None, restore=None):
    """Make CUDA device ``index`` current (cuda.core's ``set_current``: loading a module needs its
    context), and on exit, error or not, make the caller's device current again.

    ``current`` / ``make_current`` / ``restore`` default to ``torch.cuda.current_device``, cuda.core's
    ``Device(i).set_current()`` and ``torch.cuda.set_device``; tests pass stand-ins (no GPU needed).
    """
    current = current or torch.cuda.current_device
    make_current = make_current or _make_current
    restore = restore or torch.cuda.set_device
    previous = current()
    make_current(index)
    try:
        yield
    finally:
        if previous != index:
            restore(previous)


# How a plan's launch reaches the driver (``CudaExecutor.prepare``): "cuda_core" (the default) goes through
# cuda.core's launch at every call, the path the H200 measured; "driver" (OASR_CUDA_LAUNCH=driver) packs its
# parameters once and calls cuLaunchKernel (cuda.bindings) at each call. "driver" has not yet run on a GPU, so it
# is opt-in until a device run shows it equal to cuda_core bit for bit.
LAUNCH_PATHS = ("driver", "cuda_core")
LAUNCH_PATH = os.environ.get("OASR_CUDA_LAUNCH", "cuda_core")
if LAUNCH_PATH not in LAUNCH_PATHS:
    raise ValueError(f"OASR_CUDA_LAUNCH must be one of {LAUNCH_PATHS}, got {LAUNCH_PATH!r}")


class CudaExecutor:
    """Launches the NVRTC-compiled kernels on one CUDA device."""

    kind = "cuda"

    def __init__(self, device: torch.device):
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.arch = device_arch(self.device)
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._kernels: dict[str, object] = {}  # name expression -> cuda.core Kernel
        self._resident: dict[str, int] = {}  # name expression -> CTAs per SM (occupancy, read once)
        self._entries: dict[tuple, tuple] = {}  # (kernel name, targs) -> (kernel object, parameter kinds)
        self._streams: dict[int, object] = {}  # CUstream handle -> cuda.core Stream
        self._configs: dict[tuple, object] = {}  # (grid, block) -> cuda.core LaunchConfig

    def _load_family(self, family: str, expressions: list[str] | None = None) -> None:
        from cuda.core import ObjectCode

        compiled = compile_family(family, self.arch, expressions=expressions)
        with device_current(self.device.index):  # the caller's current device is restored after
            obj = ObjectCode.from_cubin(compiled.cubin, name=f"{family}.cubin", symbol_mapping=compiled.symbols)
            for expr, mangled in compiled.symbols.items():
                self._kernels[expr] = obj.get_kernel(mangled)

    def load_all(self) -> None:
        """Compile (or read from the cache) and load every kernel now, e.g. before graph capture."""
        for family in registry.families():
            self._load_family(family)

    @staticmethod
    def _require_not_capturing(expr: str) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{expr} is not loaded and a CUDA graph is being captured: call "
                "oasr.fast.paged_ops.load_kernels(device) (or run the op once) before capturing"
            )

    def resident_ctas(self, kernel: registry.Kernel, targs: tuple[str, ...], threads: int) -> int:
        """CTAs of this instantiation resident per SM on this device (the driver's occupancy query)."""
        expr = kernel.name_expression(targs)
        if expr not in self._resident:
            if expr not in self._kernels:
                self._require_not_capturing(expr)
                self._load_family(kernel.family, [expr])
            occupancy = self._kernels[expr].occupancy
            self._resident[expr] = max(1, int(occupancy.max_active_blocks_per_multiprocessor(threads, 0)))
        return self._resident[expr]

    def launch(self, kernel: registry.Kernel, targs: tuple[str, ...], grid, block, args) -> None:
        """Launch one instantiation of ``kernel`` on torch's current stream of this device (``args`` by
        ``kernel.params``).

        Per call only what can change is done: the grid check, the stream, the arguments' conversion;
        the instantiation's kernel object, its parameter kinds, each (grid, block) ``LaunchConfig`` and
        each stream's cuda.core ``Stream`` are looked up once.
        """
        registry.check_grid(kernel, grid)
        if torch.cuda.current_device() != self.device.index:
            with torch.cuda.device(self.device):  # the launch needs this device's context current
                return self.launch(kernel, targs, grid, block, args)
        entry = self._entries.get((kernel.name, targs))
        if entry is None:
            expr = kernel.name_expression(targs)
            if expr not in self._kernels:
                self._require_not_capturing(expr)
                self._load_family(kernel.family, [expr])  # this instantiation only (lazy, cached on disk)
            entry = self._entries[(kernel.name, targs)] = (self._kernels[expr], [kind for _, kind in kernel.params])
        compiled, kinds = entry
        params = [_convert(kind, value) for kind, value in zip(kinds, args, strict=True)]
        handle = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            if len(self._streams) >= 64:  # side streams come and go (captures): keep the cache small
                self._streams.clear()
            stream = self._streams[handle] = _cuda_core().Stream.from_handle(handle)
        shape = (tuple(grid), tuple(block))
        config = self._configs.get(shape)
        if config is None:
            if len(self._configs) >= 1024:
                self._configs.clear()
            config = self._configs[shape] = _cuda_core().LaunchConfig(grid=shape[0], block=shape[1])
        _cuda_core().launch(stream, config, compiled, *params)

    @property
    def launch_path(self) -> str:
        """"driver" (``prepare`` packs a plan's parameters for cuLaunchKernel) or "cuda_core" (every call through
        ``launch``): ``LAUNCH_PATH``, from OASR_CUDA_LAUNCH."""
        return LAUNCH_PATH

    def prepare(self, kernel: registry.Kernel, targs: tuple[str, ...], grid, block, args, per_call):
        """A ``packed_params.PreparedLaunch`` of one instantiation (``args`` by ``kernel.params``; the positions in
        ``per_call`` are supplied at each call), or None on the "cuda_core" path (then callers use ``launch``).

        The packed layout is checked once against the driver's own (cuda.core's ``arguments_info``: offset and
        size of each parameter); a mismatch raises RuntimeError naming the parameter. NOT YET RUN ON A GPU.
        """
        if self.launch_path != "driver":
            return None
        from cuda.bindings import driver

        from oasr.fast.kernels.packed_params import PreparedLaunch

        registry.check_grid(kernel, grid)
        expr = kernel.name_expression(targs)
        if expr not in self._kernels:
            self._require_not_capturing(expr)
            self._load_family(kernel.family, [expr])
        compiled = self._kernels[expr]
        kinds = [kind for _, kind in kernel.params]
        function = driver.CUfunction(int(compiled.handle))  # a CUkernel, which cuLaunchKernel takes as a function
        index = self.device.index

        def driver_launch(grid, block, stream, params_address):
            if torch.cuda.current_device() != index:
                with torch.cuda.device(index):
                    return driver_launch(grid, block, stream, params_address)
            (err,) = driver.cuLaunchKernel(function, *grid, *block, 0, driver.CUstream(stream), params_address, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuLaunchKernel({expr}) failed: {err}")

        prepared = PreparedLaunch(kinds, args, per_call, grid, block, driver_launch)
        info = [(int(a.offset), int(a.size)) for a in compiled.arguments_info]
        mine = list(zip(prepared.params.layout.offsets, prepared.params.layout.sizes, strict=True))
        if info != mine:
            n = max(len(info), len(mine))
            bad = next(i for i in range(n) if i >= min(len(info), len(mine)) or info[i] != mine[i])
            raise RuntimeError(f"{expr}: packed parameters (offset, size) {mine} differ from the driver's {info}, "
                               f"first at parameter {bad}")
        return prepared

    def stream_handle(self) -> int:
        """torch's current stream on this device, as the driver's handle."""
        return torch.cuda.current_stream(self.device).cuda_stream


def _cuda_core():
    """cuda.core, imported on first use (compiling for an explicit arch needs no driver; importing it does not
    either, but the CPU-only install may lack it)."""
    global _CUDA_CORE
    if _CUDA_CORE is None:
        import cuda.core as module

        _CUDA_CORE = module
    return _CUDA_CORE


_CUDA_CORE = None
_EXECUTORS: dict[int, CudaExecutor] = {}


def executor_for(device: torch.device) -> CudaExecutor:
    """The process's ``CudaExecutor`` for a CUDA device (one per device index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _EXECUTORS:
        _EXECUTORS[index] = CudaExecutor(torch.device("cuda", index))
    return _EXECUTORS[index]
