"""`mmplan profile --freeze PATTERN`: stored in the profile, lowers the solved plan's predicted memory, and `mmplan run`
leaves the frozen blocks' parameters as they were built; a pattern matching nothing is a one-line error."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from planner.cli import app
from tests.cli_helpers import one_line_error

runner = CliRunner()


def _profile_and_solve(tmp_path, *freeze: str):
    prof, plan = tmp_path / f"p{len(freeze)}.json", tmp_path / f"plan{len(freeze)}.json"
    args = [a for p in freeze for a in ("--freeze", p)]
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(prof), *args]).exit_code == 0
    # one layout for both, so that the predicted peaks differ by the freezing alone (the solver may choose differently)
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "8", "-o", str(plan),
                              "--baseline", "homogeneous", "--layout", "tp=1,pp=1,dp=2"])
    assert res.exit_code == 0, res.output
    return json.loads(prof.read_text()), plan


def test_freezing_the_vision_tower_lowers_predicted_memory_and_keeps_its_weights(tmp_path):
    from plans.plan import load_plan
    from runtime.checkpoint import latest_checkpoint
    from runtime.checkpoint_dcp import read_blocks
    from runtime.rank import build_model
    from runtime.train import Job

    plain, plain_plan = _profile_and_solve(tmp_path)
    frozen, frozen_plan = _profile_and_solve(tmp_path, "vision.*")
    assert frozen["options"]["freeze"] == ["vision.*"] and "freeze" not in plain["options"]
    assert frozen["fingerprint"] == plain["fingerprint"]  # freezing is not structure: plans stay checkable
    vision = [b["name"] for b in frozen["blocks"] if b["name"].startswith("vision.")]
    assert vision and all(b.get("frozen", False) == b["name"].startswith("vision.") for b in frozen["blocks"])
    peak = lambda p: max(m["gpu"] for m in json.loads(p.read_text())["predicted"]["memory"])  # noqa: E731
    assert peak(frozen_plan) < peak(plain_plan)

    ckpt = tmp_path / "ckpt"
    res = runner.invoke(app, ["run", str(frozen_plan), "--steps", "3", "--checkpoint-every", "3", "--checkpoint-dir", str(ckpt)])
    assert res.exit_code == 0, res.output
    initial = dict(build_model(Job(plan=load_plan(frozen_plan), model="tiny-vlm", steps=1))[0].named_parameters())
    saved = read_blocks(latest_checkpoint(str(ckpt)))
    for block in vision:
        params, _ = saved[block]
        assert all(t.equal(initial[n].detach()) for n, t in params.items()), block
    params, _ = saved["vision_proj"]
    assert any(not t.equal(initial[n].detach()) for n, t in params.items())


def test_a_freeze_pattern_matching_no_block_is_refused(tmp_path):
    line = one_line_error(runner.invoke(app, ["profile", "tiny-vlm", "-o", str(tmp_path / "p.json"), "--freeze", "visual.*"]))
    assert "--freeze 'visual.*' matches no block" in line and not (tmp_path / "p.json").exists()


def test_freezing_everything_is_refused(tmp_path):
    line = one_line_error(runner.invoke(app, ["profile", "tiny-vlm", "-o", str(tmp_path / "p.json"), "--freeze", "*"]))
    assert "nothing would train" in line
