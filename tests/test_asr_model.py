"""The shipped speech model through the engine: text out, twins agree, bad input refused, CLI."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch

from oasr.__main__ import main as oasr_main
from oasr.asr.audio import AudioError, load_audio
from oasr.asr.checkpoint import default_model_path, serving_chunking
from oasr.asr.recognizer import Recognizer
from oasr.asr.testset import load_testset

torch.set_num_threads(1)

# clips the shipped model transcribes exactly (streaming, default chunk and window, beam 8)
EXACT = ["0000", "0001", "0002"]


@pytest.fixture(scope="module")
def clips():
    return load_testset()


def test_the_model_ships_with_its_card():
    path = default_model_path()
    assert path.is_file() and path.stat().st_size < 16 * 2**20
    card = (path.parent / "MODEL_CARD.md").read_text()
    assert "WER" in card and "espeak-ng" in card


def test_a_few_clips_come_out_as_their_text(clips):
    chosen = [c for c in clips if c.id in EXACT]
    out = Recognizer(max_streams=4).transcribe([c.path for c in chosen])
    assert [t.text for t in out] == [c.text for c in chosen]
    assert all(t.partials and t.partials[-1][1] == t.text for t in out)  # the partials end in the final text


@pytest.mark.slow
def test_the_twins_give_identical_transcripts_on_every_clip(clips):
    paths = [c.path for c in clips]
    fast = [t.text for t in Recognizer(twin="fast", max_streams=16).transcribe(paths)]
    reference = [t.text for t in Recognizer(twin="reference", max_streams=16).transcribe(paths)]
    assert fast == reference


def test_streaming_in_any_pieces_gives_the_same_text(clips):
    pcm = load_audio(clips[3].path)
    whole = Recognizer(max_streams=2).transcribe([pcm], piece_seconds=10.0)[0].text
    rec = Recognizer(max_streams=2)
    stream = rec.open_stream()
    rng = np.random.default_rng(0)
    i, done = 0, []
    while i < len(pcm):
        n = int(rng.integers(1, 3000))
        stream.accept(pcm[i : i + n])
        i += n
        done += rec.step()
    stream.end()
    while not done:
        done += rec.step()
    assert done[0].text == whole


def test_bad_audio_leaves_the_other_streams_alone(clips):
    pcm = load_audio(clips[4].path)
    alone = Recognizer(max_streams=2).transcribe([pcm])[0].text
    rec = Recognizer(max_streams=2)
    good, bad = rec.open_stream(), rec.open_stream()
    bad.accept(pcm[:8000])
    for piece in (np.full(1600, np.nan, np.float32), np.zeros((1600, 2), np.float32), np.zeros(0, np.float32)):
        if piece.size:
            with pytest.raises(AudioError):
                bad.accept(piece)
    with pytest.raises(AudioError, match="outside"):
        bad.accept(pcm[:1600], sample_rate=1000)
    good.accept(pcm)
    good.end()
    bad.end()
    done = []
    while len(done) < 2:
        done += rec.step()
    assert {t.id: t.text for t in done}[good.id] == alone


def test_transcribe_cli(clips, capsys, tmp_path):
    wav = tmp_path / "clip.wav"
    import soxr

    pcm = load_audio(clips[0].path)
    sf.write(wav, soxr.resample(pcm, 16000, 44100), 44100)  # another rate: resampled
    assert oasr_main(["transcribe", str(clips[0].path)]) == 0
    assert capsys.readouterr().out.strip() == clips[0].text
    assert oasr_main(["transcribe", "--partials", str(wav)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"{wav}: {clips[0].text}" and len(out) > 2


@pytest.mark.parametrize("content", [b"", b"RIFF not really a wav file at all"])
def test_transcribe_cli_refuses_bad_files_before_any_work(tmp_path, content):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(content)
    done = subprocess.run([sys.executable, "-m", "oasr", "transcribe", str(load_testset(limit=1)[0].path), str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and str(bad) in done.stderr


def test_eval_cli_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert oasr_main(["eval", "--limit", "6", "--json", str(out), "--kv-cache-dtype", "fp8_e4m3"]) == 0
    result = json.loads(out.read_text())
    assert result["utterances"] == 6 and 0 <= result["wer"] <= 1 and 0 <= result["cer"] <= 1
    chunk, left = serving_chunking(default_model_path())
    config = result["configuration"]
    assert config["kv_cache_dtype"] == "fp8_e4m3" and (config["chunk_size"], config["num_left_chunks"]) == (chunk, left)
    assert "WER" in capsys.readouterr().out


def test_demo_runs_on_shipped_clips(capsys, tmp_path):
    plot = tmp_path / "streams.png"
    assert oasr_main(["demo", "--clips", "6", "--no-realtime", "--concurrency", "3", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    for needle in ("WER", "real-time factor", "p50", "p99", "kv_pool", "reference:"):
        assert needle in out or needle == "reference:"
    # the plot the package promises, and --no-realtime keeps streams overlapping (it held one at a time)
    assert f"plot: {plot}" in out and plot.stat().st_size > 10_000
    peak = int(re.search(r"peak (\d+) streams held", out).group(1))
    assert peak >= 2, out


@pytest.mark.parametrize("argv, expect", [
    (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
    (["--clips", "0"], "--clips must be >= 1, got 0"),
    (["--full-context"], "the demo streams"),
    (["--model", "/no/such/model.safetensors"], "no such file"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1"),
])
def test_demo_refuses_bad_options_before_any_work(capsys, argv, expect):
    with pytest.raises(SystemExit) as done:
        oasr_main(["demo", *argv])
    err = capsys.readouterr().err
    assert done.value.code == 2 and expect in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("quick", [True, False])
def test_accuracy_grid_runs_the_rows_its_verdict_compares_at_the_serving_window(quick):
    from oasr.bench.accuracy import grid

    left = serving_chunking(default_model_path())[1]
    assert serving_chunking() == serving_chunking(default_model_path())  # the shipped model by default
    assert dict(grid(quick)) == dict(grid(quick, left))  # the serving window by default
    names = dict(grid(quick, left))
    window = f"left {'all' if left < 0 else left}"
    assert names[f"{window}, model dtype"] == {"num_left_chunks": left, "kv_cache_dtype": None}
    assert names[f"{window}, model dtype, reference twin"] == {"num_left_chunks": left, "twin": "reference"}
    assert names[f"{window}, model dtype, rescored"]["rescore"] and "full context" in names
    assert {c.get("num_left_chunks") for c in names.values()} >= {1, left, -1}
