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
* Kernels are compiled and loaded before capture: the preflight runs each width's
  step eagerly first, which loads every kernel instantiation it launches (and
  only those); ``prepare``, when given, runs once before the first capture.
* Capture on a CPU device is refused with a ``ValueError``: there is nothing to
  capture; the caller runs its eager path and says so.
* **Preflight.** Before a width is captured, its step runs once eagerly while the
  kernel policy counts gaps (``oasr.fast.kernel_policy``): a width whose step
  reaches a declared kernel gap (torch serves it, reading host values, which no
  graph can hold) is not captured; it runs eagerly (``run(width)``), its reason is
  kept in ``eager_widths`` and logged once. Nothing raises inside a capture for a
  gap: the decision is made before capturing.
* **A failed capture is discarded.** An exception inside a capture (or an invalidated
  capture) ends the stream capture, resets every graph this runner captured,
  releases their pool and restores the current stream (``CudaGraphCapture.abort``)
  before the exception propagates: the process can capture again.
* ``GraphStats.memory_bytes`` is what the graphs' private pool holds (its segments in
  the allocator's snapshot), never a difference of process totals, which other frees
  can make negative.

The capture mechanism is a strategy (``CudaGraphCapture`` on a GPU), so the
runner's bookkeeping -- which widths, which outputs, what is reported -- is
tested on the CPU with a stand-in (tests/test_graph_runner.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from oasr.fast import kernel_policy

logger = logging.getLogger("oasr.fast")


@dataclass(frozen=True)
class GraphStats:
    """What capture cost: graphs, seconds, and the memory their private pool holds.

    ``widths`` are the captured widths; ``eager`` maps each width left eager to its reason (preflight).
    """

    widths: tuple
    capture_seconds: float
    memory_bytes: int
    eager: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.memory_bytes < 0:
            raise ValueError(f"GraphStats: memory_bytes is what a pool holds, never negative; got {self.memory_bytes}")

    @property
    def num_graphs(self) -> int:
        """Graphs captured (one per width)."""
        return len(self.widths)

    def format(self) -> str:
        """One line: graph count and widths, capture seconds and graph memory (and any eager widths)."""
        line = (f"{self.num_graphs} CUDA graphs (widths {list(self.widths)}), captured in "
                f"{self.capture_seconds:.2f} s, {self.memory_bytes / 2**20:.1f} MiB of graph memory")
        if self.eager:
            line += f"; eager at widths {sorted(self.eager)}: {next(iter(self.eager.values()))}"
        return line


def pool_bytes(device, pool) -> int:
    """Bytes the caching allocator's segments of private pool ``pool`` hold on ``device`` (its snapshot).

    Counted from the pool's own segments, so a free elsewhere in the process cannot make it negative.
    """
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    try:
        segments = torch.cuda.memory_snapshot(mempool_id=pool)
    except TypeError:  # a torch without the per-pool snapshot: the whole one, filtered below
        segments = torch.cuda.memory_snapshot()
    total = 0
    for seg in segments:
        if tuple(seg.get("segment_pool_id", ())) == tuple(pool) and seg.get("device", index) == index:
            total += int(seg["total_size"])
    return total


def _quietly(fn, *args) -> None:
    """Run one cleanup step; a step that does not apply (already ended, nothing to release) may raise."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 -- cleanup after a failed capture: keep going, say what failed
        logger.debug("oasr.fast: capture cleanup step %s: %s", getattr(fn, "__name__", fn), exc)


def _end_stream_capture(stream) -> None:
    """End a stream capture a failed ``capture_end`` left open (cuda-python's runtime binding)."""
    from cuda.bindings import runtime as cudart

    err, graph = cudart.cudaStreamEndCapture(stream.cuda_stream)
    if graph:
        cudart.cudaGraphDestroy(graph)


def _clear_last_error() -> None:
    from cuda.bindings import runtime as cudart

    cudart.cudaGetLastError()


class CudaGraphCapture:
    """Real capture: warm up on a side stream, record with ``CUDAGraph.capture_begin/end`` into one private pool.

    ``abort(handles)`` undoes a failed ``capture_all``: ends a capture left open, resets the graphs,
    releases the pool and starts a fresh one, so the next capture in the process starts clean.
    """

    def __init__(self, device):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; run the eager path on the CPU")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.pool = torch.cuda.graph_pool_handle()

    def begin(self) -> None:
        """Before the first capture: synchronise (the warm-ups and the captures start from a quiet device)."""
        torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable, warmup: int):
        """Warm ``fn`` up ``warmup`` times on a side stream, capture it in the pool: ``(graph, outputs)``.

        An exception inside the capture (or from ending it) ends and discards this graph before it
        propagates, and the current stream is the caller's again.
        """
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            try:
                outputs = fn()
            except BaseException:
                self._discard(graph, side)
                raise
            try:
                graph.capture_end()
            except BaseException:
                self._discard(graph, side)
                raise
        current.wait_stream(side)
        return graph, outputs

    def _discard(self, graph, stream) -> None:
        """End the capture on ``stream`` whatever state it is in, and drop ``graph``."""
        _quietly(graph.capture_end)  # ends the capture and the pool's allocation routing when it can
        if torch.cuda.is_current_stream_capturing():  # capture_end failed before ending it
            _quietly(_end_stream_capture, stream)
        _quietly(torch._C._cuda_endAllocateToPool, self.device.index, self.pool)  # no-op if already ended
        _quietly(graph.reset)
        _quietly(_clear_last_error)

    def replay(self, handle) -> None:
        """Replay a captured graph on the current stream."""
        handle.replay()

    def end(self) -> int:
        """After the last capture: the bytes the graphs' private pool holds."""
        torch.cuda.synchronize(self.device)
        return pool_bytes(self.device, self.pool)

    def abort(self, handles) -> None:
        """Discard a failed ``capture_all``: reset its graphs, release their pool, take a fresh pool."""
        for graph in handles:
            _quietly(graph.reset)
        _quietly(torch._C._cuda_releasePool, self.device.index, self.pool)
        _quietly(torch.cuda.synchronize, self.device)
        _quietly(_clear_last_error)
        self.pool = torch.cuda.graph_pool_handle()


class GraphRunner:
    """Capture ``step(width)`` for each width once (``capture_all``), then ``run(width)`` / ``replay(width)``.

    ``step(width)`` returns a tensor or a tuple/list of tensors (nested lists allowed);
    ``replay`` returns that same structure of the *captured* tensors; ``run`` replays a captured
    width and runs ``step`` eagerly at a width the preflight left eager.
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
        self.eager_widths: dict[int, str] = {}
        self.stats: GraphStats | None = None

    @property
    def captured(self) -> bool:
        """Whether ``capture_all`` has run (some widths may have been left eager by the preflight)."""
        return self.stats is not None

    def preflight(self, width: int) -> str | None:
        """Run ``step(width)`` once eagerly and say why it cannot be captured (a kernel gap it reached),
        or None. A gap is served eagerly by torch reading host values: no graph can hold it."""
        before = Counter(kernel_policy.gaps)
        self.step(width)
        reached = sorted((kernel_policy.gaps - before).keys())
        if not reached:
            return None
        return (f"the step reaches kernel gap(s) {reached} (torch serves a gap eagerly only; "
                f"`python -m oasr kernels --gaps`)")

    def capture_all(self) -> GraphStats:
        """Preflight and capture every width (once); returns and keeps the ``GraphStats``.

        A capture that raises leaves nothing behind: the strategy's ``abort`` discards every graph
        of this call and the exception propagates (``captured`` stays False).
        """
        if self.stats is not None:
            return self.stats
        if self.prepare is not None:
            self.prepare()
        start = time.perf_counter()
        eager: dict[int, str] = {}
        self.capture_strategy.begin()
        try:
            for width in self.widths:
                reason = self.preflight(width)
                if reason is not None:
                    eager[width] = reason
                    continue
                self._graphs[width] = self.capture_strategy.capture(lambda w=width: self.step(w), self.warmup)
            memory = self.capture_strategy.end()
        except BaseException:
            handles = [handle for handle, _ in self._graphs.values()]
            self._graphs.clear()
            abort = getattr(self.capture_strategy, "abort", None)
            if abort is not None:
                abort(handles)
            raise
        self.eager_widths = eager
        captured = tuple(w for w in self.widths if w in self._graphs)
        self.stats = GraphStats(captured, time.perf_counter() - start, int(memory), dict(eager))
        if eager:
            logger.warning("oasr.fast: CUDA graphs: widths %s run eager: %s", sorted(eager), next(iter(eager.values())))
        return self.stats

    def has_graph(self, width: int) -> bool:
        """Whether ``width`` replays a captured graph (False before capture or for an eager width)."""
        return width in self._graphs

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

    def run(self, width: int):
        """``replay(width)`` for a captured width, ``step(width)`` eagerly for a width the preflight left eager."""
        if width in self._graphs:
            return self.replay(width)
        if width in self.eager_widths:
            return self.step(width)
        return self._graph(width)  # raises: not a width of this runner


def capture_or_eager(runner: GraphRunner) -> tuple[GraphRunner | None, str | None]:
    """``runner.capture_all()``, then ``(runner, None)`` when some width replays a graph, or ``(None,
    reason)`` when the preflight left every width eager (the owner then runs eager and reports why)."""
    stats = runner.capture_all()
    if stats.num_graphs:
        return runner, None
    return None, next(iter(runner.eager_widths.values()))
