"""Compatibility import: the fp8 (e4m3) rule now lives in ``oasr.kv_formats.fp8_e4m3``.

Every name this module exported before is re-exported unchanged, so ``from oasr.fp8 import quantize``
keeps working; new code imports ``oasr.kv_formats``.
"""

from oasr.kv_formats.fp8_e4m3 import (  # noqa: F401
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    MODEL_DTYPES,
    dequantize,
    fp8_scales,
    quantize,
    saturation_bound,
)
