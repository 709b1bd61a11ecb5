"""The solver's search space: its vocabulary (unit, tier policy, setting) and the degrees a unit may take."""
from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

from plans.cluster import Cluster
from plans.graph import Block
from plans.plan import ActivationTier, Memory, Tier

# Vocabulary. A *unit* is a run of consecutive profile blocks that gets one layout (a profile group, or
# several merged: planner/solver/structure.py). A *layout* of a unit is (tp, dp, pp, ZeRO stage) plus the DP's cut
# points and, per stage, a tier *policy* (where params / grads / optimizer state live and whether the
# stage keeps, recomputes or offloads its activations). Every time below is one rank's seconds as the
# pipeline simulator (cost_models/pipeline.py) counts it; every size is one rank's bytes as
# cost_models/memory.stage_memory counts it. The figures of a stage of blocks [i, j) are computed for all
# (i, j) at once with prefix sums, so the functions of cost_models/ are called per block, or fitted as the
# affine functions of bytes they are (alpha + bytes / bandwidth), never duplicated as formulas
# (planner/solver/segments.py). Every layout carries the terms of a lower bound of its step (planner/solver/bounds.py).

Schedule = Literal["gpipe", "1f1b"]


@dataclass(frozen=True, slots=True)
class Policy:
    """The tiers of one stage, uniform over its blocks (planner/solver/tiers.py refines them per block)."""

    params: Tier = "gpu"
    grads: Tier = "gpu"
    optimizer: Tier = "gpu"
    activations: ActivationTier = "keep"

    def memory(self, blocks: Iterable[str], cores: Collection[str] | None = None) -> Memory:
        """The plan's Memory of a stage of `blocks`; "selective" goes to the blocks with an attention core (`cores`,
        default all) and the others keep theirs (the runtime would recompute a core-less block whole)."""
        if self.activations == "selective":
            acts = {b: "selective" for b in blocks if cores is None or b in cores}
        else:
            acts = {b: self.activations for b in blocks} if self.activations != "keep" else {}
        return Memory(self.params, self.grads, self.optimizer, acts)


KEEP = Policy()
SELECTIVE = Policy(activations="selective")  # the attention core recomputed (Korthikanti et al. 2022, section 5)
RECOMPUTE = Policy(activations="recompute")
GPU_ONLY = (KEEP, SELECTIVE, RECOMPUTE)
# With memory tiers: ZeRO-Offload (optimizer state on the host), then the model states streamed from host
# memory or NVMe (ZeRO-Infinity), activations recomputed or offloaded.
OFFLOAD = (
    Policy(optimizer="cpu"),
    Policy(optimizer="cpu", activations="recompute"),
    Policy(optimizer="cpu", activations="offload-cpu"),
    Policy("cpu", "cpu", "cpu", "recompute"),
    Policy("cpu", "cpu", "nvme", "recompute"),
    Policy("nvme", "nvme", "nvme", "recompute"),
    Policy("nvme", "nvme", "nvme", "offload-nvme"),
)


@dataclass(frozen=True, slots=True)
class Feed:
    """Data flowing into a unit from another one: the first block it feeds and the bytes per sample of the
    smallest edge (the boundary bound uses the smallest, which every plan must move)."""

    producer: str
    block: int  # index of the first fed block in the consuming unit
    bytes_per_sample: float


@dataclass(frozen=True, slots=True)
class Unit:
    """A run of consecutive profile blocks laid out as one plan group."""

    name: str
    blocks: tuple[Block, ...]
    feeds: tuple[Feed, ...] = ()  # inputs from other units (the sink's encoders)
    out_bytes: float = 0.0  # bytes per sample of the smallest edge to another unit (sources)
    input_bytes: tuple[float, ...] = ()  # per block: bytes per sample of its inputs (its recompute checkpoint)
    cross_bytes: tuple[float, ...] = ()  # per cut j = 1..L-1 (index j): per-sample bytes of the largest route a cut before block j needs
    reads: tuple[tuple[int, ...], ...] = ()  # per block: the earlier blocks of the unit whose outputs it reads
    # parameters tied between the unit's blocks (plans/graph.Tie): (owner index, the other blocks' indices, elements); a
    # stage holding another but not the owner holds a copy (cost_models/ties.py; segments.py counts it)
    ties: tuple[tuple[int, tuple[int, ...], int], ...] = ()

    @property
    def supports_tp(self) -> bool:
        return any(b.supports_tp for b in self.blocks)


@dataclass(frozen=True, slots=True)
class Setting:
    """What the search holds fixed: cluster, step shape, precision, what memory tiers may be used."""

    cluster: Cluster
    global_batch: int
    schedule: Schedule = "1f1b"
    dtype: str = "bf16"
    optimizer: str = "adam"
    measured_micro_batch: int | None = None  # the profile's micro-batch when its times were measured here
    # The search's dimensions beyond tp, dp, pp, m and cut points, each a list of entries: per-stage tier
    # policies (keep / recompute / offload ...; a new activation tier such as selective recompute is one more
    # Policy once segments.py prices it) and per-layout ZeRO stages.
    policies: tuple[Policy, ...] = GPU_ONLY
    zeros: tuple[int, ...] = (0, 1, 2, 3)
    # sequence parallelism of tp > 1 layouts (Group.sequence_parallel); where it costs no more in every stage figure
    # (BlockTimes.sp_dominates) only the layouts with it are built; its backward re-gathers (compute.regather_time)
    # make it slower in one figure at tp > 1, so both are built there
    sequence_parallel: tuple[bool, ...] = (False, True)
    # interleaved 1F1B layouts of the chain unit with these model chunks per rank (solve --schedule interleaved), besides
    # the 1F1B ones: chunk cut points balance the chunks' op time (_interleaved)
    virtual_stages: tuple[int, ...] = ()

    @property
    def host_share(self) -> float:
        """Host memory per rank (a node's RAM split evenly over its GPUs; planner/solver/tiers.py pools it per node)."""
        return self.cluster.host_memory_bytes / self.cluster.gpus_per_node

    @property
    def nvme_share(self) -> float:
        return self.cluster.nvme_bytes / self.cluster.gpus_per_node


# --- the search space --------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n) steps (n may be a global batch of 10^12)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_degrees(unit: Unit, cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees worth trying: powers of two inside one node that divide every TP block's heads and
    widths (Block.takes_tp), only for units with TP blocks; 1 on gloo clusters."""
    if not unit.supports_tp or cluster.backend == "gloo":
        return [1]
    return [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and cluster.gpus_per_node % t == 0
            and all(b.takes_tp(t) for b in unit.blocks)]


def allowed_gpus(n: int, cluster: Cluster) -> bool:
    """Rank counts a group may get so that groups pack onto whole nodes (one node: any)."""
    g = cluster.gpus_per_node
    return cluster.nodes == 1 or (n <= g and g % n == 0) or n % g == 0


def micro_batch_counts(global_batch: int, fixed_micro_batch: int | None = None) -> list[int]:
    """Numbers of micro-batches m: every divisor of the global batch up to MAX_MICRO_BATCHES, or the one a fixed
    micro-batch gives."""
    from plans.limits import MAX_MICRO_BATCHES

    if fixed_micro_batch is not None:
        return [global_batch // fixed_micro_batch]
    return [m for m in divisors(global_batch) if m <= MAX_MICRO_BATCHES]
