"""Live turns: the endpointer run over every stream's CTC speech probability, inside ``Recognizer``.

``Recognizer(endpointing=EndpointConfig(...))`` makes the engine report ``1 - p(blank)`` for each chunk it
encodes (``StreamingEngine.emit_speech_probs``; one op per cohort, from the log-probs the tick computes
anyway). ``TurnTracker`` feeds those probabilities to one ``EndpointerBank`` (a slot per open stream, a
cohort's equal-length chunks in one vector step) and, on a ``speech_stopped`` event, ends the stream's
turn: the engine's ``new_turn`` finalizes the CTC beam, frees the turn's caches and decoder state and
starts the same stream id afresh (positions from 0) with the frames not yet encoded. The turn's text
becomes a ``Segment`` (start and end in seconds from the stream's start: the endpointer's first and last
speech frames, shifted by the audio the earlier turns consumed). A stream's end closes its last turn
(``flush``). So a stream of any length holds the state of one turn at a time.

The shipped model is fragile with leading silence, so a turn's leading silence never reaches it: from a
stream's start and after every endpoint the stream is *gated*: feature frames whose audio window is below
``threshold_db`` (the file segmenter's energy threshold) are dropped, up to ``lead_frames`` before the first
frame above it; the frames the engine held unencoded at the endpoint go through the same gate. Dropped
frames count in the times (a segment's seconds are the stream's own). Digital and quiet silence cost nothing.

Per stream (on the ``AudioStream``): ``segments`` (finished turns, in order) and ``turn_events``, a queue
of ``(kind, seconds)`` / ``("segment", Segment)`` entries a server drains to tell its client when speech
started and stopped and what the turn said. Turn detection is live-stream policy: ``suspend``/``checkpoint``
of a stream with turns are refused (its turn state is not serialized).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from oasr.asr.segments import Segment, SegmenterConfig
from oasr.features.fbank import FRAME_SHIFT, SAMPLE_RATE
from oasr.vad import EndpointConfig, EndpointerBank


class TurnTracker:
    """The endpointer bank of a ``Recognizer`` and the bookkeeping of every stream's turns."""

    def __init__(self, config: EndpointConfig, subsampling_rate: int, max_streams: int,
                 threshold_db: float = SegmenterConfig.threshold_db, lead_frames: int = 5):
        if not isinstance(config, EndpointConfig):
            raise ValueError(f"Recognizer: endpointing must be an oasr.vad.EndpointConfig or None, got {config!r}")
        self.rate = subsampling_rate
        self.frame_seconds = subsampling_rate * FRAME_SHIFT / SAMPLE_RATE  # one encoder frame
        self.config = dataclasses.replace(config, frame_seconds=self.frame_seconds)  # the model's grid
        self.bank = EndpointerBank(self.config, max(1, max_streams))
        self.slots: dict = {}  # stream id -> bank slot
        self.free = list(range(self.bank.max_streams))
        self.threshold_db, self.lead_frames = float(threshold_db), int(lead_frames)

    def open(self, stream) -> None:
        """A new stream: a bank slot at frame 0, no segments."""
        if not self.free:
            size = self.bank.max_streams
            self.bank.grow(2 * size)
            self.free = list(range(size, 2 * size))
        slot = self.free.pop(0)
        self.bank.reset([slot])
        self.slots[stream.id] = slot
        stream.segments, stream.turn_events = [], []
        stream.turn_offset = 0  # feature frames the stream's earlier turns consumed
        stream.turn_started = None  # seconds, while a turn is open
        stream.gated, stream.gate_tail = True, None  # leading silence is dropped until speech
        stream.recent_db = np.zeros(0)  # the energies of the frames pushed lately (to gate the unencoded ones)

    def gate(self, stream, feats: torch.Tensor, windows: np.ndarray) -> torch.Tensor:
        """The frames of ``feats`` (their sample ``windows`` alongside) the engine should get now."""
        power = (np.asarray(windows, np.float64) ** 2).mean(axis=1)
        with np.errstate(divide="ignore"):
            db = 10.0 * np.log10(power)
        keep = self._gate_frames(stream, feats, db)
        stream.recent_db = np.concatenate([stream.recent_db, db[len(db) - len(keep):]])[-4096:]
        return keep

    def _gate_frames(self, stream, feats: torch.Tensor, db: np.ndarray) -> torch.Tensor:
        if not stream.gated:
            return feats
        tail_feats, tail_db = stream.gate_tail if stream.gate_tail is not None else (feats[:0], db[:0])
        feats, db = torch.cat([tail_feats, feats]), np.concatenate([tail_db, db])
        loud = np.flatnonzero(db > self.threshold_db)
        if not loud.size:  # all silence: keep the last few frames as the next turn's lead
            keep = max(0, len(feats) - self.lead_frames)
            stream.turn_offset += keep
            stream.frames_done += keep  # dropped: as good as encoded for the front end's bookkeeping
            stream.gate_tail = (feats[keep:], db[keep:])
            return feats[:0]
        start = max(0, int(loud[0]) - self.lead_frames)
        stream.turn_offset += start
        stream.frames_done += start
        stream.gated, stream.gate_tail = False, None
        return feats[start:]

    def drop(self, stream_id) -> None:
        """The stream left (cancelled, suspended, finished): its slot is free again."""
        slot = self.slots.pop(stream_id, None)
        if slot is not None:
            self.free.append(slot)

    def _seconds(self, stream, frame: int) -> float:
        return (stream.turn_offset + frame * self.rate) * FRAME_SHIFT / SAMPLE_RATE

    def advance(self, recognizer, outputs: dict) -> None:
        """Push this tick's speech probabilities; end the turns whose endpoint came (before the outputs of a
        finished stream are turned into its transcript, which closes its last turn itself)."""
        by_length: dict = {}
        for sid, out in outputs.items():
            if out.speech_probs is not None and out.num_frames and sid in self.slots:
                by_length.setdefault(out.num_frames, []).append(sid)
        for sids in by_length.values():
            probs = np.stack([outputs[sid].speech_probs.numpy() for sid in sids])
            events = self.bank.push([self.slots[sid] for sid in sids], probs)
            for sid in sids:
                for event in events.get(self.slots[sid], []):
                    self._on_event(recognizer, recognizer.streams[sid], event, outputs[sid].finished)
                    if event.kind == "speech_stopped":
                        break  # the rest of this chunk went to the turn that just ended

    def _on_event(self, recognizer, stream, event, finished: bool) -> None:
        if event.kind == "speech_started":
            stream.turn_started = self._seconds(stream, event.start_frame)
            stream.turn_events.append(("speech_started", stream.turn_started))
            return
        start, end = self._seconds(stream, event.start_frame), self._seconds(stream, event.end_frame)
        stream.turn_events.append(("speech_stopped", end))
        stream.turn_started = None
        if finished:  # the stream's own end closes this turn (its result is the engine's final one)
            stream.pending_segment = (start, end)
            return
        engine = recognizer.engine
        pending = engine.buffered_input(stream.id)
        # the unencoded frames go through the gate again (their energies are the last ones kept)
        db = stream.recent_db[len(stream.recent_db) - len(pending):] if len(pending) else stream.recent_db[:0]
        offset, done = stream.turn_offset, stream.frames_done  # (the gate moves the offset to the next turn's)
        stream.gated, stream.gate_tail = True, None
        keep = self._gate_frames(stream, pending, db)
        try:
            result = engine.new_turn(stream.id, keep)
        except Exception:
            stream.turn_offset, stream.frames_done = offset, done
            raise
        stream.recent_db = np.concatenate([stream.recent_db[: len(stream.recent_db) - len(pending)],
                                           db[len(db) - len(keep):]])
        words = recognizer._words(result, offset * FRAME_SHIFT / SAMPLE_RATE)
        self._add_segment(stream, start, end, recognizer.tokenizer.decode(result.tokens), words)
        stream.turn_offset += result.num_input_frames
        stream.text = ""
        self.bank.reset([self.slots[stream.id]])

    def words(self, recognizer, stream, result) -> list:
        """The turn's words with their times on the stream's clock (``Recognizer._words``)."""
        return recognizer._words(result, stream.turn_offset * FRAME_SHIFT / SAMPLE_RATE)

    def _add_segment(self, stream, start: float, end: float, text: str, words=()) -> None:
        if text:
            segment = Segment(round(start, 3), round(end, 3), text, tuple(words))
            stream.segments.append(segment)
            stream.turn_events.append(("segment", segment))

    def close(self, stream, text: str, words=()) -> None:
        """The stream ended with ``text`` in its last turn: that turn becomes its last segment."""
        span = getattr(stream, "pending_segment", None)
        if span is None and stream.id in self.slots:
            flushed = self.bank.flush([self.slots[stream.id]]).get(self.slots[stream.id], [])
            if flushed:
                span = (self._seconds(stream, flushed[0].start_frame), self._seconds(stream, flushed[0].end_frame))
                stream.turn_events.append(("speech_stopped", span[1]))
        if span is None:  # text with no turn detected (too little speech for the endpointer): the whole rest
            span = (stream.turn_offset * FRAME_SHIFT / SAMPLE_RATE, stream.samples / SAMPLE_RATE)
        self._add_segment(stream, *span, text, words)
        self.drop(stream.id)

    @staticmethod
    def joined(stream) -> str:
        """The stream's text over all its turns."""
        return " ".join(seg.text for seg in stream.segments)
