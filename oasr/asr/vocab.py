"""The open training vocabulary: a filtered Debian word list shipped inside the package.

``build_vocabulary(dict_path, out_dir)`` (run once by a maintainer, needs ``wamerican`` and ``espeak-ng``)
reads ``/usr/share/dict/american-english`` and keeps

* **words**: plain lower-case entries of 3-10 letters ``a-z`` (no possessives, accents or capitals);
* **names**: capitalized entries of 3-9 letters (first names, surnames, places), lower-cased;

then drops what espeak-ng does not speak as a word: entries it spells letter by letter (``nth`` comes out
as "en tee aitch": as many stress marks as letters) and entries without a vowel letter. The result is
written as ``words.txt.gz`` and ``names.txt.gz`` (one entry a line, sorted) under ``oasr/assets/vocab``;
``load_words()`` / ``load_names()`` read the shipped copies, so neither the recipe nor the tests need
the word list. Every entry is in the character tokenizer's alphabet (``oasr.tokenizers.char.ALPHABET``).
"""

from __future__ import annotations

import gzip
import re
import subprocess
from functools import lru_cache
from importlib import resources
from pathlib import Path

DICT_PATH = "/usr/share/dict/american-english"
_WORD = re.compile(r"^[a-z]{3,10}$")
_NAME = re.compile(r"^[A-Z][a-z]{2,8}$")


def shipped_vocab_dir() -> Path:
    """The directory of the shipped vocabulary files."""
    return Path(str(resources.files("oasr") / "assets" / "vocab"))


def spelled_out(word: str, phonemes: str) -> bool:
    """Whether espeak-ng's phonemes (``espeak-ng -x``) spell ``word`` letter by letter instead of reading it."""
    marks = phonemes.count("'") + phonemes.count(",")
    return not re.search("[aeiouy]", word) or (marks >= 2 and 2 * marks > len(word))


def espeak_phonemes(words: list[str], batch: int = 2000) -> list[str]:
    """espeak-ng's phoneme string of each word (one process per ``batch`` words)."""
    out: list[str] = []
    for i in range(0, len(words), batch):
        chunk = words[i : i + batch]
        res = subprocess.run(["espeak-ng", "-q", "-x"], input="\n".join(f"{w}," for w in chunk),
                             capture_output=True, text=True, check=True)
        lines = [line.strip() for line in res.stdout.splitlines() if line.strip()]
        if len(lines) != len(chunk):  # fall back to one call per word for this batch
            lines = [subprocess.run(["espeak-ng", "-q", "-x", w], capture_output=True, text=True,
                                    check=True).stdout.strip() for w in chunk]
        out.extend(lines)
    return out


def build_vocabulary(dict_path=DICT_PATH, out_dir=None) -> dict[str, int]:
    """Filter the word list at ``dict_path`` into ``out_dir`` (default: the shipped directory); entry counts."""
    out_dir = Path(out_dir) if out_dir is not None else shipped_vocab_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = Path(dict_path).read_text(encoding="utf-8", errors="replace").split()
    words = sorted({w for w in entries if _WORD.match(w)})
    names = sorted({w.lower() for w in entries if _NAME.match(w)} - set(words))
    counts = {}
    for kind, items in (("words", words), ("names", names)):
        kept = [w for w, p in zip(items, espeak_phonemes(items), strict=True) if not spelled_out(w, p)]
        (out_dir / f"{kind}.txt.gz").write_bytes(gzip.compress(("\n".join(kept) + "\n").encode(), mtime=0))
        counts[kind] = len(kept)
    return counts


def _load(kind: str) -> tuple[str, ...]:
    path = shipped_vocab_dir() / f"{kind}.txt.gz"
    if not path.exists():
        raise FileNotFoundError(f"the shipped vocabulary {path} is missing (python -m oasr.asr.vocab rebuilds it)")
    return tuple(gzip.decompress(path.read_bytes()).decode().split())


@lru_cache(maxsize=1)
def load_words() -> tuple[str, ...]:
    """The shipped open vocabulary (lower-case words), sorted."""
    return _load("words")


@lru_cache(maxsize=1)
def load_names() -> tuple[str, ...]:
    """The shipped names (lower-cased), sorted."""
    return _load("names")


if __name__ == "__main__":
    print(build_vocabulary())
