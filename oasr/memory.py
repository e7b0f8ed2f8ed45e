"""Memory arithmetic for the caches, without allocating anything.

The K/V pool dominates::

    bytes_per_kv_block = 2 (K and V) * num_layers * block_size_frames * n_kv_head * head_dim * elem

With ``kv_cache_dtype="fp8_e4m3"`` elem is 1 and every (frame, head) vector adds
a 4-byte fp32 scale: ``head_dim + 4`` bytes instead of ``2 * head_dim`` at fp16,
1.88x more blocks in the same budget at head_dim 64 (1.94x at 128).

``footprint(config)`` adds the rest (scratch blocks, block tables, the two
int32 length vectors, the conv cache) and ``max_num_blocks_for_budget`` turns a
byte budget into a block count. ``tests/test_memory.py`` pins every figure
against real allocations, so the formula and the allocators cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oasr.config import CacheConfig


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_kv_block(config: CacheConfig) -> int:
    """K and V of one block id, across every layer (with fp8 K/V: data plus one fp32 scale per vector)."""
    per_vector = config.head_dim * element_size(config.kv_storage_dtype)
    if config.kv_quantized:
        per_vector += 4
    return 2 * config.num_layers * config.block_size_frames * config.n_kv_head * per_vector


def kv_pool_bytes(config: CacheConfig, scratch_blocks: int = 1) -> int:
    return bytes_per_kv_block(config) * (config.max_num_blocks + scratch_blocks)


@dataclass(frozen=True)
class Footprint:
    kv_pool: int
    scratch: int
    block_tables: int
    seq_meta: int
    conv_cache: int

    @property
    def total(self) -> int:
        return self.kv_pool + self.scratch + self.block_tables + self.seq_meta + self.conv_cache

    def as_dict(self) -> dict:
        return {
            "kv_pool": self.kv_pool,
            "scratch": self.scratch,
            "block_tables": self.block_tables,
            "seq_meta": self.seq_meta,
            "conv_cache": self.conv_cache,
            "total": self.total,
        }

    def format(self) -> str:
        rows = [f"  {name:13s} {format_bytes(value):>12s}" for name, value in self.as_dict().items()]
        return "\n".join(rows)


def footprint(config: CacheConfig, scratch_blocks: int = 1, pad_lanes: int = 0) -> Footprint:
    """Bytes by component of one engine's caches (the fast twin's persistent layout)."""
    rows = config.max_batch_size + pad_lanes
    return Footprint(
        kv_pool=bytes_per_kv_block(config) * config.max_num_blocks,
        scratch=bytes_per_kv_block(config) * scratch_blocks,
        block_tables=rows * config.max_blocks_per_seq * 4,
        seq_meta=2 * rows * 4,
        conv_cache=config.num_layers * rows * config.cnn_cache_frames * config.hidden_dim
        * element_size(config.dtype),
    )


def max_num_blocks_for_budget(config: CacheConfig, budget_bytes: int, scratch_blocks: int = 1) -> int:
    """Most allocatable blocks whose K/V pool (scratch included) fits in ``budget_bytes``."""
    blocks = budget_bytes // bytes_per_kv_block(config) - scratch_blocks
    if blocks <= 0:
        raise ValueError(
            f"a budget of {budget_bytes} bytes holds no block: one block is {bytes_per_kv_block(config)} bytes"
            f" and {scratch_blocks} scratch block(s) come first"
        )
    return int(blocks)


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
