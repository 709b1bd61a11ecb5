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
    # parameters cpu / nvme, gradients cpu
    "optimizer-cpu+offload-cpu | optimizer-nvme+recompute": [
        (FIRST, [0], Memory(optimizer="cpu", activations={"*": "offload-cpu"})),
        (["llm"], [1], Memory(optimizer="nvme", activations={"*": "recompute"})),
    ],
    "params-nvme+grads-cpu+offload-nvme | params-cpu+optimizer-nvme": [
        (FIRST, [0], Memory(params="nvme", grads="cpu", activations={"*": "offload-nvme"})),
        (["llm"], [1], Memory(params="cpu", optimizer="nvme")),
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
