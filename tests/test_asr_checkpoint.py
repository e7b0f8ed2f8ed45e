"""The model file: safetensors without pickle, refused whole when it is foreign, corrupted or misshapen."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from oasr.asr.checkpoint import FORMAT, load_checkpoint, read_header, save_checkpoint
from oasr.asr.model import AsrSpec, build
from oasr.features.fbank import GlobalCmvn

TINY = AsrSpec(
    encoder=dict(input_dim=80, hidden_dim=32, num_layers=1, n_head=2, n_kv_head=1, head_dim=16, ffn_dim=64,
                 kernel_size=3, chunk_size=4, num_left_chunks=2, subsample_channels=16, subsample_kernels=(5, 3)),
    decoder=dict(hidden_dim=32, num_layers=1, n_head=2, n_kv_head=1, head_dim=16, ffn_dim=64),
)


@pytest.fixture
def saved(tmp_path):
    enc, dec = build(TINY)
    cmvn = GlobalCmvn(torch.randn(80), torch.rand(80) + 0.5)
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, enc, dec, TINY, cmvn, {"steps": 3})
    return path, enc, dec, cmvn


def test_round_trip(saved):
    path, enc, dec, cmvn = saved
    enc2, dec2, spec, cmvn2, info = load_checkpoint(path)
    assert spec == TINY and info == {"steps": 3}
    for a, b in zip(list(enc.state_dict().values()) + list(dec.state_dict().values()),
                    list(enc2.state_dict().values()) + list(dec2.state_dict().values()), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(cmvn.mean, cmvn2.mean) and torch.equal(cmvn.istd, cmvn2.istd)
    enc3 = load_checkpoint(path, chunk_size=2, num_left_chunks=-1)[0]
    assert (enc3.config.chunk_size, enc3.config.num_left_chunks) == (2, -1)


def test_float16_storage_halves_the_file_and_loads_the_rounded_weights(saved, tmp_path):
    path, enc, dec, cmvn = saved
    half = tmp_path / "half.safetensors"
    save_checkpoint(half, enc, dec, TINY, cmvn, {"steps": 3}, weights="float16")
    assert read_header(half)["weights"] == "float16"
    assert half.stat().st_size < 0.6 * path.stat().st_size
    enc2, dec2, _, cmvn2, _ = load_checkpoint(half)
    for a, b in zip(list(enc.state_dict().values()) + list(dec.state_dict().values()),
                    list(enc2.state_dict().values()) + list(dec2.state_dict().values()), strict=True):
        assert b.dtype == a.dtype and torch.equal(b, a.half().to(a.dtype) if a.is_floating_point() else a)
    assert torch.equal(cmvn.mean, cmvn2.mean)  # CMVN stays float32
    meta = read_header(half)
    _rewrite(half, meta={**meta, "weights": "float32"})  # the header no longer says what the tensors are
    with pytest.raises(ValueError, match="the model needs torch.float32"):
        load_checkpoint(half)
    _rewrite(half, meta={**meta, "weights": "int4"})
    with pytest.raises(ValueError, match="weights stored as 'int4'"):
        load_checkpoint(half)
    with pytest.raises(ValueError, match="weights must be one of"):
        save_checkpoint(tmp_path / "x.safetensors", enc, dec, TINY, cmvn, weights="bfloat16")


def _rewrite(path, tensors=None, meta=None):
    old_t, old_m = load_file(str(path)), read_header(path)
    save_file(tensors if tensors is not None else old_t, str(path), metadata=meta if meta is not None else old_m)


def test_corrupted_bytes_are_refused(saved):
    path = saved[0]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a bit of the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_checkpoint(path)


def test_truncated_and_foreign_files_are_refused(saved, tmp_path):
    path = saved[0]
    short = tmp_path / "short.safetensors"
    short.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_checkpoint(short)
    text = tmp_path / "text.safetensors"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_checkpoint(text)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(3)}, str(foreign), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not an oasr speech model"):
        load_checkpoint(foreign)


def test_edited_spec_or_tensors_are_refused(saved):
    path = saved[0]
    meta = read_header(path)
    spec = json.loads(meta["spec"])
    spec["encoder"]["hidden_dim"] = 48
    _rewrite(path, meta={**meta, "spec": json.dumps(spec)})
    with pytest.raises(ValueError, match="do not match|is torch|checksum"):
        load_checkpoint(path)
    _rewrite(path, meta={**meta, "spec": "{\"encoder\": 3}"})
    with pytest.raises(ValueError, match="cannot be built"):
        load_checkpoint(path)


def test_misshapen_or_nonfinite_tensors_with_a_valid_digest_are_refused(saved):
    from oasr.asr.checkpoint import _digest

    path = saved[0]
    meta = read_header(path)
    tensors = load_file(str(path))
    bad = dict(tensors)
    bad["cmvn.mean"] = torch.zeros(81)
    _rewrite(path, bad, {**meta, "sha256": _digest(bad)})
    with pytest.raises(ValueError, match="cmvn.mean"):
        load_checkpoint(path)
    bad = dict(tensors)
    bad["decoder.out.bias"] = bad["decoder.out.bias"].clone()
    bad["decoder.out.bias"][0] = float("nan")
    _rewrite(path, bad, {**meta, "sha256": _digest(bad)})
    with pytest.raises(ValueError, match="non-finite"):
        load_checkpoint(path)
    bad = {k: v for k, v in tensors.items() if k != "encoder.ctc.bias"}
    _rewrite(path, bad, {**meta, "sha256": _digest(bad)})
    with pytest.raises(ValueError, match="missing"):
        load_checkpoint(path)
    assert meta["format"] == FORMAT
