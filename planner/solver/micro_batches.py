"""Per-group micro-batch counts: a refinement of the search's best plans, each group's own count (Group.micro_batches) tried and simulated."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from cost_models.evaluate import evaluate
from planner.solver.space import divisors
from plans.errors import ImpossiblePrediction, MmplanError
from plans.graph import Profile
from plans.limits import MAX_MICRO_BATCHES
from plans.plan import Plan, check_plan

# The branch and bound (planner/solver/search.py) searches one micro-batch count m for all groups: its bounds
# (bounds.boundary_bound) and candidate memory figures assume every group splits the step into the same m.
# This step runs after it, on the best plan of each heterogeneous structure, and changes nothing but counts:
# for every group whose blocks the loss does not read (the loss group keeps Training.micro_batches), counts k
#   - dividing the global batch B, with the group's dp dividing its micro-batch B / k (plans/plan.py),
#   - dividing or divided by the count of every group it exchanges data with (a route re-batches whole
#     micro-batches: plans/stage_graph.py),
#   - at most MAX_MICRO_BATCHES, nearest to the current count first (|log k / m|), MAX_TRIED per group,
# are each built, checked and simulated with memory exactly (cost_models.evaluate); the fastest that fits is kept,
# group by group, passes repeated while one improves (coordinate descent, at most MAX_PASSES). The plan's other
# decisions (layouts, ranks, tiers) stay, so the result is never slower than the plan it started from and always fits.
# What it is not: a search over counts with bounds. The branch and bound's "optimal" covers the one-count space;
# a plan this step changed lies outside it and is reported as not proved optimal (planner/solver/solve.py).

MAX_TRIED = 10  # counts tried per group and pass (the nearest to its current count)
MAX_PASSES = 2  # passes over the groups (a second one when a group's new count opens counts of its neighbours)


@dataclass(frozen=True, slots=True)
class Refinement:
    """What the refinement did to one plan: the step before and after, and the counts it gave (group -> count)."""

    before_s: float
    after_s: float
    counts: tuple[tuple[str, int], ...]  # groups given their own count, with it
    tried: int  # plans built and simulated
    changed: bool  # the counts differ from the plan's it started from

    def describe(self) -> str:
        own = ", ".join(f"{g} {k} micro-batch{'es' * (k > 1)}" for g, k in self.counts)
        return (f"per-group micro-batch counts ({own}) took the step from {self.before_s:.4g} s to {self.after_s:.4g} s "
                f"({1 - self.after_s / self.before_s:.1%} less; {self.tried} counts simulated)")


def refine_micro_batches(plan: Plan, profile: Profile, deadline: float = math.inf) -> tuple[Plan, Refinement]:
    """The plan with the fastest fitting per-group micro-batch counts found (see the comment above); `plan` itself
    (its Refinement not `changed`) when none is faster or the deadline (a time.perf_counter() value) passes. A plan
    that does not fit is beaten by any candidate that does (the solver only refines fitting plans)."""
    best, step = plan, plan.predicted.step_time_s if plan.predicted.fits else math.inf
    tried = 0
    loss = set(plan.flow.loss) if plan.flow is not None else set()
    free = [g.name for g in plan.groups if not loss & set(g.blocks)]
    for _ in range(MAX_PASSES):
        improved = False
        for name in free:
            for k in candidate_counts(best, name):
                if time.perf_counter() > deadline:
                    return _result(plan, best, tried)
                tried += 1
                cand = with_count(best, profile, name, k)
                if cand is not None and cand.predicted.fits and cand.predicted.step_time_s < step:
                    best, step, improved = cand, cand.predicted.step_time_s, True
        if not improved:
            break
    return _result(plan, best, tried)


def _result(start: Plan, best: Plan, tried: int) -> tuple[Plan, Refinement]:
    counts = tuple((g.name, g.micro_batches) for g in best.groups if g.micro_batches is not None)
    return best, Refinement(float(start.predicted.step_time_s), float(best.predicted.step_time_s), counts, tried,
                            best is not start)


def candidate_counts(plan: Plan, name: str) -> list[int]:
    """Counts worth trying for group `name` (the rules in the comment above), nearest to its current count first."""
    group = plan.group(name)
    batch = plan.training.global_batch
    current = plan.micro_batches_of(group)
    others = [plan.micro_batches_of(plan.group(n)) for n in _neighbours(plan, name)]
    out = [k for k in divisors(batch) if k != current and k <= MAX_MICRO_BATCHES and (batch // k) % group.dp == 0
           and all(max(k, o) % min(k, o) == 0 for o in others)]
    out.sort(key=lambda k: (abs(math.log(k / current)), k))
    return out[:MAX_TRIED]


def _neighbours(plan: Plan, name: str) -> set[str]:
    """The groups exchanging a block output with group `name` (the plan's data flow)."""
    owner = {b: g.name for g in plan.groups for b in g.blocks}
    out = set()
    for src, dst in plan.flow.edges if plan.flow is not None else ():
        a, b = owner.get(src), owner.get(dst)
        if a is not None and b is not None and a != b and name in (a, b):
            out.add(b if a == name else a)
    return out


def with_count(plan: Plan, profile: Profile, name: str, count: int) -> Plan | None:
    """The checked, simulated plan with group `name` given `count` micro-batches per step (None: the plan's, when it
    is the plan's count), or None when it is not a plan (a check or the schedule refuses it)."""
    own = None if count == plan.training.micro_batches else count
    groups = tuple(replace(g, micro_batches=own) if g.name == name else g for g in plan.groups)
    try:
        checked = check_plan(replace(plan, groups=groups, predicted=None), profile, schema=False)
        return replace(checked, predicted=evaluate(checked, profile).predicted)
    except ImpossiblePrediction:  # inconsistent inputs: an error for every plan, never a skipped candidate
        raise
    except MmplanError:
        return None
