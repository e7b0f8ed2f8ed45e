"""Fast-twin ``CtcStateCacheManager`` and ``StreamHandle``: the reference classes, on purpose.

The manager must agree with ``oasr.reference.ctc_state``, and it does so by
being the same code. It is bookkeeping only (an id -> state map, a LIFO pool
and counters): it never reads or writes a state's contents, only calls the
decoder's ``create_state`` / ``reset_state`` / ``decode_chunk(s)`` /
``finalize_stream``, so it has nothing to make fast. What makes the fast twin
fast lives in its decoder (``oasr.fast.ctc_decoder``): pooled states keep
their preallocated tensors, and ``reset_state`` refills them in place.

Use it with the fast decoder::

    manager = CtcStateCacheManager(StreamingCtcDecoder(config, device="cuda"))
    handle = manager.allocate_stream(sid, batch=1, vocab_size=V)
    handle.decode_chunk(log_probs)            # (1, T, V)
    manager.decode_cohort(sids, chunks)       # many streams, one batched pass per frame
"""

from oasr.reference.ctc_state import CtcStateCacheManager, StreamHandle

__all__ = ["CtcStateCacheManager", "StreamHandle"]
