"""Stock transformers models trained as they are (each stage runs the model's own forward): parity with the
single-process reference under dp2, pp2, colocated and non-colocated plans, and the whole CLI path."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from planner.cli import app
from runtime.launch import launch
from runtime.reference import reference_run
from runtime.train import Job, train_rank
from tests.hf import tiny_configs
from tests.runtime.plan_builder import make_plan

STEPS = 20
VISION, PROJ, LLM = ["model.vision_tower"], ["model.multi_modal_projector"], ["model.language_model", "lm_head"]
AUDIO = ["model.audio_tower"]
FIRST_LAYER = ["model.language_model.embed_tokens", "model.language_model.layers.0"]
PLANS = {
    "llava-dp2": ("llava", [{"name": "all", "dp": 2, "stages": [(VISION + PROJ + LLM, [0, 1])]}], {}),
    "llava-pp2": ("llava", [{"name": "all", "stages": [(VISION + PROJ + FIRST_LAYER, [0]), (LLM, [1])]}], {"micro_batches": 4}),
    "llava-non-colocated": ("llava", [{"name": "vision", "stages": [(VISION + PROJ, [0])]},
                                      {"name": "llm", "stages": [(LLM, [1])]}], {}),
    "llava-colocated": ("llava", [{"name": "vision", "dp": 2, "stages": [(VISION + PROJ, [0, 1])]},
                                  {"name": "llm", "colocated_with": "vision", "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}], {}),
    # tensor parallelism from the model's own base_model_tp_plan (q/k/v/gate/up colwise, o/down rowwise)
    "llava-llm-tp2": ("llava", [{"name": "vision", "stages": [(VISION + PROJ, [0])]},
                                {"name": "llm", "tp": 2, "stages": [(LLM, [1, 2])]}], {}),
    "qwen2-audio-non-colocated": ("qwen2_audio", [{"name": "audio", "stages": [(AUDIO + PROJ, [0])]},
                                                  {"name": "llm", "dp": 2, "stages": [(LLM, [1, 2])]}], {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: f"hf:{getattr(tiny_configs, name)(root / name)}" for name in ("llava", "qwen2_audio")}


FAST = {"llava-colocated"}  # the others take 40-110 s each on a loaded 2-core machine: python -m pytest -m slow tests/hf


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in PLANS])
def test_stock_hf_plan_matches_single_process_reference(case, models):
    kind, groups, training = PLANS[case]
    model = models[kind]
    plan = make_plan(model, groups, **training)
    job = Job(plan=plan, model=model, steps=STEPS, seed=0, probe_grads=True)
    ref = reference_run(job)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    losses = [m["loss"] for m in results[0]["metrics"]]
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-4 * abs(want), (case, step, got, want)
    assert losses[-1] < losses[0] - 0.3  # the synthetic data derived from the example batch is learnable
    grads = {}
    for r in results:
        grads.update(r["grads"])
    assert set(ref["grads"]) <= set(grads), case
    for name in set(grads) - set(ref["grads"]):  # unused by the loss (LLaVA reads the second-to-last vision layer):
        assert float(grads[name].abs().max()) == 0.0, name  # None in the reference, zeros after a dp all-reduce
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, want in ref["grads"].items():
        tol = 1e-5 * max(float(want.abs().max()), 1e-3 * scale)
        assert float((grads[name] - want).abs().max()) <= tol, (case, name)


@pytest.mark.parametrize("placement", ["non-colocated", pytest.param("colocated", marks=pytest.mark.slow)])
def test_profile_solve_run_from_the_cli(placement, models, tmp_path):
    """The must-show path: profile with --measure, groups found, solve on 2 local CPUs, run 20 steps."""
    runner, prof, plan, log = CliRunner(), tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "log.jsonl"
    res = runner.invoke(app, ["profile", models["llava"], "--device", "cpu", "--measure", "-o", str(prof), "--quiet"])
    assert res.exit_code == 0, res.output
    assert list(json.loads(prof.read_text())["blocks"][0]) and \
        [g for g in dict.fromkeys(b["group"] for b in json.loads(prof.read_text())["blocks"])] == ["vision", "projector", "llm"]
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "4",
                              "--placement", placement, "-o", str(plan), "--quiet"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", str(plan), "--steps", str(STEPS), "--log", str(log)])
    assert res.exit_code == 0, res.output
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.3


def test_hf_blocks_take_their_tp_plan_from_the_model(models):
    from planner.profile import profile_model
    from runtime.source import resolve

    prof = profile_model(resolve(models["llava"]))
    assert {b.name for b in prof.blocks if b.supports_tp} == {"model.language_model.layers.0", "model.language_model.layers.1"}


def test_a_plan_from_a_group_override_profile_runs(models, tmp_path):
    """--group is stored in the profile; the plan solved from it runs (the runtime reads the plan's groups)."""
    runner, prof, plan = CliRunner(), tmp_path / "p.json", tmp_path / "plan.json"
    res = runner.invoke(app, ["profile", models["llava"], "-o", str(prof), "--quiet", "--group", "projector=vision",
                              "--group", "model.language_model.embed_tokens=llm"])
    assert res.exit_code == 0, res.output
    assert json.loads(prof.read_text())["options"]["groups"] == [["projector", "vision"], ["model.language_model.embed_tokens", "llm"]]
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "4",
                              "--placement", "non-colocated", "-o", str(plan), "--quiet"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", str(plan), "--steps", "2"])
    assert res.exit_code == 0, res.output
