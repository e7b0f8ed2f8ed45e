"""The front-end registry and its contract: ``FeatureExtractor``, ``StreamingFraming``, ``register_extractor``,
``build_extractor``, ``list_extractors`` (the package docstring describes the kinds)."""


from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamingFraming:
    """Where frame ``t`` reads in the sample stream: samples ``[t*hop - prefill, t*hop - prefill + span)``.

    ``prefill`` is the count of zeros a centred extractor puts before the first sample (0 for Kaldi's
    ``snip_edges``); ``span`` the samples one frame reads; ``hop`` the shift. Frame ``t`` of a stream is
    therefore due once ``t*hop - prefill + span`` samples have arrived.
    """

    span: int
    hop: int
    prefill: int = 0

    def __post_init__(self):
        if self.span <= 0 or self.hop <= 0 or self.prefill < 0:
            raise ValueError(f"StreamingFraming: span and hop must be > 0 and prefill >= 0, got {self}")

    def frames_due(self, num_samples: int) -> int:
        """Frames computable from the first ``num_samples`` samples (before the end of the stream)."""
        reach = num_samples + self.prefill - self.span
        return 0 if reach < 0 else reach // self.hop + 1


class FeatureExtractor:
    """Base of every front end: ``kind``, ``num_bins``, ``sample_rate``, ``framing`` and the two entry points."""

    kind = ""
    num_bins: int
    sample_rate: int
    framing: StreamingFraming | None = None

    @property
    def supports_streaming(self) -> bool:
        """Whether :meth:`online` can consume audio piece by piece (derived from ``framing``)."""
        return self.framing is not None

    def online(self):
        """A fresh per-stream extractor: ``accept(pcm) -> (n, bins)``, ``finish() -> (m, bins)``."""
        raise NotImplementedError

    def extract(self, pcm) -> np.ndarray:
        """``(frames, bins)`` float32 features of a whole utterance: the online extractor fed at once."""
        stream = self.online()
        return np.concatenate([stream.accept(pcm), stream.finish()])


_REGISTRY: dict[str, type] = {}


def register_extractor(cls):
    """Class decorator: register a :class:`FeatureExtractor` subclass under its ``kind``."""
    if not cls.kind:
        raise ValueError(f"register_extractor: {cls.__name__} has no kind")
    if cls.kind in _REGISTRY and _REGISTRY[cls.kind] is not cls:
        raise ValueError(f"register_extractor: kind {cls.kind!r} is already taken by {_REGISTRY[cls.kind].__name__}")
    _REGISTRY[cls.kind] = cls
    return cls


def list_extractors() -> list[str]:
    """The registered front-end kinds."""
    return sorted(_REGISTRY)


def build_extractor(kind: str, **options) -> FeatureExtractor:
    """An extractor of ``kind`` built with ``options`` (``ValueError`` naming the known kinds otherwise)."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown feature front end {kind!r}; known: {', '.join(list_extractors())}")
    return _REGISTRY[kind](**options)
