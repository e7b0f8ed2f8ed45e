"""The recognizer's language model: the word bigram of the recipe's own training text, rebuilt on demand.

A model trained by ``python -m oasr train`` heard sentences of ``MixedSentenceGenerator`` (``oasr.asr.opentext``:
templates and open text, ``open_share`` of it open), each shard from its own seed. ``recipe_lm(LanguageSpec(...))``
counts ``sentences`` drawn from that generator under ``seed`` (so the same distribution as the training text,
and the training side of the held-out split: no sentence of a shipped test set is ever among them) into an
``oasr.ctc.words.WordLM`` whose lexicon is the shipped open vocabulary and names plus every word the text
used. The text is a pure function of the spec, so nothing is shipped: the model is rebuilt in a few
seconds and kept for the process (``lru_cache``).

A checkpoint names its spec in its metadata (``info["language_model"]``); ``Recognizer(language_model="auto")`` uses
it when present. ``spec_from_info`` reads and checks it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache


@dataclass(frozen=True)
class LanguageSpec:
    """Which training text the word model counts: the generator's seed and open share, and how many sentences."""

    seed: int = 2026
    open_share: float = 0.6
    sentences: int = 200_000

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"LanguageSpec: seed must be an int, got {self.seed!r}")
        if isinstance(self.open_share, bool) or not isinstance(self.open_share, (int, float)) \
                or not 0.0 <= self.open_share <= 1.0:
            raise ValueError(f"LanguageSpec: open_share must be in [0, 1], got {self.open_share!r}")
        if isinstance(self.sentences, bool) or not isinstance(self.sentences, int) \
                or not 1 <= self.sentences <= 10_000_000:
            raise ValueError(f"LanguageSpec: sentences must be an int in [1, 10000000], got {self.sentences!r}")

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
    return LanguageSpec(**fields)


@lru_cache(maxsize=2)
def recipe_lm(spec: LanguageSpec, alphabet: str):
    """The ``WordLM`` of ``spec``'s training text over ``alphabet`` (built once per process)."""
    from oasr.asr.opentext import MixedSentenceGenerator
    from oasr.asr.vocab import load_names, load_words
    from oasr.ctc.words import WordLM

    generator = MixedSentenceGenerator(spec.seed, spec.open_share)
    sentences = [next(generator) for _ in range(spec.sentences)]
    lexicon = set(load_words()) | set(load_names())
    for s in sentences:
        lexicon.update(s.split())
    letters = set(alphabet) - {" "}
    lexicon = {w for w in lexicon if w and set(w) <= letters}
    return WordLM.from_sentences(sentences, lexicon, alphabet)
