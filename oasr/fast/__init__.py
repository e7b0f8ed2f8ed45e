"""The fast twin: slot-indexed persistent tensors, numpy bookkeeping, CUDA kernels.

Same names, methods, argument order and errors as ``oasr.reference`` (the
oracle it is checked against), and the same block ids for the same op
sequence. Bookkeeping is vectorised over a cohort and reaches the device
through one staged copy per call (``oasr.fast.staging``).
"""

from oasr.cache.paged import StreamKVInfo
from oasr.cache.state_spec import StreamStateSpec
from oasr.cache.stream_context import StreamContext
from oasr.fast.attention_cache import AttentionCacheManager
from oasr.fast.block_pool import BlockPool
from oasr.fast.ctc_decoder import CtcBeamState, StreamingCtcDecoder
from oasr.fast.ctc_state import CtcStateCacheManager, StreamHandle
from oasr.fast.decoder_cache import DecoderKVCacheManager, DenseDecoderKV
from oasr.fast.layered_cache import LayeredCache
from oasr.fast.paged_ops import append_kv, paged_attention
from oasr.fast.slot_pool import StreamSlotPool
from oasr.fast.slot_state import CnnCacheManager, SlotStateCache, StateView

SUPPORTS_FP8 = True  # fp8 e4m3 K/V pages (oasr.fast.paged_ops; kernels for head_dim 64 / 128)

__all__ = [
    "AttentionCacheManager",
    "BlockPool",
    "CnnCacheManager",
    "CtcBeamState",
    "CtcStateCacheManager",
    "DecoderKVCacheManager",
    "DenseDecoderKV",
    "LayeredCache",
    "SlotStateCache",
    "StateView",
    "StreamContext",
    "StreamHandle",
    "StreamingCtcDecoder",
    "StreamKVInfo",
    "StreamSlotPool",
    "StreamStateSpec",
    "append_kv",
    "paged_attention",
]
