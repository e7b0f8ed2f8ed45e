"""Argument checks both twins share, so that they fail the same way with the same words."""

from __future__ import annotations


def check_count(owner: str, name: str, value, minimum: int = 0) -> None:
    """``value`` must be an int (not a bool) ``>= minimum``; ``ValueError`` naming ``owner.name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


def as_id_list(stream_ids) -> list:
    """One stream id or a list/tuple of them, as a list."""
    return list(stream_ids) if isinstance(stream_ids, (list, tuple)) else [stream_ids]
