"""Fast ``append_kv`` / ``paged_attention`` (+ ``gather_kv_blocks``): the kernels, or vectorised torch.

This is the fast twin of ``oasr.reference.paged_ops`` and must agree with it:
same signatures, same semantics (see the reference's docstring and the diagram
in ``oasr.paged``), same errors. Each function takes one extra keyword-only
argument, ``backend``, which picks the CPU implementation (see
``oasr.fast.backend``)::

    CUDA tensors  ->  kernels_cu/ kernels, NVRTC-compiled, on torch's current stream
    CPU tensors   ->  "torch": vectorised torch, no Python loop over rows (default)
                      "emulated": the same kernels run by the host SIMT emulator

Value checks. The reference validates ``chunk_lens`` by reading it. Here that
happens wherever the values are on the host already (CPU tensors, lists, or a
CPU tensor for CUDA data); a ``chunk_lens`` tensor that lives on the GPU is
used as is, without a device-to-host read, and the kernels clamp it to
``[0, T]``. Nothing on the CUDA path synchronises with the device.

Before capturing a CUDA graph, call ``load_kernels(device)`` (or run each op
once) so that compilation and module loading happen outside the capture.
"""

from __future__ import annotations

import math

import torch

from oasr.fast.backend import resolve_backend
from oasr.fast.kernels import ops
from oasr.paged import PagedKVCache, check_chunk_lens, check_kv_chunk, check_query


def _executor(name: str, device: torch.device):
    if name == "cuda":
        from oasr.fast.kernels.nvrtc import executor_for

        return executor_for(device)
    from oasr.fast.kernels.emulation import executor

    return executor()


def load_kernels(device: torch.device | str, backend: str | None = None) -> None:
    """Compile and load every kernel for ``device`` now (before CUDA graph capture); no-op for "torch"."""
    device = torch.device(device)
    name = resolve_backend(device, backend)
    if name != "torch":
        _executor(name, device).load_all()


def _host_lens(chunk_lens, batch: int, num_frames: int, op: str) -> torch.Tensor:
    """``chunk_lens`` as a validated int32 CPU tensor (reads the values: host data only)."""
    if isinstance(chunk_lens, torch.Tensor):
        chunk_lens = chunk_lens.cpu()
    lens = check_chunk_lens(chunk_lens, batch, num_frames, "cpu")
    bad = ((lens < 0) | (lens > num_frames)).nonzero()
    if len(bad):
        b = int(bad[0, 0])
        raise ValueError(f"{op}: chunk_lens[{b}]={int(lens[b])} outside [0, T={num_frames}]")
    return lens


def _kernel_lens(chunk_lens, batch: int, num_frames: int, device: torch.device, op: str):
    """None (every row has T frames) or an int32 (B,) tensor on ``device`` for the kernels."""
    if chunk_lens is None:
        return None
    if isinstance(chunk_lens, torch.Tensor) and chunk_lens.device.type == "cuda":
        if chunk_lens.shape != (batch,):
            raise ValueError(f"chunk_lens: expected shape ({batch},), got {tuple(chunk_lens.shape)}")
        if chunk_lens.device != device:
            raise ValueError(f"{op}: chunk_lens is on {chunk_lens.device}, the pool on {device}")
        return chunk_lens.to(torch.int32).contiguous()  # device values: not read back, not validated
    return _host_lens(chunk_lens, batch, num_frames, op).to(device)


# -- append_kv ---------------------------------------------------------------------------------


def append_kv(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, chunk_lens=None, *, backend=None) -> None:
    """Write a cohort's chunk ``k, v`` of shape ``(B, T, n_kv_head, head_dim)`` into the pages."""
    check_kv_chunk(cache, k, v)
    name = resolve_backend(k.device, backend)
    B, T = k.shape[:2]
    if name == "torch":
        _append_kv_torch(cache, k, v, _host_lens(chunk_lens, B, T, "append_kv"))
    else:
        lens = _kernel_lens(chunk_lens, B, T, k.device, "append_kv")
        ops.append_kv(_executor(name, k.device), cache, k, v, lens)


def _append_kv_torch(cache: PagedKVCache, k, v, lens: torch.Tensor) -> None:
    B, T = k.shape[:2]
    t = torch.arange(T)
    valid = t[None, :] < lens[:, None].long()  # (B, T): frames to write
    rows = torch.arange(B)[:, None].expand(B, T)[valid]
    positions = (cache.cache_seqlens.long()[:, None] + t[None, :])[valid]
    blocks = cache.block_table[rows, positions // cache.block_size].long()
    offsets = positions % cache.block_size
    cache.k_cache[blocks, offsets] = k[valid].to(cache.k_cache.dtype)
    cache.v_cache[blocks, offsets] = v[valid].to(cache.v_cache.dtype)


# -- paged_attention ---------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    chunk_lens=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    backend=None,
) -> torch.Tensor:
    """Chunk attention of queries ``(B, n_head, T, head_dim)`` over each row's own pages."""
    check_query(cache, q)
    name = resolve_backend(q.device, backend)
    B, n_head, T, D = q.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if name == "torch":
        return _paged_attention_torch(q, cache, _host_lens(chunk_lens, B, T, "paged_attention"), scale, causal)
    lens = _kernel_lens(chunk_lens, B, T, q.device, "paged_attention")
    return ops.paged_attention(_executor(name, q.device), q, cache, lens, scale, causal)


def _paged_attention_torch(q, cache: PagedKVCache, lens: torch.Tensor, scale: float, causal: bool):
    """Gather every row's key range into a padded (B, L, Hkv, D), mask, and run fp32 attention."""
    B, H, T, D = q.shape
    Hkv = cache.n_kv_head
    lens = lens.long()
    seqlens = cache.cache_seqlens.long()
    starts = cache.cache_seqstarts.long()
    spans = torch.where(lens > 0, (seqlens + lens - starts).clamp(min=0), 0)  # keys per row
    L = int(spans.max()) if B else 0
    if L == 0:
        return torch.zeros_like(q)

    j = torch.arange(L)
    key_ok = j[None, :] < spans[:, None]  # (B, L)
    key_pos = starts[:, None] + j[None, :]  # table positions
    # Padding keys point at slot (0, 0) and are zeroed after the gather: the pool
    # may hold anything (NaN) there, and p = 0 times NaN would still be NaN.
    columns = torch.where(key_ok, key_pos // cache.block_size, 0)
    blocks = torch.where(key_ok, cache.block_table.long().gather(1, columns), 0)
    offsets = torch.where(key_ok, key_pos % cache.block_size, 0)
    keep = key_ok[:, :, None, None]
    k = torch.where(keep, cache.k_cache[blocks, offsets].float(), 0.0)  # (B, L, Hkv, D)
    v = torch.where(keep, cache.v_cache[blocks, offsets].float(), 0.0)

    qf = q.float().reshape(B, Hkv, H // Hkv, T, D)
    scores = torch.einsum("bkgtd,blkd->bkgtl", qf, k) * scale
    allowed = key_ok[:, None, :].expand(B, T, L)  # (B, T, L)
    if causal:
        query_pos = seqlens[:, None] + torch.arange(T)[None, :]
        allowed = allowed & (key_pos[:, None, :] <= query_pos[:, :, None])
    allowed = allowed & (torch.arange(T)[None, :] < lens[:, None])[:, :, None]
    allowed = allowed[:, None, None]  # (B, 1, 1, T, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, 0.0)  # fully masked rows: zeros
    out = torch.einsum("bkgtl,blkd->bkgtd", probs, v).reshape(B, H, T, D)
    return out.to(q.dtype)


# -- gather_kv_blocks --------------------------------------------------------------------------


def gather_kv_blocks(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_ids: torch.Tensor,
    start: int,
    num_frames: int,
    out: torch.Tensor | None = None,
    *,
    backend=None,
) -> torch.Tensor:
    """All layers of ``num_frames`` frames of one stream, packed K|V: ``(L, Hkv, T, 2 * D)``.

    ``k_pool, v_pool``: the pool, ``(num_layers, num_pool_blocks, block_size, n_kv_head,
    head_dim)``. ``block_ids``: the stream's physical blocks in order (int32, 1-D).
    Frame ``f`` is position ``start + f`` of the blocks' concatenation. ``out``, when
    given, must be contiguous with that shape and the pool's dtype and device.
    """
    if k_pool.dim() != 5 or k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(
            "gather_kv_blocks: k_pool and v_pool must both be (num_layers, num_pool_blocks, block_size, "
            f"n_kv_head, head_dim) of one dtype, got {tuple(k_pool.shape)} {k_pool.dtype} and "
            f"{tuple(v_pool.shape)} {v_pool.dtype}"
        )
    L, _, bs, Hkv, D = k_pool.shape
    start, num_frames = int(start), int(num_frames)
    if block_ids.dim() != 1 or block_ids.dtype.is_floating_point:
        raise ValueError(f"gather_kv_blocks: block_ids must be a 1-D integer tensor, got {block_ids.dtype}")
    if block_ids.device != k_pool.device:
        raise ValueError(f"gather_kv_blocks: block_ids is on {block_ids.device}, the pool on {k_pool.device}")
    if start < 0 or num_frames < 0 or start + num_frames > block_ids.shape[0] * bs:
        raise ValueError(
            f"gather_kv_blocks: frames [{start}, {start + num_frames}) outside the {block_ids.shape[0]} "
            f"blocks of {bs} frames"
        )
    shape = (L, Hkv, num_frames, 2 * D)
    if out is None:
        out = torch.empty(shape, dtype=k_pool.dtype, device=k_pool.device)
    elif out.shape != shape or out.dtype != k_pool.dtype or out.device != k_pool.device or not out.is_contiguous():
        raise ValueError(
            f"gather_kv_blocks: out must be a contiguous {shape} {k_pool.dtype} tensor on {k_pool.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    name = resolve_backend(k_pool.device, backend)
    if name == "torch":
        positions = start + torch.arange(num_frames)
        blocks = block_ids.long()[positions // bs]
        offsets = positions % bs
        out[..., :D] = k_pool[:, blocks, offsets].transpose(1, 2)  # (L, T, Hkv, D) -> (L, Hkv, T, D)
        out[..., D:] = v_pool[:, blocks, offsets].transpose(1, 2)
        return out
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("gather_kv_blocks: the pools must be contiguous for the kernels")
    if name == "emulated" and num_frames:  # host memory: a bad id would be a wild read, so check
        used = block_ids[start // bs : (start + num_frames - 1) // bs + 1]
        if int(used.min()) < 0 or int(used.max()) >= k_pool.shape[1]:
            raise IndexError(f"gather_kv_blocks: block id outside [0, {k_pool.shape[1]})")
    return ops.gather_kv_blocks(_executor(name, k_pool.device), k_pool, v_pool, block_ids, start, num_frames, out)
