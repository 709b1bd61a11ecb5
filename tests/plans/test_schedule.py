"""The schedule: textbook GPipe / 1F1B / interleaved orders on linear pipelines, in-flight counts, and
deadlock-free orders on stage graphs the textbook does not cover (an encoder feeding an interleaved LLM,
colocated groups with different pipelines)."""
from __future__ import annotations

import pytest

from cost_models.cluster_spec import parse_cluster
from plans.graph import Block, Edge, Profile
from plans.plan import Group, Plan, ProfileRef, Stage, Training, flow_of
from plans.schedule import Task, schedule, task_name
from plans.stage_graph import stage_graph

CLUSTER = parse_cluster("16xlocal-cpu", gpus_per_node=16)


def chain(names: list[str]) -> Profile:
    blocks = tuple(Block(n, n.split(".")[0], "Linear", 1, 4, 1.0, 2.0, 8.0, 4.0) for n in names)
    return Profile.build("chain", "fp32", 1, blocks, tuple(Edge(a, b, 4.0) for a, b in zip(names, names[1:])))


def pipeline(p: int, m: int, policy: str = "1f1b", v: int = 1):
    names = [f"l.{i}" for i in range(p * v)]
    stages = tuple(Stage(tuple(names[k] for k in range(len(names)) if (k // 1) % p == i), (i,)) for i in range(p))
    plan = Plan(ProfileRef("chain", "x" * 16), CLUSTER, Training(m, m, schedule=policy, virtual_stages=v),
                (Group("l", 1, 1, p, stages),), flow=flow_of(chain(names)))
    g = stage_graph(plan)
    return g, schedule(g, policy)


def names(g, order) -> list[str]:
    return [task_name(g, t).replace("l ", "") for t in order]


def test_1f1b_is_pipedream_flush() -> None:
    g, s = pipeline(4, 6)
    for i, order in enumerate(s.orders):
        warm = 4 - i - 1
        f = [t for t in order if not t.backward]
        b = [t for t in order if t.backward]
        assert [t.mb for t in f] == list(range(6)) and [t.mb for t in b] == list(range(6))
        assert [t.backward for t in order[:warm]] == [False] * warm  # warm-up
        steady = order[warm:warm + 2 * (6 - warm)]
        assert [t.backward for t in steady] == [False, True] * (6 - warm)  # one forward, one backward
    assert s.in_flight == (4, 3, 2, 1) and s.warmup == (4, 3, 2, 1)  # forwards before the first backward


def test_gpipe_runs_every_forward_first() -> None:
    g, s = pipeline(3, 4, "gpipe")
    for order in s.orders:
        assert [t.backward for t in order] == [False] * 4 + [True] * 4
    assert s.in_flight == (4, 4, 4)


def test_interleaved_follows_megatrons_order_and_holds_fewer_than_gpipe() -> None:
    g, s = pipeline(2, 4, "interleaved", v=2)
    first = names(g, s.orders[0])
    assert first[:5] == ["fwd s0.0 mb0", "fwd s0.0 mb1", "fwd s0.1 mb0", "fwd s0.1 mb1", "fwd s0.0 mb2"]
    assert len(s.orders[0]) == 2 * 2 * 4
    assert s.in_flight[0] < 4  # micro-batches of a whole stage


def test_encoder_feeding_an_interleaved_llm_does_not_stall() -> None:
    enc = [f"enc.{i}" for i in range(2)]
    llm = [f"llm.{i}" for i in range(4)]
    prof = Profile.build("mm", "fp32", 1, tuple(Block(n, n.split(".")[0], "Linear", 1, 4, 1.0, 2.0, 8.0, 4.0) for n in enc + llm),
                         tuple(Edge(a, b, 4.0) for a, b in zip(enc + llm, (enc + llm)[1:])) + (Edge("enc.1", "llm.2", 4.0),))
    groups = (Group("enc", 1, 1, 1, (Stage(tuple(enc), (0,)),)),
              Group("llm", 1, 1, 2, (Stage(("llm.0", "llm.2"), (1,)), Stage(("llm.1", "llm.3"), (2,)))))
    plan = Plan(ProfileRef("mm", prof.fingerprint), CLUSTER, Training(8, 8, schedule="interleaved", virtual_stages=2), groups,
                flow=flow_of(prof))
    g = stage_graph(plan)
    s = schedule(g, "interleaved")
    done = {t for order in s.orders for t in order}
    assert len(done) == len(g.chunks) * 8 * 2


def test_colocated_stages_share_one_order_per_rank_class() -> None:
    names_ = ["v.0", "v.1", "l.0", "l.1"]
    prof = chain(names_)
    groups = (Group("v", 2, 1, 1, (Stage(("v.0", "v.1"), (0, 1)),)),
              Group("l", 1, 1, 2, (Stage(("l.0",), (0,)), Stage(("l.1",), (1,))), colocated_with="v"))
    plan = Plan(ProfileRef("chain", prof.fingerprint), CLUSTER, Training(4, 2), groups, flow=flow_of(prof))
    g = stage_graph(plan)
    s = schedule(g, "1f1b")
    assert g.classes == ((0,), (1,))
    for k, order in enumerate(s.orders):  # every task of a hosted chunk once, vision's F before the LLM's on mb j
        assert sorted(order) == sorted(Task(c, j, b) for c in g.class_chunks[k] for j in range(2) for b in (False, True))
        assert order.index(Task(0, 0, False)) < order.index(Task(1 + k, 0, False))


def test_unknown_policy_is_refused() -> None:
    g, _ = pipeline(2, 2)
    with pytest.raises(Exception, match="unknown schedule"):
        schedule(g, "zigzag")
