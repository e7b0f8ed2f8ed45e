"""The CTC decoder's contracts, shared by both twins: ``CtcDecoderConfig``, hypotheses and beam snapshots.

The twins' streaming prefix beam searches and their pooled beam-state caches live in ``oasr.reference`` and
``oasr.fast`` (``ctc_decoder``, ``ctc_state``).
"""
