"""Predicted vs measured on this machine: a tiny model's training step on one rank, cost model against the clock.

Steps: calibrate this machine (`mmplan calibrate --quick` unless --full), profile `tiny-vlm` on the meta device
(FLOPs, op counts, saved activations) and again on the CPU with measured block times, build the 1-rank plan (one
group, tp = pp = dp = 1) on the calibrated cluster, predict its step with evaluate(), then train it with `mmplan
run`'s own path (run_plan: the runtime, its saved-tensor accounting and Adam) for --steps steps after --warmup
warm-up steps, and, for reference, time the bare step -- forward + backward of every micro-batch and the Adam step
in a plain loop, no runtime. Prints both predictions (FLOP-based with the calibrated matmul efficiency and host
costs; from the profile's measured block times) beside the runtime's median step, with the deviation
(predicted - measured) / measured.

Run: python bench/predict_bench.py [--model tiny-vlm] [--global-batch 8] [--micro-batch 4] [--steps 20] [--full]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cost_models.evaluate import evaluate  # noqa: E402
from planner.solver.baselines import homogeneous_plan  # noqa: E402
from planner.solver.layout_spec import LayoutSpec  # noqa: E402
from planner.calibrate.calibrate import calibrate  # noqa: E402
from planner.profiler.profile import profile_model  # noqa: E402
from runtime.source import call_factory, resolve  # noqa: E402


def measure_step_s(model_name: str, global_batch: int, micro_batch: int, steps: int, warmup: int) -> list[tuple[float, float]]:
    """(forward + backward of the m micro-batches, Adam step) wall seconds of each timed training step."""
    torch.manual_seed(0)
    model, batch = call_factory(resolve(model_name), micro_batch)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    m = global_batch // micro_batch
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        for _ in range(m):
            loss = model(**batch) / m
            loss.backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append((middle - start, time.perf_counter() - middle))
    return times


def run_step_s(plan_path: Path, model_name: str, steps: int, warmup: int) -> float:
    """Median step of `mmplan run` training the plan (after `warmup` steps)."""
    from planner.commands.run import run_plan

    result = run_plan(plan_path, steps=warmup + steps, model=model_name, overwrite=True)
    return statistics.median(row["step_time_s"] for row in result.metrics[warmup:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-vlm")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="full calibration (about a minute) instead of --quick")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    cluster = calibrate(quick=not args.full)
    # One rank: the plan uses one process; its "device" memory stays the per-rank share the calibration found.
    cluster = replace(cluster, gpus_per_node=1)
    print(f"calibrated in {time.perf_counter() - t0:.1f} s: fp32 peak {cluster.device.peak_flops['fp32'] / 1e9:.1f} GFLOP/s "
          f"per rank, memory {cluster.device.memory_bandwidth / 1e9:.1f} GB/s ({cluster.device.name})")

    torch.set_num_threads(1)  # the cost model describes a rank as one thread (calibrate measures it so)
    source = resolve(args.model)
    analytic = profile_model(source, micro_batch=args.micro_batch, device="meta")
    measured_profile = profile_model(source, micro_batch=args.micro_batch, device="cpu", measure=True)
    spec = LayoutSpec(tp=1, pp=1, dp=1, micro_batch=args.micro_batch)
    plan = homogeneous_plan(analytic, cluster, args.global_batch, spec)
    flops_ev = evaluate(plan, analytic)
    # The profile's block times were measured on device "cpu"; the cost model uses them on a cluster whose
    # device has that name (the calibrated one is named after the CPU model), so evaluate on a renamed copy.
    on_cpu = replace(cluster, device=replace(cluster.device, name=measured_profile.measured_on or "cpu"))
    blocks_ev = evaluate(replace(plan, cluster=on_cpu), measured_profile, on_cpu)

    import tempfile

    from plans.plan import save_plan

    with tempfile.TemporaryDirectory() as tmp:
        save_plan(plan, Path(tmp) / "plan.json")
        measured = run_step_s(Path(tmp) / "plan.json", args.model, args.steps, args.warmup)
    times = measure_step_s(args.model, args.global_batch, args.micro_batch, args.steps, args.warmup)
    bare = statistics.median(f + o for f, o in times)
    fwd_bwd, opt = statistics.median(f for f, _ in times), statistics.median(o for _, o in times)
    m = plan.training.micro_batches
    print(f"{args.model}: global batch {args.global_batch} = {m} micro-batches of {args.micro_batch}, fp32, Adam, "
          f"1 process x 1 thread; median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'':<36}{'step':>9}   {'fwd+bwd':>9} {'Adam':>8}   deviation of the step")
    print(f"{'measured: mmplan run':<36}{measured * 1e3:6.2f} ms")
    print(f"{'bare loop, no runtime (reference)':<36}{bare * 1e3:6.2f} ms   {fwd_bwd * 1e3:6.2f} ms {opt * 1e3:5.2f} ms")
    for label, ev in (("predicted, FLOPs / calibrated rate", flops_ev), ("predicted, measured block times", blocks_ev)):
        stage, step = ev.stages[0], ev.predicted.step_time_s
        print(f"{label:<36}{step * 1e3:6.2f} ms   {m * (stage.fwd_s + stage.bwd_s) * 1e3:6.2f} ms "
              f"{stage.optimizer_s * 1e3:5.2f} ms   {(step - measured) / measured * 100:+6.1f} %")


if __name__ == "__main__":
    main()
