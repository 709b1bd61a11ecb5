"""Memory tiers of one rank: the device-tier budget, activations kept/offloaded/recomputed, parameters and Adam state off the device.

Vocabulary: the *device tier* is what the plan calls "gpu" (on this CPU-only machine an accounted budget,
on CUDA real device memory); the *host tier* is "cpu" (pinned host memory on CUDA) and the *NVMe tier*
is files under a directory the user chooses. Every piece keeps the numbers of plain training bitwise:
tiers move bytes, never change them.

The pieces, one file each (this module re-exports their public names):
- runtime/budget.py: DeviceBudget, the accounted device tier (how bytes are counted is in its docstring);
- runtime/tier_io.py: the background I/O thread, scratch directory and file reads/writes of the tiers;
- runtime/activations.py: ActivationTiers, SavedActivations: saved tensors kept, offloaded or recomputed;
- runtime/param_tiers.py: ParamStore, GradTier, TieredAdam: parameters, gradients, Adam state in a tier;
- runtime/rank_tiers.py: RankTiers, TieredBlocks: a rank's tiers composed from the plan's per-stage Memory.
"""
from __future__ import annotations

from runtime.activations import (
    ActivationTiers,
    SavedActivations,
    activation_context,
    run_block,
)
from runtime.budget import (
    CATEGORIES,
    Category,
    DeviceBudget,
    MemoryBudgetExceeded,
    OffTier,
)
from runtime.param_tiers import GradTier, ParamStore, TieredAdam
from runtime.rank_tiers import RankTiers, TieredBlocks
from runtime.tier_io import check_nvme_space

__all__ = [
    "CATEGORIES",
    "ActivationTiers",
    "Category",
    "DeviceBudget",
    "GradTier",
    "MemoryBudgetExceeded",
    "OffTier",
    "ParamStore",
    "RankTiers",
    "SavedActivations",
    "TieredAdam",
    "TieredBlocks",
    "activation_context",
    "check_nvme_space",
    "run_block",
]
