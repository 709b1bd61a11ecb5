"""A per-group `--layout` (planner/solver/group_layouts.py): each group its own degrees and micro-batch on ranks of its
own; what it cannot lay out is one line naming the problem."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.solver.group_layouts import group_layout_plan, is_group_layout, parse_group_layouts
from plans.errors import MmplanError
from plans.stage_graph import stage_graph
from tests.runtime.plan_builder import local_cluster, profile


def test_group_layout_text_is_told_apart_from_one_layout():
    assert is_group_layout("vision:dp=64,micro-batch=1;llm:tp=8,dp=8,micro-batch=1")
    assert is_group_layout("llm:tp=2")
    assert not is_group_layout("tp=8,pp=2,dp=32,schedule=interleaved:2")


def test_each_group_gets_its_layout_ranks_and_micro_batch_count():
    plan = group_layout_plan(profile("tiny-vlm"), local_cluster(4), 16, "vision:dp=2,micro-batch=2;llm:tp=1,pp=2,micro-batch=1")
    vision, llm = plan.groups
    assert vision.blocks[-1] == "vision_proj"  # the unnamed projector group joins the encoder before it
    assert (vision.dp, vision.ranks, plan.micro_batches_of(vision)) == (2, (0, 1), 4)
    assert (llm.pp, llm.ranks, plan.micro_batches_of(llm), llm.micro_batches) == (2, (2, 3), 16, None)
    assert plan.training.micro_batches == 16 and plan.predicted.step_time_s > 0
    route = next(r for r in stage_graph(plan).routes if r.block == "vision_proj")
    assert (route.src_per, route.dst_per) == (1, 4)


@pytest.mark.parametrize("text,words", [
    ("vision:dp=2;vision:dp=1;llm:dp=1", ["'vision'", "twice"]),
    ("audio:dp=2;llm:dp=2", ["'audio'", "does not have", "vision"]),
    ("vision:dp=2,split=flops;llm:dp=2", ["'split'", "per group"]),
    ("vision:dp=1;llm:dp=1", ["2 GPUs", "4"]),
    ("vision:dp=3;llm:dp=1", ["not divisible by dp*micro-batch"]),
    ("vision:dp=2,schedule=gpipe;llm:dp=2,schedule=1f1b", ["one schedule"]),
    ("vision:dp=2,zero=4;llm:dp=2", ["zero must be 0, 1, 2 or 3"]),
    ("vision;llm:dp=2", ["GROUP:key=value"]),
])
def test_bad_group_layouts_are_refused_in_one_line(text, words):
    with pytest.raises(MmplanError) as err:
        group_layout_plan(profile("tiny-vlm"), local_cluster(4), 8, text)
    assert "\n" not in str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_counts_that_do_not_divide_are_refused_naming_the_rule():
    with pytest.raises(MmplanError, match="neither count divides the other"):
        group_layout_plan(profile("tiny-vlm"), local_cluster(4), 12, "vision:dp=2,micro-batch=3;llm:dp=2,micro-batch=2")


def test_solve_writes_a_per_group_layout_and_refuses_it_with_a_baseline(tmp_path):
    runner = CliRunner()
    prof, out = tmp_path / "p.json", tmp_path / "plan.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(prof)]).exit_code == 0
    layout = "vision:dp=2,micro-batch=1;llm:tp=2,micro-batch=1"
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "4xlocal-cpu", "--global-batch", "8", "--layout", layout,
                              "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "8 micro-batches (vision: 4)" in " ".join(res.output.split())
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "4xlocal-cpu", "--global-batch", "8", "--layout", layout,
                              "--baseline", "homogeneous", "-o", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "without --baseline" in res.output


def test_exporters_refuse_a_per_group_micro_batch_count_unless_lossy():
    from planner.export import export_plan
    from planner.export.common import Unsupported

    plan = group_layout_plan(profile("tiny-vlm"), local_cluster(4), 8, "vision:dp=2,micro-batch=1;llm:tp=2,micro-batch=1")
    with pytest.raises(Unsupported, match="group vision's own micro-batch count"):
        export_plan(plan, "deepspeed")
    assert any("own micro-batch count" in d for d in export_plan(plan, "deepspeed", lossy=True).dropped)


def test_why_names_the_per_group_micro_batch():
    from planner.solver.baselines import homogeneous_plan
    from planner.solver.explain import mechanisms

    plan = group_layout_plan(profile("tiny-vlm"), local_cluster(4), 8, "vision:dp=2,micro-batch=1;llm:tp=2,micro-batch=1")
    one = homogeneous_plan(profile("tiny-vlm"), local_cluster(4), 8, "tp=1,pp=1,dp=4,micro-batch=1")
    named = mechanisms(plan, one)
    assert any(m.startswith("vision:") and "a per-group micro-batch (4 micro-batches of 2 samples)" in m for m in named), named
