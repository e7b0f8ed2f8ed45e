"""The server's state directory: session files written whole or not at all, off the engine thread.

``write_atomic(path, data)``: a temporary file, fsync, rename over ``path``, fsync of the folder. A
crash at any point leaves the previous file or the new one, never a part of one.

``SessionWriter``: one daemon thread that writes and deletes session files in the order they were
asked for, so the engine thread hands a checkpoint over and goes on with its tick instead of
waiting on the disk (an fsync took 20-35 ms on the development machine; a session's bytes take
2-10 ms to make). A write that a later write or delete of the same file supersedes before it
starts is skipped (only the newest state matters). ``flush`` waits until everything asked so far
is done; ``close`` flushes and stops the thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from pathlib import Path

logger = logging.getLogger("oasr.serve")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary file, fsync, rename, fsync of the folder.

    On an error the temporary file is removed, the previous file is untouched and the error propagates.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return  # a folder that cannot be opened (some platforms): the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class SessionWriter:
    """Writes (``write_atomic``) and deletes session files on its own thread, in the order asked.

    ``stats``: ``written`` files, their ``bytes``, ``write_seconds`` spent, ``superseded`` writes
    skipped, ``failed`` writes (logged; the previous file stays).
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._latest: dict = {}  # path -> sequence number of the newest operation asked for it
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.stats = {"written": 0, "bytes": 0, "write_seconds": 0.0, "superseded": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="oasr-sessions", daemon=True)
        self._thread.start()

    def write(self, path: Path, data: bytes) -> None:
        """Write ``data`` to ``path`` (atomically) after the operations already asked."""
        self._ask("write", Path(path), data)

    def delete(self, path: Path) -> None:
        """Delete ``path`` (if it exists) after the operations already asked."""
        self._ask("delete", Path(path), None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every operation asked so far is done; False if ``timeout`` passed first."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(("flush", None, done, None))
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the thread (waits at most ``timeout`` for each)."""
        if self._thread.is_alive():
            self._queue.put(("stop", None, None, None))
            self._thread.join(timeout)

    def _ask(self, kind: str, path: Path, data) -> None:
        with self._lock:
            seq = next(self._seq)
            self._latest[path] = seq
        self._queue.put((kind, path, data, seq))

    def _run(self) -> None:
        while True:
            kind, path, data, seq = self._queue.get()
            if kind == "stop":
                return
            if kind == "flush":
                data.set()
                continue
            with self._lock:
                newest = self._latest.get(path) == seq
                if newest:
                    del self._latest[path]
            try:
                if kind == "delete":
                    path.unlink(missing_ok=True)
                elif not newest:
                    self.stats["superseded"] += 1
                else:
                    t0 = time.perf_counter()
                    write_atomic(path, data)
                    self.stats["write_seconds"] += time.perf_counter() - t0
                    self.stats["written"] += 1
                    self.stats["bytes"] += len(data)
            except Exception:
                if kind == "write":
                    self.stats["failed"] += 1
                logger.exception("session file %s: %s failed", path, kind)
