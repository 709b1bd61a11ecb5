"""ZeRO 1/2/3 on FSDP2 (runtime/zero.py): loss and gradient parity with the single-process reference, composed with
pipelines, tensor parallelism and a CPU-offloaded optimizer; checkpoints of sharded state resume under zero=0."""
from __future__ import annotations

import pytest
import torch

from plans.plan import Memory
from runtime.launch import launch
from runtime.train import Job, train_rank
from runtime.reference import reference_run
from tests.runtime.plan_builder import make_plan
from tests.runtime.test_parity import check_parity

STEPS = 6
VLM_ALL = ["vision", "vision_proj", "llm"]
PLANS = {
    "dp2-zero1": ("tiny-vlm", [{"name": "all", "dp": 2, "zero": 1, "stages": [(VLM_ALL, [0, 1])]}], {}),
    "dp2-zero2": ("tiny-vlm", [{"name": "all", "dp": 2, "zero": 2, "stages": [(VLM_ALL, [0, 1])]}], {}),
    "dp2-zero3": ("tiny-vlm", [{"name": "all", "dp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1])]}], {}),
    "pp2-dp2-zero3": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 3, "stages": [(["vision", "vision_proj", "llm.embed"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
    "dp2-zero2-optimizer-cpu": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 2, "stages": [(VLM_ALL, [0, 1], Memory(optimizer="cpu"))]},
    ], {}),
    "dp2-zero3-params-cpu": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1], Memory(params="cpu", grads="cpu", optimizer="cpu"))]},
    ], {}),
    "dp2-zero3-recompute": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1], Memory(activations={"*": "recompute"}))]},
    ], {}),
    "tp2-dp2-zero3": ("tiny-vlm", [{"name": "all", "dp": 2, "tp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1, 2, 3])]}], {}),
}

_REFERENCE: dict = {}


def reference(model: str, job: Job) -> dict:
    """The single-process run of `job` (cached by what it depends on: model, training, frozen blocks, steps)."""
    frozen = tuple(b.name for b in job.plan.flow.blocks if b.frozen)
    key = (model, job.plan.training, frozen, job.steps)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_run(job)
    return _REFERENCE[key]


@pytest.mark.parametrize("case", list(PLANS))
def test_zero_matches_single_process_reference(case):
    model, groups, training = PLANS[case]
    plan = make_plan(model, groups, **training)
    job = Job(plan=plan, model=model, steps=STEPS, seed=0, probe_grads=True)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    check_parity(case, results, reference(model, job))


def test_a_zero3_checkpoint_is_unsharded_and_resumes_under_zero0_and_zero2(tmp_path):
    """Sharded parameters and Adam state are gathered into the layout-independent checkpoint, and taken apart
    again when a ZeRO run resumes: 2 steps under ZeRO-3 + 2 resumed give the uninterrupted run's losses."""
    stage = [(VLM_ALL, [0, 1])]
    z3, z0, z2 = (make_plan("tiny-vlm", [{"name": "all", "dp": 2, "zero": z, "stages": stage}]) for z in (3, 0, 2))
    whole = launch(train_rank, 2, Job(plan=z3, model="tiny-vlm", steps=4), timeout_s=240)[0]["metrics"]
    ckpt = tmp_path / "ckpt"
    launch(train_rank, 2, Job(plan=z3, model="tiny-vlm", steps=2, checkpoint_every=2, checkpoint_dir=str(ckpt)), timeout_s=240)
    for plan in (z0, z2):
        resumed = launch(train_rank, 2, Job(plan=plan, model="tiny-vlm", steps=4, resume=str(ckpt)), timeout_s=240)[0]["metrics"]
        assert [m["step"] for m in resumed] == [2, 3]
        for got, want in zip(resumed, whole[2:]):
            assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)


@pytest.mark.parametrize("case", ["dp2-zero3", "dp2-zero2-optimizer-cpu"])
def test_a_bf16_zero_plan_steps_fp32_masters_of_its_shards(case):
    """bf16 under ZeRO: FSDP2 shards the bf16 parameters, Adam's fp32 masters cover this rank's shard only (in the
    optimizer's tier); losses and gradients as the single-process bf16 reference's, to bf16 rounding."""
    model, groups, training = PLANS[case]
    plan = make_plan(model, groups, dtype="bf16", **training)
    job = Job(plan=plan, model=model, steps=6, seed=0, probe_grads=True)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    assert all(g.dtype == torch.bfloat16 for r in results for g in r["grads"].values())
    check_parity(case, results, reference(model, job), loss_rtol=2e-2, grad_tol=4e-2)
