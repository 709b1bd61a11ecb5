"""Alpha-beta collectives against NCCL's bus-bandwidth definitions and MPICH's ring costs; link choice."""
from __future__ import annotations

import math

import pytest

from cost_models.comm import (
    all_gather_time,
    collective_link,
    all_reduce_time,
    broadcast_time,
    dp_link,
    fastest_link,
    link_between,
    link_for,
    p2p_time,
    ranks_per_node,
    pair_link,
    reduce_scatter_time,
    ring_bytes_sent,
    zero_collectives,
)
from cost_models.cluster_spec import catalog_cluster
from plans.cluster import Link

GIB = 2**30


@pytest.mark.parametrize("n", [2, 8, 64, 1024])
def test_ring_all_reduce_runs_at_bus_bandwidth(n):
    # nccl-tests PERFORMANCE.md: all-reduce busbw = algbw * 2(n-1)/n equals the link bandwidth of a ring.
    link = Link(bandwidth=450e9)
    t = all_reduce_time(GIB, n, link)
    assert GIB / t * 2 * (n - 1) / n == pytest.approx(link.bandwidth, rel=1e-12)


@pytest.mark.parametrize("collective", [all_gather_time, reduce_scatter_time])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_all_gather_and_reduce_scatter_run_at_bus_bandwidth(collective, n):
    # nccl-tests PERFORMANCE.md: all-gather / reduce-scatter busbw = algbw * (n-1)/n.
    link = Link(bandwidth=50e9)
    assert GIB / collective(GIB, n, link) * (n - 1) / n == pytest.approx(link.bandwidth, rel=1e-12)


def test_ring_latency_terms_count_the_ring_steps():
    # Thakur et al. 2005: a ring all-reduce takes 2(n-1) steps, all-gather / reduce-scatter n-1 steps.
    fast, slow = Link(1e12, 0.0), Link(1e12, 1e-5)
    for n in (2, 16):
        assert all_reduce_time(1e6, n, slow) - all_reduce_time(1e6, n, fast) == pytest.approx(2 * (n - 1) * 1e-5)
        assert all_gather_time(1e6, n, slow) - all_gather_time(1e6, n, fast) == pytest.approx((n - 1) * 1e-5)


def test_every_collective_call_pays_the_links_fixed_cost_once_and_a_send_does_not():
    bare, gloo = Link(1e9, 1e-4), Link(1e9, 1e-4, 1.2e-3)  # calibrate's collective_s: gloo's per-call cost
    for n in (2, 8):
        for collective in (all_reduce_time, all_gather_time, reduce_scatter_time, broadcast_time):
            assert collective(1e6, n, gloo) - collective(1e6, n, bare) == pytest.approx(1.2e-3)
        assert collective(1e6, 1, gloo) == 0.0  # no call on one rank
    assert p2p_time(1e6, gloo) == p2p_time(1e6, bare)
    # one all-reduce call is cheaper than the reduce-scatter + all-gather calls it is made of, by one call
    assert all_reduce_time(1e6, 8, gloo) == pytest.approx(reduce_scatter_time(1e6, 8, gloo) + all_gather_time(1e6, 8, gloo) - 1.2e-3)


def test_all_reduce_is_a_reduce_scatter_then_an_all_gather():
    link = Link(25e9, 5e-6)
    assert all_reduce_time(3e8, 16, link) == pytest.approx(reduce_scatter_time(3e8, 16, link) + all_gather_time(3e8, 16, link))


def test_broadcast_is_one_message_for_two_ranks_and_scatter_allgather_when_large():
    link = Link(25e9, 5e-6)
    assert broadcast_time(1e6, 2, link) == pytest.approx(p2p_time(1e6, link))
    # Long messages: van de Geijn scatter + all-gather moves 2(n-1)/n of the message, like an all-reduce.
    big = 64 * GIB
    assert broadcast_time(big, 64, link) == pytest.approx(2 * 63 / 64 * big / link.bandwidth, rel=1e-4)
    # Short messages: a binomial tree of ceil(log2 n) hops.
    assert broadcast_time(8, 64, link) == pytest.approx(math.ceil(math.log2(64)) * p2p_time(8, link))


def test_nothing_to_do_costs_nothing():
    link = Link(1e9, 1e-3)
    assert all_reduce_time(GIB, 1, link) == all_gather_time(GIB, 1, link) == broadcast_time(GIB, 1, link) == 0.0
    assert p2p_time(0, link) == all_reduce_time(0, 8, link) == 0.0
    assert ring_bytes_sent(GIB, 1, all_reduce=True) == 0.0
    assert ring_bytes_sent(GIB, 4, all_reduce=True) == 2 * ring_bytes_sent(GIB, 4, all_reduce=False) == 1.5 * GIB


def test_link_for_is_the_slowest_link_the_ranks_span():
    cluster = catalog_cluster("16xh100-sxm")  # two nodes of 8
    assert link_for(cluster, range(8)) == cluster.intra_node
    assert link_for(cluster, [7, 8]) == cluster.inter_node
    assert link_for(cluster, [3]) == cluster.intra_node
    assert pair_link(cluster, [0, 1], [8, 9]) == cluster.inter_node
    assert pair_link(cluster, [0, 1], [2, 3]) == cluster.intra_node
    assert pair_link(cluster, [0, 1], [0, 1]) is None  # every rank hands over to itself


def test_dp_link_is_the_link_of_the_dp_group_of_tp_rank_0():
    cluster = catalog_cluster("16xh100-sxm")
    assert dp_link(cluster, range(8), 2) == cluster.intra_node  # a stage inside one node
    assert dp_link(cluster, range(16), 8) == cluster.inter_node  # ranks 0 and 8: one per node
    assert dp_link(cluster, range(8, 16), 8) == cluster.intra_node  # dp = 1: a single rank
    assert link_between(cluster, crosses_nodes=False) == cluster.intra_node
    assert link_between(cluster, crosses_nodes=True) == cluster.inter_node  # the slower of the two
    fast = fastest_link(cluster)
    assert fast.bandwidth >= cluster.intra_node.bandwidth and fast.latency_s <= cluster.intra_node.latency_s


def test_zero_collectives_run_over_the_sharded_ranks():
    link = Link(1e9, 1e-5)
    assert zero_collectives(GIB, dp=8, zero=1, link=link) == (0.0, 0.0, 0.0)
    assert zero_collectives(GIB, dp=8, zero=2, link=link) == (0.0, reduce_scatter_time(GIB, 8, link), 7 / 8 * GIB)
    three = zero_collectives(GIB, dp=8, zero=3, link=link)
    assert three == (all_gather_time(GIB, 8, link), reduce_scatter_time(GIB, 8, link), 3 * 7 / 8 * GIB)


def test_link_for_a_range_is_the_link_for_its_ranks():
    cluster = catalog_cluster("32xh100-sxm")
    for r in (range(0), range(3, 4), range(0, 8), range(4, 12), range(0, 32, 8), range(8, 16, 2), range(6, 10, 3)):
        assert link_for(cluster, r) == link_for(cluster, list(r)), r


def test_a_collective_across_nodes_leaves_each_node_through_the_nics_of_its_ranks_there():
    # one NIC per GPU (DGX H100: 8 x 400 Gb/s ConnectX-7, 50 GB/s each): a dp group of k ranks per node runs at
    # k NICs, capped by NVLink; one rank per node (tp fills the node) is one NIC; p2p pairs stay at one NIC
    cluster = catalog_cluster("48xh100-sxm")
    nic, nvlink = cluster.inter_node.bandwidth, cluster.intra_node.bandwidth
    assert collective_link(cluster, range(0, 48, 8)) == cluster.inter_node  # tp 8: one rank per node
    assert collective_link(cluster, range(0, 48, 4)).bandwidth == 2 * nic  # tp 4: two per node
    assert collective_link(cluster, range(0, 48, 2)).bandwidth == 4 * nic  # tp 2: four per node
    assert collective_link(cluster, range(48)).bandwidth == min(nvlink, 8 * nic) == nvlink  # tp 1: NVLink-bound
    assert collective_link(cluster, range(48)).latency_s == cluster.inter_node.latency_s  # its slowest hop
    assert collective_link(cluster, range(8)) == cluster.intra_node  # inside a node: NVLink
    assert collective_link(cluster, [0, 1, 2, 8]) == cluster.inter_node  # the node with one rank bounds the ring
    assert dp_link(cluster, range(48), 2) == collective_link(cluster, range(0, 48, 2))
    assert pair_link(cluster, range(8), range(8, 16)) == cluster.inter_node  # parallel sends: a NIC each
    slow = catalog_cluster("16xh100-sxm")  # more NICs than NVLink carries: never above the intra-node link
    assert collective_link(slow, range(16)).bandwidth <= slow.intra_node.bandwidth


def test_ranks_per_node_of_a_range_is_that_of_its_ranks():
    cluster = catalog_cluster("48xh100-sxm")
    for r in (range(0), range(5, 6), range(0, 48), range(4, 12), range(0, 48, 8), range(3, 40, 3), range(6, 30, 5)):
        assert ranks_per_node(cluster, r) == ranks_per_node(cluster, list(r)), r
    assert ranks_per_node(cluster, range(4, 12)) == 4 and ranks_per_node(cluster, [0, 1, 8]) == 1
