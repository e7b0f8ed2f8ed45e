"""``CtcDecoderConfig`` and ``CtcHypothesis``: what both CTC decoder twins share.

The decoder is streaming CTC prefix beam search. Its twins are
``oasr.reference.ctc_decoder`` (plain Python, the oracle) and
``oasr.fast.ctc_decoder`` (batched torch tensors); both read this config, return
:class:`CtcHypothesis` records and validate their inputs with
:func:`check_log_probs`, so they raise the same errors for the same mistakes.

Search rule, one frame ``t`` with log-probabilities ``lp`` (both twins)
---------------------------------------------------------------------
Every prefix ``l`` in the beam carries two log scores: ``pb`` (all alignments
of frames ``0..t-1`` that collapse to ``l`` and end in blank) and ``pnb`` (those
that end in ``l``'s last token ``e``). Its score is ``logaddexp(pb, pnb)``::

    stay    l      pb'  = score(l) + lp[blank]              (blank: nothing new)
                   pnb' = pnb(l)   + lp[e]                  (repeat of e collapses; l non-empty)
    extend  l + c  pnb' = pb(l)    + lp[c]   if c == e      (e, blank, e: a second e)
                   pnb' = score(l) + lp[c]   otherwise

``c`` runs over the frame's *candidates*: the ``token_topk`` non-blank tokens
with the highest ``lp`` (ties: lower token id first), or every non-blank token
when ``token_topk`` is None. The repeat term uses ``lp[e]`` whether or not ``e``
is a candidate. When ``blank_skip_threshold`` is set and
``exp(lp[blank]) > blank_skip_threshold`` the frame has no extensions, only the
two stay terms (so with it off, the default, the search is exact up to beam
pruning). Contributions of ``-inf`` are not generated at all.

Merging, ordering and emission frames
-------------------------------------
A prefix reached both by staying and by extending its parent gets the
``logaddexp`` of the two ``pnb`` terms. Candidates are generated in a fixed
order: beam entries in rank order, each one's stay first, then its extensions by
ascending token id; a merged prefix takes the earlier of its two places. The new
beam is the ``beam_size`` best by score, **ties broken by that generation
order** (a stable sort). This is the total order both twins share; the final
n-best list is the top ``nbest`` of the beam, in beam order.

Each token of a hypothesis carries the absolute stream frame (counting across
chunks) of the extension that appended it. When a merge joins a stay and an
extension, the frames of the larger of the two contributions are kept, the
stay's ``logaddexp(pb', pnb'_stay)`` against the extension's ``pnb'``; a tie
keeps the stay's (older) frames.

Precision: both twins score in float64 whatever the input dtype, so their
scores agree to far better than the 1e-5 the tests ask for.

Committed prefix: any length of audio in fixed-size buffers
-------------------------------------------------------------
A beam holds at most ``max_prefix_len`` tokens a prefix, yet a stream may run for
hours. Every prefix of a row grows from what the row held before, so the leading
tokens that *all* live prefixes share, with the same emission frames, can never
change again: they are moved out of the beam into the row's *committed* part
(host lists, ``CtcHypothesis.tokens`` = committed + stored tokens). Each prefix
keeps at least one token (its last token drives the search), so a row commits
``m`` shared (token, frame) pairs, or ``m - 1`` when a prefix is exactly those
``m``. This is exact: scores, n-best and frames are what an unbounded search
gives (unless prefixes are dropped, below). Both twins apply the one rule, :func:`settle_rows`, at the same moments,
through the one driver, :func:`decode_bounded`:

* a call whose chunks fit (every state's longest prefix plus its frames at most
  ``max_prefix_len``) runs as one piece and settles nothing: the usual case, no
  host work beyond the twin's own;
* otherwise its input values are checked first (so the call stays all-or-nothing
  for bad input) and it runs in pieces that fit; before a piece, a state that
  would not fit settles each row whose longest prefix is longer than
  ``commit_at`` (``max(1, max_prefix_len // 2)``): the shared prefix is committed,
  and if the row's prefixes still differ on more than ``commit_at`` tokens, those
  that part from the best one earliest are dropped until the rest fit. Dropping is
  the one place the bounded search may differ from an unbounded one; it keeps the
  best prefix, and touches only alternatives that diverged ``commit_at`` tokens
  ago (256 characters, some 20 s of speech, at the default ``max_prefix_len``).
  A row settles at most once per ``max_prefix_len - commit_at`` frames.

With ``max_prefix_len = 1`` no room can ever be made once a token is kept; a
chunk that would need it raises ``RuntimeError`` as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch


class CtcHypothesis(NamedTuple):
    """One decoded hypothesis of one batch row.

    ``tokens``: label sequence (blanks removed, repeats collapsed);
    ``log_score``: natural-log probability of that label sequence under the
    frames decoded so far (``logaddexp`` of its blank- and non-blank-ending
    parts); ``frames``: for each token, the absolute frame that emitted it.
    """

    tokens: list[int]
    log_score: float
    frames: list[int]


@dataclass(frozen=True)
class CtcDecoderConfig:
    """Settings of the streaming CTC prefix beam search (both twins).

    ``beam_size``             prefixes kept after every frame (>= 1).
    ``blank_id``              index of the blank token in the vocabulary (>= 0).
    ``nbest``                 hypotheses ``finalize_stream`` returns per row (1..beam_size).
    ``token_topk``            per-frame pruning: extend with the ``token_topk`` most likely
                              non-blank tokens only; None (or 0, normalised to None) means all.
    ``blank_skip_threshold``  a probability in (0, 1]: a frame whose blank probability
                              exceeds it gets no extensions. None (default) turns it off.
    ``max_prefix_len``        most tokens a beam entry holds past its row's committed part; the
                              fast twin's token buffer is this wide. Hypotheses may be any
                              length: the shared prefix is committed as the stream advances
                              (module docstring, "Committed prefix").
    """

    beam_size: int = 4
    blank_id: int = 0
    nbest: int = 1
    token_topk: int | None = None
    blank_skip_threshold: float | None = None
    max_prefix_len: int = 512

    def __post_init__(self):
        for name, low in (("beam_size", 1), ("blank_id", 0), ("nbest", 1), ("max_prefix_len", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"CtcDecoderConfig.{name} must be an int >= {low}, got {value!r}")
        if self.nbest > self.beam_size:
            raise ValueError(
                f"CtcDecoderConfig.nbest={self.nbest} exceeds beam_size={self.beam_size}: "
                "the beam holds only beam_size hypotheses"
            )
        k = self.token_topk
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"CtcDecoderConfig.token_topk must be None or an int >= 0, got {k!r}")
        if k == 0:
            object.__setattr__(self, "token_topk", None)
        thr = self.blank_skip_threshold
        if thr is not None:
            if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0.0 < thr <= 1.0:
                raise ValueError(
                    f"CtcDecoderConfig.blank_skip_threshold must be None (off) or a probability in (0, 1], got {thr!r}"
                )
            object.__setattr__(self, "blank_skip_threshold", float(thr))

    @property
    def commit_at(self) -> int:
        """A row whose longest prefix is longer than this commits its shared prefix (module docstring)."""
        return max(1, self.max_prefix_len // 2)

    @property
    def blank_skip_log_threshold(self) -> float:
        """``log(blank_skip_threshold)``, or ``+inf`` when skipping is off (no frame exceeds it)."""
        if self.blank_skip_threshold is None:
            return math.inf
        return math.log(self.blank_skip_threshold)

    def num_candidates(self, vocab_size: int) -> int:
        """Extension tokens per frame for a vocabulary of ``vocab_size``: ``min(topk, vocab - 1)``."""
        every = vocab_size - 1
        return every if self.token_topk is None else min(self.token_topk, every)


def check_state_shape(where: str, config: CtcDecoderConfig, batch, vocab_size) -> None:
    """Validate ``create_state`` / ``reset_state`` arguments (both twins)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"{where}: batch must be an int >= 1, got {batch!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"{where}: vocab_size must be an int >= 2 (blank plus a token), got {vocab_size!r}")
    if config.blank_id >= vocab_size:
        raise ValueError(f"{where}: blank_id={config.blank_id} is outside a vocabulary of {vocab_size}")


def check_log_probs(
    where: str, log_probs, batch: int, vocab_size: int, frame_dim: bool = True, check_values: bool = True
) -> None:
    """Validate a chunk ``(batch, T, vocab)`` (or a frame ``(batch, vocab)``) of log-probabilities.

    Raises ``TypeError`` for a non-tensor and ``ValueError`` naming expected
    and actual shape, for a non-floating dtype, and for NaN or ``+inf``
    entries (``-inf``, an impossible token, is allowed). Reading the values
    costs one host synchronisation; ``check_values=False`` skips that part,
    for a caller that checks the values later itself (``values_error`` gives
    the same error) and commits nothing before it has.
    """
    if not isinstance(log_probs, torch.Tensor):
        raise TypeError(f"{where}: log_probs must be a torch.Tensor, got {type(log_probs).__name__}")
    if frame_dim:
        ok = log_probs.dim() == 3 and log_probs.shape[0] == batch and log_probs.shape[2] == vocab_size
        expected = f"(batch={batch}, T, vocab={vocab_size})"
    else:
        ok = log_probs.dim() == 2 and tuple(log_probs.shape) == (batch, vocab_size)
        expected = f"(batch={batch}, vocab={vocab_size})"
    if not ok:
        raise ValueError(f"{where}: log_probs must be {expected}, got {tuple(log_probs.shape)}")
    if not log_probs.is_floating_point():
        raise ValueError(f"{where}: log_probs must be a floating dtype, got {log_probs.dtype}")
    # one reduction: the max is NaN if any entry is NaN, +inf if any is +inf
    if check_values and log_probs.numel() and not bool(log_probs.amax() < math.inf):
        raise values_error(where)


def values_error(where: str) -> ValueError:
    """The error for log-probabilities holding NaN or ``+inf``."""
    return ValueError(f"{where}: log_probs contains NaN or +inf")


def check_cohort(states: list, log_probs_list: list, check_state, check_values: bool = True) -> None:
    """Validation both twins' ``decode_chunks`` share: one chunk per distinct state, each valid for it.

    ``check_state(state, where)`` is the twin's own check that ``state`` is one of its states;
    ``check_values`` as in :func:`check_log_probs`.
    """
    if len(states) != len(log_probs_list):
        raise ValueError(f"decode_chunks: {len(states)} states but {len(log_probs_list)} log-probability chunks")
    if len({id(s) for s in states}) != len(states):
        raise ValueError("decode_chunks: the same state appears twice in one cohort")
    for state, log_probs in zip(states, log_probs_list, strict=True):
        check_state(state, "decode_chunk")
        check_log_probs("decode_chunk", log_probs, state.batch, state.vocab_size, check_values=check_values)


class BeamEntry(NamedTuple):
    """One live prefix of a beam, twin-neutral: what a session stores of a CTC state.

    ``tokens`` and ``frames`` as in :class:`CtcHypothesis`; ``log_pb`` / ``log_pnb`` are
    the blank- and non-blank-ending float64 log scores (the search rule above).
    """

    tokens: tuple
    frames: tuple
    log_pb: float
    log_pnb: float


class BeamSnapshot(NamedTuple):
    """A decoder state in neither twin's layout: ``rows[b]`` is row ``b``'s live prefixes, rank order.

    ``committed`` is ``()`` when no row has committed a token, else one ``(tokens, frames)``
    pair of tuples per row: what precedes every prefix of that row (module docstring).
    Both twins' ``snapshot_state`` produce it and ``restore_state`` accept it, so a state
    taken from one twin continues in the other (``oasr.sessions.format`` serialises it).
    """

    batch: int
    vocab_size: int
    frames_decoded: int
    rows: tuple
    committed: tuple = ()


def committed_rows(snapshot: BeamSnapshot) -> tuple:
    """``snapshot.committed`` with one ``(tokens, frames)`` pair per row, ``((), ())`` where nothing is."""
    return snapshot.committed or tuple(((), ()) for _ in range(snapshot.batch))


def pack_committed(pairs) -> tuple:
    """The ``committed`` field for per-row ``(tokens, frames)`` pairs: ``()`` when all are empty."""
    pairs = tuple((tuple(t), tuple(f)) for t, f in pairs)
    return pairs if any(t for t, _ in pairs) else ()


def check_snapshot(where: str, config: CtcDecoderConfig, snapshot) -> None:
    """Refuse a ``BeamSnapshot`` no search under ``config`` could have produced (``ValueError``).

    Checked: the state shape, at most ``beam_size`` prefixes per row, distinct prefixes,
    tokens in the vocabulary and not blank, at most ``max_prefix_len`` of them, one strictly
    increasing emission frame per token before ``frames_decoded``, scores that are not NaN or
    ``+inf`` with a finite total, and no non-blank-ending score on the empty prefix.
    Rank order is not re-checked: the twins' ``logaddexp`` may differ in the last ulp.
    """
    if not isinstance(snapshot, BeamSnapshot):
        raise TypeError(f"{where}: expected a BeamSnapshot, got {type(snapshot).__name__}")
    check_state_shape(where, config, snapshot.batch, snapshot.vocab_size)
    fd = snapshot.frames_decoded
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise ValueError(f"{where}: frames_decoded must be an int >= 0, got {fd!r}")
    if len(snapshot.rows) != snapshot.batch:
        raise ValueError(f"{where}: {len(snapshot.rows)} beam rows for batch {snapshot.batch}")
    if snapshot.committed and len(snapshot.committed) != snapshot.batch:
        raise ValueError(f"{where}: {len(snapshot.committed)} committed rows for batch {snapshot.batch}")
    for b, (row, (ctoks, cframes)) in enumerate(zip(snapshot.rows, committed_rows(snapshot), strict=True)):
        if len(ctoks) != len(cframes):
            raise ValueError(f"{where}: row {b} commits {len(ctoks)} tokens with {len(cframes)} frames")
        if any(not 0 <= t < snapshot.vocab_size or t == config.blank_id for t in ctoks):
            raise ValueError(f"{where}: row {b} commits a token outside [0, {snapshot.vocab_size}) or the blank")
        first = [e.frames[0] for e in row if e.frames]
        steps = zip(cframes, cframes[1:], strict=False)
        if any(not 0 <= f < fd for f in cframes) or any(a >= b for a, b in steps) or \
                (cframes and any(f <= cframes[-1] for f in first)):
            raise ValueError(f"{where}: row {b}'s committed frames must increase strictly inside [0, {fd}) "
                             "and precede its prefixes' frames")
        if ctoks and any(not e.tokens for e in row):
            raise ValueError(f"{where}: row {b} has committed tokens, so every prefix keeps at least one token")
        if len(row) > config.beam_size:
            raise ValueError(f"{where}: row {b} holds {len(row)} prefixes, beam_size is {config.beam_size}")
        if len({tuple(e.tokens) for e in row}) != len(row):
            raise ValueError(f"{where}: row {b} holds the same prefix twice")
        for w, e in enumerate(row):
            at = f"{where}: row {b} prefix {w}"
            if len(e.tokens) > config.max_prefix_len or len(e.frames) != len(e.tokens):
                raise ValueError(f"{at}: {len(e.tokens)} tokens and {len(e.frames)} frames "
                                 f"(need equal counts, at most max_prefix_len={config.max_prefix_len})")
            if any(not 0 <= t < snapshot.vocab_size or t == config.blank_id for t in e.tokens):
                raise ValueError(f"{at}: a token outside [0, {snapshot.vocab_size}) or the blank: {list(e.tokens)}")
            steps = zip(e.frames, e.frames[1:], strict=False)
            if any(not 0 <= f < fd for f in e.frames) or any(a >= b for a, b in steps):
                raise ValueError(f"{at}: emission frames must increase strictly inside [0, {fd}): {list(e.frames)}")
            pb, pnb = float(e.log_pb), float(e.log_pnb)
            if math.isnan(pb) or math.isnan(pnb) or pb == math.inf or pnb == math.inf:
                raise ValueError(f"{at}: scores must not be NaN or +inf, got ({pb}, {pnb})")
            if pb == -math.inf and pnb == -math.inf:
                raise ValueError(f"{at}: a dead prefix (both scores -inf) is never kept")
            if not e.tokens and pnb != -math.inf:
                raise ValueError(f"{at}: the empty prefix cannot end in a token (log_pnb={pnb})")


# ---- the committed prefix (module docstring, "Committed prefix") ------------------------------------


def _shared(row) -> int:
    """Leading (token, frame) pairs every entry of ``row`` shares, less one if an entry is exactly those."""
    if not row:
        return 0
    m = min(len(e.tokens) for e in row)
    first = row[0]
    for e in row[1:]:
        k = 0
        while k < m and e.tokens[k] == first.tokens[k] and e.frames[k] == first.frames[k]:
            k += 1
        m = k
    return max(0, m - 1) if any(len(e.tokens) == m for e in row) else m


def _agreement(e, best) -> int:
    """Leading (token, frame) pairs ``e`` shares with ``best``."""
    k, n = 0, min(len(e.tokens), len(best.tokens))
    while k < n and e.tokens[k] == best.tokens[k] and e.frames[k] == best.frames[k]:
        k += 1
    return k


def settle_rows(config: CtcDecoderConfig, rows) -> tuple[tuple, list] | None:
    """The commit rule on a state's beam rows (``BeamSnapshot.rows``): ``(new rows, additions)``, or None.

    Each row whose longest prefix is longer than ``config.commit_at`` moves its shared prefix out
    (``additions[b]``: the ``(tokens, frames)`` row ``b`` appends to its committed part); if its
    prefixes still differ on more than ``commit_at`` tokens, those that part from the best one
    earliest are dropped until the rest fit in ``commit_at``. Costs what the beams hold, never the
    committed part.
    """
    keep = config.commit_at
    out, additions, changed = [], [], False
    for row in rows:
        longest = max((len(e.tokens) for e in row), default=0)
        added = ((), ())
        if longest > keep:
            kept = list(row)
            while len(kept) > 1 and max(len(e.tokens) for e in kept) - _shared(kept) > keep:
                agree = [_agreement(e, kept[0]) for e in kept[1:]]
                low = min(agree)
                kept = kept[:1] + [e for e, a in zip(kept[1:], agree, strict=True) if a > low]
            c = _shared(kept)
            if c or len(kept) != len(row):
                changed = True
                added = kept[0].tokens[:c], kept[0].frames[:c]
                row = tuple(BeamEntry(e.tokens[c:], e.frames[c:], e.log_pb, e.log_pnb) for e in kept)
        out.append(tuple(row))
        additions.append(added)
    return (tuple(out), additions) if changed else None


def settle_snapshot(config: CtcDecoderConfig, snapshot: BeamSnapshot) -> BeamSnapshot | None:
    """:func:`settle_rows` on a whole snapshot (its committed part extended); None when nothing changes."""
    settled = settle_rows(config, snapshot.rows)
    if settled is None:
        return None
    rows, additions = settled
    committed = [(t + at, f + af) for (t, f), (at, af) in zip(committed_rows(snapshot), additions, strict=True)]
    return snapshot._replace(rows=rows, committed=pack_committed(committed))


def decode_bounded(config: CtcDecoderConfig, states: list, log_probs_list: list, longest, settle, run,
                   check_values) -> None:
    """Decode one chunk per state within ``max_prefix_len``: the twins' shared driver (already validated).

    ``longest(state)``: the longest prefix the state holds (host-known); ``settle(state)``: apply
    :func:`settle_rows` to the state; ``run(states, chunks)``: the twin's own all-or-nothing decode
    of chunks that fit; ``check_values(chunks)``: raise for NaN / ``+inf`` (called before a call that
    settles or splits changes anything).
    """
    limit, keep = config.max_prefix_len, config.commit_at
    lengths = [x.shape[1] for x in log_probs_list]
    total = max(lengths, default=0)
    if not total:
        return
    if all(longest(s) + n <= limit for s, n in zip(states, lengths, strict=True)):
        run(states, log_probs_list)  # the usual case: it fits, one piece, nothing settled
        return
    if limit == 1:  # no room can be made once a token is kept (module docstring)
        raise _overflow(limit)
    check_values(log_probs_list)
    done = 0
    while done < total:
        live = [(s, n - done) for s, n in zip(states, lengths, strict=True) if n > done]
        for s, left in live:
            if longest(s) + left > limit and longest(s) > keep:
                settle(s)  # its longest prefix is at most commit_at now
        step = min(total - done, min(limit - longest(s) for s, _ in live))  # >= limit - commit_at >= 1
        run(states, [x[:, done : done + step] for x in log_probs_list])
        done += step


def _overflow(limit: int) -> RuntimeError:
    return RuntimeError(
        f"decode_chunk: a kept prefix would hold more than CtcDecoderConfig.max_prefix_len={limit} tokens; "
        "the state is unchanged"
    )
