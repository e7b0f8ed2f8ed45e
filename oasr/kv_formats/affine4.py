"""affine4 K/V pages: 4-bit codes with a scale and a bias per group (MLX's affine rule).

A vector of ``head_dim`` values is cut into groups of ``G`` consecutive values (G = 32 for
``affine4``, 64 for ``affine4_g64``). For each group ``x`` of a model in dtype ``M``
(fp32, fp16 or bf16), arithmetic in fp32, ``M(.)`` rounding to nearest even::

    lo, hi = min x, max x                   (-0 and +0 are one value: either may be the min)
    scale  = M((hi - lo) / 15)              stored in the model dtype; a zero is stored as +0
    bias   = M(lo)                          stored in the model dtype; a zero is stored as +0
    q      = 0 if scale == 0 else clamp(round_half_even((x - bias) / scale), 0, 15)
    x'     = float(q) * scale + bias        (fp32: q * scale first, then + bias), rounded to M

Signed zeros. A group's minimum may be ``-0`` or ``+0`` (and ``M(lo)`` of a tiny negative ``lo`` rounds
to ``-0``); which zero a min reduction returns depends on the implementation, so the rule stores a zero
scale or bias as ``+0`` (reference: ``torch.where``, fast twin: the same, kernels: an explicit test).
Every twin stores the same bytes; a dequantized value is the same number either way.

``q`` is computed with the *stored* scale and bias, so dequantization inverts exactly what
was rounded: the error of a value is at most ``scale / 2`` plus what the rounding of the
bias moved (both bounded by the group's range / 30 plus a model-dtype ulp). A constant
group has ``scale = 0`` and restores ``bias``, its value rounded to ``M``.

Storage. Two codes per byte, value ``2i`` in the low nibble of byte ``i`` and ``2i + 1`` in
the high nibble: ``head_dim / 2`` bytes of data. The scale plane holds, per vector,
``(head_dim / G, 2)`` values of the model dtype, ``[..., 0]`` the scale and ``[..., 1]`` the
bias (one interleaved plane, so a kernel reads one group's parameters with one access).
Bytes per vector: ``head_dim / 2 + 2 * (head_dim / G) * sizeof(M)``.

NaN inputs are refused by ``quantize`` (ValueError; the twins' ``append_kv`` before anything is written;
what the kernels store instead is in ``oasr.fast.paged_ops``); infinite ones are outside the rule
(as are groups whose range ``hi - lo`` overflows fp32).
The fast twin is ``oasr.fast.kv_formats.quantize_affine4``; the kernels' is
``paged_kv_append_quant_kernel<T, Affine4Page<T, G>, D>``.
"""

from __future__ import annotations

import torch

from oasr.kv_formats.model import quantize as _to_model

LEVELS = 15  # 4 bits: codes 0..15


def check_head_dim(head_dim: int, group: int) -> None:
    """``ValueError`` unless ``head_dim`` is a multiple of the group size ``group``."""
    if head_dim % group:
        raise ValueError(f"affine4 K/V pages: head_dim must be a multiple of the group size {group}, got {head_dim}")


def quantize(x: torch.Tensor, model_dtype: torch.dtype | None = None, group: int = 32):
    """``(uint8 packed codes of x.shape[:-1] + (D / 2,), params of x.shape[:-1] + (D / G, 2) in M)``."""
    if bool(torch.isnan(x).any()):
        raise ValueError("affine4.quantize: the input holds NaN; K/V must be numbers")
    check_head_dim(x.shape[-1], group)
    x, _ = _to_model(x, model_dtype)
    dtype = x.dtype
    groups = x.float().unflatten(-1, (x.shape[-1] // group, group))  # (..., n_groups, G)
    lo = groups.amin(dim=-1, keepdim=True)
    hi = groups.amax(dim=-1, keepdim=True)
    scale = _plus_zero(((hi - lo) / LEVELS).to(dtype).float())
    bias = _plus_zero(lo.to(dtype).float())
    codes = torch.round((groups - bias) / torch.where(scale == 0, 1.0, scale)).clamp(0, LEVELS)
    codes = torch.where(scale == 0, 0.0, codes).to(torch.uint8).flatten(-2)
    low, high = codes[..., 0::2], codes[..., 1::2]
    packed = low | (high << 4)
    params = torch.cat([scale, bias], dim=-1).to(dtype)  # (..., n_groups, 2)
    return packed, params


def _plus_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every zero as ``+0`` (the rule's signed-zero line)."""
    return torch.where(x == 0, torch.zeros_like(x), x)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes, one per value: ``(..., 2 * bytes)`` uint8 in 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize(stored: torch.Tensor, params: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(q) * scale + bias`` per group in fp32, rounded once to ``dtype``."""
    codes = unpack(stored).float()
    n_groups = params.shape[-2]
    groups = codes.unflatten(-1, (n_groups, codes.shape[-1] // n_groups))
    scale, bias = params[..., 0:1].float(), params[..., 1:2].float()
    return (groups * scale + bias).flatten(-2).to(dtype)
