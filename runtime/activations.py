"""Activation tiers: what autograd saves in a block's forward is kept, offloaded to the host or NVMe tier, or recomputed."""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plans.plan import ActivationTier
from runtime.budget import DeviceBudget, OffTier
from runtime.models.layers import Attention, CrossAttention, recompute_attention_core
from runtime.tier_io import TierIO, bytes_of, read_file, write_file

_PLAIN_TYPES = (torch.Tensor, nn.Parameter)


def _plain_storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """`t`'s storage if it is a strided tensor with a real one (not a wrapper subclass such as DTensor, not meta)."""
    if type(t) not in _PLAIN_TYPES or t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def has_attention_core(module: Any) -> bool:
    """True when `module` holds a zoo attention whose core the 'selective' tier can recompute alone."""
    return isinstance(module, nn.Module) and any(isinstance(m, (Attention, CrossAttention)) for m in module.modules())


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


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
        "counted",
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
        self.tiers, self.tier, self.nbytes, self.counted = tiers, tier, storage.nbytes(), False
        self.host: torch.Tensor | None = None
        self.path: str | None = None
        self.written: Any = None
        self.device_copy: torch.Tensor | None = None
        self.loading: Future | None = None
        self.ready = None  # CUDA event: the device copy is complete
        self.views = self.unpacked = 0
        io, src = tiers.io, bytes_of(storage)
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
        self.counted = True

    def __del__(self) -> None:  # the host copy / file goes with this (a weakref.finalize costs ~4x more per storage)
        if getattr(self, "counted", False):
            self.tiers.budget.remove_host(self.tier, self.nbytes)

    def prefetch(self) -> None:
        if self.device_copy is not None or self.loading is not None:
            return
        if self.tiers.io.stream is not None and self.path is None:
            self.loading = Future()
            self.loading.set_result(self._to_device(self.host))  # queued on the side stream already
        else:  # a host copy on a CPU rank is copied back here and now (TierIO.submit's inline); files on the I/O thread
            self.loading = self.tiers.io.submit(self._load, inline=self.path is None)

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
            read_file(self.path, host)
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
    write_file(path, data)


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
        self._hold = tiers.budget.hold_storage

    def prefetch(self) -> None:
        for ref in self._copies:
            copy = ref()
            if copy is not None:
                copy.prefetch()

    def hooks(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """The (pack, unpack) pair for torch.autograd.graph.saved_tensors_hooks.

        A `keep` block whose first unpack has nothing to prefetch (the block before it is not offloaded)
        hands autograd its tensors themselves: no wrapper, unpack is the identity.
        """
        if self.tier == "keep" and (self.previous is None or self.previous.tier == "keep"):
            return self._pack_kept, _identity
        return self._pack, self._unpack

    def _pack_kept(self, t: torch.Tensor) -> torch.Tensor:
        # _plain_storage inlined: this runs for every tensor autograd saves
        if type(t) in _PLAIN_TYPES and t.layout == torch.strided and not t.is_meta:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return t
            self.saved_bytes += self._hold("activations", storage)  # 0 for parameters, buffers, storages seen before
        return t

    def _pack(self, t: torch.Tensor) -> Any:
        budget = self.tiers.budget
        storage = _plain_storage(t)
        if storage is None or budget.ignores(storage):
            return t  # parameters and buffers stay where they are; so do tensors without a plain storage
        if self.tier == "keep":
            self.saved_bytes += budget.hold_storage("activations", storage)
            return _Kept(self, t)
        if storage.nbytes() == 0 or t.device.type != self.tiers.io.device.type:
            return _Kept(self, t)  # nothing to move, or a host tensor on a CUDA rank
        known = self._by_storage.get(storage._cdata)
        if known is not None and known[0]() is storage:
            copy = known[1]
        else:
            budget.hold_storage("buffers", storage)  # resident until autograd's other users free it
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
            storage = _plain_storage(t)
            if storage is not None:
                budget.hold_storage("activations", storage)
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
        self.io = TierIO("act", nvme_dir, torch.device(device) if device is not None else budget.device)
        self._ignored: weakref.WeakSet = weakref.WeakSet()
        self._in_flight: SavedActivations | None = None
        # storages brought back by a prefetch vs loaded when the backward asked; seconds the backward waited
        self.stats: dict[str, float] = {"prefetched": 0, "on_demand": 0, "wait_s": 0.0}

    @contextlib.contextmanager
    def context(self, tier: ActivationTier, *, block: str = "", previous: SavedActivations | None = None) -> Iterator[SavedActivations]:
        """Run one block's forward inside: its saved tensors are kept, or offloaded to the host or NVMe tier."""
        if tier in ("recompute", "selective"):
            raise ValueError(f"{tier!r} is not a saved-tensor policy; run the block with run_block(..., {tier!r})")
        if tier not in ("keep", "offload-cpu", "offload-nvme"):
            raise ValueError(f"unknown activation tier {tier!r}; expected keep, offload-cpu, offload-nvme, recompute or selective")
        saved = SavedActivations(self, block, tier, previous)
        try:
            with torch.autograd.graph.saved_tensors_hooks(*saved.hooks()):
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
        (its saved inputs count as kept activations, and what it recomputes in the backward is counted too);
        selective keeps everything but the attention core's own tensors (the core saves only q, k, v and is
        recomputed in the backward: models.layers.recompute_attention_core). A block without a zoo attention
        runs 'selective' as 'recompute'."""
        if isinstance(module, nn.Module) and module not in self._ignored:
            self.budget.ignore_module(module)
            self._ignored.add(module)
        if tier == "selective":
            if has_attention_core(module):
                with self.context("keep", block=block, previous=previous) as saved, recompute_attention_core():
                    return module(*args, **kwargs), saved
            tier = "recompute"  # no attention core of ours to recompute alone: the whole block (never more memory)
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
