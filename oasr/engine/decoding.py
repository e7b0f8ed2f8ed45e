"""Greedy CTC collapse, per stream, across chunk boundaries, and the whole-utterance decode oracle.

The engine decodes with the CTC prefix beam search (``oasr.ctc``; its states pooled by
``CtcStateCacheManager``) by default. ``StreamingEngine(decoder="greedy")`` keeps this
per-stream greedy collapse instead, as a baseline: a ``GreedyCtcDecoder`` per stream, whose
``decode_chunk(log_probs)`` returns the tokens a chunk completed. ``decode_utterance`` decodes a
whole utterance in one call with either decoder: the oracle the engine's streamed, batched
decoding must equal.

Greedy collapse: take the argmax of every frame, merge runs of the same label,
drop blanks. The previous frame's label is carried over a chunk boundary, so a
run that straddles two chunks is merged exactly as in one offline pass.
"""

from __future__ import annotations

import torch


def greedy_ctc_collapse(log_probs: torch.Tensor, blank: int = 0, previous: int | None = None):
    """``(T, vocab)`` log-probs -> ``(tokens, last_label)``; ``previous`` is the label before frame 0."""
    labels = log_probs.argmax(dim=-1).tolist() if log_probs.shape[0] else []
    tokens = []
    last = blank if previous is None else previous
    for label in labels:
        if label != last and label != blank:
            tokens.append(label)
        last = label
    return tokens, last


class GreedyCtcDecoder:
    """One stream's greedy decoder; ``decode_chunk`` returns the tokens the chunk completed."""

    def __init__(self, vocab_size: int | None = None, blank: int = 0):
        self.vocab_size = vocab_size
        self.blank = blank
        self.tokens: list[int] = []
        self._last = blank

    def decode_chunk(self, log_probs: torch.Tensor) -> list[int]:
        """Greedy-decode one chunk's log-probs ``(T, V)``: returns the tokens it adds."""
        new, self._last = greedy_ctc_collapse(log_probs, self.blank, self._last)
        self.tokens.extend(new)
        return new

    def finalize(self) -> list[int]:
        """Every token decoded so far."""
        return list(self.tokens)


def decode_utterance(log_probs: torch.Tensor, decoder: str = "beam", ctc_config=None) -> list[int]:
    """Decode a whole utterance's ``(T, vocab)`` log-probs in one call with the reference twin.

    The oracle for the engine's streaming decode: chunked, batched and pooled
    decoding must give exactly these tokens. ``decoder`` and ``ctc_config`` are
    the engine's own settings (``engine.decoder``, ``engine.ctc_config``).
    """
    if decoder == "greedy":
        return greedy_ctc_collapse(log_probs)[0]
    from oasr.ctc.config import CtcDecoderConfig
    from oasr.reference.ctc_decoder import StreamingCtcDecoder

    search = StreamingCtcDecoder(ctc_config or CtcDecoderConfig(beam_size=4))
    state = search.create_state(1, log_probs.shape[-1])
    search.decode_chunk(state, log_probs[None])
    return list(search.finalize_stream(state)[0][0].tokens)
