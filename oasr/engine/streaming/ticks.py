"""The streaming engine's tick: pick a cohort, run the model step, decode, finish.

Part of ``oasr.engine.streaming.engine.StreamingEngine`` (its contract and state are drawn there).
One tick (steps 2-8 in ``oasr.engine.streaming.engine``'s docstring) and ``run``: the cohort of streams
holding a chunk, its width, the model step (fast eager or graphed, reference, or a fixed-extent runtime),
the cohort's CTC decode, each stream's ``StepOutput``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import numpy as np
import torch

from oasr.engine.streaming.records import (
    StepOutput,
    TickStats,
    _common_prefix,
    _Stream,
)


class TickMixin:
    """A part of ``StreamingEngine``: its tick; no state of its own."""

    def cohort_width(self, num_streams: int) -> int:
        """Rows of the forward for ``num_streams`` ready streams: the smallest of ``cohort_widths`` that holds
        them (next power of two, capped at ``max_batch_size``; on a CPU engine the finer ladder)."""
        return next((w for w in self.cohort_widths if w >= num_streams), self.config.max_batch_size)

    def step(self) -> dict:
        """Run one tick; returns ``{stream_id: StepOutput}`` for every stream that produced or finished."""
        self._check_open()
        started = time.perf_counter()
        clock = self.stage_clock
        timed = clock.host["model"] + clock.host["decode"]
        self.tick += 1
        outputs: dict = {}
        # a waiting stream that ended with too little input for one encoder frame needs no admission
        for sid in list(self._waiting):
            s = self._streams[sid]
            if s.ended and s.num_pending < self.rate and s.session is None:  # a resumed one finishes from its state
                self._finish(s, "eos", outputs)
        self._admit()

        cohort, frames_in = [], []
        for sid in list(self._active):
            s = self._streams[sid]
            n = min(s.num_pending, self.chunk_input_frames)
            if n < self.chunk_input_frames and not s.ended:
                continue
            if n < self.rate:  # ended, nothing left that makes an encoder frame
                self._finish(s, "eos", outputs)
            elif self.backend.at_capacity(sid, n // self.rate):
                self._finish(s, "length", outputs)
            else:
                cohort.append(sid)
                frames_in.append(n)

        width, encoder_frames = 0, 0
        active = len(self._active)  # streams holding blocks while the cohort is in flight
        used, live = self._used_blocks(), sum(self.backend.history_frames(sid) for sid in self._active)
        if cohort:
            width = self.cohort_width(len(cohort))
            enc = [n // self.rate for n in frames_in]
            if self.att is not None:
                self.att.prepare_chunks_batched(cohort, enc)
            used = self._used_blocks()
            live += sum(enc)
            encoder_frames = sum(enc)
            self._forward(cohort, frames_in, enc, width, outputs)
        decode_steps = self._run_rescoring(outputs)
        self.stats.append(TickStats(
            tick=self.tick, cohort=len(cohort), width=width, active=active,
            waiting=sum(1 for sid in self._waiting if self._ready(self._streams[sid])),
            used_blocks=used, live_frames=live, encoder_frames=encoder_frames, input_frames=sum(frames_in),
            finished=sum(1 for o in outputs.values() if o.finished), decode_steps=decode_steps,
        ))
        clock.stream_chunks += len(cohort)
        clock.add("bookkeeping", time.perf_counter() - started - (clock.host["model"] + clock.host["decode"] - timed))
        return outputs

    def _take(self, s: _Stream, n: int) -> torch.Tensor:
        buffered = torch.cat(s.pending) if len(s.pending) > 1 else s.pending[0]
        taken, rest = buffered[:n], buffered[n:]
        s.pending = [rest] if rest.shape[0] else []
        s.num_pending -= n
        return taken

    def _forward(self, cohort: list, frames_in: list, enc: list, width: int, outputs: dict) -> None:
        for row, sid in enumerate(cohort):
            s = self._streams[sid]
            s.max_extent = max(s.max_extent, self.backend.history_frames(sid) + enc[row])
        clock, started = self.stage_clock, time.perf_counter()
        if self.att is None:
            log_probs, hidden = self._model_step_fixed_extent(cohort, frames_in)
        elif self.model_tick is not None:
            log_probs, hidden = self._model_step_fast(cohort, frames_in, enc, width)
        else:
            log_probs, hidden = self._model_step_reference(cohort, frames_in, enc, width)
        decoding = time.perf_counter()
        clock.add("model", decoding - started)
        self._keep_encoder_out(cohort, enc, hidden)
        chunks = [log_probs[row, : enc[row]] for row in range(len(cohort))]
        speech = None
        if self.emit_speech_probs:  # one op for the cohort
            from oasr.vad import ctc_speech_probability

            blank = self.ctc_config.blank_id if self.ctc_config is not None else 0
            speech = ctc_speech_probability(log_probs[: len(cohort), : max(enc)], blank)
        with clock.device_region("decode"):
            partials = self._decode(cohort, chunks)
        clock.add("decode", time.perf_counter() - decoding)
        clock.collect()
        for row, sid in enumerate(cohort):
            s = self._streams[sid]
            n = enc[row]
            s.offset += n
            s.input_frames += frames_in[row]
            if self.keep_log_probs:
                s.log_probs.append(chunks[row].clone())
            kept = _common_prefix(s.partial, partials[row])
            outputs[sid] = StepOutput(sid, partials[row][kept:], n, retracted=len(s.partial) - kept,
                                      partial=list(partials[row]),
                                      speech_probs=None if speech is None else speech[row, :n].clone(),
                                      log_probs=chunks[row].clone() if self.emit_log_probs else None)
            s.partial = list(partials[row])
            if s.ended and s.num_pending < self.rate:
                self._finish(s, "eos", outputs)

    def _model_region(self, width: int):
        monitor = self.tick_monitor
        return nullcontext() if monitor is None else monitor.region(f"tick {self.tick}, width {width}")

    def _model_step_fast(self, cohort: list, frames_in: list, enc: list, width: int) -> tuple:
        """Fill the pinned inputs on the host, then the capture-safe region: model step, commit, readback.

        Returns ``(log_probs, hidden)`` as float32 CPU tensors; ``hidden`` (the encoder output) only with
        ``rescore``, else None."""
        tick = self.model_tick
        xs, meta = tick.host_inputs(width)
        xs.zero_()
        values = np.zeros((width, 2), dtype=np.int64)
        for row, (sid, n) in enumerate(zip(cohort, frames_in, strict=True)):
            s = self._streams[sid]
            xs[row, :n] = self._take(s, n)
            values[row] = (s.offset, n)
        meta.numpy()[:] = values
        with self._model_region(width), self.stage_clock.device_region("model"):
            tick.run(cohort, width)
            self.att.commit_chunks_batched(cohort, enc)
        return tick.log_probs(width), (tick.hidden(width) if self.rescore else None)

    def _model_step_reference(self, cohort: list, frames_in: list, enc: list, width: int) -> tuple:
        """The reference twin's step: plain tensors through ``forward_chunk_paged`` (the oracle's way);
        returns ``(log_probs, hidden or None)`` like ``_model_step_fast``."""
        cfg = self.config
        pad = width - len(cohort)
        xs = torch.zeros((width, self.chunk_input_frames, self.input_dim), dtype=cfg.dtype)
        offsets = []
        for row, (sid, n) in enumerate(zip(cohort, frames_in, strict=True)):
            s = self._streams[sid]
            xs[row, :n] = self._take(s, n)
            offsets.append(s.offset)
        caches = self.att.get_paged_caches(cohort, pad_to=width)
        cnn_cache = self.cnn.get_cache(cohort, pad_to=width)
        views = self.states.views(cohort, pad_to=width)
        extra = {"with_hidden": True} if self.rescore else {}
        log_probs, _, new_cnn, *hidden = self.model.forward_chunk_paged(
            xs.to(cfg.device), offsets + [0] * pad, caches, cnn_cache, views, frames_in + [0] * pad, twin=self.ops,
            **extra,
        )
        self.att.commit_chunks_batched(cohort, enc)
        self.cnn.update(cohort, new_cnn, pad_to=width)
        return log_probs.float().cpu(), (hidden[0].float().cpu() if hidden else None)

    def _model_step_fixed_extent(self, cohort: list, frames_in: list) -> tuple:
        """A slot or stateful runtime's step: the cohort's features through ``backend.forward_step`` (the slot
        runtime pads to its width through the padding lane and may replay a graph; the stateful one runs at
        batch N). Returns ``(log_probs, None)``: the list API gives no encoder output. The slot runtime wraps
        its own device step (gather, step or replay, scatter) in ``tick_monitor``'s region; the stateful one
        captures nothing, so nothing of it is checked."""
        xs = torch.zeros((len(cohort), self.chunk_input_frames, self.input_dim), dtype=self.config.dtype)
        for row, (sid, n) in enumerate(zip(cohort, frames_in, strict=True)):
            xs[row, :n] = self._take(self._streams[sid], n)
        if hasattr(self.backend, "step_monitor"):
            self.backend.step_monitor = self.tick_monitor
        log_probs, _ = self.backend.forward_step(cohort, xs.to(self.config.device), frames_in)
        return log_probs.float().cpu(), None

    def _used_blocks(self) -> int:
        return 0 if self.pool is None else self.pool.num_used_blocks

    def _decode(self, cohort: list, chunks: list) -> list:
        """Decode the cohort's chunks; return each stream's best partial token list."""
        if self.ctc is None:
            for sid, lp in zip(cohort, chunks, strict=True):
                self._streams[sid].greedy.decode_chunk(lp)
            return [self._streams[sid].greedy.finalize() for sid in cohort]
        # one batched decoder call for the whole cohort; short last chunks are masked per row
        # inference mode: the search's temporaries skip autograd's bookkeeping (~15% of its CPU time); it
        # only writes into the states' existing buffers, so no inference tensor outlives the call
        with torch.inference_mode():
            self.ctc.decode_cohort(list(cohort), [lp.unsqueeze(0) for lp in chunks])
            return [list(rows[0].tokens) for rows in self.ctc.peek_cohort(list(cohort))]  # one read, whole cohort

    def run(self, max_ticks: int | None = None) -> dict:
        """Step until no tick makes progress (everything finished, or waiting for input).

        Returns ``{stream_id: StreamResult}`` for the streams that finished during the run.
        """
        finished = {}
        ticks = 0
        while max_ticks is None or ticks < max_ticks:
            outputs = self.step()
            ticks += 1
            for sid, out in outputs.items():
                if out.finished:
                    finished[sid] = self.results[sid]
            if not outputs and not self._progress_possible():
                break
        return finished

    def _progress_possible(self) -> bool:
        """Could another tick do anything without new input?"""
        if self._rescoring:
            return True
        for sid in self._active:
            s = self._streams[sid]
            if s.ended or s.num_pending >= self.chunk_input_frames:
                return True
        return any(self._ready(self._streams[sid]) or self._streams[sid].session is not None
                   for sid in self._waiting) and self.can_admit()
