"""Which implementation runs the fast twin's paged ops, chosen explicitly and reported once.

    device type   backend      what runs
    -----------   ----------   ------------------------------------------------
    cuda          "cuda"       the kernels in oasr/kernels_cu/, NVRTC-compiled (the only choice)
    cpu           "torch"      vectorised torch (default)
    cpu           "emulated"   the same kernels, g++-built against the SIMT emulator

CPU tensors take the ``backend=`` argument of the fast ops if given, else the
``OASR_CPU_BACKEND`` environment variable (``torch`` or ``emulated``), else
``torch``. Nothing falls back silently: an unknown name, or asking CUDA tensors
for a CPU backend, raises ``ValueError``; a backend that cannot run (no g++, no
CUDA headers, no NVRTC) raises when first used. The first time a device type is
served by a backend, one INFO line goes to the ``oasr.fast`` logger;
``backend_choices()`` says what a call without ``backend=`` would use now and
``backends_used()`` what has run so far; ``choose_backend(device, backend)`` answers
the same question for one device without recording anything (constructors use it
to refuse early what the chosen backend cannot serve).
"""

from __future__ import annotations

import logging
import os

import torch

ENV_VAR = "OASR_CPU_BACKEND"
CPU_BACKENDS = ("torch", "emulated")
DEFAULT_CPU_BACKEND = "torch"

logger = logging.getLogger("oasr.fast")

_DESCRIPTION = {
    "cuda": "CUDA kernels from oasr/kernels_cu/ compiled with NVRTC",
    "torch": "vectorised torch",
    "emulated": "oasr/kernels_cu/ kernels built with g++ against the SIMT emulator (slow; for tests)",
}
_used: dict[str, str] = {}  # device type -> backend that last served it
_reported: set[tuple[str, str]] = set()


def _cpu_default() -> str:
    name = os.environ.get(ENV_VAR, "").strip() or DEFAULT_CPU_BACKEND
    if name not in CPU_BACKENDS:
        raise ValueError(f"{ENV_VAR}={name!r}: expected one of {CPU_BACKENDS}")
    return name


def choose_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend that would serve tensors on ``device``; records and reports nothing."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cuda":
        if backend not in (None, "cuda"):
            raise ValueError(f"backend={backend!r} is for CPU tensors; CUDA tensors always run the CUDA kernels")
        return "cuda"
    if device.type == "cpu":
        if backend is not None and backend not in CPU_BACKENDS:
            raise ValueError(f"backend={backend!r}: CPU tensors take one of {CPU_BACKENDS}")
        return backend or _cpu_default()
    raise ValueError(f"oasr.fast has no backend for {device.type} tensors")


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend that serves tensors on ``device``; reports a new choice once."""
    name = choose_backend(device, backend)
    _used[device.type] = name
    if (device.type, name) not in _reported:
        _reported.add((device.type, name))
        logger.info("oasr.fast: %s tensors use the %r backend (%s)", device.type, name, _DESCRIPTION[name])
    return name


def backend_choices() -> dict[str, str]:
    """What a call without ``backend=`` uses now, per device type (reads OASR_CPU_BACKEND)."""
    return {"cpu": _cpu_default(), "cuda": "cuda"}


def backends_used() -> dict[str, str]:
    """Per device type, the backend that served the most recent call in this process."""
    return dict(_used)
