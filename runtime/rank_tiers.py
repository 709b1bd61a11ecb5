"""One rank's tiers composed from the plan's per-stage Memory: RankTiers, and TieredBlocks for one stage's forward."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from plans.errors import MmplanError
from plans.plan import ActivationTier
from runtime.activations import ActivationTiers, SavedActivations
from runtime.budget import DeviceBudget
from runtime.param_tiers import GradTier, ParamStore, TieredAdam, unique_params
from plans.capabilities import ZERO_TIERS, zero_runs_with
from runtime.zero import is_sharded, local_grad, local_of, local_view


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

    Blocks sharded by ZeRO (runtime/zero.py, applied before) hold DTensor parameters: the optimizer runs on
    their local shards in its tier (a CPU/NVMe-offloaded sharded optimizer); FSDP2 owns their parameters and
    gradients (no ParamStore or GradTier for them: on the device, or on the host with its CPU offload,
    zero.zero_runs_with). Frozen parameters (requires_grad False) get no optimizer state.
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
        self.sharded: dict[str, nn.Parameter] = {}  # full name -> ZeRO-sharded (DTensor) parameter
        self._shard_views: list[tuple[nn.Parameter, torch.Tensor]] = []  # (sharded parameter, its local shard)
        by_tiers: dict[tuple[str, str, str, bool], list[str]] = {}  # (tiers, ZeRO-sharded) -> blocks
        seen: set[int] = set()  # a parameter tied between blocks belongs to the first (as in the profiler)
        for blocks, memory in stages:
            for b in blocks:
                self.memory[b] = memory
                sharded_block = any(is_sharded(p) for p in modules[b].parameters())
                by_tiers.setdefault((memory.params, memory.optimizer, memory.grads, sharded_block), []).append(b)
        groups_of: dict[int, set[tuple[str, str, str]]] = {}
        for key, blocks in by_tiers.items():
            for b in blocks:
                for _, p in unique_params(modules[b]):
                    groups_of.setdefault(id(p), set()).add(key)
        if any(len(keys) > 1 and any(k[0] != "gpu" for k in keys) for keys in groups_of.values()):
            raise MmplanError("a parameter is tied between blocks whose stages hold parameters in different tiers; "
                              "give those stages the same Memory")
        for (params_tier, optimizer_tier, grads_tier, _), blocks in by_tiers.items():
            mods = {b: modules[b] for b in blocks}
            named = {}
            for b, m in mods.items():
                for n, p in unique_params(m):
                    if id(p) not in seen:
                        seen.add(id(p))
                        named[f"{b}.{n}"] = p
            sharded = {n: p for n, p in named.items() if is_sharded(p)}
            if sharded and not zero_runs_with(params_tier, grads_tier, optimizer_tier):
                raise MmplanError(f"block of {next(iter(sharded))} is sharded by ZeRO (FSDP2), but its stage puts parameters "
                                  f"in {params_tier!r}, gradients in {grads_tier!r} and the optimizer state in "
                                  f"{optimizer_tier!r}; {ZERO_TIERS}")
            for n, p in sharded.items():
                view = local_view(p)
                self.sharded[n] = p
                self._shard_views.append((p, view))
                named[n] = view
            store = None
            if params_tier == "gpu":
                self.budget.add("params", sum(p.numel() * p.element_size() for p in named.values()))
            elif sharded:  # FSDP2's CPU offload holds the shards (and their gradients) on the host
                self.budget.add_host(params_tier, sum(p.numel() * p.element_size() for p in named.values()))
            else:
                store = ParamStore(mods, params_tier, self.budget, nvme_dir=nvme_dir, order=blocks, prefetch=prefetch)
                self.stores.append(store)
                self._store_of.update(dict.fromkeys(blocks, store))
            self.grads.append(GradTier([p for n, p in named.items() if n not in sharded], grads_tier, self.budget, nvme_dir=nvme_dir))
            trained = {n: p for n, p in named.items() if p.requires_grad or n in sharded and sharded[n].requires_grad}
            self.optimizers.append(TieredAdam(trained, tier=optimizer_tier, budget=self.budget, nvme_dir=nvme_dir, store=store, lr=lr))
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
        for p, view in self._shard_views:  # FSDP2's reduced gradient shards, for the optimizer on the local shards
            view.grad = local_grad(p)
            if view.grad is not None:
                self.budget.hold("grads", view.grad)
        for opt, persistent in zip(self.optimizers, self._persistent_grads):
            opt.step()
            opt.zero_grad(set_to_none=not persistent)
        for p, view in self._shard_views:
            p.grad = view.grad = None

    def state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        return {n: s for opt in self.optimizers for n, s in opt.state_by_name().items()}

    def load_state_by_name(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        for opt in self.optimizers:  # state saved for a parameter now frozen is dropped
            opt.load_state_by_name({n: v for n, v in state.items() if n in opt.named})

    def block_params(self, block: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full name -> value of a block's parameters, wherever they live (for checkpoints)."""
        store = self._store_of.get(block)
        if store is not None:
            return {f"{block}.{n}": t for n, t in store.block_state(block).items()}
        return {f"{block}.{n}": p.detach() for n, p in unique_params(module)}

    def load_block_params(self, block: str, module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
        store = self._store_of.get(block)
        local = {n: values[f"{block}.{n}"] for n, _ in unique_params(module)}
        if store is not None:
            store.load_block_state(block, local)
            return
        with torch.no_grad():
            for n, p in unique_params(module):
                local_view(p).copy_(local_of(local[n], p))

    def close(self) -> None:
        self.activations.close()
        for store in self.stores:
            store.close()
        for opt in self.optimizers:
            opt.close()
        for grads in self.grads:
            grads.close()
