"""Random paged-attention scenarios for the kernel tests (emulated, CUDA, torch twin).

A scenario is one cohort over one layer of a pool, built the way the tests
want to see the kernels fail:

* the block table is a random permutation of physical blocks (never 0, 1, 2...),
  and table columns a row does not use point at spare blocks;
* every pool slot that the op must not read holds NaN, so one stray read shows
  up in the output (NaN * 0 is still NaN);
* the history ``[cache_seqstarts, cache_seqlens)`` holds random values,
  ``cache_seqstarts`` may sit inside a block, and rows may have an empty
  history, an empty chunk (``chunk_lens == 0``) or a full one.

Values are drawn in fp32 and rounded to the pool dtype, so the same scenario
upcast to fp32 (``Scenario.to(torch.float32)``) holds exactly the same numbers.

``to_fp8(scenario)`` turns a scenario into one over fp8 pages: the history is
quantized (``oasr.reference.fp8.quantize``), every other pool byte is the e4m3
NaN (0x7f) and every other scale is NaN, so a stray read of either shows up.
q, k and v keep the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from oasr.cache.paged import PagedKVCache


@dataclass
class Scenario:
    cache: PagedKVCache
    q: torch.Tensor  # (B, n_head, T, D)
    k: torch.Tensor  # (B, T, n_kv_head, D), the chunk to append
    v: torch.Tensor
    chunk_lens: torch.Tensor  # (B,) int32

    def clone(self) -> Scenario:
        """A copy whose pool (and scales) can be written without touching this scenario's."""
        c = self.cache
        scales = {}
        if c.quantized:
            scales = dict(k_scale=c.k_scale.clone(), v_scale=c.v_scale.clone())
        return replace(self, cache=replace(c, k_cache=c.k_cache.clone(), v_cache=c.v_cache.clone(), **scales))

    def to(self, dtype=None, device=None) -> Scenario:
        """Same numbers in another dtype / on another device (pools copied; fp8 pools and their
        scales keep their dtypes)."""
        c = self.cache

        def move(t, keep_dtype=False):
            return t.to(device=device or t.device, dtype=None if keep_dtype else (dtype or t.dtype))

        cache = replace(
            c,
            k_cache=move(c.k_cache, c.quantized),
            v_cache=move(c.v_cache, c.quantized),
            block_table=move(c.block_table, True),
            cache_seqlens=move(c.cache_seqlens, True),
            cache_seqstarts=move(c.cache_seqstarts, True),
            k_scale=None if c.k_scale is None else move(c.k_scale, True),
            v_scale=None if c.v_scale is None else move(c.v_scale, True),
        )
        return Scenario(cache, move(self.q), move(self.k), move(self.v), move(self.chunk_lens, True))


def make_scenario(
    seed: int,
    *,
    batch: int,
    n_kv_head: int,
    group: int,
    num_frames: int,
    head_dim: int,
    block_size: int,
    max_history: int,
    dtype: torch.dtype = torch.float32,
    with_seqstarts: bool = True,
) -> Scenario:
    """A random cohort over one layer of a poisoned pool, reproducible from ``seed`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    B, T, Hkv, D, bs = batch, num_frames, n_kv_head, head_dim, block_size
    seqlens = [randint(0, max_history) for _ in range(B)]
    starts = [randint(0, s) if with_seqstarts and randint(0, 1) else 0 for s in seqlens]
    lens = [randint(0, T) for _ in range(B)]
    if B > 1:  # always one full chunk, and (with 3+ rows) one empty one
        lens[0] = T
        if B > 2:
            lens[1] = 0
    W = max(1, math.ceil((max(seqlens) + T) / bs))
    spare = 3  # blocks no row owns: unused table columns point here
    num_blocks = B * W + spare
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = perm[: B * W].view(B, W).clone()
    for b in range(B):
        used = math.ceil((seqlens[b] + lens[b]) / bs)
        for col in range(used, W):
            table[b, col] = perm[B * W + randint(0, spare - 1)]

    nan = float("nan")
    k_cache = torch.full((num_blocks, bs, Hkv, D), nan, dtype=dtype)
    v_cache = torch.full((num_blocks, bs, Hkv, D), nan, dtype=dtype)
    for b in range(B):
        pos = torch.arange(starts[b], seqlens[b])
        blocks, offsets = table[b, pos // bs].long(), pos % bs
        k_cache[blocks, offsets] = torch.randn(len(pos), Hkv, D, generator=g).to(dtype)
        v_cache[blocks, offsets] = torch.randn(len(pos), Hkv, D, generator=g).to(dtype)

    cache = PagedKVCache(
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=table,
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
        cache_seqstarts=torch.tensor(starts, dtype=torch.int32),
        block_size=bs,
        max_seqlen=max(seqlens),
        max_span=max(s - st for s, st in zip(seqlens, starts, strict=True)),
    )
    q = torch.randn(B, Hkv * group, T, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, T, Hkv, D, generator=g).to(dtype)
    return Scenario(cache, q, k, v, torch.tensor(lens, dtype=torch.int32))


def to_fp8(s: Scenario) -> Scenario:
    """The scenario over fp8 pages: quantized history, NaN bytes and NaN scales everywhere else."""
    from oasr.reference.fp8 import FP8_DTYPE, quantize

    c = s.cache
    shape = c.k_cache.shape
    pools = []
    for src in (c.k_cache, c.v_cache):
        data = torch.full(shape, 0x7F, dtype=torch.uint8).view(FP8_DTYPE)  # e4m3 NaN
        scale = torch.full(shape[:-1], float("nan"), dtype=torch.float32)
        held = ~src.float().isnan().any(dim=-1)  # the history's vectors (make_scenario poisons the rest)
        data[held], scale[held] = quantize(src[held])
        pools += [data, scale]
    k, k_scale, v, v_scale = pools
    return replace(s, cache=replace(c, k_cache=k, v_cache=v, k_scale=k_scale, v_scale=v_scale))


def written_slots(s: Scenario) -> torch.Tensor:
    """Bool (num_pool_blocks, block_size): the slots append_kv writes for this scenario."""
    c = s.cache
    mask = torch.zeros(c.k_cache.shape[:2], dtype=torch.bool)
    for b in range(c.batch_size):
        start = int(c.cache_seqlens[b])
        pos = torch.arange(start, start + int(s.chunk_lens[b]))
        mask[c.block_table[b, pos // c.block_size].long().cpu(), pos % c.block_size] = True
    return mask


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor as ints: NaN == NaN when the bytes are equal."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def low_precision_bound(ref32: torch.Tensor, ref_lowp: torch.Tensor, floor: float) -> torch.Tensor:
    """Per-element bound for a low-precision kernel against the fp32 reference.

    The reference computes in fp32 from the same (exactly representable) inputs
    and rounds once at the output, so ``|ref_lowp - ref32|`` is that rounding.
    The kernel also computes in fp32 (in another order: ``floor`` covers that
    difference, calibrated on the fp32 cases) and rounds once; when its fp32
    value and the reference's straddle a rounding boundary it can land one step
    away, which stays within twice the reference's own error plus ``floor``.
    """
    return 2 * (ref_lowp.float() - ref32.float()).abs() + floor * (1 + ref32.float().abs())


# Unit roundoff (half an ulp at 1) of the 16-bit types the tensor-core kernel rounds to.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def with_abs_v(cache: PagedKVCache) -> PagedKVCache:
    """The same cache with |V| (fp8: sign bits cleared; NaN bytes stay NaN, scales are positive)."""
    if cache.quantized:
        v = (cache.v_cache.view(torch.uint8) & 0x7F).view(cache.v_cache.dtype)
    else:
        v = cache.v_cache.abs()
    return replace(cache, v_cache=v)


def v2_bound(ref32: torch.Tensor, ref_abs_v: torch.Tensor, out_dtype: torch.dtype, quantized: bool, floor: float):
    """Per-element bound for attention v2 (tensor cores) against the fp32 reference.

    v2 rounds P to the type of its P V mma (bf16 on fp8 pages, else the model
    dtype) before multiplying by V, so each p_j carries a relative error of at
    most that type's unit roundoff u_pv, and the output at most
    ``u_pv * sum_j p_j |v_j| / l`` = ``u_pv * ref_abs_v`` (the reference run
    on |V|: ``with_abs_v``). Everything else is fp32 (``floor``, as for v1)
    plus one rounding of the output to ``out_dtype`` (its unit roundoff times
    |out|).

    v3 on fp8 pages rounds P' = p * v_scale / (a per-row power of two) to f16
    instead (paged_chunk_attention_v3.cu, "Precision"): a relative error of at
    most 2^-11, inside this bound's bf16 2^-8, for every weight at least 2^-17
    of its row's unit; below that f16's subnormal step (2^-25 units) is not
    modelled here and is covered by the others' slack and ``floor`` in the
    tests' scenarios, not proven for every input.
    """
    u_pv = UNIT_ROUNDOFF[torch.bfloat16] if quantized else UNIT_ROUNDOFF[out_dtype]
    u_out = UNIT_ROUNDOFF[out_dtype]
    r = ref32.float().abs()
    return u_out * r + u_pv * (1 + u_out) * ref_abs_v.float() + floor * (1 + r)


def emulated_attention(version: str, q, cache: PagedKVCache, chunk_lens=None, softmax_scale=None, causal=False,
                       num_splits=None) -> torch.Tensor:  # fmt: skip
    """paged_attention on the emulator with attention kernel ``version`` ("v1", "v2" or "v3").

    v1 with the launcher's split count goes through the fast twin (``backend="emulated"``, whose choice
    on the emulator is v1); v2, v3, and any forced split count, through the launcher
    (``ops.paged_attention``) with the int32 lengths the twin would pass.
    """
    from oasr.fast import paged_ops as fast
    from oasr.fast.kernels import emulation, ops

    if version == "v1" and num_splits is None:
        return fast.paged_attention(q, cache, chunk_lens, softmax_scale, causal, backend="emulated")
    lens = None if chunk_lens is None else torch.as_tensor(chunk_lens, dtype=torch.int32)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return ops.paged_attention(emulation.executor(), q, cache, lens, scale, causal, num_splits, version=version)


def to_format(s: Scenario, fmt: str, model_dtype: torch.dtype | None = None) -> Scenario:
    """The scenario over pages of format ``fmt`` (``oasr.kv_formats``): the history quantized by the
    reference rule, 0x7F bytes and NaN scale planes everywhere else (a read outside the history is NaN)."""
    from oasr.kv_formats import get_format

    f = get_format(fmt)
    c = s.cache
    model_dtype = model_dtype or s.q.dtype
    NB, bs, H, D = c.k_cache.shape
    pools = []
    for src in (c.k_cache, c.v_cache):
        data = torch.full((NB, bs, H, f.data_dim(D)), 0x7F, dtype=torch.uint8).view(f.data_dtype(model_dtype))
        scale = torch.full((NB, bs, H, *f.scale_shape(D)), float("nan"), dtype=f.scale_dtype(model_dtype))
        held = ~src.float().isnan().any(dim=-1)  # the history's vectors (make_scenario poisons the rest)
        data[held], scale[held] = f.quantize(src[held].to(model_dtype), model_dtype)
        pools += [data, scale]
    k, k_scale, v, v_scale = pools
    return replace(s, cache=replace(c, k_cache=k, v_cache=v, k_scale=k_scale, v_scale=v_scale, kv_format=f.name))
