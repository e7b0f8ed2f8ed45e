"""Sessions: one stream's whole state as a versioned, checksummed byte string, and back.

A session is what a live stream needs to go on elsewhere (another engine, another
process, after a restart): its visible K/V window exactly as the pool stores it,
its slot states (conv left contexts, subsampling tails, persistent specs), its CTC
beam state, its lengths and counters and, from an engine, its unconsumed input.
It is never a memory dump: no pickle, only the fields below, each with a type.
Both twins write the same bytes for the same state and read each other's files.

Layout (little-endian; ``docs/sessions.md`` has every field with its offset)::

    +--------------------------------------------------------------+  offset 0
    | header, 64 bytes: magic "OASRSESS", version 1, header size,  |
    | flags, geometry (layers, kv heads, head_dim, hidden, kernel, |
    | chunk, block size, window in chunks, model dtype, K/V format,|
    | prefill), section count, body size                           |
    +--------------------------------------------------------------+  64
    | section: kind u32 | length u64 | payload (length bytes)      |  kinds ascending,
    | section: ...                                                 |  each at most once
    +--------------------------------------------------------------+  64 + body
    | blake2b-256 of bytes [0, 64 + body)                          |  32 bytes
    +--------------------------------------------------------------+

Sections: 1 attention (lengths, then K, V and, for a quantized format, their scale planes, of the visible
window only), 2 slot states (named tensors), 3 CTC beam (flag bit 0), 4 engine
stream (flag bit 1), 5 decoder rows (flag bit 2: the attention decoder's K/V rows as
pages, each shared page once; ``oasr.sessions.decoder_rows``), 6 encoder output
(flag bit 3: the fp32 encoder frames a rescoring engine keeps for its second pass;
only with section 4, one row per encoder frame the stream produced). A stream
suspended mid-rescoring holds no caches: sections 4 (with the job's progress) and
6 (before the job's first step) or 5 (after it), nothing else.

Reading verifies everything before anything is applied: magic, version (only 1),
size, checksum, flags, section structure, every length, every value a manager
would refuse, then the file's geometry and contents against the caches that are
to take it. A refused file raises :class:`SessionError` (a ``ValueError``) that
says what differs, and changes nothing.

The module is one idea over ~700 lines: each section's encoder sits beside its decoder and its checks, so that
every field's bytes are written and read in one place.

API, the bytes only (``oasr.sessions.stream`` captures a stream's caches into a session and restores them)::

    encode_session(session: StreamSession) -> bytes
    read_session(data, expect=None) -> StreamSession   parse + verify the file itself
    check_geometry(saved, here)                        a foreign geometry raises, naming every field that differs
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from dataclasses import dataclass, field

import torch

from oasr.cache.config import CacheConfig
from oasr.cache.validate import check_restore_lengths
from oasr.ctc.config import BeamEntry, BeamSnapshot, CtcDecoderConfig, check_snapshot
from oasr.sessions import decoder_rows as rows_section
from oasr.sessions.codec import (
    DTYPE_CODES,
    KV_FORMAT_CODES,
    KV_FORMATS,
    MODEL_DTYPE_CODES,
    MODEL_DTYPES,
    Reader,
    SessionError,
    dtype_of,
    tensor_bytes,
    tensor_from,
)

MAGIC = b"OASRSESS"
VERSION = 1
HEADER = struct.Struct("<8sHHI7IiBBBBIQ")
HEADER_BYTES = HEADER.size  # 64
SECTION = struct.Struct("<IQ")
CHECKSUM_BYTES = 32

FLAG_CTC_BEAM = 1 << 0
FLAG_ENGINE = 1 << 1
FLAG_DECODER_ROWS = 1 << 2  # the attention decoder's K/V rows (oasr.sessions.decoder_rows)
FLAG_ENCODER_OUT = 1 << 3  # the encoder output a rescoring engine keeps (StreamingEngine(rescore=True))
KNOWN_FLAGS = FLAG_CTC_BEAM | FLAG_ENGINE | FLAG_DECODER_ROWS | FLAG_ENCODER_OUT

SEC_ATTENTION, SEC_SLOT_STATES, SEC_CTC_BEAM, SEC_ENGINE, SEC_DECODER_ROWS, SEC_ENCODER_OUT = 1, 2, 3, 4, 5, 6
SECTION_NAMES = {1: "attention", 2: "slot states", 3: "CTC beam", 4: "engine stream", 5: "decoder rows",
                 6: "encoder output"}
_FLAG_OF_SECTION = {SEC_CTC_BEAM: FLAG_CTC_BEAM, SEC_ENGINE: FLAG_ENGINE, SEC_DECODER_ROWS: FLAG_DECODER_ROWS,
                    SEC_ENCODER_OUT: FLAG_ENCODER_OUT}

DECODERS = {1: "beam", 2: "greedy"}
FINISH_REASONS = {1: "eos", 2: "length"}


# ---- the parsed form ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionGeometry:
    """What the header says the session was made for; must equal the loading caches' own."""

    num_layers: int
    n_kv_head: int
    head_dim: int
    hidden_dim: int
    kernel_size: int
    chunk_size: int
    block_size_frames: int
    num_left_chunks: int
    dtype: torch.dtype
    kv_cache_dtype: str | None
    prefill_kv_window: bool

    @classmethod
    def of(cls, config: CacheConfig) -> SessionGeometry:
        """The geometry fields of ``config`` a session must match to be resumed."""
        if config.window_frames is not None:  # the header has no field for it: refuse rather than lose it
            raise SessionError(f"sessions record a chunk-aligned window (num_left_chunks); a cache with "
                               f"window_frames={config.window_frames} cannot be suspended or resumed")
        return cls(config.num_layers, config.n_kv_head, config.head_dim, config.hidden_dim, config.kernel_size,
                   config.chunk_size, config.block_size_frames, config.num_left_chunks, config.dtype,
                   config.kv_cache_dtype, config.prefill_kv_window)

    def differences(self, other: SessionGeometry) -> list[str]:
        """One line per field that differs from ``other``: the session's value and this one's."""
        return [
            f"{name}: session {getattr(self, name)!r}, here {getattr(other, name)!r}"
            for name in self.__dataclass_fields__
            if getattr(self, name) != getattr(other, name)
        ]


@dataclass
class KVWindow:
    """The stream's lengths and its visible frames ``[seqstart, seqlen)``, as stored in the pool.

    ``k``/``v`` are ``(num_layers, seqlen - seqstart, n_kv_head, head_dim)`` in the storage dtype
    (a quantized format's data: fp8 bytes, int8, packed 4-bit codes); ``k_scale``/``v_scale`` its scale planes
    ``(num_layers, frames, n_kv_head, *kv_scale_shape)`` in ``kv_scale_dtype``, or None for the model dtype.
    """

    seqlen: int
    seqstart: int
    total_frames: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class NamedState:
    """One stream's row of a declared slot state (the slot axis removed)."""

    name: str
    persistent: bool
    tensor: torch.Tensor


@dataclass
class EngineStream:
    """What a ``StreamingEngine`` keeps of a stream besides its caches (see ``StreamingEngine.suspend``)."""

    stream_id: object  # an int or str, or None when the id was of another type
    model_digest: bytes
    input_dim: int
    vocab_size: int
    decoder: str  # "beam" or "greedy"
    ended: bool
    offset: int
    input_frames: int
    max_extent: int
    partial: list
    pending: torch.Tensor  # (T, input_dim), unconsumed input
    log_probs: torch.Tensor | None  # (T, vocab) fp32, when the engine keeps them
    greedy_tokens: list = field(default_factory=list)
    greedy_last: int = 0
    rescoring: RescoreProgress | None = None  # set when the stream is suspended mid-rescoring


@dataclass
class RescoreProgress:
    """A stream suspended while its attention rescoring job runs (engine state ``"rescoring"``): its first
    pass is over and its caches are freed; what is left is the job (``oasr.engine.rescoring``)."""

    finish_reason: str  # "eos" or "length", as the first pass ended
    first_pass: list  # the CTC best (the n-best's first tokens)
    rescorer_digest: bytes  # blake2b-256 of the rescorer's weights: its K/V rows only resume on it
    steps: int  # decoder steps the job has run, 0 <= steps < longest hypothesis + 1
    nbest: list  # CtcHypothesis records, best first: the rows of the job
    scores: torch.Tensor  # (rows,) fp32 decoder log-likelihood summed over the positions scored so far


@dataclass
class StreamSession:
    geometry: SessionGeometry
    kv: KVWindow | None  # None only for a stream suspended mid-rescoring (its caches are freed)
    states: list
    ctc_config: CtcDecoderConfig | None = None
    beam: BeamSnapshot | None = None
    engine: EngineStream | None = None
    # (frames, hidden_dim) fp32: what a rescoring engine kept of the encoder output, one row per encoder
    # frame produced (``engine.offset`` rows); only with ``engine``
    encoder_out: torch.Tensor | None = None
    decoder_rows: object = None  # oasr.sessions.decoder_rows.DecoderRows: the attention decoder's K/V rows
    decoder_row_ids: list | None = None  # set by a load: the rows the decoder cache gave them

    @property
    def flags(self) -> int:
        """The header's section flags: which optional sections (CTC beam, engine, decoder rows, encoder
        output) follow."""
        return ((FLAG_CTC_BEAM if self.beam is not None else 0) | (FLAG_ENGINE if self.engine is not None else 0)
                | (FLAG_DECODER_ROWS if self.decoder_rows is not None else 0)
                | (FLAG_ENCODER_OUT if self.encoder_out is not None else 0))

    @property
    def rescoring(self) -> bool:
        """Whether the stream was suspended mid-rescoring (no caches: the job's state instead)."""
        return self.engine is not None and self.engine.rescoring is not None


# ---- byte helpers -------------------------------------------------------------------------------------


# ---- encoding -----------------------------------------------------------------------------------------


def _encode_attention(kv: KVWindow) -> bytes:
    parts = [struct.pack("<qqq", kv.seqlen, kv.seqstart, kv.total_frames), tensor_bytes(kv.k), tensor_bytes(kv.v)]
    if kv.k_scale is not None:
        parts += [tensor_bytes(kv.k_scale), tensor_bytes(kv.v_scale)]
    return b"".join(parts)


def _encode_states(states: list) -> bytes:
    parts = [struct.pack("<I", len(states))]
    for s in states:
        name = s.name.encode("utf-8")
        t = s.tensor
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"session: state {s.name!r} has dtype {t.dtype}, which a session cannot store")
        parts.append(struct.pack("<H", len(name)) + name)
        parts.append(struct.pack("<BBBB", DTYPE_CODES[t.dtype], int(s.persistent), t.dim(), 0))
        parts.append(struct.pack(f"<{t.dim()}I", *t.shape))
        raw = tensor_bytes(t)
        parts.append(struct.pack("<Q", len(raw)) + raw)
    return b"".join(parts)


def _encode_beam(config: CtcDecoderConfig, beam: BeamSnapshot) -> bytes:
    parts = [struct.pack("<IIIIdI", config.beam_size, config.blank_id, config.nbest, config.token_topk or 0,
                         config.blank_skip_threshold or 0.0, config.max_prefix_len),
             struct.pack("<IIq", beam.batch, beam.vocab_size, beam.frames_decoded)]
    for row in beam.rows:
        parts.append(struct.pack("<I", len(row)))
        for e in row:
            n = len(e.tokens)
            parts.append(struct.pack(f"<Idd{n}i{n}i", n, e.log_pb, e.log_pnb, *e.tokens, *e.frames))
    for tokens, frames in beam.committed:  # only when a row has committed tokens (see _decode_beam)
        n = len(tokens)
        parts.append(struct.pack(f"<Q{n}i{n}i", n, *tokens, *frames))
    return b"".join(parts)


def _encode_id(stream_id) -> bytes:
    if isinstance(stream_id, int) and not isinstance(stream_id, bool) and -(2**63) <= stream_id < 2**63:
        return struct.pack("<Bq", 1, stream_id)
    if isinstance(stream_id, str):
        raw = stream_id.encode("utf-8")
        return struct.pack("<BI", 2, len(raw)) + raw
    return struct.pack("<B", 0)


def _encode_engine(e: EngineStream) -> bytes:
    decoder = {v: k for k, v in DECODERS.items()}[e.decoder]
    parts = [
        _encode_id(e.stream_id),
        e.model_digest,
        struct.pack("<IIBBBB", e.input_dim, e.vocab_size, decoder, int(e.ended), int(e.log_probs is not None),
                    int(e.rescoring is not None)),
        struct.pack("<qqq", e.offset, e.input_frames, e.max_extent),
        struct.pack(f"<I{len(e.partial)}i", len(e.partial), *e.partial),
        struct.pack(f"<I{len(e.greedy_tokens)}ii", len(e.greedy_tokens), *e.greedy_tokens, e.greedy_last),
        struct.pack("<Bq", DTYPE_CODES[e.pending.dtype], e.pending.shape[0]), tensor_bytes(e.pending),
    ]
    if e.log_probs is not None:
        parts += [struct.pack("<q", e.log_probs.shape[0]), tensor_bytes(e.log_probs.float())]
    if e.rescoring is not None:
        parts.append(_encode_rescoring(e.rescoring))
    return b"".join(parts)


def _encode_rescoring(r: RescoreProgress) -> bytes:
    reason = {v: k for k, v in FINISH_REASONS.items()}[r.finish_reason]
    parts = [struct.pack("<BBBB", reason, 0, 0, 0), r.rescorer_digest, struct.pack("<I", r.steps),
             struct.pack(f"<I{len(r.first_pass)}i", len(r.first_pass), *r.first_pass), struct.pack("<I", len(r.nbest))]
    for h in r.nbest:
        n = len(h.tokens)
        parts.append(struct.pack(f"<Id{n}i{n}i", n, float(h.log_score), *h.tokens, *h.frames))
    scores = r.scores.detach().float().cpu()
    if scores.shape != (len(r.nbest),):
        raise ValueError(f"session: {tuple(scores.shape)} rescoring scores for {len(r.nbest)} hypotheses")
    return b"".join(parts) + tensor_bytes(scores)


def _encode_encoder_out(t: torch.Tensor) -> bytes:
    if t.dtype != torch.float32 or t.dim() != 2:
        raise ValueError(f"session: the kept encoder output must be (frames, hidden_dim) float32, got "
                         f"{tuple(t.shape)} {t.dtype}")
    return struct.pack("<qI", t.shape[0], t.shape[1]) + tensor_bytes(t)


def _check_host() -> None:
    if sys.byteorder != "little":  # tensor bytes are written in the host's order; the format is little-endian
        raise RuntimeError(f"oasr sessions are little-endian; this host is {sys.byteorder}-endian")


def encode_session(session: StreamSession) -> bytes:
    """The bytes of ``session`` (header, sections, checksum); the inverse of :func:`read_session`."""
    _check_host()
    g = session.geometry
    sections = [] if session.kv is None else [(SEC_ATTENTION, _encode_attention(session.kv)),
                                              (SEC_SLOT_STATES, _encode_states(session.states))]
    if session.beam is not None:
        sections.append((SEC_CTC_BEAM, _encode_beam(session.ctc_config, session.beam)))
    if session.engine is not None:
        sections.append((SEC_ENGINE, _encode_engine(session.engine)))
    if session.decoder_rows is not None:

        sections.append((SEC_DECODER_ROWS, rows_section.encode_decoder_rows(session.decoder_rows)))
    if session.encoder_out is not None:
        sections.append((SEC_ENCODER_OUT, _encode_encoder_out(session.encoder_out)))
    body = b"".join(SECTION.pack(kind, len(payload)) + payload for kind, payload in sections)
    header = HEADER.pack(
        MAGIC, VERSION, HEADER_BYTES, session.flags, g.num_layers, g.n_kv_head, g.head_dim, g.hidden_dim,
        g.kernel_size, g.chunk_size, g.block_size_frames, g.num_left_chunks, MODEL_DTYPE_CODES[g.dtype],
        KV_FORMAT_CODES[g.kv_cache_dtype], int(g.prefill_kv_window), 0, len(sections), len(body),
    )
    return header + body + hashlib.blake2b(header + body, digest_size=CHECKSUM_BYTES).digest()


# ---- decoding -----------------------------------------------------------------------------------------


def _parse_header(data: bytes) -> tuple[SessionGeometry, int, int, int]:
    if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        raise SessionError(f"not an oasr session: the first bytes are {bytes(data[:8])!r}, expected {MAGIC!r}")
    if len(data) < 10:
        raise SessionError(f"truncated session: {len(data)} bytes, the header alone is {HEADER_BYTES}")
    (version,) = struct.unpack_from("<H", data, 8)
    if version != VERSION:
        raise SessionError(f"session format version {version} is not supported: this build reads version {VERSION}")
    if len(data) < HEADER_BYTES + CHECKSUM_BYTES:
        raise SessionError(f"truncated session: {len(data)} bytes, a header and checksum alone are "
                           f"{HEADER_BYTES + CHECKSUM_BYTES}")
    (_, _, header_bytes, flags, layers, heads, head_dim, hidden, kernel, chunk, block, left, dtype_code, kv_code,
     prefill, reserved, num_sections, body_bytes) = HEADER.unpack_from(data, 0)
    if header_bytes != HEADER_BYTES:
        raise SessionError(f"session header size {header_bytes}, version 1 has {HEADER_BYTES}")
    expected = HEADER_BYTES + body_bytes + CHECKSUM_BYTES
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "overlong"
        raise SessionError(f"{what} session: {len(data)} bytes, the header announces {expected}")
    digest = hashlib.blake2b(data[: HEADER_BYTES + body_bytes], digest_size=CHECKSUM_BYTES).digest()
    if digest != bytes(data[HEADER_BYTES + body_bytes :]):
        raise SessionError("corrupt session: the blake2b checksum over header and body does not match")
    if flags & ~KNOWN_FLAGS:
        raise SessionError(f"session flags 0x{flags:08x} carry unknown bits 0x{flags & ~KNOWN_FLAGS:08x}; "
                           f"this build knows 0x{KNOWN_FLAGS:08x}")
    if dtype_code not in MODEL_DTYPES:
        raise SessionError(f"session header: unknown model dtype code {dtype_code}")
    if kv_code not in KV_FORMATS:
        raise SessionError(f"session header: unknown K/V format code {kv_code}")
    if prefill not in (0, 1) or reserved != 0:
        raise SessionError(f"session header: prefill byte {prefill} (0 or 1) and reserved byte {reserved} (0)")
    for name, value in (("num_layers", layers), ("n_kv_head", heads), ("head_dim", head_dim), ("hidden_dim", hidden),
                        ("kernel_size", kernel), ("chunk_size", chunk), ("block_size_frames", block)):
        if value < 1:
            raise SessionError(f"session header: {name}={value}, must be >= 1")
    if left < -1:
        raise SessionError(f"session header: num_left_chunks={left}, must be -1 or >= 0")
    dtype = MODEL_DTYPES[dtype_code]
    geometry = SessionGeometry(layers, heads, head_dim, hidden, kernel, chunk, block, left, dtype,
                               KV_FORMATS[kv_code], bool(prefill))
    return geometry, flags, num_sections, body_bytes


def _split_sections(body: bytes, num_sections: int, flags: int) -> dict:
    sections, pos, last = {}, 0, 0
    for i in range(num_sections):
        if pos + SECTION.size > len(body):
            raise SessionError(f"section {i}: its header runs past the body ({len(body)} bytes)")
        kind, length = SECTION.unpack_from(body, pos)
        pos += SECTION.size
        if kind not in SECTION_NAMES:
            raise SessionError(f"section {i}: unknown kind {kind}")
        if kind <= last:
            raise SessionError(f"section {i}: kind {kind} out of order or repeated (kinds ascend, each at most once)")
        if length > len(body) - pos:
            raise SessionError(f"section {i} ({SECTION_NAMES[kind]}): {length} bytes announced, {len(body) - pos} left")
        sections[kind] = body[pos : pos + length]
        pos += length
        last = kind
    if pos != len(body):
        raise SessionError(f"{len(body) - pos} bytes after the last of {num_sections} sections")
    for kind, flag in _FLAG_OF_SECTION.items():
        if bool(flags & flag) != (kind in sections):
            raise SessionError(f"flag bit {flag.bit_length() - 1} says {SECTION_NAMES[kind]} "
                               f"{'present' if flags & flag else 'absent'}, the body disagrees")
    return sections


def _decode_attention(raw: bytes, g: SessionGeometry) -> KVWindow:
    r = Reader(raw, "attention")
    seqlen, seqstart, total = r.unpack("qqq")
    config = _geometry_config(g)
    try:
        check_restore_lengths(config, seqlen, seqstart, total)
    except ValueError as exc:
        raise SessionError(f"attention section: {exc}") from None
    frames = seqlen - seqstart
    storage = config.kv_storage_dtype
    shape = (g.num_layers, frames, g.n_kv_head, config.kv_data_dim)
    size = math.prod(shape) * storage.itemsize
    k, v = tensor_from(r.take(size), storage, shape), tensor_from(r.take(size), storage, shape)
    k_scale = v_scale = None
    if config.kv_quantized:
        sshape, sdtype = shape[:-1] + config.kv_scale_shape, config.kv_scale_dtype
        ssize = math.prod(sshape) * sdtype.itemsize
        k_scale, v_scale = (tensor_from(r.take(ssize), sdtype, sshape) for _ in range(2))
        for name, s in (("K", k_scale), ("V", v_scale)):  # what append stores (KVFormat.scales_storable)
            if not config.kv_format.scales_storable(s):
                what = "negative or NaN" if config.kv_format.name == "q8_0" else "negative, NaN or infinite"
                raise SessionError(f"attention section: a {name} scale is {what}")
    r.done()
    return KVWindow(seqlen, seqstart, total, k, v, k_scale, v_scale)


def _decode_states(raw: bytes) -> list:
    r = Reader(raw, "slot states")
    states, names = [], set()
    for _ in range(r.one("I")):
        try:
            name = r.take(r.one("H")).decode("utf-8")
        except UnicodeDecodeError:
            raise SessionError("slot states section: a state name is not UTF-8") from None
        code, persistent, ndim, reserved = r.unpack("BBBB")
        dtype = dtype_of(code, f"slot state {name!r}")
        if persistent > 1 or reserved:
            raise SessionError(f"slot state {name!r}: persistent byte {persistent}, reserved byte {reserved}")
        shape = r.unpack(f"{ndim}I")
        nbytes = r.one("Q")
        if nbytes != math.prod(shape) * dtype.itemsize:
            raise SessionError(f"slot state {name!r}: {nbytes} bytes for shape {shape} of {dtype}")
        if name in names:
            raise SessionError(f"slot states section: {name!r} appears twice")
        names.add(name)
        states.append(NamedState(name, bool(persistent), tensor_from(r.take(nbytes), dtype, shape)))
    r.done()
    return states


def _decode_beam(raw: bytes) -> tuple[CtcDecoderConfig, BeamSnapshot]:
    r = Reader(raw, "CTC beam")
    beam_size, blank, nbest, topk, skip, max_len = r.unpack("IIIIdI")
    try:
        config = CtcDecoderConfig(beam_size, blank, nbest, topk or None, skip or None, max_len)
    except ValueError as exc:
        raise SessionError(f"CTC beam section: {exc}") from None
    batch, vocab, frames_decoded = r.unpack("IIq")
    if batch > len(raw):  # each row costs at least 4 bytes: refuse a huge count before looping on it
        raise SessionError(f"CTC beam section: batch {batch} cannot fit in {len(raw)} bytes")
    rows = []
    for _ in range(batch):
        count = r.one("I")
        if count > config.beam_size:
            raise SessionError(f"CTC beam section: a row of {count} prefixes, beam_size is {config.beam_size}")
        row = []
        for _ in range(count):
            n = r.one("I")
            if n > config.max_prefix_len:
                raise SessionError(f"CTC beam section: a prefix of {n} tokens, max_prefix_len is {max_len}")
            pb, pnb = r.unpack("dd")
            values = r.unpack(f"{2 * n}i")
            row.append(BeamEntry(tuple(values[:n]), tuple(values[n:]), pb, pnb))
        rows.append(tuple(row))
    committed = []
    if r.pos < len(raw):  # the rows' committed (tokens, frames): present once a row has committed a token
        for _ in range(batch):
            n = r.one("Q")
            if 8 * n > len(raw):
                raise SessionError(f"CTC beam section: {n} committed tokens cannot fit in {len(raw)} bytes")
            values = r.unpack(f"{2 * n}i")
            committed.append((tuple(values[:n]), tuple(values[n:])))
        if not any(t for t, _ in committed):
            raise SessionError("CTC beam section: a committed part in which no row has a token")
    r.done()
    beam = BeamSnapshot(batch, vocab, frames_decoded, tuple(rows), tuple(committed))
    try:
        check_snapshot("CTC beam section", config, beam)
    except ValueError as exc:
        raise SessionError(str(exc)) from None
    return config, beam


def _decode_engine(raw: bytes) -> EngineStream:
    r = Reader(raw, "engine stream")
    kind = r.one("B")
    if kind == 1:
        stream_id = r.one("q")
    elif kind == 2:
        try:
            stream_id = r.take(r.one("I")).decode("utf-8")
        except UnicodeDecodeError:
            raise SessionError("engine stream section: the stream id is not UTF-8") from None
    elif kind == 0:
        stream_id = None
    else:
        raise SessionError(f"engine stream section: unknown stream id kind {kind}")
    digest = r.take(32)
    input_dim, vocab, decoder, ended, has_lp, phase = r.unpack("IIBBBB")
    if decoder not in DECODERS or ended > 1 or has_lp > 1 or phase > 1 or input_dim < 1 or vocab < 2:
        raise SessionError(f"engine stream section: bad fields (decoder {decoder}, ended {ended}, log-probs {has_lp}, "
                           f"rescoring {phase}, input_dim {input_dim}, vocab {vocab})")
    offset, input_frames, max_extent = r.unpack("qqq")
    if min(offset, input_frames, max_extent) < 0:
        raise SessionError(f"engine stream section: negative counter ({offset}, {input_frames}, {max_extent})")
    partial = list(r.unpack(f"{r.one('I')}i"))
    greedy_tokens = list(r.unpack(f"{r.one('I')}i"))
    greedy_last = r.one("i")
    code, frames = r.unpack("Bq")
    dtype = dtype_of(code, "engine stream pending input")
    if frames < 0:
        raise SessionError(f"engine stream section: {frames} pending frames")
    pending = tensor_from(r.take(frames * input_dim * dtype.itemsize), dtype, (frames, input_dim))
    if not pending.is_floating_point() or not bool(torch.isfinite(pending).all()):
        raise SessionError("engine stream section: pending input must be finite floating-point features")
    log_probs = None
    if has_lp:
        t = r.one("q")
        if t != offset:
            raise SessionError(f"engine stream section: {t} log-prob frames for {offset} encoder frames")
        log_probs = tensor_from(r.take(t * vocab * 4), torch.float32, (t, vocab))
    rescoring = _decode_rescoring(r, vocab, offset) if phase else None
    r.done()
    if any(not 0 <= tok < vocab for tok in partial + greedy_tokens + [greedy_last]):
        raise SessionError(f"engine stream section: a token outside the vocabulary of {vocab}")
    if rescoring is not None and (not ended or frames or DECODERS[decoder] != "beam"):
        raise SessionError("engine stream section: a stream mid-rescoring has ended, has no pending input and "
                           "decodes with the beam search")
    return EngineStream(stream_id, digest, input_dim, vocab, DECODERS[decoder], bool(ended), offset, input_frames,
                        max_extent, partial, pending, log_probs, greedy_tokens, greedy_last, rescoring)


def _decode_rescoring(r: Reader, vocab: int, offset: int) -> RescoreProgress:
    from oasr.ctc.config import CtcHypothesis

    reason, *reserved = r.unpack("BBBB")
    if reason not in FINISH_REASONS or any(reserved):
        raise SessionError(f"engine stream section: rescoring finish reason {reason} (1 eos, 2 length), reserved "
                           f"{reserved}")
    digest, steps = r.take(32), r.one("I")
    first_pass = list(r.unpack(f"{r.one('I')}i"))
    count = r.one("I")
    if not 1 <= count <= len(r.data):
        raise SessionError(f"engine stream section: {count} hypotheses to rescore")
    nbest = []
    for _ in range(count):
        n = r.one("I")
        score = r.one("d")
        values = r.unpack(f"{2 * n}i")
        tokens, frames = list(values[:n]), list(values[n:])
        if any(not 0 <= t < vocab for t in tokens) or any(not 0 <= f < max(offset, 1) for f in frames) \
                or frames != sorted(frames) or not math.isfinite(score):
            raise SessionError("engine stream section: a rescoring hypothesis with tokens outside the vocabulary, "
                               "frames outside the stream or out of order, or a score that is not finite")
        nbest.append(CtcHypothesis(tokens, score, frames))
    scores = tensor_from(r.take(4 * count), torch.float32, (count,))
    if first_pass != nbest[0].tokens:
        raise SessionError("engine stream section: the first pass is not the best hypothesis of the n-best")
    if steps > max(len(h.tokens) for h in nbest) or not bool(torch.isfinite(scores).all()):
        raise SessionError(f"engine stream section: rescoring at step {steps} of a job of "
                           f"{max(len(h.tokens) for h in nbest) + 1} steps, or scores that are not finite")
    return RescoreProgress(FINISH_REASONS[reason], first_pass, digest, steps, nbest, scores)


def _check_engine_frames(session: StreamSession) -> None:
    """The engine's ``offset`` (encoder frames produced, the next chunk's absolute position) is the
    frame count every other section keeps too: the attention section's ``total_frames`` and the CTC
    beam's ``frames_decoded``. A session where they differ would resume at wrong positions."""
    e = session.engine
    if session.kv is None:
        return
    if e.offset != session.kv.total_frames:
        raise SessionError(f"engine stream section: offset {e.offset} encoder frames, the attention section has "
                           f"seen total_frames={session.kv.total_frames}")
    if session.beam is not None and session.beam.frames_decoded != e.offset:
        raise SessionError(f"engine stream section: offset {e.offset} encoder frames, the CTC beam section decoded "
                           f"frames_decoded={session.beam.frames_decoded}")


def _decode_encoder_out(raw: bytes, g: SessionGeometry) -> torch.Tensor:
    r = Reader(raw, "encoder output")
    frames, width = r.unpack("qI")
    if frames < 0 or width != g.hidden_dim:
        raise SessionError(f"encoder output section: {frames} frames of width {width}, expected frames >= 0 of "
                           f"hidden_dim {g.hidden_dim}")
    out = tensor_from(r.take(frames * width * 4), torch.float32, (frames, width))
    r.done()
    if not bool(torch.isfinite(out).all()):
        raise SessionError("encoder output section: the kept encoder output holds NaN or infinite values")
    return out


def _check_layout(sections: dict, engine: EngineStream | None) -> None:
    """Which sections a session holds. A stream of caches: attention and slot states (CTC beam, engine,
    decoder rows, encoder output optional). A stream suspended mid-rescoring holds no caches (its first
    pass is over): no attention, slot states or CTC beam; its job's state is the encoder output before
    the job's first step and the decoder rows after it."""
    if engine is None or engine.rescoring is None:
        for kind in (SEC_ATTENTION, SEC_SLOT_STATES):
            if kind not in sections:
                raise SessionError(f"session has no {SECTION_NAMES[kind]} section")
        return
    extra = [SECTION_NAMES[k] for k in (SEC_ATTENTION, SEC_SLOT_STATES, SEC_CTC_BEAM) if k in sections]
    if extra:
        raise SessionError(f"a stream suspended mid-rescoring holds no caches, the session has {', '.join(extra)}")
    steps = engine.rescoring.steps
    want = SEC_ENCODER_OUT if steps == 0 else SEC_DECODER_ROWS
    other = SEC_DECODER_ROWS if steps == 0 else SEC_ENCODER_OUT
    if want not in sections or other in sections:
        raise SessionError(f"a rescoring job at step {steps} is saved as its {SECTION_NAMES[want]} section alone "
                           f"(the encoder output before its first step, the decoder rows after)")


def _check_job_rows(session: StreamSession) -> None:
    """A rescoring job's decoder rows: dense, one per hypothesis, each ``steps`` tokens long over the
    stream's ``offset`` encoder frames, in a group of the job's capacities."""
    e, rows = session.engine, session.decoder_rows
    job = e.rescoring
    capacity = max(len(h.tokens) for h in job.nbest) + 1
    bad = [i for i, r in enumerate(rows.rows) if (r.length, r.cross_length, r.request.prompt_len,
                                                  r.request.self_tokens, r.request.cross_len)
           != (job.steps, e.offset, 0, capacity, e.offset)]
    if rows.geometry.storage != "dense" or len(rows.rows) != len(job.nbest) or bad:
        raise SessionError(f"decoder rows section: a rescoring job at step {job.steps} of {len(job.nbest)} "
                           f"hypotheses over {e.offset} encoder frames needs as many dense rows of {job.steps} "
                           f"tokens (capacity {capacity}) and {e.offset} cross frames")


def _geometry_config(g: SessionGeometry) -> CacheConfig:
    """A minimal CPU ``CacheConfig`` of the session's geometry, for the shared length arithmetic."""
    try:
        return CacheConfig(num_layers=g.num_layers, n_kv_head=g.n_kv_head, head_dim=g.head_dim, hidden_dim=g.hidden_dim,
                           kernel_size=g.kernel_size, chunk_size=g.chunk_size, num_left_chunks=g.num_left_chunks,
                           block_size_frames=g.block_size_frames, max_num_blocks=1 << 30, max_batch_size=1,
                           max_blocks_per_seq=1 << 30, prefill_kv_window=g.prefill_kv_window, dtype=g.dtype,
                           kv_cache_dtype=g.kv_cache_dtype)
    except ValueError as exc:
        raise SessionError(f"session header describes no valid geometry: {exc}") from None


def check_geometry(saved: SessionGeometry, here: SessionGeometry) -> None:
    """Raise :class:`SessionError` unless ``saved`` (a file's geometry) equals ``here`` (the caches'), naming every
    field that differs."""
    diffs = saved.differences(here)
    if diffs:
        raise SessionError("foreign session, its geometry differs: " + "; ".join(diffs))


def read_session(data, expect: SessionGeometry | None = None) -> StreamSession:
    """Parse and verify ``data`` as a whole (nothing is applied anywhere); :class:`SessionError` if refused.

    With ``expect`` (the loading caches' ``SessionGeometry.of(config)``) a header of another
    geometry is refused as soon as the header is verified, naming every field that differs.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"read_session: expected bytes, got {type(data).__name__}")
    _check_host()
    data = bytes(data)
    geometry, flags, num_sections, body_bytes = _parse_header(data)
    if expect is not None:
        check_geometry(geometry, expect)
    sections = _split_sections(data[HEADER_BYTES : HEADER_BYTES + body_bytes], num_sections, flags)
    engine = _decode_engine(sections[SEC_ENGINE]) if SEC_ENGINE in sections else None
    _check_layout(sections, engine)
    session = StreamSession(geometry, None, [])
    if SEC_ATTENTION in sections:
        session.kv = _decode_attention(sections[SEC_ATTENTION], geometry)
        session.states = _decode_states(sections[SEC_SLOT_STATES])
    if SEC_CTC_BEAM in sections:
        session.ctc_config, session.beam = _decode_beam(sections[SEC_CTC_BEAM])
    if engine is not None:
        session.engine = engine
        _check_engine_frames(session)
    if SEC_DECODER_ROWS in sections:

        session.decoder_rows = rows_section.decode_decoder_rows(sections[SEC_DECODER_ROWS])
        if session.rescoring:
            _check_job_rows(session)
    if SEC_ENCODER_OUT in sections:
        if session.engine is None:
            raise SessionError("encoder output section (flag bit 3) without the engine stream section: only an "
                               "engine keeps encoder output")
        session.encoder_out = _decode_encoder_out(sections[SEC_ENCODER_OUT], geometry)
        if session.encoder_out.shape[0] != session.engine.offset:
            raise SessionError(f"encoder output section: {session.encoder_out.shape[0]} frames kept, the stream "
                               f"produced {session.engine.offset} encoder frames")
    return session


# ---- caches <-> sessions ------------------------------------------------------------------------------


__all__ = [
    "EngineStream",
    "KVWindow",
    "NamedState",
    "RescoreProgress",
    "SessionError",
    "SessionGeometry",
    "StreamSession",
    "check_geometry",
    "encode_session",
    "read_session",
]
