"""The kernels in ``oasr/kernels_cu/``: their families, parameters and instantiations.

One entry per ``__global__`` template. Both executors read this list: NVRTC
compiles each family's source with the instantiations as name expressions, and
the host emulation build generates one ``extern "C"`` launcher per
instantiation from the same parameter list, so the two cannot drift apart.

Parameter kinds::

    ptr   a device (or, emulated, host) address: a tensor's data_ptr(), or 0
    i32   a 32-bit int   (NVRTC: np.int32; emulated: ctypes.c_int32)
    f32   a 32-bit float (NVRTC: np.float32; emulated: ctypes.c_float)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# The .cu sources ship inside the package (oasr/kernels_cu/, package data), so an installed wheel and an
# editable checkout read them the same way; OASR_KERNELS_DIR overrides.
KERNELS_DIR = Path(os.environ.get("OASR_KERNELS_DIR") or Path(__file__).resolve().parents[2] / "kernels_cu")
SHARED_HEADERS = ("common.cuh", "warp_mma.cuh", "attention_window.cuh", "kv_formats.cuh")
EMULATION_HEADERS = ("emu/simt_emu.h", "emu/warp_emu.h")

# Template arguments for each dtype the kernels take.
DTYPE_ARG = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
# fp8 pages (CacheConfig(kv_cache_dtype="fp8_e4m3")): e4m3 data plus one fp32 scale per vector.
FP8_ARG = "__nv_fp8_e4m3"
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
# Copy kernels move bytes: 16-byte units when sizes and addresses allow, else 2.
UNIT_ARG = {16: "oasr::Bytes16", 2: "unsigned short"}
HEAD_DIMS = (64, 128)
FP8_HEAD_DIMS = HEAD_DIMS  # the fp8 kernels tile the same head dims
# The other quantized page formats (oasr.kv_formats; tags in kernels_cu/kv_formats.cuh): append
# (paged_kv_append_quant_kernel), attention v1 and gather (gather_kv_blocks_quant_kernel).
QUANT_FORMATS = ("int8", "q8_0", "affine4", "affine4_g64")


def page_arg(fmt: str, dtype_arg: str) -> str:
    """The Page template argument of format ``fmt`` (a QUANT_FORMATS name) for a model dtype's argument."""
    return {"int8": "oasr::Int8Page", "q8_0": "oasr::Q8_0Page", "affine4": f"oasr::Affine4Page<{dtype_arg}, 32>",
            "affine4_g64": f"oasr::Affine4Page<{dtype_arg}, 64>"}[fmt]


@dataclass(frozen=True)
class Kernel:
    name: str  # the C++ template, namespace included
    family: str  # source file stem in oasr/kernels_cu/
    params: tuple[tuple[str, str], ...]  # (name, kind)
    instances: tuple[tuple[str, ...], ...]  # template argument lists

    def name_expression(self, targs: tuple[str, ...]) -> str:
        """The C++ name of one instantiation, e.g. ``oasr::k<float, 64>`` (NVRTC's name expression)."""
        return f"{self.name}<{', '.join(targs)}>"

    def emu_symbol(self, targs: tuple[str, ...]) -> str:
        """The extern "C" launcher the emulation build exports for one instantiation."""
        tail = "_".join(re.sub(r"[^0-9A-Za-z]+", "", a) for a in targs)
        return f"oasr_emu_{short_name(self)}__{tail}"


def short_name(kernel: Kernel) -> str:
    """The template's name without its namespace, the key of ``BY_NAME``."""
    return kernel.name.split("::")[-1]


_COPY_UNITS = tuple((u,) for u in UNIT_ARG.values())
_DTYPE_HEAD = tuple((t, str(d)) for t in DTYPE_ARG.values() for d in HEAD_DIMS)
_DTYPE_FP8_HEAD = tuple((t, str(d)) for t in DTYPE_ARG.values() for d in FP8_HEAD_DIMS)
# Attention: (model dtype, page type, head_dim), pages in the model dtype or in fp8.
_ATTENTION = tuple((t, page, str(d)) for t in DTYPE_ARG.values() for page in (t, FP8_ARG) for d in HEAD_DIMS)
_ATTENTION_QUANT = tuple(
    (t, page_arg(f, t), str(d)) for t in DTYPE_ARG.values() for f in QUANT_FORMATS for d in HEAD_DIMS
)
_QUANT_HEAD = _ATTENTION_QUANT  # (model dtype, page, head_dim): append's instances too

# Attention v2 (tensor cores): 16-bit model dtypes only, block size a template parameter.
V2_DTYPE_ARG = {t: a for t, a in DTYPE_ARG.items() if t != torch.float32}
V2_BLOCK_SIZES = (8, 16, 32, 64)
_ATTENTION_V2 = tuple(
    (t, page, str(d), str(bs))
    for t in V2_DTYPE_ARG.values()
    for page in (t, FP8_ARG)
    for d in HEAD_DIMS
    for bs in V2_BLOCK_SIZES
)

_ATTENTION_KERNEL_PARAMS = (
    ("q", "ptr"),
    ("k_cache", "ptr"),
    ("v_cache", "ptr"),
    ("k_scale", "ptr"),
    ("v_scale", "ptr"),
    ("block_table", "ptr"),
    ("table_stride", "i32"),
    ("cache_seqlens", "ptr"),
    ("cache_seqstarts", "ptr"),
    ("chunk_lens", "ptr"),
    ("out", "ptr"),
    ("part_acc", "ptr"),
    ("part_ml", "ptr"),
    ("n_head", "i32"),
    ("n_kv_head", "i32"),
    ("num_frames", "i32"),
    ("block_size", "i32"),
    ("num_splits", "i32"),
    ("split_len", "i32"),
    ("scale_log2", "f32"),
    ("causal", "i32"),
)
# The relative-position term (oasr/cache/rel_bias.py): v1 and v3 take its float32 (B, n_head, T, rel_len) table;
# their instances with the template flag kRel = true read it (REL_ARG), the others are the kernels without it.
REL_PARAMS = (("rel_bias", "ptr"), ("rel_len", "i32"))
REL_ARG = "true"

# appends and gathers of pages with per-vector scales (fp8, and the quantized formats) take the same arguments
_SCALED_APPEND_PARAMS = (
    ("k_chunk", "ptr"),
    ("v_chunk", "ptr"),
    ("k_cache", "ptr"),
    ("v_cache", "ptr"),
    ("k_scale", "ptr"),
    ("v_scale", "ptr"),
    ("block_table", "ptr"),
    ("table_stride", "i32"),
    ("cache_seqlens", "ptr"),
    ("chunk_lens", "ptr"),
    ("batch", "i32"),
    ("num_frames", "i32"),
    ("block_size", "i32"),
    ("n_kv_head", "i32"),
)
_SCALED_GATHER_PARAMS = (
    ("k_pool", "ptr"),
    ("v_pool", "ptr"),
    ("k_scale", "ptr"),
    ("v_scale", "ptr"),
    ("out", "ptr"),
    ("block_ids", "ptr"),
    ("start", "i32"),
    ("num_frames", "i32"),
    ("num_layers", "i32"),
    ("num_pool_blocks", "i32"),
    ("block_size", "i32"),
    ("n_kv_head", "i32"),
    ("head_dim", "i32"),
)
_ATTENTION_V2_PARAMS = tuple(p for p in _ATTENTION_KERNEL_PARAMS if p[0] != "block_size")  # v2, v3: a template argument
_ATTENTION_V3_PARAMS = _ATTENTION_V2_PARAMS + REL_PARAMS

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        name="oasr::paged_kv_append_kernel",
        family="paged_kv_append",
        params=(
            ("k_chunk", "ptr"),
            ("v_chunk", "ptr"),
            ("k_cache", "ptr"),
            ("v_cache", "ptr"),
            ("block_table", "ptr"),
            ("table_stride", "i32"),
            ("cache_seqlens", "ptr"),
            ("chunk_lens", "ptr"),
            ("batch", "i32"),
            ("num_frames", "i32"),
            ("block_size", "i32"),
            ("units_per_frame", "i32"),
        ),
        instances=_COPY_UNITS,
    ),
    Kernel(
        name="oasr::paged_kv_append_fp8_kernel",
        family="paged_kv_append",
        params=_SCALED_APPEND_PARAMS,
        instances=_DTYPE_FP8_HEAD,
    ),
    Kernel(
        name="oasr::paged_kv_append_quant_kernel",
        family="paged_kv_append",
        params=_SCALED_APPEND_PARAMS,
        instances=_QUANT_HEAD,
    ),
    Kernel(
        name="oasr::paged_chunk_attention_kernel",
        family="paged_chunk_attention",
        params=_ATTENTION_KERNEL_PARAMS + REL_PARAMS,
        instances=_ATTENTION + _ATTENTION_QUANT + tuple((*a, REL_ARG) for a in _ATTENTION + _ATTENTION_QUANT),
    ),
    Kernel(
        name="oasr::paged_chunk_attention_v2_kernel",
        family="paged_chunk_attention_v2",
        params=_ATTENTION_V2_PARAMS,
        instances=_ATTENTION_V2,
    ),
    Kernel(  # v3: v2's instantiations (a power-of-two block size, a template argument), each also with kRel
        name="oasr::paged_chunk_attention_v3_kernel",
        family="paged_chunk_attention_v3",
        params=_ATTENTION_V3_PARAMS,
        instances=_ATTENTION_V2 + tuple((*a, REL_ARG) for a in _ATTENTION_V2),  # and the relative-position term's
    ),
    Kernel(
        name="oasr::paged_attention_combine_kernel",
        family="paged_chunk_attention",
        params=(
            ("part_acc", "ptr"),
            ("part_ml", "ptr"),
            ("out", "ptr"),
            ("num_rows", "i32"),
            ("num_splits", "i32"),
        ),
        instances=_DTYPE_HEAD,
    ),
    Kernel(
        name="oasr::gather_kv_blocks_kernel",
        family="gather_kv_blocks",
        params=(
            ("k_pool", "ptr"),
            ("v_pool", "ptr"),
            ("out", "ptr"),
            ("block_ids", "ptr"),
            ("start", "i32"),
            ("num_frames", "i32"),
            ("num_layers", "i32"),
            ("num_pool_blocks", "i32"),
            ("block_size", "i32"),
            ("n_kv_head", "i32"),
            ("units_per_row", "i32"),
        ),
        instances=_COPY_UNITS,
    ),
    Kernel(
        name="oasr::gather_kv_blocks_fp8_kernel",
        family="gather_kv_blocks",
        params=_SCALED_GATHER_PARAMS,
        instances=tuple((t,) for t in DTYPE_ARG.values()),
    ),
    Kernel(
        name="oasr::gather_kv_blocks_quant_kernel",
        family="gather_kv_blocks",
        params=_SCALED_GATHER_PARAMS,
        instances=tuple((t, page_arg(f, t)) for t in DTYPE_ARG.values() for f in QUANT_FORMATS),
    ),
)

BY_NAME = {short_name(k): k for k in KERNELS}

# CUDA's grid limits (every arch the kernels target): x up to 2**31 - 1 blocks, y and z up to 65535.
MAX_GRID = (2**31 - 1, 65535, 65535)


def check_grid(kernel: Kernel, grid) -> None:
    """``ValueError`` unless every grid dimension lies in ``[1, MAX_GRID[axis]]``. Both executors call it
    before launching, so the emulator refuses what a GPU would."""
    for axis, n, limit in zip("xyz", grid, MAX_GRID, strict=True):
        if not 1 <= int(n) <= limit:
            raise ValueError(
                f"{kernel.name}: grid {axis} = {int(n)} is outside CUDA's [1, {limit}] (grid {tuple(grid)})"
            )


def families() -> list[str]:
    """Every kernel family (source file stem), sorted."""
    return sorted({k.family for k in KERNELS})


def kernels_of(family: str) -> list[Kernel]:
    """The registered kernels of one family."""
    return [k for k in KERNELS if k.family == family]


def source_path(family: str) -> Path:
    """The family's ``.cu`` file in ``KERNELS_DIR``."""
    return KERNELS_DIR / f"{family}.cu"


def read_sources(family: str, *, emulation: bool = False) -> dict[str, str]:
    """The texts a build of ``family`` depends on, by path relative to oasr/kernels_cu/ (for cache keys)."""
    names = [f"{family}.cu", *SHARED_HEADERS, *(EMULATION_HEADERS if emulation else ())]
    return {name: (KERNELS_DIR / name).read_text() for name in names}


_ATTENTION_PARAMS = {"q", "k_cache", "v_cache", "block_table", "out"}
_VERSION = re.compile(r"_v(\d+)$")


def attention_kernels() -> list[Kernel]:
    """The paged chunk attention kernels, one per version, in version order.

    An attention kernel is any registered kernel that takes queries, the K/V pool, a block table and
    an output (its split-K combine kernel does not); its version is its family's ``_vN`` suffix, 1
    without one (``paged_chunk_attention`` is v1). Tools and tests that compare versions key on this,
    so a new version shows up in them by being registered.
    """
    found = [k for k in KERNELS if _ATTENTION_PARAMS <= {name for name, _ in k.params}]
    return sorted(found, key=kernel_version)


def kernel_version(kernel: Kernel) -> int:
    """An attention kernel's version: its family's ``_vN`` suffix, 1 without one."""
    m = _VERSION.search(kernel.family)
    return int(m.group(1)) if m else 1
