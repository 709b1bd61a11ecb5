"""Per-group step shape (Group.micro_batches, schema mmplan.plan/3): routes re-batch between groups that count
micro-batches differently, the schedule orders each group's own micro-batches and follows the re-batching, and old
(/2) plans still load."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from cost_models.cluster_spec import parse_cluster
from plans.errors import FormatError
from plans.graph import Block, Edge, Profile
from plans.plan import Group, Plan, ProfileRef, Stage, Training, check_plan, flow_of, plan_from_data
from plans.schedule import schedule, task_name
from plans.serial import to_data
from plans.stage_graph import Piece, stage_graph, window_pieces

CLUSTER = parse_cluster("16xlocal-cpu", gpus_per_node=16)


def _profile() -> Profile:
    names = ["enc.0", "enc.1", "llm.0", "llm.1", "llm.2"]
    blocks = tuple(Block(n, n.split(".")[0], "Linear", 1, 4, 1.0, 2.0, 8.0, 4.0) for n in names)
    return Profile.build("encllm", "fp32", 1, blocks, tuple(Edge(a, b, 4.0) for a, b in zip(names, names[1:])))


def make(enc_m: int | None, llm_m: int | None, *, enc_dp: int = 1, llm_dp: int = 1, llm_pp: int = 2, m: int = 4,
         batch: int = 8, policy: str = "1f1b") -> Plan:
    enc = Group("enc", enc_dp, 1, 1, (Stage(("enc.0", "enc.1"), tuple(range(enc_dp))),), micro_batches=enc_m)
    base = enc_dp
    llm_blocks = [("llm.0",), ("llm.1", "llm.2")] if llm_pp == 2 else [("llm.0", "llm.1", "llm.2")]
    stages = tuple(Stage(b, tuple(range(base + i * llm_dp, base + (i + 1) * llm_dp))) for i, b in enumerate(llm_blocks))
    llm = Group("llm", llm_dp, 1, llm_pp, stages, micro_batches=llm_m)
    prof = _profile()
    plan = Plan(ProfileRef(prof.model, prof.fingerprint), CLUSTER, Training(batch, m, schedule=policy), (enc, llm),
                flow=flow_of(prof))
    return check_plan(plan)


def test_a_bigger_producer_micro_batch_feeds_several_consumer_ones() -> None:
    g = stage_graph(make(1, 4))
    enc = g.chunks[0]
    assert (enc.micro_batches, enc.micro_batch) == (1, 8) and (g.chunks[1].micro_batches, g.chunks[1].micro_batch) == (4, 2)
    (route,) = [r for r in g.routes if r.src == 0]
    assert (route.src_per, route.dst_per, g.windows(route)) == (1, 4, 1)
    assert route.pieces == tuple(Piece(0, 0, 2 * j, 2 * j + 2, 0, j) for j in range(4))
    assert [list(route.src_mbs(j)) for j in range(4)] == [[0]] * 4 and list(route.dst_mbs(0)) == [0, 1, 2, 3]
    assert [g.dst_offset(route, p) for p in route.pieces] == [0] * 4 and [g.src_offset(route, p) for p in route.pieces] == [0, 2, 4, 6]


def test_a_smaller_producer_micro_batch_makes_the_consumer_wait_for_several() -> None:
    g = stage_graph(make(4, 1, enc_dp=2, llm_pp=1))
    (route,) = [r for r in g.routes if r.src == 0]
    assert (route.src_per, route.dst_per) == (4, 1)
    assert list(route.src_mbs(0)) == [0, 1, 2, 3] and list(route.dst_mbs(3)) == [0]
    # each encoder micro-batch of 2 samples: replica 0 holds its first, replica 1 its second
    assert route.pieces == tuple(Piece(k % 2, 0, k, k + 1, k // 2, 0) for k in range(8))
    assert [g.dst_offset(route, p) for p in route.pieces] == list(range(8))


@pytest.mark.parametrize("src_dp,src_per,dst_dp,dst_per", [(1, 1, 2, 4), (2, 4, 4, 1), (4, 1, 2, 2), (2, 2, 2, 1), (3, 1, 2, 1)])
def test_pieces_cover_every_sample_once(src_dp, src_per, dst_dp, dst_per) -> None:
    window = 24
    ps = window_pieces(src_dp, src_per, dst_dp, dst_per, window)
    covered = sorted(s for p in ps for s in range(p.start, p.stop))
    assert covered == list(range(window))
    for p in ps:  # a piece lies inside its producer replica's slice of its micro-batch and the consumer's
        for dp, per, rep, mb in ((src_dp, src_per, p.src_replica, p.src_mb), (dst_dp, dst_per, p.dst_replica, p.dst_mb)):
            share = window // per // dp
            lo = mb * (window // per) + rep * share
            assert lo <= p.start < p.stop <= lo + share


def test_counts_that_do_not_divide_each_other_are_refused() -> None:
    with pytest.raises(FormatError, match="neither count divides the other"):
        make(2, 3, batch=12)
    with pytest.raises(FormatError, match="does not divide global_batch"):
        make(3, None)
    with pytest.raises(FormatError, match="not divisible by dp=2"):
        make(8, None, enc_dp=2)


@pytest.mark.parametrize("enc_m,llm_m,policy", list(itertools.product([1, 2, 4, 8], [1, 2, 4, 8], ["1f1b", "gpipe"])))
def test_each_group_runs_its_own_micro_batches_in_an_order_respecting_the_rebatching(enc_m, llm_m, policy) -> None:
    g = stage_graph(make(enc_m, llm_m, policy=policy))
    s = schedule(g, policy)
    done: set = set()
    position = {}
    for order in s.orders:
        for i, t in enumerate(order):
            position[t] = i
    # every chunk runs each of its own micro-batches forward and backward once
    for c, ch in enumerate(g.chunks):
        mine = [t for o in s.orders for t in o if t.chunk == c]
        assert sorted((t.mb, t.backward) for t in mine) == sorted((j, b) for j in range(ch.micro_batches) for b in (False, True))
    # replay the orders as one execution: a task runs only after what it reads (deadlock-free and dependency-correct)
    pending = [list(o) for o in s.orders]
    while any(pending):
        progressed = False
        for o in pending:
            while o and _ready(g, o[0], done):
                done.add(o.pop(0))
                progressed = True
        assert progressed, [task_name(g, o[0]) for o in pending if o]


def _ready(g, t, done) -> bool:
    if t.backward and (t.chunk, t.mb, False) not in {(x.chunk, x.mb, x.backward) for x in done}:
        return False
    for r in g.routes:
        if not t.backward and r.dst == t.chunk:
            if any((r.src, i, False) not in {tuple(x) for x in done} for i in r.src_mbs(t.mb)):
                return False
        if t.backward and r.src == t.chunk:
            if any((r.dst, j, True) not in {tuple(x) for x in done} for j in r.dst_mbs(t.mb)):
                return False
    return True


def test_an_encoder_micro_batch_over_four_llm_ones_backwards_after_all_four() -> None:
    g = stage_graph(make(1, 4))
    s = schedule(g, "1f1b")
    enc = [task_name(g, t) for t in s.orders[0]]
    assert enc == ["fwd enc s0 mb0", "bwd enc s0 mb0"]
    last = [task_name(g, t) for t in s.orders[1]]
    assert last.index("bwd llm s0 mb3") < len(last)  # the LLM runs 4 micro-batches per step


def test_a_version_2_plan_is_read_as_version_3() -> None:
    plan = make(None, None)
    data = to_data(plan)
    data["schema"] = "mmplan.plan/2"
    assert plan_from_data(data) == plan
    assert "micro_batches" not in data["groups"][0]  # omitted while it is the plan's
    assert to_data(replace(plan, groups=(replace(plan.groups[0], micro_batches=2), plan.groups[1])))["groups"][0]["micro_batches"] == 2


def _colocated(enc_m: int | None, llm_m: int | None, fill: bool) -> Plan:
    enc = Group("enc", 2, 1, 1, (Stage(("enc.0", "enc.1"), (0, 1)),), micro_batches=enc_m, fill_bubbles=fill)
    llm = Group("llm", 1, 1, 2, (Stage(("llm.0",), (0,)), Stage(("llm.1", "llm.2"), (1,))), colocated_with="enc",
                micro_batches=llm_m)
    prof = _profile()
    return check_plan(Plan(ProfileRef(prof.model, prof.fingerprint), CLUSTER, Training(8, 4), (enc, llm), flow=flow_of(prof)))


@pytest.mark.parametrize("enc_m,llm_m,fill", list(itertools.product([1, 2, 4], [2, 4, 8], [False, True])))
def test_colocated_groups_of_different_counts_share_a_deadlock_free_order(enc_m, llm_m, fill) -> None:
    from cost_models.pipeline import simulate

    plan = _colocated(enc_m, llm_m, fill)
    g = stage_graph(plan)
    s = schedule(g, "1f1b")
    done: set = set()
    pending = [list(o) for o in s.orders]
    while any(pending):
        progressed = False
        for o in pending:
            while o and _ready(g, o[0], done):
                done.add(o.pop(0))
                progressed = True
        assert progressed, [task_name(g, o[0]) for o in pending if o]
    assert simulate(plan, _profile()).step_time_s > 0  # the simulator's DAG has no cycle either
