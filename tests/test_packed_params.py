"""Kernel parameters packed once per plan (oasr.fast.kernels.packed_params), on the CPU.

The oracle for the bytes is each kernel's own signature, read from its .cu source (a pointer, an int or a
float per parameter) and packed by the struct module in native C layout ("@": each value at its natural
alignment), independently of the registry's parameter kinds and of the packer. The driver call itself
(``CudaExecutor.prepare`` -> cuLaunchKernel) needs a GPU: ``tests/test_kernels_cuda.py``.
"""

from __future__ import annotations

import random
import re
import struct

import pytest

from oasr.bench.launcher import NoopExecutor, make_view
from oasr.fast.kernels import ops, registry
from oasr.fast.kernels.packed_params import KINDS, PackedParams, PreparedLaunch, layout


def _signature(kernel: registry.Kernel) -> list[tuple[str, str]]:
    """(name, C kind) of each parameter of ``kernel``'s ``__global__`` declaration in its source."""
    src = registry.source_path(kernel.family).read_text()
    name = registry.short_name(kernel)
    m = re.search(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?" + name + r"\s*\(", src)
    assert m, f"no __global__ {name} in {kernel.family}"
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        i += 1
    params = []
    for decl in src[m.end():i - 1].split(","):
        decl = re.sub(r"\s+", " ", decl).strip()
        pname = re.findall(r"[A-Za-z_]\w*", decl)[-1]
        kind = "ptr" if "*" in decl else {"int": "i32", "float": "f32"}[decl.split()[-2]]
        params.append((pname, kind))
    return params


C_FORMAT = {"ptr": "P", "i32": "i", "f32": "f"}  # native C types: void*, int, float


def _values(kinds, rng) -> list:
    draw = {"ptr": lambda: rng.randrange(0, 2**64, 16) or 16, "i32": lambda: rng.randrange(-(2**31), 2**31),
            "f32": lambda: struct.unpack("f", struct.pack("f", rng.uniform(-1e6, 1e6)))[0]}  # fmt: skip
    return [draw[k]() for k in kinds]


@pytest.mark.parametrize("kernel", registry.KERNELS, ids=registry.short_name)
def test_packed_bytes_are_the_kernels_signature_in_c_layout(kernel):
    signature = _signature(kernel)
    assert [n for n, _ in signature] == [n for n, _ in kernel.params]  # the registry follows the source
    kinds = [k for _, k in signature]
    assert kinds == [k for _, k in kernel.params], kernel.name
    lay = layout(kinds)
    rng = random.Random(len(kinds))
    for _ in range(3):
        values = _values(kinds, rng)
        expected = struct.pack("@" + "".join(C_FORMAT[k] for k in kinds), *values)
        packed = PackedParams(kinds, values)
        got = packed.to_bytes()
        assert got[: len(expected)] == expected and got[len(expected):] == bytes(len(got) - len(expected))
        assert lay.size == len(got) and lay.size % 8 == 0 and len(expected) <= lay.size < len(expected) + 8
        # each parameter: its offset (aligned to its size) and the pointer the driver reads for it
        base = packed.buffer_address
        assert base % 8 == 0 and packed.pointers() == [base + o for o in lay.offsets]
        for i, kind in enumerate(kinds):
            size, align, _ = KINDS[kind]
            assert lay.sizes[i] == size == struct.calcsize(C_FORMAT[kind]) and lay.offsets[i] % align == 0
            prefix = struct.calcsize("@" + "".join(C_FORMAT[k] for k in kinds[: i + 1]))
            assert lay.offsets[i] == prefix - size  # where C puts it


def test_layout_pads_a_pointer_after_an_int():
    lay = layout(["i32", "ptr", "i32", "f32", "ptr"])
    assert lay.offsets == (0, 8, 16, 20, 24) and lay.size == 32
    with pytest.raises(ValueError, match="parameter 1 has kind 'i64'"):
        layout(["ptr", "i64"])


def test_values_out_of_range_are_refused_and_leave_the_buffer_unchanged():
    p = PackedParams(["ptr", "i32", "f32"], [16, -5, 0.5])
    before = p.to_bytes()
    for index, value, msg in ((0, -1, r"parameter 0 \(ptr\) = -1"), (0, 2**64, "parameter 0"),
                              (1, 2**31, r"parameter 1 \(i32\) = 2147483648")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            p.set(index, value)
    assert p.to_bytes() == before
    with pytest.raises(ValueError, match="3 parameters, 2 values"):
        PackedParams(["ptr", "i32", "f32"], [0, 0])


def test_prepared_launch_sets_the_per_call_values_then_calls_the_driver_once():
    calls = []
    kinds = ["ptr", "ptr", "i32", "ptr", "f32"]
    prep = PreparedLaunch(kinds, [16, 0, 7, 0, 2.0], (1, 3), (4, 2, 1), (128, 1, 1),
                          lambda grid, block, stream, address: calls.append((grid, block, stream, address,
                                                                             prep.params.to_bytes())))  # fmt: skip
    prep.launch(99, 4096, 8192)
    prep.launch(0, 32, 0)
    assert [c[:4] for c in calls] == [((4, 2, 1), (128, 1, 1), 99, prep.params.address),
                                      ((4, 2, 1), (128, 1, 1), 0, prep.params.address)]  # fmt: skip
    assert calls[0][4] == struct.pack("@PPiPf", 16, 4096, 7, 8192, 2.0) + bytes(4)
    assert calls[1][4] == struct.pack("@PPiPf", 16, 32, 7, 0, 2.0) + bytes(4)
    with pytest.raises(ValueError, match="2 per-call values expected, got 1"):
        prep.launch(0, 1)
    with pytest.raises(ValueError, match="per-call parameter 5"):
        PreparedLaunch(kinds, [0] * 5, (5,), (1, 1, 1), (1, 1, 1), lambda *a: None)


class _Recorder(NoopExecutor):
    """The no-op executor recording what it would hand the driver: on the cuda.core path the argument tuple, on
    the driver path the packed buffer at each call."""

    def __init__(self, prepared: bool):
        super().__init__(prepared)
        self.seen = []

    def launch(self, kernel, targs, grid, block, args) -> None:
        super().launch(kernel, targs, grid, block, args)
        self.seen.append((kernel, targs, tuple(grid), PackedParams([k for _, k in kernel.params], args).to_bytes()))

    def prepare(self, kernel, targs, grid, block, args, per_call):
        prep = super().prepare(kernel, targs, grid, block, args, per_call)
        prep._driver_launch = lambda g, b, s, a, p=prep, k=kernel: self.seen.append((k, targs, g, p.params.to_bytes()))
        return prep


@pytest.mark.parametrize("pages", ["bf16", "fp8"])
def test_attention_plans_pack_what_the_cuda_core_path_passes(pages):
    """Two calls of each view (the second through the kept plan): the driver path's bytes at each launch equal
    the packing of the arguments the cuda.core path hands its executor, the output's pointer included."""
    cache, q = make_view("cpu", pages)
    old, new = _Recorder(prepared=False), _Recorder(prepared=True)
    outs = {}
    for ex in (old, new):
        outs[id(ex)] = [ops.paged_attention(ex, q, cache, None, 0.125, True, version="v3") for _ in range(2)]
    assert len(old.seen) == len(new.seen) == 2
    for (k0, t0, g0, b0), (k1, t1, g1, b1), out_old, out_new in zip(old.seen, new.seen, outs[id(old)], outs[id(new)],
                                                                    strict=True):  # fmt: skip
        assert (k0, t0, g0) == (k1, t1, g1)
        out_at = layout([k for _, k in k0.params]).offsets[[n for n, _ in k0.params].index("out")]
        assert struct.unpack_from("<Q", b0, out_at)[0] == out_old.data_ptr()
        assert struct.unpack_from("<Q", b1, out_at)[0] == out_new.data_ptr()
        assert b0[:out_at] + b0[out_at + 8:] == b1[:out_at] + b1[out_at + 8:]  # everything else the same bytes
    assert new.launches == 0 and old.launches == 2  # the driver path never handed a call to `launch`
