"""`mmplan export`: a plan in the native configuration of the framework people train with (one module per target)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, get_args

from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan

Target = Literal["megatron", "megatron-mimo", "megatron-bridge", "torchtitan", "deepspeed"]
TARGETS: tuple[str, ...] = get_args(Target)
# What each target's file is, for the default output name and the help text.
SUFFIX = {"megatron": ".args", "megatron-mimo": ".args", "megatron-bridge": ".py", "torchtitan": ".py", "deepspeed": ".json"}


@dataclass(frozen=True)
class Export:
    """An exported configuration: its text, and what it dropped (empty unless --lossy was needed)."""

    target: str
    text: str
    dropped: tuple[str, ...]


def export_plan(plan: Plan, target: Target, *, lossy: bool = False, source: str = "plan.json",
                profile: Profile | None = None) -> Export:
    """The plan as `target`'s configuration. A feature the target cannot express raises Unsupported (an
    MmplanError naming it) unless `lossy`, when the nearest plan is exported and the export lists what it dropped.
    With the plan's `profile`, the model's shape it records is written too (else placeholders the target refuses)."""
    from planner.export import deepspeed, megatron, megatron_bridge, megatron_mimo, torchtitan
    from planner.export.common import Drops

    modules = {"megatron": megatron, "megatron-mimo": megatron_mimo, "megatron-bridge": megatron_bridge,
               "torchtitan": torchtitan, "deepspeed": deepspeed}
    if target not in modules:
        raise MmplanError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    drops = Drops(target, lossy)
    for g in plan.groups:  # per-group step shapes (Group.micro_batches): the exporters write one micro-batch count
        if g.micro_batches is not None and g.micro_batches != plan.training.micro_batches:
            drops.cannot(f"group {g.name}'s own micro-batch count ({g.micro_batches}, the plan's {plan.training.micro_batches})",
                         f"{g.name} at {plan.training.micro_batches} micro-batches")
    text = modules[target].export(plan, drops, source, profile)
    drops.check()
    return Export(target, text, tuple(drops.dropped))


def run_export(*, plan_path: str | os.PathLike, target: Target, output: str | os.PathLike | None, lossy: bool = False,
               profile_path: str | os.PathLike | None = None) -> Export:
    """Load and check the plan (against its profile when given), export it, write it atomically to `output` (None:
    return the text only)."""
    from plans.graph import load_profile
    from plans.plan import load_plan
    from plans.serial import write_atomic

    profile = load_profile(profile_path) if profile_path is not None else None
    plan = load_plan(plan_path)
    result = export_plan(plan, target, lossy=lossy, source=os.path.basename(str(plan_path)), profile=profile)
    if output is not None:
        write_atomic(output, result.text)
    return result
