"""Recording conditions: seeded, the telephone copy has nothing above 4 kHz, silences and pauses as drawn."""

import random

import numpy as np
import pytest

from oasr.asr.conditions import (
    ConditionConfig,
    add_noise,
    apply_conditions,
    empty_utterance,
    join_phrases,
    narrowband,
    noise,
    pad,
)


def _tone_mix(seconds=1.0):
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.2 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 2500 * t)
            + 0.2 * np.sin(2 * np.pi * 6000 * t)).astype(np.float32)


def _band_energy(x, lo, hi):
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x)))) ** 2
    f = np.fft.rfftfreq(len(x), 1 / 16000)
    return float(spec[(f >= lo) & (f < hi)].sum())


def test_the_narrowband_copy_has_no_energy_above_4_khz():
    rng = np.random.default_rng(0)
    x = np.concatenate([_tone_mix(), 0.1 * rng.standard_normal(16000).astype(np.float32)])
    y = narrowband(x)
    assert y.shape == x.shape and y.dtype == np.float32
    total = _band_energy(y, 0, 8000)
    assert _band_energy(y, 4000, 8000) < 1e-6 * total  # soxr's stop band, 8 kHz after the round trip
    assert _band_energy(x, 4000, 8000) > 0.3 * _band_energy(x, 0, 8000)  # the input had plenty there
    assert _band_energy(y, 300, 3400) > 0.9 * _band_energy(x, 300, 3400)  # the telephone band passes


def test_conditions_are_a_function_of_the_seed():
    x = _tone_mix(0.5)
    cfg = ConditionConfig(noise_share=1.0, narrowband_share=0.5, long_silence_share=0.5)
    a, da = apply_conditions(x, random.Random(3), cfg)
    b, db = apply_conditions(x, random.Random(3), cfg)
    c, _ = apply_conditions(x, random.Random(4), cfg)
    assert da == db and np.array_equal(a, b)
    assert not (len(a) == len(c) and np.array_equal(a, c))
    e1, d1 = empty_utterance(random.Random(9), cfg)
    e2, d2 = empty_utterance(random.Random(9), cfg)
    assert d1 == d2 and np.array_equal(e1, e2)


def test_silences_and_pauses_have_the_drawn_lengths():
    x = np.full(1600, 0.5, np.float32)
    y = pad(x, 1.25, 0.5)
    assert len(y) == 20000 + 1600 + 8000 and not y[:20000].any() and not y[-8000:].any()
    j = join_phrases([x, x, x], [0.3, 2.0])
    assert len(j) == 3 * 1600 + 4800 + 32000 and not j[1600:6400].any()
    with pytest.raises(ValueError, match="2 pauses"):
        join_phrases([x, x, x], [0.3])
    # without noise or band limiting the speech sits between silences of the recorded lengths, 0-3 s
    cfg = ConditionConfig(noise_share=0.0, narrowband_share=0.0, long_silence_share=1.0)
    leads = []
    for seed in range(40):
        y, d = apply_conditions(x, random.Random(seed), cfg)
        nz = np.flatnonzero(y)
        assert abs(nz[0] - d["lead"] * 16000) <= 16 and abs(len(y) - 1 - nz[-1] - d["trail"] * 16000) <= 16
        assert 0.0 <= d["lead"] <= 3.0 and 0.0 <= d["trail"] <= 3.0
        leads.append(d["lead"])
    assert max(leads) > 2.0 and min(leads) < 1.0


def test_noise_at_the_drawn_snr_and_empty_utterances():
    x = _tone_mix(1.0)
    p = float(np.mean(x**2))
    for kind in ("white", "brown"):
        y = add_noise(x, random.Random(1), 10.0, kind, p)
        snr = 10 * np.log10(p / float(np.mean((y - x) ** 2)))
        assert abs(snr - 10.0) < 0.5, (kind, snr)
    with pytest.raises(ValueError, match="kind"):
        noise(random.Random(0), 10, "pink")
    for seed in range(20):
        e, d = empty_utterance(random.Random(seed))
        assert 0.5 * 16000 <= len(e) <= 4 * 16000
        if d["empty"] == "digital":
            assert not e.any()
        else:  # noise alone at the drawn level (a telephone copy keeps at most the lower half of white noise)
            rms_db = 10 * np.log10(float(np.mean(e.astype(np.float64) ** 2)))
            assert d["dbfs"] - 3.5 < rms_db < d["dbfs"] + 0.5, (d, rms_db)
    with pytest.raises(ValueError, match="noise_share"):
        ConditionConfig(noise_share=2.0)
