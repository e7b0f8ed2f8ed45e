"""Models served by the caches: a small streaming Conformer with seeded weights (nothing downloaded)."""

from oasr.models.conformer import ConformerConfig, DenseState, StreamingConformer, chunk_attention_mask
from oasr.models.subsampling import CausalSubsampling4
from oasr.models.twins import available_twins, twin_module, twin_ready

__all__ = [
    "CausalSubsampling4",
    "ConformerConfig",
    "DenseState",
    "StreamingConformer",
    "available_twins",
    "chunk_attention_mask",
    "twin_module",
    "twin_ready",
]
