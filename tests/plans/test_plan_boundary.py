"""derive_boundaries: exact transfers for fan-in, fan-out, equal dp, colocated, tp and cross-attention; tiling property."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plans.boundary import derive_boundaries, slice_of
from plans.errors import FormatError
from plans.graph import Block, Edge, Profile, fingerprint
from plans.plan import Group, Stage, Training, Transfer


def profile(blocks: list[tuple[str, str]], edges: list[tuple[str, str]]) -> Profile:
    bs = tuple(Block(n, g, "Linear", 1, 4, 1.0, 2.0, 8.0, 4.0, signature=n) for n, g in blocks)
    es = tuple(Edge(s, d, 16.0) for s, d in edges)
    return Profile("synthetic", fingerprint(bs, es, ()), "fp32", 1, bs, es)


AB = profile([("a.0", "a"), ("b.0", "b")], [("a.0", "b.0")])


def group(name: str, dp: int, ranks: list[int], blocks: tuple[str, ...], tp: int = 1) -> Group:
    return Group(name, dp=dp, tp=tp, pp=1, stages=(Stage(blocks, tuple(ranks)),))


def transfers(src: Group, dst: Group, micro_batch: int) -> list[tuple[int, int, int, int]]:
    (b,) = derive_boundaries((src, dst), AB, Training(global_batch=micro_batch, micro_batches=1))
    assert (b.src_group, b.dst_group, b.src_block, b.dst_block, b.bytes_per_sample) == (src.name, dst.name, "a.0", "b.0", 16.0)
    return [(t.src_rank, t.dst_rank, t.start, t.stop) for t in b.transfers]


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
    assert got == [(0, 2, 0, 2), (1, 2, 2, 4), (0, 3, 0, 2), (1, 3, 2, 4)]
    got = transfers(group("a", 2, [0, 1, 2, 3], ("a.0",), tp=2), group("b", 2, [4, 5], ("b.0",)), 4)
    assert got == [(0, 4, 0, 2), (2, 5, 2, 4)]


def test_encoder_feeding_several_stages_gives_one_boundary_per_edge() -> None:
    prof = profile([("enc.0", "enc"), ("llm.0", "llm"), ("llm.1", "llm"), ("llm.2", "llm"), ("llm.3", "llm")],
                   [("enc.0", "llm.3"), ("enc.0", "llm.1"), ("llm.0", "llm.1"), ("llm.1", "llm.2"), ("llm.2", "llm.3")])
    enc = group("enc", 1, [0], ("enc.0",))
    llm = Group("llm", dp=1, tp=1, pp=2, stages=(Stage(("llm.0", "llm.1"), (1,)), Stage(("llm.2", "llm.3"), (2,))))
    got = derive_boundaries((enc, llm), prof, Training(4, 2))
    assert [(b.src_block, b.dst_block, b.transfers) for b in got] == [
        ("enc.0", "llm.1", (Transfer(0, 1, 0, 2),)),
        ("enc.0", "llm.3", (Transfer(0, 2, 0, 2),)),
    ]


def test_edges_inside_a_group_are_not_boundaries() -> None:
    prof = profile([("a.0", "a"), ("a.1", "a")], [("a.0", "a.1")])
    pipeline = Group("a", dp=1, tp=1, pp=2, stages=(Stage(("a.0",), (0,)), Stage(("a.1",), (1,))))
    assert derive_boundaries((pipeline,), prof, Training(2, 1)) == ()


def test_dp_must_divide_the_micro_batch() -> None:
    with pytest.raises(FormatError, match="micro-batch of 4 samples cannot be split over dp=3"):
        derive_boundaries((group("a", 3, [0, 1, 2], ("a.0",)), group("b", 1, [3], ("b.0",))), AB, Training(4, 1))


def test_unplaced_block_is_named() -> None:
    with pytest.raises(FormatError, match="'b.0'"):
        derive_boundaries((group("a", 1, [0], ("a.0",)),), AB, Training(1, 1))


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
