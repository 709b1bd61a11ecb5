"""plan.json: how to train a profiled model on a cluster — per-group layouts, stages, tiers, data flow, predictions.

The dataclasses are in plans/plan_types.py (imported by plans/stage_graph.py too) and re-exported here; this module
reads, writes and checks them."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from plans.errors import FormatError
from plans.graph import Profile
from plans.limits import MAX_BLOCKS
from plans.plan_types import (PLAN_SCHEMA, READABLE_SCHEMAS, ActivationTier, DType, Flow, FlowBlock, Group, Memory, Plan, Predicted,
                              ProfileRef, RankMemory, Schedule, SolverInfo, Stage, Tier, Training)
from plans.serial import dumps, from_data, read_json, to_data, validate, write_atomic
from plans.stage_graph import stage_graph

__all__ = ["PLAN_SCHEMA", "ActivationTier", "DType", "Flow", "FlowBlock", "Group", "Memory", "Plan", "Predicted",
           "ProfileRef", "RankMemory", "Schedule", "SolverInfo", "Stage", "Tier", "Training", "check_plan", "flow_of",
           "load_plan", "plan_from_data", "save_plan"]

# --- reading, writing and checking plan.json ---------------------------------------------------


def plan_from_data(data: Any, what: str = "plan", *, profile: Profile | None = None) -> Plan:
    """Parsed JSON -> checked Plan; with a profile, a missing flow is taken from it. A mmplan.plan/2 plan is read as
    the /3 plan it is (no group gives its own micro-batch count)."""
    _check_version(data.get("schema") if isinstance(data, dict) else None, what)
    data = _upgraded(data)
    _precheck(data, what)
    validate(data, "plan", what, distinct=DISTINCT)
    return _check(from_data(Plan, data), profile, what)


DISTINCT = {("flow", "blocks"): ("name",)}  # flow blocks equal but for their names are validated once


def _precheck(data: Any, what: str) -> None:
    """The block count of the plan's flow, before the schema (plans/graph.precheck's bound)."""
    flow = data.get("flow") if isinstance(data, dict) else None
    blocks = flow.get("blocks") if isinstance(flow, dict) else None
    if isinstance(blocks, list) and len(blocks) > MAX_BLOCKS:
        raise FormatError(f"{what} has {len(blocks):,} blocks, more than the {MAX_BLOCKS:,} mmplan plans for; "
                          "is it the right file?")


def load_plan(path: str | os.PathLike, *, profile: Profile | None = None) -> Plan:
    """Read and check a plan file (see plan_from_data)."""
    return plan_from_data(read_json(path, "plan"), f"plan {path}", profile=profile)


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Check the plan (without a profile), then write its canonical JSON atomically."""
    write_atomic(path, dumps(check_plan(plan)))


def check_plan(plan: Plan, profile: Profile | None = None, what: str = "plan", *, schema: bool = True) -> Plan:
    """Schema and consistency checks of a Plan built in code; returns it, with the profile's flow filled in
    when a profile is given and the plan has none. Raises FormatError naming the first problem.
    schema=False skips the JSON Schema (the solver's candidates: typed in code, validated when saved)."""
    _check_version(plan.schema, what)
    if plan.schema != PLAN_SCHEMA:
        plan = replace(plan, schema=PLAN_SCHEMA)
    if schema:
        validate(to_data(plan), "plan", what, distinct=DISTINCT)
    return _check(plan, profile, what)


def _check(plan: Plan, profile: Profile | None, what: str) -> Plan:
    _check_training(plan.training, what)
    for g in plan.groups:
        _check_group(g, plan, what)
    _check_colocation(plan.groups, what)
    if profile is None:
        _check_no_block_twice(plan.groups, what)
        _check_flow(plan, what)
        return plan
    _check_profile(plan, profile, what)
    return _with_flow(plan, profile, what)


def _upgraded(data: dict) -> dict:
    """A readable older plan's data as the current schema's (only the version differs: /3 added optional fields)."""
    return data if data.get("schema") == PLAN_SCHEMA else {**data, "schema": PLAN_SCHEMA}


def _check_version(version: Any, what: str) -> None:
    if version not in READABLE_SCHEMAS:
        got = "no 'schema' field" if version is None else f"schema {version!r}"
        raise FormatError(f"{what}: {got}, expected schema {PLAN_SCHEMA!r}; is this a plan.json of this mmplan version?")


def _check_training(t: Training, what: str) -> None:
    if t.global_batch % t.micro_batches:
        raise FormatError(
            f"{what}: global_batch {t.global_batch} is not divisible by micro_batches {t.micro_batches}; "
            "make the global batch a multiple of the number of micro-batches"
        )
    if t.virtual_stages > 1 and t.schedule != "interleaved":
        raise FormatError(
            f"{what}: virtual_stages {t.virtual_stages} needs the 'interleaved' schedule, not {t.schedule!r}; "
            "set virtual_stages to 1 or change the schedule"
        )
    if t.schedule == "interleaved" and t.virtual_stages < 2:
        raise FormatError(f"{what}: the 'interleaved' schedule needs virtual_stages >= 2 (model chunks per rank), got "
                          f"{t.virtual_stages}; set it, or use the '1f1b' schedule")


def _check_group(g: Group, plan: Plan, what: str) -> None:
    if [x.name for x in plan.groups].count(g.name) > 1:
        raise FormatError(f"{what}: group name {g.name!r} is used twice; give every group its own name")
    if len(g.stages) != g.pp:
        raise FormatError(f"{what}: group {g.name!r} has pp={g.pp} but {len(g.stages)} stages; list exactly pp stages")
    for i, s in enumerate(g.stages):
        _check_stage(g, i, s, plan, what)
    _check_unique_ranks(g, what)
    if not g.reshard_after_forward and g.zero != 3:
        raise FormatError(f"{what}: group {g.name!r}: reshard_after_forward=false needs zero=3 (ZeRO 1-2 never reshard "
                          f"after a forward), got zero={g.zero}; drop the field or set zero to 3")
    if g.lookahead < 0:
        raise FormatError(f"{what}: group {g.name!r}: lookahead {g.lookahead} is negative; give 0 or more micro-batches")
    if g.fill_bubbles and g.zero:
        raise FormatError(f"{what}: group {g.name!r}: fill_bubbles needs ZeRO 0, not {g.zero} (FSDP's collectives inside "
                          "the backward would make the replicas wait for each other); set zero to 0, or fill_bubbles to false")
    if g.micro_batches is not None and (g.micro_batches < 1 or plan.training.global_batch % g.micro_batches):
        raise FormatError(f"{what}: group {g.name!r}: micro_batches {g.micro_batches} does not divide global_batch "
                          f"{plan.training.global_batch}; give the group a count that divides it, or drop the field")
    if plan.micro_batch_of(g) % g.dp:
        own = "its" if g.micro_batches is not None else "global_batch /"
        raise FormatError(
            f"{what}: group {g.name!r}: a micro-batch of {plan.micro_batch_of(g)} samples is not divisible by dp={g.dp}; "
            f"choose {own} micro_batches so that every micro-batch is a multiple of the group's dp"
        )


def _check_stage(g: Group, i: int, s: Stage, plan: Plan, what: str) -> None:
    name = f"group {g.name!r} stage {i}"
    if len(s.ranks) != g.dp * g.tp:
        raise FormatError(f"{what}: {name} has {len(s.ranks)} ranks but dp*tp = {g.dp}*{g.tp} = {g.dp * g.tp}; list dp*tp ranks per stage, tp fastest")
    for r in s.ranks:
        if not 0 <= r < plan.cluster.world_size:
            world = plan.cluster.world_size
            raise FormatError(f"{what}: {name}: rank {r} is out of range for cluster {plan.cluster.name!r} of {world} ranks (0..{world - 1})")
    for rep in range(g.dp):
        shards = s.ranks[rep * g.tp : (rep + 1) * g.tp]
        nodes = sorted({plan.cluster.node_of(r) for r in shards})
        if len(nodes) > 1:
            raise FormatError(
                f"{what}: {name}: the tp ranks {list(shards)} of replica {rep} span nodes {nodes}; "
                "a tensor-parallel group must stay inside one node (ranks are listed tp fastest)"
            )
    if len(s.blocks) < plan.training.virtual_stages:
        v = plan.training.virtual_stages
        raise FormatError(f"{what}: {name} has {len(s.blocks)} blocks, fewer than virtual_stages={v}; each model chunk needs a block")
    unknown = [b for b in s.memory.activations if b not in s.blocks]
    if unknown:
        raise FormatError(f"{what}: {name}: activation tier given for block {unknown[0]!r}, which is not a block of this stage")


def _check_unique_ranks(g: Group, what: str) -> None:
    seen: set[int] = set()
    for r in g.ranks:
        if r in seen:
            raise FormatError(f"{what}: group {g.name!r} uses rank {r} twice; every rank of a group runs one stage shard")
        seen.add(r)


def _check_colocation(groups: tuple[Group, ...], what: str) -> None:
    by_name = {g.name: g for g in groups}
    for g in groups:
        if g.colocated_with is None:
            continue
        host = by_name.get(g.colocated_with)
        if host is None or host is g:
            raise FormatError(
                f"{what}: group {g.name!r} is colocated with {g.colocated_with!r}, "
                f"which is not another group of the plan (groups: {', '.join(by_name)})"
            )
        if set(g.ranks) != set(host.ranks):
            raise FormatError(
                f"{what}: group {g.name!r} is colocated with {host.name!r} but their rank sets differ "
                f"({sorted(g.ranks)} vs {sorted(host.ranks)}); colocated groups use exactly the same ranks"
            )
    roots = [g for g in groups if _root(g, by_name, what) is g]
    for i, a in enumerate(roots):
        for b in roots[i + 1 :]:
            shared = set(a.ranks) & set(b.ranks)
            if shared:
                raise FormatError(
                    f"{what}: groups {a.name!r} and {b.name!r} share rank {min(shared)} but are not colocated; "
                    "give them disjoint ranks or set colocated_with"
                )


def _root(g: Group, by_name: dict[str, Group], what: str) -> Group:
    """The group at the end of g's colocated_with chain."""
    seen = [g.name]
    while g.colocated_with is not None:
        g = by_name[g.colocated_with]
        if g.name in seen:
            raise FormatError(f"{what}: colocated_with forms a cycle ({' -> '.join(seen + [g.name])}); one group of them must own its ranks")
        seen.append(g.name)
    return g


def _check_no_block_twice(groups: tuple[Group, ...], what: str) -> dict[str, str]:
    """Block -> name of the group placing it; a block in two stages is an error."""
    owner: dict[str, str] = {}
    for g in groups:
        for b in g.blocks:
            if b in owner:
                raise FormatError(f"{what}: block {b!r} is placed twice (groups {owner[b]!r} and {g.name!r}); put each block in exactly one stage")
            owner[b] = g.name
    return owner


def _check_profile(plan: Plan, profile: Profile, what: str) -> None:
    """The plan belongs to this profile; block placement and order are checked against the flow (_check_flow)."""
    if plan.profile.fingerprint != profile.fingerprint:
        raise FormatError(
            f"{what}: plan is for another model or model version (fingerprint {plan.profile.fingerprint} of {plan.profile.model!r}, "
            f"profile has {profile.fingerprint} of {profile.model!r}); re-solve the plan for this profile"
        )
    reducing = {b.name for b in profile.blocks if b.reduces_batch}
    for g in plan.groups:
        if reducing & set(g.blocks) and plan.micro_batches_of(g) != plan.training.micro_batches:
            block = sorted(reducing & set(g.blocks))[0]
            raise FormatError(f"{what}: block {block!r} reduces over the batch and must see the plan's micro-batches, but "
                              f"group {g.name!r} gives its own micro_batches {g.micro_batches}; drop the group's count")
        if g.dp > 1 and reducing & set(g.blocks):
            block = sorted(reducing & set(g.blocks))[0]
            raise FormatError(f"{what}: block {block!r} reduces over the batch (e.g. a contrastive loss) and must see whole "
                              f"micro-batches, but group {g.name!r} has dp={g.dp}; give it dp=1")


def flow_of(profile: Profile) -> Flow:
    """The plan's copy of a profile's data flow."""
    return Flow(
        blocks=tuple(FlowBlock(b.name, b.output_bytes, b.frozen) for b in profile.blocks),
        edges=tuple((e.src, e.dst) for e in profile.edges),
        loss=profile.loss,
    )


def _with_flow(plan: Plan, profile: Profile, what: str) -> Plan:
    flow = flow_of(profile)
    if plan.flow is None:
        plan = replace(plan, flow=flow)
    elif plan.flow != flow:
        raise FormatError(f"{what}: its data flow differs from the profile's ({_first_difference(plan.flow, flow)}); "
                          "drop the plan's 'flow' to take the profile's, or re-solve")
    _check_flow(plan, what)
    return plan


def _first_difference(got: Flow, want: Flow) -> str:
    if got.blocks != want.blocks:
        return "blocks or their output bytes differ"
    if got.edges != want.edges:
        extra = sorted(set(got.edges) ^ set(want.edges))
        return f"edge {extra[0][0]} -> {extra[0][1]}" if extra else "edges are ordered differently"
    return f"the loss reads {list(got.loss)} in the plan, {list(want.loss)} in the profile"


def _check_flow(plan: Plan, what: str) -> None:
    """The flow names exactly the plan's blocks; edges and loss name known blocks; stages follow its order;
    the stage graph it gives is acyclic."""
    flow = plan.flow
    if flow is None:
        return
    order: dict[str, int] = {}
    for i, b in enumerate(flow.blocks):
        if b.name in order:
            raise FormatError(f"{what}: flow lists block {b.name!r} twice")
        order[b.name] = i
    owner = _check_no_block_twice(plan.groups, what)
    for b in owner:
        if b not in order:
            raise FormatError(f"{what}: block {b!r} of group {owner[b]!r} is not in the profile of {plan.profile.model!r} "
                              "(the plan's flow); check the block name")
    missing = [b.name for b in flow.blocks if b.name not in owner]
    if missing:
        raise FormatError(f"{what}: block {missing[0]!r} of the model is in no stage of the plan ({len(missing)} missing); place every block in one stage")
    for src, dst in flow.edges:
        for end in (src, dst):
            if end not in order:
                raise FormatError(f"{what}: flow edge {src} -> {dst} names unknown block {end!r}")
        if order[src] >= order[dst]:
            raise FormatError(f"{what}: flow edge {src} -> {dst} goes against the execution order; the data flow must be acyclic")
    if not flow.loss:
        raise FormatError(f"{what}: the flow names no block the loss reads")
    for b in flow.loss:
        if b not in order:
            raise FormatError(f"{what}: the loss reads unknown block {b!r}")
    for g in plan.groups:
        for i, s in enumerate(g.stages):
            idx = [order[b] for b in s.blocks]
            if idx != sorted(idx):
                raise FormatError(f"{what}: group {g.name!r} stage {i} lists its blocks out of the execution order; sort them as in the profile")
    stage_graph(plan)  # raises FormatError on a cycle between stages
