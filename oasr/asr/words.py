"""Word timestamps from the CTC alignment: the frames at which the beam search emitted each token.

The CTC prefix beam search records, for every token of a hypothesis, the encoder frame that emitted it
(``CtcHypothesis.frames``). A word's tokens are the run that decodes to it: token ``i`` belongs to word
``k`` when the text of ``tokens[:i + 1]`` has ``k + 1`` words (so any tokenizer works, characters or
word pieces); tokens that decode to nothing but space (a word separator) belong to no word. A word
starts at its first token's frame and ends one frame after its last token's (a CTC spike marks when
the model was sure of a token, usually within a frame or two of its sound, not the sound's edges).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Word:
    """One word and its times in seconds (from the stream's start)."""

    word: str
    start: float
    end: float


def word_times(tokenizer, tokens, frames, frame_seconds: float, offset_seconds: float = 0.0) -> list[Word]:
    """The words of ``tokens`` with times: frame ``f`` is at ``offset_seconds + f * frame_seconds``.

    ``ValueError`` when ``tokens`` and ``frames`` differ in length.
    """
    tokens, frames = list(tokens), list(frames)
    if len(tokens) != len(frames):
        raise ValueError(f"word_times: {len(tokens)} tokens but {len(frames)} frames")
    spans: list = []  # [first frame, last frame] per word
    index = getattr(tokenizer, "word_index", None)  # a tokenizer's one-pass form of the rule (CharTokenizer's)
    ks = index(tokens) if index is not None else [
        len(tokenizer.decode(tokens[: i + 1]).split()) - 1 if tokenizer.decode([token]).strip() else None
        for i, token in enumerate(tokens)]
    for k, frame in zip(ks, frames, strict=True):
        if k is None:
            continue
        if k >= len(spans):
            spans.append([frame, frame])
        else:
            spans[k][1] = frame
    words = tokenizer.decode(tokens).split()
    if len(words) != len(spans):  # a tokenizer whose pieces do not split this way: no times rather than wrong ones
        return []
    return [Word(w, round(offset_seconds + a * frame_seconds, 3), round(offset_seconds + (b + 1) * frame_seconds, 3))
            for w, (a, b) in zip(words, spans, strict=True)]
