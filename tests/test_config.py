"""CacheConfig: derived geometry and validation messages that name fields and numbers."""

import math

import pytest
import torch

import oasr
from tests.conftest import small_config


def test_seed_defaults_derive():
    cfg = oasr.CacheConfig()
    assert cfg.kv_last_dim == 128
    assert cfg.cnn_cache_frames == 14
    assert cfg.max_logical_blocks is None and not cfg.eviction
    assert cfg.blocks_per_stream == min(512, 1024 // 32) == 32
    assert cfg.max_stream_frames == 32 * 16
    assert cfg.device == torch.device("cpu") and cfg.dtype == torch.float32


@pytest.mark.parametrize(
    "chunk, bs, left, expected",
    [
        (16, 16, 4, 5),  # aligned: num_left_chunks + 1
        (16, 8, 4, 10),  # block smaller than the chunk, aligned
        (16, 64, 4, 2),  # block larger than the chunk: window straddles at most 2 blocks
        (6, 4, 2, 5),  # gcd 2: the window starts 0 or 2 frames into a block
        (4, 4, 0, 1),  # no history
        (3, 8, 1, 2),
    ],
)
def test_max_logical_blocks(chunk, bs, left, expected):
    cfg = oasr.CacheConfig(chunk_size=chunk, block_size_frames=bs, num_left_chunks=left, max_num_blocks=4096)
    assert cfg.max_logical_blocks == expected
    g = math.gcd(chunk, bs)
    assert expected == math.ceil((bs - g + left * chunk + chunk) / bs)


def test_max_logical_blocks_is_attained_and_never_exceeded():
    """Brute force: walk every chunk position for many commits and count blocks spanned."""
    for chunk in range(1, 9):
        for bs in range(1, 9):
            for left in range(0, 4):
                W = left * chunk
                worst = 0
                first = 0  # first held block
                for c in range(60):
                    seqlen_abs = c * chunk
                    last = math.ceil((seqlen_abs + chunk) / bs)
                    worst = max(worst, last - first)
                    visible = max(0, seqlen_abs + chunk - W)
                    first = max(first, visible // bs)
                cfg = oasr.CacheConfig(chunk_size=chunk, block_size_frames=bs, num_left_chunks=left,
                                       max_num_blocks=100_000, max_blocks_per_seq=512)
                assert worst <= cfg.max_logical_blocks, (chunk, bs, left)
                assert worst == cfg.max_logical_blocks, (chunk, bs, left)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(num_layers=0), ["num_layers", "0"]),
        (dict(head_dim=-4), ["head_dim", "-4"]),
        (dict(chunk_size=2.5), ["chunk_size", "2.5"]),
        (dict(num_left_chunks=-2), ["num_left_chunks", "-2"]),
        (dict(num_left_chunks=4, max_blocks_per_seq=3), ["max_blocks_per_seq=3", "max_logical_blocks=5"]),
        (dict(num_left_chunks=4, max_num_blocks=100, max_batch_size=32),
         ["max_num_blocks=100", "max_batch_size=32", "160"]),
        (dict(prefill_kv_window=True), ["prefill_kv_window", "num_left_chunks=-1"]),
        (dict(prefill_kv_window=True, num_left_chunks=0), ["prefill_kv_window", "num_left_chunks=0"]),
        (dict(max_num_blocks=31, max_batch_size=32), ["blocks_per_stream=0", "needs 1"]),
        (dict(dtype="float7"), ["dtype", "float7"]),
    ],
)
def test_validation_names_fields_and_numbers(overrides, words):
    with pytest.raises(ValueError) as info:
        oasr.CacheConfig(**overrides)
    for word in words:
        assert word in str(info.value)


def test_any_chunk_block_ratio_is_valid():
    for chunk, bs in [(16, 4), (4, 16), (6, 4), (5, 7)]:
        cfg = small_config(chunk_size=chunk, block_size_frames=bs, max_num_blocks=256, max_blocks_per_seq=32)
        assert cfg.max_logical_blocks >= 1


def test_prefill_geometry():
    cfg = small_config(prefill_kv_window=True, chunk_size=6, block_size_frames=4, num_left_chunks=2,
                       max_num_blocks=64)
    assert cfg.prefill_frames == 12 and cfg.prefill_blocks == 3
    assert cfg.max_stream_frames is None


def test_strings_normalise():
    cfg = oasr.CacheConfig(device="cpu", dtype="bf16")
    assert cfg.dtype is torch.bfloat16 and cfg.device.type == "cpu"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_non_float_model_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match=f"CacheConfig.dtype: the model dtype must be a floating-point .* got {dtype}"):
        small_config(dtype=dtype)
