"""Offline comparison of plans: predicted figures side by side, Perfetto traces, and predicted vs measured."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from cost_models.evaluate import Evaluation, evaluate
from cost_models.trace import chrome_trace
from planner.console import human_bytes, human_count
from plans.errors import FormatError, MmplanError
from plans.graph import Profile
from plans.plan import Plan, Predicted, load_plan
from plans.serial import read_text, write_atomic

TRACE_ALL_RANKS_UP_TO = 64  # traces of larger plans show one rank per class of identical ranks ("stands for ...")
WARMUP_STEPS = 1  # measured steps left out of the medians (the first step builds caches, warms allocators)


@dataclass(frozen=True, slots=True)
class Compared:
    """One plan of a comparison: the name it was given by, the plan, its predicted figures, and the
    evaluation they come from (None when they are the figures stored in the plan file)."""

    name: str
    plan: Plan
    predicted: Predicted
    evaluation: Evaluation | None = None


def load_compared(paths: Sequence[str | os.PathLike], profile: Profile | None = None) -> list[Compared]:
    """Load plans for comparison. With a profile every plan is checked against it and evaluated by the current
    cost model; without one, each plan's stored predictions are used and a plan without them is an error."""
    if not paths:
        raise MmplanError("give at least one plan file to compare")
    out = []
    for path in paths:
        plan = load_plan(path, profile=profile)
        if profile is not None:
            ev = evaluate(plan, profile)
            out.append(Compared(str(path), plan, ev.predicted, ev))
        elif plan.predicted is None:
            raise MmplanError(f"plan {path} carries no predicted figures (a hand-written plan?); pass --profile "
                              "PROFILE.json so the cost model can evaluate it")
        else:
            out.append(Compared(str(path), plan, plan.predicted))
    return out


def best_index(items: Sequence[Compared]) -> int | None:
    """The plan with the lowest step time among those that fit; None when none fits."""
    fitting = [i for i, c in enumerate(items) if c.predicted.fits]
    return min(fitting, key=lambda i: items[i].predicted.step_time_s) if fitting else None


def max_memory(predicted: Predicted) -> dict[str, float]:
    """Peak bytes of the fullest rank in each tier."""
    return {tier: max((getattr(m, tier) for m in predicted.memory), default=0.0) for tier in ("gpu", "cpu", "nvme")}


def layout_text(plan: Plan) -> str:
    """One line per group: `name: tp8 pp2 dp32 zero1 [colocated with x]`."""
    return "\n".join(f"{g.name}: tp{g.tp} pp{g.pp} dp{g.dp}" + (f" zero{g.zero}" if g.zero else "")
                     + (f" (with {g.colocated_with})" if g.colocated_with else "") for g in plan.groups)


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
    }


def compare_json(items: Sequence[Compared]) -> list[dict[str, Any]]:
    """One object per plan, in the order given."""
    best = best_index(items)
    return [figures(c, best=i == best) for i, c in enumerate(items)]


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
    row("peak CPU memory", lambda c: human_bytes(max_memory(c.predicted)["cpu"]))
    row("peak NVMe", lambda c: human_bytes(max_memory(c.predicted)["nvme"]))
    row("bubble", lambda c: f"{c.predicted.bubble_fraction:.1%}")
    row("comm per step", lambda c: human_bytes(c.predicted.comm_bytes))
    row("bottleneck", lambda c: c.predicted.bottleneck or "-")
    row("fits", lambda c: Text("yes") if c.predicted.fits else Text("no", style="bold red"))
    return table


def _schedule_text(plan: Plan) -> str:
    t = plan.training
    name = f"interleaved:{t.virtual_stages}" if t.schedule == "interleaved" else t.schedule
    return f"{name}, {t.micro_batches} x {t.micro_batch} samples"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _memory_cell(c: Compared) -> Text:
    """Fullest rank's GPU bytes of the device's; red when over."""
    gpu, cap = max_memory(c.predicted)["gpu"], c.plan.cluster.device.memory_bytes
    return Text(f"{human_bytes(gpu)} of {human_bytes(cap)}", style=None if gpu <= cap else "bold red")


def write_traces(items: Sequence[Compared], directory: str | os.PathLike) -> list[Path]:
    """One Chrome/Perfetto trace per plan, `<plan stem>.trace.json` in `directory` (created if missing; a stem
    used twice gets -2, -3, ...). Plans of up to TRACE_ALL_RANKS_UP_TO ranks get a track per rank; larger
    ones one per class of identical ranks."""
    missing = [c.name for c in items if c.evaluation is None]
    if missing:
        raise MmplanError(f"traces need the simulated timeline: pass --profile to evaluate {missing[0]}")
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise MmplanError(f"trace directory {folder} is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MmplanError(f"cannot create trace directory {folder}: {e.strerror or e}") from None
    written: list[Path] = []
    used: dict[str, int] = {}
    for c in items:
        stem = Path(c.name).stem
        used[stem] = used.get(stem, 0) + 1
        name = stem if used[stem] == 1 else f"{stem}-{used[stem]}"
        every = sorted(c.evaluation.simulation.representative)  # all ranks of the plan
        ranks = every if len(every) <= TRACE_ALL_RANKS_UP_TO else None
        path = folder / f"{name}.trace.json"
        try:
            write_atomic(path, json.dumps(chrome_trace(c.evaluation, ranks=ranks)))
        except OSError as e:
            raise MmplanError(f"cannot write trace {path}: {e.strerror or e}") from None
        written.append(path)
    return written


# --- predicted vs measured -------------------------------------------------------------------------------------


PerRank = tuple[float, ...] | float  # one number per rank, or one number for every rank


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """One step of a run's metrics log (`mmplan run` writes one JSON object per step); per-rank lists by rank."""

    step: int
    step_time_s: float
    compute_s: PerRank
    comm_s: PerRank
    idle_s: PerRank
    peak_memory_bytes: PerRank
    loss: float | None = None


def read_metrics(path: str | os.PathLike) -> tuple[MeasuredStep, ...]:
    """Parse a JSONL metrics log; every problem is one FormatError naming the line."""
    what = f"metrics log {path}"
    text = read_text(path, "metrics log")
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise FormatError(f"{what} line {n} is not valid JSON ({e.msg}); each line must be one JSON object") from None
        except (ValueError, RecursionError):  # an integer of too many digits, nesting too deep
            raise FormatError(f"{what} line {n} is not usable JSON (a number too long or nesting too deep); "
                              "each line must be one JSON object") from None
    if not rows:
        raise _no_steps(what)
    latest = {}  # a resumed run appends to its log: a step redone after the checkpoint replaces the earlier row
    for n, row in rows:
        step = _step(row, f"{what} line {n}")
        latest[step.step] = step
    return tuple(sorted(latest.values(), key=lambda s: s.step))


def metrics_from_rows(rows: Sequence[Any], what: str = "metrics") -> tuple[MeasuredStep, ...]:
    """Steps from in-memory rows: dicts as the log holds them, the runtime's StepMetrics, or MeasuredStep."""
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, MeasuredStep):
            out.append(row)
            continue
        if dataclasses.is_dataclass(row) and not isinstance(row, type):
            row = dataclasses.asdict(row)
        out.append(_step(row, f"{what} row {i}"))
    if not out:
        raise _no_steps(what)
    return tuple(out)


def _no_steps(what: str) -> FormatError:
    return FormatError(f"{what} has no steps; run at least {WARMUP_STEPS + 1} steps to compare with the prediction")


def _step(row: Any, where: str) -> MeasuredStep:
    if not isinstance(row, Mapping):
        raise FormatError(f"{where} is a JSON {type(row).__name__}, not an object with step, step_time_s, compute_s, ...")
    for key in ("step", "step_time_s", "compute_s", "peak_memory_bytes"):
        if key not in row:
            raise FormatError(f"{where} lacks field {key!r}")
    step = row["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise FormatError(f"{where}: field 'step' must be an integer >= 0, got {step!r}")
    loss = row.get("loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float)) or abs(loss) > 1e308):
        raise FormatError(f"{where}: field 'loss' must be a number, got {_brief(loss)}")
    return MeasuredStep(
        step=step,
        step_time_s=_number(row["step_time_s"], "step_time_s", where),
        compute_s=_per_rank(row["compute_s"], "compute_s", where),
        comm_s=_per_rank(row.get("comm_s", 0.0), "comm_s", where),
        idle_s=_per_rank(row.get("idle_s", 0.0), "idle_s", where),
        peak_memory_bytes=_per_rank(row["peak_memory_bytes"], "peak_memory_bytes", where),
        loss=None if loss is None else float(loss),
    )


def _number(value: Any, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e308 \
            or not math.isfinite(value):  # (compared before isfinite: a huge int does not convert to float)
        raise FormatError(f"{where}: field {key!r} must be a finite number >= 0, got {_brief(value)}")
    return float(value)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"


def _per_rank(value: Any, key: str, where: str) -> PerRank:
    """A list of one number per rank; a bare number means the same on every rank."""
    if isinstance(value, list):
        if not value:
            raise FormatError(f"{where}: field {key!r} is an empty list; give one number per rank")
        return tuple(_number(v, f"{key}[{i}]", where) for i, v in enumerate(value))
    return _number(value, key, where)


def _on_ranks(values: PerRank, world: int, key: str, step: int) -> list[float]:
    if isinstance(values, float):
        return [values] * world
    if len(values) != world:
        raise FormatError(f"metrics step {step}: {key} lists {len(values)} ranks but the plan has {world}; "
                          "is this log from a run of this plan?")
    return list(values)


def deviation(predicted: float, measured: float) -> float | None:
    """How far the prediction is from the measurement, in % of the measurement (+ = predicted too high)."""
    if measured == 0:
        return None
    return (predicted - measured) / measured * 100


def deviation_summary(plan: Plan, evaluation_or_predicted: Evaluation | Predicted,
                      metrics_rows: Sequence[Any]) -> dict[str, Any]:
    """Predicted vs measured as JSON data: step time (median over the steps after the first WARMUP_STEPS; all
    steps when there are no more), per-rank busy time (compute + comm, needs an Evaluation) and peak memory.

    Each comparison is {"predicted", "measured", "deviation_pct"}, deviation = (predicted - measured) /
    measured in %. Measured memory is what the runtime reports (on CPU the process's peak RSS, which includes
    the framework itself; the prediction counts model states and activations only).
    """
    steps = metrics_from_rows(metrics_rows)
    ev = evaluation_or_predicted if isinstance(evaluation_or_predicted, Evaluation) else None
    predicted = ev.predicted if ev else evaluation_or_predicted
    if not isinstance(predicted, Predicted):
        raise MmplanError(f"predicted vs measured needs an Evaluation or Predicted figures, got {type(predicted).__name__}")
    used = steps[WARMUP_STEPS:] or steps
    ranks = sorted({r for g in plan.groups for r in g.ranks})
    world = len(ranks)
    step_time = statistics.median(s.step_time_s for s in used)

    def per_rank(key: str) -> list[float]:
        cols = [_on_ranks(getattr(s, key), world, key, s.step) for s in used]
        return [statistics.median(c[i] for c in cols) for i in range(world)]

    compute, comm, memory = per_rank("compute_s"), per_rank("comm_s"), per_rank("peak_memory_bytes")
    pred_memory = {m.rank: m.gpu for m in predicted.memory}
    rows = []
    for i, r in enumerate(ranks):
        busy_p = ev.busy[r].compute + ev.busy[r].comm if ev and r in ev.busy else None
        busy_m = compute[i] + comm[i]
        mem_p = pred_memory.get(r)
        rows.append({
            "rank": r,
            "busy_s": _pair(busy_p, busy_m),
            "compute_s": _pair(ev.busy[r].compute if ev and r in ev.busy else None, compute[i]),
            "comm_s": _pair(ev.busy[r].comm if ev and r in ev.busy else None, comm[i]),
            "peak_memory_bytes": _pair(mem_p, memory[i]),
        })
    return {
        "steps": len(steps),
        "steps_used": len(used),
        "warmup_steps_skipped": len(steps) - len(used),
        "step_time_s": _pair(predicted.step_time_s, step_time),
        "ranks": rows,
    }


def _pair(predicted: float | None, measured: float) -> dict[str, float | None]:
    return {"predicted": predicted, "measured": measured,
            "deviation_pct": None if predicted is None else deviation(predicted, measured)}


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
        add(f"rank {r['rank']} peak memory", r["peak_memory_bytes"], human_bytes)
    return table


def _deviation_text(pct: float | None) -> Text:
    if pct is None:
        return Text("-")
    style = None if abs(pct) <= 20 else "yellow" if abs(pct) <= 50 else "bold red"
    return Text(f"{pct:+.1f} %", style=style)


# --- the `mmplan compare` command's core ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Comparison:
    """What `mmplan compare` shows: the plans, the measured steps (with --measured) and the traces written."""

    items: tuple[Compared, ...]
    measured: tuple[MeasuredStep, ...] | None = None
    traces: tuple[Path, ...] = ()

    def as_json(self) -> list[dict[str, Any]]:
        """compare_json, the plan's object carrying "measured": deviation_summary(...) when a log was given."""
        out = compare_json(self.items)
        if self.measured is not None:
            c = self.items[0]
            out[0]["measured"] = deviation_summary(c.plan, c.evaluation or c.predicted, self.measured)
        return out


def run_compare(paths: Sequence[str | os.PathLike], *, profile_path: str | os.PathLike | None = None,
                trace_dir: str | os.PathLike | None = None, measured_path: str | os.PathLike | None = None) -> Comparison:
    """Load (and with a profile evaluate) the plans, read the metrics log, write the traces; inputs are all
    checked before anything is written."""
    from plans.graph import load_profile

    if measured_path is not None and len(paths) != 1:
        raise MmplanError(f"--measured compares one plan with its run; got {len(paths)} plans")
    measured = read_metrics(measured_path) if measured_path is not None else None
    if trace_dir is not None and profile_path is None:
        raise MmplanError("--trace needs --profile: the timeline is simulated from the profile, plans do not store it")
    profile = load_profile(profile_path) if profile_path is not None else None
    items = tuple(load_compared(paths, profile))
    if measured is not None:
        deviation_summary(items[0].plan, items[0].evaluation or items[0].predicted, measured)  # rank counts match
    traces = tuple(write_traces(items, trace_dir)) if trace_dir is not None else ()
    return Comparison(items, measured, traces)
