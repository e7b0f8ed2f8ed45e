"""Speech detectors: a signal in, one speech probability per frame out (the endpointer's input).

* ``ctc_speech_probability``: what a CTC recognizer already computes. ``1 - p(blank)`` per encoder
  frame: near 1 on the frames where the model emits a token, near 0 elsewhere (peaky: inside speech,
  blanks separate the spikes, so the endpointer's silence must be longer than those gaps).
* ``EnergyDetector``: for audio with no posteriors (before a model, or a model without CTC): the frame's
  energy in dB relative to full scale, mapped through a logistic around ``threshold_db``. Digital
  silence is exactly 0. It keeps the samples of an unfinished frame between pushes, so a stream pushed
  in pieces of any size gives the same probabilities as the whole signal at once.
"""

from __future__ import annotations

import numpy as np
import torch


def ctc_speech_probability(log_probs: torch.Tensor, blank: int) -> torch.Tensor:
    """``1 - exp(log_probs[..., blank])`` in fp32: ``(..., V)`` log-softmax outputs to ``(...)`` probabilities.

    Raises ``ValueError`` when ``blank`` is not a vocabulary index.
    """
    if not 0 <= blank < log_probs.shape[-1]:
        raise ValueError(f"ctc_speech_probability: blank={blank} is outside the vocabulary of "
                         f"{log_probs.shape[-1]}")
    return (1.0 - log_probs[..., blank].float().exp()).clamp_(0.0, 1.0)


class EnergyDetector:
    """Frame energy to a speech probability, streamed: ``push(pcm)`` returns the probabilities of the frames
    it completed.

    ``pcm`` is float audio in ``[-1, 1]`` at ``sample_rate``; a frame is ``frame_seconds`` long. The
    probability is ``sigmoid((dBFS - threshold_db) / width_db)`` with ``dBFS = 10 log10(mean(x^2))``; a frame
    of zeros gives exactly 0.
    """

    def __init__(self, sample_rate: int = 16000, frame_seconds: float = 0.04, threshold_db: float = -45.0,
                 width_db: float = 3.0):
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
            raise ValueError(f"EnergyDetector: sample_rate must be a positive int, got {sample_rate!r}")
        self.frame_samples = round(sample_rate * frame_seconds)
        if self.frame_samples <= 0:
            raise ValueError(f"EnergyDetector: frame_seconds={frame_seconds} holds no sample at {sample_rate} Hz")
        if not width_db > 0:
            raise ValueError(f"EnergyDetector: width_db must be > 0, got {width_db!r}")
        self.threshold_db, self.width_db = float(threshold_db), float(width_db)
        self._rest = np.zeros(0, np.float64)

    def push(self, pcm) -> np.ndarray:
        """The speech probabilities of the whole frames completed by ``pcm`` (1-D float samples)."""
        x = np.asarray(pcm, dtype=np.float64).reshape(-1)
        if x.size and not np.isfinite(x).all():
            raise ValueError("EnergyDetector.push: samples must be finite")
        x = np.concatenate([self._rest, x])
        n = x.size // self.frame_samples
        frames = x[: n * self.frame_samples].reshape(n, self.frame_samples)
        self._rest = x[n * self.frame_samples :].copy()
        power = (frames * frames).mean(axis=1)
        with np.errstate(divide="ignore"):
            db = 10.0 * np.log10(power)
        z = np.clip((db - self.threshold_db) / self.width_db, -60.0, 60.0)
        probs = 1.0 / (1.0 + np.exp(-z))
        return np.where(power > 0, probs, 0.0)

    def reset(self) -> None:
        """Forget a partial frame (a new stream)."""
        self._rest = np.zeros(0, np.float64)

