"""`mmplan calibrate`'s probe of the host's per-op work (Cluster.forward_op_s, backward_op_s, saved_tensor_s,
released_tensor_s).

A stack of the zoo's transformer layer at width 8 on 4 tokens: the ops, modules and saved tensors of a real layer
with no arithmetic to speak of, so that each op costs what running a model op by op costs beyond its arithmetic: the
Python that calls it, the dispatcher, recording the autograd graph (forward), the autograd engine (backward). Ops are
counted as the profiler counts them (profile.dispatched: every aten op but prim's metadata queries), so that a
profile's op counts x these costs is what its blocks pay. The accounting cost is the same forward with each layer
run as the runtime runs a `keep` block (runtime/activations.py: its saved-tensor hook and memory accounting) minus
the plain forward, per activation storage autograd saved (distinct storages, parameters left out: what the runtime
accounts, as the profiler's Block.saved_tensors counts them; the hook's calls on parameters are in the figure); the
release cost is that graph's backward (the budget's weak-reference callbacks as the storages are freed) minus the
plain backward, per storage. On a CUDA machine the probe still runs on CPU tensors: it measures the dispatch the host
pays for every op, not the kernel launch, so there it is a lower bound of the host's work (which the cost model
overlaps with the GPU's: cost_models/overhead.with_host).
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.profiler.analyse import dispatched

LAYERS = 16  # ~600 forward ops, a few ms per pass


class _CountOps(TorchDispatchMode):
    """Counts the ops run inside it as the profiler counts a block's (profile.dispatched)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if dispatched(func):
            self.ops += 1
        return func(*args, **(kwargs or {}))


class _Chain(torch.nn.Module):
    """LAYERS of the zoo's transformer layer (runtime/models/layers.py) at width 8 on 4 tokens: the ops, modules and
    saved tensors of a real layer, with no arithmetic to speak of; each layer is one block, as the runtime runs it."""

    def __init__(self) -> None:
        from runtime.models.layers import TransformerLayer

        super().__init__()
        self.layers = torch.nn.ModuleList(TransformerLayer(8, 2, 32) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, tiers=None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if tiers is None:
                x = layer(x)
            else:
                with tiers.context("keep", block=str(i)):
                    x = layer(x)
        return x.sum()


def host_probe(budget_s: float) -> tuple[float, float, float, float]:
    """(forward_op_s, backward_op_s, saved_tensor_s, released_tensor_s) on this process: medians over `budget_s`
    seconds of rounds that each time a plain forward and its backward, then the same under the runtime's hooks (run
    on every rank at once by calibrate, as training runs them)."""
    from runtime.activations import ActivationTiers
    from runtime.budget import DeviceBudget

    torch.manual_seed(0)
    chain, x = _Chain(), torch.randn(1, 4, 8)
    with _CountOps() as counted:
        loss = chain(x)
    fwd_ops = counted.ops
    with _CountOps() as counted:
        loss.backward()
    bwd_ops = counted.ops
    params = {p.untyped_storage()._cdata for p in chain.parameters()}
    storages: set[int] = set()

    def count(t: torch.Tensor) -> torch.Tensor:  # what the runtime accounts: distinct storages, not parameters
        key = t.untyped_storage()._cdata
        if key not in params:
            storages.add(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        kept = chain(x)  # (alive while counting: a freed storage's address may be reused)
    accounted = len(storages)
    del kept
    tiers = ActivationTiers(DeviceBudget())
    tiers.budget.ignore_module(chain)  # as the runtime's run_block does: parameters are not activations
    try:
        def hooked() -> torch.Tensor:
            return chain(x, tiers)

        def backward(loss: torch.Tensor) -> float:
            chain.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss.backward()
            return time.perf_counter() - t0

        for _ in range(3):  # warm-up
            backward(chain(x)), backward(hooked())
        fwd, bwd, hook, release = [], [], [], []
        end = time.perf_counter() + budget_s
        while len(fwd) < 5 or time.perf_counter() < end:  # interleaved, so that a drift of the machine hits all alike
            t0 = time.perf_counter()
            plain = chain(x)
            t1 = time.perf_counter()
            plain_bwd = backward(plain)
            t2 = time.perf_counter()
            held = hooked()
            t3 = time.perf_counter()
            held_bwd = backward(held)
            fwd.append(t1 - t0)
            bwd.append(plain_bwd)
            hook.append((t3 - t2) - (t1 - t0))
            release.append(held_bwd - plain_bwd)
    finally:
        tiers.close()
    fwd_s, bwd_s, hook_s, release_s = (statistics.median(x) for x in (fwd, bwd, hook, release))
    n = max(accounted, 1)
    return fwd_s / fwd_ops, bwd_s / bwd_ops, max(0.0, hook_s) / n, max(0.0, release_s) / n


__all__ = ["host_probe"]
