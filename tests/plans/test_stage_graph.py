"""The stage graph: chunks, routes (exact transfers for fan-in, fan-out, equal dp, colocated, tp, an encoder
feeding several stages, the loss), rank classes; a tiling property of the transfers."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.cluster_spec import parse_cluster
from plans.errors import FormatError
from plans.graph import Block, Edge, Profile
from plans.plan import Group, Plan, ProfileRef, Stage, Training, flow_of
from plans.stage_graph import slice_of, stage_graph

CLUSTER = parse_cluster("16xlocal-cpu", gpus_per_node=16)


def profile(blocks: list[tuple[str, str]], edges: list[tuple[str, str]]) -> Profile:
    bs = tuple(Block(n, g, "Linear", 1, 4, 1.0, 2.0, 8.0, 4.0, signature=n) for n, g in blocks)
    es = tuple(Edge(s, d, 16.0) for s, d in edges)
    return Profile.build("synthetic", "fp32", 1, bs, es)


AB = profile([("a.0", "a"), ("b.0", "b")], [("a.0", "b.0")])


def group(name: str, dp: int, ranks: list[int], blocks: tuple[str, ...], tp: int = 1) -> Group:
    return Group(name, dp=dp, tp=tp, pp=1, stages=(Stage(blocks, tuple(ranks)),))


def graph(groups: tuple[Group, ...], prof: Profile, training: Training):
    plan = Plan(ProfileRef(prof.model, prof.fingerprint), CLUSTER, training, groups, flow=flow_of(prof))
    return stage_graph(plan)


def transfers(src: Group, dst: Group, micro_batch: int) -> list[tuple[int, int, int, int]]:
    g = graph((src, dst), AB, Training(global_batch=micro_batch, micro_batches=1))
    (r,) = g.routes
    assert (g.chunks[r.src].group, g.chunks[r.dst].group, r.block, r.bytes_per_sample) == (src.name, dst.name, "a.0", 4.0)
    return sorted(((t.src_rank, t.dst_rank, t.start, t.stop) for t in g.transfers(r)), key=lambda t: (t[1], t[2], t[0]))


def test_fan_in() -> None:
    got = transfers(group("a", 4, [0, 1, 2, 3], ("a.0",)), group("b", 2, [4, 5], ("b.0",)), 8)
    assert got == [(0, 4, 0, 2), (1, 4, 2, 4), (2, 5, 4, 6), (3, 5, 6, 8)]


def test_fan_out() -> None:
    got = transfers(group("a", 1, [0], ("a.0",)), group("b", 2, [1, 2], ("b.0",)), 4)
    assert got == [(0, 1, 0, 2), (0, 2, 2, 4)]


def test_equal_dp_disjoint_ranks() -> None:
    got = transfers(group("a", 2, [0, 1], ("a.0",)), group("b", 2, [2, 3], ("b.0",)), 4)
    assert got == [(0, 2, 0, 2), (1, 3, 2, 4)]


def test_colocated_is_a_local_hand_over() -> None:
    got = transfers(group("a", 2, [0, 1], ("a.0",)), group("b", 2, [0, 1], ("b.0",)), 6)
    assert got == [(0, 0, 0, 3), (1, 1, 3, 6)]


def test_uneven_dp_overlaps() -> None:
    got = transfers(group("a", 2, [0, 1], ("a.0",)), group("b", 3, [2, 3, 4], ("b.0",)), 6)
    assert got == [(0, 2, 0, 2), (0, 3, 2, 3), (1, 3, 3, 4), (1, 4, 4, 6)]


def test_tp_destinations_all_receive_and_tp_sources_send_from_tp_rank_0() -> None:
    got = transfers(group("a", 2, [0, 1], ("a.0",)), group("b", 1, [2, 3], ("b.0",), tp=2), 4)
    assert got == [(0, 2, 0, 2), (1, 2, 2, 4), (0, 3, 0, 2), (1, 3, 2, 4)]  # every tp rank of b receives
    got = transfers(group("a", 2, [0, 1, 2, 3], ("a.0",), tp=2), group("b", 2, [4, 5], ("b.0",)), 4)
    assert got == [(0, 4, 0, 2), (2, 5, 2, 4)]


def test_a_block_read_by_several_blocks_of_a_chunk_travels_once_per_chunk() -> None:
    prof = profile([("enc.0", "enc"), ("llm.0", "llm"), ("llm.1", "llm"), ("llm.2", "llm"), ("llm.3", "llm")],
                   [("enc.0", "llm.3"), ("enc.0", "llm.1"), ("enc.0", "llm.0"), ("llm.0", "llm.1"), ("llm.1", "llm.2"), ("llm.2", "llm.3")])
    enc = group("enc", 1, [0], ("enc.0",))
    llm = Group("llm", dp=1, tp=1, pp=2, stages=(Stage(("llm.0", "llm.1"), (1,)), Stage(("llm.2", "llm.3"), (2,))))
    g = graph((enc, llm), prof, Training(4, 2))
    assert [(r.block, g.chunks[r.src].label, g.chunks[r.dst].label) for r in g.routes] == [
        ("enc.0", "enc s0", "llm s0"), ("enc.0", "enc s0", "llm s1"), ("llm.1", "llm s0", "llm s1")]
    assert g.distance == (2, 1, 0) and g.loss == 2
    assert [r.bytes_per_sample for r in g.routes] == [4.0, 4.0, 4.0]  # the block's whole output, not the edge's bytes


def test_the_loss_chunk_receives_what_the_loss_reads() -> None:
    prof = Profile.build("two-towers", "fp32", 1, tuple(Block(n, n.split(".")[0], "Linear", 1, 4, 1.0, 2.0, 8.0, 4.0) for n in ("a.0", "b.0")),
                         (), loss=("a.0", "b.0"))
    g = graph((group("a", 1, [0], ("a.0",)), group("b", 1, [1], ("b.0",))), prof, Training(2, 1))
    assert g.loss == 1 and [(r.block, r.src, r.dst) for r in g.routes] == [("a.0", 0, 1)]
    assert g.distance == (1, 0)


def test_interleaved_stages_are_several_chunks_and_classes_group_ranks() -> None:
    names = [f"l.{i}" for i in range(4)]
    prof = profile([(n, "l") for n in names], list(zip(names, names[1:])))
    grp = Group("l", dp=2, tp=1, pp=2, stages=(Stage(("l.0", "l.2"), (0, 1)), Stage(("l.1", "l.3"), (2, 3))))
    g = graph((grp,), prof, Training(4, 2, schedule="interleaved", virtual_stages=2))
    assert [(c.label, c.blocks) for c in g.chunks] == [("l s0.0", ("l.0",)), ("l s1.0", ("l.1",)), ("l s0.1", ("l.2",)), ("l s1.1", ("l.3",))]
    assert g.classes == ((0, 1), (2, 3)) and g.class_chunks == ((0, 2), (1, 3))
    assert g.distance == (3, 2, 1, 0)


def test_stages_feeding_each_other_are_a_cycle() -> None:
    prof = profile([("a.0", "a"), ("b.0", "b"), ("a.1", "a")], [("a.0", "b.0"), ("b.0", "a.1")])
    with pytest.raises(FormatError, match="cycle"):
        graph((Group("a", 1, 1, 1, (Stage(("a.0", "a.1"), (0,)),)), group("b", 1, [1], ("b.0",))), prof, Training(1, 1))


def test_dp_must_divide_the_micro_batch() -> None:
    with pytest.raises(FormatError, match="micro-batch of 4 samples cannot be split over dp=3"):
        graph((group("a", 3, [0, 1, 2], ("a.0",)), group("b", 1, [3], ("b.0",))), AB, Training(4, 1))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Group, Group, int]:
    micro_batch = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 24]))
    divisors = [d for d in range(1, micro_batch + 1) if micro_batch % d == 0]
    src_dp, dst_dp = draw(st.sampled_from(divisors)), draw(st.sampled_from(divisors))
    src_tp, dst_tp = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    src_ranks = list(range(src_dp * src_tp))
    colocated = draw(st.booleans()) and src_dp * src_tp == dst_dp * dst_tp
    start = 0 if colocated else len(src_ranks)
    dst_ranks = list(range(start, start + dst_dp * dst_tp))
    return (group("a", src_dp, src_ranks, ("a.0",), src_tp), group("b", dst_dp, dst_ranks, ("b.0",), dst_tp), micro_batch)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_dst_rank_receives_its_slice_exactly_once(layout: tuple[Group, Group, int]) -> None:
    src, dst, m = layout
    got = transfers(src, dst, m)
    senders = {src.stages[0].ranks[r * src.tp]: slice_of(r, src.dp, m) for r in range(src.dp)}
    for replica in range(dst.dp):
        want_start, want_stop = slice_of(replica, dst.dp, m)
        for dst_rank in dst.stages[0].ranks[replica * dst.tp : (replica + 1) * dst.tp]:
            pieces = sorted((t[2], t[3], t[0]) for t in got if t[1] == dst_rank)
            assert pieces[0][0] == want_start and pieces[-1][1] == want_stop
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # no gap, no overlap
            for start, stop, src_rank in pieces:  # each piece comes from the replica that holds it
                s_start, s_stop = senders[src_rank]
                assert s_start <= start < stop <= s_stop
    assert sum(t[3] - t[2] for t in got) == m * dst.tp


def test_a_chunk_runs_a_backward_only_when_it_or_a_chunk_before_it_trains():
    """Frozen a (alone on its ranks): forwards only, so nothing is routed back to it; frozen c after a trained b still
    passes gradients back to b; the schedule has no backward task for a."""
    from dataclasses import replace

    from plans.schedule import schedule

    chain = profile([("a.0", "a"), ("b.0", "b"), ("c.0", "c")], [("a.0", "b.0"), ("b.0", "c.0")])
    frozen = replace(chain, blocks=tuple(replace(b, frozen=b.name in ("a.0", "c.0")) for b in chain.blocks))
    groups = (group("a", 1, [0], ("a.0",)), group("b", 1, [1], ("b.0",)), group("c", 1, [2], ("c.0",)))
    training = Training(global_batch=2, micro_batches=2)
    g = graph(groups, frozen, training)
    assert [g.has_backward(c) for c in range(3)] == [False, True, True]
    assert not any(t.backward and t.chunk == 0 for t in schedule(g, "1f1b").rank_order(g, 0))
    assert all(graph(groups, chain, training).has_backward(c) for c in range(3))
