"""Bench section: the word search (lexicon + word bigram over CTC log-probs), reference against fast.

The real language model (``recipe_lm(LanguageSpec())``: 60k words, 650k bigrams of the recipe text and the
English examples; built once, ~3 s) at the default ``WordSearchConfig`` (beam 32, top-k 8). A cohort of
``streams`` streams advances by 32-frame chunks with one ``decode`` call per chunk; the posteriors are
CTC-shaped spellings of the recipe text (each character held 1-2 frames, blanks between, Gaussian noise),
so the beams hold real words and commit them.

Columns: ``reference_ms`` / ``fast_ms`` are the median over chunks of (time of the cohort's ``decode``) /
``streams``: milliseconds per stream per 32-frame chunk, steady state (the first chunk, from fresh states,
is not timed). The reference is timed on fewer streams (``ref_streams``) of the same posteriors; per stream,
the two columns compare. ``fast_execution`` names the fast twin's path (``native (C++)`` where g++ is found).
"""

from __future__ import annotations

import statistics

import numpy as np

from oasr.bench import clock

CHUNK = 32
NOTES = "per stream per 32-frame chunk; the fast twin makes one native call per cohort chunk"


def spoken_posteriors(tokenizer, streams: int, frames: int, seed: int = 0) -> np.ndarray:
    """``(streams, frames, vocab)`` float64 log-probs spelling recipe-text sentences, CTC-style."""
    from oasr.asr.opentext import MixedSentenceGenerator

    rng = np.random.default_rng(seed)
    text = MixedSentenceGenerator(seed + 1, 0.6)
    space = tokenizer.symbols.index(" ")
    out = np.empty((streams, frames, tokenizer.vocab_size))
    for s in range(streams):
        ids: list = []
        while len(ids) < frames:
            for c in [*tokenizer.encode(next(text)), space]:
                ids += [c] * int(rng.integers(1, 3)) + [0] * int(rng.integers(0, 3))
        x = rng.normal(size=(frames, tokenizer.vocab_size)) * 1.5
        x[np.arange(frames), ids[:frames]] += 6.0
        x -= x.max(axis=1, keepdims=True)
        out[s] = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    return out


def _ms_per_stream_chunk(search, lp: np.ndarray) -> float:
    streams, frames, _ = lp.shape
    states = [search.new_state() for _ in range(streams)]
    now, times = clock("cpu"), []
    for i, at in enumerate(range(0, frames, CHUNK)):
        chunks = list(lp[:, at : at + CHUNK])
        start = now()
        search.decode(states, chunks)
        if i:  # the first chunk starts from fresh states: not timed
            times.append((now() - start) * 1e3 / streams)
    return statistics.median(times)


def section(quick: bool) -> list[dict]:
    """One row: 64 streams (quick: 4 timed chunks; full: 8), the reference on 4 (full: 8) of them."""
    from oasr.asr.language import LanguageSpec, recipe_lm
    from oasr.ctc.words import WordSearchConfig
    from oasr.fast.word_search import WordSearch as FastWordSearch
    from oasr.reference.word_search import WordSearch as ReferenceWordSearch
    from oasr.tokenizers.char import CharTokenizer

    tokenizer = CharTokenizer()
    lm = recipe_lm(LanguageSpec(), tokenizer.alphabet)
    config = WordSearchConfig(beam_size=32)
    streams, ref_streams, chunks = 64, (4 if quick else 8), (5 if quick else 9)
    lp = spoken_posteriors(tokenizer, streams, chunks * CHUNK)
    fast = FastWordSearch(lm, tokenizer.symbols, config)
    fast_ms = _ms_per_stream_chunk(fast, lp)
    ref_ms = _ms_per_stream_chunk(ReferenceWordSearch(lm, tokenizer.symbols, config), lp[:ref_streams])
    return [{
        "section": "word_search",
        "case": f"streams={streams} beam={config.beam_size} topk={config.token_topk} chunk={CHUNK} (recipe LM)",
        "reference_ms": ref_ms,
        "fast_ms": fast_ms,
        "ref_streams": ref_streams,
        "fast_execution": fast.execution,
    }]


if __name__ == "__main__":
    import sys

    for row in section(quick="--full" not in sys.argv):
        print(f"{row['case']}: ref {row['reference_ms']:.3f} ms  fast {row['fast_ms']:.3f} ms  "
              f"x{row['reference_ms'] / row['fast_ms']:.1f}  ({row['fast_execution']})")
