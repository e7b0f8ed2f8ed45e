"""The second held-out test set: sentence forms, voices and recording conditions the recipe never produces.

The first set (``oasr.asr.testset``) holds out sentences of the training templates' own forms; a model that
learned the forms scores well on it and badly on anything else. This set is built to catch that:

* **sentences** from a small grammar of its own (questions, requests, conditionals, relative clauses, ...)
  that neither the templates nor the open generator (``oasr.asr.opentext``: random word strings and free
  slot sequences) has as a form; every sentence is also held out by the training split's hash
  (``oasr.asr.text.is_held_out``), so the recipe can never generate one of them for training. The words
  are everyday ones the training text draws often (the templates', ``opentext.FUNCTION`` and
  ``opentext.COMMON_FORMS``): the set measures new *forms*, not rare words;
* **voices**: ``TEST2_VARIANTS`` with ``TEST2_ACCENTS`` (``en-us-nyc`` is in no other list), never trained on;
* **conditions** (the ``condition`` field of each clip): ``16k`` (the base clips, a quarter with mild noise),
  ``8k`` (copies of base clips resampled to 8 kHz and stored at 8 kHz: the loader brings them back up),
  ``lead_silence`` (copies after 1-3 s of digital silence), ``noise`` (copies at 5-12 dB SNR),
  ``long`` (about a minute: a dozen sentences by one voice with 1-2.5 s pauses; ``sentences`` lists them),
  ``silence`` and
  ``noise_only`` (no speech: the reference is the empty text).

The copies keep the base clip's sentence and voice (``source`` names it), so a condition's WER can be
compared with the same clips at 16 kHz. ``make_testset2(directory, seed)`` needs espeak-ng (the recipe's
tool, never the tests'); ``python -m oasr.asr.testset2 DIR`` runs it. The set is read with
``oasr.asr.testset.load_testset(DIR)`` like the first one.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np

SUBJECTS = ["she", "he", "they", "we", "my father", "my sister", "the doctor", "the teacher", "your friend",
            "the old man", "the children", "the driver"]
VERBS = ["open", "carry", "paint", "clean", "fix", "move", "sell", "wash", "bring", "build", "keep", "break",
         "find", "take", "send", "draw", "watch", "buy"]
NOUNS = ["letter", "picture", "bottle", "glass", "box", "bag", "chair", "table", "window", "book", "shirt", "coat",
         "plate", "cup", "ball", "phone"]
ADJECTIVES = ["heavy", "broken", "empty", "wooden", "bright", "quiet", "strange", "narrow", "careful", "tired",
              "hungry", "golden", "dirty", "gentle", "small", "old"]
PLACES = ["school", "office", "kitchen", "station", "garden", "park", "farm", "city", "garage", "basement"]
NAMES = ["anna", "peter", "maria", "david", "john"]
PERIODS = ["week", "month", "year", "night", "morning", "evening"]
SMALL = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve", "twenty"]


def _forms():
    from oasr.asr.opentext import past, plural_of, third_person

    def v(r, i):
        verb = r.choice(VERBS)
        return (verb, past(verb), third_person(verb))[i]

    def n(r, plural=False):
        noun = r.choice(NOUNS)
        return plural_of(noun) if plural else noun

    return [
        lambda r: f"could you {v(r, 0)} the {r.choice(ADJECTIVES)} {n(r)} please",
        lambda r: f"why did {r.choice(SUBJECTS)} {v(r, 0)} the {n(r)} in the {r.choice(PLACES)}",
        lambda r: f"if it rains tomorrow {r.choice(SUBJECTS)} will {v(r, 0)} the {n(r, True)}",
        lambda r: f"the {n(r)} that {r.choice(SUBJECTS)} {v(r, 1)} was {r.choice(ADJECTIVES)}",
        lambda r: f"how many {n(r, True)} did you {v(r, 0)} last {r.choice(PERIODS)}",
        lambda r: f"please {v(r, 0)} the {n(r)} and then {v(r, 0)} the {n(r)}",
        lambda r: f"i think {r.choice(SUBJECTS)} left the {n(r)} at the {r.choice(PLACES)}",
        lambda r: f"{r.choice(NAMES)} and {r.choice(NAMES)} {v(r, 1)} {r.choice(SMALL)} {n(r, True)} yesterday",
        lambda r: f"where can i {v(r, 0)} a {r.choice(ADJECTIVES)} {n(r)} near the {r.choice(PLACES)}",
        lambda r: f"do you know who {v(r, 2)} the {n(r, True)} every {r.choice(PERIODS)}",
        lambda r: f"nobody {v(r, 1)} the {r.choice(ADJECTIVES)} {n(r)} because it was too {r.choice(ADJECTIVES)}",
        lambda r: f"{r.choice(NAMES)} never {v(r, 2)} anything at the {r.choice(PLACES)}",
        lambda r: f"we should {v(r, 0)} those {n(r, True)} before the {r.choice(PLACES)} closes",
        lambda r: f"has anyone seen my {r.choice(ADJECTIVES)} {n(r)}",
    ]


class SecondSetSentences:
    """An endless seeded stream of distinct sentences of this set's forms, all held out of training."""

    def __init__(self, seed: int):
        self.random = random.Random(f"testset2/{seed}")
        self.forms = _forms()
        self.seen: set[str] = set()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        from oasr.asr.text import is_held_out

        for _ in range(100_000):
            text = " ".join(self.random.choice(self.forms)(self.random).split())
            if is_held_out(text) and text not in self.seen:
                self.seen.add(text)
                return text
        raise RuntimeError("SecondSetSentences: no new held-out sentence in 100,000 draws")


def _write(directory: Path, rows: list, clip_id: str, pcm: np.ndarray, rate: int, text: str, desc: dict):
    import soundfile as sf

    sf.write(directory / f"{clip_id}.flac", pcm, rate, subtype="PCM_16", format="FLAC")
    rows.append(f"{clip_id}\t{text}\t{json.dumps(desc, sort_keys=True)}")


def make_testset2(directory, seed: int = 20261204, base: int = 30, narrow: int = 15, lead: int = 6,
                  noisy: int = 4, long_sentences: int = 12) -> Path:
    """Synthesize the set into ``directory`` (FLAC and ``transcripts.tsv``), from ``seed``; needs espeak-ng."""
    import soxr

    from oasr.asr.conditions import NARROW_RATE, add_noise, join_phrases, noise, pad, silence
    from oasr.asr.synth import TEST2_ACCENTS, TEST2_VARIANTS, speak
    from oasr.features.fbank import SAMPLE_RATE

    if narrow + lead + noisy > base:
        raise ValueError(f"make_testset2: {narrow} + {lead} + {noisy} copies need as many base clips, got {base}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sentences = SecondSetSentences(seed)
    rows: list[str] = []

    def voice():
        return {"voice": f"{rng.choice(TEST2_ACCENTS)}+{rng.choice(TEST2_VARIANTS)}", "rate": rng.randint(130, 200),
                "pitch": rng.randint(20, 80)}

    def level(pcm, peak_db):
        return (pcm / (float(np.abs(pcm).max()) or 1.0) * 10 ** (peak_db / 20)).astype(np.float32)

    bases = []
    for i in range(base):
        text, desc = next(sentences), voice()
        pcm = pad(speak(text, desc["voice"], desc["rate"], desc["pitch"]), rng.uniform(0.1, 0.3),
                  rng.uniform(0.1, 0.3))
        pcm = level(pcm, rng.uniform(-15.0, -5.0))
        if rng.random() < 0.25:
            desc.update(noise="white", snr_db=round(rng.uniform(20.0, 35.0), 1))
            pcm = add_noise(pcm, rng, desc["snr_db"], "white", float(np.mean(pcm**2)))
        bases.append((text, desc, pcm))
        _write(directory, rows, f"{i:04d}", np.clip(pcm, -1, 1), SAMPLE_RATE, text, {**desc, "condition": "16k"})
    k = base
    for j in range(narrow):
        text, desc, pcm = bases[j]
        low = soxr.resample(pcm, SAMPLE_RATE, NARROW_RATE, quality="HQ")
        _write(directory, rows, f"{k:04d}", np.clip(low, -1, 1), NARROW_RATE, text,
               {**desc, "condition": "8k", "source": f"{j:04d}"})
        k += 1
    for j in range(narrow, narrow + lead):
        text, desc, pcm = bases[j]
        s = round(rng.uniform(1.0, 3.0), 2)
        _write(directory, rows, f"{k:04d}", pad(pcm, s, 0.0), SAMPLE_RATE, text,
               {**desc, "condition": "lead_silence", "lead": s, "source": f"{j:04d}"})
        k += 1
    for j in range(narrow + lead, narrow + lead + noisy):
        text, desc, pcm = bases[j]
        kind, snr = rng.choice(["white", "brown"]), round(rng.uniform(5.0, 12.0), 1)
        loud = add_noise(pcm, rng, snr, kind, float(np.mean(pcm**2)))
        _write(directory, rows, f"{k:04d}", np.clip(loud, -1, 1), SAMPLE_RATE, text,
               {**{a: b for a, b in desc.items() if a not in ("noise", "snr_db")}, "condition": "noise",
                "noise": kind, "snr_db": snr, "source": f"{j:04d}"})
        k += 1
    desc = voice()
    texts = [next(sentences) for _ in range(long_sentences)]
    pauses = [rng.uniform(1.0, 2.5) for _ in range(long_sentences - 1)]
    pcm = pad(join_phrases([speak(t, desc["voice"], desc["rate"], desc["pitch"]) for t in texts], pauses), 2.0, 1.0)
    _write(directory, rows, f"{k:04d}", level(pcm, -9.0), SAMPLE_RATE, " ".join(texts),
           {**desc, "condition": "long", "sentences": texts})
    k += 1
    for seconds in (2.0, 3.0):
        _write(directory, rows, f"{k:04d}", silence(seconds), SAMPLE_RATE, "",
               {"voice": "none", "condition": "silence"})
        k += 1
    for kind, dbfs in (("white", -50.0), ("brown", -40.0)):
        pcm = noise(rng, 2 * SAMPLE_RATE, kind) * np.float32(10 ** (dbfs / 20))
        _write(directory, rows, f"{k:04d}", np.clip(pcm, -1, 1), SAMPLE_RATE, "",
               {"voice": "none", "condition": "noise_only", "noise": kind, "dbfs": dbfs})
        k += 1
    (directory / "transcripts.tsv").write_text("\n".join(rows) + "\n")
    return directory


if __name__ == "__main__":
    print(make_testset2(sys.argv[1] if len(sys.argv) > 1 else "oasr/assets/testset2"))
