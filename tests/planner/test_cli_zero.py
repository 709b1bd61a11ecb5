"""`mmplan solve --baseline homogeneous --layout ...,zero=N` -> `mmplan run`: ZeRO plans train like zero=0 ones."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from planner.cli import app
from tests.cli_helpers import one_line_error

runner = CliRunner()


def _solve(tmp_path, prof, zero: int):
    plan = tmp_path / f"zero{zero}.json"
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "8", "--baseline", "homogeneous",
                              "--layout", f"tp=1,pp=1,dp=2,zero={zero}", "-o", str(plan)])
    assert res.exit_code == 0, res.output
    assert [g["zero"] for g in json.loads(plan.read_text())["groups"]] == [zero]
    return plan


def _losses(plan) -> list[float]:
    res = runner.invoke(app, ["run", str(plan), "--steps", "4", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])["losses"]


def test_a_zero3_homogeneous_plan_trains_with_the_losses_of_zero0(tmp_path):
    prof = tmp_path / "vlm.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(prof)]).exit_code == 0
    want = _losses(_solve(tmp_path, prof, 0))
    got = _losses(_solve(tmp_path, prof, 3))
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)


def test_zero_with_tiers_fsdp2_cannot_hold_is_refused_in_one_line(tmp_path):
    prof = tmp_path / "vlm.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(prof)]).exit_code == 0
    plan = _solve(tmp_path, prof, 3)
    data = json.loads(plan.read_text())
    data["groups"][0]["stages"][0]["memory"]["params"] = "cpu"  # gradients left on the GPU: FSDP2 cannot split them
    plan.write_text(json.dumps(data))
    line = one_line_error(runner.invoke(app, ["run", str(plan), "--steps", "1"]))
    assert "ZeRO stage 3" in line and "parameters in 'cpu', gradients in 'gpu'" in line
