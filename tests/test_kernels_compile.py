"""Every kernel compiles with NVRTC for sm_80 and sm_90 (no GPU, no driver) within its budget.

The baseline kernels must not spill, keep no stack frame, and stay under the
48 KB of static shared memory a CTA can declare; the attention kernel's budget
is worked out in the header of oasr/kernels_cu/paged_chunk_attention.cu. The fp8
page variants are registry entries like the others, so the same checks cover
them (sm_80 converts e4m3 in software, sm_90 with the hardware cvt).
"""

from __future__ import annotations

import pytest

from oasr.fast.kernels import nvrtc, registry

ARCHS = ["sm_80", "sm_90"]
STATIC_SMEM_LIMIT = 48 * 1024

try:
    nvrtc.cuda_include_dir()
    from cuda.core import Program  # noqa: F401

    _MISSING = None
except Exception as exc:  # cuda-python or the CUDA headers are not installed
    _MISSING = str(exc)

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"NVRTC unavailable: {_MISSING}")


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    # A fresh cache: compile for real here, and let the command test reuse it.
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("kernel-cache")
        mp.setenv("OASR_KERNEL_CACHE", str(path))
        yield path


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", registry.families())
def test_family_compiles_without_spills(kernel_cache, family, arch):
    compiled = nvrtc.compile_family(family, arch)
    assert not compiled.cached
    expected = {k.name_expression(t) for k in registry.kernels_of(family) for t in k.instances}
    assert set(compiled.resources) == expected
    for expr, res in compiled.resources.items():
        assert res.registers > 0, f"{expr}: no ptxas report parsed"
        assert (res.spill_stores, res.spill_loads) == (0, 0), f"{expr} spills on {arch}: {res}"
        assert res.stack_bytes == 0, f"{expr} uses a stack frame on {arch}: {res}"
        assert res.shared_bytes <= STATIC_SMEM_LIMIT, f"{expr}: {res.shared_bytes} B of static shared memory"
    again = nvrtc.compile_family(family, arch)
    assert again.cached and again.resources == compiled.resources


@pytest.mark.parametrize("family", ["paged_chunk_attention_v3", "paged_kv_append"])
def test_one_instantiation_compiles_alone(kernel_cache, family):
    """What a launch compiles on a cold cache: its own instantiation, one small program (a
    cold test file compiled every family), cached under its own key."""
    kernel = registry.kernels_of(family)[0]
    expr = kernel.name_expression(kernel.instances[0])
    compiled = nvrtc.compile_family(family, "sm_90", expressions=[expr])
    assert set(compiled.symbols) == {expr} and compiled.resources[expr].registers > 0
    assert nvrtc.compile_family(family, "sm_90", expressions=[expr]).cached


def test_warm_cache_compiles_what_a_launch_reads(kernel_cache, monkeypatch, capsys):
    """``python -m oasr kernels --warm``: each instantiation compiled on its own, in worker processes; a launch's
    lazy compile of that instantiation is then a cache hit (two instantiations here, to stay quick)."""
    import dataclasses

    from oasr.commands.kernels import main

    kernel = registry.BY_NAME["gather_kv_blocks_kernel"]
    small = dataclasses.replace(kernel, instances=kernel.instances[:2])
    monkeypatch.setattr(registry, "KERNELS", (small,))
    assert main(["--arch", "sm_90", "--warm", "--jobs", "2"]) == 0
    assert "2 instantiations cached for sm_90" in capsys.readouterr().out
    for targs in small.instances:
        assert nvrtc.compile_family(small.family, "sm_90", expressions=[small.name_expression(targs)]).cached


def test_kernels_command_reports_every_kernel(kernel_cache, capsys):
    from oasr.commands.kernels import main

    assert main(["--arch", ",".join(ARCHS), "--fail-on-spill", "--verbose"]) == 0
    out = capsys.readouterr().out
    for kernel in registry.KERNELS:
        for targs in kernel.instances:
            assert kernel.name_expression(targs) in out
    assert "0 compile errors, 0 spilling" in out


def test_fp8_variants_are_registered():
    # The fp8 page kernels are in the registry (so compiled, reported and budget-checked above) for
    # every model dtype and every head_dim the fp8 refusal admits.
    expect = {(t, str(d)) for t in registry.DTYPE_ARG.values() for d in registry.FP8_HEAD_DIMS}
    assert set(registry.BY_NAME["paged_kv_append_fp8_kernel"].instances) == expect
    instances = registry.BY_NAME["paged_chunk_attention_kernel"].instances
    attention = {(t, d) for t, page, d, *rel in instances if page == registry.FP8_ARG and not rel}
    assert attention == expect
    # and each with the relative-position term (oasr.cache.rel_bias)
    with_term = {(t, d) for t, page, d, *rel in instances if page == registry.FP8_ARG and rel == [registry.REL_ARG]}
    assert with_term == expect
    assert {t for (t,) in registry.BY_NAME["gather_kv_blocks_fp8_kernel"].instances} == set(registry.DTYPE_ARG.values())


def test_kernels_command_fails_on_compile_error(kernel_cache, capsys, monkeypatch):
    from oasr.commands.kernels import main

    def broken(family, arch, use_cache=True):
        raise RuntimeError(f"NVRTC failed to compile {family}.cu for {arch}")

    monkeypatch.setattr(nvrtc, "compile_family", broken)
    assert main(["--arch", "sm_80"]) == 1  # every family fails: reported, then exit 1
    assert "compile errors" in capsys.readouterr().out


def test_ptxas_log_parser_reads_spills():
    log = """ptxas info    : Compiling entry function '_Zfoo' for 'sm_90'
ptxas info    : Function properties for _Zfoo
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 46080 bytes smem, 400 bytes cmem[0]
"""
    res = nvrtc.parse_ptxas_log(log)["_Zfoo"]
    assert (res.registers, res.barriers, res.shared_bytes) == (255, 1, 46080)
    assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (24, 8, 12)


def test_attention_v2_is_registered_for_everything_the_launcher_may_choose():
    # ops.v2_supports admits fp16/bf16 queries, pages in that dtype or fp8, HEAD_DIMS, V2_BLOCK_SIZES:
    # every such combination is an instantiation (so compiled, spill-checked and reported above).
    expect = {
        (t, page, str(d), str(bs))
        for t in registry.V2_DTYPE_ARG.values()
        for page in (t, registry.FP8_ARG)
        for d in registry.HEAD_DIMS
        for bs in registry.V2_BLOCK_SIZES
    }
    assert set(registry.BY_NAME["paged_chunk_attention_v2_kernel"].instances) == expect
    assert "paged_chunk_attention_v2" in registry.families()
    # v3 serves what v2 serves (ops.ATTENTION_SERVES), so it has the same instantiations, each also with the
    # relative-position term (registry.REL_ARG)
    assert set(registry.BY_NAME["paged_chunk_attention_v3_kernel"].instances) == expect | {
        (*a, registry.REL_ARG) for a in expect}
    assert "paged_chunk_attention_v3" in registry.families()
