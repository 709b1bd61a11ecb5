"""A per-group `--layout` (planner/solver/group_layouts.py): each group its own degrees, micro-batch and stage split, on
ranks of its own or on another group's (colocated-with), 1F1B, GPipe or interleaved; what it cannot lay out is one line
naming the problem."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.solver.group_layouts import group_layout_plan, is_group_layout, parse_group_layouts
from planner.solver.megatron_split import split_blocks
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
    ("vision:dp=2,split=even;llm:dp=2", ["split must be one of layers, flops, encoders-first"]),
    ("vision:dp=2,look-ahead=1;llm:dp=2", ["unknown layout key 'look-ahead'", "lookahead"]),
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


def test_a_colocated_group_time_shares_its_hosts_ranks_with_its_own_layout():
    plan = group_layout_plan(profile("tiny-vlm"), local_cluster(2), 8, "vision:dp=2,micro-batch=2,colocated-with=llm;"
                             "llm:pp=2,split=layers")
    vision, llm = plan.groups
    assert (vision.colocated_with, vision.dp, vision.pp, vision.ranks) == ("llm", 2, 1, (0, 1))
    assert (llm.colocated_with, llm.pp, [s.ranks for s in llm.stages]) == (None, 2, [(0,), (1,)])
    assert (plan.micro_batches_of(vision), plan.micro_batches_of(llm)) == (2, 8)
    assert plan.predicted.step_time_s > 0 and plan.world_size == 2
    # written before its host, on a cluster where the host is not the first group: the host's ranks all the same
    plan = group_layout_plan(profile("tiny-avlm"), local_cluster(4), 8, "vision:dp=2,colocated-with=llm;audio:dp=2;llm:dp=2")
    assert [(g.name, g.ranks, g.colocated_with) for g in plan.groups] == [
        ("vision", (2, 3), "llm"), ("audio", (0, 1), None), ("llm", (2, 3), None)]


def test_fill_bubbles_is_written_on_a_colocated_group():
    plan = group_layout_plan(profile("tiny-vlm"), local_cluster(2), 8,
                             "vision:dp=2,colocated-with=llm,fill-bubbles=true;llm:pp=2")
    assert plan.group("vision").fill_bubbles and not plan.group("llm").fill_bubbles


def test_lookahead_is_written_per_group_and_lets_the_encoder_run_ahead():
    """`lookahead=2` on an encoder with ranks of its own: the plan's group carries it and the one schedule lets its
    stage run 2 more forwards before its first backward than 1F1B's d + 1 (plans/schedule.py: d + 1 + k)."""
    from plans.schedule import schedule

    text = "vision:dp=1,micro-batch=1{};llm:pp=2,micro-batch=1"
    ahead, plain = (group_layout_plan(profile("tiny-vlm"), local_cluster(3), 8, text.format(k)) for k in (",lookahead=2", ""))
    assert [(g.name, g.lookahead) for g in ahead.groups] == [("vision", 2), ("llm", 0)]
    assert [g.lookahead for g in plain.groups] == [0, 0]
    warmup = [schedule(stage_graph(p), p.training.schedule).warmup[0] for p in (ahead, plain)]
    assert warmup == [5, 3], warmup


@pytest.mark.parametrize("split", ["layers", "flops", "encoders-first"])
def test_a_group_holding_the_whole_model_is_split_as_the_one_layout_spec_splits_it(split):
    """One code path: a per-group split= cuts a group's blocks as the one-layout --layout cuts the model (split_blocks)."""
    prof = profile("tiny-vlm")
    plan = group_layout_plan(prof, local_cluster(2), 8, f"llm:pp=2,split={split}")
    assert [s.blocks for s in plan.groups[0].stages] == split_blocks(prof, 2, split)


def test_the_splits_cut_a_group_differently():
    stages = {split: [s.blocks for s in group_layout_plan(profile("tiny-vlm"), local_cluster(2), 8,
                                                           f"llm:pp=2,split={split}").groups[0].stages]
              for split in ("layers", "flops", "encoders-first")}
    assert stages["layers"][0][-1] == "llm.embed" and stages["encoders-first"][0][-1] == "llm.layers.0"
    assert len({tuple(v) for v in stages.values()}) >= 2


def test_an_interleaved_group_holds_its_chunks_round_robin_beside_a_1f1b_encoder():
    plan = group_layout_plan(profile("tiny-vlm"), local_cluster(4), 8, "vision:dp=2;llm:pp=2,schedule=interleaved:2")
    vision, llm = plan.groups
    assert (plan.training.schedule, plan.training.virtual_stages) == ("interleaved", 2)
    labels = [c.label for c in stage_graph(plan).chunks]
    assert labels == ["vision s0", "llm s0.0", "llm s1.0", "llm s0.1", "llm s1.1"], labels
    assert plan.predicted.step_time_s > 0


@pytest.mark.parametrize("world,text,words", [
    (2, "vision:dp=1,colocated-with=llm;llm:dp=2", ["'vision'", "1 GPUs", "'llm' (2 GPUs)", "same ranks"]),
    (2, "vision:dp=2,colocated-with=audio;llm:dp=2", ["'audio'", "not another group", "llm"]),
    (2, "vision:dp=2,colocated-with=vision;llm:dp=2", ["not another group"]),
    (2, "vision:dp=2,colocated-with=llm;llm:dp=2,colocated-with=vision", ["cycle", "vision -> llm -> vision"]),
    (4, "vision:dp=2,colocated-with=llm;llm:dp=2", ["2 GPUs (colocated groups share their host's)", "4"]),
    (4, "vision:dp=2,fill-bubbles=true;llm:dp=2", ["fill-bubbles", "colocated-with=GROUP"]),
    (2, "vision:dp=2,zero=1,colocated-with=llm,fill-bubbles=true;llm:dp=2", ["fill-bubbles needs zero=0"]),
    (2, "vision:tp=2,colocated-with=llm,fill-bubbles=true;llm:pp=2", ["fill-bubbles runs each replica", "tp ranks 0, 1", "fill-bubbles=true"]),
    (4, "vision:dp=2,schedule=interleaved:2;llm:pp=2", ["interleaved schedule needs pp >= 2"]),
    (3, "vision:dp=1,lookahead=2;llm:pp=2,schedule=gpipe", ["'vision'", "lookahead=2", "gpipe"]),
    (3, "vision:dp=1,lookahead=-1;llm:pp=2", ["lookahead must be a non-negative integer"]),
    (4, "vision:dp=2,schedule=gpipe;llm:pp=2,schedule=interleaved:2", ["one schedule"]),
    (4, "vision:pp=2,schedule=interleaved:3;llm:pp=2,schedule=interleaved:2", ["interleaved:2 and interleaved:3"]),
    (3, "vision:dp=1;llm:pp=2,schedule=interleaved:3", ["'llm' has 5 block(s)", "2 x 3 = 6"]),
    (3, "vision:dp=1;llm:pp=2,schedule=interleaved:3,split=encoders-first", ["encoders-first counts its own"]),
    (7, "vision:pp=5;llm:pp=2,schedule=interleaved:2", ["'vision' stage 0 has 1 block(s)", "interleaved:2"]),
])
def test_layouts_that_cannot_pack_are_refused_in_one_line(world, text, words):
    with pytest.raises(MmplanError) as err:
        group_layout_plan(profile("tiny-vlm"), local_cluster(world), 8, text)
    assert "\n" not in str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_solve_writes_a_colocated_per_group_layout(tmp_path):
    from plans.plan import load_plan

    runner = CliRunner()
    prof, out = tmp_path / "p.json", tmp_path / "plan.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(prof)]).exit_code == 0
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "8", "--layout",
                              "vision:dp=2,colocated-with=llm;llm:pp=2,schedule=interleaved:2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    plan = load_plan(out)
    assert plan.group("vision").colocated_with == "llm" and plan.training.virtual_stages == 2
    assert plan.predicted.step_time_s > 0
