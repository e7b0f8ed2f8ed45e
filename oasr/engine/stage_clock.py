"""``StageClock``: where a serving loop's time goes, per stage, in host seconds and device milliseconds.

The stages of one stream-chunk's trip through a ``Recognizer`` and its engine::

    ingest       AudioStream.accept: check the piece, copy it into the stream's PCM buffer
    front_end    fbank of every stream whose buffered audio completes a chunk (one batched call), CMVN, push
    model        the engine's model step (inputs staged, the step or graph replay, caches committed, readback)
    decode       the CTC prefix beam search of the cohort and the partial hypotheses read back (and, in a
                 ``Recognizer`` with a language model, the word search over the same log-probs)
    bookkeeping  the rest of the tick: admission, picking the cohort, finishing streams, statistics
    delivery     the recognizer's side of a tick's outputs: latencies, partial texts, finished transcripts

Host time is ``time.perf_counter`` around each stage (a few calls per tick, whatever the cohort).
On CUDA, ``device_region(stage)`` also records a pair of events around the stage's device work;
their elapsed times are read by ``collect`` once the events have completed (``totals`` waits for
the last one), so timing adds no synchronisation to a tick. ``stream_chunks`` counts the chunks
the engine encoded (the sum of its cohorts), the denominator of a per-stream-chunk cost.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

STAGES = ("ingest", "front_end", "model", "decode", "bookkeeping", "delivery")
DEVICE_STAGES = ("model", "decode")


class StageClock:
    """Accumulated host seconds per stage and, on CUDA, device milliseconds per device stage."""

    def __init__(self, device="cpu"):
        self.on_cuda = torch.device(device).type == "cuda"
        self.reset()

    def reset(self) -> None:
        """Zero every total (a benchmark calls it between runs)."""
        self.host = dict.fromkeys(STAGES, 0.0)
        self.device_ms = dict.fromkeys(DEVICE_STAGES, 0.0)
        self.stream_chunks = 0
        self._events: list = []  # (stage, start event, end event) not read yet

    def add(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` of host time to ``stage`` (``KeyError`` for an unknown stage)."""
        self.host[stage] += seconds

    @contextmanager
    def device_region(self, stage: str):
        """Record CUDA events around the body's device work (a no-op on the CPU)."""
        if not self.on_cuda:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((stage, start, end))

    def collect(self, wait: bool = False) -> None:
        """Add the elapsed time of every completed event pair (all of them, after a wait, with ``wait``)."""
        pending = []
        for stage, start, end in self._events:
            if wait:
                end.synchronize()
            if end.query():
                self.device_ms[stage] += start.elapsed_time(end)
            else:
                pending.append((stage, start, end))
        self._events = pending

    def totals(self) -> dict:
        """``{"host_s": {stage: seconds}, "device_ms": {stage: ms} or None, "stream_chunks": n}``."""
        self.collect(wait=True)
        return {"host_s": dict(self.host), "device_ms": dict(self.device_ms) if self.on_cuda else None,
                "stream_chunks": self.stream_chunks}


def now() -> float:
    """The host clock of every stage (``time.perf_counter``)."""
    return time.perf_counter()
