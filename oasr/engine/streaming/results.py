"""The streaming engine's results: a stream's first pass ends, it finishes with a ``StreamResult``.

Part of ``oasr.engine.streaming.engine.StreamingEngine`` (its contract and state are drawn there).
A stream's end: its first pass finalised and its caches freed, then its ``StreamResult`` (now, or
once its rescoring job is done).
"""

from __future__ import annotations

import torch

from oasr.engine.rescoring import RescoreJob
from oasr.engine.streaming.records import (
    ACTIVE,
    FINISHED,
    RESCORING,
    WAITING,
    StepOutput,
    StreamResult,
    _Stream,
)


class ResultsMixin:
    """A part of ``StreamingEngine``: its results; no state of its own."""

    def result(self, stream_id) -> StreamResult:
        """A finished stream's ``StreamResult`` (``ValueError`` while it runs, ``KeyError`` for an unknown id)."""
        s = self._stream(stream_id)
        if s.state != FINISHED:
            raise ValueError(f"stream {stream_id!r} is {s.state}, not finished")
        return self.results[stream_id]

    def _finish(self, s: _Stream, reason: str, outputs: dict) -> None:
        """End the stream's first pass; it finishes now, or once its rescoring job is done."""
        tokens, nbest, job = list(s.partial), [], None
        if s.state == ACTIVE and self.ctc is not None:
            nbest = self._contexts[s.stream_id].get_decoder().finalize_stream()[0]
            tokens = list(nbest[0].tokens) if nbest else []
            s.first_pass = list(tokens)
            if self.rescore and nbest:
                job = RescoreJob(self.rescorer, self._kept_encoder_out(s), nbest, self.ctc_weight, self.ops)
            s.encoder_out = []
        elif s.greedy is not None:
            tokens = s.greedy.finalize()
        if s.state == ACTIVE:
            self._contexts.pop(s.stream_id).free()  # blocks, slots, and the decoder state back to its pool
            self.states.free_stream(s.stream_id)
            self._active.remove(s.stream_id)
        elif s.state == WAITING:
            self._waiting.remove(s.stream_id)
        s.pending, s.num_pending = [], 0
        if job is not None:
            s.state, s.finish_reason, s.nbest = RESCORING, reason, nbest
            self._rescoring.append((s.stream_id, job))
            return
        self._complete(s, reason, tokens, nbest, outputs)

    def _complete(self, s: _Stream, reason: str, tokens: list, nbest: list, outputs: dict) -> None:
        s.state, s.finish_reason = FINISHED, reason
        log_probs = None
        if self.keep_log_probs:
            V = self.model.config.vocab_size
            log_probs = torch.cat(s.log_probs) if s.log_probs else torch.zeros(0, V)
        self.results[s.stream_id] = StreamResult(
            s.stream_id, tokens, s.offset, s.input_frames, reason, log_probs, s.admitted_tick, self.tick, nbest,
            first_pass=s.first_pass if self.rescore else None,
        )
        out = outputs.setdefault(s.stream_id, StepOutput(s.stream_id, [], 0))
        out.finished, out.finish_reason = True, reason
