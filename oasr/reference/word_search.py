"""The reference twin of the word search: the rule of ``oasr.ctc.words``, one Python dict per frame.

``WordSearch(lm, symbols, config)``; ``symbols`` is the tokenizer's symbol list (``CharTokenizer.symbols``:
blank first). Per stream a ``WordSearchState`` from ``new_state()``; then

* ``decode(states, chunks)``: each state's chunk of log-probs (``[T, V]``, torch or numpy), in order. All or
  nothing: every chunk is checked (shape, NaN) before any state changes; ``ValueError`` says which;
* ``best(state)`` -> ``WordResult``: the live partial (the top hypothesis, its unfinished word shown);
* ``finalize(state)`` -> ``WordResult``: the stream's answer (the state is not changed: a finished stream is
  simply dropped);
* ``snapshot(state)`` / ``restore(snapshot)``: a JSON-able dict, exact; ``restore`` checks it first.
"""

from __future__ import annotations

import numpy as np

from oasr.ctc.words import (
    NEG,
    SNAPSHOT_VERSION,
    WordLM,
    WordResult,
    WordSearchConfig,
    WordTime,
    check_chunk,
    check_snapshot,
    check_snapshot_fits,
    lae,
    token_chars,
)

# one hypothesis: [words, partial, partial's first frame, partial's last frame, pb, pnb, lm, n, last word, last token]
WORDS, PARTIAL, PSTART, PEND, PB, PNB, LM, N, LAST_WORD, LAST_TOKEN = range(10)


class WordSearchState:
    """One stream's word search: frames seen, committed words, the beam (a list in rank order)."""

    def __init__(self, start_id: int):
        self.frame = 0
        self.committed: list = []  # [word, first frame, last frame]
        self.beams: list = [[(), "", 0, 0, 0.0, NEG, 0.0, 0, start_id, None]]


class WordSearch:
    """Lexicon- and bigram-steered streaming CTC prefix beam search (reference twin)."""

    def __init__(self, lm: WordLM, symbols, config: WordSearchConfig | None = None):
        self.lm = lm
        self.config = config or WordSearchConfig()
        self.chars = token_chars(symbols, lm.alphabet)
        self.vocab_size = len(self.chars)
        if not any(self.chars):
            raise ValueError(f"WordSearch: no token of {list(symbols)!r} is a character of {lm.alphabet!r}")
        self.space = self.chars.index(" ") if " " in self.chars else None

    def new_state(self) -> WordSearchState:
        """A fresh stream (or a new turn)."""
        return WordSearchState(self.lm.start_id)

    # ---- searching ------------------------------------------------------------------------------------------
    def decode(self, states: list, chunks: list) -> None:
        """Advance every state over its chunk (module docstring: all or nothing)."""
        if len(states) != len(chunks):
            raise ValueError(f"WordSearch.decode: {len(states)} states but {len(chunks)} chunks")
        arrays = [check_chunk(f"WordSearch.decode (chunk {i})", c, self.vocab_size) for i, c in enumerate(chunks)]
        for state, lp in zip(states, arrays, strict=True):
            for row in lp:
                state.beams = self._frame(state.beams, row, state.frame)
                state.frame += 1
                self._bound(state)
            self._commit(state)

    def _score(self, h) -> float:
        cfg = self.config
        return lae(h[PB], h[PNB]) + cfg.lm_weight * (h[LM] + self.lm.lookahead[h[PARTIAL]]) + cfg.word_bonus * h[N]

    def _candidates(self, row: np.ndarray) -> list:
        cfg = self.config
        ids = [c for c in range(1, self.vocab_size) if self.chars[c] is not None and row[c] > cfg.prune_log]
        ids.sort(key=lambda c: (-row[c], c))
        return sorted(ids[: cfg.token_topk])

    def _frame(self, beams: list, row: np.ndarray, t: int) -> list:
        lm = self.lm
        new: dict = {}
        for h in beams:
            words, partial, pstart, pend, pb, pnb, lms, n, last_word, last = h
            total = lae(pb, pnb)
            key = (tuple(w[0] for w in words), partial)
            stay = new.get(key)
            if stay is None:
                stay = new[key] = [words, partial, pstart, pend, NEG, NEG, lms, n, last_word, last]
            stay[PB] = lae(stay[PB], total + row[0])
            if last is not None:
                stay[PNB] = lae(stay[PNB], pnb + row[last])
            for c in self._candidates(row):
                source = pb if c == last else total
                if source <= NEG:
                    continue
                ch = self.chars[c]
                if ch == " ":
                    if not partial or partial not in lm.index:
                        continue
                    wid = lm.index[partial]
                    nwords = (*words, (partial, pstart, pend))
                    nkey = (key[0] + (partial,), "")
                    proto = [nwords, "", 0, 0, NEG, NEG, lms + lm.logp(last_word, wid), n + 1, wid, c]
                else:
                    spelled = partial + ch
                    if spelled not in lm.lookahead:
                        continue
                    nkey = (key[0], spelled)
                    proto = [words, spelled, t if not partial else pstart, t, NEG, NEG, lms, n, last_word, c]
                entry = new.get(nkey)
                if entry is None:
                    entry = new[nkey] = proto
                entry[PNB] = lae(entry[PNB], source + row[c])
        ranked = sorted(new.values(), key=self._score, reverse=True)  # stable: ties keep generation order
        return ranked[: self.config.beam_size]

    def _bound(self, state: WordSearchState) -> None:
        """The bound on uncommitted words after a frame (module docstring of ``oasr.ctc.words``)."""
        most = self.config.max_words
        if max(len(h[WORDS]) for h in state.beams) <= most:
            return
        self._commit(state)  # depths are counted past the shared words (committing them changes nothing)
        if max(len(h[WORDS]) for h in state.beams) <= most:
            return
        first = state.beams[0][WORDS]
        k = len(first) - most // 2
        if k > 0:  # 1. alternatives that parted from the best more than max_words // 2 of its words ago
            state.beams = [h for h in state.beams if tuple(h[WORDS][:k]) == tuple(first[:k])]
            self._commit(state)
        state.beams = [h for h in state.beams if len(h[WORDS]) <= most]  # 2. (never the best)
        self._commit(state)

    @staticmethod
    def _commit(state: WordSearchState) -> None:
        first = state.beams[0][WORDS]
        k = len(first)
        for h in state.beams[1:]:
            words = h[WORDS]
            k = min(k, len(words))
            while k and tuple(words[:k]) != tuple(first[:k]):
                k -= 1
            if not k:
                return
        if k:
            state.committed.extend(list(w) for w in first[:k])
            for h in state.beams:
                h[WORDS] = tuple(h[WORDS][k:])

    # ---- answers --------------------------------------------------------------------------------------------
    def best(self, state: WordSearchState) -> WordResult:
        """The live partial: the top hypothesis, its unfinished word included."""
        h = state.beams[0]
        words = [*state.committed, *h[WORDS]]
        if h[PARTIAL]:
            words.append((h[PARTIAL], h[PSTART], h[PEND]))
        return _result(words)

    def finalize(self, state: WordSearchState) -> WordResult:
        """The stream's answer (module docstring: finishing)."""
        lm, cfg = self.lm, self.config
        best, best_score = None, None
        for h in state.beams:
            words, lms, n, last_word = list(h[WORDS]), h[LM], h[N], h[LAST_WORD]
            if h[PARTIAL]:
                if h[PARTIAL] not in lm.index:
                    continue  # in the middle of a non-word: it cannot finish
                wid = lm.index[h[PARTIAL]]
                lms, n, last_word = lms + lm.logp(last_word, wid), n + 1, wid
                words.append((h[PARTIAL], h[PSTART], h[PEND]))
            lms = lms + lm.logp(last_word, lm.end_id)
            score = lae(h[PB], h[PNB]) + cfg.lm_weight * lms + cfg.word_bonus * n
            if best_score is None or score > best_score:
                best, best_score = words, score
        if best is None:  # every hypothesis is in the middle of a non-word: the top one's finished words
            best = list(state.beams[0][WORDS])
        return _result([*state.committed, *best])

    # ---- sessions -------------------------------------------------------------------------------------------
    @staticmethod
    def snapshot(state: WordSearchState) -> dict:
        """The state as a JSON-able dict (exact floats)."""
        return {"version": SNAPSHOT_VERSION, "frame": state.frame, "committed": [list(w) for w in state.committed],
                "beams": [[[list(w) for w in h[WORDS]], *h[PARTIAL:]] for h in state.beams]}

    def restore(self, snapshot) -> WordSearchState:
        """A state from ``snapshot`` (``ValueError`` for a malformed one, or words this lexicon lacks)."""
        check_snapshot("WordSearch.restore", snapshot)
        check_snapshot_fits("WordSearch.restore", snapshot, self.lm, self.vocab_size)
        state = WordSearchState(self.lm.start_id)
        state.frame = snapshot["frame"]
        state.committed = [list(w) for w in snapshot["committed"]]
        state.beams = [[tuple(tuple(w) for w in h[0]), *h[1:]] for h in snapshot["beams"]]
        return state


def _result(words) -> WordResult:
    times = tuple(WordTime(w, int(a), int(b)) for w, a, b in words)
    return WordResult(" ".join(t.word for t in times), times)
