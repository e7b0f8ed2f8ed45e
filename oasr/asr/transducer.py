"""``TransducerRecognizer``: audio in, text out, for a Nemotron streaming (RNN-T) checkpoint directory.

Per stream: the checkpoint's log-mel front end (``oasr.features.NemoMel``, configured from its feature-extractor
file) fed piece by piece; the frames go to an encoder-streams object in chunks; every encoder frame a tick
returns is decoded by the ``rnnt_greedy`` family, batched over the tick's cohort, with the predictor's state in
slots (``TransducerSpec.state_specs()``, the twin's ``SlotStateCache``); the checkpoint's tokenizer
(``oasr.tokenizers.hf_json``) turns the ids into text.

**Lookahead** (the latency choice): ``lookahead`` must be one the checkpoint was trained with (its processor
file's ``supported_num_lookahead_tokens``; default its ``default_num_lookahead_tokens``). A chunk is then
``1 + s * lookahead`` log-mel frames first and ``s * (lookahead + 1)`` after (``s``: the subsampling factor),
``lookahead + 1`` encoder frames each; the latency is ``(lookahead + 1) * s * hop / rate`` seconds.

**End of stream** (where transformers leaves it to the caller): the clip's log-mel frames, then frames of
exactly 0.0 up to the next chunk boundary, encoded chunk by chunk, and every encoder frame decoded, the
padded ones too. A clip shorter than the first chunk follows the same rule (one padded first chunk).

**Device.** ``device`` (default the CPU) holds the encoder's pages, the transducer head and the predictor's slots.
On a CUDA device the fast twin captures CUDA graphs: the encoder's chunk step per cohort width
(``EncoderStreamingEngine``) and the RNN-T decode loop per (cohort width, chunk frames)
(``oasr.fast.rnnt_greedy.RnntGreedyGraphs``, eager off the GPU); the reference twin runs op by op.

**Stage clock.** ``stage_clock`` (``oasr.engine.stage_clock.StageClock``) adds up each tick's host seconds in
``model`` (the encoder's step) and ``decode`` (the batched RNN-T decode, the cohort's frames staged), with CUDA
events around both on a GPU, and counts the stream-chunks decoded; a caller adds its own stages.

The encoder is any object with ``add_stream(sid)``, ``push(sid, features (n, bins))``, ``end_stream(sid)``
and ``step() -> {sid: new encoder frames (n, hidden)}`` (``oasr.engine.encoder_streams.EncoderStreamingEngine``
for oasr's Nemotron encoder: :func:`oasr_encoder_streams`, the default); ``encoder_factory(directory,
lookahead)`` builds it.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from oasr.engine.decode_families import resolve_decode_family
from oasr.engine.stage_clock import StageClock, now
from oasr.features import NemoMel
from oasr.features.nemo_mel import OnlineNemoMel
from oasr.models.transducer import read_hf_transducer
from oasr.tokenizers import build_tokenizer

SUSPEND_FORMAT = "oasr-transducer-stream-1"


@dataclass(frozen=True)
class Lookaheads:
    """The checkpoint's trained lookaheads and the chunk geometry each implies."""

    supported: tuple
    default: int
    subsampling: int
    hop: int
    sample_rate: int

    @classmethod
    def from_checkpoint(cls, directory) -> Lookaheads:
        """Read ``processor_config.json`` (lookaheads, hop, rate) and ``config.json`` (subsampling factor)."""
        d = Path(directory)
        try:
            proc = json.loads((d / "processor_config.json").read_text())
            config = json.loads((d / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{d}: the processor or model config cannot be read ({exc})") from None
        supported = tuple(int(x) for x in proc.get("supported_num_lookahead_tokens") or (13, 6, 1, 0))
        default = int(proc.get("default_num_lookahead_tokens", supported[0]))
        fe = proc.get("feature_extractor") or {}
        sub = int((config.get("encoder_config") or {}).get("subsampling_factor", 8))
        return cls(supported, default, sub, int(fe.get("hop_length", 160)), int(fe.get("sampling_rate", 16000)))

    def check(self, lookahead: int) -> int:
        """``lookahead`` if the checkpoint was trained with it, else a one-line ``ValueError`` naming those it was."""
        if lookahead not in self.supported:
            raise ValueError(f"lookahead {lookahead} was not trained for this checkpoint; trained: "
                             f"{', '.join(map(str, self.supported))}")
        return int(lookahead)

    def chunk_frames(self, lookahead: int) -> tuple[int, int]:
        """Log-mel frames of the first chunk and of each later one."""
        return 1 + self.subsampling * lookahead, self.subsampling * (lookahead + 1)

    def latency_seconds(self, lookahead: int) -> float:
        """The chunk duration (and latency) ``lookahead`` implies, in seconds."""
        return (lookahead + 1) * self.subsampling * self.hop / self.sample_rate

    def describe(self) -> str:
        """One line per trained lookahead: its chunk duration (what ``--help`` and the demo print)."""
        return ", ".join(f"{r} ({self.latency_seconds(r) * 1000:.0f} ms chunks)" for r in self.supported)


@dataclass
class _Stream:
    mel: object
    frames_pushed: int = 0
    ended: bool = False
    chunks: list = field(default_factory=list)  # token ids decoded from each encoder chunk


class TransducerRecognizer:
    """Many streams of one checkpoint (see the module docstring)."""

    def __init__(self, directory, encoder_factory=None, lookahead: int | None = None, options=None,
                 max_batch_size: int = 8, kv_cache_dtype: str | None = None, device="cpu"):
        d = Path(directory)
        self.device = torch.device(device)
        self.lookaheads = Lookaheads.from_checkpoint(d)
        self.lookahead = self.lookaheads.check(self.lookaheads.default if lookahead is None else lookahead)
        self.head = read_hf_transducer(d).to(self.device)
        self.family, self.options = resolve_decode_family("rnnt_greedy", self, options)
        self.frontend = NemoMel.from_checkpoint(d)
        self.tokenizer = build_tokenizer("hf_json", d)
        if self.tokenizer.blank_id != self.head.spec.blank_id:
            raise ValueError(f"{d}: the tokenizer's blank id {self.tokenizer.blank_id} is not the model's "
                             f"{self.head.spec.blank_id}")
        self.twin = importlib.import_module(f"oasr.{self.options.twin}")
        if encoder_factory is None:
            self.encoder = oasr_encoder_streams(d, self.lookahead, self.options.twin, max_batch_size, kv_cache_dtype,
                                                self.device)
        elif kv_cache_dtype is not None:
            raise ValueError("TransducerRecognizer: kv_cache_dtype sets oasr's encoder pages; with your own "
                             "encoder_factory, set it there")
        else:
            self.encoder = encoder_factory(d, self.lookahead)
        rnnt = importlib.import_module(f"oasr.{self.options.twin}.rnnt_greedy")
        if self.options.twin == "fast":  # one CUDA graph per (width, chunk frames) on a GPU, eager elsewhere
            graphs = rnnt.RnntGreedyGraphs(self.head, self.options.max_symbols_per_step)
            self._decode = lambda head, enc, state, frames, max_symbols: graphs.run(enc, state, frames)
            self.rnnt_graphs = graphs
        else:
            self._decode = rnnt.decode_chunk
            self.rnnt_graphs = None
        self.states = self.twin.SlotStateCache(self.head.spec.state_specs(), max_batch_size, device=self.device)
        self.stage_clock = StageClock(self.device)
        self._streams: dict = {}

    @property
    def transducer(self):
        """The capability the ``rnnt_greedy`` family checks (``oasr.engine.decode_families``)."""
        return self.head

    # ---- input ---------------------------------------------------------------------------------------------
    def add_stream(self, stream_id) -> None:
        """Register a stream: a slot for its predictor state, a stream in the encoder, a fresh front end."""
        if stream_id in self._streams:
            raise ValueError(f"TransducerRecognizer: stream {stream_id!r} exists")
        self.states.allocate_stream(stream_id)  # raises when every slot is taken; nothing registered then
        try:
            self.encoder.add_stream(stream_id)
        except Exception:
            self.states.free_stream(stream_id)
            raise
        self._streams[stream_id] = _Stream(self.frontend.online())

    def accept_audio(self, stream_id, pcm) -> None:
        """More 16 kHz mono float samples of the stream."""
        s = self._stream(stream_id)
        if s.ended:
            raise ValueError(f"TransducerRecognizer: stream {stream_id!r} has ended; no more audio")
        self._push(stream_id, s, s.mel.accept(pcm))

    def end_stream(self, stream_id) -> None:
        """No more audio: the last log-mel frames, then 0.0 frames up to the chunk boundary (the end rule)."""
        s = self._stream(stream_id)
        if s.ended:
            return
        self._push(stream_id, s, s.mel.finish())
        first, rest = self.lookaheads.chunk_frames(self.lookahead)
        n = s.frames_pushed
        boundary = first if n <= first else first + -(-(n - first) // rest) * rest
        self._push(stream_id, s, np.zeros((boundary - n, self.frontend.num_bins), dtype=np.float32))
        s.ended = True
        self.encoder.end_stream(stream_id)

    def _push(self, stream_id, s: _Stream, frames: np.ndarray) -> None:
        if len(frames):
            self.encoder.push(stream_id, torch.from_numpy(np.ascontiguousarray(frames)))
            s.frames_pushed += len(frames)

    def _stream(self, stream_id) -> _Stream:
        if stream_id not in self._streams:
            raise KeyError(f"unknown stream id {stream_id!r}")
        return self._streams[stream_id]

    # ---- the tick ------------------------------------------------------------------------------------------
    def step(self) -> dict:
        """Encode what is ready and decode it, batched; returns ``{sid: the tokens this tick added}``."""
        clock = self.stage_clock
        t0 = now()
        with clock.device_region("model"):
            hidden = self.encoder.step()
        t1 = now()
        clock.add("model", t1 - t0)
        cohort = [sid for sid in hidden if sid in self._streams]
        if not cohort:
            return {}
        with clock.device_region("decode"):
            tokens = self._decode_cohort(cohort, hidden)
        clock.add("decode", now() - t1)
        clock.stream_chunks += len(cohort)
        return dict(zip(cohort, tokens, strict=True))

    def _decode_cohort(self, cohort: list, hidden: dict) -> list:
        """The RNN-T decode of the cohort's new encoder frames, batched; each stream's new tokens, in order."""
        rows = [hidden[sid] for sid in cohort]
        frames = [r.shape[0] for r in rows]
        # one (B, T, d) tensor where the encoder left its frames (the host, after a graphed step), then one copy
        enc = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(self.device, torch.float32)
        views = self.states.views(cohort)
        tokens, _, new = self._decode(self.head, enc, {k: v.gather() for k, v in views.items()}, frames,
                                      self.options.max_symbols_per_step)
        for k, v in views.items():
            v.scatter(new[k])
        for sid, toks in zip(cohort, tokens, strict=True):
            self._streams[sid].chunks.append(toks)
        return tokens

    def run(self, max_ticks: int = 100_000) -> None:
        """Tick until a tick encodes nothing."""
        for _ in range(max_ticks):
            if not self.step():
                return

    # ---- results -------------------------------------------------------------------------------------------
    def tokens(self, stream_id) -> list[int]:
        """Every token id decoded for the stream so far."""
        return [t for chunk in self._stream(stream_id).chunks for t in chunk]

    def chunk_tokens(self, stream_id) -> list[list[int]]:
        """The token ids decoded from each encoder chunk, in order (partial results, chunk by chunk)."""
        return [list(c) for c in self._stream(stream_id).chunks]

    def text(self, stream_id) -> str:
        """The text so far (a partial result mid-stream, the final text after the last chunk)."""
        return self.tokenizer.decode(self.tokens(stream_id))

    def transcribe(self, items, piece_seconds: float = 0.1) -> list:
        """Transcribe audio files or 16 kHz float arrays, up to ``max_batch_size`` at once, fed ``piece_seconds``
        at a time; one ``oasr.asr.recognizer.Transcript`` each (``partials``: audio seconds, text when it changed)."""
        from oasr.asr.audio import load_audio
        from oasr.asr.recognizer import Transcript

        clips = [load_audio(x) if isinstance(x, (str, Path)) else np.asarray(x, dtype=np.float32) for x in items]
        piece = max(1, int(piece_seconds * self.frontend.sample_rate))
        out: list = [None] * len(clips)
        width = self.states.max_batch_size
        for start in range(0, len(clips), width):
            wave = {f"clip{i}": i for i in range(start, min(start + width, len(clips)))}
            fed = dict.fromkeys(wave, 0)
            partials = {sid: [] for sid in wave}
            for sid in wave:
                self.add_stream(sid)
            while True:
                for sid, i in wave.items():
                    if fed[sid] < len(clips[i]):
                        self.accept_audio(sid, clips[i][fed[sid] : fed[sid] + piece])
                        fed[sid] += piece
                    if fed[sid] >= len(clips[i]):
                        self.end_stream(sid)
                ran = self.step()
                for sid in ran:
                    text = self.text(sid)
                    if not partials[sid] or partials[sid][-1][1] != text:
                        secs = min(fed[sid], len(clips[wave[sid]])) / self.frontend.sample_rate
                        partials[sid].append((secs, text))
                if not ran and all(self._streams[s].ended for s in wave):
                    break
            for sid, i in wave.items():
                text = self.text(sid)
                out[i] = Transcript(id=i, text=text, first_pass=text,
                                    audio_seconds=len(clips[i]) / self.frontend.sample_rate, partials=partials[sid])
                self.free_stream(sid)
        return out

    def suspend(self, stream_id) -> bytes:
        """Take the stream out: the encoder's suspended stream, the predictor's slot state, the front end's state
        and the tokens so far, as safetensors bytes (nothing pickled); its slot is freed. A stream the encoder has not
        admitted yet travels with its buffered features; a finished one is refused (``ValueError``, nothing changes)."""
        from safetensors.torch import save

        s = self._stream(stream_id)
        encoded = self.encoder.suspend(stream_id)
        tensors = {f"mel_{k}": v for k, v in s.mel.snapshot().items()}
        tensors.update({k: v.gather().cpu().contiguous() for k, v in self.states.views([stream_id]).items()})
        tensors["encoder"] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        meta = {"format": SUSPEND_FORMAT, "lookahead": str(self.lookahead), "frames_pushed": str(s.frames_pushed),
                "ended": str(int(s.ended)), "chunks": json.dumps(s.chunks)}
        self.states.free_stream(stream_id)
        del self._streams[stream_id]
        return save(tensors, metadata=meta)

    def resume(self, data: bytes, stream_id) -> None:
        """Put a suspended stream back (here or in another recognizer of the same checkpoint and lookahead); it
        goes on as if never stopped. One-line ``ValueError`` for foreign bytes or another lookahead."""
        import struct

        from safetensors.torch import load

        if stream_id in self._streams:
            raise ValueError(f"TransducerRecognizer: stream {stream_id!r} exists")
        try:
            data = bytes(data)
            tensors = load(data)
            (header_bytes,) = struct.unpack("<Q", data[:8])  # safetensors: the JSON header's length, then it
            meta = json.loads(data[8 : 8 + header_bytes]).get("__metadata__") or {}
        except Exception as exc:
            raise ValueError(f"TransducerRecognizer.resume: not a suspended stream ({exc})") from None
        if meta.get("format") != SUSPEND_FORMAT:
            raise ValueError(f"TransducerRecognizer.resume: format {meta.get('format')!r}, expected {SUSPEND_FORMAT!r}")
        if int(meta["lookahead"]) != self.lookahead:
            raise ValueError(f"TransducerRecognizer.resume: the stream ran at lookahead {meta['lookahead']}, this "
                             f"recognizer at {self.lookahead}")
        self.states.allocate_stream(stream_id)
        for name, view in self.states.views([stream_id]).items():
            view.scatter(tensors[name].to(self.device))
        self.encoder.resume(tensors["encoder"].numpy().tobytes(), stream_id)
        mel = OnlineNemoMel.restore(self.frontend, {k[4:]: v for k, v in tensors.items() if k.startswith("mel_")})
        self._streams[stream_id] = _Stream(mel, int(meta["frames_pushed"]), bool(int(meta["ended"])),
                                           json.loads(meta["chunks"]))

    def free_stream(self, stream_id) -> None:
        """Forget the stream and give its slot back, in the encoder too (its results go with it)."""
        self._stream(stream_id)
        self.states.free_stream(stream_id)
        del self._streams[stream_id]
        cancel = getattr(self.encoder, "cancel", None)
        if cancel is not None:
            cancel(stream_id)

    @property
    def stream_ids(self) -> list:
        """Every stream registered here (finished ones until ``free_stream``)."""
        return list(self._streams)

    def ended(self, stream_id) -> bool:
        """Whether the stream's audio has ended (``end_stream``)."""
        return self._stream(stream_id).ended

    def finished(self, stream_id) -> bool:
        """Whether the stream ended and every chunk of it was encoded and decoded (its text is final)."""
        return self._stream(stream_id).ended and self.encoder.finished(stream_id)

    def frames_encoded(self, stream_id) -> int:
        """Log-mel frames the chunks decoded so far cover (the zero padding of the last one excluded)."""
        s = self._stream(stream_id)
        if not s.chunks:
            return 0
        first, rest = self.lookaheads.chunk_frames(self.lookahead)
        return min(first + (len(s.chunks) - 1) * rest, s.frames_pushed)


def oasr_encoder_streams(directory, lookahead: int, twin: str = "fast", max_batch_size: int = 8,
                         kv_cache_dtype: str | None = None, device="cpu"):
    """oasr's Nemotron encoder of the checkpoint (``oasr.from_pretrained``) at ``lookahead``, served over paged
    caches on ``device`` (``kv_cache_dtype``: their page format, default the model dtype) by an
    ``EncoderStreamingEngine`` of ``max_batch_size`` slots (CUDA-graphed on a GPU with the fast twin)."""
    from oasr.checkpoints import from_pretrained
    from oasr.engine.encoder_streams import EncoderStreamingEngine

    encoder = from_pretrained(directory, lookahead=lookahead).model.to(device)
    config = encoder.cache_config(max_batch_size=max_batch_size, kv_cache_dtype=kv_cache_dtype, device=device)
    return EncoderStreamingEngine(encoder, config, twin=twin)


def transcribe_file(directory, pcm, encoder_factory=None, lookahead: int | None = None, piece: int = 4000) -> str:
    """One clip through a :class:`TransducerRecognizer`, fed ``piece`` samples at a time; its final text."""
    rec = TransducerRecognizer(directory, encoder_factory, lookahead)
    rec.add_stream(0)
    for i in range(0, len(pcm), piece):
        rec.accept_audio(0, pcm[i : i + piece])
        rec.step()
    rec.end_stream(0)
    rec.run()
    return rec.text(0)
