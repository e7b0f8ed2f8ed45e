"""Options shared by the speech commands (demo, transcribe, eval), checked before any work."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from oasr.commands import check_at_least, check_device
from oasr.kv_formats import FORMAT_NAMES


def _shipped_chunking() -> tuple:
    """The shipped model's serving chunk and window, from its header (``?`` where it cannot be read)."""
    from oasr.asr.checkpoint import serving_chunking

    try:
        return serving_chunking()
    except (OSError, ValueError, KeyError):
        return "?", "?"


def add_model_options(parser: argparse.ArgumentParser, streams_default: int = 16) -> None:
    """Add the options every speech command shares (model, twin, device, streaming geometry, decoding, threads)."""
    parser.add_argument("--model", default=None,
                        help="a model checkpoint (.safetensors), or a Nemotron streaming checkpoint directory "
                             "(Hugging Face layout, read locally) (default: the model shipped with the package)")
    parser.add_argument("--lookahead", type=int, default=None,
                        help="with a Nemotron checkpoint directory: the trained lookahead, in encoder frames, that "
                             "sets the chunk (and latency) = (lookahead + 1) x 80 ms; the published checkpoint "
                             "trains 13, 6, 1, 0 = 1120, 560, 160, 80 ms chunks (default: the checkpoint's)")
    parser.add_argument("--twin", choices=("fast", "reference"), default="fast", help="engine twin")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--kv-cache-dtype", choices=("model", "auto", *FORMAT_NAMES[1:]), default=None,
                        help="the K/V page format (see the formats command) (default: the model dtype)")
    chunk, left = _shipped_chunking()
    parser.add_argument("--chunk-size", type=int, default=None,
                        help=f"encoder frames per chunk, 40 ms each (default: the model's; shipped: {chunk})")
    parser.add_argument("--num-left-chunks", type=int, default=None,
                        help=f"left-context window in chunks, -1 unlimited (default: the model's; shipped: {left})")
    parser.add_argument("--rescore", action="store_true",
                        help="rescore each utterance's CTC n-best with the attention decoder (second pass)")
    parser.add_argument("--full-context", action="store_true",
                        help="no streaming: encode each utterance whole with unrestricted attention")
    parser.add_argument("--beam", type=int, default=8, help="CTC prefix beam size")
    parser.add_argument("--language-model", choices=("auto", "none"), default="auto",
                        help="the word search (a lexicon and a word bigram of the training text steer the CTC search): "
                             "auto uses the one the model names (none for the rescoring pass), none the token search "
                             "alone")
    parser.add_argument("--word-beam", type=int, default=None, help="the word search's beam (default: 32)")
    parser.add_argument("--max-streams", type=int, default=streams_default, help="concurrent streams")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def check_model_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the shared options before any work (one line on stderr and exit 2 for a bad one)."""
    check_at_least(parser, args, {"beam": 1, "max_streams": 1, "threads": 1})
    if args.word_beam is not None and args.word_beam < 1:
        parser.error(f"--word-beam must be >= 1, got {args.word_beam}")
    if args.word_beam is not None and args.language_model == "none":
        parser.error("--word-beam sets the word search, which --language-model none turns off")
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.num_left_chunks is not None and args.num_left_chunks < -1:
        parser.error(f"--num-left-chunks must be -1 (unlimited) or >= 0, got {args.num_left_chunks}")
    if args.full_context and (args.chunk_size is not None or args.num_left_chunks is not None):
        parser.error("--full-context encodes whole utterances; it takes no --chunk-size or --num-left-chunks")
    if args.full_context and args.kv_cache_dtype:
        parser.error("--full-context uses no K/V cache, so --kv-cache-dtype has nothing to store")
    check_device(parser, args.device)
    if args.model is not None and os.path.isdir(args.model):
        check_transducer_options(parser, args)
    elif args.lookahead is not None:
        parser.error("--lookahead applies to a Nemotron checkpoint directory (--model DIR)")
    elif args.model is not None:
        check_model_file(parser, args.model)


def is_transducer(args: argparse.Namespace) -> bool:
    """Whether ``--model`` names a checkpoint directory (served by ``oasr.asr.transducer``)."""
    return args.model is not None and os.path.isdir(args.model)


def check_transducer_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--model DIR`` is a Nemotron checkpoint oasr reads, ``--lookahead`` one it was trained with, and no
    option it cannot serve was given (one line on stderr and exit 2 otherwise)."""
    unsupported = [flag for flag, given in (("--rescore", args.rescore), ("--full-context", args.full_context),
                                            ("--chunk-size", args.chunk_size is not None),
                                            ("--num-left-chunks", args.num_left_chunks is not None),
                                            ("--kv-cache-dtype auto", args.kv_cache_dtype == "auto"),
                                            ("--beam", args.beam != parser.get_default("beam")),
                                            ("--word-beam", args.word_beam is not None)) if given]
    if unsupported:
        parser.error(f"--model {args.model}: a transducer checkpoint does not take {', '.join(unsupported)} "
                     f"(its chunk is set by --lookahead; greedy RNN-T decoding)")
    from oasr.asr.transducer import Lookaheads
    from oasr.checkpoints import detect_format
    from oasr.models.transducer import read_hf_transducer

    try:
        fmt = detect_format(args.model)
        if fmt != "nemotron_asr_streaming":
            raise ValueError(f"{args.model}: a {fmt} checkpoint, not a Nemotron streaming (RNN-T) one")
        lookaheads = Lookaheads.from_checkpoint(args.model)
        if args.lookahead is not None:
            lookaheads.check(args.lookahead)
        read_hf_transducer(args.model)
    except ValueError as exc:
        parser.error(f"--model {str(exc).splitlines()[0]}")


def check_model_file(parser: argparse.ArgumentParser, path: str) -> None:
    """``--model``'s file exists and is a checkpoint this version reads (a usage error otherwise)."""
    from oasr.asr.checkpoint import FORMAT, read_header

    if not os.path.isfile(path):
        parser.error(f"--model {path}: no such file")
    try:
        meta = read_header(path)
    except ValueError as exc:
        parser.error(f"--model {exc}")
    if meta.get("format") != FORMAT:
        parser.error(f"--model {path}: not an oasr speech model (format {meta.get('format')!r})")


def recognizer(args: argparse.Namespace, **extra):
    """A ``Recognizer`` configured by the options, with torch set to ``--threads`` threads."""
    import torch

    from oasr.asr.recognizer import Recognizer
    from oasr.ctc.words import WordSearchConfig

    torch.set_num_threads(args.threads)
    return Recognizer(args.model, twin=args.twin, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                      chunk_size=args.chunk_size, num_left_chunks=args.num_left_chunks, rescore=args.rescore,
                      full_context=args.full_context, beam_size=args.beam, max_streams=args.max_streams,
                      language_model=None if args.language_model == "none" else "auto",
                      word_config=None if args.word_beam is None else WordSearchConfig(beam_size=args.word_beam),
                      **extra)


def transducer_recognizer(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """A ``TransducerRecognizer`` for ``--model DIR`` (after :func:`check_transducer_options`); what only building
    it can find (e.g. a page format that does not serve the model's head size) is one line and exit 2."""
    import torch

    from oasr.asr.transducer import TransducerRecognizer

    torch.set_num_threads(args.threads)
    kv = None if args.kv_cache_dtype in (None, "model") else args.kv_cache_dtype
    try:
        return TransducerRecognizer(args.model, None, args.lookahead, {"twin": args.twin},
                                    max_batch_size=args.max_streams, kv_cache_dtype=kv, device=args.device)
    except ValueError as exc:
        parser.error(f"--model {args.model}: {str(exc).splitlines()[0]}")


def configuration(args: argparse.Namespace, rec) -> dict:
    """The configuration a result was measured under, with the model's defaults filled in."""
    if is_transducer(args):
        return {"model": str(Path(args.model)), "twin": args.twin, "device": args.device,
                "lookahead": rec.lookahead, "decoder": "rnnt_greedy", "kv_cache_dtype": args.kv_cache_dtype or "model"}
    cfg = rec.encoder.config
    streaming = not args.full_context
    return {"model": str(Path(args.model)) if args.model else "shipped", "twin": args.twin, "device": args.device,
            "kv_cache_dtype": args.kv_cache_dtype or "model", "chunk_size": cfg.chunk_size if streaming else None,
            "num_left_chunks": cfg.num_left_chunks if streaming else None, "rescore": args.rescore,
            "full_context": args.full_context, "beam": args.beam,
            "language_model": None if rec.word_pass is None else rec.word_pass.spec.to_info(),
            "word_beam": None if rec.word_pass is None else rec.word_pass.search.config.beam_size}
