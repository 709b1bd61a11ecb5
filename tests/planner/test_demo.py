"""`mmplan demo --json` on a small setting (tiny-vlm, 2 local ranks, 2 steps, 1 run per plan, no calibration): the
shape of the object, and that its figures are the plans' and the runs' own. The default demo itself runs in
tests/test_readme.py (the quickstart command)."""
from __future__ import annotations

import json
import statistics

import pytest

from planner.commands.demo import DEFAULT_CLUSTER, DEFAULT_MODEL, run_demo
from planner.commands.report import demo_json
from plans.plan import load_plan


@pytest.mark.slow  # ~10 s quiet, ~20 s on a loaded 2-core box: `python -m pytest -m slow tests/planner/test_demo.py`
def test_demo_json_shape_on_a_small_setting(tmp_path):
    result = run_demo(tmp_path / "demo", model="tiny-vlm", cluster="2xlocal-cpu", global_batch=4, steps=2, runs=1,
                      calibrate=False)
    out = json.loads(json.dumps(demo_json(result)))
    kind = out["homogeneous"]["baseline"]
    assert kind in out["baselines"] and out["baselines"][kind] == {k: v for k, v in out["homogeneous"].items() if k != "baseline"}
    # the baseline reported is the one that measured fastest of those trained
    assert out["homogeneous"]["measured_step_s"] == min(b["measured_step_s"] for b in out["baselines"].values())
    for name, entry in (("solved", out["solved"]), *out["baselines"].items()):
        assert {"layout", "predicted_step_s", "measured_step_s"} <= set(entry)
        assert entry["predicted_step_s"] > 0 and entry["measured_step_s"] > 0 and len(entry["runs_s"]) == 1
        plan = load_plan(tmp_path / "demo" / ("plan.json" if name == "solved" else f"{name}.json"))
        assert entry["predicted_step_s"] == plan.predicted.step_time_s
        rows = [json.loads(line) for line in (tmp_path / "demo" / f"run-{name}.jsonl").read_text().splitlines()]
        assert entry["measured_step_s"] == statistics.median(r["step_time_s"] for r in rows)
    assert out["predicted_speedup"] == pytest.approx(out["homogeneous"]["predicted_step_s"] / out["solved"]["predicted_step_s"])
    assert out["measured_speedup"] == pytest.approx(out["homogeneous"]["measured_step_s"] / out["solved"]["measured_step_s"])
    assert set(out["baselines"]) <= {"homogeneous", "megatron"} and len(out["load"]) == 1 + len(out["baselines"])
    assert len(out["machine_speed"]) == 1 and out["machine_speed"][0] > 0  # one round of runs, timed before it


def test_the_default_setting_exists():
    from cost_models.cluster_spec import parse_cluster
    from runtime.source import resolve

    cluster = parse_cluster(DEFAULT_CLUSTER)
    assert cluster.world_size == 2 and cluster.device.memory_bytes == 160 * 10**6
    assert resolve(DEFAULT_MODEL).name == "runtime.models.conv_vlm:factory"
