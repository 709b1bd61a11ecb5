"""The search of baselines.py over homogeneous layouts: memory first, then branch and bound on a step-time lower bound."""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cost_models.comm import dp_link, zero_collectives
from cost_models.offload import exposed, overlaps_compute
from cost_models.compute import block_time, measured_on, tp_shard
from cost_models.memory import DTYPE_BYTES, block_input_bytes, in_flight, kept_activation_bytes, stage_memory, warmup_forwards
from cost_models.tail import tail_over
from planner.solver.bounds import stage_body
from planner.solver.layout_spec import LayoutSpec, Recompute
from planner.solver.megatron_split import build_spec_plan, recomputed_tiers, spec_stages, spec_training, split_blocks
from plans.cluster import Cluster
from plans.errors import ImpossiblePrediction, MmplanError
from plans.graph import Block, Profile
from plans.plan import Memory, Plan, SolverInfo

@dataclass(frozen=True, slots=True)
class Screened:
    """A layout before simulation: its peak GPU bytes on the fullest rank and a lower bound of its step time."""

    spec: LayoutSpec
    gpu_bytes: float
    overflow: float  # gpu_bytes - device memory (> 0: does not fit)
    lower_bound_s: float


def search(profile: Profile, cluster: Cluster, global_batch: int, specs: Sequence[LayoutSpec], *, method: str,
           deadline: float = math.inf, costs: ScreenCosts | None = None) -> Plan:
    """The fastest fitting plan among `specs`, exactly as evaluating every one would find it, simulating few.

    1. Every layout's step-time lower bound (see screen; cheap: block times and tails, cached) orders them.
    2. In that order, a layout's per-rank memory is computed with the cost model's own stage_memory and
       in-flight counts (cost_models/memory.py), exactly what evaluate() reports for these plans; those that
       do not fit are skipped. Dominance: recomputation only adds compute time, so a layout with
       recomputation is skipped when the same layout with less of it is also in `specs` and fits.
    3. Branch and bound: fitting layouts are simulated in that order; the search stops when the next bound is
       no better than the best simulated step (or at the deadline, a time.perf_counter() value).
    None fits: the layout with the least overflow is built; its predictions say fits = false and the solver
    notes say by how much.
    """
    started = time.perf_counter()
    costs = costs or ScreenCosts(profile, cluster)
    order = sorted(((_step_bound(profile, cluster, global_batch, s, costs), i) for i, s in enumerate(specs)))
    memory: dict[LayoutSpec, float] = {}

    def peak(spec: LayoutSpec) -> float:
        if spec not in memory:
            memory[spec] = _peak_gpu_bytes(profile, global_batch, spec, costs)
        return memory[spec]

    cap = cluster.device.memory_bytes
    candidates = set(specs)  # dominance only by a cheaper recompute the search itself would build
    best: tuple[Plan, LayoutSpec] | None = None
    simulated = 0
    for bound, i in order:
        spec = specs[i]
        if time.perf_counter() > deadline:
            if best is None:
                raise MmplanError("the time limit ended the baseline's search before it simulated a layout")
            break
        if best is not None and bound * (1 - 1e-9) >= best[0].predicted.step_time_s:
            break
        if peak(spec) > cap or any(peak(c) <= cap for c in (replace(spec, recompute=r) for r in _cheaper(spec.recompute))
                                   if c in candidates):
            continue
        try:
            plan = build_spec_plan(profile, cluster, global_batch, spec, SolverInfo(method), schema=False)  # checked when saved
        except ImpossiblePrediction:  # inconsistent inputs: an error for every plan, never a skipped candidate
            raise
        except MmplanError:  # e.g. an interleaved order that deadlocks: not a candidate
            continue
        simulated += 1
        if plan.predicted.fits and (best is None or plan.predicted.step_time_s < best[0].predicted.step_time_s):
            best = plan, spec
    if best is not None:
        plan, spec = best
        note = (f"layout {spec}; {len(specs)} layouts, {len(memory)} screened for memory, {simulated} simulated "
                f"(the rest pruned by memory, dominance or a step-time lower bound)")
    else:
        least = min(specs, key=peak)
        plan, spec = build_spec_plan(profile, cluster, global_batch, least, SolverInfo(method)), least
        simulated += 1
        note = (f"layout {spec}; no layout fits: of {len(specs)} layouts this one needs the least memory, "
                f"{peak(least) / 1e9:.1f} GB on its fullest GPU of {cluster.device.memory_bytes / 1e9:.1f} GB")
    return replace(plan, solver=SolverInfo(method, objective=plan.predicted.step_time_s, time_s=time.perf_counter() - started,
                                           candidates=len(specs), notes=note))


def _cheaper(recompute: Recompute) -> tuple[Recompute, ...]:
    """Recompute options that only add less compute than `recompute` (none < selective <= layers <= full: each reruns a
    subset of the next one's forward), so a layout is skipped when one of these fits."""
    return {"none": (), "selective": ("none",), "layers": ("none", "selective"), "full": ("none", "selective", "layers")}[recompute]


def screen(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec, *, costs: ScreenCosts | None = None) -> Screened:
    """Memory and a step-time lower bound of a homogeneous layout, without building or simulating the plan."""
    costs = costs or ScreenCosts(profile, cluster)
    peak = _peak_gpu_bytes(profile, global_batch, spec, costs)
    return Screened(spec, peak, peak - cluster.device.memory_bytes, _step_bound(profile, cluster, global_batch, spec, costs))


def _peak_gpu_bytes(profile: Profile, global_batch: int, spec: LayoutSpec, costs: ScreenCosts) -> float:
    """GPU bytes of the layout's fullest rank, as cost_models/memory.stage_memory counts them."""
    m = global_batch // (spec.dp * spec.micro_batch)
    training = spec_training(profile, spec, global_batch)
    gpu = []
    for i, names in enumerate(costs.stage_blocks(profile, spec)):
        stage = [costs.blocks[n] for n in names]
        acts = recomputed_tiers(profile, names, spec.recompute)
        warmup = warmup_forwards(spec.schedule, m, spec.pp - i - 1, spec.virtual_stages, spec.pp)
        mem = stage_memory(stage, samples=float(spec.micro_batch), tp=spec.tp, dp=spec.dp, zero=spec.zero,
                           memory=Memory(activations=acts),
                           in_flight_micro_batches=in_flight(spec.schedule, m, warmup, spec.virtual_stages),
                           input_bytes=costs.inputs, dtype=training.dtype, optimizer=training.optimizer,
                           sequence_parallel=spec.sequence_parallel and spec.tp > 1)
        gpu.append(mem.gpu)
    return max(gpu)


def _step_bound(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec, costs: ScreenCosts) -> float:
    """A lower bound of the layout's simulated step time.

    Each term is a part of what cost_models/pipeline.py simulates, so the bound never exceeds the simulated
    step (tests check it on whole grids): stage i runs m forwards of f_i and m backwards of b_i seconds
    (block_time compute plus blocking TP all-reduces; exposed transfers and p2p sends left out) on one compute
    lane, after micro-batch 0 went through the forwards of the stages before it; its last backward is
    micro-batch m-1's, whose gradient then goes back through the stages before it; every stage ends with its
    gradient sync, optimizer step and ZeRO all-gather in sequence (the simulator's stage tail; on GPUs without the
    all-gather, which hides behind the next step's first forward there). With v > 1
    chunks per rank only the per-stage sum is used.
    """
    m = global_batch // (spec.dp * spec.micro_batch)
    training = spec_training(profile, spec, global_batch)
    dtype = training.dtype
    sp = spec.sequence_parallel and spec.tp > 1
    # per stage: forward and backward op sums and trained parameters (shared by every dp and ZeRO stage), then tails
    ops_key = ("ops", spec.tp, spec.pp, spec.micro_batch, spec.virtual_stages, spec.recompute, spec.split, sp)
    if ops_key not in costs.memo:
        samples = float(spec.micro_batch)
        ops, trained, params = [], [], []
        for names in costs.stage_blocks(profile, spec):
            t = [0.0] * 4  # forward compute, forward with its TP comm, backward compute, backward with its TP comm
            tr = pa = 0.0
            for blk, tier, count in costs.composition(profile, names, spec.recompute):
                for j, x in enumerate(costs.block_time(blk, samples, spec.tp, dtype, tier, sp)):
                    t[j] += count * x
                pa += count * blk.params / tp_shard(blk, spec.tp)
                tr += 0.0 if blk.frozen else count * blk.params / tp_shard(blk, spec.tp)  # frozen: no sync / update
            ops.append(t)
            trained.append(tr)
            params.append(pa)
        costs.memo[ops_key] = (ops, trained, params)
    ops, trained, params = costs.memo[ops_key]
    key = ("tail", *ops_key, spec.dp, spec.zero)
    if key not in costs.memo:
        per = spec.dp * spec.tp
        fwd, bwd, tail = [], [], []
        hides = overlaps_compute(cluster)
        for i, ((fc, f, bc, b), tr, pa) in enumerate(zip(ops, trained, params)):
            link = dp_link(cluster, range(i * per, (i + 1) * per), spec.tp)
            # ZeRO's gathers / reduce-scatters as the simulator charges them (pipeline._cost_chunk): hidden behind the
            # op's compute on GPUs; with v chunks per rank, over the stage's sums (a lower bound of the chunks' sum)
            z = zero_collectives(pa * DTYPE_BYTES[dtype], dp=spec.dp, zero=spec.zero, link=link)
            fwd.append(f + (exposed(z.gather, fc) if hides else z.gather))
            bwd.append(b + (exposed(z.gather + z.scatter, bc) if hides else z.gather + z.scatter))
            # the gradient buckets hide behind at most the stage's last backward compute (the simulator's overlap_s);
            # on GPUs ZeRO 1-2's parameter gather hides behind the next first forward (fsdp.first_forward_gather,
            # per block): left out of the bound there
            t = tail_over(tr, dp=spec.dp, zero=spec.zero, memory=Memory(), link=link, cluster=cluster,
                          dtype=dtype, optimizer=training.optimizer, overlap_s=bc)
            tail.append(t.total - t.param_gather if hides else t.total)
        costs.memo[key] = fwd, bwd, tail
    fwd, bwd, tail = costs.memo[key]
    bound = max(m * (f + b) + t for f, b, t in zip(fwd, bwd, tail))
    if spec.virtual_stages > 1 and costs.linear(profile, spec) and not any(b.frozen for b in profile.blocks):
        # interleaved: planner/solver/bounds.py's interleaved terms over the pp * v chunks (sends and ZeRO exposure left out of
        # the chunks' ops; the stage sums keep theirs)
        p, v = spec.pp, spec.virtual_stages
        cf, cb = costs.chunk_ops(profile, spec, dtype, sp, recomputed_tiers)
        total_f = sum(cf)
        for k in range(p):
            into = sum(cf[:k])
            wait = total_f + sum(cb[(v - 1) * p + k + 1:])
            r = min(warmup_forwards("interleaved", m, p - 1 - k, v, p) + 1, m * v)
            fmin = min(cf[k::p])
            bound = max(bound, max(into + m * (fwd[k] + bwd[k]), wait + m * bwd[k],
                                   max(wait, into + r * fmin) + (m * v - r) * fmin + m * bwd[k]) + tail[k])
    if spec.virtual_stages == 1 and costs.linear(profile, spec):
        # a linear pipeline (each stage reads only the one before it): planner/solver/bounds.py's per-stage terms, sends and
        # transfers left out -- In_k (micro-batch 0's forwards before stage k), the body (stage_body: its 2m ops and
        # the warm-up and cool-down waits), Up_k (the gradient's path back to an earlier stage, then that stage's tail)
        p = spec.pp
        back = costs.backward(profile, spec)  # stages running backwards: a frozen first stage may not
        b_ = [b if has else 0.0 for b, has in zip(bwd, back)]
        into = [sum(fwd[:k]) for k in range(p)]
        down = [sum(fwd[j] + b_[j] for j in range(k + 1, p)) for k in range(p)]
        up = [max([tail[k], *(sum(b_[i:k]) + tail[i] for i in range(k) if all(back[i:k]))]) for k in range(p)]
        for k in range(p):
            r = min(warmup_forwards(spec.schedule, m, p - 1 - k) + 1, m)
            body = stage_body(fwd[k], b_[k], m, r, down[k]) if back[k] else m * fwd[k]
            bound = max(bound, into[k] + body + up[k])
    return bound


class ScreenCosts:
    """Per-search caches of what screening needs from the profile: blocks by name, block inputs, block times."""

    def __init__(self, profile: Profile, cluster: Cluster) -> None:
        self.cluster = cluster
        self.blocks = {b.name: b for b in profile.blocks}
        self.inputs = block_input_bytes(profile)
        self.measured = profile.micro_batch if measured_on(profile, cluster) else None
        self._times: dict[tuple, tuple[float, float]] = {}
        self.memo: dict[tuple, object] = {}  # per-layout figures shared by layouts that differ in schedule or ZeRO only
        self._stages: dict[tuple, list[tuple[str, ...]]] = {}
        self._kinds: dict[str, int] = {}
        self._contents: dict[Block, int] = {}

    def sp_dominates(self, tp: int, samples: float, dtype: str) -> bool:
        """Whether sequence parallelism at (tp, samples) costs no more than without it for every block: op times
        under every recompute option and saved activations (as the solver's BlockTimes.sp_dominates); then a layout
        without it is never faster than the same layout with it and is left out of the grid."""
        key = ("sp", tp, samples, dtype)
        if key not in self.memo:
            ok = True
            for blk in {self.kind(b): b for b in self.blocks.values()}.values():
                for rec in (False, "selective", "recompute"):
                    on, off = (self.block_time(blk, samples, tp, dtype, rec, sp) for sp in (True, False))
                    ok = ok and all(a <= b for a, b in zip(on, off))
                ok = ok and all(kept_activation_bytes(blk, tp, sequence_parallel=True, tier=t)
                                <= kept_activation_bytes(blk, tp, sequence_parallel=False, tier=t) for t in ("keep", "selective"))
            self.memo[key] = ok
        return self.memo[key]

    def linear(self, profile: Profile, spec: LayoutSpec) -> bool:
        """Whether each stage of the split (each chunk, with v > 1 chunks per rank) reads only its own blocks and the
        one before it (a pipeline, not a DAG)."""
        key = ("linear", spec.pp, spec.virtual_stages, spec.split)
        if key not in self.memo:
            parts = split_blocks(profile, spec.pp * spec.virtual_stages, spec.split)
            part = {b: i for i, names in enumerate(parts) for b in names}
            self.memo[key] = all(part[e.dst] - part[e.src] in (0, 1) for e in profile.edges)
        return self.memo[key]

    def chunk_ops(self, profile: Profile, spec: LayoutSpec, dtype: str, sp: bool, recomputed) -> tuple[list[float], list[float]]:
        """Per model chunk of the split (pp * v of them), its forward and backward op seconds (compute + TP comm)."""
        key = ("chunks", spec.tp, spec.pp, spec.micro_batch, spec.virtual_stages, spec.recompute, spec.split, sp)
        if key not in self.memo:
            cf, cb = [], []
            for names in split_blocks(profile, spec.pp * spec.virtual_stages, spec.split):
                ops = [(count, self.block_time(blk, float(spec.micro_batch), spec.tp, dtype, tier, sp))
                       for blk, tier, count in self.composition(profile, tuple(names), spec.recompute)]
                cf.append(sum(count * o[1] for count, o in ops))
                cb.append(sum(count * o[3] for count, o in ops))
            self.memo[key] = (cf, cb)
        return self.memo[key]

    def composition(self, profile: Profile, names: tuple[str, ...], recompute: Recompute) -> list[tuple[Block, str | bool, int]]:
        """A stage's blocks as (a block, its recompute tier, how many blocks of equal content have that tier): the
        stage sums are taken over these (linear in the stage once, not per layout; a 10,000-block profile)."""
        key = ("composition", names, recompute)
        if key not in self.memo:
            acts = recomputed_tiers(profile, names, recompute)
            counts: dict[tuple, list] = {}
            for n in names:
                blk = self.blocks[n]
                entry = counts.setdefault((self.kind(blk), acts.get(n, False)), [blk, acts.get(n, False), 0])
                entry[2] += 1
            self.memo[key] = [tuple(e) for e in counts.values()]
        return self.memo[key]

    def backward(self, profile: Profile, spec: LayoutSpec) -> list[bool]:
        """Per stage of a linear split, whether it runs backwards: it or a stage before it trains."""
        key = ("backward", spec.pp, spec.virtual_stages, spec.split)
        if key not in self.memo:
            out: list[bool] = []
            for names in self.stage_blocks(profile, spec):
                out.append(bool(out and out[-1]) or any(not self.blocks[n].frozen for n in names))
            self.memo[key] = out
        return self.memo[key]

    def stage_blocks(self, profile: Profile, spec: LayoutSpec) -> list[tuple[str, ...]]:
        key = (spec.pp, spec.virtual_stages, spec.split)
        if key not in self._stages:
            self._stages[key] = spec_stages(profile, spec)
        return self._stages[key]

    def kind(self, block: Block) -> int:
        """A number equal for blocks of equal content but name and group (a model's identical layers)."""
        k = self._kinds.get(block.name)
        if k is None:
            k = self._kinds[block.name] = self._contents.setdefault(replace(block, name="", group=""), len(self._contents))
        return k

    def block_time(self, block: Block, samples: float, tp: int, dtype: str, recompute: bool | str,
                   sequence_parallel: bool = False) -> tuple[float, float, float, float]:
        """(forward compute, forward op, backward compute, backward op) seconds of a block as the simulator charges
        them (an op: compute and its blocking TP communication), without exposed transfers."""
        key = (self.kind(block), samples, tp, dtype, recompute, sequence_parallel)
        if key not in self._times:
            t = block_time(block, samples, tp, self.cluster, dtype=dtype, measured_micro_batch=self.measured,
                           recompute=recompute, sequence_parallel=sequence_parallel)
            self._times[key] = (t.fwd, t.fwd + t.fwd_comm, t.bwd, t.bwd + t.bwd_comm)
        return self._times[key]
