"""Reference fp8 (e4m3) K/V quantization: the shared rule module ``oasr.kv_formats.fp8_e4m3`` itself.

The rule (one power-of-two scale per vector, inputs saturated at the model
dtype's ``L``) is stated once, in ``oasr.kv_formats.fp8_e4m3``; its readable implementation
there is the reference twin's. The fast twin's vectorised restatement is
``oasr.fast.kv_formats.quantize_fp8``, the kernels' ``fp8_scale`` in
oasr/kernels_cu/common.cuh.
"""

from oasr.kv_formats.fp8_e4m3 import FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize, fp8_scales, quantize, saturation_bound

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "dequantize", "fp8_scales", "quantize", "saturation_bound"]
