"""Open training text: word sequences and free sentence shapes over a large vocabulary, mixed with the templates.

The template generator (``oasr.asr.text``) teaches a model its few hundred words in a few dozen sentence
forms, and a model trained only on it learns the forms. ``OpenSentenceGenerator`` breaks them:

* **random word sequences** (2-9 words) drawn from the shipped open vocabulary (``oasr.asr.vocab``,
  about 52,000 words of the Debian ``wamerican`` list), the common words below (``COMMON_FORMS``: a few
  hundred everyday words with their inflections) and names;
* **free shapes**: sequences of slots, each a function word, a common word, an open-vocabulary word, a
  name, a number, a clock time or a date, drawn independently (so no sentence form recurs: the model
  has to hear every word);
* **numbers, dates and names** on their own (years, digit strings, counts, ordinals, full names).

``MixedSentenceGenerator(seed, open_share, english_share=...)`` draws each sentence from the shipped English
usage examples (``english_sentences``: WordNet's, those whose every word is in ``training_vocabulary``) with
probability ``english_share`` (0 by default), otherwise from the open generator with probability
``open_share`` and from the templates otherwise. The English examples bring what neither generator has: real
word order and sentence openings (questions, requests, pronouns), so a model does not learn that an utterance
starts the way a template does. Every draw keeps the held-out split of ``oasr.asr.text``: with
``held_out=False`` it never yields a sentence for which ``is_held_out(text)`` is true, so no sentence of a
shipped test set (all of them held out by that hash: ``tests/test_asr_opentext.py`` checks it) is ever
generated for training. Everything is lower-case ``a-z``, apostrophes and single spaces: the character
tokenizer's alphabet, unchanged.
"""

from __future__ import annotations

import random
from functools import lru_cache

from oasr.asr.text import MONTHS, ONES, ORDINALS, SentenceGenerator, _date, _time, is_held_out, number_words
from oasr.asr.vocab import load_names, load_words

FUNCTION = ("the a an of to and in is it you that he she was for on are with as i his her they we be at one have "
            "this from or had by not but what all were when your can said there use each which do how their if "
            "will up other about out many then them these so some would make like him into time has look two more "
            "write go see no way could people my than first been call who its now find long down day did get come "
            "made may part over new after also back any only most very just where why our us me must should might "
            "here well because off before through still while under again every never always nothing something "
            "anyone anything nobody everyone please last those too seen been "
            "there's it's don't i'm you're we'll can't isn't won't didn't let's").split()
COMMON = ("water food house home room door window table chair bed car road street city town country world school "
          "work job office money book paper letter phone music song light fire air sun moon star sky rain snow wind "
          "tree flower grass garden river sea lake hill mountain field farm animal dog cat bird fish horse cow "
          "family friend mother father sister brother child baby man woman boy girl doctor teacher driver name "
          "morning evening night week month year today tomorrow yesterday hour minute moment story question answer "
          "idea problem reason place thing part side end start line color picture game ball party dinner lunch "
          "breakfast kitchen bread cheese apple orange coffee tea milk sugar salt box bag bottle cup glass plate "
          "shirt shoe coat hat hand head face eye ear mouth arm leg foot heart voice word sentence number language "
          "open close turn move walk run stop wait carry bring take give send read speak listen hear watch find "
          "keep leave meet help show try ask tell think know want need like love hate buy sell pay cook clean wash "
          "build break fix drive ride fly swim sing dance play write draw paint learn teach remember forget begin "
          "finish happy sad angry tired hungry busy quiet loud bright dark warm cold hot cool fresh clean dirty "
          "heavy light empty full broken early late fast slow easy hard simple strange sudden gentle careful wrong "
          "right green blue red yellow white black brown purple golden silver wooden narrow wide deep shallow").split()

IRREGULAR_PAST = dict(pair.split(":") for pair in (
    "run:ran bring:brought take:took give:gave send:sent read:read speak:spoke hear:heard find:found keep:kept "
    "leave:left meet:met tell:told think:thought know:knew buy:bought sell:sold pay:paid build:built break:broke "
    "drive:drove ride:rode fly:flew swim:swam sing:sang write:wrote draw:drew teach:taught forget:forgot "
    "begin:began").split())
VERBS = ("open close turn move walk run stop wait carry bring take give send read speak listen hear watch find keep "
         "leave meet help show try ask tell think know want need like love hate buy sell pay cook clean wash build "
         "break fix drive ride fly swim sing dance play write draw paint learn teach remember forget begin finish "
         "call look use start rain").split()
COUNTABLE = ("house room door window table chair bed car road street city town country school job book paper letter "
             "phone song tree flower river lake hill mountain field farm animal dog cat bird horse cow family friend "
             "sister brother baby boy girl doctor teacher driver name morning evening night week month year hour "
             "minute story question answer idea problem reason place thing line picture game ball party apple orange "
             "box bag bottle cup glass plate shirt shoe coat hat hand face eye ear arm leg voice word number").split()


def past(verb: str) -> str:
    """The simple past of a verb of ``VERBS`` (irregular ones from a table, the rest by spelling rules)."""
    if verb in IRREGULAR_PAST:
        return IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    if verb in ("stop", "plan", "drop"):
        return verb + verb[-1] + "ed"
    return verb + "ed"


def third_person(verb: str) -> str:
    """The third person singular present (``wash`` -> ``washes``, ``carry`` -> ``carries``)."""
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    if verb.endswith(("sh", "ch", "x", "ss", "o")):
        return verb + "es"
    return verb + "s"


def present_participle(verb: str) -> str:
    """``verb`` + ing (``run`` -> ``running``, ``make`` -> ``making``)."""
    if verb in ("run", "swim", "begin", "forget", "stop"):
        return verb + verb[-1] + "ing"
    if verb.endswith("e") and verb not in ("see",):
        return verb[:-1] + "ing"
    return verb + "ing"


def plural_of(noun: str) -> str:
    """The plural of a noun of ``COUNTABLE`` or the templates."""
    irregular = {"child": "children", "man": "men", "woman": "women", "foot": "feet", "box": "boxes",
                 "glass": "glasses", "bus": "buses"}
    if noun in irregular:
        return irregular[noun]
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


# the common words with their inflections: what the open generator draws most often besides function words
COMMON_FORMS = tuple(sorted(set(COMMON) | {past(v) for v in VERBS} | {third_person(v) for v in VERBS}
                            | {present_participle(v) for v in VERBS}
                            | {plural_of(n) for n in COUNTABLE}))


def _digits(r: random.Random) -> str:
    return " ".join(r.choice(["oh", "zero"]) if d == 0 else ONES[d] for d in (r.randrange(10) for _ in
                                                                              range(r.randint(3, 8))))


def _year(r: random.Random) -> str:
    y = r.randint(1900, 2099)
    if 2000 <= y < 2010:
        return number_words(y)
    return f"{number_words(y // 100)} {number_words(y % 100) if y % 100 >= 10 else 'oh ' + ONES[y % 100]}" \
        if y % 100 else f"{number_words(y // 100)} hundred"


def _number(r: random.Random) -> str:
    kind = r.randrange(6)
    if kind == 0:
        return number_words(r.randint(0, 9999))
    if kind == 1:
        return _digits(r)
    if kind == 2:
        return _year(r)
    if kind == 3:
        return r.choice(ORDINALS)
    if kind == 4:
        return f"{number_words(r.randint(1, 999))} point {ONES[r.randrange(10)]}"
    return f"{number_words(r.randint(1, 99))} {r.choice(['million', 'thousand', 'hundred', 'percent'])}"


class OpenSentenceGenerator:
    """An endless seeded stream of open sentences (no held-out filtering: ``MixedSentenceGenerator`` does it)."""

    def __init__(self, seed: int):
        self.random = random.Random(seed)
        self.words = load_words()
        self.names = load_names()

    def _word(self, r: random.Random) -> str:
        u = r.random()
        if u < 0.45:
            return r.choice(self.words)
        if u < 0.75:
            return r.choice(COMMON_FORMS)
        if u < 0.95:
            return r.choice(FUNCTION)
        return r.choice(self.names)

    def _slot(self, r: random.Random) -> str:
        u = r.random()
        if u < 0.40:
            return r.choice(FUNCTION)
        if u < 0.62:
            return r.choice(COMMON_FORMS)
        if u < 0.85:
            return r.choice(self.words)
        if u < 0.92:
            return r.choice(self.names)
        if u < 0.96:
            return _number(r)
        return _time(r) if u < 0.98 else _date(r)

    def _special(self, r: random.Random) -> str:
        kind = r.randrange(5)
        if kind == 0:
            return " ".join(r.choice(self.names) for _ in range(r.randint(1, 3)))
        if kind == 1:
            return " ".join(_number(r) for _ in range(r.randint(1, 3)))
        if kind == 2:
            return f"{_date(r)} {_year(r)}" if r.random() < 0.5 else f"{r.choice(MONTHS)} {_year(r)}"
        if kind == 3:
            return f"{_time(r)} {r.choice(['on', 'before', 'after', 'until'])} {_date(r)}"
        return f"{r.choice(self.names)} {r.choice(self.names)} {_number(r)}"

    def __iter__(self):
        return self

    def __next__(self) -> str:
        r = self.random
        u = r.random()
        if u < 0.35:
            text = " ".join(self._word(r) for _ in range(r.randint(2, 9)))
        elif u < 0.85:
            text = " ".join(self._slot(r) for _ in range(r.randint(3, 12)))
        else:
            text = self._special(r)
        return " ".join(text.split())


class MixedSentenceGenerator:
    """English examples (``english_share`` of the sentences), then templates and open sentences (``open_share`` of
    the rest open), on one side of the held-out split. With ``english_share=0`` the stream is exactly the one
    before the English examples existed (their draws use a random stream of their own)."""

    def __init__(self, seed: int, open_share: float = 0.6, held_out: bool = False, english_share: float = 0.0):
        if not 0.0 <= open_share <= 1.0:
            raise ValueError(f"MixedSentenceGenerator: open_share must be in [0, 1], got {open_share}")
        if not 0.0 <= english_share <= 1.0:
            raise ValueError(f"MixedSentenceGenerator: english_share must be in [0, 1], got {english_share}")
        root = random.Random(f"mixed/{seed}")
        self.random = random.Random(root.getrandbits(64))
        self.templates = SentenceGenerator(root.getrandbits(32), held_out=held_out)
        self.open = OpenSentenceGenerator(root.getrandbits(32))
        self.open_share = open_share
        self.held_out = held_out
        self.english_share = english_share
        self.english_random = random.Random(f"mixed/{seed}/english")
        self.english = [t for t in english_sentences() if is_held_out(t) == held_out] if english_share else []

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self.english_share and self.english_random.random() < self.english_share:
            return self.english_random.choice(self.english)
        if self.random.random() >= self.open_share:
            return next(self.templates)
        while True:
            text = next(self.open)
            if is_held_out(text) == self.held_out:
                return text


@lru_cache(maxsize=1)
def template_vocabulary() -> frozenset[str]:
    """``oasr.asr.text.vocabulary()``, computed once."""
    from oasr.asr.text import vocabulary

    return frozenset(vocabulary())


@lru_cache(maxsize=1)
def english_sentences() -> tuple[str, ...]:
    """The shipped English usage examples (``oasr.asr.language.load_english``) whose every word is in
    ``training_vocabulary``, in file order (both sides of the held-out split)."""
    from oasr.asr.language import load_english

    vocabulary = training_vocabulary()
    return tuple(t for t in load_english() if all(w in vocabulary for w in t.split()))


def training_vocabulary() -> set[str]:
    """Every word a training sentence can contain: the open vocabulary, names, the lists here, the templates'."""
    words = set(load_words()) | set(load_names()) | set(FUNCTION) | set(COMMON_FORMS) | template_vocabulary()
    words.update("oh zero point million thousand hundred percent on before after until".split())
    return words
