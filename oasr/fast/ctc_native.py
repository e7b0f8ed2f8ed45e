"""The fast CTC search's native CPU path: the host loop's rule in C++ (``ctc_native.cpp``), built with g++.

``StreamingCtcDecoder(native=...)`` (``oasr.fast.ctc_decoder``) runs a CPU cohort's chunk through
``decode_rows``: the candidates come from the same torch top-k per chunk as the other paths, then one
C call reads every row's beam from its state buffers, runs every frame of every row (the host loop's
``_advance_host``, step for step, in double with the same libm calls) and writes the rows back in the
state layout, or, when a prefix would outgrow ``max_prefix_len``, writes nothing. Per stream the Python
work is a few list appends: the cost of a chunk no longer has a per-frame torch op in it, and the
search's own arithmetic is ~1 us per (row, frame) at beam 8 over 29 candidates.

The library is compiled once per source (``g++ -O2``, no torch headers, a plain C ABI through
``ctypes``) into ``<kernel cache>/ctc/`` (``oasr.fast.kernels.nvrtc.cache_dir``), keyed by a hash of the
source, the flags and the compiler's version. ``unavailable_reason()`` says why it cannot be built here
(no C++ compiler, or the build failed), or None.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from oasr.fast.native_lib import NativeLibrary

SOURCE = Path(__file__).with_name("ctc_native.cpp")
CXX_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-fno-fast-math")


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.oasr_ctc_decode_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 9


_NATIVE = NativeLibrary(SOURCE, CXX_FLAGS, "ctc", "native CTC search", _bind)
library = _NATIVE.library  # compiled on first use; RuntimeError says why where it cannot be built
unavailable_reason = _NATIVE.unavailable_reason  # why it cannot run here, or None


_FIELDS = 8  # tokens, frames, lengths, keys, parent_keys, last, log_pb, log_pnb (the _Beams order)


def _state_pointers(state) -> list:
    """Per row of ``state``, its 8 buffer addresses (cached on the state until its buffers change)."""
    cached, bufs = state.native_ptrs, state.buffers
    if cached is not None and cached[0] is bufs and cached[1] == bufs.tokens.data_ptr():  # (a deep copy moves it)
        return cached[2]
    for buf in bufs:
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"native CTC search: state buffers must be contiguous CPU tensors, got {buf.device}")
    bases = [buf.data_ptr() for buf in bufs]
    steps = [buf.stride(0) * buf.element_size() for buf in bufs]
    rows = [[base + b * step for base, step in zip(bases, steps, strict=True)] for b in range(state.capacity)]
    state.native_ptrs = (bufs, bases[0], rows)
    return rows


def decode_rows(states: list, lp: torch.Tensor, row_lengths: list, cand, config) -> bool:
    """Decode the stacked chunk ``lp`` (R, T, V) of ``states``' rows with candidates ``cand``; commit all or none.

    Returns False (nothing written) when a prefix would outgrow ``config.max_prefix_len``; else writes every
    row and sets each state's ``longest``. Values are checked by the caller (NaN / ``+inf``)."""
    R, T, V = lp.shape
    K, W, L = cand.tokens.shape[2], config.beam_size, config.max_prefix_len
    ptrs, old_window, first = [], [], []
    for state in states:
        rows = _state_pointers(state)
        ptrs.extend(rows[: state.batch])
        old_window.extend([state.longest] * state.batch)
        first.extend([state.frames_decoded] * state.batch)
    ptrs = np.asarray(ptrs, dtype=np.int64)
    meta = np.asarray([old_window, first, row_lengths], dtype=np.int64)
    lp64 = np.ascontiguousarray(lp.to(torch.float64).numpy())
    blank = np.ascontiguousarray(cand.lp_blank.numpy())
    tokens = np.ascontiguousarray(cand.tokens.to(torch.int64).numpy())
    lp_tokens = np.ascontiguousarray(cand.lp_tokens.numpy())
    longest = np.zeros(R, dtype=np.int64)
    status = library().oasr_ctc_decode_rows(
        R, T, V, K, W, L, ptrs.ctypes.data, meta[0].ctypes.data, meta[1].ctypes.data, meta[2].ctypes.data,
        lp64.ctypes.data, blank.ctypes.data, tokens.ctypes.data, lp_tokens.ctypes.data, longest.ctypes.data)
    if status:
        return False
    longest = longest.tolist()
    start = 0
    for state in states:
        state.longest = max(longest[start : start + state.batch])
        start += state.batch
    return True
