"""Launchers: turn a ``PagedKVCache`` call into kernel grids and arguments.

Shared by both executors: ``CudaExecutor`` (NVRTC cubins on a GPU) and
``EmulatedExecutor`` (the same sources built with g++ for CPU tensors). A
launcher validates what it can see on the host (shapes, dtypes, strides,
alignment), sizes the grid from shapes and the view's host-side maxima
(``max_span``), and never reads a device tensor back: no ``.item()``, no
``.tolist()``, no ``.cpu()``. Per-row values (``chunk_lens``, seqlens) are
trusted as the kernels see them; the fast twin's ``paged_ops`` validates them
first wherever they are on the host already.
"""

from __future__ import annotations

import math

import torch

from oasr.fast.kernels import registry
from oasr.paged import PagedKVCache

THREADS = 128  # every kernel runs 128-thread blocks
ROWS_PER_CTA = 16  # attention: query rows (t, g) per CTA = 4 warps x 4 rows
TILE_KEYS = 32  # attention: keys per shared-memory tile
MIN_KEYS_PER_SPLIT = 64  # flash-decoding: a split gets at least two key tiles
MAX_SPLITS = 32


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _int32_vector(t: torch.Tensor, name: str, batch: int, device) -> torch.Tensor:
    if t.shape != (batch,):
        raise ValueError(f"{name}: expected shape ({batch},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the pool on {device}")
    return t.to(torch.int32).contiguous()


def _block_table(cache: PagedKVCache) -> torch.Tensor:
    table = cache.block_table
    if table.device != cache.k_cache.device:
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
    B, T = k.shape[:2]
    if B == 0 or T == 0:
        return
    dtype = cache.k_cache.dtype
    k = k.to(dtype).contiguous()
    v = v.to(dtype).contiguous()
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


def paged_attention(
    executor,
    q: torch.Tensor,
    cache: PagedKVCache,
    chunk_lens: torch.Tensor | None,
    scale: float,
    causal: bool,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launch paged_chunk_attention (and the combine kernel when the keys are split)."""
    _check_pool(cache)
    B, H, T, D = q.shape
    Hkv = cache.n_kv_head
    dtype = cache.k_cache.dtype
    if q.dtype != dtype:
        raise ValueError(f"fast paged_attention: q is {q.dtype} but the pool is {dtype}; the kernels need one dtype")
    if dtype not in registry.DTYPE_ARG or D not in registry.HEAD_DIMS:
        raise ValueError(
            f"fast paged_attention: no kernel for dtype={dtype}, head_dim={D} "
            f"(kernels: {sorted(str(d) for d in registry.DTYPE_ARG)}, head_dim {registry.HEAD_DIMS})"
        )
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if B == 0 or T == 0 or H == 0:
        return out
    for t in (q, cache.k_cache, cache.v_cache):
        if t.data_ptr() % 16:
            raise ValueError("fast paged_attention: q and the pool must be 16-byte aligned")
    table = _block_table(cache)
    seqlens = _int32_vector(cache.cache_seqlens, "cache_seqlens", B, q.device)
    seqstarts = _int32_vector(cache.cache_seqstarts, "cache_seqstarts", B, q.device)

    group = H // Hkv
    q_tiles = math.ceil(group * T / ROWS_PER_CTA)
    max_keys = max(1, cache.max_span + T)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, q_tiles, max_keys, executor.sm_count)
    split_len = TILE_KEYS * math.ceil(math.ceil(max_keys / num_splits) / TILE_KEYS)
    num_splits = max(1, math.ceil(max_keys / split_len))  # drop splits that would start past every range

    part_acc = part_ml = None
    if num_splits > 1:
        part_acc = torch.empty((num_splits, B, H, T, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_splits, B, H, T, 2), dtype=torch.float32, device=q.device)
    targs = (registry.DTYPE_ARG[dtype], str(D))
    args = (
        _ptr(q), _ptr(cache.k_cache), _ptr(cache.v_cache), _ptr(table), table.stride(0), _ptr(seqlens),
        _ptr(seqstarts), _ptr(chunk_lens), _ptr(out), _ptr(part_acc), _ptr(part_ml), H, Hkv, T,
        cache.block_size, num_splits, split_len, scale * math.log2(math.e), int(bool(causal)),
    )  # fmt: skip
    executor.launch(
        registry.BY_NAME["paged_chunk_attention_kernel"], targs, (q_tiles * num_splits, Hkv, B), (THREADS, 1, 1), args
    )
    if num_splits > 1:
        rows = B * H * T
        executor.launch(
            registry.BY_NAME["paged_attention_combine_kernel"],
            targs,
            (math.ceil(rows / 4), 1, 1),
            (THREADS, 1, 1),
            (_ptr(part_acc), _ptr(part_ml), _ptr(out), rows, num_splits),
        )
    return out


def gather_kv_blocks(
    executor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor, start: int, num_frames: int, out
) -> torch.Tensor:
    """Launch gather_kv_blocks: all layers of one stream's frames into (L, Hkv, T, 2D)."""
    L, NB, bs, Hkv, D = k_pool.shape
    if out.shape[2] == 0 or L == 0 or Hkv == 0:
        return out
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
