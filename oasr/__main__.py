"""``python -m oasr <command>``: demo (the main job), bench, kernels, formats."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("oasr.commands.demo", "run the streaming demo (the main job)"),
    "bench": ("oasr.commands.bench", "reference against fast, as ratios measured in one run"),
    "kernels": ("oasr.commands.kernels", "compile every CUDA kernel with NVRTC and report resources"),
    "formats": ("oasr.commands.formats", "the K/V page formats: bytes, and what serves them on this machine"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        print(f"python -m oasr: error: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)} "
              "(see --help)", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m oasr {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:8s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
