"""The session format's byte primitives: type codes, the error, tensors to bytes and back, bounded reads.

``oasr.sessions.format`` (a stream's session) and ``oasr.sessions.decoder_rows`` (an attention decoder's rows)
both write and read with these, so a code or a bounds check is stated once.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

DTYPE_CODES = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
    torch.int32: 5, torch.int64: 6, torch.uint8: 7, torch.int8: 8, torch.int16: 9, torch.bool: 10,
}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MODEL_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
MODEL_DTYPES = {code: dtype for dtype, code in MODEL_DTYPE_CODES.items()}
# K/V format code -> CacheConfig.kv_cache_dtype (oasr.kv_formats). Codes are never reused: an older build
# refuses a newer format's code instead of misreading its pages.
KV_FORMATS = {0: None, 1: "fp8_e4m3", 2: "int8", 3: "q8_0", 4: "affine4", 5: "affine4_g64"}
KV_FORMAT_CODES = {v: k for k, v in KV_FORMATS.items()}

class SessionError(ValueError):
    """A session that cannot be loaded here: truncated, corrupt, foreign or inconsistent (nothing changed)."""



def tensor_bytes(t: torch.Tensor) -> bytes:
    """``t``'s elements as raw little-endian bytes (contiguous, on the host); empty for no elements."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tensor_from(raw: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A host tensor of ``dtype`` and ``shape`` from ``raw`` (a copy: the bytes stay untouched)."""
    if not raw:
        return torch.empty(shape, dtype=dtype)
    flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
    return flat.view(dtype).reshape(shape)


class Reader:
    """Bounds-checked little-endian reads from one section's payload; any overrun is a SessionError."""

    def __init__(self, data: bytes, where: str):
        self.data, self.pos, self.where = data, 0, where

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes; a SessionError when fewer are left."""
        if n < 0 or self.pos + n > len(self.data):
            raise SessionError(f"{self.where} section: needs {n} more bytes at offset {self.pos}, "
                               f"only {len(self.data) - self.pos} left")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        """The next values of little-endian ``struct`` format ``fmt``."""
        try:
            s = struct.Struct("<" + fmt)
        except struct.error:  # a count too large to describe: it cannot fit in the section either
            raise SessionError(f"{self.where} section: a count in {fmt[:24]!r} runs past the section") from None
        return s.unpack(self.take(s.size))

    def one(self, fmt: str):
        """The next single value of format ``fmt``."""
        return self.unpack(fmt)[0]

    def done(self) -> None:
        """Raise a SessionError when bytes are left over."""
        if self.pos != len(self.data):
            raise SessionError(f"{self.where} section: {len(self.data) - self.pos} trailing bytes")


def dtype_of(code: int, where: str) -> torch.dtype:
    """The torch dtype of a session's dtype ``code``; a SessionError naming ``where`` for an unknown one."""
    if code not in DTYPES:
        raise SessionError(f"{where}: unknown dtype code {code}")
    return DTYPES[code]


def read_tensor_blob(data, where: str) -> tuple[dict, dict]:
    """``(tensors, metadata)`` of a safetensors byte string (a suspended transducer stream or encoder stream);
    a ``ValueError`` naming ``where`` when ``data`` is not one. Nothing is unpickled."""
    import json

    from safetensors.torch import load

    try:
        data = bytes(data)
        tensors = load(data)
        (header_bytes,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + header_bytes]).get("__metadata__") or {}
    except Exception as exc:
        raise ValueError(f"{where}: not a suspended stream ({exc})") from None
    return tensors, meta
