"""Memory tiers in real runs: offload, recompute and off-device state never change the numbers, and a
device-tier budget below the model's training state is respected."""
from __future__ import annotations

import pytest

from plans.plan import Memory
from runtime.launch import launch
from runtime.reference import reference_run
from runtime.train import Job, train_rank
from tests.runtime.plan_builder import make_plan

STEPS = 20
FIRST = ["vision", "vision_proj", "llm.embed"]

TIER_PLANS = {
    # every option appears once: optimizer cpu / nvme, activations offload-cpu / offload-nvme / recompute,
    # parameters cpu / nvme, gradients cpu / nvme
    "optimizer-cpu+offload-cpu | optimizer-nvme+recompute": [
        (FIRST, [0], Memory(optimizer="cpu", activations={"*": "offload-cpu"})),
        (["llm"], [1], Memory(optimizer="nvme", activations={"*": "recompute"})),
    ],
    "params-nvme+grads-cpu+offload-nvme | params-cpu+grads-nvme+optimizer-nvme": [
        (FIRST, [0], Memory(params="nvme", grads="cpu", activations={"*": "offload-nvme"})),
        (["llm"], [1], Memory(params="cpu", grads="nvme", optimizer="nvme")),
    ],
}


@pytest.mark.parametrize("case", list(TIER_PLANS))
def test_tier_options_keep_loss_parity(case, tmp_path):
    plan = make_plan("tiny-vlm", [{"name": "all", "stages": TIER_PLANS[case]}], micro_batches=2)
    (tmp_path / "nvme").mkdir()
    job = Job(plan=plan, model="tiny-vlm", steps=STEPS, nvme_dir=str(tmp_path / "nvme"))
    ref = reference_run(job)
    res = launch(train_rank, 2, job, timeout_s=240)
    losses = [m["loss"] for m in res[0]["metrics"]]
    for got, want in zip(losses, ref["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    assert not any((tmp_path / "nvme").rglob("*")), "nvme tier files left behind"


@pytest.mark.parametrize("case", list(TIER_PLANS))
def test_a_bf16_plans_tiers_hold_its_fp32_masters_and_keep_parity(case, tmp_path):
    """bf16 with every tier option: the fp32 master copies live with the optimizer state (cpu, nvme), parameters
    and gradients move in bf16; losses as the single-process bf16 reference's (bf16 rounding allowed)."""
    plan = make_plan("tiny-vlm", [{"name": "all", "stages": TIER_PLANS[case]}], micro_batches=2, dtype="bf16")
    (tmp_path / "nvme").mkdir()
    job = Job(plan=plan, model="tiny-vlm", steps=6, nvme_dir=str(tmp_path / "nvme"))
    ref = reference_run(job)
    res = launch(train_rank, 2, job, timeout_s=240)
    for got, want in zip([m["loss"] for m in res[0]["metrics"]], ref["losses"], strict=True):
        assert abs(got - want) <= 2e-2 * abs(want)
    assert ref["losses"][-1] < ref["losses"][0]
    assert not any((tmp_path / "nvme").rglob("*")), "nvme tier files left behind"


def test_a_bf16_plans_measured_peak_is_the_predicted_one():
    """A solved bf16 plan: 2 B parameters and gradients, 12 B of optimizer state (fp32 master, momentum, variance)
    and bf16 activations, as the cost model counts them; the same plan run in fp32 measured 35 % above it."""
    from planner.profiler.profile import profile_model
    from planner.solver.solve import solve
    from cost_models.cluster_spec import parse_cluster
    from runtime.source import resolve

    prof = profile_model(resolve("tiny-vlm"), dtype="bf16")
    plan = solve(prof, parse_cluster("2xlocal-cpu"), 8).plan
    assert plan.training.dtype == "bf16"
    res = launch(train_rank, plan.world_size, Job(plan=plan, model="tiny-vlm", steps=3), timeout_s=240)
    measured = max(max(m["peak_memory_bytes"]) for m in res[0]["metrics"][1:])
    predicted = max(m.gpu for m in plan.predicted.memory)
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted)


def test_training_beyond_device_memory_with_the_solvers_tier_plan(tmp_path):
    """A device tier of a quarter of tiny-vlm's training state: the solver places state off the device, the
    run keeps parity, stays within the budget, and its measured peak is what the cost model predicted."""
    import torch

    from cost_models.cluster_toml import cluster_from_toml
    from planner.solver.diagnosis import state_bytes
    from planner.profiler.profile import profile_model
    from planner.solver.solve import solve
    from runtime.source import resolve

    prof = profile_model(resolve("tiny-vlm"))
    training_state = state_bytes(prof, "fp32") + sum(b.activation_bytes for b in prof.blocks) * 4
    budget = training_state / 4
    cluster = cluster_from_toml(f'base = "local-cpu"\nnodes = 1\ngpus_per_node = 1\n[device]\nmemory_gb = {budget / 1e9:.9f}\n')
    plan = solve(prof, cluster, 8).plan
    stages = [s for g in plan.groups for s in g.stages]
    assert any(s.memory.params != "gpu" or s.memory.optimizer != "gpu" or set(s.memory.activations.values()) - {"keep"}
               for s in stages), "the plan should move state off the device tier"
    predicted = max(m.gpu for m in plan.predicted.memory)
    assert predicted <= budget
    job = Job(plan=plan, model="tiny-vlm", steps=STEPS, device_budget=budget, nvme_dir=str(tmp_path))  # the plan may use the NVMe tier
    ref = reference_run(job)
    res = launch(train_rank, plan.world_size, job, timeout_s=240)
    metrics = res[0]["metrics"]
    for got, want in zip([m["loss"] for m in metrics], ref["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    measured = max(max(m["peak_memory_bytes"]) for m in metrics[1:])
    assert measured <= budget
    # the predicted peak holds the next block's prefetched parameters (params off the device, brought in one block
    # ahead by a background thread); whether that prefetch has landed at the moment of the peak is thread timing:
    # measured 969-985 kB (landed later) or ~1.11 MB (landed) of the same plan in repeated runs
    prefetched = max(b.param_bytes for b in prof.blocks) if any(s.memory.params != "gpu" for s in stages) else 0
    assert predicted - prefetched - 0.10 * predicted <= measured <= 1.10 * predicted, (measured, predicted, prefetched)
