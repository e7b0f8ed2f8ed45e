"""``python -m oasr transcribe FILE...``: stream each audio file through the engine and print its text."""

from __future__ import annotations

import sys

from oasr.commands import CommandParser
from oasr.commands.asr_options import (
    add_model_options,
    check_model_options,
    is_transducer,
    recognizer,
    transducer_recognizer,
)


def build_parser() -> CommandParser:
    """The parser of ``python -m oasr transcribe``, every option with its default."""
    parser = CommandParser(prog="python -m oasr transcribe",
                           description="Transcribe audio files (WAV, FLAC, OGG; resampled to 16 kHz) by streaming "
                                       "them through the engine, one line of text per file.")
    parser.add_argument("files", nargs="+", metavar="FILE", help="audio files")
    parser.add_argument("--partials", action="store_true",
                        help="also print each partial result as it changes, with the audio time it was reached")
    add_model_options(parser)
    return parser


def main(argv=None) -> int:
    """Run ``python -m oasr transcribe`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    from oasr.asr.audio import AudioError, load_audio

    audio = []
    for path in args.files:  # every file is read and checked before any is transcribed
        try:
            audio.append(load_audio(path))
        except AudioError as exc:
            parser.error(str(exc))
    if is_transducer(args):
        transcripts = transducer_recognizer(args, parser).transcribe(audio)
    else:
        rec = recognizer(args, max_seconds=max(60.0, max(len(a) for a in audio) / 16000 + 1))
        transcripts = rec.transcribe(audio)
    for path, transcript in zip(args.files, transcripts, strict=True):
        if args.partials:
            for seconds, text in transcript.partials:
                print(f"{path} [{seconds:6.2f} s] {text}")
        print(f"{path}: {transcript.text}" if len(args.files) > 1 or args.partials else transcript.text)
    sys.stdout.flush()
    return 0
