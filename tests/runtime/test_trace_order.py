"""One truth: for every example plan, the task order each rank's runtime executes is the simulator's
predicted order; a measured run's trace (mmplan run --trace) has the predicted trace's names and processes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cost_models.evaluate import evaluate
from cost_models.pipeline import simulate
from cost_models.trace import chrome_trace
from planner.profiler.profile import profile_model
from plans.plan import load_plan
from plans.trace import task_events
from runtime.stage_map import build_stage_map
from runtime.program import trace_program
from runtime.schedule import rank_tasks
from runtime.source import call_factory, resolve

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "plans" / "examples").glob("*.json"))
_PROFILES: dict = {}


def _profile(model: str):
    if model not in _PROFILES:
        _PROFILES[model] = profile_model(resolve(model))
    return _PROFILES[model]


def _compute_order(events) -> list[str]:
    return [e.name for e in events if e.lane == "compute" and e.name[:4] in ("fwd ", "bwd ")]


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.name.startswith("tiny-")]
                         + [pytest.param(p, marks=pytest.mark.slow) for p in EXAMPLES if not p.name.startswith("tiny-")],
                         ids=lambda p: p.stem)
def test_runtime_order_is_the_predicted_order(path: Path) -> None:
    plan = load_plan(path)
    model = plan.profile.model
    prof = _profile(model)
    with torch.device("meta"):
        module, batch = call_factory(resolve(model), 1)
    from plans.plan import check_plan

    plan = check_plan(plan, prof)
    stage_map = build_stage_map(plan, trace_program(module, batch))
    sim = simulate(plan, prof)
    ranks = sorted({r for g in plan.groups for r in g.ranks})
    for rank in ranks[:: max(1, len(ranks) // 16)]:  # every rank of a small plan; a sample of a large one
        executed = [t.name for t in rank_tasks(stage_map, plan.training.schedule, rank)]
        assert executed == _compute_order(sim.rank_timeline(rank)), (path.name, rank)


def test_measured_trace_has_the_predicted_names_and_processes(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from planner.cli import app

    path = next(p for p in EXAMPLES if p.name.startswith("tiny-vlm-colocated"))
    out = tmp_path / "measured.json"
    result = CliRunner().invoke(app, ["run", str(path), "--steps", "2", "--trace", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    measured = json.loads(out.read_text())
    plan = load_plan(path)
    predicted = chrome_trace(evaluate(plan, _profile(plan.profile.model)), ranks=range(plan.world_size))
    want = {r: [n for n in names if n[:4] in ("fwd ", "bwd ")] for r, names in task_events(predicted).items()}
    got = {r: [n for n in names if n[:4] in ("fwd ", "bwd ")] for r, names in task_events(measured).items()}
    assert got == want
    pids = {e["pid"] for e in measured["traceEvents"]}
    assert pids == {e["pid"] for e in predicted["traceEvents"]} == set(range(plan.world_size))


def test_an_interleaved_plan_from_solve_runs_in_the_predicted_order(tmp_path: Path) -> None:
    """`mmplan solve --baseline homogeneous --layout ...,schedule=interleaved:2` emits a plan `run` trains (PP2,
    v = 2): every rank runs its chunks' tasks in the schedule the simulator times, with the same names."""
    from typer.testing import CliRunner

    from planner.cli import app

    prof, path, out = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "measured.json"
    runner = CliRunner()
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(prof)]).exit_code == 0
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "8", "--baseline", "homogeneous",
                              "--layout", "tp=1,pp=2,dp=1,micro-batch=2,schedule=interleaved:2", "-o", str(path)])
    assert res.exit_code == 0, res.output
    plan = load_plan(path)
    assert plan.training.schedule == "interleaved" and plan.training.virtual_stages == 2
    result = runner.invoke(app, ["run", str(path), "--steps", "2", "--trace", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    predicted = chrome_trace(evaluate(plan, _profile(plan.profile.model)), ranks=range(plan.world_size))
    want = {r: [n for n in names if n[:4] in ("fwd ", "bwd ")] for r, names in task_events(predicted).items()}
    got = {r: [n for n in names if n[:4] in ("fwd ", "bwd ")] for r, names in task_events(json.loads(out.read_text())).items()}
    assert got == want
    assert any(" s0.1 " in n for n in got[0])  # the second chunk of stage 0 ran, named as predicted
