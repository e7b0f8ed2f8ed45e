"""``FastModelTick``: the fast twin's model step of one engine tick, eager or CUDA-graphed.

What runs from the moment the engine hands a cohort to the model until the next
tick's inputs are ready. Nothing in it synchronises with the host or copies from
pageable memory (``oasr.fast.capture_check`` checks it on the CPU)::

    host (engine)                                           device
    pending features --row copies--> pinned inputs --non_blocking--> static batch[w]  (xs, offsets, lens)
                                                                          |
    slot states (tails, conv caches) --index_select(out=)-------------> static batch[w]  (gather)
                                                                          |
                                  model.paged_chunk_core (eager)  or  GraphRunner.replay(w)
                                                                          |
    slot states <--------------------------index_copy_ (scatter)------- outputs[w]
    decode <-- event.synchronize() <-- pinned log-probs <--one non_blocking copy-- outputs[w]
    rescore <------------------------- pinned hidden <----one non_blocking copy-- outputs[w]  (hidden=True)

* **Static batches.** Each cohort width ``w`` has its own device buffers for the
  inputs and the gathered slot states, allocated once. A captured graph reads
  only those, the pool, and the attention manager's per-width table buffers, so
  each replay reads its own rows: the gather before and the scatter after are
  ordinary device ops outside the graph.
* **Pinned launch plan.** The views handed to the model carry ``max_span`` and
  ``max_seqlen`` set to the worst case the config allows
  (``blocks_per_stream * block_size_frames``), so the attention's split count and
  grid are a function of the width alone, the same eager and graphed (which is
  what makes the two bit-identical). The grid then covers the worst case; splits
  past a row's keys exit at once.
* **Outputs.** The step returns what the decode strategy consumes: one opaque
  ``(w, chunk, C)`` tensor (``tick_io``: the shipped Conformer's CTC log-probs, an
  encoder-only model's hidden frames), and with ``hidden=True`` the shipped model's
  encoder hidden states (the CTC head's input), which attention rescoring keeps. Graphed,
  they land in the width's captured outputs (static per width); eager, in fresh
  tensors. Either way nothing hooks into the model: a graph replay runs no Python.
* **Readback.** The outputs come back through one ``non_blocking`` copy each into
  pinned host buffers and one event; ``log_probs(width)`` / ``hidden(width)`` wait
  on the event when the host needs them (the decoder, rescoring), not before.

Graphs (``graphs=True``) are captured at construction for every width, with
the padding lane as every row (lengths 0), so capture advances no stream. The
padding lane is also what pads a live cohort up to its width.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

logger = logging.getLogger("oasr.engine")


@dataclasses.dataclass
class _StaticBatch:
    """Device buffers of one width: the step reads only these (and the pool / table buffers)."""

    xs: torch.Tensor  # (w, T_in, input_dim)
    meta: torch.Tensor  # (w, 2) int64: offset, input length
    tails: list  # gathered subsampling tails, streaming_state_specs order
    cnn: torch.Tensor  # (num_layers, w, kernel_size - 1, hidden_dim)


def tick_io(model) -> tuple[int, int, int, int]:
    """``(input frames, input dim, output frames, output dim)`` of the model's chunk step: the static buffers'
    shapes. A model declares ``tick_io`` (e.g. ``oasr.models.nemotron.NemotronEncoder``: feature frames in,
    hidden frames out); the shipped Conformer's come from its config (features in, CTC log-probs out)."""
    declared = getattr(model, "tick_io", None)
    if declared is not None:
        return tuple(int(x) for x in declared)
    mc = model.config
    return mc.chunk_input_frames, mc.input_dim, mc.chunk_input_frames // mc.subsampling_rate, mc.vocab_size


def pinned_span(config) -> int:
    """The ``max_span`` / ``max_seqlen`` a step's views carry (launch parameters fixed per width): with the window
    prefilled every row's span is the window itself (and the relative-position table is sized for it), otherwise
    the worst case the config allows."""
    if config.prefill_kv_window or config.history_frames == 0:  # every row's span is the window (0: none)
        return config.history_frames
    return config.blocks_per_stream * config.block_size_frames


# Widths per octave of an eager CPU engine's cohorts (``engine_widths(per_octave=)``): no graph to capture per
# width, and a padded row costs as much as a stream's (every GEMM runs over it), so a finer ladder pads less.
CPU_WIDTHS_PER_OCTAVE = 4


def engine_widths(max_batch_size: int, per_octave: int = 1) -> list[int]:
    """The cohort widths an engine can run, ascending, ending at ``max_batch_size``.

    ``per_octave=1``: powers of two below ``max_batch_size``, then ``max_batch_size`` (the few shapes a CUDA
    graph capture needs). ``per_octave=k`` (a power of two): every width up to ``2k``, then ``k`` evenly spaced
    widths per octave (k=4: 1..8, 10, 12, 14, 16, 20, ..., 28, 32, 40, ...), so a cohort is padded by at
    most a ``1/k`` of its octave (an eager CPU engine's: ``CPU_WIDTHS_PER_OCTAVE``)."""
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"engine_widths: per_octave must be a power of two >= 1, got {per_octave!r}")
    widths, w = [], 1
    while w < max_batch_size:
        widths.append(w)
        w += max(1, (1 << (w.bit_length() - 1)) // per_octave)  # per_octave=1: doubling
    return widths + [max_batch_size]


class FastModelTick:
    """The model step of a tick on static buffers; see the module docstring.

    ``capture``: the graph capture strategy when ``graphs`` (default ``CudaGraphCapture`` on the
    config's device; a CPU device is refused there). Tests pass a stand-in.
    """

    def __init__(self, model, att, cnn, states, ops, config, graphs: bool = False, capture=None,
                 hidden: bool = False):
        mc = model.config
        self.with_hidden = bool(hidden)
        self.model, self.att, self.cnn, self.states, self.ops = model, att, cnn, states, ops
        self.config = config
        device = torch.device(config.device)
        on_cuda = device.type == "cuda"
        # eager on a CPU: the finer width ladder, each width's static batch allocated at its first use
        self.lazy = not graphs and not on_cuda
        self.widths = engine_widths(config.max_batch_size, CPU_WIDTHS_PER_OCTAVE if self.lazy else 1)
        rows = max(self.widths)
        self.input_frames, input_dim, self.output_frames, output_dim = tick_io(model)
        self.specs = tuple(model.streaming_state_specs)
        self.worst_span = pinned_span(config)
        dtype = config.dtype
        self._host_xs = torch.zeros((rows, self.input_frames, input_dim), dtype=dtype, pin_memory=on_cuda)
        self._host_meta = torch.zeros((rows, 2), dtype=torch.int64, pin_memory=on_cuda)
        self._host_log_probs = torch.zeros((rows, self.output_frames, output_dim), dtype=dtype,
                                           pin_memory=on_cuda)
        self._host_hidden = None
        if self.with_hidden:
            self._host_hidden = torch.zeros((rows, self.output_frames, mc.hidden_dim), dtype=dtype,
                                            pin_memory=on_cuda)
        self._uploaded = torch.cuda.Event() if on_cuda else None
        self._read_back = torch.cuda.Event() if on_cuda else None
        self._input_dim, self._dtype, self._device = input_dim, dtype, device
        self._batches = {}
        self._plans: dict[int, list] = {}  # width -> this tick's pinned views (over the graph's addresses)
        for w in [] if self.lazy else self.widths:
            self._batch(w)
        for w in self.widths:  # build the slot caches' index stagers now, not inside a tick
            self.states.views([], pad_to=w)
            self.cnn.state.view(self.cnn.SPEC_NAME, [], pad_to=w)
        self.runner = None
        self.graph_refusal = None  # why graphs were asked for and every width runs eager (a preflight reason)
        if graphs:
            from oasr.fast.graph_runner import CudaGraphCapture, GraphRunner, capture_or_eager

            capture = capture if capture is not None else CudaGraphCapture(device)
            for w in self.widths:  # every row the padding lane: capture advances no stream
                self._plan(self.att.get_paged_caches([], pad_to=w), w)
            runner = GraphRunner(self._step, self.widths, capture)  # its preflight loads what a width launches
            self.runner, self.graph_refusal = capture_or_eager(runner)

    def _batch(self, w: int) -> _StaticBatch:
        """Width ``w``'s static batch (allocated at its first use; on a CPU no graph holds its address)."""
        batch = self._batches.get(w)
        if batch is None:
            config, dtype, device = self.config, self._dtype, self._device
            batch = self._batches[w] = _StaticBatch(
                xs=torch.zeros((w, self.input_frames, self._input_dim), dtype=dtype, device=device),
                meta=torch.zeros((w, 2), dtype=torch.int64, device=device),
                tails=[torch.zeros(s.batch_shape(w), dtype=s.dtype or dtype, device=device) for s in self.specs],
                cnn=torch.zeros((config.num_layers, w, config.cnn_cache_frames, config.hidden_dim), dtype=dtype,
                                device=device),
            )
        return batch

    @property
    def graphed(self) -> bool:
        """Whether the model step replays CUDA graphs."""
        return self.runner is not None

    @property
    def graph_stats(self):
        """The graphs' ``GraphStats`` (count, capture time, memory), or None when eager."""
        return None if self.runner is None else self.runner.stats

    def pinned_host_tensors(self) -> list[torch.Tensor]:
        """The host buffers that cross to and from the device (pinned on CUDA)."""
        hidden = [self._host_hidden] if self.with_hidden else []
        return [self._host_xs, self._host_meta, self._host_log_probs, *hidden]

    def static_buffers(self, width: int) -> list[torch.Tensor]:
        """Every device tensor a step at ``width`` reads besides the pool and the table buffers."""
        b = self._batch(width)
        return [b.xs, b.meta, *b.tails, b.cnn]

    # ---- host side ----------------------------------------------------------------------------
    def host_inputs(self, width: int):
        """``(features (w, T_in, input_dim), meta (w, 2) int64)``: the pinned rows the engine fills."""
        if self._uploaded is not None and not self._uploaded.query():
            self._uploaded.synchronize()  # the last upload still reads them (never in steady state)
        return self._host_xs[:width], self._host_meta[:width]

    def log_probs(self, width: int) -> torch.Tensor:
        """The last tick's ``(w, T, C)`` output (the shipped model's log-probs; ``tick_io``) as a fresh float32
        CPU tensor (waits for the copy)."""
        if self._read_back is not None:
            self._read_back.synchronize()
        return self._host_log_probs[:width].to(torch.float32, copy=True)

    def hidden(self, width: int) -> torch.Tensor:
        """The last tick's ``(w, T, hidden_dim)`` encoder output as a fresh float32 CPU tensor (waits for the
        copy); only with ``hidden=True``."""
        if not self.with_hidden:
            raise ValueError("FastModelTick.hidden: this tick was built with hidden=False (it returns log-probs only)")
        if self._read_back is not None:
            self._read_back.synchronize()
        return self._host_hidden[:width].to(torch.float32, copy=True)

    # ---- device side --------------------------------------------------------------------------
    def _plan(self, views: list, width: int) -> list:
        """The views with the worst-case maxima: launch parameters fixed per width.

        Rebuilt every tick (the views' host-side fields, such as ``prepared_frames``, follow the
        cohort), over the same per-width table buffers a captured graph reads.
        """
        plan = [dataclasses.replace(v, max_span=self.worst_span, max_seqlen=self.worst_span) for v in views]
        first = self._plans.get(width)
        if first is not None and plan[0].block_table.data_ptr() != first[0].block_table.data_ptr():
            raise RuntimeError(f"FastModelTick: the width-{width} table buffers moved; a captured graph is stale")
        self._plans[width] = plan
        return plan

    def _step(self, width: int):
        """The capture-safe step at ``width``: static batch in, ``(output, chunk_lens, new_cnn, new_tails)``
        and with ``hidden`` the encoder output as a fifth item."""
        b = self._batch(width)
        return self.model.paged_chunk_core(b.xs, b.meta[:, 0], b.meta[:, 1], self._plans[width], b.cnn, b.tails,
                                           self.ops, **({"with_hidden": True} if self.with_hidden else {}))

    def run(self, cohort: list, width: int) -> None:
        """One model step for ``cohort`` padded to ``width`` (host inputs filled); issues the readback."""
        self._plan(self.att.get_paged_caches(cohort, pad_to=width), width)
        b = self._batch(width)
        b.meta.copy_(self._host_meta[:width], non_blocking=True)
        b.xs.copy_(self._host_xs[:width], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        views = self.states.views(cohort, pad_to=width)
        cnn_view = self.cnn.state.view(self.cnn.SPEC_NAME, cohort, pad_to=width)
        for spec, out in zip(self.specs, b.tails, strict=True):
            v = views[spec.name]
            torch.index_select(v.buffer, spec.slot_axis, v.index, out=out)
        torch.index_select(cnn_view.buffer, cnn_view.spec.slot_axis, cnn_view.index, out=b.cnn)
        log_probs, _, new_cnn, new_tails, *hidden = self.runner.run(width) if self.runner else self._step(width)
        for spec, tail in zip(self.specs, new_tails, strict=True):
            views[spec.name].scatter(tail)
        cnn_view.scatter(new_cnn)
        self._host_log_probs[:width].copy_(log_probs, non_blocking=True)
        if hidden:
            self._host_hidden[:width].copy_(hidden[0], non_blocking=True)
        if self._read_back is not None:
            self._read_back.record()
