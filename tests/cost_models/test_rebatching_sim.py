"""The simulator times per-group step shapes (Group.micro_batches): each group's tasks at its own micro-batch size,
the routes' re-batching as dependencies, the same samples moved whatever the counts."""
from __future__ import annotations

import pytest

from cost_models.evaluate import evaluate
from cost_models.pipeline import simulate
from plans.schedule import schedule, task_name
from plans.stage_graph import stage_graph
from tests.plans.test_rebatching import _profile, make


def _compute_order(sim, rank):
    return [e.name for e in sim.rank_timeline(rank) if e.lane == "compute" and e.name[:4] in ("fwd ", "bwd ")]


@pytest.mark.parametrize("enc_m,llm_m", [(1, 4), (4, 1), (2, 8), (8, 2), (4, 4)])
def test_predicted_order_is_the_schedule_and_work_scales_with_the_micro_batch(enc_m, llm_m) -> None:
    plan = make(enc_m, llm_m, batch=8)
    sim = simulate(plan, _profile())
    g = stage_graph(plan)
    sched = schedule(g, "1f1b")
    for k, ranks in enumerate(g.classes):
        assert _compute_order(sim, ranks[0]) == [task_name(g, t) for t in sched.orders[k]]
    enc = next(sc for sc in sim.stages if sc.group == "enc")
    assert enc.micro_batches == enc_m
    ref = next(sc for sc in simulate(make(8, llm_m, batch=8), _profile()).stages if sc.group == "enc")
    # FLOPs per micro-batch scale with its samples (8 / enc_m of them); per-op overheads make it at most linear
    assert ref.time.fwd * 8 / enc_m >= enc.time.fwd * (1 - 1e-9) >= ref.time.fwd * (1 - 1e-9)


def test_the_same_samples_cross_a_route_whatever_the_counts() -> None:
    base = simulate(make(4, 4), _profile()).comm_bytes
    for enc_m in (1, 2, 8):
        assert simulate(make(enc_m, 4), _profile()).comm_bytes == pytest.approx(base)


def test_an_encoder_micro_batch_over_several_llm_ones_waits_for_all_their_gradients() -> None:
    plan = make(1, 4)
    sim = simulate(plan, _profile())
    ev = {e.name: e for e in sim.rank_timeline(0) if e.lane == "compute"}
    llm_first = {e.name: e for e in sim.rank_timeline(1) if e.lane == "compute"}
    assert ev["bwd enc s0 mb0"].start >= llm_first["bwd llm s0 mb3"].end
    assert ev["fwd enc s0 mb0"].end <= llm_first["fwd llm s0 mb0"].start
    assert evaluate(plan, _profile()).predicted.step_time_s > 0
