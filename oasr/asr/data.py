"""Training data for the recipe: synthesized utterances as fbank shards, and batches drawn from them.

A shard is one ``.npz`` file of ``count`` utterances: ``feats`` (all frames, float16, concatenated),
``lens``, ``texts`` (one per utterance) and the CMVN sums of its frames. Shard ``i`` of a data set with
seed ``s`` is made from ``random.Random((s, i))``, so any shard can be (re)built alone, in any order
and in parallel, with the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import numpy as np

from oasr.asr.opentext import MixedSentenceGenerator
from oasr.asr.text import SentenceGenerator
from oasr.features.fbank import NUM_MEL_BINS, fbank


def shard_path(directory, index: int, english: bool = False, random_voices: bool = False) -> Path:
    """The path of training shard ``index`` in ``directory`` (English and random-voice shards number their own)."""
    prefix = "shard_rv_" if random_voices else "shard_en_" if english else "shard_"
    return Path(directory) / f"{prefix}{index:04d}.npz"


def make_shard(directory, index: int, count: int, seed: int, held_out: bool = False,
               more_voices: bool = False, open_share: float = 0.0, conditions=None,
               english_share: float = 0.0, random_voices: bool = False) -> Path:
    """Synthesize shard ``index`` (``count`` utterances) into ``directory``; skips an existing one.

    ``english_share > 0`` makes an *English shard* (``shard_en_NNNN.npz``, its own seed stream): that share of
    its sentences are the shipped English examples (``MixedSentenceGenerator``'s ``english_share``); it needs
    ``conditions``. ``random_voices`` makes a *random-voice shard* (``shard_rv_NNNN.npz``, its own seed stream):
    every utterance spoken by a variant drawn by ``oasr.asr.synth.random_variant`` instead of a shipped one; it
    needs ``conditions``. Held out, it is the recipe's *voice dev shard*: held-out sentences, random voices.

    Training shards are spoken by ``TRAIN_VARIANTS`` (with ``more_voices``: those and
    ``MORE_TRAIN_VARIANTS``), held-out ones by ``TEST_VARIANTS``. With ``conditions`` (a
    ``oasr.asr.conditions.ConditionConfig``) the sentences come from ``MixedSentenceGenerator`` with
    ``open_share`` open sentences and each utterance goes through ``draw_conditioned_utterance`` (silences,
    pauses, noise, telephone band, empty utterances); without it (the shipped model's recipe) the templates
    and ``draw_utterance``, byte for byte as before."""
    from oasr.asr.synth import (
        MORE_TRAIN_VARIANTS,
        TEST_VARIANTS,
        TRAIN_VARIANTS,
        RandomVoices,
        draw_conditioned_utterance,
        draw_utterance,
    )

    if held_out and more_voices:
        raise ValueError("make_shard: a held-out shard is spoken by the test voices only (more_voices=False)")
    if english_share and conditions is None:
        raise ValueError("make_shard: english_share needs conditions (the open recipe's data path)")
    if random_voices and conditions is None:
        raise ValueError("make_shard: random_voices needs conditions (the open recipe's data path)")
    path = shard_path(directory, index, english=bool(english_share), random_voices=random_voices)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = "rv/" if random_voices else "en/" if english_share else ""
    rng = random.Random(f"{seed}/{stream}{index}")
    variants = TEST_VARIANTS if held_out else TRAIN_VARIANTS + (MORE_TRAIN_VARIANTS if more_voices else [])
    if conditions is None:
        if open_share:
            raise ValueError("make_shard: open_share needs conditions (the open recipe's data path)")
        sentences = SentenceGenerator(rng.getrandbits(32), held_out=held_out)
    else:
        sentences = MixedSentenceGenerator(rng.getrandbits(32), open_share, held_out=held_out,
                                           english_share=english_share)
    feats, lens, texts, voices = [], [], [], []
    with contextlib.ExitStack() as stack:
        bank = stack.enter_context(RandomVoices()) if random_voices else None
        for _ in range(count):
            if conditions is None:
                text = next(sentences)
                pcm, desc = draw_utterance(rng, text, variants)
            else:
                pcm, text, desc = draw_conditioned_utterance(rng, sentences, variants, conditions, bank)
            f = fbank(pcm)
            feats.append(f)
            lens.append(len(f))
            texts.append(text)
            voices.append(json.dumps(desc))
    allf = np.concatenate(feats).astype(np.float64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, feats=np.concatenate(feats).astype(np.float16), lens=np.array(lens, np.int64),
             texts=np.array(texts), voices=np.array(voices), sum=allf.sum(0), sum_sq=(allf**2).sum(0),
             frames=np.int64(len(allf)))
    tmp.rename(path)
    return path


class ShardSet:
    """All utterances of the shards in a directory, held in memory as float16 features.

    The features are read into one array sized first from the shards' lengths, so loading holds one copy,
    not the shards and their concatenation (120,000 utterances are 8.8 GB)."""

    def __init__(self, directory):
        # a shard still being written is ``shard_*.tmp.npz`` until its rename: not a shard yet
        paths = sorted(p for p in Path(directory).glob("shard_*.npz") if not p.name.endswith(".tmp.npz"))
        if not paths:
            raise ValueError(f"no shards in {directory}")
        lens = []
        for p in paths:
            with np.load(p) as z:
                lens.append(z["lens"])
        self.lens = np.concatenate(lens)
        self.feats = np.empty((int(self.lens.sum()), NUM_MEL_BINS), np.float16)
        self.texts = []
        total = total_sq = 0.0
        frames = at = 0
        for p in paths:
            with np.load(p) as z:
                f = z["feats"]
                self.feats[at : at + len(f)] = f
                at += len(f)
                del f
                self.texts.extend(z["texts"].tolist())
                total = total + z["sum"]
                total_sq = total_sq + z["sum_sq"]
                frames += int(z["frames"])
        if at != len(self.feats):
            raise ValueError(f"{directory}: the shards' feature rows ({at}) do not add up to their lengths "
                             f"({len(self.feats)})")
        self.starts = np.concatenate([[0], np.cumsum(self.lens)[:-1]])
        self.stats = (total, total_sq, frames)

    def __len__(self) -> int:
        return len(self.lens)

    def utterance(self, i: int) -> np.ndarray:
        """Utterance ``i``'s feature frames."""
        return self.feats[self.starts[i] : self.starts[i] + self.lens[i]]
