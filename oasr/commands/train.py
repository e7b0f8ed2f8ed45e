"""``python -m oasr train``: the recipe that made the shipped model, end to end and resumable.

Steps, each skipped when its output exists (so a rerun resumes): synthesize ``--shards`` training
shards with espeak-ng (in ``--workers`` processes), train for ``--steps`` (``WORK/state.pt`` is
saved every 200 steps), export ``WORK/model.safetensors`` (the EMA weights, CMVN, tokenizer and
geometry) and print its held-out WER. Needs ``espeak-ng`` (Debian package) for the synthesis.
"""

from __future__ import annotations

import shutil
import time
from multiprocessing import Pool
from pathlib import Path

from oasr.commands import CommandParser, check_at_least


def build_parser() -> CommandParser:
    """The parser of ``python -m oasr train``, every option with its default."""
    parser = CommandParser(prog="python -m oasr train", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--work", required=True, help="working directory (shards, state, exported model)")
    parser.add_argument("--shards", type=int, default=12, help="training shards to synthesize")
    parser.add_argument("--extra-voice-shards", type=int, default=6,
                        help="more training shards after those, spoken by the base and a wider second voice set")
    parser.add_argument("--shard-size", type=int, default=2000, help="utterances per shard")
    parser.add_argument("--steps", type=int, default=24000, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1.2e-3, help="peak learning rate (warmup 400 steps, then cosine)")
    parser.add_argument("--seed", type=int, default=2026, help="seed of the data and the model")
    parser.add_argument("--workers", type=int, default=2, help="synthesis processes")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for training")
    parser.add_argument("--max-frames", type=int, default=3000,
                        help="padded feature frames per batch (3000: about 9 utterances; on a CPU more, smaller "
                             "steps learned faster than fewer large ones)")
    parser.add_argument("--serving-share", type=float, default=0.4,
                        help="share of batches trained at the serving chunk and left context (the rest: full "
                             "context or a random chunking)")
    return parser


def _shard(job):
    from oasr.asr.data import make_shard

    directory, index, size, seed, more_voices = job
    t0 = time.time()
    make_shard(directory, index, size, seed, more_voices=more_voices)
    return index, time.time() - t0


def main(argv=None) -> int:
    """Run ``python -m oasr train`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_at_least(parser, args, {"shards": 1, "extra_voice_shards": 0, "shard_size": 1, "steps": 1, "workers": 1,
                                  "threads": 1, "max_frames": 1000})
    if not 0.0 <= args.serving_share < 1.0:
        parser.error(f"--serving-share must be in [0, 1), got {args.serving_share}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if shutil.which("espeak-ng") is None:
        parser.error("the recipe synthesizes speech with espeak-ng, which is not installed "
                     "(Debian: apt-get install espeak-ng)")
    import torch

    from oasr.asr.checkpoint import save_checkpoint
    from oasr.asr.data import make_shard
    from oasr.asr.train import train

    work = Path(args.work)
    (work / "train").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    jobs = [(work / "train", i, args.shard_size, args.seed, i >= args.shards)
            for i in range(args.shards + args.extra_voice_shards)]
    with Pool(args.workers) as pool:
        for index, seconds in pool.imap_unordered(_shard, jobs):
            print(f"shard {index}: {args.shard_size} utterances in {seconds:.0f} s", flush=True)
    make_shard(work / "dev", 0, 150, args.seed + 1, held_out=True)
    synth_seconds = time.time() - t0
    torch.set_num_threads(args.threads)
    out = train(work, args.steps, seed=args.seed, max_frames=args.max_frames, lr=args.lr, dev_dir=work / "dev",
                serving_share=args.serving_share, log=lambda s: print(s, flush=True))
    params = sum(p.numel() for m in (out["encoder"], out["decoder"]) for p in m.parameters())
    info = {"steps": out["step"], "train_seconds": round(out["seconds"]), "synth_seconds": round(synth_seconds),
            "utterances": (args.shards + args.extra_voice_shards) * args.shard_size, "seed": args.seed,
            "threads": args.threads, "parameters": params, "serving_share": args.serving_share,
            "schedule": f"warmup 400 steps, then a cosine from lr {args.lr:g} to 5% of it at step {args.steps}; "
                        f"batches of at most {args.max_frames} padded frames"}
    save_checkpoint(work / "model.safetensors", out["encoder"], out["decoder"], out["spec"], out["cmvn"], info,
                    weights="float16")  # half the file; the shipped model's WER is measured on these weights
    print(f"recipe: synthesis {synth_seconds / 60:.1f} min, training {out['seconds'] / 60:.1f} min "
          f"({out['step']} steps, {args.threads} threads)", flush=True)
    print(f"exported {work / 'model.safetensors'}; evaluate it with: python -m oasr eval --model "
          f"{work / 'model.safetensors'}")
    return 0
