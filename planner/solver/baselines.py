"""The plans we must beat: Megatron-style homogeneous layouts (one given, or the best of a grid), ZeRO-3 and even GPipe."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal, get_args

from cost_models.memory import DTYPE_BYTES
from planner.solver.baseline_search import ScreenCosts, search
from planner.solver.candidates import sp_divides
from planner.solver.layout_spec import LayoutSpec, Recompute, Schedule, Split, check_batch, check_layout, parse_layout, parse_schedule
from planner.solver.megatron_split import build_spec_plan, layer_count, llm_layer_count, llm_start
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan, SolverInfo

# A homogeneous layout (LayoutSpec, planner/solver/layout_spec.py) is split into stages as Megatron does
# (planner/solver/megatron_split.py); the best of a grid of them is found by planner/solver/baseline_search.py.

Baseline = Literal["homogeneous", "megatron", "zero3", "gpipe-even"]
BASELINES: tuple[str, ...] = get_args(Baseline)


def homogeneous_plan(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec | str, *,
                     solver: SolverInfo | None = None, predict: bool = True) -> Plan:
    """The Megatron-style plan for exactly `spec`: one group ("model") holding every block in one pipeline,
    encoders in the first stage(s), layers split evenly over pp stages, one tp and dp for all, predictions attached."""
    spec = parse_layout(spec) if isinstance(spec, str) else spec
    check_layout(profile, cluster, global_batch, spec)
    solver = solver or SolverInfo(method="baseline:homogeneous", notes=f"layout {spec}")
    return build_spec_plan(profile, cluster, global_batch, spec, solver, predict=predict)


# --- the grid of homogeneous layouts ---------------------------------------------------------------------


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def grid_layouts(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: Sequence[str] = ("1f1b",),
                 micro_batches: Sequence[int] | None = None, zeros: Sequence[int] = (0, 1),
                 recomputes: Sequence[Recompute] = ("none", "full"), split: Split = "layers",
                 sequence_parallels: Sequence[bool] = (False,)) -> list[LayoutSpec]:
    """Every valid homogeneous layout: tp a power of two dividing gpus_per_node (1 only when no block supports
    tp), pp dividing the layer count (Megatron's uniform split) with tp*pp dividing the world, dp = world/(tp*pp),
    micro-batch sizes `micro_batches` (default 1, 2, 4, ...) with dp*micro-batch dividing the global batch,
    each ZeRO stage of `zeros` (0 and 1 are the same plan at dp = 1) and recompute option; schedules are
    `1f1b`, `gpipe` or `interleaved:V` (used where pp >= 2 and pp*V divides the layer count); sequence parallelism
    each of `sequence_parallels` where tp > 1 (off at tp = 1)."""
    check_batch(global_batch)
    world = cluster.world_size
    spans = (llm_layer_count(profile) or len(profile.blocks) - llm_start(profile)) if split == "megatron" else \
        (layer_count(profile) or len(profile.blocks))
    parsed = [parse_schedule(s) for s in schedules]
    tps = [t for t in _powers_of_two(cluster.gpus_per_node) if cluster.gpus_per_node % t == 0
           and all(b.takes_tp(t) for b in profile.blocks)]
    if not any(b.supports_tp for b in profile.blocks):
        tps = [1]
    specs = []
    for tp in tps:
        for pp in (p for p in range(1, spans + 1) if spans % p == 0 and world % (tp * p) == 0):
            dp = world // (tp * pp)
            if dp > 1 and any(b.reduces_batch for b in profile.blocks):
                continue  # one layout for every block: a contrastive head needs whole micro-batches (dp = 1)
            sizes = micro_batches if micro_batches is not None else _powers_of_two(global_batch // dp)
            for mb in (s for s in sizes if global_batch % (dp * s) == 0):
                for schedule, v in parsed:
                    if v > 1 and (pp < 2 or spans % (pp * v)):
                        continue
                    for zero in dict.fromkeys(min(z, 0) if dp == 1 else z for z in zeros):
                        for rec in recomputes:
                            for sp in dict.fromkeys(sp and tp > 1 and sp_divides(profile.blocks, tp) for sp in sequence_parallels):
                                specs.append(LayoutSpec(tp, pp, dp, mb, schedule, v, rec, zero, split, sp))
    return specs


def homogeneous_grid(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: Sequence[str] = ("1f1b",),
                     micro_batches: Sequence[int] | None = None, zeros: Sequence[int] = (0, 1),
                     recomputes: Sequence[Recompute] = ("none", "full"), split: Split = "layers",
                     sequence_parallels: Sequence[bool] = (False,)) -> list[Plan]:
    """Every layout of grid_layouts as a plan with predictions (fitting or not, in grid order). Evaluates them all:
    use best_homogeneous for large clusters."""
    specs = grid_layouts(profile, cluster, global_batch, schedules=schedules, micro_batches=micro_batches,
                         zeros=zeros, recomputes=recomputes, split=split, sequence_parallels=sequence_parallels)
    if not specs:
        raise _no_layout(profile, cluster, global_batch)
    return [build_spec_plan(profile, cluster, global_batch, s, SolverInfo("baseline:homogeneous", notes=f"layout {s}")) for s in specs]


def best_homogeneous(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: Sequence[str] = ("1f1b",),
                     micro_batches: Sequence[int] | None = None, zeros: Sequence[int] = (0, 1),
                     recomputes: Sequence[Recompute] = ("none", "full")) -> Plan:
    """The fastest homogeneous plan that fits (as homogeneous_grid would find it, without evaluating every layout);
    when none fits, the one with the least memory overflow, flagged in its predictions and solver notes."""
    specs = grid_layouts(profile, cluster, global_batch, schedules=schedules, micro_batches=micro_batches,
                         zeros=zeros, recomputes=recomputes)
    if not specs:
        raise _no_layout(profile, cluster, global_batch)
    return search(profile, cluster, global_batch, specs, method="baseline:homogeneous")


MEGATRON_SCHEDULES = ("1f1b", "gpipe", "interleaved:2")
ALL_ZEROS = (0, 1, 2, 3)


def best_megatron(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: Sequence[str] = MEGATRON_SCHEDULES,
                  micro_batches: Sequence[int] | None = None, zeros: Sequence[int] = ALL_ZEROS,
                  recomputes: Sequence[Recompute] = ("none", "selective", "full"), per_step_micro_batch: int | None = None,
                  deadline: float = math.inf, sequence_parallels: Sequence[bool] = (False, True)) -> Plan:
    """The fastest Megatron-style plan (Megatron-LM's MIMO recipe): encoders and projectors on the first pipeline
    stage, the LLM's layers split evenly by count, one tp / dp / ZeRO stage / recompute (none, selective: the
    attention core, full) / sequence parallelism / micro-batch / schedule for all -- searched over every such layout
    the runtime runs. per_step_micro_batch: only layouts whose
    micro-batch over all replicas (dp x micro-batch) is this (solve --micro-batch)."""
    specs = grid_layouts(profile, cluster, global_batch, schedules=schedules, micro_batches=micro_batches, zeros=zeros,
                         recomputes=recomputes, split="megatron", sequence_parallels=sequence_parallels)
    if per_step_micro_batch is not None:
        specs = [s for s in specs if s.dp * s.micro_batch == per_step_micro_batch]
    from plans.limits import MAX_MICRO_BATCHES  # the solver's own limit on micro-batches per step

    specs = [s for s in specs if global_batch // (s.dp * s.micro_batch) <= MAX_MICRO_BATCHES]
    if not specs:
        raise _no_layout(profile, cluster, global_batch)
    costs = ScreenCosts(profile, cluster)
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    present = set(specs)
    specs = [s for s in specs if s.sequence_parallel or s.tp == 1 or replace(s, sequence_parallel=True) not in present
             or not costs.sp_dominates(s.tp, float(s.micro_batch), dtype)]
    return search(profile, cluster, global_batch, specs, method="baseline:megatron", deadline=deadline, costs=costs)


def _no_layout(profile: Profile, cluster: Cluster, global_batch: int) -> MmplanError:
    return MmplanError(f"no homogeneous layout of {profile.model!r} on {cluster.world_size} GPUs divides global batch "
                       f"{global_batch} (dp*micro-batch must divide it); use a global batch with more factors of 2")


# --- ZeRO-3 and even GPipe -----------------------------------------------------------------------------------


def zero3_plan(profile: Profile, cluster: Cluster, global_batch: int, *, micro_batch: int | None = None,
               recompute: Recompute | None = None) -> Plan:
    """Pure sharded data parallelism (ZeRO-3 / FSDP): pp = tp = 1, dp = every GPU. Without `micro_batch` /
    `recompute`, the fastest fitting choice of micro-batch size (powers of two) and recompute none | full."""
    world = cluster.world_size
    if global_batch % world:
        raise MmplanError(f"global batch {global_batch} is not divisible by the {world} data-parallel ranks of ZeRO-3; "
                          f"use a multiple of {world}")
    return _family(profile, cluster, global_batch, "baseline:zero3", tp=1, pp=1, dp=world, zero=3, schedule="1f1b",
                   micro_batch=micro_batch, recompute=recompute)


def gpipe_even_plan(profile: Profile, cluster: Cluster, global_batch: int, *, micro_batch: int | None = None,
                    recompute: Recompute | None = None) -> Plan:
    """GPipe (Huang et al. 2019): the GPipe schedule with pp = min(world, blocks) -- the largest such pp dividing
    the world -- layers split evenly, tp = 1, dp = world / pp. Without `micro_batch` / `recompute`, the fastest
    fitting micro-batch size and recompute none | full (GPipe itself re-materialises: full)."""
    world, pp = cluster.world_size, _gpipe_pp(profile, cluster.world_size)
    return _family(profile, cluster, global_batch, "baseline:gpipe-even", tp=1, pp=pp, dp=world // pp, zero=0,
                   schedule="gpipe", micro_batch=micro_batch, recompute=recompute)


def _gpipe_pp(profile: Profile, world: int) -> int:
    """GPipe's pipeline depth: the largest pp <= min(world, blocks) dividing the world."""
    return max(p for p in range(1, min(world, len(profile.blocks)) + 1) if world % p == 0)


def _per_replica(per_step: int | None, dp: int) -> int | None:
    """Samples per micro-batch on one of `dp` replicas for `per_step` samples per micro-batch over all of them."""
    if per_step is None:
        return None
    if per_step % dp:
        raise MmplanError(f"--micro-batch {per_step} is not divisible by the baseline's {dp} data-parallel replicas; "
                          f"use a multiple of {dp}")
    return per_step // dp


def _family(profile: Profile, cluster: Cluster, global_batch: int, method: str, *, tp: int, pp: int, dp: int, zero: int,
            schedule: Schedule, micro_batch: int | None, recompute: Recompute | None) -> Plan:
    check_batch(global_batch)
    if global_batch % dp:
        raise MmplanError(f"global batch {global_batch} is not divisible by dp={dp}; use a multiple of {dp}")
    sizes = [micro_batch] if micro_batch is not None else \
        [s for s in _powers_of_two(global_batch // dp) if global_batch % (dp * s) == 0]
    specs = [LayoutSpec(tp, pp, dp, mb, schedule, 1, rec, zero)
             for mb in sizes for rec in ((recompute,) if recompute else ("none", "full"))]
    for s in specs:
        check_layout(profile, cluster, global_batch, s)
    return search(profile, cluster, global_batch, specs, method=method)


def baseline_plan(kind: Baseline, profile: Profile, cluster: Cluster, global_batch: int, *,
                  layout: LayoutSpec | str | None = None, per_step_micro_batch: int | None = None) -> Plan:
    """One entry for `mmplan solve --baseline KIND [--layout ...] [--micro-batch N]`: the given homogeneous
    layout, else the best of the kind's search; `per_step_micro_batch` (solve's --micro-batch: samples per
    micro-batch over the data-parallel replicas) fixes the micro-batch of a search."""
    if layout is not None and kind != "homogeneous":
        raise MmplanError(f"--layout applies to --baseline homogeneous only, not {kind!r}")
    if layout is not None and per_step_micro_batch is not None:
        raise MmplanError("--layout fixes the micro-batch itself: write micro-batch=N (samples per data-parallel "
                          "replica) in the layout instead of --micro-batch")
    if kind == "homogeneous":
        return homogeneous_plan(profile, cluster, global_batch, layout) if layout is not None \
            else best_homogeneous(profile, cluster, global_batch)
    if kind == "megatron":
        return best_megatron(profile, cluster, global_batch, per_step_micro_batch=per_step_micro_batch)
    if kind == "zero3":
        return zero3_plan(profile, cluster, global_batch, micro_batch=_per_replica(per_step_micro_batch, cluster.world_size))
    if kind == "gpipe-even":
        dp = cluster.world_size // _gpipe_pp(profile, cluster.world_size)
        return gpipe_even_plan(profile, cluster, global_batch, micro_batch=_per_replica(per_step_micro_batch, dp))
    raise MmplanError(f"unknown baseline {kind!r}; choose one of {', '.join(BASELINES)}")
