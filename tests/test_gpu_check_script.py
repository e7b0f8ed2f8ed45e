"""tools/gpu_check.sh's logic without a GPU: it parses, and with a Python that sees no CUDA device it
exits 2 and still leaves its one archive (what a lent machine returns), the summary beside it."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="needs bash and tar")


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_without_cuda_it_exits_2_and_packs_one_archive(tmp_path):
    fake = tmp_path / "python-without-cuda"
    fake.write_text("#!/bin/sh\n# a Python whose torch sees no CUDA device: every probe fails\nexit 1\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.tar.gz", "summary.txt"]  # the folder was packed
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        names = tar.getnames()
    assert {"gpu-check/summary.txt", "gpu-check/env.txt", "gpu-check/install.log"} <= set(names)
    summary = (out / "summary.txt").read_text()
    assert "no CUDA device: nothing ran on a GPU" in summary and "exit status 2" in summary
