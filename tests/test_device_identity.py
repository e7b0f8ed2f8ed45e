"""Device identity: ``cuda`` and ``cuda:0`` are one device when device 0 is current.

A config may name its device without an index (``torch.device("cuda")``) while every tensor reports
one (``cuda:0``); the first H200 run failed ``fill_cross: k is on cuda:0, the pool on cuda``. Every
device check goes through ``oasr.validate.same_device``; these tests pin the rule with device objects
(the current CUDA device monkeypatched on the CPU) and run the decoder's checks on an indexed CPU
device (``cpu:0`` vs a tensor's ``cpu``), which fail the same way a written ``!=`` did.
"""

from __future__ import annotations

import pytest
import torch

from oasr import fast, reference
from oasr.cache.validate import canonical_device, same_device
from tests.test_decode_step import admit_rows, make, tokens_for


@pytest.mark.parametrize("current", [0, 1])
def test_an_index_less_cuda_device_is_the_current_one(monkeypatch, current):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    cuda, zero, one = torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert canonical_device(cuda) == torch.device("cuda", current)
    assert same_device(cuda, zero) is (current == 0) and same_device(zero, cuda) is (current == 0)
    assert same_device(cuda, one) is (current == 1) and same_device("cuda", "cuda:1") is (current == 1)
    assert same_device(cuda, "cuda") and same_device(zero, "cuda:0")
    assert not same_device(zero, one)
    assert not same_device(cuda, torch.device("cpu")) and not same_device(zero, "cpu")


def test_cpu_without_an_index_is_cpu_zero():
    assert same_device(torch.device("cpu"), torch.device("cpu", 0)) and same_device("cpu:0", "cpu")
    assert not same_device("cpu", "meta")


@pytest.mark.parametrize("twin", ["reference", "fast"])
def test_decoder_on_an_indexed_device_takes_tensors_that_report_none(twin):
    """``cpu:0`` in the config, ``cpu`` on every tensor: fill_cross, prefill and steps all pass the checks."""
    ops = {"reference": reference, "fast": fast}[twin]
    decoder, cfg = make(device="cpu:0")
    assert cfg.device == torch.device("cpu", 0)
    manager = ops.DecoderKVCacheManager(cfg)
    group = admit_rows(decoder, manager, ops)  # fill_cross + prefill: raised "k is on cpu, the pool on cpu:0"
    with torch.no_grad():
        logits = decoder.step(group, torch.tensor(tokens_for(0, len(group.rows))))
    assert torch.isfinite(logits).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("twin", ["reference", "fast"])
def test_decoder_on_cuda_without_an_index_takes_cuda_zero_tensors(twin):
    """The H200 failure itself: a config on ``cuda``, tensors on ``cuda:N`` (the current device)."""
    ops = {"reference": reference, "fast": fast}[twin]
    decoder, cfg = make(device="cuda", head_dim=64)
    assert cfg.device.index is None
    manager = ops.DecoderKVCacheManager(cfg)
    group = admit_rows(decoder, manager, ops)
    with torch.no_grad():
        logits = decoder.step(group, torch.tensor(tokens_for(0, len(group.rows)), device="cuda"))
    assert torch.isfinite(logits).all()
