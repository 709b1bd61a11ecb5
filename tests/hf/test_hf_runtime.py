"""Stock transformers models trained as they are (each stage runs the model's own forward): parity with the
single-process reference under dp2, pp2, colocated and non-colocated plans, and the whole CLI path."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
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
QVISION, QVL = ["model.visual.patch_embed", "model.visual.blocks"], ["model.visual"]
CLIP_IMAGE, CLIP_TEXT = ["vision_model", "visual_projection"], ["text_model", "text_projection"]
CLIP_TEXT_FIRST = ["text_model.embeddings", "text_model.encoder.layers.0"]
FIRST_LAYER = ["model.language_model.embed_tokens", "model.language_model.layers.0"]
PLANS = {
    "llava-dp2": ("llava", [{"name": "all", "dp": 2, "stages": [(VISION + PROJ + LLM, [0, 1])]}], {}),
    "llava-pp2": ("llava", [{"name": "all", "stages": [(VISION + PROJ + FIRST_LAYER, [0]), (LLM, [1])]}], {"micro_batches": 4}),
    "llava-non-colocated": ("llava", [{"name": "vision", "stages": [(VISION + PROJ, [0])]},
                                      {"name": "llm", "stages": [(LLM, [1])]}], {}),
    "llava-colocated": ("llava", [{"name": "vision", "dp": 2, "stages": [(VISION + PROJ, [0, 1])]},
                                  {"name": "llm", "colocated_with": "vision", "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}], {}),
    # tensor parallelism from the model's own base_model_tp_plan (q/k/v/gate/up colwise, o/down rowwise); the token
    # embedding, lm_head and HF's cross-entropy vocabulary-parallel (runtime/vocab_parallel.py, as the profile prices)
    "llava-llm-tp2": ("llava", [{"name": "vision", "stages": [(VISION + PROJ, [0])]},
                                {"name": "llm", "tp": 2, "stages": [(LLM, [1, 2])]}], {}),
    "qwen2-audio-non-colocated": ("qwen2_audio", [{"name": "audio", "stages": [(AUDIO + PROJ, [0])]},
                                                  {"name": "llm", "dp": 2, "stages": [(LLM, [1, 2])]}], {}),
    "qwen2-audio-pp2": ("qwen2_audio", [{"name": "all", "stages": [(AUDIO + PROJ + FIRST_LAYER, [0]), (LLM, [1])]}],
                        {"micro_batches": 4}),
    "qwen2-audio-colocated": ("qwen2_audio", [{"name": "audio", "dp": 2, "stages": [(AUDIO + PROJ, [0, 1])]},
                                              {"name": "llm", "colocated_with": "audio",
                                               "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}], {}),
    # Qwen2-VL: packed pixel_values (patches of all images x patch dim) and packed vision-block outputs
    "qwen2-vl-dp2": ("qwen2_vl", [{"name": "all", "dp": 2, "stages": [(QVL + LLM, [0, 1])]}], {}),
    "qwen2-vl-pp2": ("qwen2_vl", [{"name": "all", "stages": [(QVISION, [0]), (QVL + LLM, [1])]}], {"micro_batches": 4}),
    "qwen2-vl-non-colocated": ("qwen2_vl", [{"name": "vision", "stages": [(QVL, [0])]},
                                            {"name": "llm", "stages": [(LLM, [1])]}], {}),
    "qwen2-vl-colocated": ("qwen2_vl", [{"name": "vision", "dp": 2, "stages": [(QVL, [0, 1])]},
                                        {"name": "llm", "colocated_with": "vision", "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}], {}),
    # the same in the default suite: 4 steps (parity of losses and of every gradient; learning is the case above's)
    "qwen2-vl-colocated-4-steps": ("qwen2_vl", [{"name": "vision", "dp": 2, "stages": [(QVL, [0, 1])]},
                                                {"name": "llm", "colocated_with": "vision",
                                                 "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}], {"steps": 4}),
    # CLIP / SigLIP: logit_scale (and logit_bias) lie outside every block; the block whose stage computes the
    # loss adopts them. A contrastive loss couples the samples of a batch, so under dp2 each replica's loss is
    # over its half of the micro-batch: the reference then runs twice as many micro-batches (same samples each).
    "clip-dp2": ("clip", [{"name": "all", "dp": 2, "stages": [(CLIP_IMAGE + CLIP_TEXT, [0, 1])]}], {"reference_x": 2}),
    # ZeRO shards the blocks; the adopted logit_scale stays whole (read outside its block) and is all-reduced
    "clip-dp2-zero2-4-steps": ("clip", [{"name": "all", "dp": 2, "zero": 2, "stages": [(CLIP_IMAGE + CLIP_TEXT, [0, 1])]}],
                               {"reference_x": 2, "steps": 4}),
    "clip-pp2": ("clip", [{"name": "all", "stages": [(CLIP_IMAGE + ["text_model.embeddings"], [0]), (CLIP_TEXT, [1])]}],
                 {"micro_batches": 4, "global_batch": 16}),
    "clip-non-colocated": ("clip", [{"name": "image", "stages": [(CLIP_IMAGE, [0])]},
                                    {"name": "text", "stages": [(CLIP_TEXT, [1])]}], {}),
    "clip-non-colocated-4-steps": ("clip", [{"name": "image", "stages": [(CLIP_IMAGE, [0])]},
                                            {"name": "text", "stages": [(CLIP_TEXT, [1])]}], {"steps": 4}),
    "clip-colocated": ("clip", [{"name": "image", "dp": 2, "stages": [(CLIP_IMAGE, [0, 1])]},
                                {"name": "text", "colocated_with": "image", "stages": [(CLIP_TEXT_FIRST, [0]), (CLIP_TEXT, [1])]}], {}),
    # (a sigmoid loss over 2-sample halves learns slower: 1.44 -> 1.19 in 20 steps)
    "siglip-dp2": ("siglip", [{"name": "all", "dp": 2, "stages": [(["vision_model", "text_model"], [0, 1])]}],
                   {"reference_x": 2, "min_drop": 0.2}),
    "siglip-pp2": ("siglip", [{"name": "all", "stages": [(["vision_model", "text_model.embeddings"], [0]), (["text_model"], [1])]}],
                   {"micro_batches": 4, "global_batch": 16}),
    "siglip-non-colocated": ("siglip", [{"name": "image", "stages": [(["vision_model"], [0])]},
                                        {"name": "text", "stages": [(["text_model"], [1])]}], {}),
    "siglip-colocated": ("siglip", [{"name": "image", "dp": 2, "stages": [(["vision_model"], [0, 1])]},
                                    {"name": "text", "colocated_with": "image", "stages": [(CLIP_TEXT_FIRST, [0]), (["text_model"], [1])]}], {}),
}
KINDS = sorted({kind for kind, _, _ in PLANS.values()})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: f"hf:{getattr(tiny_configs, name)(root / name)}" for name in KINDS}


# the others take 10-110 s each on a loaded 2-core machine: python -m pytest -m slow tests/hf -p no:cacheprovider
FAST = {"llava-colocated", "qwen2-vl-colocated-4-steps", "clip-non-colocated-4-steps", "clip-dp2-zero2-4-steps"}


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in PLANS])
def test_stock_hf_plan_matches_single_process_reference(case, models):
    kind, groups, training = PLANS[case]
    model = models[kind]
    x, drop, steps = training.get("reference_x", 1), training.get("min_drop", 0.3), training.get("steps", STEPS)
    plan = make_plan(model, groups, **{k: v for k, v in training.items() if k not in ("reference_x", "min_drop", "steps")})
    job = Job(plan=plan, model=model, steps=steps, seed=0, probe_grads=True)
    ref = reference_run(replace(job, plan=replace(plan, training=replace(plan.training, micro_batches=x * plan.training.micro_batches))))
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    losses = [m["loss"] for m in results[0]["metrics"]]
    assert len(losses) == steps
    for step, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-4 * abs(want), (case, step, got, want)
    if steps == STEPS:
        assert losses[-1] < losses[0] - drop  # the synthetic data derived from the example batch is learnable
    grads = {}
    for r in results:
        grads.update(r["grads"])
    assert set(ref["grads"]) <= set(grads), case
    for name in set(grads) - set(ref["grads"]):  # unused by the loss (LLaVA reads the second-to-last vision layer):
        assert float(grads[name].abs().max()) == 0.0, name  # None in the reference, zeros after a dp all-reduce
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, want in ref["grads"].items():
        # a gradient zero in exact arithmetic (a key bias under softmax) is float32 noise: 1e-7 of the largest
        tol = 1e-5 * max(float(want.abs().max()), 1e-2 * scale)
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
    from planner.profiler.profile import profile_model
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


def test_parameters_outside_blocks_join_the_block_that_reads_them(models):
    """CLIP's logit_scale is read only by the loss: the block the loss stage is placed by adopts it, so that
    stage trains it (the parity cases above check its gradient and the losses)."""
    import torch

    from runtime.source import call_factory, resolve
    from runtime.stage import build_rank_model

    torch.manual_seed(0)
    model, example = call_factory(resolve(models["clip"]), 1)
    rm = build_rank_model(model, example, {"text_projection"}, torch.device("cpu"))
    assert rm.program.free_consumers == {"logit_scale": {"(loss)"}}
    assert rm.aliases == {"text_projection.mmplan_free_logit_scale": "logit_scale"}
    assert any(p is model.logit_scale for p in rm.parameters())  # trained with the stage's own parameters
    from planner.profiler.profile import profile_model

    priced = profile_model(resolve(models["clip"])).block("text_projection").params  # the profile counts it there too
    assert priced == sum(p.numel() for p in rm.local["text_projection"].parameters()) == 16 * 32 + 1


# ZeRO on a stock decoder whose lm_head is tied to embed_tokens (Gemma 3, PaliGemma, InternVL tie them) and on the same
# decoder untied: the tied weight is one FSDP2 unit of both blocks (runtime/zero.py), updated once per step
DECODER = ["model", "lm_head"]


@pytest.mark.parametrize("tie", ["tied", "untied"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_on_a_stock_decoder_with_and_without_tied_embeddings(zero, tie, tmp_path):
    model = f"hf:{getattr(tiny_configs, f'llama_{tie}')(tmp_path / tie)}"
    plan = make_plan(model, [{"name": "all", "dp": 2, "zero": zero, "stages": [(DECODER, [0, 1])]}])
    job = Job(plan=plan, model=model, steps=6, seed=0, probe_grads=True)
    ref = reference_run(job)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    for got, want in zip([m["loss"] for m in results[0]["metrics"]], ref["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want), (zero, tie, got, want)
    grads = {}
    for r in results:
        grads.update(r["grads"])
    if tie == "tied":  # probed under both blocks' names, in the reference under its first
        assert torch.equal(grads.pop("lm_head.weight"), grads["model.embed_tokens.weight"])
    assert set(grads) == set(ref["grads"])
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, want in ref["grads"].items():
        assert float((grads[name] - want).abs().max()) <= 1e-5 * max(float(want.abs().max()), 1e-3 * scale), name
