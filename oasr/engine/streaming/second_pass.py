"""The streaming engine's attention rescoring (U2/WeNet two-pass): the jobs, their budget, their sessions.

Part of ``oasr.engine.streaming.engine.StreamingEngine`` (its contract and state are drawn there).
Attention rescoring (``rescore=True``): the encoder output kept per stream, the jobs advanced within
the tick budget (step 9), and a stream suspended or resumed mid-rescoring.
"""

from __future__ import annotations

import torch

from oasr.engine.rescoring import RescoreJob
from oasr.engine.streaming.records import (
    RESCORING,
    _Stream,
)
from oasr.sessions.format import (
    RescoreProgress,
    SessionError,
    SessionGeometry,
    StreamSession,
    encode_session,
)
from oasr.sessions.stream import model_digest


class SecondPassMixin:
    """A part of ``StreamingEngine``: its attention rescoring (U2/WeNet two-pass); no state of its own."""

    # ---- attention rescoring (U2/WeNet two-pass) ------------------------------------------------------
    def _setup_rescoring(self, rescore: bool, rescorer, ctc_weight: float) -> None:
        """With ``rescore=True`` a finished stream's CTC n-best is rescored by an attention decoder
        (``rescorer``, default a seeded ``AttentionDecoder`` over this encoder's hidden size):
        score = decoder log-likelihood + ``ctc_weight`` * CTC log-score. The model step returns the
        encoder output (the CTC head's input) beside the log-probs -- graphed, into the width's static
        output buffers -- so rescoring runs with or without CUDA graphs and reads the same values."""
        self.rescore, self.rescorer, self.ctc_weight = bool(rescore), None, float(ctc_weight)
        if not self.rescore:
            return
        if self.decoder != "beam":
            raise ValueError("StreamingEngine: rescore=True rescores the CTC n-best; it needs decoder='beam'")
        from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig

        cfg = self.model.config
        self.rescorer = rescorer or AttentionDecoder(DecoderConfig(vocab_size=cfg.vocab_size,
                                                                   encoder_dim=cfg.hidden_dim, seed=cfg.seed))
        if self.rescorer.config.vocab_size != cfg.vocab_size or self.rescorer.config.encoder_dim != cfg.hidden_dim:
            raise ValueError(
                f"StreamingEngine: the rescorer (vocab_size={self.rescorer.config.vocab_size}, encoder_dim="
                f"{self.rescorer.config.encoder_dim}) does not match the encoder (vocab_size={cfg.vocab_size}, "
                f"hidden_dim={cfg.hidden_dim})"
            )

    def _keep_encoder_out(self, cohort: list, enc: list, hidden) -> None:
        if not self.rescore:
            return
        for row, sid in enumerate(cohort):
            self._streams[sid].encoder_out.append(hidden[row, : enc[row]].clone())

    def _kept_encoder_out(self, s: _Stream) -> torch.Tensor:
        """The stream's kept encoder output so far, ``(offset, hidden_dim)`` fp32, for its session."""
        if s.encoder_out:
            return torch.cat(s.encoder_out)
        return torch.zeros(0, self.model.config.hidden_dim)

    def _run_rescoring(self, outputs: dict) -> int:
        """Step 9: advance the rescoring jobs within the tick budget; returns the decoder steps run."""
        steps, start = 0, None
        while self._rescoring:
            if self.decode_steps_per_tick is not None and steps >= self.decode_steps_per_tick:
                break
            now = self.clock()
            if start is None:
                start = now
            elif self.max_tick_ms is not None and (now - start) * 1e3 >= self.max_tick_ms:
                break
            sid, job = self._rescoring[0]
            steps += 1
            if job.advance():
                self._rescoring.pop(0)
                s = self._streams[sid]
                tokens, _ = job.result()
                nbest, s.nbest = s.nbest, None
                self._complete(s, s.finish_reason, list(tokens), nbest, outputs)
        return steps

    @property
    def rescorer_digest(self) -> bytes:
        """blake2b-256 of the rescorer's weights: a job's decoder rows only resume on the same rescorer."""
        if getattr(self, "_rescorer_digest", None) is None:
            self._rescorer_digest = model_digest(self.rescorer)
        return self._rescorer_digest

    def _suspend_rescoring(self, s: _Stream) -> bytes:
        """``suspend`` of a stream whose rescoring job runs: the job's state, no caches (they are freed)."""
        from oasr.sessions.decoder_rows import capture_dense

        i, job = next((i, job) for i, (sid, job) in enumerate(self._rescoring) if sid == s.stream_id)
        e = self._engine_stream(s, torch.zeros(0, self.input_dim, dtype=self.config.dtype))
        e.rescoring = RescoreProgress(s.finish_reason, list(s.first_pass), self.rescorer_digest, job.steps,
                                      list(s.nbest), job.scores.clone())
        session = StreamSession(SessionGeometry.of(self.config), None, [], engine=e)
        if job.steps:
            session.decoder_rows = capture_dense(job.kv)
        else:
            session.encoder_out = job._enc.float().cpu()
        data = encode_session(session)
        self._rescoring.pop(i)
        del self._streams[s.stream_id]
        return data

    def _resume_rescoring(self, session, stream_id):
        """``resume`` of a stream saved mid-rescoring: its job goes on here, after the jobs queued already."""
        e, job = session.engine, session.engine.rescoring
        wrong = []
        if not self.rescore:
            wrong.append("rescoring: the stream was suspended mid-rescoring, this engine does not rescore "
                         "(rescore=False)")
        else:
            if job.rescorer_digest != self.rescorer_digest:
                wrong.append("rescorer weights: the job ran on another attention decoder (digest differs)")
            if e.model_digest != self.model_digest:
                wrong.append("model weights: the session ran on another model (digest differs)")
            mcfg = self.model.config
            for name, a, b in (("decoder", e.decoder, self.decoder), ("input_dim", e.input_dim, self.input_dim),
                               ("vocab_size", e.vocab_size, mcfg.vocab_size)):
                if a != b:
                    wrong.append(f"{name}: session {a!r}, here {b!r}")
            if self.keep_log_probs and e.log_probs is None:
                wrong.append("log-probs: this engine keeps them, the session carries none")
            if session.encoder_out is not None and session.encoder_out.shape[0] != e.offset:
                wrong.append(f"encoder output: {session.encoder_out.shape[0]} frames for offset {e.offset}")
        if wrong:
            raise SessionError("foreign session for this engine: " + "; ".join(wrong))
        enc = None if session.encoder_out is None else session.encoder_out
        try:
            rescore = RescoreJob.resume(self.rescorer, job.nbest, self.ctc_weight, self.ops, job.steps, job.scores,
                                        enc=enc, rows=session.decoder_rows)
        except ValueError as exc:
            raise SessionError(f"foreign session for this engine: the rescoring job does not fit: {exc}") from None
        stream_id = self._claim_id(e.stream_id if stream_id is None else stream_id)
        s = _Stream(stream_id, None, state=RESCORING, partial=list(e.partial), ended=True, offset=e.offset,
                    input_frames=e.input_frames, max_extent=e.max_extent, finish_reason=job.finish_reason,
                    arrival_tick=self.tick, first_pass=list(job.first_pass), nbest=list(job.nbest))
        if self.keep_log_probs and e.log_probs.shape[0]:
            s.log_probs = [e.log_probs]
        self._streams[stream_id] = s
        self._rescoring.append((stream_id, rescore))
        return stream_id

    def _rescoring_difference(self, session) -> str:
        """Why ``session``'s rescoring state does not fit this engine ("" if it does)."""
        if session.encoder_out is None and self.rescore:
            return ("rescoring: this engine rescores (rescore=True), the session carries no kept encoder output "
                    "(it was saved with rescore=False), so the second pass would see part of the utterance")
        if session.encoder_out is not None and not self.rescore:
            return ("rescoring: the session carries the encoder output kept for attention rescoring (saved with "
                    "rescore=True), this engine does not rescore (rescore=False)")
        return ""
