"""Bench section: one autoregressive decode step over the decoder cache, 1 to 128 rows.

A step for ``B`` rows is what the attention decoder does per generated token,
cache side only: ``DecoderKVCacheManager.append`` (one page allocation for the
rows that cross a boundary, one ``append_kv`` per layer) and, per layer, the
decode attention (``paged_attention`` with one query per row, GQA heads packed)
over the self region. Rows start with a ``HISTORY``-token prompt. Reported:
median ms per step and decode tokens/s (``B / step time``), reference against
fast.
"""

from __future__ import annotations

import torch

from oasr.bench import median_ms
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest

LAYERS, N_KV, N_HEAD, HEAD_DIM, PAGE, HISTORY = 4, 4, 8, 64, 16, 64


def _setup(ops, rows: int, steps: int, device):
    cfg = DecoderCacheConfig(num_layers=LAYERS, n_kv_head=N_KV, head_dim=HEAD_DIM, page_size=PAGE,
                             max_num_blocks=rows * -(-(HISTORY + steps) // PAGE), max_rows=rows,
                             max_self_tokens=HISTORY + steps, kv_storage="paged", device=device)
    manager = ops.DecoderKVCacheManager(cfg)
    ids = manager.admit([DecoderRequest(HISTORY, steps)] * rows)
    g = torch.Generator().manual_seed(0)
    for r in ids:
        k = torch.randn(LAYERS, HISTORY, N_KV, HEAD_DIM, generator=g).to(device)
        manager.prefill(r, k, k.clone())
    k = torch.randn(LAYERS, rows, N_KV, HEAD_DIM, generator=g).to(device)
    q = torch.randn(rows, N_HEAD, 1, HEAD_DIM, generator=g).to(device)
    return manager, ids, k, q


def _step(ops, manager, ids, k, q) -> None:
    manager.append(ids, k, k)
    for view in manager.self_caches(ids):
        ops.paged_attention(q, view)


def section(quick: bool, device="cpu") -> list[dict]:
    """This section's rows (``quick``: the reduced grid) on ``device``; see the module docstring."""
    from oasr import fast, reference

    device = torch.device(device)
    sizes = (1, 8, 32) if quick else (1, 8, 32, 128)
    base = 2 if quick else 3
    rows_out = []
    for rows in sizes:
        # a step of a few rows takes about a millisecond: a median of 3 such samples on a shared machine is
        # noise, so small sizes take more. Warm-up and timed steps stay inside the page after HISTORY
        # (3 + 12 < PAGE): the query of the step after a full page would find no prepared slot
        repeats = max(base, min(PAGE - 4, 64 // rows))
        row = {"section": "decoder", "case": f"rows={rows} layers={LAYERS} history={HISTORY} page={PAGE}"}
        for name, ops in (("reference", reference), ("fast", fast)):
            args = (ops, *_setup(ops, rows, repeats + 4, device))
            ms = median_ms(lambda a=args: _step(*a), repeats=repeats, warmup=3, device=device)
            row[f"{name}_ms"] = ms
            row[f"{name}_tok_s"] = rows / (ms / 1e3)
        rows_out.append(row)
    return rows_out
