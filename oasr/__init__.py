"""oasr: per-stream state caches for streaming speech recognition.

Two twins with one API: ``oasr.reference`` (readable pure torch, the oracle)
and ``oasr.fast`` (slot-indexed persistent tensors, CUDA kernels).
"""

from oasr.config import CacheConfig
from oasr.ctc_config import CtcDecoderConfig, CtcHypothesis
from oasr.errors import PoolExhaustedError, SlotsExhaustedError, StreamCapacityError
from oasr.paged import PagedKVCache

__all__ = [
    "CacheConfig",
    "CtcDecoderConfig",
    "CtcHypothesis",
    "PagedKVCache",
    "PoolExhaustedError",
    "SlotsExhaustedError",
    "StreamCapacityError",
]
__version__ = "0.1.0"
