"""Run a function on N ranks: join the torchrun job this process is part of, or fork N local gloo processes."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from plans.errors import MmplanError
from plans.serial import write_atomic
from runtime.host_memory import keep_freed_memory
from runtime.launch_dirs import make_run_dir, record_pids
from runtime.signals import default_in_child

GRACE_S = 3.0  # after the first failure, how long the other ranks get to record their own errors
_POLL_S = 0.05
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
# A rank failing with one of these most likely saw a peer die: report the peer's error instead.
_SECONDARY = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|timed? ?out|timeout|"
    r"DistBackendError|DistNetworkError|DistStoreError",
    re.IGNORECASE,
)

# torch threads per local rank: one rank per core (PLATFORM-NOTES.md: 4 ranks x 2 threads ran 5x slower on 2 cores);
# `mmplan profile --measure` and `mmplan calibrate` time with the same number.
RANK_THREADS = 1


@dataclass(frozen=True, slots=True)
class RankContext:
    """Where a worker runs: its global rank, the world size, the process-group backend and its device."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    local_rank: int = 0


class RankFailure(MmplanError):
    """A rank failed, died or hung; the message names the rank and its original error on one line.

    `rank` is the failing rank (None for a time-out); `remote_traceback` the failing rank's formatted traceback.
    """

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


Worker = Callable[[RankContext, Any], Any]


def launch(
    worker: Worker,
    world_size: int,
    payload: Any = None,
    *,
    backend: str = "gloo",
    timeout_s: float | None = 120.0,
    op_timeout_s: float = 60.0,
    start_method: Literal["fork", "spawn"] = "fork",
) -> list[Any]:
    """Run worker(ctx, payload) on every rank and return the results in rank order.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) this process is one rank: it joins the job and returns
    [its own result]. Otherwise `world_size` local processes run with a file:// rendezvous, one thread each;
    the first failure (or the `timeout_s` wall-clock deadline; None: none) kills them all and raises RankFailure.
    Without a deadline a hang is still caught: every collective and receive is bounded by `op_timeout_s` (the
    process group's timeout), so a rank's peers fail waiting for it and it is blamed.
    With start_method="spawn" the worker, payload and results must be picklable (with fork only the results).
    """
    _check_args(world_size, timeout_s, op_timeout_s, start_method)
    if all(var in os.environ for var in _TORCHRUN_VARS):
        return [_run_torchrun_rank(worker, world_size, payload, backend, op_timeout_s)]
    return _run_local(worker, world_size, payload, backend, timeout_s, op_timeout_s, start_method)


def _check_args(world_size: int, timeout_s: float | None, op_timeout_s: float, start_method: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MmplanError(f"world_size must be a positive integer, got {world_size!r}")
    if (timeout_s is not None and not timeout_s > 0) or not op_timeout_s > 0:
        raise MmplanError(f"timeouts must be positive, got timeout_s={timeout_s}, op_timeout_s={op_timeout_s}")
    if start_method not in ("fork", "spawn"):
        raise MmplanError(f"start_method must be fork or spawn, got {start_method!r}")


def _device(backend: str, local_rank: int) -> torch.device:
    """cuda:local_rank for nccl (made the current device), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    torch.cuda.set_device(device)
    return device


def _one_line(text: str, limit: int = 600) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_one_line(str(exc))}"


# ----------------------------------------------------------------------------------------------- torchrun
def _run_torchrun_rank(worker: Worker, world_size: int, payload: Any, backend: str, op_timeout_s: float) -> Any:
    """Join the torchrun job (env:// rendezvous) as this process's rank and run the worker here."""
    env_world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if env_world != world_size:
        raise RankFailure(f"torchrun started {env_world} ranks but the plan needs world_size={world_size}", rank=rank)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    keep_freed_memory()
    ctx = RankContext(rank, world_size, backend, _device(backend, local_rank), local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(
            backend, init_method="env://", rank=rank, world_size=world_size, timeout=timedelta(seconds=op_timeout_s)
        )
    try:
        return worker(ctx, payload)
    except Exception as exc:
        raise RankFailure(
            f"rank {rank} failed: {_describe(exc)}", rank=rank, remote_traceback=traceback.format_exc()
        ) from exc
    finally:
        if owns_group:
            gc.collect()  # PLATFORM-NOTES: live DDP modules at destroy_process_group can hang the exit
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- child side
def _write_atomic(path: Path, obj: Any) -> None:
    write_atomic(path, pickle.dumps(obj), durable=False)  # a hand-over to the parent in a scratch directory


def _error_record(rank: int, exc: BaseException) -> dict[str, Any]:
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        message = repr(exc)
    return {
        "rank": rank,
        "type": type(exc).__name__,
        "message": message,
        "traceback": "".join(traceback.format_exception(exc)),
        "time": time.time(),
        "user_error": isinstance(exc, MmplanError),  # the user's to fix (diverged, disk full): reported as it is
    }


def _child_main(
    worker: Worker, payload: Any, rank: int, world_size: int, backend: str, run_dir: str, op_timeout_s: float
) -> None:
    """One local rank: own process group (so the parent can kill its descendants too), run, record, _exit."""
    parent = os.getppid()
    os.setpgid(0, 0)
    default_in_child()
    _die_with_parent(parent)
    torch.set_num_threads(RANK_THREADS)
    keep_freed_memory()  # steady-state steps without page faults (runtime/host_memory.py)
    run = Path(run_dir)
    code = 0
    try:
        ctx = RankContext(rank, world_size, backend, _device(backend, rank), rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{run / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=op_timeout_s),
        )
        _write_atomic(run / f"result-{rank}.pkl", worker(ctx, payload))
    except BaseException as exc:  # noqa: BLE001 - recorded for the parent, which raises RankFailure
        code = 1
        _write_atomic(run / f"error-{rank}.pkl", _error_record(rank, exc))
    finally:
        code = _teardown(code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """If the launching process dies (even by SIGKILL), its ranks die too: no orphans (Linux prctl)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own cleanup still kills its ranks
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _teardown(code: int) -> int:
    """gc (PLATFORM-NOTES: avoids exit hangs), then destroy the group; a failure there only matters on success."""
    try:
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        return code or 1
    return code


# ----------------------------------------------------------------------------------------------- parent side
_PREIMPORTED = False


def _preimport() -> None:
    """Import the heavy torch modules once in the parent so forked ranks start in ~0.2 s, not ~1.5 s each."""
    global _PREIMPORTED
    if _PREIMPORTED:
        return
    import torch.distributed.distributed_c10d

    with contextlib.suppress(Exception):  # an optional speed-up only
        import torch._dynamo  # noqa: F401  (DDP's constructor imports it lazily)
    _PREIMPORTED = True


def _run_local(
    worker: Worker,
    world_size: int,
    payload: Any,
    backend: str,
    timeout_s: float | None,
    op_timeout_s: float,
    start_method: str,
) -> list[Any]:
    if start_method == "fork" and backend == "nccl" and torch.cuda.is_initialized():
        raise MmplanError(
            'CUDA is already initialised in this process, so forked ranks cannot use it: pass start_method="spawn"'
        )
    if start_method == "fork":
        _preimport()
    run_dir = make_run_dir()  # stale ones of SIGKILLed launchers removed (runtime/launch_dirs.py)
    ctx = mp.get_context(start_method)
    procs: list[mp.Process] = []
    try:
        try:
            _start(procs, ctx, worker, payload, world_size, backend, str(run_dir), op_timeout_s)
        finally:
            record_pids(run_dir, [p.pid for p in procs])
        outcome = _watch(procs, run_dir, timeout_s)
        states = {r: _proc_state(p.pid) for r, p in enumerate(procs) if p.exitcode is None}
        killed = _kill_all(procs)
        if outcome != "ok":
            raise _failure(outcome, procs, killed, run_dir, timeout_s, states)
        return [_read_result(run_dir, rank, procs[rank]) for rank in range(world_size)]
    finally:
        _kill_all(procs)  # also on KeyboardInterrupt: no orphans
        shutil.rmtree(run_dir, ignore_errors=True)


def _start(procs: list[mp.Process], ctx: Any, worker: Worker, payload: Any, world_size: int, *args: Any) -> None:
    """Start the ranks (appending each to procs at once, so a failure midway still kills the started ones).

    gc.freeze() around fork keeps the parent's objects out of the children's collections: their gc.collect()
    before destroy_process_group then takes milliseconds instead of ~0.5 s, and copies no pages.
    """
    owns_freeze = gc.get_freeze_count() == 0  # leave a caller's own gc.freeze() alone
    if owns_freeze:
        gc.freeze()
    try:
        for rank in range(world_size):
            args_ = (worker, payload, rank, world_size, *args)
            procs.append(ctx.Process(target=_child_main, args=args_, name=f"mmplan-rank-{rank}"))
            procs[-1].start()
    finally:
        if owns_freeze:
            gc.unfreeze()


def _has_error(run_dir: Path, rank: int) -> bool:
    return (run_dir / f"error-{rank}.pkl").exists()


def _failed(proc: mp.Process, run_dir: Path, rank: int) -> bool:
    return (proc.exitcode not in (None, 0)) or _has_error(run_dir, rank)


def _settled(proc: mp.Process, run_dir: Path, rank: int) -> bool:
    """Exited, or recorded an error (it may still hang in teardown)."""
    return proc.exitcode is not None or _has_error(run_dir, rank)


def _watch(procs: list[mp.Process], run_dir: Path, timeout_s: float | None) -> Literal["ok", "failed", "timeout"]:
    """Wait until all ranks exit 0, or a rank fails (+ grace for the others), or the deadline (if any) passes."""
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    grace_end = None
    while True:
        if all(p.exitcode == 0 for p in procs):
            return "ok"
        now = time.monotonic()
        if grace_end is None and any(_failed(p, run_dir, r) for r, p in enumerate(procs)):
            grace_end = now + GRACE_S
        if grace_end is not None and (now >= grace_end or all(_settled(p, run_dir, r) for r, p in enumerate(procs))):
            return "failed"
        if now >= deadline:
            return "failed" if grace_end is not None else "timeout"
        live = [p.sentinel for p in procs if p.exitcode is None]
        multiprocessing.connection.wait(live, timeout=min(_POLL_S, max(deadline - now, 0.0)))


def _kill_all(procs: list[mp.Process]) -> set[int]:
    """SIGKILL every live rank and its process group, reap them (bounded); the ranks that were still alive."""
    killed = set()
    for rank, proc in enumerate(procs):
        if proc.pid is None or proc.exitcode is not None:
            continue
        killed.add(rank)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # fails harmlessly if the child has not called setpgid yet
        with contextlib.suppress(ProcessLookupError, PermissionError):
            proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=5.0)
    return killed


def _load(path: Path) -> Any:
    try:
        return pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError):
        return None


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode} without recording an error"


def _failure(outcome: str, procs: list[mp.Process], killed: set[int], run_dir: Path, timeout_s: float,
             states: dict[int, str] | None = None) -> RankFailure:
    """The root cause: an own error (earliest) > a silent death > a rank that was still running without an error
    while its peers only saw connection errors or time-outs (it stopped responding) > such a peer error.

    `states`: rank -> its /proc state letter when it was killed ("T": stopped by a signal)."""
    states = states or {}
    if outcome == "timeout":
        running = ", ".join(f"{r}{' (stopped by a signal)' if states.get(r) == 'T' else ''}" for r in sorted(killed)) or "none"
        return RankFailure(f"timed out after {timeout_s:g} s; ranks still running: {running}")
    candidates = []
    for rank, proc in enumerate(procs):
        record = _load(run_dir / f"error-{rank}.pkl") if _has_error(run_dir, rank) else None
        if record is not None:
            user = record.get("user_error", False)
            secondary = not user and bool(_SECONDARY.search(f"{record['type']} {record['message']}"))
            text = _one_line(record["message"]) if user else f"rank {rank} failed: {record['type']}: {_one_line(record['message'])}"
            candidates.append((3 if secondary else 0, record["time"], rank, text, record["traceback"]))
        elif rank not in killed and proc.exitcode not in (None, 0):
            candidates.append((1, 0.0, rank, f"rank {rank} {_exit_text(proc.exitcode)}", ""))
    if candidates and min(candidates)[0] == 3:  # only peers' time-outs / connection errors: blame the silent ones
        silent = sorted(r for r in killed if not _has_error(run_dir, r))
        if silent:
            how = "was stopped by a signal" if states.get(silent[0]) == "T" else "stopped responding"
            peer = min(candidates)
            candidates.append((2, 0.0, silent[0], f"rank {silent[0]} {how} (still running, no error of its own); "
                               f"rank {peer[2]} then failed waiting for it: {peer[3].split(': ', 1)[-1]}", ""))
    if not candidates:  # cannot happen: "failed" means some rank failed
        return RankFailure("a rank failed without a trace")
    _, _, rank, text, tb = min(candidates)
    return RankFailure(text, rank=rank, remote_traceback=tb)


def _proc_state(pid: int | None) -> str:
    """The state letter of /proc/<pid>/stat (R, S, D, T, Z...), "" where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return ""


def _read_result(run_dir: Path, rank: int, proc: mp.Process) -> Any:
    path = run_dir / f"result-{rank}.pkl"
    if not path.exists():
        raise RankFailure(f"rank {rank} exited with code {proc.exitcode} but left no result", rank=rank)
    return pickle.loads(path.read_bytes())
