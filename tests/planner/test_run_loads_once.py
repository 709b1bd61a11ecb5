"""One `mmplan run` loads its plan once, builds the model on meta once, traces it once per process, evaluates once.

Counted by wrapping the functions in every loaded module that holds them; local ranks are forked, so they inherit
the wrappers, and every call appends "pid name" to a file (each rank's own calls, without a log or a pipe)."""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import torch
from typer.testing import CliRunner

import cost_models.evaluate
import plans.plan
import runtime.models.zoo
import runtime.program
from planner.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "plans" / "examples"
COUNTED = [(plans.plan, "load_plan"), (runtime.models.zoo, "build"), (runtime.program, "trace_program"),
           (cost_models.evaluate, "evaluate")]


def _counting(name: str, original, calls: Path):
    def wrapper(*args, **kwargs):
        what = name
        if name == "build":  # a zoo model built on the meta device, or for real (the ranks)
            what = "build-meta" if torch.empty(()).device.type == "meta" else "build-real"
        with open(calls, "a") as f:
            f.write(f"{os.getpid()} {what}\n")
        return original(*args, **kwargs)

    return wrapper


def test_one_run_loads_builds_traces_and_evaluates_once(tmp_path, monkeypatch):
    from planner.profiler.profile import profile_model
    from plans.graph import save_profile
    from runtime.source import resolve

    profile = tmp_path / "profile.json"
    save_profile(profile_model(resolve("tiny-vlm"), device="meta"), profile)  # --profile: the run evaluates the plan
    calls = tmp_path / "calls.txt"
    for module, name in COUNTED:
        original = getattr(module, name)
        wrapper = _counting(name, original, calls)
        for loaded in list(sys.modules.values()):  # also where `from module import name` bound it
            if getattr(loaded, name, None) is original:
                monkeypatch.setattr(loaded, name, wrapper)
    res = CliRunner().invoke(app, ["run", str(EXAMPLES / "tiny-vlm-dp2.json"), "--steps", "1", "--json",
                                      "--profile", str(profile)])
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in calls.read_text().splitlines()]
    launcher = Counter(what for pid, what in rows if int(pid) == os.getpid())
    ranks = {int(pid) for pid, _ in rows} - {os.getpid()}
    per_rank = [Counter(what for p, what in rows if int(p) == pid) for pid in sorted(ranks)]
    assert launcher == {"load_plan": 1, "build-meta": 1, "trace_program": 1, "evaluate": 1}, launcher
    assert len(per_rank) == 2
    for counts in per_rank:
        assert counts == {"build-real": 1, "trace_program": 1}, counts
