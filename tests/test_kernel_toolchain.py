"""Where the kernel builds find their compiler and CUDA headers, and what happens without them.

The emulated-kernel tests must skip, saying what is missing, on a machine without g++ or CUDA headers
(and fail instead under ``OASR_REQUIRE_KERNELS=1``); ``OASR_CUDA_INCLUDE`` names the one header
directory to use, with no fallback to a toolkit elsewhere, so CI can prove that pip's headers suffice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oasr.fast.kernels import emulation, nvrtc, registry

ROOT = Path(__file__).resolve().parents[1]


def test_oasr_cuda_include_is_the_only_place_looked_in(tmp_path, monkeypatch):
    """A directory without the headers is refused even where a toolkit is installed elsewhere."""
    monkeypatch.setenv("OASR_CUDA_INCLUDE", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(emulation.EmulationUnavailable, match=str(tmp_path)) as info:
        emulation.emulation_toolchain()
    assert "/usr/local/cuda" not in str(info.value)
    with pytest.raises(RuntimeError, match=str(tmp_path)):
        nvrtc.cuda_include_dir()


def test_a_missing_compiler_is_reported_before_any_build(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(emulation.EmulationUnavailable, match="/nonexistent/g"):
        emulation.emulation_toolchain()


def test_every_emulated_test_skips_without_the_toolchain(tmp_path):
    """With the compiler and the headers hidden, the decode-attention test skips like its siblings."""
    env = {k: v for k, v in os.environ.items() if k not in ("OASR_REQUIRE_KERNELS", "CUDA_HOME", "CUDA_PATH")}
    env.update(CXX="/nonexistent/g++", OASR_CUDA_INCLUDE=str(tmp_path), OMP_NUM_THREADS="1")
    node = "tests/test_attention_decoder.py::test_decode_attention_under_emulated_kernels"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", node],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout and "kernel emulation unavailable" in proc.stdout, proc.stdout


def _header_dependencies(family: str, cxx: str, include: str) -> list[str]:
    """Every file g++ reads for the family's emulation build (``-M``), resolved."""
    shim = emulation.shim_source(family)
    cmd = [cxx, *[f for f in emulation.CXX_FLAGS if f not in ("-shared", "-fPIC")], "-M",
           f"-I{registry.KERNELS_DIR}", f"-I{include}", "-x", "c++", "-"]
    proc = subprocess.run(cmd, input=shim, capture_output=True, text=True, timeout=300,
                          cwd=registry.KERNELS_DIR)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.replace("\\\n", " ").split()[1:]  # "-.o:" then the dependencies
    return [os.path.realpath(w) for w in words if w != "-"]


def test_emulation_reads_cuda_headers_from_the_chosen_directory_only(monkeypatch):
    """No header of the build comes from a CUDA directory other than the one the toolchain chose.

    Run by CI with ``OASR_CUDA_INCLUDE`` set to pip's headers: then nothing comes from the toolkit in
    /usr/local/cuda, which that machine also has.
    """
    try:
        cxx, include = emulation.emulation_toolchain()
    except emulation.EmulationUnavailable as exc:
        pytest.skip(f"kernel emulation unavailable: {exc}")
    monkeypatch.delenv("OASR_CUDA_INCLUDE", raising=False)
    chosen = os.path.realpath(include)
    others = {os.path.realpath(c) for c in emulation._cuda_include_candidates() if os.path.isdir(c)} - {chosen}
    for family in registry.families():
        for dep in _header_dependencies(family, cxx, include):
            foreign = [o for o in others if dep.startswith(o + os.sep) and not dep.startswith(chosen + os.sep)]
            assert not foreign, f"{family}: {dep} comes from {foreign[0]}, not from {chosen}"
