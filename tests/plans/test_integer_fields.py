"""Issue 30: integers written as floats (`"global_batch": 8.0`, `"dp": 1.0`) passed the schema (jsonschema counts 8.0
as an integer) and crashed compare, run and export with a traceback; the schemas' integers are now Python ints, and
such files are refused at load in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from tests.cli_helpers import one_line_error

REPO = Path(__file__).resolve().parents[2]
DP2 = REPO / "plans" / "examples" / "tiny-vlm-dp2.json"
runner = CliRunner()


def _plan(tmp_path: Path, edit) -> Path:
    doc = json.loads(DP2.read_text())
    edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["training"].update(global_batch=8.0), "training/global_batch: 8.0 is not of type 'integer'"),
    (lambda d: d["groups"][0].update(dp=2.0), "groups/0/dp: 2.0 is not of type 'integer'"),
])
@pytest.mark.parametrize("command", [["compare"], ["export", "--to", "deepspeed", "--lossy"], ["run", "--steps", "1"]])
def test_a_plan_with_an_integer_written_as_a_float_is_refused_in_one_line(tmp_path, edit, field, command):
    plan = _plan(tmp_path, edit)
    line = one_line_error(runner.invoke(app, [command[0], str(plan), *command[1:]]))
    assert field in line, line


def test_a_profile_with_an_integer_written_as_a_float_is_refused(tmp_path):
    from planner.profiler.profile import profile_model
    from plans.graph import save_profile
    from runtime.source import resolve

    path = tmp_path / "p.json"
    save_profile(profile_model(resolve("tiny-vlm")), path)
    doc = json.loads(path.read_text())
    doc["micro_batch"] = 1.0
    path.write_text(json.dumps(doc))
    line = one_line_error(runner.invoke(app, ["show", str(path)]))
    assert "field micro_batch: 1.0 is not of type 'integer'" in line, line


def test_a_cluster_file_with_an_integer_written_as_a_float_is_refused(tmp_path):
    from cost_models.cluster_toml import cluster_from_toml
    from plans.errors import FormatError

    with pytest.raises(FormatError, match="gpus_per_node"):
        cluster_from_toml('base = "h100-sxm"\ngpus_per_node = 8.0\n', source="c.toml")
