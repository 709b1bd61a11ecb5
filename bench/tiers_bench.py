"""Memory-tier benchmark on local CPU ranks (gloo, one thread each).

(1) Beyond device memory: tiny-vlm under a device-tier budget of a quarter of its training state, with the
    solver's tier plan, vs the same model with no budget (the solver's unconstrained plan), prefetch on and
    off, and the tier plan's micro-batches run with every state on the device and nothing offloaded ("same
    micro-batches": no tier at all, no budget). Prints each row's step time, its ratio to the unbudgeted step and
    the cost model's prediction. Targets: <= 1.5x the unbudgeted step with prefetch, predicted within 15 %.
(2) Where heterogeneity pays on real processes: a per-rank device-tier cap under which the whole
    tiny-vlm-heavy does not fit one rank; on 2 ranks, the solver's plan vs the best homogeneous plan under
    the same cap, both trained. Targets: measured speed-up >= 1.2x, predicted speed-up within 15 % of it.

Run: python bench/tiers_bench.py [--steps 30] [--only 1|2]. Medians over the steps after the first two, three
alternated rounds.

Where the time went (issue 33; 2-core machine shared with other engineers: load 0.4-13, CPU time per step of the
rank measured with time.thread_time beside the wall figures):
- Before: the solver's tier plan was params/grads/optimizer on cpu, every block recomputed, 4 micro-batches:
  56.6 ms against 10.6 ms unbudgeted (5.3x; the issue's quiet run 205.5 vs 18.3 ms). Recompute cost +24 ms at 4
  micro-batches; the ParamStore's prefetch on its I/O thread +31 ms (GIL hand-offs, ~0.4 ms per block: the thread
  sat between the core and a 100 kB memcpy; "prefetch off" still loaded through the same thread, hence no
  difference between the rows). The tier ILP hid every transfer behind compute even on gloo ranks, where the
  simulator hides none, so offload-cpu and offload-nvme tied; it chose NVMe, the simulator priced that above
  recompute, and recompute stayed.
- Fixed: host-tier copies on a CPU rank run inline (tier_io.TierIO.submit inline; parameters and activations),
  parameter byte views are made once, an offloaded copy is uncounted by __del__ rather than weakref.finalize, and the
  ILP charges transfers on gloo as the simulator does. The solver now offloads activations to cpu (measured peak
  1.05 MB under the 1.26 MB budget).
- What remains, per step at 4 micro-batches (load ~4-13, so figures are high): the untiered run at the same
  4 micro-batches is already 2.1-2.2x the unbudgeted one -- the budget forces them (at 8 samples the largest layer's
  activations alone are 1.25 MB; at 2 micro-batches no tier assignment fits, predicted 1.31 MB with every block
  recomputed), and each micro-batch pays its ~1,000 eager op dispatches again (Cluster.forward_op_s / backward_op_s).
  The tiers add 1.6-1.7x on top: per offloaded storage ~30 us (pack + unpack, 308 storages a step: ~10 ms), the
  per-block Adam with its write-back +1.7 ms, gradients moved to the host tier +2 ms, parameters streamed per block
  (~28 us a block, 84 a step) and their hooks +3.5 ms. The copied bytes themselves are ~10 MB a step, ~1 ms.
- So the 1.5x target is out of reach at this budget on this machine: its floor (no tiers, the micro-batches the
  budget needs) is ~2.1x. Prefetch cannot hide anything on a CPU rank (the copy takes the core the compute uses:
  offload.overlaps_compute) and is priced as hiding nothing; on vs off measure the same (149.7 vs 147.6 ms loaded)
  and prefetch holds one block more (peak 1.05 vs 0.41 MB).
- The cost model prices each copy (offload.transfer_time copies: the link's alpha per tensor / storage, per file on
  NVMe) and the offloaded copy's extra accounting (offload_accounting: saved_tensor_s + released_tensor_s, measured
  by `mmplan calibrate`). It still predicts the tiered row low (-35 % loaded: 96 vs 150 ms, while the untiered row
  at the same micro-batches is +1 %): the per-storage Python work grows with the machine's load, the calibrated
  per-call constants do not. In isolation (one thread, a block saving 20 storages, offload-cpu against keep) an
  offloaded storage costs ~20 us more, 15 us of it priced; the parameter store's per-block work and the hooks of
  the streamed blocks (above) are priced only as one copy per tensor.
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
