"""Tokenizers as a registry: a kind name to the class that turns token ids into text.

Every tokenizer has ``vocab_size``, ``blank_id`` and ``decode(ids) -> str``. Kinds registered here:

| kind | what |
|---|---|
| ``char`` | the shipped model's character tokenizer (``oasr.tokenizers.char.CharTokenizer``) |
| ``hf_json`` | a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library, decoded as transformers does |

``build_tokenizer(kind, ...)`` builds one; an unknown kind is refused naming the known ones.
"""

from __future__ import annotations

_REGISTRY: dict[str, object] = {}


def register_tokenizer(kind: str, factory) -> None:
    """Register ``factory(*args, **kwargs) -> tokenizer`` under ``kind``."""
    if kind in _REGISTRY and _REGISTRY[kind] is not factory:
        raise ValueError(f"register_tokenizer: kind {kind!r} is already registered")
    _REGISTRY[kind] = factory


def list_tokenizers() -> list[str]:
    """The registered tokenizer kinds."""
    return sorted(_REGISTRY)


def build_tokenizer(kind: str, *args, **kwargs):
    """A tokenizer of ``kind`` (``ValueError`` naming the known kinds otherwise)."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown tokenizer kind {kind!r}; known: {', '.join(list_tokenizers())}")
    return _REGISTRY[kind](*args, **kwargs)


def _char(*args, **kwargs):
    from oasr.tokenizers.char import CharTokenizer

    return CharTokenizer(*args, **kwargs)


def _hf_json(directory, **kwargs):
    from oasr.tokenizers.hf_json import HfJsonTokenizer

    return HfJsonTokenizer.from_checkpoint(directory, **kwargs)


register_tokenizer("char", _char)
register_tokenizer("hf_json", _hf_json)

__all__ = ["build_tokenizer", "list_tokenizers", "register_tokenizer"]
