"""``Stager``: the one way host bookkeeping reaches the device in the fast twin.

The fast managers keep their bookkeeping in numpy on the host and mirror the
part a kernel reads into persistent device tensors. Nothing is ever written
into a device tensor through a Python scalar and an index (that lowers to a
pageable 4-byte host-to-device copy, which waits for all queued work). Instead
each bookkeeping call writes what it must send into one host buffer and moves
it with one copy::

    numpy arrays ──written into fixed sections──> host[k]   (pinned on CUDA)
    host[k] ──one copy_(non_blocking=True)──> device        (this stager's own)
    device ──typed views [:count], one per section──> index_copy_ / gather / ...

A stager has a fixed layout, declared at construction: sections of
``(capacity, dtype)``, 8-byte aligned, in order. A call fills the first
``count`` entries of each section and copies the bytes up to the end of the
last section it uses (gaps included: a few KiB, one transfer).

``host`` is a small ring. On CUDA a pinned buffer must not be rewritten before
the copy that reads it has run, so each ring entry records an event after its
copy (on the current stream of the stager's device, where the copy and the ops
that read the device views are queued) and ``stage`` waits on it only when the
entry comes round again and the event has not completed (a whole ring behind). On the CPU the copy is synchronous
and the ring has one entry.

A stager allocates at construction only (its typed views are cut at the first
``stage``); ``stage`` returns views. Each manager owns separate stagers for data
it keeps on the device across calls (a prepared cohort's slots) and for data
consumed at once, so one never overwrites the other.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPE = {torch.int32: np.int32, torch.int64: np.int64}
_ITEMSIZE = {torch.int32: 4, torch.int64: 8}


def _aligned(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


class Stager:
    def __init__(self, sections, device, ring: int = 4):
        """``sections``: ``(capacity, torch dtype)`` per section (int32 or int64)."""
        device = torch.device(device)
        self.device = device
        self.capacity = [int(n) for n, _ in sections]
        offsets, offset = [], 0
        for n, dtype in sections:
            offsets.append(offset)
            offset = _aligned(offset + int(n) * _ITEMSIZE[dtype])
        self._ends = [o + n * _ITEMSIZE[dt] for o, (n, dt) in zip(offsets, sections, strict=True)]
        self.nbytes = max(offset, 8)
        on_cuda = device.type == "cuda"
        entries = ring if on_cuda else 1
        self._host = [torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(entries)]
        self._device = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._offsets, self._sections = offsets, list(sections)
        self._host_views = self._device_views = None  # the typed section views, cut at the first ``stage``
        self._events = [torch.cuda.Event() for _ in range(entries)] if on_cuda else None
        self._recorded = [False] * entries
        self._next = 0
        self.copies = 0  # staged copies issued so far (tests count them)

    def stage(self, *arrays) -> list[torch.Tensor]:
        """Move one numpy array per section to the device in one copy.

        Returns one 1-D device view per section, ``count`` entries long, of the
        section's dtype. They stay valid until this stager's next ``stage``
        (stream-ordered on CUDA).
        """
        if self._device_views is None:
            self._cut_views()
        k = self._next
        self._next = (k + 1) % len(self._host)
        if self._events is not None and self._recorded[k] and not self._events[k].query():
            self._events[k].synchronize()  # the device is a whole ring behind: wait for that copy
        end = 0
        counts = []
        for i, (values, host) in enumerate(zip(arrays, self._host_views[k], strict=True)):
            count = values.size
            if count > self.capacity[i]:
                raise RuntimeError(
                    f"Stager: {count} entries for section {i} of capacity {self.capacity[i]} (a sizing bug)"
                )
            if count:
                host[:count] = values.reshape(-1)
                end = self._ends[i]
            counts.append(count)
        if end:
            self._device[:end].copy_(self._host[k][:end], non_blocking=True)
            self.copies += 1
            if self._events is not None:
                self._events[k].record(torch.cuda.current_stream(self.device))
                self._recorded[k] = True
        return [view[:count] for view, count in zip(self._device_views, counts, strict=True)]

    def _cut_views(self) -> None:
        """The typed views of every section over the buffers (not at construction: a manager that never
        stages, such as a CPU decoder manager reading its host mirror, should not pay for them)."""
        spans = [(o, n * _ITEMSIZE[dt], dt) for o, (n, dt) in zip(self._offsets, self._sections, strict=True)]
        self._host_views = [[h.numpy()[o : o + size].view(_NUMPY_DTYPE[dt]) for o, size, dt in spans]
                            for h in self._host]
        self._device_views = [self._device[o : o + size].view(dt) for o, size, dt in spans]

    def storages(self) -> list[int]:
        """Data pointers of the host ring (tests: these are only ever read by torch)."""
        return [h.untyped_storage().data_ptr() for h in self._host]
