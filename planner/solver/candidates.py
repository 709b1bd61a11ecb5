"""Candidate layouts of one unit (tp, pp, dp, ZeRO, per-stage recompute/tiers) with DP cut points, and the units."""
from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from cost_models.comm import hand_over_time, link_between, link_for, p2p_time
from cost_models.memory import block_input_bytes, in_flight, warmup_forwards
from planner.solver.bounds import Bound, layout_bound, run_bound
from planner.solver.partition import cut_table
from planner.solver.segments import BlockTimes, Segments
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
# affine functions of bytes they are (alpha + bytes / bandwidth), never duplicated as formulas
# (planner/solver/segments.py). Every layout carries the terms of a lower bound of its step (planner/solver/bounds.py).

Schedule = Literal["gpipe", "1f1b"]


@dataclass(frozen=True, slots=True)
class Policy:
    """The tiers of one stage, uniform over its blocks (planner/solver/tiers.py refines them per block)."""

    params: Tier = "gpu"
    grads: Tier = "gpu"
    optimizer: Tier = "gpu"
    activations: ActivationTier = "keep"

    def memory(self, blocks: Iterable[str], cores: Collection[str] | None = None) -> Memory:
        """The plan's Memory of a stage of `blocks`; "selective" goes to the blocks with an attention core (`cores`,
        default all) and the others keep theirs (the runtime would recompute a core-less block whole)."""
        if self.activations == "selective":
            acts = {b: "selective" for b in blocks if cores is None or b in cores}
        else:
            acts = {b: self.activations for b in blocks} if self.activations != "keep" else {}
        return Memory(self.params, self.grads, self.optimizer, acts)


KEEP = Policy()
SELECTIVE = Policy(activations="selective")  # the attention core recomputed (Korthikanti et al. 2022, section 5)
RECOMPUTE = Policy(activations="recompute")
GPU_ONLY = (KEEP, SELECTIVE, RECOMPUTE)
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
    cross_bytes: tuple[float, ...] = ()  # per cut j = 1..L-1 (index j): per-sample bytes of the largest route a cut before block j needs
    reads: tuple[tuple[int, ...], ...] = ()  # per block: the earlier blocks of the unit whose outputs it reads

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
    # The search's dimensions beyond tp, dp, pp, m and cut points, each a list of entries: per-stage tier
    # policies (keep / recompute / offload ...; a new activation tier such as selective recompute is one more
    # Policy once segments.py prices it) and per-layout ZeRO stages.
    policies: tuple[Policy, ...] = GPU_ONLY
    zeros: tuple[int, ...] = (0, 1, 2, 3)
    # sequence parallelism of tp > 1 layouts (Group.sequence_parallel); where it costs no more in every stage figure
    # (BlockTimes.sp_dominates) only the layouts with it are built; its backward re-gathers (compute.regather_time)
    # make it slower in one figure at tp > 1, so both are built there
    sequence_parallel: tuple[bool, ...] = (False, True)
    # interleaved 1F1B layouts of the chain unit with these model chunks per rank (solve --schedule interleaved), besides
    # the 1F1B ones: chunk cut points balance the chunks' op time (_interleaved)
    virtual_stages: tuple[int, ...] = ()

    @property
    def host_share(self) -> float:
        """Host memory per rank (a node's RAM split evenly over its GPUs; planner/solver/tiers.py pools it per node)."""
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
    bound: Bound = field(init=False, compare=False, repr=False)  # planner/solver/bounds.py

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
                self.sequence_parallel, self.chunks)

    def stage_blocks(self, blocks: Sequence[str]) -> list[tuple[str, ...]]:
        """Per stage, its blocks in execution order (with chunks > 1: chunks k, k + pp, ... of stage k)."""
        bounds = (0, *self.cuts, len(blocks))
        parts = [tuple(blocks[a:b]) for a, b in zip(bounds, bounds[1:])]
        return [tuple(x for c in parts[k::self.pp] for x in c) for k in range(self.pp)]

    def memories(self, blocks: Sequence[str], cores: Collection[str] | None = None) -> tuple[Memory, ...]:
        """Per-stage plan Memory of the layout (blocks: the unit's block names; cores: those with an attention core)."""
        return tuple(pol.memory(names, cores) for pol, names in zip(self.policies, self.stage_blocks(blocks)))


# --- the search space --------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n) steps (n may be a global batch of 10^12)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_degrees(unit: Unit, cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees worth trying: powers of two inside one node that divide every TP block's heads and
    widths (Block.takes_tp), only for units with TP blocks; 1 on gloo clusters."""
    if not unit.supports_tp or cluster.backend == "gloo":
        return [1]
    return [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and cluster.gpus_per_node % t == 0
            and all(b.takes_tp(t) for b in unit.blocks)]


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


# --- candidate layouts of a unit --------------------------------------------------------------------------


def stage_in_flight(schedule: Schedule, micro_batches: int, downstream: int) -> float:
    """Micro-batches of activations a one-chunk stage with `downstream` later stages holds (memory.in_flight)."""
    return in_flight(schedule, micro_batches, warmup_forwards(schedule, micro_batches, downstream))


class _Stages:
    """The DP's stage cost of a unit at one (tp, dp, ZeRO, m, downstream) and send link: per stage depth q, the
    fastest policy that fits (time inf when none does), and which policy that is. Each policy's time and the
    most micro-batches in flight each segment holds are computed once; a depth only compares with them."""

    def __init__(self, seg: Segments, downstream: int, send: np.ndarray):
        self.seg, self.downstream, self.send = seg, downstream, send
        self._keys: dict[float, int] = {}
        self._flights: dict[int, float] = {}  # q -> micro-batches in flight (the DP asks for each q many times)
        times, rooms = [], []
        for pol in seg.setting.policies:
            fwd, bwd, tail, _, _ = seg.time(pol)
            t = fwd + bwd + send[None, :] + tail / seg.micro_batches
            times.append(t if runs_with(pol, seg.zero) else np.full_like(t, np.inf))  # tiers FSDP2 cannot hold
            rooms.append(seg.room(pol))
        self._times, self._room = np.stack(times), np.stack(rooms)  # (policies, L+1, L+1)
        # which segments fit under which policy depends on the flight only through the set {room < flight}:
        # flights with as many room values below them give the same costs (one evaluation when memory never binds)
        self._rooms = np.sort(self._room.ravel())
        self._by_key: dict[int, np.ndarray] = {}
        self._which: dict[int, np.ndarray] = {}

    def flight(self, q: int) -> float:
        if q not in self._flights:
            self._flights[q] = stage_in_flight(self.seg.setting.schedule, self.seg.micro_batches, q + self.downstream)
        return self._flights[q]

    def cost(self, q: int) -> np.ndarray:
        return self.evaluate(self.flight(q))[0]

    def _key(self, flight: float) -> int:
        key = self._keys.get(flight)
        if key is None:
            key = self._keys[flight] = int(np.searchsorted(self._rooms, flight, side="left"))  # room values < flight
        return key

    def evaluate(self, flight: float) -> tuple[np.ndarray, np.ndarray | None]:
        """(the fastest fitting policy's time of every segment, which policy) at `flight` micro-batches in flight;
        `which` only once asked for (which_at)."""
        key = self._key(flight)
        if key not in self._by_key:
            self._by_key[key] = np.where(self._room >= flight, self._times, np.inf).min(axis=0)
        return self._by_key[key], self._which.get(key)

    def which_at(self, flight: float) -> np.ndarray:
        key = self._key(flight)
        if key not in self._which:
            self._which[key] = np.where(self._room >= flight, self._times, np.inf).argmin(axis=0)
        return self._which[key]


def _cross_link(setting: Setting, stage_ranks: int, pp: int) -> Link:
    """Link between consecutive stages for the DP's send estimate: the one the unit's ranks span (starting at a
    node's first rank)."""
    return link_for(setting.cluster, range(stage_ranks * pp))


def _stage_link(cluster: Cluster, stage_ranks: int, k: int) -> Link:
    """Link of the p2p between stages k and k+1 of a unit whose ranks start at a node's first rank: the one their
    ranks span (the same as pair_link's, since a stage's rank count divides a node or is whole nodes)."""
    return link_for(cluster, range(k * stage_ranks, (k + 2) * stage_ranks))


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
    deadline: float = math.inf,
    prune_dominated: bool = True,
) -> list[Layout]:
    """Every layout of `unit` at m = micro_batches with at most max_gpus ranks: for each (tp, dp, ZeRO) one DP
    table gives the cut points of every pp at once.

    downstream: for a source under 1F1B, the possible numbers of pipeline stages after it (the sink's pp:
    an encoder in front of a p-stage LLM holds activations of up to p more micro-batches); one table per
    value, unless merge_depths and memory does not bind between the smallest and the largest value, when
    one layout (downstream=None) serves them all.
    stage_ranks: only layouts with dp * tp equal to it (colocated encoders); max_pp caps the depth.
    limit: skip every (tp, dp) whose layouts' bounds are all >= limit (run_bound), e.g. the best simulated step.
    deadline: a time.perf_counter() value after which no more (tp, dp) runs are tried (solve --time-limit).
    prune_dominated: build only the sequence-parallel layouts of a tp > 1 run where they dominate
    (BlockTimes.sp_dominates); False builds both (the brute force of the tests).
    """
    cl = setting.cluster
    times = times or BlockTimes(setting)
    out: list[Layout] = []
    for tp, dp, depth in unit_runs(unit, setting, micro_batches, max_gpus=max_gpus, stage_ranks=stage_ranks, max_pp=max_pp):
        samples = setting.global_batch / micro_batches / dp
        sps = sp_values(unit, setting, tp, samples, times, prune_dominated)
        work = min(times.work(unit, tp, samples, sp) for sp in sps)
        if run_bound(work, micro_batches, depth) >= limit:
            continue
        if time.perf_counter() > deadline:
            break
        for sp in sps:
            for zero in zero_stages(cl, dp, setting.zeros):
                if time.perf_counter() > deadline:
                    break
                seg = Segments(unit, setting, tp, dp, zero, micro_batches, times, sequence_parallel=sp)
                out += _layouts_of(seg, depth, downstream, merge_depths, limit, work)
    return out


def sp_divides(blocks: Iterable[Block], tp: int) -> bool:
    """Whether tp divides the sequence of every tensor-parallel block whose sequence the profile recorded (the runtime
    shards those along it: planner/commands/run.py refuses a sequence-parallel plan otherwise, e.g. a ViT's 577 tokens)."""
    return all(b.sequence % tp == 0 for b in blocks if b.supports_tp and b.sequence)


def sp_values(unit: Unit, setting: Setting, tp: int, samples: float, times: BlockTimes, prune: bool = True) -> tuple[bool, ...]:
    """Sequence parallelism settings worth trying for a (tp, samples) run: off alone at tp = 1 (nothing to shard),
    on alone where it dominates (BlockTimes.sp_dominates) and `prune`, else Setting.sequence_parallel."""
    allowed = tuple(dict.fromkeys(setting.sequence_parallel)) or (False,)
    if tp <= 1 or not unit.supports_tp or not sp_divides(unit.blocks, tp):
        return (False,)
    if prune and True in allowed and False in allowed and times.sp_dominates(unit, tp, samples):
        return (True,)
    return allowed


ZERO_STAGES = (0, 1, 2, 3)  # every ZeRO stage the cost model prices and runtime/ trains (issue 13)


def zero_stages(cluster: Cluster, dp: int, zeros: Sequence[int] = ZERO_STAGES) -> tuple[int, ...]:
    """ZeRO stages worth trying at dp replicas: 0 alone at dp = 1 (nothing to shard), else `zeros`."""
    return (0,) if dp == 1 else tuple(zeros)


def runs_with(policy: Policy, zero: int) -> bool:
    """Whether the runtime trains a stage with these tiers under ZeRO stage `zero` (runtime.zero.zero_runs_with:
    its FSDP2 holds parameters and gradients on the GPU, or both on the host with CPU offload)."""
    if zero == 0 or (policy.params, policy.grads) == ("gpu", "gpu"):
        return True  # zero_runs_with's first case, without importing torch (seconds) into a solve that needs none
    from runtime.zero import zero_runs_with

    return zero_runs_with(policy.params, policy.grads, policy.optimizer)


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
            seg.binds(p, stage_in_flight(st.schedule, m, depths[0]), stage_in_flight(st.schedule, m, depth - 1 + depths[-1]))
            for p in st.policies)):
        variants = [(None, depths[-1])]  # memory does not depend on the depth: one table serves all
    else:
        variants = [(d, d) for d in depths]
    out = []
    links = [_stage_link(st.cluster, seg.tp * seg.dp, k) for k in range(max(0, depth - 1))]
    for recorded, assumed in variants:
        table, table_link, stages, send_max = None, None, None, 0.0
        for pp in range(1, depth + 1):
            if not allowed_gpus(seg.tp * seg.dp * pp, st.cluster) or m * work / pp >= limit:
                continue
            link = _cross_link(st, seg.tp * seg.dp, pp)
            if table is None or link != table_link:
                send = _send(seg, link)
                stages, send_max = _Stages(seg, assumed, send), float(send.max())
                table, table_link = cut_table(seg.n, stages.cost, depth), link
            part = table.best(pp)
            # the DP's slowest stage costs f + b + send + tail / m per micro-batch, and every layout's bound is at
            # least m (f + b) + tail of each of its stages (bounds.py: body >= m (f + b), Up >= tail): a layout
            # whose m (slowest - largest send) reaches `limit` cannot beat it and is not built
            if part is not None and m * (part.slowest - send_max) < limit:
                out.append(_layout(seg, stages, part.cuts, part.slowest, recorded, links))
    if st.virtual_stages and st.schedule == "1f1b" and not depths and not seg.unit.feeds and not seg.unit.out_bytes:
        out += _interleaved(seg, depth, limit)
    return out


def _interleaved(seg: Segments, depth: int, limit: float) -> list[Layout]:
    """Interleaved 1F1B layouts of a chain unit at one (tp, dp, ZeRO, m): for each v of Setting.virtual_stages and pp
    of 2..depth dividing m, the unit cut into pp * v chunks of balanced op time (prefix sums of the fastest policy's per-block
    forward + backward; not the DP's min-max: an approximation of the best cuts), stage k holding chunks k, k + pp,
    ...; per stage the fastest policy whose memory fits (its chunks' bytes added up, with the interleaved schedule's
    micro-batches in flight, memory.in_flight). Only where the chunks form a linear pipeline and nothing is frozen
    (planner/solver/bounds.py's interleaved bound assumes both)."""
    st, m, n, cl = seg.setting, seg.micro_batches, seg.n, seg.setting.cluster
    if any(b.frozen for b in seg.unit.blocks):
        return []
    usable = [pol for pol in st.policies if runs_with(pol, seg.zero)]
    if not usable:
        return []
    times = {pol: seg.time(pol) for pol in usable}
    mems = {pol: seg.memory(pol) for pol in usable}
    per_block = np.array([min(times[p][0][i, i + 1] + times[p][1][i, i + 1] for p in usable) for i in range(n)])
    prefix = np.concatenate(([0.0], np.cumsum(per_block)))
    caps = (cl.device.memory_bytes, st.host_share, st.nvme_share)
    out = []
    for v in st.virtual_stages:
        for pp in range(2, depth + 1):
            chunks = pp * v
            if chunks > n:
                break
            if not allowed_gpus(seg.tp * seg.dp * pp, cl) or m % pp:
                continue  # Megatron's interleaved schedule needs the micro-batches in groups of pp
            raw = np.searchsorted(prefix, prefix[-1] * np.arange(1, chunks) / chunks, side="left")
            cuts = tuple(min(max(int(c), i + 1), n - chunks + i + 1) for i, c in enumerate(raw))
            if any(b <= a for a, b in zip(cuts, cuts[1:])):
                continue
            starts, ends = np.array((0, *cuts)), np.array((*cuts, n))
            if _stage_preds(seg.unit, starts):
                continue  # not a linear pipeline of chunks
            flights = np.array([in_flight("interleaved", m, warmup_forwards("interleaved", m, pp - 1 - k, v, pp), v)
                                for k in range(pp)])
            best_time = np.full(pp, np.inf)
            best_rows = np.zeros((8, pp))  # fwd, bwd, tail, optimizer, gather, gpu, cpu, nvme per stage
            best_chunks = np.zeros((2, chunks))  # fwd, bwd per chunk
            choice = [usable[0]] * pp
            for pol in usable:  # chunk c is on stage c mod pp: (v, pp) reshapes sum a stage's chunks
                t = np.array([x[starts, ends] for x in times[pol]])  # (5, chunks)
                mem = np.array([x[starts, ends] for x in mems[pol]]).reshape(6, v, pp).sum(axis=1)
                used = mem[0::2] + flights[None, :] * mem[1::2]  # gpu, cpu, nvme per stage
                stage = t.reshape(5, v, pp).sum(axis=1)
                total = np.where((used <= np.array(caps)[:, None]).all(axis=0), stage[0] + stage[1], np.inf)
                better = total < best_time
                for k in np.flatnonzero(better):
                    choice[k] = pol
                best_time = np.where(better, total, best_time)
                best_rows[:, better] = np.concatenate([stage, used])[:, better]
                sel = np.tile(better, v)
                best_chunks[:, sel] = t[:2, sel]
            if not np.isfinite(best_time).all():
                continue
            slowest = float(best_time.max())
            if m * slowest >= limit:
                continue
            chunk_fwd, chunk_bwd = tuple(best_chunks[0].tolist()), tuple(best_chunks[1].tolist())
            rows = [tuple(r) for r in best_rows.tolist()]
            out.append(Layout(
                unit=seg.unit.name, schedule="1f1b", micro_batches=m, tp=seg.tp, dp=seg.dp, zero=seg.zero, cuts=cuts,
                policies=tuple(choice), downstream=None, assumed_downstream=0, fwd=rows[0], bwd=rows[1],
                lag=(0.0,) * (pp - 1), tail=rows[2], optimizer=rows[3], gather=rows[4], gpu_bytes=rows[5], cpu_bytes=rows[6],
                nvme_bytes=rows[7], samples=seg.samples, out_bytes=seg.unit.out_bytes, slowest=slowest,
                sequence_parallel=seg.sequence_parallel, chunks=v, chunk_fwd=chunk_fwd, chunk_bwd=chunk_bwd))
    return out


def _send(seg: Segments, link: Link) -> np.ndarray:
    """Forward + backward p2p of the tensors crossing a cut before block j, per micro-batch and replica."""
    cross = np.zeros(seg.n + 1)
    tp_link = _tp_link(seg)
    for j in range(1, seg.n):
        cross[j] = 2 * hand_over_time(seg.unit.cross_bytes[j] * seg.samples, seg.tp, link, tp_link)
    return cross


def _tp_link(seg: Segments) -> Link:
    """The link of a tp group (inside a node unless tp exceeds a node): the hand-over's all-gather."""
    cl = seg.setting.cluster
    return link_between(cl, crosses_nodes=seg.tp > cl.gpus_per_node)


def _layout(seg: Segments, stages: _Stages, cuts: tuple[int, ...], slowest: float, downstream: int | None,
            links: Sequence[Link] | None = None) -> Layout:
    st, cl = seg.setting, seg.setting.cluster
    starts = np.array((0, *cuts), dtype=np.int64)
    ends = np.array((*cuts, seg.n), dtype=np.int64)
    pp = len(starts)
    flights = np.array([stages.flight(pp - 1 - k) for k in range(pp)])
    which = np.array([stages.which_at(f)[a, b] for f, a, b in zip(flights, starts, ends)], dtype=np.int64)
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
    links = links if links is not None else [_stage_link(cl, stage_ranks, k) for k in range(len(cuts))]
    lag = tuple(hand_over_time(seg.unit.cross_bytes[c] * seg.samples, seg.tp, links[k], _tp_link(seg))
                for k, c in enumerate(cuts))
    entries = tuple(int(np.searchsorted(starts, f.block, side="right")) - 1 for f in seg.unit.feeds)
    preds = _stage_preds(seg.unit, starts)
    trains = [not b.frozen for b in seg.unit.blocks]
    backward: list[bool] = []
    for k, (a, b) in enumerate(zip(starts, ends)):  # conservative: upstream stages count only in a linear pipeline
        backward.append(any(trains[a:b]) or (not preds and k > 0 and backward[-1]))
    return Layout(
        unit=seg.unit.name, schedule=st.schedule, micro_batches=seg.micro_batches, tp=seg.tp, dp=seg.dp, zero=seg.zero,
        cuts=tuple(cuts), policies=policies, downstream=downstream, assumed_downstream=stages.downstream,
        fwd=tuple(fwd.tolist()), bwd=tuple(bwd.tolist()), lag=lag, tail=tuple(tail.tolist()), optimizer=tuple(opt.tolist()),
        gather=tuple(gather.tolist()), gpu_bytes=tuple((g0 + flights * g1).tolist()), cpu_bytes=tuple((c0 + flights * c1).tolist()),
        nvme_bytes=tuple((n0 + flights * n1).tolist()), samples=seg.samples, out_bytes=seg.unit.out_bytes, entries=entries,
        slowest=slowest, sequence_parallel=seg.sequence_parallel, preds=preds, backward=() if all(backward) else tuple(backward),
    )


def _stage_preds(unit: Unit, starts: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Per stage, the stages whose blocks its blocks read (Layout.preds); () when each stage reads exactly the one
    before it (or a unit without recorded reads: a linear pipeline)."""
    if not unit.reads or len(starts) == 1:
        return ()
    stage = np.searchsorted(starts, np.arange(len(unit.blocks)), side="right") - 1
    preds: list[set[int]] = [set() for _ in starts]
    for b, reads in enumerate(unit.reads):
        preds[stage[b]].update(int(stage[a]) for a in reads if stage[a] != stage[b])
    if all(p == {k - 1} for k, p in enumerate(preds) if k > 0):
        return ()
    return tuple(tuple(sorted(p)) for p in preds)


# --- units: which blocks get one layout ----------------------------------------------------------------

Structure = Literal["chain", "non-colocated", "colocated"]


def profile_units(profile: Profile, structure: Structure) -> tuple[Unit, ...] | None:
    """The units of a profile for a structure; None when the profile's groups do not fit it.

    chain: one unit of every block (one layout for the whole model, cut anywhere: the homogeneous shape).
    non-colocated / colocated: one unit per profile group, except that a group of at most SMALL_GROUP blocks with at
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
    # A cut before block j: the chunk starting at j receives, as parallel routes (plans/stage_graph.py), the
    # whole output of every earlier block it reads; the largest one read by block j itself bounds the wait.
    cross = [0.0] * (n + 1)
    reads: list[set[int]] = [set() for _ in range(n)]
    for e in profile.edges:
        a, b = index[e.src] - first, index[e.dst] - first
        if 0 <= a < b < n:
            cross[b] = max(cross[b], blocks[a].output_bytes)
            reads[b].add(a)
    return Unit(name, blocks, feeds, out_bytes, tuple(inputs[b.name] for b in blocks), tuple(cross),
                tuple(tuple(sorted(r)) for r in reads))
