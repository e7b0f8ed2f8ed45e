"""``EncoderStreamingEngine``: many streams of an encoder-only paged model, one batched forward per tick.

The engine for an encoder whose output is hidden frames (a transducer's decoder runs on them
elsewhere), such as ``oasr.models.nemotron.NemotronEncoder``. The encoder declares what the
engine reads::

    chunk_input_frames, first_chunk_input_frames     feature frames of a later / a first chunk
    output_frames(n, first)                          encoder frames a chunk of n feature frames gives
    streaming_state_specs, cache_config(), check_cache_config(config)
    forward_chunk_paged(xs, offsets, att_caches, conv_cache, states, input_lens, twin)
                                                     -> (hidden (B, C, d), chunk_lens, new_conv_cache)

One tick::

    1. admit    waiting streams with a chunk ready, arrival order, while a slot is free (the pool is
                sized so that every slot's window fits: the windows are prefilled, so a stream's
                blocks are fixed from admission)
    2. pick     active streams holding a whole chunk (a first one: first_chunk_input_frames), or,
                ended, what is left (a last short chunk)
    3. forward  one cohort, rows at different positions, padded to a power of two through the
                padding lane; K/V appended to the pages, the tails scattered back by the model
    4. commit   att.commit_chunks_batched, cnn.update
    5. finish   an ended stream with nothing left to encode is freed

**CUDA graphs.** On a CUDA device the fast twin's chunk step (3) is captured once per cohort width
(``oasr.engine.tick.FastModelTick`` over ``oasr.fast.graph_runner.GraphRunner``: static per-width inputs, the
model's ``paged_chunk_core``, its opaque ``(w, C, hidden)`` output read back) and replayed. Before capture the
runner's preflight runs each width's step once eagerly: a width that reaches a declared kernel gap (e.g. a
head_dim the attention kernels do not tile) is left eager, and when every width is, the engine runs its eager
step, with the reason logged once and kept in ``execution_note``; nothing raises inside a capture.
``cuda_graphs``: None (graphs where possible), True (graphs, or eager with the preflight's reason), False
(eager); ``graph_capture`` replaces the CUDA capture with a stand-in (tests on the CPU). ``execution`` is
``"graphed"`` or ``"eager"``.

``suspend(sid)`` takes a stream out (its caches as a session, ``oasr.session``, plus its position
and unconsumed input) as bytes, safetensors-framed, nothing pickled; ``resume(data)`` puts it back,
in this engine or another of the same geometry, and the stream goes on bit-identically.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from oasr.cache.config import CacheConfig
from oasr.models.twins import twin_module
from oasr.sessions.codec import read_tensor_blob
from oasr.sessions.stream import load_stream, model_digest, save_stream

SUSPEND_FORMAT = "oasr-encoder-stream-1"
logger = logging.getLogger("oasr.engine")


@dataclass
class _Stream:
    stream_id: object
    pending: list = field(default_factory=list)
    num_pending: int = 0
    ended: bool = False
    state: str = "waiting"  # waiting -> active -> finished; suspended streams leave the engine
    offset: int = 0  # encoder frames produced so far
    outputs: list = field(default_factory=list)
    session: bytes | None = None  # a resumed stream's caches until admission restores them


class EncoderStreamingEngine:
    """Serve many streams of an encoder-only paged model on one pool (see the module docstring)."""

    def __init__(self, model, config: CacheConfig, twin="fast", cuda_graphs: bool | None = None, graph_capture=None):
        if getattr(model, "streaming_kind", None) != "paged":
            raise ValueError(f"EncoderStreamingEngine: {type(model).__name__} does not declare streaming_kind "
                             f"'paged'")
        model.check_cache_config(config)
        self.model, self.config = model, config
        self.ops = twin_module(twin)
        self.pool = self.ops.BlockPool(config, scratch_blocks=1)
        self.att = self.ops.AttentionCacheManager(self.pool, config, pad_lanes=1)
        self.cnn = self.ops.CnnCacheManager(config, pad_lanes=1)
        self.states = self.ops.SlotStateCache(model.streaming_state_specs, config.max_batch_size, pad_lanes=1,
                                              device=config.device, dtype=config.dtype)
        self.input_dim = model.config.num_mel_bins
        self._streams: dict = {}
        self._ids = itertools.count()
        self.tick = 0
        self._digest = model_digest(model)
        self._setup_graphs(twin, cuda_graphs, graph_capture)

    def _setup_graphs(self, twin, cuda_graphs, capture) -> None:
        """Pick the eager or graphed chunk step (module docstring) and say why once."""
        if cuda_graphs not in (None, True, False):
            raise ValueError(f"EncoderStreamingEngine: cuda_graphs must be None, True or False, got {cuda_graphs!r}")
        fast = self.ops.__name__ == "oasr.fast"
        on_cuda = self.config.device.type == "cuda"
        if cuda_graphs and not fast:
            raise ValueError("EncoderStreamingEngine: cuda_graphs=True needs twin='fast' (the reference twin reads "
                             "lengths on the host, which no graph can replay)")
        if cuda_graphs and not on_cuda and capture is None:
            raise ValueError(f"EncoderStreamingEngine: cuda_graphs=True needs a CUDA device, the caches are on "
                             f"{self.config.device}; on the CPU the engine runs eager")
        want = bool(cuda_graphs) if cuda_graphs is not None else (on_cuda and fast)
        self.model_tick, self.execution = None, "eager"
        refusal = None
        if want:
            from oasr.engine.tick import FastModelTick

            # GraphRunner's preflight runs each width's step once eagerly first: a width that reaches a declared
            # kernel gap is left eager (never captured); when every width is, the tick has no runner
            tick = FastModelTick(self.model, self.att, self.cnn, self.states, self.ops, self.config, graphs=True,
                                 capture=capture)
            refusal = tick.graph_refusal
            if refusal is None:
                self.model_tick, self.execution = tick, "graphed"
                self.execution_note = f"graphed: {tick.graph_stats.format()}"
        if refusal is not None:
            self.execution_note = f"eager: not captured: {refusal}"
            logger.warning("EncoderStreamingEngine chunk step: %s", self.execution_note)
            return
        if self.model_tick is None:
            if not fast:
                self.execution_note = "eager: the reference twin runs op by op (it is the oracle)"
            elif not on_cuda:
                self.execution_note = f"eager: CUDA graphs need a CUDA device, this engine runs on {self.config.device}"
            else:
                self.execution_note = "eager: cuda_graphs=False"
        logger.info("EncoderStreamingEngine chunk step: %s", self.execution_note)

    # ---- input -----------------------------------------------------------------------------------------
    def add_stream(self, stream_id=None):
        """Register a stream (it waits for admission); returns its id."""
        if stream_id is None:
            stream_id = next(i for i in self._ids if i not in self._streams)
        if stream_id in self._streams:
            raise ValueError(f"EncoderStreamingEngine: stream {stream_id!r} exists")
        self._streams[stream_id] = _Stream(stream_id)
        return stream_id

    def push(self, stream_id, features: torch.Tensor) -> None:
        """Append ``features (n, num_mel_bins)`` to the stream's input (``ValueError`` for another shape,
        non-finite values, or after ``end_stream``; nothing changes then)."""
        s = self._stream(stream_id)
        if s.ended:
            raise ValueError(f"EncoderStreamingEngine: stream {stream_id!r} has ended; no more input")
        if features.dim() != 2 or features.shape[1] != self.input_dim:
            raise ValueError(f"EncoderStreamingEngine: features must be (n, {self.input_dim}), "
                             f"got {tuple(features.shape)}")
        if not torch.isfinite(features).all():
            raise ValueError("EncoderStreamingEngine: features hold non-finite values")
        s.pending.append(features.to(self.config.dtype))
        s.num_pending += features.shape[0]

    def end_stream(self, stream_id) -> None:
        """No more input: the stream's rest becomes its last (possibly short) chunk."""
        self._stream(stream_id).ended = True

    def result(self, stream_id) -> torch.Tensor:
        """Every encoder frame the stream produced so far, ``(frames, hidden)``."""
        s = self._stream(stream_id)
        return torch.cat(s.outputs) if s.outputs else torch.zeros(0, self.model.config.hidden_size)

    @property
    def num_active(self) -> int:
        """Streams holding a slot (and their windows' blocks)."""
        return sum(s.state == "active" for s in self._streams.values())

    def finished(self, stream_id) -> bool:
        """True once the stream ended, encoded everything it could and gave back its caches."""
        return self._stream(stream_id).state == "finished"

    # ---- the tick ----------------------------------------------------------------------------------------
    def _stream(self, stream_id) -> _Stream:
        if stream_id not in self._streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        return self._streams[stream_id]

    def _chunk_size(self, s: _Stream) -> int:
        """Feature frames the stream's next chunk takes now (0: not ready)."""
        full = self.model.first_chunk_input_frames if s.offset == 0 else self.model.chunk_input_frames
        if s.num_pending >= full:
            return full
        if s.ended and self.model.output_frames(s.num_pending, first=s.offset == 0) > 0:
            return s.num_pending
        return 0

    def _admit(self) -> None:
        active = sum(s.state == "active" for s in self._streams.values())
        for s in self._streams.values():
            if s.state != "waiting" or active >= self.config.max_batch_size:
                continue
            active += 1 if s.session is not None or self._chunk_size(s) else 0
            if s.session is not None:  # a resumed stream: its caches come back whether input is ready or not
                load_stream(s.session, s.stream_id, self.att, [self.cnn, self.states])
                s.session, s.state = None, "active"
            elif self._chunk_size(s):
                self.att.allocate_stream(s.stream_id)
                self.cnn.allocate_stream(s.stream_id)
                self.states.allocate_stream(s.stream_id)
                s.state = "active"

    def _take(self, s: _Stream, n: int) -> torch.Tensor:
        data = torch.cat(s.pending) if len(s.pending) > 1 else s.pending[0]
        rest = data[n:]
        s.pending = [rest] if rest.shape[0] else []
        s.num_pending -= n
        return data[:n]

    def step(self) -> dict:
        """One tick; returns ``stream id -> new hidden frames (n, hidden)`` for every stream that ran."""
        self._admit()
        cohort = [s for s in self._streams.values() if s.state == "active" and self._chunk_size(s)]
        out = {}
        if cohort:
            width = min(1 << (len(cohort) - 1).bit_length(), self.config.max_batch_size)
            width = max(width, len(cohort))
            ids = [s.stream_id for s in cohort]
            sizes = [self._chunk_size(s) for s in cohort]
            enc = [self.model.output_frames(n, first=s.offset == 0) for s, n in zip(cohort, sizes, strict=True)]
            if self.model_tick is not None:
                hidden = self._graphed_step(cohort, ids, sizes, enc, width)
            else:
                hidden = self._eager_step(cohort, ids, sizes, enc, width)
            for row, (s, n) in enumerate(zip(cohort, enc, strict=True)):
                frames = hidden[row, :n].clone()
                s.outputs.append(frames)
                s.offset += n
                out[s.stream_id] = frames
        for s in self._streams.values():
            if s.state == "active" and s.ended and self._chunk_size(s) == 0:
                self._free(s)
        self.tick += 1
        return out

    def _eager_step(self, cohort, ids, sizes, enc, width) -> torch.Tensor:
        xs = torch.zeros(width, self.model.chunk_input_frames, self.input_dim, dtype=self.config.dtype,
                         device=self.config.device)
        for row, (s, n) in enumerate(zip(cohort, sizes, strict=True)):
            xs[row, :n] = self._take(s, n)
        pad = width - len(cohort)
        self.att.prepare_chunks_batched(ids, enc)
        caches = self.att.get_paged_caches(ids, pad_to=width)
        hidden, _, new_conv = self.model.forward_chunk_paged(
            xs, [s.offset for s in cohort] + [0] * pad, caches, self.cnn.get_cache(ids, pad_to=width),
            self.states.views(ids, pad_to=width), sizes + [0] * pad, twin=self.ops)
        self.att.commit_chunks_batched(ids, enc)
        self.cnn.update(ids, new_conv, pad_to=width)
        return hidden

    def _graphed_step(self, cohort, ids, sizes, enc, width) -> torch.Tensor:
        """The same step on the width's static buffers (pinned host rows in, one replay, one readback); the
        padding rows carry length 0 and offset 0. Returns the hidden frames as float32 on the host."""
        tick = self.model_tick
        xs, meta = tick.host_inputs(width)
        xs.zero_()
        meta.zero_()
        for row, (s, n) in enumerate(zip(cohort, sizes, strict=True)):
            xs[row, :n] = self._take(s, n).to("cpu")
            meta[row, 0], meta[row, 1] = s.offset, n
        self.att.prepare_chunks_batched(ids, enc)
        tick.run(ids, width)  # scatters the tails and the conv cache back itself
        self.att.commit_chunks_batched(ids, enc)
        return tick.log_probs(width)

    def run(self, max_ticks: int = 10_000) -> None:
        """Tick until no stream can make progress (every ended stream finished)."""
        for _ in range(max_ticks):
            if not any(s.state == "active" or s.session is not None or self._chunk_size(s)
                       for s in self._streams.values() if s.state != "finished"):
                return
            self.step()

    def cancel(self, stream_id) -> None:
        """Drop the stream now, in any state: its slot and blocks (if admitted) go back, nothing of it is kept.
        ``KeyError`` for an unknown id."""
        s = self._stream(stream_id)
        if s.state == "active":
            self._free(s)
        del self._streams[stream_id]

    def status(self, stream_id) -> str:
        """``waiting`` (not admitted yet, or resumed and not restored yet), ``active`` or ``finished``."""
        return self._stream(stream_id).state

    @property
    def stream_ids(self) -> list:
        """Every stream the engine holds (finished ones until ``cancel``)."""
        return list(self._streams)

    def _free(self, s: _Stream) -> None:
        self.att.free_stream(s.stream_id)
        self.cnn.free_stream(s.stream_id)
        self.states.free_stream(s.stream_id)
        s.state = "finished"

    # ---- suspend / resume ----------------------------------------------------------------------------------
    def suspend(self, stream_id) -> bytes:
        """Take the stream out of this engine: its caches (a session), position, unconsumed input and ended
        flag as bytes; the stream's slot and blocks are freed. Outputs already returned are not included.

        A stream still waiting for its first admission travels as its buffered input alone (no caches); one
        resumed here and not yet restored travels with the session it came with. ``ValueError`` for a finished
        stream (nothing changes)."""
        from safetensors.torch import save

        s = self._stream(stream_id)
        if s.state == "finished":
            raise ValueError(f"EncoderStreamingEngine: stream {stream_id!r} has finished; nothing to suspend")
        if s.state == "active":
            caches = save_stream(stream_id, self.att, [self.cnn, self.states])
        else:
            caches = s.session if s.session is not None else b""
        pending = torch.cat(s.pending) if s.pending else torch.zeros(0, self.input_dim, dtype=self.config.dtype)
        blob = torch.frombuffer(bytearray(caches), dtype=torch.uint8) if caches else torch.zeros(0, dtype=torch.uint8)
        data = save({"caches": blob, "pending": pending.cpu()},
                    metadata={"format": SUSPEND_FORMAT, "offset": str(s.offset), "ended": str(int(s.ended)),
                              "model": self._digest.hex()})
        if s.state == "active":
            self._free(s)
        del self._streams[stream_id]
        return data

    def resume(self, data: bytes, stream_id) -> object:
        """Register ``stream_id`` from ``suspend``'s bytes; it is admitted (its caches restored) at the next
        tick with a free slot. ``ValueError`` for foreign bytes or another model's weights."""

        if stream_id in self._streams:
            raise ValueError(f"EncoderStreamingEngine: stream {stream_id!r} exists")
        tensors, meta = read_tensor_blob(data, "EncoderStreamingEngine.resume")
        if meta.get("format") != SUSPEND_FORMAT:
            raise ValueError(f"EncoderStreamingEngine.resume: format {meta.get('format')!r}, expected "
                             f"{SUSPEND_FORMAT!r}")
        if meta.get("model") != self._digest.hex():
            raise ValueError("EncoderStreamingEngine.resume: the stream ran on other weights")
        s = _Stream(stream_id, offset=int(meta["offset"]), ended=bool(int(meta["ended"])))
        s.session = tensors["caches"].numpy().tobytes() or None  # empty: suspended before its first admission
        pending = tensors["pending"].to(self.config.device)
        if pending.shape[0]:
            s.pending, s.num_pending = [pending], pending.shape[0]
        self._streams[stream_id] = s
        return stream_id
