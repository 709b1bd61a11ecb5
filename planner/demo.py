"""`mmplan demo`: profile -> solve -> run (solved and best homogeneous plans) -> compare, on this machine."""
from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Group as RichGroup
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from planner.console import human_bytes, safe
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


def plan_table(plans: list[tuple[str, Plan]]) -> Table:
    """Layouts side by side: per group its degrees, cut points, ranks and tiers."""
    table = Table(title="Plans", title_justify="left", header_style="bold")
    table.add_column("plan")
    table.add_column("group")
    table.add_column("dp x tp x pp", justify="right")
    table.add_column("stages")
    table.add_column("placement")
    table.add_column("tiers")
    for name, plan in plans:
        for g in plan.groups:
            stages = "; ".join(f"{len(s.blocks)} blocks @ rank {','.join(map(str, s.ranks))}" for s in g.stages)
            tiers = sorted({_tiers(s.memory) for s in g.stages})
            table.add_row(name, g.name, f"{g.dp} x {g.tp} x {g.pp}", stages,
                          f"with {g.colocated_with}" if g.colocated_with else "own ranks", " | ".join(tiers))
            name = ""
        table.add_row("", "", "", Text(f"{plan.training.micro_batches} micro-batches, {plan.training.schedule}", style="dim"), "", "")
    return table


def _tiers(memory) -> str:
    acts = "/".join(sorted(set(memory.activations.values())) or ["keep"])
    states = {memory.params, memory.grads, memory.optimizer}
    where = f"state {states.pop()}" if len(states) == 1 else f"p {memory.params}, g {memory.grads}, opt {memory.optimizer}"
    return f"{where}, act {acts}"


def results_table(result: DemoResult) -> Table:
    table = Table(title="Predicted vs measured (median step after warm-up)", title_justify="left", header_style="bold")
    for col in ("plan", "predicted step", "measured step", "deviation", "samples/s measured", "loss first -> last",
                "peak device memory"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for t in (result.solved, result.baseline):
        pred = t.plan.predicted.step_time_s
        meas = t.measured_step_s
        peak = max(max(r["peak_memory_bytes"]) for r in t.metrics)
        table.add_row(t.name, f"{pred * 1e3:.1f} ms", f"{meas * 1e3:.1f} ms", f"{(pred - meas) / meas:+.0%}",
                      f"{t.plan.training.global_batch / meas:.0f}", f"{t.metrics[0]['loss']:.3f} -> {t.metrics[-1]['loss']:.3f}",
                      human_bytes(peak))
    return table


def render(result: DemoResult) -> RichGroup:
    from planner.show import group_totals

    groups = Table(title=f"Module graph of {result.profile.model}", title_justify="left", header_style="bold")
    for col in ("group", "blocks", "params", "fwd GFLOP/sample", "measured fwd+bwd ms"):
        groups.add_column(col, justify="left" if col == "group" else "right")
    totals = group_totals(result.profile)
    for g, t in totals.items():
        ms = sum((b.fwd_ms or 0) + (b.bwd_ms or 0) for b in result.profile.group_blocks(g))
        groups.add_row(g, f"{t['blocks']:.0f}", f"{t['params'] / 1e6:.2f} M", f"{t['fwd_flops'] / 1e9:.3f}", f"{ms:.2f}")
    s, b = result.solved, result.baseline
    speedup = b.measured_step_s / s.measured_step_s
    predicted = b.plan.predicted.step_time_s / s.plan.predicted.step_time_s
    same = s.plan.groups == b.plan.groups and s.plan.training == b.plan.training
    verdict = (f"measured speed-up of the solved plan over the best homogeneous one: [bold]{speedup:.2f}x[/] "
               f"(predicted {predicted:.2f}x)" + (" — the solver chose the homogeneous layout itself" if same else ""))
    files = (f"wrote {safe(result.out)}/: profile.json, plan.json, homogeneous.json, run-solved.jsonl, "
             f"run-homogeneous.jsonl, traces/ (open in ui.perfetto.dev)")
    return RichGroup(groups, plan_table([("solved", s.plan), ("homogeneous", b.plan)]), results_table(result),
                     Panel(Text.from_markup(f"{verdict}\nsolve time {result.solve_time_s:.2f} s, demo wall time {result.wall_s:.0f} s\n{files}"),
                           title="mmplan demo", title_align="left"))


def summary_json(result: DemoResult) -> dict[str, Any]:
    return {
        "out": str(result.out), "model": result.profile.model, "wall_s": result.wall_s, "solve_time_s": result.solve_time_s,
        **{f"{t.name}_{k}": v for t in (result.solved, result.baseline) for k, v in (
            ("predicted_step_s", t.plan.predicted.step_time_s), ("measured_step_s", t.measured_step_s),
            ("first_loss", t.metrics[0]["loss"]), ("last_loss", t.metrics[-1]["loss"]))},
        "measured_speedup": result.baseline.measured_step_s / result.solved.measured_step_s,
    }


def dumps(result: DemoResult) -> str:
    return json.dumps(summary_json(result))
