"""Candidate layouts of one unit (tp, pp, dp, ZeRO, per-stage recompute/tiers) with DP cut points and step-time bounds."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from cost_models.comm import (
    all_gather_time,
    all_reduce_time,
    p2p_time,
    reduce_scatter_time,
)
from cost_models.compute import block_time, optimizer_step_time
from cost_models.memory import (
    DTYPE_BYTES,
    block_input_bytes,
    optimizer_bytes_per_param,
    warmup_forwards,
)
from cost_models.offload import transfer_time
from planner.partition import cut_table
from plans.cluster import Cluster, Link
from plans.graph import Block, Profile
from plans.plan import ActivationTier, Memory, Tier

# Vocabulary. A *unit* is a run of consecutive profile blocks that gets one layout (a profile group, or
# several merged: profile_units at the end of this file). A *layout* of a unit is (tp, dp, pp, ZeRO stage) plus the DP's cut
# points and, per stage, a tier *policy* (where params / grads / optimizer state live and whether the
# stage keeps, recomputes or offloads its activations). Every time below is one rank's seconds as the
# pipeline simulator (cost_models/pipeline.py) counts it; every size is one rank's bytes as
# cost_models/memory.stage_memory counts it. The figures of a stage of blocks [i, j) are computed for all
# (i, j) at once with prefix sums, so the functions of cost_models/ are called per block, or fitted as the
# affine functions of bytes they are (alpha + bytes / bandwidth), never duplicated as formulas.
#
# Bounds. For the ILP and the branch-and-bound of planner/allocate.py every layout carries terms of a lower
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
# The tests check bound <= simulated step time on random plans.

Schedule = Literal["gpipe", "1f1b"]
_BIG = 2.0**31  # bytes at which the affine fits of alpha-beta costs are taken (well-conditioned)


@dataclass(frozen=True, slots=True)
class Policy:
    """Tier placement of one stage, uniform over its blocks (planner/tiers.py refines it per block)."""

    params: Tier = "gpu"
    grads: Tier = "gpu"
    optimizer: Tier = "gpu"
    activations: ActivationTier = "keep"

    def memory(self, blocks: Iterable[str]) -> Memory:
        acts = {b: self.activations for b in blocks} if self.activations != "keep" else {}
        return Memory(self.params, self.grads, self.optimizer, acts)


KEEP = Policy()
RECOMPUTE = Policy(activations="recompute")
GPU_ONLY = (KEEP, RECOMPUTE)
# With memory tiers: ZeRO-Offload (optimizer state on the host), then the model states streamed from host
# memory or NVMe (ZeRO-Infinity), activations recomputed or offloaded.
OFFLOAD = (
    Policy(optimizer="cpu"),
    Policy(optimizer="cpu", activations="recompute"),
    Policy(optimizer="cpu", activations="offload-cpu"),
    Policy("cpu", "cpu", "cpu", "recompute"),
    Policy("cpu", "cpu", "nvme", "recompute"),
    Policy("nvme", "nvme", "nvme", "recompute"),
    Policy("nvme", "nvme", "nvme", "offload-nvme"),
)


@dataclass(frozen=True, slots=True)
class Feed:
    """Data flowing into a unit from another one: the first block it feeds and the bytes per sample of the
    smallest edge (the boundary bound uses the smallest, which every plan must move)."""

    producer: str
    block: int  # index of the first fed block in the consuming unit
    bytes_per_sample: float


@dataclass(frozen=True, slots=True)
class Unit:
    """A run of consecutive profile blocks laid out as one plan group."""

    name: str
    blocks: tuple[Block, ...]
    feeds: tuple[Feed, ...] = ()  # inputs from other units (the sink's encoders)
    out_bytes: float = 0.0  # bytes per sample of the smallest edge to another unit (sources)
    input_bytes: tuple[float, ...] = ()  # per block: bytes per sample of its inputs (its recompute checkpoint)
    cross_bytes: tuple[float, ...] = ()  # per cut j = 1..L-1 (index j): bytes per sample a cut before block j sends

    @property
    def supports_tp(self) -> bool:
        return any(b.supports_tp for b in self.blocks)


@dataclass(frozen=True, slots=True)
class Setting:
    """What the search holds fixed: cluster, step shape, precision, what memory tiers may be used."""

    cluster: Cluster
    global_batch: int
    schedule: Schedule = "1f1b"
    dtype: str = "bf16"
    optimizer: str = "adam"
    measured_micro_batch: int | None = None  # the profile's micro-batch when its times were measured here
    policies: tuple[Policy, ...] = GPU_ONLY

    @property
    def host_share(self) -> float:
        """Host memory per rank (a node's RAM split evenly over its GPUs; planner/tiers.py pools it per node)."""
        return self.cluster.host_memory_bytes / self.cluster.gpus_per_node

    @property
    def nvme_share(self) -> float:
        return self.cluster.nvme_bytes / self.cluster.gpus_per_node


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
    gather: tuple[float, ...]  # the parameter all-gather after the optimizer step (ZeRO 1-2)
    gpu_bytes: tuple[float, ...]
    cpu_bytes: tuple[float, ...]
    nvme_bytes: tuple[float, ...]
    samples: float  # per replica and micro-batch
    out_bytes: float  # bytes per sample of the unit's smallest edge to another unit (sources)
    entries: tuple[int, ...] = ()  # per feed of the unit: the stage holding its first fed block
    slowest: float = 0.0  # the DP's objective
    bound: Bound = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bound", _bound(self))

    @property
    def pp(self) -> int:
        return len(self.cuts) + 1

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def key(self) -> tuple:
        return (self.unit, self.micro_batches, self.tp, self.dp, self.pp, self.zero, self.downstream, self.cuts, self.policies)

    def _paths(self) -> tuple[list[float], list[float], list[float]]:
        """In_k, Up_k, Down_k of the module comment (inside the unit)."""
        p, f, b, lag, tail = self.pp, self.fwd, self.bwd, self.lag, self.tail
        into = [0.0] * p
        for k in range(1, p):
            into[k] = into[k - 1] + f[k - 1] + lag[k - 1]
        up = [0.0] * p
        for k in range(p):
            up[k] = tail[k] if k == 0 else max(tail[k], b[k - 1] + lag[k - 1] + up[k - 1])
        down = [0.0] * p
        for k in range(p - 2, -1, -1):
            down[k] = down[k + 1] + f[k + 1] + b[k + 1] + 2 * lag[k]
        return into, up, down

    def _body(self, down: list[float]) -> list[float]:
        """Per stage: the middle term of the bound (its 2m operations and the waits they cannot avoid)."""
        m, p = self.micro_batches, self.pp
        out = []
        for k in range(p):
            f, b = self.fwd[k], self.bwd[k]
            r = min(warmup_forwards(self.schedule, m, p - 1 - k + self.assumed_downstream) + 1, m)
            j0 = (m - 1) % r
            out.append(max(m * (f + b) + max(0.0, down[k] + b - r * b), m * b + max(m * f, (m - r + 1) * f + down[k]),
                           j0 * f + ((m - 1 - j0) // r + 1) * (f + down[k] + b)))
        return out

    def memories(self, blocks: Sequence[str]) -> tuple[Memory, ...]:
        """Per-stage plan Memory of the layout (blocks: the unit's block names)."""
        bounds = (0, *self.cuts, len(blocks))
        return tuple(pol.memory(blocks[a:b]) for pol, a, b in zip(self.policies, bounds, bounds[1:]))


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


def _bound(lay: Layout) -> Bound:
    into, up, down = lay._paths()
    body = lay._body(down)
    p, f, b, lag, m = lay.pp, lay.fwd, lay.bwd, lay.lag, lay.micro_batches
    ninf = -math.inf
    fpath, bpath = [], []  # per feed: forward / backward path from its entry stage to stage k
    for j in lay.entries:
        fp, bp = [ninf] * p, [ninf] * p
        for k in range(j, p):
            fp[k] = 0.0 if k == j else fp[k - 1] + f[k - 1] + lag[k - 1]
            bp[k] = 0.0 if k == j else bp[k - 1] + b[k - 1] + lag[k - 1]
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
    )


# --- the search space --------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n) steps (n may be a global batch of 10^12)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_degrees(unit: Unit, cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees worth trying: powers of two inside one node, only for units with TP blocks;
    1 on gloo clusters (the runtime runs tensor parallelism on GPUs only for now)."""
    if not unit.supports_tp or cluster.backend == "gloo":
        return [1]
    return [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and cluster.gpus_per_node % t == 0]


def allowed_gpus(n: int, cluster: Cluster) -> bool:
    """Rank counts a group may get so that groups pack onto whole nodes (one node: any)."""
    g = cluster.gpus_per_node
    return cluster.nodes == 1 or (n <= g and g % n == 0) or n % g == 0


def micro_batch_counts(global_batch: int, fixed_micro_batch: int | None = None) -> list[int]:
    """Numbers of micro-batches m: every divisor of the global batch up to MAX_MICRO_BATCHES, or the one a fixed
    micro-batch gives."""
    from plans.limits import MAX_MICRO_BATCHES

    if fixed_micro_batch is not None:
        return [global_batch // fixed_micro_batch]
    return [m for m in divisors(global_batch) if m <= MAX_MICRO_BATCHES]


# --- per-stage figures for every segment [i, j) of a unit ------------------------------------------------


def _affine(fn: Callable[[float], float], x: np.ndarray) -> np.ndarray:
    """fn (an alpha-beta cost, affine in bytes for bytes > 0 and 0 at 0) applied to an array."""
    b = (fn(2 * _BIG) - fn(_BIG)) / _BIG
    a = fn(_BIG) - b * _BIG
    return np.where(x > 0, a + b * x, 0.0)


def _span(values: np.ndarray) -> np.ndarray:
    """S[i, j] = sum of values[i:j] (j > i)."""
    c = np.concatenate(([0.0], np.cumsum(values)))
    return c[None, :] - c[:, None]


def _range_max(values: np.ndarray) -> np.ndarray:
    """R[i, j] = max of values[i:j] (0 for j <= i)."""
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for i in range(n):
        out[i, i + 1:] = np.maximum.accumulate(values[i:])
    return out


class BlockTimes:
    """Per-block op times of a unit at (tp, samples), cached for one search (block_time is the costly call)."""

    def __init__(self, setting: Setting):
        self.setting = setting
        self._cache: dict[tuple, list] = {}

    def of(self, unit: Unit, tp: int, samples: float) -> list:
        key = (unit.name, tp, samples)
        if key not in self._cache:
            st = self.setting
            self._cache[key] = [block_time(b, samples, tp, st.cluster, dtype=st.dtype, measured_micro_batch=st.measured_micro_batch)
                                for b in unit.blocks]
        return self._cache[key]

    def work(self, unit: Unit, tp: int, samples: float) -> float:
        """Seconds of one micro-batch's forward and backward through every block (no recompute, no transfers)."""
        return sum(o.fwd + o.fwd_comm + o.bwd + o.bwd_comm for o in self.of(unit, tp, samples))


@dataclass
class Segments:
    """Op durations, tails and memory of a stage of blocks [i, j) of a unit, for every (i, j), at one
    (tp, dp, ZeRO stage, micro-batch count), for each policy; figures are cached per policy."""

    unit: Unit
    setting: Setting
    tp: int
    dp: int
    zero: int
    micro_batches: int
    times: BlockTimes | None = None
    _cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        st = self.setting
        self.samples = st.global_batch / self.micro_batches / self.dp  # per replica and micro-batch
        blocks = self.unit.blocks
        ops = (self.times or BlockTimes(st)).of(self.unit, self.tp, self.samples)
        shard = np.array([self.tp if b.supports_tp else 1 for b in blocks], dtype=float)
        self.n = len(blocks)
        self.fwd, self.fwd_comm = _span(np.array([o.fwd for o in ops])), _span(np.array([o.fwd_comm for o in ops]))
        self.bwd, self.bwd_comm = _span(np.array([o.bwd for o in ops])), _span(np.array([o.bwd_comm for o in ops]))
        params = np.array([b.params for b in blocks], dtype=float) / shard
        act = np.array([b.activation_bytes for b in blocks], dtype=float) * self.samples / shard
        inp = np.array(self.unit.input_bytes, dtype=float) * self.samples / shard
        self.width = DTYPE_BYTES[st.dtype]
        self.params = _span(params)
        self.largest = _range_max(params) * self.width
        self.act, self.act_max = _span(act), _range_max(act)
        self.checkpoint = _span(inp)
        valid = np.arange(self.n + 1)[:, None] < np.arange(self.n + 1)[None, :]
        self.valid = valid
        self.dp_link = self._dp_link()

    def _dp_link(self) -> Link:
        """The link of a stage's data-parallel group when the unit's ranks start on a node boundary (or inside
        one node): it crosses nodes exactly when dp * tp > gpus per node (rank counts are node-aligned)."""
        cl = self.setting.cluster
        if cl.nodes > 1 and self.dp * self.tp > cl.gpus_per_node and self.dp > 1:
            return min(cl.intra_node, cl.inter_node, key=lambda link: link.bandwidth)
        return cl.intra_node

    def time(self, policy: Policy) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(forward op, backward op, tail, optimizer step, parameter gather) of every segment (pipeline.py's _cost_chunk and
        _stage_tail)."""
        key = ("time", policy)
        if key in self._cache:
            return self._cache[key]
        st, cl, dp, z = self.setting, self.setting.cluster, self.dp, self.zero
        recompute = policy.activations == "recompute"
        fwd, fwd_comm = self.fwd, self.fwd_comm
        bwd = self.bwd + (self.fwd if recompute else 0.0)
        bwd_comm = self.bwd_comm + (self.fwd_comm if recompute else 0.0)
        param_bytes = self.params * self.width
        act_out = 0.0
        if policy.activations.startswith("offload-"):
            act_out = _affine(lambda x: transfer_time(x, policy.activations.removeprefix("offload-"), cl), self.act)
        params_in = _affine(lambda x: transfer_time(x, policy.params, cl), param_bytes / (dp if z >= 3 else 1))
        grads_out = _affine(lambda x: transfer_time(x, policy.grads, cl), param_bytes / (dp if z >= 2 else 1))
        link = self.dp_link
        gather = _affine(lambda x: all_gather_time(x, dp, link), param_bytes) if z >= 3 else 0.0
        scatter = _affine(lambda x: reduce_scatter_time(x, dp, link), param_bytes) if z >= 2 else 0.0
        t_fwd = act_out + params_in
        t_bwd = act_out + params_in + grads_out
        fwd_op = fwd + fwd_comm + np.maximum(0.0, np.maximum(t_fwd, gather) - fwd)
        bwd_op = bwd + bwd_comm + np.maximum(0.0, np.maximum(t_bwd, gather + scatter) - bwd)
        sync = 0.0
        if z == 0:
            sync = _affine(lambda x: all_reduce_time(x, dp, link), param_bytes)
        elif z == 1:
            sync = _affine(lambda x: reduce_scatter_time(x, dp, link), param_bytes)
        gathered = _affine(lambda x: all_gather_time(x, dp, link), param_bytes) if z in (1, 2) else 0.0
        memory = Memory(policy.params, policy.grads, policy.optimizer)
        updated = self.params / dp if z >= 1 else self.params
        opt = _affine(lambda x: optimizer_step_time(x, memory, cl, dtype=st.dtype, optimizer=st.optimizer), updated)
        out = (fwd_op, bwd_op, sync + opt + gathered, opt, np.zeros_like(opt) + gathered)
        self._cache[key] = out
        return out

    def memory(self, policy: Policy) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(gpu, cpu, nvme) bytes per rank of every segment as base + in_flight * per_micro_batch pairs
        (cost_models/memory.stage_memory, term by term)."""
        key = ("memory", policy)
        if key in self._cache:
            return self._cache[key]
        st, dp, z = self.setting, self.dp, self.zero
        zeros = np.zeros_like(self.params)
        tiers = {"gpu": [zeros.copy(), zeros.copy()], "cpu": [zeros.copy(), zeros.copy()], "nvme": [zeros.copy(), zeros.copy()]}
        w = self.width
        k = optimizer_bytes_per_param(st.dtype, st.optimizer)
        tiers[policy.params][0] += w * self.params / (dp if z >= 3 else 1)
        tiers[policy.grads][0] += w * self.params / (dp if z >= 2 else 1)
        tiers[policy.optimizer][0] += k * self.params / (dp if z >= 1 else 1)
        if policy.params != "gpu":
            tiers["gpu"][0] += 2 * self.largest / (dp if z >= 3 else 1)
        if policy.grads != "gpu":
            tiers["gpu"][0] += self.largest / (dp if z >= 2 else 1)  # memory.stage_memory: one block's grads
        if z >= 3:
            tiers["gpu"][0] += 2 * self.largest
        acts = policy.activations
        if acts == "keep":
            tiers["gpu"][1] += self.act
        elif acts == "recompute":
            tiers["gpu"][1] += self.checkpoint
            tiers["gpu"][0] += self.act_max
        else:
            tiers[acts.removeprefix("offload-")][1] += self.act
            tiers["gpu"][0] += 2 * self.act_max
        out = (*tiers["gpu"], *tiers["cpu"], *tiers["nvme"])
        self._cache[key] = out
        return out

    def fits(self, policy: Policy, in_flight: float) -> np.ndarray:
        """Segments whose stage fits the GPU and this rank's share of host memory and NVMe."""
        g0, g1, c0, c1, n0, n1 = self.memory(policy)
        st = self.setting
        return (self.valid & (g0 + in_flight * g1 <= st.cluster.device.memory_bytes)
                & (c0 + in_flight * c1 <= st.host_share) & (n0 + in_flight * n1 <= st.nvme_share))

    def binds(self, policy: Policy, low: float, high: float) -> bool:
        """Whether some segment fits at `low` micro-batches in flight but not at `high`."""
        return bool(np.any(self.fits(policy, low) & ~self.fits(policy, high)))


# --- candidate layouts of a unit --------------------------------------------------------------------------


def in_flight(schedule: Schedule, micro_batches: int, downstream: int) -> float:
    """Micro-batches of activations a stage with `downstream` later stages holds (cost_models/memory.py)."""
    return float(micro_batches) if schedule == "gpipe" else float(min(micro_batches, downstream + 1))


class _Stages:
    """The DP's stage cost of a unit at one (tp, dp, ZeRO, m, downstream) and send link: per stage depth q, the
    fastest policy that fits (time inf when none does), and which policy that is."""

    def __init__(self, seg: Segments, downstream: int, send: np.ndarray):
        self.seg, self.downstream, self.send = seg, downstream, send
        self._by_flight: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    def flight(self, q: int) -> float:
        return in_flight(self.seg.setting.schedule, self.seg.micro_batches, q + self.downstream)

    def cost(self, q: int) -> np.ndarray:
        return self.evaluate(self.flight(q))[0]

    def evaluate(self, flight: float) -> tuple[np.ndarray, np.ndarray]:
        if flight not in self._by_flight:
            seg = self.seg
            best = np.full_like(seg.params, np.inf)
            which = np.zeros(best.shape, dtype=np.int64)
            for index, pol in enumerate(seg.setting.policies):
                fwd, bwd, tail, _, _ = seg.time(pol)
                t = np.where(seg.fits(pol, flight), fwd + bwd + self.send[None, :] + tail / seg.micro_batches, np.inf)
                better = t < best
                best = np.where(better, t, best)
                which = np.where(better, index, which)
            self._by_flight[flight] = (best, which)
        return self._by_flight[flight]


def _cross_link(setting: Setting, stage_ranks: int, pp: int) -> Link:
    """Link between consecutive stages for the DP's send estimate: inter-node once the unit spans nodes."""
    cl = setting.cluster
    if cl.nodes > 1 and stage_ranks * pp > cl.gpus_per_node:
        return min(cl.intra_node, cl.inter_node, key=lambda link: link.bandwidth)
    return cl.intra_node


def _stage_link(cluster: Cluster, stage_ranks: int, k: int) -> Link:
    """Link of the p2p between stages k and k+1 of a unit whose ranks start on a node boundary (pair_link)."""
    g = cluster.gpus_per_node
    if cluster.nodes > 1 and (k * stage_ranks) // g != ((k + 2) * stage_ranks - 1) // g:
        return min(cluster.intra_node, cluster.inter_node, key=lambda link: link.bandwidth)
    return cluster.intra_node


def boundary_bound(src: Layout, dst: Layout, cluster: Cluster) -> float:
    """A lower bound of the boundary from a source unit (own ranks) to the sink per micro-batch and direction
    (pipeline.boundary_time over plans/boundary.py's transfers, on the fastest link): a sink rank receives from
    every source replica overlapping its slice, a source replica's tp-rank 0 sends its slice to every tp rank of
    every overlapping sink replica; one message each, alpha + bytes / bandwidth. The link: between nodes when
    either unit fills whole nodes (allocate.assign_ranks never puts another unit on them), else the fastest."""
    if src.out_bytes <= 0:
        return 0.0
    link = fastest_link(cluster)
    if cluster.nodes > 1 and max(src.gpus, dst.gpus) >= cluster.gpus_per_node:
        link = min(cluster.intra_node, cluster.inter_node, key=lambda x: x.bandwidth)
    micro = src.samples * src.dp  # samples of a micro-batch
    per = src.out_bytes
    recv = max(1, src.dp // dst.dp) * link.latency_s + micro / dst.dp * per / link.bandwidth
    sends = max(1, dst.dp // src.dp) * dst.tp
    send = sends * link.latency_s + dst.tp * micro / src.dp * per / link.bandwidth
    return max(recv, send)


def fastest_link(cluster: Cluster) -> Link:
    """A link at least as fast as any the cluster has (for lower bounds)."""
    a, b = cluster.intra_node, cluster.inter_node
    return Link(max(a.bandwidth, b.bandwidth), min(a.latency_s, b.latency_s))


def unit_layouts(
    unit: Unit,
    setting: Setting,
    micro_batches: int,
    *,
    max_gpus: int,
    downstream: Sequence[int] = (),
    merge_depths: bool = True,
    stage_ranks: int | None = None,
    max_pp: int | None = None,
    limit: float = math.inf,
    times: BlockTimes | None = None,
) -> list[Layout]:
    """Every layout of `unit` at m = micro_batches with at most max_gpus ranks: for each (tp, dp, ZeRO) one DP
    table gives the cut points of every pp at once.

    downstream: for a source under 1F1B, the possible numbers of pipeline stages after it (the sink's pp:
    an encoder in front of a p-stage LLM holds activations of up to p more micro-batches); one table per
    value, unless merge_depths and memory does not bind between the smallest and the largest value, when
    one layout (downstream=None) serves them all.
    stage_ranks: only layouts with dp * tp equal to it (colocated encoders); max_pp caps the depth.
    limit: skip every (tp, dp) whose layouts' bounds are all >= limit (run_bound), e.g. the best simulated step.
    """
    cl = setting.cluster
    times = times or BlockTimes(setting)
    out: list[Layout] = []
    for tp, dp, depth in unit_runs(unit, setting, micro_batches, max_gpus=max_gpus, stage_ranks=stage_ranks, max_pp=max_pp):
        work = times.work(unit, tp, setting.global_batch / micro_batches / dp)
        if run_bound(work, micro_batches, depth) >= limit:
            continue
        for zero in zero_stages(cl, dp):
            seg = Segments(unit, setting, tp, dp, zero, micro_batches, times)
            out += _layouts_of(seg, depth, downstream, merge_depths, limit, work)
    return out


RUNTIME_ZERO_STAGES = (0,)  # what runtime/ trains today; the cost model also prices ZeRO 1-3 (baselines, --layout)


def zero_stages(cluster: Cluster, dp: int) -> tuple[int, ...]:
    """ZeRO stages the solver may emit: only those the runtime trains (it never writes a plan the runtime
    cannot run). With ZeRO in the runtime, (1, 2, 3) over dp > 1 replicas would be tried here."""
    return (0,) if dp == 1 else RUNTIME_ZERO_STAGES


def unit_runs(unit: Unit, setting: Setting, micro_batches: int, *, max_gpus: int, stage_ranks: int | None = None,
              max_pp: int | None = None) -> list[tuple[int, int, int]]:
    """(tp, dp, deepest pp) combinations of a unit at m micro-batches: dp divides the micro-batch (1 when a block
    reduces over the batch), dp * tp is a valid group size and at most max_gpus."""
    cl = setting.cluster
    micro = setting.global_batch // micro_batches
    out = []
    for tp in tp_degrees(unit, cl):
        for dp in ([1] if unit_reduces_batch(unit) else divisors(micro)):
            ranks = tp * dp
            if ranks > max_gpus or (stage_ranks is not None and ranks != stage_ranks) or not allowed_gpus(ranks, cl):
                continue
            out.append((tp, dp, min(len(unit.blocks), max_gpus // ranks, max_pp or len(unit.blocks))))
    return out


def run_bound(work: float, micro_batches: int, depth: int) -> float:
    """A lower bound of the step of every layout of a (tp, dp) run: one micro-batch goes through every block
    (work), and the busiest of at most `depth` stages runs m micro-batches of at least work / depth."""
    return max(work, micro_batches * work / depth)


def unit_reduces_batch(unit: Unit) -> bool:
    """A block whose output has no batch dimension (a contrastive loss) needs whole micro-batches: dp = 1."""
    return any(getattr(b, "reduces_batch", False) for b in unit.blocks)


def _layouts_of(seg: Segments, depth: int, downstream: Sequence[int], merge: bool, limit: float = math.inf,
                work: float = 0.0) -> list[Layout]:
    """Layouts of every pp <= depth at one (tp, dp, ZeRO, m); pp whose bound m * work / pp reaches `limit` are
    not built (their slowest stage runs at least work / pp per micro-batch)."""
    st, m = seg.setting, seg.micro_batches
    depths = sorted(set(downstream))
    if not depths or st.schedule == "gpipe":
        variants: list[tuple[int | None, int]] = [(None, depths[-1] if depths else 0)]
    elif merge and (len(depths) == 1 or not any(
            seg.binds(p, in_flight(st.schedule, m, depths[0]), in_flight(st.schedule, m, depth - 1 + depths[-1]))
            for p in st.policies)):
        variants = [(None, depths[-1])]  # memory does not depend on the depth: one table serves all
    else:
        variants = [(d, d) for d in depths]
    out = []
    for recorded, assumed in variants:
        table, table_link, stages = None, None, None
        for pp in range(1, depth + 1):
            if not allowed_gpus(seg.tp * seg.dp * pp, st.cluster) or m * work / pp >= limit:
                continue
            link = _cross_link(st, seg.tp * seg.dp, pp)
            if table is None or link != table_link:
                stages = _Stages(seg, assumed, _send(seg, link))
                table, table_link = cut_table(seg.n, stages.cost, depth), link
            part = table.best(pp)
            if part is not None:
                out.append(_layout(seg, stages, part.cuts, part.slowest, recorded))
    return out


def _send(seg: Segments, link: Link) -> np.ndarray:
    """Forward + backward p2p of the tensors crossing a cut before block j, per micro-batch and replica."""
    cross = np.zeros(seg.n + 1)
    for j in range(1, seg.n):
        cross[j] = 2 * p2p_time(seg.unit.cross_bytes[j] * seg.samples, link)
    return cross


def _layout(seg: Segments, stages: _Stages, cuts: tuple[int, ...], slowest: float, downstream: int | None) -> Layout:
    st, cl = seg.setting, seg.setting.cluster
    starts = np.array((0, *cuts), dtype=np.int64)
    ends = np.array((*cuts, seg.n), dtype=np.int64)
    pp = len(starts)
    flights = np.array([stages.flight(pp - 1 - k) for k in range(pp)])
    which = np.array([stages.evaluate(f)[1][a, b] for f, a, b in zip(flights, starts, ends)], dtype=np.int64)
    policies = tuple(st.policies[i] for i in which)
    figures = np.zeros((12, pp))  # fwd, bwd, tail, opt, gather, gpu0, gpu1, cpu0, cpu1, nvme0, nvme1
    for index in np.unique(which):
        sel = which == index
        a, b = starts[sel], ends[sel]
        pol = st.policies[index]
        for row, x in enumerate((*seg.time(pol), *seg.memory(pol))):
            figures[row, sel] = x[a, b]
    fwd, bwd, tail, opt, gather, g0, g1, c0, c1, n0, n1 = figures[:11]
    stage_ranks = seg.tp * seg.dp
    lag = tuple(p2p_time(seg.unit.cross_bytes[c] * seg.samples, _stage_link(cl, stage_ranks, k)) for k, c in enumerate(cuts))
    entries = tuple(int(np.searchsorted(starts, f.block, side="right")) - 1 for f in seg.unit.feeds)
    return Layout(
        unit=seg.unit.name, schedule=st.schedule, micro_batches=seg.micro_batches, tp=seg.tp, dp=seg.dp, zero=seg.zero,
        cuts=tuple(cuts), policies=policies, downstream=downstream, assumed_downstream=stages.downstream,
        fwd=tuple(fwd.tolist()), bwd=tuple(bwd.tolist()), lag=lag, tail=tuple(tail.tolist()), optimizer=tuple(opt.tolist()),
        gather=tuple(gather.tolist()), gpu_bytes=tuple((g0 + flights * g1).tolist()), cpu_bytes=tuple((c0 + flights * c1).tolist()),
        nvme_bytes=tuple((n0 + flights * n1).tolist()), samples=seg.samples, out_bytes=seg.unit.out_bytes, entries=entries,
        slowest=slowest,
    )


# --- units: which blocks get one layout ----------------------------------------------------------------

Structure = Literal["chain", "apart", "together"]


def profile_units(profile: Profile, structure: Structure) -> tuple[Unit, ...] | None:
    """The units of a profile for a structure; None when the profile's groups do not fit it.

    chain: one unit of every block (one layout for the whole model, cut anywhere: the homogeneous shape).
    apart / together: one unit per profile group, except that a group of at most SMALL_GROUP blocks with at
    most SMALL_SHARE of the FLOPs of its neighbour (a projector, a contrastive head) joins the group it takes
    its input from when that one runs right before it, else the group after it -- such a group would
    otherwise multiply the search for nothing. The
    result must be sources feeding one sink (the unit holding the last block), each unit a contiguous run
    of blocks: encoders in front of an LLM, two towers into a head. Other shapes get only the chain.
    """
    blocks = profile.blocks
    index = {b.name: i for i, b in enumerate(blocks)}
    inputs = block_input_bytes(profile)
    if structure == "chain":
        return (_unit("model", list(range(len(blocks))), profile, index, inputs, ()),)
    runs: list[list[int]] = []  # contiguous runs of one group, in execution order
    for i, b in enumerate(blocks):
        if runs and blocks[runs[-1][0]].group == b.group:
            runs[-1].append(i)
        else:
            runs.append([i])
    if len({blocks[r[0]].group for r in runs}) != len(runs):
        return None  # a group's blocks are not contiguous
    owner = {i: k for k, r in enumerate(runs) for i in r}
    feeds = {(owner[index[e.src]], owner[index[e.dst]]) for e in profile.edges if owner[index[e.src]] != owner[index[e.dst]]}
    merged = [list(r) for r in runs]
    target = list(range(len(runs)))
    work = [sum(blocks[i].fwd_flops + blocks[i].bwd_flops for i in r) for r in runs]
    for k, r in enumerate(runs):
        if len(r) > SMALL_GROUP or len(runs) == 1:
            continue
        into = k - 1 if k > 0 and (k - 1, k) in feeds else k + 1 if k + 1 < len(runs) else None
        if into is not None and work[k] <= SMALL_SHARE * work[into]:
            target[k] = _find(target, into)
    groups: dict[int, list[int]] = {}
    for k in range(len(runs)):
        groups.setdefault(_find(target, k), []).extend(merged[k])
    parts = [sorted(v) for _, v in sorted(groups.items(), key=lambda kv: min(kv[1]))]
    if any(p != list(range(p[0], p[-1] + 1)) for p in parts):
        return None
    unit_of = {i: u for u, p in enumerate(parts) for i in p}
    sink = unit_of[len(blocks) - 1]
    cross = [(unit_of[index[e.src]], unit_of[index[e.dst]], e) for e in profile.edges if unit_of[index[e.src]] != unit_of[index[e.dst]]]
    if len(parts) < 2 or any(d != sink or s == sink for s, d, _ in cross):
        return None
    names = [_unit_name(profile, p) for p in parts]
    out = []
    for u, p in enumerate(parts):
        if u == sink:
            unit_feeds = tuple(
                Feed(names[s], min(index[e.dst] for a, _, e in cross if a == s) - p[0], min(e.bytes for a, _, e in cross if a == s))
                for s in sorted({a for a, _, _ in cross}))
            out.append(_unit(names[u], p, profile, index, inputs, unit_feeds))
        else:
            sent = [e.bytes for a, _, e in cross if a == u]
            if not sent:
                return None  # a unit that feeds nothing: not the sources-into-one-sink shape
            out.append(_unit(names[u], p, profile, index, inputs, (), min(sent)))
    return tuple(out)


SMALL_GROUP = 2  # blocks; see profile_units
SMALL_SHARE = 0.25  # of the neighbour's FLOPs


def _find(target: list[int], k: int) -> int:
    while target[k] != k:
        k = target[k]
    return k


def _unit_name(profile: Profile, indices: list[int]) -> str:
    """The name of the unit's largest profile group (by blocks), e.g. "vision" for vision + vision_proj."""
    counts: dict[str, int] = {}
    for i in indices:
        counts[profile.blocks[i].group] = counts.get(profile.blocks[i].group, 0) + 1
    return max(counts, key=lambda g: (counts[g], -indices.index(next(i for i in indices if profile.blocks[i].group == g))))


def _unit(name: str, indices: list[int], profile: Profile, index: dict[str, int], inputs: dict[str, float],
          feeds: tuple[Feed, ...], out_bytes: float = 0.0) -> Unit:
    blocks = tuple(profile.blocks[i] for i in indices)
    first, n = indices[0], len(indices)
    cross = [0.0] * (n + 1)
    for e in profile.edges:
        a, b = index[e.src] - first, index[e.dst] - first
        if 0 <= a < n and 0 <= b < n:
            for j in range(a + 1, b + 1):
                cross[j] += e.bytes
    for j in range(1, n):
        if cross[j] == 0:
            cross[j] = blocks[j - 1].output_bytes  # pipeline.py relays the last block's output then
    return Unit(name, blocks, feeds, out_bytes, tuple(inputs[b.name] for b in blocks), tuple(cross))
