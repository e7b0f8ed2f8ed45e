"""q8_0 K/V pages: GGML's block format. The rule, stated once, and its readable code.

A vector of ``head_dim`` values is cut into blocks of 32 consecutive values. For each block
``x`` (the values widened exactly to fp32, all arithmetic fp32)::

    amax = max |x|
    d    = amax / 127                      rounded fp32 division
    id   = 0 if d == 0 else 1 / d          rounded fp32 division
    q    = roundf(x * id)                  round half AWAY from zero (C's roundf), int8
           (where x * id is not finite, i.e. 1/d overflowed for a block of fp32/bf16
            subnormals, q = 0: its fp16 d is 0, so the block restores zeros either way)
    stored d = fp16(d)                     round to nearest even; 2 bytes
    x'   = float(q) * float(stored d), rounded to the model dtype

Note the two details that make the bytes GGML's: ``q`` is computed from the fp32 ``d`` (not
the stored fp16 one) through the reciprocal ``id``, and it rounds half away from zero.
The GGML byte layout of one block is ``fp16 d`` (little endian) then the 32 ``int8 q``:
34 bytes per 32 values. A page keeps the ``q`` of a vector contiguous and its
``head_dim / 32`` fp16 ``d`` in the scale plane; ``to_ggml_blocks`` interleaves them into
GGML's layout, which the tests compare byte for byte with gguf-py's ``Q8_0`` quantizer.

Corner cases (GGML's own): a zero block stores ``d = 0`` and zeros; a block with
``amax >= 127 * 65520`` (about 8.3e6, beyond fp16's range for d) stores ``d = inf`` and
restores non-finite values, exactly as GGML does: q8_0 is for K/V well inside fp16's range.
NaN inputs are refused by ``quantize`` (ValueError; the twins' ``append_kv`` before anything is written;
what the kernels store instead is in ``oasr.fast.paged_ops``). A stored ``d = inf`` is saved and
loaded like any other scale (``oasr.sessions.format``).

Bytes per vector: ``head_dim * 34 / 32``; ``head_dim`` must be a multiple of 32.
The fast twin is ``oasr.fast.kv_formats.quantize_q8_0``; the kernels' is
``paged_kv_append_quant_kernel<T, Q8_0Page, D>``.
"""

from __future__ import annotations

import torch

from oasr.kv_formats.model import quantize as _to_model

NAME = "q8_0"
BLOCK = 32


def check_head_dim(head_dim: int) -> None:
    """``ValueError`` unless ``head_dim`` is a multiple of the block size (32)."""
    if head_dim % BLOCK:
        raise ValueError(f"q8_0 K/V pages: head_dim must be a multiple of {BLOCK} (GGML blocks), got {head_dim}")


def roundf(y: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: nearest integer, halves away from zero (exact for every finite fp32)."""
    a = y.abs()
    whole = torch.floor(a)
    return torch.sign(y) * (whole + (a - whole >= 0.5).float())


def quantize(x: torch.Tensor, model_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 q of x's shape, fp16 d of x.shape[:-1] + (head_dim // 32,))``."""
    if bool(torch.isnan(x).any()):
        raise ValueError("q8_0.quantize: the input holds NaN; K/V must be numbers")
    check_head_dim(x.shape[-1])
    x = _to_model(x, model_dtype)[0].float()
    blocks = x.unflatten(-1, (x.shape[-1] // BLOCK, BLOCK))  # (..., n_blocks, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    y = blocks * inverse
    q = torch.where(torch.isfinite(y), roundf(y), torch.zeros_like(y))
    return q.to(torch.int8).flatten(-2), d.squeeze(-1).half()


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(q) * float(d)`` per block in fp32, rounded once to ``dtype``."""
    blocks = stored.float().unflatten(-1, (stored.shape[-1] // BLOCK, BLOCK))
    return (blocks * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def to_ggml_blocks(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """GGML's bytes: ``(n_blocks, 34)`` uint8, each block its fp16 ``d`` (little endian) then 32 ``q``."""
    q = stored.reshape(-1, BLOCK).view(torch.uint8)
    d = scale.reshape(-1, 1).contiguous().view(torch.uint8)  # (n_blocks, 2) on a little-endian host
    return torch.cat([d, q], dim=1)
