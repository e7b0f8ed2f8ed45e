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
  width). A later CUDA-graph capture needs only those few shapes. On a CPU
  (no graphs) the ladder is finer (``oasr.engine.tick.engine_widths``: every
  width up to 8, then four per octave), since every padded row costs a
  stream's GEMM rows there.
* A resumed stream (``resume``) is admitted before every new arrival and as soon as there
  is room, input or not: it held a slot when it was suspended, so a suspension and resume
  between two ticks gives it its slot back before any other stream can take it.
* Bad input (unknown id, wrong feature shape, non-finite values, push after
  ``end_stream``, a stream id that is not an int or a str) raises before anything changes;
  no other stream is touched.
"""

from __future__ import annotations

import itertools
import logging
import time

from oasr.cache.config import CacheConfig
from oasr.cache.validate import same_device
from oasr.ctc.config import CtcDecoderConfig
from oasr.engine.decode_families import resolve_decode_family
from oasr.engine.stage_clock import StageClock
from oasr.engine.streaming.admission import AdmissionMixin
from oasr.engine.streaming.records import (
    ADMISSION_POLICIES,
    TickStats,
    refuse_unless_offered,
)
from oasr.engine.streaming.results import ResultsMixin
from oasr.engine.streaming.second_pass import SecondPassMixin
from oasr.engine.streaming.sessions import SessionsMixin
from oasr.engine.streaming.streams import StreamsMixin
from oasr.engine.streaming.ticks import TickMixin
from oasr.engine.streaming_backend import STREAMING_BACKENDS, check_streamable
from oasr.engine.tick import CPU_WIDTHS_PER_OCTAVE, FastModelTick, engine_widths
from oasr.models.twins import twin_module, twin_name

logger = logging.getLogger("oasr.engine")


class StreamingEngine(StreamsMixin, AdmissionMixin, TickMixin, ResultsMixin, SessionsMixin, SecondPassMixin):
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
        self.emit_log_probs = False  # StepOutput.log_probs: each tick's chunk (for a search outside the engine)
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
        # the cohort widths: the model step's (powers of two where graphs may be captured; the CPU's finer ladder)
        self.cohort_widths = (self.model_tick.widths if self.model_tick is not None else
                              engine_widths(self.config.max_batch_size, CPU_WIDTHS_PER_OCTAVE if not on_cuda else 1))
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
            path = getattr(self.ctc.decoder, "execution", None)  # the fast twin's: native (C++), or by size
            self.ctc_execution = (f"{self.twin} twin on the host ({self.ctc.decoder.__module__}"
                                  + (f", {path})" if path else ")"))
        self.execution_note += f"; CTC search: {self.ctc_execution}"
        logger.info("StreamingEngine CTC search: %s", self.ctc_execution)
