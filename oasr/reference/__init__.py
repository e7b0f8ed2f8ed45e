"""The reference twin: pure torch, Python free list, dense gathers, eager loops.

This is the oracle every fast path and kernel is checked against. It stays
naive on purpose; its fast twin is ``oasr.fast`` with the same names and API.
"""

from oasr.cache.state_spec import StreamStateSpec
from oasr.cache.stream_context import StreamContext
from oasr.reference.attention_cache import AttentionCacheManager, StreamKVInfo
from oasr.reference.block_pool import BlockPool
from oasr.reference.ctc_decoder import CtcBeamState, StreamingCtcDecoder
from oasr.reference.ctc_state import CtcStateCacheManager, StreamHandle
from oasr.reference.decoder_cache import DecoderKVCacheManager, DenseDecoderKV
from oasr.reference.layered_cache import LayeredCache
from oasr.reference.paged_ops import append_kv, paged_attention
from oasr.reference.slot_pool import StreamSlotPool
from oasr.reference.slot_state import CnnCacheManager, SlotStateCache, StateView

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
