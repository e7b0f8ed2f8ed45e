"""Speech in, text out: the trained model served by ``StreamingEngine`` over the paged caches.

``Recognizer`` owns one engine. Audio reaches it stream by stream: ``open_stream()`` returns an
``AudioStream`` whose ``accept(pcm)`` checks the piece and copies it into the stream's PCM buffer;
``end()`` closes the input. ``step()`` first runs the front end for every stream whose buffered
audio completes a chunk, in one batched call (``oasr.asr.batched_fbank``: Kaldi's fbank, equal
to kaldi-native-fbank's within ``FBANK_TOLERANCE``), normalizes with the model's CMVN and pushes
the frames, then runs one engine tick (a chunk for every stream with enough audio, batched) and
updates each stream's partial transcript. ``stage_clock`` (the engine's ``StageClock``) adds up
where the time goes. ``transcribe(clips)`` is the whole loop for a list of files or PCM
arrays, at most ``max_streams`` at once.

Decoding is the engine's CTC prefix beam search, and, when the model names a language model
(``language_model="auto"``, the default; ``oasr.asr.word_pass``), the word search over the same log-probs,
whose words are the text; ``rescore=True`` instead adds the attention decoder's second pass over the CTC
n-best when a stream ends. ``full_context=True`` does not stream: each
utterance is encoded whole with unrestricted attention, then decoded the same way (the accuracy
ceiling the streaming configurations are measured against).

Per chunk the stream records the latency from the moment its last audio sample was accepted to the
moment the tick that turned it into a partial result returned (``AudioStream.latencies``).
A bad file or bad PCM is refused with ``AudioError`` before anything reaches the engine, so the
other streams are unaffected.

A live stream can leave and come back: ``suspend(id)`` returns bytes that hold everything the
stream is (the front end's unconsumed samples, its counters and partials, and the engine's session:
caches, buffered frames, beam state; with turns, the turn state: ``oasr.asr.turns``), ``resume(bytes)`` on
any recognizer of the same model and geometry continues it, to the transcript (and segments) it would have
had had it never left; ``cancel(id)`` drops a stream whose client went away. These are what a server's
shutdown and a replica's migration use. The blob's meta is version 1, 2 for a stream with turns (version 1
and the turn state: an older build refuses it rather than lose the turns), or 3 for a stream decoded by the
word search (its state, ``oasr.asr.word_pass``, and the turns if any); all three are read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from oasr.asr.audio import check_pcm, load_audio
from oasr.asr.batched_fbank import PcmBuffer, fbank_frames
from oasr.asr.checkpoint import default_model_path, load_checkpoint
from oasr.ctc.config import CtcDecoderConfig
from oasr.features.fbank import FRAME_LENGTH, FRAME_SHIFT, SAMPLE_RATE
from oasr.layers import Linear

# Recognizer(matmul_dtype=): the encoder's projections in fp32 (None, torch's numerics) or bfloat16
# (oasr.layers.Linear.set_compute_dtype; on a CPU with AVX512-BF16 ~3x the fp32 GEMM; bfloat16 rounding may
# change a word where two are close: one of the shipped model's 120 shipped clips, tests/test_capacity.py)
MATMUL_DTYPES = {None: None, "bfloat16": torch.bfloat16}
logger = logging.getLogger("oasr.asr")
STREAM_MAGIC = b"OASRAUD1"  # a suspended AudioStream (Recognizer.suspend)


@dataclass
class Transcript:
    """One finished utterance: its text, the first pass's text (differs only with rescoring), timings."""

    id: object
    text: str
    first_pass: str
    audio_seconds: float
    partials: list = field(default_factory=list)  # (audio seconds consumed, text) each time the text changed
    latencies: list = field(default_factory=list)  # seconds, one per chunk
    segments: list = field(default_factory=list)  # with endpointing: the turns (oasr.asr.segments.Segment)
    words: list = field(default_factory=list)  # oasr.asr.words.Word: the word search's, or the CTC alignment's
    # (none after rescoring)


class AudioStream:
    """One live utterance inside a ``Recognizer`` (from ``Recognizer.open_stream``).

    ``accept`` only checks the piece and copies it into the stream's ``PcmBuffer``; the fbank runs in
    the recognizer's next ``step``, batched over every stream whose buffered audio completes a chunk
    (``Recognizer._front_end``), or at once for this stream on ``end`` and ``suspend``.
    """

    def __init__(self, recognizer: Recognizer, stream_id):
        self.recognizer = recognizer
        self.id = stream_id
        self.pcm = PcmBuffer()
        self.input_finished = False  # end() was called: the last frames went in, the engine was told
        self.samples = 0
        self.frames_pushed = 0
        self.frames_done = 0  # feature frames turned into encoder output so far
        self.text = ""
        self.segments: list | None = None  # with turns (oasr.asr.turns): the finished turns; None without
        self.partials: list = []
        self.latencies: list = []
        self._arrivals: list = []  # (samples accepted so far, time they were sent)

    def accept(self, pcm, sample_rate: int = SAMPLE_RATE, sent_at: float | None = None) -> None:
        """Take the next piece of audio (mono samples at ``sample_rate``); ``AudioError`` for bad input,
        ``ValueError`` after ``end``. ``sent_at``: when the source sent it (``time.perf_counter`` of
        this machine; default now), the start of the latency of the chunk it completes."""
        started = time.perf_counter()
        if self.input_finished:
            raise ValueError(f"stream {self.id!r}: audio after end()")
        if self.recognizer.engine.status(self.id) == "finished":
            raise ValueError(f"stream {self.id!r} has finished; it takes no more audio")
        x = check_pcm(pcm, sample_rate, f"stream {self.id!r}") if np.asarray(pcm).size else np.zeros(0, np.float32)
        if x.size:
            self.pcm.append(x)
            self.samples += x.size
            self._arrivals.append((self.samples, started if sent_at is None else sent_at))
            self.recognizer._buffered.add(self.id)
        self.recognizer.stage_clock.add("ingest", time.perf_counter() - started)

    def end(self) -> None:
        """End the stream's audio: the last fbank frames go in and the engine finishes the stream."""
        started = time.perf_counter()
        if not self.input_finished:
            self.recognizer._push_frames([self], [self.pcm.frames_ready()])
            self.input_finished = True
            self.recognizer._buffered.discard(self.id)
        self.recognizer.stage_clock.add("front_end", time.perf_counter() - started)
        self.recognizer.engine.end_stream(self.id)

    def _advance(self, encoder_frames: int, now: float) -> None:
        """A tick turned ``encoder_frames`` more frames into output at ``now``: record the chunk's latency,
        counted from the piece that completed its audio (the first reaching past its last frame's window)."""
        if not encoder_frames:
            return
        rate = self.recognizer.encoder.config.subsampling_rate
        self.frames_done += encoder_frames * rate
        needed = FRAME_LENGTH + (self.frames_done - 1) * FRAME_SHIFT  # samples the chunk's last frame reads
        completing = next((t for samples, t in self._arrivals if samples >= needed), None)
        if completing is None and self._arrivals:
            completing = self._arrivals[-1][1]
        if completing is not None:
            self.latencies.append(now - completing)
        while len(self._arrivals) > 1 and self._arrivals[0][0] < needed:
            self._arrivals.pop(0)


class Recognizer:
    """A trained model behind one ``StreamingEngine``; see the module docstring."""

    def __init__(self, model_path=None, *, twin: str = "fast", device: str = "cpu", kv_cache_dtype=None,
                 chunk_size: int | None = None, num_left_chunks: int | None = None, rescore: bool = False,
                 full_context: bool = False, beam_size: int = 8, max_streams: int = 16, cuda_graphs=None,
                 max_seconds: float = 60.0, matmul_dtype: str | None = None, endpointing=None,
                 language_model="auto", word_config=None):
        if matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"Recognizer: matmul_dtype must be one of {sorted(MATMUL_DTYPES, key=str)}, "
                             f"got {matmul_dtype!r}")
        overrides = {k: v for k, v in (("chunk_size", chunk_size), ("num_left_chunks", num_left_chunks))
                     if v is not None}
        path = Path(model_path) if model_path is not None else default_model_path()
        self.encoder, self.decoder, self.spec, self.cmvn, self.info = load_checkpoint(path, **overrides)
        self.tokenizer = self.spec.tokenizer()
        self.device = torch.device(device)
        self.encoder.to(self.device)
        self.decoder.to(self.device)
        self.matmul_dtype = matmul_dtype
        for module in self.encoder.modules():  # before the engine: a CUDA graph captures the GEMMs as they are
            if isinstance(module, Linear):
                module.set_compute_dtype(MATMUL_DTYPES[matmul_dtype])
        self.rescore, self.full_context = bool(rescore), bool(full_context)
        self.ctc_config = CtcDecoderConfig(beam_size=beam_size, nbest=min(beam_size, 8) if rescore else 1)
        cfg = self.encoder.config
        frames = int(max_seconds * SAMPLE_RATE / FRAME_SHIFT) // cfg.subsampling_rate + cfg.chunk_size
        blocks_per_seq = -(-frames // cfg.chunk_size) + 1
        self.cache_config = cfg.cache_config(max_batch_size=max_streams, max_blocks_per_seq=blocks_per_seq,
                                             device=self.device, kv_cache_dtype=kv_cache_dtype)
        self.twin = twin
        from oasr.engine.streaming import StreamingEngine

        self.engine = StreamingEngine(self.encoder, self.cache_config, twin=twin, decoder="beam",
                                      ctc_config=self.ctc_config, rescore=self.rescore and not self.full_context,
                                      rescorer=self.decoder if self.rescore else None,
                                      ctc_weight=self.spec.ctc_weight, cuda_graphs=cuda_graphs)
        self.word_pass = self._word_pass(language_model, word_config)  # oasr.asr.word_pass, or None
        self.turns = None  # with endpointing: oasr.asr.turns.TurnTracker
        self.turns_by_default = endpointing is not None  # open_stream(turns=None) follows this
        if endpointing is not None:
            self.enable_endpointing(endpointing)
        self.streams: dict = {}
        self._buffered: set = set()  # ids of streams holding audio the front end has not turned into frames
        self.stage_clock = self.engine.stage_clock  # the engine's stages, and ingest, front end, delivery here
        self.busy_seconds = 0.0  # time spent in feature extraction and engine ticks

    def _word_pass(self, language_model, word_config):
        """The word pass ``language_model`` asks for: ``"auto"`` (the checkpoint's, if it names one and the
        recognizer streams its first pass), None (none), or an ``oasr.asr.language.LanguageSpec``."""
        from oasr.asr.language import LanguageSpec, recipe_lm, spec_from_info

        if language_model == "auto":
            spec = spec_from_info(self.info) if not self.rescore else None
        elif language_model is None or isinstance(language_model, LanguageSpec):
            spec = language_model
        else:
            raise ValueError(f"Recognizer: language_model must be 'auto', None or an oasr.asr.language.LanguageSpec, "
                             f"got {language_model!r}")
        if spec is None:
            if word_config is not None and language_model is None:
                raise ValueError("Recognizer: word_config needs a language model (language_model=None was given)")
            return None  # ("auto" for a model that names none: word_config is what a word search would use)
        if self.rescore:
            raise ValueError("Recognizer: the word search and rescore=True are two different second passes; "
                             "choose one (language_model=None to rescore)")
        from oasr.asr.word_pass import WordPass
        from oasr.ctc.words import WordSearchConfig

        if word_config is not None and not isinstance(word_config, WordSearchConfig):
            raise ValueError(f"Recognizer: word_config must be an oasr.ctc.words.WordSearchConfig, got {word_config!r}")
        frame_seconds = self.encoder.config.subsampling_rate * FRAME_SHIFT / SAMPLE_RATE
        word_pass = WordPass(spec, recipe_lm(spec, self.tokenizer.alphabet), self.tokenizer.symbols, word_config,
                             self.twin, frame_seconds)
        self.engine.emit_log_probs = True
        logger.info("Recognizer word search: %s", word_pass.execution)
        return word_pass

    @property
    def execution_note(self) -> str:
        """What runs, in one line: the engine's note (model step, CTC search) and the word search's path."""
        note = self.engine.execution_note
        if self.word_pass is not None:
            spec = self.word_pass.spec
            english = f" and the English examples x{spec.english_repeat}" if spec.english_repeat else ""
            note += (f"; word search: {self.word_pass.execution}, bigram of {spec.sentences:,} recipe sentences "
                     f"(seed {spec.seed}){english}, {len(self.word_pass.search.lm.words):,} words")
        return note

    def enable_endpointing(self, config=None) -> None:
        """Make live turns available (``config``: an ``oasr.vad.EndpointConfig``, default its defaults) to
        streams opened with ``open_stream(turns=True)``; a no-op once enabled. ``ValueError`` with
        ``rescore`` or ``full_context`` (turns cut the streaming first pass) or a config of another type."""
        if self.turns is not None:
            return
        if self.rescore or self.full_context:
            raise ValueError("Recognizer: endpointing works on the streaming first pass; it does not go with "
                             "rescore=True or full_context=True")
        from oasr.asr.turns import TurnTracker
        from oasr.vad import EndpointConfig

        self.turns = TurnTracker(config or EndpointConfig(), self.encoder.config.subsampling_rate,
                                 self.cache_config.max_batch_size, chunk_input_frames=self.engine.chunk_input_frames)
        self.engine.emit_speech_probs = True

    # ---- streaming -------------------------------------------------------------------------
    def open_stream(self, stream_id=None, turns: bool | None = None) -> AudioStream:
        """Start a stream on the engine (``stream_id`` or a fresh one) and return its ``AudioStream``.

        ``turns``: whether the endpointer cuts the stream into turns (``oasr.asr.turns``); None: as the
        recognizer was built (``endpointing=``). True on a recognizer built without it enables the default
        ``EndpointConfig`` (``enable_endpointing``; ``ValueError`` where it cannot, nothing opened)."""
        if turns is None:
            turns = self.turns_by_default
        if turns:
            self.enable_endpointing()
        sid = self.engine.add_stream(stream_id)
        stream = self.streams[sid] = AudioStream(self, sid)
        if self.word_pass is not None:
            self.word_pass.open(sid)
        if turns:
            self.turns.open(stream)
        return stream

    def cancel(self, stream_id) -> None:
        """Drop a live stream now (its client went away): its slot, blocks and beam state go back to the
        pools, nothing of it is kept. ``KeyError`` for an unknown id."""
        if stream_id not in self.streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        self.engine.cancel(stream_id)
        del self.streams[stream_id]
        self._buffered.discard(stream_id)
        if self.turns is not None:
            self.turns.drop(stream_id)
        if self.word_pass is not None:
            self.word_pass.drop(stream_id)

    def suspend(self, stream_id) -> bytes:
        """Take a live stream out of the recognizer as self-contained bytes (see ``resume``).

        The bytes hold the front end's unconsumed samples, the stream's counters, text and partials, and
        either the engine's session (a stream that has been admitted: ``StreamingEngine.suspend``) or,
        for one still waiting for its first admission, the feature frames it has buffered. A stream
        being rescored travels with its rescoring job (the engine's session carries it); a finished one
        cannot be suspended (``ValueError``, as the engine says); ``KeyError`` for an unknown id. Nothing
        changes on an error. Per-chunk latencies already measured stay with the caller's copy of the
        stream; arrival times do not travel (they are this process's clock)."""
        if stream_id not in self.streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        stream = self.streams[stream_id]
        turns = self.turns.state(stream, self.engine) if stream.segments is not None else None
        if self.engine.status(stream_id) == "waiting" and not self.engine.admitted(stream_id):
            feats = self.engine.buffered_input(stream_id).float().contiguous()
            kind, payload, ended = "features", feats.numpy().tobytes(), self.engine.input_ended(stream_id)
            self.engine.cancel(stream_id)
        else:
            kind, payload, ended = "session", self.engine.suspend(stream_id), None  # raises for a finished one
        blob = self._stream_blob(stream, kind, payload, ended, turns, self._word_snapshot(stream_id))
        del self.streams[stream_id]
        self._buffered.discard(stream_id)
        if stream.segments is not None:
            self.turns.drop(stream_id)
        if self.word_pass is not None:
            self.word_pass.drop(stream_id)
        return blob

    def checkpoint(self, stream_id) -> bytes:
        """The bytes ``suspend`` would return for a live stream, taken without suspending it.

        The stream goes on here untouched; ``resume`` of the bytes (in another process, after a crash)
        continues it from this point exactly, and its ``samples`` say which audio the caller must send
        again. ``ValueError`` for a stream being rescored or finished (``StreamingEngine.checkpoint``),
        ``KeyError`` for an unknown id; nothing changes on an error.
        """
        if stream_id not in self.streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        stream = self.streams[stream_id]
        if self.engine.status(stream_id) == "waiting" and not self.engine.admitted(stream_id):
            feats = self.engine.buffered_input(stream_id).float().contiguous()
            kind, payload, ended = "features", feats.numpy().tobytes(), self.engine.input_ended(stream_id)
        else:
            kind, payload, ended = "session", self.engine.checkpoint(stream_id), None
        turns = self.turns.state(stream, self.engine) if stream.segments is not None else None
        return self._stream_blob(stream, kind, payload, ended, turns, self._word_snapshot(stream_id))

    def _word_snapshot(self, stream_id) -> dict | None:
        return self.word_pass.snapshot(stream_id) if self.word_pass is not None else None

    def _stream_blob(self, stream: AudioStream, kind: str, payload: bytes, ended, turns: dict | None = None,
                     words: dict | None = None) -> bytes:
        meta = {"version": 1, "kind": kind, "stream_id": stream.id, "samples": stream.samples,
                "frames_pushed": stream.frames_pushed, "frames_done": stream.frames_done, "text": stream.text,
                "partials": [[t, text] for t, text in stream.partials], "fbank_finished": stream.input_finished,
                "input_ended": ended, "model": self.engine.model_digest.hex()}
        if turns is not None:  # version 2 = version 1 and the turns: an older build refuses them, never drops them
            meta["version"], meta["turns"] = 2, turns
        if words is not None:  # version 3: the word search's state (and the turns, if any)
            meta["version"], meta["words"] = 3, words
        body = json.dumps(meta).encode()
        tail = (b"" if stream.input_finished else stream.pcm.samples.astype(np.float32).tobytes())
        data = b"".join([STREAM_MAGIC, struct.pack("<I", len(body)), body, struct.pack("<Q", len(tail)), tail,
                         struct.pack("<Q", len(payload)), payload])
        return data + hashlib.blake2b(data, digest_size=32).digest()

    def resume(self, data, stream_id=None) -> AudioStream:
        """A stream suspended by ``suspend`` (here or on another recognizer of the same model and
        geometry), live again under ``stream_id`` (default: its own id); feed it the audio that follows.

        The bytes are verified whole (checksum, layout, model) before anything changes; corrupt,
        truncated or foreign bytes raise ``ValueError`` (``oasr.sessions.format.SessionError`` for the engine's
        part), an id in use ``ValueError``. Latencies start afresh (the resumed stream's first chunk is
        timed from the resume). A stream with turns comes back with them: ``ValueError`` where this recognizer's
        endpointing knobs differ or it cannot cut turns (rescoring, full context); a recognizer built without
        endpointing enables it with the stream's knobs."""
        meta, tail, payload = self._read_stream_blob(data)
        if not np.isfinite(tail).all():
            raise ValueError("Recognizer.resume: the stream's unconsumed audio holds NaN or infinite samples")
        turns = meta.get("turns")
        if turns is not None:  # a stream with turns: this recognizer must cut them as the one that saved it did
            self._check_turns(turns)
        words = self._check_words(meta.get("words"))
        if meta["kind"] == "session":
            sid = self.engine.resume(payload, stream_id)
        else:
            feats = np.frombuffer(payload, dtype=np.float32).reshape(-1, self.encoder.config.input_dim)
            sid = self.engine.add_stream(meta["stream_id"] if stream_id is None else stream_id)
            try:
                if len(feats):
                    self.engine.push(sid, torch.from_numpy(feats.copy()))
                if meta["input_ended"]:
                    self.engine.end_stream(sid)
            except Exception:
                self.engine.cancel(sid)
                raise
        stream = AudioStream(self, sid)
        stream.pcm.append(tail)
        stream.input_finished = bool(meta["fbank_finished"])
        if tail.size and not stream.input_finished:
            self._buffered.add(sid)
        stream.samples, stream.frames_pushed = meta["samples"], meta["frames_pushed"]
        stream.frames_done, stream.text = meta["frames_done"], meta["text"]
        stream.partials = [(t, text) for t, text in meta["partials"]]
        stream._arrivals = [(stream.samples, time.perf_counter())]
        if turns is not None:
            try:
                self.turns.restore(stream, turns, self.engine, self.encoder.config.input_dim)
            except ValueError:
                self.engine.cancel(sid)
                raise
        if words is not None:
            self.word_pass.install(sid, words)
        self.streams[sid] = stream
        return stream

    def _check_words(self, snapshot):
        """The saved word-search state, checked against this recognizer (``ValueError``: nothing changed)."""
        if (snapshot is None) != (self.word_pass is None):
            have = "has a word search" if self.word_pass is not None else "has no word search (language_model=None)"
            saved = "without" if snapshot is None else "with"
            raise ValueError(f"Recognizer.resume: the stream was decoded {saved} a word search and this recognizer "
                             f"{have}; resume it on one built like the one that suspended it")
        return None if snapshot is None else self.word_pass.check(snapshot)

    def _check_turns(self, turns) -> None:
        """A saved stream's turn state fits here (``ValueError`` otherwise, nothing changed); a recognizer
        without endpointing enables it with the saved stream's knobs."""
        from oasr.vad import EndpointConfig

        try:
            saved = EndpointConfig(**turns["knobs"]["endpoint"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"Recognizer.resume: the stream's endpointing config is malformed ({exc})") from None
        if self.turns is None:
            self.enable_endpointing(saved)  # ValueError with rescore / full context; its grid is the model's
        self.turns.check_state(turns, self.encoder.config.input_dim)

    def _read_stream_blob(self, data) -> tuple[dict, np.ndarray, bytes]:
        data = bytes(data)
        if len(data) < len(STREAM_MAGIC) + 4 + 16 + 32 or not data.startswith(STREAM_MAGIC):
            raise ValueError("Recognizer.resume: not a suspended stream (expected bytes from Recognizer.suspend, "
                             f"starting {STREAM_MAGIC!r}; got {len(data)} bytes starting {data[:8]!r})")
        body, digest = data[:-32], data[-32:]
        if hashlib.blake2b(body, digest_size=32).digest() != digest:
            raise ValueError("Recognizer.resume: the suspended stream is corrupt or truncated (checksum differs)")
        at = len(STREAM_MAGIC)
        try:
            (n,) = struct.unpack_from("<I", body, at)
            meta = json.loads(body[at + 4 : at + 4 + n])
            at += 4 + n
            (n,) = struct.unpack_from("<Q", body, at)
            tail = np.frombuffer(body[at + 8 : at + 8 + n], dtype=np.float32).copy()
            at += 8 + n
            (n,) = struct.unpack_from("<Q", body, at)
            payload = body[at + 8 : at + 8 + n]
            if at + 8 + n != len(body) or len(payload) != n:
                raise ValueError("lengths do not add up")
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"Recognizer.resume: malformed suspended stream ({exc})") from None
        version = meta.get("version")
        if version not in (1, 2, 3) or meta.get("kind") not in ("session", "features") or \
                (version == 2 and not isinstance(meta.get("turns"), dict)) or (version == 1 and "turns" in meta) or \
                (version == 3) != isinstance(meta.get("words"), dict) or \
                (version == 3 and not isinstance(meta.get("turns", {}), dict)):
            raise ValueError(f"Recognizer.resume: unknown suspended-stream version/kind "
                             f"({meta.get('version')!r}, {meta.get('kind')!r})")
        if meta["model"] != self.engine.model_digest.hex():
            raise ValueError("Recognizer.resume: the stream was suspended on another model (weights digest differs)")
        if meta["kind"] == "features" and len(payload) % (4 * self.encoder.config.input_dim):
            raise ValueError(f"Recognizer.resume: buffered features of {len(payload)} bytes are not whole "
                             f"{self.encoder.config.input_dim}-dim float32 frames")
        return meta, tail, payload

    def pool_usage(self) -> dict:
        """Blocks and slots in use now, and the streams live / waiting: what a server's metrics report."""
        pool, cfg = self.engine.pool, self.cache_config
        return {"blocks_used": cfg.max_num_blocks - pool.num_free_blocks, "blocks_total": cfg.max_num_blocks,
                "slots_used": self.engine.num_active, "slots_total": cfg.max_batch_size,
                "streams_active": self.engine.num_active, "streams_waiting": self.engine.num_waiting,
                "streams_open": len(self.streams)}

    def step(self, on_error=None) -> list:
        """One engine tick; returns the ``Transcript`` of every stream that finished in it.

        ``on_error(stream_id, exc)``: called for an exception raised while one stream's frames are pushed
        (the front end) or its output of the tick is taken (its text, timings, transcript), after which
        the other streams' are handled as usual; the caller drops that stream. Without it the exception propagates. An
        exception of the engine's batched tick itself always propagates (it names no stream)."""
        t0 = time.perf_counter()
        self._front_end(on_error)
        t1 = time.perf_counter()
        self.stage_clock.add("front_end", t1 - t0)
        outputs = self.engine.step()
        now = time.perf_counter()
        done = []
        for sid, out in outputs.items():
            try:
                stream = self.streams[sid]
                stream._advance(out.num_frames, now)
                if out.partial is not None and out.num_frames and self.word_pass is None:
                    text = self.tokenizer.decode(out.partial)
                    if text != stream.text:
                        stream.text = text
                        stream.partials.append((stream.frames_done * FRAME_SHIFT / SAMPLE_RATE, text))
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(sid, exc)
        words_seconds = 0.0
        if self.word_pass is not None:  # the word search counts as decode time (it is a search of the log-probs)
            started = time.perf_counter()
            self._advance_words(outputs, now, on_error)
            words_seconds = time.perf_counter() - started
            self.stage_clock.add("decode", words_seconds)
        if self.turns is not None:  # endpoints end turns (new engine streams) before finished streams are read
            self.turns.advance(self, outputs)
        for sid, out in outputs.items():
            try:
                if out.finished and sid in self.streams:  # (not one on_error dropped above)
                    done.append(self._finish(sid))
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(sid, exc)  # this stream's work failed; the others' outputs are still taken
        delivered = time.perf_counter()
        self.stage_clock.add("delivery", delivered - now - words_seconds)
        self.busy_seconds += delivered - t0
        return done

    def _advance_words(self, outputs: dict, now: float, on_error) -> None:
        """The word pass over this tick's chunks (one call), then each stream's live text from it."""
        live = {sid: out for sid, out in outputs.items() if sid in self.streams}
        try:
            ids = self.word_pass.advance(live)
        except Exception:
            if on_error is None:
                raise
            ids = []  # the call is all or nothing: no state moved; each stream again alone, so one bad chunk
            for sid, out in live.items():  # fails its own stream only
                try:
                    ids += self.word_pass.advance({sid: out})
                except Exception as exc:
                    on_error(sid, exc)
        for sid in ids:
            stream = self.streams[sid]
            text = self.word_pass.text(sid)
            if text != stream.text:
                stream.text = text
                stream.partials.append((stream.frames_done * FRAME_SHIFT / SAMPLE_RATE, text))

    def _front_end(self, on_error=None) -> None:
        """Turn buffered audio into pushed frames, batched, for every stream whose audio completes a chunk.

        A stream's frames wait in its ``PcmBuffer`` until, with the frames the engine already holds for
        it, they make a whole chunk (``engine.chunk_input_frames``): before that the engine could not
        encode them anyway. One fbank call for all of them (``fbank_frames``), one CMVN."""
        if not self._buffered:
            return
        chunk = self.engine.chunk_input_frames
        ready, counts = [], []
        for sid in self._buffered:
            stream = self.streams[sid]
            n = stream.pcm.frames_ready()
            if n and self.engine.status(sid) == "finished":  # ended early (finish_reason "length"): drop it
                stream.pcm.take_windows(n)
            elif n and stream.frames_pushed - stream.frames_done + n >= chunk:
                ready.append(stream)
                counts.append(n)
        if ready:
            self._push_frames(ready, counts, on_error)
        self._buffered = {sid for sid in self._buffered if sid in self.streams and self.streams[sid].pcm.frames_ready()}

    def _push_frames(self, streams: list, counts: list, on_error=None) -> None:
        """``counts[i]`` fbank frames of ``streams[i]``'s buffered audio, computed in one call, normalized, pushed
        (``on_error(stream_id, exc)`` as in ``step``: a push that fails is that stream's failure)."""
        if not sum(counts):
            return
        windows = np.concatenate([s.pcm.take_windows(n) for s, n in zip(streams, counts, strict=True)])
        feats = self.cmvn.normalize(fbank_frames(windows))
        start = 0
        for stream, n in zip(streams, counts, strict=True):
            if n:
                try:
                    mine = feats[start : start + n]
                    if stream.segments is not None:  # a new turn's leading silence never reaches the model
                        mine = self.turns.gate(stream, mine, windows[start : start + n])
                    if len(mine):
                        self.engine.push(stream.id, mine)
                    stream.frames_pushed += n
                except Exception as exc:
                    if on_error is None:
                        raise
                    on_error(stream.id, exc)  # this stream's frames failed; the others' still go in
                start += n

    def _finish(self, sid) -> Transcript:
        stream = self.streams.pop(sid)
        self._buffered.discard(sid)
        result = self.engine.result(sid)
        if self.word_pass is not None:
            offset = stream.turn_offset * FRAME_SHIFT / SAMPLE_RATE if stream.segments is not None else 0.0
            text, word_list = self.word_pass.finish(sid, offset)
            first = text
        else:
            text = self.tokenizer.decode(result.tokens)
            first = self.tokenizer.decode(result.first_pass) if result.first_pass is not None else text
            word_list = None
        segments = []
        if stream.segments is not None:  # the last turn becomes the last segment; the text is every turn's
            self.turns.close(stream, text, self.turns.words(self, stream, result) if word_list is None else word_list)
            segments = stream.segments
            text = first = self.turns.joined(stream)
            words = [w for seg in segments for w in seg.words]
        else:
            words = self._words(result, 0.0) if word_list is None else word_list
        if stream.partials and stream.partials[-1][1] != text:
            stream.partials.append((stream.samples / SAMPLE_RATE, text))
        return Transcript(sid, text, first, stream.samples / SAMPLE_RATE, stream.partials, stream.latencies,
                          segments, words)

    def _words(self, result, offset_seconds: float) -> list:
        """The words of an engine result with their times (none when rescoring changed the tokens)."""
        from oasr.asr.words import word_times

        best = result.nbest[0] if result.nbest else None
        if best is None or list(best.tokens) != list(result.tokens):
            return []
        frame_seconds = self.encoder.config.subsampling_rate * FRAME_SHIFT / SAMPLE_RATE
        return word_times(self.tokenizer, best.tokens, best.frames, frame_seconds, offset_seconds)

    # ---- whole clips ------------------------------------------------------------------------
    def transcribe(self, clips, piece_seconds: float = 0.32) -> list[Transcript]:
        """Transcripts of ``clips`` (paths or 16 kHz float PCM arrays), in order.

        Every clip is validated (read, resampled) before any reaches the engine. The audio is
        fed in ``piece_seconds`` pieces, as a live source would send it, to ``max_streams`` streams
        at a time.
        """
        audio = [load_audio(c) if isinstance(c, (str, Path)) else check_pcm(c, SAMPLE_RATE) for c in clips]
        if self.full_context:
            return [self.transcribe_full_context(pcm, i) for i, pcm in enumerate(audio)]
        piece = max(1, int(piece_seconds * SAMPLE_RATE))
        results: dict = {}
        queue = list(enumerate(audio))
        live: dict = {}  # stream id -> (index, pcm, samples fed)
        while queue or live or self.streams:
            while queue and len(live) < self.cache_config.max_batch_size:
                index, pcm = queue.pop(0)
                stream = self.open_stream()
                live[stream.id] = [index, pcm, 0]
            t0 = time.perf_counter()
            for sid, entry in list(live.items()):
                index, pcm, fed = entry
                if fed >= len(pcm):
                    continue  # input ended, the engine is still encoding what is buffered
                self.streams[sid].accept(pcm[fed : fed + piece])
                entry[2] = fed + piece
                if entry[2] >= len(pcm):
                    self.streams[sid].end()
            self.busy_seconds += time.perf_counter() - t0
            for transcript in self.step():
                index = live.pop(transcript.id)[0]
                transcript.id = index
                results[index] = transcript
        return [results[i] for i in range(len(audio))]

    @torch.no_grad()
    def transcribe_full_context(self, pcm, clip_id=0) -> Transcript:
        """Encode a whole utterance with unrestricted attention, then the same beam search (and rescoring)."""
        from oasr.features.fbank import fbank
        from oasr.models.attention_decoder import attention_rescore
        from oasr.reference import StreamingCtcDecoder

        t0 = time.perf_counter()
        x = self.cmvn.normalize(fbank(pcm))[None].to(self.device)
        hidden, _ = self.encoder.encode(x, chunk_size=max(1, x.shape[1]), num_left_chunks=-1)
        log_probs = torch.log_softmax(self.encoder.ctc(hidden), -1).float().cpu()
        decoder = StreamingCtcDecoder(self.ctc_config)
        state = decoder.create_state(1, log_probs.shape[-1])
        decoder.decode_chunk(state, log_probs)
        nbest = decoder.finalize_stream(state)[0]
        tokens = list(nbest[0].tokens) if nbest else []
        first = self.tokenizer.decode(tokens)
        if self.word_pass is not None:  # the whole utterance's log-probs through the word search
            text, words = self.word_pass.whole(log_probs[0])
            self.busy_seconds += time.perf_counter() - t0
            return Transcript(clip_id, text, text, len(pcm) / SAMPLE_RATE, words=words)
        if self.rescore and nbest:
            tokens, _ = attention_rescore(self.decoder, hidden[0], nbest, self.spec.ctc_weight)
        self.busy_seconds += time.perf_counter() - t0
        return Transcript(clip_id, self.tokenizer.decode(tokens), first, len(pcm) / SAMPLE_RATE)
