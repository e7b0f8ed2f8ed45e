"""Long recordings as segments: find the speech regions of a recording, transcribe each as its own stream.

``speech_regions`` runs the energy detector and the endpointer (``oasr.vad``) over the whole recording:
each turn becomes a region, widened by ``pad_seconds`` of its surroundings on both sides (never into a
neighbour: two regions closer than twice the pad meet halfway). ``transcribe_segments`` gives each
region to ``Recognizer.transcribe`` as a clip of its own (``max_streams`` at a time), so a recording of
any length is served with the state of a few streams, and silence between sentences (however long)
never reaches the model. A recording with no speech gives no segment.

This is the *pre-segmenting* use of the endpointer (a segmenter before the front end). It
needs the whole recording, so it serves files; a live stream's turns come from the same policy run
over its own frames as they arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oasr.vad import EndpointConfig, Endpointer, EnergyDetector

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class SegmenterConfig:
    """Knobs of the file segmenter (seconds, and the energy threshold in dB relative to full scale)."""

    threshold_db: float = -55.0
    frame_seconds: float = 0.02
    min_speech_seconds: float = 0.06
    min_silence_seconds: float = 0.5
    max_segment_seconds: float = 25.0
    pad_seconds: float = 0.5  # after a turn
    lead_seconds: float = 0.05  # before a turn (the shipped model was trained on clips with little lead)

    def endpoint_config(self) -> EndpointConfig:
        """The endpointer's configuration these knobs imply."""
        return EndpointConfig(frame_seconds=self.frame_seconds, min_speech_seconds=self.min_speech_seconds,
                              min_silence_seconds=self.min_silence_seconds,
                              max_utterance_seconds=self.max_segment_seconds)


@dataclass(frozen=True)
class Segment:
    """A stretch of a recording, its times in seconds from the recording's start, and its text."""

    start: float
    end: float
    text: str
    words: tuple = ()  # oasr.asr.words.Word, where the CTC alignment gave them (live turns)


def speech_regions(pcm, sample_rate: int = SAMPLE_RATE, config: SegmenterConfig | None = None) -> list[tuple]:
    """``[(start_sample, end_sample), ...]`` of the speech in ``pcm`` (1-D float), padded, in order, disjoint.
    A region's lead never starts with digital silence (exact zeros): it begins at the first sound in it."""
    config = config or SegmenterConfig()
    x = np.asarray(pcm, dtype=np.float32).reshape(-1)
    detector = EnergyDetector(sample_rate, config.frame_seconds, config.threshold_db)
    endpointer = Endpointer(config.endpoint_config())
    events = endpointer.push(detector.push(x)) + endpointer.flush()
    frame = detector.frame_samples
    turns = [(e.start_frame * frame, min(len(x), e.end_frame * frame)) for e in events if e.kind == "speech_stopped"]
    pad, lead = round(config.pad_seconds * sample_rate), round(config.lead_seconds * sample_rate)
    regions = []
    for i, (start, end) in enumerate(turns):
        lo = max(0, start - lead) if i == 0 else max(start - lead, (turns[i - 1][1] + start) // 2)
        hi = min(len(x), end + pad) if i == len(turns) - 1 else min(end + pad, (end + turns[i + 1][0]) // 2)
        if i and lo < regions[-1][1]:
            lo = regions[-1][1]
        sound = np.flatnonzero(x[lo:start])  # digital silence is never lead (as in ``oasr.asr.turns``)
        lo = lo + int(sound[0]) if sound.size else start
        regions.append((lo, hi))
    return regions


def transcribe_segments(recognizer, pcm, config: SegmenterConfig | None = None) -> list[Segment]:
    """The segments of one 16 kHz recording with their texts, transcribed by ``recognizer``."""
    regions = speech_regions(pcm, SAMPLE_RATE, config)
    if not regions:
        return []
    x = np.asarray(pcm, dtype=np.float32).reshape(-1)
    transcripts = recognizer.transcribe([x[a:b] for a, b in regions])
    return [Segment(a / SAMPLE_RATE, b / SAMPLE_RATE, t.text) for (a, b), t in zip(regions, transcripts, strict=True)]
