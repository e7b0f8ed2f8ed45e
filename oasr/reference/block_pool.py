"""Reference ``BlockPool``: the shared K/V pool and a Python free list under a lock.

Readable oracle; its fast twin is ``oasr.fast.block_pool.BlockPool``.

Layout::

    k_pool, v_pool   (num_layers, max_num_blocks + scratch_blocks, block_size_frames, n_kv_head, head_dim)

With a quantized ``kv_cache_dtype`` (``oasr.kv_formats``) the pools hold the
format's data, ``(..., n_kv_head, kv_data_dim)`` of ``kv_storage_dtype``, and two
more tensors, ``k_scale`` and ``v_scale`` of shape ``(num_layers, num_pool_blocks,
block_size_frames, n_kv_head, *kv_scale_shape)``, hold its scale plane (fp8 and
int8: one fp32 scale per vector); they are zeroed wherever the data is zeroed,
and ``gather_kv_blocks`` dequantizes.

One block id addresses the same frames in every layer. Ids ``[0, max_num_blocks)``
are allocatable; the ``scratch_blocks`` ids after them are scratch: never on the
free list, refused by ``free``, and the target of every table entry that maps
no stream data (padding-lane rows, unused table columns).

Ownership. A manager registers itself once (``owner = pool.new_owner("AttentionCacheManager")``,
a small int tag; 0 means "no owner") and allocates and frees with ``owner=``. Each held block
records the tag it was allocated under, and ``free`` refuses a block held under another tag,
naming its owner: a stream's blocks cannot be freed from outside its manager (which would leave
the stream unable to free or reset). Plain ``allocate(n)`` / ``free(ids)`` work on unowned blocks.
Reference counts. A held block carries a count of holders (table entries of its owner that point
at it): ``allocate`` sets it to 1, ``share(ids, owner)`` raises it by one per id (a block may be
held by several rows of its owner: copy-on-write beams, a cached prompt prefix), ``free`` drops one
reference per id given and returns a block to the free list only when its count reaches 0. The
owner tag stays one per block: sharing is among the rows of one manager, never across owners.
``copy_blocks(src, dst)`` copies whole blocks (K, V, scales) in every layer, the copy-on-write step,
as one batched copy (each destination gets its source's old contents; a repeated destination is refused).

Parking (prefix caching). ``publish(ids, keys, owner)`` names held blocks by a key (a prefix
hash). A published block whose count reaches 0 is parked, not freed: it keeps its bytes, its
owner and its key, and counts as free (``num_free_blocks`` = free list + parked). ``share`` on a
parked block takes it back (count 1). ``allocate`` takes the free list first, then parked blocks
least recently parked first, forgetting their keys (``key_of`` answers None afterwards, so a
stale index entry can tell). ``drop_parked`` sends every parked block to the free list.

Invariants (checked by the tests after every operation):
  * free ids are unique and disjoint from allocated ids and scratch ids;
  * held + parked + free == max_num_blocks (held: count >= 1);
  * a held block has count >= 1, a free block count 0; the sum of counts equals the table
    entries (of every owner) that point at held blocks;
  * ``allocate`` pops from the head of the free list, ``free`` appends in the
    order given, so block ids are deterministic for a given op sequence.

``allocate`` and ``free`` are thread-safe; everything else is called from the
engine's step loop only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

import torch

from oasr.cache.block_owners import NO_OWNER, OwnerRegistry
from oasr.cache.config import CacheConfig
from oasr.cache.errors import PoolExhaustedError
from oasr.cache.validate import check_count, gather_range


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
        self.k_pool = torch.zeros(shape, dtype=config.kv_storage_dtype, device=config.device)
        self.v_pool = torch.zeros(shape, dtype=config.kv_storage_dtype, device=config.device)
        self.k_scale = self.v_scale = None
        if config.kv_quantized:
            scale_shape = shape[:-1] + config.kv_scale_shape
            self.k_scale = torch.zeros(scale_shape, dtype=config.kv_scale_dtype, device=config.device)
            self.v_scale = torch.zeros(scale_shape, dtype=config.kv_scale_dtype, device=config.device)
        self._free = deque(range(config.max_num_blocks))
        self._is_free = [True] * config.max_num_blocks
        self._owner = [NO_OWNER] * config.max_num_blocks  # tag each held block was allocated under
        self._refs = [0] * config.max_num_blocks  # holders of each block (0: free or parked)
        self._key: list = [None] * config.max_num_blocks  # the key a published block carries
        self._parked: OrderedDict[int, None] = OrderedDict()  # least recently parked first
        self._owners = OwnerRegistry()
        self._lock = threading.Lock()

    # ---- counts -----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Allocatable blocks (``max_num_blocks``), scratch excluded."""
        return self.config.max_num_blocks

    @property
    def num_free_blocks(self) -> int:
        """The free list plus the parked blocks (an allocation may take either)."""
        return len(self._free) + len(self._parked)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by an owner (``num_blocks - num_free_blocks``; parked blocks count as free)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_parked_blocks(self) -> int:
        """Published blocks with no holder: free, but still found by their hash until reclaimed."""
        return len(self._parked)

    def parked_block_ids(self) -> list[int]:
        """Parked blocks, least recently parked first (a copy)."""
        with self._lock:
            return list(self._parked)

    def key_of(self, block_id: int):
        """The key ``block_id`` was published under (held or parked), or None."""
        return self._key[int(block_id)]

    @property
    def scratch_block_ids(self) -> list[int]:
        """The scratch blocks past ``num_blocks``: never on the free list, written only by padding rows."""
        return list(range(self.num_blocks, self.num_blocks + self.scratch_blocks))

    @property
    def null_block(self) -> int:
        """Block id written into table entries that map no stream data: the first scratch block
        (block 0 when the pool has no scratch, which then must never be written through)."""
        return self.num_blocks if self.scratch_blocks else 0

    def free_block_ids(self) -> list[int]:
        """The free list, head first (a copy)."""
        with self._lock:
            return list(self._free)

    # ---- ownership (tags and messages: oasr.cache.block_owners) ----------------------
    def new_owner(self, name: str) -> int:
        """Register an owner (a manager) and return its tag for ``allocate`` / ``free``; its name in
        errors is ``"<name>#<tag>"``. Tags count from 1 in registration order."""
        return self._owners.register(name)

    def owner_of(self, block_id: int) -> str | None:
        """The name of the owner holding ``block_id``; None for a free or unowned block."""
        return self._owners.name(self._owner[int(block_id)])

    def ref_count(self, block_id: int) -> int:
        """How many holders ``block_id`` has (0 for a free block)."""
        return self._refs[int(block_id)]

    def ref_counts(self) -> list[int]:
        """Every allocatable block's count, by id (a copy)."""
        with self._lock:
            return list(self._refs)

    # ---- allocation -------------------------------------------------------
    def allocate(self, n: int, owner: int = NO_OWNER) -> list[int]:
        """Pop ``n`` block ids from the head of the free list, held under ``owner``; all or nothing."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"BlockPool.allocate: n must be an int >= 0, got {n!r}")
        owner = self._owners.check("allocate", owner)
        with self._lock:
            if n > len(self._free) + len(self._parked):
                raise PoolExhaustedError(n, len(self._free) + len(self._parked))
            ids = [self._free.popleft() for _ in range(min(n, len(self._free)))]
            while len(ids) < n:  # reclaim parked blocks, least recently parked first
                i, _ = self._parked.popitem(last=False)
                self._key[i] = None
                ids.append(i)
            for i in ids:
                self._is_free[i] = False
                self._owner[i] = owner
                self._refs[i] = 1
            return ids

    def publish(self, block_ids, keys, owner: int = NO_OWNER) -> None:
        """Name held blocks by ``keys`` (one each); they park instead of freeing at count 0."""
        ids, keys = [int(i) for i in block_ids], list(keys)
        owner = self._owners.check("publish", owner)
        if len(ids) != len(keys):
            raise ValueError(f"BlockPool.publish: {len(ids)} blocks for {len(keys)} keys")
        with self._lock:
            for i in ids:
                if not 0 <= i < self.num_blocks or self._refs[i] == 0 or self._owner[i] != owner:
                    raise ValueError(f"BlockPool.publish: block {i} is not held by {self._owners.name(owner)}")
            for i, key in zip(ids, keys, strict=True):
                self._key[i] = key

    def drop_parked(self) -> int:
        """Every parked block to the tail of the free list (least recently parked first), keys
        forgotten; returns how many."""
        with self._lock:
            ids = list(self._parked)
            self._parked.clear()
            for i in ids:
                self._key[i] = None
                self._is_free[i] = True
                self._owner[i] = NO_OWNER
                self._free.append(i)
            return len(ids)

    def share(self, block_ids, owner: int = NO_OWNER) -> None:
        """One more holder for each id given (repeats count once each); all or nothing. Each must be held
        under ``owner``."""
        ids = [int(i) for i in block_ids]
        owner = self._owners.check("share", owner)
        with self._lock:
            for i in ids:
                if not 0 <= i < self.num_blocks:
                    raise ValueError(f"BlockPool.share: block id {i} outside [0, {self.num_blocks})")
                if self._is_free[i]:
                    raise ValueError(f"BlockPool.share: block {i} is free; only a held or parked block can be shared")
                if self._owner[i] != owner:
                    raise ValueError(f"BlockPool.share: block {i} is held by {self._owners.name(self._owner[i])}, "
                                     f"not by {self._owners.name(owner)}; blocks are shared within one owner")
            for i in ids:
                self._refs[i] += 1
                self._parked.pop(i, None)  # a parked block taken back

    def free(self, block_ids, owner: int = NO_OWNER) -> None:
        """Drop one reference per id given; a block whose count reaches 0 goes to the tail of the free
        list, in the order the counts reach 0; all or nothing. Each must be held under ``owner`` (a
        manager's blocks are freed by that manager only); an id given more times than it has holders
        is a double free."""
        ids = [int(i) for i in block_ids]
        owner = self._owners.check("free", owner)
        with self._lock:
            seen: dict[int, int] = {}
            for i in ids:
                if self.num_blocks <= i < self.num_blocks + self.scratch_blocks:
                    raise ValueError(f"BlockPool.free: block {i} is a scratch block and is never freed")
                if not 0 <= i < self.num_blocks:
                    raise ValueError(f"BlockPool.free: block id {i} outside [0, {self.num_blocks})")
                if self._is_free[i] or seen.get(i, 0) >= self._refs[i]:
                    raise ValueError(f"BlockPool.free: block {i} is already free (double free)")
                if self._owner[i] != owner:
                    raise self._owners.wrong_owner(i, self._owner[i], owner)
                seen[i] = seen.get(i, 0) + 1
            for i in ids:
                self._refs[i] -= 1
                if self._refs[i] == 0 and self._key[i] is not None:
                    self._parked[i] = None
                elif self._refs[i] == 0:
                    self._is_free[i] = True
                    self._owner[i] = NO_OWNER
                    self._free.append(i)

    def copy_blocks(self, src, dst) -> None:
        """Copy block ``src[j]`` onto block ``dst[j]`` (K, V and scales, every layer): copy-on-write.

        One batched copy: every destination receives its source's contents from before the call,
        also when a destination is another pair's source (``copy_blocks([1, 2], [2, 3])`` puts the
        old block 1 in 2 and the old block 2 in 3). A destination given twice is refused
        (``ValueError``, nothing copied): it would have two contents.
        """
        src, dst = [int(i) for i in src], [int(i) for i in dst]
        if len(src) != len(dst):
            raise ValueError(f"BlockPool.copy_blocks: {len(src)} sources for {len(dst)} destinations")
        for i in src + dst:
            if not 0 <= i < self.num_blocks:
                raise ValueError(f"BlockPool.copy_blocks: block id {i} outside [0, {self.num_blocks})")
        twice = sorted({d for d in dst if dst.count(d) > 1})
        if twice:
            raise ValueError(f"BlockPool.copy_blocks: destination block {twice[0]} given more than once")
        tensors = [t for t in (self.k_pool, self.v_pool, self.k_scale, self.v_scale) if t is not None]
        old = [[t[:, s].clone() for t in tensors] for s in src]  # every source read before any write
        for d, contents in zip(dst, old, strict=True):
            for t, block in zip(tensors, contents, strict=True):
                t[:, d] = block

    def zero_blocks(self, block_ids) -> None:
        """Zero K and V of ``block_ids`` in every layer."""
        for i in block_ids:
            i = int(i)
            if not 0 <= i < self.num_blocks + self.scratch_blocks:
                raise ValueError(f"BlockPool.zero_blocks: block id {i} outside the pool")
        for i in block_ids:
            self.k_pool[:, int(i)].zero_()
            self.v_pool[:, int(i)].zero_()
            if self.k_scale is not None:
                self.k_scale[:, int(i)].zero_()
                self.v_scale[:, int(i)].zero_()

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

        Returns ``(num_layers, n_kv_head, num_frames, 2 * head_dim)`` in the model dtype, K in the
        first half of the last dimension, V in the second (dequantized when the pool stores fp8).
        """
        ids = [int(i) for i in block_ids]
        bs = self.config.block_size_frames
        num_frames = gather_range(len(ids), bs, start, num_frames)
        if not ids:
            L, _, _, H, D = *self.k_pool.shape[:4], self.config.head_dim
            return torch.zeros((L, H, 0, 2 * D), dtype=self.config.dtype, device=self.k_pool.device)
        pieces_k, pieces_v = [], []
        for i in ids:
            k, v = self.k_pool[:, i], self.v_pool[:, i]  # (L, bs, H, D)
            if self.k_scale is not None:
                k = self.config.kv_format.dequantize(k, self.k_scale[:, i], self.config.dtype)
                v = self.config.kv_format.dequantize(v, self.v_scale[:, i], self.config.dtype)
            pieces_k.append(k)
            pieces_v.append(v)
        k = torch.cat(pieces_k, dim=1)[:, start : start + num_frames]  # (L, T, H, D)
        v = torch.cat(pieces_v, dim=1)[:, start : start + num_frames]
        return torch.cat([k, v], dim=-1).transpose(1, 2).contiguous()
