"""The solver's bounds stay lower bounds of the simulated step with the schedule's mechanisms: sources running ahead
(Layout.lookahead, candidates.ahead_layouts) and colocated sources filling the sink's pipeline bubbles."""
from __future__ import annotations

import random

from planner.solver.allocate import combined_bound
from planner.solver.candidates import ahead_layouts, unit_layouts
from planner.solver.search import build_layouts
from planner.solver.space import Setting, divisors
from planner.solver.structure import profile_units
from tests.planner.test_solve import random_instance


def test_look_ahead_layouts_bound_their_simulated_step():
    checked = ahead = 0
    for seed in range(12):
        profile, cluster, batch = random_instance(seed, max_gpus=8)
        units = profile_units(profile, "non-colocated")
        if units is None:
            continue
        setting = Setting(cluster, batch, "1f1b", "bf16")
        sink = next(i for i, u in enumerate(units) if u.feeds)
        rng = random.Random(seed)
        for m in divisors(batch):
            sinks = unit_layouts(units[sink], setting, m, max_gpus=cluster.world_size - 1)
            depths = sorted({lay.pp for lay in sinks})
            per_unit = [sinks if u == sink else ahead_layouts(unit, setting, m, max_gpus=cluster.world_size - 1, depths=depths)
                        for u, unit in enumerate(units)]
            if not all(per_unit):
                continue
            for _ in range(12):
                combo = tuple(rng.choice(c) for c in per_unit)
                s = combo[sink]
                if sum(lay.gpus for lay in combo) > cluster.world_size or any(
                        lay.downstream not in (None, s.pp) for lay in combo if lay is not s):
                    continue
                plan = build_layouts(profile, cluster, batch, "1f1b", "non-colocated", units, combo)
                if plan is None:
                    continue
                assert [g.lookahead for g in plan.groups] == [lay.lookahead for lay in combo]
                assert combined_bound(units, combo, "non-colocated", cluster) <= plan.predicted.step_time_s * (1 + 1e-9), seed
                checked += 1
                ahead += any(lay.lookahead for lay in combo)
    assert checked >= 30 and ahead >= 10, (checked, ahead)


def test_colocated_bounds_hold_when_sources_fill_the_bubbles():
    checked = filled = 0
    for seed in range(12):
        profile, cluster, batch = random_instance(seed, max_gpus=8)
        units = profile_units(profile, "colocated")
        if units is None:
            continue
        setting = Setting(cluster, batch, "1f1b", "bf16", zeros=(0,))
        rng = random.Random(seed)
        for m in divisors(batch):
            per_unit = [unit_layouts(u, setting, m, max_gpus=cluster.world_size, max_pp=1 if u.out_bytes else None) for u in units]
            if not all(per_unit):
                continue
            for _ in range(12):
                combo = tuple(rng.choice(c) for c in per_unit)
                if len({lay.gpus for lay in combo}) > 1:
                    continue
                plan = build_layouts(profile, cluster, batch, "1f1b", "colocated", units, combo, fill_bubbles=True)
                if plan is None:
                    continue
                assert combined_bound(units, combo, "colocated", cluster) <= plan.predicted.step_time_s * (1 + 1e-9), seed
                checked += 1
                filled += any(g.fill_bubbles and len({r for s in g.stages for r in s.ranks}) > 1 for g in plan.groups)
    assert checked >= 20 and filled >= 10, (checked, filled)
