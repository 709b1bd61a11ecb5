"""The device tier as an accounted budget: bytes per category, their peaks, the limit, and the host tiers."""
from __future__ import annotations

import collections
import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from plans.errors import MmplanError
from plans.units import format_bytes

Category = Literal["params", "grads", "optimizer", "activations", "buffers"]
CATEGORIES: tuple[Category, ...] = ("params", "grads", "optimizer", "activations", "buffers")
OffTier = Literal["cpu", "nvme"]


class MemoryBudgetExceeded(MmplanError):
    """The device tier holds more bytes than the plan's budget allows."""


class _Held(weakref.ref):
    """A weak reference to a counted storage; autograd's last release of the storage queues it for release."""

    __slots__ = ("category", "key", "nbytes")


class DeviceBudget:
    """Bytes resident in the device tier by category, their peaks, and an optional limit.

    add/remove count sizes known up front; hold(category, tensor) counts a tensor's storage once, until
    the storage is freed. Exceeding `limit` raises MemoryBudgetExceeded at the add/hold that crossed it.
    The host tiers ("cpu", "nvme") are counted too (no limit) so the report covers the plan's RankMemory.

    How bytes are counted, chosen to match cost_models/memory.py so measured and predicted peaks can be
    compared:
    - params / optimizer: sizes added when they become resident in the device tier (all of them for the
      "gpu" tier; one block plus the one prefetched ahead for a ParamStore);
    - grads: each gradient's storage from its first accumulation until it is freed (GradTier);
    - activations: every storage autograd saves in a `keep` block (and the inputs a `recompute` block
      keeps as its checkpoint, and the activations it recomputes during the backward), parameters and
      buffers excluded, each storage once, as planner/profiler/profile.py counts them;
    - buffers: device copies in flight for offloaded activations: the original storage until autograd's
      other users free it (the forward's transient), and the copies brought back for the backward.
    A counted storage stays counted until it is really freed: torch keeps one Python object per storage,
    so a weak reference (with a callback) to `tensor.untyped_storage()` fires exactly when the memory is
    released.

    Thread-safe: the storages' weak-reference callbacks only queue their release, which the next change
    applies; changes take a lock; the common look-ups of hold (a parameter's storage, a storage already
    counted) read without it, which is safe because a live storage's entry is never removed.
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
        self._total = 0  # sum(self.current.values()), kept up to date by every change
        self._held: dict[int, _Held] = {}  # storage key -> weak reference to the counted storage
        self._ignored: dict[int, weakref.ref] = {}  # parameter and buffer storages
        self._freed: collections.deque[_Held] = collections.deque()  # released storages not yet subtracted
        self._lock = threading.RLock()  # reentrant: a garbage collection inside a change may run finalizers that count

    # counting
    def add(self, category: Category, nbytes: int) -> None:
        with self._lock:
            if self._freed:
                self._drain()
            self._grow(category, int(nbytes))

    def remove(self, category: Category, nbytes: int) -> None:
        with self._lock:
            if self._freed:
                self._drain()
            self.current[category] -= int(nbytes)
            self._total -= int(nbytes)

    def add_host(self, tier: OffTier, nbytes: int) -> None:
        with self._lock:
            self.host[tier] += int(nbytes)
            self.host_peak[tier] = max(self.host_peak[tier], self.host[tier])

    def remove_host(self, tier: OffTier, nbytes: int) -> None:
        with self._lock:
            self.host[tier] -= int(nbytes)

    def hold(self, category: Category, tensor: torch.Tensor) -> bool:
        """Count `tensor`'s storage in `category` until it is freed; False if ignored or already counted."""
        return self.hold_storage(category, tensor.untyped_storage()) > 0

    def hold_storage(self, category: Category, storage: torch.UntypedStorage) -> int:
        """hold() for a storage: the bytes newly counted (0 if ignored or already counted)."""
        key = storage._cdata
        ref = self._ignored.get(key)
        if ref is not None and ref() is storage:
            return 0
        ref = self._held.get(key)
        if ref is not None and ref() is storage:
            return 0
        with self._lock:
            if self._freed:
                self._drain()
            ref = self._held.get(key)
            if ref is not None and ref() is storage:  # counted by another thread meanwhile
                return 0
            nbytes = storage.nbytes()
            ref = _Held(storage, self._freed.append)
            ref.category, ref.key, ref.nbytes = category, key, nbytes
            self._held[key] = ref
            self._grow(category, nbytes)
            return nbytes

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages as held (parameters and buffers, as the profiler does)."""
        with self._lock:
            for t in tensors:
                if hasattr(t, "to_local"):  # a ZeRO-sharded (DTensor) parameter: its local shard's storage
                    t = t.to_local().detach()
                s = t.untyped_storage()
                self._ignored[s._cdata] = weakref.ref(s)

    def ignore_module(self, module: nn.Module) -> None:
        self.ignore(itertools.chain(module.parameters(), module.buffers()))

    def is_ignored(self, tensor: torch.Tensor) -> bool:
        return self.ignores(tensor.untyped_storage())

    def ignores(self, storage: torch.UntypedStorage) -> bool:
        ref = self._ignored.get(storage._cdata)
        return ref is not None and ref() is storage

    def _drain(self) -> None:
        """Subtract the storages freed since the last change (under the lock)."""
        while self._freed:
            ref = self._freed.popleft()
            self.current[ref.category] -= ref.nbytes
            self._total -= ref.nbytes
            if self._held.get(ref.key) is ref:
                del self._held[ref.key]

    def _grow(self, category: str, nbytes: int) -> None:
        """Add `nbytes` to `category`, note the peaks, raise past the limit (under the lock)."""
        now = self.current[category] = self.current[category] + nbytes
        self.peak[category] = max(self.peak[category], now)
        total = self._total = self._total + nbytes
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
            return self._total

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
            self.peak_total = self._total
            self.at_peak = dict(self.current)
            self.host_peak = dict(self.host)

    def report(self) -> dict[str, Any]:
        """JSON-able snapshot: current, peak per category, peak total and its breakdown, host tiers."""
        with self._lock:
            self._drain()
            return {
                "limit": self.limit, "total": self._total, "peak_total": self.peak_total,
                "current": dict(self.current), "peak": dict(self.peak), "at_peak": dict(self.at_peak),
                "host": dict(self.host), "host_peak": dict(self.host_peak),
            }
