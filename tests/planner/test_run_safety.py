"""`mmplan run` never loses a checkpoint or a log: a checkpoint directory is locked and never emptied by a run that
did not resume from it, logs are appended on resume and never replace an input, a diverging run stops and keeps
its good checkpoints, manifests name their model, and a failed save leaves nothing half-written."""
from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from runtime.checkpoint import MANIFEST, complete_steps, read_manifest
from runtime.dirlock import DirLock
from tests.cli_helpers import one_line_error

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "plans" / "examples"
PP2 = EXAMPLES / "tiny-vlm-pp2.json"
runner = CliRunner()


def run(*args) -> "object":
    return runner.invoke(app, ["run", *map(str, args)])


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (lock file aside) -> its sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".mmplan-lock"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A checkpoint directory holding step 2 and step 4 of a tiny-vlm run."""
    ck = tmp_path_factory.mktemp("ck") / "ck"
    res = run(PP2, "--steps", 4, "--checkpoint-every", 2, "--checkpoint-dir", ck, "--quiet")
    assert res.exit_code == 0, res.output
    assert [p.name for p in complete_steps(ck)] == ["step-000002", "step-000004"]
    return ck


def copy_of(ck: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(ck, dst)
    return dst


# --- checkpoint directories -----------------------------------------------------------------------------------


def test_a_directory_holding_checkpoints_is_refused_without_resume_or_overwrite(ckpt, tmp_path):
    ck = copy_of(ckpt, tmp_path / "ck")
    before = snapshot(ck)
    line = one_line_error(run(PP2, "--steps", 2, "--checkpoint-every", 1, "--checkpoint-dir", ck, "--quiet"))
    assert "already holds checkpoints" in line and "--overwrite" in line and "--resume" in line
    other = copy_of(ckpt, tmp_path / "other")  # resuming from one directory into another that holds checkpoints
    line = one_line_error(run(PP2, "--steps", 6, "--checkpoint-every", 1, "--checkpoint-dir", ck, "--resume", other))
    assert "already holds checkpoints" in line
    assert snapshot(ck) == before


def test_overwrite_replaces_them_only_once_its_own_first_checkpoint_is_complete(ckpt, tmp_path):
    ck = copy_of(ckpt, tmp_path / "ck")
    before = snapshot(ck)
    res = run(PP2, "--steps", 1, "--checkpoint-every", 3, "--checkpoint-dir", ck, "--overwrite", "--quiet")
    assert res.exit_code == 0, res.output
    assert snapshot(ck) == before  # no checkpoint of its own yet: the old ones stay
    res = run(PP2, "--steps", 3, "--checkpoint-every", 3, "--checkpoint-dir", ck, "--overwrite", "--quiet")
    assert res.exit_code == 0, res.output
    assert [p.name for p in complete_steps(ck)] == ["step-000003"]  # replaced, not mixed with the old run's


def test_resuming_in_place_keeps_the_line_and_rotates_it(ckpt, tmp_path):
    ck = copy_of(ckpt, tmp_path / "ck")
    lineage = read_manifest(ck / "step-000004").lineage
    res = run(PP2, "--steps", 6, "--checkpoint-every", 2, "--checkpoint-dir", ck, "--resume", ck, "--quiet")
    assert res.exit_code == 0, res.output
    assert [p.name for p in complete_steps(ck)] == ["step-000004", "step-000006"]
    assert read_manifest(ck / "step-000006").lineage == lineage


def test_a_directory_in_use_by_another_run_is_refused(ckpt, tmp_path):
    ck = copy_of(ckpt, tmp_path / "ck")
    before = snapshot(ck)
    with DirLock(ck, "--checkpoint-dir"):  # another run holds it
        line = one_line_error(run(PP2, "--steps", 6, "--checkpoint-every", 1, "--checkpoint-dir", ck, "--resume", ck))
        assert "in use by another mmplan run" in line and f"pid {os.getpid()}" in line
        line = one_line_error(run(PP2, "--steps", 6, "--resume", ck))  # reading it while it is written: refused too
        assert "in use" in line
    assert snapshot(ck) == before
    assert not (ck / ".mmplan-lock").exists()


def test_the_lock_dies_with_its_holder(tmp_path):
    pid = os.fork()
    if pid == 0:  # a run that is SIGKILLed while holding the directory
        DirLock(tmp_path, "--checkpoint-dir").acquire()
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    os.waitpid(pid, os.WUNTRACED)
    with pytest.raises(Exception, match=f"in use by another mmplan run \\(pid {pid}\\)"):
        DirLock(tmp_path, "--checkpoint-dir").acquire()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with DirLock(tmp_path, "--checkpoint-dir") as lock:
        assert lock.held
    with DirLock(tmp_path, "--resume", shared=True), DirLock(tmp_path, "--resume", shared=True):
        pass  # readers share


def test_resume_refuses_a_checkpoint_of_another_model(ckpt, tmp_path):
    line = one_line_error(run(EXAMPLES / "tiny-avlm-non-colocated-4xlocal-cpu.json", "--steps", 6, "--resume", ckpt))
    assert "'tiny-vlm'" in line and "'tiny-avlm'" in line and "fingerprint" in line


@pytest.mark.parametrize("field, value, words", [
    ("step", -5, "step -5"),
    ("step", 3, "step 3 is not the step of directory step-000004"),
    ("data_position", -1, "data_position"),
    ("rng", {"0": {"python": [3, [1, 2], None]}}, "rng of rank 0 cannot be restored"),
    ("rng", {"0": {"torch": "AAAA"}}, "rng of rank 0 cannot be restored"),
    ("fingerprint", 7, "must be strings"),
])
def test_manifest_fields_are_validated_before_any_work(ckpt, tmp_path, field, value, words):
    ck = copy_of(ckpt, tmp_path / "ck")
    for step in ("step-000002", "step-000004"):
        path = ck / step / MANIFEST
        doc = json.loads(path.read_text())
        doc[field] = value
        path.write_text(json.dumps(doc))
    line = one_line_error(run(PP2, "--steps", 6, "--resume", ck))
    assert "unreadable" in line and words in line


def test_a_manifest_without_a_fingerprint_is_refused(ckpt, tmp_path):
    ck = copy_of(ckpt, tmp_path / "ck")
    path = ck / "step-000004" / MANIFEST
    doc = json.loads(path.read_text())
    del doc["fingerprint"], doc["model"]
    path.write_text(json.dumps(doc))
    line = one_line_error(run(PP2, "--steps", 6, "--resume", ck))
    assert "records no model fingerprint" in line


# --- logs ----------------------------------------------------------------------------------------------------


def steps_in(log: Path) -> list[int]:
    return [json.loads(line)["step"] for line in log.read_text().splitlines()]


def test_a_log_is_appended_on_resume_and_never_silently_replaced(ckpt, tmp_path):
    ck = copy_of(ckpt, tmp_path / "ck")
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 0}\n{"step": 1}\n')
    res = run(PP2, "--steps", 5, "--resume", ck, "--log", log, "--quiet")
    assert res.exit_code == 0, res.output
    assert steps_in(log) == [0, 1, 4]  # earlier rows kept
    before = log.read_text()
    line = one_line_error(run(PP2, "--steps", 1, "--log", log))
    assert "already holds a run's log" in line and log.read_text() == before
    res = run(PP2, "--steps", 1, "--log-file", log, "--overwrite", "--quiet")
    assert res.exit_code == 0, res.output
    assert steps_in(log) == [0]


def test_a_log_never_replaces_an_input_or_follows_a_link(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_bytes(PP2.read_bytes())
    for log in (plan, tmp_path / "hardlink.json"):
        if log != plan:
            os.link(plan, log)
        line = one_line_error(run(plan, "--steps", 1, "--log", log, "--overwrite"))
        assert "input file" in line and plan.read_bytes() == PP2.read_bytes()
    target = tmp_path / "target.txt"
    target.write_text("keep me\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    line = one_line_error(run(PP2, "--steps", 1, "--log", link, "--overwrite"))
    assert "symbolic link" in line and target.read_text() == "keep me\n"


def test_outputs_of_profile_and_solve_never_replace_their_inputs(tmp_path):
    toml = tmp_path / "m.toml"
    toml.write_bytes((REPO / "runtime/models/examples/gpt3-2.7b.toml").read_bytes())
    res = runner.invoke(app, ["profile", str(toml), "-o", str(toml)])
    assert "input file" in one_line_error(res) and toml.read_bytes() == (REPO / "runtime/models/examples/gpt3-2.7b.toml").read_bytes()
    prof = tmp_path / "p.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(prof), "--quiet"]).exit_code == 0
    before = prof.read_bytes()
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "8", "-o", str(prof)])
    assert "input file" in one_line_error(res) and prof.read_bytes() == before


def test_a_trace_or_an_export_never_replaces_the_plan_it_reads(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_bytes(PP2.read_bytes())
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0}\n')
    for trace in (plan, log):
        line = one_line_error(run(plan, "--steps", 1, "--trace", trace, "--log", log, "--overwrite"))
        assert "--trace" in line and "input file" in line
    assert plan.read_bytes() == PP2.read_bytes() and log.read_text() == '{"step": 0}\n'
    res = runner.invoke(app, ["export", str(plan), "--to", "deepspeed", "-o", str(plan)])
    assert "input file" in one_line_error(res) and plan.read_bytes() == PP2.read_bytes()


def test_a_run_that_fails_before_its_first_step_leaves_no_log_and_no_directories(tmp_path):
    log, ck = tmp_path / "run.jsonl", tmp_path / "new" / "ck"
    res = run(PP2, "--steps", 3, "--log", log, "--checkpoint-every", 1, "--checkpoint-dir", ck, "--device-budget", 1)
    one_line_error(res)
    assert not log.exists() and not (tmp_path / "new").exists()


# --- divergence ----------------------------------------------------------------------------------------------


def test_a_diverging_run_stops_logs_no_nan_and_keeps_its_good_checkpoints(ckpt, tmp_path):
    ck = copy_of(ckpt, tmp_path / "ck")
    good = snapshot(ck / "step-000004")
    log = tmp_path / "run.jsonl"
    res = run(PP2, "--steps", 20, "--resume", ck, "--checkpoint-dir", ck, "--checkpoint-every", 1, "--lr", 1e30, "--log", log)
    line = one_line_error(res)
    assert "diverged at step" in line and "--lr" in line
    bad = int(line.split("diverged at step ")[1].split(":")[0])
    rows = [json.loads(r) for r in log.read_text().splitlines()]  # valid JSON: no NaN written
    assert [r["step"] for r in rows] == list(range(4, bad))
    steps = [int(p.name.split("-")[1]) for p in complete_steps(ck)]
    assert steps and max(steps) < bad  # the checkpoint holding the weights that diverged is gone
    assert snapshot(ck / "step-000004") == good or 4 not in steps
    res = run(PP2, "--steps", max(steps) + 1, "--resume", ck, "--quiet", "--json")
    assert res.exit_code == 0, res.output  # what is left resumes, with a finite loss
    assert all(math.isfinite(x) for x in json.loads(res.stdout.splitlines()[-1])["losses"])


# --- a failing save ------------------------------------------------------------------------------------------


def _limit_file_size():  # a disk that refuses large files: writes beyond 300 KB fail with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))


def test_a_save_that_fails_leaves_no_partial_checkpoint_and_names_the_file(ckpt, tmp_path):
    ck = copy_of(ckpt, tmp_path / "ck")
    before = snapshot(ck)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "planner.cli", "run", str(PP2), "--steps", "8", "--resume", str(ck),
                          "--checkpoint-dir", str(ck), "--checkpoint-every", "1"],
                         capture_output=True, text=True, timeout=300, env=env, preexec_fn=_limit_file_size)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert "cannot write checkpoint file" in lines[0] and str(ck / "step-000005") in lines[0] and ".distcp" in lines[0]
    assert snapshot(ck) == before  # no partial step directory, no temporary file
    assert [p.name for p in ck.iterdir()] and all(p.name.startswith("step-") for p in ck.iterdir())


def test_a_second_run_on_a_directory_in_use_is_refused_and_the_first_finishes_unharmed(tmp_path):
    ck = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-m", "planner.cli", "run", str(PP2), "--steps", "100000", "--checkpoint-every", "2",
                              "--checkpoint-dir", str(ck), "--quiet"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not complete_steps(ck):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        for args in (["--checkpoint-dir", str(ck), "--checkpoint-every", "1"],
                     ["--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--overwrite"],
                     ["--resume", str(ck)]):
            line = one_line_error(run(PP2, "--steps", "2", *args))
            assert f"in use by another mmplan run (pid {first.pid})" in line
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=30)
    assert first.returncode == 128 + signal.SIGTERM and err.strip() == "error: terminated by SIGTERM"
    newest = complete_steps(ck)[-1]
    res = run(PP2, "--steps", int(newest.name.split("-")[1]) + 1, "--resume", ck, "--quiet")  # what it left resumes
    assert res.exit_code == 0, res.output


def test_a_resumed_logs_redone_steps_replace_the_abandoned_ones_when_read(tmp_path):
    from planner.commands.compare import read_metrics

    row = {"step_time_s": 1.0, "compute_s": [0.5], "comm_s": [0.1], "idle_s": [0.4], "peak_memory_bytes": [1.0]}
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({**row, "step": s, "loss": float(i)}) + "\n" for i, s in enumerate([0, 1, 2, 1, 2, 3])))
    steps = read_metrics(log)
    assert [s.step for s in steps] == [0, 1, 2, 3] and [s.loss for s in steps] == [0.0, 3.0, 4.0, 5.0]
