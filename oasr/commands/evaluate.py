"""``python -m oasr eval``: word and character error rates on the shipped held-out test set."""

from __future__ import annotations

import json

from oasr.asr.evaluation import evaluate
from oasr.commands import CommandParser, check_output_path
from oasr.commands.asr_options import (
    add_model_options,
    check_model_options,
    configuration,
    is_transducer,
    recognizer,
    transducer_recognizer,
)


def build_parser() -> CommandParser:
    """The parser of ``python -m oasr eval``, every option with its default."""
    parser = CommandParser(prog="python -m oasr eval",
                           description="WER and CER of a configuration on the held-out test set (sentences and "
                                       "voices never trained on).")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the result as JSON (default: not written)")
    parser.add_argument("--testset", default=None,
                        help="a test set directory, or 'testset2' for the second shipped set (new sentence forms, "
                             "new voices, 8 kHz, long clips, silences) (default: the first shipped set)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N clips (default: all)")
    parser.add_argument("--show", type=int, default=0, help="print the first N errors with their references")
    add_model_options(parser)
    return parser


def _rate(name: str, r: dict) -> str:
    if r["words"] == 0:  # no speech: what counts is that nothing was heard
        return f"{name} {r['empty_hyps']}/{r['utterances']} empty ({r['word_errors']} words invented)"
    return f"{name} {100 * r['wer']:.1f}% ({r['utterances']} clips)"


def main(argv=None) -> int:
    """Run ``python -m oasr eval`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if args.json:
        check_output_path(parser, args.json, "--json")
    from pathlib import Path

    from oasr.asr.testset import load_testset, shipped_testset_dir

    testset = args.testset
    if testset == "testset2" and not Path(testset).is_dir():
        testset = shipped_testset_dir("testset2")
    try:
        clips = load_testset(testset, args.limit)
    except ValueError as exc:
        parser.error(str(exc))
    rec = transducer_recognizer(args, parser) if is_transducer(args) else recognizer(args)
    result = evaluate(rec, clips)
    result["configuration"] = configuration(args, rec)
    print(f"{result['utterances']} utterances, {result['audio_seconds']:.0f} s of audio: "
          f"WER {100 * result['wer']:.2f}% CER {100 * result['cer']:.2f}%"
          + (f" (first pass WER {100 * result['first_pass_wer']:.2f}%)" if args.rescore else "")
          + f", real-time factor {result['rtf']:.3f}")
    for title, key in (("condition", "per_condition"), ("voice", "per_voice")):
        if len(result[key]) > 1:
            print(f"per {title}: " + "; ".join(_rate(name, r) for name, r in result[key].items()))
    for name, r in result["paired"].items():
        print(f"{name}: {100 * r['wer']:.1f}% against {100 * r['source_wer']:.1f}% for the same {r['utterances']} "
              "clips at 16 kHz")
    shown = 0
    for h in result["hypotheses"]:
        if shown < args.show and h["ref"] != h["hyp"]:
            print(f"  {h['id']} ref: {h['ref']}\n  {' ' * len(h['id'])} hyp: {h['hyp']}")
            shown += 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
