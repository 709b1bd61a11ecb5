"""`mmplan solve`: units -> candidate layouts (DP cut points) -> GPU allocation (ILP) -> simulation -> memory tiers -> plan."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Literal

from cost_models.compute import measured_on
from cost_models.memory import DTYPE_BYTES
from planner.solver import baselines
from planner.solver.allocate import Solver, pick_solver
from planner.solver.candidates import ZERO_STAGES
from planner.solver.colocated_seed import one_layout, unpipelined_seeds
from planner.solver.micro_batches import Refinement, refine_micro_batches
from planner.solver.diagnosis import check_capacity, no_fit
from planner.solver.search import Progress, Schedule, Search, branch_and_bound, quick_incumbent, refine_tiers
from planner.solver.space import GPU_ONLY, OFFLOAD, Setting, Unit, micro_batch_counts
from planner.solver.structure import Structure, profile_units
from plans.cluster import Cluster
from plans.errors import ImpossiblePrediction, MmplanError
from plans.graph import Profile
from plans.plan import Plan, SolverInfo
from plans.units import format_capacity

# The search, in order (each step its own module):
# 1. units (planner/solver/structure.profile_units): the profile's groups, a projector or head merged into its
#    neighbour; three structures -- "chain" (every block in one unit: one layout, cut anywhere),
#    "non-colocated" (one unit per modality, each on its own disjoint ranks) and "colocated" (every unit on
#    the same ranks, encoders replicated/sharded over them with pp = 1, the LLM pipelined);
# 2. candidate layouts per unit and number of micro-batches m (planner/solver/candidates.unit_layouts), cut points
#    by the DP of planner/solver/partition.py, each with exact per-stage costs (planner/solver/segments.py) and a lower
#    bound of the step time (planner/solver/bounds.py);
# 3. the allocation ILP (planner/solver/allocate.py) proposes the combination of smallest bound; it is built and
#    simulated (cost_models.evaluate), excluded, and the ILP re-solved, until the smallest remaining bound
#    reaches the best simulated step (proved optimal over the search space) or a limit is hit (the branch and
#    bound of planner/solver/search.py);
# 4. memory tiers: when nothing fits in GPU memory the search is repeated with CPU / NVMe tier policies
#    (uniform per stage); the best plan, when it offloads or recomputes anything, gets its tiers refined
#    per block by the ILP of planner/solver/tiers.py (kept if the simulator says it is faster); when nothing fits
#    at all, planner/solver/diagnosis.py says by how much;
# 4b. per-group micro-batch counts (planner/solver/micro_batches.py), after the tiers: the best plan of each
#    heterogeneous structure (the tiers-refined best among them) gets, group by group, its own micro-batch counts
#    tried and simulated with their memory, and so does the colocated split of the best unpipelined one-layout plan
#    (planner/solver/colocated_seed.py: the same step under one count, so the branch and bound prunes it, but a
#    host-bound encoder with fewer, larger micro-batches than the LLM beside it can beat every one-count plan);
#    one that fits and beats the best plan is offered, so the emitted plan is
#    never slower than without this step. The branch and bound's proof covers the one-count space only, so an
#    emitted plan with a group's own count is reported as not proved optimal (SolverInfo.optimal false; the notes
#    say what the step gained);
# 5. the best homogeneous (Megatron-style) plan is computed in the same run and emitted instead when it is
#    faster (or when the search found none): the solver never returns a plan slower than it under the same
#    cost model.
# Search-space limits (documented simplifications): the branch and bound shares one number of micro-batches m
# over all groups (plans/plan.py's Training; step 4b only refines it per group, without bounds); colocated
# encoders have pp = 1; non-colocated group sizes divide a node or are whole nodes; per-stage tier policies are
# uniform over a stage's blocks until tiers.py refines them.

Placement = Literal["auto", "colocated", "non-colocated"]
PLACEMENTS: tuple[str, ...] = ("auto", "colocated", "non-colocated")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")  # interleaved: 1f1b layouts and interleaved chain ones
# model chunks per rank of the interleaved chain layouts (--schedule interleaved; as the Megatron grid,
# baselines.MEGATRON_SCHEDULES): with 4 the ViT-22B + GPT-175B plans of bench/hetero_bench.py gain 3-4 % (1,536 A100:
# 13.675 -> 13.118 s, pp 6 at tp 4 instead of pp 3 at tp 8; 3,072: 7.781 -> 7.563 s), Narayanan et al. 2021's bubble
# (p - 1) / (v m) halved again
VIRTUAL_STAGES = (2, 4)


@dataclass(frozen=True, slots=True)
class Solution:
    """What `mmplan solve` found: the plan, the baselines it was compared with, and how the search went."""

    plan: Plan
    baseline: Plan | None  # the homogeneous baseline (one layout, cut points by the solver's DP)
    solve_time_s: float
    structure: str  # "chain" | "non-colocated" | "colocated" | "baseline"
    candidates: int  # layouts generated over all units and structures
    simulated: int  # plans built and simulated
    proved_optimal: bool  # the bound reached the best simulated step over the search space (false for a plan of
    # per-group micro-batch counts: step 4b, outside the one-count space the proof covers)
    stopped_early: bool  # the time limit ended the search
    gap: float  # 1 - smallest remaining bound / best step of the one-count space (0 when proved optimal there)
    megatron: Plan | None = None  # the Megatron-style baseline (encoders on stage 0, LLM layers even)
    other_placement: tuple[str, Plan] | None = None  # under a forced placement: the other one's best plan
    refinement: Refinement | None = None  # step 4b's change to the emitted plan (None: it changed nothing emitted)

    @property
    def step_time_s(self) -> float:
        return self.plan.predicted.step_time_s

    @property
    def baselines(self) -> dict[str, Plan]:
        """The baselines that fit, by name."""
        out = {"homogeneous": self.baseline, "megatron": self.megatron}
        return {k: p for k, p in out.items() if p is not None and p.predicted is not None and p.predicted.fits}

    def speedup_over(self, name: str) -> float | None:
        b = self.baselines.get(name)
        return b.predicted.step_time_s / self.step_time_s if b is not None and self.step_time_s > 0 else None

    @property
    def baseline_step_time_s(self) -> float | None:
        b = self.baselines.get("homogeneous")
        return b.predicted.step_time_s if b is not None else None

    @property
    def speedup(self) -> float | None:
        return self.speedup_over("homogeneous")


DEFAULT_RESERVE = 0.10  # of each GPU's memory left free by every solved plan (allocator fragmentation, CUDA context)
WRITE_MARGIN_S = 0.2  # seconds of a --time-limit kept for building the result, writing the plan and exiting,
WRITE_PER_RANK_S = 5e-4  # and per rank (save_plan validates per-rank lists against the JSON Schema: ~1 s at 4,096
WRITE_SHARE = 0.1  # ranks on a loaded 2-core machine), and this share of it (a search step overruns the deadline)


WRITE_FACTOR = 1.5  # x the measured check of a plan: save_plan's whole write (at 8,192 ranks the check took 0.89 s of a
# 1.05 s save, measured quiet; the rest is to_data and dumps) and the summary printed after it


def _write_reserve(time_limit: float, cluster: Cluster) -> float:
    """Seconds of a time limit kept for what follows the search (at most half of it), before any write is measured."""
    return min(0.5 * time_limit, WRITE_SHARE * time_limit + WRITE_MARGIN_S + WRITE_PER_RANK_S * cluster.world_size)


def _reserve_measured_write(search: Search) -> None:
    """Under --time-limit, once the quick incumbent exists: time the check save_plan makes (the JSON Schema over
    its per-rank lists, most of writing; it slows as the machine is loaded) on it, and move the deadlines earlier
    where WRITE_FACTOR x that exceeds the reserve kept by the estimate (_write_reserve), so that the search, the
    write and the summary end within the limit on a loaded machine too."""
    if search.time_limit is None or search.best is None:
        return
    from plans.plan import check_plan

    begun = time.perf_counter()
    try:
        check_plan(search.best[1])
    except MmplanError:  # reported by the final save, with the plan it concerns
        return
    measured = WRITE_SHARE * search.time_limit + WRITE_MARGIN_S + WRITE_FACTOR * (time.perf_counter() - begun)
    shift = max(0.0, measured - _write_reserve(search.time_limit, search.cluster))
    search.deadline -= shift
    if search.resume_deadline is not None:
        search.resume_deadline -= shift


def usable_cluster(cluster: Cluster, reserve: float) -> Cluster:
    """The cluster the search plans for: each GPU's memory is capacity x (1 - reserve)."""
    if not 0 <= reserve < 1:
        raise MmplanError(f"--memory-reserve must be a fraction in [0, 1), got {reserve}")
    usable = int(cluster.device.memory_bytes * (1 - reserve))
    return replace(cluster, device=replace(cluster.device, memory_bytes=usable))


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
    memory_reserve: float = DEFAULT_RESERVE,
    started: float | None = None,
    emit: Literal["best", "homogeneous", "megatron"] = "best",
    zeros: tuple[int, ...] = ZERO_STAGES,
    sequence_parallel: tuple[bool, ...] = (False, True),
    megatron_schedules: tuple[str, ...] = baselines.MEGATRON_SCHEDULES,
    per_group_micro_batches: bool = True,
) -> Solution:
    """The fastest plan found for `profile` on `cluster` at `global_batch` samples per step (see the comment above).

    micro_batch: samples per micro-batch (over a group's data-parallel replicas; Training.micro_batch),
    default: searched. time_limit: seconds from `started` (a time.perf_counter() value, default now: the CLI
    passes the process start); the search returns the best plan so far and says it stopped early.
    memory_reserve: fraction of each GPU's memory every plan leaves free. emit: "homogeneous" / "megatron" return
    that baseline as the plan (solve --baseline), found exactly as the full solve finds it. zeros: the ZeRO
    stages searched (by the solver and the homogeneous baseline; the Megatron-style one keeps 0 and 1). sequence_parallel: the sequence-parallelism settings searched
    for tp > 1 (by the solver and both baselines; only where tp divides the sequence). megatron_schedules: the
    Megatron-style baseline's schedules (default 1F1B, GPipe and interleaved 1F1B; `solve --schedule` given
    explicitly narrows them to what it asks for, so a baseline emitted as the plan keeps the requested schedule).
    per_group_micro_batches: step 4b (each heterogeneous structure's best plan tried with per-group micro-batch
    counts; not with micro_batch given, which fixes every group's); False searches the one-count space only (what
    the brute-force tests enumerate).
    """
    started = time.perf_counter() if started is None else started
    note = progress or (lambda step, fraction: None)
    _check_request(profile, cluster, global_batch, placement, schedule, micro_batch, time_limit)
    usable = usable_cluster(cluster, memory_reserve)
    solver = pick_solver(solver)
    deadline = started + (time_limit - _write_reserve(time_limit, cluster) if time_limit is not None else math.inf)
    # --schedule interleaved: 1F1B layouts and, for the chain structure (one layout for the whole model), interleaved 1F1B
    # ones with VIRTUAL_STAGES model chunks per rank (candidates._interleaved); the heterogeneous structures lay out 1F1B
    # pipelines; the Megatron-style baseline's grid holds interleaved 1F1B layouts too
    searched = "1f1b" if schedule == "interleaved" else schedule
    search = Search(profile, usable, global_batch, searched, deadline, note, solver=solver, started=started,
                    time_limit=time_limit)
    structures = _structures(profile, usable, placement)
    ms = micro_batch_counts(global_batch, micro_batch)
    setting = _setting(profile, usable, global_batch, schedule, zeros, sequence_parallel)
    # 1. the homogeneous baseline: the chain structure alone (one layout for every block, cut points by the DP),
    #    searched first so that its step prunes the heterogeneous structures
    chain, rest, proved, gap, offload = _chain_first(search, profile, structures, setting, ms, solver, memory_tiers,
                                                     baseline, emit)
    homogeneous = _homogeneous_plan(search, cluster, memory_reserve, memory_tiers) if baseline and emit != "megatron" else None
    if emit == "homogeneous":
        if homogeneous is None:
            raise no_fit(profile, usable, setting, chain, memory_tiers, search.stopped_early)
        return _baseline_solution(homogeneous, search, started, "homogeneous")
    if not any(s == "chain" for s, _ in structures) and search.best is not None:
        search.best = (search.best[0], search.best[1], "baseline")  # outside the requested placement: a baseline
    # 2. the Megatron-style baseline (its grid of homogeneous layouts, searched by baseline_search.search)
    megatron = None
    if baseline and not _end_phase(search).out_of_time():
        note("Megatron-style baseline", 0.3)
        megatron = _megatron_plan(profile, cluster, usable, global_batch, micro_batch, search, memory_reserve, zeros,
                                  sequence_parallel, megatron_schedules)
    if emit == "megatron":
        if megatron is None and search.stopped_early:
            raise no_fit(profile, usable, setting, structures, memory_tiers, True)
        if megatron is None or not megatron.predicted.fits:
            raise _megatron_unfit(profile, usable, megatron)
        return _baseline_solution(megatron, search, started, "megatron")
    # 3. the heterogeneous structures, pruned by the best step so far
    if rest and not search.out_of_time():
        p, g, offload = _search(search, rest, setting, ms, solver, memory_tiers, offload)
        proved, gap = proved and p, max(gap, g)
    if search.best is not None and memory_tiers and not search.out_of_time():
        note("choosing memory tiers", 0.9)
        refine_tiers(search)
    homogeneous = _one_layout_leader(search, homogeneous, cluster)
    refinement = None  # after the tiers: it offers only plans faster than the best (tiers refined), so never slows it
    if per_group_micro_batches and micro_batch is None and search.best is not None and not search.out_of_time():
        note("per-group micro-batch counts", 0.92)
        seeds = ()
        if any(s == "colocated" for s, _ in structures):  # a start the branch and bound pruned (colocated_seed.py)
            seeds = tuple(("colocated", seed) for seed in unpipelined_seeds(profile, usable, global_batch, search.deadline))
        refinement = _refine_micro_batches(search, seeds)
    other = _other_placement(search, profile, usable, placement, setting, ms, solver)  # before the solve time is taken
    solution = _solution(search, profile, cluster, usable, setting, structures, memory_tiers, memory_reserve, homogeneous,
                         megatron, proved, gap, started, note, refinement)
    return _with_other(solution, other, cluster, placement)


REFINE_SHARE = 0.5  # of the time left before the deadline that step 4b may use (a forced placement's probe gets the rest)


def _refine_micro_batches(search: Search, seeds: tuple[tuple[str, Plan], ...] = ()) -> Refinement | None:
    """Step 4b: the best plan of each structure with groups of their own micro-batch counts (planner/solver/
    micro_batches.py), fastest structure first, then each of `seeds` ((structure, plan): the colocated splits of the
    best unpipelined one-layout plans, colocated_seed.py), within REFINE_SHARE of the time left; each refined plan
    offered to the search. Returns the refinement that made the search's best plan, or None when none did."""
    now = time.perf_counter()
    deadline = now + REFINE_SHARE * (search.deadline - now) if math.isfinite(search.deadline) else math.inf
    made = None
    starts = [(structure, plan) for structure, (_, plan) in sorted(search.leaders.items(), key=lambda kv: kv[1][0])]
    for structure, plan in [*starts, *seeds]:
        if len(plan.groups) < 2:
            continue  # one layout for the whole model: one count
        if time.perf_counter() > deadline:
            break
        refined, refinement = refine_micro_batches(plan, search.profile, deadline)
        search.simulated += refinement.tried
        if refinement.changed:
            before = search.best
            search.offer(refined, structure)
            made = refinement if search.best is not before else made
    return made


def _with_other(solution: Solution, other: tuple[str, Plan] | None, cluster: Cluster, placement: str) -> Solution:
    """The solution with the other placement's best plan attached and named in the solver notes."""
    if other is None:
        return solution
    name, plan = other[0], replace(other[1], cluster=cluster)
    info = replace(solution.plan.solver, notes=solution.plan.solver.notes + f"; the best {name} plan (placement "
                   f"{placement} was forced): {plan.predicted.step_time_s:.4g} s")
    return replace(solution, plan=replace(solution.plan, solver=info), other_placement=(name, plan))


def _other_placement(search: Search, profile: Profile, usable: Cluster, placement: Placement, setting: Setting, ms,
                     solver: Solver) -> tuple[str, Plan] | None:
    """Under a forced --placement colocated | non-colocated: the best plan of the other placement (GPU-only tiers,
    within what is left of the time limit), so that the user sees what the choice costs; None otherwise."""
    if placement == "auto" or search.out_of_time():
        return None
    other: Structure = "non-colocated" if placement == "colocated" else "colocated"
    found = [(s, u) for s, u in _structures(profile, usable, other) if s == other]
    if not found:
        return None
    search.progress(f"the best {other} plan, for comparison", 0.95)
    probe = Search(profile, usable, search.global_batch, search.schedule, search.deadline, search.progress, solver=solver,
                   started=search.started, time_limit=search.time_limit)
    branch_and_bound(probe, found, setting, ms, solver)
    return (other, probe.best[1]) if probe.best is not None else None


def _setting(profile: Profile, usable: Cluster, global_batch: int, schedule: Schedule, zeros: tuple[int, ...],
             sequence_parallel: tuple[bool, ...]) -> Setting:
    """What the search holds fixed (GPU-only tiers first; _search adds CPU / NVMe ones when nothing fits)."""
    searched = "1f1b" if schedule == "interleaved" else schedule
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    measured = profile.micro_batch if measured_on(profile, usable) else None
    return Setting(usable, global_batch, searched, dtype, "adam", measured, GPU_ONLY, zeros=tuple(zeros),
                   virtual_stages=VIRTUAL_STAGES if schedule == "interleaved" else (), sequence_parallel=tuple(sequence_parallel))


def _chain_first(search: Search, profile: Profile, structures, setting: Setting, ms, solver: Solver, memory_tiers: bool,
                 baseline: bool, emit: str):
    """Step 1 of solve: the chain structure (added for the baseline when the placement leaves it out) searched alone;
    returns (chain, the other structures, proved, gap, tiers were needed)."""
    chain = [(s, u) for s, u in structures if s == "chain"]
    rest = [(s, u) for s, u in structures if s != "chain"]
    if baseline and not chain:
        chain = [("chain", profile_units(profile, "chain"))]
    proved = True
    gap = 0.0
    offload = False
    if chain and emit != "megatron":
        # under a time limit, with the Megatron-style baseline to search after it, the chain (and its tiers) get
        # CHAIN_SHARE of it: the rest searches that baseline, so the plan is never slower than it for want of time
        if baseline and emit == "best" and math.isfinite(search.deadline):
            search.resume_deadline = search.deadline
            search.deadline = search.started + CHAIN_SHARE * (search.deadline - search.started)
        quick_incumbent(search, chain[0][1], setting, ms)  # a plan to return even under a very short time limit
        _reserve_measured_write(search)
        proved, gap, offload = _search(search, chain, setting, ms, solver, memory_tiers, offload)
    return chain, rest, proved, gap, offload


def _end_phase(search: Search) -> Search:
    """The chain's share of the time limit is over: the whole limit again, a stop at the share remembered."""
    if search.resume_deadline is not None:
        search.phase_stopped, search.stopped_early = search.stopped_early, False
        search.deadline, search.resume_deadline = search.resume_deadline, None
    return search


CHAIN_SHARE = 0.6  # of a --time-limit the chain structure may use when the Megatron-style baseline follows it


def _megatron_unfit(profile: Profile, usable: Cluster, megatron: Plan | None) -> MmplanError:
    """solve --baseline megatron when no Megatron-style layout fits."""
    need = f"; its least-loaded layout needs {max(m.gpu for m in megatron.predicted.memory) / 1e9:,.2f} GB on its " \
           f"fullest GPU" if megatron is not None else ""
    return MmplanError(f"no Megatron-style layout of {profile.model} fits {usable.world_size} x {usable.device.name} "
                       f"({format_capacity(usable.device.memory_bytes)} usable per GPU){need}: that baseline keeps every "
                       f"state and activation on the GPU; solve without --baseline places them in CPU / NVMe tiers, "
                       f"or add GPUs")


def _solution(search: Search, profile: Profile, cluster: Cluster, usable: Cluster, setting: Setting, structures,
              memory_tiers: bool, memory_reserve: float, homogeneous: Plan | None, megatron: Plan | None, proved: bool,
              gap: float, started: float, note: Progress, refinement: Refinement | None = None) -> Solution:
    """The end of solve: the search's best plan, or a baseline when it is faster (or the search found none)."""
    search.stopped_early = search.stopped_early or search.phase_stopped
    mega_fits = megatron is not None and megatron.predicted.fits
    if search.best is None and not mega_fits:
        raise no_fit(profile, usable, setting, structures, memory_tiers, search.stopped_early)
    step, plan, structure = search.best or (math.inf, None, "")
    if mega_fits and megatron.predicted.step_time_s < step or structure == "baseline":
        winner, name = (megatron, "megatron") if mega_fits and megatron.predicted.step_time_s < step else (plan, "homogeneous")
        why = (f"the best {name} plan ({winner.predicted.step_time_s:.4g} s) beat the best plan of the requested search "
               f"({step:.4g} s)" if winner is megatron and plan is not None else
               f"the search found no plan that fits and beats the {name} baseline")
        plan, structure, proved = winner, "baseline", False
        notes = f"{why}, so it is emitted" + "".join(f"; {n}" for n in [winner.solver.notes if winner.solver else ""] if n)
        method = winner.solver.method if winner.solver else f"baseline:{name}"
    refined = refinement is not None and structure != "baseline" and any(g.micro_batches is not None for g in plan.groups)
    if structure != "baseline":
        space = "the one-count search space" if refined else "the search space"
        method, notes = f"ilp+dp:{structure}", _notes(structure, search, proved, gap, space)
    if refined:  # the proof (if any) covered the one-count space, which this plan is outside of
        notes += f"; then {refinement.describe()}, a local refinement: not proved optimal over per-group counts"
        proved = False
    proved = proved and not search.stopped_early
    bases = {k: p.predicted.step_time_s for k, p in (("homogeneous", homogeneous), ("megatron", megatron))
             if p is not None and p.predicted.fits}
    elapsed = time.perf_counter() - started
    info = SolverInfo(method=method, objective=plan.predicted.step_time_s, time_s=elapsed, candidates=search.candidates,
                      stopped_early=search.stopped_early, notes=notes + _versus(bases, plan.predicted.step_time_s),
                      optimal=proved, memory_reserve=memory_reserve, baselines=bases)
    plan = replace(plan, cluster=cluster, solver=info)
    note("done", 1.0)
    return Solution(plan, homogeneous, elapsed, structure, search.candidates, search.simulated, proved, search.stopped_early,
                    0.0 if proved else gap, megatron, refinement=refinement if refined else None)


def _baseline_solution(plan: Plan, search: Search, started: float, name: str) -> Solution:
    elapsed = time.perf_counter() - started
    plan = replace(plan, solver=replace(plan.solver, time_s=elapsed, stopped_early=search.stopped_early))
    return Solution(plan, plan if name == "homogeneous" else None, elapsed, "baseline", search.candidates, search.simulated,
                    False, search.stopped_early, 0.0, plan if name == "megatron" else None)


def _search(search: Search, structures, setting: Setting, ms, solver: Solver, memory_tiers: bool,
            offload: bool) -> tuple[bool, float, bool]:
    """Branch and bound over `structures` with GPU-only tiers, then (memory tiers on, nothing fits yet, or an
    earlier structure needed them) with CPU / NVMe tiers too; returns (proved, gap, tiers were needed)."""
    if not offload:
        proved, gap = branch_and_bound(search, structures, setting, ms, solver)
        if search.best is not None or not memory_tiers or search.out_of_time():
            return proved, gap, False
        search.progress("nothing fits in GPU memory: searching with CPU / NVMe tiers", 0.6)
        check_capacity(search.profile, search.cluster, setting.dtype)
    proved, gap = branch_and_bound(search, structures, replace(setting, policies=GPU_ONLY + OFFLOAD), ms, solver)
    return proved, gap, True


def _homogeneous_plan(search: Search, cluster: Cluster, reserve: float, memory_tiers: bool = True) -> Plan | None:
    """The chain structure's best plan (the homogeneous baseline), tiers refined (unless --no-memory-tiers), on the
    real cluster."""
    if search.best is None:
        return None
    step, plan, _ = search.best
    if memory_tiers and not search.out_of_time():
        probe = Search(search.profile, search.cluster, search.global_batch, search.schedule, search.deadline,
                       search.progress, best=search.best)
        refine_tiers(probe)
        step, plan, _ = probe.best
        search.best = probe.best
    info = SolverInfo("baseline:homogeneous", objective=step, candidates=search.candidates,
                      notes=f"one layout for the whole model, cut points by the solver's DP; {search.simulated} plans "
                            f"simulated", optimal=False, memory_reserve=reserve)
    return replace(plan, cluster=cluster, solver=info)


def _one_layout_leader(search: Search, homogeneous: Plan | None, cluster: Cluster) -> Plan | None:
    """The homogeneous baseline, or a heterogeneous structure's best plan whose groups share one layout, merged into
    one group (colocated_seed.one_layout), when that fits and is faster: the chain's search tries CPU / NVMe tiers only
    when nothing fits without them, so a colocated plan at another micro-batch count can reach a one-layout plan the
    chain's search never built; the baseline is the best one-layout plan found, whichever search found it."""
    if homogeneous is None:
        return None
    for _, plan in search.leaders.values():
        merged = one_layout(plan, search.profile)
        if merged is not None and merged.predicted.fits and merged.predicted.step_time_s < homogeneous.predicted.step_time_s:
            info = replace(homogeneous.solver, objective=merged.predicted.step_time_s,
                           notes=f"one layout for the whole model: the groups of the colocated search's best plan share "
                                 f"one layout, merged into one ({homogeneous.predicted.step_time_s:.4g} s for the chain's "
                                 f"best)")
            homogeneous = replace(merged, cluster=cluster, solver=info)
    return homogeneous


def _megatron_plan(profile: Profile, cluster: Cluster, usable: Cluster, global_batch: int, micro_batch: int | None,
                   search: Search, reserve: float, zeros: tuple[int, ...] = ZERO_STAGES,
                   sequence_parallel: tuple[bool, ...] = (False, True),
                   schedules: tuple[str, ...] = baselines.MEGATRON_SCHEDULES) -> Plan | None:
    """The best Megatron-style plan (planner/baselines.best_megatron) for the same request, on the real cluster."""
    try:
        plan = baselines.best_megatron(profile, usable, global_batch, per_step_micro_batch=micro_batch, deadline=search.deadline,
                                       zeros=tuple(z for z in zeros if z in baselines.MEGATRON_ZEROS) or (0,),
                                       sequence_parallels=sequence_parallel, schedules=schedules)
    except ImpossiblePrediction:  # inconsistent inputs: an error for every plan, never a skipped candidate
        raise
    except MmplanError:
        return None
    return replace(plan, cluster=cluster, solver=replace(plan.solver, memory_reserve=reserve))


def _versus(bases: dict[str, float], step: float) -> str:
    return "".join(f"; {k} {v:.4g} s, speed-up {v / step:.3f}x" for k, v in bases.items())


def _notes(structure: str, search: Search, proved: bool, gap: float, space: str = "the search space") -> str:
    parts = [f"structure {structure}; {search.candidates} candidate layouts, {search.simulated} plans simulated"]
    if search.stopped_early:
        parts.append("stopped at the time limit: the best plan found so far")
    elif proved:
        parts.append(f"optimal over {space} (its bound reached the best simulated step)")
    elif gap <= search.gap_goal:
        parts.append(f"within {search.gap_goal:.1%} of the optimum over {space} (dominated candidates pruned)")
    else:
        parts.append(f"simulation budget reached; bound gap {gap:.1%}")
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

Baseline = Literal["homogeneous", "megatron", "zero3", "gpipe-even"]


def process_started() -> float:
    """When this process started, as a time.perf_counter() value (Linux /proc): --time-limit counts from there,
    so that loading Python and the profile is inside the limit. Now, when the process is older than a minute
    (a long-lived process calling the CLI app, e.g. tests) or /proc cannot tell."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - age if 0 <= age < 60 else now


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
    memory_reserve: float = DEFAULT_RESERVE,
    started: float | None = None,
    sequence_parallel: tuple[bool, ...] = (False, True),
    megatron_schedules: tuple[str, ...] = baselines.MEGATRON_SCHEDULES,
) -> tuple[Solution, Profile]:
    """Load the profile and cluster, solve (or build the requested baseline: --baseline [--layout]), write the plan.

    --baseline homogeneous / megatron (without --layout) write exactly the baseline plan `solve` compares with.
    started: a time.perf_counter() value --time-limit counts from (default now)."""
    started = time.perf_counter() if started is None else started
    from cost_models.cluster_spec import parse_cluster
    from plans.graph import load_profile
    from plans.plan import save_plan

    from planner.solver.group_layouts import group_layout_plan, is_group_layout

    per_group = layout is not None and is_group_layout(layout)
    if per_group and (baseline is not None or micro_batch is not None):
        raise MmplanError("a per-group --layout (GROUP:key=value,...;GROUP:...) writes exactly that heterogeneous plan: "
                          "use it without --baseline and --micro-batch (write micro-batch=N per group)")
    if layout is not None and baseline is None and not per_group:
        raise MmplanError("--layout describes a one-layout plan: use it with --baseline homogeneous (exactly that layout) "
                          "or --baseline megatron (the best Megatron-style plan with what it writes fixed), or name "
                          "each group's layout (vision:dp=4;llm:tp=2,dp=2)")
    profile = load_profile(profile_path)
    spec = parse_cluster(cluster, gpus_per_node)
    if per_group:
        plan = group_layout_plan(profile, usable_cluster(spec, memory_reserve), global_batch, layout)
        elapsed = time.perf_counter() - started
        plan = replace(plan, cluster=spec, solver=replace(plan.solver, time_s=elapsed, memory_reserve=memory_reserve))
        solution = Solution(plan, None, elapsed, "layout", 1, 1, False, False, 0.0)
    elif baseline in ("homogeneous", "megatron") and layout is None:
        solution = solve(profile, spec, global_batch, placement=placement, schedule=schedule, micro_batch=micro_batch,
                         time_limit=time_limit, solver=solver, memory_tiers=memory_tiers, progress=progress,
                         memory_reserve=memory_reserve, started=started, emit=baseline, sequence_parallel=sequence_parallel,
                         megatron_schedules=megatron_schedules)
    elif baseline is not None:
        plan = baselines.baseline_plan(baseline, profile, usable_cluster(spec, memory_reserve), global_batch, layout=layout,
                                       per_step_micro_batch=micro_batch)
        elapsed = time.perf_counter() - started
        plan = replace(plan, cluster=spec, solver=replace(plan.solver or SolverInfo(f"baseline:{baseline}"), time_s=elapsed,
                                                          memory_reserve=memory_reserve))
        solution = Solution(plan, plan if baseline == "homogeneous" else None, elapsed, "baseline", plan.solver.candidates,
                            0, False, False, 0.0, plan if baseline == "megatron" else None)
    else:
        solution = solve(profile, spec, global_batch, placement=placement, schedule=schedule, micro_batch=micro_batch,
                         time_limit=time_limit, solver=solver, memory_tiers=memory_tiers, progress=progress,
                         memory_reserve=memory_reserve, started=started, sequence_parallel=sequence_parallel,
                         megatron_schedules=megatron_schedules)
    save_plan(solution.plan, output)
    return solution, profile


