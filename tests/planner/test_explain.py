"""Where the step goes and why a plan wins (planner/solver/explain.py): parts add up to the step, sentences follow the numbers."""
from __future__ import annotations

import re

import pytest

from cost_models.evaluate import evaluate
from planner.solver.baselines import homogeneous_plan
from planner.commands.compare import Compared
from planner.solver.explain import PARTS, breakdown, per_gpu, why
from planner.commands.report import compare_json
from cost_models.cluster_spec import parse_cluster
from tests.planner.test_compare import chain_profile


@pytest.fixture(scope="module")
def evaluated():
    profile, cluster = chain_profile(), parse_cluster("4xlocal-cpu")
    out = {}
    for name, layout in (("pp4", "tp=1,pp=4,dp=1,schedule=gpipe"), ("dp4", "tp=1,pp=1,dp=4,micro-batch=2"),
                         ("pp2", "tp=1,pp=2,dp=2")):
        plan = homogeneous_plan(profile, cluster, 8, layout)
        out[name] = (plan, evaluate(plan, profile))
    return out


@pytest.mark.parametrize("name", ["pp4", "dp4", "pp2"])
def test_the_parts_add_up_to_the_step_on_every_stage_and_per_gpu(evaluated, name):
    plan, ev = evaluated[name]
    step = ev.predicted.step_time_s
    rows = breakdown(plan, ev)
    assert [(r.group, r.stage) for r in rows] == [(s.group, s.index) for s in ev.stages]
    for r in rows:
        assert min(r.compute, r.comm, r.offload, r.bubble) >= 0
        assert r.compute + r.comm + r.offload + r.bubble == pytest.approx(step, rel=1e-9)
        assert r.compute > 0
    assert sum(per_gpu(plan, ev).values()) == pytest.approx(step, rel=1e-9)


def test_a_deep_gpipe_pipeline_shows_its_bubble_and_data_parallel_shows_none(evaluated):
    pp4, dp4 = per_gpu(*evaluated["pp4"]), per_gpu(*evaluated["dp4"])
    # GPipe over 4 stages with 8 micro-batches idles (p-1)/(m+p-1) of the pipeline at least
    assert pp4["bubble"] > 0.2 * sum(pp4.values())
    assert dp4["bubble"] == pytest.approx(0.0, abs=1e-12)
    assert dp4["comm"] > 0  # the gradient all-reduce over 4 replicas


def test_why_names_the_speed_up_and_the_parts_that_changed_most(evaluated):
    (a, ea), (b, eb) = evaluated["dp4"], evaluated["pp4"]
    fast, slow = ((a, ea), (b, eb)) if ea.predicted.step_time_s < eb.predicted.step_time_s else ((b, eb), (a, ea))
    text = why("fast", fast[0], fast[1], "slow", slow[0], slow[1])
    ratio = slow[1].predicted.step_time_s / fast[1].predicted.step_time_s
    assert text.startswith(f"fast is {ratio:.2f}x faster than slow")
    pf, ps = per_gpu(*fast), per_gpu(*slow)
    biggest = max(PARTS, key=lambda p: ps[p] - pf[p])
    named = {"compute": "compute falls", "comm": "exposed communication falls", "offload": "exposed offload falls",
             "bubble": "bubble falls"}
    assert named[biggest] in text
    # argument order does not change who is faster
    assert why("slow", slow[0], slow[1], "fast", fast[0], fast[1]).startswith("fast is")


def test_a_plan_that_does_not_fit_loses_on_memory(evaluated):
    from dataclasses import replace
    (a, ea), (b, eb) = evaluated["dp4"], evaluated["pp2"]
    eb = replace(eb, predicted=replace(eb.predicted, fits=False))
    assert why("a", a, ea, "b", b, eb) == "b does not fit in GPU memory, a does."


def test_compare_json_carries_the_breakdown_and_why_the_best_wins(evaluated):
    items = [Compared(f"{n}.json", *evaluated[n][:1], evaluated[n][1].predicted, evaluated[n][1]) for n in ("pp4", "dp4", "pp2")]
    data = compare_json(items)
    best = next(i for i, d in enumerate(data) if d["best"])
    for i, d in enumerate(data):
        assert len(d["breakdown"]) == len(items[i].evaluation.stages)
        assert set(d["breakdown"][0]) == {"group", "stage", "ranks", "compute_s", "comm_s", "offload_s", "bubble_s"}
        if i == best:
            assert "why" not in d
        else:
            assert re.match(rf"{items[best].name.removesuffix('.json')} is \d+\.\d\dx faster than", d["why"])


def test_solve_says_why_its_plan_beats_each_baseline():
    from planner.commands.report import solution_json
    from planner.solver.solve import solve

    profile = chain_profile()
    solution = solve(profile, parse_cluster("4xlocal-cpu"), 8)
    data = solution_json(solution, "plan.json", profile)
    assert set(data["why"]) == set(solution.baselines) and solution.baselines
    for name, text in data["why"].items():
        assert text.startswith("the solved plan") or text.startswith(f"the {name} baseline")
        assert f"the {name} baseline" in text


def test_exposed_zero_gathers_are_communication_not_offload():
    # ZeRO-3 on gloo ranks: every gather is exposed (nothing overlaps there), yet the plan offloads nothing
    profile, cluster = chain_profile(), parse_cluster("4xlocal-cpu")
    plan = homogeneous_plan(profile, cluster, 8, "tp=1,pp=1,dp=4,zero=3")
    ev = evaluate(plan, profile)
    parts = per_gpu(plan, ev)
    assert parts["offload"] == 0.0 and parts["comm"] > 0
    assert all(r.offload == 0.0 for r in breakdown(plan, ev))
    assert sum(parts.values()) == pytest.approx(ev.predicted.step_time_s, rel=1e-9)


def test_why_names_the_layout_difference_and_the_time_it_saves(evaluated):
    from planner.solver.explain import mechanisms, seconds_text

    (a, ea), (b, eb) = evaluated["dp4"], evaluated["pp4"]
    fast, slow = ((a, ea), (b, eb)) if ea.predicted.step_time_s < eb.predicted.step_time_s else ((b, eb), (a, ea))
    named = mechanisms(fast[0], slow[0])
    assert named and named[0].startswith("model: ")
    assert f"dp {fast[0].groups[0].dp} instead of {slow[0].groups[0].dp}" in named[0]
    assert f"{fast[0].groups[0].pp} pipeline stage" in named[0]
    saved = slow[1].predicted.step_time_s - fast[1].predicted.step_time_s
    assert f"it saves {seconds_text(saved)} per step with model: " in why("fast", fast[0], fast[1], "slow", slow[0], slow[1])
    assert mechanisms(fast[0], fast[0]) == []


def test_a_forced_placement_reports_the_best_plan_of_the_other_one():
    from planner.profiler.profile import profile_model
    from planner.commands.report import other_placement_text, solution_json
    from planner.solver.solve import solve
    from runtime.source import resolve

    profile = profile_model(resolve("tiny-vlm"))
    solution = solve(profile, parse_cluster("4xlocal-cpu"), 8, placement="non-colocated", time_limit=60)
    name, other = solution.other_placement
    assert name == "colocated" and other.predicted.fits
    assert all(g.colocated_with for g in other.groups if g.name != other.groups[-1].name)
    assert f"the best colocated plan (placement non-colocated was forced): {other.predicted.step_time_s:.4g} s" \
        in solution.plan.solver.notes
    assert other_placement_text(solution).startswith("the best colocated plan takes ")
    data = solution_json(solution, "plan.json", profile)
    assert data["other_placement"]["placement"] == "colocated"
    assert solve(profile, parse_cluster("4xlocal-cpu"), 8, time_limit=60).other_placement is None
