"""Launchers: turn a ``PagedKVCache`` call into kernel grids and arguments.

Shared by both executors: ``CudaExecutor`` (NVRTC cubins on a GPU) and
``EmulatedExecutor`` (the same sources built with g++ for CPU tensors). A
launcher validates what it can see on the host (shapes, dtypes, strides,
alignment), sizes the grid from shapes and the view's host-side maxima
(``max_span``), and never reads a device tensor back: no ``.item()``, no
``.tolist()``, no ``.cpu()``. Per-row values (``chunk_lens``, seqlens) are
trusted as the kernels see them; the fast twin's ``paged_ops`` validates them
first wherever they are on the host already.

fp8 pages (``cache.quantized``): ``append_kv`` launches the quantizing
``paged_kv_append_fp8_kernel``, ``paged_attention`` the attention kernel's fp8
page variant (q and out stay in the model dtype), ``gather_kv_blocks`` the
dequantizing ``gather_kv_blocks_fp8_kernel``. Each refuses, by name, a geometry
the kernels cannot tile (``check_fp8_geometry``). int8, q8_0 and affine4 pages
(``cache.format``; tags in kernels_cu/kv_formats.cuh) go the same three ways
through ``paged_kv_append_quant_kernel``, attention v1's page variants and
``gather_kv_blocks_quant_kernel``; attention v2 serves model-dtype and fp8 pages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch

from oasr.cache.paged import PagedKVCache
from oasr.cache.rel_bias import check_rel_bias_columns
from oasr.cache.validate import same_device
from oasr.fast.kernels import registry
from oasr.kv_formats import get_format

THREADS = 128  # every kernel runs 128-thread blocks
ROWS_PER_CTA = 16  # attention v1: query rows (t, g) per CTA = 4 warps x 4 rows
V2_ROWS_PER_CTA = 64  # attention v2: 4 warps x one 16-row MMA tile
V3_ROWS_PER_CTA = 32  # attention v3: 2 row tiles x 2 key slices of 16-row MMA tiles
TILE_KEYS = 32  # attention (v1 and v2): keys per shared-memory tile
MIN_KEYS_PER_SPLIT = 64  # flash-decoding: a split gets at least two key tiles
MAX_SPLITS = 32
WAVE_SLACK = 1.1  # v2: the fewest splits within 10% of the best modelled time (choose_num_splits_by_waves)
ATTENTION_VERSIONS = ("v1", "v2", "v3")
# The tensor-core kernel the fast twin picks on CUDA: v3, whose emulated conformance suite passes for every
# instantiation, unless OASR_CUDA_ATTENTION=v2 pins the previous one (v3 has not yet run on a GPU).
CUDA_ATTENTION_VERSION = os.environ.get("OASR_CUDA_ATTENTION", "v3")
if CUDA_ATTENTION_VERSION not in ("v2", "v3"):
    raise ValueError(f"OASR_CUDA_ATTENTION must be v2 or v3, got {CUDA_ATTENTION_VERSION!r}")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _int32_vector(t: torch.Tensor, name: str, batch: int, device) -> torch.Tensor:
    if t.shape != (batch,):
        raise ValueError(f"{name}: expected shape ({batch},), got {tuple(t.shape)}")
    if not same_device(t.device, device):
        raise ValueError(f"{name} is on {t.device}, the pool on {device}")
    return t.to(torch.int32).contiguous()


def _block_table(cache: PagedKVCache) -> torch.Tensor:
    table = cache.block_table
    if not same_device(table.device, cache.k_cache.device):
        raise ValueError(f"block_table is on {table.device}, the pool on {cache.k_cache.device}")
    table = table.to(torch.int32)
    if table.dim() != 2 or (table.shape[1] > 1 and table.stride(1) != 1):
        table = table.contiguous()
    return table


def _check_pool(cache: PagedKVCache) -> None:
    for name, t in (("k_cache", cache.k_cache), ("v_cache", cache.v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (one layer of the pool), got strides {t.stride()}")
    if cache.k_cache.dtype != cache.v_cache.dtype or cache.k_cache.shape != cache.v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    if cache.k_cache.shape[1] != cache.block_size:
        raise ValueError(f"pool block dim {cache.k_cache.shape[1]} != block_size {cache.block_size}")
    if cache.quantized and cache.format.name == "fp8_e4m3":
        _check_scales(cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)
    elif cache.quantized:
        _check_quant_planes(cache.format, cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)


def _check_quant_planes(fmt, k_pool, v_pool, k_scale, v_scale) -> None:
    """Data and scale planes of an int8 / q8_0 / affine4 pool: the format's dtypes and shapes, contiguous,
    on the pool's device. The data planes must be 16-byte aligned (the kernels read and write a vector's
    bytes with 16-byte accesses; a layer's data plane is a multiple of 16 bytes at the head_dims they tile,
    so every layer of a pool is). The scale planes need only their element's alignment: the kernels read
    and write one scale (int8: fp32; q8_0: fp16; affine4: a (scale, bias) pair of the model dtype, read as
    two elements) per access, so a layer's plane may start anywhere the pool's packing puts it
    (e.g. layer 1 of a q8_0 pool of 7 blocks x 5 frames x 1 head x 2 fp16: 140 bytes in)."""
    D = k_pool.shape[-1] * fmt.values_per_byte
    if k_pool.dtype != fmt.data_dtype(torch.float32) or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"{fmt.name} pages: the pools must be {fmt.data_dtype(torch.float32)}, got {k_pool.dtype}")
    shape = tuple(k_pool.shape[:-1]) + fmt.scale_shape(D)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or tuple(t.shape) != shape or not t.is_contiguous() or not same_device(t.device, k_pool.device):
            got = None if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise ValueError(f"{fmt.name} pages: {name} must be a contiguous {shape} plane on {k_pool.device}, "
                             f"got {got}")
    for name, t in (("k", k_pool), ("v", v_pool)):
        if t.data_ptr() % 16:
            raise ValueError(f"{fmt.name} pages: the {name} pool must be 16-byte aligned")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.data_ptr() % t.element_size():
            raise ValueError(f"{fmt.name} pages: {name} must be aligned to its {t.element_size()}-byte elements")


def _page_arg(cache_or_format, dtype: torch.dtype) -> str:
    """The Page template argument of a quantized format for model dtype ``dtype``."""
    fmt = getattr(cache_or_format, "format", cache_or_format)
    return registry.FP8_ARG if fmt.name == "fp8_e4m3" else registry.page_arg(fmt.name, registry.DTYPE_ARG[dtype])


def _check_scales(k_pool, v_pool, k_scale, v_scale) -> None:
    """fp8 data and its fp32 scales: one scale per vector, contiguous, on the pool's device."""
    if k_pool.dtype != registry.FP8_DTYPE:
        raise ValueError(f"fp8 pages: the pool is {k_pool.dtype}, expected {registry.FP8_DTYPE} with scales")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.shape != k_pool.shape[:-1] or t.dtype != torch.float32:
            got = None if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise ValueError(f"fp8 pages: {name} must be {tuple(k_pool.shape[:-1])} float32, got {got}")
        if not t.is_contiguous() or not same_device(t.device, k_pool.device):
            raise ValueError(f"fp8 pages: {name} must be contiguous and on {k_pool.device}")
    for name, t in (("k", k_pool), ("v", v_pool)):
        if t.data_ptr() % 16:
            raise ValueError(f"fp8 pages: the {name} pool must be 16-byte aligned")


def check_fp8_geometry(head_dim: int, dtype: torch.dtype | None = None, backend: str = "cuda") -> None:
    """Refuse what the fp8 kernels cannot serve: a head_dim they do not tile, a model dtype they do not take."""
    if head_dim not in registry.FP8_HEAD_DIMS:
        raise ValueError(
            f"fp8 K/V pages: the {backend!r} kernels tile head_dim in {registry.FP8_HEAD_DIMS}, got head_dim={head_dim}"
        )
    if dtype is not None and dtype not in registry.DTYPE_ARG:
        raise ValueError(
            f"fp8 K/V pages: the {backend!r} kernels take a model dtype in "
            f"{tuple(str(d) for d in registry.DTYPE_ARG)}, got {dtype}"
        )


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address (a copy only when it is not)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _copy_unit(row_bytes: int, *tensors: torch.Tensor) -> int:
    """16-byte units when every row and address allows it, else 2-byte units."""
    if row_bytes % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors):
        return 16
    if row_bytes % 2 or any(t.data_ptr() % 2 for t in tensors):
        raise ValueError("copy kernels need 2-byte aligned rows")
    return 2


def _grid_1d(items: int, executor) -> int:
    # Grid-stride kernels: enough blocks to fill the device, never more than the work.
    return max(1, min(math.ceil(items / THREADS), 8 * executor.sm_count))


def append_kv(executor, cache: PagedKVCache, k, v, chunk_lens: torch.Tensor | None) -> None:
    """Launch paged_kv_append. ``chunk_lens`` is None (all T) or an int32 (B,) tensor on the pool's device."""
    _check_pool(cache)
    if cache.quantized:
        check_fp8_geometry(cache.head_dim, None, executor.kind)
    B, T = k.shape[:2]
    if B == 0 or T == 0:
        return
    if cache.quantized:
        return _append_kv_quantized(executor, cache, k, v, chunk_lens)
    dtype = cache.k_cache.dtype
    if k.dtype != dtype or v.dtype != dtype:  # paged_ops refuses these first (oasr.cache.validate)
        raise ValueError(f"append_kv: k and v must be the pool's {dtype}, got {k.dtype} and {v.dtype}")
    k = k.contiguous()
    v = v.contiguous()
    table = _block_table(cache)
    seqlens = _int32_vector(cache.cache_seqlens, "cache_seqlens", B, k.device)
    frame_bytes = cache.n_kv_head * cache.head_dim * k.element_size()
    unit = _copy_unit(frame_bytes, k, v, cache.k_cache, cache.v_cache)
    units = frame_bytes // unit
    kernel = registry.BY_NAME["paged_kv_append_kernel"]
    args = (
        _ptr(k), _ptr(v), _ptr(cache.k_cache), _ptr(cache.v_cache), _ptr(table), table.stride(0),
        _ptr(seqlens), _ptr(chunk_lens), B, T, cache.block_size, units,
    )  # fmt: skip
    grid = (_grid_1d(B * T * units, executor), 1, 1)
    executor.launch(kernel, (registry.UNIT_ARG[unit],), grid, (THREADS, 1, 1), args)


def _append_kv_quantized(executor, cache: PagedKVCache, k, v, chunk_lens: torch.Tensor | None) -> None:
    """Launch the quantizing append of the pages' format (fp8, or int8 / q8_0 / affine4): quantize each
    (frame, head) vector, write its data and scale plane."""
    B, T, Hkv, D = k.shape
    if k.dtype != v.dtype or k.dtype not in registry.DTYPE_ARG:  # paged_ops refuses these first
        raise ValueError(f"fp8 append_kv: k and v must share a model dtype, got {k.dtype} and {v.dtype}")
    k, v = _aligned16(k), _aligned16(v)
    table = _block_table(cache)
    seqlens = _int32_vector(cache.cache_seqlens, "cache_seqlens", B, k.device)
    lanes_per_vector = D // (16 // k.element_size())
    args = (
        _ptr(k), _ptr(v), _ptr(cache.k_cache), _ptr(cache.v_cache), _ptr(cache.k_scale), _ptr(cache.v_scale),
        _ptr(table), table.stride(0), _ptr(seqlens), _ptr(chunk_lens), B, T, cache.block_size, Hkv,
    )  # fmt: skip
    grid = (_grid_1d(B * T * Hkv * lanes_per_vector, executor), 1, 1)
    if cache.format.name == "fp8_e4m3":
        kernel = registry.BY_NAME["paged_kv_append_fp8_kernel"]
        executor.launch(kernel, (registry.DTYPE_ARG[k.dtype], str(D)), grid, (THREADS, 1, 1), args)
        return
    kernel = registry.BY_NAME["paged_kv_append_quant_kernel"]  # int8 / q8_0 / affine4: the same arguments
    targs = (registry.DTYPE_ARG[k.dtype], _page_arg(cache, k.dtype), str(D))
    executor.launch(kernel, targs, grid, (THREADS, 1, 1), args)


def choose_num_splits(batch: int, n_kv_head: int, q_tiles: int, max_keys: int, sm_count: int) -> int:
    """How many CTAs share one row's key range (flash-decoding).

    Enough splits that the grid covers about two waves of ``sm_count`` CTAs,
    but no split shorter than MIN_KEYS_PER_SPLIT keys and at most MAX_SPLITS.
    Host-side numbers only: shapes and the view's ``max_span``.
    """
    ctas = max(1, batch * n_kv_head * q_tiles)
    if ctas >= sm_count:
        return 1
    want = math.ceil(2 * sm_count / ctas)
    by_length = max(1, max_keys // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, by_length, MAX_SPLITS))


def choose_num_splits_by_waves(ctas: int, max_keys: int, slots: int) -> int:
    """How many CTAs share one row's key range, for attention v2 (flash-decoding by waves).

    ``slots`` = SMs x CTAs resident per SM (``executor.resident_ctas``: the CUDA
    occupancy of the kernel on the device; a fixed parameter for the emulator).
    With ``s`` splits the grid has ``ctas * s`` CTAs, each doing 1/s of a row's
    keys, and runs in ``ceil(ctas * s / slots)`` waves, so the modelled time is
    ``waves / s``. The answer is the fewest splits within WAVE_SLACK of the best
    modelled time (fewer splits: less combine work and fewer partial rows),
    with at least MIN_KEYS_PER_SPLIT keys per split and at most MAX_SPLITS.
    Host-side numbers only. E.g. 128 streams x 4 KV heads (512 CTAs) on 132
    SMs: 4 resident -> 1 split (0.97 waves); 3 resident -> 3 splits (4 waves of
    a third each, 1.33, against 2 whole waves at 1 split).
    """
    most = max(1, min(MAX_SPLITS, max_keys // MIN_KEYS_PER_SPLIT))
    return _fewest_splits_by_waves(max(1, ctas), most, max(1, slots))


def choose_num_splits_filled(ctas: int, max_keys: int, slots: int, sm_count: int) -> int:
    """Attention v3's split count: 1 when the grid gives every SM two CTAs or more and runs in one wave, or in
    two full waves or more (a memory-bound kernel gains nothing from a smaller last wave, and each split adds
    fp32 partials and the combine launch); else ``choose_num_splits_by_waves``: a grid under two CTAs per SM,
    or one between one and two waves of ``slots``, whose second wave would leave most SMs idle while the
    busiest runs a whole tile range alone. E.g. 128 streams x 4 KV heads (512 CTAs) on 132 SMs: 1 split at
    4 or 5 resident CTAs (one wave); 3 splits at 3 resident (fp8 pages with two row tiles per warp: 4 waves
    of a third, 1.33, against 2 whole waves); 2 streams x 4 KV heads: split by waves."""
    if ctas >= 2 * sm_count and not slots < ctas < 2 * slots:
        return 1
    return choose_num_splits_by_waves(ctas, max_keys, slots)


@functools.lru_cache(maxsize=1024)
def _fewest_splits_by_waves(ctas: int, most: int, slots: int) -> int:
    """choose_num_splits_by_waves's search over 1..most splits, computed once per (geometry, device)."""
    modelled = {s: math.ceil(ctas * s / slots) / s for s in range(1, most + 1)}
    best = min(modelled.values())
    return min(s for s, t in modelled.items() if t <= WAVE_SLACK * best)


def v2_supports(cache: PagedKVCache, q_dtype: torch.dtype, head_dim: int) -> bool:
    """True when attention v2 has an instantiation for this pool and query: fp16/bf16 queries,
    pages in that dtype or fp8, head_dim in HEAD_DIMS, block size in V2_BLOCK_SIZES."""
    page_ok = cache.format.name == "fp8_e4m3" if cache.quantized else cache.k_cache.dtype == q_dtype
    return (
        q_dtype in registry.V2_DTYPE_ARG
        and page_ok
        and head_dim in registry.HEAD_DIMS
        and cache.block_size in registry.V2_BLOCK_SIZES
    )


def choose_attention_version(executor, cache: PagedKVCache, q_dtype: torch.dtype, head_dim: int, *,
                             rel: bool = False) -> str:
    """The fast twin's choice: a tensor-core kernel (``CUDA_ATTENTION_VERSION``: v3, or v2 when
    OASR_CUDA_ATTENTION=v2) on CUDA wherever ``v2_supports`` (v3 serves the same inputs); v1 otherwise
    (fp32 pools, other block sizes, and the emulator, where v2 and v3 run only when asked by name:
    they are the slow ones to emulate, and the tests run all three). With the relative-position term
    (``rel``) only ``REL_VERSIONS`` qualify: v3 where it would be chosen, else v1 (v2 pinned included)."""
    if executor.kind == "cuda" and v2_supports(cache, q_dtype, head_dim):
        return CUDA_ATTENTION_VERSION if not rel or CUDA_ATTENTION_VERSION in REL_VERSIONS else "v1"
    return "v1"


REL_VERSIONS = ("v1", "v3")  # the attention kernels with instances that read rel_bias (registry.REL_ARG)


def _rel_args(rel_bias: torch.Tensor | None, B: int, H: int, T: int, device) -> tuple:
    """``(table, (pointer, rel_len))`` of the relative-position term for the kernels, ``(None, (0, 0))``
    without it. The table must be a float32 ``(B, H, T, R)`` tensor on the pool's device (a contiguous
    one is read in place; the caller holds the returned table until the launch is queued) with ``R >= 2T - 1``,
    the least any window needs: the launcher reads no lengths, so the full test (``R`` against the rows'
    widest history) is its caller's (``oasr.fast.paged_ops``), and a query whose window needs a column past
    ``R`` gets NaN from the kernel, never an out-of-bounds read."""
    if rel_bias is None:
        return None, (0, 0)
    if rel_bias.dim() != 4 or tuple(rel_bias.shape[:3]) != (B, H, T) or rel_bias.dtype != torch.float32:
        raise ValueError(f"fast paged_attention: rel_bias must be float32 (B={B}, n_head={H}, T={T}, R), got "
                         f"{tuple(rel_bias.shape)} {rel_bias.dtype}")
    if not same_device(rel_bias.device, device):
        raise ValueError(f"fast paged_attention: rel_bias is on {rel_bias.device}, the pool on {device}")
    if rel_bias.shape[3] >= 2**31:
        raise ValueError(f"fast paged_attention: rel_bias has {rel_bias.shape[3]} columns, the kernels index < 2**31")
    check_rel_bias_columns(rel_bias, 0, T, "the least: the launcher reads no lengths")
    table = rel_bias.contiguous()
    return table, (_ptr(table), int(table.shape[3]))


def paged_attention(
    executor,
    q: torch.Tensor,
    cache: PagedKVCache,
    chunk_lens: torch.Tensor | None,
    scale: float,
    causal: bool,
    num_splits: int | None = None,
    version: str | None = None,
    *,
    rel_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch paged_chunk_attention v1, v2 or v3 (and the combine kernel when the keys are split).

    ``version`` None: ``choose_attention_version``; "v1", "v2" or "v3" by name (v2 and v3 raise
    ``ValueError`` where ``v2_supports`` is false). ``num_splits`` None: v1 sizes splits with
    ``choose_num_splits`` (two waves of SMs), v2 with ``choose_num_splits_by_waves``, v3 with
    ``choose_num_splits_filled``; an int forces the count.

    Checked once per plan: everything a call derives from the view (the checks, the kernel, the split
    count, the grid, the packed pointers and scalars) is a function of the tensors' addresses, shapes,
    dtypes and strides and of the view's host fields, so it is kept under that key (``_PLANS``) and a
    call with the same key only allocates its output and launches. A view whose table or lengths need a
    conversion (not int32, not contiguous), a non-contiguous ``rel_bias`` or a non-contiguous ``q`` is
    planned at every call.
    """
    if not q.is_contiguous():
        q = q.contiguous()
    key = _plan_key(executor, q, cache, chunk_lens, scale, causal, num_splits, version, rel_bias)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_attention(executor, q, cache, chunk_lens, scale, causal, num_splits, version, rel_bias)
        if plan.reusable:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            plan = _PLANS[key] = _prepared(executor, plan.kept())
    out = torch.empty(q.shape, dtype=plan.dtype, device=q.device)
    if plan.kernel is None:
        return out
    part_acc = part_ml = 0
    if plan.num_splits > 1:
        shape = (plan.num_splits, *plan.shape)
        acc = torch.empty(shape, dtype=torch.float32, device=q.device)
        ml = torch.empty((*shape[:-1], 2), dtype=torch.float32, device=q.device)
        part_acc, part_ml = acc.data_ptr(), ml.data_ptr()
    out_ptr = out.data_ptr()
    if plan.prepared is not None:  # parameters packed once per plan: the call sets its three pointers
        plan.prepared.launch(executor.stream_handle(), out_ptr, part_acc, part_ml)
    else:
        executor.launch(plan.kernel, plan.kernel_targs, plan.grid, (THREADS, 1, 1),
                        (*plan.head, out_ptr, part_acc, part_ml, *plan.tail))
    del plan  # a converted rel_bias table it held was needed until the launch was queued
    if part_acc:
        rows = q.shape[0] * q.shape[1] * q.shape[2]
        executor.launch(registry.BY_NAME["paged_attention_combine_kernel"], _combine_targs(out.dtype, q.shape[3]),
                        (math.ceil(rows / 4), 1, 1), (THREADS, 1, 1), (part_acc, part_ml, out_ptr, rows,
                                                                       acc.shape[0]))
    return out


_MAX_PLANS = 512
_PLANS: dict = {}


def _prepared(executor, plan: _AttentionPlan) -> _AttentionPlan:
    """``plan`` with its launch prepared by the executor (``prepare``: the parameters packed once, ``out`` and the
    two partials' pointers supplied per call), where the executor has one and its launch path uses it."""
    prepare = getattr(executor, "prepare", None)
    if plan.kernel is None or prepare is None:
        return plan
    args = (*plan.head, 0, 0, 0, *plan.tail)
    per_call = (len(plan.head), len(plan.head) + 1, len(plan.head) + 2)  # out, part_acc, part_ml
    return dataclasses.replace(plan, prepared=prepare(plan.kernel, plan.kernel_targs, plan.grid, (THREADS, 1, 1),
                                                      args, per_call))


def _combine_targs(dtype: torch.dtype, head_dim: int) -> tuple:
    return (registry.DTYPE_ARG[dtype], str(head_dim))


@dataclass(frozen=True)
class _AttentionPlan:
    """What one attention call derives from its view: the launch without the output's pointers."""

    dtype: torch.dtype
    kernel: object  # None: an empty call (no launch)
    kernel_targs: tuple = ()
    grid: tuple = ()
    head: tuple = ()  # the pointers before ``out`` (q, pools, scales, table, lengths, chunk_lens)
    tail: tuple = ()  # the scalars after the partials (and the rel_bias table's pointer and width)
    num_splits: int = 1
    shape: tuple = ()  # (B, H, T, D)
    combine_targs: tuple = ()
    reusable: bool = False
    rel_table: object = None  # a contiguous copy of rel_bias made for this call (never in a kept plan)
    prepared: object = None  # the executor's prepared launch (``_prepared``; kept plans only), or None

    def kept(self) -> _AttentionPlan:
        """The plan as ``_PLANS`` keeps it: no tensor (a reusable plan's table is the caller's own)."""
        return dataclasses.replace(self, rel_table=None)


def _tensor_key(t: torch.Tensor | None) -> tuple:
    if t is None:
        return ()
    return (t.data_ptr(), t.shape, t.dtype, t.stride(), t.device)


def _view_key(cache: PagedKVCache) -> tuple:
    """The view's part of a plan key, computed once per view object (a view's fields are fixed; a tick
    builds new views, so a new view is keyed anew)."""
    key = cache.__dict__.get("_launch_key")
    if key is None:
        key = (_tensor_key(cache.k_cache), _tensor_key(cache.v_cache), _tensor_key(cache.k_scale),
               _tensor_key(cache.v_scale), cache.kv_format, _tensor_key(cache.block_table),
               _tensor_key(cache.cache_seqlens), _tensor_key(cache.cache_seqstarts), cache.block_size, cache.max_span)
        cache.__dict__["_launch_key"] = key
    return key


def _plan_key(executor, q, cache: PagedKVCache, chunk_lens, scale, causal, num_splits, version, rel_bias) -> tuple:
    """Everything ``_plan_attention`` reads, addresses included (a plan holds them); ``q`` is contiguous."""
    lens = () if chunk_lens is None else _tensor_key(chunk_lens)
    rel = () if rel_bias is None else _tensor_key(rel_bias)
    return (executor, version, num_splits, causal, scale, q.data_ptr(), q.shape, q.dtype, q.device, _view_key(cache),
            lens, rel)


def _plan_attention(executor, q, cache: PagedKVCache, chunk_lens, scale, causal, num_splits, version, rel_bias):
    """Every check and choice of one attention call (``paged_attention``'s contract); the launch as a plan."""
    _check_pool(cache)
    B, H, T, D = q.shape
    Hkv = cache.n_kv_head
    if B > registry.MAX_GRID[2]:  # the attention grid is (q tiles x splits, n_kv_head, B)
        raise ValueError(
            f"fast paged_attention: B={B} rows, but the kernel's grid z is the batch and CUDA allows at most "
            f"{registry.MAX_GRID[2]}; split the cohort"
        )
    if cache.quantized:  # quantized pages, q and out in the model dtype
        check_fp8_geometry(D, q.dtype, executor.kind)
        dtype, page = q.dtype, _page_arg(cache, q.dtype)
    else:
        dtype = cache.k_cache.dtype
        if q.dtype != dtype:
            raise ValueError(
                f"fast paged_attention: q is {q.dtype} but the pool is {dtype}; the kernels need one dtype"
            )
        if dtype not in registry.DTYPE_ARG or D not in registry.HEAD_DIMS:
            raise ValueError(
                f"fast paged_attention: no kernel for dtype={dtype}, head_dim={D} "
                f"(kernels: {sorted(str(d) for d in registry.DTYPE_ARG)}, head_dim {registry.HEAD_DIMS})"
            )
        page = registry.DTYPE_ARG[dtype]
    if B == 0 or T == 0 or H == 0:
        return _AttentionPlan(dtype, None)
    for t in (q, cache.k_cache, cache.v_cache):
        if t.data_ptr() % 16:
            raise ValueError("fast paged_attention: q and the pool must be 16-byte aligned")
    if version is None:
        version = choose_attention_version(executor, cache, q.dtype, D, rel=rel_bias is not None)
    if version not in ATTENTION_VERSIONS:
        raise ValueError(f"fast paged_attention: version must be one of {ATTENTION_VERSIONS}, got {version!r}")
    if rel_bias is not None and version not in REL_VERSIONS:
        raise ValueError(f"fast paged_attention: attention {version} has no relative-position term (rel_bias); "
                         f"the kernels with it are {REL_VERSIONS}")
    rel_table, rel = None, ()
    if version != "v2":  # v1, v3: the term's table (a contiguous copy is held here until the launch returns)
        rel_table, rel = _rel_args(rel_bias, B, H, T, q.device)
    if version in ("v2", "v3") and not v2_supports(cache, q.dtype, D):
        raise ValueError(
            f"fast paged_attention: {version} takes fp16/bf16 queries with pages in that dtype or fp8, head_dim in "
            f"{registry.HEAD_DIMS}, block_size in {registry.V2_BLOCK_SIZES}; got q {q.dtype}, pages "
            f"{cache.k_cache.dtype}, head_dim={D}, block_size={cache.block_size}"
        )
    table = _block_table(cache)
    seqlens = _int32_vector(cache.cache_seqlens, "cache_seqlens", B, q.device)
    seqstarts = _int32_vector(cache.cache_seqstarts, "cache_seqstarts", B, q.device)

    group = H // Hkv
    max_keys = max(1, cache.max_span + T)
    if version in ("v2", "v3"):
        kernel = registry.BY_NAME[f"paged_chunk_attention_{version}_kernel"]
        kernel_targs = (registry.DTYPE_ARG[dtype], page, str(D), str(cache.block_size))
        kernel_targs += (registry.REL_ARG,) if rel_bias is not None else ()
        q_tiles = math.ceil(group * T / (V2_ROWS_PER_CTA if version == "v2" else V3_ROWS_PER_CTA))
        if num_splits is None:
            slots = executor.sm_count * executor.resident_ctas(kernel, kernel_targs, THREADS)
            if version == "v2":
                num_splits = choose_num_splits_by_waves(B * Hkv * q_tiles, max_keys, slots)
            else:
                num_splits = choose_num_splits_filled(B * Hkv * q_tiles, max_keys, slots, executor.sm_count)
    else:
        kernel = registry.BY_NAME["paged_chunk_attention_kernel"]
        kernel_targs = (registry.DTYPE_ARG[dtype], page, str(D)) + ((registry.REL_ARG,) if rel_bias is not None else ())
        q_tiles = math.ceil(group * T / ROWS_PER_CTA)
        if num_splits is None:
            num_splits = choose_num_splits(B, Hkv, q_tiles, max_keys, executor.sm_count)
    split_len = TILE_KEYS * math.ceil(math.ceil(max_keys / num_splits) / TILE_KEYS)
    num_splits = max(1, math.ceil(max_keys / split_len))  # drop splits that would start past every range

    block_size = () if version in ("v2", "v3") else (cache.block_size,)  # v2, v3: a template argument
    head = (
        _ptr(q), _ptr(cache.k_cache), _ptr(cache.v_cache), _ptr(cache.k_scale), _ptr(cache.v_scale), _ptr(table),
        table.stride(0), _ptr(seqlens), _ptr(seqstarts), _ptr(chunk_lens),
    )  # fmt: skip
    tail = (H, Hkv, T, *block_size, num_splits, split_len, scale * math.log2(math.e), int(bool(causal)), *rel)
    # the plan may be reused only when it holds no tensor made here: every input already in the layout the
    # kernel reads (a converted copy would be stale at the next call, whose values may differ)
    reusable = (table is cache.block_table and seqlens is cache.cache_seqlens and seqstarts is cache.cache_seqstarts
                and rel_table is rel_bias)
    return _AttentionPlan(dtype, kernel, kernel_targs, (q_tiles * num_splits, Hkv, B), head, tail, num_splits,
                          (B, H, T, D), (registry.DTYPE_ARG[dtype], str(D)), reusable, rel_table)
def _launch_scaled_gather(executor, kernel: str, targs: tuple, what: str, k_pool, v_pool, k_scale, v_scale, out,
                          block_ids, start: int, num_frames: int, D: int) -> torch.Tensor:
    """The dequantizing gathers (fp8, int8 / q8_0 / affine4): one launch over ``out`` in 16-byte units."""
    L, NB, bs, Hkv = k_pool.shape[:4]
    if out.data_ptr() % 16:
        raise ValueError(f"gather_kv_blocks: out must be 16-byte aligned for the {what} kernel")
    block_ids = block_ids.to(torch.int32).contiguous()
    args = (
        _ptr(k_pool), _ptr(v_pool), _ptr(k_scale), _ptr(v_scale), _ptr(out), _ptr(block_ids), int(start),
        int(num_frames), L, NB, bs, Hkv, D,
    )  # fmt: skip
    grid = (_grid_1d(out.numel() * out.element_size() // 16, executor), 1, 1)
    executor.launch(registry.BY_NAME[kernel], targs, grid, (THREADS, 1, 1), args)
    return out


def gather_kv_blocks(
    executor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_ids: torch.Tensor,
    start: int,
    num_frames: int,
    out,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    kv_format: str | None = None,
) -> torch.Tensor:
    """Launch gather_kv_blocks: all layers of one stream's frames into (L, Hkv, T, 2D).

    With ``k_scale``/``v_scale`` (fp8 pools, scales ``(L, NB, bs, Hkv)``) the fp8 kernel dequantizes
    into ``out``'s dtype.
    """
    L, NB, bs, Hkv, D = k_pool.shape
    fmt = get_format(kv_format if kv_format is not None else ("fp8_e4m3" if k_scale is not None else None))
    D *= fmt.values_per_byte
    if fmt.quantized and fmt.name != "fp8_e4m3":  # int8 / q8_0 / affine4: the dequantizing gather
        _check_quant_planes(fmt, k_pool, v_pool, k_scale, v_scale)
        check_fp8_geometry(D, out.dtype, executor.kind)
        if out.shape[2] == 0 or L == 0 or Hkv == 0:
            return out
        targs = (registry.DTYPE_ARG[out.dtype], _page_arg(fmt, out.dtype))
        return _launch_scaled_gather(executor, "gather_kv_blocks_quant_kernel", targs, fmt.name, k_pool, v_pool,
                                     k_scale, v_scale, out, block_ids, start, num_frames, D)
    if k_scale is not None or v_scale is not None:
        _check_scales(k_pool, v_pool, k_scale, v_scale)
        check_fp8_geometry(D, out.dtype, executor.kind)
    if out.shape[2] == 0 or L == 0 or Hkv == 0:
        return out
    if k_scale is not None:
        return _launch_scaled_gather(executor, "gather_kv_blocks_fp8_kernel", (registry.DTYPE_ARG[out.dtype],),
                                     "fp8", k_pool, v_pool, k_scale, v_scale, out, block_ids, start, num_frames, D)
    row_bytes = D * k_pool.element_size()
    unit = _copy_unit(row_bytes, k_pool, v_pool, out)
    block_ids = block_ids.to(torch.int32).contiguous()
    args = (
        _ptr(k_pool), _ptr(v_pool), _ptr(out), _ptr(block_ids), int(start), int(num_frames), L, NB, bs, Hkv,
        row_bytes // unit,
    )  # fmt: skip
    grid = (_grid_1d(out.numel() * out.element_size() // unit, executor), 1, 1)
    executor.launch(
        registry.BY_NAME["gather_kv_blocks_kernel"], (registry.UNIT_ARG[unit],), grid, (THREADS, 1, 1), args
    )
    return out


# Each registered attention kernel's launcher (registry.attention_kernels(), by short name), all with
# paged_attention's signature, each pinned to its version (paged_attention alone picks one). Tests and
# the GPU bench run every entry, so a new version is compared by adding its line here; ATTENTION_SERVES
# says which inputs each one takes (the others raise ValueError).
ATTENTION_LAUNCHERS = {
    "paged_chunk_attention_kernel": functools.partial(paged_attention, version="v1"),
    "paged_chunk_attention_v2_kernel": functools.partial(paged_attention, version="v2"),
    "paged_chunk_attention_v3_kernel": functools.partial(paged_attention, version="v3"),
}
ATTENTION_SERVES = {  # (cache, q dtype, head_dim) -> bool
    "paged_chunk_attention_kernel": lambda cache, q_dtype, head_dim: True,  # every dtype the fast twin takes
    "paged_chunk_attention_v2_kernel": v2_supports,  # model-dtype and fp8 pages only
    "paged_chunk_attention_v3_kernel": v2_supports,  # the same instantiations
}
