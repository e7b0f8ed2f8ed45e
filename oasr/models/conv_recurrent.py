"""A small encoder whose whole streaming cache is fixed-extent: causal convs and a gated recurrence.

It is the slot and stateful runtimes' model (``oasr.engine.streaming_backend``), as
the Conformer is the paged runtime's. Seeded random weights, nothing downloaded.
Per layer::

    x -> LayerNorm -> causal depthwise conv (kernel_size; keeps kernel_size - 1 frames)
      -> gate a_t = sigmoid(W_a c_t), candidate u_t = tanh(W_u c_t)
      -> h_t = a_t * h_{t-1} + (1 - a_t) * u_t          (keeps one row h per layer)
      -> x + W_o h_t

then a CTC head. Every frame of a stream depends on its past only through the two
rows per layer, so the cache of a stream is two fixed-extent tensors, declared in
``slot_state_specs`` (list order = the list API's order, zero-initialised)::

    "conv"  (num_layers, kernel_size - 1, hidden_dim)   slot axis 1
    "rnn"   (num_layers, hidden_dim)                   slot axis 1

The list API (what a stateful runtime threads per request, and what the slot
runtime feeds from its slot cache)::

    states = encoder.get_streaming_init_states(batch)           # [conv (L, B, K-1, H), rnn (L, B, H)]
    log_probs, out_lens, new_states = encoder.streaming_forward(xs, input_lens, states)

``xs (B, T, input_dim)`` with ``T <= streaming_chunk_frames``; row ``b``'s frames past
``input_lens[b]`` leave its state untouched (a padding row, ``input_lens = 0``, comes
out as it went in). ``streaming_forward`` reads no device value on the host and makes
no shape from values: it is what a CUDA graph captures (checked on the CPU by
``oasr.fast.capture_check``). ``forward_offline`` runs whole utterances from zero
states; streaming in chunks reproduces it.

``streaming_kind`` is the config's declaration: ``"slot"`` (default), ``"stateful"``
(the list API only, no slot cache, nothing captured) or ``"none"`` (no chunk-wise
path: a streaming engine refuses it at construction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from oasr import layers
from oasr.cache.state_spec import StreamStateSpec
from oasr.models.subsampling import last_valid_frames

STREAMING_KINDS = ("slot", "stateful", "none")


@dataclass
class ConvRecurrentConfig:
    input_dim: int = 20
    hidden_dim: int = 32
    num_layers: int = 2
    kernel_size: int = 4
    vocab_size: int = 32
    chunk_frames: int = 8  # input frames per streaming chunk (no subsampling)
    streaming_kind: str = "slot"
    seed: int = 0

    def __post_init__(self):
        for name in ("input_dim", "hidden_dim", "num_layers", "kernel_size", "vocab_size", "chunk_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ConvRecurrentConfig.{name} must be a positive int, got {value!r}")
        if self.kernel_size < 2:
            raise ValueError(f"ConvRecurrentConfig.kernel_size must be >= 2, got {self.kernel_size}")
        if self.streaming_kind not in STREAMING_KINDS:
            raise ValueError(f"ConvRecurrentConfig.streaming_kind must be one of {STREAMING_KINDS}, "
                             f"got {self.streaming_kind!r}")


class _Layer(nn.Module):
    def __init__(self, hidden: int, kernel: int):
        super().__init__()
        self.norm = layers.LayerNorm(hidden)
        self.depthwise = layers.DepthwiseConv1d(hidden, kernel)
        self.gate = layers.Linear(hidden, hidden)
        self.cand = layers.Linear(hidden, hidden)
        self.out = layers.Linear(hidden, hidden)


class ConvRecurrentEncoder(nn.Module):
    """See the module docstring."""

    subsampling_rate = 1
    streaming_pad_value = 0.0

    def __init__(self, config: ConvRecurrentConfig | None = None):
        super().__init__()
        self.config = config = config or ConvRecurrentConfig()
        self.proj = layers.Linear(config.input_dim, config.hidden_dim)
        self.layers = nn.ModuleList(_Layer(config.hidden_dim, config.kernel_size) for _ in range(config.num_layers))
        self.ctc = layers.Linear(config.hidden_dim, config.vocab_size)
        g = torch.Generator().manual_seed(config.seed)
        with torch.no_grad():
            for p in self.parameters():
                fan_in = p[0].numel() if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5 if p.dim() > 1
                        else 0.05 * torch.randn(p.shape, generator=g))
        self.eval()

    # ---- declarations ------------------------------------------------------------------------
    @property
    def streaming_kind(self) -> str:
        """The runtime that streams this encoder (from the config)."""
        return self.config.streaming_kind

    @property
    def streaming_chunk_frames(self) -> int:
        """Input frames of one streaming chunk."""
        return self.config.chunk_frames

    @property
    def slot_state_specs(self) -> tuple:
        """The per-stream states: each layer's last ``kernel_size - 1`` conv inputs and its recurrent state."""
        c = self.config
        return (
            StreamStateSpec("conv", (c.num_layers, c.kernel_size - 1, c.hidden_dim), slot_axis=1),
            StreamStateSpec("rnn", (c.num_layers, c.hidden_dim), slot_axis=1),
        )

    def get_streaming_init_states(self, batch: int = 1) -> list:
        """Zero states for ``batch`` streams, in the model's dtype and device."""
        ref = self.ctc.weight
        return [torch.zeros(s.batch_shape(batch), dtype=ref.dtype, device=ref.device) for s in self.slot_state_specs]

    # ---- forwards --------------------------------------------------------------------------------
    def _run(self, xs: torch.Tensor, lens: torch.Tensor, conv: torch.Tensor, rnn: torch.Tensor):
        B, T, _ = xs.shape
        valid = torch.arange(T, device=xs.device)[None, :] < lens[:, None]  # (B, T)
        x = self.proj(xs)
        new_conv, new_rnn = [], []
        for i, layer in enumerate(self.layers):
            extended = torch.cat([conv[i], layer.norm(x)], dim=1)  # (B, K-1+T, H)
            c = layer.depthwise(extended.transpose(1, 2)).transpose(1, 2)
            new_conv.append(last_valid_frames(extended, lens, self.config.kernel_size - 1))
            a, u = torch.sigmoid(layer.gate(c)), torch.tanh(layer.cand(c))
            h = rnn[i]
            hs = []
            for t in range(T):
                h = torch.where(valid[:, t, None], a[:, t] * h + (1 - a[:, t]) * u[:, t], h)
                hs.append(h)
            new_rnn.append(h)
            x = x + layer.out(torch.stack(hs, 1)) if T else x
        return F.log_softmax(self.ctc(x), dim=-1), torch.stack(new_conv), torch.stack(new_rnn)

    @torch.no_grad()
    def streaming_forward(self, xs: torch.Tensor, input_lens: torch.Tensor, states: list):
        """One chunk of a batch: ``(log_probs (B, T, vocab), out_lens (B,), [conv, rnn])``; see the module."""
        log_probs, conv, rnn = self._run(xs, input_lens, states[0], states[1])
        return log_probs, input_lens, [conv, rnn]

    @torch.no_grad()
    def forward_offline(self, xs: torch.Tensor, xs_lens=None):
        """Whole utterances ``(B, T, input_dim)`` from zero states -> ``(log_probs, lens)``."""
        B, T, _ = xs.shape
        lens = torch.full((B,), T, dtype=torch.long) if xs_lens is None else torch.as_tensor(xs_lens).long()
        conv, rnn = self.get_streaming_init_states(B)
        log_probs, _, _ = self._run(xs, lens.to(xs.device), conv, rnn)
        return log_probs, lens
