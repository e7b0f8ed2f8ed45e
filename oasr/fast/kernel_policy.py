"""Kernel policy: when torch serves a fast-twin op instead of a kernel, say so and count it.

A quiet fallback makes a missing kernel invisible, and an invisible gap never gets
closed. Three cases are kept apart:

=================  ===============================================================  ==========================
case               what happens                                                     counted as
=================  ===============================================================  ==========================
out of scope       CPU tensors on the ``torch`` backend: the project targets GPUs;  ``out_of_scope[op]``
                   torch serves and the choice is reported once (INFO, oasr.fast)
gap                in scope (CUDA, or the emulated kernels) but no kernel serves    ``gaps[name]``
                   the call: it must be declared in ``KERNEL_GAPS`` (what is
                   missing, which layer must close it) and then the reference's
                   torch code serves it; undeclared, the call raises
                   ``KernelGapError``
slower             a kernel serves the call but a measured policy routes it to      ``slower[name]``
                   torch: declared in ``KERNEL_SLOWER``, counted apart from gaps
=================  ===============================================================  ==========================

``format_gap_report()`` prints the declared tables with this process's counts;
``python -m oasr kernels --gaps`` prints it. ``reset_counts()`` starts the counts again.
A call served through a gap runs eagerly and reads host values (it is the readable
oracle's code), so a CUDA graph cannot capture it: closing the gap is the fix.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

logger = logging.getLogger("oasr.fast")


class KernelGapError(ValueError):
    """An in-scope call that no kernel serves and no ``KERNEL_GAPS`` entry declares."""


@dataclass(frozen=True)
class KernelGap:
    name: str
    op: str
    missing: str  # what the kernels do not cover
    owner: str  # the layer that has to close it


@dataclass(frozen=True)
class KernelSlower:
    name: str
    op: str
    when: str  # the calls the policy routes to torch
    measured: str  # the measurement behind it


KERNEL_GAPS: dict[str, KernelGap] = {
    gap.name: gap
    for gap in (
        KernelGap(
            "paged-attention-head-dim",
            "paged_attention",
            "attention tiles for head_dim outside (64, 128) or a page dtype outside fp32 / fp16 / bf16 "
            "(model-dtype pages), with or without the relative-position term (rel_bias)",
            "oasr/kernels_cu/paged_chunk_attention*.cu tile shapes and oasr.fast.kernels.registry HEAD_DIMS",
        ),
    )
}

KERNEL_SLOWER: dict[str, KernelSlower] = {}  # none measured in-tree yet

# What the kernels cover of an op's optional terms, printed with the gaps (a call outside it is a gap above).
KERNEL_COVERAGE: dict[str, str] = {
    "paged_attention rel_bias (the relative-position term, oasr.cache.rel_bias)":
        "attention v1 (fp32 / fp16 / bf16, every page format) and v3 (fp16 / bf16 queries, model-dtype and fp8 "
        "pages), head_dim 64 and 128; v2 has none (a rel_bias call with OASR_CUDA_ATTENTION=v2 runs v1); "
        "other head_dims: the paged-attention-head-dim gap",
}

out_of_scope: Counter = Counter()
gaps: Counter = Counter()
slower: Counter = Counter()
_reported: set = set()


def serve_out_of_scope(op: str, device_type: str) -> None:
    """Count a call torch serves because it is out of scope (CPU); report the first of each op once."""
    key = f"{op} on {device_type}"
    out_of_scope[key] += 1
    if key not in _reported:
        _reported.add(key)
        logger.info("oasr.fast: %s is served by torch (out of scope: not a kernel target)", key)


def serve_gap(name: str, op: str, detail: str, capturing: bool = False) -> None:
    """Count a declared gap, or raise ``KernelGapError`` for one nobody declared, or for any gap reached
    while a CUDA graph is being captured (``capturing``): torch's service of a gap reads host values."""
    gap = KERNEL_GAPS.get(name)
    if gap is None or gap.op != op:
        raise KernelGapError(
            f"{op}: no kernel serves {detail}, and this gap ({name!r}) is not declared in "
            f"oasr.fast.kernel_policy.KERNEL_GAPS; declare what is missing and who must close it, or add the kernel"
        )
    if capturing:
        raise KernelGapError(f"{op}: kernel gap {name!r} ({detail}) reached during CUDA graph capture; torch "
                             f"serves a gap eagerly only: run eager (cuda_graphs=False) or close the gap")
    if not gaps[name]:
        logger.warning("oasr.fast: kernel gap %r: torch serves %s (%s)", name, detail, gap.missing)
    gaps[name] += 1


def serve_slower(name: str, op: str) -> None:
    """Count a declared "kernel slower than torch" routing; raise ``KeyError`` for an undeclared one."""
    entry = KERNEL_SLOWER.get(name)
    if entry is None or entry.op != op:
        raise KeyError(f"{op}: routing {name!r} to torch is not declared in KERNEL_SLOWER")
    slower[name] += 1


def reset_counts() -> None:
    """Zero the ``out_of_scope``, ``gaps`` and ``slower`` counters."""
    out_of_scope.clear()
    gaps.clear()
    slower.clear()


def format_gap_report() -> str:
    """The declared gaps and slower routings with this process's counts, and the out-of-scope counts."""
    lines = [f"kernel gaps ({len(KERNEL_GAPS)} declared): in scope, no kernel; torch serves and it is counted"]
    for gap in KERNEL_GAPS.values():
        lines.append(f"  {gap.name}  [{gap.op}]  calls: {gaps[gap.name]}")
        lines.append(f"      missing: {gap.missing}")
        lines.append(f"      closed by: {gap.owner}")
    lines.append(f"kernel slower than torch ({len(KERNEL_SLOWER)} declared): a policy, not a gap")
    for entry in KERNEL_SLOWER.values():
        lines.append(f"  {entry.name}  [{entry.op}]  calls: {slower[entry.name]}  when: {entry.when}  "
                     f"measured: {entry.measured}")
    if not KERNEL_SLOWER:
        lines.append("  (none)")
    lines.append("kernel coverage of optional terms:")
    for term, covered in KERNEL_COVERAGE.items():
        lines.append(f"  {term}: {covered}")
    lines.append("out of scope (torch serves; not debt):")
    for key, count in sorted(out_of_scope.items()):
        lines.append(f"  {key}: {count} calls")
    if not out_of_scope:
        lines.append("  (no call yet in this process)")
    return "\n".join(lines)
