"""Builds plans for runtime tests from a compact description (groups -> stages -> ranks)."""
from __future__ import annotations

from plans.plan import Group, Plan, ProfileRef, Stage, Training, check_plan
from runtime.source import resolve
from planner.profile import profile_model

_PROFILES: dict = {}


def profile(model: str):
    if model not in _PROFILES:
        _PROFILES[model] = profile_model(resolve(model), micro_batch=1)
    return _PROFILES[model]


def local_cluster(world: int):
    from cost_models.hardware import parse_cluster

    return parse_cluster(f"{world}xlocal-cpu", gpus_per_node=world)


def make_plan(model: str, groups: list[dict], *, global_batch: int = 8, micro_batches: int = 2,
              schedule: str = "1f1b") -> Plan:
    """groups: [{"name", "dp", "stages": [(block prefixes or names, ranks)], "colocated_with"}] — a block
    belongs to the first stage whose patterns match it (prefix match)."""
    prof = profile(model)
    assigned: dict[str, tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        for si, (patterns, _) in enumerate(g["stages"]):
            for b in prof.blocks:
                if b.name not in assigned and any(b.name == p or b.name.startswith(p + ".") for p in patterns):
                    assigned[b.name] = (gi, si)
    built = []
    for gi, g in enumerate(groups):
        stages = tuple(
            Stage(blocks=tuple(b.name for b in prof.blocks if assigned.get(b.name) == (gi, si)), ranks=tuple(ranks))
            for si, (_, ranks) in enumerate(g["stages"]))
        built.append(Group(name=g["name"], dp=g.get("dp", 1), tp=g.get("tp", 1), pp=len(stages), stages=stages,
                           colocated_with=g.get("colocated_with")))
    world = len({r for g in built for r in g.ranks})
    plan = Plan(profile=ProfileRef(prof.model, prof.fingerprint), cluster=local_cluster(world),
                training=Training(global_batch=global_batch, micro_batches=micro_batches, schedule=schedule, dtype="fp32"),
                groups=tuple(built))
    return check_plan(plan, prof)
