"""Bucketed data-parallel gradient reduction during the backward trains exactly like the reduction after it."""
from __future__ import annotations

from dataclasses import replace

import torch

from runtime.launch import RankContext, launch
from runtime.train import Job, RankTrainer
from tests.runtime.plan_builder import make_plan


def train_buckets(ctx: RankContext, job: Job) -> dict:
    torch.manual_seed(job.seed)
    trainer = RankTrainer(ctx, job)
    try:
        result = trainer.run()
        result["buckets"] = {k: (len(b.buckets), b.during_backward) for k, b in trainer.buckets.items()}
        return result
    finally:
        trainer.close()


def test_bucketed_reduction_matches_the_sync_one_bitwise():
    plan = make_plan("tiny-vlm", [
        {"name": "all", "dp": 2, "stages": [(["vision", "vision_proj", "llm.embed"], [0, 1]), (["llm"], [2, 3])]},
    ], micro_batches=2)
    sync = Job(plan=plan, model="tiny-vlm", steps=3, seed=0, probe_grads=True, bucket_bytes=0)
    bucketed = replace(sync, bucket_bytes=16 * 1024)  # several buckets per stage
    want = launch(train_buckets, 4, sync, timeout_s=120)
    got = launch(train_buckets, 4, bucketed, timeout_s=120)
    assert want[0]["buckets"] == {}
    for r in got:
        for n, during in r["buckets"].values():
            assert n > 1 and during >= 1  # buckets were launched while the backward still ran
    assert [m["loss"] for m in got[0]["metrics"]] == [m["loss"] for m in want[0]["metrics"]]
    for g, w in zip(got, want):
        assert set(g["grads"]) == set(w["grads"])
        for name, grad in g["grads"].items():
            assert torch.equal(grad, w["grads"][name]), name
