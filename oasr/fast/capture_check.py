"""``CaptureSafetyChecker``: does a region of code do only what a CUDA graph can capture?

A CUDA graph records device work and replays it without the host. Three kinds of
operation break that, and break the latency of an eager tick too:

* **host syncs**: anything that needs a device value on the host (``item``,
  ``bool(t)``, ``int(t)``, ``tolist``, ``.cpu()``, ``equal``);
* **data-dependent shapes**: an output whose size depends on values
  (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing,
  ``repeat_interleave`` by a tensor): the host must read the size;
* **pageable host-to-device copies**: a copy from ordinary (pageable) host memory
  waits for the device queue, and a graph cannot capture it at all. The only
  host-to-device traffic allowed is a ``non_blocking`` copy out of a registered
  pinned buffer (the ``Stager`` rings, the engine's input staging).

This module checks a region on any machine, the CPU included, by watching every
aten op under a ``TorchDispatchMode`` and the Python conversions that bypass the
dispatcher (``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu``).

How "host" and "device" are told apart on a CPU-only machine
-------------------------------------------------------------
Every tensor is CPU there, so memory is classified by declaration and provenance,
per storage:

* ``declare_device(*roots)`` walks objects (attributes, lists, dicts, modules'
  parameters and buffers) and marks every tensor it finds as device memory: the
  model, the pool, the managers, the engine's static buffers. A ``Stager`` found on
  the walk contributes its device buffer as device memory and its host ring as
  pinned memory; any object with a ``pinned_host_tensors()`` method contributes
  those as pinned.
* ``declare_pinned(*tensors)`` marks pinned host buffers directly.
* Inside the region, an op's outputs are device memory if any input is device
  memory or the op has no tensor input (a factory: ``empty``, ``arange``, ``full``
  made in device code). ``lift_fresh`` (``torch.tensor`` / ``torch.as_tensor`` of
  Python data, and a Python scalar written through an index) is itself a violation:
  on CUDA it is a pageable copy. Its output then counts as the device tensor it
  would become, so one mistake is reported once. Outputs of ops whose inputs are all
  host memory are pageable host memory. Each region starts again from the
  declarations (roots are walked anew): an address classified in an earlier region
  may since have been freed and reused.
* Every other storage -- anything made before the region that nobody declared, such
  as the feature tensors a client pushed -- is pageable host memory.

What this cannot see: a host tensor declared by mistake as device memory (the
roots define the device), and work done in numpy (host only, by construction).

A violation is then: an op writing device memory that reads a pageable host tensor
of one element or more (0-dim CPU scalars are kernel arguments on CUDA, not copies);
a ``copy_`` out of a pinned buffer that is not ``non_blocking``; a copy from device
memory into pageable host memory; ``Tensor.cpu()``, ``tolist()`` or ``numpy()`` of
device memory; ``Tensor.to(device)`` of pageable host memory (a no-op on a CPU run,
a pageable copy on CUDA).

Kernel launches
---------------
On CUDA the fast twin's ``append_kv`` / ``paged_attention`` are kernel launches; on
the CPU they run a CPU implementation whose ops say nothing about the GPU. The
checker therefore treats each call of ``oasr.fast.append_kv`` /
``oasr.fast.paged_attention`` inside the region as one opaque launch: its tensor
arguments must be device memory (``chunk_lens`` a device tensor, not a list), and
it records a *launch key* -- the shapes and every host value that sizes the grid
(``max_span``, ``max_seqlen``, ``num_splits``). A captured graph replays its launch
parameters, so two ticks at one width must have equal launch keys. The launchers'
own freedom from syncs is checked on hardware (tests/test_kernels_cuda.py).

Usage::

    checker = CaptureSafetyChecker()
    checker.declare_device(model, engine.pool, engine.att, ...)   # or watch_engine(engine)
    with checker.region("tick 3, width 4") as record:
        ...
    record.violations      # [] when capture-safe
    record.op_names        # aten ops in order (launches as "launch:<name>")
    record.launch_keys     # one per opaque launch
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from oasr.fast.staging import Stager

SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::allclose",
    "aten::_assert_async",
})
DYNAMIC_SHAPE_OPS = frozenset({
    "aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::unique",
    "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
})
INDEX_OPS = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
FRESH_OPS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy"})
DEVICE, PINNED, PAGEABLE = "device", "pinned", "pageable"


@dataclasses.dataclass
class TickRecord:
    """What one region did: its ops, its opaque launches and what broke capture safety."""

    label: str
    op_names: list = dataclasses.field(default_factory=list)
    launch_keys: list = dataclasses.field(default_factory=list)
    violations: list = dataclasses.field(default_factory=list)
    pinned_uploads: int = 0  # non_blocking copies out of pinned buffers
    pinned_readbacks: int = 0  # non_blocking copies into pinned buffers

    @property
    def num_ops(self) -> int:
        """Torch ops seen in the recorded tick."""
        return len(self.op_names)

    def summary(self) -> str:
        """A few lines: counts of ops, launches, pinned copies and every violation."""
        lines = [f"{self.label}: {self.num_ops} ops, {len(self.launch_keys)} launches, "
                 f"{self.pinned_uploads} pinned uploads, {self.pinned_readbacks} pinned readbacks, "
                 f"{len(self.violations)} violations"]
        lines += [f"  - {v}" for v in self.violations]
        return "\n".join(lines)


def iter_tensors(tree):
    """Every tensor in a nest of lists, tuples and dicts (an op's arguments or outputs)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from iter_tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from iter_tensors(x)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_scalar(t: torch.Tensor) -> bool:
    return t.dim() == 0


class _Mode(TorchDispatchMode):
    def __init__(self, checker: CaptureSafetyChecker):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.checker._on_op(func, args, kwargs, out)
        return out


class CaptureSafetyChecker:
    """Watches regions for host syncs, data-dependent shapes and pageable copies (see the module docstring)."""

    LAUNCHES = ("append_kv", "paged_attention")

    def __init__(self):
        self._kind: dict[int, str] = {}
        self._roots: list = []
        self._pinned: list = []
        self._record: TickRecord | None = None
        self.records: list[TickRecord] = []

    # ---- declarations ---------------------------------------------------------------------
    def declare_device(self, *roots) -> None:
        """Mark every tensor reachable from ``roots`` as device memory (Stager host rings as pinned).

        The roots are walked again when each region starts, so buffers they allocate later count too.
        """
        self._roots += roots
        self._reclassify()

    def declare_pinned(self, *tensors) -> None:
        """Mark ``tensors`` as the pinned staging buffers, the only host memory a capture may copy from."""
        self._pinned += tensors
        for t in tensors:
            self._kind[_ptr(t)] = PINNED

    def _reclassify(self) -> None:
        """Only the declarations: what an earlier region classified may have been freed and reused."""
        self._kind = {}
        seen: set[int] = set()
        for root in self._roots:
            self._walk(root, seen)
        for t in self._pinned:
            self._kind[_ptr(t)] = PINNED

    def _walk(self, obj, seen: set) -> None:
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self._kind.setdefault(_ptr(obj), DEVICE)
            return
        if isinstance(obj, Stager):
            for h in obj._host:
                self._kind[_ptr(h)] = PINNED
            self._kind[_ptr(obj._device)] = DEVICE
            return
        pinned = getattr(obj, "pinned_host_tensors", None)
        if callable(pinned):
            for t in pinned():
                self._kind[_ptr(t)] = PINNED
        if isinstance(obj, nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                self._kind.setdefault(_ptr(t), DEVICE)
        if isinstance(obj, dict):
            for v in list(obj.values()):
                self._walk(v, seen)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in list(obj):
                self._walk(v, seen)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                self._walk(getattr(obj, f.name), seen)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("oasr", "torch", "collections"):
            for v in list(vars(obj).values()):
                self._walk(v, seen)

    def kind(self, t: torch.Tensor) -> str:
        """Where ``t``'s memory lives for the checker: ``"device"``, ``"pinned"`` or ``"pageable"``."""
        return self._kind.get(_ptr(t), PAGEABLE)

    # ---- the region ---------------------------------------------------------------------------
    @contextmanager
    def region(self, label: str = ""):
        """Watch everything run inside; yields the ``TickRecord`` (filled when the block exits)."""
        if self._record is not None:
            raise RuntimeError("CaptureSafetyChecker: regions do not nest")
        record = TickRecord(label or f"region {len(self.records)}")
        self._reclassify()
        self._record = record
        patches = self._patch_python_conversions() + self._patch_launches()
        try:
            with _Mode(self):
                yield record
        finally:
            for owner, name, original in reversed(patches):
                setattr(owner, name, original)
            self._record = None
            self.records.append(record)

    @contextmanager
    def suspended(self):
        """Run a block unwatched inside a region (host work such as decoding that is not part of the check)."""
        record, self._record = self._record, None
        try:
            with _disable_current_modes():
                yield
        finally:
            self._record = record

    def _violation(self, text: str) -> None:
        if self._record is not None:
            self._record.violations.append(text)

    # ---- per op -------------------------------------------------------------------------------
    def _on_op(self, func, args, kwargs, out) -> None:
        record = self._record
        if record is None:
            return
        name = func._schema.name
        record.op_names.append(str(func))
        inputs = list(iter_tensors((args, kwargs)))
        outputs = list(iter_tensors(out))
        written = self._written(func, args, kwargs)
        if name in SYNC_OPS:
            self._violation(f"host sync: {func}")
        if name in DYNAMIC_SHAPE_OPS or (name == "aten::where" and len(args) == 1):
            self._violation(f"data-dependent output shape: {func}")
        if name == "aten::repeat_interleave" and args and isinstance(args[-1] if len(args) > 1 else None,
                                                                     torch.Tensor):
            self._violation(f"data-dependent output shape: {func} with tensor repeats")
        if name in INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in iter_tensors(list(indices or ()))):
                self._violation(f"data-dependent output shape: {func} with a boolean mask")
        if name in FRESH_OPS:
            self._violation(f"pageable host-to-device copy: {func} (a tensor made from Python data)")
            for t in outputs:  # flagged once: what follows reads it as the device tensor it would become
                self._kind[_ptr(t)] = DEVICE
            return

        kinds = [self.kind(t) for t in inputs]
        device_in = DEVICE in kinds
        if name == "aten::copy_":
            dst, src = args[0], args[1]
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
            dk, sk = self.kind(dst), self.kind(src)
            if sk == PINNED and dk == DEVICE:
                record.pinned_uploads += 1
                if not non_blocking:
                    self._violation(f"blocking copy from a pinned buffer (waits for the device): {func}")
            elif dk == PINNED and sk == DEVICE:
                record.pinned_readbacks += 1
                if not non_blocking:
                    self._violation(f"blocking readback into a pinned buffer (a host sync): {func}")
            elif dk == DEVICE and sk == PAGEABLE and not _is_scalar(src):
                self._violation(f"pageable host-to-device copy: {func} from pageable host memory")
            elif dk == PAGEABLE and sk == DEVICE:
                self._violation(f"device-to-host copy into pageable memory (a host sync): {func}")
            return
        touches_device = device_in or not inputs or any(self.kind(t) == DEVICE for t in written)
        if touches_device:
            for t, k in zip(inputs, kinds, strict=True):
                if k == PAGEABLE and not _is_scalar(t) and not any(t is w for w in written):
                    self._violation(f"pageable host-to-device copy: {func} reads pageable host memory "
                                    f"{tuple(t.shape)} {t.dtype}")
                    break
        new_kind = DEVICE if touches_device else PAGEABLE
        aliased = {_ptr(t) for t in inputs}
        for t in outputs:  # a view keeps its storage's kind; new storage (maybe at a reused address) gets one
            if _ptr(t) not in aliased:
                self._kind[_ptr(t)] = new_kind

    @staticmethod
    def _written(func, args, kwargs) -> list:
        out = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                out += list(iter_tensors(value))
        return out

    # ---- what bypasses the dispatcher ---------------------------------------------------------
    def _patch_python_conversions(self) -> list:
        checker = self
        saved = []

        def reads_device(name):
            original = getattr(torch.Tensor, name)

            def wrapper(t, *args, **kwargs):
                if checker._record is not None and checker.kind(t) == DEVICE:
                    checker._violation(f"host sync: Tensor.{name}() of device memory {tuple(t.shape)}")
                return original(t, *args, **kwargs)

            saved.append((torch.Tensor, name, original))
            setattr(torch.Tensor, name, wrapper)

        for name in ("tolist", "numpy", "cpu"):
            reads_device(name)

        original_to = torch.Tensor.to

        def to(t, *args, **kwargs):
            target = kwargs.get("device")
            for a in args:
                if isinstance(a, (str, torch.device)):
                    target = a
                elif isinstance(a, torch.Tensor):
                    target = a.device
            if checker._record is not None and target is not None and checker.kind(t) == PAGEABLE \
                    and not _is_scalar(t):
                checker._violation(f"pageable host-to-device copy: Tensor.to({target}) of pageable host memory "
                                   f"{tuple(t.shape)}")
            return original_to(t, *args, **kwargs)

        saved.append((torch.Tensor, "to", original_to))
        torch.Tensor.to = to
        return saved

    def _patch_launches(self) -> list:
        import oasr.fast as fast_twin

        saved = []
        for name in self.LAUNCHES:
            original = getattr(fast_twin, name)
            saved.append((fast_twin, name, original))
            setattr(fast_twin, name, self._opaque(name, original))
        return saved

    def _opaque(self, name: str, fn):
        checker = self

        def launch(*args, **kwargs):
            record = checker._record
            if record is None:
                return fn(*args, **kwargs)
            cache = next((a for a in args if hasattr(a, "block_table")), None)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            lens = args[3] if name == "append_kv" and len(args) > 3 else (
                args[2] if name == "paged_attention" and len(args) > 2 else kwargs.get("chunk_lens"))
            if lens is not None and not isinstance(lens, torch.Tensor):
                checker._violation(f"pageable host-to-device copy: {name}(chunk_lens={type(lens).__name__}) "
                                   "(a host list becomes a device tensor inside the launch)")
            cache_tensors = [] if cache is None else [
                t for t in (cache.k_cache, cache.v_cache, cache.block_table, cache.cache_seqlens,
                            cache.cache_seqstarts, cache.k_scale, cache.v_scale) if t is not None]
            for t in tensors + cache_tensors:
                if checker.kind(t) != DEVICE:
                    checker._violation(f"launch {name} reads {checker.kind(t)} host memory {tuple(t.shape)}")
            key = (name, tuple(tuple(t.shape) for t in tensors),
                   None if cache is None else (cache.max_span, cache.max_seqlen, cache.batch_size),
                   tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))))
            record.op_names.append(f"launch:{name}")
            record.launch_keys.append(key)
            checker._record = None
            try:
                with _disable_current_modes():
                    result = fn(*args, **kwargs)
            finally:
                checker._record = record
            for t in iter_tensors(result):
                checker._kind[_ptr(t)] = DEVICE  # what a kernel writes is device memory
            return result

        return launch


def engine_device_roots(engine) -> list:
    """What a ``StreamingEngine`` holds on the device: model, pool, managers, the tick's static buffers.

    Not the engine itself: the features clients pushed are pageable host memory.
    """
    roots = [engine.model, engine.pool, engine.att, engine.cnn, engine.states]
    tick = getattr(engine, "model_tick", None)
    if tick is not None:
        roots.append(tick)
    return roots


def watch_engine(engine) -> CaptureSafetyChecker:
    """A checker watching each model step of ``engine`` from now on (``engine.tick_monitor``).

    A fast attention manager on a CPU device writes its tables directly through numpy views (no
    host-to-device copy exists there, and numpy is invisible to this checker); it is switched to
    the staged path a CUDA device runs, so that what is checked is the CUDA tick.
    """
    stage_like_cuda = getattr(engine.att, "_stage_like_cuda", None)
    if stage_like_cuda is not None:
        stage_like_cuda()
    checker = CaptureSafetyChecker()
    checker.declare_device(*engine_device_roots(engine))
    engine.tick_monitor = checker
    return checker
