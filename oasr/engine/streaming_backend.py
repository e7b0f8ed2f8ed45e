"""Streaming runtimes, chosen by what the encoder declares: ``encoder.streaming_kind``.

=============  =============================  =========================================================
kind           backend                        what it owns per stream
=============  =============================  =========================================================
``"paged"``    ``PagedStreamingBackend``      K/V that grows: a block pool, per-layer tables (one window,
                                              or a ``LayeredCache`` band per window), conv rows, declared
                                              state (``StreamingEngine`` runs its paged tick on them)
``"slot"``     ``SlotStreamingBackend``       every tensor fixed-extent: one slot in a ``SlotStateCache``;
                                              the step is batched, and captured per width (CUDA graphs)
``"stateful"`` ``StatefulStreamingBackend``   a list of tensors threaded per request; nothing captured.
                                              Serves any encoder with the list API; the slot runtime's oracle
``"none"``     refused                        no chunk-wise path: a streaming engine refuses the model
=============  =============================  =========================================================

A runtime plugs in with ``@register_streaming_backend("kind")`` on a subclass of
``StreamingEncoderBackend``; ``build_streaming_backend(model, ...)`` reads the
declaration and builds it. An unknown kind, or ``"none"``, is a ``ValueError`` that
names the model and the kinds registered.

``StreamingEngine`` builds its runtime the same way, through ``for_engine(model, config,
twin)`` of the declared kind's class, and asks every runtime the same few questions
(the base class gives the fixed-extent answers)::

    pool, att, cnn     the paged caches (None for a fixed-extent runtime)
    states             allocate_stream / free_stream per stream (a slot cache, or the runtime)
    blocks_per_stream  pool blocks a stream may come to hold (0: nothing grows)
    blocks_held(sid)   pool blocks it holds now (blocks_held_by(ids): summed over streams)
    history_frames(sid), at_capacity(sid, frames)
    forward_step(ids, xs, input_lens)      the model step of a fixed-extent runtime
    refusal(model, feature)                why the engine cannot offer ``feature`` with this
                                           runtime (``ENGINE_GAPS``), or None

The slot and stateful runtimes share one surface (``allocate`` / ``free`` /
``forward_step``), and the list API of the encoder
(``get_streaming_init_states(batch)``, ``streaming_forward(xs, input_lens, states)``,
``slot_state_specs`` giving each state's batch axis). One step for ``N`` ready
streams is one forward at batch ``N`` (stateful) or at the width ``w >= N`` the slot
runtime pads to through its padding lane (a row of length 0 whose state is zero and
stays zero)::

    slot:      slot cache --index_select(out=)--> static batch[w] --step(w) or replay(w)--> outputs[w]
               outputs[w] --index_copy_--> slot cache                    (gather / scatter outside the graph)
    stateful:  per-stream lists --cat--> batch N --streaming_forward--> split --> per-stream lists
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from oasr.cache.layer_specs import ATTENTION_SPECS
from oasr.engine.tick import engine_widths
from oasr.models.twins import twin_module

logger = logging.getLogger("oasr.engine")

STREAMING_BACKENDS: dict[str, type] = {}
NONE_KIND = "none"


def register_streaming_backend(kind: str):
    """Class decorator: serve encoders declaring ``streaming_kind == kind`` with this backend."""
    if not isinstance(kind, str) or not kind or kind == NONE_KIND:
        raise ValueError(f"register_streaming_backend: kind must be a non-empty str other than 'none', got {kind!r}")

    def register(cls):
        if kind in STREAMING_BACKENDS:
            raise ValueError(f"register_streaming_backend: {kind!r} is already served by "
                             f"{STREAMING_BACKENDS[kind].__name__}")
        cls.kind = kind
        STREAMING_BACKENDS[kind] = cls
        return cls

    return register


def streaming_kind_of(model) -> str:
    """The model's declared kind (``model.encoder.streaming_kind`` or ``model.streaming_kind``)."""
    encoder = getattr(model, "encoder", model)
    kind = getattr(encoder, "streaming_kind", None)
    if not isinstance(kind, str):
        raise ValueError(f"{type(model).__name__} declares no streaming_kind; one of "
                         f"{sorted(STREAMING_BACKENDS) + [NONE_KIND]} is needed to stream it")
    return kind


def check_streamable(model) -> str:
    """The model's kind if a registered backend serves it; ``ValueError`` for ``"none"`` or an unknown kind."""
    kind = streaming_kind_of(model)
    if kind == NONE_KIND:
        raise ValueError(f"{type(model).__name__} declares streaming_kind='none': it has no chunk-wise path, so it "
                         f"cannot be served by a streaming engine; transcribe it offline (forward_offline)")
    if kind not in STREAMING_BACKENDS:
        raise ValueError(f"{type(model).__name__} declares streaming_kind={kind!r}, which no backend serves; "
                         f"registered: {sorted(STREAMING_BACKENDS)}")
    return kind


def build_streaming_backend(model, *args, **kwargs):
    """The backend of the model's declared kind, built with ``(model, *args, **kwargs)``."""
    return STREAMING_BACKENDS[check_streamable(model)](model, *args, **kwargs)


class StreamingEncoderBackend:
    """Base of the runtimes: per-stream state in, one batched chunk forward, state out.

    ``allocate(stream_id)`` / ``free(stream_id)`` / ``has_stream``; ``forward_step(ids, xs,
    input_lens)`` runs one chunk for the streams ``ids`` (``xs (N, T, input_dim)``, ``T <=
    chunk_input_frames``; ``input_lens`` N ints) and returns ``(log_probs (N, T_out, vocab),
    out_lens list)``. Geometry: ``chunk_input_frames``, ``subsampling_rate``, ``input_dim``.

    What ``StreamingEngine`` asks of a runtime (module docstring) has the fixed-extent answers
    here: no pool, nothing grows, never at capacity. The paged runtime overrides them.
    """

    kind = None
    pool = att = cnn = None  # the paged caches; a fixed-extent runtime has none
    blocks_per_stream = 0  # pool blocks a stream may come to hold (its admission reservation)

    # what the engine cannot offer with this runtime, feature -> reason (see ``refusal``)
    ENGINE_GAPS: dict = {}

    @classmethod
    def for_engine(cls, model, config, twin="fast"):
        """The runtime ``StreamingEngine`` serves ``model`` with, built from the engine's ``CacheConfig``."""
        raise NotImplementedError

    @classmethod
    def refusal(cls, model, feature: str) -> str | None:
        """Why an engine over this runtime cannot offer ``feature`` (``"sessions"``, ``"rescore"``,
        ``"cuda_graphs"``, ``"kv_format"``) for ``model``; None when it can."""
        return cls.ENGINE_GAPS.get(feature)

    def allocate(self, stream_id) -> None:
        """Give ``stream_id`` a fresh state (subclasses raise when it is taken or none is free)."""
        raise NotImplementedError

    def free(self, stream_id) -> None:
        """Release ``stream_id``'s state."""
        raise NotImplementedError

    def has_stream(self, stream_id) -> bool:
        """Whether ``stream_id`` is allocated."""
        raise NotImplementedError

    def forward_step(self, stream_ids, xs: torch.Tensor, input_lens):
        """One chunk for ``stream_ids``; returns ``(log_probs (N, T_out, vocab), out_lens list)``."""
        raise NotImplementedError

    def blocks_held(self, stream_id) -> int:
        """Pool blocks ``stream_id`` holds now (0 for fixed-extent state)."""
        return 0

    def blocks_held_by(self, stream_ids) -> int:
        """``sum(blocks_held(s) for s in stream_ids)`` (a backend may answer it in one read)."""
        return sum(self.blocks_held(sid) for sid in stream_ids)

    def history_frames(self, stream_id) -> int:
        """Frames of K/V history the stream's next chunk reads (its widest layer; 0 without K/V)."""
        return 0

    def at_capacity(self, stream_id, num_frames: int) -> bool:
        """Whether ``num_frames`` more encoder frames would pass the stream's ceiling (never, fixed-extent)."""
        return False

    def _check_step(self, stream_ids, xs: torch.Tensor, input_lens) -> list:
        ids = list(stream_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"forward_step: need distinct stream ids, got {ids}")
        for sid in ids:
            if not self.has_stream(sid):
                raise KeyError(f"unknown stream id {sid!r}")
        T_in = self.chunk_input_frames
        if xs.dim() != 3 or xs.shape[0] != len(ids) or xs.shape[1] > T_in or xs.shape[2] != self.input_dim:
            raise ValueError(f"forward_step: xs must be ({len(ids)}, <= {T_in}, {self.input_dim}), "
                             f"got {tuple(xs.shape)}")
        lens = [int(n) for n in input_lens]
        if len(lens) != len(ids) or any(not 0 <= n <= xs.shape[1] for n in lens):
            raise ValueError(f"forward_step: input_lens must be {len(ids)} ints in [0, {xs.shape[1]}], got {lens}")
        return lens


@register_streaming_backend("paged")
class PagedStreamingBackend(StreamingEncoderBackend):
    """The paged Conformer's caches: a ``BlockPool``, the attention tables, a ``CnnCacheManager`` and the
    declared ``SlotStateCache`` (each with ``pad_lanes`` padding lanes). ``StreamingEngine`` builds this at
    construction and runs its paged tick over them (``pool``, ``att``, ``cnn``, ``states``).

    One window for every layer: ``att`` is the twin's ``AttentionCacheManager`` over ``BlockPool(config)``.
    Per-layer windows (``model.config.layer_windows`` not all alike): ``att`` is the twin's
    ``LayeredCache`` over the model's attention specs (``layered`` is True), one band per window over one
    pool, each evicting by its own window; the engine's tick reads it through the same calls
    (``allocate_stream``, ``prepare_chunks_batched``, ``get_paged_caches``, ``commit_chunks_batched``,
    ``at_capacity``) and asks this backend how many blocks a stream may hold (the sum over the bands'
    ceilings) and how many it holds. ``config`` is the shared geometry (``model.config.cache_config()``
    gives it the widest window, so the fast tick's pinned launch plan covers every band).
    """

    def __init__(self, model, config, twin="fast", pad_lanes: int = 1):
        ops = twin_module(twin)
        self.model, self.config = model, config
        self.chunk_input_frames = model.config.chunk_input_frames
        self.subsampling_rate = model.config.subsampling_rate
        self.input_dim = model.config.input_dim
        self.layered = len(set(getattr(model.config, "layer_windows", ()))) > 1
        if self.layered:
            attention = [spec for spec in model.layer_specs(config) if isinstance(spec, ATTENTION_SPECS)]
            self.att = ops.LayeredCache(config, attention, pad_lanes=pad_lanes)
            self.pool = self.att.pool
            self.blocks_per_stream = sum(self.att.layout.blocks_per_stream())
        else:
            self.pool = ops.BlockPool(config, scratch_blocks=1)
            self.att = ops.AttentionCacheManager(self.pool, config, pad_lanes=pad_lanes)
            self.blocks_per_stream = config.blocks_per_stream
        self.cnn = ops.CnnCacheManager(config, pad_lanes=pad_lanes)
        self.states = ops.SlotStateCache(model.streaming_state_specs, config.max_batch_size, pad_lanes=pad_lanes,
                                         device=config.device, dtype=config.dtype)

    @classmethod
    def for_engine(cls, model, config, twin="fast"):
        """Checks ``config`` against the model's geometry, then builds with one padding lane."""
        model.check_cache_config(config)
        return cls(model, config, twin, pad_lanes=1)

    @classmethod
    def refusal(cls, model, feature: str) -> str | None:
        """Sessions carry one block table per stream: a model with per-layer windows has one per band."""
        if feature == "sessions" and len(set(getattr(model.config, "layer_windows", ()))) > 1:
            return ("its per-layer windows keep one block table per window band (LayeredCache), and a session "
                    "carries one table per stream")
        return super().refusal(model, feature)

    def blocks_held(self, stream_id) -> int:
        """Pool blocks ``stream_id`` holds now, over every band."""
        if self.layered:
            return sum(self.att.blocks_held(stream_id))
        return len(self.att.describe(stream_id).blocks)

    def blocks_held_by(self, stream_ids) -> int:
        """``sum(blocks_held(s) for s in stream_ids)``: one vectorised read where the manager has one (the fast
        twin's ``blocks_held_total``), else a call per stream."""
        total = getattr(self.att, "blocks_held_total", None)
        if total is not None and not self.layered:
            return total(stream_ids)
        return super().blocks_held_by(stream_ids)

    def history_frames(self, stream_id) -> int:
        """Frames of history the stream's next chunk reads: its widest layer's."""
        if self.layered:
            return max(self.att.cached_frames(stream_id))
        return self.att.cached_frames(stream_id)

    def at_capacity(self, stream_id, num_frames: int) -> bool:
        """Whether ``num_frames`` more encoder frames would pass a block ceiling (any band's)."""
        return self.att.at_capacity(stream_id, num_frames)


class _ListStateBackend(StreamingEncoderBackend):
    """The list API's runtimes. In an engine, ``states`` is the runtime itself: admission calls
    ``allocate_stream`` / ``free_stream`` on it as on a paged encoder's slot-state cache."""

    ENGINE_GAPS = {
        "sessions": "its state lives in the runtime's own rows, which the session format does not carry",
        "rescore": "its list API returns log-probs only, and attention rescoring needs the encoder output",
        "kv_format": "it keeps no K/V pages, so a page format (kv_cache_dtype) has nothing to store",
    }

    def __init__(self, model, max_batch_size: int = 8, device="cpu", dtype=torch.float32):
        self.model = model
        self.max_batch_size = int(max_batch_size)
        self.device, self.dtype = torch.device(device), dtype
        self.specs = tuple(model.slot_state_specs)
        self.chunk_input_frames = model.streaming_chunk_frames
        self.subsampling_rate = model.subsampling_rate
        self.input_dim = model.config.input_dim

    @classmethod
    def for_engine(cls, model, config, twin="fast"):
        """Built from the engine's ``config``: only ``max_batch_size``, ``device`` and ``dtype`` apply
        (the K/V geometry fields describe pages this runtime does not have)."""
        return cls(model, config.max_batch_size, config.device, config.dtype)

    @property
    def states(self):
        """What an engine allocates and frees per stream: this runtime."""
        return self

    def allocate_stream(self, stream_id) -> None:
        """``allocate``, under the name an engine calls on every kind's per-stream state."""
        self.allocate(stream_id)

    def free_stream(self, stream_id) -> None:
        """``free``, under the name an engine calls on every kind's per-stream state."""
        self.free(stream_id)


@register_streaming_backend("stateful")
class StatefulStreamingBackend(_ListStateBackend):
    """Per stream, the encoder's list of state tensors (batch 1); a step concatenates the cohort's
    lists along each state's batch axis, runs ``streaming_forward`` once at ``B = N`` and splits the
    new states back. Readable and uncaptured: the slot runtime's parity oracle."""

    ENGINE_GAPS = {**_ListStateBackend.ENGINE_GAPS,
                   "cuda_graphs": "it runs op by op at batch N and captures nothing (declare 'slot' to capture)"}

    def __init__(self, model, max_batch_size: int = 8, device="cpu", dtype=torch.float32):
        super().__init__(model, max_batch_size, device, dtype)
        self._states: dict = {}

    def allocate(self, stream_id) -> None:
        """Give ``stream_id`` the model's initial states (``ValueError`` if taken, ``RuntimeError`` if none free)."""
        if stream_id in self._states:
            raise ValueError(f"stream id {stream_id!r} is already allocated")
        if len(self._states) >= self.max_batch_size:
            raise RuntimeError(f"no free stream: all {self.max_batch_size} are in use")
        self._states[stream_id] = [s.to(self.device, self.dtype) for s in self.model.get_streaming_init_states(1)]

    def free(self, stream_id) -> None:
        """Drop ``stream_id``'s states (``KeyError`` if unknown)."""
        if stream_id not in self._states:
            raise KeyError(f"unknown stream id {stream_id!r}")
        del self._states[stream_id]

    def has_stream(self, stream_id) -> bool:
        """Whether ``stream_id`` is allocated."""
        return stream_id in self._states

    def state_of(self, stream_id) -> list:
        """``stream_id``'s list of state tensors (batch 1), not a copy."""
        return self._states[stream_id]

    def forward_step(self, stream_ids, xs, input_lens):
        """One chunk for ``stream_ids``; returns ``(log_probs (N, T_out, vocab), out_lens list)``, states updated."""
        lens = self._check_step(stream_ids, xs, input_lens)
        ids = list(stream_ids)
        batched = [torch.cat([self._states[sid][i] for sid in ids], dim=spec.slot_axis)
                   for i, spec in enumerate(self.specs)]
        lens_t = torch.tensor(lens, dtype=torch.long, device=self.device)
        log_probs, out_lens, new = self.model.streaming_forward(xs.to(self.device, self.dtype), lens_t, batched)
        for i, spec in enumerate(self.specs):
            for row, sid in enumerate(ids):
                self._states[sid][i] = new[i].narrow(spec.slot_axis, row, 1).clone()
        return log_probs, out_lens.tolist()


@register_streaming_backend("slot")
class SlotStreamingBackend(_ListStateBackend):
    """The whole cache in slot-indexed tensors (the twin's ``SlotStateCache`` over ``slot_state_specs``,
    one padding lane). A step pads the cohort to a width (``engine_widths``: powers of two, then
    ``max_batch_size``), gathers the rows into that width's static batch, runs the capture-safe
    ``step(width)`` -- eagerly, or as a CUDA graph replay with ``graphs=True`` -- and scatters the new
    states back. ``capture`` replaces the CUDA capture (tests); ``graphs=True`` on a CPU device without
    one is refused."""

    def __init__(self, model, max_batch_size: int = 8, device="cpu", dtype=torch.float32, twin="fast",
                 graphs: bool = False, capture=None):
        super().__init__(model, max_batch_size, device, dtype)
        self.ops = twin_module(twin)
        self.state = self.ops.SlotStateCache(list(self.specs), self.max_batch_size, pad_lanes=1,
                                             device=self.device, dtype=dtype)
        self.widths = engine_widths(self.max_batch_size)
        T, D = self.chunk_input_frames, self.input_dim
        self._batches = {
            w: dict(xs=torch.zeros((w, T, D), dtype=dtype, device=self.device),
                    lens=torch.zeros((w,), dtype=torch.long, device=self.device),
                    states=[torch.zeros(s.batch_shape(w), dtype=s.dtype or dtype, device=self.device)
                            for s in self.specs])
            for w in self.widths
        }
        on_cuda = self.device.type == "cuda"
        self._host_xs = torch.zeros((max(self.widths), T, D), dtype=dtype, pin_memory=on_cuda)
        self._host_lens = torch.zeros((max(self.widths),), dtype=torch.long, pin_memory=on_cuda)
        for w in self.widths:  # build the slot cache's index stagers now, not inside a step
            self.state.views([], pad_to=w)
        self.step_monitor = None  # e.g. a CaptureSafetyChecker: its region(label) wraps each device step
        self.runner = None
        self.graph_refusal = None  # why graphs were asked for and every width runs eager (a preflight reason)
        if graphs:
            self.capture_graphs(capture)

    @classmethod
    def for_engine(cls, model, config, twin="fast"):
        """Built from the engine's ``config`` (``max_batch_size``, ``device``, ``dtype``), eager; the engine
        captures the graphs afterwards (``capture_graphs``) when it runs graphed."""
        return cls(model, config.max_batch_size, config.device, config.dtype, twin=twin)

    def capture_graphs(self, capture=None) -> None:
        """Capture ``step(width)`` for every width (CUDA graphs; ``capture`` a stand-in in tests); from now
        on a step replays. A CPU device without a stand-in is refused (``ValueError``)."""
        from oasr.fast.graph_runner import CudaGraphCapture, GraphRunner, capture_or_eager

        if capture is None and self.device.type != "cuda":
            raise ValueError(f"SlotStreamingBackend: graphs=True needs a CUDA device, got {self.device}")
        capture = capture if capture is not None else CudaGraphCapture(self.device)
        self.runner, self.graph_refusal = capture_or_eager(GraphRunner(self.step, self.widths, capture))

    @property
    def graphed(self) -> bool:
        """Whether a step replays captured graphs."""
        return self.runner is not None

    def pinned_host_tensors(self) -> list:
        """The pinned host staging tensors a step copies from (inputs, lengths)."""
        return [self._host_xs, self._host_lens]

    def static_buffers(self, width: int) -> list:
        """The static device batch of ``width``: inputs, lengths, then one tensor per state."""
        b = self._batches[width]
        return [b["xs"], b["lens"], *b["states"]]

    def width_for(self, count: int) -> int:
        """The smallest step width that holds ``count`` streams."""
        return next(w for w in self.widths if w >= count)

    def allocate(self, stream_id) -> None:
        """Give ``stream_id`` a slot in the state cache (its errors if taken or full)."""
        self.state.allocate_stream(stream_id)

    def free(self, stream_id) -> None:
        """Release ``stream_id``'s slot."""
        self.state.free_stream(stream_id)

    def has_stream(self, stream_id) -> bool:
        """Whether ``stream_id`` holds a slot."""
        return self.state.has_stream(stream_id)

    def step(self, width: int):
        """The capture-safe forward at ``width``: the static batch in, ``(log_probs, out_lens, states)`` out."""
        b = self._batches[width]
        return self.model.streaming_forward(b["xs"], b["lens"], b["states"])

    def forward_step(self, stream_ids, xs, input_lens):
        """One chunk for ``stream_ids``, padded to a step width; returns ``(log_probs, out_lens list)``."""
        lens = self._check_step(stream_ids, xs, input_lens)
        ids = list(stream_ids)
        N, width = len(ids), self.width_for(len(ids))
        host_xs, host_lens = self._host_xs[:width], self._host_lens[:width]
        host_xs.fill_(self.model.streaming_pad_value)
        host_xs[:N, : xs.shape[1]] = xs
        host_lens.zero_()
        host_lens[:N] = torch.tensor(lens, dtype=torch.long)
        monitor = self.step_monitor
        with nullcontext() if monitor is None else monitor.region(f"slot step, width {width}"):
            log_probs, out_lens = self._device_step(ids, width)
        return log_probs[:N, : xs.shape[1]].clone(), out_lens[:N].tolist()

    def _device_step(self, ids: list, width: int):
        """Upload the pinned inputs, gather the rows, step (or replay), scatter: nothing reads the device."""
        b = self._batches[width]
        b["xs"].copy_(self._host_xs[:width], non_blocking=True)
        b["lens"].copy_(self._host_lens[:width], non_blocking=True)
        views = self.state.views(ids, pad_to=width)
        for spec, out in zip(self.specs, b["states"], strict=True):
            view = views[spec.name]
            if hasattr(view, "index"):  # the fast twin: gather into the static batch, no new tensor
                torch.index_select(view.buffer, spec.slot_axis, view.index, out=out)
            else:
                out.copy_(view.gather())
        log_probs, out_lens, new = self.runner.run(width) if self.runner else self.step(width)
        for spec, tensor in zip(self.specs, new, strict=True):
            views[spec.name].scatter(tensor)
        return log_probs, out_lens
