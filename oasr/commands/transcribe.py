"""``python -m oasr transcribe FILE_OR_DIR...``: stream each audio file through the engine and print its text.

A directory stands for the audio files directly inside it (by extension, in name order). With ``--segments``
a long recording is cut at its pauses by the energy endpointer (``oasr.asr.segments``) and each segment is printed
on a line of its own with its start and end times in seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

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
                           description="Transcribe audio files (WAV, FLAC, OGG, MP3 and whatever else libsndfile "
                                       "reads; resampled to 16 kHz; several channels mixed down to one) by "
                                       "streaming them through the engine, one line of text per file.")
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="audio files, or directories: the audio files directly inside them")
    parser.add_argument("--channel", type=int, default=None, metavar="N",
                        help="of a file with several channels, transcribe channel N only (0 is the first, the "
                             "left of a stereo file) (default: the mix of all channels)")
    parser.add_argument("--partials", action="store_true",
                        help="also print each partial result as it changes, with the audio time it was reached")
    parser.add_argument("--segments", action="store_true",
                        help="cut each file at its pauses (energy endpointer) and print one line per segment with "
                             "its start and end times: for long recordings (any length; silence never reaches "
                             "the model)")
    add_model_options(parser)
    return parser


def main(argv=None) -> int:
    """Run ``python -m oasr transcribe`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    from oasr.asr.audio import AudioError, load_audio

    if args.channel is not None and args.channel < 0:
        parser.error(f"--channel must be >= 0, got {args.channel}")
    files, audio = expand(parser, args.files), []
    for path in files:  # every file is read and checked before any is transcribed
        try:
            audio.append(load_audio(path, args.channel))
        except AudioError as exc:
            parser.error(str(exc))
    if args.segments and args.partials:
        parser.error("--segments and --partials do not go together (a segment's partials are not kept)")
    longest = 60.0 if args.segments else max(60.0, max(len(a) for a in audio) / 16000 + 1)
    rec = transducer_recognizer(args, parser) if is_transducer(args) else recognizer(args, max_seconds=longest)
    if args.segments:
        print_segments(rec, files, audio)
        return 0
    transcripts = rec.transcribe(audio)
    for path, transcript in zip(files, transcripts, strict=True):
        if args.partials:
            for seconds, text in transcript.partials:
                print(f"{path} [{seconds:6.2f} s] {text}")
        print(f"{path}: {transcript.text}" if len(files) > 1 or args.partials else transcript.text)
    sys.stdout.flush()
    return 0


def print_segments(rec, files, audio) -> None:
    """Print ``[start - end] text`` for every segment of every file (the file's name first when there are several)."""
    from oasr.asr.segments import transcribe_segments

    for path, pcm in zip(files, audio, strict=True):
        for seg in transcribe_segments(rec, pcm):
            line = f"[{seg.start:8.2f} s - {seg.end:8.2f} s] {seg.text}"
            print(f"{path} {line}" if len(files) > 1 else line)
    sys.stdout.flush()


def audio_extensions() -> set:
    """File name endings taken as audio inside a directory: libsndfile's formats (and a few aliases)."""
    import soundfile as sf

    return {"." + name.lower() for name in sf.available_formats()} | {".aif", ".aifc", ".oga", ".opus", ".snd"}


def expand(parser, paths) -> list:
    """``paths`` with every directory replaced by the audio files directly inside it, in name order."""
    out = []
    for path in paths:
        folder = Path(path)
        if not folder.is_dir():
            out.append(path)
            continue
        endings = audio_extensions()
        found = sorted(str(p) for p in folder.iterdir() if p.is_file() and p.suffix.lower() in endings)
        if not found:
            parser.error(f"{path}: a directory with no audio files in it (looked for {', '.join(sorted(endings))})")
        out += found
    return out
