"""``python -m oasr bench --sections launcher``: the attention launcher's host time per call.

What a call of ``oasr.fast.kernels.ops.paged_attention`` costs on the host before the kernel runs:
checks, the int32 views of the table and lengths, the output allocation, the split choice, the
argument tuple and the launch. The first H200 run measured about 55 us per call (event-timed per call
minus kernel-only), which a 12-layer model pays 12 times a tick when it runs eagerly and every capture
pays once; the goal is <= 10 us per launch.

Rows (128 streams, 4 KV heads x GQA 2, head_dim 64, 16-frame blocks, 1,024 frames of history, bf16 and
fp8 pages, v3):

* ``launcher (no-op launch)``: on the CPU (any device argument), the launcher driving a no-op executor
  (``kind = "cuda"``, 132 SMs, launch does nothing): everything the host does except the driver call.
  Measurable anywhere, so a change to the launcher is measured before a GPU is lent. Two rows per page
  kind: ``path cuda_core`` (every call hands its arguments to the executor's ``launch``, as cuda.core's
  path does) and ``path driver`` (the plan's parameters packed once, ``oasr.fast.kernels.packed_params``;
  a call writes its three pointers and calls a no-op in place of cuLaunchKernel).
* ``launcher (cuda)``: on a CUDA device, the real executor (launches included, kernels queued and
  never waited for within the timed loop; one synchronize after), on the executor's launch path
  (``path``: OASR_CUDA_LAUNCH, "cuda_core" unless set to "driver").

Each row: ``us_per_call`` (median of ``repeats`` wall-clock runs of ``calls`` back-to-back calls) and
``best_us_per_call`` (their minimum).
"""

from __future__ import annotations

import statistics
import time

import torch

from oasr.cache.paged import PagedKVCache
from oasr.fast.kernels import ops, registry

STREAMS, KV_HEADS, GROUP, HEAD_DIM, BLOCK, HISTORY, FRAMES = 128, 4, 2, 64, 16, 1024, 1


class NoopExecutor:
    """An executor that launches nothing: the host-side cost of the launcher alone. ``prepared``: it also
    prepares launches (packed parameters, a no-op in place of the driver call), as the CUDA executor's
    "driver" path does."""

    kind = "cuda"
    sm_count = 132

    def __init__(self, prepared: bool = False):
        self.launches = 0
        if not prepared:
            self.prepare = None  # (the launcher then hands every call's arguments to ``launch``)

    def prepare(self, kernel, targs, grid, block, args, per_call):
        """A ``PreparedLaunch`` whose driver call only counts."""
        from oasr.fast.kernels.packed_params import PreparedLaunch

        registry.check_grid(kernel, grid)
        return PreparedLaunch([kind for _, kind in kernel.params], args, per_call, grid, block, self._count)

    def _count(self, grid, block, stream, params_address) -> None:
        self.launches += 1

    def stream_handle(self) -> int:
        """No device, no stream: 0 (the default stream's handle)."""
        return 0

    def resident_ctas(self, kernel, targs, threads) -> int:
        """A fixed occupancy: the no-op path has no device to ask."""
        return 2

    def launch(self, kernel, targs, grid, block, args) -> None:
        """Check the grid as a real launch would, count the launch, run nothing."""
        registry.check_grid(kernel, grid)
        self.launches += 1


def make_view(device, pages: str) -> tuple[PagedKVCache, torch.Tensor]:
    """A 128-stream view (every row HISTORY frames) and its query, in bf16 with bf16 or fp8 pages."""
    blocks_per_row = -(-(HISTORY + FRAMES) // BLOCK)
    num_blocks = STREAMS * blocks_per_row + 1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    scales = {}
    if pages == "fp8":
        k = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
        v = torch.zeros_like(k)
        scales = {"k_scale": torch.ones(shape[:-1], device=device), "v_scale": torch.ones(shape[:-1], device=device)}
    else:
        k = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        v = torch.zeros_like(k)
    table = torch.arange(STREAMS * blocks_per_row, dtype=torch.int32, device=device).view(STREAMS, blocks_per_row)
    cache = PagedKVCache(
        k_cache=k, v_cache=v, block_table=table,
        cache_seqlens=torch.full((STREAMS,), HISTORY, dtype=torch.int32, device=device),
        cache_seqstarts=torch.zeros((STREAMS,), dtype=torch.int32, device=device),
        block_size=BLOCK, max_seqlen=HISTORY, max_span=HISTORY, **scales,
    )  # fmt: skip
    q = torch.zeros((STREAMS, KV_HEADS * GROUP, FRAMES, HEAD_DIM), dtype=torch.bfloat16, device=device)
    return cache, q


def time_calls(fn, calls: int, repeats: int) -> tuple[float, float]:
    """``(median, best)`` over ``repeats`` of the wall-clock us per call of ``calls`` back-to-back calls (the
    best is the one a shared machine disturbed least)."""
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs), min(runs)


def section(quick: bool, device="cpu") -> list[dict]:
    """The launcher rows (see the module docstring)."""
    device = torch.device(device)
    calls, repeats = (200, 5) if quick else (2000, 9)
    rows = []
    for pages in ("bf16", "fp8"):
        cache, q = make_view("cpu", pages)
        for path in ("cuda_core", "driver"):
            noop = NoopExecutor(prepared=path == "driver")
            us, best = time_calls(
                lambda c=cache, q=q, e=noop: ops.paged_attention(e, q, c, None, 0.125, False, version="v3"), calls,
                repeats)
            rows.append({"section": "launcher",
                         "case": f"launcher (no-op launch), path {path}, {pages} pages, v3, {STREAMS} streams",
                         "path": path, "us_per_call": us, "best_us_per_call": best,
                         "launches_per_call": noop.launches / (calls * repeats + 1)})  # fmt: skip
        if device.type == "cuda":
            from oasr.fast.kernels.nvrtc import executor_for

            cache, q = make_view(device, pages)
            executor = executor_for(device)

            def call(c=cache, q=q, executor=executor):
                ops.paged_attention(executor, q, c, None, 0.125, False, version="v3")

            us, best = time_calls(call, calls, repeats)
            torch.cuda.synchronize(device)
            rows.append({"section": "launcher",
                         "case": f"launcher (cuda), path {executor.launch_path}, {pages} pages, v3, {STREAMS} streams",
                         "path": executor.launch_path, "us_per_call": us, "best_us_per_call": best})
    return rows
