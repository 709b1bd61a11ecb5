"""`mmplan demo`: profile -> solve -> run (solved and best homogeneous plans) -> compare, on this machine (printed by planner/report.py)."""
from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan

DEFAULT_MODEL = "tiny-vlm-heavy"  # a vision encoder ~28x the LLM's FLOPs: the case heterogeneous layouts are for


@dataclass(frozen=True)
class Trained:
    name: str
    plan: Plan
    path: Path
    log: Path
    metrics: list[dict[str, Any]]

    @property
    def measured_step_s(self) -> float:
        rows = self.metrics[2:] or self.metrics  # the first steps warm up
        return statistics.median(r["step_time_s"] for r in rows)


@dataclass(frozen=True)
class DemoResult:
    out: Path
    profile: Profile
    solved: Trained
    baseline: Trained
    solve_time_s: float
    wall_s: float


def run_demo(out: Path, *, model: str = DEFAULT_MODEL, cluster: str = "2xlocal-cpu", global_batch: int = 16,
             steps: int = 30, progress: Callable[[str, float], None] | None = None) -> DemoResult:
    from cost_models.hardware import parse_cluster
    from runtime.source import resolve

    note = progress or (lambda step, fraction: None)
    started = time.perf_counter()
    # refuse bad options before anything is written, and leave no half-filled directory behind on a later refusal
    if steps < 1:
        raise MmplanError(f"--steps must be >= 1, got {steps}")
    if global_batch < 1:
        raise MmplanError(f"--global-batch must be >= 1, got {global_batch}")
    source, spec = resolve(model), parse_cluster(cluster)
    if out.exists() and not out.is_dir():
        raise MmplanError(f"--output {out} is a file; give a directory")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MmplanError(f"cannot create the output directory {out}: {e.strerror or e}") from None
    try:
        return _run_demo(out, source, spec, global_batch, steps, note, started)
    except MmplanError:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _run_demo(out: Path, source, spec, global_batch: int, steps: int, note: Callable[[str, float], None],
              started: float) -> DemoResult:
    from planner.compare import load_compared, write_traces
    from planner.profile import profile_model
    from planner.run import run_plan
    from planner.solve import solve
    from plans.graph import save_profile
    from plans.plan import save_plan

    note(f"profiling {source.name} (measuring each distinct block on the CPU)", 0.02)
    profile = profile_model(source, micro_batch=4, device="cpu", measure=True, reps=5)
    save_profile(profile, out / "profile.json")
    note("solving", 0.15)
    solution = solve(profile, spec, global_batch)
    baseline_plan = solution.baseline or solution.plan
    paths = {"solved": out / "plan.json", "homogeneous": out / "homogeneous.json"}
    save_plan(solution.plan, paths["solved"])
    save_plan(baseline_plan, paths["homogeneous"])
    trained = {}
    for i, (name, plan) in enumerate((("solved", solution.plan), ("homogeneous", baseline_plan))):
        note(f"training the {name} plan for {steps} steps", 0.25 + 0.35 * i)
        log = out / f"run-{name}.jsonl"
        result = run_plan(paths[name], steps=steps, log=log, overwrite=True)  # the demo owns its output directory
        trained[name] = Trained(name, plan, paths[name], log, result.metrics)
    note("comparing", 0.95)
    write_traces(load_compared(list(paths.values()), profile=profile), out / "traces")
    note("done", 1.0)
    return DemoResult(out, profile, trained["solved"], trained["homogeneous"], solution.solve_time_s,
                      time.perf_counter() - started)
