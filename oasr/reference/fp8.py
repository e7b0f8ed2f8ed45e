"""Reference fp8 (e4m3) K/V quantization: one power-of-two scale per vector.

Rule, for each vector ``x`` of ``head_dim`` values (one frame, one KV head)::

    amax   = max |x|
    scale  = the least power of two with amax / scale <= 448      (448: e4m3's largest finite value)
    stored = fp8_e4m3(x / scale)         round to nearest even; |x / scale| <= 448 so nothing saturates
    x'     = float(stored) * scale

Defined corner cases (both twins and the kernels follow them):
  * a zero vector (amax == 0) gets scale 1.0; it stores and restores zeros;
  * scales are floored at 2**-149, fp32's smallest power of two, for vectors
    whose amax is below 448 * 2**-149 (only fp32/bf16 denormals get there).

Because a scale is a power of two, ``x / scale`` is exact in fp32, so the
stored bytes equal torch's own ``(x.float() / scale).to(torch.float8_e4m3fn)``,
the independent oracle the tests use. No calibration: a vector's bytes depend
on that vector alone, whatever else is in the batch.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 2.0**-149


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-vector scales (fp32) for absolute maxima ``amax`` (any shape)."""
    a = amax.double()
    _, exponent = torch.frexp(a / FP8_MAX)  # a / 448 = m * 2**e with m in [0.5, 1): 2**e >= a / 448
    scale = torch.ldexp(torch.ones_like(a), exponent)
    scale = torch.where(a / (scale / 2) <= FP8_MAX, scale / 2, scale)  # exact power-of-two tests
    scale = torch.where(a / scale > FP8_MAX, scale * 2, scale)
    scale = scale.clamp(min=MIN_SCALE)
    scale = torch.where(a == 0, torch.ones_like(scale), scale)
    return scale.float()


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stored fp8 of x's shape, fp32 scales of x.shape[:-1])``, per vector along the last dim."""
    x = x.float()
    scale = fp8_scales(x.abs().amax(dim=-1))
    return (x / scale.unsqueeze(-1)).to(FP8_DTYPE), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (stored.float() * scale.unsqueeze(-1)).to(dtype)
