"""Time of a route between two stages' chunks for one micro-batch pair: p2p pieces, or Megatron's scatter/gather."""
from __future__ import annotations

from collections import defaultdict

from cost_models.comm import collective_link, hand_over_time, link_for, p2p_time
from plans.cluster import Cluster
from plans.stage_graph import Route, StageGraph


def route_time(graph: StageGraph, route: Route, cluster: Cluster) -> tuple[float, float]:
    """Seconds to move a route's pieces of one (producer micro-batch, consumer micro-batch) pair (and its gradients
    back), and the bytes sent: one micro-batch when both groups count alike; re-batched, the pieces of the smaller
    micro-batch (every pair moves as many samples; the slowest pair's time stands for all).

    Every message is a p2p transfer (alpha-beta on the link between its two ranks; a rank handing samples
    to itself costs nothing); a rank's sends and receives go one after another, ranks run in parallel, so
    the route takes as long as its busiest rank (Narayanan et al. 2021, section 2.2, for the pipeline case).
    """
    pairs = {(p.src_mb, p.dst_mb) for p in route.pieces}
    return max((_pair_time(graph, route, cluster, pair) for pair in sorted(pairs)), default=(0.0, 0.0))


def _pair_time(graph: StageGraph, route: Route, cluster: Cluster, pair: tuple[int, int]) -> tuple[float, float]:
    load: dict[tuple[int, int], float] = defaultdict(float)  # (0 = send / 1 = recv, rank) -> seconds
    total = 0.0
    src, dst = graph.chunks[route.src], graph.chunks[route.dst]
    if src.tp == dst.tp > 1 and src.ranks != dst.ranks:
        return _scatter_gather_time(graph, route, cluster, pair)
    for t in graph.transfers(route, pair):
        if t.src_rank == t.dst_rank:
            continue
        nbytes = (t.stop - t.start) * route.bytes_per_sample
        dt = p2p_time(nbytes, link_for(cluster, (t.src_rank, t.dst_rank)))
        load[0, t.src_rank] += dt
        load[1, t.dst_rank] += dt
        total += nbytes
    return max(load.values(), default=0.0), total


def _scatter_gather_time(graph: StageGraph, route: Route, cluster: Cluster, pair: tuple[int, int] | None = None
                         ) -> tuple[float, float]:
    """A route between stages of equal tp > 1 with Megatron's scatter/gather optimisation (Narayanan et al. 2021,
    section 4.1): every tp rank of the producer replica sends 1/tp of a piece to its counterpart, and the
    consumer's tp ranks all-gather the pieces over the TP link. Each tp rank's sends run in parallel; a
    rank's pieces go one after another; the route takes as long as its busiest rank."""
    src, dst = graph.chunks[route.src], graph.chunks[route.dst]
    tp = src.tp
    load: dict[tuple[int, int], float] = defaultdict(float)
    total = 0.0
    for t in graph.transfers(route, pair):
        if t.dst_rank != dst.tp_ranks(dst.replica_of(t.dst_rank))[0]:
            continue  # one message per piece and consumer replica: its tp-rank-0 counterpart stands for all
        nbytes = (t.stop - t.start) * route.bytes_per_sample
        dt = hand_over_time(nbytes, tp, link_for(cluster, (t.src_rank, t.dst_rank)),
                            collective_link(cluster, dst.tp_ranks(dst.replica_of(t.dst_rank))))
        load[0, t.src_rank] += dt
        load[1, t.dst_rank] += dt
        total += nbytes  # tp messages of nbytes / tp
    return max(load.values(), default=0.0), total
