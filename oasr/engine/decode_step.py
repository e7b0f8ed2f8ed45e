"""``FastDecodeStep``: one attention-decoder step over paged K/V, eager or CUDA-graphed per width.

The decoder's counterpart of ``oasr.engine.tick.FastModelTick``: what runs for
one generated token of ``B`` rows of a fast ``DecoderKVCacheManager``. Nothing
in the device half synchronises with the host or copies from pageable memory
(``oasr.fast.capture_check`` checks it on the CPU)::

    host                                                      device
    manager.prepare_step(rows)   (a page per row crossing a boundary; copy-on-write copies: device ops)
    tokens, positions, cross query lens --> pinned meta --non_blocking--> static meta[w]  (3, w) int64
    manager.self_caches(rows, pad_to=w) / cross_caches(rows, pad_to=w)   per-width table buffers
                                                                |
                          AttentionDecoder.step_at (eager)  or  GraphRunner.replay(w)
                            per layer: append_kv, paged_attention (self), paged_attention (cross)
                                                                |
    manager.commit_step(rows)                               logits[w]  (w, vocab)

* **Widths.** A step of ``B`` rows runs at the smallest width ``w >= B`` of
  ``engine_widths(max_rows)`` (powers of two, and ``max_rows``). Each width has
  its own static meta buffer, and the manager's per-width table buffers
  (``pad_to=w``) hold the rows' tables: the gather into them is an ordinary
  device op before the step, so a graph replays over fixed addresses.
* **The padding lane.** Rows ``B .. w - 1`` are padding: their self table maps
  only the pool's scratch block at length 0, so their token is written there and
  attends to itself; their cross read presents no query. Their logits are
  computed and ignored; they never touch a real row's pages.
* **Pinned launch plan.** The views carry ``max_seqlen`` and ``max_span`` at the
  config's ceilings (``max_self_tokens``, ``max_cross_tokens``): launch
  parameters are a function of the width alone, the same eager and graphed,
  which is what makes the two bit-identical.
* **fp8 pages** (``kv_cache_dtype="fp8_e4m3"``): ``append_kv`` quantizes and
  ``paged_attention`` dequantizes inside the launches, so they are captured too.

Graphs (``graphs=True``) are captured at construction for every width with
every row on the padding lane, so capture advances no row and takes no page.
Storage: the manager's rows are paged by construction; a decoder config with
``kv_storage="auto"`` resolves to paged only when ``graph_captured=True``
(``DecoderCacheConfig.storage``), so ``graphs=True`` refuses a config that says
its steps are eager.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import oasr.fast as fast_twin
from oasr.engine.tick import engine_widths


class _StepGroup:
    """The five verbs ``AttentionDecoder.step_at`` calls, over one width's planned views: every launch
    reads the same tensors on every call (the padded views and the static meta)."""

    def __init__(self, step: FastDecodeStep, width: int):
        self.step, self.width = step, width

    def write(self, layer: int, k, v) -> None:
        fast_twin.append_kv(self.step._self_plan[self.width][layer], k, v)

    def attend_self(self, layer: int, q):
        return fast_twin.paged_attention(q, self.step._self_plan[self.width][layer], causal=True)

    def attend_cross(self, layer: int, q):
        """q (B, nH, T, D): the T queries ride as extra heads (as ``PagedDecoderKV.attend_cross``)."""
        B, nH, T, D = q.shape
        view = self.step._cross_plan[self.width][layer]
        lens = self.step._meta[self.width][2]
        out = fast_twin.paged_attention(q.reshape(B, nH * T, 1, D), view, chunk_lens=lens)
        return out.reshape(B, nH, T, D)


class FastDecodeStep:
    """Decode steps of ``decoder`` over the rows of ``manager`` (a fast ``DecoderKVCacheManager``);
    see the module docstring. ``capture``: the graph capture strategy when ``graphs`` (default
    ``CudaGraphCapture`` on the manager's device; a CPU device is refused there). Tests pass a stand-in.
    """

    def __init__(self, decoder, manager, graphs: bool = False, capture=None):
        cfg = manager.config
        if not isinstance(manager, fast_twin.DecoderKVCacheManager):
            raise ValueError(f"FastDecodeStep: needs the fast twin's DecoderKVCacheManager, got "
                             f"{type(manager).__module__}.{type(manager).__name__}")
        if graphs and cfg.storage != "paged":
            raise ValueError(f"FastDecodeStep: graphs=True captures paged steps, but the config resolves "
                             f"kv_storage={cfg.kv_storage!r} to {cfg.storage!r} (graph_captured={cfg.graph_captured}); "
                             f"build it with graph_captured=True or kv_storage='paged'")
        dc = decoder.config
        if (dc.num_layers, dc.n_kv_head, dc.head_dim) != (cfg.num_layers, cfg.n_kv_head, cfg.head_dim):
            raise ValueError(f"FastDecodeStep: the decoder has (layers, kv heads, head_dim) = "
                             f"{(dc.num_layers, dc.n_kv_head, dc.head_dim)}, the cache "
                             f"{(cfg.num_layers, cfg.n_kv_head, cfg.head_dim)}")
        self.decoder, self.manager, self.config = decoder, manager, cfg
        self.widths = engine_widths(cfg.max_rows)
        device = cfg.device
        on_cuda = device.type == "cuda"
        self._host_meta = torch.zeros((3, max(self.widths)), dtype=torch.int64, pin_memory=on_cuda)
        self._host_meta_np = self._host_meta.numpy()
        self._uploaded = torch.cuda.Event() if on_cuda else None
        self._meta = {w: torch.zeros((3, w), dtype=torch.int64, device=device) for w in self.widths}
        self._self_plan: dict[int, list] = {}
        self._cross_plan: dict[int, list] = {}
        self._groups = {w: _StepGroup(self, w) for w in self.widths}
        for w in self.widths:  # the width buffers exist before any capture, every row on the padding lane
            self._plan([], w)
        self.runner = None
        self.graph_refusal = None  # why graphs were asked for and every width runs eager (a preflight reason)
        if graphs:
            from oasr.fast.graph_runner import CudaGraphCapture, GraphRunner, capture_or_eager

            capture = capture if capture is not None else CudaGraphCapture(device)
            runner = GraphRunner(self._step, self.widths, capture)  # its preflight loads what a width launches
            self.runner, self.graph_refusal = capture_or_eager(runner)

    @property
    def graphed(self) -> bool:
        """Whether the steps replay CUDA graphs."""
        return self.runner is not None

    def pinned_host_tensors(self) -> list[torch.Tensor]:
        """The host buffer that crosses to the device (pinned on CUDA)."""
        return [self._host_meta]

    def static_buffers(self, width: int) -> list[torch.Tensor]:
        """Every tensor a step at ``width`` reads besides the pool and the model: the meta and the
        manager's table buffers of that width."""
        self_view, cross_view = self._self_plan[width][0], self._cross_plan[width][0]
        return [self._meta[width], self_view.block_table, self_view.cache_seqlens, cross_view.block_table,
                cross_view.cache_seqlens]

    def width_for(self, rows: int) -> int:
        """The width a step of ``rows`` rows runs at (``ValueError`` past ``max_rows``)."""
        for w in self.widths:
            if w >= rows:
                return w
        raise ValueError(f"FastDecodeStep: {rows} rows exceed max_rows={self.config.max_rows}")

    # ---- device side --------------------------------------------------------------------------
    def _plan(self, rows: list, width: int) -> None:
        """The rows' views padded to ``width``, with the launch maxima pinned at the config's ceilings."""
        cfg = self.config
        self_views = self.manager.self_caches(rows, pad_to=width)
        cross_views = self.manager.cross_caches(rows, pad_to=width)
        span, cross = cfg.max_self_tokens, cfg.max_cross_tokens
        self_plan = [dataclasses.replace(v, max_seqlen=span, max_span=span) for v in self_views]
        cross_plan = [dataclasses.replace(v, max_seqlen=max(cross - 1, 0), max_span=cross) for v in cross_views]
        first = self._self_plan.get(width)
        if first is not None and (first[0].block_table.data_ptr() != self_plan[0].block_table.data_ptr()
                                  or self._cross_plan[width][0].block_table.data_ptr()
                                  != cross_plan[0].block_table.data_ptr()):
            raise RuntimeError(f"FastDecodeStep: the width-{width} table buffers moved; a captured graph is stale")
        self._self_plan[width], self._cross_plan[width] = self_plan, cross_plan

    @torch.no_grad()
    def _step(self, width: int) -> torch.Tensor:
        """The capture-safe step at ``width``: static meta and planned views in, logits ``(w, vocab)`` out."""
        meta = self._meta[width]
        return self.decoder.step_at(self._groups[width], meta[0], meta[1])

    # ---- one step -----------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, rows, tokens) -> torch.Tensor:
        """One token for each of ``rows`` (``tokens``: one int per row, host values); returns the logits
        ``(len(rows), vocab)``, valid until the next step at the same width. The manager's rows are
        each one token longer afterwards (``prepare_step`` before, ``commit_step`` after)."""
        rows = list(rows)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size != len(rows):
            raise ValueError(f"FastDecodeStep.run: {tokens.size} tokens for {len(rows)} rows")
        if not rows:
            raise ValueError("FastDecodeStep.run: no rows to step")
        width = self.width_for(len(rows))
        manager, B = self.manager, len(rows)
        positions = [manager.length(r) for r in rows]  # checks the rows (KeyError) before anything changes
        manager.prepare_step(rows)
        self._plan(rows, width)
        if self._uploaded is not None and not self._uploaded.query():
            self._uploaded.synchronize()  # the last upload still reads the pinned meta (never in steady state)
        host = self._host_meta_np
        host[:, :width] = 0
        host[0, :B] = tokens
        host[1, :B] = positions
        host[2, :B] = manager.cross_query_lens(rows)
        self._meta[width].copy_(self._host_meta[:, :width], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        logits = self.runner.run(width) if self.runner is not None else self._step(width)
        manager.commit_step(rows)
        return logits[:B]
