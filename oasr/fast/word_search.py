"""The fast twin of the word search: the rule of ``oasr.ctc.words`` in C++, one native call per cohort.

It must agree with ``oasr.reference.word_search`` to the bit (same API, same errors, same snapshots: either
twin restores the other's). ``WordSearch(lm, symbols, config, native="auto")``:

* the ``WordLM`` goes to C++ once (``oasr.fast.word_native``): a trie of the lexicon's prefixes (node ids
  of the sorted prefixes; per node its letter children, its ``lm.lookahead`` value and its word id), the
  bigram tables of ``lm.tables()`` (binary search over ``pair_keys``) and per token id its kind (letter,
  space, or none). The Python half of that (the trie as flat arrays) is built once per ``WordLM`` object and
  the native model once per (``WordLM``, symbols), so searches over one model share it, and their states;
* a ``WordSearchState`` is an opaque handle to the C++ state (beam, committed words, a word-node arena),
  freed with the Python object; ``decode(states, chunks)`` checks every chunk (the reference's errors),
  stacks them, and makes one call that runs every state's frames (each followed by the bound on
  uncommitted words) and commit;
* ``best`` / ``finalize`` / ``snapshot`` read the state back (word ids and trie nodes become text here);
  ``restore`` checks a snapshot exactly as the reference does and writes it in.

``native``: ``"auto"`` (the C++ search where a compiler is found, else the reference's Python rule, with a
log line saying why), ``True`` (``RuntimeError`` saying why where it cannot be built) or ``False`` (the
Python rule); ``execution`` names the path taken.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np

from oasr.ctc.words import (
    SNAPSHOT_VERSION,
    WordLM,
    WordResult,
    WordSearchConfig,
    WordTime,
    check_chunk,
    check_snapshot,
    check_snapshot_fits,
    token_chars,
)
from oasr.reference.word_search import WordSearch as ReferenceWordSearch

_logger = logging.getLogger("oasr.fast")
_reported: set = set()
_lexicons: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # WordLM -> _Lexicon
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # WordLM -> {token kinds: _NativeModel}


class _Lexicon:
    """The lexicon trie as flat arrays: node ids are positions of the sorted prefixes ("" is node 0)."""

    def __init__(self, lm: WordLM):
        self.prefixes = sorted(lm.lookahead)
        self.node_of = {p: i for i, p in enumerate(self.prefixes)}
        letter = {ch: i for i, ch in enumerate(lm.alphabet)}
        children = self.prefixes[1:]
        parent = np.array([self.node_of[p[:-1]] for p in children], dtype=np.int64)
        letters = np.array([letter[p[-1]] for p in children], dtype=np.int32)
        order = np.lexsort((letters, parent))  # by parent, then letter
        self.child_letter = np.ascontiguousarray(letters[order])
        self.child_node = np.ascontiguousarray(np.arange(1, len(self.prefixes), dtype=np.int32)[order])
        counts = np.bincount(parent, minlength=len(self.prefixes))
        self.child_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.lookahead = np.array([lm.lookahead[p] for p in self.prefixes], dtype=np.float64)
        self.node_word = np.array([lm.index.get(p, -1) for p in self.prefixes], dtype=np.int64)
        self.tables = {k: np.ascontiguousarray(v) for k, v in lm.tables().items()}


class _NativeModel:
    """One ``WordLM`` (and one token-kind table) in C++; states hold it, so it outlives them."""

    def __init__(self, lm: WordLM, kinds: np.ndarray):
        from oasr.fast import word_native

        if lm not in _lexicons:
            _lexicons[lm] = _Lexicon(lm)
        lex = _lexicons[lm]
        self.lib = word_native.library()
        self.words, self.prefixes, self.node_of = lm.words, lex.prefixes, lex.node_of
        self.start_id = lm.start_id
        t = lex.tables
        self.kinds = kinds
        self.handle = self.lib.oasr_word_model_new(
            len(lex.prefixes), lex.child_start.ctypes.data, lex.child_letter.ctypes.data, lex.child_node.ctypes.data,
            lex.lookahead.ctypes.data, lex.node_word.ctypes.data, len(lm.words), t["unigram"].ctypes.data,
            t["backoff"].ctypes.data, t["has_backoff"].ctypes.data, len(t["pair_keys"]), t["pair_keys"].ctypes.data,
            t["pair_logp"].ctypes.data, len(kinds), kinds.ctypes.data)
        self.node_word = lex.node_word

    def __del__(self):
        handle, self.handle = getattr(self, "handle", None), None
        if handle:
            self.lib.oasr_word_model_free(handle)


class WordSearchState:
    """One stream's word search, held in C++ (a handle; freed with this object). ``frame``: frames seen."""

    def __init__(self, model: _NativeModel, handle: int):
        self._model = model
        self._handle = handle
        self._committed: list = []  # WordTime of the committed words read so far (they never change)

    @property
    def frame(self) -> int:
        """Frames decoded so far."""
        return self._sizes(0, 0)[0]

    def _sizes(self, lo: int, hi: int) -> list:
        out = np.zeros(4, dtype=np.int64)
        self._model.lib.oasr_word_sizes(self._handle, lo, hi, out.ctypes.data)
        return out.tolist()

    def _read(self, lo: int, hi: int) -> list:
        """Sync the committed words; hypotheses lo .. hi - 1 as [words ([word, first, last] each), partial node,
        pstart, pend, pb, pnb, lm, n, last word, last token] (a snapshot's beam, but the partial's node)."""
        model = self._model
        _, n_committed, _, n_words = self._sizes(lo, hi)
        since = len(self._committed)
        committed = np.zeros((n_committed - since, 3), dtype=np.int64)
        ints = np.zeros((hi - lo, 7), dtype=np.int64)
        floats = np.zeros((hi - lo, 3), dtype=np.float64)
        words = np.zeros((n_words, 3), dtype=np.int64)
        model.lib.oasr_word_export(self._handle, since, lo, hi, committed.ctypes.data, ints.ctypes.data,
                                   floats.ctypes.data, words.ctypes.data)
        self._committed.extend(WordTime(model.words[w], a, b) for w, a, b in committed.tolist())
        names, words, at, out = model.words, words.tolist(), 0, []
        for (count, partial, pstart, pend, n, last_word, last_token), (pb, pnb, lm) in zip(
                ints.tolist(), floats.tolist(), strict=True):
            hyp_words = [[names[w], a, b] for w, a, b in words[at : at + count]]
            at += count
            out.append([hyp_words, partial, pstart, pend, pb, pnb, lm, n, last_word,
                        None if last_token < 0 else last_token])
        return out

    def __copy__(self):
        return WordSearchState(self._model, self._model.lib.oasr_word_state_clone(self._handle))

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __reduce__(self):
        raise TypeError("WordSearchState holds a native handle: use WordSearch.snapshot / restore")

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._model.lib.oasr_word_state_free(handle)


class WordSearch:
    """Lexicon- and bigram-steered streaming CTC prefix beam search (fast twin of the reference)."""

    def __init__(self, lm: WordLM, symbols, config: WordSearchConfig | None = None, native: bool | str = "auto"):
        self.lm = lm
        self.config = config or WordSearchConfig()
        self.chars = token_chars(symbols, lm.alphabet)
        self.vocab_size = len(self.chars)
        if not any(self.chars):
            raise ValueError(f"WordSearch: no token of {list(symbols)!r} is a character of {lm.alphabet!r}")
        self.space = self.chars.index(" ") if " " in self.chars else None
        if native not in (True, False, "auto"):
            raise ValueError(f"WordSearch: native must be True, False or 'auto', got {native!r}")
        reason = "native=False" if native is False else None
        if native is not False:
            from oasr.fast import word_native

            reason = word_native.unavailable_reason()
            if reason is not None and native is True:
                raise RuntimeError(f"WordSearch(native=True): {reason}")
        self.native = reason is None
        self.execution = "native (C++)" if self.native else f"python (the reference rule; {reason})"
        self._python = None if self.native else ReferenceWordSearch(lm, symbols, self.config)
        self._model = self._native_model() if self.native else None
        if not self.native and native == "auto" and reason not in _reported:
            _reported.add(reason)
            _logger.warning("oasr.fast: the word search runs the reference's Python rule (slow): %s", reason)

    def _native_model(self) -> _NativeModel:
        kinds = np.array([-1 if ch is None or c == 0 else -2 if ch == " " else self.lm.alphabet.index(ch)
                          for c, ch in enumerate(self.chars)], dtype=np.int32)
        per_lm = _models.setdefault(self.lm, {})
        key = kinds.tobytes()
        if key not in per_lm:
            per_lm[key] = _NativeModel(self.lm, kinds)
        return per_lm[key]

    def new_state(self):
        """A fresh stream (or a new turn)."""
        if self._python is not None:
            return self._python.new_state()
        return WordSearchState(self._model, self._model.lib.oasr_word_state_new(self.lm.start_id))

    # ---- searching ------------------------------------------------------------------------------------------
    def decode(self, states: list, chunks: list) -> None:
        """Advance every state over its chunk (the reference's rule and errors: all or nothing)."""
        if self._python is not None:
            return self._python.decode(states, chunks)
        if len(states) != len(chunks):
            raise ValueError(f"WordSearch.decode: {len(states)} states but {len(chunks)} chunks")
        arrays = [check_chunk(f"WordSearch.decode (chunk {i})", c, self.vocab_size) for i, c in enumerate(chunks)]
        for i, state in enumerate(states):
            if not isinstance(state, WordSearchState) or state._model is not self._model:
                raise ValueError(f"WordSearch.decode: state {i} is not a state of this search's native model "
                                 f"(got {type(state).__name__}); snapshot and restore it here")
        if not states:
            return None
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        lp = np.ascontiguousarray(arrays[0] if len(arrays) == 1 else np.concatenate(arrays), dtype=np.float64)
        handles = np.array([s._handle for s in states], dtype=np.uint64)
        cfg = self.config
        self._model.lib.oasr_word_decode(
            self._model.handle, min(cfg.beam_size, 2**62), min(cfg.token_topk, self.vocab_size), float(cfg.prune_log),
            float(cfg.lm_weight), float(cfg.word_bonus), min(cfg.max_words, 2**62), len(states), handles.ctypes.data,
            lp.ctypes.data, offsets.ctypes.data, self.vocab_size)
        return None

    # ---- answers --------------------------------------------------------------------------------------------
    def best(self, state) -> WordResult:
        """The live partial: the top hypothesis, its unfinished word included."""
        if self._python is not None:
            return self._python.best(state)
        h = state._read(0, 1)[0]
        words = [*state._committed, *(WordTime(*w) for w in h[0])]
        if h[1]:
            words.append(WordTime(state._model.prefixes[h[1]], h[2], h[3]))
        return _result(words)

    def finalize(self, state) -> WordResult:
        """The stream's answer (the reference's rule; the state is not changed)."""
        if self._python is not None:
            return self._python.finalize(state)
        cfg = self.config
        i = self._model.lib.oasr_word_finalize(self._model.handle, float(cfg.lm_weight), float(cfg.word_bonus),
                                               state._handle)
        h = state._read(max(i, 0), max(i, 0) + 1)[0]  # i < 0: none can finish, the top one's finished words
        words = [*state._committed, *(WordTime(*w) for w in h[0])]
        if i >= 0 and h[1] and self._model.node_word[h[1]] >= 0:
            words.append(WordTime(state._model.prefixes[h[1]], h[2], h[3]))
        return _result(words)

    # ---- sessions -------------------------------------------------------------------------------------------
    @staticmethod
    def snapshot(state) -> dict:
        """The state as a JSON-able dict (exact floats): the reference's snapshot, field for field."""
        if not isinstance(state, WordSearchState):
            return ReferenceWordSearch.snapshot(state)
        n_beams = state._sizes(0, 0)[2]
        beams = state._read(0, n_beams)
        prefixes = state._model.prefixes
        return {"version": SNAPSHOT_VERSION, "frame": state.frame,
                "committed": [[w.word, w.first_frame, w.last_frame] for w in state._committed],
                "beams": [[h[0], prefixes[h[1]], *h[2:]] for h in beams]}

    def restore(self, snapshot):
        """A state from ``snapshot`` (``ValueError`` for a malformed one, or words this lexicon lacks)."""
        if self._python is not None:
            return self._python.restore(snapshot)
        check_snapshot("WordSearch.restore", snapshot)
        check_snapshot_fits("WordSearch.restore", snapshot, self.lm, self.vocab_size)
        index, node_of = self.lm.index, self._model.node_of
        committed = np.array([[index[w], a, b] for w, a, b in snapshot["committed"]], dtype=np.int64).reshape(-1, 3)
        beams = snapshot["beams"]
        ints = np.array([[len(h[0]), node_of[h[1]], h[2], h[3], h[7], h[8], -1 if h[9] is None else h[9]]
                         for h in beams], dtype=np.int64)
        floats = np.array([[h[4], h[5], h[6]] for h in beams], dtype=np.float64)
        words = np.array([[index[w], a, b] for h in beams for w, a, b in h[0]], dtype=np.int64).reshape(-1, 3)
        state = self.new_state()
        self._model.lib.oasr_word_import(state._handle, snapshot["frame"], len(committed), committed.ctypes.data,
                                         len(beams), ints.ctypes.data, floats.ctypes.data, words.ctypes.data)
        return state


def _result(words: list) -> WordResult:
    return WordResult(" ".join(t.word for t in words), tuple(words))
