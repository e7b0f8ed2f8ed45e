"""The fbank of many frames in one call: Kaldi's log-mel filterbank as a few array operations.

``oasr.features.fbank.OnlineFbank`` runs kaldi-native-fbank one stream at a time; its C++ frame loop
costs ~20 us per 10 ms frame here (a stream-chunk of 1.28 s: ~2.5 ms), which alone caps one CPU
thread at a few hundred live streams. ``fbank_frames(windows)`` computes the same features for every
frame of every stream ready in a tick at once: one gather of the windows, one real FFT over all of
them, one matrix product with the mel banks.

The arithmetic is Kaldi's, with ``oasr.features.fbank.FBANK``'s options (16 kHz, 25 ms windows every
10 ms, no dither, ``snip_edges``, 80 bins from 20 Hz to Nyquist), per frame of 400 samples scaled
to 16-bit values::

    remove the DC offset -> pre-emphasis 0.97 (first sample against itself) -> Povey window
    -> zero-pad to 512 -> |rfft|^2 (bins 0..255; Kaldi's mel banks never read the Nyquist bin)
    -> mel banks (triangles on 1127 ln(1 + f / 700)) -> log(max(energy, float32 epsilon))

Computed in float32, as kaldi-native-fbank computes, but in another order (another FFT), so the two
differ by rounding: ``tests/test_batched_fbank.py`` measures the largest difference on the
shipped clips (bounded there by ``FBANK_TOLERANCE``) and that the shipped model's transcripts are the
same with either front end. A frame's features do not depend on the other frames of the call beyond
float32 rounding (a few ulp: the BLAS and the FFT take other code paths for a few rows), as the
model's rows do not depend on the other rows of its cohort beyond that.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from oasr.features.fbank import FRAME_LENGTH, FRAME_SHIFT, NUM_MEL_BINS, SAMPLE_RATE, num_frames

PADDED = 512  # the FFT length: the window rounded up to a power of two
PREEMPHASIS = 0.97
LOW_FREQ = 20.0
# Largest |batched - kaldi-native-fbank| over the log-mel values (range about -15..25) of the shipped
# clips: 1.5e-2, in frames of near-silence, where float32 rounding is a large part of a tiny band
# energy (the same arithmetic in float64 differs from kaldi-native-fbank by 1.4e-3: kaldi's own
# float32 error); the median difference is 4e-6. The test asserts this bound on every shipped clip.
FBANK_TOLERANCE = 5e-2
_EPS = float(np.finfo(np.float32).eps)


def _mel(f):
    return 1127.0 * np.log(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def mel_banks() -> np.ndarray:
    """``(PADDED // 2, NUM_MEL_BINS)`` float64 weights: Kaldi's triangular mel filters over FFT bins 0..255."""
    low, high = _mel(LOW_FREQ), _mel(SAMPLE_RATE / 2)
    delta = (high - low) / (NUM_MEL_BINS + 1)
    mel = _mel(np.arange(PADDED // 2) * (SAMPLE_RATE / PADDED))[:, None]  # (256, 1)
    left = low + np.arange(NUM_MEL_BINS)[None, :] * delta
    center, right = left + delta, left + 2 * delta
    rising = (mel - left) / (center - left)
    falling = (right - mel) / (right - center)
    weights = np.where(mel <= center, rising, falling)
    return np.where((mel > left) & (mel < right), weights, 0.0)


def povey_window() -> np.ndarray:
    """Kaldi's default window over ``FRAME_LENGTH`` samples: a Hann window to the power 0.85."""
    i = np.arange(FRAME_LENGTH, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2 * math.pi * i / (FRAME_LENGTH - 1))) ** 0.85


_BANKS = torch.from_numpy(mel_banks()).float()
_WINDOW = torch.from_numpy(povey_window()).float()


def fbank_frames(windows) -> torch.Tensor:
    """``(n, 80)`` float32 log-mel features of ``n`` frames given as ``(n, FRAME_LENGTH)`` samples in [-1, 1]."""
    x = torch.as_tensor(np.asarray(windows, dtype=np.float32) * np.float32(32768.0))
    if x.dim() != 2 or x.shape[1] != FRAME_LENGTH:
        raise ValueError(f"fbank_frames: expected (n, {FRAME_LENGTH}) windows, got {tuple(x.shape)}")
    if not x.shape[0]:
        return torch.zeros(0, NUM_MEL_BINS)
    x = x - x.mean(1, keepdim=True)
    # pre-emphasis and window written straight into the zero-padded FFT input (the same float32 operations
    # as a cat, a product and a pad, without their temporaries; rfft(n=) is slower here)
    padded = torch.zeros(x.shape[0], PADDED)
    y = padded[:, :FRAME_LENGTH]
    torch.mul(x[:, :-1], PREEMPHASIS, out=y[:, 1:])
    torch.sub(x[:, 1:], y[:, 1:], out=y[:, 1:])
    torch.mul(x[:, :1], 1 - PREEMPHASIS, out=y[:, :1])
    y.mul_(_WINDOW)
    squares = torch.view_as_real(torch.fft.rfft(padded)).square()  # contiguous: re^2, im^2 interleaved
    power = squares[:, : PADDED // 2, 0] + squares[:, : PADDED // 2, 1]
    return (power @ _BANKS).clamp_(min=_EPS).log_()


def frame_windows(pcm: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` analysis windows of ``pcm`` as a ``(count, FRAME_LENGTH)`` read-only view."""
    if count and len(pcm) < FRAME_LENGTH + (count - 1) * FRAME_SHIFT:
        raise ValueError(f"frame_windows: {count} frames need {FRAME_LENGTH + (count - 1) * FRAME_SHIFT} samples, "
                         f"got {len(pcm)}")
    return np.lib.stride_tricks.as_strided(pcm, (count, FRAME_LENGTH), (FRAME_SHIFT * pcm.strides[0], pcm.strides[0]),
                                           writeable=False)


class PcmBuffer:
    """One stream's samples not yet turned into fbank frames: from the start of its next frame on.

    ``append`` copies a piece in (the only per-piece work); ``take_windows`` hands out the windows of
    the frames now complete and drops the samples no later frame reads. The storage grows by doubling
    and is compacted on each take, so a steady stream reuses one array.
    """

    def __init__(self, capacity: int = 8 * FRAME_LENGTH):
        self._data = np.empty(capacity, dtype=np.float32)
        self.size = 0

    @property
    def samples(self) -> np.ndarray:
        """The buffered samples (a view; valid until the next ``append`` or take)."""
        return self._data[: self.size]

    def append(self, x: np.ndarray) -> None:
        """Copy float32 samples ``x`` in after the buffered ones."""
        end = self.size + x.size
        if end > self._data.size:
            grown = np.empty(max(end, 2 * self._data.size), dtype=np.float32)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : end] = x
        self.size = end

    def frames_ready(self) -> int:
        """Whole frames the buffered samples make (``snip_edges``)."""
        return num_frames(self.size)

    def take_windows(self, count: int) -> np.ndarray:
        """A ``(count, FRAME_LENGTH)`` copy of the first ``count`` frames' windows; their shifts are dropped."""
        windows = frame_windows(self.samples, count).copy()
        drop = count * FRAME_SHIFT
        rest = self.size - drop
        self._data[:rest] = self._data[drop : self.size].copy()
        self.size = rest
        return windows
