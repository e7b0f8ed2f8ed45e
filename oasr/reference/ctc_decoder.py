"""Reference streaming CTC prefix beam search: plain Python, one prefix at a time.

This is the oracle. Every beam row is a Python list of prefixes, every frame
walks the beam and its candidate tokens in nested ``for`` loops, and equal
prefixes merge through a ``dict`` keyed by the token tuple, so merging is exact
by construction. Scores are Python floats (float64). There are no fast paths.
Its fast twin is ``oasr.fast.ctc_decoder`` (batched tensors over rows x beams x
candidates), which must return the same n-best token sequences and emission
frames, with scores within 1e-5.

The search rule, the tie-break order and the emission-frame rule are written
once, in ``oasr.ctc.config``; this file is a literal transcription of them::

    for each frame t:                      beam: [prefix, ...] in rank order
        entries = {}                       tokens -> candidate, in generation order
        for prefix in beam:                stay first, then extensions by token id
            entries[prefix]  += stay terms (pb' = score + lp[blank], pnb' = pnb + lp[last])
            for c in candidates(t):
                entries[prefix + c] += extension term
        beam = stable_sort(entries, by score, descending)[:beam_size]

Each row also holds a committed part: the prefix all its beam entries share, moved out of
the beam so a stream of any length fits ``max_prefix_len`` (``oasr.ctc.config``,
"Committed prefix"); hypotheses are the committed part plus the entry.

API (mirrored by the fast twin): ``create_state(batch, vocab_size)``,
``reset_state(state, batch, vocab_size)``, ``decode_chunk(state, log_probs)``
with ``log_probs`` of shape ``(batch, T, vocab)``, ``decode_chunks(states,
log_probs_list)``, ``step(state, log_probs_frame)``, ``peek(state)`` and
``finalize_stream(state)``. Every call validates first and is atomic: on an
exception the state is exactly as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from oasr.ctc.config import (
    BeamEntry,
    BeamSnapshot,
    CtcDecoderConfig,
    CtcHypothesis,
    check_cohort,
    check_log_probs,
    check_snapshot,
    check_state_shape,
    committed_rows,
    decode_bounded,
    pack_committed,
    settle_rows,
)

NEG_INF = -math.inf


def logaddexp(a: float, b: float) -> float:
    """``log(exp(a) + exp(b))`` for Python floats, exact when either side is ``-inf``."""
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    hi = max(a, b)
    return hi + math.log1p(math.exp(-abs(a - b)))


@dataclass
class Prefix:
    """One beam entry: a label sequence, its emission frames and its two log scores."""

    tokens: tuple[int, ...]
    frames: tuple[int, ...]
    pb: float
    pnb: float

    @property
    def score(self) -> float:
        """The prefix's total log-probability: ending in blank or not, log-added."""
        return logaddexp(self.pb, self.pnb)


def empty_beam() -> list[Prefix]:
    """The beam before any frame: the empty prefix with probability one (ends in blank)."""
    return [Prefix(tokens=(), frames=(), pb=0.0, pnb=NEG_INF)]


@dataclass
class CtcBeamState:
    """Per-stream decoder state: ``batch`` independent beams and a frame counter.

    ``beams[b]`` is row ``b``'s beam in rank order (best first), never longer
    than ``config.beam_size``, holding only prefixes with a finite score.
    ``frames_decoded`` counts frames consumed since the last reset; it is the
    absolute frame index of the next frame. ``committed[b]`` is row ``b``'s committed
    ``(tokens, frames)``: what precedes every prefix of the row (``oasr.ctc.config``).
    """

    config: CtcDecoderConfig
    batch: int
    vocab_size: int
    frames_decoded: int = 0
    beams: list[list[Prefix]] = field(default_factory=list)
    committed: list = field(default_factory=list)

    @property
    def longest(self) -> int:
        """The longest prefix any row keeps in its beam (past its committed part)."""
        return max((len(p.tokens) for beam in self.beams for p in beam), default=0)


@dataclass
class _Candidate:
    """A prefix of the next beam while it is being assembled (at most one stay, one extension)."""

    tokens: tuple[int, ...]
    stay_pb: float = NEG_INF
    stay_pnb: float = NEG_INF
    stay_frames: tuple[int, ...] | None = None
    ext_pnb: float = NEG_INF
    ext_frames: tuple[int, ...] | None = None

    def finish(self) -> Prefix:
        pnb = logaddexp(self.stay_pnb, self.ext_pnb)
        stay_total = logaddexp(self.stay_pb, self.stay_pnb)
        keep_stay = self.stay_frames is not None and (self.ext_frames is None or stay_total >= self.ext_pnb)
        frames = self.stay_frames if keep_stay else self.ext_frames
        return Prefix(tokens=self.tokens, frames=frames, pb=self.stay_pb, pnb=pnb)


def frame_candidates(lp: list[float], config: CtcDecoderConfig) -> list[int]:
    """Extension tokens of one frame, ascending: the top ``token_topk`` non-blank tokens by ``lp``."""
    non_blank = [v for v in range(len(lp)) if v != config.blank_id]
    k = config.num_candidates(len(lp))
    if k < len(non_blank):
        non_blank = sorted(non_blank, key=lambda v: (-lp[v], v))[:k]
    return sorted(non_blank)


def advance_beam(beam: list[Prefix], lp: list[float], t: int, config: CtcDecoderConfig) -> list[Prefix]:
    """One frame of prefix beam search on one row (see ``oasr.ctc.config`` for the rule)."""
    lp_blank = lp[config.blank_id]
    skip_extensions = lp_blank > config.blank_skip_log_threshold
    candidates = [] if skip_extensions else frame_candidates(lp, config)
    entries: dict[tuple[int, ...], _Candidate] = {}
    for prefix in beam:
        score = prefix.score
        last = prefix.tokens[-1] if prefix.tokens else None
        stay_pb = score + lp_blank
        stay_pnb = prefix.pnb + lp[last] if last is not None else NEG_INF
        if logaddexp(stay_pb, stay_pnb) > NEG_INF:
            entry = entries.setdefault(prefix.tokens, _Candidate(prefix.tokens))
            entry.stay_pb, entry.stay_pnb, entry.stay_frames = stay_pb, stay_pnb, prefix.frames
        for c in candidates:
            base = prefix.pb if c == last else score
            ext_pnb = base + lp[c]
            if ext_pnb == NEG_INF:
                continue
            tokens = prefix.tokens + (c,)
            entry = entries.setdefault(tokens, _Candidate(tokens))
            entry.ext_pnb, entry.ext_frames = ext_pnb, prefix.frames + (t,)
    finished = [entry.finish() for entry in entries.values()]
    finished = [p for p in finished if p.score > NEG_INF]
    finished.sort(key=lambda p: -p.score)  # stable: ties keep generation order
    return finished[: config.beam_size]


class StreamingCtcDecoder:
    """Reference CTC prefix beam search over ``(batch, T, vocab)`` log-probability chunks.

    Stateless itself: everything a stream needs lives in its
    :class:`CtcBeamState`, so one decoder serves any number of streams
    (``CtcStateCacheManager`` pools the states).
    """

    def __init__(self, config: CtcDecoderConfig | None = None):
        self.config = config if config is not None else CtcDecoderConfig()
        if not isinstance(self.config, CtcDecoderConfig):
            raise TypeError(f"StreamingCtcDecoder: config must be a CtcDecoderConfig, got {self.config!r}")

    # ---- state lifecycle ----------------------------------------------------
    def create_state(self, batch: int, vocab_size: int) -> CtcBeamState:
        """A fresh state of ``batch`` rows, each holding only the empty prefix."""
        check_state_shape("create_state", self.config, batch, vocab_size)
        return CtcBeamState(self.config, batch, vocab_size, 0, [empty_beam() for _ in range(batch)],
                            [([], []) for _ in range(batch)])

    def reset_state(self, state: CtcBeamState, batch: int, vocab_size: int) -> None:
        """Make ``state`` decode exactly as ``create_state(batch, vocab_size)`` would.

        Whatever the state held before (another stream's beams, garbage) is
        discarded; the beam list object itself is reused.
        """
        self._check_state(state, "reset_state")
        check_state_shape("reset_state", self.config, batch, vocab_size)
        state.beams.clear()
        state.beams.extend(empty_beam() for _ in range(batch))
        state.committed[:] = [([], []) for _ in range(batch)]
        state.batch, state.vocab_size, state.frames_decoded = batch, vocab_size, 0

    def snapshot_state(self, state: CtcBeamState) -> BeamSnapshot:
        """The state as a twin-neutral ``BeamSnapshot`` (reads it, changes nothing)."""
        self._check_state(state, "snapshot_state")
        return BeamSnapshot(state.batch, state.vocab_size, state.frames_decoded, self._beam_rows(state),
                            pack_committed(state.committed))

    @staticmethod
    def _beam_rows(state: CtcBeamState) -> tuple:
        return tuple(tuple(BeamEntry(p.tokens, p.frames, p.pb, p.pnb) for p in beam) for beam in state.beams)

    @staticmethod
    def _restore_rows(state: CtcBeamState, rows) -> None:
        state.beams[:] = [
            [Prefix(tuple(int(t) for t in e.tokens), tuple(int(f) for f in e.frames), float(e.log_pb),
                    float(e.log_pnb)) for e in row]
            for row in rows
        ]

    def restore_state(self, state: CtcBeamState, snapshot: BeamSnapshot) -> None:
        """Overwrite ``state`` so it decodes exactly as the state ``snapshot`` was taken from.

        ``snapshot`` may come from either twin; it is validated first (``check_snapshot``),
        and on an error ``state`` is unchanged.
        """
        self._check_state(state, "restore_state")
        check_snapshot("restore_state", self.config, snapshot)
        self._restore_rows(state, snapshot.rows)
        state.committed[:] = [([int(x) for x in t], [int(x) for x in f]) for t, f in committed_rows(snapshot)]
        state.batch, state.vocab_size = snapshot.batch, snapshot.vocab_size
        state.frames_decoded = snapshot.frames_decoded

    # ---- decoding -----------------------------------------------------------
    def decode_chunk(self, state: CtcBeamState, log_probs: torch.Tensor) -> None:
        """Consume a chunk ``(batch, T, vocab)`` of log-probabilities (``T`` may be 0)."""
        self.decode_chunks([state], [log_probs])

    def decode_chunks(self, states: list[CtcBeamState], log_probs_list: list[torch.Tensor]) -> None:
        """Consume one chunk per state (a cohort of streams); all or nothing.

        Mirrors the fast twin's batched entry point. Here it is a loop: every
        state and chunk is validated, every new beam computed, and only then
        are the states committed. Long chunks run in pieces and rows commit their
        shared prefix (``oasr.ctc.config.decode_bounded``), exactly as in the fast twin.
        """
        self._check_cohort(states, log_probs_list)
        decode_bounded(self.config, states, log_probs_list, lambda s: s.longest, self._settle, self._decode_fitting,
                       lambda chunks: None)  # the values were checked with the shapes

    def _settle(self, state: CtcBeamState) -> None:
        settled = settle_rows(self.config, self._beam_rows(state))
        if settled is not None:
            rows, additions = settled
            self._restore_rows(state, rows)
            for (tokens, frames), (t, f) in zip(state.committed, additions, strict=True):
                tokens.extend(t)
                frames.extend(f)

    def _decode_fitting(self, states: list[CtcBeamState], log_probs_list: list[torch.Tensor]) -> None:
        updates = []
        for state, log_probs in zip(states, log_probs_list, strict=True):
            lp_rows = log_probs.detach().to("cpu", torch.float64).tolist()
            beams = [list(beam) for beam in state.beams]
            for b in range(state.batch):
                for t, lp in enumerate(lp_rows[b]):
                    beams[b] = advance_beam(beams[b], lp, state.frames_decoded + t, self.config)
                    self._check_prefix_len(beams[b])
            updates.append((state, beams, state.frames_decoded + log_probs.shape[1]))
        for state, beams, frames_decoded in updates:
            state.beams[:] = beams
            state.frames_decoded = frames_decoded

    def step(self, state: CtcBeamState, log_probs_frame: torch.Tensor) -> None:
        """Consume one frame ``(batch, vocab)``: ``decode_chunk`` with ``T = 1``."""
        self._check_state(state, "step")
        check_log_probs("step", log_probs_frame, state.batch, state.vocab_size, frame_dim=False)
        self.decode_chunk(state, log_probs_frame.unsqueeze(1))

    # ---- results --------------------------------------------------------------
    def peek(self, state: CtcBeamState) -> list[CtcHypothesis]:
        """The current best partial hypothesis of every row (does not change the state).

        A row whose beam is empty (every path impossible) reports
        ``CtcHypothesis([], -inf, [])``.
        """
        self._check_state(state, "peek")
        return [_hypothesis(beam[0], c) if beam else CtcHypothesis([], NEG_INF, [])
                for beam, c in zip(state.beams, state.committed, strict=True)]

    def peek_states(self, states: list[CtcBeamState]) -> list[list[CtcHypothesis]]:
        """``peek`` of each state, in order (the fast twin reads them back in one copy)."""
        return [self.peek(state) for state in states]

    def finalize_stream(self, state: CtcBeamState) -> list[list[CtcHypothesis]]:
        """Per row, the ``nbest`` best hypotheses, best first (fewer if the beam holds fewer).

        CTC needs no flush, so this only reads the beams; the state stays
        usable (decoding may go on, or ``reset_state`` recycles it).
        """
        self._check_state(state, "finalize_stream")
        return [[_hypothesis(p, c) for p in beam[: self.config.nbest]]
                for beam, c in zip(state.beams, state.committed, strict=True)]

    # ---- validation -------------------------------------------------------------
    def _check_state(self, state, where: str) -> None:
        if not isinstance(state, CtcBeamState):
            raise TypeError(f"{where}: expected a reference CtcBeamState, got {type(state).__name__}")
        if state.config != self.config:
            raise ValueError(f"{where}: state was made for {state.config}, this decoder has {self.config}")

    def _check_cohort(self, states, log_probs_list) -> None:
        check_cohort(states, log_probs_list, self._check_state)

    def _check_prefix_len(self, beam: list[Prefix]) -> None:
        longest = max((len(p.tokens) for p in beam), default=0)
        if longest > self.config.max_prefix_len:
            raise RuntimeError(
                f"decode_chunk: a kept prefix would hold {longest} tokens, more than "
                f"CtcDecoderConfig.max_prefix_len={self.config.max_prefix_len}; the state is unchanged"
            )


def _hypothesis(prefix: Prefix, committed: tuple) -> CtcHypothesis:
    tokens, frames = committed
    return CtcHypothesis(tokens + list(prefix.tokens), prefix.score, frames + list(prefix.frames))
