"""A C++ source of the fast twin built with the host compiler on first use and loaded by ctypes.

``NativeLibrary(source, flags, subdir, what, bind)`` compiles ``source`` once (``$CXX``, default ``g++``) into
``<kernel cache>/<subdir>/`` (``oasr.fast.kernels.nvrtc.cache_dir``), the file named by a hash of the source, the
flags and the compiler's version (``oasr.fast.kernels.emulation.compiler_version``), so an edit or another
compiler builds afresh and concurrent processes never see a half-written file; ``bind(lib)`` declares the
functions' signatures. ``library()`` returns the loaded library (``RuntimeError`` saying why it cannot be
built: no compiler, a failed build; the reason is kept, the build not retried); ``unavailable_reason()`` is
that reason, or None. The native CTC search (``oasr.fast.ctc_native``) and the native word search
(``oasr.fast.word_native``) are built this way.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path


class NativeLibrary:
    """One C++ source, built once per process and cached on disk (module docstring)."""

    def __init__(self, source: Path, flags: tuple, subdir: str, what: str, bind):
        self.source, self.flags, self.subdir, self.what, self.bind = Path(source), tuple(flags), subdir, what, bind
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._failure: str | None = None

    def _compiler(self) -> str:
        cxx = os.environ.get("CXX") or "g++"
        found = shutil.which(cxx)
        if not found:
            raise RuntimeError(f"the {self.what} needs a C++17 compiler: {cxx!r} not found (set CXX)")
        return found

    def _build(self) -> ctypes.CDLL:
        from oasr.fast.kernels.emulation import compiler_version
        from oasr.fast.kernels.nvrtc import _atomic_write, cache_dir

        cxx = self._compiler()
        version = compiler_version(cxx)
        source = self.source.read_bytes()
        digest = hashlib.sha256(source + " ".join(self.flags).encode() + version.encode()).hexdigest()[:20]
        path = cache_dir() / self.subdir / f"{self.source.stem}_{digest}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            done = subprocess.run([cxx, *self.flags, str(self.source), "-o", str(tmp)], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"the {self.what} failed to build ({cxx}): {done.stderr.strip()[-2000:]}")
            _atomic_write(path, tmp.read_bytes())
            tmp.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(path))
        self.bind(lib)
        return lib

    def library(self) -> ctypes.CDLL:
        """The built library (compiled on first use); ``RuntimeError`` saying why where it cannot be built."""
        with self._lock:
            if self._library is None and self._failure is None:
                try:
                    self._library = self._build()
                except (RuntimeError, OSError) as exc:
                    self._failure = str(exc)
            if self._library is None:
                raise RuntimeError(self._failure)
            return self._library

    def unavailable_reason(self) -> str | None:
        """Why the library cannot be used here (no compiler, a failed build), or None when it can."""
        try:
            self.library()
        except RuntimeError as exc:
            return str(exc)
        return None
