"""Bench section: fp8 K/V pages against the model dtype, one attention tick.

Same tick as the attention section (append + attention over 12 layers,
head_dim 64, 4 KV heads, chunk 16) at a fixed cohort, with the pages stored
in the model dtype and in fp8 e4m3 (+ one fp32 scale per vector). Reports the
K/V bytes each tick moves (pages read, chunk written) and the time, for the
reference and the fast twin.
"""

from __future__ import annotations

import torch

from oasr.bench import median_ms
from oasr.bench.attention import BLOCK, CHUNK, HEAD_DIM, LAYERS, N_KV, _cohort, _tick
from oasr.cache.paged import PagedKVCache
from oasr.reference.fp8 import FP8_DTYPE


def _to_fp8(caches):
    out = []
    for c in caches:
        shape = c.k_cache.shape
        out.append(PagedKVCache(
            torch.zeros(shape, dtype=FP8_DTYPE, device=c.k_cache.device),
            torch.zeros(shape, dtype=FP8_DTYPE, device=c.k_cache.device),
            c.block_table, c.cache_seqlens, c.cache_seqstarts, c.block_size, c.max_seqlen, c.max_span, c.layer,
            torch.ones(shape[:-1], device=c.k_cache.device), torch.ones(shape[:-1], device=c.k_cache.device),
        ))
    return out


def kv_bytes(streams: int, history: int, storage: torch.dtype, quantized: bool) -> int:
    """Bytes of K/V (with one fp32 scale per vector when ``quantized``) for ``streams`` at ``history``."""
    per_vector = HEAD_DIM * torch.empty((), dtype=storage).element_size() + (4 if quantized else 0)
    return LAYERS * streams * 2 * (history + 2 * CHUNK) * N_KV * per_vector


def section(quick: bool, device="cpu") -> list[dict]:
    """This section's rows (``quick``: the reduced grid) on ``device``; see the module docstring."""
    from oasr import fast, reference

    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    streams, history = (8, 256) if quick else (32, 1024)
    caches, q, k = _cohort(streams, history, device, dtype)
    rows = []
    for name, views in (("model dtype", caches), ("fp8_e4m3", _to_fp8(caches))):
        quantized = views[0].quantized
        storage = views[0].k_cache.dtype
        row = {"section": "fp8", "case": f"{name} streams={streams} history={history} block={BLOCK}"}
        args = (views, q, k)
        row["reference_ms"] = median_ms(lambda a=args: _tick(reference, *a), repeats=1 if not quick else 2)
        if quantized and not getattr(fast, "SUPPORTS_FP8", False):
            row["fast_ms"] = None
            row["note"] = "fast twin has no fp8 path yet"
        else:
            row["fast_ms"] = median_ms(lambda a=args: _tick(fast, *a), repeats=3, device=device)
        row["kv_MB_per_tick"] = kv_bytes(streams, history, storage, quantized) / 1e6
        rows.append(row)
    return rows
