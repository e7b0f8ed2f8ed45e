"""Embeddings: :class:`Embedding`, a token id to its row of a table."""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    """A lookup table ``(num_embeddings, embedding_dim)``: ``torch.nn.Embedding``'s parameters and numerics."""
