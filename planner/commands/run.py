"""`mmplan run`: check a plan against its model, launch the ranks (or join torchrun), report predicted vs measured.

What a run owns, and gives back on every exit path (success, refusal, a failing rank, Ctrl-C, SIGTERM, SIGHUP):
- its --checkpoint-dir, locked for the run (a second run on it is refused); a directory holding another run's
  checkpoints is refused unless resumed from (--resume) or --overwrite is given, and even then they are only
  replaced once this run's first checkpoint is complete; incomplete step directories are removed on failure;
- its --log, locked for the run (a second run writing into it is refused), appended to when resuming, else refused
  when it holds a log unless --overwrite; never followed through a symbolic link; removed again when a failed run
  wrote nothing into a file it created;
- a directory of its own inside --nvme-dir (locked; removed at the end, and by the next run if this one was
  SIGKILLed), so no tier file outlives the run;
- the directories it created, removed again when the run fails while they are empty.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cost_models.evaluate import Evaluation, evaluate
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan, check_plan, load_plan
from planner.commands.actual import Actual, on_actual_cluster
from planner.commands.monitor import Monitor, MonitorOptions, check_monitor
from runtime.checkpoint import remove_incomplete
from runtime.preflight import (CheckedModel, backend, check_host_memory, check_launch, check_model, plan_model,
                               check_runs, check_zero, check_zero_shares, launched_world_size)
from runtime.source import resolve
from runtime.train import Job, train_rank

@dataclass(frozen=True)
class PreparedRun:
    """A plan read and checked once for `mmplan run`: the runtime's model check (runtime/preflight.py), the cluster
    it runs on, and the cost model's one evaluation of it (with a profile)."""

    checked: CheckedModel  # the plan (with its flow), the model spec, the model built on meta and traced
    profile: Profile | None  # the one given to run (None: predictions come from the plan)
    actual: Actual  # the cluster this run is on (planner/commands/actual.py)
    evaluation: Evaluation | None  # the plan evaluated with `profile` on that cluster (None without a profile)

    @property
    def plan(self) -> Plan:
        return self.checked.plan

    @property
    def predicted(self) -> Any:
        """What to compare the measured run with: the evaluation, the plan's prediction on this cluster, or its own."""
        if self.evaluation is not None:
            return self.evaluation
        return self.actual.predicted if self.actual.predicted is not None else self.plan.predicted


@dataclass(frozen=True)
class RunResult:
    plan: Plan
    profile: Profile | None  # the one given to run (None: predictions come from the plan)
    metrics: list[dict[str, Any]]  # one row per step (rank 0's view of all ranks); empty on other torchrun ranks
    rank: int


def prepare_run(plan_path: Path, model: str | None = None, profile: Profile | None = None, *,
                predict: bool = True) -> PreparedRun:
    """Load the plan (its flow taken from `profile` when given), check it against its model, find the cluster it
    runs on and evaluate it there once with `profile`. Without `profile`, a plan solved for another kind of cluster
    is predicted with the model's profile on the meta device (FLOPs, bytes: no measured times) when `predict`.
    It owns nothing yet: a signal ends it at once (runtime/signals.exit_at_once)."""
    from runtime.signals import exit_at_once

    with exit_at_once():
        return _prepare_run(plan_path, model, profile, predict)


def _prepare_run(plan_path: Path, model: str | None, profile: Profile | None, predict: bool) -> PreparedRun:
    plan = load_plan(plan_path)
    if profile is not None:
        plan = check_plan(plan, profile, f"plan {plan_path}")
    # a plan this host cannot start, a model spec that names nothing (a mistyped zoo name, an hf: model without the
    # transformers extra): refused before the model is built and traced (seconds to minutes)
    check_launch(plan, plan_path, launched_world_size())
    resolve(model or plan_model(plan, plan_path))
    checked = check_model(plan, plan_path, model)
    plan = checked.plan
    check_runs(checked, plan_path)
    actual = on_actual_cluster(plan, None, backend(plan))
    evaluation = evaluate(plan, profile, None if actual.same else actual.cluster) if profile is not None else None
    if not actual.same and (profile is not None or predict):
        actual = on_actual_cluster(plan, profile or _meta_profile(checked), backend(plan), evaluation=evaluation)
    return PreparedRun(checked, profile, actual, evaluation)


def _meta_profile(checked: CheckedModel) -> Profile | None:
    """The model's profile on the meta device (None when it cannot be made)."""
    from planner.profiler.profile import profile_model

    try:
        profile = profile_model(resolve(checked.spec), device="meta")
    except MmplanError:
        return None
    return profile if profile.fingerprint == checked.plan.profile.fingerprint else None


def run_plan(plan_path: Path, *, steps: int, model: str | None = None, seed: int = 0, lr: float = 1e-3,
             data: str | None = None, log: Path | None = None, timeout_s: float | None = None,
             op_timeout_s: float = 300.0, device_budget: float | None = None, nvme_dir: Path | None = None,
             prefetch: bool = True, checkpoint_every: int = 0, checkpoint_dir: Path | None = None,
             resume: Path | None = None, overwrite: bool = False, profile: Profile | None = None,
             trace: Path | None = None, monitor: MonitorOptions | None = None,
             prepared: PreparedRun | None = None, checkpoint_format: str = "dcp",
             checkpoint_async: bool = False) -> RunResult:
    """Train up to step `steps` with the plan (from the checkpoint's step when resuming); rank 0's metrics.

    `timeout_s`: wall-clock limit of the whole run (None: none — a hang is caught by `op_timeout_s`, the bound on
    every collective and receive). `monitor`: the progress bar, log lines and TensorBoard of planner/commands/monitor.py.
    `prepared`: the plan already read and checked by `prepare_run` (else it is here, with `model` and `profile`).

    `overwrite`: let this run replace the checkpoints in `checkpoint_dir` and the log in `log` (see the module
    docstring for what is refused without it)."""
    check_options(steps=steps, lr=lr, checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir,
                   device_budget=device_budget, timeout_s=timeout_s, op_timeout_s=op_timeout_s,
                   checkpoint_format=checkpoint_format, checkpoint_async=checkpoint_async)
    launched = launched_world_size()
    monitor = monitor or MonitorOptions(show=False)
    check_monitor(monitor)
    check_files(log=log, resume=resume, checkpoint_dir=checkpoint_dir, overwrite=overwrite)
    prepared = prepared or prepare_run(plan_path, model, profile, predict=False)
    plan = prepared.plan
    from runtime.signals import exit_at_once

    with exit_at_once():  # the pre-check owns nothing yet
        check_zero(plan, plan_path)
        check_zero_shares(prepared.checked, plan_path, None if data in (None, "builtin") else data)
        if launched is None:
            memory = prepared.evaluation.memory if prepared.evaluation is not None else (plan.predicted.memory if plan.predicted else ())
            check_host_memory(prepared.checked, plan_path, sum(m.gpu + m.cpu for m in memory))
    job = Job(plan=plan, model=prepared.checked.spec, steps=steps, seed=seed, lr=lr,
              data=None if data in (None, "builtin") else data, log=str(log) if log else None,
              device_budget=device_budget, prefetch=prefetch, checkpoint_every=checkpoint_every,
              checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, resume=str(resume) if resume else None,
              trace=trace is not None, checkpoint_format=checkpoint_format, checkpoint_async=checkpoint_async)
    results = _train_owning(job, resume=resume, checkpoint_dir=checkpoint_dir, nvme_dir=nvme_dir, log=log,
                            overwrite=overwrite, monitor=monitor, timeout_s=timeout_s, op_timeout_s=op_timeout_s)
    rank = int(os.environ.get("RANK", 0))
    if trace is not None and rank == 0 and results[0].get("trace"):
        write_trace(trace, results[0]["trace"], results[0]["metrics"])
    return RunResult(plan, prepared.profile, results[0]["metrics"], rank)


def check_options(*, steps: int, lr: float, checkpoint_every: int, checkpoint_dir: Path | None,
                   device_budget: float | None, timeout_s: float | None, op_timeout_s: float,
                   checkpoint_format: str = "dcp", checkpoint_async: bool = False) -> None:
    """The options of a run, refused in one line before anything is read. `checkpoint_format`: dcp
    (torch.distributed.checkpoint shards, runtime/checkpoint_dcp.py) or gather (one file per block, checkpoint.py)."""
    if checkpoint_format not in ("dcp", "gather"):
        raise MmplanError(f"--checkpoint-format must be dcp or gather, got {checkpoint_format!r}")
    if checkpoint_async and checkpoint_format != "dcp":
        raise MmplanError("--checkpoint-async needs --checkpoint-format dcp (a gathered checkpoint is written in the step)")
    if steps < 1:
        raise MmplanError(f"--steps must be >= 1, got {steps}")
    if not (lr > 0 and math.isfinite(lr)):
        raise MmplanError(f"--lr must be a finite number > 0, got {lr:g}")
    if checkpoint_every < 0:
        raise MmplanError(f"--checkpoint-every must be >= 0, got {checkpoint_every}")
    if checkpoint_every and checkpoint_dir is None:
        raise MmplanError("--checkpoint-every needs --checkpoint-dir")
    if checkpoint_dir is not None and not checkpoint_every:
        raise MmplanError("--checkpoint-dir needs --checkpoint-every K (write a checkpoint every K steps); without it "
                          "nothing would be written there")
    if device_budget is not None and not device_budget > 0:
        raise MmplanError(f"--device-budget must be a number of bytes > 0, got {device_budget:g}")
    if timeout_s is not None and not timeout_s > 0:
        raise MmplanError(f"--timeout must be a number of seconds > 0, got {timeout_s:g}")
    if not op_timeout_s > 0:
        raise MmplanError(f"--op-timeout must be a number of seconds > 0, got {op_timeout_s:g}")


def _train_owning(job: Job, *, resume: Path | None, checkpoint_dir: Path | None, nvme_dir: Path | None,
                  log: Path | None, overwrite: bool, monitor: MonitorOptions, timeout_s: float | None,
                  op_timeout_s: float) -> list[Any]:
    """Create and lock what the run owns, launch the ranks, give everything back on every exit path (see the module
    docstring). Every refusal before this left nothing behind."""
    plan = job.plan
    lead = int(os.environ.get("RANK", "0")) == 0  # the process of a torchrun job that holds the directories
    created: list[Path] = []
    locks: list[Any] = []
    nvme_run: Path | None = None
    log_existed = log is not None and log.exists()
    holds_checkpoints = ok = False
    try:
        if checkpoint_dir is not None:
            _make_dir(checkpoint_dir, "--checkpoint-dir", created)
            if lead:
                locks.append(_lock(checkpoint_dir, "--checkpoint-dir"))
                holds_checkpoints = True
                _check_checkpoint_dir(checkpoint_dir, resume, overwrite)
        if resume is not None and lead and not _same_dir(resume, checkpoint_dir):
            locks.append(_lock(resume, "--resume", shared=True))
        if log is not None and lead:
            from runtime.dirlock import FileLock

            locks.append(FileLock(log, "--log").acquire())  # another run writing into it is refused
        lineage = _resumable(resume, plan).lineage if resume is not None else ""
        nvme_run = _nvme_dir(plan, nvme_dir, created, locks)
        job = replace(job, nvme_dir=str(nvme_run) if nvme_run else None, lineage=lineage or uuid.uuid4().hex[:16])
        from runtime.launch import launch  # looked up at call time (tests stand in for it)

        with Monitor(monitor if lead else MonitorOptions(show=False), steps=job.steps,
                     global_batch=plan.training.global_batch) as watching:
            results = launch(train_rank, plan.world_size, replace(job, progress=watching.path), backend=backend(plan),
                             timeout_s=timeout_s, op_timeout_s=op_timeout_s)
        ok = True
    finally:
        _give_back(ok, nvme_run=nvme_run, checkpoint_dir=checkpoint_dir if holds_checkpoints else None, log=log,
                   log_existed=log_existed, locks=locks, created=created)
    return results


def _give_back(ok: bool, *, nvme_run: Path | None, checkpoint_dir: Path | None, log: Path | None, log_existed: bool,
               locks: list[Any], created: list[Path]) -> None:
    """Remove the run's nvme directory; after a failure also its incomplete checkpoints (`checkpoint_dir`: the one
    this run held), the log it created and left empty, and the directories it created and left empty; release
    its locks."""
    if nvme_run is not None:
        shutil.rmtree(nvme_run, ignore_errors=True)
    if not ok:
        if checkpoint_dir is not None and checkpoint_dir.is_dir():
            remove_incomplete(checkpoint_dir)  # a save cut short: its space comes back, resume is unaffected
        if log is not None and not log_existed:
            with contextlib.suppress(OSError):
                if log.stat().st_size == 0:
                    log.unlink()
    for lock in reversed(locks):
        lock.release()
    if not ok:
        for top in created:
            _remove_empty_dirs(top)


def write_trace(path: Path, timelines: dict[int, list], metrics: list[dict[str, Any]]) -> None:
    """The last step's measured timeline of every rank, in the format and with the event names of
    `mmplan compare --trace` (plans/trace.py)."""
    import json

    from plans.serial import write_atomic
    from plans.trace import chrome_trace

    other = {"step": metrics[-1]["step"], "step_time_s": metrics[-1]["step_time_s"]} if metrics else {}
    write_atomic(path, json.dumps(chrome_trace(timelines, other={"measured": True, **other})))


def check_files(*, log: Path | None, resume: Path | None, checkpoint_dir: Path | None, overwrite: bool) -> None:
    """The refusals about files and directories, before any model is built: no checkpoint to resume from, a
    --checkpoint-dir that is a file, a log that holds a run (without --resume or --overwrite)."""
    if resume is not None and not resume.is_dir():
        raise MmplanError(f"--resume {resume}: no such checkpoint directory")
    if checkpoint_dir is not None and checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise MmplanError(f"--checkpoint-dir {checkpoint_dir} is a file, not a directory")
    _check_log(log, resuming=resume is not None, overwrite=overwrite)


def _check_log(log: Path | None, *, resuming: bool, overwrite: bool) -> None:
    """A log is appended to when resuming; otherwise one holding rows is replaced only with --overwrite."""
    if log is None:
        return
    if log.is_symlink():
        raise MmplanError(f"--log {log} is a symbolic link; give the path of the log file itself")
    if log.exists():
        if not log.is_file():
            raise MmplanError(f"--log {log} is not a regular file")
        if log.stat().st_size and not resuming and not overwrite:
            raise MmplanError(f"--log {log} already holds a run's log; continue it with --resume, choose another file, "
                              "or pass --overwrite to replace it")


def _lock(directory: Path, option: str, *, shared: bool = False):
    from runtime.dirlock import DirLock

    return DirLock(directory, option, shared=shared).acquire()


def _same_dir(a: Path | None, b: Path | None) -> bool:
    try:
        return a is not None and b is not None and a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_checkpoint_dir(checkpoint_dir: Path, resume: Path | None, overwrite: bool) -> None:
    """Refuse a directory holding checkpoints this run does not continue, unless --overwrite."""
    from runtime.checkpoint import complete_steps

    existing = complete_steps(checkpoint_dir)
    if existing and not overwrite and not _same_dir(resume, checkpoint_dir):
        names = ", ".join(p.name for p in existing[-3:])
        raise MmplanError(f"--checkpoint-dir {checkpoint_dir} already holds checkpoints ({names}); continue from them "
                          f"with --resume {checkpoint_dir}, choose another directory, or pass --overwrite to let this run "
                          "replace them")


def _resumable(resume: Path, plan: Plan):
    """The checkpoint a run resumes from: complete, verified, of the plan's model (its manifest says so)."""
    from runtime.checkpoint import FORMAT, check_sizes, latest_checkpoint, verified_file

    manifest = latest_checkpoint(resume, verify=False)
    if manifest is None:
        raise MmplanError(f"--resume {resume}: no complete checkpoint to resume from")
    if manifest.format == FORMAT:
        for block in manifest.files:
            verified_file(manifest, block)
    else:  # DCP's shards: every rank checks the checksums of a share of the files (runtime/checkpoint_dcp.py)
        check_sizes(manifest)
    if not manifest.fingerprint:
        raise MmplanError(f"checkpoint {manifest.path} records no model fingerprint (written by an older mmplan), so it "
                          f"cannot be checked against {plan.profile.model!r}; refusing to resume")
    if manifest.fingerprint != plan.profile.fingerprint:
        raise MmplanError(f"checkpoint {manifest.path} is of model {manifest.model!r} (fingerprint {manifest.fingerprint}) "
                          f"but the plan trains {plan.profile.model!r} (fingerprint {plan.profile.fingerprint}); resume "
                          "with a plan for that model or from another directory")
    return manifest


NVME_RUN_PREFIX = "mmplan-run-"
NVME_RUN_MARKER = ".mmplan-nvme-run"  # written into each run directory at creation: clean-up removes only these
_STALE_UNLOCKED_S = 60.0  # a run directory without a lock file is another run's being created, or a stale one


def _nvme_dir(plan: Plan, nvme_dir: Path | None, created: list[Path], locks: list[Any]) -> Path | None:
    """This run's own directory for the nvme tier, inside --nvme-dir (None when the plan does not use the tier):
    required when the plan uses it, writable, with the space; stale directories of killed runs are removed first."""
    from runtime.dirlock import DirLock
    from runtime.memory import check_nvme_space

    uses = any(s.memory.params == "nvme" or s.memory.grads == "nvme" or s.memory.optimizer == "nvme"
               or "offload-nvme" in s.memory.activations.values() for g in plan.groups for s in g.stages)
    if not uses:
        return None
    if nvme_dir is None:
        raise MmplanError("the plan places state in the nvme tier: give a directory for it with --nvme-dir")
    _make_dir(nvme_dir, "--nvme-dir", created)
    _remove_stale_runs(nvme_dir)
    needed = sum(m.nvme for m in plan.predicted.memory) if plan.predicted else 0.0
    check_nvme_space(nvme_dir, needed)
    try:
        run_dir = Path(tempfile.mkdtemp(prefix=NVME_RUN_PREFIX, dir=nvme_dir))
    except OSError as e:
        raise MmplanError(f"cannot write in --nvme-dir {nvme_dir}: {e.strerror or e}") from None
    try:
        (run_dir / NVME_RUN_MARKER).write_text(f"made by mmplan run (pid {os.getpid()}) for its nvme tier\n")
        locks.append(DirLock(run_dir, "--nvme-dir run directory").acquire())
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir


def _remove_stale_runs(nvme_dir: Path) -> None:
    """Remove the run directories in --nvme-dir that no live run holds (left by a SIGKILLed run): only those mmplan
    marked as its own at creation (a user's `mmplan-run-*` directory is not ours, whatever its name)."""
    from runtime.dirlock import LOCK_NAME, is_locked

    for d in nvme_dir.glob(f"{NVME_RUN_PREFIX}*"):
        try:
            if d.is_symlink() or not d.is_dir() or not (d / NVME_RUN_MARKER).is_file() or is_locked(d):
                continue
            if not (d / LOCK_NAME).exists() and time.time() - d.stat().st_mtime < _STALE_UNLOCKED_S:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)


def _make_dir(path: Path, option: str, created: list[Path]) -> None:
    """Create the directory an option names; the topmost directory this made is appended to `created`."""
    if path.exists():
        if not path.is_dir():
            raise MmplanError(f"{option} {path} is a file, not a directory")
        return
    top = path
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MmplanError(f"cannot create {option} {path}: {e.strerror or e}") from None
    created.append(top)


def _remove_empty_dirs(top: Path) -> None:
    """Remove the directories under and including `top` that nothing was written into."""
    for d in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except OSError:
            pass


def measured_summary(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step time and per-rank busy time over the steps after the first (warm-up)."""
    if not metrics:
        return {"step_time_s": None, "busy_s": [], "peak_memory_bytes": [], "first_loss": None, "last_loss": None}
    rows = metrics[1:] or metrics
    ranks = len(rows[0]["compute_s"])
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in rows),
        "busy_s": [statistics.median(r["compute_s"][k] + r["comm_s"][k] for r in rows) for k in range(ranks)],
        "peak_memory_bytes": [max(r["peak_memory_bytes"][k] for r in metrics) for k in range(ranks)],
        "first_loss": metrics[0]["loss"],
        "last_loss": metrics[-1]["loss"],
    }
