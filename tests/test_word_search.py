"""The word search's conformance suite: the reference and the fast twin (native C++, and its Python fallback).

A tiny hand-made ``WordLM`` and seeded random log-probs (peaky "spoken" frames and flat noise, beam 1 / 4 /
32, top-k 1 / 3 / 8, streams of hundreds of frames so words commit): the fast twin's snapshots are the
reference's to the bit after every chunk; any split of the same frames gives the same answer; a snapshot
survives JSON and restores into either twin; a bad chunk changes nothing; a malformed snapshot is refused;
only lexicon words come out; and on a tiny case the reference's answer is the brute-force optimum of the
module docstring's score. One test runs both twins over the real recipe language model.
"""

from __future__ import annotations

import copy
import itertools
import json
import math

import numpy as np
import pytest
import torch

from oasr.ctc.words import NEG, WordLM, WordSearchConfig, lae
from oasr.fast import word_native
from oasr.fast.word_search import WordSearch as FastWordSearch
from oasr.reference.word_search import WordSearch as ReferenceWordSearch
from oasr.tokenizers.char import CharTokenizer

TOKENIZER = CharTokenizer(" acdegorst")
LEXICON = ["a", "at", "cat", "cats", "dog", "dogs", "god", "rat", "rats", "sat", "sad", "eat", "toe", "red", "rose",
           "tree", "star", "card"]
SENTENCES = ["a cat sat", "dogs eat rats", "a dog sat at a tree", "a red rose", "cats eat", "a sad dog",
             "a cat sat at a dog"]
LM = WordLM.from_sentences(SENTENCES, LEXICON, TOKENIZER.alphabet)
NATIVE = word_native.unavailable_reason() is None
TWINS = ["reference", "fast-native", "fast-python"]


def make(twin: str, config: WordSearchConfig | None = None, lm: WordLM = LM, symbols=None):
    """A search of ``twin`` over ``lm`` (skips the native twin where no compiler builds it)."""
    symbols = TOKENIZER.symbols if symbols is None else symbols
    if twin == "reference":
        return ReferenceWordSearch(lm, symbols, config)
    if twin == "fast-native" and not NATIVE:
        pytest.skip(f"no native word search here: {word_native.unavailable_reason()}")
    return FastWordSearch(lm, symbols, config, native=twin == "fast-native")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def spoken(rng, frames: int, noise: float = 1.0, peak: float = 7.0, lexicon=LEXICON, tokenizer=TOKENIZER):
    """CTC-shaped log-probs of random lexicon words (each letter held 1-2 frames, blanks between)."""
    ids = []
    while len(ids) < frames:
        for c in [*tokenizer.encode(str(rng.choice(lexicon))), tokenizer.symbols.index(" ")]:
            ids += [c] * int(rng.integers(1, 3)) + [0] * int(rng.integers(0, 3))
    x = rng.normal(size=(frames, tokenizer.vocab_size)) * noise
    x[np.arange(frames), ids[:frames]] += peak
    return log_softmax(x)


def flat(rng, frames: int, scale: float = 0.6):
    """Near-uniform log-probs: every token a candidate, wide beams."""
    return log_softmax(rng.normal(size=(frames, TOKENIZER.vocab_size)) * scale)


def frames_of(kind: str, rng, frames: int) -> np.ndarray:
    if kind == "ties":  # three levels only: equal candidates, equal scores, the tie rules decide
        return rng.choice([-0.5, -1.5, -3.0, -np.inf], p=[0.3, 0.3, 0.3, 0.1], size=(frames, TOKENIZER.vocab_size))
    if kind == "peaky":
        return spoken(rng, frames)
    if kind == "flat":
        return flat(rng, frames)
    return np.concatenate([spoken(rng, frames // 2, noise=2.0, peak=3.0), flat(rng, frames - frames // 2)])


def assert_same(a: dict, b: dict) -> None:
    """Equal snapshots, bit for bit (``repr`` of a float round-trips exactly and tells -0.0 from 0.0)."""
    assert json.dumps(a) == json.dumps(b)


def random_splits(rng, total: int, most: int) -> list:
    cuts, at = [], 0
    while at < total:
        step = int(rng.integers(0, most + 1))
        cuts.append((at, min(total, at + step)))
        at += step
    return cuts


GEOMETRIES = [  # beam, topk, frames kind ("ties": three levels and -inf, lm_weight = word_bonus = 0)
    (1, 1, "peaky"), (4, 3, "flat"), (4, 8, "mixed"), (32, 8, "peaky"), (32, 8, "flat"), (32, 3, "mixed"),
    (1, 1, "ties"), (4, 2, "ties"), (32, 3, "ties")]


@pytest.mark.parametrize("twin", ["fast-native", "fast-python"])
@pytest.mark.parametrize("beam,topk,kind", GEOMETRIES)
def test_fast_twin_equals_reference_after_every_chunk(twin, beam, topk, kind):
    """Three streams decoded as one cohort, chunks of 0-40 frames each: same snapshots after every call."""
    weights = {"lm_weight": 0.0, "word_bonus": 0.0} if kind == "ties" else {}
    config = WordSearchConfig(beam_size=beam, token_topk=topk, **weights)
    ref, fast = make("reference", config), make(twin, config)
    rng = np.random.default_rng(beam * 100 + topk)
    streams = [frames_of(kind, rng, 300) for _ in range(3)]
    at = [0, 0, 0]
    rs, fs = [ref.new_state() for _ in streams], [fast.new_state() for _ in streams]
    while min(at) < 300:
        chunks = []
        for i, lp in enumerate(streams):
            step = int(rng.integers(0, 41))
            piece = lp[at[i] : at[i] + step]
            chunks.append(torch.from_numpy(piece.astype(np.float32)) if i == 2 else piece)  # as an engine gives them
            at[i] = min(300, at[i] + step)
        ref.decode(rs, chunks)
        fast.decode(fs, chunks)
        for r, f in zip(rs, fs, strict=True):
            assert_same(ref.snapshot(r), fast.snapshot(f))
            assert ref.best(r) == fast.best(f)
            assert ref.finalize(r) == fast.finalize(f)
    if kind != "ties":  # (random letters, -inf: few words finish there)
        assert any(ref.snapshot(r)["committed"] for r in rs)  # long streams commit their settled words


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("beam,topk,kind", [(1, 1, "peaky"), (4, 3, "mixed"), (32, 8, "flat")])
def test_any_split_of_the_frames_gives_the_same_answer(twin, beam, topk, kind):
    search = make(twin, WordSearchConfig(beam_size=beam, token_topk=topk))
    rng = np.random.default_rng(7 + beam)
    assert_any_split_agrees(search, frames_of(kind, rng, 240), rng)


def assert_any_split_agrees(search, lp: np.ndarray, rng) -> None:
    """``lp`` decoded whole and in random pieces (at most 1, 9, 64 frames): the same state and answers."""
    whole = search.new_state()
    search.decode([whole], [lp])
    for most in (1, 9, 64):
        state = search.new_state()
        for a, b in random_splits(rng, len(lp), most):
            search.decode([state], [lp[a:b]])
        assert_same(search.snapshot(state), search.snapshot(whole))
        assert search.finalize(state) == search.finalize(whole)
        assert search.best(state) == search.best(whole)


@pytest.mark.parametrize("source,target", list(itertools.product(TWINS[:2], TWINS)))
def test_snapshot_through_json_restores_into_either_twin(source, target):
    """Stop mid-stream, JSON the snapshot, restore it into another twin, continue: as if never stopped."""
    config = WordSearchConfig(beam_size=8, token_topk=4)
    first, second, straight = make(source, config), make(target, config), make("reference", config)
    rng = np.random.default_rng(3)
    lp = frames_of("mixed", rng, 260)
    cuts = random_splits(rng, len(lp), 30)
    never = straight.new_state()
    for a, b in cuts:
        straight.decode([never], [lp[a:b]])
    state = first.new_state()
    stop = next(i for i, (_, b) in enumerate(cuts) if b >= 130)  # the chunk after which the stream moves
    for a, b in cuts[: stop + 1]:
        first.decode([state], [lp[a:b]])
    text = json.dumps(first.snapshot(state))
    moved = second.restore(json.loads(text))
    assert_same(second.snapshot(moved), json.loads(text))
    for a, b in cuts[stop + 1 :]:
        second.decode([moved], [lp[a:b]])
    assert_same(second.snapshot(moved), straight.snapshot(never))
    assert second.finalize(moved) == straight.finalize(never)


def _bad_chunks(kind: str):
    V = TOKENIZER.vocab_size
    if kind == "width":
        return np.zeros((3, V + 1))
    if kind in ("nan", "+inf"):
        x = np.full((3, V), -2.0)
        x[1, 2] = np.nan if kind == "nan" else np.inf
        return x
    return np.zeros(V)  # 1-D


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("bad", ["width", "nan", "+inf", "1-D"])
def test_a_bad_chunk_changes_no_state(twin, bad):
    search = make(twin, WordSearchConfig(beam_size=4, token_topk=3))
    rng = np.random.default_rng(11)
    states = [search.new_state() for _ in range(3)]
    search.decode(states, [spoken(rng, 40) for _ in states])
    before = [search.snapshot(s) for s in states]
    chunks = [spoken(rng, 20), _bad_chunks(bad), spoken(rng, 20)]
    with pytest.raises(ValueError, match="chunk 1"):
        search.decode(states, chunks)
    with pytest.raises(ValueError, match="3 states but 2 chunks"):
        search.decode(states, chunks[:2])
    for s, b in zip(states, before, strict=True):
        assert_same(search.snapshot(s), b)


def _good_snapshot() -> dict:
    search = make("reference", WordSearchConfig(beam_size=4, token_topk=3))
    state = search.new_state()
    search.decode([state], [spoken(np.random.default_rng(5), 120)])
    snap = search.snapshot(state)
    assert snap["committed"] and any(h[0] for h in snap["beams"]) and any(h[1] for h in snap["beams"])
    return json.loads(json.dumps(snap))


def _set(path, value):
    def edit(s):
        *head, last = path
        for k in head:
            s = s[k]
        s[last] = value
    return edit


def _beam_with_word(value):
    def edit(s):
        h = next(h for h in s["beams"] if h[0])
        h[0][0] = value
    return edit


def _beam_with_partial(value):
    def edit(s):
        next(h for h in s["beams"] if h[1])[1] = value
    return edit


MALFORMED = {
    "not a dict": lambda s: s.clear() or s.update({"not": "a snapshot"}),
    "version": _set(["version"], 2),
    "frame negative": _set(["frame"], -1),
    "frame float": _set(["frame"], 3.0),
    "frame too big": _set(["frame"], 2**63),
    "committed not a list of words": _set(["committed"], 7),
    "committed word not text": _set(["committed", 0], [5, 0, 1]),
    "committed word frames": _set(["committed", 0], ["a", "0", 1]),
    "committed word outside the lexicon": _set(["committed", 0], ["cet", 0, 1]),
    "no beams": _set(["beams"], []),
    "beam short": _set(["beams", 0], [[], "", 0, 0, 0.0, NEG, 0.0, 0, 1]),
    "beam words": _beam_with_word(["cat", 1]),
    "beam word outside the lexicon": _beam_with_word(["cet", 1, 2]),
    "partial not text": _set(["beams", 0, 1], 3),
    "partial not a lexicon prefix": _beam_with_partial("ce"),
    "pstart": _set(["beams", 0, 2], "0"),
    "pend too big": _set(["beams", 0, 3], -(2**63) - 1),
    "pb int": _set(["beams", 0, 4], 0),
    "pnb text": _set(["beams", 0, 5], "-1e30"),
    "lm none": _set(["beams", 0, 6], None),
    "n float": _set(["beams", 0, 7], 1.0),
    "last word negative": _set(["beams", 0, 8], -1),
    "last word past <s>": _set(["beams", 0, 8], len(LEXICON) + 2),
    "last token blank": _set(["beams", 0, 9], 0),
    "last token past the vocabulary": _set(["beams", 0, 9], TOKENIZER.vocab_size),
    "last token text": _set(["beams", 0, 9], "a"),
}


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("case", list(MALFORMED))
def test_restore_refuses_a_malformed_snapshot(twin, case):
    search = make(twin, WordSearchConfig(beam_size=4, token_topk=3))
    good = _good_snapshot()
    assert_same(search.snapshot(search.restore(copy.deepcopy(good))), good)
    bad = copy.deepcopy(good)
    MALFORMED[case](bad)
    with pytest.raises(ValueError, match="WordSearch.restore"):
        search.restore(bad)


@pytest.mark.parametrize("twin", TWINS)
def test_restore_refuses_what_is_not_a_dict(twin):
    search = make(twin)
    for bad in (None, [], "snapshot"):
        with pytest.raises(ValueError, match="WordSearch.restore"):
            search.restore(bad)


def _row(**probs) -> np.ndarray:
    """One frame: the named characters' probabilities (``blank=``), the rest shared by every other token."""
    p = np.full(TOKENIZER.vocab_size, 0.0)
    for name, value in probs.items():
        p[TOKENIZER.symbols.index({"blank": "<blank>", "space": " "}.get(name, name))] = value
    rest = p == 0.0
    p[rest] = (1.0 - p.sum()) / rest.sum()
    return np.log(p)


@pytest.mark.parametrize("twin", TWINS)
def test_the_search_spells_lexicon_words_where_the_greedy_path_does_not(twin):
    """Greedy CTC reads "cet sad" here; "cet" is no word, so the search answers "cat sad"."""
    lp = np.stack([_row(c=0.9), _row(blank=0.9), _row(e=0.5, a=0.4), _row(t=0.9), _row(space=0.9),
                   _row(s=0.9), _row(a=0.9), _row(d=0.9)])
    greedy = [int(i) for i, _ in itertools.groupby(lp.argmax(axis=1)) if i]
    assert "".join(TOKENIZER.symbols[i] for i in greedy) == "cet sad"
    search = make(twin, WordSearchConfig(beam_size=8, token_topk=4))
    state = search.new_state()
    search.decode([state], [lp])
    result = search.finalize(state)
    assert result.text == "cat sad"
    assert [(w.first_frame, w.last_frame) for w in result.words] == [(0, 3), (5, 7)]


@pytest.mark.parametrize("twin", TWINS)
def test_a_hypothesis_in_the_middle_of_a_non_word_cannot_finish(twin):
    """The audio ends with "car", in the middle of "card": were its partial dropped, the empty answer would win
    (no price for a last word; the old rule did that); it cannot finish, so the answer is "card" (the weak
    final "d" taken)."""
    lp = np.stack([_row(c=0.9), _row(a=0.9), _row(r=0.9), _row(d=0.05, blank=0.9)])
    search = make(twin, WordSearchConfig(beam_size=16, token_topk=4, word_bonus=0.0))
    state = search.new_state()
    search.decode([state], [lp])
    top = search.snapshot(state)["beams"][0]
    assert top[1] == "car" and "car" not in LEXICON  # the best hypothesis is in the middle of a non-word
    assert search.best(state).text == "car"  # the live text shows it as it is
    assert search.finalize(state).text == "card"
    # nothing can finish: the top hypothesis's finished words (here none)
    only = np.stack([_row(c=0.9), _row(a=0.9), _row(r=0.9), _row(blank=0.99)])
    search = make(twin, WordSearchConfig(beam_size=1, token_topk=1))
    state = search.new_state()
    search.decode([state], [only])
    assert search.snapshot(state)["beams"][0][1] == "car" and search.finalize(state).text == ""


@pytest.mark.parametrize("twin", TWINS)
def test_every_finished_word_is_a_lexicon_word(twin):
    search = make(twin, WordSearchConfig(beam_size=8, token_topk=8))
    rng = np.random.default_rng(2)
    states = [search.new_state() for _ in range(4)]
    spelled_non_words = 0
    for _ in range(6):
        search.decode(states, [flat(rng, 30, scale=2.0) for _ in states])
        for s in states:
            assert set(search.finalize(s).text.split()) <= set(LEXICON)
            snap = search.snapshot(s)
            held = [w[0] for w in snap["committed"]] + [w[0] for h in snap["beams"] for w in h[0]]
            assert set(held) <= set(LEXICON)
            assert all(any(w.startswith(h[1]) for w in LEXICON) for h in snap["beams"])
            spelled_non_words += any(h[1] not in LEXICON for h in snap["beams"])
    assert spelled_non_words  # partials that are no words yet were held: the finishing rule had something to drop


# ---- brute force: the exact optimum of the docstring's score on a tiny case -------------------------------
TINY = CharTokenizer(" ab")
TINY_LM = WordLM.from_sentences(["a ab", "ab b", "ba a", "a a"], ["a", "ab", "b", "ba", "bb"], TINY.alphabet)


def _valid(text: str) -> bool:
    """A string the search can hold: finished lexicon words, each followed by one space, then a prefix."""
    *done, partial = text.split(" ")
    return all(w in TINY_LM.index for w in done) and partial in TINY_LM.lookahead


def _final(text: str, config: WordSearchConfig):
    """The docstring's finishing rule: (words, the lm part of the final score); None for a text in the middle
    of a non-word (it cannot finish)."""
    *done, partial = text.split(" ")
    if partial and partial not in TINY_LM.index:
        return None
    words = done + ([partial] if partial else [])
    ids = [TINY_LM.start_id, *(TINY_LM.index[w] for w in words), TINY_LM.end_id]
    lm = sum(TINY_LM.logp(u, w) for u, w in itertools.pairwise(ids))
    return words, config.lm_weight * lm + config.word_bonus * len(words)


def _brute_force(lp: np.ndarray) -> dict:
    """log P(collapse(alignment) = text) for every valid text, summing every alignment over blank and chars."""
    totals: dict = {}
    for path in itertools.product(range(4), repeat=len(lp)):  # blank, space, a, b (sos/eos is no character)
        text = "".join(TINY.symbols[t] for t, _ in itertools.groupby(path) if t)
        if _valid(text):
            totals.setdefault(text, []).append(sum(lp[i, t] for i, t in enumerate(path)))
    return {text: float(np.logaddexp.reduce(v)) for text, v in totals.items()}


def _hyp_text(h) -> str:
    words = [w[0] for w in h[0]]
    return " ".join([*words, h[1]]) if h[1] else " ".join(words) + (" " if words else "")


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("frames,seed,lm_weight,word_bonus", [(3, 0, 0.5, 0.5), (4, 1, 0.5, 0.5), (4, 2, 2.0, -1.0),
                                                              (4, 3, 0.0, 0.0), (4, 4, 1.0, 3.0)])
def test_a_wide_beam_finds_the_brute_force_optimum(twin, frames, seed, lm_weight, word_bonus):
    config = WordSearchConfig(beam_size=1000, token_topk=8, prune_log=-1e9, lm_weight=lm_weight,
                              word_bonus=word_bonus)
    rng = np.random.default_rng(seed)
    lp = log_softmax(rng.normal(size=(frames, TINY.vocab_size)) * 1.5)
    exact = _brute_force(lp)
    search = make(twin, config, lm=TINY_LM, symbols=TINY.symbols)
    state = search.new_state()
    search.decode([state], [lp])
    snap = search.snapshot(state)
    assert not snap["committed"]  # the empty hypothesis lives on: nothing shared
    held = {_hyp_text(h): lae(h[4], h[5]) for h in snap["beams"]}
    assert held.keys() == exact.keys()  # every valid spelling, exactly once
    for text, value in exact.items():
        assert math.isclose(held[text], value, rel_tol=1e-12, abs_tol=1e-12), text
    scores = {text: value + _final(text, config)[1] for text, value in exact.items() if _final(text, config)}
    best = max(scores, key=scores.get)
    assert search.finalize(state).text == " ".join(_final(best, config)[0])


# ---- the fast twin's own surface ---------------------------------------------------------------------------
def test_fast_twin_names_its_path_and_refuses_a_foreign_state():
    with pytest.raises(ValueError, match="native must be"):
        FastWordSearch(LM, TOKENIZER.symbols, native="yes")
    python = FastWordSearch(LM, TOKENIZER.symbols, native=False)
    assert python.execution.startswith("python")
    if not NATIVE:
        with pytest.raises(RuntimeError, match="native=True"):
            FastWordSearch(LM, TOKENIZER.symbols, native=True)
        return
    fast = FastWordSearch(LM, TOKENIZER.symbols, native="auto")
    assert fast.execution == "native (C++)"
    other = FastWordSearch(WordLM.from_sentences(["a cat"], ["a", "cat"], TOKENIZER.alphabet), TOKENIZER.symbols)
    lp = spoken(np.random.default_rng(0), 10)
    for stranger in (other.new_state(), make("reference").new_state()):
        with pytest.raises(ValueError, match="state 1 is not a state of this search"):
            fast.decode([fast.new_state(), stranger], [lp, lp])
    shared = FastWordSearch(LM, TOKENIZER.symbols, WordSearchConfig(beam_size=2))  # same model: states move
    state = shared.new_state()
    fast.decode([state], [lp])


@pytest.mark.parametrize("twin", TWINS)
def test_a_state_twice_in_a_cohort_and_a_copied_state(twin):
    """One state twice in a call takes both chunks in order; a deep copy goes on alone."""
    search = make(twin, WordSearchConfig(beam_size=4, token_topk=3))
    rng = np.random.default_rng(9)
    a, b, c = spoken(rng, 30), spoken(rng, 25), spoken(rng, 20)
    twice, once = search.new_state(), search.new_state()
    search.decode([twice, twice], [a, b])
    search.decode([once], [np.concatenate([a, b])])
    assert_same(search.snapshot(twice), search.snapshot(once))
    copied = copy.deepcopy(once)
    search.decode([copied], [c])
    assert_same(search.snapshot(twice), search.snapshot(once))
    search.decode([once], [c])
    assert_same(search.snapshot(copied), search.snapshot(once))


# ---- the real language model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recipe():
    from oasr.asr.language import LanguageSpec, recipe_lm
    from oasr.tokenizers.char import CharTokenizer as Tokenizer

    tokenizer = Tokenizer()
    return tokenizer, recipe_lm(LanguageSpec(), tokenizer.alphabet)


def test_the_twins_agree_on_the_recipe_language_model(recipe):
    """Four spoken streams of recipe-text words, 320 frames in 32-frame chunks at beam 32: equal snapshots
    after every chunk, and the words come back."""
    tokenizer, lm = recipe
    ref = ReferenceWordSearch(lm, tokenizer.symbols)
    fast = make("fast-native", lm=lm, symbols=tokenizer.symbols)
    rng = np.random.default_rng(2026)
    words = [w for w in lm.words if len(w) > 2][::50]
    streams = [spoken(rng, 320, noise=0.5, lexicon=words, tokenizer=tokenizer) for _ in range(4)]
    rs, fs = [ref.new_state() for _ in streams], [fast.new_state() for _ in streams]
    for at in range(0, 320, 32):
        chunks = [lp[at : at + 32] for lp in streams]
        ref.decode(rs, chunks)
        fast.decode(fs, chunks)
        for r, f in zip(rs, fs, strict=True):
            assert_same(ref.snapshot(r), fast.snapshot(f))
    for r, f in zip(rs, fs, strict=True):
        result = fast.finalize(f)
        assert result == ref.finalize(r) and len(result.words) > 10
        assert all(w.word in lm.index for w in result.words)
    assert any(ref.snapshot(r)["committed"] for r in rs)


def test_without_a_compiler_the_fast_twin_says_so_and_runs_the_python_rule(tmp_path):
    """No g++ (CXX names none, an empty kernel cache): ``native="auto"`` falls back and says why in
    ``execution``; ``native=True`` refuses with the reason."""
    import os
    import subprocess
    import sys

    code = """if True:
        import numpy as np
        from oasr.ctc.words import WordLM
        from oasr.fast.word_search import WordSearch
        from oasr.tokenizers.char import CharTokenizer
        tok = CharTokenizer(" act")
        lm = WordLM.from_sentences(["a cat"], ["a", "cat"], tok.alphabet)
        search = WordSearch(lm, tok.symbols)
        print(search.execution)
        state = search.new_state()
        search.decode([state], [np.log(np.full((4, tok.vocab_size), 1.0 / tok.vocab_size))])
        print(type(state).__module__)
        try:
            WordSearch(lm, tok.symbols, native=True)
        except RuntimeError as exc:
            print("refused:", exc)
    """
    env = {**os.environ, "CXX": "no-such-compiler-oasr", "OASR_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("python (the reference rule; the native word search needs a C++17 compiler")
    assert lines[1] == "oasr.reference.word_search"
    assert lines[2].startswith("refused: WordSearch(native=True): the native word search needs a C++17 compiler: "
                               "'no-such-compiler-oasr'")


# ---- the bound on uncommitted words (module docstring of oasr.ctc.words: bounded memory) ------------------
def unbounded(config: WordSearchConfig | None = None, lm: WordLM = LM, symbols=None) -> ReferenceWordSearch:
    """The oracle: the reference with the bound switched off (the search before the bound existed)."""
    search = ReferenceWordSearch(lm, TOKENIZER.symbols if symbols is None else symbols, config)
    search._bound = lambda state: None
    return search


def depths(snapshot: dict) -> list:
    """Uncommitted finished words per hypothesis."""
    return [len(h[0]) for h in snapshot["beams"]]


def every_word_list(snapshot: dict) -> list:
    """Per hypothesis, all its finished words (committed ones first): what no commit changes."""
    return [[*snapshot["committed"], *h[0]] for h in snapshot["beams"]]


@pytest.mark.parametrize("bad", [1, 0, -3, True, 2.0, "64", None])
def test_max_words_must_be_an_int_of_at_least_two(bad):
    with pytest.raises(ValueError, match="max_words must be an int >= 2"):
        WordSearchConfig(max_words=bad)
    assert WordSearchConfig(max_words=2).max_words == 2 and WordSearchConfig().max_words == 64


def test_a_counted_sentence_is_that_sentence_repeated():
    repeated = WordLM.from_sentences([*SENTENCES, "a cat sat", "a cat sat", "a red rose"], LEXICON, TOKENIZER.alphabet)
    counted = WordLM.from_sentences([*SENTENCES[1:], ("a cat sat", 3), ("a red rose", 1)], LEXICON,
                                    TOKENIZER.alphabet)
    assert np.array_equal(repeated.unigram, counted.unigram)
    assert repeated.bigram == counted.bigram and repeated.backoff == counted.backoff
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="count must be a positive int"):
            WordLM.from_sentences([("a cat", bad)], LEXICON, TOKENIZER.alphabet)


def _spelled(text: str, ambiguous=None) -> np.ndarray:
    """Peaky frames spelling ``text`` (each character a frame, a blank after it); ``ambiguous``: a
    ``{character: probability}`` frame first (its word's first letter, e.g. c or r)."""
    rows = [_row(**ambiguous), _row(blank=0.9)] if ambiguous else []
    for ch in text:
        rows += [_row(**{"space" if ch == " " else ch: 0.9}), _row(blank=0.9)]
    return np.stack(rows)


LONG_AGO = _spelled("at sat at a dog a sad dog a red rose a cat sat at a tree ", ambiguous={"c": 0.45, "r": 0.45})


@pytest.mark.parametrize("twin", TWINS)
def test_an_alternative_that_parted_long_ago_is_dropped_and_the_twins_agree(twin):
    """"cat ..." and "rat ..." differ in their first word only: the unbounded search holds both to the end; with
    max_words = 4 the "rat" alternatives go once the best holds 5 words, the best is kept, and the twins agree
    bit for bit after every chunk (snapshots of every chunk size, so the drop lands inside chunks too)."""
    config = WordSearchConfig(beam_size=8, token_topk=4, max_words=4)
    oracle, ref, search = unbounded(config), make("reference", config), make(twin, config)
    whole = oracle.new_state()
    oracle.decode([whole], [LONG_AGO])
    unbounded_snap = oracle.snapshot(whole)
    assert not unbounded_snap["committed"] and max(depths(unbounded_snap)) > 10
    assert {h[0][0][0] for h in unbounded_snap["beams"]} == {"cat", "rat"}  # both held to the end
    for step in (1, 7, 40):
        r, s = ref.new_state(), search.new_state()
        for at in range(0, len(LONG_AGO), step):
            ref.decode([r], [LONG_AGO[at : at + step]])
            search.decode([s], [LONG_AGO[at : at + step]])
            assert_same(search.snapshot(s), ref.snapshot(r))
            assert max(depths(search.snapshot(s))) <= 4
        snap = search.snapshot(s)
        first = unbounded_snap["beams"][0][0][0][0]  # the best's first word: kept; the others' alternatives: gone
        assert {words[0][0] for words in every_word_list(snap)} == {first}
        assert search.finalize(s) == oracle.finalize(whole)
        assert search.best(s) == oracle.best(whole)


@pytest.mark.parametrize("twin", ["fast-native", "fast-python"])
@pytest.mark.parametrize("max_words", [2, 3, 5])
@pytest.mark.parametrize("beam,topk,kind", [(4, 3, "mixed"), (32, 8, "flat"), (32, 8, "peaky"), (32, 3, "mixed"),
                                            (4, 2, "ties")])
def test_with_a_small_max_words_the_twins_agree_after_every_chunk(twin, max_words, beam, topk, kind):
    """Random streams where the bound drops often: equal snapshots after every call, depths within the bound."""
    weights = {"lm_weight": 0.0, "word_bonus": 0.0} if kind == "ties" else {}
    config = WordSearchConfig(beam_size=beam, token_topk=topk, max_words=max_words, **weights)
    ref, fast, oracle = make("reference", config), make(twin, config), unbounded(config)
    rng = np.random.default_rng(max_words * 1000 + beam * 10 + topk)
    streams = [frames_of(kind, rng, 300) for _ in range(3)]
    at = [0, 0, 0]
    rs, fs, olds = ([search.new_state() for _ in streams] for search in (ref, fast, oracle))
    deepest, dropped = 0, 0
    while min(at) < 300:
        chunks = []
        for i, lp in enumerate(streams):
            step = int(rng.integers(0, 41))
            chunks.append(lp[at[i] : at[i] + step])
            at[i] = min(300, at[i] + step)
        ref.decode(rs, chunks)
        fast.decode(fs, chunks)
        oracle.decode(olds, chunks)
        for r, f, o in zip(rs, fs, olds, strict=True):
            assert_same(ref.snapshot(r), fast.snapshot(f))
            assert max(depths(fast.snapshot(f))) <= max_words
            assert ref.finalize(r) == fast.finalize(f)
            deepest = max(deepest, *depths(oracle.snapshot(o)))
            dropped += every_word_list(ref.snapshot(r)) != every_word_list(oracle.snapshot(o))
    print(f"unbounded depth {deepest}, chunks where the bounded search differs {dropped}")
    if kind != "ties":  # the bound did something here (random letters and -inf finish few words)
        assert deepest > max_words and dropped


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("max_words,kind", [(2, "peaky"), (3, "mixed"), (4, "flat")])
def test_with_a_small_max_words_any_split_gives_the_same_answer(twin, max_words, kind):
    search = make(twin, WordSearchConfig(beam_size=8, token_topk=4, max_words=max_words))
    rng = np.random.default_rng(50 + max_words)
    assert_any_split_agrees(search, frames_of(kind, rng, 300), rng)


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("beam,topk,kind", [(4, 3, "flat"), (32, 8, "peaky"), (32, 3, "mixed")])
def test_a_max_words_beyond_the_stream_is_the_unbounded_search(twin, beam, topk, kind):
    """No hypothesis outgrows max_words: the same hypotheses, scores and answers as the unbounded search."""
    config = WordSearchConfig(beam_size=beam, token_topk=topk, max_words=1000)
    search, oracle = make(twin, config), unbounded(config)
    rng = np.random.default_rng(beam + topk)
    lp = frames_of(kind, rng, 400)
    state, old = search.new_state(), oracle.new_state()
    for a, b in random_splits(rng, len(lp), 40):
        search.decode([state], [lp[a:b]])
        oracle.decode([old], [lp[a:b]])
        assert_same(search.snapshot(state), oracle.snapshot(old))
        assert search.finalize(state) == oracle.finalize(old)


@pytest.mark.parametrize("source", TWINS[:2])
@pytest.mark.parametrize("target", TWINS)
def test_a_snapshot_deeper_than_the_bound_restores_and_the_bound_applies_from_the_next_frame(source, target):
    """Saved with a large max_words, restored under max_words = 3: valid as it is (a call with no frames
    changes nothing), the bound holds after the next frame, and the twins agree from there on."""
    deep = make(source, WordSearchConfig(beam_size=8, token_topk=4, max_words=1000))
    state = deep.new_state()
    deep.decode([state], [LONG_AGO[:-20]])
    snap = json.loads(json.dumps(deep.snapshot(state)))
    assert max(depths(snap)) > 3
    config = WordSearchConfig(beam_size=8, token_topk=4, max_words=3)
    ref, search = make("reference", config), make(target, config)
    r, s = ref.restore(copy.deepcopy(snap)), search.restore(copy.deepcopy(snap))
    search.decode([s], [LONG_AGO[:0]])
    assert_same(search.snapshot(s), snap)
    for at in range(len(LONG_AGO) - 20, len(LONG_AGO)):
        ref.decode([r], [LONG_AGO[at : at + 1]])
        search.decode([s], [LONG_AGO[at : at + 1]])
        assert_same(search.snapshot(s), ref.snapshot(r))
        assert max(depths(search.snapshot(s))) <= 3


LONG_FRAMES, LONG_CHUNK = 3200, 32


@pytest.fixture(scope="module")
def long_recipe_stream(recipe):
    """One 3,200-frame stream spelling recipe text (the bench's posteriors), on which the unbounded search
    holds 191 words at its deepest; and the reference's snapshots (JSON) after every 32-frame chunk."""
    from oasr.bench.word_search import spoken_posteriors

    tokenizer, lm = recipe
    lp = spoken_posteriors(tokenizer, 5, LONG_FRAMES, seed=5)[4]
    ref = ReferenceWordSearch(lm, tokenizer.symbols)
    state, snapshots = ref.new_state(), []
    for at in range(0, LONG_FRAMES, LONG_CHUNK):
        ref.decode([state], [lp[at : at + LONG_CHUNK]])
        snapshots.append(json.dumps(ref.snapshot(state)))
    return lp, snapshots, ref.finalize(state)


@pytest.mark.parametrize("twin", TWINS)
def test_a_long_recipe_stream_holds_at_most_max_words_and_the_twins_agree(twin, recipe, long_recipe_stream):
    """The default bound (64) on the real language model: after every chunk no hypothesis holds more than 64
    uncommitted words (the unbounded search goes far past it on this stream), and every twin's snapshot is
    the reference's."""
    tokenizer, lm = recipe
    lp, snapshots, answer = long_recipe_stream
    if twin == "fast-native":  # the unbounded search (the native twin with a bound it never reaches) for scale
        deep = make(twin, WordSearchConfig(max_words=10**9), lm=lm, symbols=tokenizer.symbols)
        state, deepest = deep.new_state(), 0
        for at in range(0, LONG_FRAMES, LONG_CHUNK):
            deep.decode([state], [lp[at : at + LONG_CHUNK]])
            deepest = max(deepest, *depths(deep.snapshot(state)))
        assert deepest > 128
    search = make(twin, lm=lm, symbols=tokenizer.symbols)
    state = search.new_state()
    for i, at in enumerate(range(0, LONG_FRAMES, LONG_CHUNK)):
        search.decode([state], [lp[at : at + LONG_CHUNK]])
        snap = search.snapshot(state)
        assert max(depths(snap)) <= 64
        assert json.dumps(snap) == snapshots[i]
    assert search.finalize(state) == answer and len(answer.words) > 150
