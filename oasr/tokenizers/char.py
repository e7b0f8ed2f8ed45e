"""Characters in, token ids out: the tokenizer stored with the speech model.

Ids: ``0`` is the CTC blank, then the symbols of the alphabet in order (``" "`` is the word
separator), and the last id is the attention decoder's start/end symbol (``sos == eos``).
``encode`` refuses text outside the alphabet (after lower-casing and collapsing whitespace), so a
transcript is never silently changed; ``normalize`` is the same mapping a reference transcript
goes through before scoring.
"""

from __future__ import annotations

import re

BLANK = "<blank>"
SOS_EOS = "<sos/eos>"
ALPHABET = " '" + "abcdefghijklmnopqrstuvwxyz"


def normalize(text: str) -> str:
    """Lower case, whitespace collapsed to single spaces, trimmed."""
    return " ".join(text.lower().split())


class CharTokenizer:
    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"CharTokenizer: the alphabet must be distinct characters, got {alphabet!r}")
        self.alphabet = alphabet
        self.symbols = [BLANK, *alphabet, SOS_EOS]
        self._ids = {c: i + 1 for i, c in enumerate(alphabet)}
        self._text = ["", *alphabet, ""]

    @property
    def vocab_size(self) -> int:
        """Symbols in the vocabulary, blank and sos/eos included."""
        return len(self.symbols)

    @property
    def blank_id(self) -> int:
        """The CTC blank's id (0)."""
        return 0

    @property
    def sos_eos_id(self) -> int:
        """The decoder's start/end-of-sequence id (the last symbol)."""
        return len(self.symbols) - 1

    def encode(self, text: str) -> list[int]:
        """Token ids of the normalized ``text`` (``ValueError`` naming characters outside the alphabet)."""
        text = normalize(text)
        bad = sorted(set(text) - set(self._ids))
        if bad:
            raise ValueError(f"CharTokenizer.encode: characters outside the alphabet {self.alphabet!r}: {bad}")
        return [self._ids[c] for c in text]

    def word_index(self, ids) -> list:
        """Per token of ``ids``, the index of its word in ``decode(ids).split()``, None for a blank, sos/eos or
        space token (the rule of ``oasr.asr.words.word_times``, in one pass): decoding only joins the characters
        and trims spaces, so a prefix's words are its runs of non-space characters. ``ValueError`` as ``decode``."""
        out, k, in_word = [], -1, False
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.symbols):
                raise ValueError(f"CharTokenizer.decode: id {i} outside [0, {len(self.symbols)})")
            if not 0 < i < self.sos_eos_id:
                out.append(None)
            elif self.alphabet[i - 1].isspace():
                in_word = False
                out.append(None)
            else:
                k += not in_word
                in_word = True
                out.append(k)
        return out

    def decode(self, ids) -> str:
        """Token ids (blank and sos/eos are skipped) to text, whitespace normalized."""
        ids = list(map(int, ids))
        n = len(self.symbols)
        if ids and (min(ids) < 0 or max(ids) >= n):
            bad = next(i for i in ids if not 0 <= i < n)
            raise ValueError(f"CharTokenizer.decode: id {bad} outside [0, {n})")
        table = self._text  # id -> its text: "" for blank and sos/eos
        return re.sub(" +", " ", "".join(map(table.__getitem__, ids))).strip()
