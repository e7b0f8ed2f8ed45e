"""``PagedKVCache``: the one view of a layer's paged K/V that both twins hand out.

A view describes a *cohort* of ``B`` rows (streams, or padding-lane rows) over
one layer of the shared pool::

    k_cache, v_cache   (num_pool_blocks, block_size, n_kv_head, head_dim)   one layer
    block_table        (B, W) int32   column i -> physical block of logical block i
    cache_seqlens      (B,)   int32   table position one past the last committed frame
    cache_seqstarts    (B,)   int32   first table position a query may attend to

A chunk of ``T`` frames for row ``b`` is written at table positions
``[cache_seqlens[b], cache_seqlens[b] + chunk_lens[b])`` (see ``append_kv``) and
its queries attend to ``[cache_seqstarts[b], cache_seqlens[b] + chunk_lens[b])``
(see ``paged_attention``). Table position ``p`` lives in physical block
``block_table[b, p // block_size]`` at offset ``p % block_size``.

With fp8 pages (``CacheConfig(kv_cache_dtype="fp8_e4m3")``) ``k_cache``/``v_cache``
are ``float8_e4m3fn`` and ``k_scale``/``v_scale`` hold one fp32 scale per
(block, position, kv head); see ``oasr.reference.fp8`` for the rule.

``max_seqlen`` and ``max_span`` are host-side maxima over the rows (of
``cache_seqlens`` and of ``cache_seqlens - cache_seqstarts``), filled from the
manager's host bookkeeping so that a launcher can size a grid without reading
the device tensors back.

The view is a plain record: it owns nothing, and ``append_kv`` writes through
it into the pool but never moves ``cache_seqlens`` (the manager's commit does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKVCache:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cache_seqstarts: torch.Tensor
    block_size: int
    max_seqlen: int
    max_span: int
    layer: int = 0
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        """True for fp8 pages: ``k_scale``/``v_scale`` are ``(num_pool_blocks, block_size, n_kv_head)`` fp32."""
        return self.k_scale is not None

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def n_kv_head(self) -> int:
        return self.k_cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]


def check_chunk_lens(chunk_lens, batch: int, num_frames: int, device) -> torch.Tensor:
    """Normalise ``chunk_lens`` to an int32 tensor of shape ``(batch,)`` on ``device``.

    ``None`` means every row's chunk is ``num_frames`` long. Values must lie in
    ``[0, num_frames]``. Validation of a tensor's *values* reads it on the host,
    so the fast twin calls this only where the values are host-side already.
    """
    if chunk_lens is None:
        return torch.full((batch,), num_frames, dtype=torch.int32, device=device)
    lens = torch.as_tensor(chunk_lens, dtype=torch.int32, device=device)
    if lens.shape != (batch,):
        raise ValueError(f"chunk_lens: expected shape ({batch},), got {tuple(lens.shape)}")
    return lens


def check_kv_chunk(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape / dtype / device checks shared by both twins' ``append_kv``."""
    B = cache.batch_size
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[0] != B or t.shape[2:] != cache.k_cache.shape[2:]:
            raise ValueError(
                f"append_kv: {name} must be (B={B}, T, n_kv_head={cache.n_kv_head}, "
                f"head_dim={cache.head_dim}), got {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"append_kv: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.device != cache.k_cache.device:
        raise ValueError(f"append_kv: k is on {k.device}, the pool on {cache.k_cache.device}")


def check_query(cache: PagedKVCache, q: torch.Tensor) -> None:
    """Shape / device checks shared by both twins' ``paged_attention``."""
    B = cache.batch_size
    if q.dim() != 4 or q.shape[0] != B or q.shape[3] != cache.head_dim:
        raise ValueError(
            f"paged_attention: q must be (B={B}, n_head, T, head_dim={cache.head_dim}), got {tuple(q.shape)}"
        )
    if q.shape[1] % cache.n_kv_head != 0:
        raise ValueError(
            f"paged_attention: n_head={q.shape[1]} must be a multiple of n_kv_head={cache.n_kv_head}"
        )
    if q.device != cache.k_cache.device:
        raise ValueError(f"paged_attention: q is on {q.device}, the pool on {cache.k_cache.device}")


@dataclass
class StreamKVInfo:
    """A snapshot of one stream's bookkeeping (for tests, notebooks and schedulers)."""

    slot: int
    blocks: tuple
    cache_seqlen: int
    cache_seqstart: int
    total_frames: int
