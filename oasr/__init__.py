"""oasr: per-stream state caches for streaming speech recognition.

Two twins with one API: ``oasr.reference`` (readable pure torch, the oracle)
and ``oasr.fast`` (slot-indexed persistent tensors, CUDA kernels).
"""

from oasr.cache.config import CacheConfig
from oasr.cache.errors import PoolExhaustedError, SlotsExhaustedError, StreamCapacityError
from oasr.cache.paged import PagedKVCache
from oasr.ctc.config import CtcDecoderConfig, CtcHypothesis

__all__ = [
    "CacheConfig",
    "CtcDecoderConfig",
    "CtcHypothesis",
    "PagedKVCache",
    "PoolExhaustedError",
    "SlotsExhaustedError",
    "StreamCapacityError",
    "from_pretrained",
]
__version__ = "0.1.0"


def from_pretrained(ckpt_dir, **kwargs):
    """Load a local checkpoint directory by its detected format (``oasr.checkpoints.from_pretrained``)."""
    from oasr.checkpoints import from_pretrained as load

    return load(ckpt_dir, **kwargs)
