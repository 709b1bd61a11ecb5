"""Parameters, gradients and Adam state in a tier: ParamStore streams blocks' parameters, GradTier, TieredAdam."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from plans.errors import MmplanError
from plans.plan import Tier
from runtime.budget import DeviceBudget, OffTier
from runtime.precision import low_precision
from runtime.tier_io import (
    ALIGN,
    MappedFile,
    TierIO,
    aligned_nbytes,
    bytes_of,
    check_nvme_space,
    read_file,
    write_file,
)

try:  # the dtype torch.optim.Adam gives its `step` counter
    from torch.optim.optimizer import _get_scalar_dtype
except ImportError:  # pragma: no cover - older torch
    def _get_scalar_dtype() -> torch.dtype:
        return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def unique_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of each distinct parameter of `module`, under its first name (tied ones once)."""
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
        self.params: dict[str, list[tuple[str, nn.Parameter]]] = {b: unique_params(blocks[b]) for b in self.order}
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
        self.io = TierIO("params", nvme_dir, budget.device)
        self._inline = tier == "cpu" and self.io.stream is None  # host memory to host memory: a plain copy, here
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
        # a uint8 view over each parameter's storage, made while it is full: it stays valid across the storage's
        # resizes (a view reads the storage's data pointer at each use), so the streaming makes no tensor per copy
        self._bytes = {id(p): bytes_of(p.untyped_storage()) for named in self.params.values() for _, p in named}
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
                src = self._bytes[id(p)]
                if initial:
                    self._host[id(p)] = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=self.io.stream is not None)
                self._host[id(p)].copy_(src)
            return
        if initial:
            offsets, at = {}, 0
            for _, p in self.params[block]:
                offsets[id(p)] = at
                at += -(-p.untyped_storage().nbytes() // ALIGN) * ALIGN
            self._file[block] = (self.io.path(), offsets)
            with open(self._file[block][0], "wb") as f:
                f.truncate(at)
        path, offsets = self._file[block]
        for _, p in self.params[block]:
            write_file(path, self._bytes[id(p)].cpu(), offsets[id(p)])

    def _materialise(self, block: str) -> None:
        for _, p in self.params[block]:
            dst = self._bytes[id(p)]
            n = dst.numel()
            p.untyped_storage().resize_(n)
            if self.tier == "cpu":
                dst.copy_(self._host[id(p)], non_blocking=self.io.stream is not None)
            elif dst.device.type == "cpu":
                path, offsets = self._file[block]
                read_file(path, dst, offsets[id(p)])
            else:
                path, offsets = self._file[block]
                dst.copy_(read_file(path, torch.empty(n, dtype=torch.uint8, pin_memory=True), offsets[id(p)]), non_blocking=True)
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
        self._loading[block] = self.io.submit(self._materialise, block, inline=self._inline)

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
                data = bytes_of(p.untyped_storage()).cpu().clone()
            elif self.tier == "cpu":
                data = self._host[id(p)].cpu().clone()
            else:
                path, offsets = self._file[block]
                data = read_file(path, torch.empty(n, dtype=torch.uint8), offsets[id(p)])
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
    'nvme': after each accumulation the gradient is added to its copy in the tier and dropped from the device
    tier (same additions in the same order as autograd's accumulation, so the sums are bitwise equal): a host
    tensor for 'cpu', a slice of one memory-mapped file under nvme_dir for 'nvme' (MappedFile, as Adam's state).
    collect() hands them back as p.grad for the reduction and the optimizer. On the device a gradient exists
    only from its accumulation until it is moved: at most one block's gradients (cost_models/memory.state_residency)."""

    def __init__(self, params: Iterable[nn.Parameter], tier: Tier, budget: DeviceBudget, *,
                 nvme_dir: str | os.PathLike | None = None) -> None:
        self.tier, self.budget = tier, budget
        self.params = [p for p in params if p.requires_grad]
        self.host: dict[int, torch.Tensor] = {}
        self._by_id = {id(p): p for p in self.params}
        self._file: MappedFile | None = None
        self._slots: dict[int, torch.Tensor] = {}
        if tier == "nvme":
            self._file = MappedFile("grads", "gradients", nvme_dir, sum(aligned_nbytes(p) for p in self.params))
            self._slots = {id(p): self._file.zeros_like(p) for p in self.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, p: nn.Parameter) -> None:
        if self.tier == "gpu":
            self.budget.hold("grads", p.grad)
            return
        g = p.grad
        self.budget.hold("grads", g)  # on the device until moved out: counted while it is there
        p.grad = None
        host = self.host.get(id(p))
        if host is None:
            if self._file is not None:
                host = self._slots[id(p)]
                host.copy_(g)  # written to the file; the device copy is freed
            else:
                host = g.detach().to("cpu", copy=True)  # a real move: the device copy is freed
            self.host[id(p)] = host
            self.budget.add_host(self.tier, g.numel() * g.element_size())
        else:
            host.add_(g.to("cpu"))

    def collect(self) -> None:
        """Move the gradients held in the tier into p.grad (call before reducing gradients and the optimizer step)."""
        for key, g in self.host.items():
            p = self._by_id[key]
            if self._file is not None:  # read back from the file into memory of its own (the slot is reused)
                p.grad = g.clone() if p.device.type == "cpu" else g.to(p.device)
            else:
                p.grad = g if p.device.type == "cpu" else g.to(p.device)
            self.budget.remove_host(self.tier, g.numel() * g.element_size())
            if self.tier == "gpu" or p.device.type != "cpu":
                self.budget.hold("grads", p.grad)
        self.host = {}

    def close(self) -> None:
        """Remove the NVMe tier's file (nothing to do for the other tiers)."""
        if self._file is not None:
            self._file.close()
            self._file, self._slots = None, {}


# --- Adam with its state in a tier -----------------------------------------------------------------


def _fp32(p: torch.Tensor, device: str | torch.device = "meta") -> torch.Tensor:
    """An uninitialised fp32 tensor of p's shape (on the meta device: for its size only)."""
    return torch.empty(p.shape, dtype=torch.float32, device=device)


class TieredAdam:
    """torch.optim.Adam with exp_avg / exp_avg_sq in the gpu, cpu or nvme tier; bitwise the same updates.

    The arithmetic is torch.optim.Adam's own (one Adam per block, same hyper-parameters); only where its
    state tensors live changes: 'gpu' beside the parameters (counted in the device budget), 'cpu' in host
    memory, 'nvme' in one memory-mapped file under nvme_dir (np.memmap-backed tensors). On CUDA with the
    state off the device the step runs on host copies of the parameters (grads copied to the host,
    updated parameters copied back). Low-precision (bf16) parameters train on fp32 master copies kept with the
    state (mixed precision, runtime/precision.py: 12 B per parameter in the tier): the gradient is widened to
    fp32, Adam updates the master, the parameter is its rounded copy. With a ParamStore the step streams block
    by block, one ahead.
    """

    def __init__(self, named_params: Mapping[str, nn.Parameter], *, tier: Tier = "gpu", budget: DeviceBudget | None = None,
                 nvme_dir: str | os.PathLike | None = None, store: ParamStore | None = None,
                 blocks: Mapping[str, Sequence[str]] | None = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self.tier, self.budget, self.store = tier, budget, store
        self.named = dict(named_params)
        if store is not None:  # the store's blocks, their frozen parameters (not among named_params) left out
            blocks = {b: [f"{b}.{n}" for n, _ in store.params[b] if f"{b}.{n}" in self.named] for b in store.order}
        blocks = {k: list(v) for k, v in (blocks or {"": list(self.named)}).items()}
        self.blocks: dict[str, list[str]] = {k: v for k, v in blocks.items() if v}  # a block with nothing to train has no Adam
        unknown = [n for names in self.blocks.values() for n in names if n not in self.named]
        if unknown:
            raise MmplanError(f"TieredAdam: parameter {unknown[0]} of a block is not among the named parameters")
        device = next((p.device for p in self.named.values()), torch.device("cpu"))
        self.on_host = tier != "gpu" and device.type != "cpu"
        self._file: MappedFile | None = None
        if tier == "nvme":
            total = sum(3 * aligned_nbytes(_fp32(p)) if low_precision(p) else 2 * aligned_nbytes(p)
                        for p in self.named.values())
            self._file = MappedFile("adam", "optimizer state", nvme_dir, total)
        self.masters: dict[str, torch.Tensor] = {}
        self._fresh: set[str] = set()  # masters still to be copied from their parameters
        self.optimizers: dict[str, torch.optim.Adam] = {}
        for b, names in self.blocks.items():
            for n in names:
                p = self.named[n]
                mixed = low_precision(p)  # an fp32 master, kept with the state in the state's tier
                if mixed and self._file is not None:
                    m = self._file.zeros_like(_fp32(p))
                elif self.on_host:
                    m = torch.empty(p.shape, dtype=torch.float32 if mixed else p.dtype, pin_memory=True)
                elif mixed:
                    m = _fp32(p, p.device)
                else:
                    continue
                self.masters[n] = m.requires_grad_()
                self._fresh.add(n)  # copied from the parameter at its first step (an offloaded one is not here yet)
            targets = [self.masters.get(n, self.named[n]) for n in names]
            opt = torch.optim.Adam(targets, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            for n, t in zip(names, targets):
                opt.state[t] = {
                    "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
                    "exp_avg": self._zeros_like(t),
                    "exp_avg_sq": self._zeros_like(t),
                }
            self.optimizers[b] = opt
        state_bytes = sum(3 * 4 * p.numel() if low_precision(p) else 2 * p.numel() * p.element_size()
                          for p in self.named.values())
        if budget is not None:
            if tier == "gpu":
                budget.add("optimizer", state_bytes)
            else:
                budget.add_host(tier, state_bytes)

    def _zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        if self._file is None:
            return torch.zeros_like(t, memory_format=torch.preserve_format, device="cpu" if self.on_host else t.device)
        return self._file.zeros_like(t)

    def step(self) -> None:
        order = list(self.optimizers)
        for i, b in enumerate(order):
            if self.store is not None:
                self.store.prefetch(order[i + 1] if i + 1 < len(order) else None)
                with self.store.materialized(b, dirty=True):
                    self._step_block(b)
            else:
                self._step_block(b)
        if self._file is not None:
            self._file.flush()

    def _step_block(self, block: str) -> None:
        masters = [n for n in self.blocks[block] if n in self.masters]
        for n in masters:
            p, m = self.named[n], self.masters[n]
            if n in self._fresh:
                with torch.no_grad():
                    m.copy_(p.detach())
                self._fresh.discard(n)
            m.grad = None if p.grad is None else p.grad.detach().to(device=m.device, dtype=m.dtype)
        self.optimizers[block].step()
        with torch.no_grad():
            for n in masters:
                self.named[n].copy_(self.masters[n])  # blocking: the next step rewrites the master in place

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
        """Layout-independent state: full parameter name -> {step, exp_avg, exp_avg_sq[, master]} (CPU copies;
        `master`: the fp32 master of a low-precision parameter)."""
        out = {n: {k: v.detach().cpu().clone() for k, v in self._state_of(n).items()} for n in (names or self.named)}
        for n, state in out.items():
            if n in self.masters and n not in self._fresh and low_precision(self.named[n]):
                state["master"] = self.masters[n].detach().cpu().clone()
        return out

    def load_state_by_name(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy saved state into the tier's tensors (files stay where they are)."""
        for n, values in state.items():
            if not values:  # saved while the parameter was frozen: its Adam state starts fresh
                continue
            if n not in self.named:
                raise MmplanError(f"optimizer state for {n}, which is not a parameter of this rank")
            mine = self._state_of(n)
            for k in ("step", "exp_avg", "exp_avg_sq"):
                mine[k].copy_(values[k])
            if n in self.masters and "master" in values:  # else (an fp32 run's checkpoint) from the loaded parameter
                with torch.no_grad():
                    self.masters[n].copy_(values["master"])
                self._fresh.discard(n)

    def close(self) -> None:
        """Drop the memory map and remove its file."""
        self.optimizers = {}
        if self._file is not None:
            self._file.close()
            self._file = None
