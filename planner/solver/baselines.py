"""The plans we must beat: Megatron-style homogeneous layouts (one given, or the best of a grid), ZeRO-3 and even GPipe."""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from cost_models.comm import dp_link, zero_collectives
from cost_models.offload import exposed, overlaps_compute
from cost_models.compute import block_time, measured_on, tp_shard
from cost_models.memory import DTYPE_BYTES, block_input_bytes, in_flight, kept_activation_bytes, stage_memory, warmup_forwards
from cost_models.tail import tail_over
from planner.solver.bounds import stage_body
from planner.solver.candidates import sp_divides
from planner.solver.construct import GroupLayout, build_plan, megatron_ranks, with_predictions
from plans.cluster import Cluster
from plans.errors import ImpossiblePrediction, MmplanError
from plans.graph import Block, Profile
from plans.plan import Group, Memory, Plan, ProfileRef, SolverInfo, Stage, Training, check_plan

# Vocabulary: a "layer" is a transformer layer, i.e. a block that supports tensor parallelism (the profiler
# marks exactly those); "spans" are what a pipeline split counts: each layer with the non-layer
# blocks (embeddings, norms, projector, head) that follow it, the blocks before the first layer joining it.
# When a model has fewer layers than the split needs parts, every block is its own span. (A solver "unit",
# planner/solver/structure.py, is something else: the blocks that get one layout.)

Schedule = Literal["1f1b", "gpipe", "interleaved"]
Recompute = Literal["none", "selective", "layers", "full"]
Baseline = Literal["homogeneous", "megatron", "zero3", "gpipe-even"]
Split = Literal["layers", "megatron"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
RECOMPUTES: tuple[str, ...] = get_args(Recompute)
BASELINES: tuple[str, ...] = get_args(Baseline)
GROUP = "model"  # the one group of a homogeneous plan: every block in one pipeline

_KEYS = ("tp", "pp", "dp", "micro-batch", "schedule", "recompute", "zero", "sequence-parallel")
_ALIASES = {"micro_batch": "micro-batch", "mb": "micro-batch", "sp": "sequence-parallel", "sequence_parallel": "sequence-parallel"}
_EXAMPLE = ("tp=8,pp=2,dp=32[,micro-batch=1][,schedule=1f1b|gpipe|interleaved:2][,recompute=none|selective|layers|full]"
            "[,zero=1][,sequence-parallel=true]")


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """One layout for every module: degrees, per-replica micro-batch size, schedule, recomputation, ZeRO stage."""

    tp: int
    pp: int
    dp: int
    micro_batch: int = 1  # samples per micro-batch on one data-parallel replica
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1  # model chunks per rank; > 1 only with the interleaved schedule
    recompute: Recompute = "none"
    zero: int = 0
    split: Split = "layers"  # layers: every transformer layer counts; megatron: encoders on stage 0, LLM layers even
    sequence_parallel: bool = False  # tp > 1: norm / residual regions sharded along the sequence

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "micro_batch", "virtual_stages"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MmplanError(f"layout: {key.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise MmplanError(f"layout: schedule must be one of 1f1b, gpipe, interleaved:V, got {self.schedule!r}")
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise MmplanError(f"layout: the interleaved schedule needs virtual_stages >= 2 and the others 1, got "
                              f"{self.schedule} with virtual_stages={self.virtual_stages}")
        if self.recompute not in RECOMPUTES:
            raise MmplanError(f"layout: recompute must be one of {', '.join(RECOMPUTES)}, got {self.recompute!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise MmplanError(f"layout: zero must be 0, 1, 2 or 3, got {self.zero!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        """Canonical text that parse_layout reads back to an equal spec."""
        schedule = f"interleaved:{self.virtual_stages}" if self.schedule == "interleaved" else self.schedule
        return (f"tp={self.tp},pp={self.pp},dp={self.dp},micro-batch={self.micro_batch},schedule={schedule},"
                f"recompute={self.recompute},zero={self.zero}" + (",sequence-parallel=true" if self.sequence_parallel else ""))


def parse_layout(text: str) -> LayoutSpec:
    """`tp=8,pp=2,dp=32[,micro-batch=1][,schedule=1f1b|gpipe|interleaved:2][,recompute=none|selective|layers|full][,zero=1][,sequence-parallel=true]`.

    Bare `interleaved` means 2 model chunks per rank. Every problem is one MmplanError naming the item."""
    if not isinstance(text, str) or not text.strip():
        raise MmplanError(f"empty layout; write it as {_EXAMPLE}")
    values: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        key = _ALIASES.get(key, key)
        if not item or not eq or not key or not value:
            raise MmplanError(f"layout item {item!r} is not key=value; write the layout as {_EXAMPLE}")
        if key not in _KEYS:
            raise MmplanError(f"unknown layout key {key!r} in {item!r}; known keys: {', '.join(_KEYS)}")
        if key in values:
            raise MmplanError(f"layout key {key!r} is given twice ({key}={values[key]} and {item})")
        values[key] = value
    missing = [k for k in ("tp", "pp", "dp") if k not in values]
    if missing:
        raise MmplanError(f"layout {text.strip()!r} lacks {', '.join(missing)}; tp, pp and dp are required ({_EXAMPLE})")
    schedule, chunks = _parse_schedule(values.get("schedule", "1f1b"))
    recompute = values.get("recompute", "none").lower()
    if recompute not in RECOMPUTES:
        raise MmplanError(f"recompute must be one of {', '.join(RECOMPUTES)}, got {values['recompute']!r}")
    zero = _positive_int(values.get("zero", "0"), "zero", allow_zero=True)
    if zero > 3:
        raise MmplanError(f"zero must be 0, 1, 2 or 3, got {values['zero']!r}")
    sp = values.get("sequence-parallel", "false").lower()
    if sp not in ("true", "false", "on", "off", "1", "0"):
        raise MmplanError(f"sequence-parallel must be true or false, got {values['sequence-parallel']!r}")
    return LayoutSpec(tp=_positive_int(values["tp"], "tp"), pp=_positive_int(values["pp"], "pp"),
                      dp=_positive_int(values["dp"], "dp"), micro_batch=_positive_int(values.get("micro-batch", "1"), "micro-batch"),
                      schedule=schedule, virtual_stages=chunks, recompute=recompute, zero=zero,  # type: ignore[arg-type]
                      sequence_parallel=sp in ("true", "on", "1"))


def _positive_int(value: str, key: str, *, allow_zero: bool = False) -> int:
    if not value.isdigit() or (int(value) == 0 and not allow_zero):
        kind = "a non-negative integer" if allow_zero else "a positive integer"
        raise MmplanError(f"{key} must be {kind}, got {value!r}")
    return int(value)


def _parse_schedule(value: str) -> tuple[Schedule, int]:
    name, colon, v = value.lower().partition(":")
    if name == "interleaved":
        if not colon:
            return "interleaved", 2
        if not v.isdigit() or int(v) < 2:
            raise MmplanError(f"schedule interleaved:V needs V >= 2 model chunks per rank, got {value!r}")
        return "interleaved", int(v)
    if name in ("1f1b", "gpipe") and not colon:
        return name, 1  # type: ignore[return-value]
    raise MmplanError(f"schedule must be 1f1b, gpipe or interleaved:V, got {value!r}")


# --- the Megatron-style split ------------------------------------------------------------------------------


def layer_count(profile: Profile) -> int:
    """Transformer layers of the model (blocks that support tensor parallelism)."""
    return sum(1 for b in profile.blocks if b.supports_tp)


def llm_start(profile: Profile) -> int:
    """Index of the first block of the LLM: the group holding the model's last block (the sink)."""
    sink = profile.blocks[-1].group
    return next(i for i, b in enumerate(profile.blocks) if b.group == sink)


def llm_layer_count(profile: Profile) -> int:
    """Transformer layers of the LLM (what a Megatron-style MIMO split counts)."""
    return sum(1 for b in profile.blocks[llm_start(profile):] if b.supports_tp)


def split_blocks(profile: Profile, parts: int, split: Split = "layers") -> list[tuple[str, ...]]:
    """The model's blocks in `parts` contiguous chunks of (nearly) equal layer count, Megatron-style.

    Each non-layer block goes with the layer before it (the blocks before the first layer with the first
    layer), so embeddings land in the first chunk and the final norm and head in the last. When the layer
    count does not divide evenly, the last chunks get one layer more (the first pipeline stage holds the
    most micro-batches in flight under 1F1B). Fewer layers than parts: every block counts as a layer.
    split "megatron" (Megatron's MIMO recipe): only the LLM's layers count, so the encoders and projectors all
    land on the first chunk with the LLM's embedding and first layers.
    """
    blocks = profile.blocks
    first = llm_start(profile) if split == "megatron" else 0
    if parts < 1 or parts > len(blocks) - first:
        raise MmplanError(f"cannot split the {len(blocks) - first} blocks of {profile.model!r} into {parts} pipeline chunks; "
                          f"use at most {len(blocks) - first} (pp x virtual stages)")
    starts = [i for i in range(first, len(blocks)) if blocks[i].supports_tp]
    if len(starts) < parts:
        starts = list(range(first, len(blocks)))
    starts[0] = 0  # the blocks before the first layer join it
    spans = [blocks[a:b] for a, b in zip(starts, [*starts[1:], len(blocks)])]
    q, r = divmod(len(spans), parts)
    sizes = [q] * (parts - r) + [q + 1] * r
    out, i = [], 0
    for n in sizes:
        out.append(tuple(b.name for u in spans[i:i + n] for b in u))
        i += n
    return out


def _stage_blocks(profile: Profile, spec: LayoutSpec) -> list[tuple[str, ...]]:
    """Blocks of each pipeline stage; with v chunks per rank stage i holds chunks i, i+pp, ... (Megatron)."""
    chunks = split_blocks(profile, spec.pp * spec.virtual_stages, spec.split)
    return [tuple(b for k in range(i, len(chunks), spec.pp) for b in chunks[k]) for i in range(spec.pp)]


def _recomputed(profile: Profile, blocks: Iterable[str], recompute: Recompute) -> dict[str, str]:
    """Activation tiers for `recompute`: full = every block recomputed; layers = the transformer layers recomputed
    whole (DeepSpeed-style activation checkpointing); selective = Megatron's selective recomputation, the attention
    core of every block that has one (Korthikanti et al. 2022, section 5; the runtime's "selective" tier)."""
    if recompute == "none":
        return {}
    by_name = {b.name: b for b in profile.blocks}
    if recompute == "selective":
        return {b: "selective" for b in blocks if by_name[b].attention_core_bytes > 0}
    return {b: "recompute" for b in blocks if recompute == "full" or by_name[b].supports_tp}


def _training(profile: Profile, spec: LayoutSpec, global_batch: int) -> Training:
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    return Training(global_batch=global_batch, micro_batches=global_batch // (spec.dp * spec.micro_batch),
                    schedule=spec.schedule, virtual_stages=spec.virtual_stages, dtype=dtype)


def check_layout(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec) -> None:
    """Raise MmplanError when `spec` cannot be laid out on `cluster` for `profile` at `global_batch`."""
    _check_batch(global_batch)
    if spec.world_size != cluster.world_size:
        raise MmplanError(f"layout {spec} uses tp*pp*dp = {spec.tp}*{spec.pp}*{spec.dp} = {spec.world_size} GPUs but "
                          f"cluster {cluster.name} has {cluster.world_size}; make tp*pp*dp equal {cluster.world_size}")
    if cluster.gpus_per_node % spec.tp:
        raise MmplanError(f"tp={spec.tp} does not divide the {cluster.gpus_per_node} GPUs per node of cluster "
                          f"{cluster.name}; a tensor-parallel group must fill whole slots of one node")
    if global_batch % (spec.dp * spec.micro_batch):
        raise MmplanError(f"global batch {global_batch} is not divisible by dp*micro-batch = {spec.dp}*{spec.micro_batch} "
                          f"= {spec.dp * spec.micro_batch}; choose a global batch that is a multiple of it")
    if spec.schedule == "interleaved" and spec.pp < 2:
        raise MmplanError(f"the interleaved schedule needs pp >= 2, got pp={spec.pp}")
    if spec.sequence_parallel and spec.tp > 1 and not sp_divides(profile.blocks, spec.tp):
        b = next(b for b in profile.blocks if b.supports_tp and b.sequence and b.sequence % spec.tp)
        raise MmplanError(f"sequence parallelism shards each layer's sequence over tp={spec.tp}, but block {b.name} reads "
                          f"a sequence of {b.sequence}; drop sequence-parallel=true or use a tp that divides it")
    parts = spec.pp * spec.virtual_stages
    if parts > len(profile.blocks):
        raise MmplanError(f"pp*virtual stages = {parts} exceeds the {len(profile.blocks)} blocks of {profile.model!r}; "
                          f"every pipeline chunk needs a block")


def _check_batch(global_batch: int) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise MmplanError(f"global batch must be a positive integer, got {global_batch!r}")


def homogeneous_plan(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec | str, *,
                     solver: SolverInfo | None = None, predict: bool = True) -> Plan:
    """The Megatron-style plan for exactly `spec`: one group ("model") holding every block in one pipeline,
    encoders in the first stage(s), layers split evenly over pp stages, one tp and dp for all, predictions attached."""
    spec = parse_layout(spec) if isinstance(spec, str) else spec
    check_layout(profile, cluster, global_batch, spec)
    solver = solver or SolverInfo(method="baseline:homogeneous", notes=f"layout {spec}")
    return _build(profile, cluster, global_batch, spec, solver, predict=predict)


def _build(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec, solver: SolverInfo,
           *, predict: bool = True, schema: bool = True) -> Plan:
    training = _training(profile, spec, global_batch)
    stages = _stage_blocks(profile, spec)
    memory = tuple(Memory(activations=_recomputed(profile, blocks, spec.recompute)) for blocks in stages)
    ranks = megatron_ranks(spec.dp, spec.tp, spec.pp)
    if spec.virtual_stages == 1:
        names = tuple(b for s in stages for b in s)
        cuts = tuple(sum(len(s) for s in stages[:i]) for i in range(1, spec.pp))
        layout = GroupLayout(GROUP, names, cuts, spec.dp, spec.tp, ranks, zero=spec.zero, memory=memory,
                             sequence_parallel=spec.sequence_parallel)
        return build_plan(profile, cluster, training, [layout], solver, predict=predict, schema=schema)
    # GroupLayout describes contiguous stages only; an interleaved stage holds v chunks, so build the Group here
    # and finish as build_plan does (check with the profile, then attach predictions).
    per = spec.dp * spec.tp
    group = Group(GROUP, spec.dp, spec.tp, spec.pp, zero=spec.zero, sequence_parallel=spec.sequence_parallel and spec.tp > 1, stages=tuple(
        Stage(blocks, ranks[i * per:(i + 1) * per], memory[i]) for i, blocks in enumerate(stages)))
    plan = check_plan(Plan(ProfileRef(profile.model, profile.fingerprint), cluster, training, (group,), solver=solver), profile,
                      schema=schema)
    return with_predictions(plan, profile)[0] if predict else plan


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
    _check_batch(global_batch)
    world = cluster.world_size
    spans = (llm_layer_count(profile) or len(profile.blocks) - llm_start(profile)) if split == "megatron" else \
        (layer_count(profile) or len(profile.blocks))
    parsed = [_parse_schedule(s) for s in schedules]
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
    return [_build(profile, cluster, global_batch, s, SolverInfo("baseline:homogeneous", notes=f"layout {s}")) for s in specs]


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
    costs = _Costs(profile, cluster)
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
    _check_batch(global_batch)
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


# --- search: memory first, then branch and bound on a step-time lower bound -----------------------------------


@dataclass(frozen=True, slots=True)
class Screened:
    """A layout before simulation: its peak GPU bytes on the fullest rank and a lower bound of its step time."""

    spec: LayoutSpec
    gpu_bytes: float
    overflow: float  # gpu_bytes - device memory (> 0: does not fit)
    lower_bound_s: float


def search(profile: Profile, cluster: Cluster, global_batch: int, specs: Sequence[LayoutSpec], *, method: str,
           deadline: float = math.inf, costs: _Costs | None = None) -> Plan:
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
    costs = costs or _Costs(profile, cluster)
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
            plan = _build(profile, cluster, global_batch, spec, SolverInfo(method), schema=False)  # checked when saved
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
        plan, spec = _build(profile, cluster, global_batch, least, SolverInfo(method)), least
        simulated += 1
        note = (f"layout {spec}; no layout fits: of {len(specs)} layouts this one needs the least memory, "
                f"{peak(least) / 1e9:.1f} GB on its fullest GPU of {cluster.device.memory_bytes / 1e9:.1f} GB")
    return replace(plan, solver=SolverInfo(method, objective=plan.predicted.step_time_s, time_s=time.perf_counter() - started,
                                           candidates=len(specs), notes=note))


def _cheaper(recompute: Recompute) -> tuple[Recompute, ...]:
    """Recompute options that only add less compute than `recompute` (none < selective <= layers <= full: each reruns a
    subset of the next one's forward), so a layout is skipped when one of these fits."""
    return {"none": (), "selective": ("none",), "layers": ("none", "selective"), "full": ("none", "selective", "layers")}[recompute]


def screen(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec, *, costs: _Costs | None = None) -> Screened:
    """Memory and a step-time lower bound of a homogeneous layout, without building or simulating the plan."""
    costs = costs or _Costs(profile, cluster)
    peak = _peak_gpu_bytes(profile, global_batch, spec, costs)
    return Screened(spec, peak, peak - cluster.device.memory_bytes, _step_bound(profile, cluster, global_batch, spec, costs))


def _peak_gpu_bytes(profile: Profile, global_batch: int, spec: LayoutSpec, costs: _Costs) -> float:
    """GPU bytes of the layout's fullest rank, as cost_models/memory.stage_memory counts them."""
    m = global_batch // (spec.dp * spec.micro_batch)
    training = _training(profile, spec, global_batch)
    gpu = []
    for i, names in enumerate(costs.stage_blocks(profile, spec)):
        stage = [costs.blocks[n] for n in names]
        acts = _recomputed(profile, names, spec.recompute)
        warmup = warmup_forwards(spec.schedule, m, spec.pp - i - 1, spec.virtual_stages, spec.pp)
        mem = stage_memory(stage, samples=float(spec.micro_batch), tp=spec.tp, dp=spec.dp, zero=spec.zero,
                           memory=Memory(activations=acts),
                           in_flight_micro_batches=in_flight(spec.schedule, m, warmup, spec.virtual_stages),
                           input_bytes=costs.inputs, dtype=training.dtype, optimizer=training.optimizer,
                           sequence_parallel=spec.sequence_parallel and spec.tp > 1)
        gpu.append(mem.gpu)
    return max(gpu)


def _step_bound(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec, costs: _Costs) -> float:
    """A lower bound of the layout's simulated step time.

    Each term is a part of what cost_models/pipeline.py simulates, so the bound never exceeds the simulated
    step (tests check it on whole grids): stage i runs m forwards of f_i and m backwards of b_i seconds
    (block_time compute plus blocking TP all-reduces; exposed transfers and p2p sends left out) on one compute
    lane, after micro-batch 0 went through the forwards of the stages before it; its last backward is
    micro-batch m-1's, whose gradient then goes back through the stages before it; every stage ends with its
    gradient sync, optimizer step and ZeRO all-gather in sequence (the simulator's stage tail). With v > 1
    chunks per rank only the per-stage sum is used.
    """
    m = global_batch // (spec.dp * spec.micro_batch)
    training = _training(profile, spec, global_batch)
    dtype = training.dtype
    sp = spec.sequence_parallel and spec.tp > 1
    # per stage: forward and backward op sums and trained parameters (shared by every dp and ZeRO stage), then tails
    ops_key = ("ops", spec.tp, spec.pp, spec.micro_batch, spec.virtual_stages, spec.recompute, spec.split, sp)
    if ops_key not in costs.memo:
        samples = float(spec.micro_batch)
        ops, trained, params = [], [], []
        for names in costs.stage_blocks(profile, spec):
            stage = [costs.blocks[n] for n in names]
            acts = _recomputed(profile, names, spec.recompute)
            t = [0.0] * 4  # forward compute, forward with its TP comm, backward compute, backward with its TP comm
            for blk in stage:
                for j, x in enumerate(costs.block_time(blk, samples, spec.tp, dtype, acts.get(blk.name, False), sp)):
                    t[j] += x
            ops.append(t)
            trained.append(sum(blk.params / tp_shard(blk, spec.tp) for blk in stage if not blk.frozen))  # frozen: no sync / update
            params.append(sum(blk.params / tp_shard(blk, spec.tp) for blk in stage))
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
            # the gradient buckets hide behind at most the stage's last backward compute (the simulator's overlap_s)
            tail.append(tail_over(tr, dp=spec.dp, zero=spec.zero, memory=Memory(), link=link, cluster=cluster,
                                  dtype=dtype, optimizer=training.optimizer, overlap_s=bc).total)
        costs.memo[key] = fwd, bwd, tail
    fwd, bwd, tail = costs.memo[key]
    bound = max(m * (f + b) + t for f, b, t in zip(fwd, bwd, tail))
    if spec.virtual_stages > 1 and costs.linear(profile, spec) and not any(b.frozen for b in profile.blocks):
        # interleaved: planner/solver/bounds.py's interleaved terms over the pp * v chunks (sends and ZeRO exposure left out of
        # the chunks' ops; the stage sums keep theirs)
        p, v = spec.pp, spec.virtual_stages
        cf, cb = costs.chunk_ops(profile, spec, dtype, sp, _recomputed)
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


class _Costs:
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
                acts = recomputed(profile, names, spec.recompute)
                ops = [self.block_time(self.blocks[n], float(spec.micro_batch), spec.tp, dtype, acts.get(n, False), sp) for n in names]
                cf.append(sum(o[1] for o in ops))
                cb.append(sum(o[3] for o in ops))
            self.memo[key] = (cf, cb)
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
            self._stages[key] = _stage_blocks(profile, spec)
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
