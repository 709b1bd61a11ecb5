"""`mmplan demo`: profile -> solve -> run (solved and best homogeneous plans) -> compare, on this machine (printed by planner/commands/report.py)."""
from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class DemoCase:
    """What `mmplan demo --case NAME` runs: a model, a capped local cluster, a global batch, and the micro-batch the
    profile measures at (and twice it: the affine fit of planner/profiler/measure.py), nearest the micro-batches its
    plans run, since a CPU block's time is not affine in the batch far from where it was measured (its working set
    leaves the caches)."""

    model: str
    cluster: str
    global_batch: int
    profile_micro_batch: int
    about: str  # one line for --help: what the case shows


CASES: dict[str, DemoCase] = {
    # a convolutional encoder (no tensor parallelism, few parameters) and a parameter-heavy, compute-light LLM, on 2
    # local ranks with a memory cap (see both files): the encoder data-parallel beside the LLM's pipeline stages
    "layouts": DemoCase("runtime.models.conv_vlm:factory", str(HERE / "demo_cluster.toml"), 8, 4,
                        "a layout per group: a data-parallel convolutional encoder beside a pipelined LLM"),
    # a host-bound ViT of narrow layers and an LLM whose logits hold it to one sample per replica under the cap
    # (runtime/models/mb_vlm.py, micro_batch_cluster.toml): the encoder's own micro-batch count
    "micro-batch": DemoCase("runtime.models.mb_vlm:factory", str(HERE / "micro_batch_cluster.toml"), 16, 1,
                            "a micro-batch count per group: a host-bound encoder in one micro-batch of the whole "
                            "batch beside an LLM that memory holds to one sample per replica and micro-batch"),
}
DEFAULT_CASE = "layouts"
DEFAULT_MODEL = CASES[DEFAULT_CASE].model
DEFAULT_CLUSTER = CASES[DEFAULT_CASE].cluster
RUNS = 3  # training runs per plan; the measured step is the median of their median steps
NVME_DIR = "nvme"  # under the output directory: the runs' nvme tier (`mmplan run --nvme-dir`)


@dataclass(frozen=True)
class Trained:
    name: str
    plan: Plan
    path: Path
    log: Path  # the first run's log
    metrics: list[dict[str, Any]]  # the first run's rows
    runs_s: tuple[float, ...] = ()  # each run's median step after warm-up, in the order they ran

    @property
    def measured_step_s(self) -> float:
        return statistics.median(self.runs_s) if self.runs_s else _median_step(self.metrics)

    @property
    def predicted_step_s(self) -> float:
        return self.plan.predicted.step_time_s


def _median_step(metrics: list[dict[str, Any]]) -> float:
    rows = metrics[2:] or metrics  # the first steps warm up
    return statistics.median(r["step_time_s"] for r in rows)


@dataclass(frozen=True)
class DemoResult:
    out: Path
    profile: Profile
    solved: Trained
    baseline: Trained  # the one-layout plan that measured fastest of those the solver compared with
    solve_time_s: float
    wall_s: float
    cluster: Cluster | None = None
    baseline_kind: str = "homogeneous"
    load: tuple[float, ...] = ()  # 1-minute load average before each run (os.getloadavg), in the order they ran
    others: tuple[Trained, ...] = ()  # the other baselines trained (a distinct layout the solver also compared with)
    case: str | None = None  # the --case it ran (None: a model or cluster of the caller's)
    # before each round of runs: the model's forward + backward timed alone, over its time in the profile
    # (profiler.measure.machine_speed; empty for a profile without whole-model times)
    speed: tuple[float, ...] = ()


def run_demo(out: Path, *, case: str = DEFAULT_CASE, model: str | None = None, cluster: str | None = None,
             global_batch: int | None = None, steps: int = 12, runs: int = RUNS, calibrate: bool = True,
             profile_micro_batch: int | None = None, progress: Callable[[str, float], None] | None = None) -> DemoResult:
    """The demo of `case` (CASES); `model`, `cluster`, `global_batch` and `profile_micro_batch` replace its own."""
    from cost_models.cluster_spec import parse_cluster
    from runtime.source import resolve

    note = progress or (lambda step, fraction: None)
    started = time.perf_counter()
    # refuse bad options before anything is written, and leave no half-filled directory behind on a later refusal
    if case not in CASES:
        raise MmplanError(f"--case must be one of {', '.join(CASES)}, got {case!r}")
    chosen = CASES[case]
    own = model is None and cluster is None
    model, cluster = model or chosen.model, cluster or chosen.cluster
    global_batch = chosen.global_batch if global_batch is None else global_batch
    profile_micro_batch = chosen.profile_micro_batch if profile_micro_batch is None else profile_micro_batch
    if steps < 1:
        raise MmplanError(f"--steps must be >= 1, got {steps}")
    if runs < 1:
        raise MmplanError(f"--runs must be >= 1, got {runs}")
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
        result = _run_demo(out, source, spec, global_batch, steps, runs, calibrate, profile_micro_batch, note, started)
        return replace(result, case=case if own else None)
    except MmplanError as e:
        if created and not (out / "profile.json").exists():
            shutil.rmtree(out, ignore_errors=True)  # refused before the profile (a model that cannot be built): no
            raise  # half-filled directory left behind
        raise MmplanError(f"{e} (what the demo wrote is kept in {out})") from None


def measured_cluster(spec: Cluster, note: Callable[[str, float], None] = lambda step, fraction: None) -> Cluster:
    """`spec` with this machine's measured device, links and runtime costs (`mmplan calibrate --quick` with its
    ranks, all busy at once); its memory capacities (the cap the plans must respect) stay those of `spec`."""
    from planner.calibrate.calibrate import calibrate

    if spec.world_size < 2:  # gloo collectives need two ranks to be measured
        return spec
    measured = calibrate(ranks=spec.world_size, quick=True, progress=lambda step, f: note(f"calibrating: {step}", 0.1 + 0.08 * f))
    device = replace(measured.device, memory_bytes=spec.device.memory_bytes)
    cluster = replace(measured, name=f"{spec.name} (measured)", device=device, host_memory_bytes=spec.host_memory_bytes,
                      nvme_bytes=spec.nvme_bytes)
    return cluster


def _run_demo(out: Path, source, spec: Cluster, global_batch: int, steps: int, runs: int, calibrate: bool,
              profile_micro_batch: int, note: Callable[[str, float], None], started: float) -> DemoResult:
    from cost_models.cluster_toml import cluster_to_toml
    from planner.commands.compare import load_compared, write_traces
    from planner.profiler.measure import machine_speed
    from planner.profiler.profile import profile_model
    from planner.commands.run import run_plan
    from planner.solver.solve import solve
    from plans.graph import save_profile
    from plans.plan import save_plan
    from plans.serial import write_atomic

    # the profile first: it builds the model, so a model that cannot be built is refused before the calibration's
    # seconds (and its progress lines)
    note(f"profiling {source.name} (measuring each distinct block on the CPU)", 0.02)
    profile = profile_model(source, micro_batch=profile_micro_batch, device="cpu", measure=True, reps=3)
    save_profile(profile, out / "profile.json")
    cluster = measured_cluster(spec, note) if calibrate else spec
    write_atomic(out / "cluster.toml", cluster_to_toml(cluster))
    note("solving", 0.2)
    solution = solve(profile, cluster, global_batch)
    # every one-layout plan the solver compared with (its homogeneous and megatron baselines, each the best of its
    # kind, never weakened) is trained, and the solved plan is measured against the fastest of them: the strongest
    # baseline is the one that measures fastest, not the one predicted fastest
    baselines = _distinct_baselines(solution.baselines) or {"homogeneous": solution.plan}
    paths = {"solved": out / "plan.json", **{kind: out / f"{kind}.json" for kind in baselines}}
    plans = {"solved": solution.plan, **baselines}
    for name, plan in plans.items():
        save_plan(plan, paths[name])
    medians: dict[str, list[float]] = {name: [] for name in plans}
    first: dict[str, tuple[Path, list]] = {}
    load: list[float] = []
    speed: list[float] = []
    order = [name for _ in range(runs) for name in plans]  # alternated: load hits every plan alike
    for i, name in enumerate(order):
        if i % len(plans) == 0:  # before each round of runs: the machine's speed against the profile's moment
            note(f"timing the model's forward + backward against its profile (round {i // len(plans) + 1} of {runs})",
                 0.25 + 0.7 * i / len(order))
            ratio = machine_speed(source, profile)
            if ratio is not None:
                speed.append(ratio)
        note(f"training the {name} plan for {steps} steps (run {i // len(plans) + 1} of {runs})", 0.25 + 0.7 * i / len(order))
        log = out / (f"run-{name}.jsonl" if name not in first else f"run-{name}-{i // len(plans) + 1}.jsonl")
        load.append(os.getloadavg()[0])
        # the demo owns its output directory; each rank is held to the cluster's device memory; whichever tiers the
        # solver chose (it may put state on NVMe when the measured profile makes memory tight), the runs have a
        # directory for the nvme tier under the output directory (each run's own inside it, removed at its end)
        result = run_plan(paths[name], steps=steps, model=source.name, log=log, overwrite=True,
                          device_budget=float(cluster.device.memory_bytes), nvme_dir=out / NVME_DIR)
        medians[name].append(_median_step(result.metrics))
        first.setdefault(name, (log, result.metrics))
    trained = {name: Trained(name, plans[name], paths[name], *first[name], runs_s=tuple(medians[name]))
               for name in plans}
    kind = min(baselines, key=lambda k: trained[k].measured_step_s)
    note("comparing", 0.97)
    write_traces(load_compared(list(paths.values()), profile=profile), out / "traces")
    note("done", 1.0)
    return DemoResult(out, profile, trained["solved"], trained[kind], solution.solve_time_s,
                      time.perf_counter() - started, cluster, kind, tuple(load),
                      tuple(trained[k] for k in baselines if k != kind), speed=tuple(speed))


def _distinct_baselines(baselines: dict[str, Plan]) -> dict[str, Plan]:
    """The solver's baselines, one per distinct layout (the megatron baseline is often the homogeneous one)."""
    kept: dict[str, Plan] = {}
    for kind, plan in baselines.items():
        if not any(p.groups == plan.groups and p.training == plan.training for p in kept.values()):
            kept[kind] = plan
    return kept
