"""Word and character error rates of a recognizer over a test set: what ``oasr eval`` and the accuracy bench run."""

from __future__ import annotations

import time

from oasr.asr.metrics import error_rates


def breakdown(clips, hyps, key) -> dict:
    """``error_rates`` of the clips grouped by ``key(clip)``, plus how many hypotheses came out empty.

    A group whose references are all empty (silence, noise alone) has no words: its ``word_errors`` are the
    words the recognizer invented, ``empty_hyps`` how many clips rightly gave nothing and ``wer``/``cer`` are None."""
    groups: dict = {}
    for c, h in zip(clips, hyps, strict=True):
        groups.setdefault(key(c), []).append((c.text, h))
    out = {}
    for name in sorted(groups):
        refs, hs = zip(*groups[name], strict=True)
        rates = error_rates(refs, hs)
        if rates["words"] == 0:  # no reference words: a rate over them means nothing
            rates.update(wer=None, cer=None)
        out[name] = {**rates, "empty_hyps": sum(not h.split() for h in hs)}
    return out


def paired(clips, hyps) -> dict:
    """Per condition of copies (clips with a ``source``): the copies' WER and their source clips' WER, when
    every source is in the run, so a condition's cost is read on the same sentences and voices."""
    by_id = {c.id: (c, h) for c, h in zip(clips, hyps, strict=True)}
    groups: dict = {}
    for c, h in zip(clips, hyps, strict=True):
        if c.source:
            groups.setdefault(c.condition, []).append((c, h))
    out = {}
    for name, pairs in sorted(groups.items()):
        if not all(c.source in by_id for c, _ in pairs):
            continue
        src = [by_id[c.source] for c, _ in pairs]
        out[name] = {"wer": error_rates([c.text for c, _ in pairs], [h for _, h in pairs])["wer"],
                     "source_wer": error_rates([c.text for c, _ in src], [h for _, h in src])["wer"],
                     "utterances": len(pairs)}
    return out


def evaluate(rec, clips) -> dict:
    """Transcribe ``clips`` with ``rec``; WER/CER of the final and (if rescoring) first-pass texts, timing, and
    the rates per condition and per voice variant (``breakdown``)."""
    t0 = time.perf_counter()
    transcripts = rec.transcribe([c.path for c in clips])
    wall = time.perf_counter() - t0
    refs = [c.text for c in clips]
    rates = error_rates(refs, [t.text for t in transcripts])
    first = error_rates(refs, [t.first_pass for t in transcripts])
    audio = sum(t.audio_seconds for t in transcripts)
    return {**rates, "first_pass_wer": first["wer"], "first_pass_cer": first["cer"], "audio_seconds": audio,
            "wall_seconds": wall, "rtf": wall / audio,
            "per_condition": breakdown(clips, [t.text for t in transcripts], lambda c: c.condition),
            "per_voice": breakdown(clips, [t.text for t in transcripts], lambda c: c.variant),
            "paired": paired(clips, [t.text for t in transcripts]),
            "hypotheses": [{"id": c.id, "ref": c.text, "hyp": t.text, "voice": c.voice,
                            "condition": c.condition} for c, t in zip(clips, transcripts, strict=True)]}
