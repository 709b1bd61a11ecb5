"""The local launcher's run directories (file:// rendezvous, results, errors): each marked with the processes using it,
so that the next launch removes those a SIGKILLed launcher left (every process named in the marker dead)."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

PREFIX = "mmplan-launch-"
MARKER = ".mmplan-launch-run"  # "pid ..." of the launcher and its ranks; only directories holding it are ever removed


def make_run_dir(root: str | None = None) -> Path:
    """A new run directory in `root` (default: the temp directory), marked with this process; stale ones removed first."""
    root = root or tempfile.gettempdir()
    remove_stale(Path(root))
    run_dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    record_pids(run_dir, [os.getpid()])
    return run_dir


def record_pids(run_dir: Path, pids: Iterable[int | None]) -> None:
    """Name these processes (the launcher's, then its ranks') in the marker: the directory is in use while one lives."""
    known = _pids(run_dir) if (run_dir / MARKER).exists() else []
    with open(run_dir / MARKER, "w") as f:
        f.write(" ".join(str(p) for p in [*known, *(p for p in pids if p is not None and p not in known)]) + "\n")


def remove_stale(root: Path) -> None:
    """Remove this user's run directories in `root` whose marked processes are all dead (a SIGKILLed launcher's)."""
    for d in root.glob(f"{PREFIX}*"):
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid() or not (d / MARKER).is_file():
                continue
            pids = _pids(d)
        except (OSError, ValueError):
            continue
        if pids and not any(_alive(p) for p in pids):
            shutil.rmtree(d, ignore_errors=True)


def _pids(run_dir: Path) -> list[int]:
    return [int(p) for p in (run_dir / MARKER).read_text().split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid: alive
        return True
    try:  # a zombie (exited, not yet reaped by its parent) uses nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
