"""Soak test: one long `mmplan run` on 2 CPU ranks, watched from outside — memory (RSS), open file descriptors and
disk use per step, and what is left behind at the end.

The run uses every tier that writes files (parameters, activations and optimizer state in the nvme tier) and
checkpoints every --checkpoint-every steps. Every --interval seconds the watcher samples, for the launcher and
each rank, VmRSS and the number of open fds (/proc), and the bytes under the NVMe directory, the checkpoint
directory and the run's TMPDIR; the step is the number of rows in the run's log.

Targets (after the warm-up, the first 10 % of the steps): per process, fds constant (growth 0) and RSS growing
by at most 20 MB over the rest of the run; checkpoint directory at most (kept + 1) checkpoints; NVMe directory
not growing; at the end the NVMe directory and TMPDIR hold nothing of the run's.

Checkpoints are DCP's (runtime/checkpoint_dcp.py) unless --checkpoint-format gather. Then (--save-reps > 0) the
save time per checkpoint of the largest model trained locally here (SAVE_MODEL, about 67 M parameters: 0.8 GB of
fp32 weights and Adam state) under a ZeRO-3 dp2 plan, DCP (each rank writes its shards) against the gathered
format (every block gathered, rank 0 writes it), and DCP's async save (the time the step is blocked: the snapshot),
medians over --save-reps saves, printed side by side with the target (DCP no slower than the gather).

Run: python bench/soak.py [--steps 1000] [--checkpoint-every 50] [--interval 0.5] [--keep DIR]
                          [--checkpoint-format dcp|gather] [--checkpoint-async] [--save-reps 5] [--save-only]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plans.plan import Memory, save_plan  # noqa: E402
from tests.runtime.plan_builder import make_plan  # noqa: E402

RSS_GROWTH_TARGET = 20e6  # bytes, per process, after warm-up
WARMUP_FRACTION = 0.1


def nvme_plan(path: Path) -> Path:
    first = ["vision", "vision_proj", "llm.embed"]
    save_plan(make_plan("tiny-vlm", [{"name": "all", "stages": [
        (first, [0], Memory(params="nvme", grads="cpu", activations={"*": "offload-nvme"})),
        (["llm"], [1], Memory(params="cpu", optimizer="nvme")),
    ]}], micro_batches=2), path)
    return path


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def rss(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def disk(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def steps_done(log: Path) -> int:
    try:
        with open(log, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def sample(launcher: int, work: Path, log: Path) -> dict:
    procs = {"launcher": launcher} | {f"rank {i}": pid for i, pid in enumerate(children(launcher))}
    return {"t": time.monotonic(), "step": steps_done(log),
            "rss": {name: rss(pid) for name, pid in procs.items()}, "fds": {name: fds(pid) for name, pid in procs.items()},
            "nvme": disk(work / "nvme"), "ckpt": disk(work / "ckpt"), "tmp": disk(work / "tmp")}


def floor_growth(values: list[float]) -> float:
    """How far the floor rose: the least value of the last quarter of the samples minus that of the first. A leak
    raises the floor; a sample taken mid-write (a checkpoint's file open, an NVMe file being swapped) is a spike
    above it and does not count."""
    q = max(1, len(values) // 4)
    return min(values[-q:]) - min(values[:q])


def growth(samples: list[dict], key: str, name: str) -> float | None:
    """The floor's growth after warm-up (floor_growth; None when the process was not seen)."""
    values = [s[key].get(name) for s in samples if s[key].get(name) is not None]
    return floor_growth(values) if len(values) >= 2 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--keep", type=Path, default=None, help="Work in this directory and keep it (default: a temporary one).")
    ap.add_argument("--checkpoint-format", choices=("dcp", "gather"), default="dcp")
    ap.add_argument("--checkpoint-async", action="store_true", help="DCP's async save in the soak run.")
    ap.add_argument("--save-reps", type=int, default=5, help="Saves timed per format (0: skip the save-time comparison).")
    ap.add_argument("--save-only", action="store_true", help="Only the save-time comparison, no soak run.")
    ap.add_argument("--save-model", default=None, help="Compare save times on this model (default: SAVE_MODEL, 67 M).")
    args = ap.parse_args()
    if args.save_only:
        return compare_save_times(args.save_reps, args.save_model)
    soaked = soak(args)
    return soaked if not args.save_reps else soaked | compare_save_times(args.save_reps, args.save_model)


def soak(args: argparse.Namespace) -> int:
    """The soak run itself: sampled from outside, then checked against the targets."""
    work = args.keep or Path(tempfile.mkdtemp(prefix="mmplan-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "tmp").mkdir(exist_ok=True)
    plan, log = nvme_plan(work / "plan.json"), work / "run.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(work / "tmp")}
    cmd = [sys.executable, "-m", "planner.cli", "run", str(plan), "--steps", str(args.steps), "--nvme-dir", str(work / "nvme"),
           "--checkpoint-every", str(args.checkpoint_every), "--checkpoint-dir", str(work / "ckpt"), "--log", str(log),
           "--checkpoint-format", args.checkpoint_format, *(["--checkpoint-async"] if args.checkpoint_async else []),
           "--quiet", "--timeout", str(max(600, args.steps * 5))]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = []
    while proc.poll() is None:
        samples.append(sample(proc.pid, work, log))
        time.sleep(args.interval)
    out, err = proc.communicate()
    wall = time.monotonic() - started
    if proc.returncode:
        print(f"run failed (exit {proc.returncode}): {err.strip()}")
        return 1

    # one row per tenth of the run: what a step costs, over time
    print(f"{args.steps} steps in {wall:.0f} s; {len(samples)} samples")
    names = sorted({n for s in samples for n in s["rss"]})
    header = f"{'step':>6} " + " ".join(f"{n + ' RSS MB':>16} {'fds':>4}" for n in names) + f" {'nvme MB':>8} {'ckpt MB':>8} {'tmp MB':>7}"
    print(header)
    shown = -1
    for s in samples:
        if s["step"] >= shown + max(1, args.steps // 10):
            shown = s["step"]
            cells = " ".join(f"{(s['rss'].get(n) or 0) / 1e6:>16.1f} {s['fds'].get(n) or 0:>4}" for n in names)
            print(f"{s['step']:>6} {cells} {s['nvme'] / 1e6:>8.2f} {s['ckpt'] / 1e6:>8.2f} {s['tmp'] / 1e6:>7.2f}")

    steady = [s for s in samples if WARMUP_FRACTION * args.steps <= s["step"] < args.steps]  # training, not teardown
    ok = True

    def check(label: str, value, target: str, passed: bool) -> None:
        nonlocal ok
        ok &= passed
        print(f"{label:<46} {value:>14}   target {target:<22} {'ok' if passed else 'FAIL'}")

    print()
    for n in names:
        g = growth(steady, "rss", n)
        if g is not None:
            check(f"{n}: RSS growth after warm-up", f"{g / 1e6:+.1f} MB", f"<= {RSS_GROWTH_TARGET / 1e6:.0f} MB", g <= RSS_GROWTH_TARGET)
        g = growth(steady, "fds", n)
        if g is not None:
            check(f"{n}: open fds growth after warm-up", f"{g:+d}", "0", g <= 0)
    one = max((s["ckpt"] for s in samples[: max(1, len(samples) // 10)]), default=0) or max(s["ckpt"] for s in samples)
    peak_ckpt = max(s["ckpt"] for s in samples)
    check("checkpoint directory, peak", f"{peak_ckpt / 1e6:.2f} MB", "<= 3 checkpoints", peak_ckpt <= 3 * max(one, 1) + 1e6)
    nv = [s["nvme"] for s in steady]
    check("NVMe directory growth after warm-up", f"{floor_growth(nv) / 1e6:+.2f} MB" if nv else "-", "<= 1 MB",
          not nv or floor_growth(nv) <= 1e6)
    left_nvme = [str(p) for p in (work / "nvme").rglob("*")] if (work / "nvme").exists() else []
    check("files left in the NVMe directory", len(left_nvme), "0", not left_nvme)
    left_tmp = [p for p in (work / "tmp").rglob("*") if p.is_file() or p.name.startswith("mmplan-")]
    check("files left in TMPDIR", len(left_tmp), "0", not left_tmp)
    rows = steps_done(log)
    check("log rows", rows, f"{args.steps}", rows == args.steps)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


# The largest model this 2-core, ~20 GB host trains in the bench: LLaVA-shaped, a 4-layer ViT and a 6-layer
# 768-wide Llama with a 16k vocabulary (about 67 M parameters; 0.27 GB of fp32 weights, 0.54 GB of Adam moments).
SAVE_MODEL = """
name = "soak-save-vlm"
dtype = "fp32"

[vision]
image_size = 32
patch = 8
hidden = 256
layers = 4
heads = 4
class_token = true

[decoder]
type = "llama"
hidden = 768
layers = 6
heads = 12
mlp = 2048
vocab = 16000
text_seq = 16
"""
_REPS = {"n": 0}  # saves per worker (read by the forked ranks)


def _timed_saves(ctx, job) -> dict:
    """One rank: build the trainer (Adam state allocated), then time `n` saves (barrier to barrier) and, for DCP, how
    long an async save blocks the caller (the snapshot) until its completion."""
    import torch
    import torch.distributed as dist

    from runtime.train import RankTrainer

    torch.manual_seed(job.seed)
    trainer = RankTrainer(ctx, job)
    times, blocked = [], []
    try:
        for i in range(_REPS["n"]):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.save_checkpoint(i + 1)
            t1 = time.perf_counter()
            dist.barrier()
            if job.checkpoint_async:
                blocked.append(t1 - t0)
                trainer.finish_checkpoint()
                dist.barrier()
            times.append(time.perf_counter() - t0)
        return {"times": times, "blocked": blocked}
    finally:
        trainer.close()


def compare_save_times(reps: int, model: str | None = None) -> int:
    """Median save time per checkpoint of SAVE_MODEL (or `model`, a zoo name or TOML) under ZeRO-3 dp2: DCP,
    gathered, DCP async (its blocking part)."""
    from statistics import median

    from runtime.launch import launch
    from runtime.train import Job

    work = Path(tempfile.mkdtemp(prefix="mmplan-soak-save-"))
    try:
        arch = work / "model.toml"
        arch.write_text(SAVE_MODEL)
        arch = model or str(arch)
        plan = make_plan(arch, [{"name": "all", "dp": 2, "zero": 3, "stages": [(["vision", "vision_proj", "llm"], [0, 1])]}])
        _REPS["n"] = reps
        rows = {}
        for label, fmt, asynchronous in (("dcp", "dcp", False), ("gather", "gather", False), ("dcp async", "dcp", True)):
            ckpt = work / f"ckpt-{fmt}-{int(asynchronous)}"
            job = Job(plan=plan, model=arch, steps=1, checkpoint_every=1, checkpoint_dir=str(ckpt),
                      checkpoint_format=fmt, checkpoint_async=asynchronous, lineage="bench")
            result = launch(_timed_saves, 2, job, timeout_s=3600, op_timeout_s=1800)[0]
            step_dir = max(p for p in ckpt.iterdir() if p.name.startswith("step-"))
            rows[label] = (median(result["times"]), median(result["blocked"]) if result["blocked"] else None, disk(step_dir))
            shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    name = model or SAVE_MODEL.split("name = ")[1].split()[0].strip('"')
    print(f"\nsave time per checkpoint, {name} (ZeRO-3 dp2, 2 CPU ranks), "
          f"median of {reps}")
    for label, (t, blocked, size) in rows.items():
        extra = f"; the step blocked {blocked:.2f} s" if blocked is not None else ""
        print(f"  {label:<10} {t:7.2f} s  ({size / 1e6:.0f} MB on disk{extra})")
    ok = rows["dcp"][0] <= rows["gather"][0]
    print(f"  dcp / gather: {rows['dcp'][0] / rows['gather'][0]:.2f}x   target <= 1.00x (no slower)   {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
