"""``DecoderCacheConfig``: geometry and capacity of an autoregressive decoder's K/V (an attention rescorer's).

The decoder's K/V is the second growing, block-addressed cache, on its own
pool and with its own policy: a row grows one token per step and is never
evicted. Each admitted row owns two regions of the pool::

    self region    logical pages 0 .. ceil((prompt_len + max_new_tokens) / page) - 1
                   |  prompt  | gen gen gen ... |            (grows: a page when a row crosses a boundary)
    cross region   logical pages 0 .. ceil(cross_len / page) - 1
                   | encoder frames (filled once) |          (fixed extent, mapped at admission)

    token position p of a region lives in physical block table[row, p // page_size], offset p % page_size

Admission reserves each row's ceiling (self pages for prompt + max_new_tokens,
plus its cross pages), so the free blocks always cover what the admitted rows
may still take: a row stepped to its ceiling never finds the pool dry.

Storage (``kv_storage``): ``"paged"`` (this pool, graph-stable addresses),
``"dense"`` (per-group ``(B, H, cap, D)`` buffers; beams may repeat rows), or
``"auto"``: paged when the decode steps are graph-captured (``graph_captured=True``:
the steps run through ``oasr.engine.decode_step.FastDecodeStep(graphs=True)``, which
refuses a config that resolves to dense), dense otherwise.

With ``kv_cache_dtype="fp8_e4m3"`` every (token, KV head) vector is stored as
e4m3 plus one fp32 power-of-two scale, ``2 * L * H * (D + 4)`` bytes per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oasr.cache.config import CacheConfig, _as_dtype, resolve_kv_format
from oasr.kv_formats import get_format

KV_STORAGES = ("paged", "dense", "auto")

_POSITIVE = ("num_layers", "n_kv_head", "head_dim", "page_size", "max_rows", "max_self_tokens")


@dataclass(frozen=True)
class DecoderRequest:
    """What one request declares at admission: its ceilings, not its actual lengths."""

    prompt_len: int
    max_new_tokens: int
    cross_len: int = 0

    def __post_init__(self):
        for name in ("prompt_len", "max_new_tokens", "cross_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DecoderRequest.{name} must be an int >= 0, got {value!r}")

    @property
    def self_tokens(self) -> int:
        """The self-attention ceiling: prompt plus every token it may generate."""
        return self.prompt_len + self.max_new_tokens


@dataclass
class DecoderCacheConfig:
    """Decoder K/V geometry; validated in ``__post_init__`` with messages naming fields and numbers.

    Give the pool either ``max_num_blocks`` or ``budget_bytes`` (the most blocks whose
    K/V, scales and scratch block fit in that many bytes); not both.
    """

    num_layers: int = 2
    n_kv_head: int = 2
    head_dim: int = 64
    page_size: int = 16
    max_num_blocks: int | None = None
    budget_bytes: int | None = None
    max_rows: int = 32
    max_self_tokens: int = 256
    max_cross_tokens: int = 0
    kv_cache_dtype: str | None = None
    kv_storage: str = "auto"
    graph_captured: bool = False
    device: torch.device | str = "cpu"
    dtype: torch.dtype | str = torch.float32

    def __post_init__(self):
        for name in _POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderCacheConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.max_cross_tokens, bool) or not isinstance(self.max_cross_tokens, int) \
                or self.max_cross_tokens < 0:
            raise ValueError(f"DecoderCacheConfig.max_cross_tokens must be an int >= 0, got {self.max_cross_tokens!r}")
        self.device = torch.device(self.device)
        self.dtype = _as_dtype(self.dtype, "DecoderCacheConfig")
        self.kv_cache_dtype = resolve_kv_format(
            "DecoderCacheConfig", self.kv_cache_dtype, self.device, self.head_dim, self.dtype
        )
        if self.kv_storage not in KV_STORAGES:
            raise ValueError(f"DecoderCacheConfig.kv_storage must be one of {KV_STORAGES}, got {self.kv_storage!r}")
        self.graph_captured = bool(self.graph_captured)
        if (self.max_num_blocks is None) == (self.budget_bytes is None):
            raise ValueError(
                f"DecoderCacheConfig: give exactly one of max_num_blocks and budget_bytes, got "
                f"max_num_blocks={self.max_num_blocks!r}, budget_bytes={self.budget_bytes!r}"
            )
        if self.budget_bytes is not None:
            if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int):
                raise ValueError(f"DecoderCacheConfig.budget_bytes must be an int, got {self.budget_bytes!r}")
            blocks = self.budget_bytes // self.bytes_per_block - 1  # one scratch block comes first
            if blocks <= 0:
                raise ValueError(
                    f"DecoderCacheConfig.budget_bytes={self.budget_bytes} holds no block: one block is "
                    f"{self.bytes_per_block} bytes (num_layers={self.num_layers}, page_size={self.page_size}, "
                    f"n_kv_head={self.n_kv_head}, head_dim={self.head_dim}) and one scratch block comes first"
                )
            self.max_num_blocks = int(blocks)
        if isinstance(self.max_num_blocks, bool) or not isinstance(self.max_num_blocks, int) \
                or self.max_num_blocks <= 0:
            raise ValueError(f"DecoderCacheConfig.max_num_blocks must be a positive int, got {self.max_num_blocks!r}")

    # ---- derived --------------------------------------------------------------
    @property
    def kv_quantized(self) -> bool:
        """Whether the K/V is stored as fp8 with per-vector scales."""
        return self.kv_cache_dtype is not None

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """dtype of the stored K/V: the format's data dtype (``oasr.kv_formats``), else the model dtype."""
        return get_format(self.kv_cache_dtype).data_dtype(self.dtype)

    @property
    def storage(self) -> str:
        """``kv_storage`` resolved: ``"auto"`` is paged for graph-captured steps (addresses that outlive a
        batch), dense otherwise (beams may repeat rows)."""
        if self.kv_storage == "auto":
            return "paged" if self.graph_captured else "dense"
        return self.kv_storage

    @property
    def self_pages(self) -> int:
        """Columns of a row's self-attention table: ``ceil(max_self_tokens / page_size)``."""
        return math.ceil(self.max_self_tokens / self.page_size)

    @property
    def cross_pages(self) -> int:
        """Columns of a row's cross-attention table: ``ceil(max_cross_tokens / page_size)``."""
        return math.ceil(self.max_cross_tokens / self.page_size)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer: ``2 L H`` times the format's bytes per vector (``2 L H D
        elem`` in the model dtype, ``2 L H (D + 4)`` with fp8; ``oasr.kv_formats``)."""
        per_vector = get_format(self.kv_cache_dtype).bytes_per_vector(self.head_dim, self.dtype)
        return 2 * self.num_layers * self.n_kv_head * per_vector

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one page: ``bytes_per_token * page_size``."""
        return self.bytes_per_token * self.page_size

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens (rounded up)."""
        return math.ceil(tokens / self.page_size)

    def pool_config(self) -> CacheConfig:
        """The ``CacheConfig`` a ``BlockPool`` is built from (only its pool geometry is used)."""
        return CacheConfig(
            num_layers=self.num_layers, n_kv_head=self.n_kv_head, head_dim=self.head_dim, hidden_dim=1,
            kernel_size=1, chunk_size=1, num_left_chunks=-1, block_size_frames=self.page_size,
            max_num_blocks=self.max_num_blocks, max_batch_size=1,
            max_blocks_per_seq=max(self.self_pages, self.cross_pages, 1),
            device=self.device, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
        )
