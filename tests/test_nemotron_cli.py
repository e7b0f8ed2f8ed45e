"""``python -m oasr transcribe / eval --model DIR [--lookahead N]`` on a Nemotron checkpoint directory.

The printed text is transformers' streaming generation's on the same audio at the same lookahead; a directory
that is not a checkpoint, a corrupt or incomplete one, an untrained lookahead and options a transducer cannot
serve are refused in one line (exit status 2) before any work.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import soundfile as sf

from oasr.commands import evaluate, transcribe

sys.path.insert(0, str(Path(__file__).parent))
import nemotron_rnnt_oracle as oracle  # noqa: E402

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model, processor = oracle.make_checkpoint(root / "ckpt", "a", seed=11)
    wavs = []
    for i, (index, seconds) in enumerate([(0, 1.3), (4, 0.6)]):
        path = root / f"clip{i}.wav"
        sf.write(path, oracle.clip(index, seconds), 16000, subtype="FLOAT")
        wavs.append(path)
    return root, model, processor, wavs


def _oracle_text(model, processor, directory, wav, lookahead):
    import torch

    from oasr.asr.audio import load_audio
    from oasr.features import NemoMel

    feats = torch.from_numpy(NemoMel.from_checkpoint(directory).extract(load_audio(wav)))
    *_, sequence = oracle.oracle_stream(model, feats, lookahead)
    return processor.decode(sequence, skip_special_tokens=True)


def test_transcribe_prints_transformers_text(made, capsys):
    root, model, processor, wavs = made
    ckpt = root / "ckpt"
    for lookahead, twin in [(None, "fast"), (0, "reference"), (1, "fast")]:
        argv = ["--model", str(ckpt), "--twin", twin, "--kv-cache-dtype", "model", *map(str, wavs)]
        if lookahead is not None:
            argv += ["--lookahead", str(lookahead)]
        assert transcribe.main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        la = processor.default_num_lookahead_tokens if lookahead is None else lookahead
        want = [f"{w}: {_oracle_text(model, processor, ckpt, w, la)}" for w in wavs]
        assert lines == want and all(len(line) > len(str(w)) + 3 for line, w in zip(lines, wavs, strict=True))


def test_eval_runs_on_a_checkpoint_directory(made, tmp_path, capsys):
    root, _, _, wavs = made
    testset = tmp_path / "set"
    testset.mkdir()
    for i, w in enumerate(wavs):
        sf.write(testset / f"{i:04d}.flac", sf.read(w, dtype="float32")[0], 16000)
    (testset / "transcripts.tsv").write_text("".join(f'{i:04d}\thello world\t{{"voice": "x"}}\n'
                                                     for i in range(len(wavs))))
    out = tmp_path / "r.json"
    rc = evaluate.main(["--model", str(root / "ckpt"), "--testset", str(testset), "--json", str(out),
                        "--kv-cache-dtype", "int8"])
    if rc != 0:
        pytest.fail(capsys.readouterr().err)
    result = json.loads(out.read_text())
    assert result["utterances"] == 2 and result["configuration"]["decoder"] == "rnnt_greedy"
    assert result["configuration"]["kv_cache_dtype"] == "int8"


def test_refusals_are_one_line(made, tmp_path, capsys):
    root, _, _, wavs = made
    ckpt = root / "ckpt"

    def refused(argv, match):
        with pytest.raises(SystemExit) as exc:
            transcribe.main([*argv, str(wavs[0])])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exc.value.code == 2 and match in err, err

    refused(["--model", str(tmp_path)], "is no checkpoint format oasr knows")
    refused(["--model", str(ckpt), "--lookahead", "5"], "lookahead 5 was not trained for this checkpoint; "
                                                       "trained: 2, 1, 0")
    refused(["--model", str(ckpt), "--rescore", "--beam", "3"], "does not take --rescore, --beam")
    refused(["--lookahead", "1"], "--lookahead applies to a Nemotron checkpoint directory")
    from oasr.commands import serve

    with pytest.raises(SystemExit) as exc:  # the server takes a checkpoint directory, with the same refusals
        serve.main(["--model", str(ckpt), "--lookahead", "5"])
    assert exc.value.code == 2 and "lookahead 5 was not trained" in capsys.readouterr().err
    refused(["--model", str(ckpt), "--kv-cache-dtype", "q8_0"], "head_dim=16 is not a multiple of 32")
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    refused(["--model", str(broken)], "not a readable safetensors file")
    shutil.copy(ckpt / "model.safetensors", broken / "model.safetensors")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["decoder_hidden_size"] += 1
    (broken / "config.json").write_text(json.dumps(cfg))
    refused(["--model", str(broken)], "transducer tensors of the wrong shape: decoder.decoder_projector.bias (24,) "
                                      "(config.json implies (25,))")


def test_demo_prints_the_lookahead_and_its_chunk(made, capsys):
    root, _, _, _ = made
    from oasr.commands import speech_demo

    assert speech_demo.main(["--model", str(root / "ckpt"), "--lookahead", "1", "--clips", "2", "--show", "1",
                             "--no-realtime"]) == 0
    out = capsys.readouterr().out
    assert "lookahead 1: 160 ms chunks; trained: 2 (240 ms chunks), 1 (160 ms chunks), 0 (80 ms chunks)" in out
    assert "accuracy: WER" in out and "transducer)" in out
