"""`mmplan solve`: units -> candidate layouts (DP cut points) -> GPU allocation (ILP) -> simulation -> memory tiers -> plan."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Literal

from cost_models.compute import measured_on
from cost_models.memory import DTYPE_BYTES
from planner.allocate import Solver, pick_solver
from planner.candidates import GPU_ONLY, OFFLOAD, Setting, Structure, Unit, micro_batch_counts, profile_units
from planner.diagnosis import check_capacity, no_fit
from planner.search import Progress, Schedule, Search, best_baseline, branch_and_bound, refine_tiers
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan, SolverInfo

# The search, in order (each step its own module):
# 1. units (planner/candidates.profile_units): the profile's groups, a projector or head merged into its
#    neighbour; three structures -- "chain" (every block in one unit: one layout, cut anywhere),
#    "non-colocated" (one unit per modality, each on its own disjoint ranks) and "colocated" (every unit on
#    the same ranks, encoders replicated/sharded over them with pp = 1, the LLM pipelined);
# 2. candidate layouts per unit and number of micro-batches m (planner/candidates.unit_layouts), cut points
#    by the DP of planner/partition.py, each with exact per-stage costs (planner/segments.py) and a lower
#    bound of the step time (planner/bounds.py);
# 3. the allocation ILP (planner/allocate.py) proposes the combination of smallest bound; it is built and
#    simulated (cost_models.evaluate), excluded, and the ILP re-solved, until the smallest remaining bound
#    reaches the best simulated step (proved optimal over the search space) or a limit is hit (the branch and
#    bound of planner/search.py);
# 4. memory tiers: when nothing fits in GPU memory the search is repeated with CPU / NVMe tier policies
#    (uniform per stage); the best plan, when it offloads or recomputes anything, gets its tiers refined
#    per block by the ILP of planner/tiers.py (kept if the simulator says it is faster); when nothing fits
#    at all, planner/diagnosis.py says by how much;
# 5. the best homogeneous (Megatron-style) plan is computed in the same run and emitted instead when it is
#    faster (or when the search found none): the solver never returns a plan slower than it under the same
#    cost model.
# Search-space limits (documented simplifications): the number of micro-batches m is shared by all groups
# (plans/plan.py's Training); colocated encoders have pp = 1; non-colocated group sizes divide a node or
# are whole nodes; per-stage tier policies are uniform over a stage's blocks until tiers.py refines them.

Placement = Literal["auto", "colocated", "non-colocated"]
PLACEMENTS: tuple[str, ...] = ("auto", "colocated", "non-colocated")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")  # interleaved: 1f1b layouts and homogeneous interleaved ones


@dataclass(frozen=True, slots=True)
class Solution:
    """What `mmplan solve` found: the plan, the homogeneous baseline it was compared with, and how the search went."""

    plan: Plan
    baseline: Plan | None
    solve_time_s: float
    structure: str  # "chain" | "non-colocated" | "colocated" | "baseline"
    candidates: int  # layouts generated over all units and structures
    simulated: int  # plans built and simulated
    proved_optimal: bool  # the bound reached the best simulated step over the search space
    stopped_early: bool  # the time limit ended the search
    gap: float  # 1 - smallest remaining bound / best step (0 when proved optimal)

    @property
    def step_time_s(self) -> float:
        return self.plan.predicted.step_time_s

    @property
    def baseline_step_time_s(self) -> float | None:
        return self.baseline.predicted.step_time_s if self.baseline is not None and self.baseline.predicted.fits else None

    @property
    def speedup(self) -> float | None:
        b = self.baseline_step_time_s
        return b / self.step_time_s if b is not None and self.step_time_s > 0 else None


def solve(
    profile: Profile,
    cluster: Cluster,
    global_batch: int,
    *,
    placement: Placement = "auto",
    schedule: Schedule = "1f1b",
    micro_batch: int | None = None,
    time_limit: float | None = None,
    solver: Solver = "highs",
    memory_tiers: bool = True,
    baseline: bool = True,
    progress: Progress | None = None,
) -> Solution:
    """The fastest plan found for `profile` on `cluster` at `global_batch` samples per step (see the comment above).

    micro_batch: samples per micro-batch (over a group's data-parallel replicas; Training.micro_batch),
    default: searched. time_limit: seconds; the search returns the best plan so far and says it stopped early.
    """
    started = time.perf_counter()
    note = progress or (lambda step, fraction: None)
    _check_request(profile, cluster, global_batch, placement, schedule, micro_batch, time_limit)
    solver = pick_solver(solver)
    # --schedule interleaved: the heterogeneous search lays out 1f1b pipelines (its cut-point DP is per contiguous
    # stage); the homogeneous grid adds interleaved 1F1B layouts, and the faster plan is emitted
    searched = "1f1b" if schedule == "interleaved" else schedule
    search = Search(profile, cluster, global_batch, searched,
                     started + (time_limit if time_limit is not None else math.inf), note, solver=solver)
    structures = _structures(profile, cluster, placement)
    ms = micro_batch_counts(global_batch, micro_batch)
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    measured = profile.micro_batch if measured_on(profile, cluster) else None
    setting = Setting(cluster, global_batch, searched, dtype, "adam", measured, GPU_ONLY)
    proved, gap = branch_and_bound(search, structures, setting, ms, solver)
    if search.best is None and memory_tiers and not search.stopped_early:
        note("nothing fits in GPU memory: searching with CPU / NVMe tiers", 0.6)
        check_capacity(profile, cluster, dtype)
        proved, gap = branch_and_bound(search, structures, replace(setting, policies=GPU_ONLY + OFFLOAD), ms, solver)
    if search.best is not None and memory_tiers:
        note("choosing memory tiers", 0.85)
        refine_tiers(search)
    base = None
    if baseline:
        note("best homogeneous baseline", 0.9)
        base = best_baseline(profile, cluster, global_batch, schedule, micro_batch)
    base_fits = base is not None and base.predicted.fits
    if search.best is None and not base_fits:
        raise no_fit(profile, cluster, setting, structures, memory_tiers, search.stopped_early)
    step, plan, structure = search.best or (math.inf, None, "")
    elapsed = time.perf_counter() - started
    if base_fits and base.predicted.step_time_s < step:
        why = (f"the best homogeneous plan ({base.predicted.step_time_s:.4g} s) beat the best heterogeneous one found "
               f"({step:.4g} s)" if plan is not None else "the search found no plan that fits but the homogeneous grid did")
        info = replace(base.solver or SolverInfo("baseline:homogeneous"), time_s=elapsed, candidates=search.candidates,
                       stopped_early=search.stopped_early,
                       notes=f"{why}, so it is emitted; " + ((base.solver.notes if base.solver else "") or ""))
        plan, structure, proved = replace(base, solver=info), "baseline", False
    else:
        info = SolverInfo(
            method=f"ilp+dp:{structure}", objective=step, time_s=elapsed, candidates=search.candidates,
            stopped_early=search.stopped_early,
            notes=_notes(structure, search, proved, gap, base, step),
        )
        plan = replace(plan, solver=info)
    note("done", 1.0)
    proved = proved and not search.stopped_early
    return Solution(plan, base, elapsed, structure, search.candidates, search.simulated, proved, search.stopped_early,
                    0.0 if proved else gap)


def _notes(structure: str, search: Search, proved: bool, gap: float, base: Plan | None, step: float) -> str:
    parts = [f"structure {structure}; {search.candidates} candidate layouts, {search.simulated} plans simulated"]
    if search.stopped_early:
        parts.append("stopped at the time limit: the best plan found so far")
    elif proved:
        parts.append("optimal over the search space (its bound reached the best simulated step)")
    elif gap <= search.gap_goal:
        parts.append(f"within {search.gap_goal:.1%} of the optimum over the search space (dominated candidates pruned)")
    else:
        parts.append(f"simulation budget reached; bound gap {gap:.1%}")
    if base is not None and base.predicted.fits:
        parts.append(f"best homogeneous {base.predicted.step_time_s:.4g} s, speed-up {base.predicted.step_time_s / step:.3f}x")
    return "; ".join(parts)


# --- checks and errors ---------------------------------------------------------------------------------------


def _check_request(profile: Profile, cluster: Cluster, global_batch: int, placement: str, schedule: str,
                   micro_batch: int | None, time_limit: float | None) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise MmplanError(f"--global-batch must be a positive integer, got {global_batch!r}")
    from plans.limits import MAX_GLOBAL_BATCH, MAX_MICRO_BATCHES

    if global_batch > MAX_GLOBAL_BATCH:
        raise MmplanError(f"--global-batch {global_batch} is more than {MAX_GLOBAL_BATCH:,} samples, the largest step mmplan plans")
    if micro_batch is not None and micro_batch >= 1 and global_batch // micro_batch > MAX_MICRO_BATCHES:
        raise MmplanError(f"--micro-batch {micro_batch} makes {global_batch // micro_batch:,} micro-batches per step, more than "
                          f"the {MAX_MICRO_BATCHES:,} mmplan plans; choose a larger micro-batch")
    if placement not in PLACEMENTS:
        raise MmplanError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if schedule not in SCHEDULES:
        raise MmplanError(f"--schedule must be one of {', '.join(SCHEDULES)} (the runtime executes these), got {schedule!r}")
    if micro_batch is not None and (micro_batch < 1 or global_batch % micro_batch):
        raise MmplanError(f"--micro-batch {micro_batch} does not divide the global batch {global_batch}; "
                          "choose a divisor of it (samples per micro-batch over a group's replicas)")
    if time_limit is not None and not time_limit > 0:
        raise MmplanError(f"--time-limit must be > 0 seconds, got {time_limit}")
    groups = len(profile_units(profile, "non-colocated") or ())
    if placement == "non-colocated" and groups and cluster.world_size < groups:
        raise MmplanError(f"--placement non-colocated gives each of the {groups} groups of {profile.model!r} its own GPUs, "
                          f"so it needs at least {groups} GPUs; the cluster has {cluster.world_size} ({groups - cluster.world_size} short)")


def _structures(profile: Profile, cluster: Cluster, placement: Placement) -> list[tuple[Structure, tuple[Unit, ...]]]:
    wanted: list[Structure] = {"auto": ["chain", "non-colocated", "colocated"], "colocated": ["colocated"],
                               "non-colocated": ["non-colocated"]}[placement]
    out = []
    for s in wanted:
        units = profile_units(profile, s)
        if units is not None and (s != "non-colocated" or cluster.world_size >= len(units)):
            out.append((s, units))
    if not out:  # one group only, or groups that do not form encoders feeding one sink
        out.append(("chain", profile_units(profile, "chain")))
    return out


# --- the command's core: `mmplan solve` ----------------------------------------------------------------------------

Baseline = Literal["homogeneous", "zero3", "gpipe-even"]


def run_solve(
    *,
    profile_path: str | os.PathLike,
    cluster: str,
    global_batch: int,
    output: str | os.PathLike,
    gpus_per_node: int | None = None,
    placement: Placement = "auto",
    schedule: Schedule = "1f1b",
    micro_batch: int | None = None,
    time_limit: float | None = None,
    solver: Solver = "highs",
    memory_tiers: bool = True,
    baseline: Baseline | None = None,
    layout: str | None = None,
    progress: Progress | None = None,
) -> tuple[Solution, Profile]:
    """Load the profile and cluster, solve (or build the requested baseline: --baseline [--layout]), write the plan."""
    from cost_models.hardware import parse_cluster
    from plans.graph import load_profile
    from plans.plan import save_plan

    if layout is not None and baseline is None:
        raise MmplanError("--layout describes a homogeneous layout: use it with --baseline homogeneous")
    profile = load_profile(profile_path)
    spec = parse_cluster(cluster, gpus_per_node)
    if baseline is not None:
        from planner import baselines

        started = time.perf_counter()
        plan = baselines.baseline_plan(baseline, profile, spec, global_batch, layout=layout)
        elapsed = time.perf_counter() - started
        plan = replace(plan, solver=replace(plan.solver or SolverInfo(f"baseline:{baseline}"), time_s=elapsed))
        solution = Solution(plan, plan if baseline == "homogeneous" else None, elapsed, "baseline", plan.solver.candidates,
                            0, False, False, 0.0)
    else:
        solution = solve(profile, spec, global_batch, placement=placement, schedule=schedule, micro_batch=micro_batch,
                         time_limit=time_limit, solver=solver, memory_tiers=memory_tiers, progress=progress)
    save_plan(solution.plan, output)
    return solution, profile


