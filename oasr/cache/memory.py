"""Memory arithmetic for the caches, without allocating anything.

The K/V pool dominates::

    bytes_per_kv_block = 2 (K and V) * num_layers * block_size_frames * n_kv_head * head_dim * elem

A quantized ``kv_cache_dtype`` replaces ``head_dim * elem`` by the format's bytes per
vector (``oasr.kv_formats``): ``head_dim + 4`` for fp8_e4m3 and int8 (1.88x more blocks
than fp16 at head_dim 64, 1.94x at 128), ``head_dim * 34 / 32`` for q8_0 (1.88x),
``head_dim / 2 + 4 * elem * head_dim / 64`` for affine4 (3.2x at fp16).

``footprint(config)`` adds the rest (scratch blocks, block tables, the two
int32 length vectors, the conv cache; with ``decoder=DecoderCacheConfig(...)``
the autoregressive decoder's own pool and tables too: ``decoder_pool_bytes``) and ``max_num_blocks_for_budget`` turns a
byte budget into a block count. ``tests/test_memory.py`` pins every figure
against real allocations, so the formula and the allocators cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass

from oasr.cache.config import CacheConfig, bytes_per_kv_block, element_size


def kv_pool_bytes(config: CacheConfig, scratch_blocks: int = 1) -> int:
    """Bytes of the K/V pool: every block, scratch blocks included."""
    return bytes_per_kv_block(config) * (config.max_num_blocks + scratch_blocks)


@dataclass(frozen=True)
class Footprint:
    kv_pool: int
    scratch: int
    block_tables: int
    seq_meta: int
    conv_cache: int
    decoder_pool: int = 0  # the decoder K/V pool: data, fp8 scales and its scratch block
    decoder_tables: int = 0  # its self and cross tables and its two length vectors (fast twin layout)

    @property
    def total(self) -> int:
        """Bytes of every component together."""
        return (self.kv_pool + self.scratch + self.block_tables + self.seq_meta + self.conv_cache
                + self.decoder_pool + self.decoder_tables)

    def as_dict(self) -> dict:
        """Bytes by component name."""
        return {
            "kv_pool": self.kv_pool,
            "scratch": self.scratch,
            "block_tables": self.block_tables,
            "seq_meta": self.seq_meta,
            "conv_cache": self.conv_cache,
            "decoder_pool": self.decoder_pool,
            "decoder_tables": self.decoder_tables,
            "total": self.total,
        }

    def format(self) -> str:
        """One indented line per component: name and size."""
        rows = [f"  {name:13s} {format_bytes(value):>12s}" for name, value in self.as_dict().items()]
        return "\n".join(rows)


def decoder_pool_bytes(decoder, scratch_blocks: int = 1) -> int:
    """A ``DecoderCacheConfig``'s pool: ``bytes_per_token * page_size`` per block, scratch included
    (``2 * L * H * (D + 4)`` bytes per token with fp8, ``2 * L * H * D * elem`` otherwise)."""
    return decoder.bytes_per_block * (decoder.max_num_blocks + scratch_blocks)


def decoder_table_bytes(decoder) -> int:
    """The fast decoder manager's persistent tables: ``(R, self_pages)`` and ``(R, cross_pages)`` int32
    block tables and a ``(2, R)`` int32 length pair (``R = max_rows``)."""
    R = decoder.max_rows
    return 4 * R * (max(decoder.self_pages, 1) + max(decoder.cross_pages, 1) + 2)


def footprint(config: CacheConfig, scratch_blocks: int = 1, pad_lanes: int = 0, decoder=None) -> Footprint:
    """Bytes by component of one engine's caches (the fast twin's persistent layout); ``decoder``, a
    ``DecoderCacheConfig``, adds the autoregressive decoder's pool and tables."""
    rows = config.max_batch_size + pad_lanes
    return Footprint(
        kv_pool=bytes_per_kv_block(config) * config.max_num_blocks,
        scratch=bytes_per_kv_block(config) * scratch_blocks,
        block_tables=rows * config.max_blocks_per_seq * 4,
        seq_meta=2 * rows * 4,
        conv_cache=config.num_layers * rows * config.cnn_cache_frames * config.hidden_dim
        * element_size(config.dtype),
        decoder_pool=0 if decoder is None else decoder_pool_bytes(decoder),
        decoder_tables=0 if decoder is None else decoder_table_bytes(decoder),
    )


def blocks_per_gib(config: CacheConfig) -> int:
    """Whole K/V blocks (every layer, K and V) in one GiB for ``config``'s geometry and format."""
    return (1 << 30) // bytes_per_kv_block(config)


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
    """``n`` bytes in B, KiB, MiB or GiB, e.g. ``1.50 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
