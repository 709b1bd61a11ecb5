"""The plan's dataclasses: what plan.json holds (loading and checking it is plans/plan.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from plans.cluster import Cluster
from plans.serial import OMIT_DEFAULT

PLAN_SCHEMA = "mmplan.plan/3"
READABLE_SCHEMAS = ("mmplan.plan/2", PLAN_SCHEMA)  # a /2 plan is a /3 plan whose groups all take Training.micro_batches

Schedule = Literal["gpipe", "1f1b", "interleaved"]
Tier = Literal["gpu", "cpu", "nvme"]  # where params / grads / optimizer state live
ActivationTier = Literal["keep", "offload-cpu", "offload-nvme", "recompute", "selective"]  # a block's saved activations;
# "selective" recomputes the attention core only (QK^T, softmax, dropout, AV; Korthikanti et al. 2022, section 5)
DType = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True, slots=True)
class ProfileRef:
    """The profile a plan was solved for; the fingerprint must match the model the runtime builds."""

    model: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class Training:
    """Step shape: the global batch shared by all groups, and the micro-batch count of every group that does not
    give its own (Group.micro_batches)."""

    global_batch: int  # samples per optimizer step
    micro_batches: int  # micro-batches per step (m) of a group without its own; its dp replicas split each micro-batch
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1  # model chunks per rank for the interleaved schedule
    dtype: DType = "bf16"  # compute dtype (mixed precision keeps fp32 master weights)
    optimizer: Literal["adam", "sgd"] = "adam"

    @property
    def micro_batch(self) -> int:
        """Samples in one micro-batch across all data-parallel replicas of a group."""
        return self.global_batch // self.micro_batches


@dataclass(frozen=True, slots=True)
class Memory:
    """Tier placement of one stage's state; blocks not named in `activations` keep theirs on the GPU."""

    params: Tier = "gpu"
    grads: Tier = "gpu"
    optimizer: Tier = "gpu"
    activations: dict[str, ActivationTier] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Stage:
    """A pipeline stage of a group: consecutive blocks, and the dp*tp ranks that run them (tp fastest)."""

    blocks: tuple[str, ...]
    ranks: tuple[int, ...]
    memory: Memory = field(default_factory=Memory)


@dataclass(frozen=True, slots=True)
class Group:
    """A module group's layout: its ranks = pp stages x dp replicas x tp shards (tp fastest, then dp, then pp)."""

    name: str
    dp: int
    tp: int
    pp: int
    stages: tuple[Stage, ...]
    zero: int = 0  # ZeRO stage 0-3 over the group's dp replicas
    colocated_with: str | None = None  # another group whose ranks this one time-shares; None = own ranks
    sequence_parallel: bool = False  # tp > 1: norm/residual regions sharded along the sequence (Korthikanti et al. 2022)
    # ZeRO-3: FSDP2's reshard_after_forward -- False keeps each block's gathered parameters from its forward to its
    # backward (one all-gather per micro-batch instead of two; the unsharded parameters held meanwhile)
    reshard_after_forward: bool = field(default=True, metadata={OMIT_DEFAULT: True})
    # 1F1B: micro-batches each stage may run ahead of its in-flight limit (d + 1, d = routes to the loss): an encoder
    # on its own ranks runs k forwards ahead of the LLM it feeds, holding k more micro-batches of activations
    lookahead: int = field(default=0, metadata={OMIT_DEFAULT: True})
    # colocated groups: each rank class runs its own replicas' share of a stage's tasks on its own, in its idle
    # slots (the LLM pipeline's bubbles), instead of all of the stage's ranks at once (ZeRO 0; tp inside a class)
    fill_bubbles: bool = field(default=False, metadata={OMIT_DEFAULT: True})
    # the group's own micro-batch count within the shared global batch (None: Training.micro_batches); the counts of
    # two groups a route connects divide one another (plans/stage_graph.py re-batches between them)
    micro_batches: int | None = field(default=None, metadata={OMIT_DEFAULT: True})

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for s in self.stages for r in s.ranks)

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(b for s in self.stages for b in s.blocks)


@dataclass(frozen=True, slots=True)
class FlowBlock:
    """A block of the model's data flow, in execution order, and the bytes per sample of its whole output
    (what the runtime sends when another stage reads it)."""

    name: str
    output_bytes: float
    frozen: bool = field(default=False, metadata={OMIT_DEFAULT: True})  # not trained (plans.graph.Block.frozen)


@dataclass(frozen=True, slots=True)
class Flow:
    """The model's data flow as the plan needs it, copied from its profile: blocks in execution order,
    which block's output each block reads (through any glue code), and which blocks the loss reads.
    The stage graph (plans/stage_graph.py) is computed from this and the groups, and nothing else."""

    blocks: tuple[FlowBlock, ...]
    edges: tuple[tuple[str, str], ...]  # (producer, consumer)
    loss: tuple[str, ...]  # blocks whose outputs the loss reads


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Predicted peak bytes of one rank in each tier."""

    rank: int
    gpu: float
    cpu: float = 0.0
    nvme: float = 0.0


@dataclass(frozen=True, slots=True)
class Predicted:
    """What the cost model expects of the plan."""

    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    comm_bytes: float  # bytes sent by all ranks in one step
    fits: bool
    memory: tuple[RankMemory, ...] = ()
    bottleneck: str = ""  # the stage that bounds the step, "group/stage i"


@dataclass(frozen=True, slots=True)
class SolverInfo:
    method: str  # e.g. "ilp+dp", "baseline:homogeneous", "hand-written"
    objective: float | None = None
    time_s: float = 0.0
    candidates: int = 0
    stopped_early: bool = False
    notes: str = ""
    optimal: bool = False  # proven optimal under the cost model over the solver's search space
    memory_reserve: float = 0.0  # fraction of each GPU's memory the plan leaves free (solve --memory-reserve)
    baselines: dict[str, float] = field(default_factory=dict)  # step seconds of the baselines it was compared with


@dataclass(frozen=True, slots=True)
class Plan:
    profile: ProfileRef
    cluster: Cluster
    training: Training
    groups: tuple[Group, ...]
    flow: Flow | None = None  # None only in a hand-written plan; filled from the profile when checked with one
    predicted: Predicted | None = None
    solver: SolverInfo | None = None
    schema: str = PLAN_SCHEMA

    def micro_batches_of(self, group: Group) -> int:
        """The group's micro-batches per step: its own count, else the plan's."""
        return self.training.micro_batches if group.micro_batches is None else group.micro_batches

    def micro_batch_of(self, group: Group) -> int:
        """Samples in one of the group's micro-batches, all its data-parallel replicas together."""
        return self.training.global_batch // self.micro_batches_of(group)

    @property
    def world_size(self) -> int:
        return len({r for g in self.groups for r in g.ranks})

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)
