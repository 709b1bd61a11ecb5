"""What `mmplan solve`, `demo` and `compare` print: rich tables and the --json objects, from their results."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Group as Stack
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cost_models.evaluate import Evaluation
from planner.commands.compare import Compared, Comparison, best_index, deviation_summary, max_memory
from planner.console import human_count, safe
from planner.solver.explain import breakdown, plan_mechanisms, seconds_text, why
from planner.profiler.show import group_totals
from plans.graph import Profile
from plans.plan import Group, Plan, Predicted
from plans.units import format_bytes, format_capacity, plural

if TYPE_CHECKING:
    from planner.commands.demo import DemoResult
    from planner.solver.solve import Solution


# --- shared cells -------------------------------------------------------------------------------------------


def placement_text(group: Group, groups: int = 2) -> str:
    """A group's placement: "colocated with <group>" (time-sharing its ranks), "non-colocated" (its own ranks, beside
    other groups) or "whole model" (the plan's only group: neither)."""
    if group.colocated_with:
        return f"colocated with {group.colocated_with}"
    return "non-colocated" if groups > 1 else "whole model"


def tiers_text(group: Group) -> str:
    """A group's tiers in one cell: params/grads/optimizer tiers of its stages, then its blocks per activation tier."""
    states = dict.fromkeys(f"{s.memory.params}/{s.memory.grads}/{s.memory.optimizer}" for s in group.stages)
    acts: dict[str, int] = {}
    for s in group.stages:
        for b in s.blocks:
            tier = s.memory.activations.get(b, "keep")
            acts[tier] = acts.get(tier, 0) + 1
    return f"{', '.join(states)}; " + ", ".join(f"{n} {tier}" for tier, n in acts.items())


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


# --- mmplan solve -------------------------------------------------------------------------------------------


def solution_json(solution: Solution, output: str | os.PathLike, profile: Profile | None = None) -> dict:
    """The --json object: the written path, step times, speed-up, solve time, fit, and how the search went."""
    plan, p = solution.plan, solution.plan.predicted
    return {
        "plan": str(output),
        "step_time_s": p.step_time_s,
        "baseline_step_time_s": solution.baseline_step_time_s,
        "speedup_vs_homogeneous": solution.speedup,
        "speedup_vs_megatron": solution.speedup_over("megatron"),
        "baselines": {name: {"layout": layout_text(b), "step_time_s": b.predicted.step_time_s}
                      for name, b in solution.baselines.items()},
        "memory_reserve": plan.solver.memory_reserve if plan.solver else 0.0,
        "solve_time_s": solution.solve_time_s,
        "fits": p.fits,
        "method": plan.solver.method if plan.solver else None,
        "structure": solution.structure,
        "stopped_early": solution.stopped_early,
        "proved_optimal": solution.proved_optimal,
        "candidates": solution.candidates,
        "simulated": solution.simulated,
        "micro_batches": plan.training.micro_batches,
        "schedule": plan.training.schedule,
        "groups": [{"name": g.name, "gpus": len(g.ranks), "dp": g.dp, "tp": g.tp, "pp": g.pp, "zero": g.zero,
                    "micro_batches": plan.micro_batches_of(g), "colocated_with": g.colocated_with, "cuts": [s.blocks[0] for s in g.stages[1:]]} for g in plan.groups],
        "peak_gpu_bytes": max((m.gpu for m in p.memory), default=0.0),
        "mfu": p.mfu,
        "why": why_solved(solution, profile) if profile is not None else {},
        "other_placement": None if solution.other_placement is None else {
            "placement": solution.other_placement[0], "layout": layout_text(solution.other_placement[1]),
            "step_time_s": solution.other_placement[1].predicted.step_time_s, "why": other_placement_text(solution)},
    }


def other_placement_text(solution: Solution) -> str:
    """Under a forced placement, one sentence on the other placement's best plan (planner/solver/explain.py's why)."""
    from planner.solver.explain import mechanisms, seconds_text

    name, other = solution.other_placement
    a, b = solution.step_time_s, other.predicted.step_time_s
    verdict = f"{b / a:.2f}x slower" if b >= a else f"{a / b:.2f}x faster"
    named = mechanisms(other, solution.plan) if b < a else []
    return (f"the best {name} plan takes {seconds_text(b)} per step, {verdict} than this one"
            + (f"; it differs in {'; '.join(named)}" if named else ""))


def why_solved(solution: Solution, profile: Profile) -> dict[str, str]:
    """Per baseline: why the solved plan beats it (or loses to it), from both plans' breakdowns (planner/solver/explain.py)."""
    from cost_models.evaluate import evaluate

    plan = solution.plan
    mine = evaluate(plan, profile)
    return {name: why("the solved plan", plan, mine, f"the {name} baseline", b, evaluate(b, profile))
            for name, b in solution.baselines.items()}


def render_solution(solution: Solution, profile: Profile):
    """Rich renderables of the summary: one row per group (layout, cut points, GPUs and their modalities, tiers),
    then the predicted step, memory and the speed-up over the best homogeneous plan of the same run."""
    plan, p = solution.plan, solution.plan.predicted
    modality = {b.name: b.group for b in profile.blocks}
    flops = {b.name: b.fwd_flops + b.bwd_flops for b in profile.blocks}
    total = sum(flops.values()) or 1.0
    world = plan.world_size
    title = (f"{plan.profile.model} on {plan.cluster.world_size} x {plan.cluster.device.name}: {plan.training.global_batch} samples "
             f"per step in {micro_batches_text(plan)}, {plan.training.schedule}")
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("group", "GPUs", "dp·tp·pp", "ZeRO", "placement", "blocks per stage (cuts before)", "params/grads/optim; activations"):
        table.add_column(col, justify="right" if col in ("GPUs", "ZeRO") else "left", overflow="fold")
    for g in plan.groups:
        sizes = "+".join(str(len(s.blocks)) for s in g.stages)
        cuts = ", ".join(s.blocks[0] for s in g.stages[1:])
        table.add_row(g.name, str(len(g.ranks)), f"{g.dp}·{g.tp}·{g.pp}", str(g.zero), placement_text(g, len(plan.groups)),
                      sizes + (f" ({cuts})" if cuts else ""), tiers_text(g))
    per_modality = []
    for g in plan.groups:
        mods = list(dict.fromkeys(modality[b] for b in g.blocks))
        share = sum(flops[b] for b in g.blocks) / total
        per_modality.append(f"{safe('+'.join(mods))}: {plural(len(g.ranks), 'GPU')} ({len(g.ranks) / world:.0%}) for {share:.1%} of the FLOPs")
    peak = {t: max((getattr(m, t) for m in p.memory), default=0.0) for t in ("gpu", "cpu", "nvme")}
    lines = [
        "GPUs per modality: " + "; ".join(per_modality),
        f"predicted step {p.step_time_s:.4g} s, {p.samples_per_s:,.1f} samples/s, MFU {p.mfu:.1%}, bubble {p.bubble_fraction:.1%}, "
        f"bottleneck {safe(p.bottleneck)}",
        f"peak memory per rank: GPU {format_bytes(peak['gpu'])} of {format_capacity(plan.cluster.device.memory_bytes)}"
        + (f", CPU {format_bytes(peak['cpu'])}" if peak["cpu"] else "") + (f", NVMe {format_bytes(peak['nvme'])}" if peak["nvme"] else "")
        + ("" if p.fits else "  [bold red]does not fit[/]"),
    ]
    reasons = why_solved(solution, profile)
    for name, b in solution.baselines.items():
        lines.append(f"{name} baseline ({safe(layout_text(b).replace(chr(10), '; '))}) {b.predicted.step_time_s:.4g} s: "
                     f"speed-up [bold]{solution.speedup_over(name):.2f}x[/]; {safe(reasons[name])}")
    if solution.other_placement is not None:
        lines.append(safe(other_placement_text(solution)))
    if solution.structure == "baseline" and solution.plan.solver:
        lines.append(f"baseline: {safe(solution.plan.solver.notes)}")
    how = "proved optimal over the search space" if solution.proved_optimal else (
        "stopped early at the time limit" if solution.stopped_early else f"bound gap {solution.gap:.1%}")
    if solution.structure == "baseline" and not solution.simulated:  # solve --baseline: its note says how it was found
        lines.append(f"built in {solution.solve_time_s:.2f} s")
    else:
        lines.append(f"solved in {solution.solve_time_s:.2f} s: {solution.candidates} candidate layouts, {solution.simulated} "
                     f"plans simulated, {how}")
    if solution.stopped_early:
        lines.append("[yellow]the time limit stopped the search: this is the best plan found so far[/]")
    return Stack(table, *(Text.from_markup(line) for line in lines))


# --- mmplan compare -----------------------------------------------------------------------------------------


def layout_text(plan: Plan) -> str:
    """One line per group: `name: tp8 pp2 dp32 zero1 [(colocated with x)]`."""
    return "\n".join(f"{g.name}: tp{g.tp} pp{g.pp} dp{g.dp}" + (f" zero{g.zero}" if g.zero else "")
                     + (f" ({placement_text(g)})" if g.colocated_with else "") for g in plan.groups)


def figures(item: Compared, *, best: bool = False) -> dict[str, Any]:
    """The JSON object of one compared plan (`mmplan compare --json`)."""
    p, plan, t = item.predicted, item.plan, item.plan.training
    return {
        "plan": item.name,
        "model": plan.profile.model,
        "cluster": plan.cluster.name,
        "world_size": plan.world_size,
        "source": "evaluated" if item.evaluation is not None else "plan file",
        "groups": [{"name": g.name, "tp": g.tp, "pp": g.pp, "dp": g.dp, "zero": g.zero, "colocated_with": g.colocated_with}
                   for g in plan.groups],
        "global_batch": t.global_batch,
        "micro_batches": t.micro_batches,
        "schedule": t.schedule,
        "step_time_s": p.step_time_s,
        "samples_per_s": p.samples_per_s,
        "tokens_per_s": p.tokens_per_s,
        "tflops_per_gpu": p.tflops_per_gpu,
        "mfu": p.mfu,
        "peak_memory_bytes": [{"rank": m.rank, "gpu": m.gpu, "cpu": m.cpu, "nvme": m.nvme} for m in p.memory],
        "max_memory_bytes": max_memory(p),
        "device_memory_bytes": plan.cluster.device.memory_bytes,
        "bubble_fraction": p.bubble_fraction,
        "comm_bytes": p.comm_bytes,
        "bottleneck": p.bottleneck,
        "fits": p.fits,
        "best": best,
        "breakdown": [{"group": r.group, "stage": r.stage, "ranks": r.ranks, "compute_s": r.compute, "comm_s": r.comm,
                       "offload_s": r.offload, "bubble_s": r.bubble}
                      for r in breakdown(plan, item.evaluation)] if item.evaluation is not None else None,
    }


def compare_json(items: Sequence[Compared]) -> list[dict[str, Any]]:
    """One object per plan, in the order given; each plan but the best says why the best beats it ("why")."""
    best = best_index(items)
    out = [figures(c, best=i == best) for i, c in enumerate(items)]
    for i, text in why_texts(items).items():
        out[i]["why"] = text
    return out


def why_texts(items: Sequence[Compared]) -> dict[int, str]:
    """For each evaluated plan other than the best: why the best beats it (planner/solver/explain.py)."""
    best = best_index(items)
    if best is None or items[best].evaluation is None:
        return {}
    b = items[best]
    return {i: why(Path(b.name).stem, b.plan, b.evaluation, Path(c.name).stem, c.plan, c.evaluation)
            for i, c in enumerate(items) if i != best and c.evaluation is not None}


def breakdown_table(items: Sequence[Compared]) -> Table | None:
    """Where each evaluated plan's step goes, per group and stage (planner/solver/explain.py); None when no plan was evaluated."""
    evaluated = [c for c in items if c.evaluation is not None]
    if not evaluated:
        return None
    table = Table(title="where the step goes (seconds per step on a rank of each stage)", title_justify="left",
                  header_style="bold")
    for name in ("plan", "group", "stage", "ranks", "compute", "exposed comm", "exposed offload", "bubble"):
        table.add_column(name, justify="left" if name in ("plan", "group") else "right")
    for c in evaluated:
        for n, r in enumerate(breakdown(c.plan, c.evaluation)):
            table.add_row(Path(c.name).stem if n == 0 else "", r.group, str(r.stage), str(r.ranks),
                          *(seconds_text(v) for v in (r.compute, r.comm, r.offload, r.bubble)))
    return table


def compare_table(items: Sequence[Compared]) -> Table:
    """Plans as columns, figures as rows; the best plan (fastest that fits) in green with a star."""
    best = best_index(items)
    source = "evaluated by the cost model" if all(c.evaluation for c in items) else "predictions stored in the plans"
    table = Table(title=f"predicted step ({source})", title_justify="left", header_style="bold")
    table.add_column("")
    for i, c in enumerate(items):
        label = Path(c.name).stem + (" ★ best" if i == best else "")
        table.add_column(label, justify="right", header_style="bold green" if i == best else "bold",
                         style="green" if i == best else None)

    def row(name: str, cell) -> None:
        table.add_row(name, *(cell(c) for c in items))

    row("layout", lambda c: layout_text(c.plan))
    row("GPUs", lambda c: f"{c.plan.world_size} of {c.plan.cluster.name}")
    row("schedule", lambda c: _schedule_text(c.plan))
    row("step time", lambda c: _seconds(c.predicted.step_time_s))
    row("samples/s", lambda c: f"{c.predicted.samples_per_s:,.1f}")
    row("tokens/s", lambda c: human_count(c.predicted.tokens_per_s) if c.predicted.tokens_per_s else "-")
    row("TFLOP/s per GPU", lambda c: f"{c.predicted.tflops_per_gpu:.4g}")
    row("MFU", lambda c: f"{c.predicted.mfu:.1%}")
    row("peak GPU memory", lambda c: _memory_cell(c))
    row("peak CPU memory", lambda c: format_bytes(max_memory(c.predicted)["cpu"]))
    row("peak NVMe", lambda c: format_bytes(max_memory(c.predicted)["nvme"]))
    row("bubble", lambda c: f"{c.predicted.bubble_fraction:.1%}")
    row("comm per step", lambda c: format_bytes(c.predicted.comm_bytes))
    row("bottleneck", lambda c: c.predicted.bottleneck or "-")
    row("fits", lambda c: Text("yes") if c.predicted.fits else Text("no", style="bold red"))
    return table


def _schedule_text(plan: Plan) -> str:
    t = plan.training
    name = f"interleaved:{t.virtual_stages}" if t.schedule == "interleaved" else t.schedule
    own = "".join(f", {g.name} {plan.micro_batches_of(g)} x {plan.micro_batch_of(g)}" for g in plan.groups
                  if g.micro_batches is not None)
    return f"{name}, {t.micro_batches} x {t.micro_batch} samples{own}"


def micro_batches_text(plan: Plan) -> str:
    """"8 micro-batches", with the groups counting their own: "8 micro-batches (vision: 4)"."""
    own = ", ".join(f"{g.name}: {g.micro_batches}" for g in plan.groups if g.micro_batches is not None)
    return plural(plan.training.micro_batches, 'micro-batch', 'micro-batches') + (f" ({own})" if own else "")


def _memory_cell(c: Compared) -> Text:
    """Fullest rank's GPU bytes of the device's; red when over."""
    gpu, cap = max_memory(c.predicted)["gpu"], c.plan.cluster.device.memory_bytes
    return Text(f"{format_bytes(gpu)} of {format_capacity(cap)}", style=None if gpu <= cap else "bold red")


def comparison_json(result: Comparison) -> list[dict[str, Any]]:
    """The `mmplan compare --json` list: compare_json, the plan's object carrying "measured":
    deviation_summary(...) when a metrics log was given."""
    out = compare_json(result.items)
    if result.measured is not None:
        c = result.items[0]
        out[0]["measured"] = deviation_summary(c.plan, c.evaluation or c.predicted, result.measured)
    return out


def measured_table(plan: Plan, evaluation_or_predicted: Evaluation | Predicted, metrics_rows: Sequence[Any]) -> Table:
    """Predicted beside measured (see deviation_summary): step time, then per rank busy time and peak memory."""
    summary = deviation_summary(plan, evaluation_or_predicted, metrics_rows)
    skipped = summary["warmup_steps_skipped"]
    table = Table(title=f"predicted vs measured (median of {summary['steps_used']} steps"
                        + (f", first {skipped} skipped as warm-up)" if skipped else ")"),
                  title_justify="left", header_style="bold")
    for name in ("", "predicted", "measured", "deviation"):
        table.add_column(name, justify="left" if not name else "right")

    def add(name: str, pair: dict, fmt) -> None:
        p = pair["predicted"]
        table.add_row(name, "-" if p is None else fmt(p), fmt(pair["measured"]), _deviation_text(pair["deviation_pct"]))

    add("step time", summary["step_time_s"], _seconds)
    for r in summary["ranks"]:
        add(f"rank {r['rank']} busy (compute + comm)", r["busy_s"], _seconds)
    for r in summary["ranks"]:
        add(f"rank {r['rank']} peak memory", r["peak_memory_bytes"], format_bytes)
    return table


def _deviation_text(pct: float | None) -> Text:
    if pct is None:
        return Text("-")
    style = None if abs(pct) <= 20 else "yellow" if abs(pct) <= 50 else "bold red"
    return Text(f"{pct:+.1f} %", style=style)


# --- mmplan demo --------------------------------------------------------------------------------------------


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
            table.add_row(name, g.name, f"{g.dp} x {g.tp} x {g.pp}", stages, placement_text(g, len(plan.groups)), tiers_text(g))
            name = ""
        table.add_row("", "", "", Text(f"{micro_batches_text(plan)}, {plan.training.schedule}", style="dim"), "", "")
    return table


def results_table(result: DemoResult) -> Table:
    """The demo's two trained plans: predicted and measured step, throughput, loss, peak device memory."""
    runs = len(result.solved.runs_s)
    table = Table(title=f"Predicted vs measured (median step after warm-up{f', median of {runs} runs' if runs > 1 else ''})",
                  title_justify="left", header_style="bold")
    for col in ("plan", "predicted step", "measured step", "deviation", "samples/s measured", "loss first -> last",
                "peak device memory"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for t in (result.solved, result.baseline, *result.others):
        pred = t.plan.predicted.step_time_s
        meas = t.measured_step_s
        peak = max(max(r["peak_memory_bytes"]) for r in t.metrics)
        table.add_row(t.name if t is result.solved else f"{t.name} baseline", f"{pred * 1e3:.1f} ms", f"{meas * 1e3:.1f} ms", f"{(pred - meas) / meas:+.0%}",
                      f"{t.plan.training.global_batch / meas:.0f}", f"{t.metrics[0]['loss']:.3f} -> {t.metrics[-1]['loss']:.3f}",
                      format_bytes(peak))
    return table


def render_demo(result: DemoResult) -> Stack:
    """What `mmplan demo` prints: the module graph, both plans, predicted vs measured, the verdict."""
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
    verdict = (f"measured speed-up of the solved plan over the fastest-measured one-layout plan ({result.baseline_kind} baseline): "
               f"[bold]{speedup:.2f}x[/] (predicted {predicted:.2f}x)"
               + (" — the solver chose the homogeneous layout itself" if same else "")
               + (f"\nload average before each run: {', '.join(f'{x:.1f}' for x in result.load)}" if result.load else "")
               + (f"\nthe model's forward + backward, timed alone before each round of runs: "
                  f"{', '.join(f'{x:.2f}x' for x in result.speed)} its time in the profile (the predictions use the "
                  "profile's: a machine shared with other jobs changes speed)" if result.speed else ""))
    from planner.commands.demo import CASES

    named = plan_mechanisms(s.plan)
    if result.case is not None:
        verdict = f"case {result.case}: {CASES[result.case].about}\n{verdict}"
    verdict += ("\nmechanism of the solved plan: " + "; ".join(named) if named
                else "\nmechanism of the solved plan: a layout per group (no per-group micro-batch count, look-ahead or "
                     "bubble filling)")
    kinds = [t.name for t in (b, *result.others)]
    files = (f"wrote {safe(result.out)}/: cluster.toml, profile.json, plan.json, {', '.join(f'{k}.json' for k in kinds)}, "
             f"run-*.jsonl (one per plan and run), traces/ (open in ui.perfetto.dev)")
    return Stack(groups, plan_table([("solved", s.plan), *((f"{t.name} baseline", t.plan) for t in (b, *result.others))]),
                 results_table(result),
                     Panel(Text.from_markup(f"{verdict}\nsolve time {result.solve_time_s:.2f} s, demo wall time {result.wall_s:.0f} s\n{files}"),
                           title="mmplan demo", title_align="left"))


def demo_json(result: DemoResult) -> dict[str, Any]:
    """The `mmplan demo --json` object: per plan its layout, predicted and measured step (the median of its runs'
    median steps), each run's median, its losses; the speed-ups; the load average before each run; the machine's
    speed before each round of runs against the profile's (DemoResult.speed)."""
    def plan(t) -> dict[str, Any]:
        return {"layout": layout_text(t.plan), "predicted_step_s": t.predicted_step_s, "measured_step_s": t.measured_step_s,
                "runs_s": list(t.runs_s), "first_loss": t.metrics[0]["loss"], "last_loss": t.metrics[-1]["loss"]}

    s, b = result.solved, result.baseline
    return {
        "case": result.case, "mechanisms": plan_mechanisms(s.plan),
        "solved": plan(s), "homogeneous": {**plan(b), "baseline": result.baseline_kind},
        # every baseline trained, by kind; "homogeneous" above is the one that measured fastest
        "baselines": {t.name: plan(t) for t in (b, *result.others)},
        "predicted_speedup": b.predicted_step_s / s.predicted_step_s,
        "measured_speedup": b.measured_step_s / s.measured_step_s,
        "out": str(result.out), "model": result.profile.model, "cluster": result.cluster.name if result.cluster else None,
        "load": list(result.load), "wall_s": result.wall_s, "solve_time_s": result.solve_time_s,
        # before each round of runs: the model's forward + backward alone over its time in the profile
        "machine_speed": list(result.speed),
    }
