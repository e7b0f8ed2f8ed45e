"""Synthesized speech for the training recipe: espeak-ng voices, speed, gain and noise.

Only the recipe (``python -m oasr train``, ``python -m oasr make-testset``) uses this module; it needs the
``espeak-ng`` program (Debian package ``espeak-ng``). Tests and the demo never synthesize: they read the
shipped FLAC clips.

A *voice* is an espeak-ng accent with a voice variant (``en-gb-scotland+m3``). The variants are split in
two: ``TRAIN_VARIANTS`` speak the training data, ``TEST_VARIANTS`` only the held-out test set, so the
test set is spoken by voices the model never heard. Each utterance draws its speaking rate, pitch,
a speed perturbation (resampling by 0.9-1.1, which moves tempo and pitch together), a gain and,
most of the time, additive noise (white or low-passed "brown" noise at 5-40 dB SNR).
"""

from __future__ import annotations

import io
import random
import shutil
import subprocess

import numpy as np

from oasr.features.fbank import SAMPLE_RATE

ACCENTS = ["en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029"]
TRAIN_VARIANTS = ["m1", "m2", "m3", "m4", "m6", "m7", "f1", "f2", "f4", "f5", "klatt", "klatt3", "klatt4",
                  "Andy", "Annie", "Denis", "Michael", "john", "linda", "max"]
TEST_VARIANTS = ["m5", "f3", "klatt2", "paul", "anika"]
# a second, wider voice set for the extra shards (``python -m oasr train --extra-voice-shards``): more
# female and high-pitched variants (the base set has few, and the held-out high-pitched voice scored worst);
# none of them is a test variant or derived from one (anikaRobot is anika's, so it is left out)
MORE_TRAIN_VARIANTS = ["belinda", "aunty", "steph", "Alicia", "Andrea", "shelby", "grandma", "m8", "klatt5",
                       "klatt6", "adam", "edward", "iven", "quincy", "zac", "rob", "travis", "benjamin"]
# the second held-out set (``oasr.asr.testset2``): variants and an accent no recipe path ever speaks with (none
# derived from a training or first-test variant: edward2, steph2, iven2 and anikaRobot are left out)
TEST2_VARIANTS = ["david", "robert", "norbert", "victor", "caleb", "Alex", "Mike", "Jacky"]
TEST2_ACCENTS = ["en-us-nyc", *ACCENTS]


def espeak_available() -> bool:
    """Whether the ``espeak-ng`` program is on PATH (the synthesizer needs it)."""
    return shutil.which("espeak-ng") is not None


def speak(text: str, voice: str, rate: int, pitch: int) -> np.ndarray:
    """``text`` spoken by espeak-ng as float32 PCM at 16 kHz."""
    import soundfile as sf
    import soxr

    if not espeak_available():
        raise RuntimeError("the training recipe needs espeak-ng (apt-get install espeak-ng)")
    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "--stdout", text],
                         check=True, capture_output=True).stdout
    pcm, sr = sf.read(io.BytesIO(wav), dtype="float32")
    return soxr.resample(pcm, sr, SAMPLE_RATE).astype(np.float32)


def perturb(pcm: np.ndarray, rng: random.Random, speed: float, noisy: bool = True) -> np.ndarray:
    """Speed (resample by ``speed``), silence padding, gain and additive noise, drawn from ``rng``."""
    import soxr

    if speed != 1.0:
        pcm = soxr.resample(pcm, SAMPLE_RATE, SAMPLE_RATE / speed).astype(np.float32)
    lead, trail = (int(rng.uniform(0.05, 0.35) * SAMPLE_RATE) for _ in range(2))
    pcm = np.concatenate([np.zeros(lead, np.float32), pcm, np.zeros(trail, np.float32)])
    peak = float(np.abs(pcm).max()) or 1.0
    pcm = pcm / peak * 10 ** (rng.uniform(-20.0, -1.0) / 20)
    if noisy and rng.random() < 0.8:
        nrng = np.random.default_rng(rng.getrandbits(32))
        noise = nrng.standard_normal(pcm.size).astype(np.float32)
        if rng.random() < 0.5:  # brown-ish: integrate and remove the drift
            noise = np.cumsum(noise)
            noise -= np.convolve(noise, np.ones(401) / 401, mode="same")
        speech_power = float(np.mean(pcm**2)) + 1e-12
        snr_db = rng.uniform(5.0, 40.0)
        noise *= np.sqrt(speech_power / (10 ** (snr_db / 10)) / (float(np.mean(noise**2)) + 1e-12))
        pcm = pcm + noise
    return np.clip(pcm, -1.0, 1.0).astype(np.float32)


def draw_conditioned_utterance(rng: random.Random, sentences, variants: list[str], config):
    """One utterance for the open recipe: ``(pcm, text, description)``.

    ``config.empty_share`` of them are silence or noise alone (text ``""``); ``config.long_share`` are 2 to
    ``config.max_phrases`` sentences from ``sentences`` by one voice with pauses between; the rest one sentence.
    Then speed perturbation and ``oasr.asr.conditions.apply_conditions``."""
    import soxr

    from oasr.asr.conditions import apply_conditions, empty_utterance, join_phrases

    if rng.random() < config.empty_share:
        pcm, desc = empty_utterance(rng, config)
        return pcm, "", desc
    n = rng.randint(2, config.max_phrases) if rng.random() < config.long_share else 1
    texts = [next(sentences) for _ in range(n)]
    voice = f"{rng.choice(ACCENTS)}+{rng.choice(variants)}"
    rate, pitch = rng.randint(125, 205), rng.randint(25, 75)
    speed = rng.choice([0.9, 1.0, 1.0, 1.1])
    pauses = [rng.uniform(*config.pause) for _ in range(n - 1)]
    pcm = join_phrases([speak(t, voice, rate, pitch) for t in texts], pauses)
    if speed != 1.0:
        pcm = soxr.resample(pcm, SAMPLE_RATE, SAMPLE_RATE / speed).astype(np.float32)
    pcm, desc = apply_conditions(pcm, rng, config)
    desc.update(voice=voice, rate=rate, pitch=pitch, speed=speed, phrases=n)
    return pcm, " ".join(texts), desc


def draw_utterance(rng: random.Random, text: str, variants: list[str], noisy: bool = True):
    """One perturbed utterance of ``text``: ``(pcm, description)``."""
    voice = f"{rng.choice(ACCENTS)}+{rng.choice(variants)}"
    rate, pitch = rng.randint(125, 205), rng.randint(25, 75)
    speed = rng.choice([0.9, 1.0, 1.0, 1.1])
    pcm = perturb(speak(text, voice, rate, pitch), rng, speed, noisy)
    return pcm, {"voice": voice, "rate": rate, "pitch": pitch, "speed": speed}
