"""``NemotronEncoderConfig``: the geometry of NVIDIA's cache-aware FastConformer encoder, read from a
Hugging Face ``config.json`` (``nemotron_asr_streaming`` or its ``nemotron_asr_streaming_encoder`` part).

Streaming geometry (encoder frames are after the ``subsampling_factor``-times subsampling)::

    lookahead a = num_lookahead_tokens      chunk C = a + 1 encoder frames
    left context  sliding_window - 1        window W = ((sliding_window - 1) // C) * C  (whole chunks)

    features   first chunk: 1 + factor * a frames     every later chunk: factor * C frames
    encoder    every chunk: C frames; a frame of chunk c sees chunks [c - W / C, c] (itself whole)

A chunk of ``C`` frames sees ``W`` frames of history and itself: exactly the oracle's chunked mask
(``left_context // C`` whole chunks back, the current chunk in full). The paged cache keeps that
window with ``CacheConfig(chunk_size=C, num_left_chunks=W // C, prefill_kv_window=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from oasr.cache.config import CacheConfig

_POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "conv_kernel_size",
             "subsampling_factor", "subsampling_conv_channels", "num_mel_bins", "subsampling_conv_kernel_size",
             "subsampling_conv_stride", "sliding_window", "max_position_embeddings")


@dataclass
class NemotronEncoderConfig:
    """The encoder fields of ``NemotronAsrStreamingEncoderConfig`` that change what is computed."""

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 8
    intermediate_size: int = 4096
    hidden_act: str = "silu"
    attention_bias: bool = True
    convolution_bias: bool = True
    conv_kernel_size: int = 9
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    num_mel_bins: int = 80
    subsampling_conv_kernel_size: int = 3
    subsampling_conv_stride: int = 2
    max_position_embeddings: int = 5000
    scale_input: bool = True
    sliding_window: int = 71
    default_num_lookahead_tokens: int = 13
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        for name in _POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"NemotronEncoderConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"NemotronEncoderConfig.hidden_act: only 'silu' is served, got {self.hidden_act!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"NemotronEncoderConfig: hidden_size={self.hidden_size} must be a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        stages = math.log2(self.subsampling_factor)
        if stages != int(stages) or stages < 1:
            raise ValueError(f"NemotronEncoderConfig.subsampling_factor must be a power of two >= 2, "
                             f"got {self.subsampling_factor}")
        if self.subsampling_conv_stride != 2:
            raise ValueError(f"NemotronEncoderConfig.subsampling_conv_stride: only 2 is served "
                             f"(factor = 2 ** stages), got {self.subsampling_conv_stride}")
        if self.subsampling_conv_kernel_size < self.subsampling_conv_stride:
            raise ValueError(f"NemotronEncoderConfig.subsampling_conv_kernel_size must be >= the stride, "
                             f"got {self.subsampling_conv_kernel_size}")
        if self.default_num_lookahead_tokens < 0:
            raise ValueError(f"NemotronEncoderConfig.default_num_lookahead_tokens must be >= 0, "
                             f"got {self.default_num_lookahead_tokens}")

    @classmethod
    def from_hf_dict(cls, config: dict) -> NemotronEncoderConfig:
        """From a ``config.json`` dict: the whole model's (``encoder_config`` inside) or the encoder's own.
        Unknown keys (dropouts, initialisers, the decoder's) are ignored; a missing key takes the default."""
        enc = config.get("encoder_config", config) if isinstance(config, dict) else None
        if not isinstance(enc, dict):
            raise ValueError(f"NemotronEncoderConfig.from_hf_dict: expected a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in enc.items() if k in known}
        if "layer_norm_eps" not in enc:
            values.pop("layer_norm_eps", None)
        return cls(**values)

    # ---- derived geometry --------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def subsampling_stages(self) -> int:
        """Strided convs in the subsampling stack: ``log2(subsampling_factor)``."""
        return int(math.log2(self.subsampling_factor))

    def freq_bins(self) -> list:
        """Frequency bins at the input of each subsampling stage, before its causal frequency padding,
        then the bins after the last stage (the linear projection reads ``channels * bins[-1]``)."""
        k, s = self.subsampling_conv_kernel_size, self.subsampling_conv_stride
        bins = [self.num_mel_bins]
        for _ in range(self.subsampling_stages):
            bins.append((bins[-1] + (k - 1) + (s - 1) - k) // s + 1)
        return bins

    def chunk_frames(self, lookahead: int | None = None) -> int:
        """``C = lookahead + 1`` encoder frames per chunk."""
        return self.lookahead(lookahead) + 1

    def lookahead(self, lookahead: int | None = None) -> int:
        """``lookahead``, checked, or the checkpoint's ``default_num_lookahead_tokens`` when None."""
        a = self.default_num_lookahead_tokens if lookahead is None else lookahead
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ValueError(f"num_lookahead_tokens must be an int >= 0, got {a!r}")
        return a

    def left_chunks(self, lookahead: int | None = None) -> int:
        """Whole chunks of history a chunk sees: ``(sliding_window - 1) // C``."""
        return (self.sliding_window - 1) // self.chunk_frames(lookahead)

    def window_frames(self, lookahead: int | None = None) -> int:
        """``W``: history frames a chunk sees (a multiple of ``C``, at most ``sliding_window - 1``)."""
        return self.left_chunks(lookahead) * self.chunk_frames(lookahead)

    def first_chunk_input_frames(self, lookahead: int | None = None) -> int:
        """Feature frames of a stream's first chunk: ``1 + factor * a`` (its causal padding is the rest)."""
        return 1 + self.subsampling_factor * self.lookahead(lookahead)

    def chunk_input_frames(self, lookahead: int | None = None) -> int:
        """Feature frames of every later chunk (and the width of a cohort's input): ``factor * C``."""
        return self.subsampling_factor * self.chunk_frames(lookahead)

    def cache_config(self, lookahead: int | None = None, **overrides) -> CacheConfig:
        """The ``CacheConfig`` serving chunks of ``lookahead + 1`` frames: the window prefilled with zeros
        at admission (masked out by the relative-position table until the stream has history of its own).

        Defaults: ``block_size_frames = C``, ``max_batch_size = 8`` and a pool of exactly
        ``max_batch_size`` streams' windows; any field overridable."""
        C, L = self.chunk_frames(lookahead), self.left_chunks(lookahead)
        values = dict(num_layers=self.num_hidden_layers, n_kv_head=self.num_attention_heads, head_dim=self.head_dim,
                      hidden_dim=self.hidden_size, kernel_size=self.conv_kernel_size, chunk_size=C,
                      num_left_chunks=L, block_size_frames=C, max_batch_size=8, max_blocks_per_seq=L + 2,
                      prefill_kv_window=L >= 1, dtype=torch.float32)
        values.update(overrides)
        if "max_num_blocks" not in overrides:
            probe = CacheConfig(**{**values, "max_num_blocks": 1 << 30})
            per_stream = probe.max_logical_blocks if probe.eviction else probe.max_blocks_per_seq
            values["max_num_blocks"] = probe.max_batch_size * per_stream
        return CacheConfig(**values)
