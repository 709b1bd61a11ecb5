"""The schedule's mechanisms train like the single-process reference and run in the predicted order: an encoder on its
own ranks running ahead of the LLM (Group.lookahead), an encoder time-sharing the LLM's ranks (Group.colocated_with)
and a colocated encoder filling the LLM pipeline's bubbles (Group.fill_bubbles) -- each also with ZeRO on one group
and TP on the other (the filling group itself stays at ZeRO 0: plans/plan.py)."""
from __future__ import annotations

import pytest

from tests.runtime.test_parity import check_parity, run_in_predicted_order

PLANS = {
    # vision on rank 0 runs 2 micro-batches ahead of a 2-stage LLM (in flight: 3 + 2 of 8)
    "encoder-ahead": ("tiny-vlm", [
        {"name": "vision", "lookahead": 2, "stages": [(["vision", "vision_proj"], [0])]},
        {"name": "llm", "stages": [(["llm.embed", "llm.layers.0"], [1]), (["llm"], [2])]},
    ], {"micro_batches": 8}),
    # vision dp 2 on ranks 0, 1, each rank running its replica's tasks in the idle slots of its 2-stage LLM pipeline
    "colocated-fills-bubbles": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "fill_bubbles": True, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "colocated_with": "vision", "stages": [(["llm.embed", "llm.layers.0"], [0]), (["llm"], [1])]},
    ], {"micro_batches": 4}),
    # the same with the LLM's stages on tp 2 and an encoder of tp 2 (each replica's tp ranks in one rank class)
    "colocated-fills-bubbles-tp2": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "tp": 2, "fill_bubbles": True, "stages": [(["vision", "vision_proj"], [0, 1, 2, 3])]},
        {"name": "llm", "tp": 2, "colocated_with": "vision",
         "stages": [(["llm.embed", "llm.layers.0"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
    # vision on dp 2 at ZeRO-3 (ranks 0, 1) runs 2 micro-batches ahead of the LLM at tp 2 (ranks 2, 3)
    "encoder-ahead-zero3-llm-tp2": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "zero": 3, "lookahead": 2, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "tp": 2, "stages": [(["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
    # the reverse: vision at tp 2 runs 2 ahead of the LLM on dp 2 at ZeRO-1
    "encoder-tp2-ahead-llm-zero1": ("tiny-vlm", [
        {"name": "vision", "tp": 2, "lookahead": 2, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "dp": 2, "zero": 1, "stages": [(["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
    # colocated without fill_bubbles: vision dp 2 at ZeRO-3 time-sharing ranks 0, 1 with the LLM at tp 2
    "colocated-encoder-zero3-llm-tp2": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "zero": 3, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "tp": 2, "colocated_with": "vision", "stages": [(["llm"], [0, 1])]},
    ], {"micro_batches": 4}),
    # the reverse: vision at tp 2, the LLM on dp 2 at ZeRO-1, on the same ranks
    "colocated-encoder-tp2-llm-zero1": ("tiny-vlm", [
        {"name": "vision", "tp": 2, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "dp": 2, "zero": 1, "colocated_with": "vision", "stages": [(["llm"], [0, 1])]},
    ], {"micro_batches": 4}),
    # the filled pipeline's own group sharded (the filling group stays at ZeRO 0, plans/plan.py): vision dp 2 x tp 2
    # filling the bubbles of an LLM of 2 stages x dp 2 at ZeRO-1 (replica r's tp ranks on stage r's ranks)
    "colocated-fills-bubbles-llm-zero1": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "tp": 2, "fill_bubbles": True, "stages": [(["vision", "vision_proj"], [0, 1, 2, 3])]},
        {"name": "llm", "dp": 2, "zero": 1, "colocated_with": "vision",
         "stages": [(["llm.embed", "llm.layers.0"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
    # vision dp 4 filling the bubbles of an LLM of 2 stages x dp 2 at ZeRO-3
    "colocated-fills-bubbles-llm-zero3": ("tiny-vlm", [
        {"name": "vision", "dp": 4, "fill_bubbles": True, "stages": [(["vision", "vision_proj"], [0, 1, 2, 3])]},
        {"name": "llm", "dp": 2, "zero": 3, "colocated_with": "vision",
         "stages": [(["llm.embed", "llm.layers.0"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 2}),
}


@pytest.mark.parametrize("case", list(PLANS))
def test_mechanism_matches_the_reference_in_the_predicted_order(case):
    plan, results, ref = run_in_predicted_order(*PLANS[case])
    if case == "encoder-ahead":  # d + 1 + k = 2 + 1 + 2 forwards before vision's first backward
        ran = [name for _, name, *_ in results[0]["trace"][0] if name[:4] in ("fwd ", "bwd ")]
        assert [n[:3] for n in ran[:6]] == ["fwd"] * 5 + ["bwd"]
    if case in ("encoder-ahead-zero3-llm-tp2", "encoder-tp2-ahead-llm-zero1"):  # 1 + 1 + 2: all 4 (2 without lookahead)
        ran = [name for _, name, *_ in results[0]["trace"][0] if name[:4] in ("fwd ", "bwd ")]
        assert [n[:3] for n in ran] == ["fwd"] * 4 + ["bwd"] * 4, ran
    if case.startswith("colocated-fills"):  # rank 1 (the LLM's last stage) runs vision's forwards before its own first
        ran = [name for _, name, *_ in results[0]["trace"][plan.world_size - 1] if name[:4] in ("fwd ", "bwd ")]
        assert ran[:2] == ["fwd vision s0 mb0", "fwd vision s0 mb1"], ran
    check_parity(case, results, ref, loss_rtol=1e-5)
