"""K/V page formats: what a page stores per (frame, KV head) vector, one module per format.

Each format states its rule once, in its module, with the readable torch code the reference
twin runs (``quantize(x, model_dtype) -> (data, scale)``, ``dequantize(data, scale, dtype)``);
the fast twin restates it vectorised in ``oasr.fast.kv_formats`` and the kernels in
``kernels_cu/kv_formats.cuh``. Both must store the same bytes. This package adds what is common:
the table of formats, their storage (``KVFormat``), bytes per vector, and the format gate.

Formats, per vector of ``D = head_dim`` values of a model in dtype ``M`` (``e`` = sizeof(M))::

    name          data                     scale plane (per vector)            bytes per vector
    model         D values of M            none                                D * e
    fp8_e4m3      D e4m3 bytes             1 fp32 (a power of two)             D + 4
    int8          D int8                   1 fp32 (amax / 127)                 D + 4
    q8_0          D int8                   D/32 fp16 (GGML blocks of 32)       D * 34 / 32
    affine4       D/2 bytes (two 4-bit)    (D/32, 2) of M: scale, bias         D / 2 + 4 * e * D / 64
    affine4_g64   D/2 bytes (two 4-bit)    (D/64, 2) of M: scale, bias         D / 2 + 2 * e * D / 64

A pool holds ``k_pool``/``v_pool`` of ``(..., n_kv_head, data_dim)`` in ``data_dtype`` and, for
a quantized format, ``k_scale``/``v_scale`` of ``(..., n_kv_head, *scale_shape)`` in
``scale_dtype(M)`` (fp8 and int8: ``(..., n_kv_head)`` fp32, as fp8 pages always had).

The gate. ``CacheConfig(kv_cache_dtype=name)`` accepts ``None``/``"model"``, ``"auto"`` or a
name above, and refuses anything else, and a geometry the format cannot cut (``check_geometry``).
``"auto"`` resolves per device (``auto_format``)::

    device                                  auto picks     why
    cpu                                     model          memory is not the constraint; no dequantize cost
    cuda, compute capability >= 8.9         fp8_e4m3       hardware e4m3 conversion; 1.9x blocks per byte
    cuda, compute capability <  8.9         int8           e4m3 is a software conversion there; same bytes
    (any pick the kernels cannot tile for this head_dim / dtype falls back to model)

The twin and backend part of the gate (``oasr.fast.kv_formats.check_format_supported``) runs when
a fast pool is built: the kernels serve the formats in ``KERNEL_FORMATS`` at head_dim 64 or 128;
the torch backend and the reference serve every format at any head_dim its rule can cut.
``python -m oasr formats`` prints the matrix for this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from oasr.kv_formats import affine4, fp8_e4m3, int8, model, q8_0
from oasr.kv_formats.fp8_e4m3 import MODEL_DTYPES

# Formats the CUDA kernels (and their CPU emulation) quantize, read and gather.
KERNEL_FORMATS = ("model", "fp8_e4m3", "int8", "q8_0", "affine4", "affine4_g64")
KERNEL_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class KVFormat:
    """One page format: its storage and its rule (``module``'s quantize / dequantize)."""

    name: str
    module: ModuleType
    summary: str
    group: int = 0  # values per scale (0: one scale per vector, or no scale)
    values_per_byte: int = 1  # 2 for 4-bit codes
    params_per_group: int = 1  # affine: scale and bias
    refuses_nan: bool = False  # the rule refuses NaN input (int8, q8_0, affine4); fp8 leaves it unspecified

    @property
    def quantized(self) -> bool:
        """Whether the format stores anything but the model dtype."""
        return self.name != "model"

    def data_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Dtype of the data plane for a model served in ``model_dtype``."""
        return {"model": model_dtype, "fp8_e4m3": fp8_e4m3.FP8_DTYPE, "int8": torch.int8,
                "q8_0": torch.int8}.get(self.name, torch.uint8)

    def data_dim(self, head_dim: int) -> int:
        """Stored data elements per vector of ``head_dim`` values."""
        return head_dim // self.values_per_byte

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        """Per-vector shape of the scale plane: () for one scale, (groups,) or (groups, 2) for affine."""
        if not self.quantized or not self.group:
            return ()
        groups = head_dim // self.group
        return (groups,) if self.params_per_group == 1 else (groups, self.params_per_group)

    def scale_dtype(self, model_dtype: torch.dtype) -> torch.dtype | None:
        """Dtype of the scale plane (None for the model dtype)."""
        return {"model": None, "fp8_e4m3": torch.float32, "int8": torch.float32,
                "q8_0": torch.float16}.get(self.name, model_dtype)

    def bytes_per_vector(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Stored bytes of one (frame, KV head) vector: data plus its scale plane."""
        data = self.data_dim(head_dim) * _itemsize(self.data_dtype(model_dtype))
        if not self.quantized:
            return data
        n = 1
        for s in self.scale_shape(head_dim):
            n *= s
        return data + n * _itemsize(self.scale_dtype(model_dtype))

    def scales_storable(self, scales: torch.Tensor) -> bool:
        """Whether ``scales`` (a scale plane) holds only what this format's append stores from numbers:
        scales >= 0 and finite (0 where a prefilled window was zeroed), q8_0's ``d`` also ``+inf`` (GGML's
        corner for a block with amax >= 127 * 65520), affine biases finite. Loaders refuse anything else."""
        if not self.quantized or not scales.numel():
            return True
        s = scales.float()
        scale = s[..., 0] if self.params_per_group == 2 else s
        finite = torch.isfinite(s) | torch.isposinf(s) if self.name == "q8_0" else torch.isfinite(s)
        return bool((scale >= 0).all() and finite.all())

    def check_geometry(self, head_dim: int, model_dtype: torch.dtype) -> None:
        """``ValueError`` when this format's rule cannot cut a vector of ``head_dim`` (or take ``model_dtype``)."""
        if model_dtype not in MODEL_DTYPES:
            raise ValueError(f"K/V format {self.name!r}: the model dtype must be one of "
                             f"{[str(d) for d in MODEL_DTYPES]}, got {model_dtype}")
        cut = max(self.group, self.values_per_byte)
        if cut > 1 and head_dim % cut:
            serves = [f.name for f in FORMATS.values() if head_dim % max(f.group, f.values_per_byte, 1) == 0]
            raise ValueError(f"K/V format {self.name!r} cuts vectors into groups of {cut} values, but head_dim="
                             f"{head_dim} is not a multiple of {cut}; formats that serve head_dim={head_dim}: "
                             f"{serves}")

    def quantize(self, x: torch.Tensor, model_dtype: torch.dtype | None = None):
        """The reference rule: ``(data, scale)`` (``scale`` None for the model dtype)."""
        if self.params_per_group == 2:
            return self.module.quantize(x, model_dtype, group=self.group)
        return self.module.quantize(x, model_dtype)

    def dequantize(self, data: torch.Tensor, scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference rule's inverse: ``data`` and ``scale`` back to values in ``dtype``."""
        return self.module.dequantize(data, scale, dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("model", model, "the model dtype itself (fp32, fp16 or bf16)"),
        KVFormat("fp8_e4m3", fp8_e4m3, "e4m3 bytes, one power-of-two fp32 scale per vector"),
        KVFormat("int8", int8, "symmetric int8, one fp32 scale (amax / 127) per vector", refuses_nan=True),
        KVFormat("q8_0", q8_0, "GGML q8_0: int8 in blocks of 32, one fp16 scale per block", group=32,
                 refuses_nan=True),
        KVFormat("affine4", affine4, "4-bit codes, scale and bias (model dtype) per group of 32",
                 group=32, values_per_byte=2, params_per_group=2, refuses_nan=True),
        KVFormat("affine4_g64", affine4, "4-bit codes, scale and bias (model dtype) per group of 64",
                 group=64, values_per_byte=2, params_per_group=2, refuses_nan=True),
    )
}
FORMAT_NAMES = tuple(FORMATS)


def get_format(name: str | None) -> KVFormat:
    """The format called ``name`` (None: the model dtype); ``KeyError`` naming the known ones."""
    key = "model" if name is None else name
    if key not in FORMATS:
        raise KeyError(f"unknown K/V format {name!r}; known: {list(FORMATS)} (or 'auto')")
    return FORMATS[key]


def auto_format(device: torch.device | str, head_dim: int, model_dtype: torch.dtype,
                capability: tuple[int, int] | None = None) -> str:
    """``"auto"`` for ``device`` (the table in this module's docstring). ``capability`` overrides the CUDA
    device's own (tests pass it; None reads it from torch)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "model"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    pick = "fp8_e4m3" if tuple(capability) >= (8, 9) else "int8"
    if head_dim not in KERNEL_HEAD_DIMS or model_dtype not in MODEL_DTYPES:
        return "model"
    return pick


__all__ = ["FORMATS", "FORMAT_NAMES", "KERNEL_FORMATS", "KERNEL_HEAD_DIMS", "KVFormat", "auto_format", "get_format"]
