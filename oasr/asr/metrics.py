"""Word and character error rates: Levenshtein distance over words or characters, summed over a corpus."""

from __future__ import annotations

from oasr.tokenizers.char import normalize


def edit_distance(ref, hyp) -> int:
    """Minimum substitutions + insertions + deletions turning ``ref`` into ``hyp`` (two sequences)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def error_rates(refs, hyps) -> dict:
    """Corpus WER and CER (errors over reference length) of paired transcripts, after ``normalize``."""
    if len(refs) != len(hyps):
        raise ValueError(f"error_rates: {len(refs)} references but {len(hyps)} hypotheses")
    werr = wtot = cerr = ctot = 0
    for ref, hyp in zip(refs, hyps, strict=True):
        ref, hyp = normalize(ref), normalize(hyp)
        werr += edit_distance(ref.split(), hyp.split())
        wtot += len(ref.split())
        cerr += edit_distance(ref, hyp)
        ctot += len(ref)
    return {"wer": werr / max(wtot, 1), "cer": cerr / max(ctot, 1), "words": wtot, "chars": ctot,
            "word_errors": werr, "char_errors": cerr, "utterances": len(refs)}
