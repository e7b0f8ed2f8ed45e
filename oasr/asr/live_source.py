"""Live streams at real time from a separate process: ``play_lanes`` drives a ``Recognizer`` as N live sources.

A *lane* is one live source: it plays its clips back to back, each clip one stream, at real time in
``piece`` samples per message. Lane ``i`` starts ``i / N`` of a chunk after the first, so chunk
boundaries spread over the chunk the way independent callers' do. The clock that says which audio is
due runs in its own process (``AudioClock``, forked), so however busy the recognizer's process is,
the audio keeps arriving on time and the latency measured is the recognizer's, not the harness's::

    clock process                                  recognizer process (play_lanes)
    every piece interval: due[i] = samples of      drain the pipe: feed each lane's new samples
    lane i due by now (multiples of the piece) --> as pieces (accept(pcm, sent_at=time sent));
    one message (time sent, due) per wake          open / end streams at clip boundaries;
                                                   step until no chunk is ready; repeat

A message carries only the due counts (8 bytes per lane), not the audio: both processes hold the
clips, so the pipe carries ~200 kB/s for 1,000 lanes. A chunk's latency runs from the moment the
clock process sent the message holding its last sample (``time.perf_counter`` is the system's
monotonic clock, shared by both processes) to the end of the tick that delivered its partial result.
"""

from __future__ import annotations

import multiprocessing
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from oasr.features.fbank import SAMPLE_RATE

_HEADER = struct.Struct("<d")  # the time the message was sent
_DONE = b"done"


@dataclass
class Lane:
    """One live source: its clips (indices into the audio list) and how far it has been fed."""

    clips: list
    start: float  # seconds after the first lane
    bounds: np.ndarray = field(default=None)  # cumulative clip ends in the lane's timeline (samples)
    fed: int = 0
    stream: object = None  # the AudioStream of the clip being fed
    clip: int = 0  # position in ``clips`` of the clip being fed


def plan_lanes(lengths: list[int], lanes: int, seconds: float, stagger: float) -> list[Lane]:
    """``lanes`` lanes over clips of ``lengths`` samples: lane ``i`` plays clips ``i, i + lanes, ...``
    (wrapping around) until it has ``seconds`` of audio, starting ``stagger * i / lanes`` seconds late."""
    if lanes < 1 or seconds <= 0 or not lengths:
        raise ValueError(f"plan_lanes: need lanes >= 1, seconds > 0 and clips, got {lanes}, {seconds}, "
                         f"{len(lengths)} clips")
    plan = []
    for i in range(lanes):
        clips, total, k = [], 0, i
        while total < seconds * SAMPLE_RATE:
            clips.append(k % len(lengths))
            total += lengths[k % len(lengths)]
            k += lanes
        plan.append(Lane(clips, stagger * i / lanes, np.cumsum([lengths[c] for c in clips])))
    return plan


def _clock_process(conn, totals: np.ndarray, starts: np.ndarray, piece: int, t0: float) -> None:
    """The clock: every piece interval, send (now, due samples per lane) while anything is due."""
    interval = piece / SAMPLE_RATE
    sent = np.zeros_like(totals)
    wake = t0
    while True:
        time.sleep(max(0.0, wake - time.perf_counter()))
        now = time.perf_counter()
        elapsed = np.maximum(now - t0 - starts, 0.0)
        due = np.minimum((elapsed * SAMPLE_RATE).astype(np.int64) // piece * piece, totals)
        due = np.where(due + piece > totals, np.where(elapsed * SAMPLE_RATE >= totals, totals, due), due)
        if (due != sent).any():
            conn.send_bytes(_HEADER.pack(now) + due.tobytes())
            sent = due
        if (sent >= totals).all():
            conn.send_bytes(_DONE)
            return
        wake += interval


class AudioClock:
    """The clock process of ``play_lanes`` (a context manager): ``poll`` / ``receive`` its messages."""

    def __init__(self, lanes: list[Lane], piece: int, lead: float = 0.2):
        totals = np.array([int(lane.bounds[-1]) for lane in lanes], dtype=np.int64)
        starts = np.array([lane.start for lane in lanes], dtype=np.float64)
        self.t0 = time.perf_counter() + lead
        ctx = multiprocessing.get_context("fork")  # the child runs numpy only, never torch
        self._conn, child = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_clock_process, args=(child, totals, starts, piece, self.t0), daemon=True)
        self._lanes = len(lanes)

    def __enter__(self) -> AudioClock:
        self._process.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(timeout=5)

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message is waiting (waiting up to ``timeout`` seconds for one)."""
        return self._conn.poll(timeout)

    def receive(self):
        """The next message: ``(time sent, due samples per lane)``, or None once every lane is done."""
        data = self._conn.recv_bytes()
        if data == _DONE:
            return None
        (sent,) = _HEADER.unpack_from(data)
        return sent, np.frombuffer(data, dtype=np.int64, offset=_HEADER.size, count=self._lanes)


@dataclass
class LaneRun:
    """What ``play_lanes`` measured: transcripts by (lane, clip position), chunk latencies, timings."""

    transcripts: dict
    latencies: np.ndarray  # seconds, one per chunk
    wall_seconds: float
    last_sent: float  # seconds after the start when the last audio was sent
    last_delivered: float  # seconds after the start when the last transcript came
    max_lag: float  # most seconds a message waited in the pipe before the recognizer read it
    harness_seconds: float  # the recognizer process's own feeding loop, accept calls excluded
    timed_out: bool = False  # the run passed its timeout: the streams still open were cancelled


def _feed(rec, lane: Lane, due: int, piece: int, audio: list, sent: float, opened: dict) -> None:
    """Feed ``lane`` up to ``due`` samples of its timeline: pieces of at most ``piece`` samples, streams
    opened at a clip's first sample and ended at its last."""
    while lane.fed < due:
        k = lane.clip
        clip_start = int(lane.bounds[k - 1]) if k else 0
        if lane.stream is None:
            lane.stream = rec.open_stream()
            opened[lane.stream.id] = k
        pcm = audio[lane.clips[k]]
        at = lane.fed - clip_start
        end = min(len(pcm), at + piece - (lane.fed % piece), due - clip_start)
        lane.stream.accept(pcm[at:end], sent_at=sent)
        lane.fed = clip_start + end
        if end == len(pcm):
            lane.stream.end()
            lane.stream = None
            lane.clip += 1


def play_lanes(rec, audio: list, lanes: list[Lane], piece: int = 640, timeout: float | None = None) -> LaneRun:
    """Play ``lanes`` over ``audio`` (16 kHz arrays) through ``rec`` at real time; see the module docstring.

    ``rec`` must be idle (no open stream). Returns a ``LaneRun``; ``transcripts[(lane, k)]`` is the
    ``Transcript`` of lane ``lane``'s ``k``-th clip. ``timeout`` (seconds from the start): a run that
    falls far behind stops there, its open streams cancelled (``timed_out``; their clips have no
    transcript), so a benchmark's time stays bounded."""
    if rec.streams:
        raise ValueError(f"play_lanes: the recognizer has {len(rec.streams)} open streams; it must be idle")
    owner: dict = {}  # stream id -> (lane index, clip position)
    transcripts: dict = {}
    latencies: list = []
    harness, max_lag, last_sent, last_delivered = 0.0, 0.0, 0.0, 0.0
    fed = np.zeros(len(lanes), dtype=np.int64)
    clock_done = timed_out = False
    with AudioClock(lanes, piece) as clock:
        t0 = clock.t0
        while not clock_done or rec.streams:
            if timeout is not None and time.perf_counter() - t0 > timeout:
                for sid in list(rec.streams):
                    rec.cancel(sid)
                timed_out = True
                break
            while not clock_done and clock.poll():
                message = clock.receive()
                if message is None:
                    clock_done = True
                    break
                sent, due = message
                started = time.perf_counter()
                max_lag = max(max_lag, started - sent)
                last_sent = max(last_sent, sent - t0)
                accepted = rec.stage_clock.host["ingest"] + rec.stage_clock.host["front_end"]
                for i in np.flatnonzero(due > fed).tolist():
                    opened: dict = {}
                    _feed(rec, lanes[i], int(due[i]), piece, audio, sent, opened)
                    owner.update({sid: (i, k) for sid, k in opened.items()})
                fed = np.maximum(fed, due)
                harness += time.perf_counter() - started - (
                    rec.stage_clock.host["ingest"] + rec.stage_clock.host["front_end"] - accepted)
            worked = False
            while True:  # every chunk that is ready now
                done = rec.step()
                for transcript in done:
                    transcripts[owner.pop(transcript.id)] = transcript
                    latencies += transcript.latencies
                    last_delivered = time.perf_counter() - t0
                if not rec.engine.stats[-1].cohort and not done:
                    break
                worked = True
            if not worked and not clock_done:
                clock.poll(0.002)  # nothing to do until the clock sends more
        wall = time.perf_counter() - t0
    return LaneRun(transcripts, np.array(latencies), wall, last_sent, last_delivered, max_lag, harness, timed_out)
