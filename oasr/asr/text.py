"""A deterministic generator of short English sentences for synthesized training and test speech.

Sentences come from templates over a closed vocabulary of a few hundred words: spoken numbers,
clock times, dates, home-assistant commands, weather reports and short descriptive sentences.
Everything is lower case letters, apostrophes and single spaces, which is exactly the
character tokenizer's alphabet (``oasr.tokenizers.char``).

The held-out test set must contain sentences never trained on. ``is_held_out(text)`` splits the
space of sentences by a stable hash (not by Python's salted ``hash``): the training stream drops
every held-out sentence, the test set draws only held-out ones. ``SentenceGenerator(seed)``
yields the same sentences on every machine and Python version.
"""

from __future__ import annotations

import hashlib
import random

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
            "eighteenth", "nineteenth", "twentieth", "twenty first", "twenty second", "twenty third",
            "twenty fourth", "twenty fifth", "twenty sixth", "twenty seventh", "twenty eighth", "twenty ninth",
            "thirtieth", "thirty first"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
          "november", "december"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
ROOMS = ["kitchen", "bedroom", "living room", "bathroom", "garage", "office", "hallway", "garden", "basement"]
DEVICES = ["lights", "lamp", "heater", "fan", "radio", "television", "oven", "dishwasher", "music"]
PEOPLE = ["my mother", "my father", "my sister", "my brother", "the doctor", "the office", "grandma", "uncle john",
          "anna", "peter", "maria", "david", "the school", "my friend"]
THINGS = ["milk", "bread", "eggs", "coffee", "apples", "rice", "cheese", "butter", "tea", "oranges", "soap",
          "batteries", "flowers", "stamps", "paper"]
GENRES = ["jazz", "rock", "classical music", "the news", "the radio", "some songs", "a podcast", "quiet music"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "brown", "grey", "orange", "purple"]
SIZES = ["small", "big", "little", "large", "tall", "short", "long", "old", "new", "young"]
NOUNS = ["dog", "cat", "car", "boat", "house", "tree", "bird", "horse", "book", "chair", "table", "window", "door",
         "bicycle", "train", "bridge", "river", "garden", "child", "woman", "man", "box", "bag", "hat", "cup"]
PLACES = ["near the river", "behind the house", "under the table", "on the hill", "in the garden",
          "next to the station", "by the window", "across the street", "at the corner", "in the park",
          "on the bridge", "inside the box", "along the road", "beside the school"]
VERBS_PAST = ["walked", "ran", "stopped", "waited", "jumped", "looked", "turned", "slept", "sat", "moved"]
ADVERBS = ["slowly", "quickly", "quietly", "carefully", "suddenly", "happily", "again", "early", "late"]
WEATHER = ["sunny", "cloudy", "rainy", "windy", "cold", "warm", "hot", "foggy", "snowy", "clear"]
UNITS = ["minutes", "hours", "seconds", "days", "weeks"]
CITIES = ["london", "paris", "berlin", "boston", "madrid", "tokyo", "sydney", "dublin", "chicago", "toronto"]


def number_words(n: int) -> str:
    """``0 <= n < 10000`` spoken in British style: ``"three hundred and five"``."""
    if not 0 <= n < 10000:
        raise ValueError(f"number_words: 0 <= n < 10000, got {n}")
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ONES[n % 10])
    if n < 1000:
        head = ONES[n // 100] + " hundred"
        return head if n % 100 == 0 else head + " and " + number_words(n % 100)
    head = number_words(n // 1000) + " thousand"
    if n % 1000 == 0:
        return head
    rest = n % 1000
    return head + (" and " if rest < 100 else " ") + number_words(rest)


def _time(r: random.Random) -> str:
    h, m = r.randint(1, 12), r.choice([0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55])
    style = r.randrange(4)
    if style == 0:
        return f"{ONES[h] if h < 20 else number_words(h)} o'clock" if m == 0 else f"{number_words(h)} {number_words(m)}"
    if style == 1 and m in (15, 30, 45):
        return {15: f"quarter past {number_words(h)}", 30: f"half past {number_words(h)}",
                45: f"quarter to {number_words(h % 12 + 1)}"}[m]
    part = r.choice(["in the morning", "in the afternoon", "in the evening", "at night"])
    if m == 0:
        return f"{number_words(h)} {part}"
    return f"{number_words(h)} {number_words(m) if m >= 10 else 'oh ' + number_words(m)} {part}"


def _date(r: random.Random) -> str:
    month = r.choice(MONTHS)
    day = r.choice(ORDINALS)
    style = r.randrange(3)
    if style == 0:
        return f"the {day} of {month}"
    if style == 1:
        return f"{r.choice(DAYS)} the {day} of {month}"
    return f"{month} {day}"


PLURALS = {"child": "children", "woman": "women", "man": "men", "box": "boxes", "bus": "buses"}


def plural(noun: str) -> str:
    """The plural of ``noun``."""
    return PLURALS.get(noun, noun + "s")


def _noun_phrase(r: random.Random) -> str:
    parts = ["the"]
    if r.random() < 0.6:
        parts.append(r.choice(SIZES))
    if r.random() < 0.6:
        parts.append(r.choice(COLORS))
    parts.append(r.choice(NOUNS))
    return " ".join(parts)


def _templates():
    def command(r):
        return r.choice([
            lambda: f"turn {r.choice(['on', 'off'])} the {r.choice(DEVICES)} in the {r.choice(ROOMS)}",
            lambda: f"set a timer for {number_words(r.randint(1, 90))} {r.choice(UNITS)}",
            lambda: f"set an alarm for {_time(r)}",
            lambda: f"wake me up at {_time(r)}",
            lambda: f"call {r.choice(PEOPLE)}",
            lambda: f"call {r.choice(PEOPLE)} at {_time(r)}",
            lambda: f"play {r.choice(GENRES)} in the {r.choice(ROOMS)}",
            lambda: f"remind me to buy {r.choice(THINGS)} and {r.choice(THINGS)}",
            lambda: f"add {number_words(r.randint(1, 12))} {r.choice(THINGS)} to the shopping list",
            lambda: f"open the {r.choice(['door', 'window', 'garage', 'curtains'])} in the {r.choice(ROOMS)}",
            lambda: f"set the {r.choice(ROOMS)} to {number_words(r.randint(15, 28))} degrees",
            lambda: f"what is the weather in {r.choice(CITIES)} on {r.choice(DAYS)}",
            lambda: f"book a table for {number_words(r.randint(2, 9))} at {_time(r)}",
            lambda: f"send a message to {r.choice(PEOPLE)} saying i will be late",
        ])()

    def numbers(r):
        return r.choice([
            lambda: f"the number is {number_words(r.randint(0, 9999))}",
            lambda: f"{number_words(r.randint(2, 999))} {plural(r.choice(NOUNS))}",
            lambda: f"room {number_words(r.randint(1, 999))} on floor {number_words(r.randint(1, 30))}",
            lambda: " ".join(ONES[r.randint(0, 9)] for _ in range(r.randint(4, 7))),
            lambda: f"it costs {number_words(r.randint(1, 500))} pounds and {number_words(r.randint(1, 99))} pence",
            lambda: f"the train leaves at {_time(r)} from platform {number_words(r.randint(1, 12))}",
        ])()

    def dates(r):
        return r.choice([
            lambda: f"the meeting is on {_date(r)} at {_time(r)}",
            lambda: f"my birthday is on {_date(r)}",
            lambda: f"we fly to {r.choice(CITIES)} on {_date(r)}",
            lambda: f"today is {_date(r)}",
        ])()

    def weather(r):
        return r.choice([
            lambda: f"it will be {r.choice(WEATHER)} in {r.choice(CITIES)} on {r.choice(DAYS)}",
            lambda: f"tomorrow will be {r.choice(WEATHER)} and {r.choice(WEATHER)}",
            lambda: f"the temperature is {number_words(r.randint(0, 40))} degrees",
        ])()

    def describe(r):
        return r.choice([
            lambda: f"{_noun_phrase(r)} is {r.choice(PLACES)}",
            lambda: f"{_noun_phrase(r)} {r.choice(VERBS_PAST)} {r.choice(ADVERBS)} {r.choice(PLACES)}",
            lambda: f"i saw {_noun_phrase(r)} {r.choice(PLACES)}",
            lambda: f"there are {number_words(r.randint(2, 20))} {r.choice(COLORS)} {plural(r.choice(NOUNS))} "
                    f"{r.choice(PLACES)}",
            lambda: f"{_noun_phrase(r)} and {_noun_phrase(r)} {r.choice(VERBS_PAST)} {r.choice(ADVERBS)}",
        ])()

    return [command, numbers, dates, weather, describe], [3, 2, 1, 1, 3]


def sentence_key(text: str) -> int:
    """A stable 64-bit key of a sentence (blake2b), the same on every machine and Python."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def is_held_out(text: str, one_in: int = 16) -> bool:
    """True for about ``1 / one_in`` of all sentences: those may only appear in the test set."""
    return sentence_key(text) % one_in == 0


class SentenceGenerator:
    """An endless, seeded stream of sentences from one side of the held-out split.

    ``held_out=False`` (training) never yields a sentence with ``is_held_out(text)``;
    ``held_out=True`` (testing) yields only such sentences.
    """

    def __init__(self, seed: int, held_out: bool = False):
        self.random = random.Random(seed)
        self.held_out = held_out
        self.templates, self.weights = _templates()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        while True:
            template = self.random.choices(self.templates, self.weights)[0]
            text = " ".join(template(self.random).split())
            if is_held_out(text) == self.held_out:
                return text


def vocabulary() -> set[str]:
    """Every word the templates can produce (a sample of 200,000 sentences covers them all)."""
    gen = SentenceGenerator(0)
    words: set[str] = set()
    for _ in range(200_000):
        words.update(next(gen).split())
    return words
