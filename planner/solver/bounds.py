"""A candidate layout (Layout) and lower bounds of the simulated step: per layout, per (tp, dp) run, per boundary."""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from cost_models.comm import all_gather_time, fastest_link, link_between
from cost_models.memory import warmup_forwards
from planner.solver.space import Policy, Schedule
from plans.cluster import Cluster
from plans.plan import Memory

# Bounds. For the ILP and the branch-and-bound of planner/solver/allocate.py every layout carries terms of a lower
# bound on the simulated step time of any plan using it. For stage k of a unit with per-micro-batch
# forward f, backward b, m micro-batches and warm-up w (1F1B: w = stages downstream, GPipe: w = m):
#   In_k   earliest start of its first forward: the forward path of micro-batch 0 to it (sends included);
#   Up_k   after any backward of stage k: the backward path to an earlier stage i, then i's gradient sync,
#          optimizer step and parameter gather (its tail), maximised over i <= k;
#   Down_k after a forward of stage k, the round trip of that micro-batch through the later stages.
# Its ranks run its 2m operations one at a time in schedule order, so the step is at least
#   In_k + max(m(f+b) + max(0, Down_k + b - r b),  m b + max(m f, (m-q+1) f + Down_k)) + Up_k
# with r = q = min(w + 1, m): the first term follows micro-batch m-1 (whose forward comes after m - r
# backwards and whose backward needs Down_k), the second micro-batch 0 (its backward waits for q forwards
# and Down_k). And the schedule's forward of micro-batch j + q comes after the backward of j, so every q
# micro-batches cost at least a round trip R_k = f + Down_k + b (1F1B's in-flight limit, which is where
# the p2p sends cost time):  In_k + j0 f + ((m - 1 - j0) / q + 1) R_k + Up_k,  j0 = (m - 1) mod q.
# When r < m both waits happen on one lane (the warm-up's and the cool-down's bubble): backward 0 starts
# no earlier than max(r f, f + Down_k); between it and the end of forward m-1 the lane runs forwards r..m-1
# and backwards 0..m-r-1 (at most r forwards precede backward 0, at least m - r backwards precede forward
# m-1, the same two facts the terms above use); after forward m-1 it runs the remaining r backwards, the
# last no earlier than Down_k + b later. So the body is at least
#   max(m f, (m - r + 1) f + Down_k) + max(m b, (m - r + 1) b + Down_k)
# (fewer forwards before backward 0 or more backwards before forward m-1 only lengthen it). On a 1F1B
# pipeline whose first stage is the slowest this is the simulated step (the 5-9 % gap of the terms above).
# The tests check bound <= simulated step time on random plans.


@dataclass(frozen=True, slots=True)
class Bound:
    """Terms of a layout's lower bound on the step time of any plan using it (see the module comment).

    own: from the unit's stages alone. fwd_out / bwd_in (sources): forward latency of micro-batch 0 until
    the unit's last forward ends; after the unit's last stage gets a gradient, its backward and the path
    back with a tail. k1..k4 (sinks): the bound is the max of k1, k2[e] + Y_e, k3[e] + X_e and
    k4[e][e'] + X_e + Y_e' with X_e = feed e's forward latency into the sink and Y_e its backward tail.
    busy: the busiest stage's compute lane, m (f + b) + optimizer (colocated ranks add these up).
    """

    own: float
    fwd_out: float
    bwd_in: float
    k1: float
    k2: tuple[float, ...]
    k3: tuple[float, ...]
    k4: tuple[tuple[float, ...], ...]
    busy: float
    trained: bool = True  # the unit's last stage runs backwards (a frozen source gets no gradient: no boundary back)


@dataclass(frozen=True)
class Layout:
    """One candidate layout of a unit with its per-stage costs (seconds, bytes per rank) and bound terms."""

    unit: str
    schedule: Schedule
    micro_batches: int
    tp: int
    dp: int
    zero: int
    cuts: tuple[int, ...]
    policies: tuple[Policy, ...]
    downstream: int | None  # 1F1B sources: the stages after the unit its memory was sized for; None = any
    assumed_downstream: int  # the depth memory and bounds assume (the largest possible when downstream is None)
    fwd: tuple[float, ...]  # forward op of one micro-batch, per stage
    bwd: tuple[float, ...]
    lag: tuple[float, ...]  # p2p send between stage k and k+1 (each direction)
    tail: tuple[float, ...]  # gradient sync + optimizer + parameter gather, per stage
    optimizer: tuple[float, ...]
    gather: tuple[float, ...]  # ZeRO 1-2's parameter all-gather (on GPUs what it adds to the next first forward)
    gpu_bytes: tuple[float, ...]
    cpu_bytes: tuple[float, ...]
    nvme_bytes: tuple[float, ...]
    samples: float  # per replica and micro-batch
    out_bytes: float  # bytes per sample of the unit's smallest edge to another unit (sources)
    entries: tuple[int, ...] = ()  # per feed of the unit: the stage holding its first fed block
    slowest: float = 0.0  # the DP's objective
    sequence_parallel: bool = False
    # the stages each stage reads from, when that is not just the one before it (() = a linear pipeline: a unit
    # holding two encoders side by side, or a block reading past a cut, is not); planner/solver/bounds.py follows it
    preds: tuple[tuple[int, ...], ...] = ()
    # per stage, whether the bounds may count on it running backwards (() = every stage): a stage of frozen blocks
    # fed by no training stage runs forwards only (plans/stage_graph.StageGraph.trains)
    backward: tuple[bool, ...] = ()
    # interleaved 1F1B: model chunks per rank (cuts are then the pp * chunks - 1 chunk cut points, stage k holding chunks
    # k, k + pp, ...; fwd / bwd / tail / bytes are per stage, chunk_fwd / chunk_bwd per chunk)
    chunks: int = 1
    chunk_fwd: tuple[float, ...] = ()
    chunk_bwd: tuple[float, ...] = ()
    reshard_after_forward: bool = True  # ZeRO-3: FSDP2 gathers again for the backward (plans.plan.Group)
    # 1F1B sources on their own ranks: micro-batches the unit's stages run ahead of the sink (Group.lookahead); memory and
    # the bound's in-flight count r already include it, through assumed_downstream (= the sink's depth + lookahead)
    lookahead: int = 0
    bound: Bound = field(init=False, compare=False, repr=False)  # layout_bound, below

    def __post_init__(self) -> None:
        object.__setattr__(self, "bound", layout_bound(self))

    @property
    def pp(self) -> int:
        return (len(self.cuts) + 1) // self.chunks

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def key(self) -> tuple:
        return (self.unit, self.micro_batches, self.tp, self.dp, self.pp, self.zero, self.downstream, self.cuts, self.policies,
                self.sequence_parallel, self.chunks, self.reshard_after_forward, self.lookahead)

    def stage_blocks(self, blocks: Sequence[str]) -> list[tuple[str, ...]]:
        """Per stage, its blocks in execution order (with chunks > 1: chunks k, k + pp, ... of stage k)."""
        bounds = (0, *self.cuts, len(blocks))
        parts = [tuple(blocks[a:b]) for a, b in zip(bounds, bounds[1:])]
        return [tuple(x for c in parts[k::self.pp] for x in c) for k in range(self.pp)]

    def memories(self, blocks: Sequence[str], cores: Collection[str] | None = None) -> tuple[Memory, ...]:
        """Per-stage plan Memory of the layout (blocks: the unit's block names; cores: those with an attention core)."""
        return tuple(pol.memory(names, cores) for pol, names in zip(self.policies, self.stage_blocks(blocks)))


def layout_bound(lay: Layout) -> Bound:
    """The bound terms of a layout (computed once, when the Layout is made)."""
    if lay.chunks > 1:
        return _interleaved_bound(lay)
    into, up, down = _paths(lay)
    body = _body(lay, down)
    p, f, b, m = lay.pp, lay.fwd, counted_bwd(lay), lay.micro_batches
    preds, lag = _dag(lay)
    ninf = -math.inf
    fpath, bpath = [], []  # per feed: forward / backward path from its entry stage to stage k
    for j in lay.entries:
        fp, bp = [ninf] * p, [ninf] * p
        fp[j] = bp[j] = 0.0
        for k in range(j + 1, p):
            fp[k] = max((fp[i] + f[i] + w for i, w in zip(preds[k], lag[k])), default=ninf)
            bp[k] = max((bp[i] + b[i] + w for i, w in zip(preds[k], lag[k])), default=ninf)
        fpath.append(fp)
        bpath.append(bp)
    own = max(into[k] + body[k] + up[k] for k in range(p))
    return Bound(
        own=own,
        fwd_out=into[-1] + f[-1],
        bwd_in=b[-1] + up[-1],
        k1=own,
        k2=tuple(max(into[k] + body[k] + bp[k] for k in range(p)) for bp in bpath),
        k3=tuple(max(fp[k] + body[k] + up[k] for k in range(p)) for fp in fpath),
        k4=tuple(tuple(max(fp[k] + body[k] + bp[k] for k in range(p)) for bp in bpath) for fp in fpath),
        busy=max(m * (x + y) + o for x, y, o in zip(f, b, lay.optimizer)),
        trained=not lay.backward or lay.backward[-1],
    )


def _interleaved_bound(lay: Layout) -> Bound:
    """An interleaved layout (a chain unit's linear pipeline of pp * v chunks, stage k holding chunks k, k + pp, ...;
    sends not counted): stage k's lane runs its m v forwards and m v backwards after micro-batch 0's forwards through
    chunks 0..k-1 reach it (In_k), and none of its backwards can start before micro-batch 0 went forward through every
    chunk and backward through every chunk after its last one, (v - 1) pp + k (W_k); its optimizer step follows its
    last backward. So the step is at least max(In_k + m (F_k + B_k), W_k + m B_k) + optimizer_k. And at most r_k =
    min(w_k + 1, m v) forwards precede its first backward (the schedule's w_k warm-up forwards, memory.warmup_forwards,
    as for 1F1B): the other m v - r_k forwards, each at least its smallest chunk's, follow it:
    max(W_k, In_k + r_k f_min) + (m v - r_k) f_min + m B_k + optimizer_k."""
    p, m, v = lay.pp, lay.micro_batches, lay.chunks
    cf, cb = lay.chunk_fwd, lay.chunk_bwd
    total_f = sum(cf)
    own = 0.0
    for k in range(p):
        into = sum(cf[:k])
        wait = total_f + sum(cb[(v - 1) * p + k + 1:])
        r = min(warmup_forwards("interleaved", m, p - 1 - k, v, p) + 1, m * v)
        fmin = min(cf[k::p])
        own = max(own, max(into + m * (lay.fwd[k] + lay.bwd[k]), wait + m * lay.bwd[k],
                           max(wait, into + r * fmin) + (m * v - r) * fmin + m * lay.bwd[k]) + lay.optimizer[k])
    busy = max(m * (x + y) + o for x, y, o in zip(lay.fwd, lay.bwd, lay.optimizer))
    return Bound(own=own, fwd_out=total_f, bwd_in=sum(cb), k1=own, k2=(), k3=(), k4=(), busy=busy)


def _dag(lay: Layout) -> tuple[list[tuple[int, ...]], list[tuple[float, ...]]]:
    """The stages each stage waits for and the send on each such edge: stage k - 1 and the p2p lag of a linear
    pipeline; else the stages its blocks read (Layout.preds), with no send counted (the lag is the route into the
    stage's first block, which then may come from any earlier stage)."""
    if not lay.preds:
        return [()] + [(k - 1,) for k in range(1, lay.pp)], [()] + [(lay.lag[k - 1],) for k in range(1, lay.pp)]
    return list(lay.preds), [(0.0,) * len(ps) for ps in lay.preds]


def counted_bwd(lay: Layout) -> tuple[float, ...]:
    """Per stage, the backward op the bounds count: none on a stage that runs forwards only (Layout.backward)."""
    return lay.bwd if not lay.backward else tuple(x if has else 0.0 for x, has in zip(lay.bwd, lay.backward))


def _paths(lay: Layout) -> tuple[list[float], list[float], list[float]]:
    """In_k, Up_k, Down_k of the module comment (inside the unit), along the stages' data flow (_dag)."""
    p, f, b, tail = lay.pp, lay.fwd, counted_bwd(lay), lay.tail
    preds, lag = _dag(lay)
    into = [0.0] * p
    up = [0.0] * p
    back = lay.backward or (True,) * p
    for k in range(p):
        into[k] = max((into[i] + f[i] + w for i, w in zip(preds[k], lag[k])), default=0.0)
        # gradients go back only to stages that run backwards
        up[k] = max([tail[k], *(b[i] + w + up[i] for i, w in zip(preds[k], lag[k]) if back[i])])
    down = [0.0] * p
    for k in range(p - 1, -1, -1):
        for i, w in zip(preds[k], lag[k]):
            down[i] = max(down[i], down[k] + f[k] + b[k] + 2 * w)
    return into, up, down

def _body(lay: Layout, down: list[float]) -> list[float]:
    """Per stage: the middle term of the bound (its 2m operations and the waits they cannot avoid)."""
    m, p = lay.micro_batches, lay.pp
    out = []
    for k in range(p):
        if lay.backward and not lay.backward[k]:
            out.append(m * lay.fwd[k])  # forwards only: no in-flight limit, no round trip
            continue
        r = min(warmup_forwards(lay.schedule, m, p - 1 - k + lay.assumed_downstream) + 1, m)
        out.append(stage_body(lay.fwd[k], lay.bwd[k], m, r, down[k]))
    return out


def stage_body(f: float, b: float, m: int, r: int, down: float) -> float:
    """The middle term of the bound of a stage with forward f, backward b, m micro-batches, at most r forwards before
    its first backward (r = min(warm-up + 1, m)) and round trip `down` through the later stages (module comment)."""
    j0 = (m - 1) % r
    terms = [m * (f + b) + max(0.0, down + b - r * b), m * b + max(m * f, (m - r + 1) * f + down),
             j0 * f + ((m - 1 - j0) // r + 1) * (f + down + b)]
    if r < m:  # both waits at once: micro-batch 0's backward, then m - 1's (the module comment's last term)
        terms.append(max(m * f, (m - r + 1) * f + down) + max(m * b, (m - r + 1) * b + down))
    return max(terms)


def run_bound(work: float, micro_batches: int, depth: int) -> float:
    """A lower bound of the step of every layout of a (tp, dp) run: one micro-batch goes through every block
    (work), and the busiest of at most `depth` stages runs m micro-batches of at least work / depth."""
    return max(work, micro_batches * work / depth)


def boundary_bound(src: Layout, dst: Layout, cluster: Cluster) -> float:
    """A lower bound of the boundary from a source unit (own ranks) to the sink per micro-batch and direction
    (routes.route_time over the route's transfers, plans/stage_graph.py, on the fastest link): a sink rank receives from
    every source replica overlapping its slice, a source replica's tp-rank 0 sends its slice to every tp rank of
    every overlapping sink replica; one message each, alpha + bytes / bandwidth. The link: between nodes when
    either unit fills whole nodes (allocate.assign_ranks never puts another unit on them), else the fastest."""
    if src.out_bytes <= 0:
        return 0.0
    fills_nodes = cluster.nodes > 1 and max(src.gpus, dst.gpus) >= cluster.gpus_per_node
    link = link_between(cluster, crosses_nodes=True) if fills_nodes else fastest_link(cluster)
    micro = src.samples * src.dp  # samples of a micro-batch
    per = src.out_bytes
    if src.tp == dst.tp > 1:  # scatter/gather (comm.hand_over_time): 1/tp per rank pair, all-gather at the receiver
        tp = dst.tp
        gather = all_gather_time(micro / dst.dp * per, tp, fastest_link(cluster))
        recv = max(1, src.dp // dst.dp) * link.latency_s + micro / dst.dp * per / (tp * link.bandwidth) + gather
        send = max(1, dst.dp // src.dp) * link.latency_s + micro / src.dp * per / (tp * link.bandwidth)
        return max(recv, send)
    recv = max(1, src.dp // dst.dp) * link.latency_s + micro / dst.dp * per / link.bandwidth
    sends = max(1, dst.dp // src.dp) * dst.tp
    send = sends * link.latency_s + dst.tp * micro / src.dp * per / link.bandwidth
    return max(recv, send)
