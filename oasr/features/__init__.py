"""The feature front ends as a registry: a kind name to the class that builds an extractor.

A front end turns 16 kHz mono float PCM into ``(frames, bins)`` float32 features, whole (``extract``) or
chunk by chunk (``online()``: an object with ``accept(pcm) -> new frames`` and ``finish() -> last
frames``). Fed the same samples in any pieces, the online extractor gives the whole-utterance frames.

Each extractor declares its streaming frame grid as :class:`StreamingFraming`; ``supports_streaming`` is
derived from it (a front end with no framing, e.g. one that normalises over the whole utterance, cannot
consume a growing buffer and says so), so streamability cannot disagree with the arithmetic.

Kinds registered here:

| kind | what | configured from |
|---|---|---|
| ``kaldi_fbank`` | the shipped model's 80-bin Kaldi fbank (``oasr.features.fbank``, wrapped) | fixed options |
| ``nemo_mel`` | NeMo-style log-mel (pre-emphasis, centred STFT, slaney mel, log | a checkpoint's |
|  | guard, no normalisation) | feature-extractor file |

``build_extractor(kind, **options)`` builds one; an unknown kind is refused naming the known ones.
"""

from oasr.features.kaldi import KaldiFbank  # registers itself
from oasr.features.nemo_mel import NemoMel, NemoMelConfig  # registers itself
from oasr.features.registry import (
    FeatureExtractor,
    StreamingFraming,
    build_extractor,
    list_extractors,
    register_extractor,
)

__all__ = ["FeatureExtractor", "KaldiFbank", "NemoMel", "NemoMelConfig", "StreamingFraming", "build_extractor",
           "list_extractors", "register_extractor"]
