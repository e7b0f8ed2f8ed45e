"""Kernel launch hygiene: grid limits, the caller's current device, argument kinds.

None of these needs a GPU: the grid check runs before any launch (a stand-in executor records
launches), the device switch is tested with stand-ins for cuda.core and torch.cuda, and the kind
check is a compile-time assertion of the emulation build, tested by compiling with g++.
"""

from __future__ import annotations

import subprocess
import types

import pytest
import torch

from oasr.cache.paged import PagedKVCache
from oasr.fast.kernels import emulation, nvrtc, ops, registry


class RecordingExecutor:
    """Stands in for an executor: records launches instead of running them."""

    kind = "emulated"
    sm_count = 4

    def __init__(self):
        self.launches = []

    def launch(self, kernel, targs, grid, block, args):
        self.launches.append((kernel.name, tuple(grid)))


def wide_cache(batch: int, head_dim: int = 64) -> PagedKVCache:
    k = torch.zeros(2, 4, 1, head_dim)
    zeros = torch.zeros(batch, dtype=torch.int32)
    return PagedKVCache(k, k.clone(), torch.zeros(batch, 1, dtype=torch.int32), zeros, zeros, 4, 0, 0)


def test_attention_refuses_a_batch_past_grid_z():
    # The attention grid is (q tiles x splits, n_kv_head, B): B = 65536 rows would be an invalid launch.
    executor = RecordingExecutor()
    q = torch.zeros(65_536, 1, 1, 64)
    with pytest.raises(ValueError, match="B=65536 rows, but the kernel's grid z is the batch .* at most 65535"):
        ops.paged_attention(executor, q, wide_cache(65_536), None, 1.0, False)
    assert executor.launches == []
    out = ops.paged_attention(executor, q[:65_535], wide_cache(65_535), None, 1.0, False)
    assert out.shape[0] == 65_535 and executor.launches[0][1][2] == 65_535


def test_executors_refuse_grids_past_cudas_limits():
    kernel = registry.BY_NAME["paged_attention_combine_kernel"]
    for grid in ((1, 1, 65_536), (1, 65_536, 1), (2**31, 1, 1), (0, 1, 1)):
        with pytest.raises(ValueError, match="is outside CUDA's"):
            registry.check_grid(kernel, grid)
        with pytest.raises(ValueError, match="is outside CUDA's"):  # before any library is built or loaded
            emulation.EmulatedExecutor().launch(kernel, ("float", "64"), grid, (128, 1, 1), ())
    registry.check_grid(kernel, (2**31 - 1, 65_535, 65_535))


class FakeDevices:
    """torch.cuda's current device and cuda.core's Device, over one integer."""

    def __init__(self, current: int):
        self.current = current
        self.log = []

    def device(self, index):
        return types.SimpleNamespace(set_current=lambda: self._set(index, "cuda.core"))

    def _set(self, index, by):
        self.log.append((by, index))
        self.current = index


def test_device_current_restores_the_callers_device():
    devices = FakeDevices(current=1)
    kwargs = dict(current=lambda: devices.current, make_current=lambda i: devices._set(i, "set"),
                  restore=lambda i: devices._set(i, "restore"))  # fmt: skip
    with nvrtc.device_current(0, **kwargs):
        assert devices.current == 0
    assert devices.current == 1
    with pytest.raises(RuntimeError, match="load failed"), nvrtc.device_current(0, **kwargs):
        raise RuntimeError("load failed")
    assert devices.current == 1
    with nvrtc.device_current(1, **kwargs):  # already current: nothing to restore
        pass
    assert devices.log == [("set", 0), ("restore", 1), ("set", 0), ("restore", 1), ("set", 1)]


def test_loading_a_family_leaves_the_callers_device_current(monkeypatch):
    # CudaExecutor._load_family used cuda.core's Device(i).set_current() and left device i current.
    # Here cuda.core, torch.cuda and the compiler are stand-ins: device 1 is current, the executor is for 0.
    cuda_core = pytest.importorskip("cuda.core")
    devices = FakeDevices(current=1)
    monkeypatch.setattr(cuda_core, "Device", devices.device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: devices.current)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: devices._set(int(i), "torch"))
    loaded = types.SimpleNamespace(get_kernel=lambda mangled: (mangled, devices.current))
    monkeypatch.setattr(cuda_core, "ObjectCode", types.SimpleNamespace(from_cubin=lambda *a, **k: loaded))
    compiled = nvrtc.CompiledFamily("gather_kv_blocks", "sm_90", b"", {"expr": "_Z6mangled"}, "")
    asked = []
    monkeypatch.setattr(nvrtc, "compile_family",
                        lambda family, arch, expressions=None: asked.append(expressions) or compiled)
    executor = object.__new__(nvrtc.CudaExecutor)  # no GPU: skip __init__'s device queries
    executor.device, executor.arch, executor._kernels = torch.device("cuda", 0), "sm_90", {}
    executor._load_family("gather_kv_blocks")
    assert executor._kernels["expr"] == ("_Z6mangled", 0)  # loaded with device 0 current
    assert devices.current == 1  # and the caller's device is current again
    executor._load_family("gather_kv_blocks", ["expr"])  # a launch loads its own instantiation only
    assert asked == [None, ["expr"]]


KIND_PROBE = """
#include "common.cuh"
namespace probe {
__global__ void kernel(const float* __restrict__ x, PARAM n, float scale) {}
}
void launcher(const void* x, int n, float scale) { oasr_emu::invoke(&probe::kernel, x, n, scale); }
"""


def _compile_probe(tmp_path, param: str) -> subprocess.CompletedProcess:
    try:
        cxx, include = emulation.emulation_toolchain()
    except emulation.EmulationUnavailable as exc:
        pytest.skip(f"kernel emulation unavailable: {exc}")
    source = tmp_path / f"probe_{param.replace(' ', '_')}.cpp"
    source.write_text(KIND_PROBE.replace("PARAM", param))
    flags = [f for f in emulation.CXX_FLAGS if f not in ("-shared", "-fPIC", "-O2")]
    cmd = [cxx, *flags, "-fsyntax-only", f"-I{registry.KERNELS_DIR}", f"-I{include}", str(source)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@pytest.mark.parametrize("param", ["long long", "unsigned", "double", "const int*"])
def test_invoke_refuses_a_parameter_type_other_than_the_registrys_kind(tmp_path, param):
    # The launcher passes an i32 as int; a kernel parameter of another type must not compile
    # (on a GPU it would read a wrong value and shift every later argument).
    result = _compile_probe(tmp_path, param)
    assert result.returncode != 0
    assert "differs from the registry's kind" in result.stderr


def test_invoke_accepts_the_registrys_kinds(tmp_path):
    result = _compile_probe(tmp_path, "int")
    assert result.returncode == 0, result.stderr


def test_cuda_executor_launch_looks_up_each_instantiation_stream_and_config_once(monkeypatch):
    """The launcher's host cost: a launch converts its arguments and launches; the kernel object,
    the parameter kinds, the cuda.core Stream of a handle and each LaunchConfig are made once. cuda.core and
    torch.cuda are stand-ins here (no GPU)."""
    made = {"streams": 0, "configs": 0, "loads": 0}
    launched = []
    def count(what, value):
        made[what] += 1
        return value

    fake_core = types.SimpleNamespace(
        Stream=types.SimpleNamespace(from_handle=lambda h: count("streams", ("S", h))),
        LaunchConfig=lambda grid, block: count("configs", ("C", grid, block)),
        launch=lambda stream, config, kernel, *params: launched.append((stream, config, kernel, params)),
    )
    monkeypatch.setattr(nvrtc, "_CUDA_CORE", fake_core)
    handles = {"now": 7}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=handles["now"]))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    executor = object.__new__(nvrtc.CudaExecutor)  # no GPU: skip __init__'s device queries
    executor.device, executor.arch = torch.device("cuda", 0), "sm_90"
    executor._kernels, executor._resident, executor._entries, executor._streams, executor._configs = {}, {}, {}, {}, {}

    def load(family, expressions=None):
        made["loads"] += 1
        for expr in expressions:
            executor._kernels[expr] = f"K[{expr}]"

    monkeypatch.setattr(executor, "_load_family", load)
    kernel = registry.BY_NAME["paged_attention_combine_kernel"]
    targs = kernel.instances[0]
    args = (1, 2, 3, 4, 5)
    for _ in range(3):
        executor.launch(kernel, targs, (8, 1, 1), (128, 1, 1), args)
    handles["now"] = 9  # another stream (e.g. a capture's side stream)
    executor.launch(kernel, targs, [8, 1, 1], [128, 1, 1], args)  # lists: the same config
    assert made == {"streams": 2, "configs": 1, "loads": 1} and len(launched) == 4
    stream, config, compiled, params = launched[-1]
    assert stream == ("S", 9) and config == ("C", (8, 1, 1), (128, 1, 1))
    assert compiled == f"K[{kernel.name_expression(targs)}]" and [int(p) for p in params] == list(args)
