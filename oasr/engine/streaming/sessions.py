"""The streaming engine's sessions: suspend, checkpoint and resume a stream as session bytes.

Part of ``oasr.engine.streaming.engine.StreamingEngine`` (its contract and state are drawn there).
A stream as session bytes (``oasr.sessions.format``, ``oasr.sessions.stream``): ``suspend`` takes it
out, ``checkpoint`` copies it, ``resume`` brings it back into this or another engine.
"""

from __future__ import annotations

import dataclasses

import torch

from oasr.cache.errors import StreamCapacityError
from oasr.engine.decoding import GreedyCtcDecoder
from oasr.engine.streaming.records import (
    ACTIVE,
    FINISHED,
    RESCORING,
    WAITING,
    _Stream,
    refuse_unless_offered,
)
from oasr.sessions.format import (
    EngineStream,
    SessionError,
    SessionGeometry,
    encode_session,
    read_session,
)
from oasr.sessions.stream import capture_stream, check_session, model_digest


class SessionsMixin:
    """A part of ``StreamingEngine``: its sessions; no state of its own."""

    @property
    def model_digest(self) -> bytes:
        """blake2b-256 of the model's weights, computed once: a session only resumes on the same model."""
        if getattr(self, "_model_digest", None) is None:
            self._model_digest = model_digest(self.model)
        return self._model_digest

    def suspend(self, stream_id) -> bytes:
        """Take a stream out of the engine as session bytes (``oasr.sessions.format``); its blocks and slot are freed.

        The session holds the stream's caches and what the engine keeps of it: unconsumed
        input, whether it ended, its counters, its partial hypothesis, (with
        ``keep_log_probs``) its log-probs so far and (with ``rescore``) the encoder output kept
        for the second pass. ``resume`` on any engine of the same model and geometry, and the
        same ``rescore`` setting, either twin, continues it exactly. An active stream, or a resumed
        one still waiting for admission, can be suspended; a stream never admitted holds no
        state yet and a finished one has nothing to continue (``ValueError``; nothing changes).
        A stream being rescored (``"rescoring"``) leaves with its job: the n-best, the scores and
        step so far, and the job's decoder K/V rows (before its first step, the encoder output).
        """
        self._check_open()
        refuse_unless_offered(type(self.backend), self.model, "sessions", "suspend")
        s = self._stream(stream_id)
        if s.state == RESCORING:
            return self._suspend_rescoring(s)
        if s.state == FINISHED or (s.state == WAITING and s.session is None):
            why = "has finished" if s.state == FINISHED else "was never admitted (it holds no cache state yet)"
            raise ValueError(f"stream {stream_id!r} {why}: only an admitted stream can be suspended")
        data = self._session_bytes(s)
        if s.state == ACTIVE:
            self._contexts.pop(stream_id).free()
            self.states.free_stream(stream_id)
            self._active.remove(stream_id)
        else:
            self._waiting.remove(stream_id)
        del self._streams[stream_id]
        return data

    def checkpoint(self, stream_id) -> bytes:
        """The session bytes ``suspend`` would return for the stream, taken without suspending it.

        The stream stays live, holding its blocks and slot; nothing of the engine changes. ``resume``
        of the bytes (after a crash, in another process) continues the stream from this point exactly
        as ``resume`` of ``suspend``'s bytes does. Refused (``ValueError``, nothing changes) for a stream
        ``suspend`` refuses and for one being rescored (its job is not copied: a server keeps its last
        checkpoint from before the rescoring began).
        """
        self._check_open()
        refuse_unless_offered(type(self.backend), self.model, "sessions", "checkpoint")
        s = self._stream(stream_id)
        if s.state not in (ACTIVE, WAITING) or (s.state == WAITING and s.session is None):
            why = {RESCORING: "is being rescored", FINISHED: "has finished"}.get(
                s.state, "was never admitted (it holds no cache state yet)")
            raise ValueError(f"stream {stream_id!r} {why}: only an admitted stream can be checkpointed")
        return self._session_bytes(s)

    def _session_bytes(self, s: _Stream) -> bytes:
        """The session of an active stream, or of a resumed one waiting for admission (nothing changes)."""
        pending = torch.cat(s.pending) if s.pending else torch.zeros(0, self.input_dim, dtype=self.config.dtype)
        log_probs = None
        if self.keep_log_probs:
            log_probs = torch.cat(s.log_probs) if s.log_probs else torch.zeros(0, self.model.config.vocab_size)
        greedy = s.greedy
        extra = EngineStream(
            s.stream_id, self.model_digest, self.input_dim, self.model.config.vocab_size, self.decoder, s.ended,
            s.offset, s.input_frames, s.max_extent, list(s.partial), pending, log_probs,
            list(greedy.tokens) if greedy else [], greedy._last if greedy else 0,
        )
        if s.state == ACTIVE:
            session = capture_stream(s.stream_id, self.att, [self.cnn, self.states], self.ctc, engine=extra)
        else:  # resumed, not admitted again yet: its session as read, with today's engine part
            session = dataclasses.replace(s.session, engine=extra)
        session.encoder_out = self._kept_encoder_out(s) if self.rescore else None
        return encode_session(session)

    def _engine_stream(self, s: _Stream, pending: torch.Tensor) -> EngineStream:
        log_probs = None
        if self.keep_log_probs:
            log_probs = torch.cat(s.log_probs) if s.log_probs else torch.zeros(0, self.model.config.vocab_size)
        return EngineStream(s.stream_id, self.model_digest, self.input_dim, self.model.config.vocab_size,
                            self.decoder, s.ended, s.offset, s.input_frames, s.max_extent, list(s.partial), pending,
                            log_probs)

    def resume(self, data, stream_id=None):
        """Add a suspended stream back; it carries its state and is admitted ahead of new arrivals, as
        soon as there is room, whether or not it has input yet (module docstring).

        ``data`` is verified whole first (``oasr.sessions.format.read_session``: truncated, corrupt or
        foreign bytes raise ``SessionError`` naming what differs), then against this engine:
        geometry, K/V format, declared states, decoder and its configuration, the model's
        weights, and rescoring: a session carries the kept encoder output exactly when it was
        saved by an engine with ``rescore=True``, and only such an engine takes it (the second
        pass needs every encoder frame; the rescorer and ``ctc_weight`` are this engine's own).
        ``stream_id`` None takes the id the session was saved under (or a fresh one if
        that was neither an int nor a str); an id in use raises ``ValueError``. Nothing changes
        on an error. Admission then restores the caches (``oasr.sessions.stream.restore_stream``) in
        new slots and blocks; the stream goes on exactly as if it had never left. Returns its id.
        """
        self._check_open()
        refuse_unless_offered(type(self.backend), self.model, "sessions", "resume")
        session = read_session(data, expect=SessionGeometry.of(self.config))
        e = session.engine
        if e is None:
            raise SessionError("session has no engine stream section: it was saved from caches, not an engine "
                               "(use oasr.sessions.stream.load_stream)")
        if session.rescoring:
            return self._resume_rescoring(session, stream_id)
        rescoring = self._rescoring_difference(session)  # first: it also explains a differing n-best size
        if rescoring:
            raise SessionError(f"foreign session for this engine: {rescoring}")
        check_session(session, self.att, [self.cnn, self.states], self.ctc)
        mcfg = self.model.config
        wrong = [f"{name}: session {a!r}, here {b!r}" for name, a, b in (
            ("decoder", e.decoder, self.decoder), ("input_dim", e.input_dim, self.input_dim),
            ("vocab_size", e.vocab_size, mcfg.vocab_size), ("pending dtype", e.pending.dtype, self.config.dtype),
        ) if a != b]
        if e.model_digest != self.model_digest:
            wrong.append("model weights: the session ran on another model (digest differs)")
        beam = session.beam
        if beam is not None and (beam.batch, beam.vocab_size) != (1, mcfg.vocab_size):
            wrong.append(f"CTC state: {beam.batch} rows over {beam.vocab_size} tokens, the engine decodes 1 row "
                         f"over {mcfg.vocab_size}")
        if self.keep_log_probs and e.log_probs is None:
            wrong.append("log-probs: this engine keeps them, the session carries none")
        if e.input_frames != e.offset * self.rate:  # every chunk before a suspension is a whole one
            wrong.append(f"frame counts: {e.input_frames} feature frames consumed for offset {e.offset} encoder "
                         f"frames, this model makes one encoder frame of every {self.rate}")
        if wrong:
            raise SessionError("foreign session for this engine: " + "; ".join(wrong))
        need = -(-session.kv.seqlen // self.config.block_size_frames)
        if need > self.config.blocks_per_stream:  # admission could never restore it
            raise StreamCapacityError(stream_id if stream_id is not None else e.stream_id, need,
                                      self.config.blocks_per_stream)
        stream_id = self._claim_id(e.stream_id if stream_id is None else stream_id)
        greedy = None
        if self.decoder == "greedy":
            greedy = GreedyCtcDecoder(mcfg.vocab_size)
            greedy.tokens, greedy._last = list(e.greedy_tokens), e.greedy_last
        s = _Stream(stream_id, greedy, partial=list(e.partial), ended=e.ended, offset=e.offset,
                    input_frames=e.input_frames, max_extent=e.max_extent, session=session, arrival_tick=self.tick)
        if e.pending.shape[0]:
            s.pending, s.num_pending = [e.pending], e.pending.shape[0]
        if self.keep_log_probs and e.log_probs.shape[0]:
            s.log_probs = [e.log_probs]
        if self.rescore and session.encoder_out.shape[0]:
            s.encoder_out = [session.encoder_out]
        self._streams[stream_id] = s
        self._waiting.append(stream_id)
        return stream_id
