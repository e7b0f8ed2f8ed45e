"""The fast twin's ``LayeredCache``: ``oasr.cache.layered_cache.LayeredCacheBase`` over this twin's pool and managers.

Its twin is ``oasr.reference.layered_cache``; both hand out the same blocks for the same op sequence.
"""

from oasr.cache.layered_cache import LayeredCacheBase
from oasr.fast.attention_cache import AttentionCacheManager
from oasr.fast.block_pool import BlockPool
from oasr.fast.slot_state import SlotStateCache


class LayeredCache(LayeredCacheBase):
    pool_cls = BlockPool
    manager_cls = AttentionCacheManager
    state_cls = SlotStateCache

    def _stage_like_cuda(self) -> None:
        """Every band's manager on the staged path a CUDA device runs (``oasr.fast.attention_cache``), so the
        capture-safety checker's ``watch_engine`` checks on the CPU the tick a CUDA device runs."""
        for band in self.bands:
            band._stage_like_cuda()
