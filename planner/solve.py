"""`mmplan solve`: units -> candidate layouts (DP cut points) -> GPU allocation (ILP) -> simulation -> memory tiers -> plan."""
from __future__ import annotations

import functools
import heapq
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from cost_models.compute import measured_on
from cost_models.memory import DTYPE_BYTES, optimizer_bytes_per_param
from planner.allocate import Allocator, Choice, Solver, assign_ranks, pick_solver
from planner.candidates import (
    RUNTIME_ZERO_STAGES,
    GPU_ONLY,
    OFFLOAD,
    BlockTimes,
    Layout,
    Policy,
    Segments,
    Setting,
    Structure,
    Unit,
    divisors,
    in_flight,
    micro_batch_counts,
    profile_units,
    tp_degrees,
    unit_layouts,
    unit_runs,
    zero_stages,
)
from planner.console import short_by
from planner.construct import GroupLayout, build_plan
from planner.partition import cut_table
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan, SolverInfo, Training

# The search, in order (each step its own module):
# 1. units (planner/candidates.profile_units): the profile's groups, a projector or head merged into its
#    neighbour; three structures -- "chain" (every block in one unit: one layout, cut anywhere), "apart"
#    (one unit per modality on disjoint ranks, non-colocated) and "together" (colocated: every unit on the
#    same ranks, encoders replicated/sharded over them with pp = 1, the LLM pipelined);
# 2. candidate layouts per unit and number of micro-batches m (planner/candidates.unit_layouts), cut points
#    by the DP of planner/partition.py, each with exact per-stage costs and a lower bound of the step time;
# 3. the allocation ILP (planner/allocate.py) proposes the combination of smallest bound; it is built and
#    simulated (cost_models.evaluate), excluded, and the ILP re-solved, until the smallest remaining bound
#    reaches the best simulated step (proved optimal over the search space) or a limit is hit;
# 4. memory tiers: when nothing fits in GPU memory the search is repeated with CPU / NVMe tier policies
#    (uniform per stage); the best plan, when it offloads or recomputes anything, gets its placement refined
#    per block by the ILP of planner/tiers.py (kept if the simulator says it is faster);
# 5. the best homogeneous (Megatron-style) plan is computed in the same run and emitted instead when it is
#    faster (or when the search found none): the solver never returns a plan slower than it under the same
#    cost model.
# Search-space limits (documented simplifications): the number of micro-batches m is shared by all groups
# (plans/plan.py's Training); colocated encoders have pp = 1; non-colocated group sizes divide a node or
# are whole nodes; per-stage tier policies are uniform over a stage's blocks until tiers.py refines them.

Placement = Literal["auto", "colocated", "non-colocated"]
Schedule = Literal["gpipe", "1f1b"]
Progress = Callable[[str, float], None]
PLACEMENTS: tuple[str, ...] = ("auto", "colocated", "non-colocated")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
EXHAUSTIVE = 4000  # candidates per structure below which none is pruned by dominance (the search is exact)
MAX_SIMULATED = 400  # plans simulated at most in one search
TOLERANCE = 1e-9  # relative: a bound this close to the best step cannot beat it (exact searches)
LARGE_GAP = 2e-3  # large searches stop once no bound is 0.2 % below the best step


@dataclass(frozen=True, slots=True)
class Solution:
    """What `mmplan solve` found: the plan, the homogeneous baseline it was compared with, and how the search went."""

    plan: Plan
    baseline: Plan | None
    solve_time_s: float
    structure: str  # "chain" | "apart" | "together" | "baseline"
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


@dataclass
class _Search:
    """Mutable bookkeeping of one solve (kept in one place, never in module globals)."""

    profile: Profile
    cluster: Cluster
    global_batch: int
    schedule: Schedule
    deadline: float
    progress: Progress
    best: tuple[float, Plan, str] | None = None  # (step, plan, structure)
    simulated: int = 0
    candidates: int = 0
    stopped_early: bool = False
    gap_goal: float = TOLERANCE
    solver: Solver = "highs"
    seen: set = field(default_factory=set)  # combinations already simulated

    def out_of_time(self) -> bool:
        if time.perf_counter() > self.deadline:
            self.stopped_early = True
        return self.stopped_early

    def simulate(self, structure: Structure, units: Sequence[Unit], layouts: Sequence[Layout]) -> bool:
        """Build and simulate one combination (once); keep it when it fits and is the fastest so far."""
        key = (structure, tuple(lay.key for lay in layouts))
        if key in self.seen:
            return False
        self.seen.add(key)
        self.simulated += 1
        self.offer(build_layouts(self.profile, self.cluster, self.global_batch, self.schedule, structure, units, layouts), structure)
        return True

    def offer(self, plan: Plan | None, structure: str) -> None:
        if plan is None or plan.predicted is None or not plan.predicted.fits:
            return
        step = plan.predicted.step_time_s
        if self.best is None or step < self.best[0]:
            self.best = (step, plan, structure)


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
    search = _Search(profile, cluster, global_batch, schedule,
                     started + (time_limit if time_limit is not None else math.inf), note, solver=solver)
    structures = _structures(profile, cluster, placement)
    ms = micro_batch_counts(global_batch, micro_batch)
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    measured = profile.micro_batch if measured_on(profile, cluster) else None
    setting = Setting(cluster, global_batch, schedule, dtype, "adam", measured, GPU_ONLY)
    proved, gap = _branch_and_bound(search, structures, setting, ms, solver)
    if search.best is None and memory_tiers and not search.stopped_early:
        note("nothing fits in GPU memory: searching with CPU / NVMe tiers", 0.6)
        _check_capacity(profile, cluster, dtype)
        proved, gap = _branch_and_bound(search, structures, replace(setting, policies=GPU_ONLY + OFFLOAD), ms, solver)
    if search.best is not None and memory_tiers:
        note("placing memory tiers", 0.85)
        _refine_tiers(search)
    base = None
    if baseline:
        note("best homogeneous baseline", 0.9)
        base = _baseline(profile, cluster, global_batch, schedule, micro_batch)
    base_fits = base is not None and base.predicted.fits
    if search.best is None and not base_fits:
        raise _no_fit(profile, cluster, setting, structures, memory_tiers, search.stopped_early)
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


def _notes(structure: str, search: _Search, proved: bool, gap: float, base: Plan | None, step: float) -> str:
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
    groups = len(profile_units(profile, "apart") or ())
    if placement == "non-colocated" and groups and cluster.world_size < groups:
        raise MmplanError(f"--placement non-colocated gives each of the {groups} groups of {profile.model!r} its own GPUs, "
                          f"so it needs at least {groups} GPUs; the cluster has {cluster.world_size} ({groups - cluster.world_size} short)")


def _structures(profile: Profile, cluster: Cluster, placement: Placement) -> list[tuple[Structure, tuple[Unit, ...]]]:
    wanted: list[Structure] = {"auto": ["chain", "apart", "together"], "colocated": ["together"],
                               "non-colocated": ["apart"]}[placement]
    out = []
    for s in wanted:
        units = profile_units(profile, s)
        if units is not None and (s != "apart" or cluster.world_size >= len(units)):
            out.append((s, units))
    if not out:  # one group only, or groups that do not form encoders feeding one sink
        out.append(("chain", profile_units(profile, "chain")))
    return out


def state_bytes(profile: Profile, dtype: str) -> float:
    """Bytes of the model's training state: parameters, gradients and optimizer state (mixed-precision Adam)."""
    params = sum(b.params for b in profile.blocks)
    return params * (2 * DTYPE_BYTES[dtype] + optimizer_bytes_per_param(dtype, "adam"))


def _check_capacity(profile: Profile, cluster: Cluster, dtype: str) -> None:
    """The training state must fit in all tiers together: every GPU, every node's host memory and NVMe."""
    need = state_bytes(profile, dtype)
    have = cluster.world_size * cluster.device.memory_bytes + cluster.nodes * (cluster.host_memory_bytes + cluster.nvme_bytes)
    if need > have:
        raise MmplanError(
            f"{profile.model} cannot fit on {cluster.world_size} x {cluster.device.name} even with every memory tier: its training "
            f"state needs {need / 1e9:,.1f} GB but GPU memory, host memory and NVMe hold {have / 1e9:,.1f} GB "
            f"{short_by(need, have)}; add nodes or NVMe")


def _no_fit(profile: Profile, cluster: Cluster, setting: Setting, structures, memory_tiers: bool, stopped: bool) -> MmplanError:
    if stopped:
        return MmplanError("the time limit ended the search before any plan that fits was found; raise --time-limit")
    need = _least_gpu_bytes(profile, cluster, setting, memory_tiers)
    cap = cluster.device.memory_bytes
    how = "with every memory tier" if memory_tiers else "in GPU memory (try --memory-tiers)"
    if need is None or need <= cap:
        single = f"one layout for the whole model would need {need / 1e9:,.2f} GB of the {cap / 1e9:,.2f} GB per GPU" \
            if need is not None else f"no layout fits the {cap / 1e9:,.2f} GB per GPU"
        return MmplanError(f"no plan of {profile.model} fits {cluster.world_size} x {cluster.device.name} {how} at global batch "
                           f"{setting.global_batch} with the placements searched ({single}); add GPUs or change the global batch")
    return MmplanError(
        f"{profile.model} does not fit on {cluster.world_size} x {cluster.device.name} {how}: its least-loaded layout needs "
        f"{need / 1e9:,.2f} GB on its fullest GPU, which has {cap / 1e9:,.2f} GB {short_by(need, cap)}; add GPUs")


def _least_gpu_bytes(profile: Profile, cluster: Cluster, setting: Setting, memory_tiers: bool) -> float | None:
    """The least GPU memory any layout of the whole model needs on its fullest rank: the partition DP with stage
    memory as its cost (min-max bytes), over tp and dp degrees, the most sharding ZeRO stage and every policy,
    at the most micro-batches (the fewest samples in each)."""
    unit = profile_units(profile, "chain")[0]
    policies = GPU_ONLY + (OFFLOAD if memory_tiers else ())
    st = replace(setting, policies=policies)
    m = setting.global_batch
    best = None
    for tp in tp_degrees(unit, cluster):
        for dp in divisors(setting.global_batch // m):
            if tp * dp > cluster.world_size:
                continue
            seg = Segments(unit, st, tp, dp, zero_stages(cluster, dp)[-1], m)
            depth = min(len(unit.blocks), cluster.world_size // (tp * dp))
            table = cut_table(seg.n, functools.partial(_stage_bytes, seg, policies), depth)
            for pp in range(1, depth + 1):
                part = table.best(pp)
                if part is not None and (best is None or part.slowest < best):
                    best = part.slowest
    return best


def _stage_bytes(seg: Segments, policies: Sequence[Policy], q: int) -> np.ndarray:
    """GPU bytes of every segment as a stage with q stages after it, under its least-GPU policy."""
    flight = in_flight(seg.setting.schedule, seg.micro_batches, q)
    out = np.full_like(seg.params, np.inf)
    for pol in policies:
        g0, g1, *_ = seg.memory(pol)
        out = np.minimum(out, np.where(seg.valid, g0 + flight * g1, np.inf))
    return out


# --- branch and bound over the structures ----------------------------------------------------------------------


def _branch_and_bound(search: _Search, structures, setting: Setting, ms: Sequence[int], solver: Solver) -> tuple[bool, float]:
    """Generate candidates and run the ILP-proposes / simulator-disposes loop; returns (proved optimal, gap)."""
    cl = search.cluster
    note = search.progress
    times = BlockTimes(setting)
    allocators: list[tuple[Structure, tuple[Unit, ...], Allocator]] = []
    exhaustive = True
    for si, (structure, units) in enumerate(structures):
        if search.out_of_time():
            break
        note(f"candidate layouts: {structure}", 0.05 + 0.45 * si / len(structures))
        cands = _candidates(search, structure, units, setting, _m_order(units, setting, ms, times, cl), times)
        if any(not c for c in cands):
            continue
        search.candidates += sum(len(c) for c in cands)
        if sum(len(c) for c in cands) > EXHAUSTIVE:
            cands = [_pareto(c, structure) for c in cands]
            exhaustive = False
        allocators.append((structure, units, Allocator(units, cands, structure, cl, solver)))
    search.gap_goal = TOLERANCE if exhaustive else LARGE_GAP
    return _run(search, allocators, budget=MAX_SIMULATED)


def _m_order(units: Sequence[Unit], setting: Setting, ms: Sequence[int], times: BlockTimes, cluster: Cluster) -> list[int]:
    """Micro-batch counts, most promising first (by the 1F1B estimate (m + p - 1) work / p of the largest unit),
    so that a good plan is simulated early and its step prunes the rest."""
    unit = max(units, key=lambda u: len(u.blocks))

    def estimate(m: int) -> float:
        runs = unit_runs(unit, setting, m, max_gpus=cluster.world_size)
        return min(((m + d - 1) * times.work(unit, tp, setting.global_batch / m / dp) / d for tp, dp, d in runs), default=math.inf)

    return sorted(ms, key=estimate)


def _run(search: _Search, allocators, budget: int) -> tuple[bool, float]:
    """Pop combinations in order of their sub-problem's floor; simulate those whose own bound can still beat
    the best step; stop when the smallest floor cannot (proved), or at the time / simulation limit."""
    heap: list[tuple[float, int, int, Choice]] = []
    tick = 0
    for i, (_, _, alloc) in enumerate(allocators):
        c = alloc.next(_remaining(search))
        if c is not None:
            heapq.heappush(heap, (c.floor, tick, i, c))
            tick += 1
    simulated = 0
    exact = True
    while heap:
        floor, _, i, choice = heap[0]
        goal = search.best[0] * (1 - search.gap_goal) if search.best is not None else math.inf
        if floor >= goal:
            return exact and search.gap_goal <= TOLERANCE, max(0.0, 1 - floor / search.best[0])
        if search.out_of_time() or simulated >= budget:
            return False, (1 - floor / search.best[0]) if search.best else 1.0
        heapq.heappop(heap)
        structure, units, alloc = allocators[i]
        exact &= choice.optimal
        if choice.bound < goal:
            search.progress(f"simulating {structure} plans ({search.simulated} so far)", min(0.8, 0.5 + 0.3 * simulated / budget))
            if search.simulate(structure, units, choice.layouts):
                simulated += 1
        alloc.exclude(choice)
        c = alloc.next(_remaining(search))
        if c is not None:
            heapq.heappush(heap, (c.floor, tick, i, c))
            tick += 1
    return exact and search.gap_goal <= TOLERANCE, 0.0


def _remaining(search: _Search) -> float:
    return max(1.0, min(120.0, search.deadline - time.perf_counter()))


def _candidates(search: _Search, structure: Structure, units: tuple[Unit, ...], setting: Setting, ms: Sequence[int],
                times: BlockTimes) -> list[list[Layout]]:
    """Candidate layouts of each unit over every m (most promising first); (tp, dp) runs and layouts whose bound
    cannot beat the best simulated step are skipped. Until a plan has been simulated, the best chain layouts
    of the first m are simulated to get one."""
    n = search.cluster.world_size
    out: list[list[Layout]] = [[] for _ in units]
    for m in ms:
        if search.out_of_time():
            break
        limit = search.best[0] if search.best else math.inf
        if structure == "chain":
            lays = unit_layouts(units[0], setting, m, max_gpus=n, limit=limit, times=times)
            out[0] += [lay for lay in lays if lay.bound.own < limit]
            if search.best is None:
                for lay in sorted(out[0], key=lambda lay: lay.bound.own)[:3]:
                    search.simulate(structure, units, (lay,))
            continue
        sink = next(i for i, u in enumerate(units) if u.feeds)
        reserve = len(units) - 1 if structure == "apart" else 0
        sink_layouts = [lay for lay in unit_layouts(units[sink], setting, m, max_gpus=n - reserve, limit=limit, times=times)
                        if lay.bound.own < limit]
        if not sink_layouts:
            continue
        depths = sorted({lay.pp for lay in sink_layouts})
        per_unit = []
        for u, unit in enumerate(units):
            if u == sink:
                per_unit.append(sink_layouts)
            elif structure == "apart":
                per_unit.append(unit_layouts(unit, setting, m, max_gpus=n - min(lay.gpus for lay in sink_layouts),
                                             downstream=depths, limit=limit, times=times))
            else:
                sizes = {lay.gpus for lay in sink_layouts}
                per_unit.append([lay for lay in unit_layouts(unit, setting, m, max_gpus=n, downstream=depths, merge_depths=False,
                                                             max_pp=1, limit=limit, times=times) if lay.gpus in sizes])
        for u, lays in enumerate(per_unit):
            out[u] += [lay for lay in lays if lay.bound.own < limit]
        if search.best is None and all(out):
            _seed(search, structure, units, out)
    return out


def _seed(search: _Search, structure: Structure, units: tuple[Unit, ...], candidates: list[list[Layout]]) -> None:
    """Simulate the few best-bounded combinations found so far, so that the rest of the generation is pruned."""
    alloc = Allocator(units, candidates, structure, search.cluster, search.solver)
    for _ in range(3):
        choice = alloc.next(_remaining(search))
        if choice is None or search.out_of_time():
            return
        search.simulate(structure, units, choice.layouts)
        alloc.exclude(choice)


def _pareto(layouts: list[Layout], structure: Structure) -> list[Layout]:
    """Drop layouts dominated in every bound term, GPU count and memory by another of the same m, depth, dp and tp
    (a heuristic on large searches: bounds, not simulated steps, are compared)."""
    groups: dict[tuple, list[Layout]] = {}
    for lay in layouts:
        groups.setdefault((lay.micro_batches, lay.downstream, lay.pp if structure != "chain" else 0, lay.dp, lay.tp), []).append(lay)
    out = []
    for lays in groups.values():
        vecs = [(lay, _vector(lay, structure)) for lay in lays]
        vecs.sort(key=lambda lv: lv[1])
        front: list[tuple[Layout, tuple]] = []
        for lay, v in vecs:
            if not any(all(a <= b for a, b in zip(fv, v)) for _, fv in front):
                front.append((lay, v))
        out += [lay for lay, _ in front]
    return out


def _vector(lay: Layout, structure: Structure) -> tuple:
    b = lay.bound
    head = (lay.gpus, b.own) if structure != "together" else (lay.gpus, b.own, b.busy, max(lay.gpu_bytes))
    extra = (b.fwd_out, b.bwd_in, *b.k2, *b.k3, *(k for row in b.k4 for k in row))
    return head + extra


# --- building plans ----------------------------------------------------------------------------------------------


def build_layouts(profile: Profile, cluster: Cluster, global_batch: int, schedule: Schedule, structure: Structure,
                  units: Sequence[Unit], layouts: Sequence[Layout]) -> Plan | None:
    """The checked plan (with predictions) of one layout per unit, or None when its ranks do not pack."""
    ranks = assign_ranks(layouts, structure, cluster)
    if ranks is None:
        return None
    sink = next((i for i, u in enumerate(units) if u.feeds), None)
    groups = []
    for i, (unit, lay, r) in enumerate(zip(units, layouts, ranks)):
        names = tuple(b.name for b in unit.blocks)
        host = units[sink].name if structure == "together" and sink is not None and i != sink else None
        groups.append(GroupLayout(unit.name, names, lay.cuts, lay.dp, lay.tp, r, zero=lay.zero, colocated_with=host,
                                  memory=lay.memories(names)))
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    training = Training(global_batch, layouts[0].micro_batches, schedule, dtype=dtype)
    try:
        return build_plan(profile, cluster, training, groups)
    except MmplanError:
        return None  # e.g. a deadlocking order: not a candidate


def _refine_tiers(search: _Search) -> None:
    """Per-block tier placement of the best plan (planner/tiers.py); kept when the simulator says it is faster."""
    from planner.tiers import place_tiers

    _, plan, structure = search.best
    stages = [s for g in plan.groups for s in g.stages]
    if all(s.memory == type(s.memory)() for s in stages):
        return  # everything on the GPU, nothing recomputed: no placement is faster
    try:
        refined = place_tiers(plan, search.profile)
    except MmplanError:
        return
    if refined is not None:
        search.offer(refined, structure)


def _baseline(profile: Profile, cluster: Cluster, global_batch: int, schedule: Schedule, micro_batch: int | None) -> Plan | None:
    """The best homogeneous plan of planner/baselines.py for the same request (None when there is none)."""
    from planner import baselines

    try:
        zeros = RUNTIME_ZERO_STAGES  # the same runnable space as the solver's (candidates.zero_stages)
        specs = baselines.grid_layouts(profile, cluster, global_batch, schedules=(schedule,), zeros=zeros)
        if micro_batch is not None:
            specs = [s for s in specs if s.dp * s.micro_batch == micro_batch]
        if not specs:
            return None
        return baselines.search(profile, cluster, global_batch, specs, method="baseline:homogeneous")
    except MmplanError:
        return None


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


def solution_json(solution: Solution, output: str | os.PathLike) -> dict:
    """The --json object: the written path, step times, speed-up, solve time, fit, and how the search went."""
    plan, p = solution.plan, solution.plan.predicted
    return {
        "plan": str(output),
        "step_time_s": p.step_time_s,
        "baseline_step_time_s": solution.baseline_step_time_s,
        "speedup_vs_homogeneous": solution.speedup,
        "solve_time_s": solution.solve_time_s,
        "fits": p.fits,
        "method": plan.solver.method if plan.solver else None,
        "structure": solution.structure,
        "stopped_early": solution.stopped_early,
        "proved_optimal": solution.proved_optimal,
        "candidates": solution.candidates,
        "simulated": solution.simulated,
        "micro_batches": plan.training.micro_batches,
        "schedule": plan.training.schedule,
        "groups": [{"name": g.name, "gpus": len(g.ranks), "dp": g.dp, "tp": g.tp, "pp": g.pp, "zero": g.zero,
                    "colocated_with": g.colocated_with, "cuts": [s.blocks[0] for s in g.stages[1:]]} for g in plan.groups],
        "peak_gpu_bytes": max((m.gpu for m in p.memory), default=0.0),
        "mfu": p.mfu,
    }


def render_solution(solution: Solution, profile: Profile, output: str | os.PathLike):
    """Rich renderables of the summary: one row per group (layout, cut points, GPUs and their modalities, tiers),
    then the predicted step, memory and the speed-up over the best homogeneous plan of the same run."""
    from rich.console import Group as Stack
    from rich.table import Table
    from rich.text import Text

    from planner.console import human_bytes, safe

    plan, p = solution.plan, solution.plan.predicted
    modality = {b.name: b.group for b in profile.blocks}
    flops = {b.name: b.fwd_flops + b.bwd_flops for b in profile.blocks}
    total = sum(flops.values()) or 1.0
    world = plan.world_size
    title = (f"{plan.profile.model} on {plan.cluster.world_size} x {plan.cluster.device.name}: {plan.training.global_batch} samples "
             f"per step in {plan.training.micro_batches} micro-batches, {plan.training.schedule}")
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("group", "GPUs", "dp·tp·pp", "ZeRO", "placement", "blocks per stage (cuts before)", "params/grads/optim; activations"):
        table.add_column(col, justify="right" if col in ("GPUs", "ZeRO") else "left", overflow="fold")
    for g in plan.groups:
        sizes = "+".join(str(len(s.blocks)) for s in g.stages)
        cuts = ", ".join(s.blocks[0] for s in g.stages[1:])
        table.add_row(g.name, str(len(g.ranks)), f"{g.dp}·{g.tp}·{g.pp}", str(g.zero),
                      f"with {g.colocated_with}" if g.colocated_with else "own ranks", sizes + (f" ({cuts})" if cuts else ""),
                      _tiers_text(g))
    per_modality = []
    for g in plan.groups:
        mods = list(dict.fromkeys(modality[b] for b in g.blocks))
        share = sum(flops[b] for b in g.blocks) / total
        per_modality.append(f"{safe('+'.join(mods))}: {len(g.ranks)} GPUs ({len(g.ranks) / world:.0%}) for {share:.1%} of the FLOPs")
    peak = {t: max((getattr(m, t) for m in p.memory), default=0.0) for t in ("gpu", "cpu", "nvme")}
    lines = [
        "GPUs per modality: " + "; ".join(per_modality),
        f"predicted step {p.step_time_s:.4g} s, {p.samples_per_s:,.1f} samples/s, MFU {p.mfu:.1%}, bubble {p.bubble_fraction:.1%}, "
        f"bottleneck {safe(p.bottleneck)}",
        f"peak memory per rank: GPU {human_bytes(peak['gpu'])} of {human_bytes(plan.cluster.device.memory_bytes)}"
        + (f", CPU {human_bytes(peak['cpu'])}" if peak["cpu"] else "") + (f", NVMe {human_bytes(peak['nvme'])}" if peak["nvme"] else "")
        + ("" if p.fits else "  [bold red]does not fit[/]"),
    ]
    if solution.speedup is not None:
        lines.append(f"best homogeneous plan {solution.baseline_step_time_s:.4g} s: speed-up [bold]{solution.speedup:.2f}x[/]")
    if solution.structure == "baseline" and solution.plan.solver:
        lines.append(f"baseline: {safe(solution.plan.solver.notes)}")
    else:
        how = "proved optimal over the search space" if solution.proved_optimal else (
            "stopped early at the time limit" if solution.stopped_early else f"bound gap {solution.gap:.1%}")
        lines.append(f"solved in {solution.solve_time_s:.2f} s: {solution.candidates} candidate layouts, {solution.simulated} plans "
                     f"simulated, {how}")
    if solution.stopped_early:
        lines.append("[yellow]the time limit stopped the search: this is the best plan found so far[/]")
    lines.append(f"wrote [bold]{safe(output)}[/]")
    return Stack(table, *(Text.from_markup(line) for line in lines))


def _tiers_text(group) -> str:
    states = dict.fromkeys(f"{s.memory.params}/{s.memory.grads}/{s.memory.optimizer}" for s in group.stages)
    acts: dict[str, int] = {}
    for s in group.stages:
        for b in s.blocks:
            tier = s.memory.activations.get(b, "keep")
            acts[tier] = acts.get(tier, 0) + 1
    return f"{', '.join(states)}; " + ", ".join(f"{n} {tier}" for tier, n in acts.items())
