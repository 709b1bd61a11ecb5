"""A per-group layout as `--layout` writes it, e.g. `vision:dp=64,micro-batch=1;llm:tp=8,dp=8,micro-batch=1`: each named
group its own degrees, ZeRO stage, recomputation and micro-batch (samples per replica, so its own micro-batch count
within the shared global batch: Group.micro_batches), on ranks of its own (non-colocated, in the order written), and
the plan it builds.

A profile group the layout does not name joins the named group before it in execution order (a projector goes with
its encoder), or the one after it when none comes before. Each group's blocks are cut into its pp stages by balanced
FLOPs (megatron_split.flops_cuts). The plan's Training.micro_batches is the loss group's count; of two groups a route
connects one count must divide the other (plans/stage_graph.py)."""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.memory import DTYPE_BYTES
from planner.solver.construct import GroupLayout, build_plan, megatron_ranks
from planner.solver.layout_spec import RECOMPUTES, Recompute, check_batch, check_tp, layout_items, parse_schedule
from planner.solver.megatron_split import flops_cuts, recomputed_tiers
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Memory, Plan, SolverInfo, Training

_GROUP_KEYS = ("tp", "pp", "dp", "micro-batch", "schedule", "recompute", "zero", "sequence-parallel")
EXAMPLE = "vision:dp=64,micro-batch=1;llm:tp=8,dp=8,micro-batch=1"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group's layout in a per-group `--layout`."""

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1  # samples per micro-batch on one data-parallel replica
    recompute: Recompute = "none"
    zero: int = 0
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


def is_group_layout(text: str) -> bool:
    """Whether `--layout` text names groups ("name:key=value,...;name:..."), not one layout for the whole model."""
    return isinstance(text, str) and any(":" in seg and "=" not in seg.partition(":")[0] for seg in text.split(";"))


def parse_group_layouts(text: str) -> tuple[tuple[GroupSpec, ...], str]:
    """The groups' specs and the plan's schedule (1f1b unless written; every group writing one writes the same)."""
    specs, schedules = [], set()
    for seg in text.split(";"):
        name, colon, items = (x.strip() for x in seg.partition(":"))
        if not colon or not name or "=" in name:
            raise MmplanError(f"per-group layout item {seg.strip()!r} is not GROUP:key=value,...; write it as {EXAMPLE}")
        values = layout_items(items)
        unknown = [k for k in values if k not in _GROUP_KEYS]
        if unknown:
            raise MmplanError(f"layout key {unknown[0]!r} of group {name!r} cannot be given per group; known keys: "
                              f"{', '.join(_GROUP_KEYS)}")
        if "schedule" in values:
            schedule, v = parse_schedule(values["schedule"])
            if v > 1:
                raise MmplanError(f"group {name!r}: a per-group layout runs 1f1b or gpipe, not interleaved:{v}")
            schedules.add(schedule)
        specs.append(_spec(name, values))
    if len(schedules) > 1:
        raise MmplanError(f"the groups of a layout share one schedule, got {', '.join(sorted(schedules))}; write one")
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise MmplanError(f"group {twice[0]!r} is laid out twice in --layout; give each group once")
    return tuple(specs), (schedules.pop() if schedules else "1f1b")


def _spec(name: str, values: dict[str, str]) -> GroupSpec:
    def positive(key: str, default: str, zero: bool = False) -> int:
        v = values.get(key, default)
        if not v.isdigit() or (int(v) == 0 and not zero):
            raise MmplanError(f"group {name!r}: {key} must be a {'non-negative' if zero else 'positive'} integer, got {v!r}")
        return int(v)

    recompute = values.get("recompute", "none").lower()
    if recompute not in RECOMPUTES:
        raise MmplanError(f"group {name!r}: recompute must be one of {', '.join(RECOMPUTES)}, got {values['recompute']!r}")
    zero = positive("zero", "0", zero=True)
    if zero > 3:
        raise MmplanError(f"group {name!r}: zero must be 0, 1, 2 or 3, got {zero}")
    sp = values.get("sequence-parallel", "false").lower()
    if sp not in ("true", "false", "on", "off", "1", "0"):
        raise MmplanError(f"group {name!r}: sequence-parallel must be true or false, got {values['sequence-parallel']!r}")
    return GroupSpec(name, positive("tp", "1"), positive("pp", "1"), positive("dp", "1"), positive("micro-batch", "1"),
                     recompute, zero, sp in ("true", "on", "1"))  # type: ignore[arg-type]


def group_layout_plan(profile: Profile, cluster: Cluster, global_batch: int, text: str, *,
                      solver: SolverInfo | None = None) -> Plan:
    """The plan for exactly the per-group layout `text` (see the module docstring), predictions attached."""
    check_batch(global_batch)
    specs, schedule = parse_group_layouts(text)
    members = _members(profile, specs)
    world = sum(s.world_size for s in specs)
    if world != cluster.world_size:
        used = " + ".join(f"{s.name} {s.tp}*{s.pp}*{s.dp}" for s in specs)
        raise MmplanError(f"layout {text!r} uses tp*pp*dp = {used} = {world} GPUs but cluster {cluster.name} has "
                          f"{cluster.world_size}; make them add up to {cluster.world_size}")
    counts = {}
    for s in specs:
        if global_batch % (s.dp * s.micro_batch):
            raise MmplanError(f"group {s.name!r}: global batch {global_batch} is not divisible by dp*micro-batch = "
                              f"{s.dp}*{s.micro_batch}; choose a global batch that is a multiple of it")
        counts[s.name] = global_batch // (s.dp * s.micro_batch)
    loss_group = next(s.name for s in specs if profile.blocks[-1].name in members[s.name])
    layouts, first, by_name = [], 0, {b.name: b for b in profile.blocks}
    for s in specs:
        blocks = members[s.name]
        if s.pp > len(blocks):
            raise MmplanError(f"group {s.name!r} has {len(blocks)} blocks, fewer than its pp={s.pp} stages")
        check_tp([by_name[b] for b in blocks], s.tp, f"group {s.name!r}: ")
        cuts = flops_cuts([by_name[b].fwd_flops + by_name[b].bwd_flops for b in blocks], s.pp)
        bounds = [0, *cuts, len(blocks)]
        memory = tuple(Memory(activations=recomputed_tiers(profile, blocks[a:z], s.recompute)) for a, z in zip(bounds, bounds[1:]))
        own = counts[s.name] if counts[s.name] != counts[loss_group] else None
        layouts.append(GroupLayout(s.name, blocks, cuts, s.dp, s.tp, megatron_ranks(s.dp, s.tp, s.pp, first), zero=s.zero,
                                   memory=memory, sequence_parallel=s.sequence_parallel, micro_batches=own))
        first += s.world_size
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    training = Training(global_batch, counts[loss_group], schedule=schedule, dtype=dtype)  # type: ignore[arg-type]
    solver = solver or SolverInfo(method="hand-written", notes=f"layout {text}")
    return build_plan(profile, cluster, training, layouts, solver)


def _members(profile: Profile, specs: tuple[GroupSpec, ...]) -> dict[str, tuple[str, ...]]:
    """Each named group's blocks in execution order: its profile group's, and those of unnamed profile groups joining it."""
    order = list(dict.fromkeys(b.group for b in profile.blocks))
    named = {s.name for s in specs}
    unknown = sorted(named - set(order))
    if unknown:
        raise MmplanError(f"--layout names group {unknown[0]!r}, which {profile.model!r} does not have; its groups: "
                          f"{', '.join(order)}")
    owner, last = {}, None
    for g in order:
        if g in named:
            last = g
        owner[g] = last
    after = next(g for g in order if g in named)
    owner = {g: o or after for g, o in owner.items()}
    out: dict[str, list[str]] = {s.name: [] for s in specs}
    for b in profile.blocks:
        out[owner[b.group]].append(b.name)
    return {k: tuple(v) for k, v in out.items()}
