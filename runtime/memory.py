"""Memory tiers of one rank: the device-tier budget, activations kept/offloaded/recomputed, parameters and Adam state off the device.

Vocabulary: the *device tier* is what the plan calls "gpu" (on this CPU-only machine an accounted budget,
on CUDA real device memory); the *host tier* is "cpu" (pinned host memory on CUDA) and the *NVMe tier*
is files under a directory the user chooses. Every piece here keeps the numbers of plain training
bitwise: tiers move bytes, never change them.

How bytes are counted (DeviceBudget), chosen to match cost_models/memory.py so measured and predicted
peaks can be compared:
- params / optimizer: sizes added when they become resident in the device tier (all of them for the
  "gpu" tier; one block plus the one prefetched ahead for a ParamStore);
- grads: each gradient's storage from its first accumulation until it is freed (GradTier);
- activations: every storage autograd saves in a `keep` block (and the inputs a `recompute` block
  keeps as its checkpoint, and the activations it recomputes during the backward), parameters and
  buffers excluded, each storage once, as planner/profile.py counts them;
- buffers: device copies in flight for offloaded activations: the original storage until autograd's
  other users free it (the forward's transient), and the copies brought back for the backward.
A counted storage stays counted until it is really freed: torch keeps one Python object per storage,
so a weakref finalizer on `tensor.untyped_storage()` fires exactly when the memory is released.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from plans.errors import MmplanError

try:  # the dtype torch.optim.Adam gives its `step` counter
    from torch.optim.optimizer import _get_scalar_dtype
except ImportError:  # pragma: no cover - older torch
    def _get_scalar_dtype() -> torch.dtype:
        return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
from plans.plan import ActivationTier, Tier

Category = Literal["params", "grads", "optimizer", "activations", "buffers"]
CATEGORIES: tuple[Category, ...] = ("params", "grads", "optimizer", "activations", "buffers")
OffTier = Literal["cpu", "nvme"]
_ALIGN = 64  # bytes; alignment of tensors packed into one NVMe file


class MemoryBudgetExceeded(MmplanError):
    """The device tier holds more bytes than the plan's budget allows."""


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_nvme_space(directory: str | os.PathLike, needed_bytes: float) -> None:
    """Refuse (MmplanError) when `directory` does not exist or has less free space than `needed_bytes`."""
    if not os.path.isdir(directory):
        raise MmplanError(f"NVMe tier directory {os.fspath(directory)} does not exist; create it or choose another with --nvme-dir")
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise MmplanError(
            f"NVMe tier directory {os.fspath(directory)} has {format_bytes(free)} free but the plan needs "
            f"{format_bytes(needed_bytes)}; free space there or choose another directory"
        )


# --- the device tier as an accounted budget -----------------------------------------------------


class DeviceBudget:
    """Bytes resident in the device tier by category, their peaks, and an optional limit.

    add/remove count sizes known up front; hold(category, tensor) counts a tensor's storage once, until
    the storage is freed. Exceeding `limit` raises MemoryBudgetExceeded at the add/hold that crossed it.
    The host tiers ("cpu", "nvme") are counted too (no limit) so the report covers the plan's RankMemory.
    Thread-safe: storage finalizers only queue their release, which the next call applies.
    """

    def __init__(self, limit: float | None = None, *, device: torch.device | str = "cpu") -> None:
        self.limit = limit
        self.device = torch.device(device)
        self.current: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.at_peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)  # breakdown when peak_total was reached
        self.host: dict[str, int] = {"cpu": 0, "nvme": 0}
        self.host_peak: dict[str, int] = {"cpu": 0, "nvme": 0}
        self._held: dict[int, tuple[weakref.ref, object]] = {}  # storage key -> (storage, token)
        self._ignored: dict[int, weakref.ref] = {}  # parameter and buffer storages
        self._freed: collections.deque = collections.deque()  # (category, nbytes, key, token) from finalizers
        self._lock = threading.RLock()

    # counting
    def add(self, category: Category, nbytes: int) -> None:
        with self._lock:
            self._drain()
            self.current[category] += int(nbytes)
            self._note()

    def remove(self, category: Category, nbytes: int) -> None:
        with self._lock:
            self._drain()
            self.current[category] -= int(nbytes)

    def add_host(self, tier: OffTier, nbytes: int) -> None:
        with self._lock:
            self.host[tier] += int(nbytes)
            self.host_peak[tier] = max(self.host_peak[tier], self.host[tier])

    def remove_host(self, tier: OffTier, nbytes: int) -> None:
        with self._lock:
            self.host[tier] -= int(nbytes)

    def hold(self, category: Category, tensor: torch.Tensor) -> bool:
        """Count `tensor`'s storage in `category` until it is freed; False if ignored or already counted."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        with self._lock:
            self._drain()
            if self._is_ignored(key, storage):
                return False
            entry = self._held.get(key)
            if entry is not None and entry[0]() is storage:
                return False
            token, nbytes = object(), storage.nbytes()
            self._held[key] = (weakref.ref(storage), token)
            weakref.finalize(storage, self._freed.append, (category, nbytes, key, token))
            self.current[category] += nbytes
            self._note()
            return True

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages as held (parameters and buffers, as the profiler does)."""
        with self._lock:
            for t in tensors:
                s = t.untyped_storage()
                self._ignored[s._cdata] = weakref.ref(s)

    def ignore_module(self, module: nn.Module) -> None:
        self.ignore(itertools.chain(module.parameters(), module.buffers()))

    def is_ignored(self, tensor: torch.Tensor) -> bool:
        s = tensor.untyped_storage()
        with self._lock:
            return self._is_ignored(s._cdata, s)

    def _is_ignored(self, key: int, storage: Any) -> bool:
        ref = self._ignored.get(key)
        return ref is not None and ref() is storage

    def _drain(self) -> None:
        while self._freed:
            category, nbytes, key, token = self._freed.popleft()
            self.current[category] -= nbytes
            entry = self._held.get(key)
            if entry is not None and entry[1] is token:
                del self._held[key]

    def _note(self) -> None:
        total = sum(self.current.values())
        for c in CATEGORIES:
            self.peak[c] = max(self.peak[c], self.current[c])
        if total > self.peak_total:
            self.peak_total = total
            self.at_peak = dict(self.current)
        if self.limit is not None and total > self.limit:
            parts = ", ".join(f"{c} {format_bytes(v)}" for c, v in self.current.items() if v)
            raise MemoryBudgetExceeded(
                f"device tier holds {format_bytes(total)} > budget {format_bytes(self.limit)}: {parts}; "
                "give the plan more memory or move more state off the device tier"
            )

    # reading
    @property
    def total(self) -> int:
        with self._lock:
            self._drain()
            return sum(self.current.values())

    def measured(self) -> int:
        """Device bytes now: torch.cuda.memory_allocated on CUDA, the accounted total elsewhere."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.total

    def measured_peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak_total

    def reset_peak(self) -> None:
        with self._lock:
            self._drain()
            self.peak = dict(self.current)
            self.peak_total = sum(self.current.values())
            self.at_peak = dict(self.current)
            self.host_peak = dict(self.host)

    def report(self) -> dict[str, Any]:
        """JSON-able snapshot: current, peak per category, peak total and its breakdown, host tiers."""
        with self._lock:
            self._drain()
            return {
                "limit": self.limit, "total": sum(self.current.values()), "peak_total": self.peak_total,
                "current": dict(self.current), "peak": dict(self.peak), "at_peak": dict(self.at_peak),
                "host": dict(self.host), "host_peak": dict(self.host_peak),
            }


# --- a background thread and scratch directory for tier transfers ---------------------------------


class _TierIO:
    """One background thread (FIFO, so a file's read never overtakes its write) and a scratch directory."""

    def __init__(self, name: str, nvme_dir: str | os.PathLike | None, device: torch.device) -> None:
        self.name, self.root, self.device = name, nvme_dir, device
        self.dir: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._names = itertools.count()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._cleanup: weakref.finalize | None = None

    def submit(self, fn: Callable, *args: Any) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mmplan-{self.name}-io")
        return self._pool.submit(fn, *args)

    def path(self) -> str:
        """A fresh file name in this component's NVMe directory (made on first use)."""
        if self.dir is None:
            if self.root is None:
                raise MmplanError(f"the NVMe tier ({self.name}) needs a directory; pass --nvme-dir")
            check_nvme_space(self.root, 0)
            self.dir = tempfile.mkdtemp(prefix=f"mmplan-{self.name}-", dir=self.root)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)  # when dropped without close()
        return os.path.join(self.dir, f"{next(self._names)}.bin")

    def unlink_later(self, path: str) -> None:
        """Delete `path` after the writes already queued (called from finalizers; never raises)."""
        try:
            if self._pool is not None:
                self._pool.submit(_unlink, path)
                return
        except RuntimeError:  # pool shut down: the directory is removed by close()
            pass
        _unlink(path)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._cleanup is not None:
            self._cleanup()  # removes the directory, once
            self.dir = None


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _buffer(t: torch.Tensor) -> memoryview:
    """A writable buffer over a contiguous CPU tensor's bytes (ctypes, not .numpy(): that would make the
    storage non-resizable for good, and parameter storages are resized)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _write_file(path: str, data: torch.Tensor, offset: int = 0) -> None:
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.seek(offset)
        f.write(_buffer(data))


def _read_file(path: str, into: torch.Tensor, offset: int = 0) -> torch.Tensor:
    with open(path, "rb") as f:
        f.seek(offset)
        n = f.readinto(_buffer(into))
    if n != into.numel() * into.element_size():
        raise MmplanError(f"NVMe tier file {path} is short: read {n} of {into.numel() * into.element_size()} bytes")
    return into


# --- activations: keep, offload to the host or NVMe tier, recompute --------------------------------


class _Kept:
    """What autograd holds for a saved tensor of a `keep` block."""

    __slots__ = ("record", "tensor")

    def __init__(self, record: SavedActivations, tensor: torch.Tensor) -> None:
        self.record, self.tensor = record, tensor


class _Copy:
    """One device storage saved by an offloaded block, held in host memory or in a file.

    Life cycle: the forward copies it off the device (on CUDA on the side stream; an NVMe write runs on
    the I/O thread); prefetch() or the first unpack brings back one device copy, which every saved view
    of the storage shares; once all views were handed out the copy is forgotten here, so it lives exactly
    as long as autograd uses it. The host copy / file lives as long as autograd holds the saved tensors.
    """

    __slots__ = (
        "__weakref__",
        "device_copy",
        "host",
        "loading",
        "nbytes",
        "path",
        "ready",
        "tier",
        "tiers",
        "unpacked",
        "views",
        "written",
    )

    def __init__(self, tiers: ActivationTiers, tier: OffTier, storage: torch.UntypedStorage) -> None:
        self.tiers, self.tier, self.nbytes = tiers, tier, storage.nbytes()
        self.host: torch.Tensor | None = None
        self.path: str | None = None
        self.written: Any = None
        self.device_copy: torch.Tensor | None = None
        self.loading: Future | None = None
        self.ready = None  # CUDA event: the device copy is complete
        self.views = self.unpacked = 0
        io, src = tiers.io, _bytes_of(storage)
        copied = None
        if io.stream is not None:  # CUDA: device -> pinned host on the side stream
            host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            io.stream.wait_stream(torch.cuda.current_stream(io.device))
            with torch.cuda.stream(io.stream):
                host.copy_(src, non_blocking=True)
                src.record_stream(io.stream)  # the allocator keeps the source until the copy is done
                copied = torch.cuda.Event()
                copied.record(io.stream)
        elif tier == "cpu":
            host = src.clone()
        else:
            host = src  # the device storage itself, kept until the background write is done
        self.written = copied  # what "copied off the device" waits for: a CUDA event, a write's Future, or None
        if tier == "cpu":
            self.host = host
        else:
            self.path = io.path()
            self.written = io.submit(_offload_to_file, self.path, host, copied)
            weakref.finalize(self, io.unlink_later, self.path)
        tiers.budget.add_host(tier, self.nbytes)
        weakref.finalize(self, tiers.budget.remove_host, tier, self.nbytes)

    def prefetch(self) -> None:
        if self.device_copy is not None or self.loading is not None:
            return
        if self.tiers.io.stream is not None and self.path is None:
            self.loading = Future()
            self.loading.set_result(self._to_device(self.host))  # queued on the side stream already
        else:
            self.loading = self.tiers.io.submit(self._load)

    def take(self) -> torch.Tensor:
        """The device copy for one unpack (waiting for its prefetch, or loading it now)."""
        if self.device_copy is None:
            stats, t0 = self.tiers.stats, time.perf_counter()
            if self.loading is not None:
                stats["prefetched"] += 1
                self.device_copy, self.loading = self.loading.result(), None
            else:
                stats["on_demand"] += 1
                self.device_copy = self._load()
            stats["wait_s"] += time.perf_counter() - t0
        dev = self.device_copy
        if dev.device.type == "cuda" and self.ready is not None:
            current = torch.cuda.current_stream(dev.device)
            current.wait_event(self.ready)
            dev.record_stream(current)
        self.unpacked += 1
        if self.unpacked >= self.views:
            self.device_copy, self.unpacked = None, 0
        return dev

    def _load(self) -> torch.Tensor:
        """Host memory or file -> a new device copy (on the I/O thread when prefetched)."""
        if self.path is not None:
            self.written.result()  # on the I/O thread this write is already done (FIFO)
            host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.tiers.io.stream is not None)
            _read_file(self.path, host)
        else:
            host = self.host
        return self._to_device(host)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        io = self.tiers.io
        if io.stream is None:
            dev = host.clone()
        else:
            with torch.cuda.stream(io.stream):
                dev = host.to(io.device, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(io.stream)
        self.tiers.budget.hold("buffers", dev)
        return dev


def _offload_to_file(path: str, data: torch.Tensor, copied: Any) -> None:
    if copied is not None:
        copied.synchronize()
    _write_file(path, data)


class _Packed:
    """What autograd holds for a saved tensor of an offloaded block: its storage's copy and its view."""

    __slots__ = ("copy", "dtype", "offset", "record", "size", "stride")

    def __init__(self, record: SavedActivations, copy: _Copy, t: torch.Tensor) -> None:
        self.record, self.copy = record, copy
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        copy.views += 1


class SavedActivations:
    """The tensors autograd saved in one forward of one block, in the block's tier.

    prefetch() starts bringing offloaded ones back to the device tier (a background thread reads NVMe
    files; on CUDA a side stream copies from pinned memory) so the backward's unpack does not stall. With
    prefetching on, the first unpack of this block's tensors starts prefetching `previous` (the block
    that ran before it), so the backward always fetches one block ahead.
    """

    def __init__(self, tiers: ActivationTiers, block: str, tier: ActivationTier, previous: SavedActivations | None) -> None:
        self.tiers, self.block, self.tier, self.previous = tiers, block, tier, previous
        self.saved_bytes = 0  # bytes of the distinct storages this block saved (0 for recompute's own)
        self._copies: list[weakref.ref] = []
        self._by_storage: dict[int, tuple[weakref.ref, _Copy]] = {}
        self._unpacked = False

    def prefetch(self) -> None:
        for ref in self._copies:
            copy = ref()
            if copy is not None:
                copy.prefetch()

    def _pack(self, t: torch.Tensor) -> Any:
        budget = self.tiers.budget
        if not _plain_tensor(t) or budget.is_ignored(t):
            return t  # parameters and buffers stay where they are; so do tensors without a plain storage
        if self.tier == "keep":
            if budget.hold("activations", t):
                self.saved_bytes += t.untyped_storage().nbytes()
            return _Kept(self, t)
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or t.device.type != self.tiers.io.device.type:
            return _Kept(self, t)  # nothing to move, or a host tensor on a CUDA rank
        known = self._by_storage.get(storage._cdata)
        if known is not None and known[0]() is storage:
            copy = known[1]
        else:
            budget.hold("buffers", t)  # resident until autograd's other users free it
            copy = _Copy(self.tiers, "cpu" if self.tier == "offload-cpu" else "nvme", storage)
            self._by_storage[storage._cdata] = (weakref.ref(storage), copy)
            self._copies.append(weakref.ref(copy))
            self.saved_bytes += copy.nbytes
        return _Packed(self, copy, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        record = packed.record
        if not record._unpacked:
            record._unpacked = True
            if record.previous is not None and self.tiers.prefetch_enabled:
                record.previous.prefetch()
        if isinstance(packed, _Kept):
            return packed.tensor
        dev = packed.copy.take()
        return torch.empty(0, dtype=packed.dtype, device=dev.device).set_(dev.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _forward_done(self) -> None:
        self._by_storage = {}  # storages seen only within one block's forward

    def wait_offloaded(self) -> None:
        """Block until this block's tensors are off the device (its writes / copies are done)."""
        for ref in self._copies:
            copy = ref()
            if copy is not None and copy.written is not None:
                if isinstance(copy.written, Future):
                    copy.written.result()
                else:
                    copy.written.synchronize()


def _plain_tensor(t: torch.Tensor) -> bool:
    """A strided tensor with a real storage (not a wrapper subclass such as DTensor, not meta)."""
    if t.layout != torch.strided or t.device.type == "meta" or type(t) not in (torch.Tensor, nn.Parameter):
        return False
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


class _CountRecomputed:
    """recompute context of torch.utils.checkpoint: counts what the recomputation saves, then passes it on.

    checkpoint runs the recomputation under its own saved-tensor hooks; this context sits inside them
    and chains onto them (torch's top-of-stack hooks), adding each recomputed storage to the budget
    until it is freed. Without that torch API nothing is counted (the numbers are unaffected).
    """

    def __init__(self, budget: DeviceBudget) -> None:
        self.budget, self.pushed = budget, False

    def __enter__(self) -> None:
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        hooks = top(True) if top is not None else None
        if hooks is None:
            return
        inner_pack, inner_unpack = hooks
        budget = self.budget

        def pack(t: torch.Tensor) -> Any:
            if _plain_tensor(t):
                budget.hold("activations", t)
            return inner_pack(t)

        torch._C._autograd._push_saved_tensors_default_hooks(pack, inner_unpack)
        self.pushed = True

    def __exit__(self, *exc: object) -> None:
        if self.pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.pushed = False


class ActivationTiers:
    """One rank's activation tiers: the budget they are counted in, the host/NVMe copies, the prefetcher."""

    def __init__(self, budget: DeviceBudget, *, nvme_dir: str | os.PathLike | None = None, prefetch: bool = True,
                 device: torch.device | str | None = None) -> None:
        self.budget = budget
        self.prefetch_enabled = prefetch
        self.io = _TierIO("act", nvme_dir, torch.device(device) if device is not None else budget.device)
        self._ignored: weakref.WeakSet = weakref.WeakSet()
        self._in_flight: SavedActivations | None = None
        # storages brought back by a prefetch vs loaded when the backward asked; seconds the backward waited
        self.stats: dict[str, float] = {"prefetched": 0, "on_demand": 0, "wait_s": 0.0}

    @contextlib.contextmanager
    def context(self, tier: ActivationTier, *, block: str = "", previous: SavedActivations | None = None) -> Iterator[SavedActivations]:
        """Run one block's forward inside: its saved tensors are kept, or offloaded to the host or NVMe tier."""
        if tier == "recompute":
            raise ValueError("'recompute' is not a saved-tensor policy; run the block with run_block(..., 'recompute')")
        if tier not in ("keep", "offload-cpu", "offload-nvme"):
            raise ValueError(f"unknown activation tier {tier!r}; expected keep, offload-cpu, offload-nvme or recompute")
        saved = SavedActivations(self, block, tier, previous)
        try:
            with torch.autograd.graph.saved_tensors_hooks(saved._pack, saved._unpack):
                yield saved
        finally:
            saved._forward_done()
        # back-pressure: at most two blocks' offloads in flight (this one and the one before), as the
        # cost model's two-block buffer assumes
        in_flight, self._in_flight = self._in_flight, (saved if tier.startswith("offload") else None)
        if in_flight is not None:
            in_flight.wait_offloaded()

    def run_block(self, module: Callable, args: Sequence[Any], kwargs: Mapping[str, Any], tier: ActivationTier, *,
                  block: str = "", previous: SavedActivations | None = None) -> tuple[Any, SavedActivations]:
        """module(*args, **kwargs) with its activations in `tier`; recompute uses non-reentrant checkpointing
        (its saved inputs count as kept activations, and what it recomputes in the backward is counted too)."""
        if isinstance(module, nn.Module) and module not in self._ignored:
            self.budget.ignore_module(module)
            self._ignored.add(module)
        if tier == "recompute":
            with self.context("keep", block=block, previous=previous) as saved:
                out = checkpoint(module, *args, use_reentrant=False,
                                 context_fn=lambda: (contextlib.nullcontext(), _CountRecomputed(self.budget)), **kwargs)
            return out, saved
        with self.context(tier, block=block, previous=previous) as saved:
            return module(*args, **kwargs), saved

    def close(self) -> None:
        """Stop the I/O thread and remove the NVMe scratch directory."""
        self.io.close()

    def __enter__(self) -> ActivationTiers:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def activation_context(tier: ActivationTier, budget: DeviceBudget, *, nvme_dir: str | os.PathLike | None = None,
                       prefetch: bool = True) -> Iterator[SavedActivations]:
    """One block's forward with its saved tensors in `tier`, on a private ActivationTiers.

    Host copies and NVMe files live as long as autograd holds the saved tensors; the private scratch
    directory and I/O thread go when the last of them is freed. For a whole stage use one ActivationTiers
    (one I/O thread, prefetch chaining across blocks, deterministic cleanup with close()).
    """
    with ActivationTiers(budget, nvme_dir=nvme_dir, prefetch=prefetch).context(tier) as saved:
        yield saved


def run_block(module: Callable, args: Sequence[Any], kwargs: Mapping[str, Any], tier: ActivationTier,
              tiers: ActivationTiers | DeviceBudget, *, block: str = "", previous: SavedActivations | None = None,
              nvme_dir: str | os.PathLike | None = None) -> tuple[Any, SavedActivations]:
    """Functional form of ActivationTiers.run_block; given a bare DeviceBudget it uses a private
    ActivationTiers (cleaned up when autograd frees the block's saved tensors)."""
    if isinstance(tiers, DeviceBudget):
        tiers = ActivationTiers(tiers, nvme_dir=nvme_dir)
    return tiers.run_block(module, args, kwargs, tier, block=block, previous=previous)


# --- parameters off the device tier ----------------------------------------------------------------


def _unique_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen: dict[int, tuple[str, nn.Parameter]] = {}
    for name, p in module.named_parameters():
        seen.setdefault(id(p), (name, p))
    return list(seen.values())


class ParamStore:
    """Parameters of some blocks held in the host or NVMe tier and materialised one block ahead of use.

    Each parameter keeps its identity (optimizers and autograd still refer to it); only its storage is
    emptied (resize to 0 bytes) when released and refilled when acquired, as FSDP does. acquire/release
    are reference counted, so a block used by an interleaved forward and backward stays resident for both.
    Dirty releases (after the optimizer step) write the new values back to the host copy or file.
    """

    def __init__(self, blocks: Mapping[str, nn.Module], tier: OffTier, budget: DeviceBudget, *,
                 nvme_dir: str | os.PathLike | None = None, order: Sequence[str] | None = None, prefetch: bool = True) -> None:
        if tier not in ("cpu", "nvme"):
            raise ValueError(f"ParamStore holds parameters in 'cpu' or 'nvme', not {tier!r}")
        self.tier, self.budget, self.prefetch_enabled = tier, budget, prefetch
        self.order = list(order or blocks)
        self.params: dict[str, list[tuple[str, nn.Parameter]]] = {b: _unique_params(blocks[b]) for b in self.order}
        owner: dict[int, str] = {}
        for b, named in self.params.items():
            for name, p in named:
                if id(p) in owner:
                    raise MmplanError(f"parameter {b}.{name} is shared with block {owner[id(p)]}; a ParamStore needs each parameter in one block")
                owner[id(p)] = b
                st = p.untyped_storage()
                if p.storage_offset() or st.nbytes() != p.numel() * p.element_size() or not p.is_contiguous():
                    raise MmplanError(f"parameter {b}.{name} is a view of a larger storage; a ParamStore needs parameters that own their storage")
        self.nbytes = {b: sum(p.untyped_storage().nbytes() for _, p in named) for b, named in self.params.items()}
        self.io = _TierIO("params", nvme_dir, budget.device)
        self._host: dict[int, torch.Tensor] = {}
        self._file: dict[str, tuple[str, dict[int, int]]] = {}  # block -> (path, id(param) -> offset)
        self._users = {b: 0 for b in self.order}
        self._resident: set[str] = set()
        self._loading: dict[str, Future] = {}
        self._pending: dict[str, tuple[int, int]] = {}  # block -> (backward holds, parameters left to accumulate)
        self._trainable = {b: sum(p.requires_grad for _, p in named) for b, named in self.params.items()}
        if tier == "nvme":
            if nvme_dir is None:
                raise MmplanError("parameters on the NVMe tier need a directory; pass --nvme-dir")
            check_nvme_space(nvme_dir, sum(self.nbytes.values()))
        for b in self.order:
            self._store(b, initial=True)
            budget.add_host(tier, self.nbytes[b])
            for _, p in self.params[b]:
                p.untyped_storage().resize_(0)
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _p, b=b: self._accumulated(b))

    # storage <-> tier
    def _store(self, block: str, *, initial: bool = False) -> None:
        """Copy the block's current values to its host copies / file."""
        if self.tier == "cpu":
            for _, p in self.params[block]:
                src = _bytes_of(p.untyped_storage())
                if initial:
                    self._host[id(p)] = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=self.io.stream is not None)
                self._host[id(p)].copy_(src)
            return
        if initial:
            offsets, at = {}, 0
            for _, p in self.params[block]:
                offsets[id(p)] = at
                at += -(-p.untyped_storage().nbytes() // _ALIGN) * _ALIGN
            self._file[block] = (self.io.path(), offsets)
            with open(self._file[block][0], "wb") as f:
                f.truncate(at)
        path, offsets = self._file[block]
        for _, p in self.params[block]:
            _write_file(path, _bytes_of(p.untyped_storage()).cpu(), offsets[id(p)])

    def _materialise(self, block: str) -> None:
        for _, p in self.params[block]:
            st = p.untyped_storage()
            n = p.numel() * p.element_size()
            st.resize_(n)
            dst = _bytes_of(st)
            if self.tier == "cpu":
                dst.copy_(self._host[id(p)], non_blocking=self.io.stream is not None)
            elif dst.device.type == "cpu":
                path, offsets = self._file[block]
                _read_file(path, dst, offsets[id(p)])
            else:
                path, offsets = self._file[block]
                dst.copy_(_read_file(path, torch.empty(n, dtype=torch.uint8, pin_memory=True), offsets[id(p)]), non_blocking=True)
        if self.io.stream is not None:
            torch.cuda.current_stream(self.io.device).synchronize()

    # the protocol
    def prefetch(self, block: str | None) -> None:
        """Start materialising `block` in the background (counted in the device tier from now on);
        a no-op when prefetching is off."""
        if self.prefetch_enabled:
            self._start(block)

    def _start(self, block: str | None) -> None:
        if block is None or block in self._resident or block in self._loading:
            return
        self.budget.add("params", self.nbytes[block])
        self._loading[block] = self.io.submit(self._materialise, block)

    def acquire(self, block: str) -> None:
        """Make `block`'s parameters resident (waiting for its prefetch, or loading them now) and hold them."""
        self._start(block)
        if block in self._loading:
            self._loading.pop(block).result()
            self._resident.add(block)
        self._users[block] += 1

    def release(self, block: str, *, dirty: bool = False) -> None:
        """Drop one hold; the last one writes back (when dirty) and empties the storages."""
        self._users[block] -= 1
        if dirty:
            self._store(block)
        if self._users[block] == 0:
            for _, p in self.params[block]:
                p.untyped_storage().resize_(0)
            self._resident.discard(block)
            self.budget.remove("params", self.nbytes[block])

    @contextlib.contextmanager
    def materialized(self, block: str, *, dirty: bool = False) -> Iterator[None]:
        self.acquire(block)
        try:
            yield
        finally:
            self.release(block, dirty=dirty)

    def attach_backward(self, block: str, outputs: Any, previous: str | None = None) -> None:
        """Acquire `block` when its backward starts (first gradient of one of its outputs) and prefetch
        `previous`; release once every trainable parameter of the block has accumulated its gradient."""
        leaves = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        started = [False]

        def begin(grad: torch.Tensor) -> None:
            if started[0]:
                return
            started[0] = True
            self.acquire(block)
            holds, _ = self._pending.get(block, (0, 0))
            self._pending[block] = (holds + 1, self._trainable[block])
            if self._trainable[block] == 0:
                self._finish(block)
            self.prefetch(previous)

        for t in leaves:
            t.register_hook(begin)

    def _accumulated(self, block: str) -> None:
        if block in self._pending:
            holds, left = self._pending[block]
            self._pending[block] = (holds, left - 1)
            if left - 1 <= 0:
                self._finish(block)

    def _finish(self, block: str) -> None:
        holds, _ = self._pending.pop(block)
        for _ in range(holds):
            self.release(block)

    def end_backward(self) -> None:
        """Release blocks whose backward did not reach every parameter (call after each backward)."""
        for block in list(self._pending):
            self._finish(block)

    def block_state(self, block: str) -> dict[str, torch.Tensor]:
        """The block's parameters by name (new CPU tensors), read from the tier without materialising."""
        out = {}
        for name, p in self.params[block]:
            n = p.numel() * p.element_size()
            if block in self._resident:
                data = _bytes_of(p.untyped_storage()).cpu().clone()
            elif self.tier == "cpu":
                data = self._host[id(p)].cpu().clone()
            else:
                path, offsets = self._file[block]
                data = _read_file(path, torch.empty(n, dtype=torch.uint8), offsets[id(p)])
            out[name] = data.view(p.dtype).view(p.shape)
        return out

    def load_block_state(self, block: str, values: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the block's parameters (by name) in the tier."""
        with self.materialized(block, dirty=True), torch.no_grad():
            for name, p in self.params[block]:
                p.copy_(values[name])

    def close(self) -> None:
        self.io.close()


# --- gradients -----------------------------------------------------------------------------------


class GradTier:
    """Where accumulated gradients live. 'gpu': counted in the device tier while they exist. 'cpu' /
    'nvme': after each accumulation the gradient is added to a host copy and dropped from the device
    tier (same additions in the same order as autograd's accumulation, so the sums are bitwise equal);
    collect() hands them back as p.grad for the reduction and the optimizer. NVMe is served from host
    memory (gradients are rewritten every micro-batch; files would only add I/O)."""

    def __init__(self, params: Iterable[nn.Parameter], tier: Tier, budget: DeviceBudget) -> None:
        self.tier, self.budget = tier, budget
        self.params = [p for p in params if p.requires_grad]
        self.host: dict[int, torch.Tensor] = {}
        self._by_id = {id(p): p for p in self.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, p: nn.Parameter) -> None:
        if self.tier == "gpu":
            self.budget.hold("grads", p.grad)
            return
        g = p.grad
        p.grad = None
        host = self.host.get(id(p))
        if host is None:
            self.host[id(p)] = g.detach().to("cpu", copy=g.device.type != "cpu")
            self.budget.add_host("cpu", g.numel() * g.element_size())
        else:
            host.add_(g.to("cpu"))

    def collect(self) -> None:
        """Move the host gradients into p.grad (call before reducing gradients and the optimizer step)."""
        for key, g in self.host.items():
            p = self._by_id[key]
            p.grad = g if p.device.type == "cpu" else g.to(p.device)
            self.budget.remove_host("cpu", g.numel() * g.element_size())
            if self.tier == "gpu" or p.device.type != "cpu":
                self.budget.hold("grads", p.grad)
        self.host = {}


# --- Adam with its state in a tier -----------------------------------------------------------------


class TieredAdam:
    """torch.optim.Adam with exp_avg / exp_avg_sq in the gpu, cpu or nvme tier; bitwise the same updates.

    The arithmetic is torch.optim.Adam's own (one Adam per block, same hyper-parameters); only where its
    state tensors live changes: 'gpu' beside the parameters (counted in the device budget), 'cpu' in host
    memory, 'nvme' in one memory-mapped file under nvme_dir (np.memmap-backed tensors). On CUDA with the
    state off the device the step runs on fp32 host copies of the parameters (grads copied to the host,
    updated parameters copied back). With a ParamStore the step streams block by block, one ahead.
    """

    def __init__(self, named_params: Mapping[str, nn.Parameter], *, tier: Tier = "gpu", budget: DeviceBudget | None = None,
                 nvme_dir: str | os.PathLike | None = None, store: ParamStore | None = None,
                 blocks: Mapping[str, Sequence[str]] | None = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self.tier, self.budget, self.store = tier, budget, store
        self.named = dict(named_params)
        if store is not None:
            blocks = {b: [f"{b}.{n}" for n, _ in store.params[b]] for b in store.order}
        self.blocks: dict[str, list[str]] = {k: list(v) for k, v in (blocks or {"": list(self.named)}).items()}
        unknown = [n for names in self.blocks.values() for n in names if n not in self.named]
        if unknown:
            raise MmplanError(f"TieredAdam: parameter {unknown[0]} of a block is not among the named parameters")
        device = next((p.device for p in self.named.values()), torch.device("cpu"))
        self.on_host = tier != "gpu" and device.type != "cpu"
        self._mmap = None
        self._path: str | None = None
        self._dir: str | None = None
        if tier == "nvme":
            total = sum(_aligned(p) for p in self.named.values()) * 2
            if nvme_dir is None:
                raise MmplanError("optimizer state on the NVMe tier needs a directory; pass --nvme-dir")
            check_nvme_space(nvme_dir, total)
            self._dir = tempfile.mkdtemp(prefix="mmplan-optim-", dir=nvme_dir)
            self._path = os.path.join(self._dir, "adam.bin")
            self._mmap = np.memmap(self._path, dtype=np.uint8, mode="w+", shape=(max(total, 1),))
        self._offset = 0
        self.masters: dict[str, torch.Tensor] = {}
        self.optimizers: dict[str, torch.optim.Adam] = {}
        for b, names in self.blocks.items():
            targets = []
            for n in names:
                p = self.named[n]
                if self.on_host:
                    m = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                    m.copy_(p.detach())
                    self.masters[n] = m.requires_grad_()
                targets.append(self.masters.get(n, p))
            opt = torch.optim.Adam(targets, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            for n, t in zip(names, targets):
                opt.state[t] = {
                    "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
                    "exp_avg": self._zeros_like(t),
                    "exp_avg_sq": self._zeros_like(t),
                }
            self.optimizers[b] = opt
        state_bytes = sum(2 * p.numel() * p.element_size() for p in self.named.values())
        if budget is not None:
            if tier == "gpu":
                budget.add("optimizer", state_bytes)
            else:
                budget.add_host(tier, state_bytes)

    def _zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        if self._mmap is None:
            return torch.zeros_like(t, memory_format=torch.preserve_format, device="cpu" if self.on_host else t.device)
        n = t.numel() * t.element_size()
        view = torch.from_numpy(np.asarray(self._mmap[self._offset:self._offset + n]))
        self._offset += _aligned(t)
        return view.view(t.dtype).view(t.shape)

    def step(self) -> None:
        order = list(self.optimizers)
        for i, b in enumerate(order):
            if self.store is not None:
                self.store.prefetch(order[i + 1] if i + 1 < len(order) else None)
                with self.store.materialized(b, dirty=True):
                    self._step_block(b)
            else:
                self._step_block(b)
        if self._mmap is not None:
            self._mmap.flush()

    def _step_block(self, block: str) -> None:
        if self.on_host:
            for n in self.blocks[block]:
                p, m = self.named[n], self.masters[n]
                m.grad = None if p.grad is None else p.grad.detach().to("cpu")
        self.optimizers[block].step()
        if self.on_host:
            with torch.no_grad():
                for n in self.blocks[block]:
                    self.named[n].copy_(self.masters[n])  # blocking: the next step rewrites the pinned master in place

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.named.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for m in self.masters.values():
            m.grad = None

    def _state_of(self, name: str) -> dict[str, torch.Tensor]:
        target = self.masters.get(name, self.named[name])
        for opt in self.optimizers.values():
            if target in opt.state:
                return opt.state[target]
        raise KeyError(name)

    def state_by_name(self, names: Iterable[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """Layout-independent state: full parameter name -> {step, exp_avg, exp_avg_sq} (CPU copies)."""
        return {n: {k: v.detach().cpu().clone() for k, v in self._state_of(n).items()} for n in (names or self.named)}

    def load_state_by_name(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy saved state into the tier's tensors (files stay where they are)."""
        for n, values in state.items():
            if n not in self.named:
                raise MmplanError(f"optimizer state for {n}, which is not a parameter of this rank")
            mine = self._state_of(n)
            for k in ("step", "exp_avg", "exp_avg_sq"):
                mine[k].copy_(values[k])

    def close(self) -> None:
        """Drop the memory map and remove its file."""
        self.optimizers = {}
        self._mmap = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _aligned(t: torch.Tensor) -> int:
    return -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN


# --- one stage's blocks with the stage's Memory applied ----------------------------------------------


class TieredBlocks(Mapping):
    """The `modules` program.evaluate calls for one forward of one stage, with the stage's tiers applied.

    Each block call: acquire its parameters (ParamStore) and prefetch the next block's, run it with its
    activation tier, release its parameters, and arm its backward (parameters acquired when its output
    gradient arrives, the previous block's prefetched). `saved` lists the blocks' SavedActivations in
    call order; prefetch_backward() starts bringing the last one back before the backward begins.
    """

    def __init__(self, modules: Mapping[str, nn.Module], activations: Mapping[str, ActivationTier], tiers: ActivationTiers,
                 store: ParamStore | None = None, order: Sequence[str] | None = None) -> None:
        self.modules, self.activations, self.tiers, self.store = modules, activations, tiers, store
        self.order = list(order or modules)
        self.saved: list[SavedActivations] = []
        self._last_block: str | None = None

    def __getitem__(self, name: str) -> Callable[..., Any]:
        module = self.modules[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._run(name, module, args, kwargs)

        return call

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def _run(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        store = self.store
        if store is not None:
            store.acquire(name)
            i = self.order.index(name)
            store.prefetch(self.order[i + 1] if i + 1 < len(self.order) else None)
        try:
            out, saved = self.tiers.run_block(module, args, kwargs, self.activations.get(name, "keep"), block=name,
                                              previous=self.saved[-1] if self.saved else None)
        finally:
            if store is not None:
                store.release(name)
        self.saved.append(saved)
        if store is not None and torch.is_grad_enabled():
            store.attach_backward(name, out, previous=self._last_block)
        self._last_block = name
        return out

    def prefetch_backward(self) -> None:
        """Start bringing back the last block's activations and parameters (call before its backward)."""
        if self.saved and self.tiers.prefetch_enabled:
            self.saved[-1].prefetch()
        if self.store is not None:
            self.store.prefetch(self._last_block)


# --- a rank's tiers, built from the plan's per-stage Memory ---------------------------------------------


class RankTiers:
    """Everything one rank needs to apply its stages' Memory: the budget, activation tiers, parameter
    stores, gradient tiers and tiered Adam optimizers (one per distinct params/optimizer tier pair).

    `stages`: (blocks in execution order, Memory) of every stage this rank runs; `modules`: the rank's
    local blocks by name; `named_params`: full parameter name -> parameter for those blocks (each
    parameter in exactly one block: block name + "." + its name inside the block).
    """

    def __init__(self, stages: Sequence[tuple[Sequence[str], Any]], modules: Mapping[str, nn.Module], *,
                 limit: float | None = None, nvme_dir: str | os.PathLike | None = None, device: torch.device | str = "cpu",
                 lr: float = 1e-3, prefetch: bool = True) -> None:
        self.budget = DeviceBudget(limit, device=device)
        self.activations = ActivationTiers(self.budget, nvme_dir=nvme_dir, prefetch=prefetch, device=device)
        self.memory: dict[str, Any] = {}  # block -> its stage's Memory
        self.stores: list[ParamStore] = []
        self._store_of: dict[str, ParamStore] = {}  # block -> the store holding its parameters
        self.optimizers: list[TieredAdam] = []
        self.grads: list[GradTier] = []
        self._persistent_grads: list[bool] = []  # per optimizer: keep gradient buffers across steps
        by_tiers: dict[tuple[str, str, str], list[str]] = {}
        seen: set[int] = set()  # a parameter tied between blocks belongs to the first (as in the profiler)
        for blocks, memory in stages:
            for b in blocks:
                self.memory[b] = memory
                by_tiers.setdefault((memory.params, memory.optimizer, memory.grads), []).append(b)
        groups_of: dict[int, set[tuple[str, str, str]]] = {}
        for key, blocks in by_tiers.items():
            for b in blocks:
                for _, p in _unique_params(modules[b]):
                    groups_of.setdefault(id(p), set()).add(key)
        if any(len(keys) > 1 and any(k[0] != "gpu" for k in keys) for keys in groups_of.values()):
            raise MmplanError("a parameter is tied between blocks whose stages hold parameters in different tiers; "
                              "give those stages the same Memory")
        for (params_tier, optimizer_tier, grads_tier), blocks in by_tiers.items():
            mods = {b: modules[b] for b in blocks}
            named = {}
            for b, m in mods.items():
                for n, p in _unique_params(m):
                    if id(p) not in seen:
                        seen.add(id(p))
                        named[f"{b}.{n}"] = p
            store = None
            if params_tier == "gpu":
                self.budget.add("params", sum(p.numel() * p.element_size() for p in named.values()))
            else:
                store = ParamStore(mods, params_tier, self.budget, nvme_dir=nvme_dir, order=blocks, prefetch=prefetch)
                self.stores.append(store)
                self._store_of.update(dict.fromkeys(blocks, store))
            self.grads.append(GradTier(named.values(), grads_tier, self.budget))
            self.optimizers.append(TieredAdam(named, tier=optimizer_tier, budget=self.budget, nvme_dir=nvme_dir, store=store, lr=lr))
            self._persistent_grads.append(grads_tier == "gpu" and params_tier == "gpu")
        for m in modules.values():
            self.budget.ignore_module(m)

    def blocks(self, names: Sequence[str], modules: Mapping[str, nn.Module]) -> TieredBlocks:
        """program.evaluate's `modules` for one forward of a stage running `names` (in order)."""
        store = self._store_of.get(names[0]) if names else None
        activations = {b: self.memory[b].activations.get(b, "keep") for b in names}
        return TieredBlocks({b: modules[b] for b in names}, activations, self.activations, store, order=names)

    def glue(self) -> contextlib.AbstractContextManager[SavedActivations]:
        """Wrap a stage's whole forward in this: tensors the glue code between blocks saves (the loss,
        slicing, concatenation) are kept and counted too; blocks inside use their own tier."""
        return self.activations.context("keep", block="(glue)")

    def after_backward(self) -> None:
        for store in self.stores:
            store.end_backward()

    def before_reduce(self) -> None:
        """Gradients held in the host tier back into p.grad (before the all-reduce and the step)."""
        for g in self.grads:
            g.collect()

    def step(self) -> None:
        """Optimizer step; device-tier gradients stay allocated and are zeroed in place, like Megatron's
        persistent gradient buffer (so every step after the first holds them, as the cost model counts)."""
        for opt, persistent in zip(self.optimizers, self._persistent_grads):
            opt.step()
            opt.zero_grad(set_to_none=not persistent)

    def state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        return {n: s for opt in self.optimizers for n, s in opt.state_by_name().items()}

    def load_state_by_name(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        for opt in self.optimizers:
            opt.load_state_by_name({n: v for n, v in state.items() if n in opt.named})

    def block_params(self, block: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full name -> value of a block's parameters, wherever they live (for checkpoints)."""
        store = self._store_of.get(block)
        if store is not None:
            return {f"{block}.{n}": t for n, t in store.block_state(block).items()}
        return {f"{block}.{n}": p.detach() for n, p in _unique_params(module)}

    def load_block_params(self, block: str, module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
        store = self._store_of.get(block)
        local = {n: values[f"{block}.{n}"] for n, _ in _unique_params(module)}
        if store is not None:
            store.load_block_state(block, local)
            return
        with torch.no_grad():
            for n, p in _unique_params(module):
                p.copy_(local[n])

    def close(self) -> None:
        self.activations.close()
        for store in self.stores:
            store.close()
        for opt in self.optimizers:
            opt.close()
