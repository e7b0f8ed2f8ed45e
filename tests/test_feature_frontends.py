"""The front-end registry: ``kaldi_fbank`` (wrapped) and ``nemo_mel`` against transformers' extractor.

``nemo_mel`` streamed in pieces of any size equals transformers' ``NemotronAsrStreamingFeatureExtractor``
on the whole audio within 1e-5, and equals its documented streaming protocol (first chunk centred, later
chunks from ``n_fft // 2`` samples before their first frame with ``center=False``, the last chunk padded
with ``is_last_audio_chunk``), chunk for chunk.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.features import KaldiFbank, NemoMel, NemoMelConfig, build_extractor, list_extractors
from oasr.features import fbank as kaldi_features

sys.path.insert(0, str(Path(__file__).parent))
from nemotron_rnnt_oracle import clip  # noqa: E402

transformers = pytest.importorskip("transformers")

EXTRACTOR_CONFIGS = [
    dict(feature_size=80),
    dict(feature_size=16, hop_length=128, n_fft=400, win_length=320, preemphasis=0.9),
    dict(feature_size=40, preemphasis=0.0, mel_filters_dtype="bfloat16"),
]


def _hf_extractor(tmp_path, fields):
    from transformers import NemotronAsrStreamingFeatureExtractor

    fe = NemotronAsrStreamingFeatureExtractor(**fields)
    fe.save_pretrained(tmp_path)
    return fe


def _hf_whole(fe, pcm):
    out = fe(pcm, sampling_rate=16000, return_tensors="pt")
    return out.input_features[0][: int(out.attention_mask[0].sum())].numpy()


def test_registry_lists_both_and_refuses_unknown():
    assert {"kaldi_fbank", "nemo_mel"} <= set(list_extractors())
    assert isinstance(build_extractor("kaldi_fbank"), KaldiFbank)
    assert build_extractor("nemo_mel", feature_size=16).num_bins == 16
    with pytest.raises(ValueError, match="unknown feature front end 'mfcc'; known: .*kaldi_fbank.*nemo_mel"):
        build_extractor("mfcc")
    assert build_extractor("kaldi_fbank").supports_streaming and build_extractor("nemo_mel").supports_streaming


def test_kaldi_fbank_is_the_shipped_front_end():
    pcm = clip(1, 1.3)
    fb = build_extractor("kaldi_fbank")
    stream = fb.online()
    pieces = [stream.accept(pcm[:777]), stream.accept(pcm[777:]), stream.finish()]
    np.testing.assert_array_equal(np.concatenate(pieces), kaldi_features.fbank(pcm))
    np.testing.assert_array_equal(fb.extract(pcm), kaldi_features.fbank(pcm))


@pytest.mark.parametrize("fields", EXTRACTOR_CONFIGS, ids=["default80", "odd-grid", "bf16-filters-no-emph"])
def test_nemo_mel_streamed_equals_transformers_whole(tmp_path, fields):
    fe = _hf_extractor(tmp_path, fields)
    mel = NemoMel.from_checkpoint(tmp_path)
    assert mel.config == NemoMelConfig(**fields)
    rng = np.random.default_rng(0)
    for index, seconds in [(0, 1.7), (2, None), (3, 0.0123), (4, 0.001)]:
        pcm = clip(index, seconds)
        want = _hf_whole(fe, pcm)
        got_whole = mel.extract(pcm)
        assert got_whole.shape == want.shape == (mel.num_frames(len(pcm)), mel.num_bins)
        np.testing.assert_allclose(got_whole, want, atol=1e-5, rtol=0)
        stream, parts, pos = mel.online(), [], 0
        while pos < len(pcm):  # pieces of random size, some empty, some shorter than a hop
            step = int(rng.choice([0, 1, 37, 160, 511, 2000]))
            parts.append(stream.accept(pcm[pos : pos + step]))
            pos += step
        parts.append(stream.finish())
        np.testing.assert_allclose(np.concatenate(parts), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lookahead", [13, 1, 0])
def test_nemo_mel_equals_transformers_streaming_protocol(tmp_path, lookahead):
    """The processor's chunk sizes: first chunk centred, later ones with the n_fft//2 overlap, last padded."""
    from transformers import NemotronAsrStreamingProcessor
    from transformers.models.parakeet.tokenization_parakeet import ParakeetTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from nemotron_rnnt_oracle import train_tokenizer

    fe = _hf_extractor(tmp_path, {})
    tok = ParakeetTokenizer(tokenizer_object=train_tokenizer(), unk_token="<unk>", pad_token="<unk>")
    proc = NemotronAsrStreamingProcessor(fe, tok)
    proc.set_num_lookahead_tokens(lookahead)
    hop, half = fe.hop_length, fe.n_fft // 2
    pcm = clip(5, 2.3)
    mel = NemoMel.from_checkpoint(tmp_path)
    stream = mel.online()
    first = proc(pcm[: proc.num_samples_first_audio_chunk], sampling_rate=16000, is_streaming=True)
    want = [first.input_features[0][: proc.num_mel_frames_first_audio_chunk].numpy()]
    got = [stream.accept(pcm[: proc.num_samples_first_audio_chunk])]
    frame = proc.num_mel_frames_first_audio_chunk
    fed = proc.num_samples_first_audio_chunk
    while True:
        start = hop * frame - half
        piece = pcm[max(start, 0) : start + proc.num_samples_per_audio_chunk]
        piece = np.concatenate([np.zeros(max(0, -start), np.float32), piece])  # a negative start: the centring zeros
        last = start + proc.num_samples_per_audio_chunk >= len(pcm)
        # the processor does not pass is_last_audio_chunk on: its feature extractor is called as it would
        out = proc.feature_extractor(piece, sampling_rate=16000, center=False, is_last_audio_chunk=last,
                                     return_tensors="pt")
        want.append(out.input_features[0][: int(out.attention_mask[0].sum())].numpy())
        got.append(stream.accept(pcm[fed : start + proc.num_samples_per_audio_chunk]))
        fed = max(fed, start + proc.num_samples_per_audio_chunk)
        if last:
            got.append(stream.finish())
            break
        frame += proc.num_mel_frames_per_audio_chunk
    want, got = np.concatenate(want), np.concatenate(got)
    assert want.shape == got.shape == (mel.num_frames(len(pcm)), 80)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_nemo_mel_refuses_bad_files(tmp_path):
    with pytest.raises(ValueError, match="no preprocessor_config.json or processor_config.json"):
        NemoMelConfig.from_checkpoint(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        NemoMelConfig.from_checkpoint(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"feature_size": 80}))
    with pytest.raises(ValueError, match="lacks sampling_rate, hop_length, n_fft, win_length, preemphasis"):
        NemoMelConfig.from_checkpoint(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"feature_extractor_type": "WhisperFeatureExtractor"}))
    with pytest.raises(ValueError, match="'WhisperFeatureExtractor' is not the NeMo-style log-mel of nemo_mel"):
        NemoMelConfig.from_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="mel_filters_dtype must be one of"):
        NemoMelConfig(mel_filters_dtype="int8")


def test_nemo_mel_online_refuses_bad_audio():
    stream = NemoMel().online()
    with pytest.raises(ValueError, match="1-D array"):
        stream.accept(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="NaN or infinite"):
        stream.accept(np.array([0.0, np.nan]))
    assert stream.received == 0 and stream.emitted == 0
    stream.finish()
    with pytest.raises(ValueError, match="already finished"):
        stream.accept(np.zeros(3))
    assert torch.is_tensor(NemoMel().window)
