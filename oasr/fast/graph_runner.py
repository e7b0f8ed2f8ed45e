"""``GraphRunner``: one CUDA graph per cohort width, replayed instead of launching a forward op by op.

In the manner of vLLM's CUDA-graph runner (and of a graphed streaming
encoder forward): a *step* is a function of the width only. It reads static input
buffers that the caller fills before each replay, and returns output tensors.
The runner captures ``step(width)`` once per width, all graphs in one shared
memory pool, largest width first (a smaller graph's allocations then fit in
what the larger one already reserved), and afterwards replays::

    caller: fill the static inputs of width w  (copies into fixed addresses)
    runner: replay(w)  -> the outputs captured at width w (the same tensors every time)
    caller: read / scatter the outputs before the next replay at width w

Contract
--------
* A replay's outputs stay valid until the next replay **at that width**; a replay
  at another width leaves them alone (each width has its own graph and outputs,
  and the pool never hands a live graph's outputs to another).
* ``step`` must be capture-safe: no host sync, no shape from values, no
  host-to-device copy from pageable memory, and every tensor it reads that
  outlives a call at a fixed address (``CaptureSafetyChecker`` checks the first
  three on the CPU; the stand-in capture of the tests checks the last).
* Kernels are compiled and loaded before capture: pass ``prepare`` (e.g.
  ``lambda: paged_ops.load_kernels(device)``), run once before the first capture.
* Capture on a CPU device is refused with a ``ValueError``: there is nothing to
  capture; the caller runs its eager path and says so.

The capture mechanism is a strategy (``CudaGraphCapture`` on a GPU), so the
runner's bookkeeping -- which widths, which outputs, what is reported -- is
tested on the CPU with a stand-in (tests/test_graph_runner.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GraphStats:
    """What capture cost: graphs, seconds, and the memory their shared pool reserved."""

    widths: tuple
    capture_seconds: float
    memory_bytes: int

    @property
    def num_graphs(self) -> int:
        """Graphs captured (one per width)."""
        return len(self.widths)

    def format(self) -> str:
        """One line: graph count and widths, capture seconds and graph memory."""
        return (f"{self.num_graphs} CUDA graphs (widths {list(self.widths)}), captured in "
                f"{self.capture_seconds:.2f} s, {self.memory_bytes / 2**20:.1f} MiB of graph memory")


class CudaGraphCapture:
    """Real capture: warm up on a side stream, record with ``torch.cuda.graph`` into one shared pool."""

    def __init__(self, device):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; run the eager path on the CPU")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._reserved_before = None

    def begin(self) -> None:
        """Before the first capture: synchronise and note the reserved memory."""
        torch.cuda.synchronize(self.device)
        self._reserved_before = torch.cuda.memory_reserved(self.device)

    def capture(self, fn: Callable, warmup: int):
        """Warm ``fn`` up ``warmup`` times on a side stream, capture it in the shared pool: ``(graph, outputs)``."""
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        return graph, outputs

    def replay(self, handle) -> None:
        """Replay a captured graph on the current stream."""
        handle.replay()

    def end(self) -> int:
        """After the last capture: the bytes the graphs reserved."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device) - self._reserved_before


class GraphRunner:
    """Capture ``step(width)`` for each width once (``capture_all``), then ``replay(width)``.

    ``step(width)`` returns a tensor or a tuple/list of tensors (nested lists allowed);
    ``replay`` returns that same structure of the *captured* tensors.
    """

    def __init__(self, step: Callable[[int], object], widths: Sequence[int], capture,
                 prepare: Callable[[], None] | None = None, warmup: int = 2):
        widths = sorted({int(w) for w in widths}, reverse=True)
        if not widths or widths[-1] < 1:
            raise ValueError(f"GraphRunner: widths must be positive ints, got {widths}")
        self.step = step
        self.widths = tuple(widths)  # capture order: largest first
        self.capture_strategy = capture
        self.prepare = prepare
        self.warmup = warmup
        self._graphs: dict[int, tuple] = {}
        self.stats: GraphStats | None = None

    @property
    def captured(self) -> bool:
        """Whether the graphs have been captured."""
        return self.stats is not None

    def capture_all(self) -> GraphStats:
        """Capture every width (once); returns and keeps the ``GraphStats``."""
        if self.stats is not None:
            return self.stats
        if self.prepare is not None:
            self.prepare()
        start = time.perf_counter()
        self.capture_strategy.begin()
        for width in self.widths:
            self._graphs[width] = self.capture_strategy.capture(lambda w=width: self.step(w), self.warmup)
        memory = self.capture_strategy.end()
        self.stats = GraphStats(self.widths, time.perf_counter() - start, int(memory))
        return self.stats

    def outputs(self, width: int):
        """The tensors a replay at ``width`` writes (the captured outputs)."""
        return self._graph(width)[1]

    def _graph(self, width: int):
        if width not in self._graphs:
            raise KeyError(f"GraphRunner: no graph for width {width}; captured widths {sorted(self._graphs)}")
        return self._graphs[width]

    def replay(self, width: int):
        """Replay the width's graph; its outputs are valid until the next replay at this width."""
        handle, outputs = self._graph(width)
        self.capture_strategy.replay(handle)
        return outputs
