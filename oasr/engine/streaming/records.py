"""The streaming engine's records: stream states, ids, what a tick reports and what a stream leaves.

``StepOutput`` (one stream, one tick), ``StreamResult`` (a finished stream), ``TickStats`` (one tick's
bookkeeping) and ``_Stream`` (what the engine keeps per stream); the stream id rule (``check_stream_id``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oasr.engine.decoding import GreedyCtcDecoder

WAITING, ACTIVE, RESCORING, FINISHED = "waiting", "active", "rescoring", "finished"
STREAM_ID_BITS = 64  # an int id is stored as a signed 64-bit integer in a session
ADMISSION_POLICIES = ("length", "arrival")


def check_stream_id(stream_id) -> None:
    """A stream id is an ``int`` within signed 64 bits or a ``str`` encodable as UTF-8: the two kinds a
    session stores (so a suspended stream comes back under its own id). ``ValueError`` otherwise: a
    bool (it would collide with 0 and 1), a float, bytes, a tuple, a numpy integer (pass ``int(x)``)."""
    if isinstance(stream_id, str):
        try:
            stream_id.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"stream id {stream_id!r}: a str id must be encodable as UTF-8") from None
        return
    if isinstance(stream_id, int) and not isinstance(stream_id, bool):
        low, high = -(2 ** (STREAM_ID_BITS - 1)), 2 ** (STREAM_ID_BITS - 1)
        if not low <= stream_id < high:
            raise ValueError(f"stream id {stream_id}: an int id must fit in signed 64 bits [{low}, {high})")
        return
    raise ValueError(f"stream ids are ints or strs, got {stream_id!r} ({type(stream_id).__name__})")


def refuse_unless_offered(backend_cls, model, feature: str, what: str) -> None:
    """``ValueError`` naming the model's streaming kind when its runtime cannot offer ``feature``
    (``StreamingEncoderBackend.refusal``); ``what`` is the call or argument that asked for it."""
    reason = backend_cls.refusal(model, feature)
    if reason is not None:
        raise ValueError(f"StreamingEngine: {what} is not offered for {type(model).__name__} "
                         f"(streaming_kind={backend_cls.kind!r}): {reason}")


def _common_prefix(old: list, new: list) -> int:
    """Length of the longest common prefix of two token lists (compared in C while they agree)."""
    n = min(len(old), len(new))
    if old[:n] == new[:n]:
        return n
    return next(i for i, (a, b) in enumerate(zip(old[:n], new[:n], strict=True)) if a != b)


@dataclass
class StepOutput:
    """What one stream produced in one tick.

    ``partial`` is the stream's best hypothesis so far. Beam search may revise
    its tail, so the change since the previous tick is reported as an edit:
    drop the last ``retracted`` tokens shown, then append ``new_tokens``
    (greedy decoding never retracts).
    """

    stream_id: object
    new_tokens: list
    num_frames: int  # encoder (log-prob) frames produced this tick
    finished: bool = False
    finish_reason: str | None = None  # "eos" or "length" once finished
    retracted: int = 0
    partial: list = field(default_factory=list)
    # with ``engine.emit_speech_probs``: ``1 - p(blank)`` of this tick's ``num_frames`` frames (the endpointer's input)
    speech_probs: torch.Tensor | None = None
    # with ``engine.emit_log_probs``: this tick's ``[num_frames, vocab]`` CTC log-probs (a word search's input)
    log_probs: torch.Tensor | None = None


@dataclass
class StreamResult:
    """A finished stream: its tokens, and its log-probs when the engine keeps them."""

    stream_id: object
    tokens: list
    num_frames: int
    num_input_frames: int
    finish_reason: str
    log_probs: torch.Tensor | None
    admitted_tick: int | None
    finished_tick: int
    nbest: list = field(default_factory=list)  # CtcHypothesis records, best first (beam search)
    first_pass: list | None = None  # with rescore=True: the CTC best before attention rescoring


@dataclass
class TickStats:
    """Bookkeeping of one tick, taken while the cohort's blocks are in flight (the tick's peak)."""

    tick: int
    cohort: int
    width: int
    active: int  # streams holding a slot (and blocks)
    waiting: int  # streams with input ready that admission holds back
    used_blocks: int
    live_frames: int
    encoder_frames: int
    input_frames: int
    finished: int
    decode_steps: int = 0  # attention-decoder steps run this tick (rescoring), within the tick budget


@dataclass
class _Stream:
    stream_id: object
    greedy: GreedyCtcDecoder | None  # only with decoder="greedy"; beam states live in the pool
    state: str = WAITING
    partial: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    num_pending: int = 0
    ended: bool = False
    offset: int = 0  # encoder frames produced so far (the next chunk's absolute position)
    input_frames: int = 0  # feature frames consumed by the encoder
    log_probs: list = field(default_factory=list)
    finish_reason: str | None = None
    admitted_tick: int | None = None
    max_extent: int = 0  # most K/V frames a chunk of this stream ever attended to
    session: object = None  # a resumed stream's StreamSession until admission restores it (see resume)
    arrival_tick: int = 0  # engine.tick when add_stream ran (the admission clock)
    encoder_out: list = field(default_factory=list)  # with rescore=True: the encoder's chunks, for the 2nd pass
    first_pass: list | None = None
    nbest: list | None = None  # while rescoring: the CTC n-best its job scores
