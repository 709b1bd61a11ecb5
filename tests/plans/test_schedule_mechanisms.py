"""The schedule's two ways past lock-step: an encoder on its own ranks running k micro-batches ahead (Group.lookahead),
and a colocated group's rank classes running their replicas' shares of its tasks in their own idle slots
(Group.fill_bubbles) -- orders, in-flight counts, memory and simulated step."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.cluster_spec import parse_cluster
from cost_models.evaluate import evaluate
from cost_models.pipeline import simulate
from plans.errors import FormatError
from plans.graph import Block, Edge, Profile
from plans.plan import Group, Plan, ProfileRef, Stage, Training, check_plan, flow_of
from plans.schedule import Task, schedule
from plans.stage_graph import stage_graph

CLUSTER = parse_cluster("16xlocal-cpu", gpus_per_node=16)


def profile(names: list[str], enc_flops: float = 1e9, llm_flops: float = 1e9) -> Profile:
    blocks = tuple(Block(n, n.split(".")[0], "Linear", 1000, 4000, enc_flops if n.startswith("v") else llm_flops,
                         2 * (enc_flops if n.startswith("v") else llm_flops), 1e6, 4e3) for n in names)
    return Profile.build("mm", "fp32", 1, blocks, tuple(Edge(a, b, 4e3) for a, b in zip(names, names[1:])))


def encoder_plan(k: int, m: int = 8, p: int = 2) -> tuple[Plan, Profile]:
    """vision on rank 0, a p-stage LLM on ranks 1..p, vision running k micro-batches ahead."""
    llm = [f"l.{i}" for i in range(p)]
    prof = profile(["v.0", *llm])
    groups = (Group("v", 1, 1, 1, (Stage(("v.0",), (0,)),), lookahead=k),
              Group("l", 1, 1, p, tuple(Stage((n,), (1 + i,)) for i, n in enumerate(llm))))
    plan = Plan(ProfileRef("mm", prof.fingerprint), CLUSTER, Training(m, m), groups, flow=flow_of(prof))
    return check_plan(plan, prof), prof


@pytest.mark.parametrize("k", [0, 1, 3])
def test_an_encoder_on_its_own_ranks_runs_k_forwards_ahead(k):
    plan, prof = encoder_plan(k)
    g = stage_graph(plan)
    s = schedule(g, "1f1b")
    enc = s.orders[g.class_of[0]]
    first_backward = next(i for i, t in enumerate(enc) if t.backward)
    assert first_backward == 2 + 1 + k  # d + 1 + k forwards: d = 2 routes to the loss
    assert s.in_flight[0] == 3 + k and s.in_flight[1:] == (2, 1)  # the LLM's stages are unchanged
    assert [t.mb for t in enc if not t.backward] == list(range(8))


def test_the_look_ahead_is_priced_in_memory_and_written_only_when_set():
    from plans.serial import to_data

    (p0, prof), (p2, _) = encoder_plan(0), encoder_plan(2)
    m0, m2 = evaluate(p0, prof), evaluate(p2, prof)
    act = 1e6 * 1  # one micro-batch of one sample: the block's saved activations
    assert m2.stage_memory[0].gpu - m0.stage_memory[0].gpu == pytest.approx(2 * act)
    assert m2.stage_memory[1:] == m0.stage_memory[1:]
    assert "lookahead" not in to_data(p0)["groups"][0] and to_data(p2)["groups"][0]["lookahead"] == 2
    with pytest.raises(FormatError, match="lookahead"):
        check_plan(replace(p0, groups=(replace(p0.groups[0], lookahead=-1), p0.groups[1])), prof)


def test_running_ahead_hides_a_slow_encoders_latency():
    """An encoder as slow as an LLM stage, links slow: in lock-step (k = 0) the LLM's first stage waits for the encoder's
    round trip every micro-batch (3.42 s); running ahead it does not (3.12 s)."""
    plan, prof = encoder_plan(0, m=16)
    slow = replace(plan.cluster, intra_node=replace(plan.cluster.intra_node, latency_s=5e-2))
    steps = [simulate(replace(plan, groups=(replace(plan.groups[0], lookahead=k), plan.groups[1]), cluster=slow), prof, slow).step_time_s
             for k in (0, 3)]
    assert steps[1] < steps[0] * 0.95, steps


def colocated_plan(fill: bool, p: int = 4, m: int = 8, zero: int = 0, enc_tp: int = 1) -> tuple[Plan, Profile]:
    """vision dp = p (tp enc_tp) on the ranks of a p-stage LLM (each stage on enc_tp ranks), colocated."""
    llm = [f"l.{i}" for i in range(p)]
    prof = profile(["v.0", *llm])
    n = p * enc_tp
    groups = (Group("v", p, enc_tp, 1, (Stage(("v.0",), tuple(range(n))),), zero=zero, fill_bubbles=fill),
              Group("l", 1, enc_tp, p, tuple(Stage((x,), tuple(range(i * enc_tp, (i + 1) * enc_tp))) for i, x in enumerate(llm)),
                    colocated_with="v"))
    plan = Plan(ProfileRef("mm", prof.fingerprint), CLUSTER, Training(m * p, m), groups, flow=flow_of(prof))
    return check_plan(plan, prof), prof


def test_a_colocated_encoder_fills_the_llm_pipelines_bubbles():
    (serial, prof), (filled, _) = colocated_plan(False), colocated_plan(True)
    g = stage_graph(filled)
    s = schedule(g, "1f1b")
    assert s.units[0] == ((0,), (1,), (2,), (3,)) and s.units[1:] == (((0,),), ((1,),), ((2,),), ((3,),))
    last = s.orders[3]  # the LLM's last stage forwards vision's micro-batches while it waits for its first input
    assert last[:4] == tuple(Task(0, j, False) for j in range(4))
    for k, order in enumerate(s.orders):  # every class runs each of vision's tasks once, on its own replica
        assert sorted(t for t in order if t.chunk == 0) == [Task(0, j, b) for j in range(8) for b in (False, True)]
    assert schedule(stage_graph(serial), "1f1b").units[0] == ((0, 1, 2, 3),)
    steps = [simulate(p, prof).step_time_s for p in (serial, filled)]
    assert steps[1] < steps[0] / 1.5, steps  # 16.7 s in series with the pipeline, 7.4 s in its bubbles


def test_bubble_filling_needs_zero_0_and_each_replicas_tp_ranks_in_one_class():
    with pytest.raises(FormatError, match="ZeRO 0"):
        colocated_plan(True, zero=1)
    plan, prof = colocated_plan(True, enc_tp=2)
    assert simulate(plan, prof).step_time_s > 0  # tp 2 inside each LLM stage's two ranks
    bad = replace(plan, groups=(replace(plan.groups[0], dp=2, tp=4), plan.groups[1]))  # a replica over 2 stages
    with pytest.raises(FormatError, match="fill_bubbles"):
        schedule(stage_graph(check_plan(bad, prof)), "1f1b")
