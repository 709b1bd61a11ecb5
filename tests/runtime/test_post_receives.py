"""The runtime announces each task's receives from other ranks before the task runs (Exchange.post_receives): gloo
sends a message only once its receive is posted, so a receive posted when the task needs the data waits for a round
trip through both ranks even when the data was sent long before (the micro-batch demo's solved plan waited 33 ms a
step there on a 2-vCPU VM, 18 ms with them posted ahead). Checked on that plan, whose LLM micro-batches read samples
of both ranks' encoder replicas, forward and backward."""
from __future__ import annotations

from pathlib import Path

import runtime.boundary as boundary
from cost_models.cluster_spec import parse_cluster
from planner.commands.demo import CASES
from planner.solver.solve import solve
from plans.graph import load_profile
from runtime.launch import launch
from runtime.train import Job, train_rank

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "demo_micro_batch"


def test_every_receive_from_another_rank_was_posted_before_its_task(monkeypatch, tmp_path):
    profile = load_profile(FIXTURES / "profile.json")
    plan = solve(profile, parse_cluster(str(FIXTURES / "cluster.toml")), CASES["micro-batch"].global_batch).plan
    taken = boundary.Exchange._get

    def recording(self, src, shape, dtype, key, tag):  # inherited by the forked ranks
        if src != self.rank:
            with open(tmp_path / f"rank{self.rank}.txt", "a") as f:
                f.write(f"{key[3]} {int(key in self.posted)}\n")  # direction, posted ahead
        return taken(self, src, shape, dtype, key, tag)

    monkeypatch.setattr(boundary.Exchange, "_get", recording)
    job = Job(plan=plan, model=CASES["micro-batch"].model, steps=2, seed=0)
    launch(train_rank, plan.world_size, job, timeout_s=120)
    for rank in range(plan.world_size):
        rows = [line.split() for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
        assert {d for d, _ in rows} == {"0", "1"}, rank  # activations and gradients cross the ranks
        assert all(posted == "1" for _, posted in rows), rank
