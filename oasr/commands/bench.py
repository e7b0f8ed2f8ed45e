"""``python -m oasr bench``: reference against fast, as ratios measured in one run."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys

import torch
from tqdm import tqdm

from oasr.bench import fix_malloc_thresholds, format_table, with_ratio
from oasr.commands import CommandParser, check_at_least, check_device, check_output_path

# name -> (module, function, takes a device argument)
SECTIONS = {
    "bookkeeping": ("oasr.bench.cache", "section_bookkeeping", False),
    "attention": ("oasr.bench.attention", "section", True),
    "stream_cost": ("oasr.bench.stream_cost", "section", False),
    "ctc": ("oasr.bench.ctc", "section", False),
    "word_search": ("oasr.bench.word_search", "section", False),  # lexicon + word bigram search, the recipe LM
    "fp8": ("oasr.bench.fp8", "section", True),
    "kv_formats": ("oasr.bench.kv_formats", "section", True),
    "launcher": ("oasr.bench.launcher", "section", True),  # the attention launcher's host us per call
    "graphs": ("oasr.bench.graphs", "section", True),  # CUDA only: one "skipped" row on the CPU
    "decoder": ("oasr.bench.decoder", "section", True),
    "shared_pages": ("oasr.bench.shared_pages", "section", True),
    "accuracy": ("oasr.bench.accuracy", "section", True),  # WER per cache choice (the trained model)
    "speech": ("oasr.bench.speech", "section", True),  # RTF and latency at 1/8/64 live streams, training speed
    "serve": ("oasr.bench.serve", "section", True),  # python -m oasr serve under the openai client and live clients
    "capacity": ("oasr.bench.capacity", "section", True),  # live streams held at real time within a latency budget
    "serve_load": ("oasr.bench.serve_load", "section", True),  # WebSocket clients python -m oasr serve holds
}


# Measured (2026-12-04, every section's quick grid timed alone, on a 2-core CPU shared with other jobs: 4 min
# wall, 35 s of this process's CPU): speech 50 s (it plays its clips in real time), attention 16 s, serve 12 s,
# accuracy 11 s, ctc 5 s, the rest a few seconds each; kv_formats compiles its emulated kernels on first use
# (140 s wall, then cached in ~/.cache/oasr/kernels/emu). Unloaded, about two minutes.
QUICK_HELP = ("a reduced grid; all sections take about 2 minutes on a 2-core CPU (4 on a loaded one), most of it "
              "the speech section, whose clips play in real time (~50 s), and on first use the kv_formats kernel "
              "compile (~2 min, cached after); --sections bookkeeping,ctc,fp8 takes about 20 s")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Every option, before any work (one line on stderr, exit status 2); returns the sections to run."""
    check_at_least(parser, args, {"threads": 1})
    if not args.latency_budget_ms > 0 or args.latency_budget_ms == float("inf"):
        parser.error(f"--latency-budget-ms must be a finite number > 0, got {args.latency_budget_ms}")
    if args.time_budget_s is not None and not 0 < args.time_budget_s < float("inf"):
        parser.error(f"--time-budget-s must be a finite number > 0, got {args.time_budget_s}")
    if args.time_budget_s is not None and args.capacity_model == "shipped":
        parser.error("--time-budget-s applies to a Nemotron --capacity-model, not the shipped model")
    args.lookahead_list = None
    if args.lookaheads is not None:
        from oasr.bench.capacity_nemotron import MODELS

        if args.capacity_model == "shipped":
            parser.error("--lookaheads applies to a Nemotron --capacity-model, not the shipped model")
        trained = MODELS[args.capacity_model]["lookaheads"]
        try:
            args.lookahead_list = [int(x) for x in args.lookaheads.split(",") if x.strip()]
        except ValueError:
            parser.error(f"--lookaheads must be comma-separated ints, got {args.lookaheads!r}")
        bad = [a for a in args.lookahead_list if a not in trained]
        if bad or not args.lookahead_list:
            parser.error(f"--lookaheads: {bad or args.lookaheads!r} not among {args.capacity_model}'s trained "
                         f"{','.join(map(str, trained))}")
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        parser.error(f"--sections: unknown or no section(s) {unknown or args.sections!r}; choose from {list(SECTIONS)}")
    check_device(parser, args.device)
    if args.json not in (None, "-"):
        check_output_path(parser, args.json, "--json")
    return names


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m oasr bench`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = CommandParser(prog="python -m oasr bench", description=__doc__.split(": ", 1)[1])
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated sections, run in this order (reverse it to check order independence) "
                             f"(default: all, in this order: {', '.join(SECTIONS)})")
    parser.add_argument("--device", default="cpu", help="device for the sections that take one: cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: small ops on a shared 2-core machine are noisy with more)")
    parser.add_argument("--latency-budget-ms", type=float, default=250.0,
                        help="capacity and serve_load sections: the p99 chunk latency a number of live streams "
                             "(or WebSocket clients) must hold")
    parser.add_argument("--capacity-model", default="shipped",
                        choices=["shipped", "nemotron-0.6b", "nemotron-tiny"],
                        help="capacity section: the shipped model, or a Nemotron streaming transducer with random "
                             "weights, rows per lookahead (nemotron-0.6b: the full-size configuration, for a GPU; "
                             "nemotron-tiny: a small one)")
    parser.add_argument("--lookaheads", default=None, metavar="A,B",
                        help="capacity section with a Nemotron model: the lookaheads to measure (default: every one "
                             "the configuration was trained with, 13,6,1,0 for nemotron-0.6b)")
    parser.add_argument("--time-budget-s", type=float, default=None, metavar="S",
                        help="capacity section with a Nemotron model: start no run that would end past S seconds "
                             "and keep the rows so far (default: no limit)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="also write all rows as JSON to PATH; without PATH the JSON alone goes to stdout "
                             "and the tables to stderr (default: not written)")
    args = parser.parse_args(argv)
    names = _check_args(parser, args)

    # --json without a path: stdout carries the JSON alone (pipe it to a file or jq); everything else,
    # the tables included, goes to stderr.
    report = contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext()
    with report:
        all_rows = _run(args, names)
    if args.json:
        text = json.dumps(all_rows, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as handle:
                handle.write(text + "\n")
    return 0


def _run(args: argparse.Namespace, names: list[str]) -> list[dict]:
    """Run the sections in order, printing each one's table as it finishes; returns all rows."""
    torch.set_num_threads(args.threads)
    print(f"bench: {args.threads} torch thread(s); CPU rows timed in process CPU time; {fix_malloc_thresholds()}")
    all_rows = []
    for name in tqdm(names, desc="bench", unit="section", file=sys.stderr):
        module_name, function, takes_device = SECTIONS[name]
        section = getattr(importlib.import_module(module_name), function)
        extra = {"latency_budget_ms": args.latency_budget_ms} if name in ("capacity", "serve_load") else {}
        if name == "capacity":
            extra.update(model=args.capacity_model, lookaheads=args.lookahead_list, time_budget_s=args.time_budget_s)
        rows = section(args.quick, args.device, **extra) if takes_device else section(args.quick)
        rows = with_ratio(rows)
        all_rows += rows
        notes = getattr(importlib.import_module(module_name), "NOTES", "")
        tqdm.write(f"\n== {name} ==  (ratio = reference_ms / fast_ms)\n{format_table(rows)}"
                   + (f"\nnotes: {notes}" if notes else ""), file=sys.stdout)
    return all_rows
