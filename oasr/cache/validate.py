"""Argument checks both twins share, so that they fail the same way with the same words."""

from __future__ import annotations

import torch

from oasr.cache.errors import PoolExhaustedError, SlotsExhaustedError, StreamCapacityError
from oasr.kv_formats.fp8_e4m3 import MODEL_DTYPES  # the dtypes a model runs in (CacheConfig.dtype)


def canonical_device(device) -> torch.device:
    """``device`` with its index spelled out: ``cuda`` is the current CUDA device (``cuda:N``), an
    index-less device of another type is index 0 (``cpu`` is ``cpu:0``)."""
    device = torch.device(device)
    if device.index is not None:
        return device
    index = 0
    if device.type == "cuda":
        try:
            index = torch.cuda.current_device()
        except (RuntimeError, AssertionError):  # no CUDA in this build / no device: "cuda" names device 0
            index = 0
    return torch.device(device.type, index)


def same_device(a, b) -> bool:
    """Whether ``a`` and ``b`` (devices or their names) are one device: ``cuda`` and ``cuda:0`` are when
    device 0 is current (a tensor always reports its index, a config may be written without one). Every
    check that compares devices goes through here, never through ``!=`` on what was written."""
    if a == b:  # the common case: spelled alike (cheap, no CUDA query)
        return True
    return canonical_device(a) == canonical_device(b)


def check_count(owner: str, name: str, value, minimum: int = 0) -> None:
    """``value`` must be an int (not a bool) ``>= minimum``; ``ValueError`` naming ``owner.name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


def as_id_list(stream_ids) -> list:
    """One stream id or a list/tuple of them, as a list."""
    return list(stream_ids) if isinstance(stream_ids, (list, tuple)) else [stream_ids]


def gather_range(num_blocks: int, block_size: int, start: int, num_frames: int | None) -> int:
    """``num_frames`` for ``gather_kv_blocks`` (None: to the end), checked to lie inside the blocks."""
    total = num_blocks * block_size
    if num_frames is None:
        num_frames = total - start
    if start < 0 or num_frames < 0 or start + num_frames > total:
        raise ValueError(
            f"gather_kv_blocks: frames [{start}, {start + num_frames}) outside the {total} frames "
            f"of {num_blocks} blocks"
        )
    return num_frames


def check_dense_chunk(config, kv_chunk) -> int:
    """A dense-mode chunk must be ``(num_layers, n_kv_head, T, 2 * head_dim)``, ``1 <= T <= chunk_size``, in the
    model dtype (``config.dtype``; refused, never cast, as ``append_kv``'s K/V); returns T."""
    shape = tuple(kv_chunk.shape)
    if (
        kv_chunk.dim() != 4
        or shape[0] != config.num_layers
        or shape[1] != config.n_kv_head
        or shape[3] != config.kv_last_dim
        or not 1 <= shape[2] <= config.chunk_size
    ):
        raise ValueError(
            f"commit: expected kv_chunk of shape ({config.num_layers}, {config.n_kv_head}, T, {config.kv_last_dim}) "
            f"with 1 <= T <= chunk_size={config.chunk_size}, got {shape}"
        )
    if kv_chunk.dtype != config.dtype:
        raise ValueError(
            f"commit: kv_chunk must be {config.dtype}, the model dtype (CacheConfig.dtype), got {kv_chunk.dtype}; "
            f"convert it before the call"
        )
    return shape[2]


# -- paged ops (append_kv, paged_attention): both twins call these first --------------------------------


def check_chunk_lens(chunk_lens, batch: int, num_frames: int, device) -> torch.Tensor:
    """Normalise ``chunk_lens`` to an int32 tensor of shape ``(batch,)`` on ``device``.

    ``None`` means every row's chunk is ``num_frames`` long. Only the shape is checked here; the
    values (each in ``[0, num_frames]`` and within the row's prepared frames) are checked by
    ``check_lens_values``, which reads them, so the fast twin calls it only where the values are
    host-side already.
    """
    if chunk_lens is None:
        return torch.full((batch,), num_frames, dtype=torch.int32, device=device)
    if isinstance(chunk_lens, torch.Tensor) and (chunk_lens.dtype.is_floating_point or chunk_lens.dtype.is_complex):
        raise ValueError(f"chunk_lens: expected an integer tensor, got {chunk_lens.dtype}")
    lens = torch.as_tensor(chunk_lens, dtype=torch.int32, device=device)
    if lens.shape != (batch,):
        raise ValueError(f"chunk_lens: expected shape ({batch},), got {tuple(lens.shape)}")
    return lens


def check_lens_values(op: str, cache, lens: torch.Tensor, num_frames: int, what: str = "frames") -> None:
    """Every row's chunk length in ``[0, num_frames]`` and at most the row's ``prepared_frames``.

    ``lens``: the normalised lengths (reads them: host data, or the reference). Raises
    ``ValueError`` for the first bad row, before the caller writes anything.
    """
    values = lens.tolist()  # one read; then Python ints (a few rows: cheaper than tensor ops per call)
    prepared = cache.prepared_frames
    if prepared is not None and len(prepared) != len(values):
        raise ValueError(f"{op}: the view's prepared_frames has {len(prepared)} rows, the cohort {len(values)}")
    # paged_attention's q puts heads before frames, K/V the other way round: a q in K/V's layout
    # reaches this check with its heads taken for frames, so the message names the layout first.
    layout = (" q must be (B, n_head, T, head_dim), heads before frames; if it is (B, T, n_head, head_dim), "
              "pass q.transpose(1, 2).") if op == "paged_attention" else ""
    for b, n in enumerate(values):
        if n > num_frames and layout:
            raise ValueError(f"{op}: chunk_lens[{b}]={n} is more than q's T={num_frames} (its dim 2).{layout}")
        if not 0 <= n <= num_frames:
            raise ValueError(f"{op}: chunk_lens[{b}]={n} outside [0, T={num_frames}]")
        if prepared is not None and n > prepared[b]:
            raise ValueError(
                f"{op}: row {b} has a chunk of {n} {what}, more than the {prepared[b]} frames prepared for it "
                f"(prepare_chunk with num_frames >= {n} first, or pass chunk_lens).{layout}"
            )


def _check_dtype(op: str, name: str, t: torch.Tensor, cache) -> None:
    """``t`` must be in the view's served dtype (see ``PagedKVCache``): no silent casts."""
    expected = cache.served_dtype
    if not cache.quantized and cache.model_dtype not in (None, cache.k_cache.dtype):
        raise ValueError(
            f"{op}: the view's model_dtype {cache.model_dtype} differs from its pool's {cache.k_cache.dtype}"
        )
    if expected is None:  # quantized pages, model dtype not declared: the tensor's own, if a model dtype
        if t.dtype not in MODEL_DTYPES:
            raise ValueError(
                f"{op}: {name} must be in a model dtype {tuple(str(d) for d in MODEL_DTYPES)} for quantized pages, "
                f"got {t.dtype}"
            )
    elif t.dtype != expected:
        role = "the model dtype (CacheConfig.dtype)" if cache.quantized else "the pool's dtype"
        raise ValueError(f"{op}: {name} must be {expected}, {role}, got {t.dtype}; convert it before the call")


def check_kv_chunk(cache, k: torch.Tensor, v: torch.Tensor) -> None:
    """Checks shared by both twins' ``append_kv``: ``k`` and ``v`` are ``(B, T, n_kv_head, head_dim)``
    (B the view's rows), of one shape, in the view's served dtype (the pool's; for fp8 pages the model
    dtype), on the pool's device. ``ValueError`` naming what was expected and what came."""
    B, H, D = cache.batch_size, cache.n_kv_head, cache.head_dim
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[0] != B or t.shape[2] != H or t.shape[3] != D:
            raise ValueError(
                f"append_kv: {name} must be (B={B}, T, n_kv_head={H}, head_dim={D}), got {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"append_kv: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    for name, t in (("k", k), ("v", v)):
        _check_dtype("append_kv", name, t, cache)
    if k.dtype != v.dtype:
        raise ValueError(f"append_kv: k and v dtypes differ: {k.dtype} vs {v.dtype}")
    for name, t in (("k", k), ("v", v)):
        if not same_device(t.device, cache.k_cache.device):
            raise ValueError(f"append_kv: {name} is on {t.device}, the pool on {cache.k_cache.device}")


def check_kv_numbers(op: str, fmt, tensors, lens=None) -> None:
    """Refuse NaN, before anything is written, for a page format whose rule refuses it
    (``KVFormat.refuses_nan``: int8, q8_0, affine4; ``fmt`` a format or its name, None for the model dtype).

    ``tensors``: ``(name, tensor)`` pairs, every value of which is written; with ``lens`` (``(B,)``
    ints) the tensors are ``(B, T, ...)`` chunks and only frames ``t < lens[b]`` count (what
    ``append_kv`` writes). Reads the values: the kernel path, which never reads a device tensor back,
    does not call it (``oasr.fast.paged_ops`` documents what the kernels store instead). ``ValueError``
    naming the op, the tensor and the first row and frame."""
    from oasr.kv_formats import get_format

    f = fmt if hasattr(fmt, "refuses_nan") else get_format(fmt)
    if not f.refuses_nan:
        return
    for name, t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if not bool(t.sum().isnan()):  # one pass: no NaN anywhere (a NaN sum of inf - inf is checked below)
            continue
        bad = t.isnan()
        if lens is not None:
            bad = bad.flatten(2).any(dim=-1)
            frames = torch.arange(t.shape[1], device=t.device)
            bad &= frames[None, :] < torch.as_tensor(lens, device=t.device).long()[:, None]
        if bool(bad.any()):
            at = [int(i) for i in bad.nonzero()[0].tolist()]
            where = f" at row {at[0]}, frame {at[1]}" if lens is not None else f" at index {tuple(at)}"
            raise ValueError(f"{op}: {name} holds NaN{where}; {f.name} K/V pages refuse NaN (K/V must be "
                             f"numbers); nothing was written")


def check_query(cache, q: torch.Tensor) -> None:
    """Checks shared by both twins' ``paged_attention``: ``q`` is ``(B, n_head, T, head_dim)`` (heads
    before frames, unlike K/V), ``n_head`` a multiple of ``n_kv_head``, in the view's served dtype, on
    the pool's device. ``ValueError`` naming what was expected and what came."""
    B, D = cache.batch_size, cache.head_dim

    def layout() -> str:
        return f"q must be (B={B}, n_head, T, head_dim={D}) (K/V are (B, T, n_kv_head, head_dim))"

    if q.dim() != 4 or q.shape[0] != B or q.shape[3] != D:
        raise ValueError(f"paged_attention: {layout()}, got {tuple(q.shape)}")
    if q.shape[1] % cache.n_kv_head != 0:
        raise ValueError(
            f"paged_attention: n_head={q.shape[1]} must be a multiple of "
            f"n_kv_head={cache.n_kv_head}; {layout()}, got {tuple(q.shape)}"
        )
    _check_dtype("paged_attention", "q", q, cache)
    if not same_device(q.device, cache.k_cache.device):
        raise ValueError(f"paged_attention: q is on {q.device}, the pool on {cache.k_cache.device}")


def expected_kv_lengths(config, total_frames: int) -> tuple[int, int]:
    """``(seqlen, seqstart)`` a stream holds after committing ``total_frames`` frames since admission.

    Eviction is a function of the frames written alone (``oasr.cache.config``): of the
    ``prefill_frames + total_frames`` table positions ever written, the whole blocks before the
    first visible position are gone, so the managers' lengths are determined by ``total_frames``.
    """
    written = config.prefill_frames + total_frames
    if not config.eviction:
        return written, 0
    visible = max(0, written - config.history_frames)
    dropped = visible // config.block_size_frames * config.block_size_frames
    return written - dropped, visible - dropped


def check_restore_lengths(config, seqlen, seqstart, total_frames) -> int:
    """Lengths a restored stream may carry (``ValueError`` naming them otherwise); returns its block count."""
    for name, value in (("seqlen", seqlen), ("seqstart", seqstart), ("total_frames", total_frames)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"restore_stream: {name} must be an int >= 0, got {value!r}")
    expected = expected_kv_lengths(config, total_frames)
    if (seqlen, seqstart) != expected:
        raise ValueError(
            f"restore_stream: seqlen={seqlen}, seqstart={seqstart} are not the lengths of a stream that "
            f"committed total_frames={total_frames} (expected seqlen={expected[0]}, seqstart={expected[1]} "
            f"for this geometry)"
        )
    return -(-seqlen // config.block_size_frames)


def check_restore_room(config, stream_id, need: int, free_blocks: int, slot_pools) -> None:
    """Raise unless a restored stream of ``need`` blocks can be admitted now: its block ceiling
    (``StreamCapacityError``), free blocks (``PoolExhaustedError``), a free slot in every pool
    (``SlotsExhaustedError``)."""
    if need > config.blocks_per_stream:
        raise StreamCapacityError(stream_id, need, config.blocks_per_stream)
    if need > free_blocks:
        raise PoolExhaustedError(need, free_blocks)
    for slots in slot_pools:
        if slots.num_free == 0:
            raise SlotsExhaustedError(slots.capacity)
