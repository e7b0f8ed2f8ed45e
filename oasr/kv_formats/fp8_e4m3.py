"""fp8 (e4m3) K/V quantization: the rule, stated once, and its readable implementation.

Every fp8 user follows this rule: the reference twin (``oasr.reference.fp8`` is
this module), the fast twin's vectorised ``oasr.fast.kv_formats.quantize_fp8``,
and the CUDA kernels (``fp8_saturate`` / ``fp8_scale`` in kernels_cu/common.cuh).
A new fp8 cache (e.g. a decoder's K/V) calls ``quantize(x, model_dtype)`` and
``dequantize(stored, scale, model_dtype)``.

Rule, for each vector ``x`` of ``head_dim`` values (one frame, one KV head) of a
model that runs in dtype ``M`` (fp32, fp16 or bf16)::

    L      = 1.875 * 2**emax(M)    the largest value of 4 significant bits that M holds:
                                   61440 for fp16, 1.875 * 2**127 (about 3.19e38) for fp32 and bf16
    x      = clamp(x, -L, L)       saturate (touches only the top ~6% of M's range)
    amax   = max |x|
    scale  = the least power of two with amax / scale <= 448      (448: e4m3's largest finite value)
    stored = fp8_e4m3(x / scale)   round to nearest even; |x / scale| <= 448 so nothing saturates there
    x'     = float(stored) * scale, rounded to M    (|x'| <= L: finite in M)

Why the clamp. An e4m3 value has 4 significant bits at any scale, so near the
top of ``M`` the nearest representable value above ``x`` is ``2**(emax + 1)``,
which overflows ``M`` to inf (fp16 65000 -> 256 * 256 = 65536 > 65504). Choosing
a larger power-of-two scale does not help: the significand grid is the same
(and only coarser in e4m3's subnormals), so 65000 rounds to 65536 at every
scale. Rounding down is the only finite answer, and clamping the input to ``L``
does exactly that: every finite input dequantizes to a finite value. The clamp
changes no scale (amax in ``[L, max(M)]`` gets the same scale as ``L``) and no
stored byte except where the plain rule rounded up to ``2**(emax + 1)``: values
in ``(L, L + half a step)`` round down to ``L`` either way.

Defined corner cases (both twins and the kernels follow them):
  * a zero vector (amax == 0) gets scale 1.0; it stores and restores zeros;
  * scales are floored at 2**-149, fp32's smallest power of two, for vectors
    whose amax is below 448 * 2**-149 (only fp32/bf16 denormals get there);
  * NaN and infinite inputs are outside the rule (not specified).

Because a scale is a power of two, ``x / scale`` is exact in fp32, so the
stored bytes equal torch's own ``(x.float().clamp(-L, L) / scale).to(torch.float8_e4m3fn)``,
the independent oracle the tests use. No calibration: a vector's bytes depend
on that vector alone, whatever else is in the batch.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 2.0**-149
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def saturation_bound(model_dtype: torch.dtype) -> float:
    """``L`` of the rule: ``1.875 * 2**emax`` of ``model_dtype`` (fp32, fp16 or bf16)."""
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"fp8: the model dtype must be one of {[str(d) for d in MODEL_DTYPES]}, got {model_dtype}")
    emax = math.floor(math.log2(torch.finfo(model_dtype).max))
    return 1.875 * 2.0**emax


def _model_dtype(x: torch.Tensor, model_dtype: torch.dtype | None) -> torch.dtype:
    """``model_dtype``, or ``x``'s own dtype when it is a model dtype, else fp32."""
    if model_dtype is not None:
        return model_dtype
    return x.dtype if x.dtype in MODEL_DTYPES else torch.float32


def fp8_scales(amax: torch.Tensor, model_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-vector scales (fp32) for absolute maxima ``amax`` (any shape), ``amax`` clamped to ``L`` first."""
    a = amax.double().clamp(max=saturation_bound(model_dtype))
    _, exponent = torch.frexp(a / FP8_MAX)  # a / 448 = m * 2**e with m in [0.5, 1): 2**e >= a / 448
    scale = torch.ldexp(torch.ones_like(a), exponent)
    scale = torch.where(a / (scale / 2) <= FP8_MAX, scale / 2, scale)  # exact power-of-two tests
    scale = torch.where(a / scale > FP8_MAX, scale * 2, scale)
    scale = scale.clamp(min=MIN_SCALE)
    scale = torch.where(a == 0, torch.ones_like(scale), scale)
    return scale.float()


def quantize(x: torch.Tensor, model_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stored fp8 of x's shape, fp32 scales of x.shape[:-1])``, per vector along the last dim.

    ``model_dtype``: the dtype the values are served in (default: ``x``'s own, if a model dtype,
    else fp32); it sets the saturation bound ``L``.
    """
    bound = saturation_bound(_model_dtype(x, model_dtype))
    x = x.float().clamp(-bound, bound)
    scale = fp8_scales(x.abs().amax(dim=-1))
    return (x / scale.unsqueeze(-1)).to(FP8_DTYPE), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``stored.float() * scale`` in fp32, rounded once to ``dtype`` (finite for the rule's stored values)."""
    return (stored.float() * scale.unsqueeze(-1)).to(dtype)
