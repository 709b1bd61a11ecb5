"""A stock Hugging Face Llama whose lm_head is tied to embed_tokens (tie_word_embeddings), its embedding and head on two
pipeline stages: a copy on each, the copies' gradients all-reduced between them (runtime/ties.py); 20 steps of the
single-process reference's losses at pp2 and pp2 x dp2."""
from __future__ import annotations

import pytest
import torch

from runtime.launch import launch
from runtime.reference import reference_run
from runtime.train import Job, train_rank
from tests.hf import tiny_configs
from tests.runtime.plan_builder import make_plan, profile

FIRST = ["model.embed_tokens", "model.layers.0"]
SECOND = ["model.layers.1", "model.norm", "lm_head"]


@pytest.mark.parametrize("dp", [1, 2], ids=["pp2", "pp2-dp2"])
def test_a_stock_tied_decoder_trains_with_its_embedding_and_head_on_two_stages(dp, tmp_path):
    model = f"hf:{tiny_configs.llama_tied(tmp_path / 'tied')}"
    ties = profile(model).ties
    assert [(t.parameter, t.blocks) for t in ties] == [("model.embed_tokens.weight", ("model.embed_tokens", "lm_head"))]
    ranks = list(range(2 * dp))
    plan = make_plan(model, [{"name": "all", "dp": dp, "stages": [(FIRST, ranks[:dp]), (SECOND, ranks[dp:])]}],
                     micro_batches=4)
    job = Job(plan=plan, model=model, steps=20, seed=0, probe_grads=True)
    ref = reference_run(job)
    results = launch(train_rank, plan.world_size, job, timeout_s=300)
    for step, (got, want) in enumerate(zip([m["loss"] for m in results[0]["metrics"]], ref["losses"], strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    grads = {}
    for r in results:
        grads.update(r["grads"])
    torch.testing.assert_close(grads.pop("lm_head.weight"), grads["model.embed_tokens.weight"], rtol=1e-6, atol=1e-9)
    assert set(grads) == set(ref["grads"])
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, want in ref["grads"].items():
        assert float((grads[name] - want).abs().max()) <= 1e-5 * max(float(want.abs().max()), 1e-3 * scale), name
