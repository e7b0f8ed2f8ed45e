"""Pick a twin by name: ``"reference"`` (the oracle) or ``"fast"``.

Model and engine code never import a twin directly; they take a ``twin``
argument (a name or an already imported module) and resolve it here, so one
code path serves both and a test parametrizes over them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TWIN_NAMES = ("reference", "fast")

#: What a twin must export before the model and the engine can run on it.
REQUIRED = (
    "AttentionCacheManager",
    "BlockPool",
    "CnnCacheManager",
    "SlotStateCache",
    "append_kv",
    "paged_attention",
)


def twin_module(twin) -> ModuleType:
    """``oasr.reference`` / ``oasr.fast`` from a name, or ``twin`` itself if it is already a module."""
    if isinstance(twin, ModuleType):
        return twin
    if twin not in TWIN_NAMES:
        raise ValueError(f"twin must be one of {TWIN_NAMES} (or a twin module), got {twin!r}")
    module = importlib.import_module(f"oasr.{twin}")
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"oasr.{twin} does not provide {', '.join(missing)} yet; use twin='reference'")
    return module


def twin_name(twin) -> str:
    """The short name (``"reference"`` / ``"fast"``) of a name or a twin module."""
    if isinstance(twin, ModuleType):
        return twin.__name__.rsplit(".", 1)[-1]
    return str(twin)


def twin_ready(twin: str) -> bool:
    """True when ``oasr.<twin>`` exports everything in ``REQUIRED`` (never raises)."""
    try:
        twin_module(twin)
    except (ImportError, RuntimeError, ValueError):
        return False
    return True


def available_twins() -> list[str]:
    """The twins that can run now, reference first."""
    return [name for name in TWIN_NAMES if twin_ready(name)]
