"""A SIGKILLed launcher's run directory (file:// rendezvous) is removed by the next launch; nothing else is."""
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.launch_dirs import MARKER, PREFIX, make_run_dir, record_pids

ROOT = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_marked_directories_of_dead_processes_are_removed(tmp_path):
    stale, live, unmarked, empty = (tmp_path / f"{PREFIX}{n}" for n in ("stale", "live", "user", "empty"))
    for d in (stale, live, unmarked, empty):
        d.mkdir()
    (stale / MARKER).write_text(f"{_dead_pid()} {_dead_pid()}\n")
    (live / MARKER).write_text(f"{_dead_pid()} {os.getpid()}\n")  # one rank still alive: in use
    (unmarked / "results.txt").write_text("a user's directory of that name\n")
    (empty / MARKER).write_text("\n")
    made = make_run_dir(str(tmp_path))
    assert not stale.exists() and live.exists() and unmarked.exists() and empty.exists()
    record_pids(made, [123, None, os.getpid()])
    assert (made / MARKER).read_text().split() == [str(os.getpid()), "123"]


WORKER = """
import sys, time
from runtime.launch import launch
def sleeper(ctx, payload):
    time.sleep(600)
launch(sleeper, 2, None, timeout_s=600)
"""


def test_the_next_launch_removes_a_sigkilled_launchers_directory(tmp_path, monkeypatch):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # an import of torch and two ranks started, on a loaded machine
        left = []
        while time.monotonic() < deadline and not left:  # the launcher's pid and its two ranks' in the marker
            left = [d for d in tmp_path.glob(f"{PREFIX}*") if _marked(d) == 3]
            assert proc.poll() is None, "the launcher exited"
            time.sleep(0.1)
        assert left, "the launcher's directory never named its two ranks"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    pids = [int(p) for p in (left[0] / MARKER).read_text().split()]
    deadline = time.monotonic() + 60  # the ranks die with their parent (launch._die_with_parent)
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and
                                              Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0] != "Z" for p in pids):
        time.sleep(0.1)
    assert left[0].exists()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    from runtime.launch import launch

    assert launch(_rank, 1, None, timeout_s=120) == [0]
    assert not left[0].exists() and not list(tmp_path.glob(f"{PREFIX}*"))


def _marked(d: Path) -> int:
    try:
        return len((d / MARKER).read_text().split())
    except OSError:
        return 0


def _rank(ctx, payload):
    return ctx.rank
