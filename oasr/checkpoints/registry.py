"""The checkpoint-format registry: a converter per on-disk format, picked by detection.

A converter (subclass ``CheckpointConverter``) declares the ``architecture`` it builds and its
``source_format``, and implements three methods::

    detect(ckpt_dir) -> bool                   cheap: reads config.json / a header, never the weights
    build_config(ckpt_dir) -> config           the architecture's config from the directory
    load_state_dict(ckpt_dir, config) -> (state_dict, extra)
                                               the model's tensors by its parameter names, checked
                                               strictly: missing and unexpected tensors named

``build_model(config, **options)`` makes the (weightless) module; the base ``convert`` runs the
chain and returns a ``Pretrained``. ``from_pretrained(DIR)`` tries every registered converter's
``detect``: exactly one must claim the directory (none: one line naming the known formats).
Nothing is fetched: ``DIR`` is a local directory. Register with ``@register_converter``; the
built-in converters are imported on first use (``BUILTIN``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

#: Modules whose import registers the built-in converters.
BUILTIN = ("oasr.asr.native_format", "oasr.models.nemotron.converter")

_CONVERTERS: dict[str, type] = {}


@dataclass
class Pretrained:
    """What ``from_pretrained`` returns: the model with its weights, and where it came from."""

    model: nn.Module
    config: object
    source_format: str
    architecture: str
    path: Path
    extra: dict = field(default_factory=dict)  # what the format holds besides the model (a decoder, more tensors)


class CheckpointConverter:
    """Base of a format's converter (see the module docstring)."""

    source_format: str = ""
    architecture: str = ""

    def detect(self, ckpt_dir: Path) -> bool:
        """Does this format claim ``ckpt_dir``? Cheap: a config or a header, never the weights."""
        raise NotImplementedError

    def build_config(self, ckpt_dir: Path):
        """The architecture's config from the directory (``ValueError`` naming what cannot be built)."""
        raise NotImplementedError

    def build_model(self, config, **options) -> nn.Module:
        """The module for ``config``, weights not loaded yet; ``options`` are serving choices."""
        raise NotImplementedError

    def load_state_dict(self, ckpt_dir: Path, config, model: nn.Module) -> tuple:
        """``(state_dict by the model's names, extra)``, checked strictly against ``model`` (``check_tensors``)."""
        raise NotImplementedError

    def convert(self, ckpt_dir: Path, dtype: torch.dtype | None = None, **options) -> Pretrained:
        """build_config, build_model, load_state_dict, then the weights in (strict) and ``dtype``: a ``Pretrained``."""
        config = self.build_config(ckpt_dir)
        model = self.build_model(config, **options)
        state_dict, extra = self.load_state_dict(ckpt_dir, config, model)
        model.load_state_dict(state_dict, strict=True)
        if dtype is not None:
            model.to(dtype)
        model.eval()
        return Pretrained(model, config, self.source_format, self.architecture, Path(ckpt_dir), extra)


def check_tensors(where, expected: dict, tensors: dict) -> None:
    """``ValueError`` naming every missing and unexpected tensor and every shape mismatch
    (``expected``: name -> tensor of the model's ``state_dict``)."""
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: tensors do not match the model: missing {missing}, unexpected {unexpected}")
    wrong = [f"{n} {tuple(tensors[n].shape)} (model {tuple(ref.shape)})" for n, ref in expected.items()
             if tuple(tensors[n].shape) != tuple(ref.shape)]
    if wrong:
        raise ValueError(f"{where}: tensors of the wrong shape: {'; '.join(wrong)}")


def register_converter(cls: type) -> type:
    """Class decorator: register a ``CheckpointConverter`` under its ``source_format`` (unique)."""
    name = getattr(cls, "source_format", "")
    if not name:
        raise ValueError(f"register_converter: {cls.__name__} declares no source_format")
    if name in _CONVERTERS and _CONVERTERS[name] is not cls:
        raise ValueError(f"register_converter: format {name!r} is already registered by {_CONVERTERS[name].__name__}")
    _CONVERTERS[name] = cls
    return cls


def converters() -> dict:
    """``source_format -> converter class``, built-ins included."""
    for module in BUILTIN:
        importlib.import_module(module)
    return dict(_CONVERTERS)


def detect_format(ckpt_dir) -> str:
    """The one registered format claiming ``ckpt_dir`` (``ValueError`` for none or several)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise ValueError(f"from_pretrained: {d} is not a directory (nothing is downloaded: pass a local checkpoint "
                         f"directory)")
    known = converters()
    claims = [name for name, cls in known.items() if cls().detect(d)]
    if not claims:
        raise ValueError(f"from_pretrained: {d} is no checkpoint format oasr knows (known: {', '.join(sorted(known))})")
    if len(claims) > 1:
        raise ValueError(f"from_pretrained: {d} is claimed by several formats: {claims}")
    return claims[0]


def from_pretrained(ckpt_dir, source_format: str | None = None, dtype: torch.dtype | None = None,
                    **options) -> Pretrained:
    """Load a local checkpoint directory with the converter that detects it (or ``source_format``).

    ``options`` go to the converter's ``build_model`` (e.g. ``lookahead`` for Nemotron); ``dtype``
    casts the loaded model (e.g. ``torch.bfloat16``)."""
    known = converters()
    if source_format is None:
        source_format = detect_format(ckpt_dir)
    elif source_format not in known:
        raise ValueError(f"from_pretrained: unknown format {source_format!r} (known: {', '.join(sorted(known))})")
    return known[source_format]().convert(Path(ckpt_dir), dtype=dtype, **options)
