"""``python -m oasr demo``: many concurrent live streams of the shipped test clips, transcribed.

The clips are played as live sources: each stream starts at its own time and sends its audio in
``--piece-ms`` pieces at real time (``--no-realtime`` sends them as fast as the engine takes them).
The engine batches whatever chunks are ready into one tick. At the end the demo prints a few
transcripts beside their references, the WER and CER over all clips, the real-time factor (time
spent in feature extraction and engine ticks over seconds of audio), the per-chunk latency
percentiles (from the moment a chunk's last audio sample was sent to its partial result) and what
the caches hold in memory.
"""

from __future__ import annotations

import argparse

import numpy as np

from oasr.asr.playback import play
from oasr.commands import CommandParser, check_at_least, check_output_path
from oasr.commands.asr_options import (
    add_model_options,
    check_model_options,
    configuration,
    is_transducer,
    recognizer,
    transducer_recognizer,
)


def build_parser() -> CommandParser:
    """The parser of ``python -m oasr demo``, every option with its default."""
    parser = CommandParser(prog="python -m oasr demo", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--clips", type=int, default=None, help="how many shipped clips to play (default: all)")
    parser.add_argument("--concurrency", type=int, default=24,
                        help="streams live at once on average (start times are staggered to keep this many)")
    parser.add_argument("--piece-ms", type=int, default=40, help="audio per message a live source sends")
    parser.add_argument("--realtime", action=argparse.BooleanOptionalAction, default=True,
                        help="send audio at real time (latency is meaningful only then)")
    parser.add_argument("--show", type=int, default=6, help="transcripts to print beside their references")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the numbers as JSON (default: not written)")
    parser.add_argument("--plot", default="oasr_demo_streams.png", metavar="PATH",
                        help="plot of the run over time: live streams, pool blocks in use, chunk latency "
                             "(.png, .pdf or .svg; '' for none)")
    add_model_options(parser, streams_default=32)
    return parser


def memory_lines(rec) -> list[str]:
    """The run's memory lines: the caches by component and the pool's peak occupancy."""
    from oasr.cache.memory import bytes_per_kv_block, footprint, format_bytes

    engine, cfg = rec.engine, rec.cache_config
    fp = footprint(cfg, scratch_blocks=1, pad_lanes=1)
    peak = max(engine.stats, key=lambda s: s.used_blocks)
    window = "unlimited" if cfg.num_left_chunks < 0 else f"{cfg.num_left_chunks} chunks"
    per_frame = bytes_per_kv_block(cfg) / cfg.block_size_frames
    return [
        f"memory: K/V pages {cfg.kv_cache_dtype or str(cfg.dtype).replace('torch.', '')}, "
        f"{format_bytes(bytes_per_kv_block(cfg))} per block of {cfg.block_size_frames} frames "
        f"({format_bytes(int(per_frame))} per 40 ms frame, all {cfg.num_layers} layers), left window {window}",
        f"  peak pool use {peak.used_blocks}/{cfg.max_num_blocks} blocks "
        f"({format_bytes(int(peak.used_blocks * bytes_per_kv_block(cfg)))}) with {peak.active} streams active",
        fp.format(),
    ]


def plot_run(run: dict, pool_blocks: int, path: str, title: str) -> None:
    """Three panels over the run's clock: streams held, pool blocks in use (of ``pool_blocks``), chunk latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, streams, blocks = zip(*run["timeline"], strict=True) if run["timeline"] else ((), (), ())
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    top.step(t, streams, where="post")
    top.set_ylabel("live streams")
    middle.step(t, [100 * b / pool_blocks for b in blocks], where="post", color="tab:orange")
    middle.set_ylabel(f"pool blocks in use\n(% of {pool_blocks})")
    if run["latencies"]:
        lt, lat = zip(*run["latencies"], strict=True)
        bottom.scatter(lt, [1000 * x for x in lat], s=4, alpha=0.4, color="tab:green")
    bottom.set_ylabel("chunk latency (ms)")
    bottom.set_xlabel("seconds since the first stream started")
    for ax in (top, middle, bottom):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def transducer_demo(args, parser, clips, audio) -> int:
    """``demo --model DIR``: the shipped clips through a Nemotron checkpoint (its lookahead and chunk duration,
    the trained ones, the transcripts beside their references, WER and real-time factor)."""
    import time

    from oasr.asr.metrics import error_rates

    rec = transducer_recognizer(args, parser)
    la = rec.lookaheads
    params = sum(p.numel() for p in rec.encoder.model.parameters()) if hasattr(rec.encoder, "model") else 0
    print(f"oasr demo: {len(clips)} clips through {args.model} ({params:,}-parameter encoder + "
          f"{sum(p.numel() for p in rec.head.parameters()):,}-parameter transducer), twin {args.twin}")
    print(f"  lookahead {rec.lookahead}: {la.latency_seconds(rec.lookahead) * 1000:.0f} ms chunks; trained: "
          f"{la.describe()}")
    t0 = time.perf_counter()
    transcripts = rec.transcribe(audio, piece_seconds=args.piece_ms / 1000)
    wall = time.perf_counter() - t0
    for clip, t in list(zip(clips, transcripts, strict=True))[: args.show]:
        print(f"   {clip.id} {t.text}\n   {' ' * len(clip.id)} reference: {clip.text}")
    rates = error_rates([c.text for c in clips], [t.text for t in transcripts])
    seconds = sum(len(a) for a in audio) / 16000
    print(f"accuracy: WER {100 * rates['wer']:.2f}%, CER {100 * rates['cer']:.2f}% over {len(clips)} clips; "
          f"speed: real-time factor {wall / seconds:.3f} ({wall:.1f} s for {seconds:.1f} s of audio)")
    return 0


def main(argv=None) -> int:
    """Run ``python -m oasr demo`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_model_options(parser, args)
    check_at_least(parser, args, {"concurrency": 1, "piece_ms": 1, "show": 0})
    if args.clips is not None and args.clips < 1:
        parser.error(f"--clips must be >= 1, got {args.clips}")
    if args.full_context:
        parser.error("the demo streams; --full-context is for the eval command")
    if args.json:
        check_output_path(parser, args.json, "--json")
    if args.plot:
        check_output_path(parser, args.plot, "--plot")
        if not args.plot.lower().endswith((".png", ".pdf", ".svg")):
            parser.error(f"--plot {args.plot}: the plot is written as .png, .pdf or .svg, by the path's suffix; "
                         "give a path ending in one of them ('' for no plot)")
    from oasr.asr.audio import load_audio
    from oasr.asr.metrics import error_rates
    from oasr.asr.testset import load_testset

    clips = load_testset(limit=args.clips)
    audio = [load_audio(c.path) for c in clips]
    if is_transducer(args):
        return transducer_demo(args, parser, clips, audio)
    rec = recognizer(args)
    cfg = rec.encoder.config
    print(f"demo: {args.threads} torch thread(s)")
    print(f"oasr demo: {len(clips)} held-out clips ({sum(map(len, audio)) / 16000:.0f} s of speech, voices and "
          f"sentences never trained on) as live streams, ~{args.concurrency} at once, {args.piece_ms} ms pieces"
          f"{' in real time' if args.realtime else ', as fast as possible'}")
    print(f"  model: {sum(p.numel() for p in rec.encoder.parameters()):,}-parameter streaming Conformer "
          f"({cfg.num_layers} layers) + {sum(p.numel() for p in rec.decoder.parameters()):,}-parameter attention "
          f"decoder; chunk {cfg.chunk_size} frames ({cfg.chunk_size * 40} ms), left context "
          f"{'unlimited' if cfg.num_left_chunks < 0 else f'{cfg.num_left_chunks} chunks'}; twin {rec.twin}; "
          f"{rec.execution_note}")
    transcripts, run = play(rec, audio, args.concurrency, max(1, args.piece_ms * 16), args.realtime)
    refs = [c.text for c in clips]
    rates = error_rates(refs, [t.text for t in transcripts])
    latencies = np.array([x for t in transcripts for x in t.latencies]) * 1000
    audio_s = sum(t.audio_seconds for t in transcripts)
    print(f"transcripts (first {min(args.show, len(clips))}; * marks an error):")
    for clip, t in list(zip(clips, transcripts, strict=True))[: args.show]:
        mark = " " if t.text == clip.text else "*"
        print(f" {mark} {clip.id} [{clip.voice}] {t.text}")
        if t.text != clip.text:
            print(f"   {' ' * len(clip.id)}  reference: {clip.text}")
    first = error_rates(refs, [t.first_pass for t in transcripts])
    print(f"accuracy: WER {100 * rates['wer']:.2f}% ({rates['word_errors']}/{rates['words']} words), "
          f"CER {100 * rates['cer']:.2f}%" + (f"; first pass alone WER {100 * first['wer']:.2f}%"
                                                if args.rescore else "") + f" over {len(clips)} clips")
    print(f"speed: real-time factor {rec.busy_seconds / audio_s:.3f} (compute {rec.busy_seconds:.2f} s for "
          f"{audio_s:.1f} s of audio; wall {run['wall_seconds']:.1f} s), peak {run['peak_streams']} streams held, "
          f"{rec.engine.tick} ticks")
    if len(latencies):
        p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
        print(f"latency per chunk (last sample sent -> partial result, {len(latencies)} chunks): p50 {p50:.1f} ms, "
              f"p95 {p95:.1f} ms, p99 {p99:.1f} ms" + ("" if args.realtime else " (not real time: queueing only)"))
    for line in memory_lines(rec):
        print(line)
    if args.plot:
        plot_run(run, rec.cache_config.max_num_blocks, args.plot,
                 f"oasr demo: {len(clips)} clips, ~{args.concurrency} live at once"
                 + ("" if args.realtime else " (not real time)"))
        print(f"plot: {args.plot}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({**{k: v for k, v in rates.items()}, "rtf": rec.busy_seconds / audio_s,
                       "latency_ms": dict(zip(("p50", "p95", "p99"), map(float, np.percentile(latencies, [50, 95, 99])),
                                              strict=True)) if len(latencies) else None,
                       **{k: v for k, v in run.items() if k not in ("timeline", "latencies")},
                       "configuration": configuration(args, rec)}, f, indent=1)
    return 0
