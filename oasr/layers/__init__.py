"""The layer waist: what every model in ``oasr/models/`` is built from.

Models never construct ``torch.nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d``, ``nn.LayerNorm``,
``nn.Embedding`` or ``nn.LSTM`` themselves; they take the classes here. Each class is a
checkpoint-compatible subclass of its torch counterpart (same parameter names, same
``state_dict``, same numerics), so a checkpoint written before the waist loads unchanged, and a
later change that applies to every architecture (a quantized GEMM, a fused epilogue, a
capture-safe convolution) is made here once instead of in each model.

``tests/test_layer_waist.py`` enforces it: it builds every registered architecture at a tiny size
and fails on any module whose type is a bare torch layer from the list above, and fails again when a
registered architecture has no tiny configuration in the test.

| kind | classes |
|---|---|
| projections | :class:`Linear` |
| normalisation | :class:`LayerNorm` |
| convolution | :class:`Conv1d`, :class:`DepthwiseConv1d`, :class:`Conv2d` |
| embeddings | :class:`Embedding` |
| recurrence | :class:`LSTM` |
| activation | :func:`silu` |
"""

from oasr.layers.activation import silu
from oasr.layers.conv import Conv1d, Conv2d, DepthwiseConv1d
from oasr.layers.embedding import Embedding
from oasr.layers.linear import Linear
from oasr.layers.norm import LayerNorm
from oasr.layers.recurrent import LSTM

#: The torch classes a model must not construct directly (the waist's conformance test reads this).
BARE_TORCH_LAYERS = ("Linear", "Conv1d", "Conv2d", "LayerNorm", "Embedding", "LSTM", "GRU", "RNN", "RMSNorm",
                     "GroupNorm", "BatchNorm1d", "BatchNorm2d", "AvgPool1d", "MultiheadAttention")

__all__ = ["BARE_TORCH_LAYERS", "Conv1d", "Conv2d", "DepthwiseConv1d", "Embedding", "LSTM", "LayerNorm", "Linear",
           "silu"]
