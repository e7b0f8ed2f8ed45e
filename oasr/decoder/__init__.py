"""The attention decoder's K/V contracts, shared by both twins.

| module | what |
|---|---|
| ``config`` | ``DecoderCacheConfig`` and ``DecoderRequest``: geometry, capacity, a row's ceiling |
| ``common`` | admission arithmetic, refusals, row records, argument checks |
| ``kv`` | a decode group's K/V in either storage (dense buffers or paged rows) |
| ``prefix_cache`` | the chained block hash and index of shared prompt prefixes |

The twins' ``DecoderKVCacheManager`` live in ``oasr.reference.decoder_cache`` and ``oasr.fast.decoder_cache``.
"""
