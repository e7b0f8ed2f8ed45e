"""``python -m oasr serve``: the recognizer behind an HTTP and WebSocket server (FastAPI on uvicorn).

OpenAI's transcription API at ``POST /v1/audio/transcriptions`` (the official ``openai`` client
works with only ``base_url`` changed), live audio over ``WebSocket /v1/realtime``, ``GET /health``
and ``GET /metrics`` (Prometheus). One thread owns the engine; a request that finds every stream
slot taken waits ``--admit-timeout`` seconds, then gets 503 with ``Retry-After``. On SIGTERM or
Ctrl-C the live streams are suspended into ``--state-dir``; a server started again on the same
directory resumes each one when its client reconnects with the stream id (docs/serving.md). With
``--state-dir`` every live stream is also checkpointed there every ``--checkpoint-every`` seconds,
so a stream survives a crash (SIGKILL, out of memory) too, from its last checkpoint.
"""

from __future__ import annotations

import os
import tempfile

from oasr.commands import CommandParser
from oasr.commands.asr_options import (
    add_model_options,
    check_model_options,
    is_transducer,
    recognizer,
    transducer_recognizer,
)

DEFAULT_CHECKPOINT_EVERY = 5.0  # seconds, with --state-dir


def build_parser() -> CommandParser:
    """The parser of ``python -m oasr serve``, every option with its default."""
    parser = CommandParser(prog="python -m oasr serve", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    parser.add_argument("--admit-timeout", type=float, default=5.0,
                        help="seconds a request waits for a free stream slot before 503 + Retry-After")
    parser.add_argument("--state-dir", default=None,
                        help="directory for suspended streams: written at shutdown, resumed on reconnect "
                             "(default: none; live streams are dropped at shutdown)")
    parser.add_argument("--checkpoint-every", type=float, default=None,
                        help=f"seconds between checkpoints of each live stream in --state-dir, so a stream "
                             f"survives a crash of the server; 0: off (default: {DEFAULT_CHECKPOINT_EVERY:g} with "
                             f"--state-dir, off without)")
    parser.add_argument("--shutdown-timeout", type=float, default=60.0,
                        help="seconds from SIGTERM or Ctrl-C to the end of the process, whatever the engine "
                             "does (streams not saved by then are lost; their last checkpoints stay)")
    parser.add_argument("--max-audio-seconds", type=float, default=300.0,
                        help="longest upload or live stream taken, in seconds of audio")
    parser.add_argument("--max-upload-mb", type=float, default=64.0, help="largest upload taken, in MiB")
    parser.add_argument("--model-name", default="oasr", help="the model name the API reports")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level")
    add_model_options(parser, streams_default=64)
    return parser


def check_args(parser: CommandParser, args) -> None:
    """Every option, before any work (one line on stderr, exit status 2 for a bad one)."""
    check_model_options(parser, args)
    if args.full_context:
        parser.error("the server streams; --full-context is for the eval command")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if not args.admit_timeout >= 0:
        parser.error(f"--admit-timeout must be >= 0 seconds, got {args.admit_timeout}")
    if not args.max_audio_seconds > 0:
        parser.error(f"--max-audio-seconds must be > 0, got {args.max_audio_seconds}")
    if not args.max_upload_mb > 0:
        parser.error(f"--max-upload-mb must be > 0, got {args.max_upload_mb}")
    if not args.shutdown_timeout > 0:
        parser.error(f"--shutdown-timeout must be > 0 seconds, got {args.shutdown_timeout}")
    if args.checkpoint_every is not None and not args.checkpoint_every >= 0:
        parser.error(f"--checkpoint-every must be >= 0 seconds (0: off), got {args.checkpoint_every}")
    if args.checkpoint_every and args.state_dir is None:
        parser.error("--checkpoint-every writes into --state-dir: give one")
    if args.state_dir is not None:
        check_state_dir(parser, args.state_dir)


def check_state_dir(parser: CommandParser, state_dir: str) -> None:
    """The state directory exists (created here if need be) and takes a file (usage error otherwise)."""
    if os.path.exists(state_dir) and not os.path.isdir(state_dir):
        parser.error(f"--state-dir {state_dir}: exists and is not a directory")
    try:
        os.makedirs(state_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=state_dir, prefix=".oasr-probe-"):
            pass
    except OSError as exc:
        parser.error(f"--state-dir {state_dir}: not a writable directory ({exc.strerror or exc})")


def main(argv=None) -> int:
    """Run ``python -m oasr serve`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        import uvicorn

        from oasr.serve.app import OasrServer, ServeOptions, create_app
        from oasr.serve.worker import EngineWorker
    except ImportError as exc:
        parser.error(f"the server needs the serve extra (pip install 'oasr[serve]'): {exc}")
    if is_transducer(args):  # a Nemotron checkpoint directory: its recognizer behind the same stream API
        from oasr.asr.transducer_serving import ServedTransducer

        rec = ServedTransducer(transducer_recognizer(args, parser))
    else:
        rec = recognizer(args, max_seconds=args.max_audio_seconds)
    every = args.checkpoint_every
    if every is None:
        every = DEFAULT_CHECKPOINT_EVERY if args.state_dir is not None else 0.0
    worker = EngineWorker(rec, admit_timeout=args.admit_timeout, state_dir=args.state_dir,
                          checkpoint_every=every or None)
    options = ServeOptions(model_name=args.model_name, max_audio_seconds=args.max_audio_seconds,
                           max_upload_bytes=int(args.max_upload_mb * (1 << 20)))
    app = create_app(worker, options)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, ws="websockets-sansio",
                            timeout_graceful_shutdown=30)
    saved = worker.saved_sessions()
    print(f"oasr serve: {rec.twin} twin on {args.device}, {worker.max_streams} stream slots, {rec.execution_note}"
          + (f"; {len(saved)} suspended stream(s) in {args.state_dir} wait for their clients" if saved else ""),
          flush=True)
    OasrServer(config, announce=True, exit_deadline=args.shutdown_timeout).run()
    return 0
