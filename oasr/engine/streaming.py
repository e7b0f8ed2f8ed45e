"""``StreamingEngine``: many streams, one shared pool, one batched paged forward per tick.

Works with either twin (``twin="reference"`` or ``"fast"``); it only calls the
managers' public API and the model's ``forward_chunk_paged``. One tick::

    1. admit    resumed streams first (input or not), then waiting streams, shortest
                buffered input first but any stream that has waited
                ``max_wait_time`` ticks ahead of newer ones (``admission_order``),
                while a slot is free and the pool can still hold one more stream's
                worst case (``blocks_per_stream``)
    2. pick     active streams holding a whole chunk (4 * chunk_size feature frames)
                or, once ended, a last short chunk
    3. capacity a picked stream whose chunk would pass its block ceiling (unlimited
                history) finishes now with what it has: finish_reason="length"
    4. prepare  att.prepare_chunks_batched(cohort, frames)   one pool allocation
    5. forward  the model on the cohort padded to a power of two (padding rows ride
                the padding lane: scratch block, lane slot); for the fast twin the
                capture-safe step of ``oasr.engine.tick`` (eager, or one CUDA graph
                replay per width), for the reference ``model.forward_chunk_paged``
    6. commit   att.commit_chunks_batched (advance, evict) and cnn.update; the
                subsampling tails were scattered back by the forward
    7. decode   the cohort's valid log-probs go through the pooled CTC prefix beam
                search in one call (``CtcStateCacheManager.decode_cohort``); each
                stream's best partial hypothesis is reported (greedy on request)
    8. finish   an ended stream with nothing left to encode is freed: "eos"; with
                ``rescore=True`` its CTC n-best becomes a rescoring job
    9. rescore  the rescoring jobs advance one decoder step at a time, oldest first,
                until they are done or the tick's budget binds (``decode_steps_per_tick``
                steps, ``max_tick_ms`` of wall time); a stream finishes with its job

Policies (see docs/engine.md):

* Admission reserves ``config.blocks_per_stream`` per active stream: a stream is
  admitted only if the free blocks cover every active stream's remaining worst
  case plus its own, so no admitted stream can run the pool dry mid-forward.
  ``CacheConfig`` validation makes that hold for ``max_batch_size`` streams, so
  with an engine that owns its pool the slot count is what usually binds.
* Cohort width is the next power of two of the ready streams, capped at
  ``max_batch_size`` (a non-power-of-two ``max_batch_size`` is then one more
  width). A later CUDA-graph capture needs only those few shapes.
* A resumed stream (``resume``) is admitted before every new arrival and as soon as there
  is room, input or not: it held a slot when it was suspended, so a suspension and resume
  between two ticks gives it its slot back before any other stream can take it.
* Bad input (unknown id, wrong feature shape, non-finite values, push after
  ``end_stream``, a stream id that is not an int or a str) raises before anything changes;
  no other stream is touched.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from oasr.cache.config import CacheConfig
from oasr.cache.errors import StreamCapacityError
from oasr.cache.stream_context import StreamContext
from oasr.cache.validate import same_device
from oasr.ctc.config import CtcDecoderConfig
from oasr.engine.decode_families import resolve_decode_family
from oasr.engine.decoding import GreedyCtcDecoder
from oasr.engine.rescoring import RescoreJob
from oasr.engine.stage_clock import StageClock
from oasr.engine.streaming_backend import STREAMING_BACKENDS, check_streamable
from oasr.engine.tick import FastModelTick, engine_widths
from oasr.models.twins import twin_module, twin_name
from oasr.sessions.format import (
    EngineStream,
    RescoreProgress,
    SessionError,
    SessionGeometry,
    StreamSession,
    encode_session,
    read_session,
)
from oasr.sessions.stream import capture_stream, check_session, model_digest, restore_stream

WAITING, ACTIVE, RESCORING, FINISHED = "waiting", "active", "rescoring", "finished"
STREAM_ID_BITS = 64  # an int id is stored as a signed 64-bit integer in a session
ADMISSION_POLICIES = ("length", "arrival")

logger = logging.getLogger("oasr.engine")


def check_stream_id(stream_id) -> None:
    """A stream id is an ``int`` within signed 64 bits or a ``str`` encodable as UTF-8: the two kinds a
    session stores (so a suspended stream comes back under its own id). ``ValueError`` otherwise: a
    bool (it would collide with 0 and 1), a float, bytes, a tuple, a numpy integer (pass ``int(x)``)."""
    if isinstance(stream_id, str):
        try:
            stream_id.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"stream id {stream_id!r}: a str id must be encodable as UTF-8") from None
        return
    if isinstance(stream_id, int) and not isinstance(stream_id, bool):
        low, high = -(2 ** (STREAM_ID_BITS - 1)), 2 ** (STREAM_ID_BITS - 1)
        if not low <= stream_id < high:
            raise ValueError(f"stream id {stream_id}: an int id must fit in signed 64 bits [{low}, {high})")
        return
    raise ValueError(f"stream ids are ints or strs, got {stream_id!r} ({type(stream_id).__name__})")


def refuse_unless_offered(backend_cls, model, feature: str, what: str) -> None:
    """``ValueError`` naming the model's streaming kind when its runtime cannot offer ``feature``
    (``StreamingEncoderBackend.refusal``); ``what`` is the call or argument that asked for it."""
    reason = backend_cls.refusal(model, feature)
    if reason is not None:
        raise ValueError(f"StreamingEngine: {what} is not offered for {type(model).__name__} "
                         f"(streaming_kind={backend_cls.kind!r}): {reason}")


def _common_prefix(old: list, new: list) -> int:
    """Length of the longest common prefix of two token lists (compared in C while they agree)."""
    n = min(len(old), len(new))
    if old[:n] == new[:n]:
        return n
    return next(i for i, (a, b) in enumerate(zip(old[:n], new[:n], strict=True)) if a != b)


@dataclass
class StepOutput:
    """What one stream produced in one tick.

    ``partial`` is the stream's best hypothesis so far. Beam search may revise
    its tail, so the change since the previous tick is reported as an edit:
    drop the last ``retracted`` tokens shown, then append ``new_tokens``
    (greedy decoding never retracts).
    """

    stream_id: object
    new_tokens: list
    num_frames: int  # encoder (log-prob) frames produced this tick
    finished: bool = False
    finish_reason: str | None = None  # "eos" or "length" once finished
    retracted: int = 0
    partial: list = field(default_factory=list)
    # with ``engine.emit_speech_probs``: ``1 - p(blank)`` of this tick's ``num_frames`` frames (the endpointer's input)
    speech_probs: torch.Tensor | None = None


@dataclass
class StreamResult:
    """A finished stream: its tokens, and its log-probs when the engine keeps them."""

    stream_id: object
    tokens: list
    num_frames: int
    num_input_frames: int
    finish_reason: str
    log_probs: torch.Tensor | None
    admitted_tick: int | None
    finished_tick: int
    nbest: list = field(default_factory=list)  # CtcHypothesis records, best first (beam search)
    first_pass: list | None = None  # with rescore=True: the CTC best before attention rescoring


@dataclass
class TickStats:
    """Bookkeeping of one tick, taken while the cohort's blocks are in flight (the tick's peak)."""

    tick: int
    cohort: int
    width: int
    active: int  # streams holding a slot (and blocks)
    waiting: int  # streams with input ready that admission holds back
    used_blocks: int
    live_frames: int
    encoder_frames: int
    input_frames: int
    finished: int
    decode_steps: int = 0  # attention-decoder steps run this tick (rescoring), within the tick budget


@dataclass
class _Stream:
    stream_id: object
    greedy: GreedyCtcDecoder | None  # only with decoder="greedy"; beam states live in the pool
    state: str = WAITING
    partial: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    num_pending: int = 0
    ended: bool = False
    offset: int = 0  # encoder frames produced so far (the next chunk's absolute position)
    input_frames: int = 0  # feature frames consumed by the encoder
    log_probs: list = field(default_factory=list)
    finish_reason: str | None = None
    admitted_tick: int | None = None
    max_extent: int = 0  # most K/V frames a chunk of this stream ever attended to
    session: object = None  # a resumed stream's StreamSession until admission restores it (see resume)
    arrival_tick: int = 0  # engine.tick when add_stream ran (the admission clock)
    encoder_out: list = field(default_factory=list)  # with rescore=True: the encoder's chunks, for the 2nd pass
    first_pass: list | None = None
    nbest: list | None = None  # while rescoring: the CTC n-best its job scores


class StreamingEngine:
    """Serve many streams on one shared pool; see the module docstring for one tick.

    ``decoder="beam"`` (default) decodes with the twin's streaming CTC prefix beam
    search, its per-stream states pooled in a ``CtcStateCacheManager`` and
    admitted and freed with the other caches through ``StreamContext``;
    ``ctc_config`` sets it (default ``CtcDecoderConfig(beam_size=4)``).
    ``decoder="greedy"`` keeps the per-stream greedy collapse as a baseline.

    ``cuda_graphs``: replay one captured CUDA graph per cohort width for the model step
    (``oasr.engine.tick``); None (default) means on for the fast twin on CUDA, off
    otherwise. ``True`` is refused on the CPU and with the reference twin.
    ``graph_capture`` replaces the CUDA capture with a stand-in (tests only).
    ``execution`` says which path runs (``"graphed"`` / ``"eager"``), ``execution_note``
    why, and the choice is logged once to ``oasr.engine``.

    ``admission``: ``"length"`` (default) admits ready waiting streams shortest buffered
    input first, except that a stream waiting ``max_wait_time`` ticks or more since
    ``add_stream`` goes ahead of every newer one (oldest first), so none starves;
    ``"arrival"`` admits in arrival order. Resumed streams go first either way (module docstring).

    Tick budget for the autoregressive work (the rescoring jobs' decoder steps, step 9):
    at most ``decode_steps_per_tick`` steps (None: no limit) and no new step once
    ``max_tick_ms`` milliseconds (None: no limit) have passed since the tick's first one,
    whichever binds first; the first step of a tick always runs, so every tick makes
    progress. Work left over continues next tick; results do not depend on the budget
    (each job's arithmetic is its own). ``clock`` (default ``time.monotonic``, seconds)
    is what the deadline reads; tests inject a fake one.

    Stream ids are ints (within 64 bits, signed) or strs (encodable as UTF-8): the ids a session
    stores. Anything else (a bool, a float, bytes, a tuple, a larger int) is refused at
    ``add_stream`` and ``resume`` with ``ValueError``.

    ``close()`` (or leaving a ``with StreamingEngine(...) as engine:`` block) drops the engine's
    references to the model, its model step and the rescorer; its results stay readable, and
    every call that would run the model raises ``ValueError``. The engine adds nothing to the model
    (no hook), so a closed or dropped engine leaves the model as it found it.
    """

    def __init__(self, model, config: CacheConfig, twin="fast", decoder: str = "beam",
                 ctc_config: CtcDecoderConfig | None = None, keep_log_probs: bool = False,
                 cuda_graphs: bool | None = None, admission: str = "length", max_wait_time: int = 8,
                 graph_capture=None, rescore: bool = False, rescorer=None, ctc_weight: float = 0.5,
                 decode_steps_per_tick: int | None = None, max_tick_ms: float | None = None, clock=None):
        if decoder not in ("beam", "greedy"):
            raise ValueError(f"StreamingEngine: decoder must be 'beam' or 'greedy', got {decoder!r} (the CTC "
                             f"families; a transducer is served by oasr.asr.transducer.TransducerRecognizer)")
        # the decode family (oasr.engine.decode_families): the model checked against its capabilities, once
        self.decode_family, _ = resolve_decode_family(decoder, model)
        if admission not in ADMISSION_POLICIES:
            raise ValueError(f"StreamingEngine: admission must be one of {ADMISSION_POLICIES}, got {admission!r}")
        if isinstance(max_wait_time, bool) or not isinstance(max_wait_time, int) or max_wait_time < 0:
            raise ValueError(f"StreamingEngine: max_wait_time must be an int >= 0 (ticks), got {max_wait_time!r}")
        if cuda_graphs not in (None, True, False):
            raise ValueError(f"StreamingEngine: cuda_graphs must be None, True or False, got {cuda_graphs!r}")
        self.backend_kind = check_streamable(model)  # the encoder's streaming_kind, read before anything else
        backend_cls = STREAMING_BACKENDS[self.backend_kind]
        if decode_steps_per_tick is not None and (isinstance(decode_steps_per_tick, bool) or not isinstance(
                decode_steps_per_tick, int) or decode_steps_per_tick < 1):
            raise ValueError(f"StreamingEngine: decode_steps_per_tick must be None or an int >= 1, got "
                             f"{decode_steps_per_tick!r}")
        if max_tick_ms is not None and (isinstance(max_tick_ms, bool) or not isinstance(max_tick_ms, (int, float))
                                        or not max_tick_ms > 0 or max_tick_ms == float("inf")):
            raise ValueError(f"StreamingEngine: max_tick_ms must be None or a finite number > 0, got {max_tick_ms!r}")
        if clock is not None and not callable(clock):
            raise ValueError(f"StreamingEngine: clock must be callable (seconds), got {clock!r}")
        if rescore:
            refuse_unless_offered(backend_cls, model, "rescore", "rescore=True")
        if cuda_graphs:
            refuse_unless_offered(backend_cls, model, "cuda_graphs", "cuda_graphs=True")
        if config.kv_cache_dtype is not None:
            refuse_unless_offered(backend_cls, model, "kv_format", f"kv_cache_dtype={config.kv_cache_dtype!r}")
        param = next(model.parameters())
        if not same_device(param.device, config.device):
            raise ValueError(f"StreamingEngine: the model is on {param.device}, the caches on {config.device}")
        self.model = model
        self.config = config
        self.ops = twin_module(twin)
        self.twin = twin_name(self.ops)
        self.decoder = decoder
        self.ctc = self.ctc_config = None
        if decoder == "beam":
            # the second pass rescores an n-best list; the first pass alone needs only its best
            self.ctc_config = ctc_config or CtcDecoderConfig(beam_size=4, nbest=4 if rescore else 1)
            self.ctc = self.ops.CtcStateCacheManager(self.ops.StreamingCtcDecoder(self.ctc_config))
        self.keep_log_probs = keep_log_probs
        # set True to get each chunk's CTC speech probability (1 - p(blank)) in StepOutput.speech_probs
        self.emit_speech_probs = False
        # the runtime of the declared kind (oasr.engine.streaming_backend); a paged one checks the geometry
        self.backend = backend_cls.for_engine(model, config, self.ops)
        self.chunk_input_frames = self.backend.chunk_input_frames
        self.input_dim = self.backend.input_dim
        self.rate = self.backend.subsampling_rate
        # paged: the caches the tick drives; fixed-extent (slot, stateful): pool, att, cnn are None and
        # states is the runtime (admission allocates and frees each stream's state there)
        self.pool, self.att, self.cnn, self.states = self.backend.pool, self.backend.att, self.backend.cnn, \
            self.backend.states
        self._streams: dict = {}
        self._waiting: list = []  # arrival order
        self._active: list = []  # admission order
        self._contexts: dict = {}
        self._ids = itertools.count()
        self.results: dict = {}
        self.stats: list[TickStats] = []
        self.stage_clock = StageClock(config.device)  # host (and device) time per stage of the ticks
        self.tick = 0
        self.admission = admission
        self.max_wait_time = max_wait_time
        self.tick_monitor = None  # e.g. a CaptureSafetyChecker: its region(label) wraps each model step
        self.decode_steps_per_tick, self.max_tick_ms = decode_steps_per_tick, max_tick_ms
        self.clock = clock or time.monotonic
        self._rescoring: list = []  # (stream id, RescoreJob), oldest first
        self.model_tick = None
        self._setup_rescoring(rescore, rescorer, ctc_weight)  # first: the model step returns what it consumes
        self._setup_model_tick(cuda_graphs, graph_capture)
        self._setup_ctc_search(cuda_graphs, graph_capture)

    def _setup_model_tick(self, cuda_graphs, capture) -> None:
        """Pick the eager or graphed model step (fast twin) and report the choice once."""
        on_cuda = self.config.device.type == "cuda"
        if cuda_graphs and self.twin != "fast":
            raise ValueError("StreamingEngine: cuda_graphs=True needs twin='fast' (the reference twin hands out "
                             "fresh view tensors every tick, which no graph can replay)")
        if cuda_graphs and not on_cuda and capture is None:
            raise ValueError(f"StreamingEngine: cuda_graphs=True needs a CUDA device, the caches are on "
                             f"{self.config.device}; on the CPU the engine runs eager (cuda_graphs=None or False)")
        capturable = type(self.backend).refusal(self.model, "cuda_graphs") is None
        graphs = bool(cuda_graphs) if cuda_graphs is not None else (on_cuda and self.twin == "fast" and capturable)
        if self.twin == "fast" and self.att is not None:
            self.model_tick = FastModelTick(self.model, self.att, self.cnn, self.states, self.ops, self.config,
                                            graphs=graphs, capture=capture, hidden=self.rescore)
        elif graphs:  # a fixed-extent runtime captures its own step per width
            self.backend.capture_graphs(capture)
        owner = self.model_tick if self.model_tick is not None else self.backend
        refusal = getattr(owner, "graph_refusal", None) if graphs else None
        graphs = graphs and refusal is None  # the preflight left every width eager: the engine runs eager
        self.execution = "graphed" if graphs else "eager"
        if graphs:
            stats = self.model_tick.graph_stats if self.model_tick is not None else self.backend.runner.stats
            self.execution_note = f"graphed: {stats.format()}"
        elif refusal is not None:
            self.execution_note = f"eager: not captured: {refusal}"
            logger.warning("StreamingEngine model step: %s", self.execution_note)
            return
        elif not capturable:
            self.execution_note = f"eager: streaming_kind={self.backend_kind!r} captures nothing"
        elif self.twin != "fast":
            self.execution_note = "eager: the reference twin runs op by op (it is the oracle)"
        elif not on_cuda:
            self.execution_note = f"eager: CUDA graphs need a CUDA device, this engine runs on {self.config.device}"
        else:
            self.execution_note = "eager: cuda_graphs=False"
        logger.info("StreamingEngine model step: %s", self.execution_note)

    def _setup_ctc_search(self, cuda_graphs, capture) -> None:
        """The CTC search's path, chosen once and reported: with graphs on (``cuda_graphs`` True, or None
        on CUDA; fast twin), the beam states live on the device and each chunk's search replays one CUDA
        graph (``oasr.fast.ctc_graph``), whether or not the model step's preflight left it eager (the
        search reaches no kernel gap); otherwise the states stay on the host (the fast twin's CPU paths).
        A stand-in ``graph_capture`` (tests) drives the graphed search on the CPU, one capture per graph."""
        self.ctc_execution = None
        if self.ctc is None:
            return
        on_cuda = self.config.device.type == "cuda"
        wanted = bool(cuda_graphs) if cuda_graphs is not None else on_cuda
        if wanted and self.twin == "fast" and (on_cuda or capture is not None):
            factory = None if capture is None else type(capture)
            decoder = self.ops.StreamingCtcDecoder(self.ctc_config, device=self.config.device, cuda_graphs=True,
                                                   graph_capture=factory)
            self.ctc = self.ops.CtcStateCacheManager(decoder)
            # every cohort width's graph for a full chunk, now: no capture lands in a served tick
            # (a chunk of another length, or an unknown vocabulary, captures its graphs at first use)
            decoder.graphs.max_width = self.config.max_batch_size
            vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
            if isinstance(vocab, int):
                decoder.graphs.prepare(engine_widths(self.config.max_batch_size),
                                       self.chunk_input_frames // self.rate, vocab)
            self.ctc_execution = f"graphed on {self.config.device} (one graph per cohort width bucket and chunk)"
        else:
            self.ctc_execution = f"{self.twin} twin on the host ({self.ctc.decoder.__module__})"
        self.execution_note += f"; CTC search: {self.ctc_execution}"
        logger.info("StreamingEngine CTC search: %s", self.ctc_execution)

    # ---- input ---------------------------------------------------------------------------
    def _stream(self, stream_id) -> _Stream:
        if stream_id not in self._streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        return self._streams[stream_id]

    def add_stream(self, stream_id=None):
        """Register a stream (it waits for admission); returns its id."""
        stream_id = self._claim_id(stream_id)
        greedy = GreedyCtcDecoder(self.model.config.vocab_size) if self.decoder == "greedy" else None
        self._streams[stream_id] = _Stream(stream_id, greedy, arrival_tick=self.tick)
        self._waiting.append(stream_id)
        return stream_id

    def push(self, stream_id, features) -> None:
        """Append ``(T, input_dim)`` feature frames, any ``T >= 0``, to a stream's input."""
        self._check_open()
        s = self._stream(stream_id)
        if s.state == FINISHED:
            raise ValueError(f"stream {stream_id!r} has finished (finish_reason={s.finish_reason!r}); "
                             f"it takes no more input")
        if s.ended:
            raise ValueError(f"stream {stream_id!r}: push after end_stream")
        feats = torch.as_tensor(features)
        if feats.dim() != 2 or feats.shape[1] != self.input_dim:
            raise ValueError(f"stream {stream_id!r}: features must be (T, input_dim={self.input_dim}), "
                             f"got {tuple(feats.shape)}")
        if not feats.is_floating_point():
            raise ValueError(f"stream {stream_id!r}: features must be floating point, got {feats.dtype}")
        if not bool(torch.isfinite(feats).all()):
            raise ValueError(f"stream {stream_id!r}: features contain NaN or inf")
        if feats.shape[0]:
            s.pending.append(feats.detach().to("cpu", self.config.dtype))
            s.num_pending += feats.shape[0]

    def end_stream(self, stream_id) -> None:
        """No more input: the stream finishes once its buffered frames are encoded."""
        self._check_open()
        s = self._stream(stream_id)
        if s.ended:
            raise ValueError(f"stream {stream_id!r}: end_stream called twice")
        s.ended = True

    def cancel(self, stream_id) -> None:
        """Drop a stream at once, whatever its state: a waiting stream leaves the queue, an active one
        gives back its slot, its blocks and its decoder state, a stream being rescored drops its job,
        a finished one its result. The id is forgotten (it may be used again). A client that went away
        is the use: nothing of it stays in the engine. ``KeyError`` for an unknown id; nothing changes."""
        s = self._stream(stream_id)
        if s.state == ACTIVE:
            self._contexts.pop(stream_id).free()
            self.states.free_stream(stream_id)
            self._active.remove(stream_id)
        elif s.state == WAITING:
            self._waiting.remove(stream_id)
        elif s.state == RESCORING:
            self._rescoring = [(sid, job) for sid, job in self._rescoring if sid != stream_id]
        self.results.pop(stream_id, None)
        del self._streams[stream_id]

    def new_turn(self, stream_id, pending: torch.Tensor | None = None) -> StreamResult:
        """End the stream's current turn without closing the stream; returns the turn's ``StreamResult``.

        The turn's first pass is finalized (the CTC beam's best, as if the stream had ended here), its
        slot, blocks and decoder state go back to the pools, and the same id starts afresh: a new stream
        waiting for admission, positions from 0, holding the frames pushed but not yet encoded, or
        ``pending`` instead (``(T, input_dim)`` frames, e.g. those of ``buffered_input`` less a silence), and
        ended if the old one was. The turn's result is returned, not kept in ``results``. Raises
        ``ValueError`` for a finished stream or one being rescored, and with ``rescore=True`` (a turn's
        second pass is not run), ``KeyError`` for an unknown id; nothing changes on an error.
        """
        self._check_open()
        s = self._stream(stream_id)
        if self.rescore:
            raise ValueError("StreamingEngine.new_turn: not with rescore=True (a turn has no second pass)")
        if s.state not in (ACTIVE, WAITING) or s.session is not None:
            raise ValueError(f"stream {stream_id!r} is {s.state}{' (resumed, not yet admitted)' if s.session else ''}"
                             f"; only a running stream starts a new turn")
        if pending is not None:
            pending = torch.as_tensor(pending)
            if pending.dim() != 2 or pending.shape[1] != self.input_dim or not pending.is_floating_point() \
                    or not bool(torch.isfinite(pending).all()):
                raise ValueError(f"StreamingEngine.new_turn: pending must be finite float (T, input_dim="
                                 f"{self.input_dim}) frames, got {tuple(pending.shape)} {pending.dtype}")
            pending = [pending.detach().to("cpu", self.config.dtype)] if pending.shape[0] else []
            num_pending = sum(p.shape[0] for p in pending)
        else:
            pending, num_pending = s.pending, s.num_pending
        ended = s.ended
        outputs: dict = {}
        self._finish(s, "eos", outputs)  # clears pending, frees the caches
        result = self.results.pop(stream_id)
        greedy = GreedyCtcDecoder(self.model.config.vocab_size) if self.decoder == "greedy" else None
        fresh = self._streams[stream_id] = _Stream(stream_id, greedy, arrival_tick=self.tick)
        fresh.pending, fresh.num_pending, fresh.ended = pending, num_pending, ended
        self._waiting.append(stream_id)
        return result

    def buffered_input(self, stream_id) -> torch.Tensor:
        """A copy of the stream's feature frames pushed but not yet encoded, ``(T, input_dim)`` on the CPU."""
        s = self._stream(stream_id)
        if not s.pending:
            return torch.zeros(0, self.input_dim, dtype=self.config.dtype)
        return torch.cat(s.pending).clone()

    def admitted(self, stream_id) -> bool:
        """Whether the stream holds cache state that ``suspend`` can save: it is active, or it was
        resumed and waits to be admitted again. A new stream still waiting for its first admission, and
        a stream that is being rescored or has finished, hold none."""
        s = self._stream(stream_id)
        return s.state == ACTIVE or (s.state == WAITING and s.session is not None)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        """Streams that hold a slot now."""
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Streams with input ready that wait for admission."""
        return len(self._waiting)

    @property
    def active_ids(self) -> list:
        """The ids of the streams that hold a slot, in admission order."""
        return list(self._active)

    def status(self, stream_id) -> str:
        """``"waiting"``, ``"active"``, ``"rescoring"`` (first pass done, its caches freed, the attention
        rescoring job still running: ``rescore=True`` with a tick budget) or ``"finished"``."""
        return self._stream(stream_id).state

    @property
    def stream_ids(self) -> list:
        """Every stream the engine knows (waiting, active or finished), in the order they were added.

        A suspended stream is no longer known here; ``resume`` adds it again.
        """
        return list(self._streams)

    def input_ended(self, stream_id) -> bool:
        """Whether ``end_stream`` was called for the stream: it takes no more input.

        True from ``end_stream`` on, also while its buffered frames are still being
        encoded (``status`` tells when it has finished); ``KeyError`` for an unknown id.
        """
        return self._stream(stream_id).ended

    def result(self, stream_id) -> StreamResult:
        """A finished stream's ``StreamResult`` (``ValueError`` while it runs, ``KeyError`` for an unknown id)."""
        s = self._stream(stream_id)
        if s.state != FINISHED:
            raise ValueError(f"stream {stream_id!r} is {s.state}, not finished")
        return self.results[stream_id]

    @property
    def longest_extent(self) -> int:
        """Most K/V frames (history plus chunk) any stream's chunk has attended to so far."""
        return max((s.max_extent for s in self._streams.values()), default=0)

    def cohort_width(self, num_streams: int) -> int:
        """Rows of the forward for ``num_streams`` ready streams: next power of two, capped."""
        width = 1
        while width < num_streams:
            width *= 2
        return min(width, self.config.max_batch_size)

    def can_admit(self) -> bool:
        """A free slot, and free blocks for every active stream's remaining worst case plus one more."""
        if len(self._active) >= self.config.max_batch_size:
            return False
        if self.pool is None:  # fixed-extent state: a slot is all a stream needs
            return True
        per_stream = self.backend.blocks_per_stream  # every band's ceiling with per-layer windows
        held = sum(self.backend.blocks_held(sid) for sid in self._active)
        still_claimable = len(self._active) * per_stream - held
        return self.pool.num_free_blocks - still_claimable >= per_stream

    def _ready(self, s: _Stream) -> bool:
        return s.num_pending >= self.chunk_input_frames or s.ended

    def admission_order(self) -> list:
        """Waiting stream ids in the order the next admission considers them (see ``admission``).

        Resumed streams (still carrying their session) come first, in the order they were resumed.
        Then, ``"length"``: streams that have waited ``max_wait_time`` ticks or more (``tick -
        arrival_tick``, counted at the tick that admits), oldest first; then the rest by buffered
        feature frames, fewest first, ties in arrival order. ``"arrival"``: arrival order.
        """
        resumed = [sid for sid in self._waiting if self._streams[sid].session is not None]
        waiting = [sid for sid in self._waiting if self._streams[sid].session is None]
        if self.admission == "arrival":
            return resumed + waiting
        now = self.tick
        overdue = [sid for sid in waiting if now - self._streams[sid].arrival_tick >= self.max_wait_time]
        late = set(overdue)
        rest = sorted((sid for sid in waiting if sid not in late), key=lambda sid: self._streams[sid].num_pending)
        return resumed + overdue + rest

    # ---- the tick ------------------------------------------------------------------------
    def _admit(self) -> None:
        for sid in self.admission_order():
            s = self._streams[sid]
            if not self._ready(s) and s.session is None:
                continue  # nothing to encode yet: do not hold a slot for it (a resumed stream held one)
            if not self.can_admit():
                break  # every stream reserves the same worst case: if this one does not fit, none does
            self._contexts[sid] = self._allocate_caches(sid, s)
            self._waiting.remove(sid)
            self._active.append(sid)
            s.state = ACTIVE
            s.admitted_tick = self.tick

    def _take(self, s: _Stream, n: int) -> torch.Tensor:
        buffered = torch.cat(s.pending) if len(s.pending) > 1 else s.pending[0]
        taken, rest = buffered[:n], buffered[n:]
        s.pending = [rest] if rest.shape[0] else []
        s.num_pending -= n
        return taken

    def _finish(self, s: _Stream, reason: str, outputs: dict) -> None:
        """End the stream's first pass; it finishes now, or once its rescoring job is done."""
        tokens, nbest, job = list(s.partial), [], None
        if s.state == ACTIVE and self.ctc is not None:
            nbest = self._contexts[s.stream_id].get_decoder().finalize_stream()[0]
            tokens = list(nbest[0].tokens) if nbest else []
            s.first_pass = list(tokens)
            if self.rescore and nbest:
                job = RescoreJob(self.rescorer, self._kept_encoder_out(s), nbest, self.ctc_weight, self.ops)
            s.encoder_out = []
        elif s.greedy is not None:
            tokens = s.greedy.finalize()
        if s.state == ACTIVE:
            self._contexts.pop(s.stream_id).free()  # blocks, slots, and the decoder state back to its pool
            self.states.free_stream(s.stream_id)
            self._active.remove(s.stream_id)
        elif s.state == WAITING:
            self._waiting.remove(s.stream_id)
        s.pending, s.num_pending = [], 0
        if job is not None:
            s.state, s.finish_reason, s.nbest = RESCORING, reason, nbest
            self._rescoring.append((s.stream_id, job))
            return
        self._complete(s, reason, tokens, nbest, outputs)

    def _complete(self, s: _Stream, reason: str, tokens: list, nbest: list, outputs: dict) -> None:
        s.state, s.finish_reason = FINISHED, reason
        log_probs = None
        if self.keep_log_probs:
            V = self.model.config.vocab_size
            log_probs = torch.cat(s.log_probs) if s.log_probs else torch.zeros(0, V)
        self.results[s.stream_id] = StreamResult(
            s.stream_id, tokens, s.offset, s.input_frames, reason, log_probs, s.admitted_tick, self.tick, nbest,
            first_pass=s.first_pass if self.rescore else None,
        )
        out = outputs.setdefault(s.stream_id, StepOutput(s.stream_id, [], 0))
        out.finished, out.finish_reason = True, reason

    def _run_rescoring(self, outputs: dict) -> int:
        """Step 9: advance the rescoring jobs within the tick budget; returns the decoder steps run."""
        steps, start = 0, None
        while self._rescoring:
            if self.decode_steps_per_tick is not None and steps >= self.decode_steps_per_tick:
                break
            now = self.clock()
            if start is None:
                start = now
            elif self.max_tick_ms is not None and (now - start) * 1e3 >= self.max_tick_ms:
                break
            sid, job = self._rescoring[0]
            steps += 1
            if job.advance():
                self._rescoring.pop(0)
                s = self._streams[sid]
                tokens, _ = job.result()
                nbest, s.nbest = s.nbest, None
                self._complete(s, s.finish_reason, list(tokens), nbest, outputs)
        return steps

    def step(self) -> dict:
        """Run one tick; returns ``{stream_id: StepOutput}`` for every stream that produced or finished."""
        self._check_open()
        started = time.perf_counter()
        clock = self.stage_clock
        timed = clock.host["model"] + clock.host["decode"]
        self.tick += 1
        outputs: dict = {}
        # a waiting stream that ended with too little input for one encoder frame needs no admission
        for sid in list(self._waiting):
            s = self._streams[sid]
            if s.ended and s.num_pending < self.rate and s.session is None:  # a resumed one finishes from its state
                self._finish(s, "eos", outputs)
        self._admit()

        cohort, frames_in = [], []
        for sid in list(self._active):
            s = self._streams[sid]
            n = min(s.num_pending, self.chunk_input_frames)
            if n < self.chunk_input_frames and not s.ended:
                continue
            if n < self.rate:  # ended, nothing left that makes an encoder frame
                self._finish(s, "eos", outputs)
            elif self.backend.at_capacity(sid, n // self.rate):
                self._finish(s, "length", outputs)
            else:
                cohort.append(sid)
                frames_in.append(n)

        width, encoder_frames = 0, 0
        active = len(self._active)  # streams holding blocks while the cohort is in flight
        used, live = self._used_blocks(), sum(self.backend.history_frames(sid) for sid in self._active)
        if cohort:
            width = self.cohort_width(len(cohort))
            enc = [n // self.rate for n in frames_in]
            if self.att is not None:
                self.att.prepare_chunks_batched(cohort, enc)
            used = self._used_blocks()
            live += sum(enc)
            encoder_frames = sum(enc)
            self._forward(cohort, frames_in, enc, width, outputs)
        decode_steps = self._run_rescoring(outputs)
        self.stats.append(TickStats(
            tick=self.tick, cohort=len(cohort), width=width, active=active,
            waiting=sum(1 for sid in self._waiting if self._ready(self._streams[sid])),
            used_blocks=used, live_frames=live, encoder_frames=encoder_frames, input_frames=sum(frames_in),
            finished=sum(1 for o in outputs.values() if o.finished), decode_steps=decode_steps,
        ))
        clock.stream_chunks += len(cohort)
        clock.add("bookkeeping", time.perf_counter() - started - (clock.host["model"] + clock.host["decode"] - timed))
        return outputs

    def _forward(self, cohort: list, frames_in: list, enc: list, width: int, outputs: dict) -> None:
        for row, sid in enumerate(cohort):
            s = self._streams[sid]
            s.max_extent = max(s.max_extent, self.backend.history_frames(sid) + enc[row])
        clock, started = self.stage_clock, time.perf_counter()
        if self.att is None:
            log_probs, hidden = self._model_step_fixed_extent(cohort, frames_in)
        elif self.model_tick is not None:
            log_probs, hidden = self._model_step_fast(cohort, frames_in, enc, width)
        else:
            log_probs, hidden = self._model_step_reference(cohort, frames_in, enc, width)
        decoding = time.perf_counter()
        clock.add("model", decoding - started)
        self._keep_encoder_out(cohort, enc, hidden)
        chunks = [log_probs[row, : enc[row]] for row in range(len(cohort))]
        speech = None
        if self.emit_speech_probs:  # one op for the cohort
            from oasr.vad import ctc_speech_probability

            blank = self.ctc_config.blank_id if self.ctc_config is not None else 0
            speech = ctc_speech_probability(log_probs[: len(cohort), : max(enc)], blank)
        with clock.device_region("decode"):
            partials = self._decode(cohort, chunks)
        clock.add("decode", time.perf_counter() - decoding)
        clock.collect()
        for row, sid in enumerate(cohort):
            s = self._streams[sid]
            n = enc[row]
            s.offset += n
            s.input_frames += frames_in[row]
            if self.keep_log_probs:
                s.log_probs.append(chunks[row].clone())
            kept = _common_prefix(s.partial, partials[row])
            outputs[sid] = StepOutput(sid, partials[row][kept:], n, retracted=len(s.partial) - kept,
                                      partial=list(partials[row]),
                                      speech_probs=None if speech is None else speech[row, :n].clone())
            s.partial = list(partials[row])
            if s.ended and s.num_pending < self.rate:
                self._finish(s, "eos", outputs)

    def _model_region(self, width: int):
        monitor = self.tick_monitor
        return nullcontext() if monitor is None else monitor.region(f"tick {self.tick}, width {width}")

    def _model_step_fast(self, cohort: list, frames_in: list, enc: list, width: int) -> tuple:
        """Fill the pinned inputs on the host, then the capture-safe region: model step, commit, readback.

        Returns ``(log_probs, hidden)`` as float32 CPU tensors; ``hidden`` (the encoder output) only with
        ``rescore``, else None."""
        tick = self.model_tick
        xs, meta = tick.host_inputs(width)
        xs.zero_()
        values = np.zeros((width, 2), dtype=np.int64)
        for row, (sid, n) in enumerate(zip(cohort, frames_in, strict=True)):
            s = self._streams[sid]
            xs[row, :n] = self._take(s, n)
            values[row] = (s.offset, n)
        meta.numpy()[:] = values
        with self._model_region(width), self.stage_clock.device_region("model"):
            tick.run(cohort, width)
            self.att.commit_chunks_batched(cohort, enc)
        return tick.log_probs(width), (tick.hidden(width) if self.rescore else None)

    def _model_step_reference(self, cohort: list, frames_in: list, enc: list, width: int) -> tuple:
        """The reference twin's step: plain tensors through ``forward_chunk_paged`` (the oracle's way);
        returns ``(log_probs, hidden or None)`` like ``_model_step_fast``."""
        cfg = self.config
        pad = width - len(cohort)
        xs = torch.zeros((width, self.chunk_input_frames, self.input_dim), dtype=cfg.dtype)
        offsets = []
        for row, (sid, n) in enumerate(zip(cohort, frames_in, strict=True)):
            s = self._streams[sid]
            xs[row, :n] = self._take(s, n)
            offsets.append(s.offset)
        caches = self.att.get_paged_caches(cohort, pad_to=width)
        cnn_cache = self.cnn.get_cache(cohort, pad_to=width)
        views = self.states.views(cohort, pad_to=width)
        extra = {"with_hidden": True} if self.rescore else {}
        log_probs, _, new_cnn, *hidden = self.model.forward_chunk_paged(
            xs.to(cfg.device), offsets + [0] * pad, caches, cnn_cache, views, frames_in + [0] * pad, twin=self.ops,
            **extra,
        )
        self.att.commit_chunks_batched(cohort, enc)
        self.cnn.update(cohort, new_cnn, pad_to=width)
        return log_probs.float().cpu(), (hidden[0].float().cpu() if hidden else None)

    def _model_step_fixed_extent(self, cohort: list, frames_in: list) -> tuple:
        """A slot or stateful runtime's step: the cohort's features through ``backend.forward_step`` (the slot
        runtime pads to its width through the padding lane and may replay a graph; the stateful one runs at
        batch N). Returns ``(log_probs, None)``: the list API gives no encoder output. The slot runtime wraps
        its own device step (gather, step or replay, scatter) in ``tick_monitor``'s region; the stateful one
        captures nothing, so nothing of it is checked."""
        xs = torch.zeros((len(cohort), self.chunk_input_frames, self.input_dim), dtype=self.config.dtype)
        for row, (sid, n) in enumerate(zip(cohort, frames_in, strict=True)):
            xs[row, :n] = self._take(self._streams[sid], n)
        if hasattr(self.backend, "step_monitor"):
            self.backend.step_monitor = self.tick_monitor
        log_probs, _ = self.backend.forward_step(cohort, xs.to(self.config.device), frames_in)
        return log_probs.float().cpu(), None

    def _used_blocks(self) -> int:
        return 0 if self.pool is None else self.pool.num_used_blocks

    def _decode(self, cohort: list, chunks: list) -> list:
        """Decode the cohort's chunks; return each stream's best partial token list."""
        if self.ctc is None:
            for sid, lp in zip(cohort, chunks, strict=True):
                self._streams[sid].greedy.decode_chunk(lp)
            return [self._streams[sid].greedy.finalize() for sid in cohort]
        # one batched decoder call for the whole cohort; short last chunks are masked per row
        # inference mode: the search's temporaries skip autograd's bookkeeping (~15% of its CPU time); it
        # only writes into the states' existing buffers, so no inference tensor outlives the call
        with torch.inference_mode():
            self.ctc.decode_cohort(list(cohort), [lp.unsqueeze(0) for lp in chunks])
            return [list(rows[0].tokens) for rows in self.ctc.peek_cohort(list(cohort))]  # one read, whole cohort

    def run(self, max_ticks: int | None = None) -> dict:
        """Step until no tick makes progress (everything finished, or waiting for input).

        Returns ``{stream_id: StreamResult}`` for the streams that finished during the run.
        """
        finished = {}
        ticks = 0
        while max_ticks is None or ticks < max_ticks:
            outputs = self.step()
            ticks += 1
            for sid, out in outputs.items():
                if out.finished:
                    finished[sid] = self.results[sid]
            if not outputs and not self._progress_possible():
                break
        return finished

    def _progress_possible(self) -> bool:
        """Could another tick do anything without new input?"""
        if self._rescoring:
            return True
        for sid in self._active:
            s = self._streams[sid]
            if s.ended or s.num_pending >= self.chunk_input_frames:
                return True
        return any(self._ready(self._streams[sid]) or self._streams[sid].session is not None
                   for sid in self._waiting) and self.can_admit()

    # ---- sessions (oasr.sessions.format, .stream) --------------------------------------------------------
    def _claim_id(self, stream_id):
        """``stream_id``, or a fresh int id for None; ``ValueError`` if it is not an int or a str
        (``check_stream_id``) or is in use."""
        self._check_open()
        if stream_id is None:
            stream_id = next(self._ids)
            while stream_id in self._streams:
                stream_id = next(self._ids)
        else:
            check_stream_id(stream_id)
            if stream_id in self._streams:
                raise ValueError(f"stream id {stream_id!r} is already in use")
        return stream_id

    def _allocate_caches(self, sid, s: _Stream) -> StreamContext:
        """Admit ``sid`` in every cache: fresh, or carrying a resumed stream's state."""
        if s.session is not None:
            restore_stream(s.session, sid, self.att, [self.cnn, self.states], self.ctc)
            s.session = None
            return StreamContext(sid, self.att, self.cnn, self.ctc)
        ctx = StreamContext.allocate(sid, self.att, self.cnn, self.ctc, vocab_size=self.model.config.vocab_size)
        try:
            self.states.allocate_stream(sid)
        except Exception:
            ctx.free()
            raise
        return ctx

    @property
    def model_digest(self) -> bytes:
        """blake2b-256 of the model's weights, computed once: a session only resumes on the same model."""
        if getattr(self, "_model_digest", None) is None:
            self._model_digest = model_digest(self.model)
        return self._model_digest

    def suspend(self, stream_id) -> bytes:
        """Take a stream out of the engine as session bytes (``oasr.sessions.format``); its blocks and slot are freed.

        The session holds the stream's caches and what the engine keeps of it: unconsumed
        input, whether it ended, its counters, its partial hypothesis, (with
        ``keep_log_probs``) its log-probs so far and (with ``rescore``) the encoder output kept
        for the second pass. ``resume`` on any engine of the same model and geometry, and the
        same ``rescore`` setting, either twin, continues it exactly. An active stream, or a resumed
        one still waiting for admission, can be suspended; a stream never admitted holds no
        state yet and a finished one has nothing to continue (``ValueError``; nothing changes).
        A stream being rescored (``"rescoring"``) leaves with its job: the n-best, the scores and
        step so far, and the job's decoder K/V rows (before its first step, the encoder output).
        """
        self._check_open()
        refuse_unless_offered(type(self.backend), self.model, "sessions", "suspend")
        s = self._stream(stream_id)
        if s.state == RESCORING:
            return self._suspend_rescoring(s)
        if s.state == FINISHED or (s.state == WAITING and s.session is None):
            why = "has finished" if s.state == FINISHED else "was never admitted (it holds no cache state yet)"
            raise ValueError(f"stream {stream_id!r} {why}: only an admitted stream can be suspended")
        data = self._session_bytes(s)
        if s.state == ACTIVE:
            self._contexts.pop(stream_id).free()
            self.states.free_stream(stream_id)
            self._active.remove(stream_id)
        else:
            self._waiting.remove(stream_id)
        del self._streams[stream_id]
        return data

    def checkpoint(self, stream_id) -> bytes:
        """The session bytes ``suspend`` would return for the stream, taken without suspending it.

        The stream stays live, holding its blocks and slot; nothing of the engine changes. ``resume``
        of the bytes (after a crash, in another process) continues the stream from this point exactly
        as ``resume`` of ``suspend``'s bytes does. Refused (``ValueError``, nothing changes) for a stream
        ``suspend`` refuses and for one being rescored (its job is not copied: a server keeps its last
        checkpoint from before the rescoring began).
        """
        self._check_open()
        refuse_unless_offered(type(self.backend), self.model, "sessions", "checkpoint")
        s = self._stream(stream_id)
        if s.state not in (ACTIVE, WAITING) or (s.state == WAITING and s.session is None):
            why = {RESCORING: "is being rescored", FINISHED: "has finished"}.get(
                s.state, "was never admitted (it holds no cache state yet)")
            raise ValueError(f"stream {stream_id!r} {why}: only an admitted stream can be checkpointed")
        return self._session_bytes(s)

    def _session_bytes(self, s: _Stream) -> bytes:
        """The session of an active stream, or of a resumed one waiting for admission (nothing changes)."""
        pending = torch.cat(s.pending) if s.pending else torch.zeros(0, self.input_dim, dtype=self.config.dtype)
        log_probs = None
        if self.keep_log_probs:
            log_probs = torch.cat(s.log_probs) if s.log_probs else torch.zeros(0, self.model.config.vocab_size)
        greedy = s.greedy
        extra = EngineStream(
            s.stream_id, self.model_digest, self.input_dim, self.model.config.vocab_size, self.decoder, s.ended,
            s.offset, s.input_frames, s.max_extent, list(s.partial), pending, log_probs,
            list(greedy.tokens) if greedy else [], greedy._last if greedy else 0,
        )
        if s.state == ACTIVE:
            session = capture_stream(s.stream_id, self.att, [self.cnn, self.states], self.ctc, engine=extra)
        else:  # resumed, not admitted again yet: its session as read, with today's engine part
            session = dataclasses.replace(s.session, engine=extra)
        session.encoder_out = self._kept_encoder_out(s) if self.rescore else None
        return encode_session(session)

    def resume(self, data, stream_id=None):
        """Add a suspended stream back; it carries its state and is admitted ahead of new arrivals, as
        soon as there is room, whether or not it has input yet (module docstring).

        ``data`` is verified whole first (``oasr.sessions.format.read_session``: truncated, corrupt or
        foreign bytes raise ``SessionError`` naming what differs), then against this engine:
        geometry, K/V format, declared states, decoder and its configuration, the model's
        weights, and rescoring: a session carries the kept encoder output exactly when it was
        saved by an engine with ``rescore=True``, and only such an engine takes it (the second
        pass needs every encoder frame; the rescorer and ``ctc_weight`` are this engine's own).
        ``stream_id`` None takes the id the session was saved under (or a fresh one if
        that was neither an int nor a str); an id in use raises ``ValueError``. Nothing changes
        on an error. Admission then restores the caches (``oasr.sessions.stream.restore_stream``) in
        new slots and blocks; the stream goes on exactly as if it had never left. Returns its id.
        """
        self._check_open()
        refuse_unless_offered(type(self.backend), self.model, "sessions", "resume")
        session = read_session(data, expect=SessionGeometry.of(self.config))
        e = session.engine
        if e is None:
            raise SessionError("session has no engine stream section: it was saved from caches, not an engine "
                               "(use oasr.sessions.stream.load_stream)")
        if session.rescoring:
            return self._resume_rescoring(session, stream_id)
        rescoring = self._rescoring_difference(session)  # first: it also explains a differing n-best size
        if rescoring:
            raise SessionError(f"foreign session for this engine: {rescoring}")
        check_session(session, self.att, [self.cnn, self.states], self.ctc)
        mcfg = self.model.config
        wrong = [f"{name}: session {a!r}, here {b!r}" for name, a, b in (
            ("decoder", e.decoder, self.decoder), ("input_dim", e.input_dim, self.input_dim),
            ("vocab_size", e.vocab_size, mcfg.vocab_size), ("pending dtype", e.pending.dtype, self.config.dtype),
        ) if a != b]
        if e.model_digest != self.model_digest:
            wrong.append("model weights: the session ran on another model (digest differs)")
        beam = session.beam
        if beam is not None and (beam.batch, beam.vocab_size) != (1, mcfg.vocab_size):
            wrong.append(f"CTC state: {beam.batch} rows over {beam.vocab_size} tokens, the engine decodes 1 row "
                         f"over {mcfg.vocab_size}")
        if self.keep_log_probs and e.log_probs is None:
            wrong.append("log-probs: this engine keeps them, the session carries none")
        if e.input_frames != e.offset * self.rate:  # every chunk before a suspension is a whole one
            wrong.append(f"frame counts: {e.input_frames} feature frames consumed for offset {e.offset} encoder "
                         f"frames, this model makes one encoder frame of every {self.rate}")
        if wrong:
            raise SessionError("foreign session for this engine: " + "; ".join(wrong))
        need = -(-session.kv.seqlen // self.config.block_size_frames)
        if need > self.config.blocks_per_stream:  # admission could never restore it
            raise StreamCapacityError(stream_id if stream_id is not None else e.stream_id, need,
                                      self.config.blocks_per_stream)
        stream_id = self._claim_id(e.stream_id if stream_id is None else stream_id)
        greedy = None
        if self.decoder == "greedy":
            greedy = GreedyCtcDecoder(mcfg.vocab_size)
            greedy.tokens, greedy._last = list(e.greedy_tokens), e.greedy_last
        s = _Stream(stream_id, greedy, partial=list(e.partial), ended=e.ended, offset=e.offset,
                    input_frames=e.input_frames, max_extent=e.max_extent, session=session, arrival_tick=self.tick)
        if e.pending.shape[0]:
            s.pending, s.num_pending = [e.pending], e.pending.shape[0]
        if self.keep_log_probs and e.log_probs.shape[0]:
            s.log_probs = [e.log_probs]
        if self.rescore and session.encoder_out.shape[0]:
            s.encoder_out = [session.encoder_out]
        self._streams[stream_id] = s
        self._waiting.append(stream_id)
        return stream_id

    # ---- attention rescoring (U2/WeNet two-pass) ------------------------------------------------------
    def _setup_rescoring(self, rescore: bool, rescorer, ctc_weight: float) -> None:
        """With ``rescore=True`` a finished stream's CTC n-best is rescored by an attention decoder
        (``rescorer``, default a seeded ``AttentionDecoder`` over this encoder's hidden size):
        score = decoder log-likelihood + ``ctc_weight`` * CTC log-score. The model step returns the
        encoder output (the CTC head's input) beside the log-probs -- graphed, into the width's static
        output buffers -- so rescoring runs with or without CUDA graphs and reads the same values."""
        self.rescore, self.rescorer, self.ctc_weight = bool(rescore), None, float(ctc_weight)
        if not self.rescore:
            return
        if self.decoder != "beam":
            raise ValueError("StreamingEngine: rescore=True rescores the CTC n-best; it needs decoder='beam'")
        from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig

        cfg = self.model.config
        self.rescorer = rescorer or AttentionDecoder(DecoderConfig(vocab_size=cfg.vocab_size,
                                                                   encoder_dim=cfg.hidden_dim, seed=cfg.seed))
        if self.rescorer.config.vocab_size != cfg.vocab_size or self.rescorer.config.encoder_dim != cfg.hidden_dim:
            raise ValueError(
                f"StreamingEngine: the rescorer (vocab_size={self.rescorer.config.vocab_size}, encoder_dim="
                f"{self.rescorer.config.encoder_dim}) does not match the encoder (vocab_size={cfg.vocab_size}, "
                f"hidden_dim={cfg.hidden_dim})"
            )

    # ---- lifetime ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run: the engine holds no model and runs no more ticks."""
        return self.model is None

    def _check_open(self) -> None:
        if self.model is None:
            raise ValueError("StreamingEngine is closed: it holds no model (results stay readable)")

    def close(self) -> None:
        """Drop every reference to the model (the engine's own, its model step's, the rescorer).
        Idempotent. Finished streams' results stay readable; ``add_stream``, ``push``,
        ``end_stream``, ``step``, ``run``, ``suspend`` and ``resume`` raise ``ValueError`` from then on."""
        self.model = self.model_tick = self.rescorer = None

    def __enter__(self) -> StreamingEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _kept_encoder_out(self, s: _Stream) -> torch.Tensor:
        """The stream's kept encoder output so far, ``(offset, hidden_dim)`` fp32, for its session."""
        if s.encoder_out:
            return torch.cat(s.encoder_out)
        return torch.zeros(0, self.model.config.hidden_dim)

    @property
    def rescorer_digest(self) -> bytes:
        """blake2b-256 of the rescorer's weights: a job's decoder rows only resume on the same rescorer."""
        if getattr(self, "_rescorer_digest", None) is None:
            self._rescorer_digest = model_digest(self.rescorer)
        return self._rescorer_digest

    def _engine_stream(self, s: _Stream, pending: torch.Tensor) -> EngineStream:
        log_probs = None
        if self.keep_log_probs:
            log_probs = torch.cat(s.log_probs) if s.log_probs else torch.zeros(0, self.model.config.vocab_size)
        return EngineStream(s.stream_id, self.model_digest, self.input_dim, self.model.config.vocab_size,
                            self.decoder, s.ended, s.offset, s.input_frames, s.max_extent, list(s.partial), pending,
                            log_probs)

    def _suspend_rescoring(self, s: _Stream) -> bytes:
        """``suspend`` of a stream whose rescoring job runs: the job's state, no caches (they are freed)."""
        from oasr.sessions.decoder_rows import capture_dense

        i, job = next((i, job) for i, (sid, job) in enumerate(self._rescoring) if sid == s.stream_id)
        e = self._engine_stream(s, torch.zeros(0, self.input_dim, dtype=self.config.dtype))
        e.rescoring = RescoreProgress(s.finish_reason, list(s.first_pass), self.rescorer_digest, job.steps,
                                      list(s.nbest), job.scores.clone())
        session = StreamSession(SessionGeometry.of(self.config), None, [], engine=e)
        if job.steps:
            session.decoder_rows = capture_dense(job.kv)
        else:
            session.encoder_out = job._enc.float().cpu()
        data = encode_session(session)
        self._rescoring.pop(i)
        del self._streams[s.stream_id]
        return data

    def _resume_rescoring(self, session, stream_id):
        """``resume`` of a stream saved mid-rescoring: its job goes on here, after the jobs queued already."""
        e, job = session.engine, session.engine.rescoring
        wrong = []
        if not self.rescore:
            wrong.append("rescoring: the stream was suspended mid-rescoring, this engine does not rescore "
                         "(rescore=False)")
        else:
            if job.rescorer_digest != self.rescorer_digest:
                wrong.append("rescorer weights: the job ran on another attention decoder (digest differs)")
            if e.model_digest != self.model_digest:
                wrong.append("model weights: the session ran on another model (digest differs)")
            mcfg = self.model.config
            for name, a, b in (("decoder", e.decoder, self.decoder), ("input_dim", e.input_dim, self.input_dim),
                               ("vocab_size", e.vocab_size, mcfg.vocab_size)):
                if a != b:
                    wrong.append(f"{name}: session {a!r}, here {b!r}")
            if self.keep_log_probs and e.log_probs is None:
                wrong.append("log-probs: this engine keeps them, the session carries none")
            if session.encoder_out is not None and session.encoder_out.shape[0] != e.offset:
                wrong.append(f"encoder output: {session.encoder_out.shape[0]} frames for offset {e.offset}")
        if wrong:
            raise SessionError("foreign session for this engine: " + "; ".join(wrong))
        enc = None if session.encoder_out is None else session.encoder_out
        try:
            rescore = RescoreJob.resume(self.rescorer, job.nbest, self.ctc_weight, self.ops, job.steps, job.scores,
                                        enc=enc, rows=session.decoder_rows)
        except ValueError as exc:
            raise SessionError(f"foreign session for this engine: the rescoring job does not fit: {exc}") from None
        stream_id = self._claim_id(e.stream_id if stream_id is None else stream_id)
        s = _Stream(stream_id, None, state=RESCORING, partial=list(e.partial), ended=True, offset=e.offset,
                    input_frames=e.input_frames, max_extent=e.max_extent, finish_reason=job.finish_reason,
                    arrival_tick=self.tick, first_pass=list(job.first_pass), nbest=list(job.nbest))
        if self.keep_log_probs and e.log_probs.shape[0]:
            s.log_probs = [e.log_probs]
        self._streams[stream_id] = s
        self._rescoring.append((stream_id, rescore))
        return stream_id

    def _rescoring_difference(self, session) -> str:
        """Why ``session``'s rescoring state does not fit this engine ("" if it does)."""
        if session.encoder_out is None and self.rescore:
            return ("rescoring: this engine rescores (rescore=True), the session carries no kept encoder output "
                    "(it was saved with rescore=False), so the second pass would see part of the utterance")
        if session.encoder_out is not None and not self.rescore:
            return ("rescoring: the session carries the encoder output kept for attention rescoring (saved with "
                    "rescore=True), this engine does not rescore (rescore=False)")
        return ""

    def _keep_encoder_out(self, cohort: list, enc: list, hidden) -> None:
        if not self.rescore:
            return
        for row, sid in enumerate(cohort):
            self._streams[sid].encoder_out.append(hidden[row, : enc[row]].clone())
