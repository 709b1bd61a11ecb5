"""Runtime benchmark on 2 CPU ranks (gloo, one thread each).

(a) overhead: a DP-2 plan through mmplan's runtime vs a plain hand-written torch DDP loop on the same
    model, data and ranks. Target: ratio <= 1.10.
(b) heterogeneity, measured: for tiny-vlm-heavy and tiny-avlm, the solver's plan vs the best homogeneous
    plan on `2xlocal-cpu` (calibrated when --calibrate), both trained; prints the measured speed-up and
    each plan's predicted-vs-measured step-time deviation. Targets: speed-up >= 0.95x, deviation <= 20 %.

Run: python bench/runtime_bench.py [--steps 30] [--calibrate] [--only a|b]
Step times are medians over the steps after the first two (warm-up); machines here are shared and
noisy, so both sides of each comparison run in the same invocation, alternating, three rounds each.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.solver.construct import GroupLayout, build_plan  # noqa: E402
from planner.profiler.profile import profile_model  # noqa: E402
from plans.plan import Training, save_plan  # noqa: E402
from runtime.data import open_dataset  # noqa: E402
from runtime.launch import launch  # noqa: E402
from runtime.source import resolve  # noqa: E402
from runtime.rank import build_model, vocab_of  # noqa: E402
from runtime.train import Job, step_samples, train_rank  # noqa: E402

WARMUP = 2


def ddp_worker(ctx, job: Job) -> list[float]:
    """The plain baseline: DDP over the world, each rank its half of every global batch."""
    model, example = build_model(job)
    dataset = open_dataset(None, example, vocab_of(model), job.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=job.lr)
    per = job.plan.training.global_batch // ctx.world_size
    times = []
    for step in range(job.steps):
        batch = dataset.sample_batch(step_samples(step, job.plan, 0, ctx.rank * per, (ctx.rank + 1) * per))
        t0 = time.perf_counter()
        loss = ddp(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    del ddp, opt
    return times


def median_after_warmup(times: list[float]) -> float:
    return statistics.median(times[WARMUP:])


def overhead(model: str, steps: int) -> None:
    prof = profile_model(resolve(model))
    from cost_models.cluster_spec import parse_cluster

    cluster = parse_cluster("2xlocal-cpu")
    plan = build_plan(prof, cluster, Training(global_batch=16, micro_batches=1, schedule="1f1b", dtype="fp32"),
                      [GroupLayout("model", tuple(b.name for b in prof.blocks), (), dp=2, tp=1, ranks=(0, 1))])
    job = Job(plan=plan, model=model, steps=steps)
    ours, plain = [], []
    for _ in range(3):
        res = launch(train_rank, 2, job, timeout_s=600)
        ours.append(median_after_warmup([m["step_time_s"] for m in res[0]["metrics"]]))
        plain.append(median_after_warmup(launch(ddp_worker, 2, job, timeout_s=600)[0]))
    a, b = statistics.median(ours), statistics.median(plain)
    ratio = a / b
    print(f"(a) {model} DP-2, global batch 16: mmplan {a * 1e3:.1f} ms/step, plain DDP {b * 1e3:.1f} ms/step, "
          f"ratio {ratio:.3f} (target <= 1.10: {'met' if ratio <= 1.10 else 'MISSED'})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", choices=["a", "b"])
    ap.add_argument("--calibrate", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.only in (None, "a"):
        overhead("tiny-vlm-heavy", args.steps)
    if args.only in (None, "b"):
        from bench.runtime_hetero import heterogeneity  # noqa: WPS433  (solver-dependent part)

        heterogeneity(args.steps, args.calibrate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
