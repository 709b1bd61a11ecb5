"""Builds complete plans from layouts: the one place baselines, the solver and tests turn decisions into a Plan."""
from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.evaluate import Evaluation, evaluate
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Group, Memory, Plan, ProfileRef, SolverInfo, Stage, Training, check_plan, flow_of


@dataclass(frozen=True)
class GroupLayout:
    """One module group's layout decision.

    blocks: the group's blocks in execution order; cuts: indices into `blocks` where stages 1..pp-1
    start; ranks: dp*tp*pp ranks ordered tp fastest, then dp, then pp (Megatron's convention).
    """

    name: str
    blocks: tuple[str, ...]
    cuts: tuple[int, ...]
    dp: int
    tp: int
    ranks: tuple[int, ...]
    zero: int = 0
    colocated_with: str | None = None
    memory: tuple[Memory, ...] = ()  # one per stage; empty = everything on the GPU
    sequence_parallel: bool = False  # tp > 1: norm / residual regions sharded along the sequence (Group's field)
    lookahead: int = 0  # Group.lookahead
    fill_bubbles: bool = False  # Group.fill_bubbles
    chunks: int = 1  # interleaved schedule: model chunks per stage; cuts then split pp * chunks chunks, stage k holding k, k + pp, ...
    reshard_after_forward: bool = True  # ZeRO-3: FSDP2's reshard_after_forward (Group's field)
    micro_batches: int | None = None  # Group.micro_batches: the group's own count (None: the plan's)

    @property
    def pp(self) -> int:
        return (len(self.cuts) + 1) // self.chunks

    def stage_blocks(self) -> list[tuple[str, ...]]:
        bounds = [0, *self.cuts, len(self.blocks)]
        parts = [self.blocks[a:b] for a, b in zip(bounds, bounds[1:])]
        return [tuple(x for c in parts[k::self.pp] for x in c) for k in range(self.pp)]


def to_group(layout: GroupLayout) -> Group:
    per_stage = layout.dp * layout.tp
    if len(layout.ranks) != per_stage * layout.pp:
        raise MmplanError(f"group {layout.name}: {len(layout.ranks)} ranks for dp={layout.dp} x tp={layout.tp} x pp={layout.pp}")
    memories = layout.memory or (Memory(),) * layout.pp
    stages = tuple(
        Stage(blocks=blocks, ranks=tuple(layout.ranks[i * per_stage:(i + 1) * per_stage]), memory=memories[i])
        for i, blocks in enumerate(layout.stage_blocks())
    )
    return Group(name=layout.name, dp=layout.dp, tp=layout.tp, pp=layout.pp, stages=stages, zero=layout.zero,
                 colocated_with=layout.colocated_with, sequence_parallel=layout.sequence_parallel and layout.tp > 1,
                 reshard_after_forward=layout.reshard_after_forward or layout.zero != 3,
                 lookahead=layout.lookahead, fill_bubbles=layout.fill_bubbles, micro_batches=layout.micro_batches)


def build_plan(profile: Profile, cluster: Cluster, training: Training, layouts: list[GroupLayout] | tuple[GroupLayout, ...],
               solver: SolverInfo | None = None, *, predict: bool = True, schema: bool = True) -> Plan:
    """A checked plan (carrying the profile's data flow) with the cost model's predictions attached (schema=False:
    without the JSON Schema check, for the solver's many candidates; save_plan checks the one written)."""
    groups = tuple(to_group(layout) for layout in layouts)
    plan = Plan(profile=ProfileRef(profile.model, profile.fingerprint), cluster=cluster, training=training,
                groups=groups, flow=flow_of(profile), solver=solver)
    plan = check_plan(plan, profile, schema=schema)
    return with_predictions(plan, profile)[0] if predict else plan


def with_predictions(plan: Plan, profile: Profile) -> tuple[Plan, Evaluation]:
    ev = evaluate(plan, profile)
    return replace(plan, predicted=ev.predicted), ev


def megatron_ranks(dp: int, tp: int, pp: int, first: int = 0) -> tuple[int, ...]:
    """Consecutive ranks; the tp fastest, then dp, then pp ordering is the order of the list itself."""
    return tuple(range(first, first + dp * tp * pp))
