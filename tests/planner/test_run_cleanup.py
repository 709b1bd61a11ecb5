"""`mmplan run` runs only the code the user asked for, and gives back every resource it created on every exit path:
success, refusal, a killed rank, SIGTERM / SIGHUP to the launcher, and a launcher killed outright."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans.plan import Memory, save_plan
from tests.runtime.plan_builder import make_plan
from tests.cli_helpers import one_line_error

REPO = Path(__file__).resolve().parents[2]
PP2 = REPO / "plans" / "examples" / "tiny-vlm-pp2.json"
runner = CliRunner()
FIRST = ["vision", "vision_proj", "llm.embed"]


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if not p.is_dir()]


@pytest.fixture(scope="module")
def nvme_plan(tmp_path_factory) -> Path:
    """tiny-vlm on 2 ranks with parameters, activations and optimizer state in the nvme tier."""
    path = tmp_path_factory.mktemp("plans") / "nvme.json"
    save_plan(make_plan("tiny-vlm", [{"name": "all", "stages": [
        (FIRST, [0], Memory(params="nvme", grads="cpu", activations={"*": "offload-nvme"})),
        (["llm"], [1], Memory(params="cpu", optimizer="nvme")),
    ]}], micro_batches=2), path)
    return path


def start(args: list, tmp_path: Path) -> subprocess.Popen:
    """`mmplan run` in its own session, with its own TMPDIR (to see what it leaves there)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.Popen([sys.executable, "-m", "planner.cli", "run", *map(str, args)], cwd=tmp_path, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def leftovers(tmp_path: Path, nvme: Path) -> list[Path]:
    """Files in the nvme directory, and anything of ours or any file in TMPDIR (torch's own empty cache
    directory, made at import, is not the run's)."""
    tmp = tmp_path / "tmp"
    ours = files_under(nvme) + list(nvme.iterdir()) if nvme.exists() else []  # a directory the run made goes too
    return ours + list(tmp.glob("mmplan-*")) + files_under(tmp)


# --- code the user did not ask for ---------------------------------------------------------------------------


@pytest.mark.parametrize("factory", ["evil:factory", "os:abort", "signal:pause"])
def test_a_plan_cannot_choose_code_to_run(tmp_path, monkeypatch, factory):
    (tmp_path / "evil.py").write_text("import pathlib\npathlib.Path('ran').write_text('x')\ndef factory(mb):\n    raise SystemExit\n")
    doc = json.loads(PP2.read_text())
    doc["profile"]["model"] = factory
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    line = one_line_error(runner.invoke(app, ["run", str(plan), "--steps", "1"]))
    assert time.monotonic() - t0 < 30
    assert f"--model {factory}" in line and not (tmp_path / "ran").exists()
    # the user's own --model is what runs (here the zoo model the plan's fingerprint belongs to)
    res = runner.invoke(app, ["run", str(plan), "--steps", "1", "--model", "tiny-vlm", "--quiet"])
    assert res.exit_code == 0, res.output


def test_a_plan_with_a_gap_in_its_ranks_is_refused_before_launch(tmp_path):
    doc = json.loads(PP2.read_text())
    doc["cluster"]["gpus_per_node"] = 4
    doc["groups"][2]["stages"][0]["ranks"] = [3]
    plan = tmp_path / "gap.json"
    plan.write_text(json.dumps(doc))
    t0 = time.monotonic()
    line = one_line_error(runner.invoke(app, ["run", str(plan), "--steps", "1"]))
    assert "ranks 0, 3 but not 1, 2" in line and time.monotonic() - t0 < 30


# --- cleanup ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_launcher_stops_it_within_5_s_leaving_nothing(nvme_plan, tmp_path, sig):
    nvme = tmp_path / "nvme"
    proc = start([nvme_plan, "--steps", 100000, "--nvme-dir", nvme, "--quiet"], tmp_path)
    wait_for(lambda: any(p.name.endswith(".bin") for p in files_under(nvme)) if nvme.exists() else False)
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 5.0
    assert proc.returncode == 128 + sig
    assert err.strip().splitlines() == [f"error: terminated by {signal.Signals(sig).name}"]
    assert leftovers(tmp_path, nvme) == []


def test_a_killed_rank_leaves_no_tier_files(nvme_plan, tmp_path):
    nvme = tmp_path / "nvme"
    proc = start([nvme_plan, "--steps", 100000, "--nvme-dir", nvme, "--quiet"], tmp_path)
    wait_for(lambda: any(p.name.endswith(".bin") for p in files_under(nvme)) if nvme.exists() else False)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    os.kill(int(children[-1]), signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "was killed by signal SIGKILL" in err
    assert leftovers(tmp_path, nvme) == []


def test_a_killed_launchers_tier_files_are_removed_by_the_next_run(nvme_plan, tmp_path):
    nvme = tmp_path / "nvme"
    proc = start([nvme_plan, "--steps", 100000, "--nvme-dir", nvme, "--quiet"], tmp_path)
    wait_for(lambda: any(p.name.endswith(".bin") for p in files_under(nvme)) if nvme.exists() else False)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup possible; its ranks die with it
    proc.communicate(timeout=30)
    assert files_under(nvme)
    res = runner.invoke(app, ["run", str(nvme_plan), "--steps", "1", "--nvme-dir", str(nvme), "--quiet"])
    assert res.exit_code == 0, res.output
    assert list(nvme.iterdir()) == []


def test_tier_files_are_removed_after_success_resume_and_refusal(nvme_plan, tmp_path):
    nvme, ck = tmp_path / "nvme", tmp_path / "ck"
    res = runner.invoke(app, ["run", str(nvme_plan), "--steps", "2", "--nvme-dir", str(nvme), "--checkpoint-every", "2",
                              "--checkpoint-dir", str(ck), "--quiet"])
    assert res.exit_code == 0, res.output
    assert list(nvme.iterdir()) == []
    res = runner.invoke(app, ["run", str(nvme_plan), "--steps", "3", "--nvme-dir", str(nvme), "--resume", str(ck), "--quiet"])
    assert res.exit_code == 0, res.output
    assert list(nvme.iterdir()) == []
    res = runner.invoke(app, ["run", str(nvme_plan), "--steps", "3", "--nvme-dir", str(nvme), "--device-budget", "1"])
    one_line_error(res)
    assert list(nvme.iterdir()) == []


@contextlib.contextmanager
def unwritable(path: Path):
    """A directory nobody may create files in (root too: the immutable attribute, where the file system has it)."""
    path.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("running as root on a file system without chattr +i")
        try:
            yield path
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)


def test_unwritable_checkpoint_and_nvme_directories_are_refused_before_launch(nvme_plan, tmp_path):
    with unwritable(tmp_path / "ro") as ro:
        t0 = time.monotonic()
        line = one_line_error(runner.invoke(app, ["run", str(PP2), "--steps", "2", "--checkpoint-every", "1",
                                                  "--checkpoint-dir", str(ro)]))
        assert str(ro) in line and "--checkpoint-dir" in line
        line = one_line_error(runner.invoke(app, ["run", str(nvme_plan), "--steps", "2", "--nvme-dir", str(ro)]))
        assert str(ro) in line and "--nvme-dir" in line
        assert time.monotonic() - t0 < 30


def test_nvme_clean_up_removes_only_directories_mmplan_marked_as_its_own(nvme_plan, tmp_path):
    """Issue 30: a user's checkpoint and results directories named mmplan-run-* in --nvme-dir were deleted by the next
    run (which exited 0). Only directories holding the marker written at their creation are stale runs."""
    from planner.commands.run import NVME_RUN_MARKER

    nvme = tmp_path / "nvme"
    users = [nvme / "mmplan-run-checkpoints", nvme / "mmplan-run-results"]
    for d in users:
        d.mkdir(parents=True)
        (d / "data.bin").write_bytes(b"mine")
    stale = nvme / "mmplan-run-killed"  # what a SIGKILLed run leaves: marked, unlocked
    stale.mkdir()
    (stale / NVME_RUN_MARKER).write_text("made by mmplan run\n")
    (stale / "params.bin").write_bytes(b"x")
    for d in (*users, stale):
        os.utime(d, (time.time() - 3600, time.time() - 3600))  # older than any run being created
    res = runner.invoke(app, ["run", str(nvme_plan), "--steps", "1", "--nvme-dir", str(nvme), "--quiet"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in nvme.iterdir()) == sorted(d.name for d in users)
    assert all((d / "data.bin").read_bytes() == b"mine" for d in users)
