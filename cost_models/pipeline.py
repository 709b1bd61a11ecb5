"""Discrete-event simulation of one training step over all groups, their pipeline stages and boundaries."""
from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from cost_models.comm import (
    all_gather_time,
    all_reduce_time,
    link_for,
    p2p_time,
    pair_link,
    reduce_scatter_time,
    ring_bytes_sent,
)
from cost_models.compute import OpTime, block_time, measured_on, optimizer_step_time
from cost_models.memory import DTYPE_BYTES, in_flight, warmup_forwards
from cost_models.offload import exposed, transfer_time
from plans.boundary import derive_boundaries
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Block, Profile
from plans.plan import Boundary, Plan

# How the step is modelled (all times in seconds from the step's start):
# - A group's stage is split into model chunks: maximal runs of its blocks that are consecutive in the
#   profile's execution order. A plain stage is one chunk; for the interleaved schedule stage i lists
#   the blocks of virtual stages i, i+pp, ..., which come out as its v chunks (Narayanan et al. 2021).
# - Ranks that host the same set of stages are identical (all dp replicas and tp shards of a stage do
#   the same work), so the simulation runs one representative per such "rank class" and results are
#   expanded to every rank by symmetry; the event loop is O(ops log ops), ops = (stages x rank classes
#   they span) x 2 micro-batches, independent of dp and tp. A class executes one compute op at a time;
#   among the ready heads of the queues of the stages it hosts (each in its schedule's order) it starts
#   the earliest, ties going to the one earlier in its own schedule (so a colocated encoder's forward of
#   micro-batch j runs before the LLM's forward of j, which needs it).
# - Dependencies: the forward of chunk k+1 (or of a block across a group boundary) on micro-batch j
#   waits for the forward of its producer on j plus the transfer; backward gradients flow back the same
#   way. Transfers are delays on a comm lane; they do not occupy the compute lane.
# - After a stage's last backward: its data-parallel gradient sync (comm lane), its optimizer step
#   (compute lane), then for ZeRO 1-2 the all-gather of the updated parameters.
# - Not modelled (documented simplifications): overlap of the data-parallel gradient sync with the
#   backward of earlier micro-batches (the sync starts after the stage's last backward); contention of
#   concurrent p2p / boundary transfers on one link; Megatron's scatter-gather of p2p tensors over tp;
#   a global gradient-norm all-reduce before the optimizer step (each stage steps when its grads are
#   ready); receive events (a transfer shows once, on the sender's comm lane).

Lane = Literal["compute", "comm", "transfer"]
LANES: tuple[Lane, ...] = ("compute", "comm", "transfer")


@dataclass(frozen=True, slots=True)
class Event:
    """One interval of a rank's timeline (seconds from the step's start)."""

    rank: int
    lane: Lane
    name: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Busy:
    """Seconds one rank spends in a step on each lane."""

    compute: float = 0.0  # forward, backward (with recompute), optimizer step
    comm: float = 0.0  # TP all-reduces, p2p and boundary sends, data-parallel and ZeRO collectives
    transfer: float = 0.0  # offload / prefetch between GPU and cpu / nvme tiers


@dataclass(frozen=True, slots=True)
class StageCost:
    """What one pipeline stage costs per micro-batch and per step, on each of its ranks (seconds)."""

    group: str
    index: int
    chunks: int  # model chunks (virtual stages) on the stage's ranks
    time: OpTime  # compute and blocking TP comm of one micro-batch, all chunks
    fwd_s: float  # forward op duration per micro-batch: time.fwd + fwd_comm + exposed transfers
    bwd_s: float
    transfer_fwd_s: float  # offload out / parameter streaming per micro-batch on the transfer lane
    transfer_bwd_s: float  # prefetch in / parameter and gradient streaming per micro-batch
    grad_sync_s: float  # data-parallel gradient all-reduce (ZeRO 0) or reduce-scatter (ZeRO 1) after the last backward
    optimizer_s: float
    param_gather_s: float  # all-gather of updated parameters after the step (ZeRO 1-2)
    downstream: int  # pipeline stages after this one on the longest data path
    warmup: int  # forwards (chunk x micro-batch) before the first backward
    in_flight: float  # micro-batches of activations held at the peak (memory.in_flight)


@dataclass(frozen=True, slots=True)
class Simulation:
    """One simulated step: times, per-stage costs, per-rank busy time and the representative timelines."""

    step_time_s: float
    pipeline_time_s: float  # end of the last forward/backward, before gradient sync and optimizer
    bubble_fraction: float  # idle compute time / (ranks x pipeline_time_s)
    stages: tuple[StageCost, ...]
    representative: dict[int, int]  # every rank of the plan -> the rank whose events it repeats
    busy: dict[int, Busy]  # every rank of the plan
    comm_bytes: float  # bytes sent by all ranks in one step
    bottleneck: str  # the busiest ranks' stages, "group/stage i" (+ ...)
    events: Callable[[], tuple[Event, ...]] = field(repr=False, compare=False)  # built once, on first use

    @property
    def timeline(self) -> tuple[Event, ...]:
        """Events of one representative rank per rank class, by rank then start (built on first access)."""
        return self.events()

    def rank_timeline(self, rank: int) -> tuple[Event, ...]:
        """The timeline of any rank: its representative's events, relabelled."""
        rep = self.representative[rank]
        return tuple(Event(rank, e.lane, e.name, e.start, e.end) for e in self.timeline if e.rank == rep)


@dataclass(slots=True)
class _Chunk:
    """Working record of one model chunk (filled while the simulation is built)."""

    group: int
    stage: int
    position: int  # index of the chunk in its group's execution order
    blocks: tuple[str, ...]
    params: float = 0.0  # parameters on one rank (tp-parallel blocks divided by tp)
    time: OpTime = field(default_factory=OpTime)
    fwd: float = 0.0  # op durations per micro-batch
    bwd: float = 0.0
    transfer_fwd: float = 0.0
    transfer_bwd: float = 0.0
    overlap_comm_fwd: float = 0.0  # ZeRO-3 gathers / ZeRO-2,3 reduce-scatters hidden behind compute
    overlap_comm_bwd: float = 0.0
    bytes_per_mb: float = 0.0  # bytes one rank of the chunk sends per micro-batch (TP + ZeRO collectives)


@dataclass(frozen=True, slots=True)
class _Tail:
    """Per-step work of a stage after its last backward (seconds), and the bytes one of its ranks sends."""

    grad_sync: float
    optimizer: float
    param_gather: float
    bytes_sent: float


def simulate(plan: Plan, profile: Profile, cluster: Cluster | None = None) -> Simulation:
    """Simulate one training step of `plan` for `profile` on `cluster` (default: the plan's)."""
    cluster = cluster or plan.cluster
    blocks = {b.name: b for b in profile.blocks}
    m = plan.training.micro_batches
    chunks, chunk_of = _chunks(plan, profile)
    by_stage: dict[tuple[int, int], list[int]] = defaultdict(list)
    for c, ch in enumerate(chunks):
        by_stage[ch.group, ch.stage].append(c)
    measured = profile.micro_batch if measured_on(profile, cluster) else None
    for ch in chunks:
        _cost_chunk(ch, plan, blocks, cluster, measured)
    edges, edge_bytes = _chunk_edges(chunks, chunk_of, plan, profile, blocks, cluster)
    orders = _orders(plan, chunks, edges, by_stage)
    class_ranks, rank_class = _rank_classes(plan)

    ops = _Ops(num_resources=2 * len(class_ranks))  # resource 2c: compute lane of class c, 2c+1: its comm lane
    fb_ops: dict[tuple[int, int, int], list[int]] = {}  # (chunk, micro-batch, 0 = fwd / 1 = bwd) -> op per class
    tails: list[tuple[tuple[int, int], _Tail]] = []
    stage_costs = []
    for (gi, si), cs in sorted(by_stage.items()):
        g, stage = plan.groups[gi], plan.groups[gi].stages[si]
        order, warmup, downstream = orders[gi, si]
        tail = _stage_tail(plan, gi, si, sum(chunks[c].params for c in cs), cluster)
        classes = sorted({rank_class[r] for r in stage.ranks})
        last, sync, opt, gather = [], [], [], []
        for cls in classes:
            q, comm_q = ops.queue(2 * cls), ops.queue(2 * cls + 1)
            for c, j, d in order:
                op = ops.op(q, chunks[c].bwd if d else chunks[c].fwd, ("bwd" if d else "fwd", c, j))
                fb_ops.setdefault((c, j, d), []).append(op)
            last.append(op)
            sync.append(ops.op(comm_q, tail.grad_sync, ("sync", gi, si)))
            opt.append(ops.op(q, tail.optimizer, ("optimizer", gi, si)))
            gather.append(ops.op(comm_q, tail.param_gather, ("gather", gi, si)))
        for a in last:  # the sync is a collective over all the stage's ranks
            for b in sync:
                ops.depend(a, b, 0.0)
        for a in sync:
            for b in opt:
                ops.depend(a, b, 0.0)
        for a, b in zip(opt, gather):
            ops.depend(a, b, 0.0)
        tails.append(((gi, si), tail))
        stage_costs.append(StageCost(
            group=g.name, index=si, chunks=len(cs), time=sum((chunks[c].time for c in cs), OpTime()),
            fwd_s=sum(chunks[c].fwd for c in cs), bwd_s=sum(chunks[c].bwd for c in cs),
            transfer_fwd_s=sum(chunks[c].transfer_fwd for c in cs), transfer_bwd_s=sum(chunks[c].transfer_bwd for c in cs),
            grad_sync_s=tail.grad_sync, optimizer_s=tail.optimizer, param_gather_s=tail.param_gather,
            downstream=downstream, warmup=warmup, in_flight=in_flight(plan.training.schedule, m, warmup, len(cs)),
        ))
    for (src, dst), lag in edges.items():
        for j in range(m):
            for a in fb_ops[src, j, 0]:
                for b in fb_ops[dst, j, 0]:
                    ops.depend(a, b, lag)
            for a in fb_ops[dst, j, 1]:
                for b in fb_ops[src, j, 1]:
                    ops.depend(a, b, lag)

    try:
        start, end = ops.run()
    except _Deadlock as stuck:
        kind, c, j = stuck.args[0]
        ch = chunks[c] if kind in ("fwd", "bwd") else None
        where = f"the {'forward' if kind == 'fwd' else 'backward'} of micro-batch {j} of group {plan.groups[ch.group].name!r} stage {ch.stage}" if ch else f"the {kind} of group {plan.groups[c].name!r} stage {j}"
        raise MmplanError(f"the plan's schedule deadlocks: {where} waits on work queued behind it; use the 1f1b or gpipe schedule for this layout") from None
    return _result(plan, chunks, stage_costs, tails, edges, edge_bytes, fb_ops, ops, start, end, class_ranks, rank_class)


# --- chunks, their costs, their dependencies --------------------------------------------------------


def _chunks(plan: Plan, profile: Profile) -> tuple[list[_Chunk], dict[str, int]]:
    """Every group's chunks in execution order, and the chunk of every block."""
    order = {b.name: i for i, b in enumerate(profile.blocks)}
    chunks: list[_Chunk] = []
    chunk_of: dict[str, int] = {}
    for gi, g in enumerate(plan.groups):
        stage_of = {b: si for si, s in enumerate(g.stages) for b in s.blocks}
        for b in stage_of:
            if b not in order:
                raise MmplanError(f"block {b!r} of group {g.name!r} is not in the profile of {profile.model!r}; re-solve the plan for this profile")
        run: list[str] = []
        first = len(chunks)
        for b in sorted(stage_of, key=order.__getitem__):
            if run and stage_of[run[-1]] != stage_of[b]:
                chunks.append(_Chunk(gi, stage_of[run[-1]], len(chunks) - first, tuple(run)))
                run = []
            run.append(b)
        if run:
            chunks.append(_Chunk(gi, stage_of[run[-1]], len(chunks) - first, tuple(run)))
        for c in range(first, len(chunks)):
            for b in chunks[c].blocks:
                chunk_of[b] = c
    missing = [b.name for b in profile.blocks if b.name not in chunk_of]
    if missing:
        raise MmplanError(f"block {missing[0]!r} of the profile is in no stage of the plan ({len(missing)} missing); place every block in one stage")
    return chunks, chunk_of


def _cost_chunk(ch: _Chunk, plan: Plan, blocks: dict[str, Block], cluster: Cluster, measured: int | None) -> None:
    """Fill a chunk's per-micro-batch compute, TP comm, transfers and overlapped ZeRO collectives."""
    training = plan.training
    g = plan.groups[ch.group]
    mem = g.stages[ch.stage].memory
    samples = training.micro_batch / g.dp  # samples of one micro-batch on one dp replica
    width = DTYPE_BYTES[training.dtype]
    time, tp_bytes, params = OpTime(), 0.0, 0.0
    out_bytes = {"cpu": 0.0, "nvme": 0.0}  # activation bytes offloaded per micro-batch, by tier
    for name in ch.blocks:
        b = blocks[name]
        t = g.tp if b.supports_tp else 1
        tier = mem.activations.get(name, "keep")
        time += block_time(b, samples, g.tp, cluster, dtype=training.dtype, measured_micro_batch=measured, recompute=tier == "recompute")
        if t > 1:  # ring all-reduces: 2 per forward, 2 per backward (and 2 more when recomputed)
            tp_bytes += (6 if tier == "recompute" else 4) * ring_bytes_sent(b.output_bytes * samples, t, all_reduce=True)
        if tier.startswith("offload-"):
            out_bytes[tier.removeprefix("offload-")] += b.activation_bytes * samples / t
        params += b.params / t
    param_bytes = params * width  # this rank's tp shard of the chunk's parameters, compute dtype
    act = sum(transfer_time(v, tier, cluster) for tier, v in out_bytes.items())  # out in fwd, back in before bwd
    params_in = transfer_time(param_bytes / (g.dp if g.zero >= 3 else 1), mem.params, cluster)  # streamed per op
    grads_out = transfer_time(param_bytes / (g.dp if g.zero >= 2 else 1), mem.grads, cluster)
    # ZeRO-3 gathers the chunk's parameters for every forward and backward; ZeRO-2/3 reduce-scatter its
    # gradients after every backward (Rajbhandari et al. 2020, sections 5.2-5.3 and 7.2), both
    # prefetched / bucketed behind compute.
    dp_link = link_for(cluster, g.stages[ch.stage].ranks[:: g.tp])
    gather = all_gather_time(param_bytes, g.dp, dp_link) if g.zero >= 3 else 0.0
    scatter = reduce_scatter_time(param_bytes, g.dp, dp_link) if g.zero >= 2 else 0.0
    ch.params, ch.time = params, time
    ch.transfer_fwd = act + params_in
    ch.transfer_bwd = act + params_in + grads_out
    ch.overlap_comm_fwd, ch.overlap_comm_bwd = gather, gather + scatter
    ch.fwd = time.fwd + time.fwd_comm + exposed(max(ch.transfer_fwd, gather), time.fwd)
    ch.bwd = time.bwd + time.bwd_comm + exposed(max(ch.transfer_bwd, gather + scatter), time.bwd)
    one = ring_bytes_sent(param_bytes, g.dp, all_reduce=False)
    ch.bytes_per_mb = tp_bytes + (2 * one if g.zero >= 3 else 0.0) + (one if g.zero >= 2 else 0.0)


def _stage_tail(plan: Plan, gi: int, si: int, params: float, cluster: Cluster) -> _Tail:
    """Per-step costs after the stage's last backward: gradient sync, optimizer step, parameter all-gather.

    ZeRO 0: ring all-reduce of the gradients; ZeRO 1: reduce-scatter, then all-gather of the updated
    parameters (Megatron's distributed optimizer; the same 2(n-1)/n volume, ZeRO section 7.2.1);
    ZeRO 2: the reduce-scatter ran after every backward, the all-gather remains; ZeRO 3: nothing.
    """
    g, training = plan.groups[gi], plan.training
    stage = g.stages[si]
    link = link_for(cluster, stage.ranks[:: g.tp])  # the dp group of tp rank 0
    nbytes = params * DTYPE_BYTES[training.dtype]  # this rank's gradients (and parameters)
    sync, sent = 0.0, 0.0
    if g.zero == 0:
        sync, sent = all_reduce_time(nbytes, g.dp, link), ring_bytes_sent(nbytes, g.dp, all_reduce=True)
    elif g.zero == 1:
        sync, sent = reduce_scatter_time(nbytes, g.dp, link), ring_bytes_sent(nbytes, g.dp, all_reduce=False)
    gather = all_gather_time(nbytes, g.dp, link) if g.zero in (1, 2) else 0.0
    sent += ring_bytes_sent(nbytes, g.dp, all_reduce=False) if g.zero in (1, 2) else 0.0
    updated = params / g.dp if g.zero >= 1 else params
    opt = optimizer_step_time(updated, stage.memory, cluster, dtype=training.dtype, optimizer=training.optimizer)
    return _Tail(sync, opt, gather, sent)


def _chunk_edges(
    chunks: list[_Chunk], chunk_of: dict[str, int], plan: Plan, profile: Profile, blocks: dict[str, Block], cluster: Cluster
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """(producer chunk, consumer chunk) -> transfer seconds per micro-batch, and bytes all ranks send for it.

    Inside a group, consecutive chunks: every profile edge crossing the cut is relayed over it, or the
    last block's output when the profile has no such edge; p2p of bytes x samples per replica, each
    rank to its peer in the next stage (Narayanan et al. 2021, section 2.2). Across groups: the plan's
    boundaries (derived from the profile when the plan has none), timed by boundary_time.
    """
    training = plan.training
    lags: dict[tuple[int, int], float] = {}
    sent: dict[tuple[int, int], float] = {}
    cut: dict[tuple[int, int], float] = defaultdict(float)  # (group, position k) -> bytes/sample from chunk k to k+1
    for e in profile.edges:
        a, b = chunks[chunk_of[e.src]], chunks[chunk_of[e.dst]]
        if a.group == b.group:
            for k in range(a.position, b.position):
                cut[a.group, k] += e.bytes
    for c, ch in enumerate(chunks[:-1]):
        nxt = chunks[c + 1]
        if nxt.group != ch.group:
            continue
        g = plan.groups[ch.group]
        nbytes = (cut.get((ch.group, ch.position)) or blocks[ch.blocks[-1]].output_bytes) * training.micro_batch / g.dp
        src, dst = g.stages[ch.stage].ranks, g.stages[nxt.stage].ranks
        link = pair_link(cluster, src, dst)
        lags[c, c + 1] = p2p_time(nbytes, link) if link else 0.0
        sent[c, c + 1] = nbytes * len(src) if link else 0.0
    boundaries = plan.boundaries
    if not boundaries and len(plan.groups) > 1:
        boundaries = derive_boundaries(plan.groups, profile, training)
    for bd in boundaries:
        key = chunk_of[bd.src_block], chunk_of[bd.dst_block]
        lag, nbytes = boundary_time(bd, cluster)
        lags[key] = lags.get(key, 0.0) + lag
        sent[key] = sent.get(key, 0.0) + nbytes
    return lags, sent


def boundary_time(boundary: Boundary, cluster: Cluster) -> tuple[float, float]:
    """Seconds to realise a boundary for one micro-batch, and the bytes it moves.

    Every transfer is a p2p message (alpha-beta on the link between its two ranks; a rank handing
    samples to itself costs nothing); a rank's sends and receives go one after another, ranks run in
    parallel, so the boundary takes as long as the busiest rank.
    """
    load: dict[tuple[int, int], float] = defaultdict(float)  # (0 = send / 1 = recv, rank) -> seconds
    total = 0.0
    for t in boundary.transfers:
        if t.src_rank == t.dst_rank:
            continue
        nbytes = (t.stop - t.start) * boundary.bytes_per_sample
        dt = p2p_time(nbytes, link_for(cluster, (t.src_rank, t.dst_rank)))
        load[0, t.src_rank] += dt
        load[1, t.dst_rank] += dt
        total += nbytes
    return max(load.values(), default=0.0), total


def _rank_classes(plan: Plan) -> tuple[list[list[int]], dict[int, int]]:
    """Ranks grouped by the stages they host (identical work), and each rank's class."""
    hosted: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for gi, g in enumerate(plan.groups):
        for si, s in enumerate(g.stages):
            for r in s.ranks:
                hosted[r].append((gi, si))
    index: dict[tuple, int] = {}
    class_ranks: list[list[int]] = []
    rank_class: dict[int, int] = {}
    for r in sorted(hosted):
        c = index.setdefault(tuple(hosted[r]), len(class_ranks))
        if c == len(class_ranks):
            class_ranks.append([])
        class_ranks[c].append(r)
        rank_class[r] = c
    return class_ranks, rank_class


# --- schedules ------------------------------------------------------------------------------------


def _orders(plan: Plan, chunks: list[_Chunk], edges: dict[tuple[int, int], float], by_stage: dict[tuple[int, int], list[int]]) -> dict[tuple[int, int], tuple[list[tuple[int, int, int]], int, int]]:
    """(group, stage) -> (op order, warm-up forwards, downstream stages).

    downstream: stages after this one on the longest data path of the stage graph (stage i -> i+1 inside
    a group, boundaries across groups). The warm-up is warmup_forwards(downstream) -- an encoder in front
    of a pp-stage LLM warms up like one more pipeline stage -- raised, for a stage that feeds other stages
    through non-interleaved chunks, until it has forwarded every micro-batch its consumers forward before
    their backward of each micro-batch k: then it never waits for a gradient that needs a forward it has
    not run (e.g. an encoder feeding an interleaved LLM, whose first stage forwards many micro-batches
    before its first backward). Stages are ordered consumers first.
    """
    training, m = plan.training, plan.training.micro_batches
    succ: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
    feeds: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # stage -> (its chunk, consumer chunk)
    for gi, g in enumerate(plan.groups):
        for si in range(g.pp - 1):
            succ[gi, si].add((gi, si + 1))
    for a, b in edges:
        ca, cb = chunks[a], chunks[b]
        if (ca.group, ca.stage) != (cb.group, cb.stage) and (ca.group != cb.group or cb.stage == ca.stage + 1):
            succ[ca.group, ca.stage].add((cb.group, cb.stage))
            feeds[ca.group, ca.stage].append((a, b))
    done: dict[tuple[int, int], tuple[list[tuple[int, int, int]], int, int]] = {}
    path: set[tuple[int, int]] = set()

    def visit(node: tuple[int, int]) -> int:
        if node in done:
            return done[node][2]
        if node in path:
            raise MmplanError(f"groups feed each other in a cycle through {plan.groups[node[0]].name!r} stage {node[1]}; the group graph must be acyclic")
        path.add(node)
        down = max((1 + visit(n) for n in succ[node]), default=0)
        path.discard(node)
        cs, pp = by_stage[node], plan.groups[node[0]].pp
        w = warmup_forwards(training.schedule, m, down, len(cs), pp)
        needs = [] if len(cs) > 1 else [(a, _forwarded_before_backward(done[chunks[b].group, chunks[b].stage][0], b, m)) for a, b in feeds[node]]
        order = _schedule(m, w, cs, pp)
        while w < m * len(cs) and any(have < need for a, need in needs for have, need in zip(_forwarded_before_backward(order, a, m), need)):
            w += 1
            order = _schedule(m, w, cs, pp)
        done[node] = (order, w, down)
        return down

    for gi, g in enumerate(plan.groups):
        for si in range(len(g.stages)):
            visit((gi, si))
    return done


def _forwarded_before_backward(order: list[tuple[int, int, int]], chunk: int, m: int) -> list[int]:
    """For each micro-batch k: the highest micro-batch whose forward of `chunk` precedes its backward of k."""
    out, top = [m] * m, -1
    for c, j, d in order:
        if c == chunk:
            if d:
                out[j] = top
            else:
                top = max(top, j)
    return out


def _schedule(m: int, warmup: int, chunks: list[int], pp: int) -> list[tuple[int, int, int]]:
    """The op order of one stage: (chunk, micro-batch, 0 = forward / 1 = backward).

    Forwards go by micro-batch; with v > 1 chunks in Megatron's interleaved order (pp micro-batches
    through chunk 0, then the same ones through chunk 1, ...), backwards with the chunks reversed. The
    first `warmup` forwards run alone, then one forward and one backward alternate (1F1B), then the
    remaining backwards drain; GPipe's warm-up is every forward.
    """
    if len(chunks) == 1:
        fwd = [(chunks[0], j) for j in range(m)]
        bwd = fwd
    else:
        fwd, bwd = [], []
        for g0 in range(0, m, pp):
            group = range(g0, min(g0 + pp, m))
            fwd += [(c, j) for c in chunks for j in group]
            bwd += [(c, j) for c in reversed(chunks) for j in group]
    order = [(c, j, 0) for c, j in fwd[:warmup]]
    for k in range(len(fwd) - warmup):
        order += [(*fwd[warmup + k], 0), (*bwd[k], 1)]
    order += [(c, j, 1) for c, j in bwd[len(fwd) - warmup :]]
    return order


# --- the event loop ------------------------------------------------------------------------------


class _Ops:
    """Ops on resources with per-queue order and dependency delays; run() gives start and end times.

    Each resource (a class's compute or comm lane) holds queues (one per stage it hosts), each in
    schedule order. Event-driven: ops start in non-decreasing time order, so when the heap yields a
    resource's candidate no other op can become ready earlier. O(ops log ops).
    """

    def __init__(self, num_resources: int):
        self.num_resources = num_resources
        self.queues: list[list[int]] = []
        self.queue_resource: list[int] = []
        self.dur: list[float] = []
        self.what: list[tuple] = []
        self.queue_of: list[int] = []
        self.succ: list[list[tuple[int, float]]] = []
        self.npred: list[int] = []

    def queue(self, resource: int) -> int:
        self.queues.append([])
        self.queue_resource.append(resource)
        return len(self.queues) - 1

    def op(self, queue: int, duration: float, what: tuple) -> int:
        i = len(self.dur)
        self.dur.append(duration)
        self.what.append(what)
        self.queue_of.append(queue)
        self.succ.append([])
        self.npred.append(0)
        self.queues[queue].append(i)
        return i

    def depend(self, before: int, after: int, lag: float) -> None:
        self.succ[before].append((after, lag))
        self.npred[after] += 1

    def run(self) -> tuple[list[float], list[float]]:
        n = len(self.dur)
        queues, queue_of, dur, succ = self.queues, self.queue_of, self.dur, self.succ
        start, end, ready = [0.0] * n, [0.0] * n, [0.0] * n
        remaining = list(self.npred)
        head = [0] * len(queues)
        free = [0.0] * self.num_resources
        version = [0] * self.num_resources
        res_queues: list[list[int]] = [[] for _ in range(self.num_resources)]
        for q, r in enumerate(self.queue_resource):
            res_queues[r].append(q)
        heap: list[tuple] = []

        def offer(r: int) -> None:
            version[r] += 1
            best = None
            for q in res_queues[r]:
                h = head[q]
                if h < len(queues[q]):
                    op = queues[q][h]
                    if remaining[op] == 0:
                        key = (max(free[r], ready[op]), h, q, op)
                        if best is None or key < best:
                            best = key
            if best is not None:
                heapq.heappush(heap, (best[0], best[1], best[2], version[r], r, best[3]))

        for r in range(self.num_resources):
            offer(r)
        done = 0
        while heap:
            s, _, q, ver, r, op = heapq.heappop(heap)
            if ver != version[r]:
                continue
            e = s + dur[op]
            start[op], end[op] = s, e
            free[r] = e
            head[q] += 1
            done += 1
            touched = {r}
            for nxt, lag in succ[op]:
                if e + lag > ready[nxt]:
                    ready[nxt] = e + lag
                remaining[nxt] -= 1
                if remaining[nxt] == 0:
                    nq = queue_of[nxt]
                    if queues[nq][head[nq]] == nxt:
                        touched.add(self.queue_resource[nq])
            for t in touched:
                offer(t)
        if done < n:
            raise _Deadlock(next(self.what[queues[q][head[q]]] for q in range(len(queues)) if head[q] < len(queues[q])))
        return start, end


class _Deadlock(Exception):
    """No op can start: the queue orders wait on each other (args[0]: the `what` of one stuck op)."""


# --- results -------------------------------------------------------------------------------------


def _result(plan, chunks, stage_costs, tails, edges, edge_bytes, fb_ops, ops, start, end, class_ranks, rank_class) -> Simulation:
    """Busy time, bubble, communication volume and bottleneck from the simulated op times; the timeline lazily."""
    m, ncls = plan.training.micro_batches, len(class_ranks)
    size = [len(ranks) for ranks in class_ranks]
    compute, comm, transfer, pipe_busy = [0.0] * ncls, [0.0] * ncls, [0.0] * ncls, [0.0] * ncls
    comm_bytes = 2 * m * sum(edge_bytes.values())  # activations forward, gradients back
    pipeline_end = 0.0
    resource = [ops.queue_resource[q] for q in ops.queue_of]
    for op, what in enumerate(ops.what):
        cls, lane = divmod(resource[op], 2)
        if what[0] in ("fwd", "bwd"):
            ch = chunks[what[1]]
            if what[0] == "bwd":
                compute[cls] += ch.time.bwd
                comm[cls] += ch.time.bwd_comm + ch.overlap_comm_bwd
                transfer[cls] += ch.transfer_bwd
            else:
                compute[cls] += ch.time.fwd
                comm[cls] += ch.time.fwd_comm + ch.overlap_comm_fwd
                transfer[cls] += ch.transfer_fwd
            pipe_busy[cls] += end[op] - start[op]
            comm_bytes += ch.bytes_per_mb * size[cls]
            pipeline_end = max(pipeline_end, end[op])
        elif lane:
            comm[cls] += end[op] - start[op]
        else:
            compute[cls] += end[op] - start[op]
    for (a, b), lag in edges.items():  # p2p and boundary sends, counted on the sender
        for src, d in ((a, 0), (b, 1)):
            for j in range(m):
                for op in fb_ops[src, j, d]:
                    comm[resource[op] // 2] += lag
    for (gi, si), tail in tails:
        comm_bytes += len(plan.groups[gi].stages[si].ranks) * tail.bytes_sent
    total = sum(size)
    bubble = 1 - sum(b * n for b, n in zip(pipe_busy, size)) / (total * pipeline_end) if pipeline_end > 0 else 0.0
    busiest = max(range(ncls), key=lambda c: compute[c] + comm[c])
    rep = [ranks[0] for ranks in class_ranks]
    bottleneck = " + ".join(f"{g.name}/stage {si}" for g in plan.groups for si, s in enumerate(g.stages) if rep[busiest] in s.ranks)
    busy_cls = [Busy(compute[c], comm[c], transfer[c]) for c in range(ncls)]
    return Simulation(
        step_time_s=max(end, default=0.0),
        pipeline_time_s=pipeline_end,
        bubble_fraction=max(0.0, bubble),
        stages=tuple(stage_costs),
        representative={r: rep[c] for r, c in rank_class.items()},
        busy={r: busy_cls[c] for r, c in rank_class.items()},
        comm_bytes=comm_bytes,
        bottleneck=bottleneck,
        events=functools.cache(functools.partial(_timeline, plan, chunks, edges, fb_ops, ops, start, end, rep)),
    )


def _timeline(plan, chunks, edges, fb_ops, ops, start, end, rep) -> tuple[Event, ...]:
    """The representative ranks' events: ops on their lanes; of each forward / backward its blocking TP
    all-reduces (drawn after its compute), its ZeRO collectives and tier transfers (from its start, hidden
    behind it); sends from the end of the producer's op."""
    groups, m = plan.groups, plan.training.micro_batches
    interleaved = {ch.group for ch in chunks if ch.position >= groups[ch.group].pp}
    events: list[Event] = []
    for op, what in enumerate(ops.what):
        cls, lane = divmod(ops.queue_resource[ops.queue_of[op]], 2)
        r, s, e = rep[cls], start[op], end[op]
        if what[0] in ("fwd", "bwd"):
            kind, c, j = what
            ch = chunks[c]
            d = kind == "bwd"
            work = ch.time.bwd if d else ch.time.fwd
            blocking = ch.time.bwd_comm if d else ch.time.fwd_comm
            hidden = ch.overlap_comm_bwd if d else ch.overlap_comm_fwd
            moved = ch.transfer_bwd if d else ch.transfer_fwd
            label = f"{kind} {groups[ch.group].name} s{ch.stage}" + (f"c{ch.position}" if ch.group in interleaved else "") + f" mb{j}"
            events.append(Event(r, "compute", label, s, e))
            if blocking > 0:
                events.append(Event(r, "comm", f"tp all-reduces of {label}", s + work, s + work + blocking))
            if hidden > 0:
                events.append(Event(r, "comm", f"zero collectives of {label}", s, s + hidden))
            if moved > 0:
                events.append(Event(r, "transfer", f"{'prefetch' if d else 'offload'} of {label}", s, s + moved))
        elif e > s:
            _, gi, si = what
            events.append(Event(r, "comm" if lane else "compute", f"{what[0]} {groups[gi].name} s{si}", s, e))
    for (a, b), lag in edges.items():
        if lag <= 0:
            continue
        for d, (src, dst) in enumerate(((a, b), (b, a))):
            what = f"{'act' if d == 0 else 'grad'} {groups[chunks[src].group].name} c{chunks[src].position} -> {groups[chunks[dst].group].name} c{chunks[dst].position}"
            for j in range(m):
                for op in fb_ops[src, j, d]:
                    r = rep[ops.queue_resource[ops.queue_of[op]] // 2]
                    events.append(Event(r, "comm", f"send {what} mb{j}", end[op], end[op] + lag))
    return tuple(sorted(events, key=lambda e: (e.rank, e.start, LANES.index(e.lane))))
