"""The allocation ILP (planner/solver/allocate.py): exact for its objective, solutions in bound order, both solvers, ranks."""
from __future__ import annotations

import itertools

import pytest

from cost_models.cluster_spec import parse_cluster
from planner.solver import allocate
from planner.solver.allocate import Allocator, assign_ranks, combined_bound, pick_solver
from planner.solver.candidates import unit_layouts
from planner.solver.space import Setting, divisors
from planner.solver.structure import profile_units
from plans.errors import MmplanError
from tests.planner.test_solve import random_instance


def candidates(seed: int, structure: str):
    profile, cluster, batch = random_instance(seed)
    setting = Setting(cluster, batch, "1f1b", "bf16")
    units = profile_units(profile, structure)
    sink = next(i for i, u in enumerate(units) if u.feeds)
    per_unit = [[] for _ in units]
    for m in divisors(batch):
        sinks = unit_layouts(units[sink], setting, m, max_gpus=cluster.world_size - (len(units) - 1 if structure == "non-colocated" else 0))
        depths = sorted({lay.pp for lay in sinks})
        for u, unit in enumerate(units):
            if u == sink:
                per_unit[u] += sinks
            elif structure == "non-colocated":
                per_unit[u] += unit_layouts(unit, setting, m, max_gpus=cluster.world_size - 1, downstream=depths)
            else:
                per_unit[u] += unit_layouts(unit, setting, m, max_gpus=cluster.world_size, downstream=depths, merge_depths=False, max_pp=1)
    return units, per_unit, cluster


def feasible(units, combo, structure, cluster) -> bool:
    sink = next(i for i, u in enumerate(units) if u.feeds)
    if len({lay.micro_batches for lay in combo}) > 1:
        return False
    if any(lay.downstream is not None and lay.downstream != combo[sink].pp for i, lay in enumerate(combo) if i != sink):
        return False
    if structure == "non-colocated":
        return sum(lay.gpus for lay in combo) <= cluster.world_size
    return len({lay.gpus for lay in combo}) == 1 and sum(max(lay.gpu_bytes) for lay in combo) <= cluster.device.memory_bytes


# enumerate_limit 0: every sub-problem solved as an ILP; None: the default, small ones enumerated (allocate.ENUMERATE_LIMIT)
@pytest.mark.parametrize("enumerate_limit", [0, None], ids=["ilp", "enumerated"])
# seed 8, not 0, non-colocated: seed 0 leaves a unit without candidates, so that case only ever skipped
@pytest.mark.parametrize("seed,structure", [(8, "non-colocated"), (9, "non-colocated"), (10, "non-colocated"), (17, "non-colocated"), (0, "colocated"), (6, "colocated")])
def test_ilp_solutions_come_in_bound_order_and_the_first_is_the_minimum(seed, structure, enumerate_limit, monkeypatch):
    units, per_unit, cluster = candidates(seed, structure)
    if any(not c for c in per_unit):
        pytest.skip("a unit without candidates")
    combos = [combo for combo in itertools.product(*per_unit) if feasible(units, combo, structure, cluster)]
    tighter = [combined_bound(units, combo, structure, cluster) for combo in combos]
    # the ILP's own objective: combined_bound without the colocated ranks' serial term, which only the bound of a
    # proposed combination adds (Choice.bound >= Choice.floor)
    monkeypatch.setattr("planner.solver.allocate._colocated_ranks", lambda layouts, sink: 0.0)
    every = [combined_bound(units, combo, structure, cluster) for combo in combos]
    monkeypatch.undo()
    assert all(e <= b * (1 + 1e-12) for e, b in zip(every, tighter))
    alloc = Allocator(units, per_unit, structure, cluster, enumerate_limit=enumerate_limit)
    floors, seen = [], set()
    for _ in range(12):
        choice = alloc.next()
        if choice is None:
            break
        assert feasible(units, choice.layouts, structure, cluster)
        assert choice.bound >= choice.floor - 1e-12
        key = tuple(id(lay) for lay in choice.layouts)
        assert key not in seen  # an excluded combination never comes back
        seen.add(key)
        floors.append(choice.floor)
        alloc.exclude(choice)
    assert all(b >= a * (1 - 1e-12) for a, b in zip(floors, floors[1:]))
    if every:
        assert floors and floors[0] == pytest.approx(min(every), rel=1e-9)  # the ILP is exact for its objective


def test_highs_and_cbc_agree():
    units, per_unit, cluster = candidates(9, "non-colocated")
    first = [Allocator(units, per_unit, "non-colocated", cluster, solver, enumerate_limit=0).next() for solver in ("highs", "cbc")]
    assert first[0].floor == pytest.approx(first[1].floor, rel=1e-6)


@pytest.mark.parametrize("seed,structure", [(9, "non-colocated"), (17, "non-colocated"), (6, "colocated"), (10, "colocated")])
def test_enumerated_sub_problems_propose_what_the_ilp_proposes(seed, structure):
    """Under allocate.ENUMERATE_LIMIT combinations the objective is evaluated for all of them instead of solving the
    sub-ILP: the same floors as the ILP proposes, in order. HiGHS's are exact to its tolerances only: its MIP
    feasibility tolerance (1e-6) lets T sit up to 1e-6 s below a term (here once, so that floor came after a larger
    one); the enumeration's are exact and come sorted."""
    units, per_unit, cluster = candidates(seed, structure)
    if any(not c for c in per_unit):
        pytest.skip("a unit without candidates")
    runs = []
    for limit in (0, None):
        alloc, floors = Allocator(units, per_unit, structure, cluster, enumerate_limit=limit), []
        while len(floors) < 60 and (choice := alloc.next()) is not None:
            floors.append(choice.floor)
            alloc.exclude(choice)
        runs.append(floors)
    ilp, enumerated = runs
    assert len(ilp) == len(enumerated) > 1
    assert enumerated == sorted(enumerated)
    assert enumerated == pytest.approx(sorted(ilp), rel=1e-9, abs=1.01e-6)


def test_missing_solvers_are_reported(monkeypatch):
    monkeypatch.setattr(allocate, "solver_available", lambda name: name == "cbc")
    assert pick_solver("highs") == "cbc"  # the fallback
    monkeypatch.setattr(allocate, "solver_available", lambda name: False)
    with pytest.raises(MmplanError, match="install highspy"):
        pick_solver("highs")


def test_rank_assignment_packs_node_aligned_and_keeps_tp_in_nodes():
    profile, _, _ = random_instance(17)
    cluster = parse_cluster("32xh100-sxm")
    setting = Setting(cluster, 8, "1f1b", "bf16")
    units = profile_units(profile, "non-colocated")
    lays = [unit_layouts(u, setting, 2, max_gpus=24) for u in units]
    checked = 0
    for combo in itertools.product(*(sorted(c, key=lambda lay: lay.gpus)[::7] for c in lays)):
        ranks = assign_ranks(combo, "non-colocated", cluster)
        if sum(lay.gpus for lay in combo) > 32:
            assert ranks is None
            continue
        assert ranks is not None
        flat = [r for rs in ranks for r in rs]
        assert len(flat) == len(set(flat)) and max(flat) < 32
        for lay, rs in zip(combo, ranks):
            assert len(rs) == lay.gpus and list(rs) == list(range(rs[0], rs[0] + len(rs)))
            if lay.gpus % 8 == 0:
                assert rs[0] % 8 == 0  # whole nodes start on a node boundary
            else:
                assert rs[0] // 8 == rs[-1] // 8  # smaller groups stay inside one node
            for i in range(0, len(rs), lay.tp):
                assert rs[i] // 8 == rs[i + lay.tp - 1] // 8  # a tensor-parallel group never spans nodes
        checked += 1
    assert checked > 5
    colocated = assign_ranks(combo, "colocated", cluster)
    assert all(rs == tuple(range(len(rs))) for rs in colocated)
