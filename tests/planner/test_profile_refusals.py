"""Issue 30: `mmplan profile` refuses what needs no model before resolving or building it, and `--device cpu` checks
the model's bytes (counted on the meta device) against the memory available before building it for real."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

import planner.profiler.profile as profile_module
import runtime.preflight as preflight
import runtime.source as source_module
from planner.cli import app
from tests.cli_helpers import one_line_error

runner = CliRunner()


@pytest.mark.parametrize("args, words", [
    (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--measure"], "--measure needs a real device"),
    (["--dtype", "fp64"], "unknown dtype 'fp64'"),
    (["--group", "nonsense"], "--group expects PATTERN=GROUP"),
])
def test_option_refusals_come_before_the_model(tmp_path, monkeypatch, args, words):
    def resolved(*_a, **_k):
        raise AssertionError("the model was resolved before the refusal")

    monkeypatch.setattr(source_module, "resolve", resolved)
    line = one_line_error(runner.invoke(app, ["profile", "tiny-vlm", "-o", str(tmp_path / "p.json"), *args]))
    assert words in line, line


def test_a_cpu_profile_larger_than_the_memory_available_is_refused_before_the_build(tmp_path, monkeypatch):
    def traced(*_a, **_k):
        raise AssertionError("the model was built and traced on the CPU")

    monkeypatch.setattr(profile_module, "analyse", traced)
    monkeypatch.setattr(preflight, "available_memory", lambda: 1e6)  # 1 MB: tiny-vlm's parameters need more
    line = one_line_error(runner.invoke(app, ["profile", "tiny-vlm", "--device", "cpu", "-o", str(tmp_path / "p.json")]))
    assert "needs at least" in line and "1.0 MB available" in line and "--device meta" in line, line
    assert not (tmp_path / "p.json").exists()
