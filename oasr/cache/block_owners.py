"""Owner tags of pool blocks: the names behind them and the errors that name them (both BlockPool twins).

A manager registers once with ``BlockPool.new_owner(name)`` and gets a small
int tag (1, 2, ... in registration order; ``NO_OWNER`` = 0 is "no owner");
each twin keeps one tag per block (a list in the reference, a numpy array in
the fast twin) and asks this registry for names and messages, so both fail
with the same words. One owner per held block; a block shared by several
rows of that owner carries a reference count in the pool (``share`` / ``free``).
"""

from __future__ import annotations

import threading

NO_OWNER = 0  # the owner tag of free blocks and of blocks from a plain allocate(n)


class OwnerRegistry:
    def __init__(self):
        self._names = {NO_OWNER: "no owner"}
        self._lock = threading.Lock()

    def register(self, name: str) -> int:
        """A new tag; its name in errors is ``"<name>#<tag>"``."""
        with self._lock:
            tag = len(self._names)
            self._names[tag] = f"{name}#{tag}"
            return tag

    def name(self, tag: int) -> str | None:
        """The owner's name; None for ``NO_OWNER``."""
        return None if tag == NO_OWNER else self._names[int(tag)]

    def check(self, op: str, owner) -> int:
        """``owner`` as an int tag, or ``ValueError`` unless it is ``NO_OWNER`` or a registered tag."""
        if isinstance(owner, bool) or not hasattr(owner, "__index__") or int(owner) not in self._names:
            raise ValueError(f"BlockPool.{op}: owner must be 0 or a tag from new_owner(), got {owner!r}")
        return int(owner)

    def wrong_owner(self, block: int, held_by: int, owner: int) -> ValueError:
        """The error for freeing ``block``, held under ``held_by``, as ``owner``."""
        if held_by != NO_OWNER:
            return ValueError(
                f"BlockPool.free: block {block} is owned by {self._names[held_by]}; only its owner may "
                f"free it (free or reset the stream through that manager)"
            )
        return ValueError(
            f"BlockPool.free: block {block} has no owner; {self._names[owner]} may free only its own blocks"
        )
