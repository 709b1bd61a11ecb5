"""Solve time of the solver at scale against the issue's targets, with its speed-up over both baselines.

Run: python bench/solve_bench.py [--repeats 3] [--batch-per-gpu 1] [--cases vit22b-llama70b@4096,...] [--time-limit T]
     [--schedule interleaved|1f1b|gpipe]
Profiles are built on the meta device first (not counted in the solve time). Every dimension of the search is on
(tp, dp, pp, micro-batches, ZeRO 0-3, sequence parallelism, keep / selective / full recompute / memory tiers, cut
points, placements, and -- with the default --schedule interleaved -- interleaved 1F1B chain layouts of 2 model
chunks per rank beside the 1F1B ones). Targets: solve
time < 2 s at 64 GPUs, < 10 s at 1024, < 60 s at 4096. Both baselines (homogeneous: one layout, cut points by the
solver's DP; megatron: encoders on stage 0, LLM layers even) are searched inside the same solve() call and are
included in its time. The solve time is the median of --repeats runs; the load average is printed with it
(the machine is shared).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.cluster_spec import parse_cluster  # noqa: E402
from planner.profiler.profile import profile_model  # noqa: E402
from planner.solver.solve import solve  # noqa: E402
from runtime.source import resolve  # noqa: E402

CASES = ("llava-1.5-13b@64", "qwen2-vl-72b@1024", "vit22b-llama70b@4096")


def time_target(gpus: int) -> float | None:
    return 2.0 if gpus <= 64 else 10.0 if gpus <= 1024 else 60.0 if gpus <= 4096 else None


def _speedup(x: float | None) -> str:
    return f"{x:.3f}x" if x is not None else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-per-gpu", type=float, default=1.0, help="global batch = this x GPUs (default 1)")
    parser.add_argument("--cases", default=",".join(CASES), help="model@gpus,... (h100-sxm clusters)")
    parser.add_argument("--time-limit", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="solves per case; the median time is reported")
    parser.add_argument("--schedule", default="interleaved", help="solve --schedule (default interleaved: 1F1B and interleaved)")
    args = parser.parse_args(argv)
    profiles: dict[str, object] = {}
    print(f"{'model':<16} {'GPUs':>5} {'batch':>6} {'structure':<13} {'groups (GPUs: dp*tp*pp zero)':<44} {'step s':>7} "
          f"{'vs homog':>8} {'vs megatron':>11} {'solve s (median)':>17} {'target':>8} {'sims':>5} {'load':>5} proved")
    for case in args.cases.split(","):
        model, gpus = case.split("@")
        gpus = int(gpus)
        if model not in profiles:
            profiles[model] = profile_model(resolve(model))
        batch = max(1, int(args.batch_per_gpu * gpus))
        walls, load = [], os.getloadavg()[0]  # the 1-minute load average before the case's solves
        for _ in range(max(1, args.repeats)):
            started = time.perf_counter()
            sol = solve(profiles[model], parse_cluster(f"{gpus}xh100-sxm"), batch, time_limit=args.time_limit, schedule=args.schedule)
            walls.append(time.perf_counter() - started)
        wall = statistics.median(walls)
        tiers = {t for g in sol.plan.groups for st in g.stages for t in st.memory.activations.values()}
        groups = ", ".join(f"{g.name} {len(g.ranks)}: {g.dp}*{g.tp}*{g.pp} z{g.zero}" + (" sp" if g.sequence_parallel else "")
                           + (" (coloc)" if g.colocated_with else "") for g in sol.plan.groups)
        groups += (f" v{sol.plan.training.virtual_stages}" if sol.plan.training.virtual_stages > 1 else "") + \
            (" " + "/".join(sorted(tiers)) if tiers else "")
        t_target = time_target(gpus)
        t_mark = "-" if t_target is None else (f"<{t_target:g} " + ("ok" if wall < t_target else "MISS"))
        times = "/".join(f"{w:.2f}" for w in walls)
        print(f"{model:<16} {gpus:>5} {batch:>6} {sol.structure:<13} {groups:<44} {sol.step_time_s:>7.3f} "
              f"{_speedup(sol.speedup):>8} {_speedup(sol.speedup_over('megatron')):>11} {wall:>6.2f} ({times}) {t_mark:>8} "
              f"{sol.simulated:>5} {load:>5.1f} "
              f"{'yes' if sol.proved_optimal else ('stopped' if sol.stopped_early else f'gap {sol.gap:.1%}')}", flush=True)


if __name__ == "__main__":
    main()
