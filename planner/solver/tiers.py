"""Memory tiers: an ILP choosing the tier (GPU / CPU / NVMe, or recompute) of each stage's params, grads, optimizer state and each block's activations."""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, replace

import pulp

from cost_models.comm import dp_link, zero_collectives
from cost_models.compute import block_time, measured_on, tp_shard
from cost_models.evaluate import evaluate
from cost_models.memory import (
    DTYPE_BYTES,
    TierBytes,
    activation_residency,
    kept_activation_bytes,
    activation_transient,
    block_input_bytes,
    state_residency,
)
from cost_models.offload import offload_accounting, overlaps_compute, state_streaming, transfer_time
from cost_models.tail import tail_over
from planner.solver.allocate import Solver, _solver, pick_solver
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import ActivationTier, Memory, Plan, Tier, check_plan
from plans.units import short_by

# Formulation, for the stages s of a plan whose layout and ranks are fixed (cost_models/memory.stage_memory
# and pipeline.py's chunk costs, term by term, their constants computed by the cost_models functions named
# below; every figure is one rank's, per micro-batch unless noted):
#   z[s,k] in {0,1}    stage s puts (params, grads, optimizer state) in tiers k = (tp, tg, to), 27 choices
#                      (5 under ZeRO: what the runtime's FSDP2 holds, runtime.zero.zero_runs_with)
#   a[s,b,x] in {0,1}  block b keeps its activations (x = keep), recomputes them, or offloads them to cpu/nvme
#   o[s,t] in {0,1}    stage s offloads some activations to tier t (the transfer's latency is paid once)
#   h[s] >= 0          the transient GPU buffer: the recomputed block, or two blocks being offloaded / prefetched
#   ef[s], eb[s] >= 0  transfer time of the forward / backward that does not hide behind its compute (on CPU
#                      ranks, offload.overlaps_compute False, nothing hides: the (expose) rows without "- F_s", "- B[s]")
#   T >= 0             the slowest rank class: its stages' m (forward + backward) + optimizer steps
# (one)       sum_k z[s,k] = 1;   sum_x a[s,b,x] = 1                          every stage s, block b of s
# (latency)   o[s,t] >= a[s,b,offload-t]
# (transient) h[s] >= transient(x, act_b) a[s,b,x]    (memory.activation_transient: act_b recomputed, 2 act_b offloaded)
# (expose)    ef[s] >= out[s] + pin[s] - F_s;             ef[s] >= gather_s - F_s
#             eb[s] >= out[s] + pin[s] + gout[s] - B[s];  eb[s] >= gather_s + scatter_s - B[s]
#             out[s] = sum_t (o[s,t] alpha_t + sum_b (act_b / beta_t + (n_b - 1) alpha_t) a[s,b,offload-t]): activations
#             out and back, one copy per storage (n_b: Block.saved_tensors); eb adds offload.offload_accounting
#             pin[s], gout[s] = sum_k z[s,k] (params / grads streamed from k's tiers: offload.state_streaming)
#             B[s] = B_s + sum_b f_b a[s,b,recompute];  gather_s, scatter_s: comm.zero_collectives
# (gpu)       sum_{s on class c} gpu[s] <= device memory                      every rank class c (colocated: several s)
#             gpu[s] = sum_k z[s,k] state_gpu[s,k] + in_flight_s sum_b,x residency_gpu(x, b) a[s,b,x] + h[s]
#             (memory.state_residency, memory.activation_residency: act_b kept, input_b recomputed)
# (host)      sum_s ranks_of_s_on_n * cpu[s] <= host memory of node n;  same for nvme
# (time)      T >= sum_{s on c} (m (F_s + fcomm_s + ef[s] + B[s] + bcomm[s] + eb[s]) + sum_k z[s,k] opt[s,k])
#             (opt[s,k]: the optimizer step of tail.tail_over)
# minimise T + 1e-3 / stages * sum_s (its own term): the slowest class, then every other one.
# Tiers by access frequency and lifetime: params are read by every forward and backward, gradients written
# by every backward, optimizer state touched once a step (the natural first to leave the GPU); activations
# live from a forward to its backward (offloaded while other micro-batches run, prefetched back).

ACTIVATION_TIERS: tuple[ActivationTier, ...] = ("keep", "recompute", "offload-cpu", "offload-nvme")
TIERS: tuple[Tier, ...] = ("gpu", "cpu", "nvme")
STATES = tuple(itertools.product(TIERS, TIERS, TIERS))  # (params, grads, optimizer)


@dataclass(frozen=True, slots=True)
class _Stage:
    """Constants of one stage for the formulation."""

    key: tuple[int, int]  # (group index, stage index)
    blocks: tuple[str, ...]
    ranks: tuple[int, ...]
    in_flight: float
    fwd: float  # F_s: forward compute of one micro-batch
    fwd_comm: float
    bwd: float  # B_s without recompute
    bwd_comm: float
    recompute_fwd: dict[str, float]  # block -> forward seconds added to the backward when recomputed
    recompute_comm: dict[str, float]
    act: dict[str, float]  # block -> activation bytes of one micro-batch
    residency: dict[str, dict[str, TierBytes]]  # block -> tier x -> bytes per micro-batch in flight (activation_residency)
    transient: dict[str, dict[str, float]]  # block -> tier x -> GPU bytes while it runs (activation_transient)
    gather: float
    scatter: float
    storages: dict[str, int]  # block -> activation storages one forward saves (one copy each way when offloaded)
    state: dict[tuple[str, str, str], tuple[float, float, float, float, float, float]]  # k -> gpu, cpu, nvme bytes, pin, gout, opt


def place_tiers(plan: Plan, profile: Profile, *, solver: Solver = "highs", time_limit: float = 30.0) -> Plan | None:
    """The plan with every stage's memory placed by the ILP above (predictions refreshed), or None when the
    solver finds no tier assignment in time. Raises MmplanError naming the shortfall when none can exist."""
    stages, m = _stages(plan, profile)
    _check_room(plan, stages)
    prob, z, a = _model(plan, stages, m)
    status = prob.solve(_solver(pick_solver(solver), time_limit))
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) or status != pulp.LpStatusOptimal:
        if status == pulp.LpStatusInfeasible:
            raise MmplanError(_shortfall(plan, stages))
        return None
    memories: dict[tuple[int, int], Memory] = {}
    for st in stages:
        k = next(k for k in st.state if (z[st.key][k].value() or 0) > 0.5)
        acts = {b: x for b in st.blocks for x in ACTIVATION_TIERS if (a[st.key][b][x].value() or 0) > 0.5 and x != "keep"}
        memories[st.key] = Memory(params=k[0], grads=k[1], optimizer=k[2], activations=acts)
    groups = tuple(replace(g, stages=tuple(replace(s, memory=memories[gi, si]) for si, s in enumerate(g.stages)))
                   for gi, g in enumerate(plan.groups))
    placed = check_plan(replace(plan, groups=groups, predicted=None), profile)
    return replace(placed, predicted=evaluate(placed, profile).predicted)


def _stages(plan: Plan, profile: Profile) -> tuple[list[_Stage], int]:
    from plans.capabilities import zero_runs_with

    cluster, training = plan.cluster, plan.training
    ev = evaluate(plan, profile)
    in_flight = {(sc.group, sc.index): sc.in_flight for sc in ev.stages}
    blocks = {b.name: b for b in profile.blocks}
    inputs = block_input_bytes(profile)
    measured = profile.micro_batch if measured_on(profile, cluster) else None
    width = DTYPE_BYTES[training.dtype]
    out = []
    for gi, g in enumerate(plan.groups):
        samples = training.micro_batch / g.dp
        for si, s in enumerate(g.stages):
            f = fc = b = bc = 0.0
            rf, rc, act, ckpt = {}, {}, {}, {}
            params = largest = trained = 0.0
            tensors = trained_tensors = 0
            for name in s.blocks:
                blk = blocks[name]
                t = tp_shard(blk, g.tp)
                op = block_time(blk, samples, g.tp, cluster, dtype=training.dtype, measured_micro_batch=measured)
                f, fc, b, bc = f + op.fwd, fc + op.fwd_comm, b + op.bwd, bc + op.bwd_comm
                rf[name], rc[name] = op.fwd, op.fwd_comm
                act[name] = kept_activation_bytes(blk, g.tp, sequence_parallel=g.sequence_parallel) * samples
                ckpt[name] = inputs.get(name, 0.0) * samples / (t if g.sequence_parallel else 1)
                params += blk.params / t
                tensors += blk.param_tensors
                trained_tensors += 0 if blk.frozen else blk.param_tensors
                trained += 0.0 if blk.frozen else blk.params / t  # frozen: no grads, optimizer state or update
                largest = max(largest, blk.params / t)
            param_bytes = params * width
            link = dp_link(cluster, s.ranks, g.tp)
            gather, scatter, _ = zero_collectives(param_bytes, dp=g.dp, zero=g.zero, link=link)
            state = {}
            for k in STATES:
                if g.zero and not zero_runs_with(*k):  # the tiers the runtime's ZeRO (FSDP2) can hold
                    continue
                memory = Memory(*k)
                tiers = state_residency(params, largest, dp=g.dp, zero=g.zero, memory=memory, dtype=training.dtype,
                                        optimizer=training.optimizer, trained=trained,
                                        reshard_after_forward=g.reshard_after_forward)
                pin, gout = state_streaming(param_bytes, dp=g.dp, zero=g.zero, memory=memory, cluster=cluster,
                                            tensors=max(1, tensors), trained_tensors=max(1, trained_tensors))
                opt = tail_over(trained, dp=g.dp, zero=g.zero, memory=memory, link=link, cluster=cluster,
                                dtype=training.dtype, optimizer=training.optimizer).optimizer
                state[k] = (tiers.gpu, tiers.cpu, tiers.nvme, pin, gout, opt)
            residency = {name: {x: activation_residency(x, act[name], ckpt[name]) for x in ACTIVATION_TIERS}
                         for name in s.blocks}
            transient = {name: {x: activation_transient(x, act[name]) for x in ACTIVATION_TIERS} for name in s.blocks}
            out.append(_Stage((gi, si), s.blocks, s.ranks, in_flight[g.name, si], f, fc, b, bc, rf, rc, act, residency,
                              transient, gather, scatter, {name: blocks[name].saved_tensors for name in s.blocks}, state))
    return out, training.micro_batches


def _classes(stages: list[_Stage]) -> list[list[_Stage]]:
    """Stages grouped by the rank classes hosting them (ranks with the same stages; colocated ranks host several)."""
    hosted: dict[int, list[_Stage]] = defaultdict(list)
    for st in stages:
        for r in st.ranks:
            hosted[r].append(st)
    unique: dict[tuple, list[_Stage]] = {}
    for r in sorted(hosted):
        unique.setdefault(tuple(s.key for s in hosted[r]), hosted[r])
    return list(unique.values())


def _affine(tier: str, cluster) -> tuple[float, float]:
    """(alpha, seconds per byte) of transfer_time to `tier` (affine in bytes for bytes > 0)."""
    big = 2.0**31
    slope = (transfer_time(2 * big, tier, cluster) - transfer_time(big, tier, cluster)) / big
    return transfer_time(big, tier, cluster) - slope * big, slope


def _model(plan: Plan, stages: list[_Stage], m: int):
    cluster = plan.cluster
    prob = pulp.LpProblem("tiers", pulp.LpMinimize)
    T = prob.add_variable("T", lowBound=0)
    z, a, terms = {}, {}, {}
    costs = {t: _affine(t, cluster) for t in ("cpu", "nvme")}
    node_cpu, node_nvme = defaultdict(list), defaultdict(list)
    gpu = {}
    for n, st in enumerate(stages):
        z[st.key] = {k: prob.add_variable(f"z_{n}_{''.join(x[0] for x in k)}", cat="Binary") for k in st.state}
        a[st.key] = {b: {x: prob.add_variable(f"a_{n}_{i}_{x.replace('-', '_')}", cat="Binary") for x in ACTIVATION_TIERS}
                     for i, b in enumerate(st.blocks)}
        zs, av = z[st.key], a[st.key]
        prob += pulp.lpSum(zs.values()) == 1, f"one_state_{n}"
        for i, b in enumerate(st.blocks):
            prob += pulp.lpSum(av[b].values()) == 1, f"one_act_{n}_{i}"
        o = {t: prob.add_variable(f"o_{n}_{t}", cat="Binary") for t in ("cpu", "nvme")}
        h = prob.add_variable(f"h_{n}", lowBound=0)
        for i, b in enumerate(st.blocks):
            for t in ("cpu", "nvme"):
                prob += o[t] >= av[b][f"offload-{t}"], f"latency_{n}_{i}_{t}"
                prob += h >= st.transient[b][f"offload-{t}"] * av[b][f"offload-{t}"], f"transient_{n}_{i}_{t}"
            prob += h >= st.transient[b]["recompute"] * av[b]["recompute"], f"transient_{n}_{i}_rc"
        # one copy (alpha) per offloaded storage, at least one per tier used (offload.transfer_time's copies)
        out = pulp.lpSum(o[t] * costs[t][0] + pulp.lpSum((st.act[b] * costs[t][1] + max(0, st.storages[b] - 1) * costs[t][0])
                                                         * av[b][f"offload-{t}"] for b in st.blocks)
                         for t in ("cpu", "nvme"))
        accounting = pulp.lpSum(offload_accounting(st.storages[b], cluster) * (av[b]["offload-cpu"] + av[b]["offload-nvme"])
                                for b in st.blocks)
        pin = pulp.lpSum(st.state[k][3] * zs[k] for k in st.state)
        gout = pulp.lpSum(st.state[k][4] * zs[k] for k in st.state)
        bwd = st.bwd + pulp.lpSum(st.recompute_fwd[b] * av[b]["recompute"] for b in st.blocks)
        bcomm = st.bwd_comm + pulp.lpSum(st.recompute_comm[b] * av[b]["recompute"] for b in st.blocks)
        ef, eb = prob.add_variable(f"ef_{n}", lowBound=0), prob.add_variable(f"eb_{n}", lowBound=0)
        if overlaps_compute(cluster):  # GPUs: transfers and ZeRO collectives hide behind the pass's compute
            prob += ef >= out + pin - st.fwd, f"expose_f_{n}"
            prob += ef >= st.gather - st.fwd, f"expose_fz_{n}"
            prob += eb >= out + pin + gout + accounting - bwd, f"expose_b_{n}"
            prob += eb >= st.gather + st.scatter - bwd, f"expose_bz_{n}"
        else:  # CPU ranks: they take the compute's core, one after another (pipeline._cost_chunk's CPU branch)
            prob += ef >= out + pin + st.gather, f"expose_f_{n}"
            prob += eb >= out + pin + gout + accounting + st.gather + st.scatter, f"expose_b_{n}"
        opt = pulp.lpSum(st.state[k][5] * zs[k] for k in st.state)
        terms[st.key] = m * (st.fwd + st.fwd_comm + ef + bwd + bcomm + eb) + opt
        def resident(tier: str):  # activation bytes per micro-batch in flight on `tier` (activation_residency)
            return pulp.lpSum(getattr(st.residency[b][x], tier) * av[b][x] for b in st.blocks for x in ACTIVATION_TIERS
                              if getattr(st.residency[b][x], tier))

        gpu[st.key] = pulp.lpSum(st.state[k][0] * zs[k] for k in st.state) + h + st.in_flight * resident("gpu")
        cpu = pulp.lpSum(st.state[k][1] * zs[k] for k in st.state) + st.in_flight * resident("cpu")
        nvme = pulp.lpSum(st.state[k][2] * zs[k] for k in st.state) + st.in_flight * resident("nvme")
        per_node = defaultdict(int)
        for r in st.ranks:
            per_node[cluster.node_of(r)] += 1
        for node, count in per_node.items():
            node_cpu[node].append(count * cpu)
            node_nvme[node].append(count * nvme)
    for c, members in enumerate(_classes(stages)):
        prob += pulp.lpSum(gpu[s.key] for s in members) <= cluster.device.memory_bytes, f"gpu_{c}"
        prob += T >= pulp.lpSum(terms[s.key] for s in members), f"time_{c}"
    for node in node_cpu:
        prob += pulp.lpSum(node_cpu[node]) <= cluster.host_memory_bytes, f"host_{node}"
        prob += pulp.lpSum(node_nvme[node]) <= cluster.nvme_bytes, f"nvme_{node}"
    prob += T + 1e-3 / len(stages) * pulp.lpSum(terms.values())
    return prob, z, a


def _check_room(plan: Plan, stages: list[_Stage]) -> None:
    """Fail fast with the shortfall when even everything offloaded cannot fit (the ILP would only say infeasible)."""
    message = _shortfall(plan, stages, only_if_short=True)
    if message:
        raise MmplanError(message)


def _shortfall(plan: Plan, stages: list[_Stage], only_if_short: bool = False) -> str:
    """A sentence naming by how many bytes the plan's ranks or nodes are short of memory in every tier (from
    necessary conditions: a rank's GPU holds at least its stages' least GPU-resident state; a node's tiers
    combined hold at least its ranks' whole state)."""
    cluster = plan.cluster
    cap = cluster.device.memory_bytes
    gpu_need: dict[int, float] = defaultdict(float)  # rank -> least GPU bytes of its model states
    node_need: dict[int, float] = defaultdict(float)  # node -> least bytes of its ranks' model states
    for st in stages:
        least_gpu = min(v[0] for v in st.state.values())
        least_all = min(v[0] + v[1] + v[2] for v in st.state.values())
        for r in st.ranks:
            gpu_need[r] += least_gpu
            node_need[cluster.node_of(r)] += least_all
    rank, worst = max(gpu_need.items(), key=lambda kv: kv[1])
    if worst > cap:
        return (f"rank {rank} needs at least {worst / 1e9:,.2f} GB of GPU memory even with its model states on CPU / NVMe, "
                f"but has {cap / 1e9:,.2f} GB {short_by(worst, cap)}; add GPUs")
    for node, need in sorted(node_need.items()):
        ranks = len({r for r in gpu_need if cluster.node_of(r) == node})
        room = ranks * cap + cluster.host_memory_bytes + cluster.nvme_bytes
        if need > room:
            return (f"node {node} must hold {need / 1e9:,.1f} GB of training state but its GPUs, host memory and NVMe hold "
                    f"{room / 1e9:,.1f} GB {short_by(need, room)}; add nodes or NVMe")
    if only_if_short:
        return ""
    return (f"no assignment of tiers to {plan.profile.model}'s state and activations fits the GPU, host memory and NVMe of "
            f"{cluster.world_size} x {cluster.device.name}; add GPUs or nodes")
