"""Speed-up of solved plans over the best homogeneous layout, and solve time, against the issue's targets.

Run: python bench/solve_bench.py [--batch-per-gpu 1] [--cases vit22b-llama70b@128,...]
Profiles are built on the meta device first (not counted in the solve time). Targets: >= 1.3x on the
vit22b-llama70b cases; solve time < 2 s at 64 GPUs, < 10 s at 1024, < 60 s at 4096 (on this 2-core machine).
The homogeneous baseline (planner/baselines.best_homogeneous) is searched inside the same solve() call and is
included in its time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.hardware import parse_cluster  # noqa: E402
from planner.profile import profile_model  # noqa: E402
from planner.solve import solve  # noqa: E402
from runtime.source import resolve  # noqa: E402

CASES = ("vit22b-llama70b@128", "vit22b-llama70b@512", "qwen2-vl-72b@1024", "whisper-llama-7b@64", "llava-1.5-13b@64",
         "vit22b-llama70b@4096")
SPEEDUP_TARGET = {"vit22b-llama70b": 1.3}


def time_target(gpus: int) -> float | None:
    return 2.0 if gpus <= 64 else 10.0 if gpus <= 1024 else 60.0 if gpus <= 4096 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-per-gpu", type=float, default=1.0, help="global batch = this x GPUs (default 1)")
    parser.add_argument("--cases", default=",".join(CASES), help="model@gpus,... (h100-sxm clusters)")
    parser.add_argument("--time-limit", type=float, default=None)
    args = parser.parse_args(argv)
    profiles: dict[str, object] = {}
    print(f"{'model':<18} {'GPUs':>5} {'batch':>6} {'structure':<9} {'groups (GPUs: dp*tp*pp)':<40} {'step s':>7} {'homog s':>8} "
          f"{'speed-up':>8} {'target':>7} {'solve s':>8} {'target':>7} {'sims':>5} proved")
    for case in args.cases.split(","):
        model, gpus = case.split("@")
        gpus = int(gpus)
        if model not in profiles:
            profiles[model] = profile_model(resolve(model))
        batch = max(1, int(args.batch_per_gpu * gpus))
        started = time.perf_counter()
        sol = solve(profiles[model], parse_cluster(f"{gpus}xh100-sxm"), batch, time_limit=args.time_limit)
        wall = time.perf_counter() - started
        groups = ", ".join(f"{g.name} {len(g.ranks)}: {g.dp}*{g.tp}*{g.pp}" + (" (coloc)" if g.colocated_with else "")
                           for g in sol.plan.groups)
        speedup = sol.speedup
        s_target = SPEEDUP_TARGET.get(model)
        t_target = time_target(gpus)
        s_mark = "-" if s_target is None else (f">={s_target:g} " + ("ok" if speedup and speedup >= s_target else "MISS"))
        t_mark = "-" if t_target is None else (f"<{t_target:g} " + ("ok" if wall < t_target else "MISS"))
        base = f"{sol.baseline_step_time_s:.3f}" if sol.baseline_step_time_s else "-"
        print(f"{model:<18} {gpus:>5} {batch:>6} {sol.structure:<9} {groups:<40} {sol.step_time_s:>7.3f} {base:>8} "
              f"{(speedup or 0):>7.3f}x {s_mark:>7} {wall:>8.2f} {t_mark:>7} {sol.simulated:>5} "
              f"{'yes' if sol.proved_optimal else ('stopped' if sol.stopped_early else f'gap {sol.gap:.1%}')}", flush=True)


if __name__ == "__main__":
    main()
