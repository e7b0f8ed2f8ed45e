"""``python -m oasr train``: the training recipe (synthesize, train, export), end to end and resumable.

Steps, each skipped when its output exists (so a rerun resumes): synthesize ``--shards`` training
shards with espeak-ng (in ``--workers`` processes), train for ``--steps`` (``WORK/state.pt`` is
saved every 200 steps), export ``WORK/model.safetensors`` (the EMA weights, CMVN, tokenizer and
geometry) and print its held-out WER. Needs ``espeak-ng`` (Debian package) for the synthesis.

The data (the open recipe, the default): ``--open-share`` of the sentences from the open generator
(``oasr.asr.opentext``: word sequences and free slot sequences over 52,000 words, numbers, dates, names),
the rest from the templates; every utterance through the recording conditions of
``oasr.asr.conditions`` (0-3 s silences, pauses between phrases, noise at 0-35 dB SNR, 8 kHz copies,
silence- and noise-only utterances with empty text). ``--english-shards`` more shards (16 by default) draw
half their sentences from the shipped English usage examples (``oasr.asr.opentext.english_sentences``): real
word order and sentence openings, which neither generator has. ``--random-voice-shards`` more (16 by
default) are spoken by voices drawn at random (``oasr.asr.synth.random_variant``: every utterance an espeak-ng
variant file of its own, its settings spread over the span of the training variants'), sentences as in the
English shards; with them the run also makes a *voice dev shard* (``WORK/dev_voices``: held-out English
examples by random voices) and logs its greedy WER beside the dev shard's. ``--legacy-data`` makes the
template-only shards the shipped model was trained on: ``--legacy-data --shards 12 --extra-voice-shards 6
--shard-size 2000 --steps 24000`` is that model's recipe. ``WORK/data.json`` records the data options and a
rerun with different ones is refused (its shards would mix two recipes; a record written before the English
shards existed lacks their field and still matches: those shards are unchanged).

The next model's training run (estimated at about 108 minutes on two idle CPU cores: synthesis about 23
(the 16 English shards took 6.5 of them, 16 random-voice shards about 5.5), training about 85 with its dev
checks (the 600-utterance voice dev shard about 2.5 of them), from side-by-side measurements against the
shipped recipe; see MODEL_CARD.md):

    python -m oasr train --work /tmp/oasr-train      # seeded; rerun the same line to resume

then ``python -m oasr eval --model /tmp/oasr-train/model.safetensors`` (the first held-out set) and the same
with ``--testset testset2`` (new sentence forms, voices and conditions). With a GPU:
``--device cuda --size medium`` (8.9 M parameters instead of 2.9 M; too slow for the CPU budget).
"""

from __future__ import annotations

import json
import shutil
import time
from multiprocessing import Pool
from pathlib import Path

from oasr.commands import CommandParser, check_at_least

ENGLISH_SHARE = 0.5  # of an English shard's sentences (``data.json``: ``english_share``)


def build_parser() -> CommandParser:
    """The parser of ``python -m oasr train``, every option with its default."""
    parser = CommandParser(prog="python -m oasr train", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--work", required=True, help="working directory (shards, state, exported model)")
    parser.add_argument("--shards", type=int, default=16, help="training shards to synthesize")
    parser.add_argument("--extra-voice-shards", type=int, default=8,
                        help="more training shards after those, spoken by the base and a wider second voice set")
    parser.add_argument("--english-shards", type=int, default=None,
                        help=f"English shards after those (a share of {ENGLISH_SHARE:g} of their sentences the shipped "
                             "English usage examples, the rest as in the other shards; the wider voice set); "
                             "default 16, none with --legacy-data")
    parser.add_argument("--random-voice-shards", type=int, default=None,
                        help="random-voice shards after those (each utterance spoken by an espeak-ng variant drawn "
                             "at random within the span of the training variants' settings; sentences as in the "
                             "English shards); default 16, none with --legacy-data")
    parser.add_argument("--shard-size", type=int, default=1500, help="utterances per shard")
    parser.add_argument("--steps", type=int, default=20000, help="optimizer steps")
    parser.add_argument("--open-share", type=float, default=0.6,
                        help="share of open sentences (word sequences, free forms, numbers, dates, names); the "
                             "rest from the templates")
    parser.add_argument("--legacy-data", action="store_true",
                        help="the template-only, condition-free shards of the shipped model (its recipe: with "
                             "--shards 12 --extra-voice-shards 6 --shard-size 2000 --steps 24000)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="model geometry: small (2.9 M parameters, the CPU recipe) or medium (about 3x the "
                             "compute per step: for --device cuda)")
    parser.add_argument("--dev-size", type=int, default=150, help="held-out dev utterances (greedy WER while training)")
    parser.add_argument("--voice-dev-size", type=int, default=600,
                        help="utterances of the voice dev shard (made with random-voice shards: held-out English "
                             "examples by random voices), by which weights are chosen; 150 of them moved by 1-3 "
                             "points between checks 1,000 steps apart, 750 by under one; a work folder that "
                             "already has one keeps it")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] for training (synthesis is on the CPU)")
    parser.add_argument("--lr", type=float, default=1.2e-3, help="peak learning rate (warmup 400 steps, then cosine)")
    parser.add_argument("--seed", type=int, default=2026, help="seed of the data and the model")
    parser.add_argument("--workers", type=int, default=2, help="synthesis processes")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for training")
    parser.add_argument("--init", default=None,
                        help="start from this exported model's weights and CMVN (fine-tuning; same --size), "
                             "e.g. oasr/assets/model/model.safetensors; default: random weights")
    parser.add_argument("--max-frames", type=int, default=3000,
                        help="padded feature frames per batch (3000: about 9 utterances; on a CPU more, smaller "
                             "steps learned faster than fewer large ones)")
    parser.add_argument("--serving-share", type=float, default=0.4,
                        help="share of batches trained at the serving chunk and left context (the rest: full "
                             "context or a random chunking)")
    return parser


# model geometries (``AsrSpec`` field overrides): small is the shipped model's
SIZES = {
    "small": {},
    "medium": {"encoder": {"hidden_dim": 192, "num_layers": 8, "n_head": 4, "n_kv_head": 2, "head_dim": 64,
                           "ffn_dim": 768, "subsample_channels": 192},
               "decoder": {"hidden_dim": 192, "num_layers": 3, "n_head": 4, "n_kv_head": 2, "head_dim": 64,
                           "ffn_dim": 768}},
}


def model_spec(size: str):
    """The ``AsrSpec`` of a ``--size``."""
    from oasr.asr.model import AsrSpec

    base = AsrSpec()
    over = SIZES[size]
    return AsrSpec(encoder={**base.encoder, **over.get("encoder", {})},
                   decoder={**base.decoder, **over.get("decoder", {})})


def data_options(args) -> dict:
    """What the shards are made from (``WORK/data.json``): a rerun must make the same shards."""
    from oasr.asr.conditions import ConditionConfig

    if args.legacy_data:
        return {"seed": args.seed, "shard_size": args.shard_size, "legacy": True}
    return {"seed": args.seed, "shard_size": args.shard_size, "legacy": False, "open_share": args.open_share,
            "english_share": ENGLISH_SHARE, "conditions": ConditionConfig().to_dict()}


def same_data(recorded: dict, options: dict) -> bool:
    """Whether shards recorded with ``recorded`` (a ``data.json``) belong to a run with ``options``. A record
    written before the English shards existed lacks ``english_share``: its shards are the same as today's (the
    English ones have their own names and seeds), so it matches and is rewritten with the field."""
    if not recorded.get("legacy") and "english_share" not in recorded:
        recorded = {**recorded, "english_share": options.get("english_share")}
    return recorded == options


def _shard(job):
    from oasr.asr.conditions import ConditionConfig
    from oasr.asr.data import make_shard

    directory, index, size, seed, more_voices, kind, options = job  # kind: "", "English" or "random-voice"
    t0 = time.time()
    if options["legacy"]:
        make_shard(directory, index, size, seed, more_voices=more_voices)
    else:
        make_shard(directory, index, size, seed, more_voices=more_voices, open_share=options["open_share"],
                   conditions=ConditionConfig(**{k: tuple(v) if isinstance(v, list) else v
                                                 for k, v in options["conditions"].items()}),
                   english_share=options["english_share"] if kind else 0.0, random_voices=kind == "random-voice")
    return f"{kind} shard {index}".lstrip(), time.time() - t0


def main(argv=None) -> int:
    """Run ``python -m oasr train`` with ``argv`` (the process's arguments by default); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.english_shards is None:
        args.english_shards = 0 if args.legacy_data else 16
    if args.random_voice_shards is None:
        args.random_voice_shards = 0 if args.legacy_data else 16
    check_at_least(parser, args, {"shards": 1, "extra_voice_shards": 0, "english_shards": 0,
                                  "random_voice_shards": 0, "shard_size": 1,
                                  "steps": 1, "workers": 1, "threads": 1, "max_frames": 1000, "dev_size": 1,
                                  "voice_dev_size": 1})
    if args.legacy_data and args.english_shards:
        parser.error(f"--english-shards {args.english_shards}: --legacy-data makes the template-only shards, "
                     "which have no English examples")
    if args.legacy_data and args.random_voice_shards:
        parser.error(f"--random-voice-shards {args.random_voice_shards}: --legacy-data makes the template-only "
                     "shards, spoken by the shipped variants only")
    if not 0.0 <= args.serving_share < 1.0:
        parser.error(f"--serving-share must be in [0, 1), got {args.serving_share}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if not 0.0 <= args.open_share <= 1.0:
        parser.error(f"--open-share must be in [0, 1], got {args.open_share}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if shutil.which("espeak-ng") is None:
        parser.error("the recipe synthesizes speech with espeak-ng, which is not installed "
                     "(Debian: apt-get install espeak-ng)")
    import torch

    from oasr.asr.checkpoint import save_checkpoint
    from oasr.asr.data import make_shard
    from oasr.asr.train import train

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    work = Path(args.work)
    (work / "train").mkdir(parents=True, exist_ok=True)
    options = json.loads(json.dumps(data_options(args)))  # as data.json holds it (tuples become lists)
    recorded = work / "data.json"
    if recorded.exists() and not same_data(json.loads(recorded.read_text()), options):
        parser.error(f"{work} holds shards made with other data options ({recorded}); use a new --work or the "
                     "same options")
    recorded.write_text(json.dumps(options, indent=1, sort_keys=True) + "\n")
    t0 = time.time()
    jobs = [(work / "train", i, args.shard_size, args.seed, i >= args.shards, "", options)
            for i in range(args.shards + args.extra_voice_shards)]
    jobs += [(work / "train", i, args.shard_size, args.seed, True, "English", options)
             for i in range(args.english_shards)]
    jobs += [(work / "train", i, args.shard_size, args.seed, False, "random-voice", options)
             for i in range(args.random_voice_shards)]
    with Pool(args.workers) as pool:
        for name, seconds in pool.imap_unordered(_shard, jobs):
            print(f"{name}: {args.shard_size} utterances in {seconds:.0f} s", flush=True)
    if options["legacy"]:
        make_shard(work / "dev", 0, args.dev_size, args.seed + 1, held_out=True)
    else:  # held-out sentences and voices, in the same conditions as the training data
        from oasr.asr.conditions import ConditionConfig

        make_shard(work / "dev", 0, args.dev_size, args.seed + 1, held_out=True, open_share=args.open_share,
                   conditions=ConditionConfig())
        if args.random_voice_shards:  # held-out English examples by random voices: the second set's proxy
            make_shard(work / "dev_voices", 0, args.voice_dev_size, args.seed + 1, held_out=True,
                       open_share=args.open_share, conditions=ConditionConfig(), english_share=1.0,
                       random_voices=True)
    synth_seconds = time.time() - t0
    torch.set_num_threads(args.threads)
    out = train(work, args.steps, seed=args.seed, max_frames=args.max_frames, lr=args.lr, dev_dir=work / "dev",
                spec=model_spec(args.size), serving_share=args.serving_share, device=args.device, init=args.init,
                voice_dev_dir=work / "dev_voices" if args.random_voice_shards else None,
                log=lambda s: print(s, flush=True))
    params = sum(p.numel() for m in (out["encoder"], out["decoder"]) for p in m.parameters())
    info = {"steps": out["step"], "train_seconds": round(out["seconds"]), "synth_seconds": round(synth_seconds),
            "utterances": len(jobs) * args.shard_size, "seed": args.seed,
            "threads": args.threads, "parameters": params, "serving_share": args.serving_share,
            "device": args.device, "size": args.size, "data": options,
            "init": None if args.init is None else Path(args.init).name,
            "schedule": f"warmup 400 steps, then a cosine from lr {args.lr:g} to 5% of it at step {args.steps}; "
                        f"batches of at most {args.max_frames} padded frames"}
    if not options["legacy"]:  # the word search's language model: text drawn from the training text's generator
        from oasr.asr.language import LanguageSpec

        info["language_model"] = LanguageSpec(seed=args.seed, open_share=args.open_share).to_info()
    save_checkpoint(work / "model.safetensors", out["encoder"], out["decoder"], out["spec"], out["cmvn"], info,
                    weights="float16")  # half the file; the shipped model's WER is measured on these weights
    print(f"recipe: synthesis {synth_seconds / 60:.1f} min, training {out['seconds'] / 60:.1f} min "
          f"({out['step']} steps, {args.threads} threads)", flush=True)
    print(f"exported {work / 'model.safetensors'}; evaluate it with: python -m oasr eval --model "
          f"{work / 'model.safetensors'}")
    return 0
