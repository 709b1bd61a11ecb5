"""A per-group layout as `--layout` writes it, e.g. `vision:dp=64,micro-batch=1;llm:tp=8,dp=8,micro-batch=1`: each
named group its own degrees, ZeRO stage, recomputation, stage split and micro-batch (samples per replica, so its own
micro-batch count within the shared global batch: Group.micro_batches), and the plan it builds.

Ranks: each group on ranks of its own, in the order written (non-colocated), unless it writes `colocated-with=GROUP`:
then it time-shares that group's ranks (Group.colocated_with; the same GPU count, its own tp, pp and dp over them in
Megatron order), and `fill-bubbles=true` runs its replicas' tasks in the idle slots of each rank class
(Group.fill_bubbles). `lookahead=K` lets a group's stages run K forwards ahead of 1F1B's in-flight limit (an
encoder on its own ranks running ahead of the LLM it feeds, holding K more micro-batches of activations:
Group.lookahead). A profile group the layout does not name joins the named group before it in execution order
(a projector goes with its encoder), or the one after it when none comes before.

Stages: each group's blocks are cut into its pp stages (pp * V chunks under interleaved:V) by `split=` as the
one-layout spec cuts the whole model (megatron_split.split_cuts): flops (the default), layers, or encoders-first (the
blocks of profile groups joining it before its own on the first stage). The plan has one schedule: 1f1b (unless
written), gpipe, or interleaved:V, which the groups writing it run with V model chunks per stage and the others as
1F1B (one chunk per stage; the plan format's one Training.virtual_stages, so one V). The plan's
Training.micro_batches is the loss group's count; of two groups a route connects one count must divide the other
(plans/stage_graph.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.memory import DTYPE_BYTES
from planner.solver.construct import GroupLayout, build_plan, megatron_ranks
from planner.solver.layout_spec import (RECOMPUTES, Recompute, Schedule, Split, check_batch, check_tp, layout_items,
                                        parse_schedule, parse_split)
from planner.solver.megatron_split import recomputed_tiers, split_cuts
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Memory, Plan, SolverInfo, Training

_GROUP_KEYS = ("tp", "pp", "dp", "micro-batch", "schedule", "recompute", "zero", "sequence-parallel", "split",
               "colocated-with", "fill-bubbles", "lookahead")
EXAMPLE = "vision:dp=64,micro-batch=1;llm:tp=8,dp=8,micro-batch=1"
_BOOLS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}


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
    split: Split = "flops"  # how its blocks are cut into stages (layout_spec.Split)
    schedule: Schedule | None = None  # as written; None: not written
    virtual_stages: int = 1  # model chunks per stage; > 1 only with schedule interleaved
    colocated_with: str | None = None  # the group whose ranks it time-shares; None: ranks of its own
    fill_bubbles: bool = False  # colocated: its replicas' tasks in each rank class's idle slots
    lookahead: int = 0  # micro-batches its stages run ahead of 1F1B's in-flight limit (Group.lookahead)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


def is_group_layout(text: str) -> bool:
    """Whether `--layout` text names groups ("name:key=value,...;name:..."), not one layout for the whole model."""
    return isinstance(text, str) and any(":" in seg and "=" not in seg.partition(":")[0] for seg in text.split(";"))


def parse_group_layouts(text: str) -> tuple[tuple[GroupSpec, ...], str]:
    """The groups' specs and the plan's schedule (plan_schedule)."""
    specs = []
    for seg in text.split(";"):
        name, colon, items = (x.strip() for x in seg.partition(":"))
        if not colon or not name or "=" in name:
            raise MmplanError(f"per-group layout item {seg.strip()!r} is not GROUP:key=value,...; write it as {EXAMPLE}")
        specs.append(_spec(name, layout_items(items, _GROUP_KEYS)))
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise MmplanError(f"group {twice[0]!r} is laid out twice in --layout; give each group once")
    _check_colocation(specs)
    schedule = plan_schedule(specs)[0]
    ahead = next((s for s in specs if s.lookahead), None)
    if ahead is not None and schedule == "gpipe":
        raise MmplanError(f"group {ahead.name!r}: lookahead={ahead.lookahead} lets 1F1B stages run forwards ahead of their "
                          "in-flight limit; gpipe runs every forward first anyway: drop lookahead or schedule=gpipe")
    return tuple(specs), schedule


def plan_schedule(specs: tuple[GroupSpec, ...] | list[GroupSpec]) -> tuple[Schedule, int]:
    """The plan's one schedule and model chunks per rank: interleaved:V when a group writes it (the groups not
    writing it run 1F1B inside it), else the one written (1f1b unless none is)."""
    written = {s.schedule for s in specs if s.schedule is not None}
    chunks = sorted({s.virtual_stages for s in specs if s.schedule == "interleaved"})
    if "gpipe" in written and len(written) > 1:
        raise MmplanError(f"the groups of a layout share one schedule, got {', '.join(sorted(written))}; write one "
                          "(interleaved:V groups may sit beside 1f1b ones, gpipe beside none)")
    if len(chunks) > 1:
        raise MmplanError(f"the groups of a layout share one interleaved schedule, got interleaved:{chunks[0]} and "
                          f"interleaved:{chunks[1]}; write one V (the plan has one virtual_stages)")
    if chunks:
        return "interleaved", chunks[0]
    return (written.pop() if written else "1f1b"), 1  # type: ignore[return-value]


def _spec(name: str, values: dict[str, str]) -> GroupSpec:
    def positive(key: str, default: str, zero: bool = False) -> int:
        v = values.get(key, default)
        if not v.isdigit() or (int(v) == 0 and not zero):
            raise MmplanError(f"group {name!r}: {key} must be a {'non-negative' if zero else 'positive'} integer, got {v!r}")
        return int(v)

    def boolean(key: str) -> bool:
        v = values.get(key, "false")
        if v.lower() not in _BOOLS:
            raise MmplanError(f"group {name!r}: {key} must be true or false, got {v!r}")
        return _BOOLS[v.lower()]

    recompute = values.get("recompute", "none").lower()
    if recompute not in RECOMPUTES:
        raise MmplanError(f"group {name!r}: recompute must be one of {', '.join(RECOMPUTES)}, got {values['recompute']!r}")
    zero = positive("zero", "0", zero=True)
    if zero > 3:
        raise MmplanError(f"group {name!r}: zero must be 0, 1, 2 or 3, got {zero}")
    schedule, chunks = parse_schedule(values["schedule"]) if "schedule" in values else (None, 1)
    spec = GroupSpec(name, positive("tp", "1"), positive("pp", "1"), positive("dp", "1"), positive("micro-batch", "1"),
                     recompute, zero, boolean("sequence-parallel"),  # type: ignore[arg-type]
                     parse_split(values.get("split", "flops"), f"group {name!r}: "), schedule, chunks,
                     values.get("colocated-with"), boolean("fill-bubbles"), positive("lookahead", "0", zero=True))
    if spec.schedule == "interleaved" and spec.pp < 2:
        raise MmplanError(f"group {name!r}: the interleaved schedule needs pp >= 2, got pp={spec.pp}; write pp=2 or more, "
                          "or drop schedule=interleaved")
    if spec.fill_bubbles and spec.colocated_with is None:
        raise MmplanError(f"group {name!r}: fill-bubbles runs a group in the idle slots of the ranks it shares; write "
                          "colocated-with=GROUP with it")
    if spec.fill_bubbles and spec.zero:
        raise MmplanError(f"group {name!r}: fill-bubbles needs zero=0, not {spec.zero} (FSDP's collectives inside the "
                          "backward would make the replicas wait for each other)")
    return spec


def _check_colocation(specs: list[GroupSpec]) -> None:
    """colocated-with names another laid-out group, forms no cycle, and the groups sharing ranks have as many GPUs."""
    by_name = {s.name: s for s in specs}
    for s in specs:
        if s.colocated_with is None:
            continue
        if s.colocated_with == s.name or s.colocated_with not in by_name:
            others = ", ".join(n for n in by_name if n != s.name)
            raise MmplanError(f"group {s.name!r} is colocated with {s.colocated_with!r}, which is not another group of "
                              f"the layout; name one of {others}")
        host = _root(s, by_name)
        if host.world_size != s.world_size:
            raise MmplanError(f"group {s.name!r} (tp*pp*dp = {s.tp}*{s.pp}*{s.dp} = {s.world_size} GPUs) is colocated with "
                              f"{host.name!r} ({host.world_size} GPUs); colocated groups use exactly the same ranks: make "
                              f"its tp*pp*dp {host.world_size}")


def _root(spec: GroupSpec, by_name: dict[str, GroupSpec]) -> GroupSpec:
    """The group owning the ranks at the end of spec's colocated-with chain."""
    seen = [spec.name]
    while spec.colocated_with is not None:
        spec = by_name[spec.colocated_with]
        if spec.name in seen:
            raise MmplanError(f"colocated-with forms a cycle ({' -> '.join(seen + [spec.name])}); one of these groups must "
                              "own its ranks: drop its colocated-with")
        seen.append(spec.name)
    return spec


def group_layout_plan(profile: Profile, cluster: Cluster, global_batch: int, text: str, *,
                      solver: SolverInfo | None = None) -> Plan:
    """The plan for exactly the per-group layout `text` (see the module docstring), predictions attached."""
    check_batch(global_batch)
    specs, _ = parse_group_layouts(text)
    schedule, chunks = plan_schedule(specs)
    members = _members(profile, specs)
    by_name = {s.name: s for s in specs}
    owners = [s for s in specs if s.colocated_with is None]
    world = sum(s.world_size for s in owners)
    if world != cluster.world_size:
        used = " + ".join(f"{s.name} {s.tp}*{s.pp}*{s.dp}" for s in owners)
        shared = " (colocated groups share their host's)" if len(owners) < len(specs) else ""
        raise MmplanError(f"layout {text!r} uses tp*pp*dp = {used} = {world} GPUs{shared} but cluster {cluster.name} has "
                          f"{cluster.world_size}; make them add up to {cluster.world_size}")
    firsts = {s.name: sum(o.world_size for o in owners[:i]) for i, s in enumerate(owners)}
    counts = {}
    for s in specs:
        if global_batch % (s.dp * s.micro_batch):
            raise MmplanError(f"group {s.name!r}: global batch {global_batch} is not divisible by dp*micro-batch = "
                              f"{s.dp}*{s.micro_batch}; choose a global batch that is a multiple of it")
        counts[s.name] = global_batch // (s.dp * s.micro_batch)
    loss_group = next(s.name for s in specs if profile.blocks[-1].name in members[s.name])
    layouts, by_block = [], {b.name: b for b in profile.blocks}
    for s in specs:
        layout = _group_layout(profile, s, members[s.name], by_block, chunks if s.schedule == "interleaved" else 1,
                               firsts[_root(s, by_name).name], counts[s.name] if counts[s.name] != counts[loss_group] else None)
        if chunks > 1:
            short = next(((i, b) for i, b in enumerate(layout.stage_blocks()) if len(b) < chunks), None)
            if short is not None:
                raise MmplanError(f"group {s.name!r} stage {short[0]} has {len(short[1])} block(s), fewer than the {chunks} "
                                  f"model chunks per rank of interleaved:{chunks} (the plan asks every stage for as many "
                                  f"blocks); give group {s.name!r} fewer stages")
        layouts.append(layout)
    _check_fill_bubbles(layouts)
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    training = Training(global_batch, counts[loss_group], schedule=schedule, virtual_stages=chunks, dtype=dtype)  # type: ignore[arg-type]
    solver = solver or SolverInfo(method="hand-written", notes=f"layout {text}")
    return build_plan(profile, cluster, training, layouts, solver)


def _check_fill_bubbles(layouts: list[GroupLayout]) -> None:
    """A fill-bubbles group's replica runs on the ranks of one rank class (plans/schedule.py): its tp ranks must host
    the same stages of every group."""
    hosted: dict[int, list[tuple[str, int]]] = {}
    for lay in layouts:
        per = lay.dp * lay.tp
        for r_i, r in enumerate(lay.ranks):
            hosted.setdefault(r, []).append((lay.name, r_i // per))
    for lay in (x for x in layouts if x.fill_bubbles):
        for start in range(0, len(lay.ranks), lay.tp):
            shards = lay.ranks[start:start + lay.tp]
            if len({tuple(hosted[r]) for r in shards}) > 1:
                raise MmplanError(f"group {lay.name!r}: fill-bubbles runs each replica on ranks hosting the same stages, "
                                  f"but its tp ranks {', '.join(map(str, shards))} host different ones; drop fill-bubbles=true "
                                  "or give it a tp whose ranks stay inside one stage of the group it shares them with")


def _group_layout(profile: Profile, s: GroupSpec, blocks: tuple[str, ...], by_block: dict, chunks: int, first: int,
                  micro_batches: int | None) -> GroupLayout:
    """Group s's layout: its blocks cut by its split into pp * chunks chunks, its ranks from `first` in Megatron order."""
    parts = s.pp * chunks
    own = next(i for i, b in enumerate(blocks) if by_block[b].group == s.name)  # encoders-first: its own blocks count
    counted = len(blocks) - (own if s.split == "encoders-first" else 0)
    if parts > counted:
        what = f"pp x V = {s.pp} x {chunks} = {parts} pipeline chunks" if chunks > 1 else f"pp={s.pp} stages"
        raise MmplanError(f"group {s.name!r} has {counted} block(s) to cut"
                          + (" (split=encoders-first counts its own)" if s.split == "encoders-first" else "")
                          + f", fewer than its {what}; give it at most {counted}")
    check_tp([by_block[b] for b in blocks], s.tp, f"group {s.name!r}: ")
    cuts = split_cuts([by_block[b] for b in blocks], parts, s.split, own)
    layout = GroupLayout(s.name, blocks, cuts, s.dp, s.tp, megatron_ranks(s.dp, s.tp, s.pp, first), zero=s.zero,
                         colocated_with=s.colocated_with, sequence_parallel=s.sequence_parallel, chunks=chunks,
                         fill_bubbles=s.fill_bubbles, micro_batches=micro_batches, lookahead=s.lookahead)
    memory = tuple(Memory(activations=recomputed_tiers(profile, stage, s.recompute)) for stage in layout.stage_blocks())
    return replace(layout, memory=memory)


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
