"""``python -m oasr.serve.ray``: the shipped clips over the engines, every stream moved once."""

from __future__ import annotations

import ray
from ray import serve

from oasr.serve.ray.app import deploy, start_local


def main(argv: list[str] | None = None) -> int:
    """Stream shipped clips through ``num_engines`` engines, move every stream once mid-utterance, and compare
    each transcript with ``Recognizer.transcribe`` of the same clip; prints the timings. Exit 0 when all match."""
    import argparse
    import time

    import numpy as np
    import torch

    from oasr.asr.audio import load_audio
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset

    parser = argparse.ArgumentParser(prog="python -m oasr.serve.ray", description=main.__doc__)
    parser.add_argument("--engines", type=int, default=2, help="engine deployments (default 2)")
    parser.add_argument("--engine-cpus", type=float, default=0.5, help="CPUs Ray reserves per engine (CPU only)")
    parser.add_argument("--gpus", action="store_true", help="one GPU per engine (num_gpus=1), recognizers on cuda")
    parser.add_argument("--clips", type=int, default=8, help="shipped clips, one stream each (default 8)")
    parser.add_argument("--max-streams", type=int, default=8, help="stream slots per engine (default 8)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    parser.add_argument("--address", default=None, help="connect to this Ray cluster instead of starting one")
    args = parser.parse_args(argv)
    for name in ("engines", "clips", "max_streams"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.engine_cpus > 0:
        parser.error(f"--engine-cpus must be > 0, got {args.engine_cpus}")
    torch.set_num_threads(1)
    clips = load_testset(limit=args.clips)
    pcm = [load_audio(clip.path) for clip in clips]
    offline = [t.text for t in Recognizer(max_streams=args.max_streams).transcribe(pcm)]

    t0 = time.perf_counter()
    if args.address:
        ray.init(address=args.address)
        serve.start(proxy_location="Disabled")
    else:
        start_local(num_cpus=args.num_cpus)
    t1 = time.perf_counter()
    try:
        streams = deploy(args.engines, gpus=args.gpus, engine_cpus=args.engine_cpus,
                         recognizer_options={"max_streams": args.max_streams})
        t2 = time.perf_counter()
        ids = [streams.open_stream() for _ in clips]
        piece = 5120  # 0.32 s
        halves = [len(x) // 2 for x in pcm]
        for sid, x, half in zip(ids, pcm, halves, strict=True):
            for at in range(0, half, piece):
                streams.accept(sid, x[at : min(at + piece, half)])
        moves, move_s = [], []
        for sid in ids:
            t = time.perf_counter()
            moves.append(streams.migrate(sid))
            move_s.append(time.perf_counter() - t)
        for sid, x, half in zip(ids, pcm, halves, strict=True):
            for at in range(half, len(x), piece):
                streams.accept(sid, x[at : min(at + piece, len(x))])
            streams.end(sid)
        results = [streams.result(sid) for sid in ids]
        t3 = time.perf_counter()
    finally:
        serve.shutdown()
        if not args.address:
            ray.shutdown()
    same = [r["text"] == text for r, text in zip(results, offline, strict=True)]
    for clip, move, r, ok in zip(clips, moves, results, same, strict=True):
        print(f"{clip.id}  {move['from']} -> {move['to']}  {move['bytes'] / 1024:6.1f} KiB  "
              f"{'same' if ok else 'DIFFERS'}  {r['text']}")
    kib = np.array([m["bytes"] for m in moves]) / 1024
    ms = np.array(move_s) * 1e3
    print(f"Ray and Serve up in {t1 - t0:.1f} s; {args.engines} engines deployed in {t2 - t1:.1f} s; "
          f"{len(ids)} streams, each moved once mid-utterance, done in {t3 - t2:.1f} s")
    print(f"sessions {kib.mean():.1f} KiB mean, {kib.max():.1f} KiB max; a move takes {np.median(ms):.0f} ms median, "
          f"{ms.max():.0f} ms max (suspend, transfer, resume, through the router)")
    print(f"{sum(same)}/{len(same)} transcripts equal Recognizer.transcribe of the same clip")
    return 0 if all(same) else 1


if __name__ == "__main__":
    raise SystemExit(main())
