"""The encoder caches' contracts, shared by both twins: what a stream's caches are and how they are sized.

| module | what |
|---|---|
| ``config`` | ``CacheConfig``: the geometry and the position arithmetic (drawn once, there) |
| ``paged`` | ``PagedKVCache``: the one view of a layer's paged K/V both twins hand to a model |
| ``memory`` | bytes by component, blocks from a byte budget (no allocation) |
| ``layer_specs`` / ``layered_cache`` | per-layer windows and fixed-extent states, composed over one pool |
| ``state_spec`` / ``cnn_cache`` | fixed-size per-stream state declarations; the conv left context as one |
| ``stream_context`` | one stream's handle on all of its caches |
| ``validate`` / ``errors`` / ``block_owners`` | the checks, errors and pool-owner tags both twins share |

The twins themselves live in ``oasr.reference`` and ``oasr.fast``; nothing here imports either.
"""
