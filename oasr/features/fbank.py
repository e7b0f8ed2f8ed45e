"""The acoustic front end: 80-dim Kaldi log-mel filterbanks, offline and chunk by chunk, and global CMVN.

Features are computed by ``kaldi-native-fbank`` (a C++ reimplementation of Kaldi's ``compute-fbank-feats``)
with the options in ``FBANK``: 16 kHz, 25 ms windows every 10 ms, 80 mel bins, no dither (so the
same audio always gives the same features), ``snip_edges`` (a frame is emitted only once its whole
window has arrived, which is what lets the online extractor equal the offline one).

``fbank(pcm)`` computes a whole utterance; ``OnlineFbank`` takes PCM in pieces of any size as they
arrive and hands out the frames that became complete. Fed the same samples, the two give identical
frames, bit for bit (``tests/test_asr_frontend.py``). ``GlobalCmvn`` normalizes every frame with the
mean and inverse standard deviation measured on the training set and stored with the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SAMPLE_RATE = 16000
NUM_MEL_BINS = 80
FRAME_SHIFT = 160  # samples (10 ms)
FRAME_LENGTH = 400  # samples (25 ms)


def _options():
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = SAMPLE_RATE
    opts.frame_opts.dither = 0.0
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = NUM_MEL_BINS
    return opts


def num_frames(num_samples: int) -> int:
    """Frames ``fbank`` makes from ``num_samples`` samples (``snip_edges``: whole windows only)."""
    return 0 if num_samples < FRAME_LENGTH else 1 + (num_samples - FRAME_LENGTH) // FRAME_SHIFT


def _as_pcm(pcm) -> np.ndarray:
    x = np.asarray(pcm, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"fbank: expected mono PCM, a 1-D array of samples, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("fbank: the audio holds NaN or infinite samples")
    return x


class OnlineFbank:
    """Chunk-wise fbank: ``accept(pcm)`` returns the ``(n, 80)`` float32 frames completed by these samples.

    ``pcm`` is float in [-1, 1] at 16 kHz (any length, possibly empty). ``finish()`` marks the end of
    the input and returns nothing new (``snip_edges``: a partial last window is dropped, as offline).

    Every frame depends only on the samples of its own window (no dither, no cross-frame state), so
    the extractor's whole state is ``tail``: the samples from the start of the next frame on (fewer
    than one window plus a shift). ``OnlineFbank.restore(tail)`` continues where it left off, frame
    for frame identical to never having stopped (what a suspended stream carries).
    """

    def __init__(self):
        import kaldi_native_fbank as knf

        self._fbank = knf.OnlineFbank(_options())
        self._taken = 0
        self.finished = False
        self.tail = np.zeros(0, dtype=np.float32)

    @classmethod
    def restore(cls, tail) -> OnlineFbank:
        """An extractor that goes on from ``tail`` (another one's ``tail``); no frame is due yet."""
        x = _as_pcm(tail)
        if x.size >= FRAME_LENGTH:
            raise ValueError(f"OnlineFbank.restore: a tail holds fewer than {FRAME_LENGTH} samples (a whole "
                             f"window would already have made a frame), got {x.size}")
        online = cls()
        online.accept(x)  # under one window: no frame comes out
        return online

    def accept(self, pcm) -> np.ndarray:
        """Take more PCM samples; returns the fbank frames now complete (``ValueError`` after ``finish``)."""
        if self.finished:
            raise ValueError("OnlineFbank.accept: the input was already finished")
        x = _as_pcm(pcm)
        if x.size:
            # Kaldi's fbank works on 16-bit sample values, as kaldi's wav reader gives them
            self._fbank.accept_waveform(SAMPLE_RATE, (x * 32768.0).tolist())
            self.tail = np.concatenate([self.tail, x])
        frames = self._take()
        self.tail = self.tail[len(frames) * FRAME_SHIFT :]
        return frames

    def finish(self) -> np.ndarray:
        """End the input; returns the last frames (calling it again returns none)."""
        if not self.finished:
            self._fbank.input_finished()
            self.finished = True
        frames = self._take()
        self.tail = np.zeros(0, dtype=np.float32)
        return frames

    def _take(self) -> np.ndarray:
        ready = self._fbank.num_frames_ready
        frames = [self._fbank.get_frame(i) for i in range(self._taken, ready)]
        self._taken = ready
        if not frames:
            return np.zeros((0, NUM_MEL_BINS), dtype=np.float32)
        return np.asarray(frames, dtype=np.float32)


def fbank(pcm) -> np.ndarray:
    """``(num_frames(len(pcm)), 80)`` float32 log-mel features of a whole utterance (16 kHz mono float PCM)."""
    online = OnlineFbank()
    head = online.accept(pcm)
    return np.concatenate([head, online.finish()])


@dataclass
class GlobalCmvn:
    """Per-dimension mean and inverse standard deviation: ``normalize(x) = (x - mean) * istd``."""

    mean: torch.Tensor
    istd: torch.Tensor

    @classmethod
    def from_stats(cls, total: np.ndarray, total_sq: np.ndarray, count: int) -> GlobalCmvn:
        """Mean and inverse standard deviation from per-dimension sums, sums of squares and a frame count."""
        mean = total / count
        var = np.maximum(total_sq / count - mean**2, 1e-8)
        return cls(torch.tensor(mean, dtype=torch.float32), torch.tensor(1.0 / np.sqrt(var), dtype=torch.float32))

    def normalize(self, feats) -> torch.Tensor:
        """``(feats - mean) * istd`` as float32."""
        x = torch.as_tensor(feats, dtype=torch.float32)
        return (x - self.mean) * self.istd
