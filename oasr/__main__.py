"""``python -m oasr <command>`` (or ``oasr <command>``): demo (the main job), transcribe, eval, train, bench,
kernels, formats, engine-demo, serve; ``--version``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def _regular_package() -> None:
    """Make ``oasr`` the package this file belongs to when Python took a folder named ``oasr`` for it.

    From the folder that holds a clone named ``oasr``, ``python -m oasr`` finds the clone itself first
    (the working directory leads ``sys.path``) and imports it as an empty namespace package: the real
    package's modules still load (through the install's finder), but ``oasr`` lacks its own names
    (``__version__``). Put the real package in its place before anything else is imported. (The
    package finds its assets from its own files, so nothing else depends on how it was imported.)
    """
    package = sys.modules.get("oasr")
    if package is None or getattr(package, "__file__", None) is not None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("oasr", os.path.join(here, "__init__.py"),
                                                  submodule_search_locations=[here])
    real = importlib.util.module_from_spec(spec)
    sys.modules["oasr"] = real
    spec.loader.exec_module(real)


_regular_package()

COMMANDS = {
    "demo": ("oasr.commands.speech_demo", "live streams of the shipped clips, transcribed (the main job)"),
    "transcribe": ("oasr.commands.transcribe", "stream audio files through the engine and print their text"),
    "eval": ("oasr.commands.evaluate", "word and character error rates on the shipped test set"),
    "train": ("oasr.commands.train", "the training recipe: synthesize speech, train, export the model"),
    "bench": ("oasr.commands.bench", "reference against fast, as ratios measured in one run"),
    "kernels": ("oasr.commands.kernels", "compile every CUDA kernel with NVRTC and report resources"),
    "formats": ("oasr.commands.formats", "the K/V page formats: bytes, and what serves them on this machine"),
    "engine-demo": ("oasr.commands.demo", "the engine on a seeded random model: every cache option (eviction, "
                    "prefill, fp8, sessions)"),
    "serve": ("oasr.commands.serve", "an HTTP/WebSocket server: OpenAI's transcription API, live audio, metrics"),
}


def usage() -> str:
    """The top-level help: one line per command, the names in a column wide enough for the longest."""
    from oasr.commands import invoked_as

    width = max(map(len, COMMANDS)) + 2
    lines = [f"usage: {invoked_as()} COMMAND [options]   ({invoked_as()} COMMAND --help: its options; --version)", ""]
    lines += [f"  {name:{width}s}{text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one command with its options (``argv`` defaults to the process's); returns the exit status.

    ``--help`` prints the commands on stdout (exit 0); no command prints them on stderr (exit 2), as an
    unknown command's one-line error does.
    """
    from oasr.commands import invoked_as

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from oasr import __version__

        print(f"oasr {__version__}")
        return 0
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv:
        print(usage() + f"\n\n{invoked_as()}: error: no command given", file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        print(f"{invoked_as()}: error: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)} "
              "(see --help)", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
