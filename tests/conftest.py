"""Shared fixtures: the ``twin`` fixture runs a test body against both twins.

One conformance suite is the definition of "same API": every test that takes
``twin`` runs once with ``oasr.reference`` and once with ``oasr.fast``.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from hypothesis import settings

import oasr

TWINS = ("reference", "fast")

# One CPU thread for the suite, and for the processes it starts (the demo's subprocess, notebook
# kernels): the tests' tensors are small, and on a loaded machine torch's default of one thread per
# core made the engine and streaming tests some 60x slower. A test that wants more sets it itself.
torch.set_num_threads(1)
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")


def load_twin(name: str):
    module = importlib.import_module(f"oasr.{name}")
    if not hasattr(module, "AttentionCacheManager"):
        pytest.skip(f"oasr.{name} does not provide the cache managers yet")
    return module


@pytest.fixture(params=TWINS)
def twin(request):
    return load_twin(request.param)


def small_config(**overrides) -> oasr.CacheConfig:
    """A tiny geometry that keeps tests fast; override any field."""
    fields = dict(
        num_layers=2,
        n_kv_head=2,
        head_dim=8,
        hidden_dim=16,
        kernel_size=3,
        chunk_size=4,
        num_left_chunks=2,
        block_size_frames=4,
        max_num_blocks=32,
        max_batch_size=4,
        max_blocks_per_seq=8,
    )
    fields.update(overrides)
    return oasr.CacheConfig(**fields)


def snapshot(pool, att=None, cnn=None) -> dict:
    """Everything a failed call must leave untouched, in comparable form."""
    state = {
        "free": pool.free_block_ids(),
        "k": pool.k_pool.clone(),
        "v": pool.v_pool.clone(),
    }
    if att is not None:
        state["streams"] = {sid: att.describe(sid) for sid in att.stream_ids}
        views = {}
        for sid in att.stream_ids:
            try:
                views[sid] = [t.clone() for t in att.get_paged_state_views(sid)]
            except RuntimeError:
                views[sid] = None
        state["views"] = views
        state["slots_free"] = att.slots.num_free
    if cnn is not None:
        state["cnn"] = cnn.buffer.clone()
    return state


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                               y.view(torch.uint8) if y.is_floating_point() else y), key
        elif key == "views":
            assert x.keys() == y.keys()
            for sid in x:
                if x[sid] is None:
                    assert y[sid] is None
                else:
                    assert all(torch.equal(p, q) for p, q in zip(x[sid], y[sid], strict=True)), sid
        else:
            assert x == y, key


# In CI (OASR_REQUIRE_KERNELS=1, set by .ci/run) a missing compiler or NVRTC must fail the run:
# otherwise "the kernels pass under emulation" could quietly become "the kernel tests were skipped".
_TOOLCHAIN_SKIPS = ("kernel emulation unavailable", "NVRTC unavailable")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("OASR_REQUIRE_KERNELS") == "1":
        reason = str(report.longrepr)
        if any(text in reason for text in _TOOLCHAIN_SKIPS):
            report.outcome = "failed"
            report.longrepr = f"OASR_REQUIRE_KERNELS=1 but the toolchain is missing: {reason}"


# CI runs a fixed sequence of hypothesis examples, so a red build always reproduces; development
# runs keep exploring new ones (and would find what CI's fixed draws miss).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="module")
def emu():
    """The host-emulated kernel executor, every kernel loaded (a toolchain skip when it cannot build)."""
    from oasr.fast.kernels import emulation

    missing = emulation.unavailable_reason()
    if missing is not None:
        pytest.skip(f"kernel emulation unavailable: {missing}")
    executor = emulation.executor()
    executor.load_all()
    return executor
