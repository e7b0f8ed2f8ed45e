"""The fast CTC search's batched frame step: rows x beams x candidates in a few tensor ops, and the host loop.

Used by ``oasr.fast.ctc_decoder.StreamingCtcDecoder`` (the contract, the state layout and the choice of path are
drawn there) and by ``oasr.fast.ctc_graph`` (a chunk's ``search_chunk`` captured as one CUDA graph).

One frame, vectorised over rows x beams x candidates (``K`` candidates, ``S = 1 + K``)::

    slot (i, 0)      = prefix i stays          (blank, or repeat of its last token)
    slot (i, 1 + k)  = prefix i + cands[k]     (cands ascending, so slot order = generation order)
    scores           (R, W * S)                the only candidate-sized array
    merge            prefix j in the beam whose parent i is also in the beam, with last[j] a
                     candidate: one (R, W, W) key comparison finds i, a gather of i's tokens
                     verifies it, the extension's score folds into j, and the merged entry takes
                     the earlier of slots (j, 0) and (i, 1 + k)
    new beam         top W by (score desc, slot asc); records decoded from the slot indices,
                     tokens/frames gathered from the source prefixes, one token appended

Rolling hash: two 31-bit polynomial hashes, ``h <- (h * P + token + 1) mod (2^31 - 1)``,
packed into one int64 (``h1 << 31 | h2``); no product overflows. A key match is
only a hint: the parent's stored tokens are compared with the child's, so a
merge is never wrong. A merge could be *missed* only if a prefix of the same
length ranked before the true parent collided in all 62 bits (about
``W^2 / 2^62`` per frame), which we accept.

The host loop's step (``_advance_host``) does the same for tiny CPU cohorts with Python lists, merging by
token tuple.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from oasr.ctc.config import (
    CtcDecoderConfig,
)

NEG_INF = -math.inf


# Per-frame beam cut over W * S slots: one stable sort of the row when it is at most this wide,
# else the threshold top-k of ``_top_set`` (a few more ops, linear in the width).
_SORT_WIDTH = 1024


_HASH_MOD = 2**31 - 1


_HASH_MUL = (911_382_323, 972_663_749)


class _Beams(NamedTuple):
    """The per-row tensors of a state (views or temporaries), in the layout of the module docstring."""

    tokens: torch.Tensor
    frames: torch.Tensor
    lengths: torch.Tensor
    keys: torch.Tensor
    parent_keys: torch.Tensor
    last: torch.Tensor
    log_pb: torch.Tensor
    log_pnb: torch.Tensor


def _allocate(rows: int, config: CtcDecoderConfig, device) -> _Beams:
    W, L = config.beam_size, config.max_prefix_len
    return _Beams(
        tokens=torch.empty(rows, W, L, dtype=torch.int32, device=device),
        frames=torch.empty(rows, W, L, dtype=torch.int32, device=device),
        lengths=torch.empty(rows, W, dtype=torch.int64, device=device),
        keys=torch.empty(rows, W, dtype=torch.int64, device=device),
        parent_keys=torch.empty(rows, W, dtype=torch.int64, device=device),
        last=torch.empty(rows, W, dtype=torch.int64, device=device),
        log_pb=torch.empty(rows, W, dtype=torch.float64, device=device),
        log_pnb=torch.empty(rows, W, dtype=torch.float64, device=device),
    )


def _fill_initial(beams: _Beams) -> None:
    """Every row: slot 0 the empty prefix (``log_pb = 0``), every other slot dead."""
    beams.tokens.fill_(-1)
    beams.frames.fill_(-1)
    beams.lengths.zero_()
    beams.keys.zero_()
    beams.parent_keys.fill_(-1)
    beams.last.fill_(-1)
    beams.log_pb.fill_(NEG_INF)
    beams.log_pb[:, 0] = 0.0
    beams.log_pnb.fill_(NEG_INF)


def _extend_keys(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rolling hash of ``prefix + token`` from the prefix's packed key (int64 in, int64 out)."""
    h1, h2 = keys >> 31, keys & _HASH_MOD
    c = tokens + 1
    h1 = (h1 * _HASH_MUL[0] + c) % _HASH_MOD
    h2 = (h2 * _HASH_MUL[1] + c) % _HASH_MOD
    return (h1 << 31) | h2


def _key_of(tokens) -> int:
    """The packed rolling hash of a whole prefix: ``_extend_keys`` folded over it from the empty key 0."""
    key = 0
    for token in tokens:
        key = _extend_key(key, token)
    return key


def _top_set(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the ``k`` best entries per row of ``x`` (N, n) by (value desc, index asc).

    No host read: ``t``, the k-th largest value, comes from ``topk``; every entry above ``t``
    is in, and of the entries equal to ``t`` the lowest indices fill the rest. An int key
    (above ``t``: n + 1, equal: n - index, below: 0) puts exactly that set first, and a second
    ``topk`` over the key picks it whatever order ``topk`` gives equal keys.
    """
    n = x.shape[1]
    if n <= k:
        return torch.arange(n, device=x.device).expand(x.shape[0], n)
    t = x.topk(k, dim=1).values[:, k - 1 :]
    rank = torch.arange(n, 0, -1, dtype=torch.int32, device=x.device)
    key = torch.where(x > t, n + 1, torch.where(x == t, rank, 0))
    return key.topk(k, dim=1).indices.sort(dim=1).values


def _ranked_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` best entries per row, ordered by (score desc, index asc); no host read.

    A narrow row is sorted whole (stable: ties keep index order); a wide one takes the
    set from ``_top_set`` and orders those ``k`` by a stable sort.
    """
    if scores.shape[1] <= _SORT_WIDTH:
        return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    idx = _top_set(scores, k)
    order = scores.gather(1, idx).sort(dim=1, descending=True, stable=True).indices
    return idx.gather(1, order)


class _Candidates(NamedTuple):
    """Per-frame inputs of a chunk, computed once for all its frames (``R`` rows, ``T`` frames)."""

    lp: torch.Tensor  # (R, T, V) the chunk, in its own dtype (read through gathers only)
    lp_blank: torch.Tensor  # (R, T) float64
    tokens: torch.Tensor  # (R, T, K) candidate ids, ascending
    lp_tokens: torch.Tensor  # (R, T, K) float64 log-probs of the candidates; -inf on skipped frames


def _chunk_candidates(lp: torch.Tensor, config: CtcDecoderConfig, all_tokens) -> _Candidates:
    """Candidates of every frame of a chunk ``lp`` (R, T, V) in one ``topk`` call.

    Selection runs in the input dtype (converting to float64 is exact, so the
    order is the same) and only the picked values are widened to float64.
    """
    R, T, V = lp.shape
    K = config.num_candidates(V)
    blank = config.blank_id
    if all_tokens is not None:
        tokens = all_tokens.expand(R, T, K)
        lp_tokens = lp.gather(2, tokens).to(torch.float64)
    else:
        masked = lp.clone()
        masked.select(2, blank).fill_(NEG_INF)  # a fill, not a scalar upload: capture-safe
        tokens = _top_set(masked.reshape(R * T, V), K).reshape(R, T, K)
        # from `masked`: if fewer than K tokens are possible the blank may be picked, and must stay -inf
        lp_tokens = masked.gather(2, tokens).to(torch.float64)
    lp_blank = lp[:, :, blank].to(torch.float64)
    skip = lp_blank > config.blank_skip_log_threshold
    lp_tokens = lp_tokens.masked_fill(skip[:, :, None], NEG_INF)
    return _Candidates(lp, lp_blank, tokens, lp_tokens)


def _advance(beams: _Beams, cand: _Candidates, t: int, frame: torch.Tensor, beam_size: int, active=None):
    """Frame ``t`` of the chunk for every row; ``frame`` (R,) holds its absolute frame index.

    ``beams`` may be a window of the first ``Lw <= max_prefix_len`` token
    positions (see ``decode_chunks``). ``active`` (R,) bool, if given, marks
    the rows whose chunk has a frame ``t``; the others keep their beams. Returns
    the new beams and a 0-d bool tensor that is True when a live prefix of an
    active row outgrew the window.
    """
    R, W, Lw = beams.tokens.shape
    K = cand.tokens.shape[2]
    S = 1 + K
    lp, lp_blank = cand.lp[:, t], cand.lp_blank[:, t]
    cands, lp_cand = cand.tokens[:, t], cand.lp_tokens[:, t]

    # ---- stay and extension terms ---------------------------------------------------------------
    pb, pnb, last = beams.log_pb, beams.log_pnb, beams.last
    score = torch.logaddexp(pb, pnb)
    live = score > NEG_INF
    stay_pb = score + lp_blank[:, None]
    stay_pnb = torch.where(last >= 0, pnb + lp.gather(1, last.clamp(min=0)).to(torch.float64), NEG_INF)
    stay_tot = torch.logaddexp(stay_pb, stay_pnb)
    is_last = cands[:, None, :] == last[:, :, None]  # (R, W, K): cands[k] == last[i]
    ext = torch.where(is_last, pb[:, :, None], score[:, :, None]) + lp_cand[:, None, :]

    # ---- merges: prefix j whose parent i is in the beam and extends by last[j] ----------------
    parent_of = (
        (beams.keys[:, :, None] == beams.parent_keys[:, None, :])
        & (beams.lengths[:, :, None] + 1 == beams.lengths[:, None, :])
        & live[:, :, None]
        & live[:, None, :]
    )  # (R, W_i, W_j)
    has_parent = parent_of.any(1)
    parent = parent_of.to(torch.int8).argmax(1)  # first match
    # verify the hash hint: live prefixes are padded with -1, so parent and child differ
    # in exactly one position (the child's last token)
    parent_tokens = beams.tokens.gather(1, parent[:, :, None].expand(R, W, Lw))
    has_parent &= (parent_tokens != beams.tokens).sum(-1) == 1
    kpos = is_last.to(torch.int8).argmax(-1)  # position of last[j] among the candidates
    ext_into = ext.reshape(R, W * K).gather(1, parent * K + kpos)
    merged = has_parent & is_last.any(-1) & (ext_into > NEG_INF)
    merged_pnb = torch.logaddexp(stay_pnb, ext_into)
    merged_score = torch.logaddexp(stay_pb, merged_pnb)
    ext_wins = ext_into > stay_tot

    # ---- candidate scores in generation order, merged entries moved to their earlier slot -------
    scores = torch.cat([stay_tot[:, :, None], ext], 2).reshape(R, W * S)
    scores = torch.cat([scores, scores.new_zeros(R, 1)], 1)  # column W*S: dump for masked scatters
    own = torch.arange(W, device=lp.device)[None, :]
    stay_slot = own * S
    ext_slot = parent * S + 1 + kpos
    keep_stay_slot = (own < parent) & (stay_tot > NEG_INF)
    dest = torch.where(keep_stay_slot, stay_slot, ext_slot)
    other = torch.where(keep_stay_slot, ext_slot, stay_slot)
    dump = torch.full_like(dest, W * S)
    scores.scatter_(1, torch.where(merged, other, dump), NEG_INF)
    scores.scatter_(1, torch.where(merged, dest, dump), merged_score)
    scores = scores[:, : W * S]

    # ---- select and decode the new beam -------------------------------------------------------
    sel = _ranked_top(scores, beam_size)  # (R, W) slot indices, rank order
    new_score = scores.gather(1, sel)
    new_live = new_score > NEG_INF
    src, sub = sel // S, sel % S
    is_ext = sub > 0
    k_sel = (sub - 1).clamp(min=0)
    add = torch.where(is_ext, cands.gather(1, k_sel), -1)
    new_pb = torch.where(is_ext, NEG_INF, stay_pb.gather(1, src))
    new_pnb = torch.where(is_ext, ext.reshape(R, W * K).gather(1, src * K + k_sel), stay_pnb.gather(1, src))
    hit = merged[:, None, :] & (dest[:, None, :] == sel[:, :, None])  # (R, W_sel, W_j)
    is_merged = hit.any(-1)
    j = hit.to(torch.int8).argmax(-1)
    from_ext = ext_wins.gather(1, j)
    new_pb = torch.where(is_merged, stay_pb.gather(1, j), new_pb)
    new_pnb = torch.where(is_merged, merged_pnb.gather(1, j), new_pnb)
    src = torch.where(is_merged, torch.where(from_ext, parent.gather(1, j), j), src)
    add = torch.where(is_merged, torch.where(from_ext, last.gather(1, j), -1), add)
    # a dead pick may be a slot a merge emptied: give it no scores and let it grow nothing
    new_pb = torch.where(new_live, new_pb, NEG_INF)
    new_pnb = torch.where(new_live, new_pnb, NEG_INF)
    grow = (add >= 0) & new_live

    src_len = beams.lengths.gather(1, src)
    overflow = grow & (src_len >= Lw)
    if active is not None:
        overflow &= active[:, None]
    overflow = overflow.any()
    pos = src_len.clamp(max=Lw - 1)[:, :, None]
    src3 = src[:, :, None].expand(R, W, Lw)
    tokens = beams.tokens.gather(1, src3)
    tokens.scatter_(2, pos, torch.where(grow, add, tokens.gather(2, pos)[:, :, 0]).to(torch.int32)[:, :, None])
    frames = beams.frames.gather(1, src3)
    now = frame[:, None].expand(R, W)
    frames.scatter_(2, pos, torch.where(grow, now, frames.gather(2, pos)[:, :, 0]).to(torch.int32)[:, :, None])
    src_key = beams.keys.gather(1, src)
    new_beams = _Beams(
        tokens=tokens,
        frames=frames,
        lengths=src_len + grow,
        keys=torch.where(grow, _extend_keys(src_key, add), src_key),
        parent_keys=torch.where(grow, src_key, beams.parent_keys.gather(1, src)),
        last=torch.where(grow, add, last.gather(1, src)),
        log_pb=new_pb,
        log_pnb=new_pnb,
    )
    if active is not None:  # rows past their chunk's length keep what they had
        new_beams = _Beams(
            *(torch.where(active.view(-1, *[1] * (new.dim() - 1)), new, old)
              for new, old in zip(new_beams, beams, strict=True))
        )
    return new_beams, overflow


def search_chunk(beams: _Beams, lp: torch.Tensor, first_frame: torch.Tensor, row_len, config: CtcDecoderConfig,
                 candidates) -> tuple[_Beams, torch.Tensor]:
    """A whole chunk ``lp`` (R, T, V) over ``beams``: device work only, no host read, no shape from values.

    ``first_frame`` (R,) int64: each row's absolute index of frame 0; ``row_len`` (R,) int64 or None
    (every row has ``T`` frames): a row past its length keeps its beams. ``candidates(lp)`` gives the
    chunk's ``_Candidates``. Returns the new beams (dead slots cleared) and the header (2 + R,) int64:
    bad input (NaN / ``+inf`` anywhere in ``lp``), a prefix outgrew the window, each row's longest
    prefix. Capture-safe for fixed shapes (``oasr.fast.ctc_graph`` replays it as one CUDA graph).
    """
    cand = candidates(lp)
    overflow = torch.zeros((), dtype=torch.bool, device=lp.device)
    for t in range(lp.shape[1]):
        active = row_len > t if row_len is not None else None
        beams, over = _advance(beams, cand, t, first_frame + t, config.beam_size, active)
        overflow |= over
    beams = _clear_dead(beams)
    bad_input = ~(lp.amax() < math.inf)  # NaN or +inf anywhere (the padding is 0)
    return beams, torch.cat([torch.stack([bad_input, overflow]).long(), beams.lengths.amax(1)])


def _clear_dead(beams: _Beams) -> _Beams:
    """Reset dead slots to the empty, all-padding record (run once per chunk, before commit)."""
    live = torch.logaddexp(beams.log_pb, beams.log_pnb) > NEG_INF
    live3 = live[:, :, None]
    return _Beams(
        tokens=torch.where(live3, beams.tokens, -1),
        frames=torch.where(live3, beams.frames, -1),
        lengths=torch.where(live, beams.lengths, 0),
        keys=torch.where(live, beams.keys, 0),
        parent_keys=torch.where(live, beams.parent_keys, -1),
        last=torch.where(live, beams.last, -1),
        log_pb=beams.log_pb,
        log_pnb=beams.log_pnb,
    )


def _logaddexp(a: float, b: float) -> float:
    """``log(exp(a) + exp(b))`` for Python floats (the host loop's arithmetic), exact at ``-inf``."""
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    return max(a, b) + math.log1p(math.exp(-abs(a - b)))


def _extend_key(key: int, token: int) -> int:
    """``_extend_keys`` for one Python int (same hash, so both paths store the same keys)."""
    c = token + 1
    h1 = ((key >> 31) * _HASH_MUL[0] + c) % _HASH_MOD
    h2 = ((key & _HASH_MOD) * _HASH_MUL[1] + c) % _HASH_MOD
    return (h1 << 31) | h2


# A host-loop prefix: (tokens, frames, log_pb, log_pnb, key, parent_key), tokens and frames as tuples.
def _advance_host(beam: list, lp_row, lp_blank: float, cands: list, lp_cands: list, frame: int, beam_size: int):
    """One frame of one row on the host: the rule of ``oasr.ctc.config``, merging by token tuple."""
    entries: dict = {}  # tokens -> [stay_pb, stay_pnb, stay_frames, ext_pnb, ext_frames, key, parent_key]
    for tokens, frames, pb, pnb, key, parent_key in beam:
        score = _logaddexp(pb, pnb)
        last = tokens[-1] if tokens else -1
        stay_pb = score + lp_blank
        stay_pnb = pnb + float(lp_row[last]) if tokens else NEG_INF
        if _logaddexp(stay_pb, stay_pnb) > NEG_INF:
            entry = entries.get(tokens)
            if entry is None:
                entry = entries[tokens] = [NEG_INF, NEG_INF, None, NEG_INF, None, key, parent_key]
            entry[0], entry[1], entry[2] = stay_pb, stay_pnb, frames
        for c, lp_c in zip(cands, lp_cands, strict=True):
            ext_pnb = (pb if c == last else score) + lp_c
            if ext_pnb == NEG_INF:
                continue
            child = tokens + (c,)
            entry = entries.get(child)
            if entry is None:
                entry = entries[child] = [NEG_INF, NEG_INF, None, NEG_INF, None, _extend_key(key, c), key]
            entry[3], entry[4] = ext_pnb, frames + (frame,)
    finished = []
    for tokens, (stay_pb, stay_pnb, stay_frames, ext_pnb, ext_frames, key, parent_key) in entries.items():
        pnb = _logaddexp(stay_pnb, ext_pnb)
        score = _logaddexp(stay_pb, pnb)
        if score == NEG_INF:
            continue
        keep_stay = stay_frames is not None and (ext_frames is None or _logaddexp(stay_pb, stay_pnb) >= ext_pnb)
        finished.append((score, (tokens, stay_frames if keep_stay else ext_frames, stay_pb, pnb, key, parent_key)))
    finished.sort(key=lambda e: -e[0])  # stable: ties keep generation order
    return [prefix for _, prefix in finished[:beam_size]]
