"""Colocated per-group layouts written by `--layout` (planner/solver/group_layouts.py) train like the single-process
reference in the predicted order, on 2 local ranks: an encoder time-sharing a pipelined LLM's ranks (its stages cut by
layer count), and one filling the bubbles of an interleaved LLM with its own micro-batch count."""
from __future__ import annotations

import pytest

from planner.solver.group_layouts import group_layout_plan
from runtime.launch import launch
from runtime.train import Job, train_rank
from tests.runtime.plan_builder import local_cluster, profile
from tests.runtime.test_parity import STEPS, assert_executed_order_is_predicted, check_parity, reference

LAYOUTS = {  # the layout, and (vision's micro-batches, the LLM's, the LLM's chunks per stage, vision fills bubbles)
    "colocated-llm-pp2-layers": ("vision:dp=2,colocated-with=llm;llm:pp=2,split=layers", (4, 8, 1, False)),
    "colocated-fill-interleaved": ("vision:dp=2,micro-batch=2,colocated-with=llm,fill-bubbles=true;"
                                   "llm:pp=2,schedule=interleaved:2", (2, 8, 2, True)),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_a_colocated_layout_trains_like_the_reference(case):
    text, shape = LAYOUTS[case]
    plan = group_layout_plan(profile("tiny-vlm"), local_cluster(2), 8, text)
    vision, llm = plan.groups
    assert (vision.colocated_with, set(vision.ranks)) == ("llm", set(llm.ranks)) and plan.world_size == 2
    assert (plan.micro_batches_of(vision), plan.micro_batches_of(llm), plan.training.virtual_stages, vision.fill_bubbles) == shape
    assert plan.predicted is not None and plan.predicted.step_time_s > 0
    job = Job(plan=plan, model="tiny-vlm", steps=STEPS, seed=0, probe_grads=True, trace=True)
    ref = reference("tiny-vlm", job)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    assert_executed_order_is_predicted(plan, "tiny-vlm", results[0]["trace"])
    check_parity(case, results, ref, loss_rtol=1e-5)
