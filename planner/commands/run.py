"""`mmplan run`: check a plan against its model, launch the ranks (or join torchrun), report predicted vs measured.

What a run owns, and gives back on every exit path (success, refusal, a failing rank, Ctrl-C, SIGTERM, SIGHUP):
- its --checkpoint-dir, locked for the run (a second run on it is refused); a directory holding another run's
  checkpoints is refused unless resumed from (--resume) or --overwrite is given, and even then they are only
  replaced once this run's first checkpoint is complete; incomplete step directories are removed on failure;
- its --log, appended to when resuming, else refused when it holds a log unless --overwrite; never followed
  through a symbolic link; removed again when a failed run wrote nothing into a file it created;
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

import torch

from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Plan, check_plan, load_plan
from planner.commands.monitor import Monitor, MonitorOptions, check_monitor

MAX_LOCAL_RANKS = 64  # beyond this a plan is for a real cluster: start it with torchrun
RANKS_PER_CORE = 4  # local ranks beyond this many per CPU core are refused (each is a process with its own model)
# A forked local rank's own memory besides the model it builds: 32 MB private dirty measured per rank of the
# tiny-vlm-pp2 example on CPU (/proc/self/smaps_rollup after 2 steps), doubled for margin.
RANK_OVERHEAD_BYTES = 64e6


@dataclass(frozen=True)
class RunResult:
    plan: Plan
    profile: Profile | None  # the one given to run (None: predictions come from the plan)
    metrics: list[dict[str, Any]]  # one row per step (rank 0's view of all ranks); empty on other torchrun ranks
    rank: int


def checked_plan(plan_path: Path, model: str | None, profile: Profile | None = None) -> tuple[Plan, Profile | None, str, float]:
    """The plan (its flow taken from `profile` when given), the profile, the model spec and the bytes of one
    sample of the model's inputs; refuse a model
    whose structural fingerprint differs from the plan's. Cheap: the model is built on the meta device and
    traced with torch.fx — no profiling analysis."""
    from runtime.program import model_fingerprint, traced_flow, trace_program
    from runtime.source import call_factory, resolve

    plan = load_plan(plan_path)
    if profile is not None:
        plan = check_plan(plan, profile, f"plan {plan_path}")
    spec = model or _plan_model(plan, plan_path)
    with torch.device("meta"):
        module, batch = call_factory(resolve(spec), 1)
    program = trace_program(module, batch)
    found = model_fingerprint(module, program)
    if found != plan.profile.fingerprint:
        raise MmplanError(
            f"plan {plan_path} was solved for model {plan.profile.model!r} with fingerprint {plan.profile.fingerprint}, "
            f"but {spec!r} builds a model with fingerprint {found} (another module tree or data flow): re-profile and re-solve")
    if plan.flow is None:  # a hand-written plan: the flow of the model it was just checked against
        plan = check_plan(replace(plan, flow=traced_flow(program, module)), None, f"plan {plan_path}")
    sample_bytes = sum(t[:1].numel() * t.element_size() for t in batch.values() if isinstance(t, torch.Tensor))
    return plan, profile, spec, float(sample_bytes)


def _plan_model(plan: Plan, plan_path: Path) -> str:
    """The plan's model when it names no code: a zoo name or an architecture TOML. A plan file must not choose
    code to import and run, so a `package.module:factory` in it is used only when the user passes it as --model."""
    from runtime.source import is_factory

    spec = plan.profile.model
    if is_factory(spec):
        raise MmplanError(f"plan {plan_path} names the Python factory {spec!r} as its model; a plan does not choose "
                          f"code to run: pass --model {spec} to run that factory")
    return spec


def _backend(plan: Plan) -> str:
    if plan.cluster.backend == "nccl" and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def run_plan(plan_path: Path, *, steps: int, model: str | None = None, seed: int = 0, lr: float = 1e-3,
             data: str | None = None, log: Path | None = None, timeout_s: float | None = None,
             op_timeout_s: float = 300.0, device_budget: float | None = None, nvme_dir: Path | None = None,
             prefetch: bool = True, checkpoint_every: int = 0, checkpoint_dir: Path | None = None,
             resume: Path | None = None, overwrite: bool = False, profile: Profile | None = None,
             trace: Path | None = None, monitor: MonitorOptions | None = None) -> RunResult:
    """Train up to step `steps` with the plan (from the checkpoint's step when resuming); rank 0's metrics.

    `timeout_s`: wall-clock limit of the whole run (None: none — a hang is caught by `op_timeout_s`, the bound on
    every collective and receive). `monitor`: the progress bar, log lines and TensorBoard of planner/commands/monitor.py.

    `overwrite`: let this run replace the checkpoints in `checkpoint_dir` and the log in `log` (see the module
    docstring for what is refused without it)."""
    from runtime.launch import launch
    from runtime.train import Job, train_rank

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
    launched = _launched_world_size()
    if timeout_s is not None and not timeout_s > 0:
        raise MmplanError(f"--timeout must be a number of seconds > 0, got {timeout_s:g}")
    if not op_timeout_s > 0:
        raise MmplanError(f"--op-timeout must be a number of seconds > 0, got {op_timeout_s:g}")
    monitor = monitor or MonitorOptions(show=False)
    check_monitor(monitor)
    plan, profile, spec, sample_bytes = checked_plan(plan_path, model, profile)
    _check_precision(plan, plan_path)
    _check_rank_numbering(plan, plan_path)
    _check_tensor_parallel(plan, spec, plan_path)
    world = plan.world_size
    if launched is not None:
        if launched != world:
            raise MmplanError(f"the plan needs {world} ranks but this job was launched with {launched}")
    else:
        _check_host_ranks(plan, plan_path)
    _check_zero(plan, plan_path)
    if launched is None:
        _check_host_memory(plan, profile, plan_path, sample_bytes, _model_bytes(spec))
    if resume is not None and not resume.is_dir():
        raise MmplanError(f"--resume {resume}: no such checkpoint directory")
    if checkpoint_dir is not None and checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise MmplanError(f"--checkpoint-dir {checkpoint_dir} is a file, not a directory")
    _check_log(log, resuming=resume is not None, overwrite=overwrite)
    # every refusal above leaves nothing behind; from here on directories are created and locked, and given back
    # on every exit path (see the module docstring)
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
        lineage = _resumable(resume, plan).lineage if resume is not None else ""
        nvme_run = _nvme_dir(plan, nvme_dir, created, locks)
        job = Job(plan=plan, model=spec, steps=steps, seed=seed, lr=lr, data=None if data in (None, "builtin") else data,
                  log=str(log) if log else None, device_budget=device_budget, nvme_dir=str(nvme_run) if nvme_run else None,
                  prefetch=prefetch, checkpoint_every=checkpoint_every,
                  checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, resume=str(resume) if resume else None,
                  trace=trace is not None, lineage=lineage or uuid.uuid4().hex[:16])
        with Monitor(monitor if lead else MonitorOptions(show=False), steps=steps,
                     global_batch=plan.training.global_batch) as watching:
            job = replace(job, progress=watching.path)
            results = launch(train_rank, world, job, backend=_backend(plan), timeout_s=timeout_s, op_timeout_s=op_timeout_s)
        ok = True
    finally:
        if nvme_run is not None:
            shutil.rmtree(nvme_run, ignore_errors=True)
        if not ok:
            if holds_checkpoints and checkpoint_dir.is_dir():
                from runtime.checkpoint import remove_incomplete

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
    rank = int(os.environ.get("RANK", 0))
    if trace is not None and rank == 0 and results[0].get("trace"):
        write_trace(trace, results[0]["trace"], results[0]["metrics"])
    return RunResult(plan, profile, results[0]["metrics"], rank)


def actual_prediction(plan_path: Path, profile: Profile | None, model: str | None):
    """planner.commands.actual.on_actual_cluster for the plan at `plan_path` (None when it cannot be read: run_plan then
    refuses it in one line). Without `profile`, a plan solved for another cluster is evaluated with the model's
    profile on the meta device (FLOPs, bytes: no measured times)."""
    from planner.commands.actual import on_actual_cluster

    try:
        plan = load_plan(plan_path)
        if "RANK" not in os.environ:
            _check_host_ranks(plan, plan_path)  # a plan this host cannot start: run_plan refuses it, no warning first
    except MmplanError:
        return None
    if profile is None and not on_actual_cluster(plan, None, _backend(plan)).same:
        from planner.profiler.profile import profile_model
        from runtime.source import resolve

        try:
            profile = profile_model(resolve(model or _plan_model(plan, plan_path)), device="meta")
            if profile.fingerprint != plan.profile.fingerprint:
                profile = None  # another model: run_plan refuses it in one line
        except MmplanError:
            profile = None
    return on_actual_cluster(plan, profile, _backend(plan))


def write_trace(path: Path, timelines: dict[int, list], metrics: list[dict[str, Any]]) -> None:
    """The last step's measured timeline of every rank, in the format and with the event names of
    `mmplan compare --trace` (plans/trace.py)."""
    import json

    from plans.serial import write_atomic
    from plans.trace import chrome_trace

    other = {"step": metrics[-1]["step"], "step_time_s": metrics[-1]["step_time_s"]} if metrics else {}
    write_atomic(path, json.dumps(chrome_trace(timelines, other={"measured": True, **other})))


def _check_zero(plan: Plan, plan_path: Path) -> None:
    """ZeRO runs on FSDP2 (runtime/zero.py): only the memory tiers it can hold (runtime.zero.zero_runs_with)."""
    from runtime.zero import ZERO_TIERS, zero_runs_with

    for g in plan.groups:
        if not g.zero:
            continue
        for i, st in enumerate(g.stages):
            m = st.memory
            if not zero_runs_with(m.params, m.grads, m.optimizer):
                raise MmplanError(f"plan {plan_path}: group {g.name} stage {i} uses ZeRO stage {g.zero} with parameters in "
                                  f"{m.params!r}, gradients in {m.grads!r} and optimizer state in {m.optimizer!r}; "
                                  f"{ZERO_TIERS}: set zero=0 or change the tiers")


def _check_rank_numbering(plan: Plan, plan_path: Path) -> None:
    """The runtime starts one process per rank of the plan: the ranks must be 0..N-1 without gaps."""
    used = sorted({r for g in plan.groups for r in g.ranks})
    if used != list(range(len(used))):
        present = set(used)
        missing = [r for r in range(min(used[-1], len(used) + 8)) if r not in present]  # bounded: ranks may be huge
        raise MmplanError(f"plan {plan_path} uses ranks {_ranks(used)} but not {_ranks(missing)}; the runtime starts one "
                          f"process per rank of the plan, numbered 0..{len(used) - 1}: renumber its ranks without gaps")


def _check_tensor_parallel(plan: Plan, spec: str, plan_path: Path) -> None:
    """Every tensor-parallel block must shard exactly (tp divides its heads, kv heads and MLP width): checked on
    the model built on the meta device (no memory) before any rank starts, not by the ranks mid-setup."""
    sharded = [(g, b) for g in plan.groups if g.tp > 1 for b in g.blocks]
    if not sharded:
        return
    import torch

    from runtime.source import resolve
    from runtime.tensor_parallel import check_tp, supports_tp

    with torch.device("meta"):
        model, example = resolve(spec).factory(1)
    for g, b in sharded:
        block = model.get_submodule(b)
        if supports_tp(block):
            try:
                check_tp(block, g.tp)
            except MmplanError as e:
                raise MmplanError(f"plan {plan_path}: group {g.name!r} has tp={g.tp}, which block {b} cannot use: {e}") from None
    _check_sequence_parallel(plan, model, example, plan_path)


def _check_precision(plan: Plan, plan_path: Path) -> None:
    """The runtime trains fp32 and bf16 plans (runtime/precision.py); refuse another before any rank starts."""
    from runtime.precision import torch_dtype

    try:
        torch_dtype(plan.training.dtype)
    except MmplanError as e:
        raise MmplanError(f"plan {plan_path}: {e}") from None


def _check_sequence_parallel(plan: Plan, model: Any, example: dict, plan_path: Path) -> None:
    """A sequence-parallel group's layers must see a sequence its tp divides: one forward on the meta device
    records each such layer's sequence length before any rank starts."""
    from runtime.tensor_parallel import supports_sequence_parallel

    watched = {b: g for g in plan.groups if g.sequence_parallel and g.tp > 1 for b in g.blocks
               if supports_sequence_parallel(model.get_submodule(b))}
    if not watched:
        return
    lengths: dict[str, int] = {}

    def record(name: str):
        def hook(_module: Any, args: tuple) -> None:
            lengths.setdefault(name, args[0].shape[1])  # (B, S, D)
        return hook

    handles = [model.get_submodule(b).register_forward_pre_hook(record(b)) for b in watched]
    try:
        model(**example)
    except Exception:  # noqa: BLE001 - a model the meta device cannot run: the ranks check it at their first forward
        return
    finally:
        for h in handles:
            h.remove()
    for b, g in watched.items():
        if b in lengths and lengths[b] % g.tp:
            raise MmplanError(f"plan {plan_path}: group {g.name!r} is sequence-parallel with tp={g.tp}, but block {b} "
                              f"reads a sequence of {lengths[b]}; set sequence_parallel false or use a tp dividing it")


def _host() -> str:
    """This machine in a few words, for refusals: name, CPU cores, CUDA devices, available memory."""
    import socket

    from plans.units import format_bytes as human_bytes

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = _available_memory()
    memory = f", {human_bytes(available)} memory available" if available is not None else ""
    return f"this host ({socket.gethostname()}: {os.cpu_count() or 1} CPU cores, {gpus} CUDA devices{memory})"


def _torchrun_hint(plan: Plan) -> str:
    c = plan.cluster
    return (f"start it on its cluster with torchrun, one process per GPU: torchrun --nnodes {c.nodes} --nproc-per-node "
            f"{c.gpus_per_node} -m planner.cli run PLAN")


def _check_host_ranks(plan: Plan, plan_path: Path) -> None:
    """A local run starts one process per rank here: refused when this host cannot hold that many (more ranks than
    CUDA devices for an nccl plan on a GPU host; more than RANKS_PER_CORE per CPU core or MAX_LOCAL_RANKS on CPU)."""
    world, cluster = plan.world_size, plan.cluster
    if _backend(plan) == "nccl":
        limit, what = torch.cuda.device_count(), "one per CUDA device"
    else:
        limit, what = min(MAX_LOCAL_RANKS, RANKS_PER_CORE * (os.cpu_count() or 1)), f"{RANKS_PER_CORE} per CPU core"
    if world > limit:
        raise MmplanError(f"plan {plan_path} is for cluster {cluster.name} ({world} ranks), but {_host()} runs at most "
                          f"{limit} local ranks ({what}); {_torchrun_hint(plan)}")


def _model_bytes(spec: str) -> float:
    """Bytes of the whole model's parameters and buffers: every local rank builds it before keeping its blocks."""
    from runtime.source import call_factory, resolve

    with torch.device("meta"):
        module, _ = call_factory(resolve(spec), 1)
    return float(sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]))


def _check_host_memory(plan: Plan, profile: Profile | None, plan_path: Path, sample_bytes: float,
                       model_bytes: float = 0.0) -> None:
    """A local run must fit this machine: the ranks' training state and activations (the cost model's prediction),
    each rank's own process and the whole model it builds first, plus the input samples of two steps (the data
    loader builds the next step ahead), refused before any rank allocates them (a global batch may be 16 M samples)."""
    from cost_models.evaluate import evaluate
    from plans.units import format_bytes as human_bytes

    available = _available_memory()
    if available is None:
        return
    data = 2 * plan.training.global_batch * sample_bytes
    predicted = evaluate(plan, profile).memory if profile is not None else (plan.predicted.memory if plan.predicted else ())
    model = sum(m.gpu + m.cpu for m in predicted)
    ranks = plan.world_size * (RANK_OVERHEAD_BYTES + model_bytes)
    if data + model + ranks > available:
        raise MmplanError(f"plan {plan_path} is for cluster {plan.cluster.name} ({plan.world_size} ranks) and needs about "
                          f"{human_bytes(data + model + ranks)} of memory to run locally ({human_bytes(model)} for its "
                          f"ranks' state and activations, {human_bytes(ranks)} for {plan.world_size} rank processes that "
                          f"each build the model, {human_bytes(data)} for the input samples of two steps of "
                          f"{plan.training.global_batch:,}), but {_host()}; lower the global batch, or "
                          f"{_torchrun_hint(plan)}")


def _available_memory() -> float | None:
    """MemAvailable + SwapFree from /proc/meminfo, in bytes (None where unknown)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return sum(float(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree") if k in fields) or None
    except (OSError, ValueError):
        return None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


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
    from runtime.checkpoint import latest_checkpoint

    manifest = latest_checkpoint(resume)
    if manifest is None:
        raise MmplanError(f"--resume {resume}: no complete checkpoint to resume from")
    if not manifest.fingerprint:
        raise MmplanError(f"checkpoint {manifest.path} records no model fingerprint (written by an older mmplan), so it "
                          f"cannot be checked against {plan.profile.model!r}; refusing to resume")
    if manifest.fingerprint != plan.profile.fingerprint:
        raise MmplanError(f"checkpoint {manifest.path} is of model {manifest.model!r} (fingerprint {manifest.fingerprint}) "
                          f"but the plan trains {plan.profile.model!r} (fingerprint {plan.profile.fingerprint}); resume "
                          "with a plan for that model or from another directory")
    return manifest


NVME_RUN_PREFIX = "mmplan-run-"
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
        locks.append(DirLock(run_dir, "--nvme-dir run directory").acquire())
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir


def _remove_stale_runs(nvme_dir: Path) -> None:
    """Remove the run directories in --nvme-dir that no live run holds (left by a SIGKILLed run)."""
    from runtime.dirlock import LOCK_NAME, is_locked

    for d in nvme_dir.glob(f"{NVME_RUN_PREFIX}*"):
        try:
            if d.is_symlink() or not d.is_dir() or is_locked(d):
                continue
            if not (d / LOCK_NAME).exists() and time.time() - d.stat().st_mtime < _STALE_UNLOCKED_S:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)


def _launched_world_size() -> int | None:
    """WORLD_SIZE of a torchrun launch, None when not launched by one."""
    value = os.environ.get("WORLD_SIZE")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise MmplanError(f"the environment variable WORLD_SIZE={value!r} is not a number of ranks") from None


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
