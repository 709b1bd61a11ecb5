"""Per-group step shapes train like the single-process reference, in the predicted order: an encoder on its own ranks
with fewer micro-batches than the LLM (its forward over several LLM micro-batches at once, its backward after all of
their gradients), with more (the LLM waits for several), with ZeRO on one group and TP on the other, the same on
colocated groups (time-sharing, or filling the LLM's bubbles), and the local analogue of NVIDIA's layout (the encoder
data-parallel, the LLM tensor-parallel at one sample per micro-batch)."""
from __future__ import annotations

import pytest

from runtime.launch import launch
from runtime.train import Job, train_rank
from tests.runtime.test_parity import STEPS, assert_executed_order_is_predicted, check_parity, reference, run_in_predicted_order

ENC = ["vision", "vision_proj"]
PLANS = {
    # case (a): one encoder micro-batch of 8 samples feeds 4 LLM micro-batches of a 2-stage pipeline
    "encoder-coarser": ("tiny-vlm", [
        {"name": "vision", "micro_batches": 1, "stages": [(ENC, [0])]},
        {"name": "llm", "stages": [(["llm.embed", "llm.layers.0"], [1]), (["llm"], [2])]},
    ], {"micro_batches": 4}),
    # case (b): 4 encoder micro-batches of 2 samples over dp 2 (one each) make each LLM micro-batch of 4
    "encoder-finer": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "micro_batches": 4, "stages": [(ENC, [0, 1])]},
        {"name": "llm", "stages": [(["llm"], [2])]},
    ], {"micro_batches": 2}),
    # ZeRO-3 on the encoder's dp 2 (2 micro-batches), TP 2 on the LLM (4 micro-batches)
    "encoder-zero3-coarser-llm-tp2": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "zero": 3, "micro_batches": 2, "stages": [(ENC, [0, 1])]},
        {"name": "llm", "tp": 2, "stages": [(["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
    # ZeRO-1 on the LLM's dp 2 (2 micro-batches), the encoder at TP 2 with 4
    "encoder-tp2-finer-llm-zero1": ("tiny-vlm", [
        {"name": "vision", "tp": 2, "micro_batches": 4, "stages": [(ENC, [0, 1])]},
        {"name": "llm", "dp": 2, "zero": 1, "stages": [(["llm"], [2, 3])]},
    ], {"micro_batches": 2}),
    # colocated: vision dp 2 at ZeRO-3 with 2 micro-batches time-sharing ranks 0, 1 with the LLM at tp 2 with 4
    "colocated-encoder-zero3-coarser-llm-tp2": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "zero": 3, "micro_batches": 2, "stages": [(ENC, [0, 1])]},
        {"name": "llm", "tp": 2, "colocated_with": "vision", "stages": [(["llm"], [0, 1])]},
    ], {"micro_batches": 4}),
    # colocated: vision at tp 2 with 4 micro-batches, the LLM on dp 2 at ZeRO-1 with 2
    "colocated-encoder-tp2-finer-llm-zero1": ("tiny-vlm", [
        {"name": "vision", "tp": 2, "micro_batches": 4, "stages": [(ENC, [0, 1])]},
        {"name": "llm", "dp": 2, "zero": 1, "colocated_with": "vision", "stages": [(["llm"], [0, 1])]},
    ], {"micro_batches": 2}),
    # colocated, filling bubbles: vision dp 2 x tp 2 with 2 micro-batches in the idle slots of a 2-stage tp 2 LLM with 4
    "colocated-fill-encoder-coarser-llm-tp2": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "tp": 2, "micro_batches": 2, "fill_bubbles": True, "stages": [(ENC, [0, 1, 2, 3])]},
        {"name": "llm", "tp": 2, "colocated_with": "vision",
         "stages": [(["llm.embed", "llm.layers.0"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
}


@pytest.mark.parametrize("case", list(PLANS))
def test_rebatched_plan_matches_the_reference_in_the_predicted_order(case):
    plan, results, ref = run_in_predicted_order(*PLANS[case])
    if case == "encoder-coarser":  # the encoder's one backward comes after the LLM's 4 micro-batches
        ran = [name for _, name, *_ in results[0]["trace"][0] if name[:4] in ("fwd ", "bwd ")]
        assert ran == ["fwd vision s0 mb0", "bwd vision s0 mb0"], ran
    check_parity(case, results, ref, loss_rtol=1e-5)


def test_nvidias_layout_written_by_layout_trains_like_the_reference():
    """The local analogue of NVIDIA's layout, written as `--layout` writes it: the encoder on dp 2 at one sample per
    replica (4 micro-batches of 2), the LLM at tp 2 with one sample per micro-batch (8 micro-batches)."""
    from planner.solver.group_layouts import group_layout_plan
    from tests.runtime.plan_builder import local_cluster, profile

    plan = group_layout_plan(profile("tiny-vlm"), local_cluster(4), 8, "vision:dp=2,micro-batch=1;llm:tp=2,micro-batch=1")
    assert [(g.name, g.dp, g.tp, plan.micro_batches_of(g)) for g in plan.groups] == [("vision", 2, 1, 4), ("llm", 1, 2, 8)]
    job = Job(plan=plan, model="tiny-vlm", steps=STEPS, seed=0, probe_grads=True, trace=True)
    ref = reference("tiny-vlm", job)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    assert_executed_order_is_predicted(plan, "tiny-vlm", results[0]["trace"])
    check_parity("nvidia-analogue", results, ref, loss_rtol=1e-5)
