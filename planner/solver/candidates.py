"""Candidate layouts of one unit (tp, pp, dp, ZeRO, per-stage recompute/tiers) with DP cut points."""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from cost_models.comm import collective_link, hand_over_time, link_for
from cost_models.memory import in_flight, warmup_forwards
from planner.solver.bounds import Layout, run_bound
from planner.solver.partition import cut_table
from planner.solver.segments import BlockTimes, Segments
from planner.solver.space import Policy, Schedule, Setting, Unit, allowed_gpus, divisors, tp_degrees
from plans.capabilities import SEQUENCE_PARALLEL_PADS
from plans.cluster import Cluster, Link
from plans.graph import Block

# The vocabulary (unit, policy, setting) is planner/solver/space.py's, Layout planner/solver/bounds.py's (it carries
# its bound); a unit's layouts are found per (tp, dp, ZeRO, m) by one DP table (planner/solver/partition.py) over the
# stage figures of planner/solver/segments.py.

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
            for zero, again in zero_forms(cl, dp, setting.zeros):
                if time.perf_counter() > deadline:
                    break
                seg = Segments(unit, setting, tp, dp, zero, micro_batches, times, sequence_parallel=sp,
                               reshard_after_forward=again)
                out += _layouts_of(seg, depth, downstream, merge_depths, limit, work)
    return out


def sp_divides(blocks: Iterable[Block], tp: int) -> bool:
    """Whether the runtime can shard these blocks' sequences over tp: always where it pads a sequence tp does not divide
    (plans/capabilities.SEQUENCE_PARALLEL_PADS: a ViT's 577 tokens run as 578 at tp=2, priced so), else where tp
    divides the sequence of every tensor-parallel block whose sequence the profile recorded."""
    return SEQUENCE_PARALLEL_PADS or all(b.sequence % tp == 0 for b in blocks if b.supports_tp and b.sequence)


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


def zero_forms(cluster: Cluster, dp: int, zeros: Sequence[int] = ZERO_STAGES) -> tuple[tuple[int, bool], ...]:
    """(ZeRO stage, reshard_after_forward) pairs worth trying: every zero_stages one, and ZeRO-3 also without
    resharding after the forward (FSDP2's reshard_after_forward=False: one all-gather per micro-batch, the gathered
    parameters held from each forward to its backward). Keeping parameters unsharded across a step's micro-batches
    (gathered once per step) is ZeRO-2 (reduce-scatter every micro-batch) and ZeRO-1 (once per step) as the runtime
    runs them (runtime/zero.before_backward), already here."""
    return tuple((z, again) for z in zero_stages(cluster, dp, zeros) for again in ((True, False) if z == 3 else (True,)))


def runs_with(policy: Policy, zero: int) -> bool:
    """Whether the runtime trains a stage with these tiers under ZeRO stage `zero` (runtime.zero.zero_runs_with:
    its FSDP2 holds parameters and gradients on the GPU, or both on the host with CPU offload)."""
    if zero == 0 or (policy.params, policy.grads) == ("gpu", "gpu"):
        return True  # zero_runs_with's first case, without importing torch (seconds) into a solve that needs none
    from plans.capabilities import zero_runs_with

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


LOOKAHEADS = (0, 1, 2, 4)  # micro-batches a source on its own ranks may run ahead of the sink (Group.lookahead)


def ahead_layouts(unit: Unit, setting: Setting, micro_batches: int, *, max_gpus: int, depths: Sequence[int],
                  limit: float = math.inf, times: BlockTimes | None = None, deadline: float = math.inf) -> list[Layout]:
    """A non-colocated source's layouts (unit_layouts) for each look-ahead k of LOOKAHEADS (1F1B, k < m): sized, for
    memory and the bound's in-flight count, as if the sink had k more stages -- an encoder running k forwards ahead
    holds k more micro-batches (plans/schedule.py: its limit d + 1 + k) -- and recorded for the sink's own depth."""
    out: list[Layout] = []
    for k in LOOKAHEADS:
        if k and (setting.schedule != "1f1b" or k >= micro_batches):
            break
        lays = unit_layouts(unit, setting, micro_batches, max_gpus=max_gpus, downstream=[d + k for d in depths],
                            limit=limit, times=times, deadline=deadline)
        out += [lay if not k else replace(lay, lookahead=k, downstream=None if lay.downstream is None else lay.downstream - k)
                for lay in lays]
    return out


def colocated_layouts(unit: Unit, setting: Setting, micro_batches: int, *, max_gpus: int, depths: Sequence[int],
                      sizes: Iterable[int], limit: float = math.inf, times: BlockTimes | None = None,
                      deadline: float = math.inf) -> list[Layout]:
    """A colocated source's unpipelined layouts on as many ranks as a sink layout (`sizes`), sized for every sink
    depth of `depths`: for each (tp, dp, ZeRO, sequence parallelism, depth), the fastest policy that fits the GPU
    alone, and every slower policy of setting.policies that holds less GPU memory than each faster one kept.
    The source shares its ranks with the sink, so the fastest policy alone (unit_layouts' per-stage choice) may
    leave the sink no room where a leaner one (recomputing its activations) would (the old candidates are a subset)."""
    times = times or BlockTimes(setting)
    sizes = set(sizes)
    fronts: dict[tuple, list[Layout]] = {}
    for pol in setting.policies:
        one = replace(setting, policies=(pol,))
        for lay in unit_layouts(unit, one, micro_batches, max_gpus=max_gpus, downstream=depths, merge_depths=False,
                                max_pp=1, limit=limit, times=times, deadline=deadline):
            if lay.gpus in sizes:
                key = (lay.tp, lay.dp, lay.zero, lay.reshard_after_forward, lay.sequence_parallel, lay.downstream)
                fronts.setdefault(key, []).append(lay)
    out: list[Layout] = []
    for lays in fronts.values():
        lays.sort(key=lambda lay: (lay.bound.own, max(lay.gpu_bytes)))
        least = math.inf
        for lay in lays:
            if max(lay.gpu_bytes) < least:
                out.append(lay)
                least = max(lay.gpu_bytes)
    return out


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
            if _stage_preds(seg.unit, seg.positions[starts]):
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
                unit=seg.unit.name, schedule="1f1b", micro_batches=m, tp=seg.tp, dp=seg.dp, zero=seg.zero,
                cuts=tuple(int(seg.positions[c]) for c in cuts), reshard_after_forward=seg.reshard_after_forward,
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
        cross[j] = 2 * hand_over_time(seg.unit.cross_bytes[seg.positions[j]] * seg.samples, seg.tp, link, tp_link)
    return cross


def _tp_link(seg: Segments) -> Link:
    """The link of a tp group (inside a node unless tp exceeds a node): the hand-over's all-gather."""
    cl = seg.setting.cluster
    return collective_link(cl, range(seg.tp))


def _layout(seg: Segments, stages: _Stages, cuts: tuple[int, ...], slowest: float, downstream: int | None,
            links: Sequence[Link] | None = None) -> Layout:
    """The layout of the DP's cuts (indices of seg.positions; the layout's are block indices)."""
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
    starts, ends = seg.positions[starts], seg.positions[ends]  # block indices from here on
    cuts = tuple(int(c) for c in starts[1:])
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
        reshard_after_forward=seg.reshard_after_forward,
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
