"""The launcher bench section: the attention launcher driving a no-op launch path on the CPU."""

from __future__ import annotations

from oasr.bench.launcher import NoopExecutor, make_view
from oasr.commands.bench import SECTIONS
from oasr.fast.kernels import ops


def test_launcher_section_is_registered_and_drives_one_launch_per_call():
    assert "launcher" in SECTIONS
    for pages in ("bf16", "fp8"):
        cache, q = make_view("cpu", pages)
        noop = NoopExecutor()
        out = ops.paged_attention(noop, q, cache, None, 0.125, False, version="v3")
        assert noop.launches == 1 and out.shape == q.shape  # one v3 launch, no split at 128 streams
