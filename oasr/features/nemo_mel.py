"""``nemo_mel``: the NeMo-style log-mel of a Nemotron streaming checkpoint, configured from its own file.

Per utterance (what the checkpoint's feature extractor computes):

1. pre-emphasis ``y[n] = x[n] - a * x[n-1]`` (``y[0] = x[0]``);
2. a centred STFT: ``n_fft // 2`` zeros on each side, frames of ``n_fft`` samples every ``hop`` samples,
   a symmetric Hann window of ``win_length`` centred in the ``n_fft`` span (rounded to the checkpoint's
   ``mel_filters_dtype`` first);
3. the power spectrum through a slaney-scale, slaney-normalised mel filter bank (0 Hz to Nyquist);
4. ``log(mel + 2**-24)`` (NeMo's log guard); no normalisation of any kind;
5. ``(L + 2*(n_fft//2) - n_fft) // hop`` frames are kept for ``L`` samples (the last centred STFT frame,
   which reaches past the audio by more than it covers, is dropped, as the checkpoint's extractor does).

Streaming (:class:`OnlineNemoMel`): frame ``t`` reads the pre-emphasised, front-padded samples
``[t*hop, t*hop + n_fft)``; it is emitted as soon as they have all arrived, and the end of the stream
appends the ``n_fft // 2`` zeros and emits the frames still due. The pre-emphasis carries the last sample
across pieces. Fed the same audio in any pieces, the frames equal the whole-utterance ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oasr.features.registry import FeatureExtractor, StreamingFraming, register_extractor

LOG_GUARD = 2.0**-24
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FILE_KEYS = ("feature_size", "sampling_rate", "hop_length", "n_fft", "win_length", "preemphasis")


def _hz_to_mel_slaney(hz: np.ndarray) -> np.ndarray:
    # linear below 1 kHz (3 / 200 mel per Hz), logarithmic above (27 steps per factor 6.4)
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz * 3.0 / 200.0
    log_region = hz >= 1000.0
    mel[log_region] = 15.0 + np.log(hz[log_region] / 1000.0) * 27.0 / np.log(6.4)
    return mel


def _mel_to_hz_slaney(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = mel * 200.0 / 3.0
    log_region = mel >= 15.0
    hz[log_region] = 1000.0 * np.exp((mel[log_region] - 15.0) * np.log(6.4) / 27.0)
    return hz


def slaney_mel_filters(num_bins: int, n_fft: int, sample_rate: int) -> np.ndarray:
    """``(num_bins, n_fft // 2 + 1)`` float32 triangular filters, equal area (slaney norm), 0 Hz to Nyquist."""
    fft_hz = np.linspace(0.0, sample_rate // 2, n_fft // 2 + 1)
    edges = _mel_to_hz_slaney(np.linspace(0.0, _hz_to_mel_slaney(np.array([sample_rate / 2.0]))[0], num_bins + 2))
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (fft_hz[None] - lo) / (mid - lo)
    falling = (hi - fft_hz[None]) / (hi - mid)
    tri = np.maximum(0.0, np.minimum(rising, falling))
    return (tri * (2.0 / (hi - lo))).astype(np.float32)


@dataclass(frozen=True)
class NemoMelConfig:
    """The numbers of the front end; :meth:`from_checkpoint` reads them from the checkpoint's own file."""

    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 512
    win_length: int = 400
    preemphasis: float = 0.97
    mel_filters_dtype: str = "float32"

    def __post_init__(self):
        if self.mel_filters_dtype not in _DTYPES:
            raise ValueError(f"nemo_mel: mel_filters_dtype must be one of {sorted(_DTYPES)}, "
                             f"got {self.mel_filters_dtype!r}")
        if not 0 < self.win_length <= self.n_fft or self.hop_length <= 0 or self.feature_size <= 0:
            raise ValueError(f"nemo_mel: need 0 < win_length <= n_fft, hop_length > 0, feature_size > 0; got {self}")

    @classmethod
    def from_checkpoint(cls, directory) -> NemoMelConfig:
        """Read ``preprocessor_config.json`` or the ``feature_extractor`` of ``processor_config.json``.

        ``ValueError`` (one line) for a directory with neither file, a file that is not JSON, or one that
        lacks a key or names another extractor.
        """
        d = Path(directory)
        for name in ("preprocessor_config.json", "processor_config.json"):
            path = d / name
            if path.is_file():
                break
        else:
            raise ValueError(f"{d}: no preprocessor_config.json or processor_config.json (no feature extractor)")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
        if name == "processor_config.json":
            data = data.get("feature_extractor")
            if not isinstance(data, dict):
                raise ValueError(f"{path}: has no 'feature_extractor' section")
        kind = data.get("feature_extractor_type", "NemotronAsrStreamingFeatureExtractor")
        if kind != "NemotronAsrStreamingFeatureExtractor":
            raise ValueError(f"{path}: feature extractor {kind!r} is not the NeMo-style log-mel of nemo_mel")
        missing = [k for k in _FILE_KEYS if k not in data]
        if missing:
            raise ValueError(f"{path}: the feature extractor lacks {', '.join(missing)}")
        values = {k: data[k] for k in _FILE_KEYS}
        values["preemphasis"] = float(values["preemphasis"] or 0.0)
        values["mel_filters_dtype"] = data.get("mel_filters_dtype", "float32")
        return cls(**values)


@register_extractor
class NemoMel(FeatureExtractor):
    """The log-mel of one configuration (``NemoMel(config)`` or ``NemoMel(**NemoMelConfig fields)``)."""

    kind = "nemo_mel"

    def __init__(self, config: NemoMelConfig | None = None, **fields):
        self.config = config if config is not None else NemoMelConfig(**fields)
        c = self.config
        self.num_bins = c.feature_size
        self.sample_rate = c.sampling_rate
        self.framing = StreamingFraming(span=c.n_fft, hop=c.hop_length, prefill=c.n_fft // 2)
        rounding = _DTYPES[c.mel_filters_dtype]
        window = torch.hann_window(c.win_length, periodic=False).to(rounding).float()
        left = (c.n_fft - c.win_length) // 2
        self.window = torch.nn.functional.pad(window, (left, c.n_fft - c.win_length - left))
        mel = torch.from_numpy(slaney_mel_filters(c.feature_size, c.n_fft, c.sampling_rate))
        self.mel_filters = mel.to(rounding).float()  # (bins, n_fft // 2 + 1)

    @classmethod
    def from_checkpoint(cls, directory) -> NemoMel:
        """The front end of a checkpoint directory (``NemoMelConfig.from_checkpoint``)."""
        return cls(NemoMelConfig.from_checkpoint(directory))

    def num_frames(self, num_samples: int) -> int:
        """Frames a whole utterance of ``num_samples`` samples gives."""
        n = self.config.n_fft
        return max(0, (num_samples + 2 * (n // 2) - n) // self.config.hop_length)

    def frames_of(self, spans: torch.Tensor) -> np.ndarray:
        """``(k, n_fft)`` pre-emphasised sample spans -> ``(k, bins)`` float32 log-mel frames."""
        spectrum = torch.fft.rfft(spans * self.window, dim=-1)
        power = spectrum.real.square() + spectrum.imag.square()
        return torch.log(power @ self.mel_filters.T + LOG_GUARD).numpy()

    def online(self) -> OnlineNemoMel:
        """A fresh per-stream extractor."""
        return OnlineNemoMel(self)


class OnlineNemoMel:
    """One stream's log-mel, piece by piece (see the module docstring for the frame rule)."""

    def __init__(self, mel: NemoMel):
        self.mel = mel
        c = mel.config
        self.received = 0  # samples accepted
        self.emitted = 0  # frames handed out
        self.finished = False
        self._last = None  # the previous raw sample (pre-emphasis); None before the first
        # pre-emphasised front-padded samples from the start of frame ``emitted`` on
        self._buffer = torch.zeros(c.n_fft // 2)

    def accept(self, pcm) -> np.ndarray:
        """Take more samples (1-D float, any length); returns the ``(n, bins)`` frames now complete."""
        if self.finished:
            raise ValueError("OnlineNemoMel.accept: the input was already finished")
        x = np.asarray(pcm, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"nemo_mel: expected mono PCM, a 1-D array of samples, got shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("nemo_mel: the audio holds NaN or infinite samples")
        if x.size:
            t = torch.from_numpy(x)
            a = self.mel.config.preemphasis
            before = torch.cat([t[:1] if self._last is None else self._last.view(1), t[:-1]])
            emph = t - a * before if a else t.clone()
            if self._last is None:
                emph[0] = t[0]
            self._last = t[-1].clone()
            self._buffer = torch.cat([self._buffer, emph])
            self.received += x.size
        return self._emit(self.mel.framing.frames_due(self.received))

    def finish(self) -> np.ndarray:
        """End the stream: the trailing zeros of the centred STFT, and the last frames (none on a 2nd call)."""
        if self.finished:
            return np.zeros((0, self.mel.num_bins), dtype=np.float32)
        self.finished = True
        self._buffer = torch.cat([self._buffer, torch.zeros(self.mel.config.n_fft // 2)])
        return self._emit(self.mel.num_frames(self.received))

    def snapshot(self) -> dict:
        """The whole state as tensors (what a suspended stream carries): the buffered samples, the pre-emphasis's
        last sample, the counters."""
        last = torch.tensor([0.0 if self._last is None else float(self._last)])
        return {"buffer": self._buffer.clone(), "last": last,
                "counters": torch.tensor([self.received, self.emitted, int(self.finished), int(self._last is None)])}

    @classmethod
    def restore(cls, mel: NemoMel, snap: dict) -> OnlineNemoMel:
        """An extractor that goes on from ``snapshot()``'s state, frame for frame as if never stopped."""
        online = cls(mel)
        received, emitted, finished, fresh = (int(x) for x in snap["counters"])
        online.received, online.emitted, online.finished = received, emitted, bool(finished)
        online._last = None if fresh else snap["last"][0].clone()
        online._buffer = snap["buffer"].clone()
        return online

    def _emit(self, upto: int) -> np.ndarray:
        count = upto - self.emitted
        if count <= 0:
            return np.zeros((0, self.mel.num_bins), dtype=np.float32)
        c = self.mel.config
        spans = self._buffer[: (count - 1) * c.hop_length + c.n_fft].unfold(0, c.n_fft, c.hop_length)
        frames = self.mel.frames_of(spans)
        self._buffer = self._buffer[count * c.hop_length :]
        self.emitted = upto
        return frames
