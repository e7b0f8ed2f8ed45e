"""``StreamContext``: one stream's handle on all of its caches.

A thin facade binding a ``stream_id`` to the attention manager, the conv (slot
state) manager and, optionally, the CTC state manager, so an engine's loop
reads as one object per stream. It works with either twin: it only calls the
managers' public API. ``StreamContext.allocate`` admits a stream in every
manager or in none (a failure rolls back what was admitted). A context's whole
cache state travels as session bytes through ``oasr.sessions.stream.save_context``
/ ``load_context``, to another set of managers of either twin. ``att`` and
``cnn`` may be None for an encoder with no paged K/V and no conv manager (a
fixed-extent runtime keeps its own state).
"""

from __future__ import annotations


class StreamContext:
    def __init__(self, stream_id, att, cnn, ctc=None):
        self.stream_id = stream_id
        self.att = att
        self.cnn = cnn
        self.ctc = ctc

    @classmethod
    def allocate(cls, stream_id, att, cnn, ctc=None, ctc_batch: int = 1, vocab_size: int | None = None):
        """Admit ``stream_id`` in every manager, or in none."""
        if ctc is not None and vocab_size is None:
            raise ValueError("StreamContext.allocate: vocab_size is required when a CTC manager is given")
        done = []
        try:
            for manager in (att, cnn):
                if manager is not None:
                    manager.allocate_stream(stream_id)
                    done.append(manager)
            if ctc is not None:
                ctc.allocate_stream(stream_id, ctc_batch, vocab_size)
                done.append(ctc)
        except Exception:
            for manager in reversed(done):
                manager.free_stream(stream_id)
            raise
        return cls(stream_id, att, cnn, ctc)

    # ---- per chunk, paged --------------------------------------------------------
    def prepare_chunk(self, num_frames: int | None = None) -> None:
        """Blocks for this stream's next ``num_frames`` frames (default chunk_size)."""
        self.att.prepare_chunk(self.stream_id, num_frames)

    def at_capacity(self, num_frames: int | None = None) -> bool:
        """True when preparing the next ``num_frames`` would pass the stream's block ceiling."""
        return self.att.at_capacity(self.stream_id, num_frames)

    def get_att_caches(self):
        """This stream's paged K/V views, one per layer."""
        return self.att.get_paged_caches([self.stream_id])

    def get_paged_state_views(self):
        """``(block_table (1, W), cache_seqlens (1,), cache_seqstarts (1,))`` of this stream."""
        return self.att.get_paged_state_views(self.stream_id)

    def cached_frames(self) -> int:
        """K/V frames the stream holds (its visible history)."""
        return self.att.cached_frames(self.stream_id)

    def commit_chunk_paged(self, num_frames: int, new_cnn_cache=None) -> None:
        """Commit ``num_frames`` written through the paged views, and the new conv cache when given."""
        self.att.commit_chunk_paged(self.stream_id, num_frames)
        if new_cnn_cache is not None:
            self.cnn.update([self.stream_id], new_cnn_cache)

    # ---- per chunk, dense --------------------------------------------------------
    def get_att_cache(self):
        """The visible history packed as ``(num_layers, n_kv_head, seqlen - seqstart, 2 * head_dim)``."""
        return self.att.get_stacked_cache(self.stream_id)

    def commit_chunk(self, kv_chunk, new_cnn_cache=None) -> None:
        """Commit a dense chunk ``kv_chunk`` and the new conv cache (``ValueError`` for a wrong conv shape; nothing
        written).
        """
        if new_cnn_cache is not None:
            expected = tuple(self.cnn.get_cache([self.stream_id]).shape)
            if tuple(new_cnn_cache.shape) != expected:
                raise ValueError(f"commit_chunk: cnn cache expected {expected}, got {tuple(new_cnn_cache.shape)}")
        self.att.commit(self.stream_id, kv_chunk)
        if new_cnn_cache is not None:
            self.cnn.update([self.stream_id], new_cnn_cache)

    # ---- shared -------------------------------------------------------------------
    def get_cnn_cache(self):
        """The stream's conv cache, one batch row."""
        return self.cnn.get_cache([self.stream_id])

    def get_decoder(self):
        """The stream's CTC decoder handle (``RuntimeError`` when the context has no CTC manager)."""
        if self.ctc is None:
            raise RuntimeError(f"stream {self.stream_id!r}: this StreamContext has no CTC manager")
        return self.ctc.get_decoder(self.stream_id)

    def reset(self) -> None:
        """Rewind what the encoder heard: K/V back to admission, conv state zeroed (persistent kept)."""
        self.att.reset_stream(self.stream_id)
        self.cnn.reset_stream(self.stream_id)

    def free(self) -> None:
        """Release the stream's blocks and slots; its CTC state goes back to the pool."""
        for manager in (self.att, self.cnn, self.ctc):
            if manager is not None:
                manager.free_stream(self.stream_id)
