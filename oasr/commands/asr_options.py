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
                        help="a model checkpoint (.safetensors) (default: the model shipped with the package)")
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
    parser.add_argument("--max-streams", type=int, default=streams_default, help="concurrent streams")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def check_model_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the shared options before any work (one line on stderr and exit 2 for a bad one)."""
    check_at_least(parser, args, {"beam": 1, "max_streams": 1, "threads": 1})
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.num_left_chunks is not None and args.num_left_chunks < -1:
        parser.error(f"--num-left-chunks must be -1 (unlimited) or >= 0, got {args.num_left_chunks}")
    if args.full_context and (args.chunk_size is not None or args.num_left_chunks is not None):
        parser.error("--full-context encodes whole utterances; it takes no --chunk-size or --num-left-chunks")
    if args.full_context and args.kv_cache_dtype:
        parser.error("--full-context uses no K/V cache, so --kv-cache-dtype has nothing to store")
    check_device(parser, args.device)
    if args.model is not None:
        check_model_file(parser, args.model)


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

    torch.set_num_threads(args.threads)
    return Recognizer(args.model, twin=args.twin, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                      chunk_size=args.chunk_size, num_left_chunks=args.num_left_chunks, rescore=args.rescore,
                      full_context=args.full_context, beam_size=args.beam, max_streams=args.max_streams, **extra)


def configuration(args: argparse.Namespace, rec) -> dict:
    """The configuration a result was measured under, with the model's defaults filled in."""
    cfg = rec.encoder.config
    streaming = not args.full_context
    return {"model": str(Path(args.model)) if args.model else "shipped", "twin": args.twin, "device": args.device,
            "kv_cache_dtype": args.kv_cache_dtype or "model", "chunk_size": cfg.chunk_size if streaming else None,
            "num_left_chunks": cfg.num_left_chunks if streaming else None, "rescore": args.rescore,
            "full_context": args.full_context, "beam": args.beam}
