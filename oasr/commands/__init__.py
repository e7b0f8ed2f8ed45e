"""The command line's shared parts: a parser whose usage errors are one line, and option checks.

Every command checks all of its options right after parsing, before any work
(no model built, no kernel compiled): a bad option ends the command with one
line on stderr, ``<prog>: error: <what was expected, what came>``, and exit
status 2, as argparse does for an option of the wrong type.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

_MARKUP = re.compile(r"``(.*?)``")


def invoked_as() -> str:
    """How the command line was started: ``oasr`` (the installed script) or ``python -m oasr``."""
    return "oasr" if os.path.basename(sys.argv[0]) in ("oasr", "oasr.exe") else "python -m oasr"


def plain(text: str) -> str:
    """``text`` without reStructuredText's double backquotes (docstrings reused as help)."""
    return _MARKUP.sub(r"\1", text)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` to an option's help, unless the help states its default, the option is
    required or its default is None (then the help must say in words what happens without it)."""

    def _get_help_string(self, action):
        text = plain(action.help or "")
        if "(default" in text or action.required or action.default is None:
            return text
        action.help = text
        return super()._get_help_string(action)

    def _format_text(self, text):
        return super()._format_text(plain(text))


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that shows every default in ``--help`` and reports a usage error in one line.

    A ``prog`` starting ``python -m oasr`` names the command as it was invoked (``oasr X`` from the
    installed script).
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        prog = kwargs.get("prog")
        if prog and prog.startswith("python -m oasr"):
            kwargs["prog"] = invoked_as() + prog[len("python -m oasr"):]
        super().__init__(**kwargs)

    def error(self, message: str):
        """Exit with status 2 and one line on stderr: ``<prog>: error: <message> (see --help)``."""
        one_line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {one_line} (see --help)\n")


def check_at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, lows: dict) -> None:
    """Each ``args.<name>`` must be an int ``>= lows[name]``; the option is named as typed."""
    for name, low in lows.items():
        value = getattr(args, name)
        if value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def check_device(parser: argparse.ArgumentParser, device: str, option: str = "--device") -> None:
    """``cpu``, or ``cuda``/``cuda:N`` with torch seeing that CUDA device."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        parser.error(f"{option} must be cpu or cuda[:N], got {device!r}")
    if parsed.type not in ("cpu", "cuda"):
        parser.error(f"{option} must be cpu or cuda[:N], got {device!r}")
    if parsed.type == "cuda":
        if not torch.backends.cuda.is_built():
            parser.error(f"{option} {device}: this torch ({torch.__version__}) is a CPU build, without CUDA")
        count = torch.cuda.device_count()
        if count == 0:
            parser.error(f"{option} {device}: torch sees no CUDA device")
        if parsed.index is not None and parsed.index >= count:
            parser.error(f"{option} {device}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def check_output_path(parser: argparse.ArgumentParser, path: str, option: str) -> None:
    """The file can be written: its directory exists and is writable (so a long run does not fail at its end)."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{option} {path}: is a directory, expected a file path")
    if not os.path.isdir(directory):
        parser.error(f"{option} {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        parser.error(f"{option} {path}: directory {directory} is not writable")


def device_memory_bytes(device: str) -> int:
    """Physical memory of the device the caches go on: host RAM for cpu, the GPU's for cuda."""
    import torch

    parsed = torch.device(device)
    if parsed.type == "cuda":
        return torch.cuda.get_device_properties(parsed.index or 0).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(parser: argparse.ArgumentParser, needed: int, device: str, what: str) -> None:
    """Refuse a run whose up-front allocations alone would take more than half the device's memory."""
    from oasr.cache.memory import format_bytes

    available = device_memory_bytes(device)
    if needed > available // 2:
        parser.error(f"{what} would allocate {format_bytes(needed)} up front, more than half of this "
                     f"{device}'s {format_bytes(available)}")
