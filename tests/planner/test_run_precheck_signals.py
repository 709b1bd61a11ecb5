"""SIGTERM, SIGHUP and SIGINT during `mmplan run`'s pre-check end it at once (runtime/signals.exit_at_once), even when
the code running then swallows the interrupt (a library's broad `except`): issue 31 saw a pre-check outlive SIGTERM by
more than 45 s. Before the fix the stubborn factory below kept the process alive for its whole minute."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DP2 = REPO / "plans" / "examples" / "tiny-vlm-dp2.json"
STUBBORN = '''import time
def factory(micro_batch):
    open("started", "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except BaseException:  # library code that swallows KeyboardInterrupt (and the Terminated it raises)
            pass
    raise SystemExit("the factory was not stopped")
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_during_the_pre_check_ends_run_at_once(tmp_path, sig):
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "run", str(DP2), "--steps", "1", "--model",
                             "stubborn:factory"], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists():  # the pre-check is building the model
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "timed out"
            time.sleep(0.05)
        time.sleep(0.2)
        t0 = time.monotonic()
        for _ in range(3):  # a swallowed first signal used to make every later one ignored
            proc.send_signal(sig)
            time.sleep(0.1)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 5.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig
    want = "error: interrupted" if sig == signal.SIGINT else f"error: terminated by {signal.Signals(sig).name}"
    assert err.strip().splitlines() == [want]
