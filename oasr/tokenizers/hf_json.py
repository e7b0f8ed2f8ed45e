"""``hf_json``: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library (nothing reimplemented).

Decoding follows the checkpoint's transformers processor exactly (a transducer's ids, not CTC frames):

* repeated ids are kept (each RNN-T emission is a token; nothing is merged);
* the pad id (``tokenizer_config.json``'s ``pad_token``) is dropped, then the special tokens (the blank among
  them) are skipped by the library's own ``decode``;
* no whitespace is stripped; ``clean_up_tokenization_spaces`` from ``tokenizer_config.json`` is applied as
  transformers does (never to a BPE model, whose spaces before punctuation are real).

The blank is ``processor_config.json``'s ``blank_token`` (default ``<blank>``), or ``blank_id=``.
"""

from __future__ import annotations

import json
from pathlib import Path

_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_name(value):
    return value.get("content") if isinstance(value, dict) else value


class HfJsonTokenizer:
    """Ids to text for one checkpoint; build with :meth:`from_checkpoint`."""

    def __init__(self, tokenizer, blank_id: int, pad_id: int | None = None, clean_up_spaces: bool = False):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if not 0 <= blank_id < self.vocab_size:
            raise ValueError(f"hf_json: blank id {blank_id} outside the vocabulary [0, {self.vocab_size})")
        self.blank_id = int(blank_id)
        self.pad_id = pad_id
        self.clean_up_spaces = bool(clean_up_spaces) and type(tokenizer.model).__name__ != "BPE"

    @classmethod
    def from_checkpoint(cls, directory, blank_id: int | None = None) -> HfJsonTokenizer:
        """Read ``DIR/tokenizer.json`` (and the configs beside it); one-line ``ValueError`` when unusable."""
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - a dependency
            raise ValueError("hf_json: the 'tokenizers' package is not installed (pip install tokenizers)") from None
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{d}: no tokenizer.json")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library's own parse errors
            raise ValueError(f"{path}: not a tokenizers file ({str(exc).splitlines()[0][:200]})") from None
        config = _read_json(d / "tokenizer_config.json")
        pad = _token_name(config.get("pad_token"))
        pad_id = tok.token_to_id(pad) if pad is not None else None
        if blank_id is None:
            blank = _read_json(d / "processor_config.json").get("blank_token", "<blank>")
            blank_id = tok.token_to_id(blank)
            if blank_id is None:
                raise ValueError(f"{path}: the blank token {blank!r} is not in the vocabulary")
        return cls(tok, blank_id, pad_id, config.get("clean_up_tokenization_spaces", False))

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (``None`` when it is not in the vocabulary)."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Text to token ids (no special tokens added): what a server reports as a transcript's tokens."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Token ids to text, as the checkpoint's processor decodes them (``ValueError`` for an id out of range)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"hf_json.decode: ids {bad[:5]} outside [0, {self.vocab_size})")
        if self.pad_id is not None:
            ids = [i for i in ids if i != self.pad_id]
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text
