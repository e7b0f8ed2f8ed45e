"""Argument checks both twins share, so that they fail the same way with the same words."""

from __future__ import annotations

from oasr.errors import PoolExhaustedError, SlotsExhaustedError, StreamCapacityError


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
    """A dense-mode chunk must be ``(num_layers, n_kv_head, T, 2 * head_dim)``, ``1 <= T <= chunk_size``; returns T."""
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
    return shape[2]


def expected_kv_lengths(config, total_frames: int) -> tuple[int, int]:
    """``(seqlen, seqstart)`` a stream holds after committing ``total_frames`` frames since admission.

    Eviction is a function of the frames written alone (``oasr.config``): of the
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
