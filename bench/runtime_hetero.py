"""Part (b) of bench/runtime_bench.py: the solver's plan vs the best homogeneous plan, both trained here.

For tiny-vlm-heavy and tiny-avlm on 2 local ranks: profile with measured block times, solve, train both
plans (alternating, three rounds), print the measured speed-up and each plan's predicted-vs-measured
step-time deviation. Targets: speed-up >= 0.95x (never measurably slower), deviation <= 20 %.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

MODELS = ("tiny-vlm-heavy", "tiny-avlm")


def heterogeneity(steps: int, calibrate: bool) -> None:
    from cost_models.cluster_spec import parse_cluster
    from cost_models.cluster_toml import cluster_to_toml
    from planner.profiler.profile import profile_model
    from planner.commands.run import run_plan
    from planner.solver.solve import solve
    from plans.plan import save_plan
    from plans.serial import write_atomic
    from runtime.source import resolve

    with tempfile.TemporaryDirectory() as tmp:
        cluster = "2xlocal-cpu"
        if calibrate:
            from planner.calibrate.calibrate import calibrate as measure

            path = Path(tmp) / "here.toml"
            write_atomic(path, cluster_to_toml(measure(ranks=2, quick=True)))
            cluster = str(path)
        for model in MODELS:
            profile = profile_model(resolve(model), micro_batch=4, device="cpu", measure=True)
            solution = solve(profile, parse_cluster(cluster), 16)
            plans = {"solved": solution.plan, "homogeneous": solution.baseline or solution.plan}
            paths = {}
            for name, plan in plans.items():
                paths[name] = Path(tmp) / f"{model}-{name}.json"
                save_plan(plan, paths[name])
            measured = {name: [] for name in plans}
            for _ in range(3):
                for name in plans:
                    rows = run_plan(paths[name], steps=steps).metrics[2:]
                    measured[name].append(statistics.median(r["step_time_s"] for r in rows))
            med = {name: statistics.median(v) for name, v in measured.items()}
            speedup = med["homogeneous"] / med["solved"]
            print(f"(b) {model}: solved {med['solved'] * 1e3:.1f} ms/step, homogeneous {med['homogeneous'] * 1e3:.1f} ms/step, "
                  f"measured speed-up {speedup:.2f}x (target >= 0.95: {'met' if speedup >= 0.95 else 'MISSED'}), "
                  f"predicted {plans['homogeneous'].predicted.step_time_s / plans['solved'].predicted.step_time_s:.2f}x")
            for name, plan in plans.items():
                dev = (plan.predicted.step_time_s - med[name]) / med[name]
                layout = ", ".join(f"{g.name} {g.dp}x{g.tp}x{g.pp}" for g in plan.groups)
                print(f"    {name:<11} [{layout}; m={plan.training.micro_batches}] predicted {plan.predicted.step_time_s * 1e3:.1f} ms, "
                      f"deviation {dev:+.0%} (target within 20 %: {'met' if abs(dev) <= 0.20 else 'MISSED'})")
