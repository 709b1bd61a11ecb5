"""Builds plans for runtime tests from a compact description (groups -> stages -> ranks)."""
from __future__ import annotations

from dataclasses import replace

from plans.plan import Group, Memory, Plan, ProfileRef, Stage, Training, check_plan
from runtime.source import resolve
from planner.profiler.profile import profile_model

_PROFILES: dict = {}


def profile(model: str, freeze: tuple[str, ...] = ()):
    if (model, freeze) not in _PROFILES:
        _PROFILES[model, freeze] = profile_model(resolve(model), micro_batch=1, freeze=freeze)
    return _PROFILES[model, freeze]


def local_cluster(world: int):
    from cost_models.cluster_spec import parse_cluster

    return parse_cluster(f"{world}xlocal-cpu", gpus_per_node=world)


def make_plan(model: str, groups: list[dict], *, global_batch: int = 8, micro_batches: int = 2,
              schedule: str = "1f1b", freeze: tuple[str, ...] = (), virtual_stages: int = 1, dtype: str = "fp32") -> Plan:
    """groups: [{"name", "dp", "tp", "zero", "stages": [(block prefixes or names, ranks[, Memory])], "colocated_with",
    "lookahead", "fill_bubbles", "micro_batches"}] —
    a block belongs to the first stage whose patterns match it (prefix match); a Memory's activation tier
    given for the key "*" applies to every block of the stage; `freeze`: profile --freeze patterns."""
    prof = profile(model, tuple(freeze))
    assigned: dict[str, tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        for si, (patterns, *_) in enumerate(g["stages"]):
            for b in prof.blocks:
                if b.name not in assigned and any(b.name == p or b.name.startswith(p + ".") for p in patterns):
                    assigned[b.name] = (gi, si)
    built = []
    for gi, g in enumerate(groups):
        stages = []
        for si, (_, ranks, *memory) in enumerate(g["stages"]):
            blocks = tuple(b.name for b in prof.blocks if assigned.get(b.name) == (gi, si))
            mem = memory[0] if memory else Memory()
            if "*" in mem.activations:
                mem = replace(mem, activations={b: mem.activations["*"] for b in blocks})
            stages.append(Stage(blocks=blocks, ranks=tuple(ranks), memory=mem))
        stages = tuple(stages)
        built.append(Group(name=g["name"], dp=g.get("dp", 1), tp=g.get("tp", 1), pp=len(stages), stages=stages,
                           zero=g.get("zero", 0), colocated_with=g.get("colocated_with"),
                           reshard_after_forward=g.get("reshard_after_forward", True), lookahead=g.get("lookahead", 0),
                           fill_bubbles=g.get("fill_bubbles", False), micro_batches=g.get("micro_batches")))
    world = len({r for g in built for r in g.ranks})
    plan = Plan(profile=ProfileRef(prof.model, prof.fingerprint), cluster=local_cluster(world),
                training=Training(global_batch=global_batch, micro_batches=micro_batches, schedule=schedule, dtype=dtype,
                                                virtual_stages=virtual_stages),
                groups=tuple(built))
    return check_plan(plan, prof)
