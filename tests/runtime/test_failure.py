"""A rank that raises mid-run stops the whole job quickly, naming the rank and its own error."""
from __future__ import annotations

import time

import pytest

from runtime.launch import RankFailure, launch
from runtime.train import Job, train_rank
from tests.runtime.plan_builder import make_plan


def test_rank_raising_at_step_3_stops_the_job_naming_it():
    plan = make_plan("tiny-vlm", [
        {"name": "all", "stages": [(["vision", "vision_proj", "llm.embed"], [0]), (["llm"], [1])]},
    ], micro_batches=2)
    job = Job(plan=plan, model="tiny-vlm", steps=50, fail_at=(1, 3))
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as err:
        launch(train_rank, 2, job, timeout_s=120, op_timeout_s=30)
    assert time.monotonic() - t0 < 60
    message = str(err.value)
    assert "rank 1" in message and "injected failure at step 3" in message
    assert "\n" not in message
