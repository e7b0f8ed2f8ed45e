"""Reading audio for recognition: WAV/FLAC/OGG through ``soundfile``, resampled to 16 kHz by ``soxr``.

``load_audio(path)`` returns mono float32 PCM in [-1, 1] at ``SAMPLE_RATE``. Every refusal is one
``AudioError`` (a ``ValueError``) that says what was expected and what came:

* a file soundfile cannot decode (not audio, truncated, unknown container);
* an empty file, or one with no samples;
* more than one channel (a recognizer hears one speaker stream; mix down first, say how you want it);
* NaN or infinite samples (possible in float WAV files);
* a sample rate outside ``[MIN_RATE, MAX_RATE]``. Any rate inside it is resampled with soxr's
  high-quality filter; 16 kHz passes through untouched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from oasr.asr.features import SAMPLE_RATE

MIN_RATE, MAX_RATE = 8000, 192000


class AudioError(ValueError):
    """The input is not audio this recognizer can hear."""


def check_pcm(pcm, sample_rate: int, what: str = "audio") -> np.ndarray:
    """Validate and resample PCM already in memory: ``(N,)`` or ``(N, 1)`` float/int samples."""
    x = np.asarray(pcm)
    if x.ndim == 2 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 1:
        channels = x.shape[1] if x.ndim == 2 else "?"
        raise AudioError(f"{what}: expected mono audio, got {channels} channels (shape {x.shape})")
    if x.dtype.kind in "iu":
        x = x.astype(np.float32) / float(np.iinfo(x.dtype).max + 1)
    elif x.dtype.kind != "f":
        raise AudioError(f"{what}: expected float or integer samples, got dtype {x.dtype}")
    x = x.astype(np.float32, copy=False)
    if x.size == 0:
        raise AudioError(f"{what}: no samples")
    if not np.isfinite(x).all():
        raise AudioError(f"{what}: {int((~np.isfinite(x)).sum())} samples are NaN or infinite")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise AudioError(f"{what}: the sample rate must be an int, got {sample_rate!r}")
    if not MIN_RATE <= sample_rate <= MAX_RATE:
        raise AudioError(f"{what}: sample rate {sample_rate} Hz is outside [{MIN_RATE}, {MAX_RATE}] Hz")
    if sample_rate != SAMPLE_RATE:
        import soxr

        x = soxr.resample(x, int(sample_rate), SAMPLE_RATE, quality="HQ").astype(np.float32)
    return x


def load_audio(path) -> np.ndarray:
    """Mono float32 PCM at 16 kHz from an audio file (``AudioError`` for anything else)."""
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        raise AudioError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise AudioError(f"{path}: the file is empty")
    try:
        pcm, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises LibsndfileError / RuntimeError / TypeError by format
        raise AudioError(f"{path}: not a readable audio file ({str(exc).strip() or type(exc).__name__})") from None
    if pcm.shape[1] != 1:
        raise AudioError(f"{path}: expected mono audio, got {pcm.shape[1]} channels")
    return check_pcm(pcm[:, 0], rate, str(path))
