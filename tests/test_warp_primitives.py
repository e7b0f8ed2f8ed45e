"""oasr/kernels_cu/warp_mma.cuh under the host emulation (oasr/kernels_cu/emu/warp_emu.h), against torch.

The primitives are driven one at a time by the small kernels in
tests/kernels_cu_test/warp_primitives.cu, on random data, and read back
through the PTX ISA's fragment layouts (drawn in warp_mma.cuh). The kernels
named *misuse* are wrong on purpose (a wrong lane mapping, a missing
.trans, a missing cp.async wait); the tests require that they give wrong
results, which is what makes the emulation worth trusting: it fails where
the hardware would.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from oasr.fast.kernels import emulation
from oasr.fast.kernels.registry import FP8_DTYPE, Kernel

_MISSING = emulation.unavailable_reason()

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"kernel emulation unavailable: {_MISSING}")

SOURCE = Path(__file__).parent / "kernels_cu_test" / "warp_primitives.cu"
HALF, BF16 = "__half", "__nv_bfloat16"
TORCH = {HALF: torch.float16, BF16: torch.bfloat16}

MMA = Kernel(
    "oasr_test::mma_kernel", "warp_primitives", (("a", "ptr"), ("b", "ptr"), ("c", "ptr"), ("d", "ptr")),
    tuple((t, m) for t in (HALF, BF16) for m in ("0", "1", "2")),
)  # fmt: skip
LDMATRIX = Kernel(
    "oasr_test::ldmatrix_kernel", "warp_primitives", (("in", "ptr"), ("out", "ptr")),
    tuple((x, t) for x in ("2", "4") for t in ("0", "1")),
)  # fmt: skip
TILE_MMA = Kernel(
    "oasr_test::tile_mma_kernel", "warp_primitives", (("a", "ptr"), ("b", "ptr"), ("d", "ptr")),
    ((HALF, "0", "0"), (BF16, "0", "0"), (HALF, "1", "0"), (BF16, "1", "0"), (BF16, "1", "1")),
)  # fmt: skip
CP_ASYNC = Kernel(
    "oasr_test::cp_async_kernel", "warp_primitives", (("src", "ptr"), ("out", "ptr")),
    (("0", "0"), ("1", "0"), ("0", "1")),
)  # fmt: skip
FP8X2 = Kernel(
    "oasr_test::fp8x2_kernel", "warp_primitives", (("in", "ptr"), ("out", "ptr"), ("n", "i32")),
    ((HALF,), (BF16,)),
)  # fmt: skip
EX2 = Kernel(
    "oasr_test::ex2_kernel", "warp_primitives", (("in", "ptr"), ("out", "ptr"), ("n", "i32")), (("0",), ("1",))
)
BYTE_PERM = Kernel(
    "oasr_test::byte_perm_kernel", "warp_primitives",
    (("x", "ptr"), ("y", "ptr"), ("s", "ptr"), ("out", "ptr"), ("n", "i32")), (("0",),),
)  # fmt: skip
FP8X4 = Kernel(
    "oasr_test::fp8x4_kernel", "warp_primitives", (("in", "ptr"), ("out", "ptr"), ("n", "i32")),
    tuple((t, i) for t in (HALF, BF16) for i in ("0", "1")),
)  # fmt: skip
FP8_K_TILE = Kernel(
    "oasr_test::fp8_k_tile_kernel", "warp_primitives", (("q", "ptr"), ("k", "ptr"), ("s_out", "ptr")),
    tuple((t, m) for t in (HALF, BF16) for m in ("0", "1")),
)  # fmt: skip
FP8_V_TILE = Kernel(
    "oasr_test::fp8_v_tile_kernel", "warp_primitives", (("p", "ptr"), ("v", "ptr"), ("o_out", "ptr")),
    (("0",), ("1",)),
)  # fmt: skip


@pytest.fixture(scope="module")
def lib():
    return emulation.build_source(SOURCE, (MMA, LDMATRIX, TILE_MMA, CP_ASYNC, FP8X2, EX2, BYTE_PERM, FP8X4,
                                           FP8_K_TILE, FP8_V_TILE))


def _run(lib, kernel, targs, args, block=32, grid=1):
    values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    emulation.launch_in(lib, kernel, targs, (grid, 1, 1), (block, 1, 1), values)


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


# -- mma ---------------------------------------------------------------------------------------


def _mma_case(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(16, 16, generator=g).to(dtype)
    b = torch.randn(16, 8, generator=g).to(dtype)
    c = torch.randn(16, 8, generator=g)
    want = a.double() @ b.double() + c.double()
    # fp32 accumulation of exact products: within 16 roundings of the largest partial sum
    bound = 16 * 2.0**-23 * (a.double().abs() @ b.double().abs() + c.double().abs())
    return a, b, c, want, bound


@pytest.mark.parametrize("targ", [HALF, BF16])
def test_mma_matches_torch_through_the_fragment_layout(lib, targ):
    for seed in range(3):
        a, b, c, want, bound = _mma_case(seed, TORCH[targ])
        d = torch.full((16, 8), float("nan"))
        _run(lib, MMA, (targ, "0"), (_bits16(a), _bits16(b), c, d))
        assert ((d.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("misuse", ["1", "2"], ids=["A-rows-and-k-halves-swapped", "B-lane-grid-transposed"])
@pytest.mark.parametrize("targ", [HALF, BF16])
def test_mma_with_a_wrong_lane_mapping_fails(lib, targ, misuse):
    a, b, c, want, bound = _mma_case(7, TORCH[targ])
    d = torch.full((16, 8), float("nan"))
    _run(lib, MMA, (targ, misuse), (_bits16(a), _bits16(b), c, d))
    assert not d.isnan().any()  # it ran and wrote every element ...
    assert ((d.double() - want).abs() > bound).float().mean() > 0.5  # ... mostly wrong


# -- ldmatrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("x", ["2", "4"])
@pytest.mark.parametrize("trans", ["0", "1"], ids=["plain", "trans"])
def test_ldmatrix_gives_each_lane_its_fragment(lib, x, trans):
    n = int(x)
    m = torch.randint(0, 2**16, (n, 8, 8), dtype=torch.int32)  # distinct-ish 16-bit values
    inp = m.to(torch.int16)  # two's complement: same bits
    out32 = torch.zeros(32 * n, dtype=torch.int32)
    _run(lib, LDMATRIX, (x, trans), (inp, out32))
    out = out32.view(32, n).long() & 0xFFFFFFFF
    lane = torch.arange(32)
    g, q = lane // 4, lane % 4
    for i in range(n):
        mi = m[i] if trans == "0" else m[i].T
        lo, hi = mi[g, 2 * q], mi[g, 2 * q + 1]
        assert torch.equal(out[:, i], lo.long() | (hi.long() << 16)), f"matrix {i}"


@pytest.mark.parametrize(
    "targ,b_is_kn", [(HALF, "0"), (BF16, "0"), (HALF, "1"), (BF16, "1")], ids=["f16-Bnk", "bf16-Bnk", "f16-Bkn",
                                                                               "bf16-Bkn"]
)  # fmt: skip
def test_ldmatrix_feeds_mma(lib, targ, b_is_kn):
    # A by ldmatrix_x4; B (16 x 8) stored as K is (n-major) by ldmatrix_x2, or as V is (k-major) by x2.trans.
    dtype = TORCH[targ]
    g = torch.Generator().manual_seed(int(b_is_kn) + 10 * (dtype == torch.bfloat16))
    a = torch.randn(16, 16, generator=g).to(dtype)
    b = torch.randn(16, 8, generator=g).to(dtype)
    stored = b if b_is_kn == "1" else b.T.contiguous()
    d = torch.full((16, 8), float("nan"))
    _run(lib, TILE_MMA, (targ, b_is_kn, "0"), (a, stored, d))
    want = a.double() @ b.double()
    bound = 16 * 2.0**-23 * (a.double().abs() @ b.double().abs())
    assert ((d.double() - want).abs() <= bound).all()


def test_v_loaded_without_trans_fails(lib):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    d = torch.full((16, 8), float("nan"))
    _run(lib, TILE_MMA, (BF16, "1", "1"), (a, b, d))
    assert not d.isnan().any()
    assert ((d.double() - a.double() @ b.double()).abs() > 1e-3).float().mean() > 0.5


# -- cp.async ----------------------------------------------------------------------------------

STALE = 0xAB


SLOTS = 5


def _cp_async(lib, pattern, misuse, threads=64):
    src = torch.randint(0, 256, (threads * SLOTS * 16,), dtype=torch.uint8)
    src[src == STALE] = 0  # so a stale byte can never pass for data
    out = torch.zeros(3 * threads * SLOTS * 16, dtype=torch.uint8)
    _run(lib, CP_ASYNC, (pattern, misuse), (src, out), block=threads)
    return src.view(threads, SLOTS, 16), out.view(3, threads, SLOTS, 16)


def _expect(src, landed):
    """Slots after a wait: the copies of the retired groups landed, the others still hold 0xAB.
    Slot 2 is a zero-filled 16-byte copy; slot 4 two 4-byte copies (data, then zeros; 8 bytes untouched)."""
    want = torch.full_like(src, STALE)
    for s in landed:
        if s == 2:
            want[:, 2] = 0
        elif s == 4:
            want[:, 4, :4] = src[:, 4, :4]
            want[:, 4, 4:8] = 0
        else:
            want[:, s] = src[:, s]
    return want


@pytest.mark.parametrize(
    "pattern,steps",
    [
        ("0", [(0,), (0, 1, 2), (0, 1, 2, 3, 4)]),  # three groups in flight: wait<2>, wait<1>, wait<0>
        ("1", [(0,), (0, 1, 2), (0, 1, 2, 3, 4)]),  # two in flight, wait<1>, one more committed, wait<1>, wait<0>
    ],
    ids=["three-groups-wait-2-1-0", "interleaved-commit-wait"],
)
def test_cp_async_lands_only_at_the_wait_that_retires_its_group(lib, pattern, steps):
    src, out = _cp_async(lib, pattern, "0")
    for step, landed in enumerate(steps):
        assert torch.equal(out[step], _expect(src, landed)), f"after wait {step}"


def test_cp_async_read_without_wait_sees_stale_bytes(lib):
    # The misuse: issue, commit, __syncthreads, read. The barrier does not complete copies.
    src, out = _cp_async(lib, "0", "1")
    assert (out == STALE).all()


# -- fp8 -> f16 / bf16 -------------------------------------------------------------------------


@pytest.mark.skipif(FP8_DTYPE is None, reason="torch has no float8_e4m3fn")
@pytest.mark.parametrize("targ", [HALF, BF16])
def test_fp8x2_conversion_matches_torch_on_all_256_bytes(lib, targ):
    dtype = TORCH[targ]
    byte = torch.arange(256, dtype=torch.int32)
    pairs = byte | (byte.roll(37) << 8)  # every byte once in the low half, once in the high half
    out = torch.zeros(256, dtype=torch.int32)
    _run(lib, FP8X2, (targ,), (pairs.to(torch.int16), out, 256), block=128, grid=2)
    got = out.view(dtype).view(256, 2)  # (low, high) halves
    for half, src in ((0, byte), (1, byte.roll(37))):
        want = src.to(torch.uint8).view(FP8_DTYPE).to(dtype)
        g = got[:, half]
        assert torch.equal(g.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(_bits16(g[ok]), _bits16(want[ok]))  # exact, signed zeros included


# -- ex2.approx.ftz ----------------------------------------------------------------------------

TINY = 2.0**-126  # the smallest normal fp32


def test_ex2_approx_ftz_matches_exp2_and_flushes_like_the_hardware(lib):
    normal = torch.linspace(-126, 127, 2001)
    special = torch.tensor([-126.5, -127.0, -140.0, -149.0, -1000.0, float("-inf"), float("inf"), float("nan"),
                            1e-40, -1e-40, 0.0, -0.0])  # fmt: skip
    x = torch.cat([normal, special])
    out = torch.full_like(x, 7.0)
    _run(lib, EX2, ("0",), (x, out, x.numel()), block=128, grid=math.ceil(x.numel() / 128))
    want = torch.exp2(normal.double())
    # the hardware's ex2.approx is within 2^-22 relative (PTX ISA); the emulator is exact std::exp2 in fp32
    assert ((out[: normal.numel()].double() - want).abs() <= 2.0**-22 * want).all()
    got = out[normal.numel():].tolist()  # in the order of `special`
    assert got[:5] == [0.0] * 5 and got[5] == 0.0  # results below 2^-126 flush to +0; 2^-inf = 0
    assert got[6] == float("inf") and math.isnan(got[7])
    assert got[8:] == [1.0] * 4  # subnormal inputs (+-1e-40) read as zero, like +-0: exactly 1


def test_ex2_through_a_subnormal_intermediate_is_zero(lib):
    # The misuse: 2^x computed as 2^(x - 100) * 2^100. Exact arithmetic (and exp2f with denormals)
    # gives 2^x; under .ftz the intermediate 2^(x - 100) < 2^-126 flushes, as on the hardware.
    x = torch.linspace(-40, -27, 64)
    out = torch.full_like(x, float("nan"))
    _run(lib, EX2, ("1",), (x, out, x.numel()), block=64)
    assert (torch.exp2(x) > TINY).all()  # the right answer is a normal number ...
    assert (out == 0).all()  # ... which the misuse loses


# -- byte_perm ---------------------------------------------------------------------------------


def test_byte_perm_selects_bytes_of_y_x(lib):
    g = torch.Generator().manual_seed(5)
    n = 256
    x = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    y = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    sel = torch.randint(0, 8, (n, 4), generator=g, dtype=torch.int64)
    s = (sel << torch.tensor([0, 4, 8, 12])).sum(1)
    out = torch.zeros(n, dtype=torch.int32)
    i32 = lambda t: t.to(torch.int64).where(t < 2**31, t - 2**32).to(torch.int32)  # noqa: E731 (same bits)
    _run(lib, BYTE_PERM, ("0",), (i32(x), i32(y), i32(s), out, n), block=128, grid=2)
    xy = x | (y << 32)
    want = sum(((xy >> (8 * sel[:, i])) & 0xFF) << (8 * i) for i in range(4))
    assert torch.equal(out.to(torch.int64) & 0xFFFFFFFF, want)


# -- fp8 quads after ldmatrix ------------------------------------------------------------------


@pytest.mark.skipif(FP8_DTYPE is None, reason="torch has no float8_e4m3fn")
@pytest.mark.parametrize("interleaved", ["0", "1"], ids=["pairs-01-23", "pairs-02-13"])
@pytest.mark.parametrize("targ", [HALF, BF16])
def test_fp8x4_pairs_the_bytes_as_documented(lib, targ, interleaved):
    g = torch.Generator().manual_seed(9)
    raw = torch.randint(0, 256, (512, 4), generator=g, dtype=torch.uint8)
    out = torch.zeros(512, 2, dtype=torch.int32)
    _run(lib, FP8X4, (targ, interleaved), (raw.view(torch.int32).view(-1), out, 512), block=128, grid=4)
    got = out.view(TORCH[targ]).view(512, 2, 2)  # [word][register][half]
    values = raw.view(FP8_DTYPE).to(TORCH[targ])
    order = [[0, 1], [2, 3]] if interleaved == "0" else [[0, 2], [1, 3]]
    want = values[:, torch.tensor(order)]
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(_bits16(got[ok]), _bits16(want[ok]))


def _fp8_bytes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x38  # no NaN bytes: the products are compared numerically
    return raw, raw.view(FP8_DTYPE).double()


@pytest.mark.skipif(FP8_DTYPE is None, reason="torch has no float8_e4m3fn")
@pytest.mark.parametrize("misuse", ["0", "1"], ids=["matched-dim-order", "misuse-interleaved-pairs"])
@pytest.mark.parametrize("targ", [HALF, BF16])
def test_fp8_k_fragments_feed_q_k_transposed(lib, targ, misuse):
    dtype = TORCH[targ]
    q = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    raw, k = _fp8_bytes((16, 32), 4)
    s = torch.full((16, 16), float("nan"))
    _run(lib, FP8_K_TILE, (targ, misuse), (q, raw, s))
    want = q.double() @ k.T
    bound = 32 * 2.0**-23 * (q.double().abs() @ k.abs().T)  # fp32 sums of exact products
    assert not s.isnan().any()
    ok = (s.double() - want).abs() <= bound
    assert ok.all() if misuse == "0" else ok.float().mean() < 0.5


@pytest.mark.skipif(FP8_DTYPE is None, reason="torch has no float8_e4m3fn")
@pytest.mark.parametrize("misuse", ["0", "1"], ids=["interleaved", "misuse-plain-pairs"])
def test_fp8_v_fragments_after_trans_feed_p_v(lib, misuse):
    p = torch.rand(16, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    raw, v = _fp8_bytes((16, 32), 6)
    o = torch.full((16, 32), float("nan"))
    _run(lib, FP8_V_TILE, (misuse,), (p, raw, o))
    want = p.double() @ v
    bound = 16 * 2.0**-23 * (p.double().abs() @ v.abs())
    assert not o.isnan().any()
    ok = (o.double() - want).abs() <= bound
    assert ok.all() if misuse == "0" else ok.float().mean() < 0.5
