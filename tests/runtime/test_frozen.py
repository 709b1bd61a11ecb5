"""Frozen blocks (profile --freeze, or parameters not requiring grad): parity with the single-process reference,
frozen parameters unchanged, no optimizer state for them, and no backward where nothing before it trains."""
from __future__ import annotations

import pytest

from runtime.launch import launch
from runtime.train import Job, train_rank
from tests.runtime.plan_builder import make_plan
from tests.runtime.test_parity import check_parity
from tests.runtime.test_zero import reference

STEPS = 6
VISION = ("vision.*",)
PLANS = {
    "dp2": ([{"name": "all", "dp": 2, "stages": [(["vision", "vision_proj", "llm"], [0, 1])]}], {}),
    # the frozen encoder alone on stage 0: no backward task there, nothing routed back to it
    "pp2-frozen-first-stage": ([
        {"name": "vision", "stages": [(["vision"], [0])]},
        {"name": "llm", "stages": [(["vision_proj", "llm"], [1])]},
    ], {"micro_batches": 4}),
    # a frozen encoder sharded by ZeRO-1 on its own ranks (forwards only), the LLM under ZeRO-2
    "frozen-encoder-zero1-llm-zero2": ([
        {"name": "vision", "dp": 2, "zero": 1, "stages": [(["vision"], [0, 1])]},
        {"name": "llm", "dp": 2, "zero": 2, "stages": [(["vision_proj", "llm"], [2, 3])]},
    ], {}),
    "pp2xdp2-zero3": ([
        {"name": "all", "dp": 2, "zero": 3, "stages": [(["vision", "vision_proj", "llm.embed"], [0, 1]), (["llm"], [2, 3])]},
    ], {}),
}


def _run(case: str, *, trace: bool = False):
    groups, training = PLANS[case]
    plan = make_plan("tiny-vlm", groups, freeze=VISION, **training)
    job = Job(plan=plan, model="tiny-vlm", steps=STEPS, seed=0, probe_grads=True, trace=trace)
    return plan, job, launch(train_rank, plan.world_size, job, timeout_s=240)


@pytest.mark.parametrize("case", list(PLANS))
def test_frozen_vision_matches_the_reference(case):
    plan, job, results = _run(case)
    ref = reference("tiny-vlm", job)
    assert ref["grads"] and not any(n.startswith("vision.") for n in ref["grads"])
    check_parity(case, results, ref)
    grads = {n for r in results for n in r["grads"]}
    assert not any(n.startswith("vision.") for n in grads)


def test_frozen_parameters_do_not_change_and_get_no_optimizer_state(tmp_path):
    groups, training = PLANS["pp2-frozen-first-stage"]
    plan = make_plan("tiny-vlm", groups, freeze=VISION, **training)
    later = Job(plan=plan, model="tiny-vlm", steps=4, checkpoint_every=4, checkpoint_dir=str(tmp_path / "b"))
    results = launch(train_rank, 2, later, timeout_s=240)
    from runtime.checkpoint import latest_checkpoint
    from runtime.checkpoint_dcp import read_blocks
    from runtime.rank import build_model

    initial = dict(build_model(later)[0].named_parameters())
    saved = read_blocks(latest_checkpoint(str(tmp_path / "b")))
    for block in ("vision.patch_embed", "vision.layers.0", "vision.norm"):
        params, opt = saved[block]
        assert params and not any(opt.values()), block
        for n, t in params.items():
            assert t.equal(initial[n].detach()), n
    params, opt = saved["vision_proj"]
    assert all(opt.values()) and any(not t.equal(initial[n].detach()) for n, t in params.items())
    assert [m["step"] for m in results[0]["metrics"]] == [0, 1, 2, 3]


def test_a_frozen_first_stage_runs_no_backward():
    plan, _, results = _run("pp2-frozen-first-stage", trace=True)
    names = [name for _, name, *_ in results[0]["trace"][0]]
    assert any(n.startswith("fwd ") for n in names) and not any(n.startswith("bwd ") for n in names)
    assert any(n.startswith("bwd ") for _, n, *_ in results[0]["trace"][1])
