"""The colocated split of the best unpipelined one-layout plan: a start for per-group micro-batch counts that the branch and bound cannot give.

The branch and bound (planner/solver/search.py) searches one micro-batch count for every group and prunes a
structure whose one-count plans are no faster than the best so far; planner/solver/micro_batches.py then refines
only the structures it kept. A one-layout plan without pipeline stages is also a colocated plan -- every group on
the same ranks with the same dp, tp, ZeRO stage and tiers (build_layouts' colocated shape: the sources colocated
with the sink) -- which steps exactly as fast, so under one count the colocated structure cannot beat it and is
pruned. With its own count a source can: a host-bound encoder (its ops dispatched per micro-batch whatever their
size) runs once per step beside an LLM whose activations hold it to many small micro-batches. `unpipelined_seeds`
are such plans, for solve's step 4b to refine alongside the structures' leaders."""
from __future__ import annotations

import math
from dataclasses import replace

from planner.solver.baseline_search import search as baseline_search
from planner.solver.baselines import grid_layouts
from planner.solver.construct import GroupLayout, build_plan
from planner.solver.structure import profile_units
from plans.cluster import Cluster
from plans.errors import ImpossiblePrediction, MmplanError
from plans.graph import Profile
from plans.plan import Plan


def unpipelined_seeds(profile: Profile, cluster: Cluster, global_batch: int, deadline: float = math.inf) -> list[Plan]:
    """For each micro-batch count, the colocated split (colocated_split) of the fastest fitting one-layout plan with
    pp = 1 and that count among the homogeneous baseline's grid (baselines.grid_layouts: every tp, dp and
    micro-batch, ZeRO 0/1, no or full recompute); fewest micro-batches first. Each count has its own: the fastest
    one-count plan may recompute to run fewer, larger micro-batches, where the refinement gains most from one that
    keeps its activations at more, smaller ones. Empty when the profile has no colocated units."""
    if profile_units(profile, "colocated") is None:
        return []
    by_count: dict[int, list] = {}
    for spec in grid_layouts(profile, cluster, global_batch):
        if spec.pp == 1:
            by_count.setdefault(global_batch // (spec.dp * spec.micro_batch), []).append(spec)
    seeds = []
    for count in sorted(by_count):
        try:
            plan = baseline_search(profile, cluster, global_batch, by_count[count], method="colocated-seed",
                                   deadline=deadline)
        except ImpossiblePrediction:
            raise
        except MmplanError:
            continue
        split = colocated_split(plan, profile) if plan.predicted is not None and plan.predicted.fits else None
        if split is not None:
            seeds.append(split)
    return seeds


def colocated_split(plan: Plan, profile: Profile) -> Plan | None:
    """`plan` (one group, one stage) as the colocated structure lays it out: one group per colocated unit
    (structure.profile_units), each with the plan's degrees, ZeRO stage, ranks and tiers (the activation tiers of
    its own blocks), the sources colocated with the sink; None when `plan` is not of that shape or the split is
    not a plan."""
    units = profile_units(profile, "colocated")
    if units is None or len(plan.groups) != 1 or plan.groups[0].pp != 1 or plan.training.virtual_stages != 1:
        return None
    group = plan.groups[0]
    stage = group.stages[0]
    sink = next((u.name for u in units if u.feeds), None)
    if sink is None:
        return None
    layouts = []
    for unit in units:
        names = tuple(b.name for b in unit.blocks)
        memory = replace(stage.memory, activations={b: t for b, t in stage.memory.activations.items() if b in names})
        layouts.append(GroupLayout(unit.name, names, (), group.dp, group.tp, stage.ranks, zero=group.zero,
                                   colocated_with=None if unit.name == sink else sink, memory=(memory,),
                                   sequence_parallel=group.sequence_parallel,
                                   reshard_after_forward=group.reshard_after_forward))
    try:
        return build_plan(profile, plan.cluster, plan.training, layouts, schema=False)
    except ImpossiblePrediction:
        raise
    except MmplanError:
        return None



def one_layout(plan: Plan, profile: Profile) -> Plan | None:
    """The inverse of colocated_split: a plan whose groups all share one layout -- one stage each on the same ranks,
    the same dp, tp, ZeRO stage, sequence parallelism and state tiers, one micro-batch count -- as one group of every
    block (its activation tiers the groups' own), which steps exactly as fast; None for any other plan. A
    heterogeneous structure's plan of this shape (the colocated search may reach one through tiers the chain's
    search did not need) is a one-layout plan, so the homogeneous baseline takes it when it is faster."""
    if len(plan.groups) < 2 or plan.training.virtual_stages != 1:
        return None
    first = plan.groups[0]
    shape = lambda g: (g.pp, g.dp, g.tp, g.zero, g.sequence_parallel, g.reshard_after_forward, g.stages[0].ranks,
                       g.stages[0].memory.params, g.stages[0].memory.grads, g.stages[0].memory.optimizer)
    if any(shape(g) != shape(first) or g.micro_batches is not None or g.lookahead for g in plan.groups) or first.pp != 1:
        return None
    order = {b.name: i for i, b in enumerate(profile.blocks)}
    names = tuple(sorted((b for g in plan.groups for b in g.blocks), key=order.__getitem__))
    activations = {b: t for g in plan.groups for b, t in g.stages[0].memory.activations.items()}
    memory = replace(first.stages[0].memory, activations=activations)
    layout = GroupLayout("model", names, (), first.dp, first.tp, first.stages[0].ranks, zero=first.zero,
                         memory=(memory,), sequence_parallel=first.sequence_parallel,
                         reshard_after_forward=first.reshard_after_forward)
    try:
        return build_plan(profile, plan.cluster, plan.training, [layout], schema=False)
    except ImpossiblePrediction:
        raise
    except MmplanError:
        return None
