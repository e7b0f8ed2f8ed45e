"""Layer specs: what each layer keeps per stream, declared once, composed over one pool.

A streaming cache is a declaration. Each attention layer says how much history it
reads; each fixed-extent state (a convolution's left context, a recurrent row, a
subsampling tail) says its shape. Nothing is allocated until a composition is
built from the list (``LayeredCache`` in either twin), and the memory of the
whole composition is known before that (``CacheLayout.footprint``).

Kinds of spec::

    FullAttention(left_chunks=-1)   every frame (-1), or the last left_chunks chunks (chunk-aligned window)
    SlidingWindow(window_frames)    the last window_frames frames, any number >= 0
    FixedState = StreamStateSpec    a fixed-extent row per stream (conv / recurrent / tail state)

The attention specs, in order, are the model's attention layers ``0 .. L-1``; the
fixed states are found by name.

How a composition lays out K/V
------------------------------
Layers with the same window are one *group*. Every block id of the shared pool
holds ``u`` layers, ``u = gcd(group sizes)``; a group of ``G`` layers is split into
``G / u`` *bands* of ``u`` layers, and each band is one ``AttentionCacheManager``
over the shared pool whose config carries the band's window. A band evicts by its
own window; its blocks go back to the one free list the other bands draw from::

    attention layer    0       1       2       3       4       5
    spec               local   wide    local   wide    local   wide      local: 8 frames, wide: 32
    groups             {0, 2, 4} -> 8 frames          {1, 3, 5} -> 32 frames
    block unit         u = gcd(3, 3) = 3 layers per block id
    bands              band 0 = layers [0, 2, 4]      band 1 = layers [1, 3, 5]
    one pool           | b0 | b1 | b2 | b3 | ... | scratch |   every band allocates and frees here

With every layer alike (the uniform ``CacheConfig``) there is one group, ``u = L``,
one band, and that band's config is the config itself: exactly the cache a plain
``AttentionCacheManager`` over a ``BlockPool(config)`` builds, block for block.

Memory per stream follows the windows: a band with window ``W`` holds at most
``max_logical_blocks(W)`` blocks of ``u`` layers (``oasr.cache.config`` draws that
arithmetic), so a local layer costs a fraction of a wide one.

With an unlimited band (``FullAttention(-1)``) the pool left after the bounded
bands' worst cases is shared equally between the unlimited bands: each stream of
such a band may hold ``(max_num_blocks - B * bounded_worst) // (B * unlimited_bands)``
blocks, so no admitted stream can run the pool dry.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from oasr.cache.config import CacheConfig
from oasr.cache.memory import Footprint, element_size
from oasr.cache.state_spec import StreamStateSpec

FixedState = StreamStateSpec  # the fixed-extent kind is the existing per-stream state declaration


@dataclass(frozen=True)
class FullAttention:
    """Attention over all history (``left_chunks=-1``) or the last ``left_chunks`` chunks."""

    left_chunks: int = -1

    def __post_init__(self):
        if isinstance(self.left_chunks, bool) or not isinstance(self.left_chunks, int) or self.left_chunks < -1:
            raise ValueError(f"FullAttention.left_chunks must be -1 (unlimited) or >= 0, got {self.left_chunks!r}")

    def history_frames(self, chunk_size: int) -> int | None:
        """Frames of history attended to (None: unlimited)."""
        return None if self.left_chunks < 0 else self.left_chunks * chunk_size


@dataclass(frozen=True)
class SlidingWindow:
    """Attention over the last ``window_frames`` frames of history (any count, not only whole chunks)."""

    window_frames: int

    def __post_init__(self):
        if isinstance(self.window_frames, bool) or not isinstance(self.window_frames, int) or self.window_frames < 0:
            raise ValueError(f"SlidingWindow.window_frames must be an int >= 0, got {self.window_frames!r}")

    def history_frames(self, chunk_size: int) -> int | None:
        """Frames of history attended to: ``window_frames``, whatever the chunk size."""
        return self.window_frames


ATTENTION_SPECS = (FullAttention, SlidingWindow)


def attention_spec_of(config: CacheConfig):
    """The spec every layer of a uniform ``config`` has."""
    if config.window_frames is not None:
        return SlidingWindow(config.window_frames)
    return FullAttention(config.num_left_chunks)


def conv_state_spec(config: CacheConfig) -> StreamStateSpec:
    """The causal conv's left context of every layer, in ``CnnCacheManager``'s layout."""
    return StreamStateSpec("cnn", (config.num_layers, config.cnn_cache_frames, config.hidden_dim), slot_axis=1)


def uniform_specs(config: CacheConfig, states: tuple = ()) -> list:
    """``config``'s own composition: ``num_layers`` alike attention specs, then ``states``."""
    return [attention_spec_of(config)] * config.num_layers + list(states)


def _band_config(config: CacheConfig, window: int | None, unit: int, max_blocks_per_seq: int) -> CacheConfig:
    """One band's config: ``unit`` layers, its window (chunk-aligned windows as ``num_left_chunks``)."""
    if window is None:
        left, frames = -1, None
    elif window % config.chunk_size == 0:
        left, frames = window // config.chunk_size, None
    else:
        left, frames = -1, window
    return dataclasses.replace(config, num_layers=unit, num_left_chunks=left, window_frames=frames,
                               max_blocks_per_seq=max_blocks_per_seq)


@dataclass(frozen=True)
class Band:
    """``layers`` (model attention layer indices) share one table; ``config`` carries their window."""

    layers: tuple
    window: int | None  # history frames; None = unlimited
    config: CacheConfig


class CacheLayout:
    """The arithmetic of a composition, allocating nothing.

    ``CacheLayout(config, specs)``: ``config`` gives the geometry shared by every layer
    (heads, head_dim, chunk and block size, dtype, batch, ``max_num_blocks`` of the
    shared pool, in blocks of ``unit`` layers); ``specs`` one attention spec per layer
    of ``config.num_layers`` plus any fixed states (None: ``uniform_specs(config)``).
    A config whose pool was sized from a budget (``max_num_blocks=None``) is re-sized
    here in blocks of ``unit`` layers, so the composition spends the same budget.

    Errors (``ValueError``): a spec of an unknown kind; not ``num_layers`` attention
    specs; two fixed states with one name; a pool smaller than ``max_batch_size``
    streams at every bounded band's worst case (or with no room left for the
    unlimited bands' first chunk).
    """

    def __init__(self, config: CacheConfig, specs=None):
        specs = uniform_specs(config) if specs is None else list(specs)
        attention, states = [], []
        for spec in specs:
            if isinstance(spec, ATTENTION_SPECS):
                attention.append(spec)
            elif isinstance(spec, StreamStateSpec):
                states.append(spec)
            else:
                raise ValueError(f"layer spec: expected FullAttention, SlidingWindow or FixedState, got {spec!r}")
        if len(attention) != config.num_layers:
            raise ValueError(f"layer specs: {len(attention)} attention specs for num_layers={config.num_layers}")
        names = [s.name for s in states]
        if len(set(names)) != len(names):
            raise ValueError(f"layer specs: fixed state names repeat: {names}")
        self.config = config
        self.attention_specs = tuple(attention)
        self.state_specs = tuple(states)
        self.windows = tuple(s.history_frames(config.chunk_size) for s in attention)

        if config.prefill_kv_window:
            self._check_prefill(config)
        groups: dict = {}
        for layer, window in enumerate(self.windows):
            groups.setdefault(window, []).append(layer)
        self.unit = math.gcd(*(len(g) for g in groups.values()))
        budget = getattr(config, "pool_budget", None)
        if budget is not None and self.unit != config.num_layers:  # a budget-sized pool, re-sized in our blocks
            sized_from = config.pool_sized_from
            config = dataclasses.replace(config, max_num_blocks=budget // self.bytes_per_block - 1)
            config.pool_sized_from, config.pool_budget = sized_from, budget
            self.config = config
        B, N = config.max_batch_size, config.max_num_blocks
        bands = []
        for window, layers in groups.items():
            for i in range(0, len(layers), self.unit):
                bands.append((tuple(layers[i : i + self.unit]), window))
        bounded = [(layers, w) for layers, w in bands if w is not None]
        unlimited = [(layers, w) for layers, w in bands if w is None]
        built = {}
        worst = 0
        for layers, w in bounded:
            cfg = self._band(config, layers, w, config.max_blocks_per_seq)
            built[layers] = cfg
            worst += cfg.max_logical_blocks
        if B * worst > N:
            raise ValueError(
                f"CacheLayout: max_num_blocks={N} is too small: max_batch_size={B} streams x {worst} blocks "
                f"(the bounded bands' worst case) = {B * worst}"
            )
        if unlimited:
            share = (N - B * worst) // (B * len(unlimited))
            cap = min(config.max_blocks_per_seq, share)
            one_chunk = math.ceil(config.chunk_size / config.block_size_frames)
            if cap < one_chunk:
                raise ValueError(
                    f"CacheLayout: the {len(unlimited)} unlimited band(s) get {cap} blocks per stream after the "
                    f"bounded bands' worst case; one chunk needs {one_chunk} (raise max_num_blocks)"
                )
            for layers, _ in unlimited:
                built[layers] = self._band(config, layers, None, cap)
        if len(bands) == 1 and bands[0][1] == config.history_frames:  # uniform: the band is the config itself
            built = {bands[0][0]: config}
        self.bands = tuple(Band(layers, w, built[layers]) for layers, w in bands)
        self.band_of_layer = {}
        for b, band in enumerate(self.bands):
            for j, layer in enumerate(band.layers):
                self.band_of_layer[layer] = (b, j)

    def _check_prefill(self, config: CacheConfig) -> None:
        """``prefill_kv_window=True`` prefills every layer's window: refuse, naming the layers and the specs
        the caller wrote, a layer whose spec has no window (unlimited) or an empty one."""
        bad = [f"layer {layer} is {spec!r} ({'unlimited history' if window is None else 'an empty window'})"
               for layer, (spec, window) in enumerate(zip(self.attention_specs, self.windows, strict=True))
               if not window]
        if bad:
            raise ValueError(
                f"CacheLayout: CacheConfig.prefill_kv_window=True prefills every attention layer's window, but "
                f"{'; '.join(bad)}: give every layer a window of at least one frame (FullAttention(left_chunks "
                f">= 1) or SlidingWindow(window_frames >= 1)) or set prefill_kv_window=False"
            )

    def _band(self, config: CacheConfig, layers: tuple, window: int | None, max_blocks_per_seq: int) -> CacheConfig:
        """``_band_config``, a refusal prefixed with the band's layers and the specs the caller wrote (the
        band's config carries internal window values: a chunk-aligned window as num_left_chunks)."""
        try:
            return _band_config(config, window, self.unit, max_blocks_per_seq)
        except ValueError as exc:
            specs = sorted({repr(self.attention_specs[layer]) for layer in layers})
            raise ValueError(f"CacheLayout: layers {list(layers)} ({', '.join(specs)}): {exc}") from None

    # ---- arithmetic ---------------------------------------------------------------------
    @property
    def uniform(self) -> bool:
        """Whether every layer shares one band (one window)."""
        return len(self.bands) == 1

    @property
    def pool_config(self) -> CacheConfig:
        """The config the shared ``BlockPool`` is built from (``num_layers = unit``)."""
        return self.bands[0].config

    @property
    def bytes_per_block(self) -> int:
        """One block id: K and V of ``unit`` layers, each vector the page format's bytes (data and scale
        plane: ``KVFormat.bytes_per_vector``, the one bytes rule ``oasr.cache.memory`` uses too)."""
        cfg = self.config
        per_vector = cfg.kv_format.bytes_per_vector(cfg.head_dim, cfg.dtype)
        return 2 * self.unit * cfg.block_size_frames * cfg.n_kv_head * per_vector

    def blocks_per_stream(self) -> list[int]:
        """Per band, the most blocks one stream can hold at once."""
        return [band.config.blocks_per_stream for band in self.bands]

    def state_bytes_per_stream(self) -> int:
        """Bytes of one stream's fixed-extent states."""
        dtype = self.config.dtype
        return sum(math.prod(s.shape) * element_size(s.dtype or dtype) for s in self.state_specs)

    def bytes_per_stream(self) -> int:
        """A stream's worst case: its blocks in every band plus its fixed states."""
        return sum(self.blocks_per_stream()) * self.bytes_per_block + self.state_bytes_per_stream()

    def footprint(self, scratch_blocks: int = 1, pad_lanes: int = 0) -> Footprint:
        """Bytes by component of the composition in the fast twin's persistent layout (tables per band)."""
        rows = self.config.max_batch_size + pad_lanes
        tables = sum(rows * band.config.max_blocks_per_seq * 4 for band in self.bands)
        return Footprint(
            kv_pool=self.bytes_per_block * self.config.max_num_blocks,
            scratch=self.bytes_per_block * scratch_blocks,
            block_tables=tables,
            seq_meta=len(self.bands) * 2 * rows * 4,
            conv_cache=rows * self.state_bytes_per_stream(),
        )

    def max_num_blocks_for_budget(self, budget_bytes: int, scratch_blocks: int = 1) -> int:
        """Most blocks (of ``unit`` layers) whose pool, scratch included, fits in ``budget_bytes``."""
        blocks = budget_bytes // self.bytes_per_block - scratch_blocks
        if blocks <= 0:
            raise ValueError(
                f"a budget of {budget_bytes} bytes holds no block: one block is {self.bytes_per_block} bytes "
                f"and {scratch_blocks} scratch block(s) come first"
            )
        return int(blocks)

    def describe(self) -> str:
        """A readable summary: the block unit and each band's layers, window and blocks per stream."""
        lines = [f"block unit: {self.unit} layer(s) per block id, {self.bytes_per_block} bytes"]
        for b, band in enumerate(self.bands):
            window = "unlimited" if band.window is None else f"{band.window} frames"
            lines.append(f"band {b}: layers {list(band.layers)}, window {window}, "
                         f"<= {band.config.blocks_per_stream} blocks per stream")
        return "\n".join(lines)


def layout_for_budget(config: CacheConfig, specs, budget_bytes: int, scratch_blocks: int = 1) -> CacheLayout:
    """The composition of ``specs`` with its pool sized to ``budget_bytes`` (``max_num_blocks`` replaced)."""
    probe = CacheLayout(dataclasses.replace(config, max_num_blocks=1 << 30), specs)
    blocks = probe.max_num_blocks_for_budget(budget_bytes, scratch_blocks)
    return CacheLayout(dataclasses.replace(config, max_num_blocks=blocks), specs)
