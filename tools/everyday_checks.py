"""Quick checks of a speech model outside its test sets: pauses without turns, leading silence, silence
alone, and a few everyday sentences synthesized at check time.

    PYTHONPATH=$PWD python tools/everyday_checks.py [--model PATH] [--json OUT]

Four checks, each printed on one line (and ``--json``):

* ``pauses``: the first 12 shipped clips joined by 1 s of digital silence, one stream, no turns: its WER
  against the clips' texts joined;
* ``lead``: the same 12 clips each after 1 s and after 3 s of digital silence, the plain recognizer (no
  turns, so the silence reaches the model) and the recognizer with turns (the gate keeps it out);
* ``silence``: 2 s of digital silence alone (the right answer is empty text);
* ``everyday``: five everyday sentences spoken by eight espeak-ng voices (needs ``espeak-ng``; skipped
  without it), how many of the 40 come out word for word, and the ones that do not.

The everyday sentences are not drawn from a test set: they are the kind of thing a newcomer types first.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

SAMPLE_RATE = 16000
SENTENCES = ("please turn on the kitchen light", "i would like a cup of coffee", "the weather is nice today",
             "can you call my sister tomorrow", "we need more bread and milk")
VOICES = ("en-us+m3", "en-us+f2", "en+m1", "en+f4", "en-gb+klatt", "en-us+Annie", "en+steph", "en-us+Andy")


def main(argv=None) -> int:
    """Run the checks, print them (and ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: the shipped model)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    import torch
    from long_recording import build  # tools/ is on the path when this file runs as a script

    from oasr.asr.audio import load_audio
    from oasr.asr.metrics import error_rates
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.synth import espeak_available, speak
    from oasr.asr.testset import load_testset
    from oasr.vad import EndpointConfig

    torch.set_num_threads(1)
    rec = Recognizer(args.model)
    turns = Recognizer(args.model, endpointing=EndpointConfig())
    testset = load_testset(limit=12)
    refs = [c.text for c in testset]
    clips = [load_audio(c.path) for c in testset]
    out = {}

    joined, _ = build(clips, lead=0.0, min_pause=1.0, max_pause=1.0, tail=0.0)  # long_recording's recording
    text = rec.transcribe([joined])[0].text
    out["pauses_wer"] = error_rates([" ".join(refs)], [text])["wer"]
    print(f"pauses: 12 clips, 1 s apart ({len(joined) / SAMPLE_RATE:.0f} s), no turns: "
          f"WER {100 * out['pauses_wer']:.1f}%")

    alone = error_rates(refs, [t.text for t in rec.transcribe(clips)])["wer"]
    for lead in (1.0, 3.0):
        padded = [np.concatenate([np.zeros(int(lead * SAMPLE_RATE), np.float32), c]) for c in clips]
        for name, r in (("plain", rec), ("turns", turns)):
            wer = error_rates(refs, [t.text for t in r.transcribe(padded)])["wer"]
            out[f"lead_{lead:g}s_{name}_wer"] = wer
            print(f"lead: {lead:g} s of digital silence first, {name}: WER {100 * wer:.2f}% "
                  f"(the clips alone {100 * alone:.2f}%)")

    out["silence_text"] = rec.transcribe([np.zeros(2 * SAMPLE_RATE, np.float32)])[0].text
    print(f"silence: 2 s of digital silence gives {out['silence_text']!r}")

    if espeak_available():
        wrong = []
        for sentence in SENTENCES:
            heard = rec.transcribe([speak(sentence, voice, 160, 50) for voice in VOICES])
            wrong += [f"{voice}: {t.text}" for voice, t in zip(VOICES, heard, strict=True) if t.text != sentence]
        out["everyday_right"] = len(SENTENCES) * len(VOICES) - len(wrong)
        out["everyday_wrong"] = wrong
        print(f"everyday: {out['everyday_right']} of {len(SENTENCES) * len(VOICES)} word for word"
              + ("; " + "; ".join(wrong) if wrong else ""))
    else:
        print("everyday: skipped (espeak-ng is not installed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
