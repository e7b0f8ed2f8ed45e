"""Fast ``append_kv`` / ``paged_attention`` (+ ``gather_kv_blocks``): the kernels, or vectorised torch.

This is the fast twin of ``oasr.reference.paged_ops`` and must agree with it:
same signatures, same semantics (see the reference's docstring and the diagram
in ``oasr.cache.paged``), same errors. Each function takes one extra keyword-only
argument, ``backend``, which picks the CPU implementation (see
``oasr.fast.backend``)::

    CUDA tensors  ->  oasr/kernels_cu/ kernels, NVRTC-compiled, on torch's current stream
                      (attention: v3, the tensor-core kernel, where it has an instance
                      (OASR_CUDA_ATTENTION=v2 pins v2); v1 otherwise:
                      ``ops.choose_attention_version``)
    CPU tensors   ->  "torch": vectorised torch, no Python loop over rows (default)
                      "emulated": the same kernels run by the host SIMT emulator

Value checks. The reference validates ``chunk_lens`` by reading it. Here that
happens wherever the values are on the host already (CPU tensors, lists, or a
CPU tensor for CUDA data); a ``chunk_lens`` tensor that lives on the GPU is
used as is, without a device-to-host read, and the kernels clamp it to
``[0, T]``. Nothing on the CUDA path synchronises with the device.

NaN in K/V. The torch backend refuses NaN in a written frame, before anything is written, for a
format whose rule refuses it (int8, q8_0, affine4: ``KVFormat.refuses_nan``), as the reference does.
The kernels (CUDA, "emulated") read nothing back, so they cannot refuse; they store NaN by this rule
(the max / min reductions are fmaxf / fminf, which skip a NaN operand)::

    int8      the scale from the vector's other values (2**-149 if all are NaN); a NaN stores q = -127
    q8_0      d from the block's other values (0 if all are NaN); a NaN stores q = 0
    affine4   scale and bias from the group's other values; a NaN stores code 0 (it reads back as the
              bias); a group of NaN only stores scale = bias = NaN and codes 0 (it reads back as NaN)

``tests/test_kv_nan_refusal.py`` checks both behaviours. fp8 pages leave NaN unspecified in every twin.

Before capturing a CUDA graph, call ``load_kernels(device)`` (or run each op
once) so that compilation and module loading happen outside the capture.

fp8 pages (``cache.quantized``; the rule is stated in ``oasr.kv_formats.fp8_e4m3`` and restated
here, vectorised as the kernels compute it, by ``oasr.fast.kv_formats``' ``fp8_scales`` / ``quantize_fp8`` /
``dequantize_fp8``)::

    append_kv          quantizes each written (frame, head) vector: e4m3 data + fp32 scale,
                       stored bytes and scales bit-identical to the reference on every backend
    paged_attention    reads dequantized pages (the kernels per tile); q, out in the model dtype
    gather_kv_blocks   k_scale=, v_scale= and out_dtype= (the model dtype): dequantizes

The other quantized formats (``oasr.kv_formats``: int8, q8_0, affine4) follow
the same three lines with their own rule, vectorised in ``oasr.fast.kv_formats``.
The kernels serve ``KERNEL_FORMATS`` at head_dim in ``KERNEL_HEAD_DIMS`` only; the
torch backend serves any format at any head_dim its rule cuts.
``check_format_supported(format, head_dim, device)`` (``check_fp8_supported`` for
fp8) raises the ``ValueError`` a call would raise, so a pool can refuse at
construction.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from oasr.cache.paged import PagedKVCache
from oasr.cache.rel_bias import check_rel_bias, check_rel_bias_columns, host_span
from oasr.cache.validate import (
    check_chunk_lens,
    check_kv_chunk,
    check_kv_numbers,
    check_lens_values,
    check_query,
    same_device,
)
from oasr.fast import cpu_rows, kernel_policy
from oasr.fast.backend import choose_backend, resolve_backend
from oasr.fast.kernels import ops, registry
from oasr.fast.kv_formats import check_format_supported, dequantize, dequantize_fp8, quantize
from oasr.kv_formats import get_format
from oasr.reference.paged_ops import paged_attention as reference_paged_attention  # serves a declared kernel gap

FP8_DTYPE = registry.FP8_DTYPE
FP8_HEAD_DIMS = registry.FP8_HEAD_DIMS


def _executor(name: str, device: torch.device):
    if name == "cuda":
        from oasr.fast.kernels.nvrtc import executor_for

        return executor_for(device)
    from oasr.fast.kernels.emulation import executor

    return executor()


def load_kernels(device: torch.device | str, backend: str | None = None) -> None:
    """Compile and load every kernel for ``device`` now (before CUDA graph capture); no-op for "torch"."""
    device = torch.device(device)
    name = resolve_backend(device, backend)
    if name != "torch":
        _executor(name, device).load_all()


def _host_lens(cache: PagedKVCache, chunk_lens, num_frames: int, op: str, what: str = "frames") -> torch.Tensor:
    """``chunk_lens`` as a validated int32 CPU tensor (reads the values: host data only): each in
    ``[0, T]`` and within the row's prepared frames (``oasr.cache.validate.check_lens_values``)."""
    if isinstance(chunk_lens, torch.Tensor):
        chunk_lens = chunk_lens.cpu()
    lens = check_chunk_lens(chunk_lens, cache.batch_size, num_frames, "cpu")
    check_lens_values(op, cache, lens, num_frames, what)
    return lens


def _check_full_rows(cache: PagedKVCache, num_frames: int, op: str, what: str) -> None:
    """``chunk_lens=None`` (every row has ``T`` frames) against the view's ``prepared_frames``, in Python
    ints: no tensor op unless a row was prepared for fewer frames (then the shared check raises)."""
    batch, prepared = cache.batch_size, cache.prepared_frames
    if prepared is not None and (len(prepared) != batch or any(p < num_frames for p in prepared)):
        check_lens_values(op, cache, torch.full((batch,), num_frames), num_frames, what)


def _host_lens_list(cache: PagedKVCache, chunk_lens, num_frames: int, op: str, what: str = "frames") -> list[int]:
    """``_host_lens`` as a Python list; ``None`` is checked by ``_check_full_rows``."""
    if chunk_lens is None:
        _check_full_rows(cache, num_frames, op, what)
        return [num_frames] * cache.batch_size
    return _host_lens(cache, chunk_lens, num_frames, op, what).tolist()


def _kernel_lens(cache: PagedKVCache, chunk_lens, num_frames: int, device: torch.device, op: str, what: str):
    """None (every row has T frames) or an int32 (B,) tensor on ``device`` for the kernels."""
    batch = cache.batch_size
    if chunk_lens is None:
        _check_full_rows(cache, num_frames, op, what)
        return None
    if isinstance(chunk_lens, torch.Tensor) and chunk_lens.device.type == "cuda":
        if not same_device(chunk_lens.device, device):
            raise ValueError(f"{op}: chunk_lens is on {chunk_lens.device}, the pool on {device}")
        lens = check_chunk_lens(chunk_lens, batch, num_frames, device)  # shape and integer dtype only
        return lens.contiguous()  # device values: not read back, not validated
    return _host_lens(cache, chunk_lens, num_frames, op, what).to(device)


# -- fp8 ----------------------------------------------------------------------------------------


def check_fp8_supported(
    head_dim: int, device: torch.device | str, *, dtype: torch.dtype | None = None, backend: str | None = None
) -> None:
    """Raise ``ValueError`` if fp8 K/V pages of ``head_dim`` (and model ``dtype``) cannot be served on
    ``device`` by ``backend`` (default: what a call without ``backend=`` would use now). The kernels
    ("cuda", "emulated") tile head_dim in ``FP8_HEAD_DIMS`` and take fp32/fp16/bf16 queries; "torch"
    serves any. Reads nothing from the device; records no backend choice."""
    name = choose_backend(torch.device(device), backend)
    if name != "torch":
        ops.check_fp8_geometry(int(head_dim), dtype, name)


# -- append_kv ---------------------------------------------------------------------------------


def append_kv(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, chunk_lens=None, *, backend=None) -> None:
    """Write a cohort's chunk ``k, v`` of shape ``(B, T, n_kv_head, head_dim)`` into the pages.

    Arguments and checks as the reference's (``k``, ``v``: ``(B, T, n_kv_head, head_dim)`` in the
    served dtype; ``chunk_lens`` ``(B,)`` in ``[0, T]`` and within each row's prepared frames), all
    before the first write. A ``chunk_lens`` tensor on the GPU is not read: its values are trusted
    (the kernels clamp them to ``[0, T]``).
    """
    check_kv_chunk(cache, k, v)
    name = resolve_backend(k.device, backend)
    B, T = k.shape[:2]
    if B == 0:  # an empty cohort writes nothing (checked like any other; no row path, no launch)
        _host_lens(cache, chunk_lens, T, "append_kv")
        return
    if name == "torch":
        kernel_policy.serve_out_of_scope("append_kv", k.device.type)
        if cpu_rows.planned_decode_step(cache, B, T, chunk_lens):  # its plan answered the length checks
            rows, lens = True, [1] * B
        elif cpu_rows.use_row_loop(cache, B, T):  # dispatch by size: see oasr.fast.cpu_rows
            rows, lens = True, _host_lens_list(cache, chunk_lens, T, "append_kv")
        else:
            rows, lens = False, _host_lens(cache, chunk_lens, T, "append_kv")
        if cache.format.refuses_nan:  # the torch rule refuses NaN before K is written (the kernels: module doc)
            check_kv_numbers("append_kv", cache.format, (("k", k), ("v", v)), lens)
        if rows:
            cpu_rows.append_kv_rows(cache, k, v, lens)
        else:
            _append_kv_torch(cache, k, v, lens)
    else:
        if cache.quantized:
            check_format_supported(cache.format.name, cache.head_dim, k.device, backend=name)
        lens = _kernel_lens(cache, chunk_lens, T, k.device, "append_kv", "frames")
        ops.append_kv(_executor(name, k.device), cache, k, v, lens)


def _append_kv_torch(cache: PagedKVCache, k, v, lens: torch.Tensor) -> None:
    B, T = k.shape[:2]
    t = torch.arange(T)
    valid = t[None, :] < lens[:, None].long()  # (B, T): frames to write
    rows = torch.arange(B)[:, None].expand(B, T)[valid]
    positions = (cache.cache_seqlens.long()[:, None] + t[None, :])[valid]
    blocks = cache.block_table[rows, positions // cache.block_size].long()
    offsets = positions % cache.block_size
    if cache.quantized:
        fmt = cache.format.name
        checked = cache.format.refuses_nan  # append_kv refused NaN before this write
        cache.k_cache[blocks, offsets], cache.k_scale[blocks, offsets] = quantize(fmt, k[valid], k.dtype,
                                                                                  nan_checked=checked)
        cache.v_cache[blocks, offsets], cache.v_scale[blocks, offsets] = quantize(fmt, v[valid], v.dtype,
                                                                                  nan_checked=checked)
        return
    cache.k_cache[blocks, offsets] = k[valid].to(cache.k_cache.dtype)
    cache.v_cache[blocks, offsets] = v[valid].to(cache.v_cache.dtype)


# -- paged_attention ---------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    chunk_lens=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    rel_bias: torch.Tensor | None = None,
    *,
    backend=None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Chunk attention of queries ``(B, n_head, T, head_dim)`` over each row's own pages.

    ``q``: ``(B, n_head, T, head_dim)`` (heads first, unlike K/V) in the served dtype; ``chunk_lens``
    as for ``append_kv``. Returns ``(B, n_head, T, head_dim)`` in ``q``'s dtype.

    ``rel_bias``: None, or the relative-position term, a float32 ``(B, n_head, T, R)`` table of
    queries x distances added to the scores (``oasr.cache.rel_bias``: column ``(p_q - p_k) + T - 1``).
    Its ``R`` is checked against the rows' widest history where the lengths are on the host (CPU
    tensors, or a view's ``HostPlan``), else (CUDA) against the view's ``max_span``: a table of
    ``oasr.cache.rel_bias.required_columns(cache.max_span, T)`` columns always passes. A query whose window
    needs a column past ``R`` anyway (a stale ``max_span``) gets NaN from the kernels.

    ``num_splits`` pins the kernels' key-range split count (a CUDA graph replays its launch
    parameters, so a captured width pins it); None lets the launcher choose from the view's
    ``max_span``. The torch backend has no splits and ignores it.
    """
    check_query(cache, q)
    name = resolve_backend(q.device, backend)
    B, n_head, T, D = q.shape
    if rel_bias is not None:
        check_rel_bias(cache, q, rel_bias)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    what = "query frames (q's dim 2)"
    if B == 0:  # an empty cohort: an empty output (checked like any other; no row path, no launch)
        _host_lens(cache, chunk_lens, T, "paged_attention", what)
        return torch.zeros_like(q)
    if name == "torch":
        kernel_policy.serve_out_of_scope("paged_attention", q.device.type)
        if cpu_rows.use_decode_batch(cache, B, T):  # dispatch by size: see oasr.fast.cpu_rows
            if cpu_rows.planned_decode_step(cache, B, T, chunk_lens):  # its plan answered the length checks
                lens = [1] * B
            else:
                lens = _host_lens_list(cache, chunk_lens, T, "paged_attention", what)
            _check_rel_columns(cache, rel_bias, T)
            return cpu_rows.attend_decode_batch(q, cache, lens, scale, causal, rel_bias)
        if cpu_rows.use_row_loop(cache, B, T):
            lens = _host_lens_list(cache, chunk_lens, T, "paged_attention", what)
            _check_rel_columns(cache, rel_bias, T)
            return cpu_rows.attend_rows(q, cache, lens, scale, causal, rel_bias)
        lens = _host_lens(cache, chunk_lens, T, "paged_attention", what)
        _check_rel_columns(cache, rel_bias, T)
        return _paged_attention_torch(q, cache, lens, scale, causal, rel_bias)
    if cache.quantized:
        check_format_supported(cache.format.name, D, q.device, dtype=q.dtype, backend=name)
    elif cache.k_cache.dtype not in registry.DTYPE_ARG or D not in registry.HEAD_DIMS:  # in scope, no kernel
        kernel_policy.serve_gap("paged-attention-head-dim", "paged_attention",
                                f"head_dim={D} with {cache.k_cache.dtype} pages on the {name!r} backend",
                                capturing=q.is_cuda and torch.cuda.is_current_stream_capturing())
        return reference_paged_attention(q, cache, chunk_lens, scale, causal, rel_bias)
    lens = _kernel_lens(cache, chunk_lens, T, q.device, "paged_attention", what)
    _check_rel_columns(cache, rel_bias, T)
    return ops.paged_attention(_executor(name, q.device), q, cache, lens, scale, causal, num_splits,
                               rel_bias=rel_bias)


def _check_rel_columns(cache: PagedKVCache, rel_bias, num_frames: int) -> None:
    """``rel_bias``'s column count against the rows' widest history, from host numbers only: the view's
    ``HostPlan``, else its length tensors when they are CPU tensors; device lengths are not read (then
    only ``R >= 2T - 1``: the kernels give NaN to a query whose window needs more, see oasr.cache.rel_bias)."""
    if rel_bias is None:
        return
    plan = cache.host
    if plan is not None and plan.describes(cache):
        check_rel_bias_columns(rel_bias, host_span(plan.seqlens, plan.seqstarts), num_frames, "the view's lengths")
    elif cache.cache_seqlens.device.type == "cpu" and cache.cache_seqstarts.device.type == "cpu":
        spans = host_span(cache.cache_seqlens.tolist(), cache.cache_seqstarts.tolist())
        check_rel_bias_columns(rel_bias, spans, num_frames, "the view's lengths")
    else:  # device lengths are not read: the view's host maximum stands for them
        check_rel_bias_columns(rel_bias, cache.max_span, num_frames, "the view's max_span; device lengths not read")


# Rows per group on the CPU path: a group's gathered K and V stay within this many bytes, so they
# live in cache instead of in freshly mapped memory (at 32 streams x 1040 keys one ungrouped
# gather was 34 MB, page-faulted on every call, and twice the reference's time).
_CPU_GROUP_BYTES = 4 << 20


def _paged_attention_torch(q, cache: PagedKVCache, lens: torch.Tensor, scale: float, causal: bool, rel_bias=None):
    """Vectorised attention over groups of rows sized to ``_CPU_GROUP_BYTES`` (see ``_attend_rows``)."""
    B, H, T, D = q.shape
    per_row = 2 * cache.n_kv_head * max(cache.max_span + T, 1) * D * 4
    rows = max(1, _CPU_GROUP_BYTES // per_row)
    if rows >= B:
        return _attend_rows(q, cache, lens, scale, causal, rel_bias)
    out = torch.empty_like(q)
    for r0 in range(0, B, rows):  # row tiles, like a kernel's grid; each tile is one vectorised pass
        r1 = min(B, r0 + rows)
        tile = dataclasses.replace(cache, block_table=cache.block_table[r0:r1],
                                   cache_seqlens=cache.cache_seqlens[r0:r1],
                                   cache_seqstarts=cache.cache_seqstarts[r0:r1])
        out[r0:r1] = _attend_rows(q[r0:r1], tile, lens[r0:r1], scale, causal,
                                  None if rel_bias is None else rel_bias[r0:r1])
    return out


def _attend_rows(q, cache: PagedKVCache, lens: torch.Tensor, scale: float, causal: bool, rel_bias=None):
    """Gather every row's key range into a padded (B, Hkv, L, D), mask, and run fp32 attention
    (``rel_bias``: each (query, key) pair's column gathered from the table, added before the mask)."""
    B, H, T, D = q.shape
    Hkv = cache.n_kv_head
    lens = lens.long()
    seqlens = cache.cache_seqlens.long()
    starts = cache.cache_seqstarts.long()
    spans = torch.where(lens > 0, (seqlens + lens - starts).clamp(min=0), 0)  # keys per row
    # no key anywhere still takes one masked column: the same tensors are read whatever the lengths,
    # as a kernel reads its arguments (a stand-in for graph capture checks that on the CPU)
    L = max(int(spans.max()), 1) if B else 0
    if L == 0:
        return torch.zeros_like(q)

    j = torch.arange(L)
    key_ok = j[None, :] < spans[:, None]  # (B, L)
    key_pos = starts[:, None] + j[None, :]  # table positions
    # Padding keys point at slot (0, 0) and are zeroed after the gather: the pool
    # may hold anything (NaN) there, and p = 0 times NaN would still be NaN.
    columns = torch.where(key_ok, key_pos // cache.block_size, 0)
    blocks = torch.where(key_ok, cache.block_table.long().gather(1, columns), 0)
    offsets = torch.where(key_ok, key_pos % cache.block_size, 0)
    # One row lookup over (block, offset, head) vectors lands K/V directly in the (B, Hkv, L, D)
    # layout the matmuls read: no advanced-indexing gather, no transposing copy. (F.embedding is
    # that lookup; on the CPU it measured ~3x faster than index_select into a fresh tensor.)
    vector = ((blocks * cache.block_size + offsets)[:, None, :] * Hkv + torch.arange(Hkv)[None, :, None]).view(-1)
    if cache.quantized and cache.format.name != "fp8_e4m3":  # int8 / q8_0 / affine4: gather data and scales
        fmt, width = cache.format.name, cache.k_cache.shape[-1]
        plane = cache.k_scale.shape[3:]  # the scale plane of one vector
        n = cache.k_scale.shape[0] * cache.k_scale.shape[1] * Hkv

        def take(data, scales):
            stored = data.reshape(-1, width).index_select(0, vector).view(B, Hkv, L, width)
            return dequantize(fmt, stored, scales.reshape(n, -1).index_select(0, vector).view(B, Hkv, L, *plane))

        k, v = take(cache.k_cache, cache.k_scale), take(cache.v_cache, cache.v_scale)
    elif cache.quantized or cache.k_cache.dtype != torch.float32:
        k = F.embedding(vector, cache.k_cache.reshape(-1, D)).view(B, Hkv, L, D)
        v = F.embedding(vector, cache.v_cache.reshape(-1, D)).view(B, Hkv, L, D)
    else:  # fp32 pages: gather into the per-thread workspace (same memory every call, see cpu_rows)
        k, v = cpu_rows.gather_vectors(cache.k_cache, cache.v_cache, vector, (B, Hkv, L, D))
    if cache.quantized and cache.format.name == "fp8_e4m3":  # exactly as the reference: stored.float() * scale
        k = dequantize_fp8(k, cache.k_scale.reshape(-1).index_select(0, vector).view(B, Hkv, L))
        v = dequantize_fp8(v, cache.v_scale.reshape(-1).index_select(0, vector).view(B, Hkv, L))
    k, v = k.float(), v.float()  # ours to change (workspace or a fresh gather; float() copies other dtypes)
    if not bool(key_ok.all()):  # a host read, fine on this CPU-only path: zero the padding in place
        pad = ~key_ok[:, None, :, None]
        k.masked_fill_(pad, 0.0)
        v.masked_fill_(pad, 0.0)
    G = H // Hkv
    qf = q.float().reshape(B, Hkv, G * T, D)  # query head h = kv_head * G + g, rows (g, t)
    scores = (qf @ k.transpose(2, 3)).mul_(scale).view(B, Hkv, G, T, L)
    if rel_bias is not None:  # column (p_q - p_k) + T - 1; padding keys' columns are clamped, then masked
        query_pos = seqlens[:, None] + torch.arange(T)[None, :]  # (B, T)
        columns = (query_pos[:, :, None] - key_pos[:, None, :] + (T - 1)).clamp_(0, rel_bias.shape[3] - 1)
        bias = rel_bias.gather(3, columns[:, None].expand(B, H, T, L))  # (B, H, T, L)
        scores += bias.view(B, Hkv, G, T, L)
    allowed = key_ok[:, None, :].expand(B, T, L)  # (B, T, L)
    if causal:
        query_pos = seqlens[:, None] + torch.arange(T)[None, :]
        allowed = allowed & (key_pos[:, None, :] <= query_pos[:, :, None])
    allowed = allowed & (torch.arange(T)[None, :] < lens[:, None])[:, :, None]
    allowed = allowed[:, None, None]  # (B, 1, 1, T, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    no_keys = ~allowed.any(dim=-1, keepdim=True)  # (B, 1, 1, T, 1): past the chunk, or fully masked
    probs = probs.masked_fill_(no_keys, 0.0)
    out = (probs.view(B, Hkv, G * T, L) @ v).view(B, Hkv, G, T, D)
    # Such rows are zeros like the reference's, also when v holds NaN or Inf (0 * NaN is NaN in the matmul).
    out = out.masked_fill_(no_keys, 0.0).view(B, H, T, D)
    return out.to(q.dtype)


# -- gather_kv_blocks --------------------------------------------------------------------------


def gather_kv_blocks(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_ids: torch.Tensor,
    start: int,
    num_frames: int,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    kv_format: str | None = None,
    backend=None,
) -> torch.Tensor:
    """All layers of ``num_frames`` frames of one stream, packed K|V: ``(L, Hkv, T, 2 * D)``.

    ``k_pool, v_pool``: the pool, ``(num_layers, num_pool_blocks, block_size, n_kv_head,
    head_dim)``. ``block_ids``: the stream's physical blocks in order (int32, 1-D).
    Frame ``f`` is position ``start + f`` of the blocks' concatenation. ``out``, when
    given, must be contiguous with that shape, on the pool's device.

    The output dtype is ``out``'s, else ``out_dtype``. A pool in the model dtype is copied
    (the output dtype, if given, must be the pool's). An fp8 pool comes with ``k_scale`` and
    ``v_scale`` (fp32, ``(num_layers, num_pool_blocks, block_size, n_kv_head)``) and is
    dequantized, ``(stored.float() * scale).to(dtype)``, into the model dtype, which must
    then be given (``out`` or ``out_dtype``). Another quantized format names itself with
    ``kv_format`` (``oasr.kv_formats``; its scales then have the format's scale plane) and is
    dequantized by its own rule; ``kv_format`` None with scales means fp8_e4m3.
    """
    if k_pool.dim() != 5 or k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(
            "gather_kv_blocks: k_pool and v_pool must both be (num_layers, num_pool_blocks, block_size, "
            f"n_kv_head, head_dim) of one dtype, got {tuple(k_pool.shape)} {k_pool.dtype} and "
            f"{tuple(v_pool.shape)} {v_pool.dtype}"
        )
    fmt = get_format(kv_format if kv_format is not None else ("fp8_e4m3" if k_scale is not None else None))
    L, _, bs, Hkv, D = *k_pool.shape[:4], k_pool.shape[4] * fmt.values_per_byte
    start, num_frames = int(start), int(num_frames)
    if block_ids.dim() != 1 or block_ids.dtype.is_floating_point:
        raise ValueError(f"gather_kv_blocks: block_ids must be a 1-D integer tensor, got {block_ids.dtype}")
    if not same_device(block_ids.device, k_pool.device):
        raise ValueError(f"gather_kv_blocks: block_ids is on {block_ids.device}, the pool on {k_pool.device}")
    if start < 0 or num_frames < 0 or start + num_frames > block_ids.shape[0] * bs:
        raise ValueError(
            f"gather_kv_blocks: frames [{start}, {start + num_frames}) outside the {block_ids.shape[0]} "
            f"blocks of {bs} frames"
        )
    quantized = _check_gather_scales(k_pool, k_scale, v_scale, fmt)
    dtype = out.dtype if out is not None else out_dtype
    if out is not None and out_dtype is not None and out_dtype != out.dtype:
        raise ValueError(f"gather_kv_blocks: out is {out.dtype} but out_dtype={out_dtype}")
    if quantized and dtype is None:
        raise ValueError("gather_kv_blocks: an fp8 pool needs the model dtype to dequantize into (out or out_dtype)")
    if not quantized and dtype not in (None, k_pool.dtype):
        raise ValueError(f"gather_kv_blocks: the pool is {k_pool.dtype}; it is copied, not converted, to {dtype}")
    dtype = dtype or k_pool.dtype
    shape = (L, Hkv, num_frames, 2 * D)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=k_pool.device)
    elif out.shape != shape or not same_device(out.device, k_pool.device) or not out.is_contiguous():
        raise ValueError(
            f"gather_kv_blocks: out must be a contiguous {shape} {dtype} tensor on {k_pool.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    name = resolve_backend(k_pool.device, backend)
    if name == "torch":
        positions = start + torch.arange(num_frames)
        blocks = block_ids.long()[positions // bs]
        offsets = positions % bs
        k, v = k_pool[:, blocks, offsets], v_pool[:, blocks, offsets]  # (L, T, Hkv, D)
        if quantized:
            k = dequantize(fmt.name, k, k_scale[:, blocks, offsets], dtype)
            v = dequantize(fmt.name, v, v_scale[:, blocks, offsets], dtype)
        out[..., :D] = k.transpose(1, 2)  # (L, T, Hkv, D) -> (L, Hkv, T, D)
        out[..., D:] = v.transpose(1, 2)
        return out
    if quantized:
        check_format_supported(fmt.name, D, k_pool.device, dtype=dtype, backend=name)
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("gather_kv_blocks: the pools must be contiguous for the kernels")
    if name == "emulated" and num_frames:  # host memory: a bad id would be a wild read, so check
        used = block_ids[start // bs : (start + num_frames - 1) // bs + 1]
        if int(used.min()) < 0 or int(used.max()) >= k_pool.shape[1]:
            raise IndexError(f"gather_kv_blocks: block id outside [0, {k_pool.shape[1]})")
    executor = _executor(name, k_pool.device)
    return ops.gather_kv_blocks(executor, k_pool, v_pool, block_ids, start, num_frames, out, k_scale, v_scale,
                                kv_format=fmt.name)


def _check_gather_scales(k_pool: torch.Tensor, k_scale, v_scale, fmt) -> bool:
    """True for a quantized pool with its scales; refuses half a pair, or data / scales of the wrong shape
    or dtype for ``fmt`` (fp8: fp32 scales of ``k_pool.shape[:-1]``)."""
    if k_scale is None and v_scale is None:
        if fmt.quantized:
            raise ValueError(f"gather_kv_blocks: a {fmt.name} pool needs k_scale and v_scale")
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("gather_kv_blocks: pass both k_scale and v_scale, or neither")
    if not fmt.quantized:
        raise ValueError("gather_kv_blocks: scales were given for a pool in the model dtype")
    data_dtype = fmt.data_dtype(torch.float32)
    if k_pool.dtype != data_dtype:
        raise ValueError(f"gather_kv_blocks: scales were given but the pool is {k_pool.dtype}, not {data_dtype} "
                         f"(a {fmt.name} pool)")
    D = k_pool.shape[-1] * fmt.values_per_byte
    shape = tuple(k_pool.shape[:-1]) + fmt.scale_shape(D)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        dtype_ok = t.dtype == fmt.scale_dtype(t.dtype) if fmt.name.startswith("affine") \
            else t.dtype == fmt.scale_dtype(torch.float32)
        if tuple(t.shape) != shape or not dtype_ok or not same_device(t.device, k_pool.device):
            raise ValueError(
                f"gather_kv_blocks: {name} must be {shape} "
                f"{fmt.scale_dtype(torch.float32) if not fmt.name.startswith('affine') else 'model dtype'} on "
                f"{k_pool.device} (a {fmt.name} pool), got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    return True
