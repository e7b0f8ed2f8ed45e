"""A kernel's parameters packed once, for launches through the CUDA driver's ``cuLaunchKernel``.

cuda.core's ``launch`` converts every argument and builds the driver's parameter array at each call
(about 16 us of the 22.6 us host time the H200 measured per attention call). A plan's launch differs
from call to call only in a few pointers (the output, the split partials), so its parameters can be
packed once, into one buffer laid out as the kernel's parameter list is (each value at its natural
alignment: pointers 8 bytes, ``int`` and ``float`` 4), with the array of pointers to each value that
``cuLaunchKernel``'s ``kernelParams`` takes; a call rewrites the pointers that changed and launches.
The driver copies the values when the launch is queued, so the buffer may be rewritten once the call
returns.

Layout (``layout``), by the parameter kinds of ``oasr.fast.kernels.registry``::

    ptr   8 bytes, aligned to 8   (a device address, 0 for none)
    i32   4 bytes, aligned to 4   (two's complement, -2^31 .. 2^31 - 1)
    f32   4 bytes, aligned to 4   (IEEE single)

``PackedParams`` holds the values and the pointer array; ``PreparedLaunch`` adds the launch (the grid,
the block, which parameters a call supplies, and the function that calls the driver). Both are plain
host objects: the packing is tested on the CPU (``tests/test_packed_params.py``), and the driver call
itself is made by ``oasr.fast.kernels.nvrtc.CudaExecutor.prepare`` on a GPU.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# kind -> (bytes, alignment, struct format)
KINDS = {"ptr": (8, 8, "Q"), "i32": (4, 4, "i"), "f32": (4, 4, "f")}


@dataclass(frozen=True)
class ParamLayout:
    """Where each parameter lies in the packed buffer."""

    kinds: tuple[str, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: int  # the buffer's bytes (the last parameter's end, rounded up to 8)


def layout(kinds: Sequence[str]) -> ParamLayout:
    """The packed layout of parameters of ``kinds`` (each at its natural alignment, in order).

    Raises ValueError for a kind outside ``KINDS``."""
    offsets, sizes, at = [], [], 0
    for i, kind in enumerate(kinds):
        if kind not in KINDS:
            raise ValueError(f"packed parameters: parameter {i} has kind {kind!r}; the kinds are {sorted(KINDS)}")
        size, align, _ = KINDS[kind]
        at = -(-at // align) * align
        offsets.append(at)
        sizes.append(size)
        at += size
    return ParamLayout(tuple(kinds), tuple(offsets), tuple(sizes), -(-at // 8) * 8)


def _checked(kind: str, value, index: int):
    """``value`` as the struct module packs it for ``kind``, or ValueError naming the parameter."""
    if kind == "f32":
        return float(value)
    v = int(value)
    lo, hi = (0, 2**64 - 1) if kind == "ptr" else (-(2**31), 2**31 - 1)
    if not lo <= v <= hi:
        raise ValueError(f"packed parameters: parameter {index} ({kind}) = {v} is outside [{lo}, {hi}]")
    return v


class PackedParams:
    """The values of one launch's parameters in one buffer, and the pointer to each (``kernelParams``).

    The buffer lives as long as this object; ``address`` is the ``void**`` array the driver reads."""

    def __init__(self, kinds: Sequence[str], values: Sequence):
        self.layout = layout(kinds)
        if len(values) != len(self.layout.kinds):
            raise ValueError(f"packed parameters: {len(self.layout.kinds)} parameters, {len(values)} values")
        self._buffer = (ctypes.c_uint64 * (self.layout.size // 8 or 1))()  # 8-byte aligned
        self._view = memoryview(self._buffer).cast("B")
        base = ctypes.addressof(self._buffer)
        self._pointers = (ctypes.c_void_p * max(1, len(kinds)))(*(base + o for o in self.layout.offsets))
        self._formats = tuple("<" + KINDS[k][2] for k in self.layout.kinds)
        for i, v in enumerate(values):
            self.set(i, v)

    def set(self, index: int, value) -> None:
        """Write parameter ``index``'s value (range-checked for its kind)."""
        struct.pack_into(self._formats[index], self._view, self.layout.offsets[index],
                         _checked(self.layout.kinds[index], value, index))  # fmt: skip

    @property
    def address(self) -> int:
        """The address of the array of pointers to each value (``cuLaunchKernel``'s ``kernelParams``)."""
        return ctypes.addressof(self._pointers)

    @property
    def buffer_address(self) -> int:
        """The address of the packed values."""
        return ctypes.addressof(self._buffer)

    def pointers(self) -> list[int]:
        """The array ``address`` points to: one address per parameter, into the buffer."""
        return [int(p) for p in self._pointers[: len(self.layout.kinds)]]

    def to_bytes(self) -> bytes:
        """The packed values, ``layout.size`` bytes."""
        return bytes(self._view[: self.layout.size])


class PreparedLaunch:
    """One kernel launch with its parameters packed once: a call supplies the parameters named ``per_call``
    (by position) and the stream, and the rest are as prepared.

    ``driver_launch(grid, block, stream, params_address)`` queues the launch (on a GPU, ``cuLaunchKernel``;
    the launcher bench passes a no-op). Calls from several threads are serialised (the buffer is shared)."""

    def __init__(self, kinds: Sequence[str], values: Sequence, per_call: Sequence[int], grid, block,
                 driver_launch: Callable[[tuple, tuple, int, int], None]):  # fmt: skip
        self.params = PackedParams(kinds, values)
        self.per_call = tuple(per_call)
        for i in self.per_call:
            if not 0 <= i < len(kinds):
                raise ValueError(f"packed launch: per-call parameter {i} is not one of the {len(kinds)} parameters")
        self.grid, self.block = tuple(grid), tuple(block)
        self._driver_launch = driver_launch
        self._lock = threading.Lock()

    def launch(self, stream: int, *values) -> None:
        """Set the per-call parameters to ``values`` and queue the launch on ``stream`` (a driver handle)."""
        if len(values) != len(self.per_call):
            raise ValueError(f"packed launch: {len(self.per_call)} per-call values expected, got {len(values)}")
        with self._lock:
            for i, v in zip(self.per_call, values, strict=True):
                self.params.set(i, v)
            self._driver_launch(self.grid, self.block, stream, self.params.address)
