"""GPU check: every CUDA code path of mmplan on one GPU, in at most 8 minutes, as one table (ok / FAIL / skip).

Rows (each through the CLI a user runs, in its own process, so no CUDA state leaks between them):
  1. `mmplan profile --device cuda --measure` of a real-size model (llava-1.5-7b: its LLM layer is a 7B-class
     block), the measured fwd/bwd times and the FLOP/s they imply;
  2. the same for the model the other rows train (a ~0.6 B-parameter LLaVA-shaped arch TOML);
  3. a 1-rank plan, everything on the GPU (the reference losses of the rows below);
  4. the same plan with parameters, gradients and Adam state on the CPU and activations offloaded to pinned
     host memory, prefetched one block ahead on a side CUDA stream: losses must equal row 3;
  5. offload without prefetch, and how much of the offload cost prefetching hides (the overlap);
  6. full recomputation: losses equal row 3, measured peak memory lower;
  7. a ZeRO-3 step at world size 1 through the normal `run` path ("skip" naming the refusal when the runtime
     does not train ZeRO yet);
  8. checkpoint at step 4, resume to step 6: losses equal the uninterrupted run's;
  9. predicted vs measured step time and peak GPU memory of row 3 (the plan predicted from row 2's measured
     block times);
 10. `mmplan calibrate --device cuda` under torchrun on every local GPU: the cluster TOML it writes (GEMM efficiency
     of the largest shape, the NCCL link within the node, FSDP2's per-block cost); on CPU, its one-line refusal.
Bands for ok in row 9: step time within 0.5-2x, peak memory within 0.7-1.3x of the prediction (wide on
purpose: this checks the paths are wired, not the model's accuracy; compare --trace does that). In the CPU dry
run the step-time band and the prefetch overlap are reported as "skip" when outside (no side stream on CPU;
block timings on a shared host are noise), never as ok.

Run: python bench/gpu_check.py                 (needs a CUDA device; says so and exits 0 without one)
     python bench/gpu_check.py --device cpu    (a dry run: the same steps on CPU at small sizes)
Exit code: 0 when no row FAILed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 6  # steps of every training row; the median step time skips the first two (warm-up)

# The model the training rows use: LLaVA-shaped (ViT -> MLP projector -> GPT), fp32. On CUDA ~0.6 B parameters
# (training state ~10 GB, a step well above launch overheads); on CPU the small example TOML's sizes.
SIZES = {
    "cuda": dict(image_size=224, patch=14, vhidden=1024, vlayers=4, vheads=16, proj=2048,
                 hidden=2048, layers=8, heads=16, vocab=32000, seq=512, global_batch=8, micro_batches=2),
    "cpu": dict(image_size=32, patch=8, vhidden=64, vlayers=2, vheads=4, proj=128,
                hidden=64, layers=2, heads=4, vocab=256, seq=16, global_batch=8, micro_batches=2),
}
REAL_SIZE = {"cuda": "llava-1.5-7b", "cpu": "tiny-vlm"}  # row 1's model
CLUSTER = {"cuda": "1xh200", "cpu": "1xlocal-cpu"}


@dataclass
class Row:
    name: str
    status: str = "skip"  # ok | FAIL | skip
    detail: str = ""
    seconds: float = 0.0


class Failed(Exception):
    """A step's command failed: its one-line error."""


class Check:
    def __init__(self, device: str, budget_s: float, work: Path) -> None:
        self.device, self.work = device, work
        self.deadline = time.monotonic() + budget_s
        self.rows: list[Row] = []
        self.runs: dict[str, list[dict]] = {}

    # --- running CLI commands ------------------------------------------------------------------------------
    def cli(self, *args: str) -> str:
        """`mmplan ARGS` in a fresh process (stdout returned); Failed with its error line, or at the budget's end."""
        left = self.deadline - time.monotonic()
        if left < 5:
            raise TimeoutError("the time budget is spent")
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        try:
            done = subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=self.work, env=env,
                                  capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"mmplan {args[0]} ran past the time budget") from None
        if done.returncode:
            lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
            raise Failed(lines[-1] if lines else f"exit code {done.returncode}")
        return done.stdout

    def train(self, key: str, plan: Path, *extra: str, steps: int = STEPS) -> list[dict]:
        log = self.work / f"{key}.jsonl"
        self.cli("run", str(plan), "--steps", str(steps), "--log", str(log), "--overwrite", "--quiet",
                 "--profile", str(self.work / "model-profile.json"), *extra)
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        self.runs[key] = rows
        return rows

    def row(self, name: str, fn) -> None:
        row = Row(name)
        t0 = time.monotonic()
        try:
            row.status, row.detail = fn()
        except TimeoutError as e:
            row.status, row.detail = "skip", str(e)
        except Failed as e:
            row.status, row.detail = "FAIL", str(e)
        except Exception as e:  # noqa: BLE001 - a bug in a step is that row's failure, the others still run
            row.status, row.detail = "FAIL", f"{type(e).__name__}: {e}"
        row.seconds = time.monotonic() - t0
        self.rows.append(row)
        print(f"  {row.status:4}  {name}: {row.detail}  ({row.seconds:.0f} s)", file=sys.stderr, flush=True)

    # --- the rows -------------------------------------------------------------------------------------------
    def profile_real_size(self) -> tuple[str, str]:
        out = self.work / "real-profile.json"
        self.cli("profile", REAL_SIZE[self.device], "--device", self.device, "--measure", "-o", str(out))
        blocks = json.loads(out.read_text())["blocks"]
        timed = [b for b in blocks if b.get("fwd_ms") and b.get("bwd_ms")]
        if not timed:
            return "FAIL", "no block has measured times"
        big = max(timed, key=lambda b: b["fwd_flops"])
        tflops = big["fwd_flops"] / (big["fwd_ms"] / 1e3) / 1e12
        return "ok", (f"{REAL_SIZE[self.device]}: {len(timed)}/{len(blocks)} blocks timed; {big['name']} fwd "
                      f"{big['fwd_ms']:.3g} ms bwd {big['bwd_ms']:.3g} ms ({tflops:.3g} TFLOP/s fwd per sample)")

    def profile_model(self) -> tuple[str, str]:
        toml = self.work / "model.toml"
        toml.write_text(model_toml(SIZES[self.device]))
        out = self.work / "model-profile.json"
        self.cli("profile", str(toml), "--device", self.device, "--measure", "-o", str(out))
        data = json.loads(out.read_text())
        params = sum(b["params"] for b in data["blocks"])
        return "ok", f"{params / 1e6:.0f} M parameters, {len(data['blocks'])} blocks, measured on {data.get('measured_on')}"

    def build_plans(self) -> dict[str, Path]:
        from cost_models.cluster_spec import parse_cluster
        from planner.solver.baselines import homogeneous_plan
        from plans.graph import load_profile
        from plans.plan import Memory, check_plan, save_plan

        prof = load_profile(self.work / "model-profile.json")
        size = SIZES[self.device]
        spec = f"tp=1,pp=1,dp=1,micro-batch={size['global_batch'] // size['micro_batches']}"
        base = homogeneous_plan(prof, parse_cluster(CLUSTER[self.device]), size["global_batch"], spec)
        self.predicted = base.predicted
        group = base.groups[0]
        blocks = [b for s in group.stages for b in s.blocks]

        def with_memory(memory: Memory, **group_fields) -> object:
            g = replace(group, stages=tuple(replace(s, memory=memory) for s in group.stages), **group_fields)
            return check_plan(replace(base, groups=(g,)), prof)

        plans = {
            "keep": base,
            "offload": with_memory(Memory(params="cpu", grads="cpu", optimizer="cpu",
                                          activations={b: "offload-cpu" for b in blocks})),
            "recompute": with_memory(Memory(activations={b: "recompute" for b in blocks})),
            "zero3": with_memory(Memory(), zero=3),
        }
        paths = {}
        for key, plan in plans.items():
            paths[key] = self.work / f"plan-{key}.json"
            save_plan(plan, paths[key])
        return paths

    def plan_row(self, paths: dict[str, Path]) -> tuple[str, str]:
        paths.update(self.build_plans())
        p = self.predicted
        return "ok", f"{', '.join(paths)}; predicted {p.step_time_s:.3g} s/step, {_gb(p.memory[0].gpu)} GPU memory"

    def keep(self, paths) -> tuple[str, str]:
        rows = self.train("keep", paths["keep"])
        return "ok", f"{len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, {_median_s(rows):.3g} s/step"

    def offload(self, paths) -> tuple[str, str]:
        rows = self.train("offload", paths["offload"])
        diff = _max_rel(rows, self.runs["keep"])
        status = "ok" if diff <= 1e-6 else "FAIL"
        return status, (f"losses vs all-on-GPU: max rel. diff {diff:.1e}; {_median_s(rows):.3g} s/step, peak device "
                        f"{_gb(_peak(rows))} (all on GPU: {_gb(_peak(self.runs['keep']))})")

    def overlap(self, paths) -> tuple[str, str]:
        rows = self.train("offload-no-prefetch", paths["offload"], "--no-prefetch")
        keep, pre, nopre = (_median_s(self.runs[k]) for k in ("keep", "offload", "offload-no-prefetch"))
        cost = nopre - keep
        hidden = (nopre - pre) / cost if cost > 0 else float("nan")
        status = "ok" if pre <= nopre * 1.05 and _max_rel(rows, self.runs["keep"]) <= 1e-6 else "FAIL"
        if self.device == "cpu" and status == "FAIL" and _max_rel(rows, self.runs["keep"]) <= 1e-6:
            status = "skip"  # no side stream on CPU: prefetch is a thread, and on a few shared cores it may cost
        return status, (f"offload step {nopre:.3g} s without prefetch, {pre:.3g} s with, {keep:.3g} s all on GPU: "
                        f"prefetch hides {hidden:.0%} of the offload cost")

    def recompute(self, paths) -> tuple[str, str]:
        rows = self.train("recompute", paths["recompute"])
        diff = _max_rel(rows, self.runs["keep"])
        lower = _peak(rows) < _peak(self.runs["keep"])
        status = "ok" if diff <= 1e-6 and lower else "FAIL"
        return status, (f"losses max rel. diff {diff:.1e}; peak {_gb(_peak(rows))} vs {_gb(_peak(self.runs['keep']))} kept; "
                        f"{_median_s(rows):.3g} s/step")

    def zero3(self, paths) -> tuple[str, str]:
        try:
            rows = self.train("zero3", paths["zero3"])
        except Failed as e:
            if "zero" in str(e).lower():
                return "skip", f"not supported yet: {str(e).removeprefix('error: ')}"
            raise
        diff = _max_rel(rows, self.runs["keep"])
        return ("ok" if diff <= 1e-5 else "FAIL"), f"losses vs ZeRO 0: max rel. diff {diff:.1e}; {_median_s(rows):.3g} s/step"

    def resume(self, paths) -> tuple[str, str]:
        ckpt = self.work / "ckpt"
        first = self.train("ckpt", paths["keep"], "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt), steps=4)
        second = self.train("resumed", paths["keep"], "--resume", str(ckpt), steps=STEPS)
        joined = first + second
        if [r["step"] for r in joined] != list(range(STEPS)):
            return "FAIL", f"steps {[r['step'] for r in joined]}"
        diff = _max_rel(joined, self.runs["keep"])
        return ("ok" if diff <= 1e-6 else "FAIL"), f"steps 0-3, resumed 4-5: losses vs uninterrupted max rel. diff {diff:.1e}"

    def predicted_time(self, paths) -> tuple[str, str]:
        measured, predicted = _median_s(self.runs["keep"]), self.predicted.step_time_s
        ratio = measured / predicted
        status = "ok" if 0.5 <= ratio <= 2.0 else "FAIL" if self.device == "cuda" else "skip"  # CPU: a shared host's noise
        return status, f"predicted {predicted:.3g} s, measured {measured:.3g} s ({ratio:.2f}x)"

    def predicted_memory(self, paths) -> tuple[str, str]:
        measured, predicted = _peak(self.runs["keep"]), self.predicted.memory[0].gpu
        ratio = measured / predicted
        return ("ok" if 0.7 <= ratio <= 1.3 else "FAIL"), f"predicted {_gb(predicted)}, measured {_gb(measured)} ({ratio:.2f}x)"

    def all(self) -> None:
        self.row("profile --measure, real-size block", self.profile_real_size)
        self.row("profile --measure, the trained model", self.profile_model)
        if self.rows[-1].status != "ok":
            return
        paths: dict[str, Path] = {}
        self.row("plans from the measured profile", lambda: self.plan_row(paths))
        if self.rows[-1].status != "ok":
            return
        self.row("1 rank, all on GPU", lambda: self.keep(paths))
        if self.rows[-1].status != "ok":
            return
        self.row("CPU offload + prefetch (side stream)", lambda: self.offload(paths))
        if "offload" in self.runs:
            self.row("offload overlap (prefetch on/off)", lambda: self.overlap(paths))
        self.row("recompute (full)", lambda: self.recompute(paths))
        self.row("ZeRO-3, world 1", lambda: self.zero3(paths))
        self.row("checkpoint + resume", lambda: self.resume(paths))
        self.row("predicted vs measured step time", lambda: self.predicted_time(paths))
        self.row("predicted vs measured peak memory", lambda: self.predicted_memory(paths))
        self.row("calibrate --device cuda", self.calibrate_cuda)

    def calibrate_cuda(self) -> tuple[str, str]:
        """Row 10: the GPU calibration under torchrun (every local GPU), read back as the solver reads it."""
        out = self.work / "calibrated.toml"
        if self.device == "cpu":
            try:
                self.cli("calibrate", "--device", "cuda", "-o", str(out))
            except Failed as e:
                return ("ok", f"refused: {e}") if "needs CUDA" in str(e) else ("FAIL", str(e))
            return "FAIL", "calibrate --device cuda ran without CUDA"
        import torch

        from cost_models.cluster_toml import load_cluster_toml
        from cost_models.hardware import efficiency

        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={torch.cuda.device_count()}", "-m", "planner.cli", "calibrate",
                               "--device", "cuda", "-o", str(out)], cwd=self.work, env=env, capture_output=True,
                              text=True, timeout=max(5.0, self.deadline - time.monotonic()))
        if done.returncode:
            lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
            return "FAIL", lines[-1] if lines else f"exit code {done.returncode}"
        cl = load_cluster_toml(out)
        top = max(f for f, _ in cl.device.efficiency)
        return "ok", (f"{cl.gpus_per_node} GPU(s): GEMM {efficiency(cl.device, top):.0%} of {cl.device.peak_flops['bf16'] / 1e12:.0f} "
                      f"TFLOP/s at {top:.2g} FLOPs; NVLink {cl.intra_node.bandwidth / 1e9:.0f} GB/s "
                      f"{cl.intra_node.latency_s * 1e6:.1f} us; FSDP2 {cl.zero_block_s * 1e3:.2f} ms per block")


def model_toml(s: dict) -> str:
    return f"""name = "gpu-check-vlm"
dtype = "fp32"

[vision]
image_size = {s['image_size']}
patch = {s['patch']}
hidden = {s['vhidden']}
layers = {s['vlayers']}
heads = {s['vheads']}
class_token = true

[projector]
hidden = {s['proj']}

[decoder]
type = "gpt"
hidden = {s['hidden']}
layers = {s['layers']}
heads = {s['heads']}
vocab = {s['vocab']}
text_seq = {s['seq']}
"""


def _median_s(rows: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in (rows[2:] or rows))


def _peak(rows: list[dict]) -> float:
    return max(max(r["peak_memory_bytes"]) for r in rows)


def _max_rel(rows: list[dict], ref: list[dict]) -> float:
    by_step = {r["step"]: r["loss"] for r in ref}
    return max(abs(r["loss"] - by_step[r["step"]]) / max(abs(by_step[r["step"]]), 1e-12) for r in rows)


def _gb(n: float) -> str:
    from plans.units import format_bytes

    return format_bytes(n)


def table(rows: list[Row], device: str) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"mmplan GPU check ({device})")
    for col in ("check", "status", "detail", "s"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r.name, r.status, r.detail, f"{r.seconds:.0f}")
    console = Console(width=160, highlight=False, markup=False)
    with console.capture() as cap:
        console.print(t)
    return cap.get()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default) or cpu: a dry run of the same steps at small sizes")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting new steps after this many seconds")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # does not initialise CUDA in this process
            print("no CUDA device here: nothing to check (python bench/gpu_check.py --device cpu runs the same steps "
                  "on CPU at small sizes)")
            return 0
    with tempfile.TemporaryDirectory(prefix="mmplan-gpu-check-") as work:
        check = Check(args.device, args.budget_s, Path(work))
        check.all()
    print(table(check.rows, args.device))
    return 1 if any(r.status == "FAIL" for r in check.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
