"""Images of different sizes in one batch (Qwen2-VL's packed patches, runtime/samples.py): the runtime splits the
packed inputs and the packed vision-block outputs per sample by their image grids, across data-parallel replicas,
pipeline stages and group boundaries; losses and gradients match the single-process reference."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from runtime.launch import launch
from runtime.reference import reference_run
from runtime.samples import collate, row_range, sample_rows, split_samples
from runtime.train import Job, train_rank
from tests.hf import tiny_configs
from tests.hf.test_hf_runtime import FIRST_LAYER, LLM, QVISION, QVL
from tests.runtime.plan_builder import make_plan

STEPS = 3
PLANS = {  # images of 16 and 8 pixels a side alternate: 16 and 4 patches, 4 and 1 merged tokens per sample
    "dp2": [{"name": "all", "dp": 2, "stages": [(QVL + LLM, [0, 1])]}],
    "pp2": [{"name": "all", "stages": [(QVISION, [0]), (QVL + LLM, [1])]}],  # patch-level rows cross the cut
    "non-colocated": [{"name": "vision", "stages": [(QVL, [0])]}, {"name": "llm", "stages": [(LLM, [1])]}],
    # vision dp2 feeding one pipeline replica: the two replicas' merged tokens (of 2 sizes) concatenate (fan-in)
    "colocated": [{"name": "vision", "dp": 2, "stages": [(QVL, [0, 1])]},
                  {"name": "llm", "colocated_with": "vision", "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tiny_configs.qwen2_vl(tmp_path_factory.mktemp("hf") / "qwen2_vl_sizes")
    config = json.loads((directory / "config.json").read_text())
    config["mmplan_inputs"]["image_size"] = [16, 8]
    (directory / "config.json").write_text(json.dumps(config))
    return f"hf:{directory}"


def test_rows_per_sample_follow_the_image_grid():
    grid = torch.tensor([[1, 4, 4], [1, 2, 2], [1, 2, 4]])
    batch = {"ids": torch.zeros(3, 5, dtype=torch.long), "pixels": torch.randn(16 + 4 + 8, 6), "grid": grid}
    rows = sample_rows(batch)
    assert rows == {"ids": (1, 1, 1), "pixels": (16, 4, 8), "grid": (1, 1, 1)}
    assert row_range(rows["pixels"], 1, 3) == (16, 28)
    samples = split_samples(batch)
    assert [tuple(s["pixels"].shape) for s in samples] == [(16, 6), (4, 6), (8, 6)]
    again = collate([{k: v[0] if k != "pixels" else v for k, v in s.items()} for s in samples], {"pixels"})
    assert all(torch.equal(again[k], batch[k]) for k in batch)


@pytest.mark.parametrize("case", list(PLANS))
def test_images_of_two_sizes_match_the_single_process_reference(case, model):
    plan = make_plan(model, PLANS[case])
    job = Job(plan=plan, model=model, steps=STEPS, seed=0, probe_grads=True)
    ref = reference_run(job)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    losses = [m["loss"] for m in results[0]["metrics"]]
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), (case, step, got, want)
    grads = {}
    for r in results:
        grads.update(r["grads"])
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, want in ref["grads"].items():
        tol = 1e-5 * max(float(want.abs().max()), 1e-2 * scale)
        assert float((grads[name] - want).abs().max()) <= tol, (case, name)
