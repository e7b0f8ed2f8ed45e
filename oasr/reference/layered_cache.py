"""The reference twin's ``LayeredCache``: ``oasr.cache.layered_cache.LayeredCacheBase`` over this twin's pools.

Its twin is ``oasr.fast.layered_cache``; both hand out the same blocks for the same op sequence.
"""

from oasr.cache.layered_cache import LayeredCacheBase
from oasr.reference.attention_cache import AttentionCacheManager
from oasr.reference.block_pool import BlockPool
from oasr.reference.slot_state import SlotStateCache


class LayeredCache(LayeredCacheBase):
    pool_cls = BlockPool
    manager_cls = AttentionCacheManager
    state_cls = SlotStateCache
