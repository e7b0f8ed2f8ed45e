"""The open training text: seeded, held-out sentences never generated, every character in the tokenizer's alphabet."""

import itertools
import json

import pytest

from oasr.asr.opentext import (
    COMMON_FORMS,
    FUNCTION,
    MixedSentenceGenerator,
    OpenSentenceGenerator,
    english_sentences,
    past,
    plural_of,
    present_participle,
    template_vocabulary,
    third_person,
    training_vocabulary,
)
from oasr.asr.testset import load_testset, shipped_testset_dir
from oasr.asr.testset2 import SecondSetSentences
from oasr.asr.text import is_held_out
from oasr.asr.vocab import load_names, load_words, spelled_out
from oasr.tokenizers.char import CharTokenizer


def _take(gen, n):
    return list(itertools.islice(gen, n))


def test_the_generators_are_functions_of_their_seed():
    assert _take(MixedSentenceGenerator(7), 300) == _take(MixedSentenceGenerator(7), 300)
    assert _take(MixedSentenceGenerator(7), 50) != _take(MixedSentenceGenerator(8), 50)
    assert _take(OpenSentenceGenerator(3), 100) == _take(OpenSentenceGenerator(3), 100)
    assert _take(SecondSetSentences(1), 40) == _take(SecondSetSentences(1), 40)


def test_training_text_never_holds_a_held_out_sentence():
    train = _take(MixedSentenceGenerator(11, open_share=0.6), 4000)
    assert not any(is_held_out(t) for t in train)
    held = _take(MixedSentenceGenerator(11, open_share=0.6, held_out=True), 300)
    assert all(is_held_out(t) for t in held)
    # both shipped sets are held out by the same hash, so no training stream can ever produce one of them
    for name in ("testset", "testset2"):
        texts = [c.text for c in load_testset(shipped_testset_dir(name)) if c.text and c.condition != "long"]
        assert texts and all(is_held_out(t) for t in texts), name
    # each sentence of a long clip is held out on its own (the clip's text is their join)
    table = (shipped_testset_dir("testset2") / "transcripts.tsv").read_text().splitlines()
    longs = [json.loads(line.split("\t")[2]) for line in table if '"long"' in line]
    assert longs and all(is_held_out(t) for d in longs for t in d["sentences"])
    assert " ".join(longs[0]["sentences"]) in {c.text for c in load_testset(shipped_testset_dir("testset2"))}
    second = {c.text for c in load_testset(shipped_testset_dir("testset2")) if c.condition != "long" and c.text}
    assert not second & set(train)


def test_the_mix_follows_the_open_share():
    template_words = template_vocabulary()
    texts = _take(MixedSentenceGenerator(5, open_share=0.0), 500)
    assert all(set(t.split()) <= template_words for t in texts)
    opened = _take(MixedSentenceGenerator(5, open_share=1.0), 500)
    outside = sum(not set(t.split()) <= template_words for t in opened)
    assert outside > 400
    with pytest.raises(ValueError, match="open_share"):
        MixedSentenceGenerator(0, open_share=1.5)


def test_english_examples_join_the_mix_on_their_own_random_stream():
    """``english_share``: that share of the sentences are English examples of the split's side, every word in the
    training vocabulary; 0 leaves the stream exactly as it was (the shards made before it stay reproducible)."""
    assert _take(MixedSentenceGenerator(9, english_share=0.0), 400) == _take(MixedSentenceGenerator(9), 400)
    examples = set(english_sentences())
    vocabulary = training_vocabulary()
    assert len(examples) > 30000 and all(set(t.split()) <= vocabulary for t in examples)
    texts = _take(MixedSentenceGenerator(9, english_share=0.5), 2000)
    english = [t for t in texts if t in examples]
    assert 850 < len(english) < 1150  # binomial(2000, 0.5): 1000 +- 22
    assert not any(is_held_out(t) for t in texts)
    # the rest is the stream without examples, in order (its draws are untouched by the English ones)
    others = [t for t in texts if t not in examples]
    assert others[:200] == [t for t in _take(MixedSentenceGenerator(9), 1200) if t not in examples][:200]
    held = _take(MixedSentenceGenerator(9, held_out=True, english_share=1.0), 300)
    assert all(t in examples and is_held_out(t) for t in held)
    # no sentence of either shipped test set is an example: the English shards cannot teach a test sentence
    for name in ("testset", "testset2"):
        assert not {c.text for c in load_testset(shipped_testset_dir(name))} & examples, name
    with pytest.raises(ValueError, match="english_share"):
        MixedSentenceGenerator(0, english_share=-0.1)


def test_the_tokenizer_covers_every_training_and_test_word():
    tok = CharTokenizer()
    words = training_vocabulary()
    assert len(load_words()) > 40000 and len(load_names()) > 5000
    for w in words:
        assert tok.decode(tok.encode(w)) == w
    for t in _take(MixedSentenceGenerator(2), 2000):
        assert tok.decode(tok.encode(t)) == t and t == " ".join(t.split())
    # the second set's words are everyday ones the open text draws often (it measures new forms, not rare words)
    frequent = set(COMMON_FORMS) | set(FUNCTION) | template_vocabulary()
    for c in load_testset(shipped_testset_dir("testset2")):
        assert set(c.text.split()) <= frequent, c.text


def test_inflections_and_the_espeak_spelling_filter():
    assert [past(v) for v in ("stop", "carry", "bring", "move", "paint")] == [
        "stopped", "carried", "brought", "moved", "painted"]
    assert [third_person(v) for v in ("wash", "fix", "carry", "play")] == ["washes", "fixes", "carries", "plays"]
    assert [present_participle(v) for v in ("run", "make", "see")] == ["running", "making", "seeing"]
    assert [plural_of(n) for n in ("city", "box", "child", "day")] == ["cities", "boxes", "children", "days"]
    assert spelled_out("nth", ",Ent,i:;'eItS") and not spelled_out("cat", "k'at")
    assert not spelled_out("understanding", ",Vnd3st'andIN")
