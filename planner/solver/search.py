"""The solver's search: candidates per unit, then the allocation ILP proposes and the simulator disposes (branch and bound)."""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from planner.solver.allocate import Allocator, Choice, Solver, assign_ranks
from planner.solver.bounds import Layout
from planner.solver.candidates import _layouts_of, ahead_layouts, colocated_layouts, sp_values, unit_layouts, unit_runs, zero_stages
from planner.solver.construct import GroupLayout, build_plan
from planner.solver.segments import BlockTimes, Segments
from planner.solver.space import Setting, Unit
from planner.solver.tiers import place_tiers
from planner.solver.structure import Structure
from plans.cluster import Cluster
from plans.errors import ImpossiblePrediction, MmplanError
from plans.graph import Profile
from plans.plan import Plan, Training
from cost_models.memory import DTYPE_BYTES

Schedule = Literal["gpipe", "1f1b"]
Progress = Callable[[str, float], None]
EXHAUSTIVE = 4000  # candidates per structure below which none is pruned by dominance (the search is exact)
MAX_SIMULATED = 400  # plans simulated at most in one search
TOLERANCE = 1e-9  # relative: a bound this close to the best step cannot beat it (exact searches)
LARGE_GAP = 2e-3  # large searches stop once no bound is 0.2 % below the best step


@dataclass
class Search:
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
    started: float = field(default_factory=time.perf_counter)
    time_limit: float | None = None
    floor: float = 0.0  # the smallest bound not yet ruled out in the current branch and bound (progress only)
    phase_stopped: bool = False  # a phase held to a share of the time limit (solve's chain structure) stopped at it
    resume_deadline: float | None = None  # the whole time limit's deadline while such a phase runs
    leaders: dict = field(default_factory=dict)  # structure -> (step, plan): each structure's fastest fitting plan

    def report(self, step: str, fraction: float) -> None:
        """Progress with the incumbent and the bound; the fraction is the share of the time limit used, if any."""
        if self.time_limit:
            fraction = max(fraction, min(0.99, (time.perf_counter() - self.started) / self.time_limit))
        best = f"best {self.best[0]:.4g} s" if self.best is not None else "no plan yet"
        floor = min(self.floor, self.best[0]) if self.best is not None else self.floor
        bound = f", bound {floor:.4g} s" if floor > 0 else ""
        self.progress(f"{step}: {best}{bound}", fraction)

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
        for fill in (False, True) if structure == "colocated" else (False,):  # sources in the sink's bubbles or not
            self.offer(build_layouts(self.profile, self.cluster, self.global_batch, self.schedule, structure, units, layouts,
                                     fill_bubbles=fill), structure)
        return True

    def offer(self, plan: Plan | None, structure: str) -> None:
        if plan is None or plan.predicted is None or not plan.predicted.fits:
            return
        step = plan.predicted.step_time_s
        if structure not in self.leaders or step < self.leaders[structure][0]:
            self.leaders[structure] = (step, plan)
        if self.best is None or step < self.best[0]:
            self.best = (step, plan, structure)


def branch_and_bound(search: Search, structures, setting: Setting, ms: Sequence[int], solver: Solver) -> tuple[bool, float]:
    """Generate candidates and run the ILP-proposes / simulator-disposes loop; returns (proved optimal, gap)."""
    cl = search.cluster
    search.floor = 0.0  # this search's bound is not known yet
    times = BlockTimes(setting)
    allocators: list[tuple[Structure, tuple[Unit, ...], Allocator]] = []
    exhaustive = True
    for si, (structure, units) in enumerate(structures):
        if search.out_of_time():
            break
        search.report(f"{structure}: candidate layouts", 0.05 + 0.45 * si / len(structures))
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


def _run(search: Search, allocators, budget: int) -> tuple[bool, float]:
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
        search.floor = floor
        if floor >= goal:
            return exact and search.gap_goal <= TOLERANCE, max(0.0, 1 - floor / search.best[0])
        if search.out_of_time() or simulated >= budget:
            return False, (1 - floor / search.best[0]) if search.best else 1.0
        heapq.heappop(heap)
        structure, units, alloc = allocators[i]
        exact &= choice.optimal
        if choice.bound < goal:
            search.report(f"{structure}: {search.simulated} simulated", min(0.8, 0.5 + 0.3 * simulated / budget))
            if search.simulate(structure, units, choice.layouts):
                simulated += 1
        alloc.exclude(choice)
        c = alloc.next(_remaining(search))
        if c is not None:
            heapq.heappush(heap, (c.floor, tick, i, c))
            tick += 1
    return exact and search.gap_goal <= TOLERANCE, 0.0


def _remaining(search: Search) -> float:
    return max(1.0, min(120.0, search.deadline - time.perf_counter()))


def _candidates(search: Search, structure: Structure, units: tuple[Unit, ...], setting: Setting, ms: Sequence[int],
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
            lays = unit_layouts(units[0], setting, m, max_gpus=n, limit=limit, times=times, deadline=search.deadline)
            out[0] += [lay for lay in lays if lay.bound.own < limit]
            if search.best is None:
                for lay in sorted(out[0], key=lambda lay: lay.bound.own)[:3]:
                    search.simulate(structure, units, (lay,))
            continue
        sink = next(i for i, u in enumerate(units) if u.feeds)
        reserve = len(units) - 1 if structure == "non-colocated" else 0
        sink_layouts = [lay for lay in unit_layouts(units[sink], setting, m, max_gpus=n - reserve, limit=limit, times=times, deadline=search.deadline)
                        if lay.bound.own < limit]
        if not sink_layouts:
            continue
        depths = sorted({lay.pp for lay in sink_layouts})
        per_unit = []
        for u, unit in enumerate(units):
            if u == sink:
                per_unit.append(sink_layouts)
            elif structure == "non-colocated":
                per_unit.append(ahead_layouts(unit, setting, m, max_gpus=n - min(lay.gpus for lay in sink_layouts),
                                              depths=depths, limit=limit, times=times, deadline=search.deadline))
            else:
                per_unit.append(colocated_layouts(unit, setting, m, max_gpus=n, depths=depths, sizes={lay.gpus for lay in sink_layouts},
                                                  limit=limit, times=times, deadline=search.deadline))
        for u, lays in enumerate(per_unit):
            out[u] += [lay for lay in lays if lay.bound.own < limit]
        if search.best is None and all(out):
            _seed(search, structure, units, out)
    return out


def quick_incumbent(search: Search, units: tuple[Unit, ...], setting: Setting, ms: Sequence[int]) -> None:
    """An incumbent within moments, even past a short time limit: unpipelined layouts (pp = 1, no DP table) of the
    chain (`units`) at the most promising m with the most-sharding ZeRO stage: of the six (tp, dp) runs of least
    work per micro-batch, the two of smallest bound are simulated (then the next six, up to 18 runs, until one fits)."""
    if search.best is not None or not ms:
        return
    times = BlockTimes(setting)
    m = _m_order(units, setting, ms, times, search.cluster)[0]
    unit, n = units[0], search.cluster.world_size
    runs = unit_runs(unit, setting, m, max_gpus=n)
    runs.sort(key=lambda r: (times.work(unit, r[0], setting.global_batch / m / r[1]), -r[1]))
    for start in range(0, len(runs), 6):
        lays = []
        for tp, dp, _ in runs[start:start + 6]:
            sp = sp_values(unit, setting, tp, setting.global_batch / m / dp, times)[-1]
            seg = Segments(unit, setting, tp, dp, max(zero_stages(search.cluster, dp, setting.zeros)), m, times, sequence_parallel=sp)
            lays += _layouts_of(seg, 1, (), True)
        for lay in sorted(lays, key=lambda lay: lay.bound.own)[:2]:
            search.simulate("chain", units, (lay,))
        if search.best is not None or start >= 12:
            return


def _seed(search: Search, structure: Structure, units: tuple[Unit, ...], candidates: list[list[Layout]]) -> None:
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
        groups.setdefault((lay.micro_batches, lay.downstream, lay.lookahead, lay.pp if structure != "chain" else 0, lay.dp, lay.tp), []).append(lay)
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
    head = (lay.gpus, b.own) if structure != "colocated" else (lay.gpus, b.own, b.busy, max(lay.gpu_bytes))
    extra = (b.fwd_out, b.bwd_in, *b.k2, *b.k3, *(k for row in b.k4 for k in row))
    return head + extra


# --- building plans ----------------------------------------------------------------------------------------------


def build_layouts(profile: Profile, cluster: Cluster, global_batch: int, schedule: Schedule, structure: Structure,
                  units: Sequence[Unit], layouts: Sequence[Layout], *, fill_bubbles: bool = False) -> Plan | None:
    """The checked plan (with predictions) of one layout per unit, or None when its ranks do not pack. fill_bubbles:
    colocated sources of ZeRO 0 run their replicas' tasks in each rank class's idle slots (Group.fill_bubbles); None
    when a replica's tp ranks straddle two of the sink's stages."""
    ranks = assign_ranks(layouts, structure, cluster)
    if ranks is None:
        return None
    sink = next((i for i, u in enumerate(units) if u.feeds), None)
    groups = []
    for i, (unit, lay, r) in enumerate(zip(units, layouts, ranks)):
        names = tuple(b.name for b in unit.blocks)
        cores = {b.name for b in unit.blocks if b.attention_core_bytes > 0}
        host = units[sink].name if structure == "colocated" and sink is not None and i != sink else None
        groups.append(GroupLayout(unit.name, names, lay.cuts, lay.dp, lay.tp, r, zero=lay.zero, colocated_with=host,
                                  memory=lay.memories(names, cores), sequence_parallel=lay.sequence_parallel, chunks=lay.chunks,
                                  reshard_after_forward=lay.reshard_after_forward, lookahead=lay.lookahead,
                                  fill_bubbles=fill_bubbles and host is not None and lay.zero == 0))
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    chunks = max(lay.chunks for lay in layouts)  # an interleaved layout (the chain unit's) makes the schedule interleaved
    training = Training(global_batch, layouts[0].micro_batches, "interleaved" if chunks > 1 else schedule, chunks, dtype=dtype)
    try:
        return build_plan(profile, cluster, training, groups, schema=False)
    except ImpossiblePrediction:  # inconsistent inputs: an error for every plan, never a skipped candidate
        raise
    except MmplanError:
        return None  # e.g. a deadlocking order: not a candidate


def refine_tiers(search: Search) -> None:
    """Per-block tiers of the best plan (planner/solver/tiers.py); kept when the simulator says it is faster."""
    _, plan, structure = search.best
    stages = [s for g in plan.groups for s in g.stages]
    if all(s.memory == type(s.memory)() for s in stages):
        return  # everything on the GPU, nothing recomputed: no other tiers are faster
    try:
        refined = place_tiers(plan, search.profile, time_limit=max(0.05, min(30.0, search.deadline - time.perf_counter())))
    except ImpossiblePrediction:  # inconsistent inputs: an error for every plan, never a skipped candidate
        raise
    except MmplanError:
        return
    if refined is not None:
        search.offer(refined, structure)
