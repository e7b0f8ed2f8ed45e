"""``kaldi_fbank``: the shipped model's front end (``oasr.features.fbank``) behind the registry's interface."""

from __future__ import annotations

from oasr.features import fbank as _fbank
from oasr.features.registry import FeatureExtractor, StreamingFraming, register_extractor


@register_extractor
class KaldiFbank(FeatureExtractor):
    """80-bin Kaldi log-mel fbank, 25 ms windows every 10 ms, ``snip_edges`` (no options: the shipped recipe)."""

    kind = "kaldi_fbank"
    num_bins = _fbank.NUM_MEL_BINS
    sample_rate = _fbank.SAMPLE_RATE
    framing = StreamingFraming(span=_fbank.FRAME_LENGTH, hop=_fbank.FRAME_SHIFT, prefill=0)

    def online(self) -> _fbank.OnlineFbank:
        """A fresh ``OnlineFbank`` (``accept`` / ``finish``)."""
        return _fbank.OnlineFbank()

    def extract(self, pcm):
        """``fbank(pcm)``: the whole utterance's frames."""
        return _fbank.fbank(pcm)
