"""The endpointer: per-frame speech probabilities in, turn events out (policy, no model).

A stream's frames are numbered from 0 at its start (or at its last reset); frame ``t`` covers
``[t * frame_seconds, (t + 1) * frame_seconds)``. A frame is *speech* when its probability exceeds
``speech_threshold``. The rules, for one stream::

    frames      0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 ...
    speech      . . x x x . x . . . .  .  .  .  x  x  .  .
                    |<-- turn ---->|<-- trailing silence -->|
                    start=2        last speech ends at 7

    * outside a turn, ``min_speech_frames`` consecutive speech frames start one; the turn starts at the
      first frame of that run (event ``speech_started``);
    * inside a turn, once ``min_silence_frames`` frames have passed since the last speech frame ended,
      the turn ends at that end (event ``speech_stopped``, reason ``"silence"``);
    * a turn that reaches ``max_utterance_frames`` frames is cut there (reason ``"max_length"``); a new
      turn may start right after, by the first rule;
    * ``flush()`` (the end of the stream) ends an open turn at its last speech frame (reason
      ``"end_of_stream"``).

Speech inside a turn never needs ``min_speech_frames``: one speech frame (a CTC spike) keeps the turn
alive. An ASR-derived signal is peaky (CTC emits single-frame spikes separated by blanks), so its
``min_silence_seconds`` must be well above the gaps between spikes inside speech (a few hundred ms);
the defaults are chosen for that.

``Endpointer`` is the readable per-stream state machine, the oracle. ``EndpointerBank`` keeps the same
state for ``max_streams`` slots in arrays and advances a cohort's frames with one vector step per frame
(work per chunk independent of the cohort's width); it emits exactly the events the per-stream machine
would, in the same order per stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

REASONS = ("silence", "max_length", "end_of_stream")


@dataclass(frozen=True)
class EndpointConfig:
    """The endpointer's knobs, in seconds; ``frame_seconds`` is the probability grid's frame length.

    Raises ``ValueError`` for a non-positive duration, a threshold outside ``[0, 1)``, or a maximum
    utterance shorter than the speech needed to start one.
    """

    frame_seconds: float = 0.04
    speech_threshold: float = 0.5
    min_speech_seconds: float = 0.04
    min_silence_seconds: float = 0.8
    max_utterance_seconds: float = 30.0

    def __post_init__(self):
        for name in ("frame_seconds", "min_speech_seconds", "min_silence_seconds", "max_utterance_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"EndpointConfig.{name} must be a positive number of seconds, got {value!r}")
        if not 0.0 <= self.speech_threshold < 1.0:
            raise ValueError(f"EndpointConfig.speech_threshold must be in [0, 1), got {self.speech_threshold!r}")
        if self.max_utterance_frames < self.min_speech_frames:
            raise ValueError(f"EndpointConfig: max_utterance_seconds={self.max_utterance_seconds} is shorter than "
                             f"min_speech_seconds={self.min_speech_seconds}")

    def frames(self, seconds: float) -> int:
        """Whole frames in ``seconds`` (at least one)."""
        return max(1, round(seconds / self.frame_seconds))

    @property
    def min_speech_frames(self) -> int:
        """Consecutive speech frames that start a turn."""
        return self.frames(self.min_speech_seconds)

    @property
    def min_silence_frames(self) -> int:
        """Frames after the last speech frame that end a turn."""
        return self.frames(self.min_silence_seconds)

    @property
    def max_utterance_frames(self) -> int:
        """The longest turn, in frames."""
        return self.frames(self.max_utterance_seconds)


@dataclass(frozen=True)
class EndpointEvent:
    """``speech_started`` (``end_frame`` None, ``reason`` None) or ``speech_stopped`` with its ``reason``.

    Frames count from the stream's start (or its last reset); ``seconds(frame)`` converts with the config.
    """

    kind: str
    start_frame: int
    end_frame: int | None = None
    reason: str | None = None

    def times(self, frame_seconds: float) -> tuple[float, float | None]:
        """``(start, end)`` in seconds (end None for ``speech_started``)."""
        end = None if self.end_frame is None else self.end_frame * frame_seconds
        return self.start_frame * frame_seconds, end


def _check_probs(probs, where: str) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.size and not np.isfinite(p).all():
        raise ValueError(f"{where}: speech probabilities must be finite")
    return p


class Endpointer:
    """One stream's endpointer: ``push(probs)`` a chunk of frames, get the events they complete."""

    def __init__(self, config: EndpointConfig):
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Back to a stream's start: no turn, frame 0."""
        self.frame = 0  # frames seen
        self.in_turn = False
        self.run = 0  # consecutive speech frames while outside a turn
        self.start = 0  # the open turn's first frame
        self.last_end = 0  # the frame after the open turn's last speech frame

    def push(self, probs) -> list[EndpointEvent]:
        """Advance over ``probs`` (1-D, one speech probability per frame); the events, in frame order."""
        p = _check_probs(probs, "Endpointer.push")
        if p.ndim != 1:
            raise ValueError(f"Endpointer.push: probs must be 1-D (frames,), got shape {tuple(p.shape)}")
        c = self.config
        events = []
        for value in p:
            t = self.frame
            speech = value > c.speech_threshold
            if not self.in_turn:
                self.run = self.run + 1 if speech else 0
                if self.run >= c.min_speech_frames:
                    self.in_turn, self.start, self.last_end = True, t - self.run + 1, t + 1
                    events.append(EndpointEvent("speech_started", self.start))
            else:
                if speech:
                    self.last_end = t + 1
                if t + 1 - self.last_end >= c.min_silence_frames:
                    events.append(EndpointEvent("speech_stopped", self.start, self.last_end, "silence"))
                    self.in_turn, self.run = False, 0
                elif t + 1 - self.start >= c.max_utterance_frames:
                    events.append(EndpointEvent("speech_stopped", self.start, t + 1, "max_length"))
                    self.in_turn, self.run = False, 0
            self.frame = t + 1
        return events

    def flush(self) -> list[EndpointEvent]:
        """The end of the stream: an open turn ends at its last speech frame."""
        if not self.in_turn:
            return []
        self.in_turn, self.run = False, 0
        return [EndpointEvent("speech_stopped", self.start, self.last_end, "end_of_stream")]


class EndpointerBank:
    """``max_streams`` endpointers in arrays, indexed by slot; the vectorised twin of :class:`Endpointer`.

    ``push(slots, probs)`` advances the given slots over ``probs (len(slots), T)`` (every row ``T`` frames;
    a shorter chunk is a separate call) and returns ``{slot: [events]}`` for the slots that had any.
    Slots must be distinct and in ``[0, max_streams)``; a bad call raises before any state changes.
    """

    def __init__(self, config: EndpointConfig, max_streams: int):
        if isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams <= 0:
            raise ValueError(f"EndpointerBank: max_streams must be a positive int, got {max_streams!r}")
        self.config, self.max_streams = config, max_streams
        self.frame = np.zeros(max_streams, np.int64)
        self.in_turn = np.zeros(max_streams, bool)
        self.run = np.zeros(max_streams, np.int64)
        self.start = np.zeros(max_streams, np.int64)
        self.last_end = np.zeros(max_streams, np.int64)

    def grow(self, max_streams: int) -> None:
        """Room for ``max_streams`` slots (the new ones at a stream's start); never shrinks."""
        extra = max_streams - self.max_streams
        if extra <= 0:
            return
        for name in ("frame", "in_turn", "run", "start", "last_end"):
            array = getattr(self, name)
            setattr(self, name, np.concatenate([array, np.zeros(extra, array.dtype)]))
        self.max_streams = max_streams

    def reset(self, slots) -> None:
        """Slots back to a stream's start."""
        s = self._slots(slots, "reset")
        for array in (self.frame, self.run, self.start, self.last_end):
            array[s] = 0
        self.in_turn[s] = False

    def _slots(self, slots, op: str) -> np.ndarray:
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        if s.size and (s.min() < 0 or s.max() >= self.max_streams):
            raise ValueError(f"EndpointerBank.{op}: slots must be in [0, {self.max_streams}), got {s.tolist()}")
        if np.unique(s).size != s.size:
            raise ValueError(f"EndpointerBank.{op}: slots must be distinct, got {s.tolist()}")
        return s

    def push(self, slots, probs) -> dict[int, list[EndpointEvent]]:
        """Advance ``slots`` over ``probs (len(slots), T)``; events per slot, in frame order."""
        s = self._slots(slots, "push")
        p = _check_probs(probs, "EndpointerBank.push")
        if p.ndim != 2 or p.shape[0] != s.size:
            raise ValueError(f"EndpointerBank.push: probs must be (len(slots)={s.size}, frames), "
                             f"got shape {tuple(p.shape)}")
        c = self.config
        frame, in_turn, run = self.frame[s], self.in_turn[s], self.run[s]
        start, last_end = self.start[s], self.last_end[s]
        found = []  # (row, frame offset, order, event)
        speech_all = p > c.speech_threshold
        for j in range(p.shape[1]):
            t = frame + j
            speech = speech_all[:, j]
            outside = ~in_turn
            run = np.where(outside, np.where(speech, run + 1, 0), run)
            begins = outside & (run >= c.min_speech_frames)
            start = np.where(begins, t - run + 1, start)
            last_end = np.where(begins | (in_turn & speech), t + 1, last_end)
            silence = in_turn & (t + 1 - last_end >= c.min_silence_frames)
            too_long = in_turn & ~silence & (t + 1 - start >= c.max_utterance_frames)
            for row in np.flatnonzero(begins):
                found.append((row, j, EndpointEvent("speech_started", int(start[row]))))
            for row in np.flatnonzero(silence):
                found.append((row, j, EndpointEvent("speech_stopped", int(start[row]), int(last_end[row]),
                                                     "silence")))
            for row in np.flatnonzero(too_long):
                found.append((row, j, EndpointEvent("speech_stopped", int(start[row]), int(t[row] + 1),
                                                     "max_length")))
            ends = silence | too_long
            in_turn = (in_turn | begins) & ~ends
            run = np.where(ends, 0, run)
        self.frame[s], self.in_turn[s], self.run[s] = frame + p.shape[1], in_turn, run
        self.start[s], self.last_end[s] = start, last_end
        out: dict[int, list[EndpointEvent]] = {}
        for row, _, event in sorted(found, key=lambda item: (item[0], item[1])):
            out.setdefault(int(s[row]), []).append(event)
        return out

    def flush(self, slots) -> dict[int, list[EndpointEvent]]:
        """The end of these streams: each open turn ends at its last speech frame."""
        s = self._slots(slots, "flush")
        out = {}
        for slot in s[self.in_turn[s]]:
            out[int(slot)] = [EndpointEvent("speech_stopped", int(self.start[slot]), int(self.last_end[slot]),
                                            "end_of_stream")]
        self.in_turn[s] = False
        self.run[s] = 0
        return out
