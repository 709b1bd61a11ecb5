"""A parameter tied across pipeline stages costs what the runtime does with it (cost_models/ties.py, runtime/ties.py):
the stage holding a copy counts its parameters, gradients and optimizer state exactly, and each holder's tail adds the
all-reduce of the copies' gradients; a tie within one stage costs nothing more."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.comm import link_for
from cost_models.evaluate import evaluate
from cost_models.memory import model_state_bytes
from cost_models.tail import tie_sync_time
from cost_models.ties import copy_blocks, tie_syncs
from tests.runtime.plan_builder import make_plan, profile

TIED = "tiny-vlm-tied"
FIRST = ["vision", "vision_proj", "llm.embed", "llm.layers.0"]
SECOND = ["llm.layers.1", "llm.norm", "llm.head"]


@pytest.mark.parametrize(("dp", "zero"), [(1, 0), (2, 0), (2, 1), (2, 3)])
def test_the_copy_stage_holds_the_ties_model_states_and_both_stages_pay_its_all_reduce(dp, zero):
    prof = profile(TIED)
    (tie,) = prof.ties
    untied = replace(prof, ties=())  # the same model priced as if the head held nothing of its own
    ranks = list(range(2 * dp))
    plan = make_plan(TIED, [{"name": "all", "dp": dp, "zero": zero, "stages": [(FIRST, ranks[:dp]), (SECOND, ranks[dp:])]}])
    assert copy_blocks(prof, [s.blocks for s in plan.groups[0].stages]) == {"llm.head": tie}
    got, base = evaluate(plan, prof), evaluate(plan, untied)
    state = model_state_bytes(tie.params, dp=dp, zero=zero, dtype=plan.training.dtype, optimizer=plan.training.optimizer)
    assert got.stage_memory[0].gpu == base.stage_memory[0].gpu
    assert got.stage_memory[1].gpu == pytest.approx(base.stage_memory[1].gpu + state.total, rel=1e-12)
    sync = tie_sync_time(tie.params / (dp if zero else 1), 2, link_for(plan.cluster, [0, dp]), dtype=plan.training.dtype)
    assert sync > 0
    assert got.simulation.stages[0].grad_sync_s == pytest.approx(base.simulation.stages[0].grad_sync_s + sync)
    assert got.simulation.stages[1].grad_sync_s > base.simulation.stages[1].grad_sync_s + sync * 0.999
    assert got.predicted.step_time_s > base.predicted.step_time_s


def test_a_tie_within_one_stage_costs_nothing_more():
    prof = profile(TIED)
    plan = make_plan(TIED, [{"name": "all", "dp": 2, "stages": [(FIRST + SECOND, [0, 1])]}])
    assert tie_syncs(prof, [s.blocks for s in plan.groups[0].stages]) == []
    got, base = evaluate(plan, prof), evaluate(plan, replace(prof, ties=()))
    assert got.predicted == base.predicted
