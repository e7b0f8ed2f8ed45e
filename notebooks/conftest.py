"""Notebook kernels inherit this environment: one CPU thread each, as the unit tests run (tests/conftest.py)."""

import os

for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
