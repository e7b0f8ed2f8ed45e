"""K/V page formats (oasr.kv_formats): stored bytes against independent oracles, both twins bit for
bit, dequantization error within each rule's bound, the format gate, and the memory arithmetic."""

import numpy as np
import pytest
import torch

import oasr
from oasr.cache import memory
from oasr.decoder.config import DecoderCacheConfig
from oasr.fast import kv_formats as fast_formats
from oasr.kv_formats import FORMATS, auto_format, get_format
from oasr.kv_formats import q8_0 as q8_0_rule
from tests.conftest import small_config

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZED = [name for name in FORMATS if name != "model"]


def raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor (NaN == NaN when the bytes agree)."""
    return t.contiguous().view(torch.uint8).numpy()


def adversarial(dtype: torch.dtype, D: int = 64) -> dict[str, torch.Tensor]:
    """(4, D) inputs that probe each rule's corners, representable in ``dtype``."""
    g = torch.Generator().manual_seed(3)
    tiny = torch.finfo(dtype).tiny  # smallest normal
    cases = {
        "random": torch.randn(4, D, generator=g),
        "zeros": torch.zeros(4, D),
        "subnormal": torch.randn(4, D, generator=g) * tiny / 4,
        "ties": torch.arange(4 * D).float().reshape(4, D) % 64 - 31.5,  # halves: ties of every rounding rule
        "one_big": torch.where(torch.arange(D) == 5, 1000.0, 0.25).expand(4, D).clone(),
        "constant": torch.full((4, D), 3.0),
        "huge": torch.linspace(-1, 1, 4 * D).reshape(4, D) * (65504.0 if dtype is torch.float16 else 1e9),
    }
    return {name: x.to(dtype) for name, x in cases.items()}


# ---- oracles written from the rules (numpy, not torch) ----------------------------------------


def int8_oracle(x: np.ndarray):
    x = x.astype(np.float32)
    scale = np.maximum(np.abs(x).max(axis=-1) / np.float32(127), np.float32(2.0**-149)).astype(np.float32)
    q = np.clip(np.rint(x / scale[..., None]), -127, 127).astype(np.int8)  # np.rint: half to even
    return q, scale


def affine4_oracle(x: np.ndarray, model: np.dtype | None, group: int):
    """model: the numpy dtype of the model (np.float16 / np.float32); bf16 goes through torch rounding."""
    def to_model(a):
        if model is None:  # bf16: round through torch (numpy has no bf16)
            return torch.from_numpy(a).bfloat16().float().numpy()
        return a.astype(model).astype(np.float32)

    x = x.astype(np.float32)
    g = x.reshape(*x.shape[:-1], -1, group)
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    scale = to_model((hi - lo) / np.float32(15))
    bias = to_model(lo)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale == 0, 0, np.clip(np.rint((g - bias) / scale), 0, 15)).astype(np.uint8)
    q = q.reshape(x.shape)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale[..., 0], bias[..., 0]


def gguf_q8_0(x: torch.Tensor) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf_quants.quantize(x.float().numpy().reshape(-1, x.shape[-1]), GGMLQuantizationType.Q8_0)


# ---- bytes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("case", ["random", "zeros", "subnormal", "ties", "one_big", "constant", "huge"])
@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_q8_0_bytes_equal_gguf(dtype, case, impl):
    x = adversarial(dtype, 128)[case]
    if impl == "reference":
        q, d = q8_0_rule.quantize(x)
    else:
        q, d = fast_formats.quantize_q8_0(x)
    ours = q8_0_rule.to_ggml_blocks(q, d).numpy().reshape(x.shape[0], -1)
    np.testing.assert_array_equal(ours, gguf_q8_0(x).reshape(x.shape[0], -1))


def test_q8_0_ties_round_away_from_zero():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5] + [0.0] * 27])  # d = 1: q = roundf(x)
    q, d = q8_0_rule.quantize(x)
    assert float(d[0, 0]) == 1.0
    assert q[0, :5].tolist() == [127, 1, -1, 2, -3]


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("case", ["random", "zeros", "subnormal", "ties", "one_big", "constant", "huge"])
def test_int8_and_affine4_bytes_equal_oracles(dtype, case):
    x = adversarial(dtype)[case]
    for impl in (get_format("int8").quantize, lambda t, m=None: fast_formats.quantize_int8(t, m)):
        q, scale = impl(x, dtype)
        oq, oscale = int8_oracle(x.float().numpy())
        np.testing.assert_array_equal(q.numpy(), oq)
        np.testing.assert_array_equal(scale.numpy(), oscale)
    model = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: None}[dtype]
    for group in (32, 64):
        name = "affine4" if group == 32 else "affine4_g64"
        for packed, params in (FORMATS[name].quantize(x, dtype), fast_formats.quantize(name, x, dtype)):
            opacked, oscale, obias = affine4_oracle(x.float().numpy(), model, group)
            np.testing.assert_array_equal(packed.numpy(), opacked)
            np.testing.assert_array_equal(params[..., 0].float().numpy(), oscale)
            np.testing.assert_array_equal(params[..., 1].float().numpy(), obias)
            assert params.dtype == dtype


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_twins_store_and_restore_the_same_bits(name, dtype):
    f = FORMATS[name]
    for case, x in adversarial(dtype).items():
        if name == "fp8_e4m3" and case == "huge":
            continue
        data, scale = f.quantize(x, dtype)
        fdata, fscale = fast_formats.quantize(name, x, dtype)
        np.testing.assert_array_equal(raw(data), raw(fdata), err_msg=case)
        np.testing.assert_array_equal(raw(scale), raw(fscale), err_msg=case)
        np.testing.assert_array_equal(raw(f.dequantize(data, scale, dtype)),
                                      raw(fast_formats.dequantize(name, data, scale, dtype)), err_msg=case)


@pytest.mark.parametrize("name", ["int8", "q8_0", "affine4", "affine4_g64"])
@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_nan_is_refused(name, impl):
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    quantize = FORMATS[name].quantize if impl == "reference" else lambda t, m=None: fast_formats.quantize(name, t, m)
    with pytest.raises(ValueError, match="NaN"):
        quantize(x)


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_dequantized_error_within_each_rule(dtype):
    """int8: |x - x'| <= scale/2; q8_0: <= d/2 (+ the fp16 rounding of d times |q|); affine4: <= scale/2 +
    the bias's rounding; each plus one rounding to the model dtype."""
    x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 2).to(dtype).float()
    ulp = torch.finfo(dtype).eps * x.abs() + torch.finfo(dtype).tiny
    q, s = FORMATS["int8"].quantize(x, dtype)
    err = (FORMATS["int8"].dequantize(q, s, dtype).float() - x).abs()
    assert bool((err <= s[:, None] / 2 * (1 + 1e-5) + ulp).all())
    q, d = FORMATS["q8_0"].quantize(x, dtype)
    amax = x.unflatten(-1, (4, 32)).abs().amax(-1)
    d32 = amax / 127
    bound = d32 / 2 * (1 + 1e-5) + (d.float() - d32).abs() * 127  # q <= 127 times d's fp16 rounding
    err = (FORMATS["q8_0"].dequantize(q, d, dtype).float() - x).unflatten(-1, (4, 32)).abs()
    assert bool((err <= bound[..., None] + ulp.unflatten(-1, (4, 32))).all())
    for name in ("affine4", "affine4_g64"):
        f = FORMATS[name]
        packed, params = f.quantize(x, dtype)
        err = (f.dequantize(packed, params, dtype).float() - x).unflatten(-1, (-1, f.group)).abs()
        g = x.unflatten(-1, (-1, f.group))
        rng = g.amax(-1) - g.amin(-1)
        bias_moved = (params[..., 1].float() - g.amin(-1)).abs()
        bound = rng / 30 * (1 + 2 * torch.finfo(dtype).eps) + 15 * (params[..., 0].float() - rng / 15).abs() \
            + bias_moved
        assert bool((err <= bound[..., None] + 2 * ulp.unflatten(-1, (-1, f.group))).all()), name


# ---- bytes per vector, footprint, budget -------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_footprint_matches_real_pools(twin, name, dtype):
    cfg = small_config(head_dim=64, dtype=dtype, kv_cache_dtype=name)
    pool = twin.BlockPool(cfg, scratch_blocks=1)
    real = sum(t.numel() * t.element_size() for t in (pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale)
               if t is not None)
    assert real == memory.kv_pool_bytes(cfg, scratch_blocks=1)
    expected = {"model": 64 * dtype.itemsize, "fp8_e4m3": 68, "int8": 68, "q8_0": 68,
                "affine4": 32 + 4 * dtype.itemsize, "affine4_g64": 32 + 2 * dtype.itemsize}[name]
    assert FORMATS[name].bytes_per_vector(64, dtype) == expected
    assert memory.bytes_per_kv_block(cfg) == 2 * cfg.num_layers * cfg.block_size_frames * cfg.n_kv_head * expected
    budget = 10 * memory.bytes_per_kv_block(cfg) + 5
    assert memory.max_num_blocks_for_budget(cfg, budget) == 9
    assert memory.blocks_per_gib(cfg) == (1 << 30) // memory.bytes_per_kv_block(cfg)


# ---- the gate ----------------------------------------------------------------------------------


def test_gate_refuses_unknown_and_uncuttable_formats():
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        small_config(kv_cache_dtype="q4_k")
    with pytest.raises(ValueError, match=r"multiple of 32.*serve head_dim=48: \['model', 'fp8_e4m3', 'int8'\]"):
        small_config(head_dim=48, kv_cache_dtype="q8_0")
    with pytest.raises(ValueError, match="multiple of 64"):
        small_config(head_dim=96, kv_cache_dtype="affine4_g64")
    assert small_config(head_dim=96, kv_cache_dtype="affine4").kv_cache_dtype == "affine4"
    with pytest.raises(ValueError, match="DecoderCacheConfig.kv_cache_dtype='affine4'"):
        DecoderCacheConfig(num_layers=1, n_kv_head=1, head_dim=40, page_size=4, max_rows=2,
                                max_self_tokens=8, max_num_blocks=8, kv_cache_dtype="affine4")


def test_auto_per_device_kind():
    assert auto_format("cpu", 64, torch.float16) == "model"
    assert small_config(kv_cache_dtype="auto").kv_cache_dtype is None  # CPU: the model dtype
    assert auto_format("cuda:0", 64, torch.float16, capability=(9, 0)) == "fp8_e4m3"
    assert auto_format("cuda:0", 128, torch.bfloat16, capability=(8, 9)) == "fp8_e4m3"
    assert auto_format("cuda:0", 64, torch.float16, capability=(8, 0)) == "int8"
    assert auto_format("cuda:0", 80, torch.float16, capability=(9, 0)) == "model"  # no kernel tile


@pytest.mark.parametrize("name", QUANTIZED)
def test_fast_gate_names_what_serves(name):
    fast_formats.check_format_supported(name, 64, "cpu", dtype=torch.float16, backend="torch")
    fast_formats.check_format_supported(name, 128, "cpu", dtype=torch.float16, backend="torch")
    if name in fast_formats.KERNEL_FORMATS:
        fast_formats.check_format_supported(name, 64, "cpu", dtype=torch.float16, backend="emulated")
        with pytest.raises(ValueError, match=r"tile head_dim in \(64, 128\).*the torch backend \(backend='torch'\) "):
            fast_formats.check_format_supported(name, 192, "cpu", dtype=torch.float16, backend="emulated")
        # what it names serves (it named 'model' pages, which the kernels refuse alike)
        fast_formats.check_format_supported(name, 192, "cpu", dtype=torch.float16, backend="torch")
        with pytest.raises(ValueError, match="tile head_dim") as refused:
            fast_formats.check_format_supported("model", 192, "cpu", dtype=torch.float16, backend="emulated")
        assert "'model' pages" not in str(refused.value)
    else:
        with pytest.raises(ValueError, match="no pages of this format; they serve"):
            fast_formats.check_format_supported(name, 64, "cpu", dtype=torch.float16, backend="emulated")


@pytest.mark.parametrize("name", QUANTIZED)
def test_fast_quantize_leaves_its_input_alone(name):
    """Regression: the fast twin's in-place arithmetic once ran on an fp32 input's own storage."""
    x = torch.randn(3, 64)
    before = x.clone()
    fast_formats.quantize(name, x, torch.float32)
    assert torch.equal(x, before)


# ---- paged ops: both twins on every format ----------------------------------------------------

from dataclasses import replace  # noqa: E402

from oasr.fast import paged_ops as fast_ops  # noqa: E402
from oasr.fast.kernels.testing import make_scenario, to_format, written_slots  # noqa: E402
from oasr.reference import paged_ops as ref_ops  # noqa: E402


def format_scenario(name, dtype, seed=7, head_dim=64):
    s = make_scenario(seed, batch=4, n_kv_head=2, group=2, num_frames=5, head_dim=head_dim, block_size=4,
                      max_history=11, dtype=dtype)
    return to_format(s, name, dtype)


def clone_cache(c):
    return replace(c, k_cache=c.k_cache.clone(), v_cache=c.v_cache.clone(), k_scale=c.k_scale.clone(),
                   v_scale=c.v_scale.clone())


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_ops_twins_agree(name, dtype, backend="torch"):
    s = format_scenario(name, dtype)
    ref, fast = clone_cache(s.cache), clone_cache(s.cache)
    ref_ops.append_kv(ref, s.k, s.v, s.chunk_lens)
    fast_ops.append_kv(fast, s.k, s.v, s.chunk_lens, backend=backend)
    for a, b in ((ref.k_cache, fast.k_cache), (ref.v_cache, fast.v_cache), (ref.k_scale, fast.k_scale),
                 (ref.v_scale, fast.v_scale)):
        np.testing.assert_array_equal(raw(a), raw(b))
    untouched = ~written_slots(s)  # nothing outside the written slots moved
    np.testing.assert_array_equal(raw(ref.k_scale[untouched]), raw(s.cache.k_scale[untouched]))
    out_ref = ref_ops.paged_attention(s.q, ref, s.chunk_lens)
    out_fast = fast_ops.paged_attention(s.q, fast, s.chunk_lens, backend=backend)
    assert not out_ref.isnan().any()
    torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=2e-5 if dtype is torch.float32 else 8e-3,
                               rtol=1e-4 if dtype is torch.float32 else 1e-2)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dense_gather_dequantizes_like_the_reference(name):
    cfg = small_config(head_dim=64, dtype=torch.bfloat16, kv_cache_dtype=name)
    pools = [oasr.reference.BlockPool(cfg), oasr.fast.BlockPool(cfg)]
    g = torch.Generator().manual_seed(2)
    bs = cfg.block_size_frames
    k = torch.randn(cfg.num_layers, 2, bs, cfg.n_kv_head, 64, generator=g).bfloat16()
    for pool in pools:
        data, scale = cfg.kv_format.quantize(k, cfg.dtype)
        pool.k_pool[:, [3, 1]] = data
        pool.v_pool[:, [3, 1]] = data.roll(1, dims=2)
        if scale is not None:
            pool.k_scale[:, [3, 1]] = scale
            pool.v_scale[:, [3, 1]] = scale
    a, b = (p.gather_kv_blocks([3, 1], start=1, num_frames=4) for p in pools)
    assert a.dtype == torch.bfloat16 and a.shape == (cfg.num_layers, cfg.n_kv_head, 4, 128)
    np.testing.assert_array_equal(raw(a), raw(b))


# ---- sessions record the format and refuse a foreign one --------------------------------------

from oasr.sessions import format as S  # noqa: E402
from oasr.sessions import stream as SS  # noqa: E402
from tests.session_helpers import make_engine as _make_engine  # noqa: E402
from tests.session_helpers import make_model, start  # noqa: E402


@pytest.mark.parametrize("name", ["int8", "q8_0", "affine4"])
def test_sessions_carry_the_format_across_twins_and_refuse_another(name):
    model = make_model("fp32", head_dim=32)
    a = _make_engine(model, "reference", "fp32", kv_cache_dtype=name)
    start(a)
    caches = lambda e: (e.att, [e.cnn, e.states], e.ctc)  # noqa: E731
    data = SS.save_stream("a", *caches(a))
    assert S.read_session(data).geometry.kv_cache_dtype == name
    b = _make_engine(model, "fast", "fp32", kv_cache_dtype=name)
    SS.load_stream(data, "moved", *caches(b))
    assert SS.save_stream("moved", *caches(b)) == data  # the same pages, byte for byte
    other = "q8_0" if name != "q8_0" else "int8"
    c = _make_engine(model, "fast", "fp32", kv_cache_dtype=other)
    with pytest.raises(S.SessionError, match="kv_cache_dtype"):
        SS.load_stream(data, "x", *caches(c))
    assert c.att.pool.num_free_blocks == c.att.pool.num_blocks  # the refusal took nothing


# ---- the decoder cache takes the same formats ---------------------------------------------------

from oasr.decoder.config import DecoderRequest  # noqa: E402
from tests.test_decoder_cache import dcfg, shuffle_free_list  # noqa: E402
from tests.test_decoder_cache import kv as decoder_kv  # noqa: E402


@pytest.mark.parametrize("name", QUANTIZED)
def test_decoder_paged_equals_dense_on_every_format(twin, name):
    c = dcfg(kv_cache_dtype=name, head_dim=64)
    m = twin.DecoderKVCacheManager(c)
    shuffle_free_list(m.pool, seed=4)
    m.pool.k_scale.copy_(torch.full_like(m.pool.k_scale, float("nan")))  # NaN wherever nothing should be read
    m.pool.v_scale.copy_(torch.full_like(m.pool.v_scale, float("nan")))
    rows = m.admit([DecoderRequest(3, 5, 0)] * 2)
    dense = twin.DenseDecoderKV(c, 2, capacity=8)
    for b, r in enumerate(rows):
        k, v = decoder_kv(2, 3, 2, 64, seed=b)
        m.prefill(r, k, v)
        dense.prefill(b, k, v)
    for s in range(3):
        k, v = decoder_kv(2, 2, 2, 64, seed=10 + s)
        m.append(rows, k, v)
        dense.append(k, v)
    exact = [reference_values(c, b) for b in range(2)]
    for b, r in enumerate(rows):
        got = m.gather_self(r)
        assert torch.equal(got, dense.gather_self(b))
        assert bool(torch.isfinite(got).all())
        err = (got - exact[b]).abs().max()
        assert 0 < err < {"fp8_e4m3": 0.3, "int8": 0.05, "q8_0": 0.05}.get(name, 0.6), err


def reference_values(c, b):
    """Row b's self K/V as the test wrote it (prefill then three appends), packed (L, H, n, 2D) fp32."""
    k, v = decoder_kv(2, 3, 2, 64, seed=b)
    ks, vs = [k], [v]
    steps = [decoder_kv(2, 2, 2, 64, seed=10 + s) for s in range(3)]
    ks += [sk[:, b : b + 1] for sk, _ in steps]
    vs += [sv[:, b : b + 1] for _, sv in steps]
    kk, vv = torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # (L, n, H, D)
    return torch.cat([kk, vv], dim=-1).transpose(1, 2)


# ---- python -m oasr formats ------------------------------------------------------------------------

from oasr.commands import formats as formats_cli  # noqa: E402


def test_cli_prints_the_matrix_and_gates_one_configuration(capsys, tmp_path):
    assert formats_cli.main(["--head-dims", "64,48", "--json", str(tmp_path / "f.json")]) == 0
    out = capsys.readouterr().out
    assert "q8_0" in out and "68 (1.88x)" in out and "auto picks: D=64: model" in out
    import json

    table = json.loads((tmp_path / "f.json").read_text())
    assert table["bytes_per_vector"]["affine4"] == {"64": 40}  # head_dim 48 is not cut by groups of 32
    assert table["served"]["q8_0/64/emulated"] and not table["served"]["q8_0/48/torch"]
    assert formats_cli.main(["--check", "q8_0", "--head-dim", "48"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "multiple of 32" in err[0] and "['model', 'fp8_e4m3', 'int8']" in err[0]
    assert formats_cli.main(["--check", "affine4", "--head-dim", "96", "--backend", "emulated"]) == 2
    assert "tile head_dim in (64, 128)" in capsys.readouterr().err
    assert formats_cli.main(["--check", "affine4", "--head-dim", "96", "--backend", "torch"]) == 0
    assert formats_cli.main(["--check", "q4_k"]) == 2


# ---- the bench section's arithmetic (its timings are the bench's, never asserted) ------------------

from oasr.bench import kv_formats as bench_formats  # noqa: E402


def test_bench_columns_and_the_wer_hook():
    assert bench_formats.bytes_per_frame("model") == 2 * 12 * 4 * 128
    assert bench_formats.bytes_per_frame("affine4") == 2 * 12 * 4 * 40
    assert bench_formats.blocks_per_gib("q8_0") == (1 << 30) // (2 * 12 * 4 * 68 * 16)
    kv = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).half()
    rows = {r["case"].split()[0]: r for r in bench_formats.error_rows(kv)}
    assert rows["model"]["max_err"] == 0 and 0 < rows["q8_0"]["rms_err"] < rows["affine4"]["rms_err"]
    wers = {None: 10.0, "fp8_e4m3": 10.4, "int8": 10.1, "q8_0": 10.0, "affine4": 11.2, "affine4_g64": 12.0}
    seen = []
    table = bench_formats.wer_rows(lambda fmt: seen.append(fmt) or wers[fmt])
    assert seen[0] is None and len(seen) == len(FORMATS)  # the model dtype first, every format once
    within = {r["case"].split()[0]: r["within_0.5"] for r in table}
    assert within == {"model": True, "fp8_e4m3": True, "int8": True, "q8_0": True, "affine4": False,
                      "affine4_g64": False}
