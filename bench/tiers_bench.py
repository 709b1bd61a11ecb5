"""Memory-tier benchmark on local CPU ranks (gloo, one thread each).

(1) Beyond device memory: tiny-vlm under a device-tier budget of a quarter of its training state, with the
    solver's tier plan, vs the same model with no budget (the solver's unconstrained plan), prefetch on and
    off. Prints the step-time ratio. Target: <= 1.5x with prefetch.
(2) Where heterogeneity pays on real processes: a per-rank device-tier cap under which the whole
    tiny-vlm-heavy does not fit one rank; on 2 ranks, the solver's plan vs the best homogeneous plan under
    the same cap, both trained. Targets: measured speed-up >= 1.2x, predicted speed-up within 15 % of it.

Run: python bench/tiers_bench.py [--steps 30]. Medians over the steps after the first two, three rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.cluster_spec import parse_cluster  # noqa: E402
from cost_models.cluster_toml import cluster_from_toml  # noqa: E402
from planner.profiler.profile import profile_model  # noqa: E402
from planner.commands.run import run_plan  # noqa: E402
from planner.solver.diagnosis import state_bytes  # noqa: E402
from planner.solver.solve import solve  # noqa: E402
from cost_models.evaluate import evaluate  # noqa: E402
from plans.plan import Memory, save_plan  # noqa: E402
from runtime.source import resolve  # noqa: E402


def capped(ranks: int, budget: float) -> str:
    return f'base = "local-cpu"\nnodes = 1\ngpus_per_node = {ranks}\n[device]\nmemory_gb = {budget / 1e9:.9f}\n'


def timed(path: Path, steps: int, **kw) -> float:
    rows = run_plan(path, steps=steps, **kw).metrics[2:]
    return statistics.median(r["step_time_s"] for r in rows)


def _on_device(plan):
    """`plan` with every stage's state on the device tier and every activation kept (its micro-batches unchanged)."""
    groups = tuple(replace(g, stages=tuple(replace(s, memory=Memory()) for s in g.stages)) for g in plan.groups)
    return replace(plan, groups=groups)


def beyond_memory(steps: int, tmp: Path) -> None:
    prof = profile_model(resolve("tiny-vlm"), micro_batch=4, device="cpu", measure=True)
    budget = (state_bytes(prof, "fp32") + sum(b.activation_bytes for b in prof.blocks) * 4) / 4
    free = solve(prof, parse_cluster("1xlocal-cpu"), 8, baseline=False).plan
    tiered = solve(prof, cluster_from_toml(capped(1, budget)), 8, baseline=False).plan
    floor = _on_device(replace_cluster(tiered, free.cluster))
    floor = replace(floor, predicted=evaluate(floor, prof).predicted)
    save_plan(free, tmp / "free.json")
    save_plan(tiered, tmp / "tiered.json")
    save_plan(floor, tmp / "floor.json")
    predicted = {"no budget": free.predicted.step_time_s, "same micro-batches": floor.predicted.step_time_s,
                 "budget, prefetch": tiered.predicted.step_time_s, "budget, no prefetch": tiered.predicted.step_time_s}
    runs = {name: [] for name in predicted}
    for _ in range(3):  # alternated, so a load that comes and goes lands on every row
        runs["no budget"].append(timed(tmp / "free.json", steps))
        runs["same micro-batches"].append(timed(tmp / "floor.json", steps))
        runs["budget, prefetch"].append(timed(tmp / "tiered.json", steps, device_budget=budget, nvme_dir=tmp))
        runs["budget, no prefetch"].append(timed(tmp / "tiered.json", steps, device_budget=budget, nvme_dir=tmp, prefetch=False))
    base = statistics.median(runs["no budget"])
    tiers = sorted({f"{s.memory.params}/{s.memory.grads}/{s.memory.optimizer}, acts {'/'.join(sorted(set(s.memory.activations.values())) or ['keep'])}"
                    for g in tiered.groups for s in g.stages})
    print(f"(1) tiny-vlm, device budget {budget / 1e6:.2f} MB (1/4 of its training state); tier plan: {'; '.join(tiers)}, "
          f"{tiered.training.micro_batches} micro-batches (unbudgeted: {free.training.micro_batches})")
    floor_med = statistics.median(runs["same micro-batches"])
    for name, values in runs.items():
        med = statistics.median(values)
        error = (predicted[name] - med) / med
        target = ""
        if name == "budget, prefetch":
            target = (f"  (target <= 1.5x: {'met' if med / base <= 1.5 else 'MISSED'}; predicted within 15 %: "
                      f"{'met' if abs(error) <= 0.15 else 'MISSED'}; {med / floor_med:.2f}x the same micro-batches untiered)")
        print(f"    {name:<20} {med * 1e3:7.1f} ms/step  {med / base:5.2f}x   predicted {predicted[name] * 1e3:6.1f} ms ({error:+.0%}){target}")


def replace_cluster(plan, cluster):
    """`plan` on `cluster` (the unbudgeted machine), so the untiered row is not refused by the budget's device memory."""
    return replace(plan, cluster=cluster, predicted=None)


def heterogeneity(steps: int, tmp: Path) -> None:
    prof = profile_model(resolve("tiny-vlm-heavy"), micro_batch=4, device="cpu", measure=True)
    whole = state_bytes(prof, "fp32") + sum(b.activation_bytes for b in prof.blocks) * 8
    cap = 0.6 * whole  # one rank cannot hold the whole model
    solution = solve(prof, cluster_from_toml(capped(2, cap)), 16)
    plans = {"solved": solution.plan, "homogeneous": solution.baseline}
    if plans["homogeneous"] is None:
        print("(2) no homogeneous plan fits the cap; nothing to compare")
        return
    for name, plan in plans.items():
        save_plan(plan, tmp / f"{name}.json")
    runs = {name: [timed(tmp / f"{name}.json", steps, nvme_dir=tmp) for _ in range(3)] for name in plans}
    med = {k: statistics.median(v) for k, v in runs.items()}
    measured = med["homogeneous"] / med["solved"]
    predicted = plans["homogeneous"].predicted.step_time_s / plans["solved"].predicted.step_time_s
    print(f"(2) tiny-vlm-heavy, 2 ranks capped at {cap / 1e6:.1f} MB each (the whole model needs {whole / 1e6:.1f} MB):")
    for name, plan in plans.items():
        layout = ", ".join(f"{g.name} {g.dp}x{g.tp}x{g.pp}" for g in plan.groups)
        print(f"    {name:<11} [{layout}] measured {med[name] * 1e3:.1f} ms, predicted {plan.predicted.step_time_s * 1e3:.1f} ms")
    print(f"    measured speed-up {measured:.2f}x (target >= 1.2: {'met' if measured >= 1.2 else 'MISSED'}), predicted "
          f"{predicted:.2f}x ({(predicted - measured) / measured:+.0%}; target within 15 %: "
          f"{'met' if abs(predicted - measured) <= 0.15 * measured else 'MISSED'})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", choices=("1", "2"), help="run one part")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.only != "2":
            beyond_memory(args.steps, Path(tmp))
        if args.only != "1":
            heterogeneity(args.steps, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
