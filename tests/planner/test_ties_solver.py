"""The solver and parameters tied across stages: its vectorised stage memory counts a tied copy as the cost model
does (cost_models/ties.py), it never splits a tie between groups (the runtime refuses that: plans/capabilities.py),
and what it emits for a tied model passes the runtime's pre-check."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cost_models.evaluate import evaluate
from planner.solver.candidates import stage_in_flight
from planner.solver.construct import GroupLayout, build_plan, megatron_ranks
from planner.solver.segments import Segments
from planner.solver.solve import solve
from planner.solver.space import GPU_ONLY, Setting
from planner.solver.structure import profile_units
from plans.plan import Training
from runtime.preflight import check_ties
from runtime.source import call_factory, resolve
from tests.runtime.plan_builder import local_cluster, profile

TIED = "tiny-vlm-tied"


@pytest.mark.parametrize(("dp", "zero", "cut"), [(1, 0, 7), (2, 1, 7), (2, 3, 4), (1, 0, 9)])
def test_segment_memory_counts_a_tied_copy_as_the_cost_model(dp, zero, cut):
    prof = profile(TIED)
    cluster = local_cluster(2 * dp)
    unit = profile_units(prof, "chain")[0]
    assert unit.ties == ((5, (9,), prof.ties[0].params),)  # llm.embed owns it, llm.head holds it too
    m, batch = 4, 8
    setting = Setting(cluster, batch, "1f1b", "fp32", "adam", None, GPU_ONLY)
    seg = Segments(unit, setting, 1, dp, zero, m)
    names = tuple(b.name for b in prof.blocks)
    policy = GPU_ONLY[0]
    plan = build_plan(prof, cluster, Training(batch, m, "1f1b", dtype="fp32"),
                      [GroupLayout("model", names, (cut,), dp, 1, megatron_ranks(dp, 1, 2), zero=zero)])
    ev = evaluate(plan, prof)
    g0, g1, *_ = seg.memory(policy)
    for k, (a, b) in enumerate([(0, cut), (cut, len(names))]):
        flight = stage_in_flight("1f1b", m, 1 - k)
        assert g0[a, b] + flight * g1[a, b] == pytest.approx(ev.stage_memory[k].gpu, rel=1e-9), (k, a, b)


def test_a_tie_across_groups_leaves_only_the_chain():
    prof = profile(TIED)
    assert profile_units(prof, "non-colocated") is not None
    split = prof.with_groups({"llm.embed": "vision", "vision_proj": "vision"})  # the embedding joins the encoder
    assert profile_units(replace(split, ties=()), "non-colocated") is not None
    assert profile_units(split, "non-colocated") is None and profile_units(split, "colocated") is None


@pytest.mark.parametrize("placement", ["auto", "non-colocated"])
def test_a_solved_plan_for_a_tied_model_passes_the_runtimes_pre_check(placement):
    prof = profile(TIED)
    plan = solve(prof, local_cluster(4), 8, placement=placement, time_limit=60).plan
    model, _ = call_factory(resolve(TIED), 1)
    check_ties(plan, model, Path("plan.json"))
