"""A non-editable install works: the wheel carries the kernel sources, and they compile and run from there.

The wheel is built from a copy of the package (no network: the installed setuptools, no build isolation) and
installed with ``--no-deps --target`` into a temporary directory; a child process that has that directory
first on its path (so it imports the installed copy, not the checkout, while torch and cuda-python come from
this interpreter's environment) compiles a kernel family with NVRTC from the installed copy and runs the
gather kernel under the host emulation against a plain torch gather. Caches are fresh, so nothing is
served from an earlier build of the checkout's sources.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import oasr
from oasr.fast.kernels import emulation, nvrtc

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import os, sys
    import torch
    import oasr
    from oasr.fast.kernels import registry

    target = os.environ["TARGET"]
    assert oasr.__file__.startswith(target), oasr.__file__
    assert str(registry.KERNELS_DIR).startswith(target), registry.KERNELS_DIR
    print("kernels", len(registry.families()), registry.KERNELS_DIR)
    if os.environ["CHECK_NVRTC"] == "1":
        from oasr.fast.kernels import nvrtc
        compiled = nvrtc.compile_family("gather_kv_blocks", "sm_80")
        assert not compiled.cached and compiled.cubin, "nothing compiled"
        print("nvrtc", len(compiled.cubin))
    if os.environ["CHECK_EMULATION"] == "1":
        from oasr.fast.kernels import emulation, ops
        g = torch.Generator().manual_seed(0)
        L, NB, bs, H, D = 2, 6, 4, 2, 8
        k_pool, v_pool = torch.randn(2, L, NB, bs, H, D, generator=g)
        block_ids = torch.tensor([4, 1, 3], dtype=torch.int32)
        start, frames = 2, 9
        out = torch.full((L, H, frames, 2 * D), float("nan"))
        ops.gather_kv_blocks(emulation.executor(), k_pool, v_pool, block_ids, start, frames, out)
        pos = torch.arange(start, start + frames)
        blocks, slots = block_ids.long()[pos // bs], pos % bs
        want = torch.cat([k_pool[:, blocks, slots], v_pool[:, blocks, slots]], dim=-1).transpose(1, 2)
        assert torch.equal(out, want)
        print("emulated gather ok")
    """
)


def _toolchains() -> tuple[bool, bool]:
    try:
        nvrtc.cuda_include_dir()
        from cuda.core import Program  # noqa: F401

        has_nvrtc = True
    except Exception:
        has_nvrtc = False
    try:
        emulation.emulation_toolchain()
        has_emulation = True
    except emulation.EmulationUnavailable:
        has_emulation = False
    return has_nvrtc, has_emulation


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building the wheel needs setuptools >= 77 (the build-system), have {setuptools.__version__}")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "oasr", src / "oasr", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
           "-w", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("oasr-*.whl")
    return path


def test_wheel_carries_the_kernels_licence_and_types(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "oasr" / "kernels_cu").rglob("*") if p.is_file()}
    assert sources and sources <= names, sorted(sources - names)
    assert "oasr/py.typed" in names
    assert wheel.name.startswith(f"oasr-{oasr.__version__}-")
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = zipfile.ZipFile(wheel).read(info).decode()
    assert "License-Expression: MIT" in metadata
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    entry_points = zipfile.ZipFile(wheel).read(info.replace("METADATA", "entry_points.txt")).decode()
    assert "oasr = oasr.__main__:main" in entry_points


def test_installed_package_compiles_and_runs_a_kernel(wheel, tmp_path):
    has_nvrtc, has_emulation = _toolchains()
    if not (has_nvrtc or has_emulation):
        pytest.skip("NVRTC unavailable and kernel emulation unavailable: nothing to compile with")
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {k: v for k, v in os.environ.items() if k != "OASR_KERNELS_DIR"}
    env.update(PYTHONPATH=str(target), TARGET=str(target), OASR_KERNEL_CACHE=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1", CHECK_NVRTC=str(int(has_nvrtc)), CHECK_EMULATION=str(int(has_emulation)))
    version = subprocess.run([sys.executable, str(target / "bin" / "oasr"), "--version"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert version.stdout.strip() == f"oasr {oasr.__version__}", version.stdout + version.stderr
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if os.environ.get("OASR_REQUIRE_KERNELS") == "1":
        assert has_nvrtc and has_emulation, "OASR_REQUIRE_KERNELS=1 but a kernel toolchain is missing"
