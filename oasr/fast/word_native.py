"""The fast word search's native library: ``word_native.cpp`` built with g++ on first use, loaded by ctypes.

The library is compiled once per source (``g++ -O2 -ffp-contract=off``: no FMA contraction and no fast
math, so every double operation is the reference's; no torch headers, a plain C ABI) into
``<kernel cache>/words/`` (``oasr.fast.kernels.nvrtc.cache_dir``), keyed by a hash of the source, the flags
and the compiler's version (``oasr.fast.kernels.emulation.compiler_version``). ``unavailable_reason()``
says why it cannot be built here (no C++ compiler, or the build failed), or None.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from oasr.fast.native_lib import NativeLibrary

SOURCE = Path(__file__).with_name("word_native.cpp")
CXX_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off")

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


def _bind(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


_NATIVE = NativeLibrary(SOURCE, CXX_FLAGS, "words", "native word search", _bind)
library = _NATIVE.library  # compiled on first use; RuntimeError says why where it cannot be built
unavailable_reason = _NATIVE.unavailable_reason  # why it cannot run here, or None
