"""``CacheConfig``: the one geometry every cache of a stream is built from.

Positions and blocks
--------------------
A stream's K/V lives in fixed-size blocks of ``block_size_frames`` frames.
Its block table maps *logical* block ``i`` (table column ``i``) to a physical
block id in the shared pool. A chunk may start and end anywhere inside a
block: a new block is allocated only when a write crosses into a logical block
the stream does not hold yet.

With eviction on (``num_left_chunks >= 0``) a chunk attends to exactly the last
``W = num_left_chunks * chunk_size`` frames of history plus itself. Positions
below are *table positions* (frame index relative to logical block 0)::

     block:   |   0   |   1   |   2   |   3   |   4   |       bs = 4, chunk = 6, W = 12
     frames:  0 1 2 3 4 5 6 7 8 9 ...
                       ^seqstart               ^seqlen
              [ evictable ][.. visible history ..][ current chunk .....]
                   (whole blocks before seqstart are freed at commit)

     cache_seqstarts = max(0, cache_seqlens - W)   first visible position
     cache_seqlens   = frames committed so far     (minus what eviction shifted)

At commit, every block lying *entirely* before the next chunk's first visible
position is returned to the pool and the table shifts left by that many
columns; ``cache_seqlens`` and ``cache_seqstarts`` drop by the same multiple of
``block_size_frames``. The first visible position may therefore sit inside a
block, which is why the view carries ``cache_seqstarts`` and not only lengths.

How many blocks can a stream hold at once? While a chunk is in flight it spans
``[seqlen - W, seqlen + chunk_size)``, ``W + chunk_size`` frames, starting at an
offset ``o`` inside its first block. Every commit is a multiple of
``chunk_size`` (only a stream's last chunk may be short) and every eviction a
multiple of ``block_size_frames``, so ``o`` is a multiple of
``g = gcd(chunk_size, block_size_frames)`` and at most ``bs - g``::

     max_logical_blocks = ceil((bs - g + W + chunk_size) / bs)

That is exact for aligned geometries (``bs == chunk``: ``num_left_chunks + 1``)
and needs no "chunk <= block" restriction, which the design we started from had
only because it allocated one block per chunk.

A sliding window of its own length: ``window_frames = W`` (with
``num_left_chunks == -1``) bounds history to the last ``W`` frames, any ``W >= 0``,
not only a multiple of ``chunk_size``. Then ``seqlen - W`` is no longer a multiple
of ``g`` without a prefill: the first visible position sits at ``r = (-W) mod g``
past a multiple of ``g``, so ``o <= bs - g + r`` and::

     max_logical_blocks = ceil((bs - g + r + W + chunk_size) / bs)     (r = 0 with prefill)

With eviction off (``num_left_chunks == -1``, no ``window_frames``) history is unlimited and each
stream is capped at ``blocks_per_stream = min(max_blocks_per_seq,
max_num_blocks // max_batch_size)`` blocks; ``max_stream_frames`` is that cap in
frames. The manager's ``at_capacity`` says when a stream's next chunk would
pass it, so a scheduler can finish the stream instead of failing mid-forward.

Sizing the pool
---------------
``max_num_blocks=None`` sizes the pool from a byte budget instead of a count: the
most blocks whose K/V (one scratch block included) fit in it. The budget is
``pool_budget_bytes`` when given (any device). Otherwise, on a CUDA device, it is
the device's free memory less a headroom of ``POOL_HEADROOM_FRACTION`` (10%) of its
total memory, left for activations, CUDA graphs and the allocator; on the CPU there
is no free-memory reading a pool may claim, so a budget is required. One INFO line
on the ``oasr.cache.config`` logger says which budget sized the pool and how many blocks
it gave; ``pool_sized_from`` and ``pool_budget`` keep the answer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from oasr.kv_formats import FORMAT_NAMES, KVFormat, auto_format, get_format

logger = logging.getLogger("oasr.cache.config")

POOL_HEADROOM_FRACTION = 0.10  # of the device's total memory, kept free when sizing the pool from free memory

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

_POSITIVE_FIELDS = (
    "num_layers",
    "n_kv_head",
    "head_dim",
    "hidden_dim",
    "kernel_size",
    "chunk_size",
    "block_size_frames",
    "max_num_blocks",
    "max_batch_size",
    "max_blocks_per_seq",
)


# Accepted values of ``kv_cache_dtype``: None / "model" (the model dtype), "auto", or a format of
# ``oasr.kv_formats`` (the table of formats, their bytes and the "auto" rule live there).
KV_CACHE_DTYPES = {None: None, **{name: name for name in FORMAT_NAMES if name != "model"}}


def _check_fp8_supported(device: torch.device) -> None:
    """Refuse fp8 K/V at construction where this torch cannot store or convert it."""
    if getattr(torch, "float8_e4m3fn", None) is None:
        raise ValueError(f"CacheConfig.kv_cache_dtype='fp8_e4m3': torch {torch.__version__} has no float8_e4m3fn")
    try:
        probe = torch.tensor([1.5, -3.0], device=device).to(torch.float8_e4m3fn).float()
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"CacheConfig.kv_cache_dtype='fp8_e4m3': torch {torch.__version__} cannot convert to "
            f"float8_e4m3fn on {device}: {exc}"
        ) from exc
    if probe.tolist() != [1.5, -3.0]:
        raise ValueError(f"CacheConfig.kv_cache_dtype='fp8_e4m3': float8 round trip is wrong on {device}")


def resolve_kv_format(owner: str, value, device: torch.device, head_dim: int, dtype: torch.dtype) -> str | None:
    """The format gate's configuration half: ``value`` (None, "model", "auto" or a format name) checked
    against the format's own rule (head_dim it can cut, model dtype) and the device's torch, resolved to
    None (the model dtype) or a format name. Refusals name what would serve instead."""
    if value == "auto":
        value = auto_format(device, head_dim, dtype)
    if value == "model":
        value = None
    if not isinstance(value, (str, type(None))) or value not in KV_CACHE_DTYPES:
        raise ValueError(
            f"{owner}.kv_cache_dtype must be None or 'model' (the model dtype), 'auto', or one of "
            f"{sorted(k for k in KV_CACHE_DTYPES if k)}, got {value!r}"
        )
    if value is None:
        return None
    try:
        get_format(value).check_geometry(head_dim, dtype)
    except ValueError as exc:
        raise ValueError(f"{owner}.kv_cache_dtype={value!r}: {exc}") from None
    if value == "fp8_e4m3":
        _check_fp8_supported(device)
    return value


def _as_dtype(value, owner: str = "CacheConfig") -> torch.dtype:
    """The model dtype a config names: a floating-point torch dtype of 2 bytes or more, or one of ``_DTYPES``.

    Integer, bool and complex dtypes are refused (``ValueError``), and so are the 1-byte floats: fp8 is a
    storage format for K/V pages (``kv_cache_dtype="fp8_e4m3"``), not a dtype the model computes in.
    """
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    if isinstance(value, torch.dtype):
        if value.is_floating_point and torch.empty((), dtype=value).element_size() >= 2:
            return value
        raise ValueError(
            f"{owner}.dtype: the model dtype must be a floating-point dtype such as torch.float32, torch.float16 "
            f"or torch.bfloat16, got {value}" + (" (fp8 pages: kv_cache_dtype='fp8_e4m3')" if value.is_floating_point
                                                 else "")
        )
    raise ValueError(f"{owner}.dtype: expected a torch dtype or one of {sorted(_DTYPES)}, got {value!r}")


@dataclass
class CacheConfig:
    """Geometry and capacity of a stream's caches.

    Fields are validated in ``__post_init__``; every message names the fields
    and the numbers involved. ``device`` and ``dtype`` accept strings
    (``"cpu"``, ``"cuda:0"``, ``"bfloat16"``) and are normalised to torch types.
    """

    num_layers: int = 12
    n_kv_head: int = 4
    head_dim: int = 64
    hidden_dim: int = 256
    kernel_size: int = 15
    chunk_size: int = 16
    num_left_chunks: int = -1
    block_size_frames: int = 16
    max_num_blocks: int | None = 1024
    max_batch_size: int = 32
    max_blocks_per_seq: int = 512
    prefill_kv_window: bool = False
    device: torch.device | str = "cpu"
    dtype: torch.dtype | str = torch.float32
    kv_cache_dtype: str | None = None
    window_frames: int | None = None
    pool_budget_bytes: int | None = None

    def __post_init__(self):
        self.pool_sized_from, self.pool_budget = "max_num_blocks", None
        size_pool = self.max_num_blocks is None
        if not size_pool and self.pool_budget_bytes is not None:
            raise ValueError(f"CacheConfig: give max_num_blocks={self.max_num_blocks} or pool_budget_bytes="
                             f"{self.pool_budget_bytes} (with max_num_blocks=None), not both")
        for name in _POSITIVE_FIELDS:
            if size_pool and name == "max_num_blocks":
                continue
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        if (
            isinstance(self.num_left_chunks, bool)
            or not isinstance(self.num_left_chunks, int)
            or self.num_left_chunks < -1
        ):
            raise ValueError(
                f"CacheConfig.num_left_chunks must be -1 (unlimited) or >= 0, got {self.num_left_chunks!r}"
            )
        if self.window_frames is not None:
            if isinstance(self.window_frames, bool) or not isinstance(self.window_frames, int) \
                    or self.window_frames < 0:
                raise ValueError(f"CacheConfig.window_frames must be None or an int >= 0, got {self.window_frames!r}")
            if self.num_left_chunks != -1:
                raise ValueError(
                    f"CacheConfig: give the window once: window_frames={self.window_frames} or "
                    f"num_left_chunks={self.num_left_chunks}, not both"
                )
        self.device = torch.device(self.device)
        self.dtype = _as_dtype(self.dtype)
        self.prefill_kv_window = bool(self.prefill_kv_window)
        self.kv_cache_dtype = resolve_kv_format(
            "CacheConfig", self.kv_cache_dtype, self.device, self.head_dim, self.dtype
        )
        if size_pool:
            self._size_pool()

        if self.prefill_kv_window and self.history_frames is None:
            raise ValueError(
                "CacheConfig.prefill_kv_window=True needs a window: set num_left_chunks >= 1 or window_frames >= 1 "
                "(got num_left_chunks=-1, unlimited history)"
            )
        if self.prefill_kv_window and self.history_frames == 0:
            raise ValueError(
                "CacheConfig.prefill_kv_window=True with num_left_chunks=0 prefills an empty window; "
                "use num_left_chunks >= 1 or prefill_kv_window=False"
            )
        if self.eviction:
            need = self.max_logical_blocks
            if self.max_blocks_per_seq < need:
                raise ValueError(
                    f"CacheConfig.max_blocks_per_seq={self.max_blocks_per_seq} is too narrow: a stream "
                    f"holds up to max_logical_blocks={need} blocks (num_left_chunks={self.num_left_chunks}, "
                    f"chunk_size={self.chunk_size}, block_size_frames={self.block_size_frames})"
                )
            if self.max_num_blocks < self.max_batch_size * need:
                raise ValueError(
                    f"CacheConfig.max_num_blocks={self.max_num_blocks} is too small: max_batch_size="
                    f"{self.max_batch_size} streams x max_logical_blocks={need} = "
                    f"{self.max_batch_size * need} blocks at their worst case"
                )
        else:
            one_chunk = math.ceil(self.chunk_size / self.block_size_frames)
            if self.blocks_per_stream < one_chunk:
                raise ValueError(
                    f"CacheConfig: a stream may hold blocks_per_stream={self.blocks_per_stream} blocks "
                    f"(min(max_blocks_per_seq={self.max_blocks_per_seq}, max_num_blocks={self.max_num_blocks}"
                    f" // max_batch_size={self.max_batch_size})) but one chunk of {self.chunk_size} frames "
                    f"needs {one_chunk}"
                )

    def _size_pool(self) -> None:
        """``max_num_blocks=None``: the most blocks a budget holds (see the module docstring)."""
        budget = self.pool_budget_bytes
        device = torch.device(self.device)
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
                raise ValueError(f"CacheConfig.pool_budget_bytes must be a positive int, got {budget!r}")
            source = f"pool_budget_bytes={budget}"
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - POOL_HEADROOM_FRACTION * total)
            source = (f"free memory of {device}: {free} bytes free less {POOL_HEADROOM_FRACTION:.0%} of "
                      f"{total} as headroom = {budget}")
        else:
            raise ValueError(f"CacheConfig.max_num_blocks=None on {device}: give pool_budget_bytes (only a CUDA "
                             f"device has a free-memory reading to size the pool from)")
        per_block = bytes_per_kv_block(self)
        blocks = budget // per_block - 1  # one scratch block comes first
        if blocks <= 0:
            raise ValueError(f"CacheConfig: a budget of {budget} bytes ({source}) holds no block: one block is "
                             f"{per_block} bytes and one scratch block comes first")
        self.max_num_blocks = int(blocks)
        self.pool_budget_bytes = None  # resolved: the config now reads as one sized by count
        self.pool_sized_from, self.pool_budget = source, budget
        logger.info("CacheConfig: max_num_blocks=%d (%d bytes a block) sized from %s", blocks, per_block, source)

    # ---- derived geometry -------------------------------------------------
    @property
    def kv_format(self) -> KVFormat:
        """The page format (``oasr.kv_formats``): the model dtype unless ``kv_cache_dtype`` names one."""
        return get_format(self.kv_cache_dtype)

    @property
    def kv_quantized(self) -> bool:
        """True when K/V pages are quantized: data plus a scale plane (``kv_scale_shape``)."""
        return self.kv_cache_dtype is not None

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """dtype of the K/V pool tensors: the format's data dtype (the model dtype when not quantized)."""
        return self.kv_format.data_dtype(self.dtype)

    @property
    def kv_data_dim(self) -> int:
        """Last dimension of the pool tensors: ``head_dim`` (``head_dim / 2`` for 4-bit codes)."""
        return self.kv_format.data_dim(self.head_dim)

    @property
    def kv_scale_shape(self) -> tuple[int, ...]:
        """Per-vector shape of ``k_scale``/``v_scale``: () for one scale per vector, else per group."""
        return self.kv_format.scale_shape(self.head_dim)

    @property
    def kv_scale_dtype(self) -> torch.dtype | None:
        """Dtype of the K/V pages' scale plane (None when ``kv_cache_dtype`` stores no scales)."""
        return self.kv_format.scale_dtype(self.dtype)

    @property
    def kv_last_dim(self) -> int:
        """Last dimension of the packed dense K|V layout: ``2 * head_dim``."""
        return 2 * self.head_dim

    @property
    def cnn_cache_frames(self) -> int:
        """Left-context frames the causal depthwise conv keeps: ``kernel_size - 1``."""
        return self.kernel_size - 1

    @property
    def eviction(self) -> bool:
        """True when history is bounded (``num_left_chunks >= 0`` or ``window_frames`` set)."""
        return self.num_left_chunks >= 0 or self.window_frames is not None

    @property
    def history_frames(self) -> int | None:
        """``W``: frames of history a chunk attends to, or None when unlimited."""
        if self.window_frames is not None:
            return self.window_frames
        return self.num_left_chunks * self.chunk_size if self.eviction else None

    @property
    def max_logical_blocks(self) -> int | None:
        """Most blocks one stream can hold at once with eviction on (see the module docstring)."""
        if not self.eviction:
            return None
        bs = self.block_size_frames
        g = math.gcd(self.chunk_size, bs)
        W = self.history_frames
        r = 0 if self.prefill_kv_window else (-W) % g
        return math.ceil((bs - g + r + W + self.chunk_size) / bs)

    @property
    def blocks_per_stream(self) -> int:
        """A stream's block ceiling: ``max_logical_blocks`` with eviction, else its share of the pool."""
        if self.eviction:
            return self.max_logical_blocks
        return min(self.max_blocks_per_seq, self.max_num_blocks // self.max_batch_size)

    @property
    def max_stream_frames(self) -> int | None:
        """Longest stream in frames with eviction off; None (no ceiling) with eviction on."""
        if self.eviction:
            return None
        return self.blocks_per_stream * self.block_size_frames

    @property
    def prefill_frames(self) -> int:
        """Frames a stream reports as cached at admission: ``W`` with prefill, else 0."""
        return self.history_frames if self.prefill_kv_window else 0

    @property
    def prefill_blocks(self) -> int:
        """Blocks allocated (and zeroed) at admission."""
        return math.ceil(self.prefill_frames / self.block_size_frames)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_kv_block(config: CacheConfig) -> int:
    """K and V of one block id, across every layer: the format's bytes per vector (data plus its scale
    plane, ``oasr.kv_formats``) per frame and KV head."""
    per_vector = config.kv_format.bytes_per_vector(config.head_dim, config.dtype)
    return 2 * config.num_layers * config.block_size_frames * config.n_kv_head * per_vector
