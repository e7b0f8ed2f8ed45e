"""``ServedTransducer``: a ``TransducerRecognizer`` behind the stream API the server drives.

``oasr.serve.worker.EngineWorker`` drives a ``Recognizer`` (``oasr.asr.recognizer``): ``open_stream`` returns a
stream with ``accept(pcm)`` / ``end()`` and the counters ``samples``, ``frames_done``, ``text``, ``latencies``;
``step(on_error)`` runs one tick and returns the ``Transcript`` of every stream that finished in it; ``cancel``,
``suspend``, ``checkpoint``, ``resume``; ``pool_usage()``, ``busy_seconds``, ``cache_config.max_batch_size``,
``tokenizer.encode``; and a few engine facts (``engine.stream_ids``, ``status``, ``input_ended``, ``cancel``,
``stats[-1].cohort``, ``num_active``, ``num_waiting``, ``tick``, ``execution_note``). This module gives a
Nemotron streaming checkpoint's ``TransducerRecognizer`` exactly that surface, so the server serves it unchanged.

Semantics, as ``Recognizer``'s:

- ``frames_done`` counts 10 ms feature frames the decoded chunks cover (the last chunk's zero padding excluded);
  ``text`` is the stream's text so far (partials: ``(audio seconds, text)`` each time it changed).
- ``latencies``: one per decoded chunk, seconds from the arrival of the piece holding the last sample the chunk's
  log-mel frames read (``accept(..., sent_at=)``: when its source sent it; default when ``accept`` took it) to
  the end of the tick that decoded it.
- ``stage_clock``: the transducer's (``model``, ``decode``), plus ``ingest`` (``accept``: the piece checked, its
  log-mel frames, the push; the front end runs per piece here, so ``front_end`` stays 0) and ``delivery`` (the
  tick's per-stream results).
- A stream finishes in the tick that decodes its last chunk (after ``end()``); its ``Transcript`` is returned by
  that ``step`` and it leaves ``streams``; the engine keeps it (``engine.stream_ids``) until ``engine.cancel``.
- ``suspend(sid)`` returns self-contained bytes (the transducer's suspended stream, which holds the encoder's
  caches or, before its first admission, its buffered features, and the predictor's slots, the front end's
  state and the tokens; plus this stream's counters and partials), safetensors-framed, nothing pickled.
  ``checkpoint(sid)`` is the same bytes with the stream left running: it is suspended and resumed at once (the
  encoder restores its caches at the next tick, bit for bit). A finished stream is refused (``ValueError``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from oasr.asr.audio import check_pcm
from oasr.features.fbank import FRAME_SHIFT, SAMPLE_RATE
from oasr.sessions.codec import read_tensor_blob

SERVED_FORMAT = "oasr-served-transducer-1"


@dataclass
class TransducerTick:
    """What the server reads of one tick: the streams it decoded (``cohort``); ``decode_steps`` is 0 (the
    transducer decodes inside the tick)."""

    cohort: int
    seconds: float
    decode_steps: int = 0


class TransducerAudioStream:
    """One live utterance inside a ``ServedTransducer`` (from ``open_stream`` or ``resume``)."""

    def __init__(self, served: ServedTransducer, stream_id):
        self.served = served
        self.id = stream_id
        self.samples = 0
        self.frames_done = 0  # 10 ms feature frames turned into decoded output so far
        self.text = ""
        self.partials: list = []
        self.latencies: list = []
        self.segments = None  # no turns: the transducer does not cut them (the server asks every stream)
        self._last_accept: float | None = None
        self._arrivals: deque = deque()  # (samples received after a piece, when it was sent), not yet timed

    def accept(self, pcm, sample_rate: int = SAMPLE_RATE, sent_at: float | None = None) -> None:
        """Take the next piece of audio (mono samples at ``sample_rate``); ``AudioError`` for bad input.
        ``sent_at``: when the source sent it (``time.perf_counter``; default now), where its chunk's latency starts."""
        started = time.perf_counter()
        if not np.asarray(pcm).size:
            self._last_accept = started
            return
        x = check_pcm(pcm, sample_rate, f"stream {self.id!r}")
        if x.size:
            self.served.rec.accept_audio(self.id, x)
            self.samples += x.size
            self._arrivals.append((self.samples, started if sent_at is None else sent_at))
        self._last_accept = started
        self.served.stage_clock.add("ingest", time.perf_counter() - started)

    def _arrival_of(self, sample_count: int) -> float | None:
        """When the piece that brought the stream to ``sample_count`` samples arrived (earlier pieces forgotten)."""
        while len(self._arrivals) > 1 and self._arrivals[0][0] < sample_count:
            self._arrivals.popleft()
        return self._arrivals[0][1] if self._arrivals else self._last_accept

    def end(self) -> None:
        """End the stream's audio: its last chunk (zero-padded to the chunk boundary) follows."""
        self.served.rec.end_stream(self.id)
        self.served._ended.add(self.id)


class _EngineFacts:
    """The engine-level facts the server reads, answered from the transducer and its encoder."""

    def __init__(self, served: ServedTransducer):
        self._served = served
        self.stats: list = []
        self.tick = 0

    @property
    def _rec(self):
        return self._served.rec

    @property
    def stream_ids(self) -> list:
        """Every stream the transducer holds (finished ones until ``cancel``)."""
        return self._rec.stream_ids

    def cancel(self, stream_id) -> None:
        """Forget a stream (finished or not); an id already gone is ignored (the server cancels every finished
        stream after taking its transcript)."""
        if stream_id in self._rec.stream_ids:
            self._rec.free_stream(stream_id)
        self._served.streams.pop(stream_id, None)
        self._served._ended.discard(stream_id)

    def input_ended(self, stream_id) -> bool:
        """Whether the stream's audio has ended."""
        return self._rec.ended(stream_id)

    def status(self, stream_id) -> str:
        """The encoder's status of the stream: ``waiting``, ``active`` or ``finished``."""
        return self._rec.encoder.status(stream_id)

    @property
    def num_active(self) -> int:
        """Streams admitted by the encoder (holding its slot and window blocks)."""
        return self._rec.encoder.num_active

    @property
    def num_waiting(self) -> int:
        """Streams open but not yet admitted by the encoder."""
        enc = self._rec.encoder
        return sum(enc.status(sid) == "waiting" for sid in self._rec.stream_ids)

    @property
    def execution_note(self) -> str:
        """One line the server prints at start: the model, its lookahead and chunk, and the encoder's path."""
        rec = self._rec
        note = getattr(rec.encoder, "execution_note", "eager")
        return (f"Nemotron RNN-T, lookahead {rec.lookahead} ({rec.lookaheads.latency_seconds(rec.lookahead) * 1e3:.0f}"
                f" ms chunks), greedy decoding, {note}")


class ServedTransducer:
    """``rec`` (a ``TransducerRecognizer`` over oasr's ``EncoderStreamingEngine``) as the server's recognizer."""

    def __init__(self, rec):
        self.rec = rec
        self.tokenizer = rec.tokenizer
        self.twin = rec.options.twin
        self.cache_config = SimpleNamespace(max_batch_size=rec.states.max_batch_size)
        self.engine = _EngineFacts(self)
        self.stage_clock = rec.stage_clock
        self.streams: dict = {}
        self._ended: set = set()  # streams whose audio ended, not finished yet
        self.busy_seconds = 0.0
        self._ids = 0

    @property
    def execution_note(self) -> str:
        """What runs, in one line (``Recognizer.execution_note``'s counterpart): the engine facts' note."""
        return self.engine.execution_note

    # ---- streams ---------------------------------------------------------------------------------------------
    def open_stream(self, stream_id=None) -> TransducerAudioStream:
        """Start a stream (``stream_id`` or a fresh one); ``ValueError`` for an id in use, the slot pool's error
        when every slot is taken (nothing registered then)."""
        if stream_id is None:
            while f"s{self._ids}" in self.rec.stream_ids:
                self._ids += 1
            stream_id = f"s{self._ids}"
        self.rec.add_stream(stream_id)
        stream = self.streams[stream_id] = TransducerAudioStream(self, stream_id)
        return stream

    def cancel(self, stream_id) -> None:
        """Drop a live stream now (its slots and blocks go back). ``KeyError`` for an unknown id."""
        if stream_id not in self.streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        self.engine.cancel(stream_id)

    def suspend(self, stream_id) -> bytes:
        """Take a live stream out as self-contained bytes (module docstring); ``KeyError`` for an unknown id,
        ``ValueError`` for a finished one (nothing changes on an error)."""
        if stream_id not in self.streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        if self.rec.finished(stream_id):
            raise ValueError(f"stream {stream_id!r} has finished; nothing to suspend")
        stream = self.streams[stream_id]
        inner = self.rec.suspend(stream_id)
        del self.streams[stream_id]
        self._ended.discard(stream_id)
        return self._blob(stream, inner)

    def checkpoint(self, stream_id) -> bytes:
        """The bytes ``suspend`` would return, the stream going on here (suspended and resumed at once)."""
        stream = self.streams.get(stream_id)
        data = self.suspend(stream_id)
        resumed = self.resume(data, stream_id)
        resumed.latencies, resumed._last_accept, resumed._arrivals = stream.latencies, stream._last_accept, \
            stream._arrivals
        return data

    def _blob(self, stream: TransducerAudioStream, inner: bytes) -> bytes:
        from safetensors.torch import save

        meta = {"format": SERVED_FORMAT, "samples": str(stream.samples), "frames_done": str(stream.frames_done),
                "partials": json.dumps([[t, text] for t, text in stream.partials])}
        return save({"transducer": torch.frombuffer(bytearray(inner), dtype=torch.uint8)}, metadata=meta)

    def resume(self, data, stream_id=None) -> TransducerAudioStream:
        """A stream from ``suspend``/``checkpoint`` bytes (of a recognizer of the same checkpoint and lookahead),
        live again under ``stream_id``; ``ValueError`` for foreign or corrupt bytes or an id in use."""
        tensors, meta = read_tensor_blob(data, "ServedTransducer.resume")
        if meta.get("format") != SERVED_FORMAT or "transducer" not in tensors:
            raise ValueError(f"ServedTransducer.resume: format {meta.get('format')!r}, expected {SERVED_FORMAT!r}")
        if stream_id is None:
            raise ValueError("ServedTransducer.resume: give the stream id to resume under")
        self.rec.resume(tensors["transducer"].numpy().tobytes(), stream_id)
        stream = TransducerAudioStream(self, stream_id)
        stream.samples, stream.frames_done = int(meta["samples"]), int(meta["frames_done"])
        stream.partials = [(t, text) for t, text in json.loads(meta["partials"])]
        stream.text = self.rec.text(stream_id)
        stream._last_accept = time.perf_counter()
        self.streams[stream_id] = stream
        if self.rec.ended(stream_id):
            self._ended.add(stream_id)
        return stream

    # ---- the tick ----------------------------------------------------------------------------------------------
    def step(self, on_error=None) -> list:
        """One tick (encode what is ready, decode it); the ``Transcript`` of every stream that finished in it.
        ``on_error(stream_id, exc)`` as ``Recognizer.step``: an exception taking one stream's output goes there
        and the others go on; the tick's own exception propagates."""
        from oasr.asr.recognizer import Transcript

        t0 = time.perf_counter()
        ran = self.rec.step()
        now = time.perf_counter()
        self.busy_seconds += now - t0
        self.engine.stats.append(TransducerTick(cohort=len(ran), seconds=now - t0))
        self.engine.tick += 1
        hop, reach = self.rec.lookaheads.hop, self.rec.frontend.config.n_fft // 2  # a frame's last sample: k*hop+reach
        done, delivering = [], time.perf_counter()
        # only a stream that ran, or whose audio ended, can change or finish in this tick
        touched = [sid for sid in self.streams if sid in ran or sid in self._ended]
        for sid in touched:
            try:
                stream = self.streams[sid]
                if sid in ran:
                    frames = self.rec.frames_encoded(sid)
                    stream.frames_done = frames * hop // FRAME_SHIFT
                    arrived = stream._arrival_of(min(max(frames - 1, 0) * hop + reach, stream.samples))
                    if arrived is not None:
                        stream.latencies.append(now - arrived)
                    text = self.rec.text(sid)
                    if text != stream.text:
                        stream.text = text
                        stream.partials.append((min(stream.frames_done * FRAME_SHIFT, stream.samples) / SAMPLE_RATE,
                                                text))
                if self.rec.finished(sid):
                    del self.streams[sid]
                    self._ended.discard(sid)
                    done.append(Transcript(sid, stream.text, stream.text, stream.samples / SAMPLE_RATE,
                                           stream.partials, stream.latencies))
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(sid, exc)
        self.stage_clock.add("delivery", time.perf_counter() - delivering)
        return done

    def pool_usage(self) -> dict:
        """Blocks and slots in use now, and the streams live / waiting (what a server's metrics report)."""
        enc = self.rec.encoder
        pool, cfg = getattr(enc, "pool", None), getattr(enc, "config", None)
        blocks = {}
        if pool is not None and cfg is not None:
            blocks = {"blocks_used": cfg.max_num_blocks - pool.num_free_blocks, "blocks_total": cfg.max_num_blocks}
        return {**blocks, "slots_used": self.engine.num_active, "slots_total": self.cache_config.max_batch_size,
                "streams_active": self.engine.num_active, "streams_waiting": self.engine.num_waiting,
                "streams_open": len(self.streams)}
