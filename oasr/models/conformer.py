"""A small streaming Conformer with seeded random weights, and its three forwards.

Nothing is downloaded: ``StreamingConformer(ConformerConfig(seed=...))`` builds
the same weights on every machine. The point of the model is not accuracy but
an exact oracle for the caches: streaming it chunk by chunk through either twin
must reproduce the offline chunk-masked forward (fp32, max abs diff <= 1e-5).

Geometry (encoder frames are after the 4x subsampling)::

    features  |<------- 4 * chunk_size ------->|<------- 4 * chunk_size ------->|<- n ->|
    encoder   |<-- chunk 0: chunk_size -->|<-- chunk 1 -->| ...                |n // 4 |   short last chunk
    attention  a frame of chunk c sees chunks [c - num_left_chunks, c]  (all of [0, c] when -1)

Three forwards compute the same frames:

* ``forward_offline``: the whole utterance with the chunk mask above, causal convs;
* ``forward_chunk``: one stream, one chunk, dense caches (WeNet's concatenation);
* ``forward_chunk_paged``: a cohort of streams at different offsets, K/V through
  ``PagedKVCache`` views, ``append_kv`` / ``paged_attention`` from the chosen twin.

Positions are absolute encoder frame indices in the stream: rotary embeddings
are applied before K is cached, so eviction never renumbers anything.

With ``prefill_window`` (``CacheConfig.prefill_kv_window``) a stream starts with
``W = num_left_chunks * chunk_size`` cached frames whose K and V are zero; the
offline forward reproduces it by putting ``W`` zero keys before frame 0.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from oasr import layers
from oasr.cache.config import CacheConfig
from oasr.cache.layer_specs import ATTENTION_SPECS, CacheLayout, FullAttention, conv_state_spec
from oasr.models.layers import ConformerBlock, masked_attention, rope_cos_sin, rope_inv_freq
from oasr.models.subsampling import CausalSubsampling4, last_valid_frames
from oasr.models.twins import twin_module


@dataclass
class ConformerConfig:
    """Model geometry. ``cache_config()`` builds the matching ``CacheConfig``."""

    input_dim: int = 20
    hidden_dim: int = 32
    num_layers: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 16
    ffn_dim: int = 64
    kernel_size: int = 5
    vocab_size: int = 32
    chunk_size: int = 4
    num_left_chunks: int = -1
    subsample_channels: int = 32
    subsample_kernels: tuple = (5, 3)
    rope_base: float = 10000.0
    seed: int = 0
    attention_specs: tuple | None = None  # per layer FullAttention / SlidingWindow; None: num_left_chunks for all

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("num_left_chunks", "rope_base", "seed", "subsample_kernels", "attention_specs"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ConformerConfig.{f.name} must be a positive int, got {value!r}")
        if self.num_left_chunks < -1:
            raise ValueError(f"ConformerConfig.num_left_chunks must be -1 or >= 0, got {self.num_left_chunks}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"ConformerConfig: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"ConformerConfig: rotary positions need an even head_dim, got {self.head_dim}")
        if self.attention_specs is not None:
            self.attention_specs = tuple(self.attention_specs)
            if len(self.attention_specs) != self.num_layers or not all(
                isinstance(spec, ATTENTION_SPECS) for spec in self.attention_specs
            ):
                raise ValueError(f"ConformerConfig.attention_specs: one FullAttention / SlidingWindow per layer "
                                 f"(num_layers={self.num_layers}), got {self.attention_specs!r}")
        self.subsample_kernels = tuple(int(k) for k in self.subsample_kernels)
        if len(self.subsample_kernels) != 2 or min(self.subsample_kernels) < 2:
            raise ValueError(f"ConformerConfig.subsample_kernels: two kernels >= 2, got {self.subsample_kernels}")

    @property
    def subsampling_rate(self) -> int:
        """Input frames per encoder frame (4)."""
        return CausalSubsampling4.rate

    @property
    def chunk_input_frames(self) -> int:
        """Feature frames in one full chunk: ``4 * chunk_size``."""
        return self.subsampling_rate * self.chunk_size

    @property
    def layer_windows(self) -> tuple:
        """Per layer, the history frames its attention reads (None: unlimited)."""
        specs = self.attention_specs or (FullAttention(self.num_left_chunks),) * self.num_layers
        return tuple(spec.history_frames(self.chunk_size) for spec in specs)

    def cache_config(self, **overrides) -> CacheConfig:
        """A ``CacheConfig`` with this model's geometry; capacity fields (and anything else) overridable.

        Defaults: ``block_size_frames = chunk_size``, ``max_batch_size = 8``,
        ``max_blocks_per_seq = 64``, and ``max_num_blocks`` just large enough for
        ``max_batch_size`` streams at their ceiling. With ``attention_specs`` the config
        carries the widest layer window (the geometry every band shares; each band's own
        window comes from ``layer_specs``) and the pool covers every band's ceiling.
        """
        values = dict(
            num_layers=self.num_layers,
            n_kv_head=self.n_kv_head,
            head_dim=self.head_dim,
            hidden_dim=self.hidden_dim,
            kernel_size=self.kernel_size,
            chunk_size=self.chunk_size,
            num_left_chunks=self.num_left_chunks,
            block_size_frames=self.chunk_size,
            max_batch_size=8,
            max_blocks_per_seq=64,
            dtype=torch.float32,
        )
        if self.attention_specs is not None:  # the shared config carries the widest window (None: unlimited)
            windows = self.layer_windows
            widest = None if None in windows else max(windows)
            if widest is not None and widest % self.chunk_size:
                values.update(num_left_chunks=-1, window_frames=widest)
            else:
                values["num_left_chunks"] = -1 if widest is None else widest // self.chunk_size
        values.update(overrides)
        if "max_num_blocks" not in overrides and self.attention_specs is not None:
            probe = CacheLayout(CacheConfig(**{**values, "max_num_blocks": 1 << 30}), self.attention_specs)
            per_stream = sum(b.config.blocks_per_stream if b.window is not None else b.config.max_blocks_per_seq
                             for b in probe.bands)
            values["max_num_blocks"] = values["max_batch_size"] * per_stream
        elif "max_num_blocks" not in overrides:
            probe = CacheConfig(**{**values, "max_num_blocks": 1 << 30})
            per_stream = probe.max_logical_blocks if probe.eviction else probe.max_blocks_per_seq
            values["max_num_blocks"] = probe.max_batch_size * per_stream
        return CacheConfig(**values)


_GEOMETRY = ("num_layers", "n_kv_head", "head_dim", "hidden_dim", "kernel_size", "chunk_size")


class DenseState:
    """A plain tensor with the ``gather`` / ``scatter`` surface of a ``StateView``.

    ``StreamingConformer.new_states(batch)`` hands these out for running the chunk
    forwards without a ``SlotStateCache`` (one stream in a test, a notebook).
    """

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def gather(self) -> torch.Tensor:
        """The held state batch."""
        return self.tensor

    def scatter(self, new: torch.Tensor) -> None:
        """Replace the held state with a copy of ``new`` (``ValueError`` for another shape)."""
        if new.shape != self.tensor.shape:
            raise ValueError(f"DenseState: expected shape {tuple(self.tensor.shape)}, got {tuple(new.shape)}")
        self.tensor = new.clone()


def _init_weights(model: nn.Module, seed: int) -> None:
    """Seeded init on the CPU generator, so every machine builds bit-identical weights.

    Linear / conv weights ~ N(0, 1 / fan_in); biases and LayerNorm parameters get
    small random values so no parameter is trivially zero or one.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) / fan_in**0.5)
                module.bias.copy_(0.02 * torch.randn(module.bias.shape, generator=g))
            elif isinstance(module, nn.LayerNorm):
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=g))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
        model.ctc.weight.mul_(1.0)  # peakier posteriors: greedy decoding emits a varied token stream


def chunk_attention_mask(num_frames: int, chunk_size: int, num_left_chunks: int, lens: torch.Tensor,
                         prefill: int = 0) -> torch.Tensor:
    """``(B, T, prefill + T)`` bool: may query frame ``i`` see key position ``p``?

    Key positions run ``-prefill .. T - 1`` (the prefilled zeros first). Query ``i`` in
    chunk ``c = i // chunk_size`` sees keys in chunks ``[c - num_left_chunks, c]``
    (``[.., c]`` when ``num_left_chunks == -1``) that lie before the row's length.
    """
    device = lens.device
    q_chunk = torch.arange(num_frames, device=device) // chunk_size
    key_pos = torch.arange(-prefill, num_frames, device=device)
    k_chunk = torch.div(key_pos, chunk_size, rounding_mode="floor")
    allowed = k_chunk[None, :] <= q_chunk[:, None]
    if num_left_chunks >= 0:
        allowed &= k_chunk[None, :] >= q_chunk[:, None] - num_left_chunks
    key_valid = key_pos[None, :] < lens[:, None]
    return allowed[None] & key_valid[:, None, :]


def window_attention_mask(num_frames: int, chunk_size: int, window: int | None, lens: torch.Tensor,
                          prefill: int = 0) -> torch.Tensor:
    """``(B, T, prefill + T)`` bool for a layer reading ``window`` frames of history (None: all).

    Query ``i`` in chunk ``c`` sees key positions ``p`` with ``c * chunk_size - window <= p <
    (c + 1) * chunk_size`` that lie before the row's length: exactly what a streaming chunk
    attends to when its cache keeps the last ``window`` frames. ``window = n * chunk_size`` is
    ``chunk_attention_mask`` with ``num_left_chunks = n``.
    """
    device = lens.device
    q_start = torch.arange(num_frames, device=device) // chunk_size * chunk_size
    key_pos = torch.arange(-prefill, num_frames, device=device)
    allowed = key_pos[None, :] < q_start[:, None] + chunk_size
    if window is not None:
        allowed &= key_pos[None, :] >= q_start[:, None] - window
    key_valid = key_pos[None, :] < lens[:, None]
    return allowed[None] & key_valid[:, None, :]


def _row_values(values, B: int, high: int | None, device, what: str) -> torch.Tensor:
    """One int per row as a ``(B,)`` int64 tensor on ``device``, checked where the values are host data.

    A sequence of ints or a CPU tensor is validated on the host (``0 <= v``, and ``v <= high`` unless
    ``high`` is None) before one tensor is made from it. A tensor on an accelerator is trusted as is,
    shape-checked only: reading its values would synchronise with the device.
    """
    bound = f"[0, {high}]" if high is not None else ">= 0"
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        if tuple(values.shape) != (B,):
            raise ValueError(f"{what} must be ({B},) values {bound}, got shape {tuple(values.shape)}")
        return values.to(device=device, dtype=torch.long)
    host = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    if len(host) != B or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= v and (high is None or v <= high)
        for v in host
    ):
        raise ValueError(f"{what} must be ({B},) values {bound}, got {host}")
    return torch.tensor([int(v) for v in host], dtype=torch.long, device=device)


class StreamingConformer(nn.Module):
    def __init__(self, config: ConformerConfig | None = None):
        super().__init__()
        self.config = config = config or ConformerConfig()
        self.subsample = CausalSubsampling4(
            config.input_dim, config.subsample_channels, config.hidden_dim, config.subsample_kernels
        )
        self.layers = nn.ModuleList(
            ConformerBlock(config.hidden_dim, config.n_head, config.n_kv_head, config.head_dim, config.ffn_dim,
                           config.kernel_size)
            for _ in range(config.num_layers)
        )
        self.ctc = layers.Linear(config.hidden_dim, config.vocab_size)
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_base), persistent=False)
        _init_weights(self, config.seed)
        self.eval()

    # ---- declarations ----------------------------------------------------------------
    @property
    def streaming_state_specs(self) -> tuple:
        """Fixed-extent per-stream state besides K/V and the conv cache: the subsampling tails."""
        return self.subsample.state_specs

    @property
    def streaming_kind(self) -> str:
        """The streaming runtime this encoder needs: K/V that grows, paged (``oasr.engine.streaming_backend``)."""
        return "paged"

    def layer_specs(self, cache_config: CacheConfig) -> list:
        """The whole per-stream cache as a declaration for ``LayeredCache``: one attention spec per
        layer (``config.attention_specs``, else ``num_left_chunks`` for all), the conv left context
        of every layer (``"cnn"``), and the subsampling tails."""
        cfg = self.config
        attention = cfg.attention_specs or (FullAttention(cfg.num_left_chunks),) * cfg.num_layers
        return list(attention) + [conv_state_spec(cache_config)] + list(self.streaming_state_specs)

    def new_states(self, batch: int = 1) -> dict:
        """Zeroed ``DenseState`` per declared state, for running chunk forwards without a slot cache."""
        ref = self.ctc.weight
        return {
            spec.name: DenseState(torch.zeros(spec.batch_shape(batch), dtype=ref.dtype, device=ref.device))
            for spec in self.streaming_state_specs
        }

    def check_cache_config(self, cache_config: CacheConfig) -> None:
        """Raise ``ValueError`` if ``cache_config``'s geometry is not this model's."""
        wrong = [
            f"{name}: cache {getattr(cache_config, name)} vs model {getattr(self.config, name)}"
            for name in _GEOMETRY
            if getattr(cache_config, name) != getattr(self.config, name)
        ]
        if wrong:
            raise ValueError("CacheConfig does not match the model geometry: " + "; ".join(wrong))

    # ---- helpers -------------------------------------------------------------------------
    def _check_features(self, xs: torch.Tensor, where: str) -> None:
        if xs.dim() != 3 or xs.shape[2] != self.config.input_dim:
            raise ValueError(f"{where}: xs must be (B, T, input_dim={self.config.input_dim}), got {tuple(xs.shape)}")

    def _lens(self, lens, B: int, T: int, device) -> torch.Tensor:
        """``lens`` as a ``(B,)`` int64 tensor on ``device``; ``None`` is ``T`` for every row."""
        if lens is None:
            return torch.full((B,), T, dtype=torch.long, device=device)
        return _row_values(lens, B, T, device, "input lengths")

    def _cos_sin(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.inv_freq, self.ctc.weight.dtype)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.ctc(x), dim=-1)

    def _empty_output(self, B: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros((B, 0, self.config.vocab_size))

    # ---- 1. offline ------------------------------------------------------------------------
    @torch.no_grad()
    def forward_offline(self, xs: torch.Tensor, xs_lens=None, num_left_chunks: int | None = None,
                        prefill_window: bool = False, kv_transform=None):
        """Whole utterances ``xs (B, T_in, input_dim)`` -> ``(log_probs (B, T_in // 4, vocab), out_lens (B,))``.

        Chunk-masked attention (``num_left_chunks`` defaults to the model's), causal
        convolutions. ``prefill_window`` puts ``num_left_chunks * chunk_size`` zero keys
        and values before frame 0, as a prefilled paged window does. ``kv_transform``,
        if given, maps every layer's keys and values ``(B, T, n_kv_head, head_dim)``
        before attention: what a cache stores them as (e.g. an fp8 round trip).
        """
        hidden, lens = self.encode(xs, xs_lens, num_left_chunks=num_left_chunks, prefill_window=prefill_window,
                                   kv_transform=kv_transform)
        if hidden.shape[1] == 0:
            return self._empty_output(xs.shape[0], xs), lens
        return self._head(hidden), lens

    def encode(self, xs: torch.Tensor, xs_lens=None, chunk_size: int | None = None,
               num_left_chunks: int | None = None, prefill_window: bool = False, kv_transform=None):
        """The offline encoder without the CTC head, differentiable: ``(hidden (B, T, hidden_dim), lens (B,))``.

        ``forward_offline`` is this under ``no_grad`` followed by the head; training calls it directly.
        ``chunk_size`` (default the model's) and ``num_left_chunks`` (default the model's; -1: all
        left chunks; a ``chunk_size`` of at least ``T`` is full context) shape the attention mask,
        which is how one set of weights learns to serve several chunk sizes (dynamic chunk training).
        Frames past a row's length are zero.
        """
        cfg = self.config
        self._check_features(xs, "encode")
        B, T_in, _ = xs.shape
        C = cfg.chunk_size if chunk_size is None else chunk_size
        per_layer = num_left_chunks is None and chunk_size is None and cfg.attention_specs is not None
        if per_layer:  # each layer its own window (config.attention_specs) and, prefilled, its own zero keys
            windows = cfg.layer_windows
            if prefill_window and any(w is None or w < 1 for w in windows):
                raise ValueError(f"forward_offline: prefill_window needs every layer's window >= 1, got {windows}")
            prefills = [w if prefill_window else 0 for w in windows]
        else:
            L = cfg.num_left_chunks if num_left_chunks is None else num_left_chunks
            if prefill_window and L < 1:
                raise ValueError("forward_offline: prefill_window needs num_left_chunks >= 1")
            prefills = [L * C if prefill_window else 0] * cfg.num_layers
        lens_in = self._lens(xs_lens, B, T_in, xs.device)
        x, lens, _ = self.subsample(xs, self.subsample.zero_tails(B, xs), lens_in)
        T = x.shape[1]
        if T == 0:
            return x, lens
        valid = (torch.arange(T, device=xs.device)[None, :] < lens[:, None])[..., None].to(x.dtype)
        x = x * valid  # padded frames stay finite and never reach a valid frame
        cos, sin = self._cos_sin(torch.arange(T, device=xs.device).expand(B, T))
        if per_layer:
            masks = [window_attention_mask(T, C, w, lens, p) for w, p in zip(windows, prefills, strict=True)]
        else:
            masks = [chunk_attention_mask(T, C, L, lens, prefills[0])] * cfg.num_layers
        zero_context = x.new_zeros((B, cfg.kernel_size - 1, cfg.hidden_dim))
        for layer, prefill, allowed in zip(self.layers, prefills, masks, strict=True):
            zeros_kv = x.new_zeros((B, prefill, cfg.n_kv_head, cfg.head_dim))

            def attend(q, k, v, allowed=allowed, zeros_kv=zeros_kv):
                if kv_transform is not None:
                    k, v = kv_transform(k), kv_transform(v)
                return masked_attention(q, torch.cat([zeros_kv, k], 1), torch.cat([zeros_kv, v], 1), allowed)

            x, _ = layer(x, cos, sin, attend, zero_context)
            x = x * valid
        return x, lens

    # ---- 2. one stream, dense caches ---------------------------------------------------------
    @torch.no_grad()
    def forward_chunk(self, xs: torch.Tensor, offset: int, required_cache_size: int, att_cache: torch.Tensor,
                      cnn_cache: torch.Tensor, states: Mapping):
        """One chunk of one stream with dense caches (the WeNet-style concatenation).

        ``xs (1, T_in, input_dim)`` with ``T_in <= 4 * chunk_size`` (less only for a last chunk);
        ``offset``: encoder frames this stream has produced before; ``att_cache
        (num_layers, n_kv_head, T_cache, 2 * head_dim)``, K | V packed, K already rotated;
        ``cnn_cache (num_layers, 1, kernel_size - 1, hidden_dim)``; ``states``: name ->
        ``StateView`` / ``DenseState`` of the subsampling tails, updated in place.

        Returns ``(log_probs (1, T, vocab), new_att_cache, new_cnn_cache)``. ``new_att_cache``
        is ``cat(att_cache, this chunk's K|V)`` trimmed to its last ``required_cache_size``
        frames (kept whole when negative): feed it back as the next chunk's ``att_cache``.
        Its last ``T`` frames are what a dense ``AttentionCacheManager.commit`` takes.
        """
        cfg = self.config
        self._check_features(xs, "forward_chunk")
        if xs.shape[0] != 1:
            raise ValueError(f"forward_chunk: one stream at a time (batch 1), got batch {xs.shape[0]}")
        if xs.shape[1] > cfg.chunk_input_frames:
            raise ValueError(f"forward_chunk: at most 4 * chunk_size = {cfg.chunk_input_frames} frames, "
                             f"got {xs.shape[1]}")
        D = cfg.head_dim
        expected = (cfg.num_layers, cfg.n_kv_head, att_cache.shape[2], 2 * D)
        if att_cache.dim() != 4 or tuple(att_cache.shape) != expected:
            raise ValueError(f"forward_chunk: att_cache must be {expected}, got {tuple(att_cache.shape)}")
        tails = [states[spec.name].gather() for spec in self.streaming_state_specs]
        x, lens, new_tails = self.subsample(xs, tails, self._lens(None, 1, xs.shape[1], xs.device))
        T = x.shape[1]
        if T == 0:
            return self._empty_output(1, xs), att_cache, cnn_cache
        cos, sin = self._cos_sin(offset + torch.arange(T, device=xs.device)[None, :])
        new_kv, new_cnn = [], []
        for i, layer in enumerate(self.layers):
            cache_k = att_cache[i, :, :, :D].transpose(0, 1)[None]  # (1, T_cache, n_kv_head, D)
            cache_v = att_cache[i, :, :, D:].transpose(0, 1)[None]

            def attend(q, k, v, cache_k=cache_k, cache_v=cache_v):
                new_kv.append(torch.cat([k, v], dim=-1)[0].transpose(0, 1))  # (n_kv_head, T, 2D)
                return masked_attention(q, torch.cat([cache_k, k], 1), torch.cat([cache_v, v], 1), None)

            x, extended = layer(x, cos, sin, attend, cnn_cache[i])
            new_cnn.append(last_valid_frames(extended, lens, cfg.kernel_size - 1))
        new_att_cache = torch.cat([att_cache, torch.stack(new_kv)], dim=2)
        if required_cache_size >= 0:
            new_att_cache = new_att_cache[:, :, max(0, new_att_cache.shape[2] - required_cache_size):]
        for spec, tail in zip(self.streaming_state_specs, new_tails, strict=True):
            states[spec.name].scatter(tail)
        return self._head(x), new_att_cache, torch.stack(new_cnn)

    # ---- 3. a cohort, paged caches -------------------------------------------------------------
    @torch.no_grad()
    def forward_chunk_paged(self, xs: torch.Tensor, offsets, att_caches, cnn_cache: torch.Tensor,
                            states: Mapping, input_lens=None, twin="reference", with_hidden: bool = False):
        """One chunk for each row of a cohort, K/V through paged views.

        ``xs (B, T_in, input_dim)`` (rows padded with anything past their length);
        ``offsets (B,)``: each row's absolute encoder position (frames produced before);
        ``att_caches``: one ``PagedKVCache`` per layer over the same ``B`` rows, as
        ``AttentionCacheManager.get_paged_caches`` returns them after ``prepare_chunk``;
        ``cnn_cache (num_layers, B, kernel_size - 1, hidden_dim)``; ``states``: name ->
        ``StateView`` of the subsampling tails (gathered here, scattered back in place);
        ``input_lens (B,)``: valid feature frames per row (``T_in`` by default, 0 for a
        padding row); ``twin``: whose ``append_kv`` / ``paged_attention`` to run.

        Returns ``(log_probs (B, T_in // 4, vocab), chunk_lens (B,), new_cnn_cache)``, and with
        ``with_hidden`` a fourth item, the encoder output (the CTC head's input) ``(B, T_in // 4,
        hidden_dim)``: what an attention decoder rescoring the CTC n-best attends to. Row ``b``'s
        frames past ``chunk_lens[b] = input_lens[b] // 4`` are garbage that no valid frame reads.
        K/V is appended to the pool; the caller commits ``chunk_lens`` to the manager and writes
        ``new_cnn_cache`` back.
        """
        cfg = self.config
        twin_module(twin)
        self._check_features(xs, "forward_chunk_paged")
        B, T_in, _ = xs.shape
        if len(att_caches) != cfg.num_layers or any(c.batch_size != B for c in att_caches):
            raise ValueError(f"forward_chunk_paged: need {cfg.num_layers} paged caches of {B} rows")
        expected = (cfg.num_layers, B, cfg.kernel_size - 1, cfg.hidden_dim)
        if tuple(cnn_cache.shape) != expected:
            raise ValueError(f"forward_chunk_paged: cnn_cache must be {expected}, got {tuple(cnn_cache.shape)}")
        lens_in = self._lens(input_lens, B, T_in, xs.device)
        offsets = _row_values(offsets, B, None, xs.device, "forward_chunk_paged: offsets")
        tails = [states[spec.name].gather() for spec in self.streaming_state_specs]
        log_probs, chunk_lens, new_cnn, new_tails, *hidden = self.paged_chunk_core(
            xs, offsets, lens_in, att_caches, cnn_cache, tails, twin, with_hidden=with_hidden
        )
        if log_probs.shape[1] == 0:
            return log_probs, chunk_lens, cnn_cache, *hidden
        for spec, tail in zip(self.streaming_state_specs, new_tails, strict=True):
            states[spec.name].scatter(tail)
        return log_probs, chunk_lens, new_cnn, *hidden

    @torch.no_grad()
    def paged_chunk_core(self, xs: torch.Tensor, offsets: torch.Tensor, input_lens: torch.Tensor, att_caches,
                         cnn_cache: torch.Tensor, tails: list, twin="reference", num_splits: int | None = None,
                         with_hidden: bool = False):
        """The body of ``forward_chunk_paged``, device tensors in and out: what a CUDA graph captures.

        ``xs (B, T_in, input_dim)``; ``offsets``, ``input_lens``: ``(B,)`` int64 on ``xs``'s device,
        used as they are (nothing reads them back; the public forward validates host values first);
        ``att_caches``: one ``PagedKVCache`` per layer; ``cnn_cache (num_layers, B, kernel_size - 1,
        hidden_dim)``; ``tails``: the subsampling tails in ``streaming_state_specs`` order, already
        gathered. ``num_splits`` pins the fast twin's attention split count (None: the launcher's
        choice from the views' ``max_span``; only given for the fast twin).

        Returns ``(log_probs, chunk_lens, new_cnn_cache, new_tails)``, with ``with_hidden`` a fifth
        item ``hidden (B, T_in // 4, hidden_dim)`` (the CTC head's input, for a second pass), and writes
        nothing but the chunk's K/V into the pool. Nothing here synchronises with the host, reads host data or makes a
        shape from values: every shape follows from ``B`` and ``T_in`` (``CaptureSafetyChecker`` checks).
        """
        cfg = self.config
        ops = twin_module(twin)
        B, T_in, _ = xs.shape
        x, chunk_lens, new_tails = self.subsample(xs, tails, input_lens)
        T = x.shape[1]
        if T == 0:
            hidden = [x] if with_hidden else []
            return self._empty_output(B, xs), chunk_lens, cnn_cache, list(tails), *hidden
        cos, sin = self._cos_sin(offsets[:, None] + torch.arange(T, device=xs.device)[None, :])
        lens32 = chunk_lens.to(torch.int32)
        split_kwargs = {} if num_splits is None else {"num_splits": num_splits}
        new_cnn = []
        for i, layer in enumerate(self.layers):
            cache = att_caches[i]

            def attend(q, k, v, cache=cache):
                ops.append_kv(cache, k.contiguous(), v.contiguous(), lens32)
                out = ops.paged_attention(q.transpose(1, 2).contiguous(), cache, lens32,
                                          **split_kwargs)  # (B, n_head, T, D)
                return out.transpose(1, 2).reshape(B, T, -1)

            x, extended = layer(x, cos, sin, attend, cnn_cache[i])
            new_cnn.append(last_valid_frames(extended, chunk_lens, cfg.kernel_size - 1))
        hidden = [x] if with_hidden else []
        return self._head(x), chunk_lens, torch.stack(new_cnn), new_tails, *hidden
