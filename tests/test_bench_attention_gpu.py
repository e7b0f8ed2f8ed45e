"""The GPU attention bench (oasr.bench.attention_gpu), what can be checked without a GPU.

It refuses a CPU device before doing anything, its bytes-moved arithmetic is the tick's traffic,
and its cohort and SDPA contender compute the same attention as the fast twin's torch path (so a
GPU row's ``max_err`` compares like with like). The timed comparison itself runs only on a GPU
(tools/gpu_check.sh). The FlexAttention peer's inputs (run eagerly on the CPU) and the markdown report
of tools/gpu_report.py are checked here.
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


@pytest.mark.parametrize("page", ["bf16", "fp8"])
@pytest.mark.parametrize("history", [32, 40])  # keys 48 (whole pages) and 56 (a partial last page)
def test_flex_inputs_attend_to_each_streams_own_pages(page, history):
    # The FlexAttention peer's inputs, run eagerly on the CPU: the same attention as the fp32 oracle,
    # over the pool's own pages through the block mask (a stray page would change the numbers).
    flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
    torch.manual_seed(1)
    cache, q = gpu.make_cohort(history, page, "cpu", streams=3)
    keys = history + 16
    q_flat, k, v, mask = gpu.flex_inputs(cache, q, keys)
    assert k.shape == (1, 4, cache.k_cache.shape[0] * 16, 64) and q_flat.shape == (1, 8, 3 * 16, 64)
    out = flex_attention(q_flat.float(), k.float(), v.float(), block_mask=mask, enable_gqa=True)
    out = out.view(8, 3, 16, 64).transpose(0, 1)
    expect = gpu.fp32_expected(cache, q, keys)
    # fp32 on the same (bf16, or dequantized to bf16) values: only the summation order differs
    assert ((out - expect).abs() <= 1e-5 * (1 + expect.abs())).all()


def test_gpu_report_tables_and_refusal(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_report", Path(__file__).parents[1] / "tools" / "gpu_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    rows = [
        {"section": "attention", "case": "streams=8 history=256", "fast_ms": 1.0},  # the 12-layer rows: ignored
        {"section": "attention", "case": "gpu bf16 pages, 128 streams, history=1024", "kernel": "v3",
         "copy_GBps": 4200.0, "us": 120.0, "of_copy_bw": 0.28, "graph_us": 40.0, "graph_GBps": 3525.0,
         "graph_of_copy_bw": 0.84, "host_us": 30.0, "max_err": 1e-3, "note": ""},
        {"section": "attention", "case": "gpu fp8 pages, 128 streams, history=1024", "kernel": "flex-paged",
         "copy_GBps": 4200.0, "note": "not run on fp8 pages"},
    ]  # fmt: skip
    text = report.tables(rows)
    assert "| 1024 | v3 | 40.0 | 120.0 | 30.0 | 3,525 | 84% | 28% | 1.0e-03 |  |" in text
    assert "fp8 pages:" in text and "| 1024 | flex-paged | - | - | - | - | - | - | - | not run on fp8 pages |" in text
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    doc = tmp_path / "kernels.md"
    doc.write_text("# Kernels\n")
    assert report.main([str(path), "--device", "NVIDIA H200", "--append", str(doc)]) == 0
    assert "### Measured by tools/gpu_check.sh on NVIDIA H200" in doc.read_text() and "| 1024 | v3 |" in doc.read_text()
    path.write_text(json.dumps(rows[:1]))
    assert report.main([str(path)]) == 2  # no GPU rows: one clear refusal, nothing appended
