"""`mmplan compare` and `mmplan calibrate` from the command line: JSON output, traces, measured logs, one-line errors."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import planner.calibrate.calibrate as calibrate_module
from planner.calibrate.fit import to_cluster
from planner.calibrate.settings import Calibration
from cost_models.evaluate import evaluate
from cost_models.cluster_spec import parse_cluster
from planner.solver.baselines import gpipe_even_plan, homogeneous_plan
from planner.cli import app
from plans.cluster import Link
from plans.graph import save_profile
from plans.plan import save_plan

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    d = tmp_path_factory.mktemp("compare")
    profile = profile_model(resolve("tiny-vlm"))
    cluster = parse_cluster("4xlocal-cpu")
    save_profile(profile, d / "profile.json")
    pp2 = homogeneous_plan(profile, cluster, 8, "tp=1,pp=2,dp=2")
    save_plan(pp2, d / "pp2.json")
    save_plan(gpipe_even_plan(profile, cluster, 8), d / "gpipe.json")
    return d, profile, pp2


def one_error_line(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


def test_json_has_the_fields_in_argument_order(files):
    d, _, pp2 = files
    res = invoke("compare", d / "gpipe.json", d / "pp2.json", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [x["plan"] for x in data] == [str(d / "gpipe.json"), str(d / "pp2.json")]
    for key in ("step_time_s", "samples_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes", "bubble_fraction", "fits"):
        assert key in data[0] and key in data[1], key
    assert data[1]["step_time_s"] == pp2.predicted.step_time_s and data[1]["source"] == "plan file"
    assert [m["rank"] for m in data[1]["peak_memory_bytes"]] == [0, 1, 2, 3]
    assert sum(x["best"] for x in data) == 1


def test_table_and_reevaluation_with_a_profile(files):
    d, _, _ = files
    res = invoke("compare", d / "pp2.json", d / "gpipe.json", "--profile", d / "profile.json")
    assert res.exit_code == 0, res.output
    assert "step time" in res.stdout and "best" in res.stdout and "evaluated by the cost model" in res.stdout
    data = json.loads(invoke("compare", d / "pp2.json", "--profile", d / "profile.json", "--json").stdout)
    assert data[0]["source"] == "evaluated"


def test_trace_writes_one_loadable_trace_per_plan(files, tmp_path):
    d, _, _ = files
    out = tmp_path / "traces"
    res = invoke("compare", d / "pp2.json", d / "gpipe.json", "--profile", d / "profile.json", "--trace", out)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["gpipe.trace.json", "pp2.trace.json"]
    trace = json.loads((out / "pp2.trace.json").read_text())
    assert isinstance(trace["traceEvents"], list)
    procs = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted(e["pid"] for e in procs) == [0, 1, 2, 3]  # one per rank
    assert any(e["ph"] == "X" and e["cat"] == "compute" for e in trace["traceEvents"])


def test_measured_log_shows_deviations(files, tmp_path):
    d, profile, pp2 = files
    ev = evaluate(pp2, profile)
    log = tmp_path / "run.jsonl"
    steps = [{"step": s, "loss": 1.0, "step_time_s": 0.1 if s == 0 else 0.02, "compute_s": [0.01] * 4,
              "comm_s": [0.002] * 4, "idle_s": [0.008] * 4, "peak_memory_bytes": [2e8] * 4} for s in range(3)]
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    res = invoke("compare", d / "pp2.json", "--profile", d / "profile.json", "--measured", log, "--json")
    assert res.exit_code == 0, res.output
    measured = json.loads(res.stdout)[0]["measured"]
    assert measured["step_time_s"]["measured"] == 0.02  # the 0.1 s warm-up step is left out
    assert measured["step_time_s"]["deviation_pct"] == pytest.approx((ev.predicted.step_time_s - 0.02) / 0.02 * 100)
    busy = ev.busy[1].compute + ev.busy[1].comm
    assert measured["ranks"][1]["busy_s"]["deviation_pct"] == pytest.approx((busy - 0.012) / 0.012 * 100)
    res = invoke("compare", d / "pp2.json", "--measured", log)
    assert res.exit_code == 0 and "predicted vs measured" in res.stdout and "rank 3 busy" in res.stdout


@pytest.mark.parametrize("case", ["missing", "not-json", "schema", "bad-measured", "two-with-measured",
                                  "trace-without-profile", "no-predictions", "wrong-profile"])
def test_bad_inputs_exit_2_with_one_line(files, tmp_path, case):
    d, profile, pp2 = files
    plan = d / "pp2.json"
    args, needle = {
        "missing": ([tmp_path / "nope.json"], "cannot read plan"),
        "not-json": ([_write(tmp_path / "x.json", "{oops")], "is not valid JSON"),
        "schema": ([_write(tmp_path / "v9.json", plan.read_text().replace('"mmplan.plan/3"', '"mmplan.plan/9"'))],
                   "schema 'mmplan.plan/9'"),
        "bad-measured": ([plan, "--measured", _write(tmp_path / "r.jsonl", '{"step": 0}\n')], "lacks field"),
        "two-with-measured": ([plan, plan, "--measured", _write(tmp_path / "empty.jsonl", "")], "one plan"),
        "trace-without-profile": ([plan, "--trace", tmp_path / "t"], "--trace needs --profile"),
        "no-predictions": ([_write(tmp_path / "bare.json", _without_predictions(plan.read_text()))], "--profile"),
        "wrong-profile": ([plan, "--profile", _write(tmp_path / "p.json", "[]")], "profile"),
    }[case]
    line = one_error_line(invoke("compare", *args))
    assert needle in line, line


def _write(path, text):
    path.write_text(text)
    return path


def _without_predictions(text: str) -> str:
    data = json.loads(text)
    data.pop("predicted")
    return json.dumps(data)


# --- calibrate ----------------------------------------------------------------------------------------------------

def fake_calibration(**kw):
    return Calibration(
        device_name="cpu: Test CPU", ranks=2, gpus_per_node=2, backend="gloo", matmul=((64, 2e10), (256, 4e10)),
        peak_flops={"fp32": 4e10, "bf16": 8e10, "fp16": 1e9}, memory_bandwidth=2e10, copy=Link(1e10, 1e-6),
        host_to_device=Link(1e10, 1e-6), all_reduce=Link(1e9, 1e-4), p2p=Link(2e9, 5e-5), disk_write=Link(1e9, 2e-4),
        disk_read=Link(2e9, 1e-4), host_memory_bytes=16 * 2**30, device_memory_bytes=8 * 2**30,
        disk_free_bytes=10**11, wall_s=1.0)


def test_calibrate_writes_a_cluster_toml_and_prints_what_it_measured(tmp_path, monkeypatch):
    seen = {}

    def measure(**kw):
        seen.update(kw)
        kw["progress"]("matmul", 0.5)
        return fake_calibration()

    monkeypatch.setattr(calibrate_module, "measure", measure)
    out = tmp_path / "here.toml"
    res = invoke("calibrate", "-o", out, "--quick", "--ranks", 3)
    assert res.exit_code == 0, res.output
    assert seen["quick"] is True and seen["ranks"] == 3
    cluster = parse_cluster(str(out))
    assert cluster == to_cluster(fake_calibration())
    for needle in ("fp32 peak (matmul)", "40.0 GFLOP/s", "memory bandwidth", "all-reduce", "disk write", "catalog local-cpu",
                   f"--cluster {out}"):
        assert needle in res.stdout, needle


def test_calibrate_fails_before_measuring_when_the_output_is_unwritable(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate_module, "measure", lambda **kw: pytest.fail("measured anyway"))
    line = one_error_line(invoke("calibrate", "-o", tmp_path / "missing" / "c.toml"))
    assert "does not exist" in line
