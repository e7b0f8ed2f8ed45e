"""The fast word search's native library: ``word_native.cpp`` built with g++ on first use, loaded by ctypes.

The library is compiled once per source (``g++ -O2 -ffp-contract=off``: no FMA contraction and no fast
math, so every double operation is the reference's; no torch headers, a plain C ABI) into
``<kernel cache>/words/`` (``oasr.fast.kernels.nvrtc.cache_dir``), keyed by a hash of the source, the flags
and the compiler's version (``oasr.fast.kernels.emulation.compiler_version``). ``unavailable_reason()``
says why it cannot be built here (no C++ compiler, or the build failed), or None.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("word_native.cpp")
CXX_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None

_P, _I64, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_SIGNATURES = {
    "oasr_word_model_new": (_P, [_I64, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _P]),
    "oasr_word_model_free": (None, [_P]),
    "oasr_word_state_new": (_P, [_I64]),
    "oasr_word_state_free": (None, [_P]),
    "oasr_word_state_clone": (_P, [_P]),
    "oasr_word_decode": (None, [_P, _I64, _I64, _D, _D, _D, _I64, _I64, _P, _P, _P, _I64]),
    "oasr_word_sizes": (None, [_P, _I64, _I64, _P]),
    "oasr_word_export": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _P]),
    "oasr_word_import": (None, [_P, _I64, _I64, _P, _I64, _P, _P, _P]),
    "oasr_word_finalize": (_I64, [_P, _D, _D, _P]),
}


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    found = shutil.which(cxx)
    if not found:
        raise RuntimeError(f"the native word search needs a C++17 compiler: {cxx!r} not found (set CXX)")
    return found


def _build() -> ctypes.CDLL:
    from oasr.fast.kernels.emulation import compiler_version
    from oasr.fast.kernels.nvrtc import _atomic_write, cache_dir

    cxx = _compiler()
    version = compiler_version(cxx)
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(CXX_FLAGS).encode() + version.encode()).hexdigest()[:20]
    path = cache_dir() / "words" / f"word_native_{digest}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        done = subprocess.run([cxx, *CXX_FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"the native word search failed to build ({cxx}): {done.stderr.strip()[-2000:]}")
        _atomic_write(path, tmp.read_bytes())
        tmp.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def library() -> ctypes.CDLL:
    """The built library (compiled on first use); ``RuntimeError`` saying why where it cannot be built."""
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _build()
            except (RuntimeError, OSError) as exc:
                _failure = str(exc)
        if _library is None:
            raise RuntimeError(_failure)
        return _library


def unavailable_reason() -> str | None:
    """Why the native word search cannot run here (no compiler, a failed build), or None when it can."""
    try:
        library()
    except RuntimeError as exc:
        return str(exc)
    return None
