"""A smoke run of the training recipe: a few steps on real fbank features lower the joint loss."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.asr.audio import load_audio
from oasr.asr.testset import load_testset
from oasr.asr.train import batches, joint_loss, learning_rate, train
from oasr.features.fbank import fbank
from tests.test_asr_checkpoint import TINY


def _tiny_shards(directory, n=6):
    clips = load_testset(limit=n)
    feats = [fbank(load_audio(c.path)) for c in clips]
    allf = np.concatenate(feats).astype(np.float64)
    directory.mkdir(parents=True)
    np.savez(directory / "shard_0000.npz", feats=np.concatenate(feats).astype(np.float16),
             lens=np.array([len(f) for f in feats]), texts=np.array([c.text for c in clips]),
             voices=np.array(["{}"] * n), sum=allf.sum(0), sum_sq=(allf**2).sum(0), frames=np.int64(len(allf)))


def test_a_shard_still_being_written_is_not_read(tmp_path):
    """Shards synthesized while a run trains join at its next epoch; one half written (``*.tmp.npz`` until the
    rename) must not be read then."""
    from oasr.asr.data import ShardSet

    _tiny_shards(tmp_path / "train")
    (tmp_path / "train" / "shard_en_0003.tmp.npz").write_bytes(b"PK\x03\x04 half a zip")
    assert len(ShardSet(tmp_path / "train")) == 6


def test_shards_load_as_their_concatenation(tmp_path):
    """``ShardSet`` reads every shard into one preallocated array: the same rows, lengths, texts and statistics
    as concatenating them, in name order (English shards after the others)."""
    from oasr.asr.data import ShardSet

    _tiny_shards(tmp_path / "train")
    with np.load(tmp_path / "train" / "shard_0000.npz") as z:
        one = {k: z[k] for k in z.files}
    np.savez(tmp_path / "train" / "shard_en_0000.npz", **{**one, "feats": one["feats"][::-1].copy(),
                                                          "texts": one["texts"][::-1].copy()})
    data = ShardSet(tmp_path / "train")
    assert np.array_equal(data.feats, np.concatenate([one["feats"], one["feats"][::-1]]))
    assert np.array_equal(data.lens, np.concatenate([one["lens"], one["lens"]]))
    assert data.texts == one["texts"].tolist() + one["texts"][::-1].tolist()
    assert np.array_equal(data.utterance(0), one["feats"][: one["lens"][0]])
    assert np.allclose(data.stats[0], 2 * one["sum"]) and data.stats[2] == 2 * int(one["frames"])


def test_recipe_lowers_the_loss_and_resumes(tmp_path):
    torch.set_num_threads(1)
    _tiny_shards(tmp_path / "train")
    logs = []
    out = train(tmp_path, steps=12, seed=1, max_frames=4000, lr=3e-3, warmup=2, save_every=6, log_every=1,
                spec=TINY, log=logs.append)
    losses = [float(line.split(" ctc ")[1].split()[0]) for line in logs if line.startswith("step ")]
    assert len(losses) == 12 and np.mean(losses[-3:]) < 0.92 * np.mean(losses[:3]), losses
    assert (tmp_path / "state.pt").exists() and out["step"] == 12
    more = []
    train(tmp_path, steps=14, seed=1, max_frames=4000, lr=3e-3, warmup=2, save_every=6, log_every=1, spec=TINY,
          log=more.append)
    assert more[0] == "resumed at step 12 (epoch 12)" or more[0].startswith("resumed at step 12")
    assert sum(line.startswith("step ") for line in more) == 2


def test_the_voice_dev_shard_is_checked_beside_the_dev_shard(tmp_path, monkeypatch):
    """With ``voice_dev_dir`` each dev check logs that shard's greedy WER too (the EMA weights, as for the dev
    shard: the same numbers when both directories hold the same shard), over every utterance of each shard;
    without it, only the dev shard's."""
    import oasr.asr.train as train_module

    torch.set_num_threads(1)
    for d in ("train", "dev", "voices"):
        _tiny_shards(tmp_path / d)
    counted = []
    real_greedy_wer = train_module.greedy_wer

    def counting(encoder, tokenizer, cmvn, shards, count, *args):
        counted.append((len(shards), count))
        return real_greedy_wer(encoder, tokenizer, cmvn, shards, count, *args)

    monkeypatch.setattr(train_module, "greedy_wer", counting)
    logs = []
    train(tmp_path, steps=2, seed=1, max_frames=2500, warmup=1, dev_every=1, dev_dir=tmp_path / "dev",
          voice_dev_dir=tmp_path / "voices", spec=TINY, log=logs.append)
    dev = [line.split()[-1] for line in logs if ": dev greedy" in line]
    voices = [line.split()[-1] for line in logs if ": voice dev greedy" in line]
    assert len(dev) == 2 and voices == dev
    assert len(counted) == 4 and all(count == size for size, count in counted)  # a check scores the whole shard
    (tmp_path / "state.pt").unlink()
    logs.clear()
    train(tmp_path, steps=1, seed=1, max_frames=2500, warmup=1, dev_dir=tmp_path / "dev", spec=TINY,
          log=logs.append)
    assert any(": dev greedy" in line for line in logs) and not any("voice dev" in line for line in logs)


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    """Stopped at step 5 (mid-epoch, between saves) and resumed, the run ends where an uninterrupted one does:
    same batches, same chunkings, same SpecAugment masks and dropout, bit for bit."""
    torch.set_num_threads(1)
    _tiny_shards(tmp_path / "a" / "train")
    _tiny_shards(tmp_path / "b" / "train")
    kw = dict(steps=9, seed=3, max_frames=2500, lr=3e-3, warmup=2, save_every=4, spec=TINY, serving_share=0.3,
              log=lambda s: None)
    straight = train(tmp_path / "a", **kw)
    first = train(tmp_path / "b", stop_at=5, **kw)
    assert first["step"] == 5
    resumed = train(tmp_path / "b", **kw)
    assert resumed["step"] == 9
    for m in ("encoder", "decoder"):
        for (name, p), q in zip(straight[m].named_parameters(), resumed[m].parameters(), strict=True):
            assert torch.equal(p, q), name


def test_a_run_can_start_from_an_exported_model(tmp_path):
    """``init``: step 0 holds the checkpoint's weights and CMVN (lr 0 keeps them), EMA included; resuming
    ignores it; a checkpoint of another geometry is refused before any step."""
    from oasr.asr.checkpoint import load_checkpoint, save_checkpoint
    from oasr.asr.model import AsrSpec

    torch.set_num_threads(1)
    _tiny_shards(tmp_path / "a" / "train")
    _tiny_shards(tmp_path / "b" / "train")
    _tiny_shards(tmp_path / "c" / "train")
    kw = dict(max_frames=2500, warmup=1, spec=TINY, log=lambda s: None)
    first = train(tmp_path / "a", steps=3, seed=1, lr=3e-3, **kw)
    save_checkpoint(tmp_path / "m.safetensors", first["encoder"], first["decoder"], TINY, first["cmvn"])
    logs = []
    tuned = train(tmp_path / "b", steps=1, seed=2, lr=1e-12, init=tmp_path / "m.safetensors",
                  **{**kw, "log": logs.append})
    assert any(line.startswith("starting from") for line in logs)
    enc, dec, _, cmvn, _ = load_checkpoint(tmp_path / "m.safetensors")
    for m, want in (("encoder", enc), ("decoder", dec)):
        for (name, p), q in zip(tuned[m].named_parameters(), want.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-6), name  # one step at lr 1e-12
    assert torch.equal(tuned["cmvn"].mean, cmvn.mean) and torch.equal(tuned["cmvn"].istd, cmvn.istd)
    other = AsrSpec.from_dict({**TINY.to_dict(), "encoder": {**TINY.to_dict()["encoder"], "num_layers": 2}})
    with pytest.raises(ValueError, match="this run trains"):
        train(tmp_path / "c", steps=1, init=tmp_path / "m.safetensors", **{**kw, "spec": other})


def test_batches_and_schedule():
    import random

    lens = np.array([100, 300, 120, 290, 50, 310, 305])
    plan = batches(lens, 650, random.Random(0))
    assert sorted(i for b in plan for i in b) == list(range(len(lens)))
    assert all(max(lens[b]) * len(b) <= 650 or len(b) == 1 for b in plan)
    assert learning_rate(0, 100, 1.0, 10) == 0.1 and learning_rate(9, 100, 1.0, 10) == 1.0
    assert abs(learning_rate(100, 100, 1.0, 10) - 0.05) < 1e-9


def test_serving_share_draws_the_serving_chunking():
    import random

    from oasr.asr.train import draw_chunking

    # share 0 keeps the original schedule's draws exactly (a resumed run stays reproducible)
    a, b = random.Random(5), random.Random(5)
    original = [draw_chunking(a) for _ in range(200)]
    assert [draw_chunking(b, (16, 4), 0.0) for _ in range(200)] == original
    rng = random.Random(7)
    draws = [draw_chunking(rng, (16, 4), 0.4) for _ in range(4000)]
    serving = sum(d == (16, 4) for d in draws) / len(draws)
    full = sum(d == (100000, -1) for d in draws) / len(draws)
    assert 0.37 < serving < 0.44 and 0.27 < full < 0.33  # 0.4 + 0.6 * (1/50 * 1/7), 0.6 * 0.5
    with pytest.raises(ValueError, match="serving_share"):
        train(Path("."), 1, serving_share=1.0)


def test_joint_loss_is_finite_for_every_chunking():
    from oasr.asr.model import build

    torch.manual_seed(0)
    enc, dec = build(TINY)
    tok = TINY.tokenizer()
    x = torch.randn(2, 64, 80)
    lens = torch.tensor([64, 40])
    targets = [tok.encode("ab c"), tok.encode("d")]
    for chunk, left in [(1, 1), (3, -1), (100000, -1), (4, 2)]:
        loss, ctc, att = joint_loss(enc, dec, tok, x, lens, targets, chunk, left)
        assert torch.isfinite(loss) and ctc > 0 and att > 0


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="the recipe synthesizes with espeak-ng")
def test_open_recipe_smoke(tmp_path, capsys):
    """The open recipe end to end on a toy budget: seeded shards (same bytes twice), two steps, export, resume,
    and a rerun with other data options refused."""
    from oasr.asr.conditions import ConditionConfig
    from oasr.asr.data import make_shard
    from oasr.commands.train import main as train_main

    cfg = ConditionConfig(long_share=0.5, empty_share=0.3)
    a = make_shard(tmp_path / "a", 0, 4, 7, open_share=0.6, conditions=cfg)
    b = make_shard(tmp_path / "b", 0, 4, 7, open_share=0.6, conditions=cfg)
    with np.load(a) as za, np.load(b) as zb:
        assert all(np.array_equal(za[k], zb[k]) for k in za.files)
    # a random-voice shard: the same bytes twice too, each utterance's drawn variant file in its description,
    # and the installed espeak-ng data left as it was (the variants live in a private folder, removed after)
    from oasr.asr.synth import RandomVoices, installed_data_dir

    installed = set((Path(installed_data_dir()) / "voices" / "!v").iterdir())
    c = make_shard(tmp_path / "c", 0, 3, 7, open_share=0.6, conditions=cfg, english_share=0.5, random_voices=True)
    d = make_shard(tmp_path / "d", 0, 3, 7, open_share=0.6, conditions=cfg, english_share=0.5, random_voices=True)
    assert c.name == "shard_rv_0000.npz"
    with np.load(c) as zc, np.load(d) as zd:
        assert all(np.array_equal(zc[k], zd[k]) for k in zc.files)
        descs = [json.loads(v) for v in zc["voices"]]
    spoken = [v for v in descs if "voice" in v]
    assert spoken and all(v["voice"].endswith("+" + RandomVoices.NAME) and v["variant_file"].startswith(
        "language variant") for v in spoken)
    assert set((Path(installed_data_dir()) / "voices" / "!v").iterdir()) == installed
    with pytest.raises(ValueError, match="random_voices"):
        make_shard(tmp_path / "e", 0, 3, 7, open_share=0.6, random_voices=True)
    argv = ["--work", str(tmp_path / "w"), "--shards", "1", "--extra-voice-shards", "1", "--english-shards", "1",
            "--random-voice-shards", "1", "--shard-size", "3", "--steps", "2", "--dev-size", "2",
            "--voice-dev-size", "3", "--workers", "1", "--threads", "1", "--max-frames", "1000"]
    assert train_main(argv) == 0
    assert (tmp_path / "w" / "model.safetensors").exists()
    # the voice dev shard: held-out English examples (every one) by random voices, its WER logged
    from oasr.asr.opentext import english_sentences, is_held_out

    held_out_examples = {t for t in english_sentences() if is_held_out(t)}
    with np.load(tmp_path / "w" / "dev_voices" / "shard_rv_0000.npz") as z:
        assert all(t in held_out_examples for t in z["texts"] if t) and len(z["lens"]) == 3  # --voice-dev-size
    assert "voice dev greedy streaming WER" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "w" / "train").glob("shard_*.npz")) == [
        "shard_0000.npz", "shard_0001.npz", "shard_en_0000.npz", "shard_rv_0000.npz"]
    from oasr.asr.checkpoint import load_checkpoint
    from oasr.asr.language import LanguageSpec, spec_from_info

    # the export names the word search's language model: text of the training generator, the run's seed and share
    assert spec_from_info(load_checkpoint(tmp_path / "w" / "model.safetensors")[4]) == LanguageSpec(2026, 0.6)
    assert json.loads((tmp_path / "w" / "data.json").read_text())["open_share"] == 0.6
    assert train_main(argv) == 0 and "resumed at step 2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_main([*argv, "--open-share", "0.3"])


def test_data_records_written_before_the_english_shards_still_match():
    """A ``data.json`` without ``english_share`` (its shards made before the English ones existed, which have
    names and seeds of their own) belongs to today's run with the same options; any other difference does not."""
    from oasr.commands.train import build_parser, data_options, same_data

    options = json.loads(json.dumps(data_options(build_parser().parse_args(["--work", "w"]))))
    assert options["english_share"] == 0.5
    old = {k: v for k, v in options.items() if k != "english_share"}
    assert same_data(old, options) and same_data(options, options)
    assert not same_data({**old, "open_share": 0.3}, options)
    assert not same_data({**options, "english_share": 0.25}, options)
    legacy = json.loads(json.dumps(data_options(build_parser().parse_args(["--work", "w", "--legacy-data"]))))
    assert "english_share" not in legacy and same_data(legacy, legacy) and not same_data(legacy, options)


@pytest.mark.parametrize("option", ["--english-shards", "--random-voice-shards"])
def test_open_data_shards_are_refused_with_the_legacy_data(capsys, option):
    from oasr.commands.train import main as train_main

    with pytest.raises(SystemExit):
        train_main(["--work", "w", "--legacy-data", option, "2"])
    assert f"{option} 2: --legacy-data" in capsys.readouterr().err


def test_random_variants_stay_in_their_documented_ranges():
    """``random_variant`` (no espeak-ng needed): seeded, varied, every setting within the span its docstring
    gives, formants 0-5 moved together by one tract scale, and never the Klatt type only a test variant uses."""
    import random

    from oasr.asr.synth import random_variant

    assert random_variant(random.Random(3)) == random_variant(random.Random(3))
    rng = random.Random(0)
    files = [random_variant(rng) for _ in range(400)]
    assert len(set(files)) == 400
    seen = {"tone": 0, "breath": 0, "echo": 0, "klatt": 0}
    spreads = []
    for text in files:
        lines = text.splitlines()
        assert lines[:2] == ["language variant", "name oasr-random"]
        settings = [line.split() for line in lines[2:]]
        formants = {int(f[1]): [int(x) for x in f[2:]] for f in settings if f[0] == "formant"}
        assert sorted(formants) == list(range(9))
        for k, (freq, strength, width) in formants.items():
            assert 40 <= freq <= 150 and 0 <= strength <= 160 and 50 <= width <= 180, (k, freq, strength, width)
        low = [formants[k][0] for k in range(6)]
        spreads.append(max(low) / min(low))
        values = {f[0]: [int(x) for x in f[1:]] for f in settings if f[0] != "formant"}
        base, top = values["pitch"]
        assert 55 <= base <= 240 and base + 10 <= top <= base + 120
        assert 30 <= values["voicing"][0] <= 200 and all(55 <= c <= 150 for c in values["consonants"])
        assert values.get("klatt", [1]) != [2]
        for key in seen:
            seen[key] += key in values
    assert max(spreads) <= 1.1 / 0.9 + 0.03  # one scale, each formant jittered by at most 10%
    assert all(40 < n < 200 for n in seen.values()), seen  # the optional settings: sometimes, not always


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_follows_the_cpu_run(tmp_path):
    """``device="cuda"``: the same batches, chunkings and masks as on the CPU (they are drawn there), so the
    losses track the CPU run's within float rounding, the state resumes, and the networks come back on the CPU."""
    torch.set_num_threads(1)
    _tiny_shards(tmp_path / "c" / "train")
    _tiny_shards(tmp_path / "g" / "train")
    kw = dict(steps=4, seed=2, max_frames=4000, lr=3e-3, warmup=2, save_every=2, log_every=1, spec=TINY)
    cpu, gpu = [], []
    train(tmp_path / "c", log=cpu.append, **kw)
    out = train(tmp_path / "g", device="cuda", log=gpu.append, stop_at=3, **kw)
    out = train(tmp_path / "g", device="cuda", log=gpu.append, **kw)
    assert next(out["encoder"].parameters()).device.type == "cpu" and out["step"] == 4
    lc = [float(line.split(" ctc ")[1].split()[0]) for line in cpu if line.startswith("step ")]
    lg = [float(line.split(" ctc ")[1].split()[0]) for line in gpu if line.startswith("step ")]
    assert len(lc) == len(lg) == 4 and np.allclose(lc, lg, rtol=2e-2), (lc, lg)
