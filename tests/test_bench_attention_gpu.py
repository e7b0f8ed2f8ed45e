"""The GPU attention bench (oasr.bench.attention_gpu), what can be checked without a GPU.

It refuses a CPU device before doing anything, its bytes-moved arithmetic is the tick's traffic,
and its cohort and SDPA contender compute the same attention as the fast twin's torch path (so a
GPU row's ``max_err`` compares like with like). The timed comparison itself runs only on a GPU
(tools/gpu_check.sh); it has not run yet.
"""

from __future__ import annotations

import pytest
import torch

from oasr.bench import attention_gpu as gpu
from oasr.fast import paged_ops as fast


def test_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        gpu.section(True, "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        gpu.require_cuda(torch.device("cpu"))


@pytest.mark.parametrize("history", gpu.HISTORIES)
def test_bytes_moved(history):
    keys, q_out = history + 16, 2 * 128 * 8 * 16 * 64 * 2  # q read + out written, bf16
    assert gpu.bytes_moved(history, "bf16") == 2 * 128 * keys * 4 * 64 * 2 + q_out
    assert gpu.bytes_moved(history, "fp8") == 2 * 128 * keys * 4 * (64 + 4) + q_out  # e4m3 + fp32 scale per vector
    assert gpu.bytes_moved(history, "fp8") < gpu.bytes_moved(history, "bf16")


@pytest.mark.parametrize("page", ["bf16", "fp8"])
def test_cohort_and_error_oracle_match_the_fast_twin(page):
    torch.manual_seed(0)
    cache, q = gpu.make_cohort(256, page, "cpu")
    assert cache.quantized == (page == "fp8") and q.shape == (128, 8, 16, 64)
    assert int(cache.block_table.unique().numel()) == cache.block_table.numel()  # every page distinct
    expect = gpu.fp32_expected(cache, q, 256 + 16)  # what a GPU row's max_err is measured against
    want = fast.paged_attention(q, cache, backend="torch")  # fp32 over the window [0, history + chunk), bf16 out
    # the fast path rounds the same fp32 value to bf16 once: half a bf16 ulp, plus summation-order slack
    assert ((expect - want.float()).abs() <= 2.0**-8 * want.float().abs() + 1e-6).all()
    assert gpu._sdpa_gather(cache, q, 256 + 16).shape == want.shape
