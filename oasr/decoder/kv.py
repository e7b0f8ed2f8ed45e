"""A decode group's K/V, in either storage: dense per-group buffers, or rows of the paged pool.

A *group* is the rows one decode call advances together (a batch of requests,
or the beams of one request). The model talks to a group through five verbs,
whatever the storage::

    prefill(b, k, v)          row b's prompt K/V, (L, T, H, D)      (the prompt itself attends fresh)
    fill_cross(b, k, v)       row b's cross K/V from the encoder, (L, S, H, D), converted to the model dtype
    begin_step()              before a step of one token per row
    write(layer, k, v)        this step's (B, 1, H, D) at each row's length
    attend_self(layer, q)     q (B, n_head, 1, D) over [0, length + 1), causal
    attend_cross(layer, q)    q (B, n_head, T, D) over each row's cross extent
    end_step()                every row's length + 1

``DenseDecoderKV`` (``kv_storage="dense"``): per layer ``(B, H, cap, D)`` K and V
(and ``(B, H, cap)`` fp32 scales with fp8), rows by position in the group.
``select(idx)`` gathers rows, repeats allowed (beam expansion); ``merge`` stacks
two groups. The buffers move with every ``select``, so a captured graph cannot
hold their addresses.

``PagedDecoderKV`` (``kv_storage="paged"``): rows of a ``DecoderKVCacheManager``,
a step written and read through the manager's ``open_step`` handle (``PagedKVCache``
views and the twin's ``append_kv`` / ``paged_attention``, or the fast twin's host
plan on a CPU); graph-stable addresses. ``select`` keeps and reorders rows;
a repeated index forks a row onto shared, copy-on-write pages.

fp8 (``kv_cache_dtype="fp8_e4m3"``): each written (token, head) vector is
quantized by the twin's own rule of the format (``oasr.kv_formats`` /
``oasr.fast.kv_formats``), one call per layer, and read
dequantized; select and merge move the scales with their rows.
"""

from __future__ import annotations

import math

import torch

from oasr.cache.validate import check_kv_numbers, same_device
from oasr.decoder.common import as_index, check_cross_fill, check_kv, check_step_kv, select_sources
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.kv_formats import get_format


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q (B, nH, T, D), k/v (B, Hkv, S, D) fp32, allowed (B, T, S) -> (B, nH, T, D); no key: zeros."""
    B, nH, T, D = q.shape
    G = nH // k.shape[1]
    kh = k.repeat_interleave(G, dim=1)
    vh = v.repeat_interleave(G, dim=1)
    scores = (q.float() @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    mask = allowed[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
    return (probs @ vh).to(q.dtype)


def _attend_shared(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, nH, T, D) of rows that all read one region, ``k_t`` (Hkv, D, S) and ``v`` (Hkv, S, D) fp32
    -> (B, nH, T, D) in q's dtype. The rows ride as queries of each KV head's group, ordered (row, query
    head in the group, t): one batched matmul each way for every row at once. No key (S = 0): zeros."""
    B, nH, T, D = q.shape
    Hkv, S = k_t.shape[0], k_t.shape[2]
    if S == 0:
        return torch.zeros_like(q)
    G = nH // Hkv
    qf = q.float().reshape(B, Hkv, G * T, D).transpose(0, 1).reshape(Hkv, B * G * T, D)
    probs = torch.bmm(qf, k_t).mul_(1.0 / math.sqrt(D)).softmax(-1)  # (any device: no constant tensor)
    out = torch.bmm(probs, v).view(Hkv, B, G * T, D).transpose(0, 1)
    return out.reshape(B, nH, T, D).to(q.dtype)



def group_row(b, batch: int, op: str) -> int:
    """Position ``b`` in a group of ``batch`` rows, as an int: an int or a numpy integer (never a bool,
    which would read as 0 or 1), ValueError otherwise; KeyError outside ``[0, batch)``."""
    b = as_index(b, "group rows", op)
    if not 0 <= b < batch:
        raise KeyError(f"{op}: row {b} outside the group's [0, {batch})")
    return b


class DenseDecoderKV:
    """Per-group dense buffers (module docstring). Subclassed by each twin with its format rules."""

    # (format, x (..., D), model dtype) -> (data, scale plane); (format, data, scales, dtype) -> values.
    # Set by the twin's subclass (oasr.kv_formats for the reference, oasr.fast.kv_formats for the fast twin).
    quantize = None
    dequantize = None

    def __init__(self, config: DecoderCacheConfig, batch: int, capacity: int, cross_capacity: int = 0):
        self.config = config
        L, H = config.num_layers, config.n_kv_head
        fmt = get_format(config.kv_cache_dtype)
        D, plane, sdt = fmt.data_dim(config.head_dim), fmt.scale_shape(config.head_dim), fmt.scale_dtype(config.dtype)
        dev, st = config.device, config.kv_storage_dtype
        self.capacity, self.cross_capacity = int(capacity), int(cross_capacity)
        shape, cross = (batch, H, self.capacity, D), (batch, H, self.cross_capacity, D)
        self.k = [torch.zeros(shape, dtype=st, device=dev) for _ in range(L)]
        self.v = [torch.zeros(shape, dtype=st, device=dev) for _ in range(L)]
        self.cross_k = [torch.zeros(cross, dtype=st, device=dev) for _ in range(L)]
        self.cross_v = [torch.zeros(cross, dtype=st, device=dev) for _ in range(L)]
        q = config.kv_quantized
        self.k_scale = [torch.zeros(shape[:-1] + plane, dtype=sdt, device=dev) for _ in range(L)] if q else None
        self.v_scale = [torch.zeros(shape[:-1] + plane, dtype=sdt, device=dev) for _ in range(L)] if q else None
        self.cross_k_scale = [torch.zeros(cross[:-1] + plane, dtype=sdt, device=dev) for _ in range(L)] if q else None
        self.cross_v_scale = [torch.zeros(cross[:-1] + plane, dtype=sdt, device=dev) for _ in range(L)] if q else None
        self.lengths = [0] * batch
        self.cross_lengths = [0] * batch

    # ---- storage helpers ----------------------------------------------------------
    _TENSORS = ("k", "v", "cross_k", "cross_v", "k_scale", "v_scale", "cross_k_scale", "cross_v_scale")

    @property
    def batch_size(self) -> int:
        """Rows in the group."""
        return len(self.lengths)

    def _store(self, data: list, scales, layer: int, rows, positions, x: torch.Tensor) -> None:
        """x (N, H, D) into data[layer][rows, :, positions] (quantized with the twin's rule of the format)."""
        if scales is None:
            data[layer][rows, :, positions] = x.to(data[layer].dtype)
        else:
            stored, scale = type(self).quantize(self.config.kv_cache_dtype, x, self.config.dtype)  # the twin's rule
            data[layer][rows, :, positions] = stored
            scales[layer][rows, :, positions] = scale

    def _load(self, data: list, scales, layer: int, end: int) -> torch.Tensor:
        x = data[layer][:, :, :end]
        if scales is None:
            return x.float()
        return type(self).dequantize(self.config.kv_cache_dtype, x, scales[layer][:, :, :end], torch.float32)

    # ---- writes ---------------------------------------------------------------------
    def _check_row(self, b, op: str) -> int:
        return group_row(b, self.batch_size, op)

    def _check_step_kv(self, layer, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write``'s arguments before anything is stored: a layer index, ``(B, 1, H, D)`` in the model dtype."""
        L = self.config.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
            raise ValueError(f"write: layer must be an int in [0, {L}), got {layer!r}")
        cfg = self.config
        want = (self.batch_size, 1, cfg.n_kv_head, cfg.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"write: {name} must be (B, 1, H, D) = {want}, got {got}")
            if not same_device(t.device, cfg.device):
                raise ValueError(f"write: {name} is on {t.device}, the group on {cfg.device}")
            if t.dtype != cfg.dtype:
                raise ValueError(f"write: {name} is {t.dtype}, the decoder serves {cfg.dtype} (no silent conversion)")
        check_kv_numbers("write", cfg.kv_cache_dtype, (("k", k), ("v", v)))  # NaN: refused before K is stored

    def prefill(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write row ``b``'s prompt K/V ``(L, T, n_kv_head, head_dim)`` into its empty buffer (``ValueError``
        otherwise).
        """
        b = self._check_row(b, "prefill")
        T = check_kv(self.config, k, v, "prefill", (), convert=False)
        if self.lengths[b]:
            raise ValueError(f"prefill: row {b} already holds {self.lengths[b]} tokens; prefill an empty row")
        if T > self.capacity:
            raise ValueError(f"prefill: a prompt of {T} tokens exceeds the group's capacity={self.capacity}")
        for layer in range(self.config.num_layers):
            self._store(self.k, self.k_scale, layer, b, slice(0, T), k[layer].transpose(0, 1))
            self._store(self.v, self.v_scale, layer, b, slice(0, T), v[layer].transpose(0, 1))
        self.lengths[b] = T

    def fill_cross(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Same rules as the manager's: idempotent same-length refill, converted dtype."""
        b = self._check_row(b, "fill_cross")
        T = check_kv(self.config, k, v, "fill_cross", (), convert=True)
        check_cross_fill(b, T, self.cross_capacity, self.cross_lengths[b])
        dtype = self.config.dtype
        for layer in range(self.config.num_layers):
            self._store(self.cross_k, self.cross_k_scale, layer, b, slice(0, T), k[layer].to(dtype).transpose(0, 1))
            self._store(self.cross_v, self.cross_v_scale, layer, b, slice(0, T), v[layer].to(dtype).transpose(0, 1))
        self.cross_lengths[b] = T

    def begin_step(self) -> None:
        """Start a decode step: every row must have room for one more token (``ValueError`` otherwise)."""
        full = [b for b, n in enumerate(self.lengths) if n >= self.capacity]
        if full:
            raise ValueError(f"row {full[0]} is at the group's capacity of {self.capacity} tokens")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's ``k, v (B, 1, H, D)`` at each row's length (one quantize-and-scatter per layer).
        The shape, dtype (the model's: no silent conversion) and device are checked first: a
        ``ValueError`` stores nothing."""
        self._check_step_kv(layer, k, v)
        rows = torch.arange(self.batch_size, device=k.device)
        pos = torch.tensor(self.lengths, device=k.device)
        self._store(self.k, self.k_scale, layer, rows, pos, k[:, 0])
        self._store(self.v, self.v_scale, layer, rows, pos, v[:, 0])

    def end_step(self) -> None:
        """Finish a decode step: every row is one token longer."""
        self.lengths = [n + 1 for n in self.lengths]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token for every row, ``k, v (L, B, H, D)`` in the model dtype, checked whole before any
        layer is written (``ValueError``, nothing stored)."""
        check_step_kv(self.config, k, v, self.batch_size)
        self.begin_step()
        for layer in range(self.config.num_layers):
            self.write(layer, k[layer][:, None], v[layer][:, None])
        self.end_step()

    # ---- reads ----------------------------------------------------------------------
    def attend_self(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``q`` over each row's own tokens at ``layer`` (the step's included)."""
        T = q.shape[2]
        lens = torch.tensor(self.lengths, device=q.device)
        end = max(self.lengths) + T
        k = self._load(self.k, self.k_scale, layer, end)
        v = self._load(self.v, self.v_scale, layer, end)
        key = torch.arange(end, device=q.device)
        query = lens[:, None] + torch.arange(T, device=q.device)[None, :]
        allowed = key[None, None, :] <= query[:, :, None]
        return _attend(q, k, v, allowed)

    def attend_cross(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over each row's cross-attention K/V (the encoder output) at ``layer``."""
        T = q.shape[2]
        end = max(self.cross_lengths, default=0)
        k = self._load(self.cross_k, self.cross_k_scale, layer, end)
        v = self._load(self.cross_v, self.cross_v_scale, layer, end)
        lens = torch.tensor(self.cross_lengths, device=q.device)
        allowed = (torch.arange(end, device=q.device)[None, :] < lens[:, None])[:, None, :].expand(-1, T, -1)
        return _attend(q, k, v, allowed)

    def gather_self(self, b: int) -> torch.Tensor:
        """Row b's self K/V as packed ``(L, H, length, 2D)`` in the model dtype (the manager's format)."""
        b = self._check_row(b, "gather_self")
        n = self.lengths[b]
        out = []
        for layer in range(self.config.num_layers):
            k = self._load(self.k, self.k_scale, layer, n)[b]
            v = self._load(self.v, self.v_scale, layer, n)[b]
            out.append(torch.cat([k, v], dim=-1).to(self.config.dtype))
        return torch.stack(out)

    # ---- beams ------------------------------------------------------------------------
    def _like(self, tensors: dict, lengths: list, cross_lengths: list) -> DenseDecoderKV:
        new = object.__new__(type(self))
        new.config, new.capacity, new.cross_capacity = self.config, self.capacity, self.cross_capacity
        for name in self._TENSORS:
            setattr(new, name, tensors.get(name))
        new.lengths, new.cross_lengths = list(lengths), list(cross_lengths)
        return new

    def select(self, idx) -> DenseDecoderKV:
        """A new group of rows ``idx`` (repeats allowed: beam expansion); data and scales move together."""
        picks = select_sources(list(range(self.batch_size)), idx)
        index = torch.tensor(picks, dtype=torch.long, device=self.config.device)
        tensors = {}
        for name in self._TENSORS:
            layers = getattr(self, name)
            if layers is not None:
                tensors[name] = [t.index_select(0, index) for t in layers]
        return self._like(tensors, [self.lengths[i] for i in picks], [self.cross_lengths[i] for i in picks])

    def merge(self, other: DenseDecoderKV) -> DenseDecoderKV:
        """This group's rows then ``other``'s, in one group (same config and capacities)."""
        if other.config is not self.config and other.config != self.config:
            raise ValueError("merge: the groups have different DecoderCacheConfigs")
        if (other.capacity, other.cross_capacity) != (self.capacity, self.cross_capacity):
            raise ValueError(f"merge: capacities differ: ({self.capacity}, {self.cross_capacity}) vs "
                             f"({other.capacity}, {other.cross_capacity})")
        tensors = {}
        for name in self._TENSORS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None:
                tensors[name] = [torch.cat([a, b]) for a, b in zip(mine, theirs, strict=True)]
        return self._like(tensors, self.lengths + other.lengths, self.cross_lengths + other.cross_lengths)


class PagedDecoderKV:
    """A group of rows of a ``DecoderKVCacheManager`` (module docstring); ``ops`` is the twin module."""

    def __init__(self, manager, rows: list[int], ops, backend: str | None = None, *,
                 shared_cross: bool | None = None, cross_kv: list | None = None):
        self.manager, self.rows, self.ops, self.backend = manager, list(rows), ops, backend
        self.config = manager.config
        self._self = self._cross = None
        # True: every row maps the same cross pages (``manager.shares_cross``); None: not asked yet.
        # ``select`` hands True on (forks and kept rows of sharing rows, or of a lone row, still share);
        # the manager is asked at the group's first cross read otherwise.
        self._shared_cross = shared_cross
        # The shared region read once (``attend_cross``): ``(manager.cross_writes at the read, per layer
        # (K^T (Hkv, D, S), V (Hkv, S, D)) fp32)``, or None.
        self._cross_kv = cross_kv

    @classmethod
    def admit(cls, manager, requests: list[DecoderRequest], ops, backend: str | None = None) -> PagedDecoderKV:
        """Admit ``requests`` on ``manager`` and wrap the rows as one group (``AdmissionError`` if they do not fit)."""
        return cls(manager, manager.admit(requests), ops, backend)

    @property
    def batch_size(self) -> int:
        """Rows in the group."""
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        """Each row's token count, in group order."""
        return self.manager.lengths(self.rows)

    def _kw(self) -> dict:
        return {} if self.backend is None else {"backend": self.backend}

    def prefill(self, b: int, k, v) -> None:
        """Write row ``b``'s prompt K/V through the manager (see ``DecoderKVCacheManager.prefill``)."""
        self.manager.prefill(self.rows[group_row(b, self.batch_size, "prefill")], k, v)

    def fill_cross(self, b: int, k, v) -> None:
        """Write row ``b``'s cross-attention K/V through the manager; the cached cross views are rebuilt."""
        self.manager.fill_cross(self.rows[group_row(b, self.batch_size, "fill_cross")], k, v)
        self._cross = self._shared_cross = self._cross_kv = None

    def begin_step(self) -> None:
        """Start a decode step: the manager prepares a page for each row's next token and hands out the
        step (``open_step``: the views and the twin's ops, or the fast twin's host plan on a CPU)."""
        self._self = self.manager.open_step(self.rows, **self._kw())

    def write(self, layer: int, k, v) -> None:
        """Append this step's K/V ``(B, 1, n_kv_head, head_dim)`` at ``layer``."""
        self._self.write(layer, k, v)

    def attend_self(self, layer: int, q):
        """Causal paged attention of ``q`` over each row's tokens at ``layer``."""
        return self._self.attend(layer, q)

    def end_step(self) -> None:
        """Finish a decode step: the manager commits one token per row."""
        self._self.commit()
        self._self = None

    def attend_cross(self, layer: int, q):
        """q (B, nH, T, D): the T queries ride as extra heads (head h*T + t still reads KV head h // G),
        so each row presents one query and the paged kernel attends it to exactly the cross extent.

        When every row maps the same cross pages (a lone row, or the beams of one utterance) and the
        manager's twin reads shared regions once (``SHARED_CROSS_READ``: the fast twin), the region is
        read once. Pages in the model dtype: ``manager.read_cross`` of the first row, kept for the
        group and handed on by ``select`` while the manager's ``cross_writes`` count says no cross
        region was written since (``fill_cross`` refuses shared pages, and a lone row's refill is
        counted), then one grouped attention for all rows (``_attend_shared``). Quantized pages: a
        view of the first row only, all rows' queries riding as its heads, ordered (KV head, query
        head in its group, row, t) so that each still reads its own KV head. Either way the same dot
        products as row by row, one read instead of ``B``."""
        B, nH, T, D = q.shape
        manager = self.manager
        if B > 1 and self._shared_cross is None:
            self._shared_cross = manager.SHARED_CROSS_READ and manager.shares_cross(self.rows)
        if B and manager.SHARED_CROSS_READ and (B == 1 or self._shared_cross) and not self.config.kv_quantized:
            if self._cross_kv is None or self._cross_kv[0] != manager.cross_writes:
                self._cross_kv = (manager.cross_writes, manager.read_cross(self.rows[0]))
            return _attend_shared(q, *self._cross_kv[1][layer])
        if self._cross is None:
            rows = self.rows[:1] if B > 1 and self._shared_cross else self.rows
            self._cross = (manager.cross_caches(rows), manager.cross_query_lens(rows))
        views, lens = self._cross
        lens = None if all(lens) else lens  # None: every row presents its query (nothing to check)
        if not self._shared_cross or B == 1:
            out = self.ops.paged_attention(q.reshape(B, nH * T, 1, D), views[layer], chunk_lens=lens, **self._kw())
            return out.reshape(B, nH, T, D)
        Hkv = self.config.n_kv_head
        packed = q.reshape(B, Hkv, nH // Hkv, T, D).permute(1, 2, 0, 3, 4).reshape(1, nH * B * T, 1, D)
        out = self.ops.paged_attention(packed, views[layer], chunk_lens=lens, **self._kw())
        return out.reshape(Hkv, nH // Hkv, B, T, D).permute(2, 0, 1, 3, 4).reshape(B, nH, T, D)

    def gather_self(self, b: int) -> torch.Tensor:
        """Row ``b``'s self-attention K/V, all layers, as one dense tensor (for checks)."""
        return self.manager.gather_self(self.rows[group_row(b, self.batch_size, "gather_self")])

    def select(self, idx) -> PagedDecoderKV:
        """Keep and reorder rows (the others finish); a repeated index forks a row onto shared,
        copy-on-write pages (``DecoderKVCacheManager.select``)."""
        rows = self.manager.select(self.rows, idx)
        # rows drawn from sharing rows (or from one row) share; the gathered region goes on with them
        # (``attend_cross`` reads it again if a cross region was written since)
        shared = True if self._shared_cross or (self.batch_size == 1 and self.manager.SHARED_CROSS_READ) else None
        return PagedDecoderKV(self.manager, rows, self.ops, self.backend, shared_cross=shared,
                              cross_kv=self._cross_kv if shared else None)

    def merge(self, other: PagedDecoderKV) -> PagedDecoderKV:
        """One group of both groups' rows (``ValueError`` unless they share the manager)."""
        if other.manager is not self.manager:
            raise ValueError("merge: paged groups must share one DecoderKVCacheManager")
        return PagedDecoderKV(self.manager, self.rows + other.rows, self.ops, self.backend)

    def finish(self) -> None:
        """Finish every row (their pages go back to the pool); the group is empty afterwards."""
        for r in self.rows:
            self.manager.finish(r)
        self.rows = []


def decode_group(config: DecoderCacheConfig, ops, requests: list[DecoderRequest], manager=None,
                 backend: str | None = None):
    """A group for ``requests`` in the storage ``config.storage`` resolves to (``kv_storage="auto"``: paged
    when steps are graph-captured, dense otherwise). Paged rows are admitted into ``manager`` (refused
    with ``AdmissionError`` when the ceilings do not fit); dense buffers are sized to the largest ceiling."""
    if config.storage == "paged":
        if manager is None:
            raise ValueError("decode_group: paged storage needs the DecoderKVCacheManager to admit the rows into")
        return PagedDecoderKV.admit(manager, requests, ops, backend)
    capacity = max((r.self_tokens for r in requests), default=0)
    cross = max((r.cross_len for r in requests), default=0)
    return ops.DenseDecoderKV(config, len(requests), capacity, cross)
