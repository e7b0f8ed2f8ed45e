"""A long recording of the shipped clips with pauses, and the WER of its live turns against the clips one by one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/long_recording.py [--limit N] [--seed S] [--json OUT]
        [--model PATH] [--language-model auto|none]

The recording: every shipped clip in order, ``--lead`` seconds of silence first, then a pause drawn uniformly from
``[--min-pause, --max-pause]`` seconds after each clip (seeded), ``--tail`` seconds at the end (120 clips with
the defaults: about 12.5 minutes). Three transcriptions of it are scored against the clips' reference texts,
all joined in order:

* ``clips``: every clip transcribed alone (the ceiling the other two are measured against);
* ``live turns``: one live stream with ``Recognizer(endpointing=EndpointConfig())``, fed in 0.32 s pieces;
* ``file segmenter``: ``transcribe_segments`` (the energy endpointer over the whole file).

Per clip, the live turns' segments that fall inside its span (clip plus half of each neighbouring pause) are
compared with the clip transcribed alone; the clips whose live text differs are listed (where a turn loses words).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SAMPLE_RATE = 16000


def build(clips, seed: int = 0, lead: float = 3.0, min_pause: float = 1.0, max_pause: float = 5.0,
          tail: float = 1.0):
    """The recording (float32 PCM) and each clip's ``(start, end)`` sample span in it."""
    rng = np.random.default_rng(seed)
    parts, spans, at = [np.zeros(int(lead * SAMPLE_RATE), np.float32)], [], int(lead * SAMPLE_RATE)
    for i, x in enumerate(clips):
        parts.append(x)
        spans.append((at, at + len(x)))
        at += len(x)
        pause = tail if i == len(clips) - 1 else rng.uniform(min_pause, max_pause)
        parts.append(np.zeros(int(pause * SAMPLE_RATE), np.float32))
        at += int(pause * SAMPLE_RATE)
    return np.concatenate(parts), spans


def per_clip(segments, spans) -> list[str]:
    """The text of the segments whose middle falls in each clip's span (widened halfway into its pauses)."""
    edges = [0] + [(spans[i][1] + spans[i + 1][0]) // 2 for i in range(len(spans) - 1)] + [10**12]
    texts = [[] for _ in spans]
    for seg in segments:
        mid = (seg.start + seg.end) / 2 * SAMPLE_RATE
        k = next(i for i in range(len(spans)) if edges[i] <= mid < edges[i + 1])
        texts[k].append(seg.text)
    return [" ".join(t) for t in texts]


def main(argv=None) -> int:
    """Build the recording, transcribe it three ways, print the WERs (and ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-segmenter", action="store_true")
    parser.add_argument("--lead-frames", type=int, default=None, help="the gate's lead (feature frames)")
    parser.add_argument("--threshold-db", type=float, default=None, help="the gate's energy threshold")
    parser.add_argument("--model", default=None, help="a checkpoint (default: the shipped model)")
    parser.add_argument("--language-model", choices=("auto", "none"), default="auto",
                        help="the word search: the model's (auto) or none")
    args = parser.parse_args(argv)

    import torch

    from oasr.asr.audio import load_audio
    from oasr.asr.metrics import error_rates
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.segments import transcribe_segments
    from oasr.asr.testset import load_testset
    from oasr.vad import EndpointConfig

    torch.set_num_threads(1)
    testset = load_testset(limit=args.limit)
    clips = [load_audio(c.path) for c in testset]
    refs = [c.text for c in testset]
    pcm, spans = build(clips, args.seed)
    print(f"recording: {len(clips)} clips, {len(pcm) / SAMPLE_RATE:.1f} s")
    out = {"clips": len(clips), "seconds": round(len(pcm) / SAMPLE_RATE, 1)}

    lm = None if args.language_model == "none" else "auto"
    rec = Recognizer(args.model, language_model=lm)
    alone = [t.text for t in rec.transcribe(clips)]
    out["clips_wer"] = error_rates([" ".join(refs)], [" ".join(alone)])["wer"]

    t0 = time.perf_counter()
    live_rec = Recognizer(args.model, endpointing=EndpointConfig(), language_model=lm)
    if args.lead_frames is not None:
        live_rec.turns.lead_frames = args.lead_frames
    if args.threshold_db is not None:
        live_rec.turns.threshold_db = args.threshold_db
    live = live_rec.transcribe([pcm])[0]
    out["live_seconds"] = round(time.perf_counter() - t0, 1)
    out["live_wer"] = error_rates([" ".join(refs)], [live.text])["wer"]
    out["live_segments"] = len(live.segments)
    if not args.skip_segmenter:
        segs = transcribe_segments(rec, pcm)
        out["segmenter_wer"] = error_rates([" ".join(refs)], [" ".join(s.text for s in segs)])["wer"]
    by_clip = per_clip(live.segments, spans)
    diffs = [(i, refs[i], alone[i], by_clip[i]) for i in range(len(clips)) if by_clip[i] != alone[i]]
    out["clips_differing"] = len(diffs)
    for i, ref, a, got in diffs:
        print(f"clip {i}: ref  {ref!r}\n         alone {a!r}\n         live  {got!r}")
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "diffs": diffs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
