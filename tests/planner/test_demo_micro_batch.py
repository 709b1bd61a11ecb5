"""`mmplan demo --case micro-batch` (issue 32): on the case's measured profile and calibrated cluster (one demo run's,
kept in tests/fixtures/demo_micro_batch/), the solved plan gives the host-bound encoder its own micro-batch count,
beats every one-layout baseline by the margin the demo shows, and owes that to the count; a traced run of the plan
executes the predicted task order and trains exactly as the single-process reference. (The measured speed-up
itself is the demo's to show: it needs calibration and several runs, README's demo section.)"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cost_models.cluster_spec import parse_cluster
from cost_models.pipeline import simulate
from planner.commands.demo import CASES, run_demo
from planner.solver.colocated_seed import one_layout, unpipelined_seeds
from planner.solver.explain import plan_mechanisms
from planner.solver.micro_batches import with_count
from planner.solver.solve import solve, usable_cluster
from plans.errors import MmplanError
from plans.graph import load_profile
from runtime.launch import launch
from runtime.reference import reference_run
from runtime.train import Job, train_rank
from tests.runtime.test_parity import check_parity

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "demo_micro_batch"
CASE = CASES["micro-batch"]
STEPS = 6


@pytest.fixture(scope="module")
def solved():
    profile = load_profile(FIXTURES / "profile.json")
    return profile, solve(profile, parse_cluster(str(FIXTURES / "cluster.toml")), CASE.global_batch)


def test_the_solved_plan_runs_the_encoder_in_fewer_micro_batches_than_the_llm(solved):
    profile, solution = solved
    plan = solution.plan
    vision, llm = plan.group("vision"), plan.group("llm")
    assert vision.colocated_with == "llm" and vision.ranks == llm.ranks  # one set of ranks, one layout each
    assert vision.micro_batches is not None and plan.micro_batches_of(vision) < plan.micro_batches_of(llm)
    assert plan_mechanisms(plan)[0].startswith("per-group micro-batch count: vision in ")
    for kind, baseline in solution.baselines.items():  # the one-layout plans the demo trains against
        assert baseline.predicted.step_time_s >= 1.2 * plan.predicted.step_time_s, kind
    # the gain is the count's: the same plan with the encoder at the LLM's count is no faster than the baseline
    one_count = with_count(plan, profile, "vision", plan.training.micro_batches)
    homogeneous = solution.baselines["homogeneous"].predicted.step_time_s
    assert one_count is None or not one_count.predicted.fits or one_count.predicted.step_time_s > 0.95 * homogeneous


def test_a_one_layout_plan_split_by_group_and_merged_back_steps_alike(solved):
    """The seeds of the per-group refinement are one-layout plans as colocated groups; merged back they are the
    one-layout plan the homogeneous baseline may take: each form steps as fast as the other."""
    profile, _ = solved
    usable = usable_cluster(parse_cluster(str(FIXTURES / "cluster.toml")), 0.1)
    seeds = unpipelined_seeds(profile, usable, CASE.global_batch)
    assert seeds and all(s.group("vision").colocated_with == "llm" and s.predicted.fits for s in seeds)
    for seed in seeds:
        merged = one_layout(seed, profile)
        assert [g.name for g in merged.groups] == ["model"]
        assert merged.groups[0].blocks == tuple(b.name for b in profile.blocks)
        assert merged.predicted.step_time_s == pytest.approx(seed.predicted.step_time_s, rel=0.02)
    assert one_layout(solved[1].plan, profile) is None  # its own counts: not one layout


def test_its_run_executes_the_predicted_order_and_trains_as_the_reference(solved):
    profile, solution = solved
    plan = solution.plan
    job = Job(plan=plan, model=CASE.model, steps=STEPS, seed=0, probe_grads=True, trace=True)
    ref = reference_run(job)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    sim = simulate(plan, profile)
    trace = results[0]["trace"]
    for rank in range(plan.world_size):
        predicted = [e.name for e in sim.rank_timeline(rank) if e.lane == "compute" and e.name[:4] in ("fwd ", "bwd ")]
        executed = [name for lane, name, *_ in trace[rank] if name[:4] in ("fwd ", "bwd ")]
        assert executed == predicted, rank
        assert sum(n.startswith("fwd vision") for n in executed) == plan.micro_batches_of(plan.group("vision"))
    check_parity("demo micro-batch", results, ref, loss_rtol=1e-5)


def test_a_case_the_demo_does_not_have_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(MmplanError, match=r"^--case must be one of layouts, micro-batch, got 'bubbles'$"):
        run_demo(tmp_path / "demo", case="bubbles")
    assert not (tmp_path / "demo").exists()


def test_the_case_files_exist():
    cluster = parse_cluster(CASE.cluster)
    assert cluster.world_size == 2 and cluster.device.memory_bytes == 16 * 10**6
    assert CASE.profile_micro_batch == 1 and CASE.global_batch == 16
