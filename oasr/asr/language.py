"""The recognizer's language model: a word bigram of the recipe's training text and English examples, rebuilt on demand.

A model trained by ``python -m oasr train`` heard sentences of ``MixedSentenceGenerator`` (``oasr.asr.opentext``:
templates and open text, ``open_share`` of it open), each shard from its own seed. ``recipe_lm(LanguageSpec(...))``
counts ``sentences`` drawn from that generator under ``seed`` (so the same distribution as the training text,
and the training side of the held-out split: no sentence of a shipped test set is ever among them) into an
``oasr.ctc.words.WordLM`` whose lexicon is the shipped open vocabulary and names plus every word the text
used. That text is a pure function of the spec, so none of it is shipped: the model is rebuilt in a few
seconds and kept for the process (``lru_cache``).

**English sentences.** The generator's open text is built to teach the acoustic model every word (its
word sequences and free shapes draw each slot independently), so it teaches a language model nothing
about which word follows which: after ``a`` any of 60,000 words is about as likely. ``english_repeat``
adds the usage examples of WordNet 3.0 (``english.txt.gz`` under ``oasr/assets/lm``: 47,512 everyday
sentences such as "hold your breath" or "inhale the fresh mountain air", extracted once by
``build_english_text`` from Debian's ``wordnet-base``; WordNet's license is shipped beside it), each counted
``english_repeat`` times; a sentence with a word outside the lexicon is left out (the lexicon stays the
recipe's). ``english_repeat=0`` is the generator's text alone (a checkpoint that does not name the field
means that). The examples the recipe holds out (``oasr.asr.text.is_held_out``: one in 16, what the voice dev
shard speaks) are left out too, so that shard scores the word search on sentences its model never counted;
``held_out_english=True`` counts them as well, which is what a checkpoint that does not name the field was
built with.

A checkpoint names its spec in its metadata (``info["language_model"]``); ``Recognizer(language_model="auto")`` uses
it when present. ``spec_from_info`` reads and checks it.
"""

from __future__ import annotations

import gzip
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

WORDNET_DIR = "/usr/share/wordnet"  # Debian's wordnet-base


@dataclass(frozen=True)
class LanguageSpec:
    """Which text the word model counts: the generator's seed and open share, how many of its sentences, how
    many times the shipped English sentences (module docstring; 0: none), and whether their held-out ones too."""

    seed: int = 2026
    open_share: float = 0.6
    sentences: int = 200_000
    english_repeat: int = 10
    held_out_english: bool = False

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"LanguageSpec: seed must be an int, got {self.seed!r}")
        if isinstance(self.open_share, bool) or not isinstance(self.open_share, (int, float)) \
                or not 0.0 <= self.open_share <= 1.0:
            raise ValueError(f"LanguageSpec: open_share must be in [0, 1], got {self.open_share!r}")
        if isinstance(self.sentences, bool) or not isinstance(self.sentences, int) \
                or not 1 <= self.sentences <= 10_000_000:
            raise ValueError(f"LanguageSpec: sentences must be an int in [1, 10000000], got {self.sentences!r}")
        if isinstance(self.english_repeat, bool) or not isinstance(self.english_repeat, int) \
                or not 0 <= self.english_repeat <= 1000:
            raise ValueError(f"LanguageSpec: english_repeat must be an int in [0, 1000], got {self.english_repeat!r}")
        if not isinstance(self.held_out_english, bool):
            raise ValueError(f"LanguageSpec: held_out_english must be a bool, got {self.held_out_english!r}")

    def to_info(self) -> dict:
        """The spec as checkpoint metadata."""
        return {"kind": "recipe_text_bigram", **asdict(self)}


def spec_from_info(info) -> LanguageSpec | None:
    """The spec a checkpoint's metadata names (None if it names none); ``ValueError`` for a malformed one."""
    entry = (info or {}).get("language_model")
    if entry is None:
        return None
    if not isinstance(entry, dict) or entry.get("kind") != "recipe_text_bigram":
        raise ValueError(f"checkpoint: language_model must be a dict of kind 'recipe_text_bigram', got {entry!r}")
    fields = {k: entry[k] for k in ("seed", "open_share", "sentences") if k in entry}
    return LanguageSpec(**fields, english_repeat=entry.get("english_repeat", 0),  # absent: written before them
                        held_out_english=entry.get("held_out_english", True))


@lru_cache(maxsize=2)
def recipe_lm(spec: LanguageSpec, alphabet: str):
    """The ``WordLM`` of ``spec``'s training text over ``alphabet`` (built once per process)."""
    from oasr.asr.opentext import MixedSentenceGenerator
    from oasr.asr.text import is_held_out
    from oasr.asr.vocab import load_names, load_words
    from oasr.ctc.words import WordLM

    generator = MixedSentenceGenerator(spec.seed, spec.open_share)
    sentences = [next(generator) for _ in range(spec.sentences)]
    lexicon = set(load_words()) | set(load_names())
    for s in sentences:
        lexicon.update(s.split())
    letters = set(alphabet) - {" "}
    lexicon = {w for w in lexicon if w and set(w) <= letters}
    if spec.english_repeat:
        sentences += [(t, spec.english_repeat) for t in load_english()
                      if all(w in lexicon for w in t.split()) and (spec.held_out_english or not is_held_out(t))]
    return WordLM.from_sentences(sentences, lexicon, alphabet)


def shipped_english_path() -> Path:
    """The shipped English sentences (``build_english_text`` wrote them)."""
    return Path(str(resources.files("oasr") / "assets" / "lm" / "english.txt.gz"))


@lru_cache(maxsize=1)
def load_english() -> tuple[str, ...]:
    """The shipped English sentences, one string each (lower-case words of ``a-z`` and ``'``)."""
    path = shipped_english_path()
    if not path.exists():
        raise FileNotFoundError(f"the shipped English sentences {path} are missing "
                                "(python -m oasr.asr.language rebuilds them from Debian's wordnet-base)")
    return tuple(line for line in gzip.decompress(path.read_bytes()).decode().split("\n") if line)


def normalize_sentence(text: str) -> str | None:
    """One example as the tokenizer's text (lower-case words of ``a-z`` and inner apostrophes, single spaces), or
    None for one that cannot be read aloud as written (digits, symbols) or has fewer than 2 or more than 30
    words."""
    text = text.lower().replace("\u2019", "'")
    if re.search(r"[0-9@#$%&*_=+<>/\\|\[\]{}]", text):
        return None
    text = re.sub(r"[^a-z' ]+", " ", text)
    words = [w.strip("'") for w in text.split()]
    words = [w for w in words if w]
    return " ".join(words) if 2 <= len(words) <= 30 else None


def build_english_text(wordnet_dir=WORDNET_DIR, out_path=None) -> int:
    """Extract WordNet's usage examples (the quoted parts of the glosses in ``data.{noun,verb,adj,adv}``) into
    ``out_path`` (default: the shipped file), normalized (``normalize_sentence``), unique, in file order; run
    once by a maintainer (Debian: ``apt-get install wordnet-base``). Returns the number of sentences."""
    out_path = Path(out_path) if out_path is not None else shipped_english_path()
    seen: dict = {}
    for part in ("noun", "verb", "adj", "adv"):
        for line in (Path(wordnet_dir) / f"data.{part}").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:  # the license header's lines start with two spaces
                continue
            for example in re.findall(r'"([^"]+)"', line.split("|", 1)[1]):
                sentence = normalize_sentence(example)
                if sentence is not None:
                    seen.setdefault(sentence, None)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(gzip.compress(("\n".join(seen) + "\n").encode(), mtime=0))
    return len(seen)


if __name__ == "__main__":
    print(build_english_text())
