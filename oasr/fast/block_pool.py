"""Fast ``BlockPool``: the shared K/V pool with a numpy ring-buffer free list.

Fast twin of ``oasr.reference.block_pool.BlockPool``: same layout, same
methods, same errors, and the same block ids for the same op sequence.

Free list::

    _ring    int32 (max_num_blocks,)   circular; the free list is
             _ring[_head], _ring[_head + 1], ..., _count entries (mod max_num_blocks)
    _is_free bool  (max_num_blocks,)
    _owner   int32 (max_num_blocks,)   the owner tag each held block was allocated under (0: none)
    _refs    int32 (max_num_blocks,)   holders of each block (0: free); ``share`` raises, ``free`` lowers

``allocate`` pops from the head, ``free`` appends at the tail in the order
given, exactly like the reference's deque, so both twins hand out the same ids.
``allocate_array`` / ``free_array`` are the managers' hot-path entry points:
numpy in, numpy out, a constant number of numpy operations whatever the count.
The scratch blocks (ids ``[max_num_blocks, max_num_blocks + scratch_blocks)``)
are never on the free list and ``free`` refuses them, as in the reference.
Ownership (``new_owner``, ``owner=``) is the reference's, kept in the
``_owner`` array: one vectorised comparison in ``free_array``. Reference counts are the
reference's (``share``, ``ref_count``, ``free`` drops one reference per id and frees at 0, in
the order counts reach 0); ``copy_blocks`` is one indexed copy per pool tensor.
Parking (``publish``, ``num_parked_blocks``, ``drop_parked``) is the reference's, with the
parked blocks in an insertion-ordered dict and the keys in a list (host bookkeeping only).

Validation is vectorised; when it finds a bad id, the reference's loop is
replayed on the host to raise exactly the reference's error for the first bad
id in the order given. ``allocate*`` and ``free*`` are thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from oasr.cache.block_owners import NO_OWNER, OwnerRegistry
from oasr.cache.config import CacheConfig
from oasr.cache.errors import PoolExhaustedError
from oasr.cache.validate import check_count, gather_range
from oasr.fast.kv_formats import check_format_supported
from oasr.fast.paged_ops import gather_kv_blocks as _gather_kv_blocks
from oasr.fast.staging import Stager

_FEW_IDS = 16  # free_array takes the element loop up to this many ids


def _id_array(block_ids) -> tuple[list, np.ndarray]:
    """``block_ids`` as Python ints (for messages) and as int64 (an id past int64 becomes -1: out of range)."""
    if isinstance(block_ids, np.ndarray) and block_ids.dtype.kind == "i" and block_ids.ndim == 1:
        ids = block_ids.astype(np.int64)  # (the managers' arrays: no per-element conversion)
        return ids.tolist(), ids
    ids = [int(i) for i in block_ids]
    try:
        return ids, np.array(ids, dtype=np.int64)
    except OverflowError:
        return ids, np.array([i if -(2**63) <= i < 2**63 else -1 for i in ids], dtype=np.int64)


class BlockPool:
    def __init__(self, config: CacheConfig, scratch_blocks: int = 1):
        check_count("BlockPool", "scratch_blocks", scratch_blocks)
        self.config = config
        self.scratch_blocks = scratch_blocks
        shape = (
            config.num_layers,
            config.max_num_blocks + scratch_blocks,
            config.block_size_frames,
            config.n_kv_head,
            config.kv_data_dim,
        )
        if config.kv_quantized:  # the format gate: refuse now what this backend cannot serve, not at the first chunk
            check_format_supported(config.kv_cache_dtype, config.head_dim, config.device, dtype=config.dtype)
        self.k_pool = torch.zeros(shape, dtype=config.kv_storage_dtype, device=config.device)
        self.v_pool = torch.zeros(shape, dtype=config.kv_storage_dtype, device=config.device)
        self.k_scale = self.v_scale = None
        if config.kv_quantized:
            scale_shape = shape[:-1] + config.kv_scale_shape
            self.k_scale = torch.zeros(scale_shape, dtype=config.kv_scale_dtype, device=config.device)
            self.v_scale = torch.zeros(scale_shape, dtype=config.kv_scale_dtype, device=config.device)
        n = config.max_num_blocks
        self._ring = np.arange(n, dtype=np.int32)
        self._head = 0
        self._count = n
        self._is_free = np.ones(n, dtype=bool)
        self._last_place = np.zeros(n, dtype=np.int64)  # free_array's duplicate check
        self._owner = np.zeros(n, dtype=np.int32)  # NO_OWNER
        self._refs = np.zeros(n, dtype=np.int32)
        self._key: list = [None] * n
        self._keyed = np.zeros(n, dtype=bool)  # a key is set (vectorised parking test in free_array)
        self._parked: OrderedDict[int, None] = OrderedDict()
        self._owners = OwnerRegistry()
        self._lock = threading.Lock()
        self._stager = Stager([(n + scratch_blocks, torch.int64)], config.device)
        self._copy_stager = Stager([(n, torch.int64), (n, torch.int64)], config.device)
        self._host_bytes = None  # on the CPU, numpy views of the pool tensors' bytes (block copies)

    # ---- counts -----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Allocatable blocks (``max_num_blocks``), scratch excluded."""
        return self.config.max_num_blocks

    @property
    def num_free_blocks(self) -> int:
        """The free list plus the parked blocks (see the reference)."""
        return self._count + len(self._parked)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by an owner (``num_blocks - num_free_blocks``; parked blocks count as free)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_parked_blocks(self) -> int:
        """Published blocks with no holder: free, but still found by their hash until reclaimed."""
        return len(self._parked)

    def parked_block_ids(self) -> list[int]:
        """The parked blocks, least recently parked first (the order they are reclaimed in)."""
        with self._lock:
            return list(self._parked)

    def key_of(self, block_id: int):
        """The prefix-cache hash a block is published under, or None."""
        return self._key[int(block_id)]

    @property
    def scratch_block_ids(self) -> list[int]:
        """The scratch blocks past ``num_blocks``: never on the free list, written only by padding rows."""
        return list(range(self.num_blocks, self.num_blocks + self.scratch_blocks))

    @property
    def null_block(self) -> int:
        """Block id of table entries that map no stream data (see the reference)."""
        return self.num_blocks if self.scratch_blocks else 0

    def _ring_positions(self, start: int, count: int) -> np.ndarray:
        return (start + np.arange(count)) % max(self.num_blocks, 1)

    def free_block_ids(self) -> list[int]:
        """The free list, head first (a copy)."""
        with self._lock:
            return self._ring[self._ring_positions(self._head, self._count)].tolist()

    # ---- ownership (tags and messages: oasr.cache.block_owners) ----------------------
    def new_owner(self, name: str) -> int:
        """Register an owner (a manager) and return its tag for ``allocate`` / ``free``; its name in
        errors is ``"<name>#<tag>"``. Tags count from 1 in registration order."""
        return self._owners.register(name)

    def owner_of(self, block_id: int) -> str | None:
        """The name of the owner holding ``block_id``; None for a free or unowned block."""
        return self._owners.name(int(self._owner[int(block_id)]))

    def ref_count(self, block_id: int) -> int:
        """How many holders ``block_id`` has (0 for a free block)."""
        return int(self._refs[int(block_id)])

    def ref_counts(self) -> list[int]:
        """Every allocatable block's count, by id (a copy)."""
        with self._lock:
            return self._refs.tolist()

    # ---- allocation -------------------------------------------------------
    def allocate(self, n: int, owner: int = NO_OWNER) -> list[int]:
        """Pop ``n`` block ids from the head of the free list, held under ``owner``; all or nothing."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"BlockPool.allocate: n must be an int >= 0, got {n!r}")
        return self.allocate_array(n, owner).tolist()

    def allocate_array(self, n, owner: int = NO_OWNER) -> np.ndarray:
        """``allocate`` returning an int64 numpy array (the managers' hot path; numpy ints accepted)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"BlockPool.allocate: n must be an int >= 0, got {n!r}")
        owner = self._owners.check("allocate", owner)
        n = int(n)
        with self._lock:
            if n > self._count + len(self._parked):
                raise PoolExhaustedError(n, self._count + len(self._parked))
            if n > self._count:  # the whole free list, then parked blocks, least recently parked first
                reclaimed = [self._parked.popitem(last=False)[0] for _ in range(n - self._count)]
                for i in reclaimed:
                    self._key[i] = None
                self._keyed[reclaimed] = False
                ids = np.concatenate([self._ring[self._ring_positions(self._head, self._count)].astype(np.int64),
                                      np.array(reclaimed, dtype=np.int64)])
                self._head, self._count = 0, 0
                self._is_free[ids] = False
                self._owner[ids] = owner
                self._refs[ids] = 1
                return ids
            head = self._head
            if head + n <= self.num_blocks:
                ids = self._ring[head : head + n].astype(np.int64)
            else:
                ids = self._ring[self._ring_positions(head, n)].astype(np.int64)
            self._head = (head + n) % self.num_blocks if self.num_blocks else 0
            self._count -= n
            self._is_free[ids] = False
            self._owner[ids] = owner
            self._refs[ids] = 1
            return ids

    def publish(self, block_ids, keys, owner: int = NO_OWNER) -> None:
        """See the reference: name held blocks by ``keys``; they park instead of freeing at count 0."""
        given, ids = _id_array(block_ids)
        keys = list(keys)
        owner = self._owners.check("publish", owner)
        if ids.size != len(keys):
            raise ValueError(f"BlockPool.publish: {ids.size} blocks for {len(keys)} keys")
        with self._lock:
            for i in given:
                if not 0 <= i < self.num_blocks or self._refs[i] == 0 or self._owner[i] != owner:
                    raise ValueError(f"BlockPool.publish: block {i} is not held by {self._owners.name(owner)}")
            for i, key in zip(given, keys, strict=True):
                self._key[i] = key
            self._keyed[ids] = True

    def drop_parked(self) -> int:
        """Every parked block to the tail of the free list, keys forgotten; returns how many."""
        with self._lock:
            ids = np.array(list(self._parked), dtype=np.int64)
            self._parked.clear()
            for i in ids.tolist():
                self._key[i] = None
            self._keyed[ids] = False
            self._push_free(ids)
            return int(ids.size)

    def _push_free(self, ids) -> None:
        """``ids`` (an int array, or a list of a few ints: element by element) to the free list's tail."""
        if isinstance(ids, list):
            tail, size = self._head + self._count, max(self.num_blocks, 1)
            for j, i in enumerate(ids):
                self._ring[(tail + j) % size] = i
                self._is_free[i] = True
                self._owner[i] = NO_OWNER
            self._count += len(ids)
            return
        positions = self._ring_positions(self._head + self._count, ids.size)
        self._ring[positions] = ids
        self._is_free[ids] = True
        self._owner[ids] = NO_OWNER
        self._count += ids.size

    def share(self, block_ids, owner: int = NO_OWNER) -> None:
        """One more holder per id given (repeats count once each); all or nothing; held under ``owner``."""
        given, ids = _id_array(block_ids)
        owner = self._owners.check("share", owner)
        with self._lock:
            if ids.size:
                if ids.size <= _FEW_IDS:  # a few ids: element checks, then one scatter (repeats: add.at)
                    n = self.num_blocks
                    bad = [not 0 <= i < n or self._is_free[i] or self._owner[i] != owner for i in given]
                else:
                    in_range = (ids >= 0) & (ids < self.num_blocks)
                    safe = np.where(in_range, ids, 0)
                    bad = ~in_range | self._is_free[safe] | (self._owner[safe] != owner)
                if any(bad) if isinstance(bad, list) else bad.any():
                    self._raise_share_error(given[bad.index(True) if isinstance(bad, list) else int(np.argmax(bad))],
                                            owner)
                if len(set(given)) < len(given):
                    np.add.at(self._refs, ids, 1)
                else:  # no repeats: a plain scatter (np.add.at is several times slower on small arrays)
                    self._refs[ids] += 1
                if self._parked:
                    for i in given:
                        self._parked.pop(i, None)  # a parked block taken back

    def _raise_share_error(self, i: int, owner: int) -> None:
        if not 0 <= i < self.num_blocks:
            raise ValueError(f"BlockPool.share: block id {i} outside [0, {self.num_blocks})")
        if self._is_free[i]:
            raise ValueError(f"BlockPool.share: block {i} is free; only a held or parked block can be shared")
        raise ValueError(f"BlockPool.share: block {i} is held by {self._owners.name(int(self._owner[i]))}, not by "
                         f"{self._owners.name(owner)}; blocks are shared within one owner")

    def free(self, block_ids, owner: int = NO_OWNER) -> None:
        """Return ``block_ids`` to the tail of the free list, in order; all or nothing. Each must be
        held under ``owner``."""
        ids, array = _id_array(block_ids)
        self.free_array(array, ids, owner)

    def free_array(self, ids: np.ndarray, as_given: list | None = None, owner: int = NO_OWNER) -> None:
        """``free`` of an integer numpy array (the managers' hot path).

        ``as_given`` is the caller's id list, used only in the error message.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        owner = self._owners.check("free", owner)
        with self._lock:
            n, k = self.num_blocks, ids.size
            if k <= _FEW_IDS:  # a few ids (a row's pages): a plain loop beats ~20 vector ops of setup
                self._free_few(ids.tolist(), as_given, owner)
                return
            if k:
                in_range = (ids >= 0) & (ids < n)
                safe = np.where(in_range, ids, 0)
                repeats = False
                if k > 1:
                    ordered = np.sort(safe)
                    repeats = bool((ordered[1:] == ordered[:-1]).any())  # cheaper than unique when none repeat
                # an id given more often than it has holders is a double free (a parked block has none), as
                # in the reference's loop: once each below, and for repeated ids their counts here
                over = False
                if repeats:  # runs of the sorted ids: each distinct id and how often it is given
                    first = np.concatenate([[True], ordered[1:] != ordered[:-1]])
                    counts = np.diff(np.append(np.flatnonzero(first), k))
                    over = bool((counts > self._refs[ordered[first]]).any())
                bad = ~in_range | self._is_free[safe] | (self._owner[safe] != owner) | (self._refs[safe] < 1)
                if over or bad.any():
                    self._raise_free_error(ids.tolist() if as_given is None else as_given, owner)
                if repeats:
                    np.subtract.at(self._refs, ids, 1)
                else:
                    self._refs[ids] -= 1
                done = self._refs[ids] == 0
                if repeats:  # a repeated id reaches 0 at its last place
                    position = np.arange(k)
                    self._last_place[ids] = position
                    done &= self._last_place[ids] == position
                ids = ids[done]
                park = self._keyed[ids]
                if park.any():
                    for i in ids[park].tolist():
                        self._parked[i] = None
                    ids = ids[~park]
            self._push_free(ids)

    def _free_few(self, given: list, as_given: list | None, owner: int) -> None:
        """``free_array`` for a few ids, element by element: the same checks, order and effect."""
        self._check_free_few(given, as_given, owner)
        self._drop_few(given)

    def _check_free_few(self, given: list, as_given: list | None, owner: int) -> None:
        n, seen = self.num_blocks, {}
        for i in given:
            if not 0 <= i < n or self._is_free[i] or self._owner[i] != owner or seen.get(i, 0) >= self._refs[i]:
                self._raise_free_error(given if as_given is None else as_given, owner)
            seen[i] = seen.get(i, 0) + 1

    def _drop_few(self, given: list) -> None:
        freed = []
        for i in given:  # a repeated id reaches 0 at its last place, as in the vectorised path
            self._refs[i] -= 1
            if self._refs[i] == 0:
                if self._keyed[i]:
                    self._parked[i] = None
                else:
                    freed.append(i)
        if freed:
            self._push_free(freed)

    def _free_and_share(self, released: list, taken: list, owner: int) -> None:
        """``free(released)`` then ``share(taken)`` of a few int ids under one lock (a manager's select
        of a beam: the dropped rows' references go, the forks' come), every id checked before anything
        changes (the same messages as the two calls). ``owner`` is a registered owner id."""
        with self._lock:
            self._check_free_few(released, None, owner)
            n = self.num_blocks
            for i in taken:  # (a fork's parent is kept: what it holds cannot reach 0 above)
                if not 0 <= i < n or self._is_free[i] or self._owner[i] != owner:
                    self._raise_share_error(i, owner)
            self._drop_few(released)
            for i in taken:
                self._refs[i] += 1
            if self._parked:
                for i in taken:
                    self._parked.pop(i, None)

    def _raise_free_error(self, ids: list, owner: int) -> None:
        """The reference's validation loop, run only to raise its error for the first bad id."""
        seen: dict[int, int] = {}
        for i in ids:
            if self.num_blocks <= i < self.num_blocks + self.scratch_blocks:
                raise ValueError(f"BlockPool.free: block {i} is a scratch block and is never freed")
            if not 0 <= i < self.num_blocks:
                raise ValueError(f"BlockPool.free: block id {i} outside [0, {self.num_blocks})")
            if self._is_free[i] or seen.get(i, 0) >= self._refs[i]:
                raise ValueError(f"BlockPool.free: block {i} is already free (double free)")
            if self._owner[i] != owner:
                raise self._owners.wrong_owner(i, int(self._owner[i]), owner)
            seen[i] = seen.get(i, 0) + 1
        raise AssertionError("BlockPool.free: vectorised validation flagged ids the loop accepts")

    def copy_blocks(self, src, dst) -> None:
        """Copy block ``src[j]`` onto block ``dst[j]`` (K, V, scales, every layer): one staged copy of the
        ids, then one ``index_copy_`` per pool tensor (the copy-on-write of a whole step at once).
        As the reference: every destination gets its source's contents from before the call (the
        sources are gathered first); a destination given twice is refused."""
        _, s = _id_array(src)
        given, d = _id_array(dst)
        if s.size != d.size:
            raise ValueError(f"BlockPool.copy_blocks: {s.size} sources for {d.size} destinations")
        both = np.concatenate([s, d])
        bad = (both < 0) | (both >= self.num_blocks)
        if bad.any():
            i = int(both[int(np.argmax(bad))])
            raise ValueError(f"BlockPool.copy_blocks: block id {i} outside [0, {self.num_blocks})")
        if len(set(given)) < len(given):
            values, counts = np.unique(d, return_counts=True)
            twice = int(values[int(np.argmax(counts > 1))])
            raise ValueError(f"BlockPool.copy_blocks: destination block {twice} given more than once")
        if s.size:
            self._copy_ids(s, d)

    def _copy_ids(self, s: np.ndarray, d: np.ndarray) -> None:
        """``copy_blocks`` of int64 ids its caller has checked (a manager's copy-on-write of blocks it
        holds onto blocks it just took): the copies alone."""
        if self.k_pool.device.type == "cpu":  # the pool's bytes through numpy (a fancy read copies first)
            if self._host_bytes is None:
                self._host_bytes = [t.view(torch.uint8).numpy() for t in (self.k_pool, self.v_pool, self.k_scale,
                                                                          self.v_scale) if t is not None]
            for data in self._host_bytes:
                data[:, d] = data[:, s]
            return
        src_d, dst_d = self._copy_stager.stage(s, d)
        for pool in (self.k_pool, self.v_pool, self.k_scale, self.v_scale):
            if pool is not None:
                data = pool.view(torch.uint8) if pool.dtype.itemsize == 1 else pool
                data.index_copy_(1, dst_d, data.index_select(1, src_d))

    def _device_ids(self, ids: np.ndarray) -> torch.Tensor:
        """Block ids as an int64 device tensor, through the pool's staged copy."""
        (index,) = self._stager.stage(ids)
        return index

    def zero_blocks(self, block_ids) -> None:
        """Zero K and V of ``block_ids`` in every layer (one staged copy, two device fills)."""
        given, ids = _id_array(block_ids)
        bad = (ids < 0) | (ids >= self.num_blocks + self.scratch_blocks)
        if bad.any():
            i = given[int(np.argmax(bad))]
            raise ValueError(f"BlockPool.zero_blocks: block id {i} outside the pool")
        if ids.size:
            index = self._device_ids(ids)
            if self.k_scale is None:
                self.k_pool.index_fill_(1, index, 0)
                self.v_pool.index_fill_(1, index, 0)
            else:  # index_fill_ has no fp8 kernel: zero the bytes (0x00 is +0.0 in e4m3)
                self.k_pool.view(torch.uint8).index_fill_(1, index, 0)
                self.v_pool.view(torch.uint8).index_fill_(1, index, 0)
                self.k_scale.index_fill_(1, index, 0)
                self.v_scale.index_fill_(1, index, 0)

    # ---- tensor entry points ----------------------------------------------
    def get_kv_view(self, layer: int):
        """``(k, v)`` of one layer, each ``(num_pool_blocks, block_size, n_kv_head, head_dim)``."""
        return self.k_pool[layer], self.v_pool[layer]

    def get_kv_scale_view(self, layer: int):
        """``(k_scale, v_scale)`` of one layer, each ``(num_pool_blocks, block_size, n_kv_head)``;
        ``(None, None)`` unless the pool stores fp8."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def get_kv_block_view(self, layer: int, block_id: int):
        """``(k, v)`` of one block in one layer, each ``(block_size, n_kv_head, head_dim)``."""
        return self.k_pool[layer, block_id], self.v_pool[layer, block_id]

    def gather_kv_blocks(self, block_ids, start: int = 0, num_frames: int | None = None) -> torch.Tensor:
        """Dense packed K|V of frames ``[start, start + num_frames)`` of the concatenated blocks.

        Validates like the reference, then runs ``oasr.fast.paged_ops.gather_kv_blocks``. Returns
        ``(num_layers, n_kv_head, num_frames, 2 * head_dim)``, K then V in the last dimension.
        """
        _, ids = _id_array(block_ids)
        num_frames = gather_range(ids.size, self.config.block_size_frames, start, num_frames)
        if not ids.size:
            L, _, _, H, D = *self.k_pool.shape[:4], self.config.head_dim
            return self.k_pool.new_zeros((L, H, 0, 2 * D), dtype=self.config.dtype)
        return _gather_kv_blocks(
            self.k_pool, self.v_pool, self._device_ids(ids), start, num_frames,
            k_scale=self.k_scale, v_scale=self.v_scale, out_dtype=self.config.dtype,
            kv_format=self.config.kv_cache_dtype,
        )  # fmt: skip
