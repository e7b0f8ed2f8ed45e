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
frame above it; the frames the engine held unencoded at the endpoint go through the same gate. Frames of
digital silence (exact zeros) are never lead: between a pause of zeros and a noisy recording's own quiet
start the model hears a transition no training utterance has, and weights trained on random voices wrote a
short word there ("she the new yellow window": a 12.5-minute recording's live turns 2.86% WER with them as
lead against 1.27% without, the clips alone 0.53%). Dropped frames count in the times (a segment's seconds
are the stream's own). Digital and quiet silence cost nothing.

Per stream (on the ``AudioStream``): ``segments`` (finished turns, in order) and ``turn_events``, a queue
of ``(kind, seconds)`` / ``("segment", Segment)`` entries a server drains to tell its client when speech
started and stopped and what the turn said.

A stream with turns can be suspended and checkpointed like any other (``Recognizer.suspend``/``checkpoint``):
``TurnTracker.state`` is everything the turn logic holds for it (its endpointer slot's counters, the audio the
earlier turns consumed, the open turn's start, the gate's state and held-back frames, the energies of the frames
the engine holds, the segments and the events not yet drained, and the knobs that decide future endpoints) as
a JSON-able dict; ``restore`` puts it back on a stream of another recognizer, which then cuts the same turns at
the same times as had the stream never left. ``check_state`` refuses a malformed one before anything changes.
"""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import torch

from oasr.asr.segments import Segment, SegmenterConfig
from oasr.asr.words import Word
from oasr.features.fbank import FRAME_SHIFT, SAMPLE_RATE
from oasr.vad import EndpointConfig, EndpointerBank

BANK_FIELDS = ("frame", "in_turn", "run", "start", "last_end")  # one endpointer slot's counters


class TurnTracker:
    """The endpointer bank of a ``Recognizer`` and the bookkeeping of every stream's turns."""

    def __init__(self, config: EndpointConfig, subsampling_rate: int, max_streams: int,
                 threshold_db: float = SegmenterConfig.threshold_db, lead_frames: int = 5,
                 chunk_input_frames: int = 128):
        if not isinstance(config, EndpointConfig):
            raise ValueError(f"Recognizer: endpointing must be an oasr.vad.EndpointConfig or None, got {config!r}")
        self.rate = subsampling_rate
        self.frame_seconds = subsampling_rate * FRAME_SHIFT / SAMPLE_RATE  # one encoder frame
        self.config = dataclasses.replace(config, frame_seconds=self.frame_seconds)  # the model's grid
        self.bank = EndpointerBank(self.config, max(1, max_streams))
        self.slots: dict = {}  # stream id -> bank slot
        self.free = list(range(self.bank.max_streams))
        self.threshold_db, self.lead_frames = float(threshold_db), int(lead_frames)
        # encoded frames a stream keeps for the next turn: the chunk an endpoint fires in, and the silence before it
        self.keep_frames = int(chunk_input_frames) + self.config.min_silence_frames * self.rate

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
        stream.turn_offset = 0  # feature frames (stream clock) before the open turn's first frame
        stream.turn_started = None  # seconds, while a turn is open
        stream.gated, stream.gate_tail = True, None  # leading silence is dropped until speech
        # the open turn's last frames given to the engine (its frame turn_pushed - len(recent) onwards, the
        # engine's unencoded ones last) and their energies: an endpoint gives the next turn those after its cut
        stream.turn_pushed = 0
        stream.recent = torch.zeros(0, 0)
        stream.recent_db = np.zeros(0)

    def gate(self, stream, feats: torch.Tensor, windows: np.ndarray) -> torch.Tensor:
        """The frames of ``feats`` (their sample ``windows`` alongside) the engine should get now."""
        power = (np.asarray(windows, np.float64) ** 2).mean(axis=1)
        with np.errstate(divide="ignore"):
            db = 10.0 * np.log10(power)
        keep, keep_db = self._gate_frames(stream, feats, db)
        self._pushed(stream, keep, keep_db)
        return keep

    def _pushed(self, stream, feats: torch.Tensor, db: np.ndarray) -> None:
        if len(feats):
            stream.recent = torch.cat([stream.recent, feats]) if len(stream.recent) else feats.clone()
            stream.recent_db = np.concatenate([stream.recent_db, db])
            stream.turn_pushed += len(feats)

    def _gate_frames(self, stream, feats: torch.Tensor, db: np.ndarray) -> tuple:
        if not stream.gated:
            return feats, db
        tail_feats, tail_db = stream.gate_tail if stream.gate_tail is not None else (feats[:0], db[:0])
        feats, db = torch.cat([tail_feats, feats]), np.concatenate([tail_db, db])
        loud = np.flatnonzero(db > self.threshold_db)
        if not loud.size:  # all silence: keep the last few frames as the next turn's lead
            keep = max(0, len(feats) - self.lead_frames)
            stream.turn_offset += keep
            stream.frames_done += keep  # dropped: as good as encoded for the front end's bookkeeping
            stream.gate_tail = (feats[keep:], db[keep:])
            return feats[:0], db[:0]
        start = max(0, int(loud[0]) - self.lead_frames)
        while start < loud[0] and db[start] == -np.inf:  # digital silence is never lead (see the module doc)
            start += 1
        stream.turn_offset += start
        stream.frames_done += start
        stream.gated, stream.gate_tail = False, None
        return feats[start:], db[start:]

    def drop(self, stream_id) -> None:
        """The stream left (cancelled, suspended, finished): its slot is free again."""
        slot = self.slots.pop(stream_id, None)
        if slot is not None:
            self.free.append(slot)

    def _seconds(self, stream, frame: int) -> float:
        return (stream.turn_offset + frame * self.rate) * FRAME_SHIFT / SAMPLE_RATE

    def cut_frame(self, event) -> int:
        """The encoder frame of the ending turn where the next turn's audio starts: where the endpoint fired
        (``min_silence_frames`` after the turn's last speech), or where a turn at its maximum length was cut.

        The rest of the chunk the endpoint fired in (encoded into the ending turn) goes to the next turn
        again, through the gate: its silence is dropped, and speech that began there (the next sentence,
        which the ending turn's CTC often leaves blank) is encoded from its start."""
        if event.reason == "silence":
            return event.end_frame + self.config.min_silence_frames
        return event.end_frame

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
                stream = recognizer.streams[sid]
                for event in events.get(self.slots[sid], []):
                    self._on_event(recognizer, stream, event, outputs[sid].finished)
                    if event.kind == "speech_stopped":
                        break  # the rest of this chunk goes to the next turn (encoded again there)
                else:
                    self._trim(recognizer, stream)

    def _trim(self, recognizer, stream) -> None:
        """Keep of the frames pushed in this turn the engine's unencoded ones and ``keep_frames`` before."""
        if stream.id not in recognizer.engine.stream_ids:
            return
        keep = recognizer.engine.num_buffered(stream.id) + self.keep_frames
        if len(stream.recent) > keep:
            stream.recent, stream.recent_db = stream.recent[-keep:].clone(), stream.recent_db[-keep:].copy()

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
        cut = self.cut_frame(event)
        # the frames after the cut (encoded into the ending turn, or not yet encoded) start the next turn
        first = stream.turn_pushed - len(stream.recent)  # the turn's frame index of recent[0]
        at = min(max(cut * self.rate, first), stream.turn_pushed)
        encoded_after = max(0, stream.turn_pushed - engine.num_buffered(stream.id) - at)
        again, again_db = stream.recent[at - first :], stream.recent_db[at - first :]
        offset, done, gate = stream.turn_offset, stream.frames_done, (stream.gated, stream.gate_tail)
        stream.gated, stream.gate_tail = True, None
        keep, keep_db = self._gate_frames(stream, again, again_db)  # (moves the offset past a dropped silence)
        try:
            result = engine.new_turn(stream.id, keep)
        except Exception:
            stream.turn_offset, stream.frames_done, (stream.gated, stream.gate_tail) = offset, done, gate
            raise
        if recognizer.word_pass is not None:  # the word search's words that began before the cut
            text, words = recognizer.word_pass.cut(stream.id, cut, offset * FRAME_SHIFT / SAMPLE_RATE)
        else:
            tokens, words = self._turn_words(recognizer, result, cut, offset)
            text = recognizer.tokenizer.decode(tokens)
        self._add_segment(stream, start, end, text, words)
        stream.turn_offset += at
        stream.frames_done -= encoded_after  # encoded in the ending turn and again in the next
        stream.recent, stream.recent_db, stream.turn_pushed = stream.recent[:0], stream.recent_db[:0], 0
        self._pushed(stream, keep, keep_db)
        stream.text = ""
        self.bank.reset([self.slots[stream.id]])

    def _turn_words(self, recognizer, result, cut: int, offset: int) -> tuple:
        """The ending turn's tokens emitted before frame ``cut`` (those after belong to the next turn, which
        encodes their audio again) and their words on the stream's clock."""
        from oasr.asr.words import word_times

        best = result.nbest[0] if result.nbest else None
        if best is None or list(best.tokens) != list(result.tokens):
            return list(result.tokens), []
        n = sum(1 for f in best.frames if f < cut)
        tokens, frames = list(best.tokens[:n]), list(best.frames[:n])
        return tokens, word_times(recognizer.tokenizer, tokens, frames, self.frame_seconds,
                                  offset * FRAME_SHIFT / SAMPLE_RATE)

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

    # ---- saving and restoring a stream's turns ----------------------------------------------------------------
    def knobs(self) -> dict:
        """What decides a stream's future endpoints: the endpointer's config on the model's grid, the gate's."""
        return {"endpoint": dataclasses.asdict(self.config), "threshold_db": self.threshold_db,
                "lead_frames": self.lead_frames}

    def state(self, stream, engine) -> dict:
        """Everything the turn logic holds for ``stream``, JSON-able (floats exact: arrays as base64 bytes)."""
        slot = self.slots[stream.id]
        tail = None
        if stream.gate_tail is not None:
            feats, db = stream.gate_tail
            tail = {"feats": _pack(feats.float().numpy(), np.float32), "frames": int(feats.shape[0]),
                    "db": _pack(db, np.float64)}
        encoded = len(stream.recent) - engine.num_buffered(stream.id)  # the rest travels as the engine's input
        return {"knobs": self.knobs(),
                "bank": {name: int(getattr(self.bank, name)[slot]) for name in BANK_FIELDS},
                "turn_offset": int(stream.turn_offset), "turn_started": stream.turn_started,
                "gated": bool(stream.gated), "gate_tail": tail, "turn_pushed": int(stream.turn_pushed),
                "recent": _pack(stream.recent[:encoded].float().numpy(), np.float32), "recent_frames": encoded,
                "recent_db": _pack(stream.recent_db, np.float64),
                "segments": [_segment_json(seg) for seg in stream.segments],
                "events": [[kind, _segment_json(value) if kind == "segment" else value]
                           for kind, value in stream.turn_events]}

    def check_state(self, state, input_dim: int) -> None:
        """``ValueError`` unless ``state`` is one ``state`` could have written for a stream of this tracker."""
        try:
            if state["knobs"] != self.knobs():
                raise ValueError(f"the stream was cut into turns with {state['knobs']}, this recognizer cuts them "
                                 f"with {self.knobs()}")
            bank = state["bank"]
            if set(bank) != set(BANK_FIELDS) or not all(isinstance(v, int) and v >= 0 for v in bank.values()):
                raise ValueError(f"bad endpointer counters {bank}")
            if not isinstance(state["turn_offset"], int) or state["turn_offset"] < 0:
                raise ValueError(f"bad turn offset {state['turn_offset']!r}")
            if state["gate_tail"] is not None:
                tail = state["gate_tail"]
                if _unpack(tail["feats"], np.float32).size != tail["frames"] * input_dim or \
                        _unpack(tail["db"], np.float64).size != tail["frames"]:
                    raise ValueError("the gate's held-back frames do not add up")
            if _unpack(state["recent"], np.float32).size != state["recent_frames"] * input_dim or \
                    not 0 <= state["recent_frames"] <= state["turn_pushed"]:
                raise ValueError("the turn's recent frames do not add up")
            _unpack(state["recent_db"], np.float64)
            for seg in state["segments"]:
                _segment_from(seg)
            for kind, value in state["events"]:
                if kind == "segment":
                    _segment_from(value)
                elif kind not in ("speech_started", "speech_stopped") or not isinstance(value, (int, float)):
                    raise ValueError(f"bad turn event {[kind, value]!r}")
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"Recognizer.resume: the stream's turn state is malformed ({type(exc).__name__}: "
                             f"{exc})") from None

    def restore(self, stream, state: dict, engine, input_dim: int) -> None:
        """``stream`` (just resumed on ``engine``, not yet open here) gets a slot and the turn state ``state``
        describes (``check_state`` first: nothing changes on a refusal)."""
        self.check_state(state, input_dim)
        pending = engine.buffered_input(stream.id).float()
        recent = _unpack(state["recent"], np.float32).reshape(state["recent_frames"], input_dim)
        recent_db = _unpack(state["recent_db"], np.float64)
        if len(recent_db) != len(recent) + len(pending):
            raise ValueError(f"Recognizer.resume: the turn's {len(recent_db)} recent energies do not match its "
                             f"{len(recent)} encoded and {len(pending)} buffered frames")
        self.open(stream)
        slot = self.slots[stream.id]
        for name, value in state["bank"].items():
            getattr(self.bank, name)[slot] = value
        stream.turn_offset, stream.turn_started = state["turn_offset"], state["turn_started"]
        stream.gated = state["gated"]
        tail = state["gate_tail"]
        if tail is not None:
            feats = torch.from_numpy(_unpack(tail["feats"], np.float32).reshape(tail["frames"], input_dim))
            stream.gate_tail = (feats, _unpack(tail["db"], np.float64))
        stream.recent = torch.cat([torch.from_numpy(recent), pending])
        stream.recent_db, stream.turn_pushed = recent_db, state["turn_pushed"]
        stream.segments = [_segment_from(seg) for seg in state["segments"]]
        stream.turn_events = [(kind, _segment_from(value) if kind == "segment" else value)
                              for kind, value in state["events"]]

    @staticmethod
    def joined(stream) -> str:
        """The stream's text over all its turns."""
        return " ".join(seg.text for seg in stream.segments)


def _pack(array, dtype) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


def _unpack(text: str, dtype) -> np.ndarray:
    data = base64.b64decode(text.encode("ascii"), validate=True)
    if len(data) % np.dtype(dtype).itemsize:
        raise ValueError(f"{len(data)} bytes are not whole {np.dtype(dtype).name} values")
    return np.frombuffer(data, dtype=dtype).copy()


def _segment_json(seg: Segment) -> dict:
    words = [[w.word, w.start, w.end] for w in seg.words]
    return {"start": seg.start, "end": seg.end, "text": seg.text, "words": words}


def _segment_from(d: dict) -> Segment:
    if set(d) != {"start", "end", "text", "words"} or not isinstance(d["text"], str):
        raise ValueError(f"bad segment {d!r}")
    words = tuple(Word(str(w), float(a), float(b)) for w, a, b in d["words"])
    return Segment(float(d["start"]), float(d["end"]), d["text"], words)
