"""The plans we must beat: Megatron-style homogeneous layouts (one given, or the best of a grid), ZeRO-3 and even GPipe."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal, get_args

from cost_models.memory import DTYPE_BYTES
from planner.solver.baseline_search import ScreenCosts, search
from planner.solver.candidates import sp_divides
from planner.solver.layout_spec import (LayoutSpec, Recompute, Schedule, Split, check_batch, check_layout, layout_items,
                                        parse_layout, parse_schedule)
from planner.solver.megatron_split import build_spec_plan, layer_count, llm_layer_count, llm_start, split_blocks
from planner.solver.space import divisors
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
    """The plan for exactly `spec`: one group ("model") holding every block in one pipeline, cut into stages as its
    split says (text without split=: flops, the homogeneous baseline's), one tp and dp for all, predictions attached."""
    spec = parse_layout(spec, default_split="flops") if isinstance(spec, str) else spec
    check_layout(profile, cluster, global_batch, spec)
    solver = solver or SolverInfo(method="baseline:homogeneous", notes=f"layout {spec}")
    return build_spec_plan(profile, cluster, global_batch, spec, solver, predict=predict)


# --- the grid of homogeneous layouts ---------------------------------------------------------------------


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def micro_batch_sizes(global_batch: int, dp: int) -> list[int]:
    """Every per-replica micro-batch size s with dp * s dividing the global batch (Megatron accepts any), at most
    MAX_MICRO_BATCHES micro-batches per step."""
    from plans.limits import MAX_MICRO_BATCHES  # the solver's own limit on micro-batches per step

    if global_batch % dp:
        return []
    return [s for s in divisors(global_batch // dp) if global_batch // (dp * s) <= MAX_MICRO_BATCHES]


def _pipeline_depths(profile: Profile, world: int, tp: int, split: Split) -> tuple[list[int], int]:
    """(pp values, the count the chunks split): layers / encoders-first -- pp dividing the (LLM's) layer count, as
    Megatron's uniform split needs; flops -- any pp up to the block count; each with tp * pp dividing the world."""
    if split == "encoders-first":
        spans = llm_layer_count(profile) or len(profile.blocks) - llm_start(profile)
    elif split == "layers":
        spans = layer_count(profile) or len(profile.blocks)
    else:
        spans = len(profile.blocks)
    ok = [p for p in range(1, spans + 1) if world % (tp * p) == 0 and (split == "flops" or spans % p == 0)]
    return ok, spans


def grid_layouts(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: Sequence[str] = ("1f1b",),
                 micro_batches: Sequence[int] | None = None, zeros: Sequence[int] = (0, 1),
                 recomputes: Sequence[Recompute] = ("none", "full"), split: Split = "flops",
                 sequence_parallels: Sequence[bool] = (False,)) -> list[LayoutSpec]:
    """Every valid homogeneous layout: tp a power of two dividing gpus_per_node (1 only when no block supports
    tp), pp as _pipeline_depths allows for `split`, dp = world/(tp*pp), micro-batch sizes `micro_batches` (default:
    every divisor, micro_batch_sizes) with dp*micro-batch dividing the global batch, each ZeRO stage of `zeros`
    (0 and 1 are the same plan at dp = 1) and recompute option; schedules are `1f1b`, `gpipe` or `interleaved:V`
    (used where pp >= 2 and, for the layer splits, pp*V divides the layer count); sequence parallelism each of
    `sequence_parallels` where tp > 1 (a sequence tp does not divide is padded: candidates.sp_divides)."""
    check_batch(global_batch)
    world = cluster.world_size
    parsed = [parse_schedule(s) for s in schedules]
    tps = [t for t in _powers_of_two(cluster.gpus_per_node) if cluster.gpus_per_node % t == 0
           and all(b.takes_tp(t) for b in profile.blocks)]
    if not any(b.supports_tp for b in profile.blocks):
        tps = [1]
    specs: list[LayoutSpec] = []
    linear: dict[int, bool] = {}
    for tp in tps:
        depths, spans = _pipeline_depths(profile, world, tp, split)
        for pp in depths:
            dp = world // (tp * pp)
            if dp > 1 and any(b.reduces_batch for b in profile.blocks):
                continue  # one layout for every block: a contrastive head needs whole micro-batches (dp = 1)
            sizes = micro_batches if micro_batches is not None else micro_batch_sizes(global_batch, dp)
            for mb in (s for s in sizes if global_batch % (dp * s) == 0):
                for schedule, v in parsed:
                    if v > 1 and (pp < 2 or (spans % (pp * v) if split != "flops" else pp * v > spans)):
                        continue
                    if split == "flops" and not _linear(profile, pp * v, linear):
                        continue  # a stage reading past its neighbour (a tiny embedding alone on a stage): not a pipeline
                    specs += _variants(profile, LayoutSpec(tp, pp, dp, mb, schedule, v, split=split), zeros, recomputes,
                                       sequence_parallels)
    return specs


def _linear(profile: Profile, parts: int, memo: dict[int, bool]) -> bool:
    """Whether the FLOPs split into `parts` chunks is a pipeline: every block reads only its own chunk or the one before."""
    if parts not in memo:
        part = {b: i for i, names in enumerate(split_blocks(profile, parts, "flops")) for b in names}
        memo[parts] = all(part[e.dst] - part[e.src] in (0, 1) for e in profile.edges)
    return memo[parts]


def _variants(profile: Profile, spec: LayoutSpec, zeros: Sequence[int], recomputes: Sequence[Recompute],
              sequence_parallels: Sequence[bool]) -> list[LayoutSpec]:
    """`spec` with each ZeRO stage (0 alone at dp = 1), recompute option and sequence-parallelism setting (off where
    tp = 1 or tp does not divide a layer's sequence)."""
    return [replace(spec, zero=zero, recompute=rec, sequence_parallel=sp)
            for zero in dict.fromkeys(min(z, 0) if spec.dp == 1 else z for z in zeros)
            for rec in recomputes
            for sp in dict.fromkeys(sp and spec.tp > 1 and sp_divides(profile.blocks, spec.tp) for sp in sequence_parallels)]


def homogeneous_grid(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: Sequence[str] = ("1f1b",),
                     micro_batches: Sequence[int] | None = None, zeros: Sequence[int] = (0, 1),
                     recomputes: Sequence[Recompute] = ("none", "full"), split: Split = "flops",
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
                     recomputes: Sequence[Recompute] = ("none", "full"), split: Split = "flops") -> Plan:
    """The fastest homogeneous plan that fits (as homogeneous_grid would find it, without evaluating every layout);
    when none fits, the one with the least memory overflow, flagged in its predictions and solver notes."""
    specs = grid_layouts(profile, cluster, global_batch, schedules=schedules, micro_batches=micro_batches,
                         zeros=zeros, recomputes=recomputes, split=split)
    if not specs:
        raise _no_layout(profile, cluster, global_batch)
    return search(profile, cluster, global_batch, specs, method="baseline:homogeneous")


MEGATRON_SCHEDULES = ("1f1b", "gpipe", "interleaved:2", "interleaved:4")
ALL_ZEROS = (0, 1, 2, 3)
MEGATRON_ZEROS = (0, 1)  # Megatron-LM's data parallelism: plain, or its distributed optimizer (ZeRO-1)
MEGATRON_RECOMPUTES: tuple[Recompute, ...] = ("none", "selective", "full")


def best_megatron(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: Sequence[str] = MEGATRON_SCHEDULES,
                  micro_batches: Sequence[int] | None = None, zeros: Sequence[int] = MEGATRON_ZEROS,
                  recomputes: Sequence[Recompute] = MEGATRON_RECOMPUTES, per_step_micro_batch: int | None = None,
                  deadline: float = math.inf, sequence_parallels: Sequence[bool] = (False, True),
                  layout: str | None = None) -> Plan:
    """The fastest Megatron-style plan (Megatron-LM's MIMO recipe): encoders and projectors on the first pipeline
    stage, the LLM's layers split evenly by count, one tp / dp / ZeRO stage (0, or 1: Megatron's distributed optimizer) /
    recompute (none, selective: the attention core, full) / sequence parallelism / micro-batch (every divisor) /
    schedule for all -- searched over every such layout the runtime runs. per_step_micro_batch: only layouts whose
    micro-batch over all replicas (dp x micro-batch) is this (solve --micro-batch). layout (solve --baseline megatron
    --layout): the items it writes are fixed (tp, pp, dp at least; split defaults to encoders-first), the rest searched."""
    if layout is not None:
        specs = _layout_grid(profile, cluster, global_batch, layout, schedules, zeros, recomputes, sequence_parallels)
    else:
        specs = grid_layouts(profile, cluster, global_batch, schedules=schedules, micro_batches=micro_batches, zeros=zeros,
                             recomputes=recomputes, split="encoders-first", sequence_parallels=sequence_parallels)
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


def _layout_grid(profile: Profile, cluster: Cluster, global_batch: int, layout: str, schedules: Sequence[str],
                 zeros: Sequence[int], recomputes: Sequence[Recompute], sequence_parallels: Sequence[bool]) -> list[LayoutSpec]:
    """The Megatron grid around `--layout`: what it writes fixed, every other item searched (checked like the layout)."""
    given = set(layout_items(layout))
    spec = parse_layout(layout, default_split="encoders-first")
    check_layout(profile, cluster, global_batch, spec)
    sizes = [spec.micro_batch] if "micro-batch" in given else micro_batch_sizes(global_batch, spec.dp)
    parsed = [(spec.schedule, spec.virtual_stages)] if "schedule" in given else [parse_schedule(s) for s in schedules]
    out = []
    for mb in sizes:
        for schedule, v in parsed:
            base = replace(spec, micro_batch=mb, schedule=schedule, virtual_stages=v)
            for s in _variants(profile, base, [spec.zero] if "zero" in given else zeros,
                               [spec.recompute] if "recompute" in given else recomputes,
                               [spec.sequence_parallel] if "sequence-parallel" in given else sequence_parallels):
                try:
                    check_layout(profile, cluster, global_batch, s)
                except MmplanError:
                    continue  # e.g. an interleaved split with more chunks than blocks
                out.append(s)
    return out


def _no_layout(profile: Profile, cluster: Cluster, global_batch: int) -> MmplanError:
    return MmplanError(f"no homogeneous layout of {profile.model!r} on {cluster.world_size} GPUs divides global batch "
                       f"{global_batch} (dp*micro-batch must divide it); use a global batch with more small factors")


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
                  layout: str | None = None, per_step_micro_batch: int | None = None) -> Plan:
    """One entry for `mmplan solve --baseline KIND [--layout ...] [--micro-batch N]`: the best of the kind's search;
    `per_step_micro_batch` (solve's --micro-batch: samples per micro-batch over the data-parallel replicas) fixes the
    micro-batch of a search. `layout`: with homogeneous, exactly that layout (split=flops unless written); with
    megatron, the best Megatron-style plan with what it writes fixed (split=encoders-first unless written)."""
    if layout is not None and kind not in ("homogeneous", "megatron"):
        raise MmplanError(f"--layout applies to --baseline homogeneous or megatron, not {kind!r}")
    if layout is not None and per_step_micro_batch is not None:
        raise MmplanError("--layout fixes the micro-batch itself: write micro-batch=N (samples per data-parallel "
                          "replica) in the layout instead of --micro-batch")
    if kind == "homogeneous":
        return homogeneous_plan(profile, cluster, global_batch, layout) if layout is not None \
            else best_homogeneous(profile, cluster, global_batch)
    if kind == "megatron":
        return best_megatron(profile, cluster, global_batch, per_step_micro_batch=per_step_micro_batch, layout=layout)
    if kind == "zero3":
        return zero3_plan(profile, cluster, global_batch, micro_batch=_per_replica(per_step_micro_batch, cluster.world_size))
    if kind == "gpipe-even":
        dp = cluster.world_size // _gpipe_pp(profile, cluster.world_size)
        return gpipe_even_plan(profile, cluster, global_batch, micro_batch=_per_replica(per_step_micro_batch, dp))
    raise MmplanError(f"unknown baseline {kind!r}; choose one of {', '.join(BASELINES)}")
