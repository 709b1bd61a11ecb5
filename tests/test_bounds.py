"""Every size read from a file or an option is bounded before work proportional to it begins: huge batches, endless
files, rank numbers; and plans or profiles that cannot work (a cyclic data flow, a tp that does not divide the heads)
are refused before anything starts."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.solver.space import divisors, micro_batch_counts
from planner.cli import app
from plans.limits import MAX_FILE_BYTES, MAX_GLOBAL_BATCH, MAX_MICRO_BATCHES
from plans.serial import schema
from tests.cli_helpers import one_line_error

REPO = Path(__file__).resolve().parents[1]
PP2 = REPO / "plans" / "examples" / "tiny-vlm-pp2.json"
runner = CliRunner()


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prof") / "tiny-vlm.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(path), "--quiet"]).exit_code == 0
    return path


def test_divisors_take_square_root_time_and_are_exact():
    for n in range(1, 3000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    t0 = time.monotonic()
    assert len(divisors(10**12)) == 169
    assert time.monotonic() - t0 < 2
    assert max(micro_batch_counts(10**12)) <= MAX_MICRO_BATCHES


def test_the_schema_states_the_same_bounds_as_the_code():
    training = schema("plan")["$defs"]["training"]["properties"]
    assert training["global_batch"]["maximum"] == MAX_GLOBAL_BATCH
    assert training["micro_batches"]["maximum"] == MAX_MICRO_BATCHES


@pytest.mark.parametrize("args, words", [
    (["--global-batch", "1000000000000"], "more than 16,777,216 samples"),
    (["--global-batch", str(2**20), "--micro-batch", "1"], "micro-batches per step"),
])
def test_solve_refuses_a_batch_beyond_the_bounds_at_once(profile, tmp_path, args, words):
    t0 = time.monotonic()
    res = runner.invoke(app, ["solve", str(profile), "--cluster", "2xlocal-cpu", "-o", str(tmp_path / "p.json"),
                              "--time-limit", "5", *args])
    assert words in one_line_error(res) and time.monotonic() - t0 < 5
    assert not (tmp_path / "p.json").exists()


def test_solve_at_the_largest_global_batch_answers_within_its_time_limit(profile, tmp_path):
    t0 = time.monotonic()
    res = runner.invoke(app, ["solve", str(profile), "--cluster", "2xlocal-cpu", "-o", str(tmp_path / "p.json"),
                              "--time-limit", "5", "--global-batch", str(MAX_GLOBAL_BATCH), "--quiet"])
    assert time.monotonic() - t0 < 5 + 5  # the limit, and the final simulation and writing after it
    assert res.exit_code in (0, 2), res.output
    assert (res.exit_code == 0) == (tmp_path / "p.json").exists()


def huge_plan(tmp_path: Path, **training) -> Path:
    doc = json.loads(PP2.read_text())
    doc["training"].update(training)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("command", [["compare"], ["run", "--steps", "1"], ["show"]])
def test_a_plan_of_10_to_the_12_micro_batches_is_refused_when_read(tmp_path, command):
    plan = huge_plan(tmp_path, global_batch=10**12, micro_batches=10**12)
    t0 = time.monotonic()
    res = runner.invoke(app, [command[0], str(plan), *command[1:]])
    one_line_error(res)
    assert time.monotonic() - t0 < 20


def test_run_refuses_a_plan_whose_step_does_not_fit_this_machine_before_launch(tmp_path):
    plan = huge_plan(tmp_path, global_batch=MAX_GLOBAL_BATCH, micro_batches=MAX_MICRO_BATCHES)
    line = one_line_error(runner.invoke(app, ["run", str(plan), "--steps", "1"]))
    assert "available" in line and "16,777,216" in line


LARGER = f"larger than {MAX_FILE_BYTES / 2**20:g} MiB"


@pytest.mark.parametrize("command, words", [
    (["show", "{zero}"], LARGER),
    (["compare", "{zero}"], LARGER),
    (["compare", str(PP2), "--measured", "{zero}"], LARGER),
    (["solve", "{zero}", "--cluster", "2xlocal-cpu", "--global-batch", "8", "-o", "{out}"], LARGER),
    (["solve", "{profile}", "--cluster", "{zero}", "--global-batch", "8", "-o", "{out}"], LARGER),
    (["run", "{zero}"], LARGER),
    (["profile", "{zero_toml}", "-o", "{out}"], "is not a regular file"),
])
def test_an_endless_input_file_is_refused_after_a_bounded_read(profile, tmp_path, command, words):
    zero_toml = tmp_path / "zero.toml"
    zero_toml.symlink_to("/dev/zero")
    args = [a.format(zero="/dev/zero", zero_toml=zero_toml, out=tmp_path / "out.json", profile=profile) for a in command]
    t0 = time.monotonic()
    line = one_line_error(runner.invoke(app, args))
    assert words in line
    assert time.monotonic() - t0 < 20 and not (tmp_path / "out.json").exists()


def test_a_cyclic_profile_is_refused(profile, tmp_path):
    doc = json.loads(profile.read_text())
    first = doc["edges"][0]
    doc["edges"].append({"src": first["dst"], "dst": first["src"], "bytes": 1.0})
    bad = tmp_path / "cyclic.json"
    bad.write_text(json.dumps(doc))
    line = one_line_error(runner.invoke(app, ["show", str(bad)]))
    assert "cycle" in line and f"{first['src']} -> {first['dst']} -> {first['src']}" in line


def test_a_tp_that_does_not_divide_the_heads_is_refused_before_launch(tmp_path):
    from plans.serial import to_data
    from tests.runtime.plan_builder import make_plan

    plan = to_data(make_plan("tiny-vlm", [{"name": "all", "tp": 2, "stages": [(["vision", "vision_proj", "llm"], [0, 1])]}]))
    plan["groups"][0].update(tp=3)
    plan["groups"][0]["stages"][0]["ranks"] = [0, 1, 2]
    plan["cluster"]["gpus_per_node"] = 3
    plan.pop("flow", None)  # a hand-edited plan: run takes the flow from the traced model
    path = tmp_path / "tp3.json"
    path.write_text(json.dumps(plan))
    t0 = time.monotonic()
    line = one_line_error(runner.invoke(app, ["run", str(path), "--steps", "1"]))
    assert "tp=3" in line and "heads=4" in line and time.monotonic() - t0 < 30


def test_a_shortfall_is_shown_in_a_unit_that_shows_it():
    from plans.units import short_by

    assert short_by(8.004e9, 8e9) == "(4.0 MB short)"
    assert short_by(9e9, 8e9) == "(1.0 GB short)"
    assert not math.isnan(float(short_by(1, 0).split()[0][1:]))
