"""`mmplan run` end to end: trains a plan on local gloo ranks, logs JSONL, refuses plans for other models."""
from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from planner.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "plans" / "examples"
runner = CliRunner()


def test_run_a_hand_written_plan_logs_every_step(tmp_path):
    log = tmp_path / "run.jsonl"
    res = runner.invoke(app, ["run", str(EXAMPLES / "tiny-vlm-pp2.json"), "--steps", "4", "--log", str(log), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert summary["losses"] == [r["loss"] for r in rows]
    for r in rows:
        assert len(r["compute_s"]) == len(r["comm_s"]) == len(r["peak_memory_bytes"]) == 2
        assert r["step_time_s"] > 0


def test_run_refuses_a_plan_for_another_model(tmp_path):
    res = runner.invoke(app, ["run", str(EXAMPLES / "tiny-vlm-pp2.json"), "--model", "tiny-avlm", "--steps", "1"])
    assert res.exit_code == 2
    assert "fingerprint" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_run_refuses_a_launch_of_the_wrong_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    res = runner.invoke(app, ["run", str(EXAMPLES / "tiny-vlm-pp2.json"), "--steps", "1"])
    assert res.exit_code == 2 and "needs 2 ranks" in res.stderr and "launched with 3" in res.stderr


def test_run_rejects_zero_steps():
    res = runner.invoke(app, ["run", str(EXAMPLES / "tiny-vlm-pp2.json"), "--steps", "0"])
    assert res.exit_code == 2 and "--steps" in res.stderr
