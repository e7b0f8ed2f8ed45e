"""Recording conditions for synthesized speech: silences, pauses, telephone band, noise; all drawn from a seed.

A model trained on tightly cut, full-band clips loses the first words after a second of leading silence,
hears letters in digital silence and falls apart at 8 kHz. ``apply_conditions(pcm, rng, config)`` puts an
utterance (already spoken, 16 kHz) through what a live service meets:

* leading and trailing silence: with probability ``long_silence_share`` each side gets 0-``max_silence``
  seconds, otherwise a short 0.05-0.35 s margin;
* additive noise (white or brown) at an SNR drawn from ``snr_db``, with probability ``noise_share``; the
  noise runs over the silences too, so the model learns that noise alone is not speech;
* a telephone-band copy (``narrowband``: resampled to 8 kHz and back, nothing left above 4 kHz), with
  probability ``narrowband_share``;
* a gain (peak -20..-1 dBFS).

``join_phrases(pcms, pauses)`` makes one utterance of several phrases with pauses between them (the
recipe draws ``long_share`` of its utterances as 2-``max_phrases`` phrases, pauses from ``pause``), and
``empty_utterance(rng, config)`` is silence or noise alone, transcribed as the empty text
(``empty_share`` of the utterances). Every draw comes from the ``random.Random`` passed in (numpy's noise
from a seed drawn from it), so the same seed gives the same samples, bit for bit.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np

from oasr.features.fbank import SAMPLE_RATE

NARROW_RATE = 8000


@dataclass(frozen=True)
class ConditionConfig:
    """Shares and ranges of the conditions (seconds, dB). The defaults are the recipe's."""

    long_silence_share: float = 0.3
    max_silence: float = 3.0
    noise_share: float = 0.7
    snr_db: tuple[float, float] = (0.0, 35.0)
    narrowband_share: float = 0.25
    long_share: float = 0.1
    max_phrases: int = 4
    pause: tuple[float, float] = (0.3, 2.5)
    empty_share: float = 0.03

    def __post_init__(self):
        for name in ("long_silence_share", "noise_share", "narrowband_share", "long_share", "empty_share"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"ConditionConfig.{name} must be in [0, 1], got {v}")
        if self.max_silence < 0 or self.pause[0] < 0 or self.pause[0] > self.pause[1]:
            raise ValueError(f"ConditionConfig: bad silence/pause ranges {self.max_silence}, {self.pause}")
        if self.snr_db[0] > self.snr_db[1] or self.max_phrases < 2:
            raise ValueError(f"ConditionConfig: bad snr_db {self.snr_db} or max_phrases {self.max_phrases}")

    def to_dict(self) -> dict:
        """The config as JSON-able values."""
        return asdict(self)


def silence(seconds: float) -> np.ndarray:
    """``seconds`` of digital silence at 16 kHz."""
    return np.zeros(int(round(seconds * SAMPLE_RATE)), np.float32)


def pad(pcm: np.ndarray, lead: float, trail: float) -> np.ndarray:
    """``pcm`` with ``lead`` seconds of silence before and ``trail`` after."""
    return np.concatenate([silence(lead), np.asarray(pcm, np.float32), silence(trail)])


def join_phrases(pcms, pauses) -> np.ndarray:
    """Phrases joined by silences: ``pauses[i]`` seconds between phrase ``i`` and ``i + 1``."""
    pcms = list(pcms)
    if len(pauses) != len(pcms) - 1:
        raise ValueError(f"join_phrases: {len(pcms)} phrases need {len(pcms) - 1} pauses, got {len(pauses)}")
    parts = [np.asarray(pcms[0], np.float32)]
    for p, x in zip(pauses, pcms[1:], strict=True):
        parts += [silence(p), np.asarray(x, np.float32)]
    return np.concatenate(parts)


def narrowband(pcm: np.ndarray) -> np.ndarray:
    """A telephone-band copy: resampled to 8 kHz and back to 16 kHz (soxr), same length as ``pcm``."""
    import soxr

    low = soxr.resample(np.asarray(pcm, np.float32), SAMPLE_RATE, NARROW_RATE, quality="HQ")
    up = soxr.resample(low, NARROW_RATE, SAMPLE_RATE, quality="HQ").astype(np.float32)
    out = np.zeros(len(pcm), np.float32)
    out[: min(len(pcm), len(up))] = up[: len(pcm)]
    return out


def noise(rng: random.Random, n: int, kind: str) -> np.ndarray:
    """``n`` samples of unit-variance ``"white"`` or ``"brown"`` (integrated, drift removed) noise."""
    x = np.random.default_rng(rng.getrandbits(32)).standard_normal(n).astype(np.float32)
    if kind == "brown":
        x = np.cumsum(x)
        x -= np.convolve(x, np.ones(401) / 401, mode="same")
    elif kind != "white":
        raise ValueError(f"noise: kind must be 'white' or 'brown', got {kind!r}")
    return (x / (float(np.std(x)) + 1e-12)).astype(np.float32)


def add_noise(pcm: np.ndarray, rng: random.Random, snr_db: float, kind: str, speech_power: float) -> np.ndarray:
    """``pcm`` plus noise at ``snr_db`` below ``speech_power`` (the mean power of the speech alone)."""
    return pcm + noise(rng, len(pcm), kind) * np.float32(np.sqrt(speech_power / 10 ** (snr_db / 10)))


def _gain(pcm: np.ndarray, rng: random.Random) -> np.ndarray:
    peak = float(np.abs(pcm).max()) or 1.0
    return pcm / peak * np.float32(10 ** (rng.uniform(-20.0, -1.0) / 20))


def apply_conditions(pcm: np.ndarray, rng: random.Random, config: ConditionConfig = ConditionConfig()):
    """Silences, noise, telephone band and gain drawn for one spoken utterance: ``(pcm, description)``."""
    pcm = np.asarray(pcm, np.float32)
    speech_power = float(np.mean(pcm**2)) + 1e-12
    lead, trail = ((rng.uniform(0.0, config.max_silence) if rng.random() < config.long_silence_share
                    else rng.uniform(0.05, 0.35)) for _ in range(2))
    pcm = pad(pcm, lead, trail)
    desc = {"lead": round(lead, 3), "trail": round(trail, 3)}
    if rng.random() < config.noise_share:
        kind = rng.choice(["white", "brown"])
        snr = rng.uniform(*config.snr_db)
        pcm = add_noise(pcm, rng, snr, kind, speech_power)
        desc.update(noise=kind, snr_db=round(snr, 1))
    if rng.random() < config.narrowband_share:
        pcm = narrowband(pcm)
        desc["band"] = "8k"
    return np.clip(_gain(pcm, rng), -1.0, 1.0).astype(np.float32), desc


def empty_utterance(rng: random.Random, config: ConditionConfig = ConditionConfig()):
    """Silence alone (digital or with noise at -75..-30 dBFS), 0.5-4 s: ``(pcm, description)``; its text is ''."""
    n = int(rng.uniform(0.5, 4.0) * SAMPLE_RATE)
    if rng.random() < 0.25:
        return np.zeros(n, np.float32), {"empty": "digital"}
    kind = rng.choice(["white", "brown"])
    level = rng.uniform(-75.0, -30.0)
    pcm = noise(rng, n, kind) * np.float32(10 ** (level / 20))
    desc = {"empty": kind, "dbfs": round(level, 1)}
    if rng.random() < config.narrowband_share:
        pcm = narrowband(pcm)
        desc["band"] = "8k"
    return np.clip(pcm, -1.0, 1.0).astype(np.float32), desc
