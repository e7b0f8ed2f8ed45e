"""Word search over CTC log-probs: a lexicon and a word bigram model steer a streaming prefix beam search.

A character CTC model spells by ear: ``fone``, ``becaus``, ``beforedabasement``. The word search runs a
second streaming prefix beam search over the same chunked log-probs in which a hypothesis may only spell
words of a lexicon and every finished word is scored by a word bigram model. It is the same search rule as
the token search (``oasr.ctc.config``) with three additions, and both twins (``oasr.reference.word_search``,
plain Python; ``oasr.fast.word_search``, one C++ call per cohort) follow this text to the bit.

The language model: ``WordLM``
------------------------------
``WordLM.from_sentences(sentences, lexicon)`` counts the sentences' words and word pairs (``<s>`` before the
first word, ``</s>`` after the last) and keeps, in float64:

* ``unigram[w]`` = ``log((c(w) + k) / (N + k * (W + 1)))`` for every lexicon word and ``</s>`` (``N`` word
  tokens counted, ``W`` lexicon words, ``k`` = ``add_k``): a lexicon word never seen still has a floor;
* for every context ``u`` seen (``<s>`` or a word): ``backoff[u]`` = ``log(D * n1(u) / c(u))`` and, per pair
  ``(u, w)`` seen, ``bigram[u, w]`` = ``log((c(u, w) - D) / c(u) + D * n1(u) / c(u) * exp(unigram[w]))``
  (absolute discounting ``D`` interpolated with the unigram; ``n1(u)``: distinct words after ``u``);
* ``logp(u, w)``: ``bigram[u, w]`` if the pair was seen, else ``backoff[u] + unigram[w]`` if ``u`` was seen
  as a context, else ``unigram[w]``. One addition at most: both twins compute it identically;
* ``lookahead(p)`` for every prefix ``p`` of a lexicon word: the largest ``unigram[w]`` over the words ``w``
  that begin with ``p``; ``lookahead("") = 0``.

The lexicon is the set of words the hypotheses may spell (characters of the tokenizer's alphabet, no space);
a sentence word outside it is refused by ``from_sentences``.

The search (one stream; ``WordSearchConfig`` sets the numbers)
---------------------------------------------------------------
A hypothesis is its finished words (each ``(word, first frame, last frame)``: the frames of its first and
last character's emission), the word being spelled (``partial``: a lexicon prefix, maybe empty), the last
token it emitted, ``pb``/``pnb`` as in the token search, and ``lm`` (the sum of ``logp`` of its finished
words) and ``n`` (their count). Its score is::

    lae(pb, pnb) + lm_weight * (lm + lookahead(partial)) + word_bonus * n

(``lae(a, b)`` = ``a + log1p(exp(b - a))`` with ``a >= b``, or ``a`` when ``b`` is ``-inf``/``NEG``.)
One frame with log-probs ``lp``:

* **candidates**: the non-blank tokens that are characters of the alphabet with ``lp[c] > prune_log``, the
  ``token_topk`` largest (ties: lower id first), then taken in ascending token id;
* **stay**: every hypothesis ``h`` (in beam order) goes on: ``pb' = score_ac(h) + lp[blank]`` and, if it has
  emitted a token ``e``, ``pnb' = pnb(h) + lp[e]``;
* **extend** ``h`` by candidate ``c`` (from ``pb(h)`` alone if ``c`` is ``h``'s last token, else from
  ``lae(pb, pnb)``; nothing if that is ``NEG``):

  - a **letter** (any alphabet character but the space): ``partial + letter`` must be a lexicon prefix;
  - the **space** ends the word: ``partial`` must be non-empty and a lexicon word; the word is appended,
    ``lm += logp(previous word or <s>, word)``, ``n += 1``, ``partial = ""``;

  the new hypothesis gets ``pnb' = source + lp[c]``;
* hypotheses reached twice merge by ``lae`` of each of ``pb'``/``pnb'``; a merged one keeps the place (and
  the word frames) of its first generation; generation order is the beam order, each hypothesis's stay first,
  then its extensions by ascending token id;
* the new beam is the ``beam_size`` best by score, ties in generation order (a stable sort).

``NEG`` (``-1e30``) stands for ``-inf`` in the scores. **Finishing** a stream: a hypothesis spelling a lexicon
word finishes it (its ``logp`` added, ``n + 1``); one with an empty partial is finished as it is; one in the
middle of a non-word (a lexicon prefix that is no word) cannot finish and takes no part (dropping its partial
would let it skip the language model's price for its last word and win for it). Every taking part adds
``logp(last word, </s>)``; the best final score wins (ties: beam order). If none can finish, the answer is the
top hypothesis's finished words. ``best(state)`` is the current top hypothesis with its partial shown as a
word (no ``</s>``, nothing dropped): the live partial text.

**Bounded memory**: the finished words that every hypothesis shares from its start (same words, same frames)
are *shared*; moving them to the state's committed list changes no score and no answer. After each chunk all
of them have moved (a twin may move some earlier, inside a chunk: nothing shows it). A hypothesis's *depth* is
the number of its finished words past the shared ones (what it holds uncommitted after a chunk). The bound,
``max_words`` (``WordSearchConfig``; ``m`` here, ``h = m // 2``), applies **after every frame** (after the
ranking, before the next frame; so any split of the same frames gives the same result): if some hypothesis's
depth exceeds ``m``,

1. with ``k`` = the best's (beam rank 0's) depth minus ``h``: if ``k > 0``, every hypothesis whose first ``k``
   words past the shared ones (word and both frames) are not the best's first ``k`` is dropped (one holding
   fewer than ``k`` words included);
2. then every hypothesis whose depth (past the words the remaining ones share) still exceeds ``m`` is dropped;
3. then the shared words are committed.

The beam keeps its order; the best is never dropped (its depth is at most ``h`` after step 1), and every
hypothesis's depth is at most ``m`` after every frame (so at most ``m`` uncommitted words after a chunk):
past its committed words (the transcript itself), an hour of audio holds what a few seconds do. Dropping is
the one place the bounded search may differ from an unbounded one (directly, and through the beam places it
frees, in what is kept later): step 1 touches only alternatives that parted from the best more than ``h`` of
its words ago (32 words at the default, over ten seconds of speech), step 2 only one that spelled more than
``m - h`` words more than the best since they parted (a rare, heavily split spelling). A restored snapshot
may hold deeper beams (saved with a larger ``max_words``): it is valid, and the bound applies from its next
frame.

Snapshots (``snapshot(state)``, ``restore(snapshot)``) are JSON-able dicts with floats written exactly, so a
stream suspended in one process continues in another (either twin) with the same bits.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

NEG = -1e30
SNAPSHOT_VERSION = 1


def lae(a: float, b: float) -> float:
    """``log(exp(a) + exp(b))`` as the word search computes it (both twins: the same operations)."""
    if a < b:
        a, b = b, a
    if b <= NEG:
        return a
    return a + math.log1p(math.exp(b - a))


@dataclass(frozen=True)
class WordSearchConfig:
    """The word search's numbers (module docstring).

    ``beam_size`` hypotheses kept per frame; ``token_topk`` candidates per frame at most, each above
    ``prune_log`` (natural log); ``lm_weight`` scales the language model, ``word_bonus`` is added per word;
    ``max_words`` (an int >= 2) bounds the uncommitted words a hypothesis holds (module docstring: bounded
    memory).
    """

    beam_size: int = 32
    token_topk: int = 8
    prune_log: float = -12.0
    lm_weight: float = 0.5
    word_bonus: float = 0.5
    max_words: int = 64

    def __post_init__(self):
        for name in ("beam_size", "token_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WordSearchConfig: {name} must be a positive int, got {value!r}")
        for name in ("prune_log", "lm_weight", "word_bonus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"WordSearchConfig: {name} must be a finite number, got {value!r}")
        if self.lm_weight < 0:
            raise ValueError(f"WordSearchConfig: lm_weight must be >= 0, got {self.lm_weight}")
        if isinstance(self.max_words, bool) or not isinstance(self.max_words, int) or self.max_words < 2:
            raise ValueError(f"WordSearchConfig: max_words must be an int >= 2, got {self.max_words!r}")


@dataclass(frozen=True)
class WordTime:
    """One word of a word-search result: its text and the frames of its first and last character."""

    word: str
    first_frame: int
    last_frame: int


@dataclass(frozen=True)
class WordResult:
    """A word-search answer: the text (words joined by spaces) and its words with their frames."""

    text: str
    words: tuple


class WordLM:
    """A lexicon with a word bigram model over it (module docstring); immutable once built."""

    def __init__(self, words, unigram, backoff: dict, bigram: dict, alphabet: str):
        self.words = tuple(words)  # sorted lexicon; ids are positions, len(words) is </s>, len(words) + 1 is <s>
        self.index = {w: i for i, w in enumerate(self.words)}
        self.end_id, self.start_id = len(self.words), len(self.words) + 1
        self.unigram = np.asarray(unigram, dtype=np.float64)  # [W + 1]: the words, then </s>
        self.backoff = dict(backoff)  # context id -> log weight
        self.bigram = dict(bigram)  # (context id, word id) -> log prob
        self.alphabet = alphabet
        self.lookahead: dict = {"": 0.0}
        for i, w in enumerate(self.words):
            value = float(self.unigram[i])
            for j in range(1, len(w) + 1):
                p = w[:j]
                if self.lookahead.get(p, NEG) < value:
                    self.lookahead[p] = value

    @classmethod
    def from_sentences(cls, sentences, lexicon, alphabet: str, discount: float = 0.7,
                       add_k: float = 0.05) -> WordLM:
        """Count ``sentences`` (strings of space-separated words, or ``(string, times)`` pairs: that sentence
        counted ``times`` times, a positive int) over ``lexicon`` (an iterable of words).

        ``ValueError`` for a word outside the alphabet (or empty, or with a space), for a sentence word outside
        the lexicon (a model that could predict a word the search cannot spell is a mistake), and for a
        ``times`` that is no positive int."""
        if not 0.0 < discount < 1.0 or not add_k > 0.0:
            raise ValueError(f"WordLM: discount must be in (0, 1) and add_k > 0, got {discount}, {add_k}")
        letters = set(alphabet) - {" "}
        words = sorted(set(lexicon))
        for w in words:
            if not w or not set(w) <= letters:
                raise ValueError(f"WordLM: lexicon words are non-empty strings of {alphabet.strip()!r}, got {w!r}")
        index = {w: i for i, w in enumerate(words)}
        W = len(words)
        end, start = W, W + 1
        uni = collections.Counter()
        pairs = collections.Counter()
        for sentence in sentences:
            times = 1
            if isinstance(sentence, tuple):
                sentence, times = sentence
                if isinstance(times, bool) or not isinstance(times, int) or times < 1:
                    raise ValueError(f"WordLM: a sentence's count must be a positive int, got {times!r}")
            ids = []
            for w in sentence.split():
                if w not in index:
                    raise ValueError(f"WordLM: sentence word {w!r} is not in the lexicon ({sentence!r})")
                ids.append(index[w])
            ids.append(end)
            if times == 1:
                uni.update(ids)
                pairs.update(zip([start, *ids[:-1]], ids, strict=True))
            else:
                for key in ids:
                    uni[key] += times
                for key in zip([start, *ids[:-1]], ids, strict=True):
                    pairs[key] += times
        total = sum(uni.values())
        unigram = np.array([math.log((uni.get(i, 0) + add_k) / (total + add_k * (W + 1))) for i in range(W + 1)])
        context = collections.Counter()
        followers = collections.Counter()
        for (u, _), c in pairs.items():
            context[u] += c
            followers[u] += 1
        backoff = {u: math.log(discount * followers[u] / c) for u, c in context.items()}
        bigram = {}
        for (u, w), c in pairs.items():
            cu = context[u]
            bigram[(u, w)] = math.log((c - discount) / cu + discount * followers[u] / cu * math.exp(unigram[w]))
        return cls(words, unigram, backoff, bigram, alphabet)

    def word_id(self, word: str) -> int:
        """The id of a lexicon word (``KeyError`` otherwise)."""
        return self.index[word]

    def logp(self, context: int, word: int) -> float:
        """``log p(word | context)`` by ids (``start_id`` for ``<s>``, ``end_id`` for ``</s>``)."""
        value = self.bigram.get((context, word))
        if value is not None:
            return value
        bow = self.backoff.get(context)
        return float(self.unigram[word]) if bow is None else bow + float(self.unigram[word])

    def tables(self) -> dict:
        """The model as flat arrays (what the fast twin's native search reads): ``unigram`` [W + 1],
        ``backoff`` [W + 2] (0 where a context was never seen, with ``has_backoff``), and the bigram pairs
        sorted by ``context * (W + 2) + word`` (``pair_keys`` int64, ``pair_logp`` float64)."""
        n = len(self.words) + 2
        backoff = np.zeros(n, dtype=np.float64)
        has = np.zeros(n, dtype=np.uint8)
        for u, v in self.backoff.items():
            backoff[u], has[u] = v, 1
        keys = np.array([u * n + w for (u, w) in self.bigram], dtype=np.int64)
        vals = np.array(list(self.bigram.values()), dtype=np.float64)
        order = np.argsort(keys, kind="stable")
        return {"unigram": self.unigram, "backoff": backoff, "has_backoff": has, "pair_keys": keys[order],
                "pair_logp": vals[order]}


def token_chars(symbols, alphabet: str) -> list:
    """Per token id, its alphabet character or None (blank, sos/eos, anything else)."""
    return [s if len(s) == 1 and s in alphabet else None for s in symbols]


def check_chunk(where: str, log_probs, vocab_size: int) -> np.ndarray:
    """A chunk of log-probs as float64 ``[T, vocab_size]``; ``ValueError`` for another shape, a NaN or a
    ``+inf`` (which would make NaN scores, and a NaN has no rank); ``-inf`` is a zero probability."""
    array = np.asarray(log_probs.detach().cpu().numpy() if hasattr(log_probs, "detach") else log_probs,
                       dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != vocab_size:
        raise ValueError(f"{where}: log-probs must be [frames, {vocab_size}], got shape {tuple(array.shape)}")
    if not (array < np.inf).all():
        raise ValueError(f"{where}: log-probs contain " + ("NaN" if np.isnan(array).any() else "+inf"))
    return array


def check_snapshot(where: str, snapshot) -> None:
    """``ValueError`` unless ``snapshot`` has the shape ``snapshot()`` writes (checked before any use)."""
    if not isinstance(snapshot, dict) or snapshot.get("version") != SNAPSHOT_VERSION:
        raise ValueError(f"{where}: expected a word-search snapshot (a dict of version {SNAPSHOT_VERSION}), "
                         f"got {type(snapshot).__name__}"
                         + (f" of version {snapshot.get('version')!r}" if isinstance(snapshot, dict) else ""))
    try:
        if not isinstance(snapshot["frame"], int) or snapshot["frame"] < 0:
            raise ValueError("frame")
        for w in snapshot["committed"]:
            _check_word(w)
        if not snapshot["beams"]:
            raise ValueError("beams")
        for b in snapshot["beams"]:
            words, partial, pstart, pend, pb, pnb, lm, n, last_word, last_token = b
            for w in words:
                _check_word(w)
            if not isinstance(partial, str) or not all(isinstance(v, int) for v in (pstart, pend, n, last_word)):
                raise ValueError("beam")
            if last_token is not None and not isinstance(last_token, int):
                raise ValueError("last token")
            if not all(isinstance(v, float) for v in (pb, pnb, lm)):
                raise ValueError("scores")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: malformed word-search snapshot ({exc})") from None


def check_snapshot_fits(where: str, snapshot, lm: WordLM, vocab_size: int) -> None:
    """``ValueError`` unless a ``check_snapshot``-valid snapshot fits this search: every hypothesis's last word
    an id of ``lm`` (``<s>``/``</s>`` included) and last token an id of the vocabulary (not the blank), every
    word (committed or not) a lexicon word, every partial a lexicon prefix, and every integer a signed 64-bit
    one (what a snapshot of this lexicon can hold; both twins refuse the same snapshots)."""
    ints = [snapshot["frame"]]
    for word, first, last in snapshot["committed"]:
        if word not in lm.index:
            raise ValueError(f"{where}: committed word {word!r} is not in the lexicon")
        ints += (first, last)
    for h in snapshot["beams"]:
        words, partial, pstart, pend, _, _, _, n, last_word, last_token = h
        if not 0 <= last_word <= lm.start_id or (last_token is not None and not 0 < last_token < vocab_size):
            raise ValueError(f"{where}: a hypothesis's last word or token is out of range")
        for word, first, last in words:
            if word not in lm.index:
                raise ValueError(f"{where}: hypothesis word {word!r} is not in the lexicon")
            ints += (first, last)
        if partial not in lm.lookahead:
            raise ValueError(f"{where}: partial word {partial!r} is not a prefix of a lexicon word")
        ints += (pstart, pend, n)
    if any(not -(2**63) <= v < 2**63 for v in ints):
        raise ValueError(f"{where}: a frame or count does not fit in 64 bits")


def _check_word(w) -> None:
    word, first, last = w
    if not isinstance(word, str) or not isinstance(first, int) or not isinstance(last, int):
        raise ValueError("word")
