"""Fast twin of ``oasr.kv_formats``: every format's quantize / dequantize, vectorised for the torch
backend, plus the twin's part of the format gate.

Each function restates its reference (``oasr.kv_formats.<format>``) the way the kernels compute it
and must store the same bytes: fewer temporaries, in-place arithmetic, and tie fixes instead of a
readable rounding helper. ``tests/test_kv_formats.py`` compares every pair bit for bit on random and
adversarial inputs, and each against an oracle written from the rule (gguf-py's for q8_0).

Gate: ``check_format_supported(name, head_dim, device, dtype=, backend=)`` raises the ``ValueError``
an op would raise, naming the formats that would serve instead, so a pool refuses at construction.
"""

from __future__ import annotations

import torch

from oasr.fast.backend import choose_backend
from oasr.kv_formats import FORMATS, KERNEL_FORMATS, KERNEL_HEAD_DIMS, get_format
from oasr.kv_formats.fp8_e4m3 import FP8_DTYPE, MODEL_DTYPES, saturation_bound


def _refuse_nan(x: torch.Tensor, name: str, checked: bool = False) -> None:
    if not checked and x.is_floating_point() and bool(x.isnan().any()):
        raise ValueError(f"{name}.quantize: the input holds NaN; K/V must be numbers")


def _model(x: torch.Tensor, model_dtype: torch.dtype | None) -> torch.dtype:
    return model_dtype or (x.dtype if x.dtype in MODEL_DTYPES else torch.float32)


def quantize_int8(x: torch.Tensor, model_dtype: torch.dtype | None = None, *, nan_checked: bool = False):
    """int8: ``(q int8, scale fp32 per vector)``; scale = max(amax / 127, 2**-149), q = rne(x / scale)."""
    _refuse_nan(x, "int8", nan_checked)
    xf = x.to(_model(x, model_dtype)).to(torch.float32, copy=True)  # ours to change in place
    scale = xf.abs().amax(dim=-1).div_(127).clamp_(min=2.0**-149)
    q = xf.div_(scale.unsqueeze(-1)).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale


def dequantize_int8(stored, scale, dtype=torch.float32):
    """int8: ``float(q) * scale`` in fp32, rounded once to ``dtype``."""
    return stored.float().mul_(scale.unsqueeze(-1)).to(dtype)


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    """roundf from round-half-even: only exact ties differ, and they move away from zero."""
    r = torch.round(y)
    tie = (y - torch.trunc(y)).abs() == 0.5
    return torch.where(tie, torch.trunc(y) + torch.sign(y), r)


def quantize_q8_0(x: torch.Tensor, model_dtype: torch.dtype | None = None, *, nan_checked: bool = False):
    """q8_0 (GGML): ``(q int8, d fp16 per block of 32)``; q from the fp32 d through id = 1 / d."""
    _refuse_nan(x, "q8_0", nan_checked)
    D = x.shape[-1]
    if D % 32:
        raise ValueError(f"q8_0 K/V pages: head_dim must be a multiple of 32 (GGML blocks), got {D}")
    blocks = x.to(_model(x, model_dtype)).to(torch.float32, copy=True).reshape(*x.shape[:-1], D // 32, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True).div_(127)
    inverse = torch.reciprocal(d).masked_fill_(d == 0, 0.0)
    y = blocks.mul_(inverse)
    q = _round_half_away(y).nan_to_num_(0.0, 0.0, 0.0)  # 1/d overflowed (subnormal blocks): q = 0
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1).to(torch.float16)


def dequantize_q8_0(stored, scale, dtype=torch.float32):
    """q8_0: ``float(q) * float(d)`` per block of 32 in fp32, rounded once to ``dtype``."""
    D = stored.shape[-1]
    blocks = stored.float().reshape(*stored.shape[:-1], D // 32, 32)
    return blocks.mul_(scale.float().unsqueeze(-1)).reshape(stored.shape).to(dtype)


def quantize_affine4(x: torch.Tensor, model_dtype: torch.dtype | None = None, group: int = 32, *,
                     nan_checked: bool = False):
    """affine4 (MLX's rule): ``(packed uint8 codes, (groups, 2) scale/bias in the model dtype)``."""
    _refuse_nan(x, "affine4", nan_checked)
    D = x.shape[-1]
    if D % group:
        raise ValueError(f"affine4 K/V pages: head_dim must be a multiple of the group size {group}, got {D}")
    dtype = _model(x, model_dtype)
    g = x.to(dtype).to(torch.float32, copy=True).reshape(*x.shape[:-1], D // group, group)
    lo, hi = torch.aminmax(g, dim=-1, keepdim=True)
    scale = (hi - lo).div_(15).to(dtype).float()
    bias = lo.to(dtype).float()
    scale.masked_fill_(scale == 0, 0.0)  # a zero scale or bias is stored as +0, whichever zero aminmax gave
    bias.masked_fill_(bias == 0, 0.0)
    flat = scale == 0
    codes = g.sub_(bias).div_(scale.masked_fill(flat, 1.0)).round_().clamp_(0, 15).masked_fill_(flat, 0.0)
    pairs = codes.to(torch.uint8).reshape(*x.shape[:-1], D // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed, torch.stack([scale.squeeze(-1), bias.squeeze(-1)], dim=-1).to(dtype)


def dequantize_affine4(stored, params, dtype=torch.float32):
    """affine4: ``float(q) * scale + bias`` per group in fp32, rounded once to ``dtype``."""
    codes = torch.stack([stored & 0x0F, stored >> 4], dim=-1).reshape(*stored.shape[:-1], -1).float()
    G = params.shape[-2]
    groups = codes.reshape(*codes.shape[:-1], G, codes.shape[-1] // G)
    out = groups.mul_(params[..., 0:1].float()).add_(params[..., 1:2].float())
    return out.reshape(codes.shape).to(dtype)


# -- fp8 (e4m3): the fast twin's vectorised form of oasr.kv_formats.fp8_e4m3 --------------------------


def fp8_scales(amax: torch.Tensor, model_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-vector fp32 scales for absolute maxima ``amax`` (clamped first to ``saturation_bound(model_dtype)``):
    the least power of two ``s`` with ``amax / s <= 448``, at least 2**-149, and 1 for ``amax == 0``
    (the rule of ``oasr.kv_formats.fp8_e4m3``).

    The kernels' exponent arithmetic (``fp8_scale`` in oasr/kernels_cu/common.cuh), vectorised:
    ``amax = 1.f * 2**e`` gives ``s = 2**(e - 8)`` when ``1.f <= 1.75`` (fraction bits <= 0x600000),
    else ``2**(e - 7)``; fp32 denormals are scaled by 2**64 first. NaN maxima get 1 (not specified).
    """
    amax = amax.float().clamp(max=saturation_bound(model_dtype)).contiguous()
    tiny = amax < 2.0**-126
    bits = torch.where(tiny, amax * 2.0**64, amax).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 - torch.where(tiny, 64, 0).to(torch.int32)
    k = (exponent - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)).clamp(min=-149)
    normal = (k.clamp(min=-126) + 127) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    scale = torch.where(k >= -126, normal, subnormal).view(torch.float32)
    return torch.where(amax > 0, scale, 1.0)


def quantize_fp8(x: torch.Tensor, model_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 data of x's shape, fp32 scales of x.shape[:-1])``, one scale per vector along the last dim.

    ``model_dtype`` (default ``x``'s own) sets the saturation bound: values are clamped to
    ``+-saturation_bound(model_dtype)`` first, so every one dequantizes to a finite value
    (``oasr.kv_formats.fp8_e4m3``).
    """
    if model_dtype is None:
        model_dtype = x.dtype
    bound = saturation_bound(model_dtype)
    x = x.float().clamp(-bound, bound)
    scale = fp8_scales(x.abs().amax(dim=-1))
    return (x / scale.unsqueeze(-1)).to(FP8_DTYPE), scale


def dequantize_fp8(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``stored.float() * scale`` in fp32, rounded once to ``dtype``."""
    return (stored.float() * scale.unsqueeze(-1)).to(dtype)


def quantize(fmt: str, x: torch.Tensor, model_dtype: torch.dtype | None = None, *, nan_checked: bool = False):
    """``(data, scale)`` of format ``fmt`` (scale None for the model dtype). ``nan_checked``: the caller
    refused NaN already (``oasr.cache.validate.check_kv_numbers``), so the formats that refuse it skip
    their own look (a second pass over ``x``)."""
    f = get_format(fmt)
    if f.name == "model":
        return x.to(_model(x, model_dtype)), None
    if f.name == "fp8_e4m3":
        return quantize_fp8(x, _model(x, model_dtype))
    if f.name == "int8":
        return quantize_int8(x, model_dtype, nan_checked=nan_checked)
    if f.name == "q8_0":
        return quantize_q8_0(x, model_dtype, nan_checked=nan_checked)
    return quantize_affine4(x, model_dtype, group=f.group, nan_checked=nan_checked)


def dequantize(fmt: str, stored: torch.Tensor, scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``stored`` (with its ``scale``) in format ``fmt`` back to values in ``dtype``."""
    name = get_format(fmt).name
    if name == "model":
        return stored.to(dtype)
    if name in ("fp8_e4m3",):
        return dequantize_fp8(stored, scale, dtype)
    if name == "int8":
        return dequantize_int8(stored, scale, dtype)
    if name == "q8_0":
        return dequantize_q8_0(stored, scale, dtype)
    return dequantize_affine4(stored, scale, dtype)


def check_format_supported(
    fmt: str | None, head_dim: int, device: torch.device | str, *, dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> None:
    """Raise ``ValueError`` if the fast twin cannot serve K/V pages of ``fmt`` at ``head_dim`` (model
    ``dtype``) on ``device`` with ``backend`` (default: what a call without ``backend=`` would use now).
    The kernels ("cuda", "emulated") serve ``KERNEL_FORMATS`` at head_dim in ``KERNEL_HEAD_DIMS``; the
    torch backend every format whose rule cuts ``head_dim``. The message names what would serve."""
    f = get_format(fmt)
    if dtype is not None:
        f.check_geometry(int(head_dim), dtype)
    name = choose_backend(torch.device(device), backend)
    if name == "torch":
        return
    if f.name not in KERNEL_FORMATS:
        raise ValueError(f"K/V format {f.name!r}: the {name!r} kernels have no pages of this format; they "
                         f"serve {list(KERNEL_FORMATS)} (or use the torch backend)")
    if int(head_dim) not in KERNEL_HEAD_DIMS:
        raise ValueError(f"K/V format {f.name!r}: the {name!r} kernels tile head_dim in {KERNEL_HEAD_DIMS}, got "
                         f"head_dim={head_dim}; the torch backend (backend='torch') serves it")


def supported_matrix(head_dims=(64, 80, 128), device: torch.device | str = "cpu", dtype=torch.float16):
    """``{(format, head_dim, backend): None or the refusal}`` for ``python -m oasr formats``."""
    device = torch.device(device)
    backends = ("torch", "emulated") if device.type == "cpu" else ("cuda",)
    out = {}
    for name in FORMATS:
        for d in head_dims:
            for b in backends:
                try:
                    check_format_supported(name, d, device, dtype=dtype, backend=b)
                    out[(name, d, b)] = None
                except ValueError as exc:
                    out[(name, d, b)] = str(exc)
    return out
