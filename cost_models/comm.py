"""Alpha-beta cost of collectives and point-to-point sends, and the link a set of ranks communicates over."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from cost_models.memory import zero_divisors
from plans.cluster import Cluster, Link

# Every time here is in seconds; every size is the bytes of the whole tensor one rank holds before
# (all-reduce, reduce-scatter, broadcast) or after (all-gather) the collective. Link.bandwidth is
# bytes/s in one direction, Link.latency_s is the per-message start-up cost alpha.


def link_between(cluster: Cluster, *, crosses_nodes: bool) -> Link:
    """The link ranks communicate over: the intra-node one, or, when they span nodes, the slower of intra- and
    inter-node (a ring or a set of parallel sends is as slow as its slowest hop; Thakur et al. 2005 assume one
    uniform link per collective). Every choice of link in the cost model and the solver comes down to this."""
    if not crosses_nodes:
        return cluster.intra_node
    return min(cluster.intra_node, cluster.inter_node, key=lambda link: link.bandwidth)


def link_for(cluster: Cluster, ranks: Iterable[int]) -> Link:
    """The slowest link the rank set spans (link_between)."""
    per_node = cluster.gpus_per_node
    if isinstance(ranks, range) and ranks.step > 0:  # ascending: it spans nodes iff its ends lie on two (hot path)
        return link_between(cluster, crosses_nodes=len(ranks) > 1 and ranks[0] // per_node != ranks[-1] // per_node)
    return link_between(cluster, crosses_nodes=len({r // per_node for r in ranks}) > 1)  # node_of(r), inlined: hot


def ranks_per_node(cluster: Cluster, ranks: Iterable[int]) -> int:
    """The fewest ranks of the set on any node it spans (0 for an empty set)."""
    per_node = cluster.gpus_per_node
    if isinstance(ranks, range) and ranks.step > 0:  # ascending, evenly spaced (the hot path): count node by node
        if not len(ranks):
            return 0
        fewest = len(ranks)
        for node in range(ranks[0] // per_node, ranks[-1] // per_node + 1):
            lo, hi = max(ranks.start, node * per_node), min(ranks.stop, (node + 1) * per_node)
            first = lo + (ranks.start - lo) % ranks.step  # the range's first element >= lo
            if first < hi:
                fewest = min(fewest, len(range(first, hi, ranks.step)))
        return fewest
    counts: dict[int, int] = {}
    for r in ranks:
        counts[r // per_node] = counts.get(r // per_node, 0) + 1
    return min(counts.values()) if counts else 0


def collective_link(cluster: Cluster, ranks: Iterable[int]) -> Link:
    """The link a collective over `ranks` runs at: inside a node the intra-node link; across nodes the inter-node
    link is one NIC per GPU (Cluster.inter_node; the DGX A100 / H100 user guides: 8 ConnectX NICs, one per GPU, on
    rail-optimised fabrics), and NCCL runs one ring per channel with the rings' node-crossing hops spread over the
    NICs of the group's GPUs on each node, so a group with k ranks on each node leaves every node through k NICs at
    once: min(intra-node, k x NIC) per rank (the ring's per-rank volume is the same at every hop; nccl-tests issue
    #119: 96 GB/s bus bandwidth across nodes from 4 x 25 GB/s HDR NICs, i.e. the NICs of the node's 4 GPUs together).
    k is the fewest of the group's ranks on any node it spans (the slowest node bounds the ring). A group with one
    rank per node (every tp-th rank when tp fills a node) is one NIC: link_for's slowest link."""
    link = link_for(cluster, ranks)
    if link is cluster.intra_node or link.bandwidth >= cluster.intra_node.bandwidth:
        return link
    k = ranks_per_node(cluster, ranks)
    if k <= 1:
        return link
    inter, intra = cluster.inter_node, cluster.intra_node
    return Link(min(intra.bandwidth, k * inter.bandwidth), max(intra.latency_s, inter.latency_s),
                max(intra.collective_s, inter.collective_s))


def dp_link(cluster: Cluster, stage_ranks: Sequence[int], tp: int) -> Link:
    """The link of a stage's data-parallel collectives: the one the dp group of its tp-rank 0 spans (stage ranks
    in Megatron order, tp fastest, so that group is every tp-th rank; the other dp groups span the same nodes), at
    the NICs its ranks on each node use together (collective_link)."""
    return collective_link(cluster, stage_ranks[::tp])


def pair_link(cluster: Cluster, src: Iterable[int], dst: Iterable[int]) -> Link | None:
    """Slowest link over the pairs (src[i], dst[i]) that send in parallel; None when every pair is one rank."""
    pairs = [(a, b) for a, b in zip(src, dst) if a != b]
    if not pairs:
        return None
    per_node = cluster.gpus_per_node
    return link_between(cluster, crosses_nodes=not all(a // per_node == b // per_node for a, b in pairs))


def fastest_link(cluster: Cluster) -> Link:
    """A link at least as fast as any the cluster has: the higher bandwidth and the lower latency (lower bounds)."""
    a, b = cluster.intra_node, cluster.inter_node
    return Link(max(a.bandwidth, b.bandwidth), min(a.latency_s, b.latency_s), min(a.collective_s, b.collective_s))


def p2p_time(nbytes: float, link: Link) -> float:
    """One message: alpha + bytes / bandwidth (Hockney's model)."""
    if nbytes <= 0:
        return 0.0
    return link.latency_s + nbytes / link.bandwidth


def hand_over_time(nbytes: float, tp: int, link: Link, tp_link: Link) -> float:
    """One pipeline hand-over of `nbytes` between stages of equal tp: a p2p send for tp = 1; for tp > 1 Megatron's
    scatter/gather (Narayanan et al. 2021, section 4.1): each tp rank sends 1/tp to its counterpart over `link`,
    then the receiving tp ranks all-gather the pieces over `tp_link`."""
    if tp <= 1:
        return p2p_time(nbytes, link)
    return p2p_time(nbytes / tp, link) + all_gather_time(nbytes, tp, tp_link)


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: 2(n-1) alpha + 2(n-1)/n * bytes / bandwidth, plus the link's fixed cost per collective call
    (Link.collective_s: every collective here pays it once).

    Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH",
    section 4.5 (reduce-scatter then all-gather on a ring); NCCL's busbw = algbw * 2(n-1)/n (nccl-tests
    PERFORMANCE.md) is the same factor.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    return link.collective_s + 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather of a result of `nbytes`: (n-1) alpha + (n-1)/n * bytes / bandwidth (Thakur et al. 2005, 4.1)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return link.collective_s + (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an input of `nbytes`: (n-1) alpha + (n-1)/n * bytes / bandwidth (Thakur et al. 2005, 4.4)."""
    return all_gather_time(nbytes, n, link)


def broadcast_time(nbytes: float, n: int, link: Link) -> float:
    """MPICH broadcast: the faster of a binomial tree, ceil(log2 n)(alpha + bytes/bw), and scatter + ring
    all-gather, (ceil(log2 n) + n - 1) alpha + 2(n-1)/n bytes/bw (Thakur et al. 2005, section 4.1)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = math.ceil(math.log2(n))
    tree = steps * (link.latency_s + nbytes / link.bandwidth)
    scatter_allgather = (steps + n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth
    return link.collective_s + min(tree, scatter_allgather)


def ring_bytes_sent(nbytes: float, n: int, *, all_reduce: bool) -> float:
    """Bytes one rank sends in a ring collective: 2(n-1)/n * bytes for all-reduce, (n-1)/n for the halves."""
    if n <= 1:
        return 0.0
    return (2 if all_reduce else 1) * (n - 1) / n * nbytes


class ZeroCollectives(NamedTuple):
    """ZeRO's communication in every micro-batch of a stage, per rank."""

    gather: float  # seconds: the parameter all-gather before every forward and every backward (ZeRO 3)
    scatter: float  # seconds: the gradient reduce-scatter after every backward (ZeRO 2-3)
    bytes_sent: float  # bytes one rank sends for them in a micro-batch: two gathers and one scatter


def zero_collectives(param_bytes: float, *, dp: int, zero: int, link: Link) -> ZeroCollectives:
    """ZeRO's per-micro-batch collectives of a stage holding `param_bytes` of parameters per rank: stage 3
    all-gathers the parameters before every forward and backward, stages 2-3 reduce-scatter the gradients after
    every backward (Rajbhandari et al. 2020, sections 5.2-5.3 and 7.2), each over the ranks the state is sharded
    over (zero_divisors); both are prefetched / bucketed behind compute."""
    share = zero_divisors(zero, dp)
    return ZeroCollectives(
        all_gather_time(param_bytes, share.params, link),
        reduce_scatter_time(param_bytes, share.grads, link),
        2 * ring_bytes_sent(param_bytes, share.params, all_reduce=False) + ring_bytes_sent(param_bytes, share.grads, all_reduce=False),
    )
