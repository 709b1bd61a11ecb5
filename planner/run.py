"""`mmplan run`: check a plan against its model, launch the ranks (or join torchrun), report predicted vs measured."""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan, check_plan, load_plan

MAX_LOCAL_RANKS = 64  # beyond this a plan is for a real cluster: start it with torchrun


@dataclass(frozen=True)
class RunResult:
    plan: Plan
    profile: Profile | None  # the one given to run (None: predictions come from the plan)
    metrics: list[dict[str, Any]]  # one row per step (rank 0's view of all ranks); empty on other torchrun ranks
    rank: int


def checked_plan(plan_path: Path, model: str | None, profile: Profile | None = None) -> tuple[Plan, Profile | None, str]:
    """The plan (its flow taken from `profile` when given), the profile, and the model spec; refuse a model
    whose structural fingerprint differs from the plan's. Cheap: the model is built on the meta device and
    traced with torch.fx — no profiling analysis."""
    from runtime.program import model_fingerprint, traced_flow, trace_program
    from runtime.source import call_factory, resolve

    plan = load_plan(plan_path)
    if profile is not None:
        plan = check_plan(plan, profile, f"plan {plan_path}")
    spec = model or plan.profile.model
    with torch.device("meta"):
        module, batch = call_factory(resolve(spec), 1)
    program = trace_program(module, batch)
    found = model_fingerprint(module, program)
    if found != plan.profile.fingerprint:
        raise MmplanError(
            f"plan {plan_path} was solved for model {plan.profile.model!r} with fingerprint {plan.profile.fingerprint}, "
            f"but {spec!r} builds a model with fingerprint {found} (another module tree or data flow): re-profile and re-solve")
    if plan.flow is None:  # a hand-written plan: the flow of the model it was just checked against
        plan = check_plan(replace(plan, flow=traced_flow(program)), None, f"plan {plan_path}")
    return plan, profile, spec


def _backend(plan: Plan) -> str:
    if plan.cluster.backend == "nccl" and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def run_plan(plan_path: Path, *, steps: int, model: str | None = None, seed: int = 0, lr: float = 1e-3,
             data: str | None = None, log: Path | None = None, timeout_s: float = 600.0,
             op_timeout_s: float = 60.0, device_budget: float | None = None, nvme_dir: Path | None = None,
             prefetch: bool = True, checkpoint_every: int = 0, checkpoint_dir: Path | None = None,
             resume: Path | None = None, profile: Profile | None = None, trace: Path | None = None) -> RunResult:
    """Train up to step `steps` with the plan (from the checkpoint's step when resuming); rank 0's metrics."""
    from runtime.launch import launch
    from runtime.train import Job, train_rank

    if steps < 1:
        raise MmplanError(f"--steps must be >= 1, got {steps}")
    if checkpoint_every < 0:
        raise MmplanError(f"--checkpoint-every must be >= 0, got {checkpoint_every}")
    if checkpoint_every and checkpoint_dir is None:
        raise MmplanError("--checkpoint-every needs --checkpoint-dir")
    if device_budget is not None and not device_budget > 0:
        raise MmplanError(f"--device-budget must be a number of bytes > 0, got {device_budget:g}")
    launched = _launched_world_size()
    plan, profile, spec = checked_plan(plan_path, model, profile)
    world = plan.world_size
    if launched is not None:
        if launched != world:
            raise MmplanError(f"the plan needs {world} ranks but this job was launched with {launched}")
    elif world > MAX_LOCAL_RANKS:
        raise MmplanError(f"the plan needs {world} ranks; start it with torchrun on a cluster of that size "
                          f"(at most {MAX_LOCAL_RANKS} local processes)")
    sharded = [g.name for g in plan.groups if g.zero]
    if sharded:
        raise MmplanError(f"group {sharded[0]} uses ZeRO stage {plan.group(sharded[0]).zero}: the cost model plans ZeRO, "
                          "but the runtime trains with zero=0 only; re-solve (the solver emits zero=0) or edit the plan")
    if plan.training.schedule not in ("gpipe", "1f1b"):
        raise MmplanError(f"the runtime executes the gpipe and 1f1b schedules; this plan uses {plan.training.schedule}")
    if resume is not None and not resume.is_dir():
        raise MmplanError(f"--resume {resume}: no such checkpoint directory")
    if checkpoint_dir is not None and checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise MmplanError(f"--checkpoint-dir {checkpoint_dir} is a file, not a directory")
    # every refusal above leaves nothing behind; from here on directories are created, and removed again when
    # the run is refused after all (no space for the nvme tier, a dataset or budget the ranks refuse) while empty
    created: list[Path] = []
    try:
        nvme_dir = _nvme_dir(plan, nvme_dir, created)
        if checkpoint_dir is not None:
            _make_dir(checkpoint_dir, "--checkpoint-dir", created)
        job = Job(plan=plan, model=spec, steps=steps, seed=seed, lr=lr, data=None if data in (None, "builtin") else data,
                  log=str(log) if log else None, device_budget=device_budget, nvme_dir=str(nvme_dir) if nvme_dir else None,
                  prefetch=prefetch, checkpoint_every=checkpoint_every,
                  checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, resume=str(resume) if resume else None,
                  trace=trace is not None)
        results = launch(train_rank, world, job, backend=_backend(plan), timeout_s=timeout_s, op_timeout_s=op_timeout_s)
    except BaseException:
        for top in created:
            _remove_empty_dirs(top)
        raise
    rank = int(os.environ.get("RANK", 0))
    if trace is not None and rank == 0 and results[0].get("trace"):
        write_trace(trace, results[0]["trace"], results[0]["metrics"])
    return RunResult(plan, profile, results[0]["metrics"], rank)


def write_trace(path: Path, timelines: dict[int, list], metrics: list[dict[str, Any]]) -> None:
    """The last step's measured timeline of every rank, in the format and with the event names of
    `mmplan compare --trace` (plans/trace.py)."""
    import json

    from plans.serial import write_atomic
    from plans.trace import chrome_trace

    other = {"step": metrics[-1]["step"], "step_time_s": metrics[-1]["step_time_s"]} if metrics else {}
    write_atomic(path, json.dumps(chrome_trace(timelines, other={"measured": True, **other})))


def _nvme_dir(plan: Plan, nvme_dir: Path | None, created: list[Path]) -> Path | None:
    """The directory for the nvme tier: required when the plan uses it, and it must have the space."""
    from runtime.memory import check_nvme_space

    uses = any(s.memory.params == "nvme" or s.memory.grads == "nvme" or s.memory.optimizer == "nvme"
               or "offload-nvme" in s.memory.activations.values() for g in plan.groups for s in g.stages)
    if not uses:
        return nvme_dir
    if nvme_dir is None:
        raise MmplanError("the plan places state in the nvme tier: give a directory for it with --nvme-dir")
    _make_dir(nvme_dir, "--nvme-dir", created)
    needed = sum(m.nvme for m in plan.predicted.memory) if plan.predicted else 0.0
    check_nvme_space(nvme_dir, needed)
    return nvme_dir


def _launched_world_size() -> int | None:
    """WORLD_SIZE of a torchrun launch, None when not launched by one."""
    value = os.environ.get("WORLD_SIZE")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise MmplanError(f"the environment variable WORLD_SIZE={value!r} is not a number of ranks") from None


def _make_dir(path: Path, option: str, created: list[Path]) -> None:
    """Create the directory an option names; the topmost directory this made is appended to `created`."""
    if path.exists():
        if not path.is_dir():
            raise MmplanError(f"{option} {path} is a file, not a directory")
        return
    top = path
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MmplanError(f"cannot create {option} {path}: {e.strerror or e}") from None
    created.append(top)


def _remove_empty_dirs(top: Path) -> None:
    """Remove the directories under and including `top` that nothing was written into."""
    for d in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except OSError:
            pass


def measured_summary(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step time and per-rank busy time over the steps after the first (warm-up)."""
    if not metrics:
        return {"step_time_s": None, "busy_s": [], "peak_memory_bytes": [], "first_loss": None, "last_loss": None}
    rows = metrics[1:] or metrics
    ranks = len(rows[0]["compute_s"])
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in rows),
        "busy_s": [statistics.median(r["compute_s"][k] + r["comm_s"][k] for r in rows) for k in range(ranks)],
        "peak_memory_bytes": [max(r["peak_memory_bytes"][k] for r in metrics) for k in range(ranks)],
        "first_loss": metrics[0]["loss"],
        "last_loss": metrics[-1]["loss"],
    }
