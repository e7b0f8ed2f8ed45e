"""Run the CUDA kernels on the CPU: build them with g++ against ``emu/simt_emu.h``.

Each kernel family (one ``oasr/kernels_cu/*.cu``) becomes one shared library: a
generated shim includes the ``.cu`` file and exports, per instantiation in the
registry, ``extern "C" void oasr_emu_<kernel>__<targs>(gx, gy, gz, bx, by, bz,
args...)``, which runs the grid through ``oasr_emu::launch``. The libraries are
cached under ``<kernel cache>/emu`` keyed by a hash of the sources, the shim,
the flags and the compiler's version, so a test session compiles once (all
families in parallel) and later sessions not at all.

The build needs g++ with C++20 and CUDA headers that include ``crt/host_defines.h``
and ``nv/target`` (cuda_fp16.h includes both): a CUDA toolkit's, or pip's
``nvidia/cu13/include`` once ``nvidia-cuda-crt`` and ``nvidia-cuda-cccl`` are installed
(the ``cuda`` extra). ``emulation_toolchain()`` finds both or raises
``EmulationUnavailable`` saying what is missing.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from oasr.fast.kernels import registry
from oasr.fast.kernels.nvrtc import _atomic_write, cache_dir

CXX_FLAGS = (
    "-std=c++20",
    "-O2",
    "-shared",
    "-fPIC",
    "-pthread",
    # CUDA code type-puns 16-byte vectors (Pack<T, N>, float4 over float arrays)
    # the way nvcc allows; tell g++ not to assume strict aliasing.
    "-fno-strict-aliasing",
    "-DOASR_HOST_EMULATION=1",
)
# Grid size the launchers use for the emulator's notional "SM count" when they
# size split-K grids (small, so tests exercise the split path on small inputs).
EMULATED_SM_COUNT = 4
# CTAs "resident" per emulated SM, for launchers that size grids by waves (attention v2).
EMULATED_RESIDENT_CTAS = 2

_CTYPE = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "f32": ctypes.c_float}
_CDECL = {"ptr": "const void*", "i32": "int", "f32": "float"}


class EmulationUnavailable(RuntimeError):
    pass


def _cuda_include_candidates() -> list[str]:
    """Where to look for the CUDA headers, in order; ``OASR_CUDA_INCLUDE``, when set, is the only place."""
    if os.environ.get("OASR_CUDA_INCLUDE"):
        return [os.environ["OASR_CUDA_INCLUDE"]]
    out = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append(os.path.join(os.environ[var], "include"))
    try:
        from cuda.pathfinder import get_cuda_path_or_home

        root = get_cuda_path_or_home()
        if root:
            out.append(os.path.join(root, "include"))
    except Exception:
        pass
    out.append("/usr/local/cuda/include")
    out.extend(sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True))
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            out.append(found)
    except Exception:
        pass
    return out


# What cuda_fp16.h / cuda_bf16.h pull in on a host compiler: crt/ (a toolkit, or pip's nvidia-cuda-crt)
# and nv/target (a toolkit, or pip's nvidia-cuda-cccl).
REQUIRED_CUDA_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "crt/host_defines.h", "nv/target")


def emulation_toolchain() -> tuple[str, str]:
    """(C++ compiler path, CUDA include dir), or raise EmulationUnavailable saying what is missing.

    The compiler is ``$CXX`` or ``g++`` on PATH (it must exist). The include dir is the first of
    ``_cuda_include_candidates()`` holding every file of ``REQUIRED_CUDA_HEADERS``; with
    ``OASR_CUDA_INCLUDE`` set, that directory or nothing (no fallback to a toolkit).
    """
    cxx = os.environ.get("CXX") or "g++"
    if not shutil.which(cxx):
        raise EmulationUnavailable(f"kernel emulation needs a C++20 compiler: {cxx!r} not found (set CXX)")
    cxx = shutil.which(cxx)
    candidates = _cuda_include_candidates()
    for inc in candidates:
        if all(os.path.isfile(os.path.join(inc, f)) for f in REQUIRED_CUDA_HEADERS):
            return cxx, inc
    raise EmulationUnavailable(
        f"kernel emulation needs CUDA headers with {', '.join(REQUIRED_CUDA_HEADERS)} (a CUDA toolkit, or pip's "
        "nvidia-cuda-runtime + nvidia-cuda-crt + nvidia-cuda-cccl, the `cuda` extra); looked in: "
        + ", ".join(candidates)
        + ("" if os.environ.get("OASR_CUDA_INCLUDE") else ". Set OASR_CUDA_INCLUDE or CUDA_HOME to choose one.")
    )


def unavailable_reason() -> str | None:
    """Why the host emulation cannot build here (the ``EmulationUnavailable`` message), or None when it can."""
    try:
        emulation_toolchain()
    except EmulationUnavailable as exc:
        return str(exc)
    return None


def shim_source(family: str) -> str:
    """The generated translation unit: the family's .cu plus one launcher per instantiation."""
    return _shim(f"{family}.cu", registry.kernels_of(family))


def _shim(include: str, kernels) -> str:
    lines = [f'#include "{include}"', ""]
    for kernel in kernels:
        decl = ", ".join(f"{_CDECL[kind]} {name}" for name, kind in kernel.params)
        call = ", ".join(name for name, _ in kernel.params)
        for targs in kernel.instances:
            lines += [
                f'extern "C" void {kernel.emu_symbol(targs)}(unsigned gx, unsigned gy, unsigned gz, '
                f"unsigned bx, unsigned by, unsigned bz, {decl}) {{",
                "    oasr_emu::launch(dim3(gx, gy, gz), dim3(bx, by, bz), [&] {",
                f"        oasr_emu::invoke(&{kernel.name_expression(targs)}, {call});",
                "    });",
                "}",
                "",
            ]
    return "\n".join(lines)


def compiler_version(cxx: str) -> str:
    """The first line of ``cxx --version`` (part of every build cache key: a new compiler rebuilds)."""
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.split("\n")[0]


def _library_path(family: str, cxx: str, include: str) -> tuple[Path, str]:
    return _cached_path(family, shim_source(family), registry.read_sources(family, emulation=True), cxx, include)


def _cached_path(stem: str, shim: str, sources: dict[str, str], cxx: str, include: str) -> tuple[Path, str]:
    h = hashlib.sha256()
    for name, text in sorted(sources.items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    h.update(repr((shim, CXX_FLAGS, compiler_version(cxx), include)).encode())
    return cache_dir() / "emu" / f"{stem}-{h.hexdigest()[:20]}.so", shim


_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}


def build(families: list[str] | None = None) -> dict[str, Path]:
    """Build (or find cached) emulation libraries, compiling missing ones in parallel."""
    cxx, include = emulation_toolchain()
    families = families or registry.families()
    return _compile({family: _library_path(family, cxx, include) for family in families}, cxx, include)


def _compile(targets: dict[str, tuple[Path, str]], cxx: str, include: str, extra_include: Path | None = None):
    paths, jobs = {}, []
    includes = [f"-I{registry.KERNELS_DIR}", *([f"-I{extra_include}"] if extra_include else []), f"-I{include}"]
    for stem, (path, shim) in targets.items():
        paths[stem] = path
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        shim_path = path.with_suffix(".cpp")
        _atomic_write(shim_path, shim.encode())
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        cmd = [cxx, *CXX_FLAGS, *includes, str(shim_path), "-o", str(tmp)]
        jobs.append((stem, path, tmp, cmd, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
    errors = []
    for stem, path, tmp, cmd, proc in jobs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"{stem}: {' '.join(cmd)}\n{err}")
            continue
        os.replace(tmp, path)
    if errors:
        raise RuntimeError("emulation build failed:\n" + "\n".join(errors))
    return paths


def build_source(source: Path, kernels) -> ctypes.CDLL:
    """Build (or find cached) one .cu outside oasr/kernels_cu/ (test kernels) with launchers for ``kernels``
    (``registry.Kernel`` entries); it may include oasr/kernels_cu/ headers. Launch with ``launch_in``."""
    cxx, include = emulation_toolchain()
    sources = {source.name: source.read_text()}
    for name in (*registry.SHARED_HEADERS, *registry.EMULATION_HEADERS):
        sources[name] = (registry.KERNELS_DIR / name).read_text()
    target = _cached_path(source.stem, _shim(source.name, kernels), sources, cxx, include)
    path = _compile({source.stem: target}, cxx, include, extra_include=source.parent)[source.stem]
    return ctypes.CDLL(str(path))


def launch_in(library: ctypes.CDLL, kernel: registry.Kernel, targs: tuple[str, ...], grid, block, args) -> None:
    """Run one instantiation of ``kernel`` from ``library``: grid/block are 3-tuples, args by ``kernel.params``."""
    fn = getattr(library, kernel.emu_symbol(targs))
    fn.argtypes = [ctypes.c_uint] * 6 + [_CTYPE[kind] for _, kind in kernel.params]
    fn.restype = None
    values = [(int(v) or None) if kind == "ptr" else v for (_, kind), v in zip(kernel.params, args, strict=True)]
    fn(*grid, *block, *values)


def _library(family: str) -> ctypes.CDLL:
    with _lock:
        if family not in _libraries:
            path = build([family])[family]
            _libraries[family] = ctypes.CDLL(str(path))
        return _libraries[family]


class EmulatedExecutor:
    """Runs kernels on CPU tensors through the g++-built emulation libraries."""

    kind = "emulated"
    sm_count = EMULATED_SM_COUNT

    def __init__(self):
        self._functions: dict[str, object] = {}

    def load_all(self) -> None:
        """Build (or load from the cache) every family's emulation library now, not at a first launch."""
        build()  # one parallel build of every family
        for family in registry.families():
            _library(family)

    def resident_ctas(self, kernel: registry.Kernel, targs: tuple[str, ...], threads: int) -> int:
        """CTAs per SM for the wave arithmetic: a parameter here (EMULATED_RESIDENT_CTAS), not a measurement."""
        return EMULATED_RESIDENT_CTAS

    def launch(self, kernel: registry.Kernel, targs: tuple[str, ...], grid, block, args) -> None:
        """Run one instantiation of ``kernel`` over ``grid`` x ``block`` on CPU tensors' addresses (``args`` by
        ``kernel.params``).
        """
        registry.check_grid(kernel, grid)
        symbol = kernel.emu_symbol(targs)
        fn = self._functions.get(symbol)
        if fn is None:
            fn = getattr(_library(kernel.family), symbol)
            fn.argtypes = [ctypes.c_uint] * 6 + [_CTYPE[kind] for _, kind in kernel.params]
            fn.restype = None
            self._functions[symbol] = fn
        values = [(int(v) or None) if kind == "ptr" else v for (_, kind), v in zip(kernel.params, args, strict=True)]
        fn(*grid, *block, *values)


_EXECUTOR: EmulatedExecutor | None = None


def executor() -> EmulatedExecutor:
    """The process's one ``EmulatedExecutor``."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = EmulatedExecutor()
    return _EXECUTOR
