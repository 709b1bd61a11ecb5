"""Issue 30: `mmplan demo` cannot fail because of its own choices. Its cluster offers an NVMe tier and whether the
solver uses it depended on the profile measured that time (3 of 3 demos failed on a busy machine with "give a
directory for it with --nvme-dir", an option demo does not have). Each tier choice is forced here -- the solver's
plans replaced by ones keeping state on the GPU, the host, NVMe, activations offloaded to NVMe -- and every run
must get what that plan needs; on a failure the demo keeps what it wrote and says where. The runs themselves are
stood in for (the default demo trains for real in tests/test_readme.py)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import planner.commands.run as run_module
import planner.profiler.profile as profile_module
import planner.solver.solve as solve_module
from planner.commands.demo import NVME_DIR, run_demo
from plans.errors import MmplanError
from plans.plan import load_plan

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "plans" / "examples" / "tiny-vlm-dp2.json"


def _forced(plan, tier: str):
    def memory(stage):
        if tier == "offload-nvme":
            return replace(stage.memory, activations={b: "offload-nvme" for b in stage.blocks})
        return replace(stage.memory, optimizer=tier)

    groups = tuple(replace(g, stages=tuple(replace(s, memory=memory(s)) for s in g.stages)) for g in plan.groups)
    return replace(plan, groups=groups)


def _uses_nvme(plan) -> bool:
    return any(s.memory.optimizer == "nvme" or "offload-nvme" in s.memory.activations.values()
               for g in plan.groups for s in g.stages)


@pytest.fixture(scope="module")
def tiny_profile():
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    return profile_model(resolve("tiny-vlm"))


@pytest.fixture
def demo_parts(monkeypatch, tiny_profile):
    """The demo with its profile, solve and runs stood in for; returns the calls the runs got."""
    calls: list[dict] = []
    monkeypatch.setattr(profile_module, "profile_model", lambda *a, **k: tiny_profile)

    def set_tier(tier: str):
        plan = load_plan(PLAN)
        solution = SimpleNamespace(plan=_forced(plan, tier), baselines={"homogeneous": _forced(plan, tier)},
                                   solve_time_s=0.0)
        monkeypatch.setattr(solve_module, "solve", lambda *a, **k: solution)

    def fake_run(path, **kw):
        plan = load_plan(path)
        if _uses_nvme(plan) and kw.get("nvme_dir") is None:  # what `mmplan run` refuses (issue 30's failure)
            raise MmplanError("the plan places state in the nvme tier: give a directory for it with --nvme-dir")
        calls.append({"plan": plan, **kw})
        return SimpleNamespace(metrics=[{"step_time_s": 0.01}] * kw["steps"])

    monkeypatch.setattr(run_module, "run_plan", fake_run)
    return set_tier, calls


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme", "offload-nvme"])
def test_every_tier_the_solver_may_choose_runs(tmp_path, demo_parts, tier):
    set_tier, calls = demo_parts
    set_tier(tier)
    out = tmp_path / "demo"
    result = run_demo(out, model="tiny-vlm", cluster="2xlocal-cpu", global_batch=8, steps=2, runs=1, calibrate=False)
    assert result.solved.measured_step_s > 0 and len(calls) == 2
    for call in calls:
        nvme = call.get("nvme_dir")
        assert nvme is not None and Path(nvme).parent == out and Path(nvme).name == NVME_DIR  # under the output directory


def test_a_failed_demo_keeps_what_it_wrote_and_says_where(tmp_path, demo_parts, monkeypatch):
    set_tier, _ = demo_parts
    set_tier("gpu")

    def failing(path, **kw):
        raise MmplanError("a rank ran out of memory")

    monkeypatch.setattr(run_module, "run_plan", failing)
    out = tmp_path / "demo"
    with pytest.raises(MmplanError, match=rf"^a rank ran out of memory \(what the demo wrote is kept in {out}\)$"):
        run_demo(out, model="tiny-vlm", cluster="2xlocal-cpu", global_batch=8, steps=2, runs=1, calibrate=False)
    assert {"profile.json", "plan.json", "cluster.toml"} <= {p.name for p in out.iterdir()}
