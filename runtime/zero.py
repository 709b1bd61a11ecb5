"""ZeRO 1/2/3 on torch's FSDP2: a stage's blocks sharded over its data-parallel group, one `fully_shard` per block.

Why FSDP2 for all three stages (and not torch's ZeroRedundancyOptimizer for 1/2): one mechanism whose
collectives are reduce-scatter + all-gather (the volume of the all-reduce it replaces, as cost_models/tail.py
prices ZeRO), shards every parameter evenly along dim 0 (ZeroRedundancyOptimizer gives each rank whole
parameters, so shares are uneven, and broadcasts every updated parameter from its owner), and the three stages
differ only in when FSDP2 reshards parameters and reduces gradients (DeepSpeed's definitions, Rajbhandari et
al. 2020):

- ZeRO-1: parameters stay unsharded through the step (``reshard_after_forward=False``, resharded after the
  stage's last backward); gradients accumulate unsharded and are reduce-scattered once, at the last backward;
  the optimizer updates this rank's shard and the next forward all-gathers it.
- ZeRO-2: as ZeRO-1, but every micro-batch's backward reduce-scatters, so only gradient shards accumulate.
- ZeRO-3: parameters resharded after each forward and each backward (all-gathered again before each use).

The runtime's loss is already divided by dp * micro-batches (train.py), so FSDP2 must sum, not average:
gradient divide factor 1 with `set_force_sum_reduction_for_comms` (gloo has no PREMUL_SUM). Parameters
become DTensors sharded on dim 0; the optimizer (param_tiers.TieredAdam, with its tiers) runs on their local
shards (`local_view`), so a CPU-offloaded optimizer holds only this rank's share. A stage with parameters and
gradients in the cpu tier uses FSDP2's CPUOffloadPolicy (ZeRO-Offload / ZeRO-Infinity's host-resident shards);
no other parameter or gradient tier runs under ZeRO (`plans/capabilities.zero_runs_with`). Checkpoints stay
unsharded and layout-independent: `full` gathers, `local_of` takes this rank's shard of a full tensor.

Tied parameters (a token embedding shared with the LM head, `tie_word_embeddings`): the blocks sharing one are
sharded as one FSDP2 unit, `fully_shard([embed, head])` as torchtitan does, so both blocks hold the same DTensor
(one shard set, one optimizer state, one gradient reduction of the summed gradient, one update). Sharded block by
block, each `fully_shard` would swap the shared Parameter for a DTensor of its own: two copies, each stepped with
half the gradient. FSDP2 takes a grouped unit only below a root, so a unit gets a parameterless holder as its root.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


from plans.capabilities import ZERO_TIERS, zero_runs_with  # noqa: F401  (the tiers FSDP2 holds here, as data)


def apply_zero(modules: Mapping[str, nn.Module], group: Any, zero: int, device: torch.device,
               offload: bool = False, replicated: Iterable[nn.Parameter] = (),
               reshard_after_forward: bool = True) -> list[FSDPModule]:
    """Shard each block with parameters over `group` (this rank's data-parallel group of the stage), in place;
    returns the sharded blocks. Apply after tensor parallelism (the shards are of the tp-local tensors).
    `offload`: FSDP2's CPU offload (sharded parameters and gradients on the host, gathered to the device for use).
    `replicated`: parameters left whole (FSDP2's ignored_params) -- a block's adopted parameter that the model's
    forward reads outside the block (CLIP's logit_scale): FSDP2 only gathers a parameter around its own module's
    forward. Their gradients are the caller's to all-reduce. `reshard_after_forward=False` (ZeRO-3 only: the plan's
    Group field) keeps each block's gathered parameters from its forward to its backward (resharded after it)."""
    if zero not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3 here, got {zero}")
    # FSDP2 warns, on every rank and run, when a block returns a view (a projector's reshape): an in-place op on it
    # would skip the backward all-gather. The runtime's glue never modifies a block's output in place (ZeRO-3 parity
    # tests, tests/runtime/test_zero.py), so the warning is noise on the user's terminal.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    mesh = DeviceMesh.from_group(group, device.type)
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    sharded, keep = [], {id(p) for p in replicated}
    for unit in tied_units(modules.values()):
        ignored = {p for m in unit for p in m.parameters() if id(p) in keep}
        if not any(id(p) not in keep for m in unit for p in m.parameters()):
            continue
        # blocks sharing a parameter (a tied embedding and LM head) are one FSDP unit, as torchtitan shards them: one
        # DTensor in both blocks, one shard set, one optimizer state, one gradient reduction. Sharded one by one, each
        # block's fully_shard would replace the shared Parameter by a DTensor of its own (two copies, each updated).
        reshard = zero >= 3 and reshard_after_forward
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=reshard, offload_policy=policy,
                    ignored_params=ignored or None)
        sharded.extend(unit)  # each block of a unit is an FSDPModule of the unit's one state
        if len(unit) > 1:  # FSDP2 refuses a grouped state as a root: a holder without parameters of its own is its root
            holder = _Holder(unit)
            fully_shard(holder, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
            holder._get_fsdp_state()._lazy_init()
        unit[0].set_gradient_divide_factor(1.0)
        unit[0].set_force_sum_reduction_for_comms(True)
    return sharded


class _Holder(nn.Module):
    """The root FSDP2 needs above a unit of several blocks (it is never called: the blocks run on their own)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self) -> None:  # pragma: no cover - never called
        raise RuntimeError("a ZeRO unit's holder is not run")


def check_ties_within_chunks(chunks: Iterable[Iterable[str]], modules: Mapping[str, nn.Module]) -> None:
    """A ZeRO stage's chunks (one, or v under the interleaved schedule) are sharded one by one, so blocks sharing a
    parameter must be in one chunk (each chunk's FSDP2 units reduce at that chunk's last backward)."""
    from plans.errors import MmplanError

    owner: dict[int, tuple[int, str]] = {}
    for i, blocks in enumerate(chunks):
        for b in blocks:
            for p in modules[b].parameters():
                j, other = owner.setdefault(id(p), (i, b))
                if j != i:
                    raise MmplanError(f"blocks {other} and {b} share a parameter but are in different chunks of an "
                                      "interleaved ZeRO stage; the runtime shards a tied parameter within one chunk")


def tied_units(modules: Iterable[nn.Module]) -> list[list[nn.Module]]:
    """`modules` grouped into units: modules sharing a parameter (directly or through others) in one unit, in the
    order of each unit's first module."""
    modules = list(modules)
    root = list(range(len(modules)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    owner: dict[int, int] = {}
    for i, m in enumerate(modules):
        for p in m.parameters():
            j = owner.setdefault(id(p), i)
            root[find(i)] = find(j)
    units: dict[int, list[nn.Module]] = {}
    for i, m in enumerate(modules):
        units.setdefault(find(i), []).append(m)
    return list(units.values())


def before_backward(modules: Iterable[FSDPModule], zero: int, last: bool) -> None:
    """Set what the coming backward of a stage's micro-batch does: reduce gradients (every micro-batch from
    ZeRO-2 on; only the last for ZeRO-1) and reshard parameters (always under ZeRO-3; else after the last)."""
    for m in modules:
        m.set_requires_gradient_sync(zero >= 2 or last, recurse=False)
        m.set_reshard_after_backward(zero >= 3 or last, recurse=False)


def is_sharded(t: Any) -> bool:
    return isinstance(t, DTensor)


def local_view(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded parameter as a plain leaf tensor sharing its storage (in-place updates
    reach the parameter); a plain tensor is returned as it is."""
    if not isinstance(p, DTensor):
        return p
    with torch.no_grad():
        return p.to_local().detach()


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over the data-parallel group for a sharded one)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_from_local(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `local` is this rank's shard, sharded as parameter `like` (collective)."""
    if not isinstance(like, DTensor) or local.dim() == 0:
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()).full_tensor()


def local_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `whole`, sharded as parameter `like` (no communication)."""
    if not isinstance(like, DTensor) or whole.dim() == 0:
        return whole
    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()
