"""Discrete-event simulation of one training step over all groups, their pipeline stages and boundaries."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from cost_models.comm import dp_link, ring_bytes_sent, zero_collectives
from cost_models.compute import OpTime, block_time, grad_accumulation_time, measured_on, tp_shard
from cost_models.fsdp import chunk_passes, first_forward_gather
from cost_models.memory import DTYPE_BYTES, block_input_bytes, kept_activation_bytes, zero_divisors
from cost_models.offload import exposed, offload_accounting, overlaps_compute, state_streaming, transfer_time
from cost_models.overhead import step_overhead, zero_block_time
from cost_models.routes import route_time
from cost_models.tail import stage_tail
from cost_models.ties import plan_stages, with_copies, with_tie_syncs
from plans.cluster import Cluster
from plans.errors import FormatError, MmplanError
from plans.graph import Block, Profile
from plans.plan import Group, Plan, flow_of
from plans.schedule import Task, schedule, task_name
from plans.stage_graph import Chunk, StageGraph, stage_graph
from plans.trace import LANES as TRACE_LANES

# How the step is modelled (all times in seconds from the step's start):
# - The step runs the plan's schedule (plans/schedule.py) over its stage graph (plans/stage_graph.py): the
#   same chunks, routes and per-rank task orders the runtime executes. Ranks of one rank class do the same
#   work, so the simulation runs one representative per class and expands results to every rank by
#   symmetry; its size is (chunks x micro-batches x 2), independent of dp and tp.
# - A task (forward or backward of a chunk on a micro-batch) occupies the compute lane of every class
#   hosting its stage; it starts when it is first in each of their orders and its inputs have arrived:
#   the forward of a chunk waits for the forwards of the chunks it reads plus the route's transfer time,
#   the backward for the backwards of the chunks that read it plus the transfer back. With fixed orders
#   the step is a longest-path computation over a DAG: O(tasks + dependencies).
# - Transfers are delays between tasks (every p2p message alpha-beta on the link between its two ranks;
#   a rank's messages of one route go one after another; the busiest rank sets the route's time); they do
#   not occupy a lane.
# - After a class's last task, as in the runtime's loop: the data-parallel gradient sync of each stage it
#   hosts (comm lane, a collective over all the stage's classes), then each stage's optimizer step
#   (compute lane), then for ZeRO 1-2 the all-gather of the updated parameters (comm lane): on GPUs what FSDP2's
#   gathers add to the next step's first forward, where they run (fsdp.first_forward_gather), kept in the tail.
# - The gradient sync is bucketed and overlaps the stage's last backward (tail.tail_over); routes between stages
#   of equal tp > 1 use the scatter/gather optimisation (route_time).
# - Not modelled (documented simplifications): contention of concurrent transfers on one link; a global gradient-norm
#   all-reduce before the optimizer step.

Lane = Literal["compute", "comm", "transfer"]
LANES: tuple[Lane, ...] = TRACE_LANES  # one lane list for predicted and measured traces


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
    param_gather_s: float  # ZeRO 1-2's all-gather of the updated parameters (exposed part on GPUs)
    downstream: int  # pipeline stages after this one on the longest data path
    warmup: int  # forwards (chunk x micro-batch) before the first backward
    in_flight: float  # micro-batches of activations held at the peak (memory.in_flight)
    micro_batches: int = 1  # the stage's micro-batches per step (its group's own count, Plan.micro_batches_of)


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
    overhead_s: float = 0.0  # the runtime's fixed per-step cost included in step_time_s (cost_models/overhead.py)

    @property
    def timeline(self) -> tuple[Event, ...]:
        """Events of one representative rank per rank class, by rank then start (built on first access)."""
        return self.events()

    def rank_timeline(self, rank: int) -> tuple[Event, ...]:
        """The timeline of any rank: its representative's events, relabelled."""
        rep = self.representative[rank]
        return tuple(Event(rank, e.lane, e.name, e.start, e.end) for e in self.timeline if e.rank == rep)


@dataclass(slots=True)
class _Cost:
    """What one chunk costs per micro-batch on one of its ranks (filled by _cost_chunk)."""

    params: float = 0.0  # parameters on one rank (tp-parallel blocks divided by tp)
    trained: float = 0.0  # of them, those of blocks not frozen (synced and updated in the tail)
    tensors: int = 0  # trained parameter tensors (Block.param_tensors): the optimizer's per-tensor work
    time: OpTime = field(default_factory=OpTime)
    fwd: float = 0.0  # task durations per micro-batch
    bwd: float = 0.0
    transfer_fwd: float = 0.0
    transfer_bwd: float = 0.0
    overlap_comm_fwd: float = 0.0  # ZeRO-3 gathers / ZeRO-2,3 reduce-scatters hidden behind compute
    overlap_comm_bwd: float = 0.0
    param_gather: float | None = None  # GPUs: what ZeRO 1-2's gather adds to the step's first forward (tail.tail_over)
    bytes_per_mb: float = 0.0  # bytes one rank of the chunk sends per micro-batch (TP + ZeRO collectives)


def simulate(plan: Plan, profile: Profile, cluster: Cluster | None = None, *, grad_sync_overlap: bool = True,
             blocking_p2p: bool = False, fused_grad_accumulation: bool = False,
             overlapped_tp_backward: bool = False, optimizer_extra_bytes: float = 0.0, grad_sync_bytes: int | None = None,
             overlapped_param_gather: bool = False, tp_comm_overlap: bool = False,
             cross_entropy_bytes: tuple[float, float] | None = None, selective: str = "attention",
             attention: str = "fused") -> Simulation:
    """Simulate one training step of `plan` for `profile` on `cluster` (default: the plan's).

    Eleven switches price other runtimes than mmplan's (the fidelity bench reproduces published runs with them):
    `grad_sync_overlap=False`, a runtime that all-reduces the gradients only after the last backward (Megatron-LM's
    `--DDP-impl local`, the default until 2023); `blocking_p2p=True`, a runtime whose pipeline sends and receives
    stop the compute stream (Megatron-LM 2021, p2p_communication._communicate: batch_isend_irecv, wait, then
    torch.cuda.synchronize()): a task's send of its output to the next chunk (forward) or of its input gradient
    to the previous one (backward) is part of the task, and the receiver starts when that task ends;
    `fused_grad_accumulation=True`, a runtime whose weight-gradient GEMMs add into the accumulated gradient
    themselves (Megatron-LM's gradient accumulation fusion, default since 83b1e42f30, 2022-02-13: the wgrad GEMM
    writes into `main_grad` with beta = 1), so only parameters outside GEMMs (embeddings, norms) pay
    compute.grad_accumulation_time; `overlapped_tp_backward=True`, a runtime whose column-parallel linears run their
    backward collectives (the input-gradient all-reduce / reduce-scatter, sequence parallelism's re-gather) beside
    their GEMMs (Megatron-LM since 2021-09, TransformerEngine: compute.tp_collectives), where mmplan's runtime
    waits for them;
    `optimizer_extra_bytes`, a runtime whose optimizer step moves that many more bytes per updated parameter than
    the update mmplan's runtime does (Megatron-LM's mixed-precision optimizer: compute.mixed_precision_step_bytes),
    at the device's memory bandwidth, for optimizer states on the GPU; `grad_sync_bytes`, a runtime that reduces
    gradients of that many bytes per element across data parallelism (Megatron-LM reduces fp32 gradients of bf16
    models); `overlapped_param_gather=True`, a runtime whose ZeRO 1-2 parameter all-gather runs ahead of the next
    step's forward, hidden behind the stage's first forward but for its first bucket (Megatron-LM's distributed
    optimizer with `--overlap-param-gather`) (both: tail.tail_over); `tp_comm_overlap=True`, a runtime whose
    sequence-parallel layers run their tensor-parallel communication inside their GEMMs (TransformerEngine's
    userbuffers, Megatron-LM `--tp-comm-overlap`: compute.userbuffers_tp_time); `cross_entropy_bytes`, a runtime
    whose cross-entropy on the output head moves (forward, backward) bytes per logit (Megatron-LM's unfused
    vocabulary-parallel cross-entropy on an fp32 copy of the logits: compute._compute); `selective="op"`, a
    runtime whose "selective" tier is torchtitan's op-level activation checkpointing (compute.op_sac_time);
    `attention="sdpa"`, a runtime running PyTorch's SDPA kernel (FlashAttention-2: hardware.attention_efficiency)."""
    cluster = cluster or plan.cluster
    if plan.flow is None:
        plan = replace(plan, flow=flow_of(profile))
    try:
        graph = stage_graph(plan)
        sched = schedule(graph, plan.training.schedule)
    except FormatError as e:
        raise MmplanError(str(e)) from None
    group_of = {g.name: g for g in plan.groups}
    block_kw = dict(overlapped_tp_backward=overlapped_tp_backward, tp_comm_overlap=tp_comm_overlap,
                    cross_entropy_bytes=cross_entropy_bytes, selective=selective, attention=attention)  # block_time's
    costs, lags, sent = _chunk_costs(plan, profile, cluster, graph, group_of, blocking_p2p, fused_grad_accumulation,
                                     grad_sync_bytes, block_kw)
    # the DAG: task ops (joint over the classes hosting their stage), then each class's tail ops
    ops, stage_of, stage_classes, task_op = _task_ops(graph, sched, costs, lags)
    tails = _stage_tails(plan, graph, group_of, costs, cluster, grad_sync_overlap, grad_sync_bytes,
                         overlapped_param_gather, optimizer_extra_bytes, profile)
    sync, gather, optimizer = _tail_ops(ops, graph, tails, stage_of, stage_classes)
    try:
        start, end = ops.run()
    except _Deadlock as stuck:  # cannot happen for orders from plans.schedule; kept as a loud guard
        raise MmplanError(f"the plan's schedule deadlocks at {stuck.args[0]}") from None

    stage_costs = []
    for s, cs in enumerate(graph.stages):
        ch, tail = graph.chunks[cs[0]], tails[s]
        stage_costs.append(StageCost(
            group=ch.group, index=ch.stage, chunks=len(cs), time=sum((costs[c].time for c in cs), OpTime()),
            fwd_s=sum(costs[c].fwd for c in cs), bwd_s=sum(costs[c].bwd for c in cs),
            transfer_fwd_s=sum(costs[c].transfer_fwd for c in cs), transfer_bwd_s=sum(costs[c].transfer_bwd for c in cs),
            grad_sync_s=tail.grad_sync, optimizer_s=tail.optimizer, param_gather_s=tail.param_gather,
            downstream=max(graph.distance[cs[-1]], 0), warmup=sched.warmup[s], in_flight=sched.in_flight[s],
            micro_batches=ch.micro_batches,
        ))
    return _result(plan, graph, sched, costs, stage_costs, tails, lags, sent, task_op, optimizer, sync, gather, start, end, stage_of,
                   overhead=step_overhead(cluster))


def _chunk_costs(plan, profile, cluster, graph, group_of, blocking_p2p, fused_grad_accumulation, grad_bytes, block_kw
                 ) -> tuple[list, tuple, tuple]:
    """simulate's per-chunk costs and its routes' (lag, bytes sent); under `blocking_p2p` the sends become part of
    the tasks (see simulate's docstring) and the lags 0."""
    blocks = with_copies(profile, plan_stages(plan))  # a stage holding a tied copy counts it (cost_models/ties.py)
    for ch in graph.chunks:
        for b in ch.blocks:
            if b not in blocks:
                raise MmplanError(f"block {b!r} of group {ch.group!r} is not in the profile of {profile.model!r}; re-solve the plan for this profile")
    measured = profile.micro_batch if measured_on(profile, cluster) else None
    inputs = block_input_bytes(profile)
    memo: dict = {}  # block_time of blocks equal but for their name, shared (a model's identical layers)
    costs = [_cost_chunk(ch, group_of[ch.group], plan, blocks, cluster, measured, inputs, fused_grad_accumulation,
                         grad_bytes, memo, **block_kw) for ch in graph.chunks]
    lags, sent = zip(*(route_time(graph, r, cluster) for r in graph.routes)) if graph.routes else ((), ())
    if blocking_p2p and graph.routes:  # the sends become part of the tasks (see the docstring)
        for i, r in enumerate(graph.routes):
            costs[r.src].fwd += lags[i]
            if graph.has_backward(r.dst) and graph.has_backward(r.src):
                costs[r.dst].bwd += lags[i]
        lags = (0.0,) * len(lags)
    return costs, lags, sent


def _task_ops(graph, sched, costs, lags) -> tuple[_Ops, dict, list, dict[tuple[Task, int], int]]:
    """The DAG's task ops, each joint over the classes that run it together (Schedule.units: all the stage's, or one
    under fill_bubbles), in each class's order, with the routes' dependencies between the classes their transfers
    connect (StageGraph.class_pairs); also each chunk's stage, each stage's classes and the op of (task, class)."""
    ops = _Ops()
    stage_of = {c: s for s, cs in enumerate(graph.stages) for c in cs}
    stage_classes = [sorted({graph.class_of[r] for r in graph.chunks[cs[0]].ranks}) for cs in graph.stages]
    task_op: dict[tuple[Task, int], int] = {}
    made: dict[tuple[Task, tuple[int, ...]], int] = {}
    for k, order in enumerate(sched.orders):
        for t in order:
            unit = sched.unit_of(stage_of[t.chunk], k)
            op = made.get((t, unit))
            if op is None:
                cost = costs[t.chunk]
                op = made[t, unit] = ops.op(cost.bwd if t.backward else cost.fwd, ("task", t), list(unit))
            task_op[t, k] = op
            ops.then(2 * k, op)
    for i, r in enumerate(graph.routes):
        backward = graph.has_backward(r.dst) and graph.has_backward(r.src)
        for a, b in r.pairs(graph.windows(r)):  # producer micro-batch a feeds consumer micro-batch b (re-batching)
            links = set()
            for ks, kd in graph.class_pairs[i]:
                links.add((task_op[Task(r.src, a, False), ks], task_op[Task(r.dst, b, False), kd]))
                if backward:
                    links.add((task_op[Task(r.dst, b, True), kd], task_op[Task(r.src, a, True), ks]))
            for a, b in sorted(links):
                ops.depend(a, b, lags[i])
    return ops, stage_of, stage_classes, task_op


def _stage_tails(plan, graph, group_of, costs, cluster, grad_sync_overlap, grad_sync_bytes, overlapped_param_gather,
                 optimizer_extra_bytes, profile_ties=None) -> list:
    """Each stage's tail (gradient sync, optimizer step, parameter all-gather; simulate's switches applied)."""
    tails = []
    for s, cs in enumerate(graph.stages):
        ch = graph.chunks[cs[0]]
        g = group_of[ch.group]
        # frozen blocks: no sync / update; the gradient buckets hide behind the stage's last backward (its first
        # chunk's, under the interleaved schedule)
        tails.append(stage_tail(g, ch.stage, sum(costs[c].trained for c in cs), plan.training, cluster,
                                tensors=sum(costs[c].tensors for c in cs),
                                overlap_s=costs[cs[0]].time.bwd if overlaps_compute(cluster) and grad_sync_overlap else 0.0,
                                grad_bytes=grad_sync_bytes,
                                gather_overlap_s=costs[cs[0]].time.fwd if overlapped_param_gather else None,
                                gather_exposed_s=None if costs[cs[0]].param_gather is None  # CPU: serial
                                else sum(costs[c].param_gather for c in cs)))  # each chunk's first forward
        if optimizer_extra_bytes and g.stages[ch.stage].memory.optimizer == "gpu":  # see the docstring
            updated = sum(costs[c].trained for c in cs) / zero_divisors(g.zero, g.dp).optimizer
            tails[-1] = replace(tails[-1], optimizer=tails[-1].optimizer
                                + optimizer_extra_bytes * updated / cluster.device.memory_bandwidth)
    return with_tie_syncs(plan, graph, profile_ties, tails, cluster, grad_sync_bytes)


def _tail_ops(ops: _Ops, graph, tails, stage_of, stage_classes) -> tuple[list[int], list[int], dict[tuple[int, int], int]]:
    """Each class's tail ops after its last task: the syncs in stage order (the runtime's reduce_gradients), then
    every optimizer step, then the ZeRO 1-2 parameter all-gathers."""
    sync = [ops.op(tails[s].grad_sync, ("sync", s), stage_classes[s]) for s in range(len(graph.stages))]
    gather = [ops.op(tails[s].param_gather, ("gather", s), stage_classes[s]) for s in range(len(graph.stages))]
    optimizer: dict[tuple[int, int], int] = {}
    for k in range(len(graph.classes)):
        hosted = sorted({stage_of[c] for c in graph.class_chunks[k]})
        last = ops.last(2 * k)
        for s in hosted:  # syncs after the class's last task, in stage order (the runtime's reduce_gradients)
            if last is not None:
                ops.depend(last, sync[s], 0.0)
            ops.then(2 * k + 1, sync[s])
        for s in hosted:  # then every optimizer step, then the ZeRO 1-2 parameter all-gathers
            opt = optimizer[k, s] = ops.op(tails[s].optimizer, ("optimizer", s), [k])
            ops.depend(ops.last(2 * k + 1), opt, 0.0)
            ops.then(2 * k, opt)
        for s in hosted:
            ops.depend(optimizer[k, hosted[-1]], gather[s], 0.0)
            ops.then(2 * k + 1, gather[s])
    return sync, gather, optimizer


# --- costs -------------------------------------------------------------------------------------------


_CONTENT = tuple(f for f in Block.__dataclass_fields__ if f not in ("name", "group"))


def _content(b: Block, memo: dict) -> tuple:
    """A block's fields but its name and group (equal for a model's identical layers), kept in `memo` by identity."""
    key = ("content", id(b))
    out = memo.get(key)
    if out is None:
        out = memo[key] = tuple(getattr(b, f) for f in _CONTENT)
    return out


def _cost_chunk(ch: Chunk, g: Group, plan: Plan, blocks: dict[str, Block], cluster: Cluster, measured: int | None,
                inputs: dict[str, float], fused_grad_accumulation: bool = False, grad_bytes: int | None = None,
                memo: dict | None = None, **block_kw) -> _Cost:
    """A chunk's per-micro-batch compute, TP comm, transfers and overlapped ZeRO collectives on one rank; `grad_bytes`:
    bytes per gradient element ZeRO-2/3 reduce-scatters (simulate's grad_sync_bytes); `block_kw`: block_time's switches;
    memo: block times of one simulation, shared by blocks equal but for their name and group."""
    memo = {} if memo is None else memo
    training = plan.training
    mem = g.stages[ch.stage].memory
    cost = _Cost()
    samples = ch.micro_batch / g.dp  # samples of one of the group's micro-batches on one dp replica
    width = DTYPE_BYTES[training.dtype]
    time, tp_bytes, params = OpTime(), 0.0, 0.0
    added = 0.0  # trained parameters whose gradients are accumulated by a separate add (not inside a GEMM)
    out_bytes = {"cpu": 0.0, "nvme": 0.0}  # activation bytes offloaded per micro-batch, by tier
    out_copies = {"cpu": 0, "nvme": 0}  # their storages (copies, and files on nvme)
    tensors = trained_tensors = 0  # parameter tensors of the chunk, and those with gradients
    per_block = []  # (forward, backward compute, parameter bytes, trained parameter bytes) of each block
    for name in ch.blocks:
        b = blocks[name]
        t = tp_shard(b, g.tp)
        tier = mem.activations.get(name, "keep")
        key = (_content(b, memo), samples, g.tp, tier, g.sequence_parallel, inputs.get(name, 0.0))
        op = memo.get(key)
        if op is None:
            op = memo[key] = block_time(b, samples, g.tp, cluster, dtype=training.dtype, measured_micro_batch=measured,
                                        recompute=tier, sequence_parallel=g.sequence_parallel,
                                        input_bytes=inputs.get(name, 0.0), **block_kw)
        time += op
        per_block.append((op.fwd, op.bwd, b.params / t * width, 0.0 if b.frozen else b.params / t * width))
        if t > 1 and b.vocab_parallel:  # one all-reduce: the embedding's output, the head's input gradient
            tp_bytes += ring_bytes_sent((b.output_bytes if b.vocab_parallel == "embedding" else inputs.get(name, 0.0)) * samples,
                                        t, all_reduce=True)
        elif t > 1:  # ring all-reduces: 2 per forward, 2 per backward (and 2 more when recomputed); sequence parallelism
            # re-gathers each region's input in the backward (compute.regather_time): 2 all-gathers, one all-reduce's bytes
            tp_bytes += ((6 if tier == "recompute" else 4) + g.sequence_parallel) * ring_bytes_sent(b.output_bytes * samples, t, all_reduce=True)
        if tier.startswith("offload-"):
            out_bytes[tier.removeprefix("offload-")] += kept_activation_bytes(b, g.tp, sequence_parallel=g.sequence_parallel) * samples
            out_copies[tier.removeprefix("offload-")] += b.saved_tensors  # one copy each way per storage
        params += b.params / t
        tensors += b.param_tensors
        trained_tensors += 0 if b.frozen else b.param_tensors
        cost.trained += 0.0 if b.frozen else b.params / t
        # fused: a block with GEMMs counts as GEMM weights (a transformer layer's norm parameters are < 0.1 % of it)
        added += 0.0 if b.frozen or (fused_grad_accumulation and b.fwd_matmul_flops > 0) else b.params / t
        cost.tensors += 0 if b.frozen else b.param_tensors
    # every backward but the first adds its weight gradients into the accumulated ones (compute.grad_accumulation_time)
    extra_bwd = grad_accumulation_time(added, micro_batches=ch.micro_batches, dp=g.dp, zero=g.zero,
                                       grads_tier=mem.grads, cluster=cluster, dtype=training.dtype)
    param_bytes = params * width  # this rank's tp shard of the chunk's parameters, compute dtype
    sharded = zero_block_time(sum(1 for n in ch.blocks if blocks[n].params), g.zero, cluster, param_bytes) / 2  # both ways
    act = sum(transfer_time(v, tier, cluster, copies=out_copies[tier]) for tier, v in out_bytes.items())  # out in fwd, back in bwd
    params_in, grads_out = state_streaming(param_bytes, dp=g.dp, zero=g.zero, memory=mem, cluster=cluster,
                                           tensors=max(1, tensors), trained_tensors=max(1, trained_tensors))  # per op
    cost.params = params
    cost.transfer_fwd = act + params_in
    cost.transfer_bwd = act + params_in + grads_out + offload_accounting(sum(out_copies.values()), cluster)
    link = dp_link(cluster, ch.ranks, g.tp)
    if overlaps_compute(cluster):  # GPUs: FSDP2 per block (cost_models/fsdp.py)
        zf, zb, gathers, scatters, copies = chunk_passes(per_block, g.zero, g.dp, g.reshard_after_forward, link, cluster,
                                                         reduce_scale=(grad_bytes or width) / width)
        time += OpTime(fwd=sharded + copies[0], bwd=sharded + extra_bwd + copies[1])
        cost.fwd = zf + copies[0] + sharded + time.fwd_comm + exposed(cost.transfer_fwd, time.fwd)
        cost.bwd = zb + copies[1] + sharded + extra_bwd + time.bwd_comm + exposed(cost.transfer_bwd, time.bwd)
        cost.overlap_comm_fwd, cost.overlap_comm_bwd = gathers[0], gathers[1] + scatters
        cost.param_gather = first_forward_gather(per_block, g.zero, g.dp, link, cluster, reduce_scale=(grad_bytes or width) / width)
        zero_bytes = zero_collectives(param_bytes, dp=g.dp, zero=g.zero, link=link).bytes_sent
        if g.zero >= 3 and not g.reshard_after_forward:  # no backward all-gather
            zero_bytes -= ring_bytes_sent(param_bytes, g.dp, all_reduce=False)
    else:  # CPU ranks: transfers and collectives take the compute's cores, one after another
        time += OpTime(fwd=sharded, bwd=sharded + extra_bwd)
        gather, scatter, zero_bytes = zero_collectives(param_bytes, dp=g.dp, zero=g.zero, link=link)
        back = gather if g.reshard_after_forward else 0.0
        cost.overlap_comm_fwd, cost.overlap_comm_bwd = gather, back + scatter
        cost.fwd = time.fwd + time.fwd_comm + cost.transfer_fwd + gather
        cost.bwd = time.bwd + time.bwd_comm + cost.transfer_bwd + back + scatter
        if g.zero >= 3 and not g.reshard_after_forward:
            zero_bytes -= ring_bytes_sent(param_bytes, g.dp, all_reduce=False)
    cost.time = time
    cost.bytes_per_mb = tp_bytes + zero_bytes
    return cost


# --- the DAG of ops and its longest paths ------------------------------------------------------------


class _Ops:
    """Ops with fixed orders on resources (2k: compute lane of class k, 2k+1: its comm lane) and
    dependency delays. An op on several resources starts when it is first on each; run() gives every
    op's start and end as the longest path to it (Kahn's algorithm)."""

    def __init__(self):
        self.dur: list[float] = []
        self.what: list[tuple] = []
        self.classes: list[list[int]] = []
        self.succ: list[list[tuple[int, float]]] = []
        self.npred: list[int] = []
        self.tail: dict[int, int] = {}  # resource -> its last op so far

    def op(self, duration: float, what: tuple, classes: list[int]) -> int:
        self.dur.append(duration)
        self.what.append(what)
        self.classes.append(classes)
        self.succ.append([])
        self.npred.append(0)
        return len(self.dur) - 1

    def then(self, resource: int, op: int) -> None:
        """Append op to the resource's order."""
        prev = self.tail.get(resource)
        if prev is not None:
            self.depend(prev, op, 0.0)
        self.tail[resource] = op

    def last(self, resource: int) -> int | None:
        return self.tail.get(resource)

    def depend(self, before: int, after: int, lag: float) -> None:
        self.succ[before].append((after, lag))
        self.npred[after] += 1

    def run(self) -> tuple[list[float], list[float]]:
        n = len(self.dur)
        start, end = [0.0] * n, [0.0] * n
        remaining = list(self.npred)
        ready = [i for i in range(n) if remaining[i] == 0]
        done = 0
        while ready:
            i = ready.pop()
            e = end[i] = start[i] + self.dur[i]
            done += 1
            for nxt, lag in self.succ[i]:
                if e + lag > start[nxt]:
                    start[nxt] = e + lag
                remaining[nxt] -= 1
                if remaining[nxt] == 0:
                    ready.append(nxt)
        if done < n:
            raise _Deadlock(next(self.what[i] for i in range(n) if remaining[i] > 0))
        return start, end


class _Deadlock(Exception):
    """The orders and dependencies form a cycle (args[0]: the `what` of one op on it)."""


# --- results -------------------------------------------------------------------------------------


def _result(plan, graph, sched, costs, stage_costs, tails, lags, sent, task_op, optimizer, sync, gather, start, end, stage_of,
            overhead: float = 0.0) -> Simulation:
    """Busy time, bubble, communication volume and bottleneck from the op times; the timeline lazily. `overhead`: the
    runtime's fixed per-step seconds (cost_models/overhead.step_overhead), added to the step."""
    ncls = len(graph.classes)
    size = [len(ranks) for ranks in graph.classes]
    compute, comm, transfer, pipe_busy = [0.0] * ncls, [0.0] * ncls, [0.0] * ncls, [0.0] * ncls
    pairs = [len(r.pairs(graph.windows(r))) for r in graph.routes]  # (producer, consumer) micro-batch pairs per step
    comm_bytes = 2 * sum(n * b for n, b in zip(pairs, sent))  # activations forward, gradients back
    pipeline_end = 0.0
    for k, order in enumerate(sched.orders):
        for t in order:
            op, cost = task_op[t, k], costs[t.chunk]
            if t.backward:
                compute[k] += cost.time.bwd
                comm[k] += cost.time.bwd_comm + cost.overlap_comm_bwd
                transfer[k] += cost.transfer_bwd
            else:
                compute[k] += cost.time.fwd
                comm[k] += cost.time.fwd_comm + cost.overlap_comm_fwd
                transfer[k] += cost.transfer_fwd
            pipe_busy[k] += end[op] - start[op]
            comm_bytes += cost.bytes_per_mb * size[k]
            pipeline_end = max(pipeline_end, end[op])
    for (k, s), op in optimizer.items():
        compute[k] += end[op] - start[op]
    for s, cls in enumerate(graph.stages):
        for k in sorted({graph.class_of[r] for r in graph.chunks[cls[0]].ranks}):
            comm[k] += (end[sync[s]] - start[sync[s]]) + (end[gather[s]] - start[gather[s]])
    for i, r in enumerate(graph.routes):  # transfers, counted on the sender's class
        k = graph.class_of[graph.chunks[r.src].ranks[0]]
        comm[k] += pairs[i] * lags[i] * (2 if graph.has_backward(r.dst) else 1)
    for s, tail in enumerate(tails):
        comm_bytes += len(graph.chunks[graph.stages[s][0]].ranks) * tail.bytes_sent
    total = sum(size)
    bubble = 1 - sum(b * n for b, n in zip(pipe_busy, size)) / (total * pipeline_end) if pipeline_end > 0 else 0.0
    busiest = max(range(ncls), key=lambda c: compute[c] + comm[c])
    rep = [ranks[0] for ranks in graph.classes]
    bottleneck = " + ".join(f"{graph.chunks[cs[0]].group}/stage {graph.chunks[cs[0]].stage}"
                            for s, cs in enumerate(graph.stages) if any(c in graph.class_chunks[busiest] for c in cs))
    busy_cls = [Busy(compute[c], comm[c], transfer[c]) for c in range(ncls)]
    return Simulation(
        step_time_s=max(end, default=0.0) + overhead,
        overhead_s=overhead,
        pipeline_time_s=pipeline_end,
        bubble_fraction=max(0.0, bubble),
        stages=tuple(stage_costs),
        representative={r: rep[c] for r, c in graph.class_of.items()},
        busy={r: busy_cls[c] for r, c in graph.class_of.items()},
        comm_bytes=comm_bytes,
        bottleneck=bottleneck,
        events=functools.cache(functools.partial(_timeline, graph, sched, costs, lags, task_op, optimizer, sync, gather, start, end, rep)),
    )


def _timeline(graph, sched, costs, lags, task_op, optimizer, sync, gather, start, end, rep) -> tuple[Event, ...]:
    """The representative ranks' events: tasks on their compute lanes (named as in the runtime's measured
    trace, plans.schedule.task_name), of each task its blocking TP all-reduces (after its compute), its ZeRO
    collectives and tier transfers (from its start, hidden behind it); the tail ops; route sends from the
    end of the producing task."""
    events: list[Event] = []
    for k, order in enumerate(sched.orders):
        r = rep[k]
        for t in order:
            op, cost = task_op[t, k], costs[t.chunk]
            s, e = start[op], end[op]
            label = task_name(graph, t)
            work = cost.time.bwd if t.backward else cost.time.fwd
            blocking = cost.time.bwd_comm if t.backward else cost.time.fwd_comm
            hidden = cost.overlap_comm_bwd if t.backward else cost.overlap_comm_fwd
            moved = cost.transfer_bwd if t.backward else cost.transfer_fwd
            events.append(Event(r, "compute", label, s, e))
            if blocking > 0:
                events.append(Event(r, "comm", f"tp all-reduces of {label}", s + work, s + work + blocking))
            if hidden > 0:
                events.append(Event(r, "comm", f"zero collectives of {label}", s, s + hidden))
            if moved > 0:
                events.append(Event(r, "transfer", f"{'prefetch' if t.backward else 'offload'} of {label}", s, s + moved))
        for s_idx in sorted({st for st, cs in enumerate(graph.stages) if any(c in graph.class_chunks[k] for c in cs)}):
            name = graph.chunks[graph.stages[s_idx][0]].label.rsplit(".", 1)[0]
            for kind, op, lane in (("sync", sync[s_idx], "comm"), ("optimizer", optimizer[k, s_idx], "compute"), ("gather", gather[s_idx], "comm")):
                if end[op] > start[op]:
                    events.append(Event(r, lane, f"{kind} {name}", start[op], end[op]))
    for i, route in enumerate(graph.routes):
        if lags[i] <= 0:
            continue
        src, dst = graph.chunks[route.src], graph.chunks[route.dst]
        k_src, k_dst = graph.class_of[src.ranks[0]], graph.class_of[dst.ranks[0]]
        for a, j in route.pairs(graph.windows(route)):  # producer micro-batch a -> consumer micro-batch j
            op = task_op[Task(route.src, a, False), k_src]
            events.append(Event(rep[k_src], "comm", f"send act {route.block} -> {dst.label} mb{j}", end[op], end[op] + lags[i]))
            back = task_op.get((Task(route.dst, j, True), k_dst))
            if back is not None and graph.has_backward(route.src):
                events.append(Event(rep[k_dst], "comm", f"send grad {route.block} <- {dst.label} mb{j}", end[back], end[back] + lags[i]))
    return tuple(sorted(events, key=lambda e: (e.rank, e.start, LANES.index(e.lane))))
