"""Offline comparison of plans: their predicted figures, Perfetto traces, and predicted vs measured (printed by planner/commands/report.py)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_models.evaluate import MEMORY_MODELS, Evaluation, evaluate
from cost_models.trace import chrome_trace
from plans.errors import FormatError, MmplanError
from plans.graph import Profile
from plans.plan import Plan, Predicted, load_plan
from plans.serial import parse_json, read_text, refuse_non_regular, validate, write_atomic

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


def load_compared(paths: Sequence[str | os.PathLike], profile: Profile | None = None,
                  memory_model: str = "tensors") -> list[Compared]:
    """Load plans for comparison. With a profile every plan is checked against it and evaluated by the current
    cost model (memory counted as `memory_model` says: cost_models.evaluate.MEMORY_MODELS); without one, each plan's
    stored predictions are used and a plan without them is an error."""
    if not paths:
        raise MmplanError("give at least one plan file to compare")
    if memory_model not in MEMORY_MODELS:
        raise MmplanError(f"--memory-model must be one of {', '.join(MEMORY_MODELS)}, got {memory_model!r}")
    if memory_model != "tensors" and profile is None:
        raise MmplanError(f"--memory-model {memory_model} needs --profile: the figures stored in plans count tensors only")
    out = []
    for path in paths:
        plan = load_plan(path, profile=profile)
        if profile is not None:
            ev = evaluate(plan, profile, **MEMORY_MODELS[memory_model])
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
    paths = []
    for c in items:
        stem = Path(c.name).stem
        used[stem] = used.get(stem, 0) + 1
        name = stem if used[stem] == 1 else f"{stem}-{used[stem]}"
        paths.append(folder / f"{name}.trace.json")
        refuse_non_regular(paths[-1], "--trace")  # every trace's path before any is written
    for c, path in zip(items, paths):
        every = sorted(c.evaluation.simulation.representative)  # all ranks of the plan
        ranks = every if len(every) <= TRACE_ALL_RANKS_UP_TO else None
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
    """Parse a JSONL metrics log (plans/schema/metrics.json, one object per line); every problem is one
    FormatError naming the line."""
    what = f"metrics log {path}"
    text = read_text(path, "metrics log")
    rows = [(n, parse_json(line, f"{what} line {n}", allow_nan=True)) for n, line in enumerate(text.splitlines(), 1)
            if line.strip()]
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
    """One validated row (plans/schema/metrics.json) as a MeasuredStep."""
    validate(row, "metrics", where, message=functools.partial(_schema_message, where))
    loss = row.get("loss")
    return MeasuredStep(
        step=row["step"],
        step_time_s=_finite(row["step_time_s"], "step_time_s", where),
        compute_s=_per_rank(row["compute_s"], "compute_s", where),
        comm_s=_per_rank(row.get("comm_s", 0.0), "comm_s", where),
        idle_s=_per_rank(row.get("idle_s", 0.0), "idle_s", where),
        peak_memory_bytes=_per_rank(row["peak_memory_bytes"], "peak_memory_bytes", where),
        loss=None if loss is None else float(loss),
    )


def _schema_message(where: str, err: Any) -> str:
    """One sentence for the first schema error of a metrics row, naming the field as `key[i]`."""
    path = list(err.absolute_path)
    if not path and err.validator == "type":
        return f"{where} is a JSON {type(err.instance).__name__}, not an object with step, step_time_s, compute_s, ..."
    if err.validator == "required":
        return f"{where} lacks field {next(k for k in err.validator_value if k not in err.instance)!r}"
    key = str(path[0]) + "".join(f"[{i}]" for i in path[1:])
    if err.validator == "minItems":
        return f"{where}: field {key!r} is an empty list; give one number per rank"
    expected = {"step": "an integer >= 0", "loss": "a number"}.get(key, "a finite number >= 0")
    return f"{where}: field {key!r} must be {expected}, got {_brief(err.instance)}"


def _finite(value: int | float, key: str, where: str) -> float:
    """A schema-checked number as a float; NaN (which compares with nothing, so passes a schema's bounds) is refused."""
    if not math.isfinite(value):
        raise FormatError(f"{where}: field {key!r} must be a finite number >= 0, got {_brief(value)}")
    return float(value)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"


def _per_rank(value: Any, key: str, where: str) -> PerRank:
    """A list of one number per rank; a bare number means the same on every rank."""
    if isinstance(value, list):
        return tuple(_finite(v, f"{key}[{i}]", where) for i, v in enumerate(value))
    return _finite(value, key, where)


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


# --- the `mmplan compare` command's core ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Comparison:
    """What `mmplan compare` shows: the plans, the measured steps (with --measured) and the traces written."""

    items: tuple[Compared, ...]
    measured: tuple[MeasuredStep, ...] | None = None
    traces: tuple[Path, ...] = ()


def run_compare(paths: Sequence[str | os.PathLike], *, profile_path: str | os.PathLike | None = None,
                trace_dir: str | os.PathLike | None = None, measured_path: str | os.PathLike | None = None,
                memory_model: str = "tensors") -> Comparison:
    """Load (and with a profile evaluate) the plans, read the metrics log, write the traces; inputs are all
    checked before anything is written."""
    from plans.graph import load_profile

    if measured_path is not None and len(paths) != 1:
        raise MmplanError(f"--measured compares one plan with its run; got {len(paths)} plans")
    measured = read_metrics(measured_path) if measured_path is not None else None
    if trace_dir is not None and profile_path is None:
        raise MmplanError("--trace needs --profile: the timeline is simulated from the profile, plans do not store it")
    profile = load_profile(profile_path) if profile_path is not None else None
    items = tuple(load_compared(paths, profile, memory_model))
    if measured is not None:
        deviation_summary(items[0].plan, items[0].evaluation or items[0].predicted, measured)  # rank counts match
    traces = tuple(write_traces(items, trace_dir)) if trace_dir is not None else ()
    return Comparison(items, measured, traces)
