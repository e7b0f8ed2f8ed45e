"""The relative-position term on a real GPU: v1 and v3 against the reference, and under CUDA-graph capture.

Marked ``cuda`` and skipped without a device. The same scenarios and bounds as the emulated suite
(tests/test_rel_bias_kernels.py): shuffled tables, NaN in every pool slot and table entry nothing
may read, head_dim 64 and 128 (Nemotron's), model-dtype and fp8 pages.
"""

from __future__ import annotations

import random

import pytest
import torch

from oasr.cache.rel_bias import required_columns
from oasr.fast import paged_ops as fast
from oasr.fast.kernels import ops
from oasr.fast.kernels.nvrtc import executor_for
from oasr.fast.kernels.testing import make_scenario, to_fp8
from oasr.reference import paged_ops as ref
from tests.test_rel_bias import poisoned_bias
from tests.test_rel_bias_kernels import check_v1, check_v3

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def device():
    dev = torch.device("cuda", torch.cuda.current_device())
    fast.load_kernels(dev)
    return dev


def _case(seed, dtype, head_dim, fp8, causal):
    rng = random.Random(seed)
    T = rng.randint(1, 16)
    s = make_scenario(seed, batch=rng.randint(1, 8), n_kv_head=rng.choice([1, 2, 4]), group=rng.choice([1, 2, 4]),
                      num_frames=T, head_dim=head_dim, block_size=rng.choice([8, 16, 32, 64]),
                      max_history=rng.randint(0, 300), dtype=dtype)
    if fp8:
        s = to_fp8(s)
    ref.append_kv(s.cache, s.k, s.v, s.chunk_lens)
    bias = poisoned_bias(s, required_columns(s.cache.max_span, T) + rng.randint(0, 5), seed, causal)
    return s, bias


CASES = [(dtype, hd, fp8, seed) for dtype in (torch.float16, torch.bfloat16) for hd in (64, 128)
         for fp8 in (False, True) for seed in range(3)]


@pytest.mark.parametrize("dtype,head_dim,fp8,seed", CASES)
def test_v1_and_v3_match_reference(device, dtype, head_dim, fp8, seed):
    causal = seed % 2 == 1
    s, bias = _case(seed, dtype, head_dim, fp8, causal)
    g = s.to(device=device)
    executor = executor_for(device)
    lens = g.chunk_lens.to(torch.int32)
    scale = head_dim**-0.5
    expected = ref.paged_attention(s.q, s.cache, s.chunk_lens, causal=causal, rel_bias=bias)
    for version in ops.REL_VERSIONS:
        for splits in (None, 3):
            out = ops.paged_attention(executor, g.q, g.cache, lens, scale, causal, splits, version=version,
                                      rel_bias=bias.to(device))
            if version == "v1":
                check_v1(out.cpu(), expected)
            else:
                check_v3(out.cpu(), s, bias, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_on_cuda_under_graph_capture(device, dtype):
    """The fast twin's own choice (v3 or v1), captured once and replayed over new table contents."""
    s, bias = _case(5, dtype, 128, False, False)
    g = s.to(device=device)
    table = bias.to(device)
    eager = fast.paged_attention(g.q, g.cache, g.chunk_lens, rel_bias=table)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fast.paged_attention(g.q, g.cache, g.chunk_lens, rel_bias=table)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    table.copy_(bias * 0.5)  # new values in place (the unread entries stay NaN)
    graph.replay()
    expected = ref.paged_attention(s.q, s.cache, s.chunk_lens, rel_bias=bias * 0.5)
    torch.cuda.synchronize()
    assert not captured.isnan().any()
    torch.testing.assert_close(captured.float().cpu(), expected.float(), rtol=2e-2, atol=2e-2)
