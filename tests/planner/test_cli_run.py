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
    for name, value in {"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RUN_ID": "job"}.items():
        monkeypatch.setenv(name, value)
    res = runner.invoke(app, ["run", str(EXAMPLES / "tiny-vlm-pp2.json"), "--steps", "1"])
    assert res.exit_code == 2 and "needs 2 ranks" in res.stderr and "launched with 3" in res.stderr


def test_run_rejects_zero_steps():
    res = runner.invoke(app, ["run", str(EXAMPLES / "tiny-vlm-pp2.json"), "--steps", "0"])
    assert res.exit_code == 2 and "--steps" in res.stderr


def test_a_plan_from_a_bf16_profile_with_two_colocated_groups_trains(tmp_path):
    """Plans of bf16 (and --group, --measure) profiles run: the fingerprint is structural, and run re-profiles nothing."""
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "--dtype", "bf16", "-o", str(prof), "--group", "llm.head=head"]).exit_code == 0
    # the solver's own colocated plan (solve itself emits the homogeneous baseline when that predicts faster)
    from cost_models.cluster_spec import parse_cluster
    from planner.solver.solve import solve
    from plans.graph import load_profile
    from plans.plan import save_plan

    save_plan(solve(load_profile(prof), parse_cluster("2xlocal-cpu"), 8, placement="colocated", baseline=False).plan, plan)
    assert len(json.loads(plan.read_text())["groups"]) > 1
    res = runner.invoke(app, ["run", str(plan), "--steps", "3", "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["losses"]) == 3


def test_a_model_whose_data_flow_differs_from_the_plan_is_refused(tmp_path):
    """The traced model must read, across stages, what the plan routes (one clear line, before training)."""
    data = json.loads((EXAMPLES / "tiny-vlm-pp2.json").read_text())
    prof = tmp_path / "p.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(prof)]).exit_code == 0
    flow = json.loads(prof.read_text())
    data["flow"] = {"blocks": [{"name": b["name"], "output_bytes": b["output_bytes"]} for b in flow["blocks"]],
                    "edges": [[e["src"], e["dst"]] for e in flow["edges"] if e["dst"] != "llm.layers.0"], "loss": flow["loss"]}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    res = runner.invoke(app, ["run", str(plan), "--steps", "1"])
    assert res.exit_code == 2
    assert "traced data flow differs from the plan's" in res.output and "Traceback" not in res.output


def test_run_trains_a_sequence_parallel_plan_with_selective_recompute(tmp_path):
    """Group.sequence_parallel and the 'selective' activation tier are accepted and trained (tp2 LLM)."""
    from plans.plan import save_plan
    from tests.runtime.test_vocab_sequence_parallel import tiny_plan

    plan = tmp_path / "sp.json"
    save_plan(tiny_plan(sp=True, tier="selective"), plan)
    res = runner.invoke(app, ["run", str(plan), "--steps", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["losses"]) == 2


def test_a_sequence_the_tp_size_does_not_divide_is_padded_and_trains(tmp_path):
    """The ViT's 17 tokens under sequence parallelism at tp=2: padded to 18 (runtime/sequence_parallel.py), not refused."""
    from dataclasses import replace

    from plans.plan import check_plan, save_plan
    from tests.runtime.plan_builder import make_plan, profile

    plan = make_plan("tiny-vlm", [{"name": "all", "tp": 2, "stages": [(["vision", "vision_proj", "llm"], [0, 1])]}])
    plan = check_plan(replace(plan, groups=tuple(replace(g, sequence_parallel=True) for g in plan.groups)),
                      profile("tiny-vlm"))
    save_plan(plan, tmp_path / "sp.json")
    res = runner.invoke(app, ["run", str(tmp_path / "sp.json"), "--steps", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["losses"]) == 1


def test_run_refuses_what_it_would_silently_not_do(tmp_path):
    """An fp16 plan (the runtime has no loss scaling) and --checkpoint-dir without --checkpoint-every (nothing would
    be written): one line, exit 2, before any rank starts, nothing created."""
    from plans.plan import load_plan, save_plan
    import dataclasses

    plan = load_plan(EXAMPLES / "tiny-vlm-pp2.json")
    fp16 = tmp_path / "fp16.json"
    save_plan(dataclasses.replace(plan, training=dataclasses.replace(plan.training, dtype="fp16")), fp16)
    res = runner.invoke(app, ["run", str(fp16), "--steps", "1"])
    assert res.exit_code == 2 and "not 'fp16'" in res.output and len(res.output.strip().splitlines()) == 1
    ck = tmp_path / "ck"
    res = runner.invoke(app, ["run", str(EXAMPLES / "tiny-vlm-pp2.json"), "--steps", "1", "--checkpoint-dir", str(ck)])
    assert res.exit_code == 2 and "--checkpoint-every" in res.output and not ck.exists()


def test_a_plan_without_predictions_still_reports_its_step_and_a_bad_lr_stops_before_launch(tmp_path):
    import json

    data = json.loads((EXAMPLES / "tiny-vlm-pp2.json").read_text())
    data.pop("predicted", None)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    res = runner.invoke(app, ["run", str(bare), "--steps", "3"])
    assert res.exit_code == 0 and "measured step" in res.output and "loss " in res.output
    res = runner.invoke(app, ["run", str(bare), "--steps", "1", "--lr", "-1"])
    assert res.exit_code == 2 and "--lr must be" in res.output and "rank" not in res.output
