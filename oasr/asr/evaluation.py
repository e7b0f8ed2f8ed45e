"""Word and character error rates of a recognizer over a test set: what ``oasr eval`` and the accuracy bench run."""

from __future__ import annotations

import time

from oasr.asr.metrics import error_rates


def evaluate(rec, clips) -> dict:
    """Transcribe ``clips`` with ``rec``; WER/CER of the final and (if rescoring) first-pass texts, and timing."""
    t0 = time.perf_counter()
    transcripts = rec.transcribe([c.path for c in clips])
    wall = time.perf_counter() - t0
    refs = [c.text for c in clips]
    rates = error_rates(refs, [t.text for t in transcripts])
    first = error_rates(refs, [t.first_pass for t in transcripts])
    audio = sum(t.audio_seconds for t in transcripts)
    return {**rates, "first_pass_wer": first["wer"], "first_pass_cer": first["cer"], "audio_seconds": audio,
            "wall_seconds": wall, "rtf": wall / audio,
            "hypotheses": [{"id": c.id, "ref": c.text, "hyp": t.text} for c, t in zip(clips, transcripts, strict=True)]}
