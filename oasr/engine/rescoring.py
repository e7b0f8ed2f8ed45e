"""``RescoreJob``: one stream's attention rescoring, advanced one decoder step at a time.

The second pass (U2/WeNet) scores each CTC n-best hypothesis ``h`` with the
attention decoder, ``log p(h + eos | sos, encoder output)``, and picks the best
``decoder score + ctc_weight * CTC score``. Here that teacher-forced scoring runs
autoregressively over the decoder's K/V cache, all hypotheses of the stream as the
rows of one decode group, so the engine can spread it over ticks under a step
budget and a deadline (``StreamingEngine(decode_steps_per_tick=, max_tick_ms=)``)::

    rows   h0: sos a  b  c  eos            step 0  prefill(sos)   -> log p(a | sos)  per row
           h1: sos a  d  eos               step 1  step(a, a)     -> log p(b | sos a), log p(d | sos a)
           h2: sos e  eos                  step 2  step(b, d, e)  -> ...
                                           ...     one step per position of the longest hypothesis
    a row past its eos is fed eos and its outputs are ignored (it never changes another row)

A job's arithmetic does not depend on when its steps run: a budget that cuts it
across ticks gives the same scores, bit for bit, as running it in one go. The
scores equal ``AttentionDecoder.score`` (the teacher-forced forward over all
positions at once) up to float rounding; the picked hypothesis is the same unless
two combined scores tie to within that rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oasr.decoder.config import DecoderRequest


class RescoreJob:
    """Rescore ``nbest`` (``CtcHypothesis`` records) against ``enc (S, encoder_dim)`` with ``decoder``.

    ``ops``: the twin module whose ``DenseDecoderKV`` holds the group (the decoder's device
    and dtype). ``advance()`` runs one decoder step and returns True once every position is
    scored; ``steps`` counts the steps taken, ``total_steps`` is fixed at construction
    (the longest hypothesis plus one). ``result()`` gives ``(best tokens, combined scores)``
    like ``attention_rescore``.
    """

    def __init__(self, decoder, enc: torch.Tensor, nbest, ctc_weight: float, ops):
        self.decoder, self.ctc_weight = decoder, float(ctc_weight)
        self.hyps = [list(h.tokens) for h in nbest]
        self.ctc_scores = [float(h.log_score) for h in nbest]
        if not self.hyps:
            raise ValueError("RescoreJob: an empty n-best list has nothing to rescore")
        cfg = decoder.config
        param = next(decoder.parameters())
        self.device = param.device
        longest = max(len(h) for h in self.hyps)
        self.total_steps = longest + 1  # the prefill (sos) and one step per token of the longest hypothesis
        rows = len(self.hyps)
        self.inputs = torch.full((rows, longest + 1), cfg.eos, dtype=torch.long)  # position p feeds inputs[:, p]
        self.targets = torch.full((rows, longest + 1), cfg.eos, dtype=torch.long)  # and scores targets[:, p]
        self.inputs[:, 0] = cfg.sos
        for i, h in enumerate(self.hyps):
            if h:
                self.inputs[i, 1 : len(h) + 1] = torch.tensor(h, dtype=torch.long)
                self.targets[i, : len(h)] = torch.tensor(h, dtype=torch.long)
        self.lengths = torch.tensor([len(h) for h in self.hyps])
        self.scores = torch.zeros(rows, dtype=torch.float32)
        self.steps = 0
        enc = enc.to(device=self.device, dtype=param.dtype)
        cache_cfg = cfg.cache_config(max_rows=rows, max_self_tokens=self.total_steps,
                                     max_cross_tokens=max(enc.shape[0], 1), kv_storage="dense",
                                     device=self.device, dtype=param.dtype)
        request = DecoderRequest(prompt_len=1, max_new_tokens=longest, cross_len=enc.shape[0])
        self.kv = ops.DenseDecoderKV(cache_cfg, rows, request.self_tokens, request.cross_len)
        self._enc = enc

    @property
    def done(self) -> bool:
        """Whether every position is scored (``steps == total_steps``)."""
        return self.steps == self.total_steps

    @torch.no_grad()
    def advance(self) -> bool:
        """One decoder step for every row: position ``steps`` scored; True when the job is done."""
        if self.done:
            raise ValueError("RescoreJob.advance: the job is done")
        p = self.steps
        tokens = self.inputs[:, p].to(self.device)
        if p == 0:
            k, v = self.decoder.cross_kv(self._enc)  # one encoder output: its cross K/V once, every row
            for b in range(len(self.hyps)):
                self.kv.fill_cross(b, k, v)
            self._enc = None
            logits = self.decoder.prefill(self.kv, tokens[:, None])
        else:
            logits = self.decoder.step(self.kv, tokens)
        logp = F.log_softmax(logits.float(), -1).cpu()
        picked = logp.gather(1, self.targets[:, p, None])[:, 0]
        self.scores += torch.where(p <= self.lengths, picked, torch.zeros_like(picked))
        self.steps += 1
        if self.done:
            self.kv = None  # the group's buffers go back now, not when the job is dropped
        return self.done

    @classmethod
    def resume(cls, decoder, nbest, ctc_weight: float, ops, steps: int, scores: torch.Tensor, enc=None,
               rows=None) -> RescoreJob:
        """A job that goes on from a session (``oasr.sessions.format.RescoreProgress``): before its first step
        from the encoder output ``enc``; after it from its dense decoder rows ``rows``
        (``oasr.sessions.decoder_rows.DecoderRows``: every row ``steps`` tokens over the same cross K/V). It
        then runs the steps left exactly as the saved job would have (``SessionError`` if the rows do
        not fit this decoder)."""
        from oasr.sessions.decoder_rows import restore_dense

        if steps == 0:
            job = cls(decoder, enc, nbest, ctc_weight, ops)
        else:
            frames = rows.rows[0].cross_length if rows.rows else 0
            job = cls(decoder, torch.zeros(frames, decoder.config.encoder_dim), nbest, ctc_weight, ops)
            job.kv, job._enc = restore_dense(rows, job.kv.config, ops), None
        if not 0 <= steps < job.total_steps or tuple(scores.shape) != (len(job.hyps),):
            raise ValueError(f"RescoreJob.resume: step {steps} of {job.total_steps}, {tuple(scores.shape)} scores for "
                             f"{len(job.hyps)} rows")
        job.steps, job.scores = steps, scores.detach().to(torch.float32).clone()
        return job

    def result(self) -> tuple[list, list]:
        """``(tokens of the best hypothesis, combined score per hypothesis)``; only when done."""
        if not self.done:
            raise ValueError(f"RescoreJob.result: {self.total_steps - self.steps} step(s) still to run")
        combined = [float(d) + self.ctc_weight * c for d, c in zip(self.scores.tolist(), self.ctc_scores, strict=True)]
        best = max(range(len(self.hyps)), key=lambda i: combined[i])
        return self.hyps[best], combined
