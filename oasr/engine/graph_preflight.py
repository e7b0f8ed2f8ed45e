"""Before any CUDA-graph capture: would every layer of the chunk step be served by a kernel?

A call that reaches a declared kernel gap (``oasr.fast.kernel_policy.KERNEL_GAPS``) is served by the reference's
torch code, which reads host values: inside a capture it raises (``serve_gap(capturing=True)``). So an engine asks
here first, from the cache geometry alone (no tensor, no device), and runs its chunk step eager when the answer is
a reason, logged once. The decision is the kernels' (the CUDA ones and their CPU emulation tile the same shapes),
so it is the same on the CPU with a stand-in capture as on a GPU.

Covered: the paged attention of every layer (``head_dim`` and the page dtype for model-dtype pages; the page
format's kernel coverage for quantized pages). The other ops of a paged step (projections, convolutions, norms,
the K/V append) are torch or kernels that serve every shape the cache config admits.
"""

from __future__ import annotations

from oasr.cache.config import CacheConfig


def graph_preflight(config: CacheConfig) -> str | None:
    """None when a step over ``config``'s pages is kernel-served at every layer (capturable); else one line
    naming the layers, the gap or refusal, and that the step runs eager."""
    from oasr.fast.kernel_policy import KERNEL_GAPS
    from oasr.fast.kernels import registry
    from oasr.kv_formats import KERNEL_FORMATS, KERNEL_HEAD_DIMS, get_format

    layers = f"all {config.num_layers} attention layers" if config.num_layers > 1 else "the attention layer"
    fmt = get_format(config.kv_cache_dtype)
    D = int(config.head_dim)
    if not fmt.quantized:
        if config.dtype in registry.DTYPE_ARG and D in registry.HEAD_DIMS:
            return None
        gap = KERNEL_GAPS["paged-attention-head-dim"]
        return (f"{layers} reach the declared kernel gap {gap.name!r} (head_dim={D} with {config.dtype} pages; "
                f"the kernels tile head_dim {registry.HEAD_DIMS}): torch serves a gap eagerly only, so the chunk "
                f"step runs eager")
    if fmt.name not in KERNEL_FORMATS or D not in KERNEL_HEAD_DIMS:
        return (f"{layers} have {fmt.name!r} pages at head_dim={D}, which no kernel serves (kernel formats "
                f"{list(KERNEL_FORMATS)}, head_dim {KERNEL_HEAD_DIMS}): the chunk step runs eager")
    return None
