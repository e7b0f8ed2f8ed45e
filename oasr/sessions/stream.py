"""Sessions from and into caches: capture one stream's state out of the managers, restore it into others.

``oasr.sessions.format`` is the byte format (header, sections, checksum); this module reads a live stream's
caches into a :class:`~oasr.sessions.format.StreamSession` (its visible K/V window through the pool's bytes, its
slot states, its CTC beam) and admits a stream carrying a session's state, after checking that it fits the
caches that are to take it. A refused session raises :class:`SessionError` (a ``ValueError``) that says what
differs, and changes nothing.

API, from bytes to caches::

    save_stream(stream_id, att, slot_states, ctc=None, engine=None, decoder_rows=None) -> bytes
    read_session(data) -> StreamSession               parse + verify the file itself (oasr.sessions.format)
    check_session(session, att, slot_states, ctc)     verify it fits these caches
    restore_stream(session, stream_id, att, slot_states, ctc)   apply (after the checks)
    load_stream(data, stream_id, att, slot_states, ctc=None, decoder=None) -> StreamSession   all three

``slot_states`` is a list of slot-indexed caches: ``SlotStateCache`` objects and/or
``CnnCacheManager`` objects (their ``.state``), e.g. ``[cnn, states]``. The engine's
``StreamingEngine.suspend`` / ``resume`` add the stream's input and counters.
"""

from __future__ import annotations

import hashlib

import torch

from oasr.cache.config import CacheConfig
from oasr.cache.validate import check_restore_room
from oasr.sessions import decoder_rows as rows_section
from oasr.sessions.codec import SessionError, tensor_bytes
from oasr.sessions.format import (
    EngineStream,
    KVWindow,
    NamedState,
    SessionGeometry,
    StreamSession,
    check_geometry,
    encode_session,
    read_session,
)


def _slot_caches(slot_states) -> list:
    caches = [getattr(c, "state", c) for c in slot_states]
    names = [name for c in caches for name in c.specs]
    if len(set(names)) != len(names):
        raise ValueError(f"session: state names must be unique across the slot caches, got {names}")
    return caches


def _window_index(config: CacheConfig, blocks, seqstart: int, seqlen: int, device):
    """Pool ``(block, offset)`` index tensors of table positions ``[seqstart, seqlen)``."""
    bs = config.block_size_frames
    positions = torch.arange(seqstart, seqlen)
    block_ids = torch.tensor(list(blocks), dtype=torch.int64)[positions // bs] if len(blocks) else positions
    return block_ids.to(device), (positions % bs).to(device)


def capture_stream(stream_id, att, slot_states, ctc=None, engine: EngineStream | None = None,
                   decoder_rows=None) -> StreamSession:
    """Read one stream's state out of the caches (changes nothing). ``decoder_rows``: the stream's
    attention-decoder rows, captured with ``oasr.sessions.decoder_rows.capture_paged`` (or ``capture_dense``)."""
    config = att.config
    info = att.describe(stream_id)
    pool = att.pool
    blocks, offsets = _window_index(config, info.blocks, info.cache_seqstart, info.cache_seqlen, pool.k_pool.device)

    def window(t):  # through the bytes: advanced indexing has no fp8 kernel on every device
        if t is None:
            return None
        if not len(blocks):  # an empty window (nothing committed yet, or a zero-width window)
            return torch.empty((t.shape[0], 0, *t.shape[3:]), dtype=t.dtype)
        return t.view(torch.uint8)[:, blocks, offsets].cpu().view(t.dtype)

    k, v, k_scale, v_scale = (window(t) for t in (pool.k_pool, pool.v_pool, pool.k_scale, pool.v_scale))
    kv = KVWindow(info.cache_seqlen, info.cache_seqstart, info.total_frames, k, v, k_scale, v_scale)
    states = []
    for cache in _slot_caches(slot_states):
        for name, spec in cache.specs.items():
            row = cache.view(name, [stream_id]).gather().select(spec.slot_axis, 0)
            states.append(NamedState(name, spec.persistent, row.cpu().contiguous()))
    session = StreamSession(SessionGeometry.of(config), kv, states, engine=engine, decoder_rows=decoder_rows)
    if ctc is not None:
        session.ctc_config, session.beam = ctc.decoder.config, ctc.snapshot_stream(stream_id)
    return session


def save_stream(stream_id, att, slot_states, ctc=None, engine: EngineStream | None = None,
                decoder_rows=None) -> bytes:
    """The session bytes of ``stream_id`` (changes nothing); see the module docstring for the arguments."""
    return encode_session(capture_stream(stream_id, att, slot_states, ctc, engine, decoder_rows))



def check_session(session: StreamSession, att, slot_states, ctc=None, stream_id=None, decoder=None) -> None:
    """Raise :class:`SessionError` unless ``session`` fits these caches exactly (changes nothing).

    Foreign: another geometry, dtype or K/V format; other declared states (names, shapes, dtypes,
    persistence); a CTC beam where this stack has no decoder or the reverse, or another decoder
    configuration. With ``stream_id`` also the room to admit it: a duplicate id (``ValueError``),
    its block ceiling, free blocks and a free slot (``StreamCapacityError``, ``PoolExhaustedError``,
    ``SlotsExhaustedError``). ``decoder``: the ``DecoderKVCacheManager`` to take the session's decoder
    rows (both present or both absent; their geometry and format, then room: ``AdmissionError``).
    """
    if session.kv is None:
        raise SessionError("the session holds a stream suspended mid-rescoring (no caches); only "
                           "StreamingEngine.resume takes it")
    check_geometry(session.geometry, SessionGeometry.of(att.config))
    caches = _slot_caches(slot_states)
    declared = {name: (cache, spec) for cache in caches for name, spec in cache.specs.items()}
    saved = {s.name: s for s in session.states}
    if set(declared) != set(saved):
        raise SessionError(f"foreign session: it holds states {sorted(saved)}, these caches declare {sorted(declared)}")
    for name, (cache, spec) in declared.items():
        s = saved[name]
        dtype = cache.buffers[name].dtype
        if tuple(s.tensor.shape) != spec.shape or s.tensor.dtype != dtype or s.persistent != spec.persistent:
            raise SessionError(
                f"foreign session: state {name!r} is {tuple(s.tensor.shape)} {s.tensor.dtype} "
                f"persistent={s.persistent}, declared here {spec.shape} {dtype} persistent={spec.persistent}")
    if (session.beam is None) != (ctc is None):
        raise SessionError(f"foreign session: it {'has no' if session.beam is None else 'carries a'} CTC beam "
                           f"state, these caches {'have a' if ctc is not None else 'have no'} CTC decoder")
    if ctc is not None and session.ctc_config != ctc.decoder.config:
        raise SessionError(f"foreign session: CTC decoder {session.ctc_config}, here {ctc.decoder.config}")
    if (session.decoder_rows is None) != (decoder is None):
        raise SessionError(f"foreign session: it {'has no' if session.decoder_rows is None else 'carries'} "
                           f"attention-decoder rows, {'a' if decoder is not None else 'no'} decoder cache is given")
    if decoder is not None:

        rows_section.check_paged(session.decoder_rows, decoder)
    if stream_id is not None:
        check_room(session, stream_id, att, caches, ctc)


def check_room(session: StreamSession, stream_id, att, slot_states, ctc=None) -> None:
    """Raise if ``stream_id`` cannot be admitted with ``session``'s state now (changes nothing)."""
    caches = _slot_caches(slot_states)
    if att.has_stream(stream_id) or any(c.has_stream(stream_id) for c in caches) or (
            ctc is not None and ctc.has_stream(stream_id)):
        raise ValueError(f"stream id {stream_id!r} is already allocated")
    need = -(-session.kv.seqlen // att.config.block_size_frames)
    check_restore_room(att.config, stream_id, need, att.pool.num_free_blocks, [att.slots] + [c.slots for c in caches])


def restore_stream(session: StreamSession, stream_id, att, slot_states, ctc=None, decoder=None) -> None:
    """Admit ``stream_id`` carrying ``session``'s state; checks everything first (``check_session``).
    With ``decoder`` the decoder rows are restored too; their new row ids go to ``session.decoder_row_ids``."""
    check_session(session, att, slot_states, ctc, stream_id=stream_id, decoder=decoder)
    caches = _slot_caches(slot_states)
    kv = session.kv
    blocks = att.restore_stream(stream_id, kv.seqlen, kv.seqstart, kv.total_frames)
    pool = att.pool
    b, o = _window_index(att.config, blocks, kv.seqstart, kv.seqlen, pool.k_pool.device)
    for target, saved in ((pool.k_pool, kv.k), (pool.v_pool, kv.v), (pool.k_scale, kv.k_scale),
                          (pool.v_scale, kv.v_scale)):
        if saved is not None and saved.numel():
            target.view(torch.uint8)[:, b, o] = saved.view(torch.uint8).to(target.device)
    saved = {s.name: s for s in session.states}
    for cache in caches:
        cache.allocate_stream(stream_id)
        for name, spec in cache.specs.items():
            row = saved[name].tensor.unsqueeze(spec.slot_axis).to(cache.buffers[name].device)
            cache.view(name, [stream_id]).scatter(row)
    if ctc is not None:
        ctc.restore_stream(stream_id, session.beam)
    if decoder is not None:

        session.decoder_row_ids = rows_section.restore_paged(session.decoder_rows, decoder)


def load_stream(data, stream_id, att, slot_states, ctc=None, decoder=None) -> StreamSession:
    """Verify ``data`` and admit ``stream_id`` with its state, or raise and change nothing; returns the session
    (with ``decoder``, a ``DecoderKVCacheManager``, its restored decoder rows in ``decoder_row_ids``)."""
    session = read_session(data, expect=SessionGeometry.of(att.config))
    restore_stream(session, stream_id, att, slot_states, ctc, decoder)
    return session


def model_digest(model: torch.nn.Module) -> bytes:
    """blake2b-256 over a model's state dict (names, dtypes, shapes, bytes): which weights a session ran on."""
    h = hashlib.blake2b(digest_size=32)
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(tensor_bytes(t))
    return h.digest()


def save_context(ctx, states=None) -> bytes:
    """A ``StreamContext``'s session bytes: K/V window, conv cache, ``states`` (a ``SlotStateCache``), CTC beam."""
    return save_stream(ctx.stream_id, ctx.att, [ctx.cnn] + ([states] if states is not None else []), ctx.ctc)


def load_context(data, stream_id, att, cnn, ctc=None, states=None):
    """Admit ``stream_id`` in every manager carrying the state in ``data`` and return its ``StreamContext``,
    or raise and change nothing."""
    from oasr.cache.stream_context import StreamContext

    load_stream(data, stream_id, att, [cnn] + ([states] if states is not None else []), ctc)
    return StreamContext(stream_id, att, cnn, ctc)


__all__ = [
    "capture_stream",
    "check_room",
    "check_session",
    "load_context",
    "load_stream",
    "model_digest",
    "restore_stream",
    "save_context",
    "save_stream",
]
