"""The fast twin's attention (encoder K/V) cache: ``AttentionCacheManager``.

Fast twin of ``oasr.reference.attention_cache`` (one module there; here a
package because the fast manager's vectorised bookkeeping and its dispatch by
size and by device would not fit one file):

    manager.py   ``AttentionCacheManager``: its contract, its state, the lifecycle
    chunks.py    paged mode's tick: prepare a chunk's blocks, commit its frames, evict
    views.py     paged mode's reads: a stream's state views, a cohort's paged views
    dense.py     dense mode: commit a packed chunk, read the stacked history
"""

from oasr.fast.attention_cache.manager import AttentionCacheManager

__all__ = ["AttentionCacheManager"]
