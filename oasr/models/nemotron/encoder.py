"""``NemotronEncoder``: NVIDIA's cache-aware FastConformer encoder, served chunk by chunk over paged caches.

It computes what transformers' ``NemotronAsrStreamingEncoder`` computes when fed chunk by chunk
with its own caches (``use_cache=True``, ``num_lookahead_tokens=a``), for a cohort of streams at
different positions in one forward. Parameter names are the checkpoint's (``subsampling.*``,
``layers.i.*``, under ``encoder.`` in a whole ``NemotronAsrStreamingForRNNT`` file).

Per stream, four kinds of state (``layer_specs``):

* K/V, paged, one window of ``W`` frames per layer, prefilled with zeros at admission
  (``cache_config``: ``prefill_kv_window``), so every stream of a cohort has the same span and
  the relative-position keys are computed once per layer for the cohort;
* the depthwise convolution's ``kernel - 1`` frames per layer (``CnnCacheManager``);
* the subsampling tails, one per strided Conv2d (declared ``StreamStateSpec``\\ s, slot state);
* the position, ``offsets`` (encoder frames produced so far), passed in by the caller.

A chunk::

    features (B, factor * C, mels) -> subsampling (first chunk: zero causal padding; later: the tails)
      -> * sqrt(hidden) -> blocks (each: append this chunk's K/V, paged attention with the table) -> (B, C, hidden)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from oasr.cache.config import CacheConfig
from oasr.cache.layer_specs import FullAttention, conv_state_spec
from oasr.models.conformer import DenseState, _row_values
from oasr.models.nemotron.block import FastConformerBlock
from oasr.models.nemotron.config import NemotronEncoderConfig
from oasr.models.nemotron.subsampling import CausalConv2dSubsampling
from oasr.models.twins import twin_module

_GEOMETRY = {"num_layers": "num_hidden_layers", "n_kv_head": "num_attention_heads", "head_dim": "head_dim",
             "hidden_dim": "hidden_size", "kernel_size": "conv_kernel_size"}


class NemotronEncoder(nn.Module):
    def __init__(self, config: NemotronEncoderConfig, lookahead: int | None = None):
        super().__init__()
        self.config = config
        self.lookahead = config.lookahead(lookahead)
        self.subsampling = CausalConv2dSubsampling(config)
        self.layers = nn.ModuleList(FastConformerBlock(config) for _ in range(config.num_hidden_layers))
        self.input_scale = math.sqrt(config.hidden_size) if config.scale_input else 1.0
        self.eval()

    # ---- declarations ----------------------------------------------------------------------------
    @property
    def chunk_size(self) -> int:
        """Encoder frames per chunk, ``lookahead + 1``."""
        return self.lookahead + 1

    @property
    def window(self) -> int:
        """History frames a chunk sees (``W``)."""
        return self.config.window_frames(self.lookahead)

    @property
    def chunk_input_frames(self) -> int:
        """Feature frames of a later chunk (the cohort's input width): ``factor * C``."""
        return self.config.chunk_input_frames(self.lookahead)

    @property
    def first_chunk_input_frames(self) -> int:
        """Feature frames of a stream's first chunk: ``1 + factor * a``."""
        return self.config.first_chunk_input_frames(self.lookahead)

    def output_frames(self, input_frames: int, first: bool) -> int:
        """Encoder frames a chunk of ``input_frames`` feature frames gives: ``ceil(n / factor)`` for a
        stream's first chunk (zero causal padding), ``n // factor`` for a later one (the tails)."""
        f = self.config.subsampling_factor
        return -(-input_frames // f) if first else input_frames // f

    @property
    def tick_io(self) -> tuple:
        """``(input frames, mel bins, output frames, hidden size)`` of one chunk step: the static buffers a graphed
        step (``oasr.engine.tick.FastModelTick``) reads and writes."""
        return self.chunk_input_frames, self.config.num_mel_bins, self.chunk_size, self.config.hidden_size

    @property
    def streaming_state_specs(self) -> tuple:
        """The declared fixed-extent states: the subsampling tails."""
        return self.subsampling.state_specs

    @property
    def streaming_kind(self) -> str:
        """``"paged"``: K/V in a paged window (``oasr.engine.streaming_backend``)."""
        return "paged"

    def cache_config(self, **overrides) -> CacheConfig:
        """``config.cache_config`` for this encoder's lookahead, in the weights' dtype unless overridden."""
        overrides.setdefault("dtype", self.layers[0].norm_out.weight.dtype)
        return self.config.cache_config(self.lookahead, **overrides)

    def layer_specs(self, cache_config: CacheConfig) -> list:
        """The whole per-stream cache as a declaration: a window per layer, the conv context, the tails."""
        L = self.config.left_chunks(self.lookahead)
        return [FullAttention(L)] * self.config.num_hidden_layers + [conv_state_spec(cache_config)] + list(
            self.streaming_state_specs)

    def check_cache_config(self, cache_config: CacheConfig) -> None:
        """``ValueError`` naming every field where ``cache_config`` is not this encoder's geometry."""
        wrong = [f"{name}: cache {getattr(cache_config, name)} vs model {getattr(self.config, mine)}"
                 for name, mine in _GEOMETRY.items() if getattr(cache_config, name) != getattr(self.config, mine)]
        if cache_config.chunk_size != self.chunk_size:
            wrong.append(f"chunk_size: cache {cache_config.chunk_size} vs lookahead + 1 = {self.chunk_size}")
        if cache_config.history_frames != self.window:
            wrong.append(f"history: cache {cache_config.history_frames} vs the window {self.window}")
        if self.window and not cache_config.prefill_kv_window:
            wrong.append("prefill_kv_window: the relative-position table needs every stream's span to be the window")
        if wrong:
            raise ValueError("CacheConfig does not match the Nemotron encoder: " + "; ".join(wrong))

    def new_states(self, batch: int = 1) -> dict:
        """Zeroed ``DenseState`` per declared state (running chunk forwards without a ``SlotStateCache``)."""
        ref = self.layers[0].norm_out.weight
        return {spec.name: DenseState(torch.zeros(spec.batch_shape(batch), dtype=ref.dtype, device=ref.device))
                for spec in self.streaming_state_specs}

    # ---- the chunk forward -------------------------------------------------------------------------
    @torch.no_grad()
    def forward_chunk_paged(self, xs: torch.Tensor, offsets, att_caches, conv_cache: torch.Tensor, states: Mapping,
                            input_lens=None, twin="reference"):
        """One chunk for each row of a cohort.

        ``xs (B, factor * C, num_mel_bins)``: a row's chunk from frame 0 (a first chunk carries
        ``1 + factor * a`` frames, later ones ``factor * C``; the last one of a stream may be shorter);
        ``offsets (B,)``: encoder frames each row produced before (0: its first chunk; every other
        offset a multiple of ``C``); ``att_caches``: one ``PagedKVCache`` per layer after
        ``prepare_chunk``; ``conv_cache (num_layers, B, kernel - 1, hidden)``; ``states``: name ->
        ``StateView`` / ``DenseState`` of the subsampling tails (scattered back in place);
        ``input_lens (B,)`` valid feature frames (``T_in`` by default, 0 for a padding row).

        Returns ``(hidden (B, C, hidden_size), chunk_lens (B,), new_conv_cache)``; frames past a
        row's ``chunk_lens`` are garbage. The caller commits ``chunk_lens`` and writes the conv cache back.
        """
        cfg = self.config
        twin_module(twin)
        if xs.dim() != 3 or xs.shape[2] != cfg.num_mel_bins or xs.shape[1] != self.chunk_input_frames:
            raise ValueError(f"forward_chunk_paged: xs must be (B, {self.chunk_input_frames}, "
                             f"num_mel_bins={cfg.num_mel_bins}), got {tuple(xs.shape)}")
        B, T_in, _ = xs.shape
        if len(att_caches) != cfg.num_hidden_layers or any(c.batch_size != B for c in att_caches):
            raise ValueError(f"forward_chunk_paged: need {cfg.num_hidden_layers} paged caches of {B} rows")
        expected = (cfg.num_hidden_layers, B, cfg.conv_kernel_size - 1, cfg.hidden_size)
        if tuple(conv_cache.shape) != expected:
            raise ValueError(f"forward_chunk_paged: conv_cache must be {expected}, got {tuple(conv_cache.shape)}")
        lens = (torch.full((B,), T_in, dtype=torch.long, device=xs.device) if input_lens is None
                else _row_values(input_lens, B, T_in, xs.device, "forward_chunk_paged: input lengths"))
        offsets = _row_values(offsets, B, None, xs.device, "forward_chunk_paged: offsets")
        if xs.device.type == "cpu" and any(o % self.chunk_size for o in offsets.tolist()):
            raise ValueError(f"forward_chunk_paged: offsets must be multiples of C={self.chunk_size}, "
                             f"got {offsets.tolist()}")
        tails = [states[spec.name].gather() for spec in self.streaming_state_specs]
        hidden, chunk_lens, new_conv, new_tails = self.paged_chunk_core(xs, offsets, lens, att_caches, conv_cache,
                                                                         tails, twin)
        for spec, tail in zip(self.streaming_state_specs, new_tails, strict=True):
            states[spec.name].scatter(tail)
        return hidden, chunk_lens, new_conv

    @torch.no_grad()
    def paged_chunk_core(self, xs, offsets, input_lens, att_caches, conv_cache, tails, twin="reference"):
        """The body of ``forward_chunk_paged``, device tensors in and out, nothing read back (capturable).

        Returns ``(hidden, chunk_lens, new_conv_cache, new_tails)``; writes only the chunk's K/V."""
        ops = twin_module(twin)
        first = offsets == 0
        x, chunk_lens, new_tails = self.subsampling(xs, tails, input_lens, first)
        x = x * self.input_scale
        lens32 = chunk_lens.to(torch.int32)
        new_conv = []
        for i, layer in enumerate(self.layers):
            cache = att_caches[i]

            def attend(h, cache=cache, attn=layer.self_attn):
                return attn.attend(h, cache, lens32, offsets, self.window, ops)

            x, conv = layer(x, attend, conv_cache[i], chunk_lens)
            new_conv.append(conv)
        return x, chunk_lens, torch.stack(new_conv), new_tails
