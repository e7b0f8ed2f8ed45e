"""The model dtype itself: K/V pages stored as the model computes them (fp32, fp16 or bf16).

No quantization: ``quantize(x)`` returns ``x`` in the model dtype and no scale, ``dequantize`` widens.
It is the baseline every other format's error is measured against, and the only format every
twin, device and kernel serves.
"""

from __future__ import annotations

import torch

from oasr.kv_formats.fp8_e4m3 import MODEL_DTYPES

NAME = "model"


def quantize(x: torch.Tensor, model_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, None]:
    """``(x in the model dtype, None)``; ``model_dtype`` defaults to ``x``'s own (a model dtype) or fp32."""
    dtype = model_dtype or (x.dtype if x.dtype in MODEL_DTYPES else torch.float32)
    return x.to(dtype), None


def dequantize(stored: torch.Tensor, scale: None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``stored`` as ``dtype``."""
    return stored.to(dtype)
