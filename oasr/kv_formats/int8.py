"""int8 K/V pages: symmetric, one fp32 scale per vector. The rule, stated once, and its readable code.

Rule, for each vector ``x`` of ``head_dim`` values (one frame, one KV head), in fp32::

    amax   = max |x|
    scale  = max(amax / 127, 2**-149)        fp32 division, rounded to nearest; stored as fp32 (4 bytes)
    q      = clamp(round_half_even(x / scale), -127, 127)     stored as int8 (-128 is never used)
    x'     = float(q) * scale, rounded to the model dtype

How the scale is chosen: the largest magnitude maps to +-127, so the whole int8 range
(symmetric, no zero point) covers the vector and a value's error is at most ``scale / 2 =
amax / 254``. The floor ``2**-149`` (fp32's smallest subnormal) keeps ``x / scale`` finite for
vectors of fp32/bf16 subnormals; a zero vector gets that floor and stores zeros. Unlike fp8's
power-of-two scale, ``x / scale`` is a rounded division: the stored bytes are those of that
IEEE fp32 division rounded half to even, which the tests' numpy oracle recomputes.

Bytes per vector: ``head_dim + 4``. Both twins and the kernels follow this rule:
``oasr.fast.kv_formats.quantize_int8`` and ``paged_kv_append_quant_kernel<T, Int8Page, D>``.
NaN inputs are refused by ``quantize`` (ValueError; the twins' ``append_kv`` before anything is written;
what the kernels store instead is in ``oasr.fast.paged_ops``); infinite ones are outside the rule.
"""

from __future__ import annotations

import torch

from oasr.kv_formats.model import quantize as _to_model

NAME = "int8"
QMAX = 127
MIN_SCALE = 2.0**-149


def _check_finite_or_inf(x: torch.Tensor, name: str) -> None:
    if bool(torch.isnan(x).any()):
        raise ValueError(f"{name}.quantize: the input holds NaN; K/V must be numbers")


def quantize(x: torch.Tensor, model_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 data of x's shape, fp32 scales of x.shape[:-1])``, one scale per vector (last dim)."""
    _check_finite_or_inf(x, NAME)
    x = _to_model(x, model_dtype)[0].float()
    amax = x.abs().amax(dim=-1)
    scale = torch.clamp(amax / QMAX, min=MIN_SCALE)
    q = torch.round(x / scale.unsqueeze(-1)).clamp(-QMAX, QMAX)  # torch.round: half to even
    return q.to(torch.int8), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(q) * scale`` in fp32, rounded once to ``dtype``."""
    return (stored.float() * scale.unsqueeze(-1)).to(dtype)
