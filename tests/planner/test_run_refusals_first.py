"""Issue 30: every refusal of `mmplan run` that needs no model comes before the model is built and traced (options,
files, the host's size, a mistyped model, torchrun's variables), and stray torchrun variables are named in one line
instead of waiting up to --op-timeout. "Before" is checked by making the model's build fail the test, not by time."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import planner.commands.run as run_module
from planner.cli import app
from tests.cli_helpers import one_line_error

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "plans" / "examples"
PP2 = EXAMPLES / "tiny-vlm-pp2.json"
runner = CliRunner()
TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def no_model(monkeypatch):
    """Building or tracing the model, or launching ranks, fails the test."""
    def built(*_a, **_k):
        raise AssertionError("the model was built before the refusal")

    monkeypatch.setattr(run_module, "check_model", built)
    monkeypatch.setattr(run_module, "_train_owning", built)
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)


def _log_with_rows(tmp_path: Path) -> Path:
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 1}\n')
    return log


@pytest.mark.parametrize("case, args, words", [
    ("negative steps", lambda t: [PP2, "--steps", "-5"], "--steps"),
    ("an existing log", lambda t: [PP2, "--steps", "1", "--log", _log_with_rows(t)], "already holds a run's log"),
    ("no checkpoint to resume", lambda t: [PP2, "--steps", "1", "--resume", t / "none"], "no such checkpoint directory"),
    ("a checkpoint dir that is a file", lambda t: [PP2, "--steps", "1", "--checkpoint-every", "1", "--checkpoint-dir",
                                                   _log_with_rows(t)], "is a file"),
    ("a 128-GPU plan here", lambda t: [EXAMPLES / "vit22b-llama70b-non-colocated-128xh100-sxm.json", "--steps", "1"],
     "torchrun"),
    ("a mistyped zoo name", lambda t: [PP2, "--steps", "1", "--model", "tiny-vlmm"], "unknown model 'tiny-vlmm'"),
])
def test_refusals_that_need_no_model_come_first(no_model, tmp_path, case, args, words):
    line = one_line_error(runner.invoke(app, ["run", *map(str, args(tmp_path))]))
    assert words in line, (case, line)


def test_an_hf_model_without_transformers_is_refused_before_the_build(no_model, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    config = REPO / "runtime" / "models" / "hf_configs"
    spec = next(p for p in config.rglob("config.json"))
    line = one_line_error(runner.invoke(app, ["run", str(PP2), "--steps", "1", "--model", f"hf:{spec}"]))
    assert "transformers" in line


@pytest.mark.parametrize("env, named", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "not MASTER_ADDR, MASTER_PORT"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "TORCHELASTIC_RUN_ID is unset"),
    ({"MASTER_PORT": "29500"}, "not RANK, WORLD_SIZE, MASTER_ADDR"),
])
def test_stray_torchrun_variables_are_named_instead_of_waiting(no_model, monkeypatch, env, named):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = one_line_error(runner.invoke(app, ["run", str(PP2), "--steps", "1"]))
    assert named in line and all(f"{k}={v}" in line for k, v in env.items()), line


def test_joining_a_torchrun_job_says_so_in_one_line(monkeypatch):
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "j7"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(run_module, "run_plan", lambda *a, **k: SimpleNamespace(rank=1, metrics=[]))
    res = runner.invoke(app, ["run", str(PP2), "--steps", "1"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stderr.splitlines() if "joining" in line]
    assert lines == ["joining torchrun job j7: rank 1 of 2, master 127.0.0.1:29511; each collective waits up to "
                     "--op-timeout 300 s for the other ranks"], res.stderr
