"""NVIDIA's cache-aware FastConformer (Nemotron streaming ASR) encoder over oasr's paged caches.

``config`` (geometry from a Hugging Face ``config.json``), ``subsampling`` (the causal Conv2d stack
and its tails), ``attention`` (Transformer-XL relative positions as a ``paged_attention`` table),
``block`` (one FastConformer block), ``encoder`` (the chunk forward), ``converter`` (the checkpoint
format). transformers' ``NemotronAsrStreamingEncoder`` is the oracle (tests only).
"""

from oasr.models.nemotron.config import NemotronEncoderConfig
from oasr.models.nemotron.encoder import NemotronEncoder

__all__ = ["NemotronEncoder", "NemotronEncoderConfig"]
