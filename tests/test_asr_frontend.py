"""The speech front end: audio loading and its refusals, streaming fbank == offline, tokenizer, error rates."""

import io
import struct

import numpy as np
import pytest
import soundfile as sf
import torch

from oasr.asr.audio import AudioError, check_pcm, decode_audio, load_audio
from oasr.asr.metrics import edit_distance, error_rates
from oasr.asr.testset import load_testset
from oasr.features.fbank import SAMPLE_RATE, OnlineFbank, fbank, num_frames
from oasr.tokenizers.char import CharTokenizer, normalize


def _clip_pcm():
    return load_audio(load_testset(limit=1)[0].path)


@pytest.mark.parametrize("seed", range(4))
def test_streaming_fbank_equals_offline(seed):
    pcm = _clip_pcm()
    offline = fbank(pcm)
    assert offline.shape == (num_frames(len(pcm)), 80)
    rng = np.random.default_rng(seed)
    online, frames, i = OnlineFbank(), [], 0
    while i < len(pcm):  # pieces of random size, including empty ones and single samples
        n = int(rng.choice([0, 1, 7, 160, 399, 400, 641, 5000]))
        frames.append(online.accept(pcm[i : i + n]))
        i += n
    frames.append(online.finish())
    assert np.array_equal(np.concatenate(frames), offline)


def test_fbank_refuses_nan_and_multichannel():
    with pytest.raises(ValueError, match="NaN"):
        fbank(np.array([0.0, np.nan] * 300, dtype=np.float32))
    with pytest.raises(ValueError, match="mono"):
        fbank(np.zeros((400, 2), np.float32))


def test_tokenizer_round_trip():
    tok = CharTokenizer()
    for text in ["set a timer for twenty minutes", "it's ten o'clock", "  Mixed   CASE  "]:
        ids = tok.encode(text)
        assert 0 not in ids and tok.sos_eos_id not in ids
        assert tok.decode(ids) == normalize(text)
    assert tok.decode([0, tok.encode("a")[0], 0, tok.sos_eos_id]) == "a"
    with pytest.raises(ValueError, match="outside the alphabet"):
        tok.encode("caf\u00e9 42")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])


def test_error_rates():
    assert edit_distance("kitten", "sitting") == 3
    r = error_rates(["a b c d", "x y"], ["a c d", "x y z"])
    assert r["word_errors"] == 2 and r["words"] == 6 and r["wer"] == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="2 references but 1"):
        error_rates(["a", "b"], ["a"])


def test_other_sample_rates_are_resampled(tmp_path):
    pcm = _clip_pcm()
    import soxr

    for rate in (8000, 22050, 44100):
        path = tmp_path / f"clip_{rate}.wav"
        sf.write(path, soxr.resample(pcm, SAMPLE_RATE, rate), rate, subtype="PCM_16")
        back = load_audio(path)
        assert abs(len(back) - len(pcm)) <= 2
        n = min(len(back), len(pcm))
        # the band below 4 kHz survives every round trip: correlation with the original stays high
        assert np.corrcoef(back[:n], pcm[:n])[0, 1] > (0.6 if rate == 8000 else 0.97)


@pytest.mark.parametrize("case", ["not audio", "empty", "channel", "nan", "rate", "missing", "truncated", "folder"])
def test_bad_audio_is_one_clear_error(tmp_path, case):
    path = tmp_path / "x.wav"
    if case == "not audio":
        path.write_text("this is not a recording\n" * 20)
        match = "not a readable audio file"
    elif case == "empty":
        path.write_bytes(b"")
        match = "empty"
    elif case == "channel":  # stereo is mixed down (below); a channel it does not have is refused
        sf.write(path, np.zeros((1600, 2), np.float32), SAMPLE_RATE)
        with pytest.raises(AudioError, match="2 channel"):
            load_audio(path, channel=2)
        return
    elif case == "truncated":  # a WAV cut inside its data
        sf.write(path, np.zeros(16000, np.float32), SAMPLE_RATE, subtype="PCM_16")
        path.write_bytes(path.read_bytes()[:-5000])
        match = "truncated WAV: its data chunk runs 5000 bytes past the end"
    elif case == "folder":
        path = tmp_path
        match = "a directory"
    elif case == "nan":
        x = np.zeros(1600, np.float32)
        x[5] = np.nan
        sf.write(path, x, SAMPLE_RATE, subtype="FLOAT")
        match = "NaN"
    elif case == "rate":
        sf.write(path, np.zeros(1600, np.float32), 4000)
        match = "outside"
    else:
        path = tmp_path / "nothing.wav"
        match = "no such file"
    with pytest.raises(AudioError, match=match):
        load_audio(path)
    assert issubclass(AudioError, ValueError)


@pytest.mark.parametrize("riff, data", [(0x7FFFF024, 0x7FFFF000), (0xFFFFFFFF, 0xFFFFFFFF), (0x24, 0)])
def test_a_streamed_wav_reads_to_its_end(tmp_path, riff, data):
    """A streaming writer (``espeak-ng --stdout``, a pipe) cannot fill in the sizes: placeholders are not a cut."""
    path = tmp_path / "streamed.wav"
    pcm = (np.sin(np.arange(8000) / 7.0) * 0.3).astype(np.float32)
    sf.write(path, pcm, SAMPLE_RATE, subtype="PCM_16")
    raw = bytearray(path.read_bytes())
    assert raw[36:40] == b"data"
    struct.pack_into("<I", raw, 4, riff)
    struct.pack_into("<I", raw, 40, data)
    path.write_bytes(bytes(raw) + b"\x01")  # and half a sample frame at the end (a pipe cut mid-frame)
    back = load_audio(path)
    assert len(back) == len(pcm) and np.abs(back - pcm).max() < 1e-3
    upload = io.BytesIO(b"xx" + path.read_bytes())  # a file object read from where it stands (an upload)
    upload.seek(2)
    assert np.array_equal(decode_audio(upload, "upload.wav"), back)


def test_a_huge_data_size_under_a_real_riff_size_is_a_cut(tmp_path):
    path = tmp_path / "cut.wav"
    sf.write(path, np.zeros(8000, np.float32), SAMPLE_RATE, subtype="PCM_16")
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 40, 0x7FFFF000)  # the RIFF size stays the file's own
    path.write_bytes(bytes(raw))
    with pytest.raises(AudioError, match="truncated WAV"):
        load_audio(path)


def test_stereo_is_mixed_down_or_one_channel_is_taken(tmp_path):
    # most recordings are stereo; they used to be refused
    pcm = _clip_pcm()
    left, right = pcm, np.roll(pcm, 800) * 0.5
    path = tmp_path / "stereo.wav"
    sf.write(path, np.stack([left, right], 1), SAMPLE_RATE, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(path), (left + right) / 2, atol=1e-7)
    np.testing.assert_array_equal(load_audio(path, channel=0), left)
    np.testing.assert_array_equal(load_audio(path, channel=1), right)
    with pytest.raises(AudioError, match="mix it down"):  # in memory, (N, C) stays refused: it is ambiguous
        check_pcm(np.stack([left, right], 1), SAMPLE_RATE)


def test_formats_libsndfile_reads_are_read(tmp_path):
    pcm = _clip_pcm()[:16000]
    for name, fmt, subtype in [("a.mp3", "MP3", "MPEG_LAYER_III"), ("a.ogg", "OGG", "VORBIS"), ("a.aiff", "AIFF",
                                                                                                   "PCM_16")]:
        if fmt not in sf.available_formats():
            continue
        sf.write(tmp_path / name, pcm, SAMPLE_RATE, format=fmt, subtype=subtype)
        got = load_audio(tmp_path / name)
        assert abs(len(got) - len(pcm)) < 2000 and np.isfinite(got).all(), name


def test_audio_error_imports_as_documented():
    from oasr.asr import AudioError as documented

    assert documented is AudioError


def test_testset_voice_column_plain_or_json_and_missing_clips(tmp_path):
    sf.write(tmp_path / "a.flac", np.zeros(1600, np.float32), SAMPLE_RATE)
    sf.write(tmp_path / "b.wav", np.zeros(1600, np.float32), SAMPLE_RATE)
    (tmp_path / "transcripts.tsv").write_text('a\thello there\t{"voice": "en+f3", "rate": 150}\nb\tbye\ten-us\n')
    clips = load_testset(tmp_path)
    assert [(c.id, c.text, c.voice, c.path.name) for c in clips] == [("a", "hello there", "en+f3", "a.flac"),
                                                                    ("b", "bye", "en-us", "b.wav")]
    (tmp_path / "transcripts.tsv").write_text("a\thello\nc\tgone\n")
    with pytest.raises(ValueError, match=r"transcripts.tsv:2: clip 'c' is listed but .*c.flac does not exist"):
        load_testset(tmp_path)
    (tmp_path / "transcripts.tsv").write_text("a hello\n")
    with pytest.raises(ValueError, match=r"transcripts.tsv:1: expected id<TAB>text"):
        load_testset(tmp_path)


def test_check_pcm_takes_int_samples_and_refuses_bad_rates():
    x = (np.sin(np.arange(1600) / 10) * 20000).astype(np.int16)
    y = check_pcm(x, SAMPLE_RATE)
    assert y.dtype == np.float32 and np.abs(y).max() <= 1.0
    with pytest.raises(AudioError, match="int"):
        check_pcm(y, 16000.0)
    with pytest.raises(AudioError, match="no samples"):
        check_pcm(np.zeros(0, np.float32), SAMPLE_RATE)
    assert torch.equal(torch.from_numpy(check_pcm(y[:, None], SAMPLE_RATE)), torch.from_numpy(y))


def test_shipped_testset_is_small_and_consistent():
    clips = load_testset()
    assert len(clips) >= 100
    size = sum(c.path.stat().st_size for c in clips)
    assert size < 8 * 2**20
    from oasr.asr.synth import TEST_VARIANTS, TRAIN_VARIANTS
    from oasr.asr.text import is_held_out

    for c in clips:  # held-out sentences, held-out voices
        assert is_held_out(c.text) and c.voice.split("+")[1] in TEST_VARIANTS
        assert c.voice.split("+")[1] not in TRAIN_VARIANTS
