"""Checkpoints on torch.distributed.checkpoint (issue 30 item 12): every rank writes its own shards, a resume under
another plan (dp <-> pp <-> ZeRO-3 <-> tp, colocated <-> non-colocated) reads its shards of them and keeps the
single-process reference's losses, an asynchronous save resumes bitwise, and a gathered (format /1) checkpoint is
still read. Runs go through the CLI in this process (CliRunner; the ranks are forked, gloo, one thread each)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from plans.plan import save_plan
from planner.cli import app
from runtime.checkpoint import FORMAT, FORMAT_DCP, latest_checkpoint, read_manifest
from runtime.checkpoint_dcp import read_full
from runtime.reference import reference_run
from runtime.train import Job
from tests.runtime.plan_builder import make_plan

VLM_ALL = ["vision", "vision_proj", "llm"]
PLANS = {
    "pp2": [{"name": "all", "stages": [(["vision", "vision_proj", "llm.embed"], [0]), (["llm"], [1])]}],
    "dp2": [{"name": "all", "dp": 2, "stages": [(VLM_ALL, [0, 1])]}],
    "dp1": [{"name": "all", "stages": [(VLM_ALL, [0])]}],
    "dp2-zero3": [{"name": "all", "dp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1])]}],
    "colocated-vision-dp2-llm-tp2": [
        {"name": "vision", "dp": 2, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "tp": 2, "colocated_with": "vision", "stages": [(["llm"], [0, 1])]}],
    "tp2-dp2-zero3": [{"name": "all", "dp": 2, "tp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1, 2, 3])]}],
    "non-colocated-llm-dp2-zero3": [
        {"name": "vision", "stages": [(["vision", "vision_proj"], [0])]},
        {"name": "llm", "dp": 2, "zero": 3, "stages": [(["llm"], [1, 2])]}],
}
runner = CliRunner()


def plan_file(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.json"
    if not path.exists():
        save_plan(make_plan("tiny-vlm", PLANS[name], micro_batches=2), path)
    return path


def run(plan: Path, *args) -> None:
    res = runner.invoke(app, ["run", str(plan), "--quiet", *map(str, args)])
    assert res.exit_code == 0, res.output


def losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plans")


@pytest.fixture(scope="module")
def reference() -> dict[int, float]:
    """The single-process run's losses over 6 steps (every plan here trains the same model, batch and seed)."""
    return reference_run(Job(plan=make_plan("tiny-vlm", PLANS["pp2"], micro_batches=2), model="tiny-vlm", steps=6))["losses"]


@pytest.mark.parametrize("saved, resumed", [
    ("dp2", "pp2"),
    ("dp2-zero3", "dp1"),
    ("colocated-vision-dp2-llm-tp2", "non-colocated-llm-dp2-zero3"),
])
def test_a_resume_under_another_plan_keeps_the_reference_losses(saved, resumed, plans, reference, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    run(plan_file(plans, saved), "--steps", 3, "--checkpoint-every", 3, "--checkpoint-dir", ckpt)
    manifest = latest_checkpoint(ckpt)
    assert manifest.format == FORMAT_DCP and manifest.step == 3
    run(plan_file(plans, resumed), "--steps", 6, "--resume", ckpt, "--log", log)
    got = losses(log)
    assert sorted(got) == [3, 4, 5]
    for step, loss in got.items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])


def test_every_rank_writes_its_own_shards(plans, reference, tmp_path):
    """tp 2 x ZeRO-3 over dp 2 (a 2-D mesh, tp outer): a tp-sharded weight and its Adam moments are written as 4
    chunks, one in each rank's file, no file holds half the bytes (no gather through one rank), and a pp2 plan
    resumes from them with the reference's losses."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    run(plan_file(plans, "tp2-dp2-zero3"), "--steps", 3, "--checkpoint-every", 3, "--checkpoint-dir", ckpt)
    manifest = latest_checkpoint(ckpt)
    assert sorted(manifest.files) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    meta = dcp.FileSystemReader(manifest.path).read_metadata()
    for key in ("model.llm.layers.0.mlp.w1.weight", "optim.llm.layers.0.mlp.w1.weight.exp_avg"):  # (128, 64), tp dim 0
        chunks = meta.state_dict_metadata[key].chunks
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [((r * 32, 0), (32, 64)) for r in range(4)]
    w2 = meta.state_dict_metadata["model.llm.layers.0.mlp.w2.weight"].chunks  # (64, 128): tp dim 1, ZeRO dim 0
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in w2) == [((0, 0), (32, 64)), ((0, 64), (32, 64)),
                                                                       ((32, 0), (32, 64)), ((32, 64), (32, 64))]
    by_file: dict[str, int] = {}
    for info in meta.storage_data.values():
        by_file[info.relative_path] = by_file.get(info.relative_path, 0) + info.length
    assert len(by_file) == 4 and max(by_file.values()) < 0.5 * sum(by_file.values())
    full = read_full(manifest, "model.")  # what the shards add up to, as a one-process reader sees it
    assert all(tuple(full[k].shape) == tuple(meta.state_dict_metadata[k].size) for k in full)
    run(plan_file(plans, "pp2"), "--steps", 6, "--resume", ckpt, "--log", log)
    got = losses(log)
    assert sorted(got) == [3, 4, 5]
    assert all(abs(loss - reference[step]) <= 1e-4 * abs(reference[step]) for step, loss in got.items())


def test_an_asynchronous_save_resumes_bitwise(plans, tmp_path):
    """Checkpoints at steps 2 and 4 written by a background thread while training went on: resuming from either gives
    the floats of the uninterrupted run (the snapshot was taken at the save, not when the thread wrote it)."""
    plan = plan_file(plans, "dp2-zero3")
    full, ckpt = tmp_path / "full.jsonl", tmp_path / "ckpt"
    run(plan, "--steps", 6, "--log", full)
    run(plan, "--steps", 4, "--checkpoint-every", 2, "--checkpoint-dir", ckpt, "--checkpoint-async")
    assert [p.name for p in sorted(ckpt.glob("step-*")) if (p / "manifest.json").is_file()] == ["step-000002", "step-000004"]
    want = losses(full)
    for start in (4, 2):
        log = tmp_path / f"from-{start}.jsonl"
        run(plan, "--steps", 6, "--resume", ckpt, "--log", log)
        got = losses(log)
        assert sorted(got) == list(range(start, 6)) and got == {s: want[s] for s in got}
        shutil.rmtree(ckpt / "step-000004", ignore_errors=True)  # next: from the older one


def test_a_gathered_checkpoint_still_resumes_bitwise_and_new_saves_use_dcp(plans, tmp_path):
    plan = plan_file(plans, "pp2")
    full, old, log = tmp_path / "full.jsonl", tmp_path / "old", tmp_path / "resumed.jsonl"
    run(plan, "--steps", 4, "--log", full)
    run(plan, "--steps", 2, "--checkpoint-every", 2, "--checkpoint-dir", old, "--checkpoint-format", "gather")
    assert read_manifest(latest_checkpoint(old).path).format == FORMAT and list(Path(latest_checkpoint(old).path).glob("*.pt"))
    new = tmp_path / "new"
    run(plan, "--steps", 4, "--resume", old, "--log", log, "--checkpoint-every", 4, "--checkpoint-dir", new)
    want, got = losses(full), losses(log)
    assert sorted(got) == [2, 3] and got == {s: want[s] for s in got}
    assert latest_checkpoint(new).format == FORMAT_DCP and latest_checkpoint(new).step == 4


def test_checkpoint_options_are_refused_in_one_line(tmp_path):
    plan = plan_file(tmp_path, "pp2")
    res = runner.invoke(app, ["run", str(plan), "--checkpoint-every", 1, "--checkpoint-dir", str(tmp_path / "c"),
                              "--checkpoint-format", "gather", "--checkpoint-async"])
    assert res.exit_code == 2 and "--checkpoint-async needs --checkpoint-format dcp" in res.output
    assert not (tmp_path / "c").exists()
