"""`mmplan run` left running: a line every N steps on stderr, TensorBoard scalars, no wall-clock limit by default,
and local runs this host cannot hold refused in one line that names the plan's cluster and this host."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.commands import monitor

from planner.commands import run
from planner.cli import app
from tests.cli_helpers import one_line_error

EXAMPLES = Path(__file__).resolve().parents[2] / "plans" / "examples"
PLAN = str(EXAMPLES / "tiny-vlm-pp2.json")
runner = CliRunner()
LINE = re.compile(r"^step (\d+)/5  loss (\d+\.\d{4})  [\d,]+\.\d samples/s  \d+\.\d{3} s/step$")


def test_a_line_every_n_steps_on_stderr_and_the_last_step(tmp_path):
    log = tmp_path / "run.jsonl"
    res = runner.invoke(app, ["run", PLAN, "--steps", "5", "--log-every", "2", "--log", str(log), "--json"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stderr.splitlines() if line.startswith("step ")]
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    assert [int(m[1]) for m in matches] == [2, 4, 5]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [float(m[2]) for m in matches] == [round(rows[s - 1]["loss"], 4) for s in (2, 4, 5)]
    json.loads(res.stdout.strip().splitlines()[-1])  # stdout keeps the JSON summary alone


def test_quiet_and_log_every_zero_print_no_step_lines():
    for extra in (["--quiet"], ["--log-every", "0"]):
        res = runner.invoke(app, ["run", PLAN, "--steps", "2", *extra])
        assert res.exit_code == 0, res.output
        assert not [line for line in res.stderr.splitlines() if line.startswith("step ")], extra


def test_tensorboard_scalars_per_step(tmp_path):
    pytest.importorskip("tensorboard")  # optional; CI has it through torchtitan (the [export] extra)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    res = runner.invoke(app, ["run", PLAN, "--steps", "3", "--tensorboard", str(tmp_path / "tb"), "--quiet"])
    assert res.exit_code == 0, res.output
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"train/loss", "train/step_time_s", "train/samples_per_s"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]


def test_tensorboard_missing_is_one_line(monkeypatch, tmp_path):
    real = monitor.importlib.util.find_spec
    monkeypatch.setattr(monitor.importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    res = runner.invoke(app, ["run", PLAN, "--steps", "1", "--tensorboard", str(tmp_path / "tb")])
    assert "pip install tensorboard" in one_line_error(res)
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("args,needle", [(["--log-every", "-1"], "--log-every"), (["--timeout", "0"], "--timeout"),
                                         (["--op-timeout", "0"], "--op-timeout")])
def test_bad_monitor_options_are_one_line(args, needle):
    assert needle in one_line_error(runner.invoke(app, ["run", PLAN, "--steps", "1", *args]))


def test_no_wall_clock_limit_by_default(monkeypatch):
    seen = {}

    def fake_launch(worker, world, job, **kwargs):
        seen.update(kwargs)
        raise run.MmplanError("stop here")

    import runtime.launch

    monkeypatch.setattr(runtime.launch, "launch", fake_launch)
    one_line_error(runner.invoke(app, ["run", PLAN, "--steps", "1"]))
    assert seen["timeout_s"] is None and seen["op_timeout_s"] == 300.0


def test_a_plan_for_a_large_cluster_is_refused_naming_it_and_this_host():
    line = one_line_error(runner.invoke(app, ["run", str(EXAMPLES / "llava-1.5-13b-solved-64xh100-sxm.json"), "--steps", "1"]))
    assert "cluster 64xh100-sxm (64 ranks)" in line and "this host (" in line and "CPU cores" in line
    assert "torchrun --nnodes 8 --nproc-per-node 8" in line


def test_a_local_run_beyond_this_hosts_memory_is_refused(monkeypatch):
    from runtime import preflight

    monkeypatch.setattr(preflight, "_available_memory", lambda: 1e6)
    line = one_line_error(runner.invoke(app, ["run", PLAN, "--steps", "1"]))
    assert "is for cluster local-cpu (2 ranks)" in line and "rank processes that each build the model" in line and "this host (" in line


def test_a_log_another_run_is_writing_is_refused(monkeypatch, tmp_path):
    """Two runs sharing --log (with --overwrite, each writing at its own offset) tore each other's lines: the run
    holds an flock on its log, and a second run on it stops in one line before launching anything."""
    import runtime.launch
    from runtime.dirlock import FileLock

    launched = []

    def fake_launch(worker, world, job, **kwargs):
        launched.append(job.log)
        raise run.MmplanError("stop here")

    monkeypatch.setattr(runtime.launch, "launch", fake_launch)
    log = tmp_path / "metrics.jsonl"
    held = FileLock(log, "--log").acquire()  # the first run, still writing
    try:
        line = one_line_error(runner.invoke(app, ["run", PLAN, "--steps", "1", "--log", str(log), "--overwrite"]))
    finally:
        held.release()
    assert "--log" in line and "being written by another run" in line and not launched
    line = one_line_error(runner.invoke(app, ["run", PLAN, "--steps", "1", "--log", str(log), "--overwrite"]))
    assert "stop here" in line and launched == [str(log)]
