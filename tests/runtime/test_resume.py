"""Checkpoints in real runs: resume after SIGKILL is bitwise identical, under another plan it keeps parity,
and a damaged checkpoint is refused."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plans.plan import save_plan
from runtime.reference import reference_run
from runtime.train import Job
from tests.runtime.plan_builder import make_plan

PP2 = [{"name": "all", "stages": [(["vision", "vision_proj", "llm.embed"], [0]), (["llm"], [1])]}]
DP2 = [{"name": "all", "dp": 2, "stages": [(["vision", "vision_proj", "llm"], [0, 1])]}]


def mmplan(*args, **kw):
    return subprocess.run([sys.executable, "-m", "planner.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kw)


def losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


@pytest.fixture(scope="module")
def pp2_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "pp2.json"
    save_plan(make_plan("tiny-vlm", PP2, micro_batches=2), path)
    return path


def test_resume_after_sigkill_is_bitwise_identical(pp2_plan, tmp_path):
    steps = 40
    full = tmp_path / "full.jsonl"
    assert mmplan("run", pp2_plan, "--steps", steps, "--log", full, "--quiet").returncode == 0
    rng = random.Random(7)
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "run", str(pp2_plan), "--steps", str(steps),
                             "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt), "--quiet"],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(ckpt.glob("step-*/manifest.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.6))  # a random point after the first checkpoint, possibly mid-write
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = tmp_path / "resumed.jsonl"
    res = mmplan("run", pp2_plan, "--steps", steps, "--resume", ckpt, "--log", resumed, "--quiet")
    assert res.returncode == 0, res.stderr
    after = losses(resumed)
    assert after and min(after) >= 2
    want = losses(full)
    assert after == {s: want[s] for s in after}  # bitwise: the same floats


def test_a_dp2_checkpoint_resumes_under_a_pp2_plan_with_parity(tmp_path):
    dp2 = tmp_path / "dp2.json"
    plan = make_plan("tiny-vlm", DP2, micro_batches=2)
    save_plan(plan, dp2)
    pp2 = tmp_path / "pp2.json"
    save_plan(make_plan("tiny-vlm", PP2, micro_batches=2), pp2)
    ckpt = tmp_path / "ckpt"
    assert mmplan("run", dp2, "--steps", 4, "--checkpoint-every", 4, "--checkpoint-dir", ckpt, "--quiet").returncode == 0
    log = tmp_path / "pp2.jsonl"
    res = mmplan("run", pp2, "--steps", 8, "--resume", ckpt, "--log", log, "--quiet")
    assert res.returncode == 0, res.stderr
    ref = reference_run(Job(plan=plan, model="tiny-vlm", steps=8))["losses"]
    got = losses(log)
    assert sorted(got) == [4, 5, 6, 7]
    for step, loss in got.items():
        assert abs(loss - ref[step]) <= 1e-4 * abs(ref[step])


def test_a_damaged_checkpoint_is_refused(pp2_plan, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert mmplan("run", pp2_plan, "--steps", 2, "--checkpoint-every", 2, "--checkpoint-dir", ckpt, "--quiet").returncode == 0
    victim = sorted(ckpt.glob("step-*/*.distcp"))[0]  # a DCP shard file (the default --checkpoint-format)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = mmplan("run", pp2_plan, "--steps", 4, "--resume", ckpt)
    assert res.returncode == 2
    assert "corrupt" in res.stderr and victim.name in res.stderr and "Traceback" not in res.stderr
    victim.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    res = mmplan("run", pp2_plan, "--steps", 4, "--resume", ckpt)
    assert res.returncode == 2 and "corrupt" in res.stderr


def test_a_bf16_run_resumes_bitwise_with_its_fp32_masters(tmp_path):
    """The checkpoint of a bf16 plan holds Adam's fp32 master copies beside the bf16 weights: 4 + 4 resumed steps
    give the floats of 8 straight ones (restarting the masters from the rounded weights would not)."""
    plan = tmp_path / "pp2-bf16.json"
    save_plan(make_plan("tiny-vlm", PP2, micro_batches=2, dtype="bf16"), plan)
    full, resumed, ckpt = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    assert mmplan("run", plan, "--steps", 8, "--log", full, "--quiet").returncode == 0
    assert mmplan("run", plan, "--steps", 4, "--checkpoint-every", 4, "--checkpoint-dir", ckpt, "--quiet").returncode == 0
    res = mmplan("run", plan, "--steps", 8, "--resume", ckpt, "--log", resumed, "--quiet")
    assert res.returncode == 0, res.stderr
    want, got = losses(full), losses(resumed)
    assert sorted(got) == [4, 5, 6, 7] and got == {s: want[s] for s in got}
    from runtime.checkpoint import latest_checkpoint
    from runtime.checkpoint_dcp import read_full

    saved = read_full(latest_checkpoint(ckpt))
    params = {k[len("model."):]: t for k, t in saved.items() if k.startswith("model.llm.layers.0.")}
    masters = {k[len("optim."):-len(".master")]: t for k, t in saved.items()
               if k.startswith("optim.llm.layers.0.") and k.endswith(".master")}
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
    assert all(params[n].dtype == torch.bfloat16 and torch.equal(params[n], m.to(torch.bfloat16)) for n, m in masters.items())
    assert any(not torch.equal(m, params[n].float()) for n, m in masters.items())  # the bits bf16 cannot hold
